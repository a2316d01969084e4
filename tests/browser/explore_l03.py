"""Lesson 03's attention-run explorer in the browser: for lengths typed in and the causal box toggled, the
numbers it shows equal a direct call of its state function, of ``OpRecorder`` on the engine's backends and
of ``flops.attention_cells``.
"""
from __future__ import annotations

import math
import re

from widget_driver import ARM_PROBE_JS, UPDATE_TIMEOUT_MS, finish, inner_text, open_explorer, wait_text

from lessons_lib.core.attention import varlen_attention
from lessons_lib.course import l03_attention as L
from lessons_lib.measure import flops
from lessons_lib.measure.profile import random_qkv
from lessons_lib.measure.recorder import OpRecorder

PRED_RE = re.compile(r"(padded|masked|varlen): computed (\d+) \| useful (\d+) \| wasted \d+ = "
                     r"(?:above the diagonal (\d+) \+ )?(?:pad|cross-request|outside the blocks) (\d+)")


def _shown(page) -> dict:
    """The explorer's table, read from the page: ``{backend label: (cells, predicted, scores, largest, err)}``."""
    table = page.evaluate("""() => [...document.querySelectorAll('.arx-rows tr')].map(
        tr => [...tr.children].map(td => td.innerText.trim()))""")
    assert table and tuple(table[0]) == L.RUN_COLUMNS, f"explorer table header: {table[:1]}"
    rows = {}
    for label, cells, pred, scores, largest, err, ms in table[1:]:
        assert float(ms) > 0, f"{label}: no time shown"
        rows[label] = (int(cells), int(pred), int(scores), largest, float(err))
    return rows


def _check(page, lengths: str, causal: bool, wait: bool = True) -> dict:
    """The explorer's rows against a direct call of the state function, of the recorder and of flops."""
    state = L.attention_run_state(lengths, causal)
    lens = state["seq_lens"]
    done = f"ran on lengths {lens}, causal {state['causal']}"   # the status line is set last
    if wait:
        wait_text(page, ".arx-status", f"t => t === {done!r}")
    shown = _shown(page)
    assert list(shown) == [L.run_label(state, n) for n in L.RUN_BACKENDS]
    q, k, v, cu = random_qkv(lens, L.RUN_HEADS, L.RUN_D_HEAD, seed=0)
    for name in L.RUN_BACKENDS:
        row = state["rows"][name]
        cells, pred, scores, largest, err = shown[L.run_label(state, name)]
        assert (cells, pred, scores) == (row["cells"], row["predicted"], row["scores"])
        assert largest == L._kib(row["largest_bytes"])
        with OpRecorder() as rec:  # the recorder, called here directly on the same backend and inputs
            varlen_attention(q, k, v, cu, causal=causal, backend=row["backend"])
        assert cells == rec.cells // L.RUN_HEADS
        method = "masked" if name == "masked" else "padded" if name == "padded" else "varlen"
        assert pred == flops.attention_cells(lens, method, causal and method != "varlen").computed
        # the error is a float32 rounding: equal up to the thread split of the kernel process vs this one
        assert err <= state["bound"] and math.isclose(err, row["error"], rel_tol=0.5, abs_tol=1e-7), (name, err, row)
    pred_lines = PRED_RE.findall(inner_text(page, ".arx-predicted"))
    assert [(m, int(c), int(u), int(a or 0), int(o)) for m, c, u, a, o in pred_lines] == \
        [(m, *(lambda x: (x.computed, x.useful, x.causal, x.outside))(flops.attention_waste(lens, m, causal)))
         for m in flops.METHODS]
    summary = inner_text(page, ".arx-summary")
    assert f"{state['tiled'].executed_cells} cells executed" in summary and f": {state['useful']} |" in summary
    loop_cells = shown[L.run_label(state, "loop")][0]   # each request's whole block: the loop computes nothing else
    m, p = (shown[L.run_label(state, n)][0] - loop_cells for n in ("masked", "padded"))  # the table's own cells
    assert f"masked {m} cross-request cells, padded {p} pad cells per head" in summary, summary
    if causal:  # the loop's computed-and-masked cells against what sdpa was handed, from the recorder directly
        masked_cells = loop_cells - flops.attention_cells(lens, "varlen", causal=True).useful
        fused = shown[L.run_label(state, "varlen")][0]
        assert (f"the loop computed {loop_cells} cells and masked {masked_cells} of them; "
                f"{state['rows']['varlen']['backend']} was handed {fused} cells") in summary, summary
        assert f"the {masked_cells} cells per head above the causal diagonal inside the blocks" in summary, summary
    return shown


def _timed(page, action, text_ms: list, latencies: list, src: str) -> str:
    """Run ``action`` (a key press on a control); record key -> new figure on screen. Returns the new src."""
    page.evaluate(ARM_PROBE_JS, [".arx-figure", ".arx-rows"])
    action()
    page.wait_for_function("() => window.__probe.t1 !== null", timeout=UPDATE_TIMEOUT_MS)
    probe = page.evaluate("() => window.__probe")
    if probe["tText"] is not None:
        text_ms.append(probe["tText"] - probe["t0"])
    latencies.append(probe["t1"] - probe["t0"])
    assert probe["src"] != src, "the explorer's figure was not redrawn"
    return probe["src"]


def test_lesson03_attention_run_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "03_masked_vs_varlen_attention.ipynb", "arx",
        r"""() => document.querySelectorAll('.arx-rows tr').length === 5
                  && !!document.querySelector('.arx-figure img')""", "the attention-run explorer")
    box, causal_box = page.locator(".arx-lengths input"), page.locator(".arx-causal input")
    lengths, causal = box.input_value(), causal_box.is_checked()
    first = _check(page, lengths, causal)
    src = page.locator(".arx-figure img").first.get_attribute("src")

    def type_lengths(text):
        def act():
            box.fill(text)
            box.press("Enter")
        return act

    latencies, text_ms = [], []
    src = _timed(page, type_lengths("10, 30, 5"), text_ms, latencies, src)
    assert _check(page, "10, 30, 5", causal) != first, "new lengths, the same numbers"
    before = _shown(page)
    src = _timed(page, lambda: (causal_box.focus(), page.keyboard.press("Space")), text_ms, latencies, src)
    assert causal_box.is_checked() != causal
    causal = not causal
    _check(page, "10, 30, 5", causal)
    assert _shown(page) != before or "useful (whole blocks)" in inner_text(page, ".arx-summary")
    for text in ("1, 1, 1, 1, 1, 1, 1, 1", "100, 100, 100", "300, 5, 5, 5"):
        src = _timed(page, type_lengths(text), text_ms, latencies, src)
        _check(page, text, causal)

    # Bad input: a clear message, the last numbers stay
    box.fill("10, 0")
    box.press("Enter")
    wait_text(page, ".arx-status", "t => t.includes('not run: lengths: every request needs 1..512 tokens, got 0')")
    _check(page, "300, 5, 5, 5", causal, wait=False)

    finish(page, widget, "03", latencies, text_ms, console_errors, t_start, capsys)
