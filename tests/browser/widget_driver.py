"""What every lesson's browser test does: open a lesson in JupyterLab, Run All, find its explorer,
press keys on its controls, time key press -> new figure on screen, screenshot, report.

Each lesson's test lives in ``explore_lNN.py`` (one file per lesson); ``test_widgets_browser.py``
collects them all into one module so that they share one JupyterLab server and one Chromium.
"""
from __future__ import annotations

import re
import statistics
import time

import pytest
from course_browser import ARTIFACTS

SHOTS = ARTIFACTS / "browser"
KERNEL_TIMEOUT_MS = 90_000
RUN_ALL_TIMEOUT_MS = 180_000   # the whole lesson runs before its widget appears
UPDATE_TIMEOUT_MS = 30_000
MOVES = 5                      # latency samples per lesson

KERNEL_IDLE_JS = """() => [...document.querySelectorAll('.jp-StatusBar-Item')].some(e => {
    const t = e.textContent.trim();
    return /\\|\\s*Idle$/.test(t) && !/No Kernel/i.test(t);
})"""

# Arms a one-shot latency probe: t0 = the next (trusted) keydown anywhere in the page,
# tText = the readout text changed, t1 = a new <img> (different src) in the figure output is
# decoded and a frame painted.
ARM_PROBE_JS = """([figSel, textSel]) => {
    const out = document.querySelector(figSel), text = document.querySelector(textSel);
    const oldSrc = (out.querySelector('img') || {}).src || null, oldText = text.innerText;
    const probe = window.__probe = {t0: null, t1: null, tText: null, src: null};
    document.addEventListener('keydown', () => { if (probe.t0 === null) probe.t0 = performance.now(); },
                              {capture: true, once: true});
    const textObs = new MutationObserver(() => {
        if (probe.tText === null && text.innerText !== oldText) { probe.tText = performance.now(); textObs.disconnect(); }
    });
    textObs.observe(text, {childList: true, subtree: true, characterData: true});
    const obs = new MutationObserver(() => {
        const img = out.querySelector('img');
        if (!img || !img.src || img.src === oldSrc || probe.src !== null) return;
        probe.src = img.src;
        obs.disconnect();
        img.decode().catch(() => null).then(() => requestAnimationFrame(() => {
            probe.t1 = performance.now();
        }));
    });
    obs.observe(out, {childList: true, subtree: true, attributes: true, attributeFilter: ['src']});
}"""


def open_and_run_all(context, lab_server, notebook: str):
    page = context.new_page()
    console_errors = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: console_errors.append(str(e)))
    # Name what failed (a console line only says "404"): e.g. a lesson image outside the server root.
    page.on("response", lambda r: console_errors.append(f"HTTP {r.status} {r.url.split('?')[0]}")
            if r.status >= 400 else None)
    page.on("requestfailed", lambda r: console_errors.append(f"request failed {r.url.split('?')[0]}"))
    page.goto(lab_server.lab_url(notebook), wait_until="domcontentloaded")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=KERNEL_TIMEOUT_MS)
    page.wait_for_function(KERNEL_IDLE_JS, timeout=KERNEL_TIMEOUT_MS)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator("[data-command='runmenu:run-all']").click()
    return page, console_errors


# Run All done or stopped: nothing queued/running ("[*]") and the kernel idle.
RUN_SETTLED_JS = """() => ![...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*'))
    && [...document.querySelectorAll('.jp-StatusBar-Item')].some(e => /\\|\\s*Idle$/.test(e.textContent.trim()))"""
ERROR_OUTPUTS_JS = """() => [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
    .map(e => e.innerText).filter(t => /Error|Traceback/.test(t))"""


def open_explorer(context, lab_server, notebook: str, cls: str, ready_js: str, what: str):
    """Open ``notebook``, Run All, wait for the explorer ``.<cls>`` (``ready_js``) and screenshot it as
    ``NN_before.png``. Returns ``page, widget, console_errors, t_start``."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    page, console_errors = open_and_run_all(context, lab_server, notebook)
    wait_widget(page, ready_js, what)
    widget = page.locator(f".{cls}")
    widget.scroll_into_view_if_needed()
    widget.screenshot(path=str(SHOTS / f"{notebook[:2]}_before.png"))
    return page, widget, console_errors, t_start


def slider_max(page, cls: str) -> int:
    """The slider ``.<cls>``'s maximum, as its handle announces it (aria-valuemax)."""
    return int(page.locator(f".{cls} .noUi-handle").first.get_attribute("aria-valuemax").split(".")[0])


