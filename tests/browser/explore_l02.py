"""Lesson 02's module-reach explorer in the browser: its verdict line equals ``row_dependency`` on the module
and the lengths shown, for typed lengths and for other modules picked in the dropdown.
"""
from __future__ import annotations

import re

import numpy as np
import torch
from widget_driver import ARM_PROBE_JS, UPDATE_TIMEOUT_MS, finish, inner_text, open_explorer, wait_text

from lessons_lib.core.batch import cumulative
from lessons_lib.course import l02_linear
from lessons_lib.course.explore import parse_lengths
from lessons_lib.measure import batch_invariance

LINE_RE = re.compile(r"(.+) on cu_seqlens (\[[\d, ]+\]): (\d+) of (\d+) pairs change \| diagonal (\d+) \| "
                     r"same request (\d+) \| across requests (\d+) \| row i reads (.+) \| alone vs batched: max \|diff\| (\S+) "
                     r"\(bound (\S+)\), differ: (.+) \| (safe to batch flat|mixes requests)")


def _parse(text: str) -> dict:
    m = LINE_RE.fullmatch(text.strip())
    assert m, f"module-reach readout not in the documented format: {text!r}"
    return {"module": m[1], "cu": m[2], "pairs": int(m[3]), "all": int(m[4]), "diagonal": int(m[5]),
            "own": int(m[6]), "other": int(m[7]), "reads": m[8], "alone_diff": float(m[9]), "alone_bound": float(m[10]),
            "differ": m[11], "verdict": m[12]}


def _expected(module: str, lengths: str) -> dict:
    """A direct call of the library, and the counts recounted here from its measured map."""
    lens = parse_lengths(lengths)
    state = l02_linear.module_reach_state(module, lens)
    dep = state["dep"]
    owner = np.repeat(np.arange(len(lens)), lens)
    across = int((dep & (owner[:, None] != owner[None, :])).sum())
    assert across == state["other_requests"] and dep.shape == (sum(lens), sum(lens))
    want = _parse(l02_linear.module_reach_text(state))
    assert want["cu"] == str(cumulative(lens)) and want["other"] == across
    m = l02_linear.reach_modules()[module]   # each request alone, run here on the explorer's input rows
    x = torch.randn(sum(lens), m.width, generator=torch.Generator().manual_seed(5))
    alone = batch_invariance.alone_vs_batched(m.fn, x, lens)
    differ = alone["differ"]
    assert want["differ"] == (", ".join(differ) or "none") and want["alone_diff"] == float(f"{alone['max_diff']:.1e}")
    assert want["verdict"] == ("mixes requests" if across or differ else "safe to batch flat")
    return want


def _check(page, module: str, lengths: str) -> dict:
    want = _expected(module, lengths)
    wait_text(page, ".mrx-verdict", f"t => t.startsWith({(module + ' on cu_seqlens ' + want['cu'])!r})")
    got = _parse(inner_text(page, ".mrx-verdict"))
    assert got == want, (got, want)
    return got


def _timed(page, act, text_ms: list) -> tuple[float, str]:
    """Run ``act`` (a key press on a control, or a pick that sets the probe's t0 itself); return (ms to the
    new figure on screen, its src)."""
    page.evaluate(ARM_PROBE_JS, [".mrx-figure", ".mrx-verdict"])
    act()
    page.wait_for_function("() => window.__probe.t1 !== null", timeout=UPDATE_TIMEOUT_MS)
    probe = page.evaluate("() => window.__probe")
    if probe["tText"] is not None:
        text_ms.append(probe["tText"] - probe["t0"])
    return probe["t1"] - probe["t0"], probe["src"]


def test_lesson02_module_reach_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "02_linear_is_per_token.ipynb", "mrx",
        r"""() => /(safe to batch flat|mixes requests)$/.test(((document.querySelector('.mrx-verdict') || {}).innerText
                  || '').trim()) && !!document.querySelector('.mrx-figure img')""", "the module-reach explorer")

    select, box = page.locator(".mrx-module select"), page.locator(".mrx-lengths input")
    module, lengths = select.input_value(), box.input_value()
    first = _check(page, module, lengths)
    src = page.locator(".mrx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    # Type new lengths: cu_seqlens and the counts follow
    lengths = "5, 20, 15"

    def type_lengths():
        box.fill(lengths)
        box.press("Enter")
    ms, new_src = _timed(page, type_lengths, text_ms)
    latencies.append(ms)
    assert new_src != src, "the map was not redrawn for new lengths"
    src = new_src
    now = _check(page, module, lengths)
    assert now != first, "new lengths, the same numbers"

    # Other modules: the four above the current one in the dropdown, one at a time; the verdict follows the module
    options = select.locator("option").evaluate_all("os => os.map(o => o.value)")
    verdicts = [now["verdict"]]
    for _ in range(4):
        before = select.input_value()
        target = options[options.index(before) - 1]

        def pick(target=target):  # a <select> gets no keydown from select_option: start the clock by hand
            page.evaluate("() => { window.__probe.t0 = performance.now(); }")
            select.select_option(value=target)
        ms, new_src = _timed(page, pick, text_ms)
        latencies.append(ms)
        module = select.input_value()
        assert module == target, f"picked {target!r}, the dropdown shows {module!r}"
        assert new_src != src, f"the map was not redrawn for {module!r}"
        src = new_src
        verdicts.append(_check(page, module, lengths)["verdict"])
    assert set(verdicts) == {"safe to batch flat", "mixes requests"}, verdicts

    # Bad input: the error is shown, not a stale verdict
    box.fill("10, 0")
    box.press("Enter")
    wait_text(page, ".mrx-verdict", "t => t.includes('every request needs 1..')")
    assert "mrx-error" in (page.locator(".mrx-verdict").get_attribute("class") or "")

    finish(page, widget, "02", latencies, text_ms, console_errors, t_start, capsys)
