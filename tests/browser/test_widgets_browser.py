"""End to end: the lesson widgets move in a real browser, and show what lessons_lib computes.

For lessons 03, 04, 05, 07 and 08 this opens the notebook in JupyterLab (Debian's Chromium, headless),
waits for a really connected kernel, runs all cells, reads the live numbers off the widget,
moves a slider with the keyboard, and checks that the numbers become exactly what
``lessons_lib`` computes for the new setting and that the figure was redrawn (a new ``<img>``
source). Lesson 07's explorer runs the Triton kernel: its counters and error must equal a direct
call for the same input, before and after the tile sliders move and new lengths are typed. Lesson 08's
explorer runs the engine chunked and whole: its readout must equal a direct call of its state function
for each budget the slider moves to.
Lesson 04 also checks what must NOT move: the TP trace stays the same string while the
requests slider moves. Screenshots before/after go to ``test-artifacts/browser/``.

The update latency (key press on the slider -> new figure decoded and painted) is measured
in the page for several moves and printed; never asserted (timings vary by machine).
"""
from __future__ import annotations

import math
import re
import statistics
import time

import pytest
from course_browser import ARTIFACTS

from lessons_lib.core.batch import cumulative, pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.course import l03_attention, l04_tp, l05_flops, l07_kernel, l08_chunked
from lessons_lib.measure import flops
from lessons_lib.ops import tiling
from lessons_lib.tp.dryrun import expected_trace, record_trace, trace_signature
from lessons_lib.tp.trace import summarize_trace

SHOTS = ARTIFACTS / "browser"
KERNEL_TIMEOUT_MS = 90_000
RUN_ALL_TIMEOUT_MS = 180_000   # the whole lesson runs before its widget appears
UPDATE_TIMEOUT_MS = 30_000
MOVES = 5                      # latency samples per lesson

COUNTS_RE = re.compile(r"(padded|masked|varlen): computed (\d+) \| useful (\d+) \| wasted (\d+)")
MIX_RE = re.compile(r"(\d+) x (\d+): linear ([\d.]+) GFLOP \| attention ([\d.]+) GFLOP \| ([\d.]+)% attention \| "
                    r"(linear|attention)-dominated")
TRACE_RE = re.compile(r"rank (\d): (.+)")
ATTN_RE = re.compile(r"R = (\d+) \| cu_seqlens (\[[^\]]*\](?: \(\d+ requests\))?) \| positions (.+) \| max_seqlen (\d+) \| "
                     r"grid (\d+) tiles? x (\d+) requests? x (\d+) heads = (\d+) blocks")
RANK_RE = re.compile(r"rank (\d): heads (\d+)-(\d+), sum L_i\^2 = (\d+) cells per head per layer, (\d+) per forward")

# A kernel whose status reads "Idle" but is not yet connected drops a Run All clicked then:
# wait for the status bar's "<kernel name> | Idle" (it says "No Kernel" until connected).
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


def _open_and_run_all(context, lab_server, notebook: str):
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


def _open_explorer(context, lab_server, notebook: str, cls: str, ready_js: str, what: str):
    """Open ``notebook``, Run All, wait for the explorer ``.<cls>`` (``ready_js``) and screenshot it as
    ``NN_before.png``. Returns ``page, widget, console_errors, t_start``."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    page, console_errors = _open_and_run_all(context, lab_server, notebook)
    _wait_widget(page, ready_js, what)
    widget = page.locator(f".{cls}")
    widget.scroll_into_view_if_needed()
    widget.screenshot(path=str(SHOTS / f"{notebook[:2]}_before.png"))
    return page, widget, console_errors, t_start


def _slider_max(page, cls: str) -> int:
    """The slider ``.<cls>``'s maximum, as its handle announces it (aria-valuemax)."""
    return int(page.locator(f".{cls} .noUi-handle").first.get_attribute("aria-valuemax").split(".")[0])


def _wait_widget(page, ready_js: str, what: str) -> None:
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