def wait_widget(page, ready_js: str, what: str) -> None:
    """Wait for the widget after Run All; fail fast, with the error, if the run stopped without it."""
    deadline = time.monotonic() + RUN_ALL_TIMEOUT_MS / 1000
    settled_since = None
    while time.monotonic() < deadline:
        if page.evaluate(ready_js):
            return
        if page.evaluate(RUN_SETTLED_JS):
            settled_since = settled_since or time.monotonic()
            if time.monotonic() - settled_since > 5:  # idle, nothing queued, still no widget
                errors = page.evaluate(ERROR_OUTPUTS_JS)
                pytest.fail(f"Run All finished without showing {what}; "
                            f"last error output: {errors[-1][-1500:] if errors else '(none)'}", pytrace=False)
        else:
            settled_since = None
        time.sleep(0.5)
    pytest.fail(f"{what} did not appear within {RUN_ALL_TIMEOUT_MS / 1000:.0f} s of Run All", pytrace=False)


def inner_text(page, selector: str) -> str:
    return page.locator(selector).inner_text().strip()


def wait_text(page, selector: str, predicate_js: str, timeout=UPDATE_TIMEOUT_MS):
    """Wait until ``predicate_js(innerText of selector)``; on a timeout, fail with the text the page shows."""
    try:
        page.wait_for_function(f"""() => {{ const e = document.querySelector({selector!r});
            if (!e) return false; const t = e.innerText.trim(); return ({predicate_js})(t); }}""", timeout=timeout)
    except Exception as exc:  # playwright's TimeoutError: say what was on the page instead
        shown = page.evaluate(f"() => (document.querySelector({selector!r}) || {{}}).innerText || '(no such element)'")
        raise AssertionError(f"{selector} never satisfied {predicate_js} within {timeout / 1000:.0f} s; "
                             f"it shows:\n{shown}") from exc


def readout(page, slider_cls: str) -> int:
    return int(inner_text(page, f".{slider_cls} .widget-readout"))


def step_right(page, prefix: str, text_sel: str, r: int, src: str, latencies: list, text_ms: list) -> tuple[int, str]:
    """ArrowRight on the explorer's ``<prefix>-num-requests`` slider: R goes up by one and the
    figure is redrawn. Returns the new R and the new figure's src; records the latency."""
    ms, new_src = move(page, f"{prefix}-num-requests", f".{prefix}-figure", text_sel, "ArrowRight", text_ms)
    latencies.append(ms)
    assert new_src != src, f"the {prefix} figure was not redrawn"
    r_new = readout(page, f"{prefix}-num-requests")
    assert r_new == r + 1, f"ArrowRight on the slider moved R from {r} to {r_new}"
    return r_new, new_src


def move(page, slider_cls: str, figure_sel: str, text_sel: str, key: str, text_ms: list) -> tuple[float, str]:
    """Press ``key`` on the slider's handle; return (ms to the new figure on screen, its src).

    The ms to the readout text change is appended to ``text_ms`` (the figure's share of the
    latency is the difference).

    It first waits for the kernel to go idle: an update started by the step before (a dropdown, typed
    lengths) may still be drawing its figure, and that figure must not be taken for this key's."""
    page.wait_for_function(KERNEL_IDLE_JS, timeout=UPDATE_TIMEOUT_MS)
    page.evaluate(ARM_PROBE_JS, [figure_sel, text_sel])
    page.locator(f".{slider_cls} .noUi-handle").first.focus()
    page.keyboard.press(key)
    page.wait_for_function("() => window.__probe.t1 !== null", timeout=UPDATE_TIMEOUT_MS)
    probe = page.evaluate("() => window.__probe")
    if probe["tText"] is not None:
        text_ms.append(probe["tText"] - probe["t0"])
    return probe["t1"] - probe["t0"], probe["src"]


def finish(page, widget, lesson: str, latencies: list[float], text_ms: list[float], console_errors: list[str],
            t_start: float, capsys) -> None:
    """After-screenshots, the latency report (printed past pytest's capture), page closed."""
    widget.screenshot(path=str(SHOTS / f"{lesson}_after.png"))
    page.screenshot(path=str(SHOTS / f"{lesson}_page.png"))
    (SHOTS / f"{lesson}_latency_ms.txt").write_text("\n".join(f"{x:.1f}" for x in latencies) + "\n")
    with capsys.disabled():
        print(f"\n[browser] lesson {lesson}: slider -> new figure on screen, {len(latencies)} moves: "
              f"median {statistics.median(latencies):.0f} ms, min {min(latencies):.0f} ms, "
              f"max {max(latencies):.0f} ms (goal < 300 ms)")
        if text_ms:
            print(f"[browser] lesson {lesson}: slider -> new numbers in the readout: "
                  f"median {statistics.median(text_ms):.0f} ms ({len(text_ms)} moves)")
        for line in console_errors[:5]:
            print(f"[browser] lesson {lesson}: console/network error: {line[:200]}")
        print(f"[browser] lesson {lesson} end to end: {time.monotonic() - t_start:.1f} s")
    page.close()
