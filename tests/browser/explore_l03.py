"""Lesson 03's diagonal-block explorer in the browser: its counts equal ``attention_cells`` for every R.
"""
from __future__ import annotations

import re

from widget_driver import MOVES, finish, inner_text, open_explorer, readout, step_right, wait_text

from lessons_lib.course import l03_attention
from lessons_lib.measure import flops

COUNTS_RE = re.compile(r"(padded|masked|varlen): computed (\d+) \| useful (\d+) \| wasted (\d+)")


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


def test_lesson03_diagonal_block_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "03_masked_vs_varlen_attention.ipynb", "dbx",
        r"""() => /varlen: computed \d+/.test((document.querySelector('.dbx-counts') || {}).innerText || '')
                  && !!document.querySelector('.dbx-figure img')""", "the diagonal-block explorer")

    pattern = page.locator(".dbx-pattern select").input_value()
    r, length = readout(page, "dbx-num-requests"), readout(page, "dbx-length")
    assert _parse_counts(inner_text(page, ".dbx-counts")) == _expected_counts(r, length, pattern)
    src = page.locator(".dbx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for _ in range(MOVES):
        r, src = step_right(page, "dbx", ".dbx-counts", r, src, latencies, text_ms)
        want = _expected_counts(r, length, pattern)
        want_text = "\n".join(f"{m}: computed {c} | useful {u} | wasted {w}" for m, (c, u, w) in want.items())
        wait_text(page, ".dbx-counts", f"t => t === {want_text!r}")
        assert _parse_counts(inner_text(page, ".dbx-counts")) == want

    finish(page, widget, "03", latencies, text_ms, console_errors, t_start, capsys)