def _text(page, selector: str) -> str:
    return page.locator(selector).inner_text().strip()


def _wait_text(page, selector: str, predicate_js: str, timeout=UPDATE_TIMEOUT_MS):
    page.wait_for_function(f"""() => {{ const e = document.querySelector({selector!r});
        if (!e) return false; const t = e.innerText.trim(); return ({predicate_js})(t); }}""", timeout=timeout)


def _parse_counts(text: str) -> dict:
    found = {m: tuple(int(x) for x in rest) for m, *rest in COUNTS_RE.findall(text)}
    assert set(found) == set(flops.METHODS), f"counts widget text does not list all methods: {text!r}"
    return found


def _expected_counts(num_requests: int, length: int, pattern: str) -> dict:
    state = l03_attention.diagonal_block_state(num_requests, length, pattern)
    # Independent of the widget module's own bookkeeping: recount from the lengths it reports.
    assert state["seq_lens"] == l03_attention.explorer_seq_lens(num_requests, length, pattern)
    for m in flops.METHODS:
        assert state["counts"][m] == flops.attention_cells(state["seq_lens"], m)
    return {m: (c.computed, c.useful, c.wasted) for m, c in state["counts"].items()}


def _parse_mix(text: str) -> list[tuple]:
    rows = [MIX_RE.fullmatch(line.strip()) for line in text.splitlines() if line.strip()]
    assert rows and all(rows), f"FLOP-mix widget text not in the documented format: {text!r}"
    return [(int(m[1]), int(m[2]), m[3], m[4], m[5], m[6]) for m in rows]


def _expected_mix(total: int, counting: str) -> list[tuple]:
    """Recomputed from measure.flops alone: 1 x T, 10 x T/10, 100 x T/100, GFLOP to 2 decimals."""
    state = l05_flops.flop_mix_state(total, counting)
    out = []
    for r, row in zip((1, 10, 100), state["rows"]):
        lens = [total // r] * r
        assert row["seq_lens"] == lens
        f = flops.forward_flops(ModelConfig(), lens, "varlen", causal=counting == "causal")
        out.append((r, total // r, f"{f.linear / 1e9:.2f}", f"{f.attention / 1e9:.2f}",
                    f"{100 * f.attention_fraction:.1f}", "attention" if f.attention > f.linear else "linear"))
    return out


def _expected_tp(total: int, num_requests: int, pattern: str) -> tuple[str, dict]:
    """What the lesson 04 explorer must show, recomputed from the dry run, ``pack`` and ``attention_cells``."""
    lens = l04_tp.packing_lens(total, num_requests, pattern)
    assert sum(lens) == total and len(lens) == num_requests
    cfg = ModelConfig()
    traces = [record_trace(cfg, lens, rank, 2) for rank in (0, 1)]
    assert all(trace_signature(t) == trace_signature(expected_trace(cfg, total, rank, 2)) for rank, t in enumerate(traces))
    trace_text = "\n".join(f"rank {rank}: {summarize_trace(t)}" for rank, t in enumerate(traces))
    trace_text += f"\nsame as 1 request of {total} tokens: yes"
    cells = flops.attention_cells(lens, "varlen").computed
    tiles = math.ceil(max(lens) / l04_tp.TILE)
    return trace_text, {"R": num_requests, "cu": cumulative(lens), "max_seqlen": max(lens), "tiles": tiles,
                        "grid": tiles * num_requests * cfg.heads_per_rank(2), "cells": cells,
                        "per_forward": cells * cfg.heads_per_rank(2) * cfg.n_layers,
                        "positions_restart": pack([[0] * n for n in lens]).positions.tolist().count(0)}


def _parse_attention(text: str) -> dict:
    head = ATTN_RE.search(text)
    ranks = RANK_RE.findall(text)
    assert head and len(ranks) == 2, f"attention readout not in the documented format: {text!r}"
    cells = {int(c) for *_, c, _ in ranks}
    assert len(cells) == 1 and [(int(a), int(b)) for _, a, b, _, _ in ranks] == [(0, 3), (4, 7)]
    shown_cu = head[2]
    tiles, requests, heads, grid = (int(head[i]) for i in (5, 6, 7, 8))
    assert requests == int(head[1]) and tiles * requests * heads == grid, f"the grid does not add up: {head[0]!r}"
    return {"R": int(head[1]), "cu": shown_cu, "max_seqlen": int(head[4]), "tiles": tiles, "grid": grid,
            "cells": cells.pop(),
            "per_forward": int(ranks[0][4]),
            "positions_restart": sum(e.strip() == "0" or e.strip().startswith("0..") for e in head[3].split(","))}


def _check_attention(text: str, want: dict) -> None:
    got = _parse_attention(text)
    assert got["cu"] == l04_tp.short_cu(want["cu"]), (got["cu"], want["cu"])
    for key in ("R", "max_seqlen", "tiles", "grid", "cells", "per_forward"):
        assert got[key] == want[key], (key, got[key], want[key])
    if want["R"] <= 8:  # every run of positions is listed: each starts at 0
        assert got["positions_restart"] == want["positions_restart"]


def _readout(page, slider_cls: str) -> int:
    return int(_text(page, f".{slider_cls} .widget-readout"))


def _step_right(page, prefix: str, text_sel: str, r: int, src: str, latencies: list, text_ms: list) -> tuple[int, str]:
    """ArrowRight on the explorer's ``<prefix>-num-requests`` slider: R goes up by one and the
    figure is redrawn. Returns the new R and the new figure's src; records the latency."""
    ms, new_src = _move(page, f"{prefix}-num-requests", f".{prefix}-figure", text_sel, "ArrowRight", text_ms)
    latencies.append(ms)
    assert new_src != src, f"the {prefix} figure was not redrawn"
    r_new = _readout(page, f"{prefix}-num-requests")
    assert r_new == r + 1, f"ArrowRight on the slider moved R from {r} to {r_new}"
    return r_new, new_src


def _move(page, slider_cls: str, figure_sel: str, text_sel: str, key: str, text_ms: list) -> tuple[float, str]:
    """Press ``key`` on the slider's handle; return (ms to the new figure on screen, its src).

    The ms to the readout text change is appended to ``text_ms`` (the figure's share of the
    latency is the difference)."""
    page.evaluate(ARM_PROBE_JS, [figure_sel, text_sel])
    page.locator(f".{slider_cls} .noUi-handle").first.focus()
    page.keyboard.press(key)
    page.wait_for_function("() => window.__probe.t1 !== null", timeout=UPDATE_TIMEOUT_MS)
    probe = page.evaluate("() => window.__probe")
    if probe["tText"] is not None:
        text_ms.append(probe["tText"] - probe["t0"])
    return probe["t1"] - probe["t0"], probe["src"]


def _finish(page, widget, lesson: str, latencies: list[float], text_ms: list[float], console_errors: list[str],
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


def test_lesson03_diagonal_block_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = _open_explorer(
        browser_context, lab_server, "03_masked_vs_varlen_attention.ipynb", "dbx",
        r"""() => /varlen: computed \d+/.test((document.querySelector('.dbx-counts') || {}).innerText || '')
                  && !!document.querySelector('.dbx-figure img')""", "the diagonal-block explorer")

    pattern = page.locator(".dbx-pattern select").input_value()
    r, length = _readout(page, "dbx-num-requests"), _readout(page, "dbx-length")
    assert _parse_counts(_text(page, ".dbx-counts")) == _expected_counts(r, length, pattern)
    src = page.locator(".dbx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for _ in range(MOVES):
        r, src = _step_right(page, "dbx", ".dbx-counts", r, src, latencies, text_ms)
        want = _expected_counts(r, length, pattern)
        want_text = "\n".join(f"{m}: computed {c} | useful {u} | wasted {w}" for m, (c, u, w) in want.items())
        _wait_text(page, ".dbx-counts", f"t => t === {want_text!r}")
        assert _parse_counts(_text(page, ".dbx-counts")) == want

    _finish(page, widget, "03", latencies, text_ms, console_errors, t_start, capsys)


def test_lesson04_tp_packing_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = _open_explorer(
        browser_context, lab_server, "04_tp2_invariance.ipynb", "tpx",
        r"""() => /same as 1 request/.test((document.querySelector('.tpx-trace') || {}).innerText || '')
                  && !!document.querySelector('.tpx-figure img')""", "the TP packing explorer")

    pattern = page.locator(".tpx-pattern select").input_value()
    total, r = _readout(page, "tpx-tokens"), _readout(page, "tpx-num-requests")
    want_trace, want_attn = _expected_tp(total, r, pattern)
    trace = _text(page, ".tpx-trace")
    assert trace == want_trace
    _check_attention(_text(page, ".tpx-attention"), want_attn)
    src = page.locator(".tpx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for _ in range(MOVES - 1):  # more requests, the same tokens: the trace must not move
        r, src = _step_right(page, "tpx", ".tpx-attention", r, src, latencies, text_ms)
        _, want_attn = _expected_tp(total, r, pattern)
        _wait_text(page, ".tpx-attention", f"t => t.includes('R = {r} |')")
        _check_attention(_text(page, ".tpx-attention"), want_attn)
        assert _text(page, ".tpx-trace") == trace, "the TP trace moved although only the packing changed"
    # End on the tokens slider: more tokens, and now the trace changes (only its T)
    ms, new_src = _move(page, "tpx-tokens", ".tpx-figure", ".tpx-trace", "End", text_ms)
    latencies.append(ms)
    assert new_src != src
    total = _readout(page, "tpx-tokens")
    max_tokens = _slider_max(page, "tpx-tokens")
    assert total == max_tokens, f"End on the tokens slider left T={total}, slider max is {max_tokens}"
    want_trace, want_attn = _expected_tp(total, r, pattern)
    _wait_text(page, ".tpx-trace", f"t => t === {want_trace!r}")
    assert f"[{total}, 512]" in _text(page, ".tpx-trace") and _text(page, ".tpx-trace") != trace
    _wait_text(page, ".tpx-attention", f"t => t.includes('cu_seqlens {l04_tp.short_cu(want_attn['cu'])}')")
    _check_attention(_text(page, ".tpx-attention"), want_attn)
    trace, src = _text(page, ".tpx-trace"), new_src
    # Home on the requests slider: ONE request of T tokens, longer than a tile: max_seqlen adds tiles to the grid
    ms, new_src = _move(page, "tpx-num-requests", ".tpx-figure", ".tpx-attention", "Home", text_ms)
    latencies.append(ms)
    assert new_src != src and _readout(page, "tpx-num-requests") == 1
    _, want_attn = _expected_tp(total, 1, pattern)
    assert want_attn["tiles"] > 1, f"T = {total} does not exceed one tile of {l04_tp.TILE}"
    _wait_text(page, ".tpx-attention", "t => t.includes('R = 1 |')")
    _check_attention(_text(page, ".tpx-attention"), want_attn)
    assert _text(page, ".tpx-trace") == trace, "the TP trace moved although only the packing changed"

    _finish(page, widget, "04", latencies, text_ms, console_errors, t_start, capsys)


def test_lesson05_flop_mix_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = _open_explorer(
        browser_context, lab_server, "05_flop_regimes.ipynb", "frx",
        r"""() => /-dominated/.test((document.querySelector('.frx-table') || {}).innerText || '')
                  && !!document.querySelector('.frx-figure img')""", "the FLOP-mix explorer")

    counting = page.locator(".frx-counting select").input_value()
    total = _readout(page, "frx-tokens")
    assert _parse_mix(_text(page, ".frx-table")) == _expected_mix(total, counting)
    assert _text(page, ".frx-rule").endswith(f"L = {l05_flops.crossover_length(ModelConfig(), counting == 'causal')} "
                                             f"tokens per request ({counting})")
    src = page.locator(".frx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    # Small steps first (100 tokens each), then End (the slider's max), where 1 x T is attention-dominated.
    for key in ["ArrowRight"] * (MOVES - 1) + ["End"]:
        ms, new_src = _move(page, "frx-tokens", ".frx-figure", ".frx-table", key, text_ms)
        latencies.append(ms)
        assert new_src != src, "the FLOPs figure was not redrawn"
        src = new_src
        total = _readout(page, "frx-tokens")
        want = _expected_mix(total, counting)
        _wait_text(page, ".frx-table", f"t => t.startsWith('1 x {total}:')")
        assert _parse_mix(_text(page, ".frx-table")) == want
    max_tokens = _slider_max(page, "frx-tokens")
    assert total == max_tokens, f"End on the tokens slider left T={total}, slider max is {max_tokens}"
    assert _parse_mix(_text(page, ".frx-table"))[0][-1] == "attention", "1 x T_max should be attention-dominated"

    _finish(page, widget, "05", latencies, text_ms, console_errors, t_start, capsys)


K7_RE = re.compile(r"(programs|early_exits|tiles|tiles_skipped|cells): measured (\d+|not run) \| predicted (\d+) \| picture (\d+)")


def _k7_numbers(page) -> dict:
    text = _text(page, ".k7x-counts")
    found = {f: (m, int(p), int(pic)) for f, m, p, pic in K7_RE.findall(text)}
    assert set(found) == {"programs", "early_exits", "tiles", "tiles_skipped", "cells"}, f"counts not in format: {text!r}"
    return found


def _k7_expected(lengths: str, block_m: int, block_n: int, causal: bool, bug: str = l07_kernel.NO_BUG
                 ) -> tuple[dict, str]:
    """The explorer's numbers recomputed here: the kernel run directly (same seed, same bug), the tiling predictor."""
    state = l07_kernel.kernel_state(lengths, block_m, block_n, causal, bug)
    want = {}
    for f in ("programs", "early_exits", "tiles", "tiles_skipped", "cells"):
        predicted = getattr(tiling.predict_work(state["seq_lens"], block_m=block_m, block_n=block_n, causal=causal), f)
        measured = str(getattr(state["measured"], f)) if state["ran"] else "not run"
        want[f] = (measured, predicted, predicted)
    error = f"max |out - fp64 reference| = {state['error']:.2e}" if state["ran"] else "kernel not run"
    return want, error


def _k7_check(page, lengths: str, block_m: int, block_n: int, causal: bool, bug: str = l07_kernel.NO_BUG) -> None:
    want, error = _k7_expected(lengths, block_m, block_n, causal, bug)
    _wait_text(page, ".k7x-counts", f"t => t.includes('programs: measured {want['programs'][0]} | predicted "
                                     f"{want['programs'][1]} |') && t.includes('cells: measured {want['cells'][0]} |') "
                                     f"&& t.includes('tiles: measured {want['tiles'][0]} |')")
    assert _k7_numbers(page) == want
    assert error in _text(page, ".k7x-status")


def test_lesson07_kernel_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = _open_explorer(
        browser_context, lab_server, "07_inside_the_kernel.ipynb", "k7x",
        r"""() => /programs: measured/.test((document.querySelector('.k7x-counts') || {}).innerText || '')
                  && !!document.querySelector('.k7x-figure img')""", "the kernel explorer")

    lengths = page.locator(".k7x-lengths input").input_value()
    causal = page.locator(".k7x-causal input").is_checked()
    block_m, block_n = _readout(page, "k7x-block-m"), _readout(page, "k7x-block-n")
    _k7_check(page, lengths, block_m, block_n, causal)
    first = _k7_numbers(page)
    src = page.locator(".k7x-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for slider in ("k7x-block-m", "k7x-block-m", "k7x-block-n"):  # 16 -> 32 -> 64 rows, then 16 -> 32 keys
        ms, new_src = _move(page, slider, ".k7x-figure", ".k7x-counts", "ArrowRight", text_ms)
        latencies.append(ms)
        assert new_src != src, "the launch picture was not redrawn"
        src = new_src
        block_m, block_n = _readout(page, "k7x-block-m"), _readout(page, "k7x-block-n")
        _k7_check(page, lengths, block_m, block_n, causal)
    assert (block_m, block_n) == (64, 32)
    assert _k7_numbers(page) != first, "new tile sizes, the same numbers"

    # Type new lengths: the numbers follow the input (a long + short mix, so some programs return at once)
    box = page.locator(".k7x-lengths input")
    box.fill("100, 5, 20")
    box.press("Enter")
    _k7_check(page, "100, 5, 20", block_m, block_n, causal)
    assert int(_k7_numbers(page)["early_exits"][1]) > 0

    # Pick a bug: the kernel runs with one line changed and its tiles leave the prediction
    page.locator(".k7x-bug select").select_option(label="no early return")
    _k7_check(page, "100, 5, 20", block_m, block_n, causal, "no early return")
    tiles = _k7_numbers(page)["tiles"]
    if tiles[0] != "not run":
        assert int(tiles[0]) > tiles[1], f"no early return, yet the kernel's tiles equal the prediction: {tiles}"
        assert "with the bug 'no early return'" in _text(page, ".k7x-status")

    _finish(page, widget, "07", latencies, text_ms, console_errors, t_start, capsys)


CPX_RE = re.compile(r"chunked \(budget ([\d,]+)\): (\d+) forwards, largest ([\d,]+) tokens \| the (\d+) requests behind the "
                    r"longest wait ([\d.]+) forwards, ([\d,]+) tokens on average \| score cells ([\d,]+) \(whole blocks\), "
                    r"([\d,]+) causal \| cache read ([\d,]+) rows, peak ([\d,]+) B")


def _expected_chunked(workload: str, num_requests: int, budget: int) -> str:
    """Lesson 08's readout for these inputs, from a direct call of the state function (it runs the engine)."""
    state = l08_chunked.chunked_plan_state(workload, num_requests, budget)
    assert state["chunked"]["timeline"] == l08_chunked.planned_timeline(state["seq_lens"], budget, True)
    return re.sub(r"<div>(.*?)</div>", r"\1\n", l08_chunked.chunked_plan_html(state)).strip()


def test_lesson08_chunked_prefill_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = _open_explorer(
        browser_context, lab_server, "08_chunked_prefill.ipynb", "cpx",
        r"""() => /chunked \(budget/.test((document.querySelector('.cpx-counts') || {}).innerText || '')
                  && !!document.querySelector('.cpx-figure img')""", "the chunked-prefill explorer")

    workload = page.locator(".cpx-workload select").input_value()
    r, budget = _readout(page, "cpx-num-requests"), _readout(page, "cpx-budget")
    text = _text(page, ".cpx-counts")
    assert text == _expected_chunked(workload, r, budget)
    first = CPX_RE.search(text)
    assert first and int(first[1].replace(",", "")) == budget
    src = page.locator(".cpx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for _ in range(MOVES):  # the budget up by one slider step (16 tokens): the engine runs again
        ms, new_src = _move(page, "cpx-budget", ".cpx-figure", ".cpx-counts", "ArrowRight", text_ms)
        latencies.append(ms)
        assert new_src != src, "the timeline was not redrawn"
        src = new_src
        new_budget = _readout(page, "cpx-budget")
        assert new_budget == budget + 16, f"ArrowRight moved the budget from {budget} to {new_budget}"
        budget = new_budget
        want = _expected_chunked(workload, r, budget)
        _wait_text(page, ".cpx-counts", f"t => t === {want!r}")
        got = CPX_RE.search(_text(page, ".cpx-counts"))
        assert got and int(got[1].replace(",", "")) == budget and got[0] != first[0], "the numbers did not change"

    _finish(page, widget, "08", latencies, text_ms, console_errors, t_start, capsys)
