"""Lesson 08's chunked-prefill explorer in the browser: its readout equals a direct call of its state function.
"""
from __future__ import annotations

import re

from widget_driver import MOVES, finish, inner_text, move, open_explorer, readout, wait_text

from lessons_lib.course import l08_chunked

CPX_RE = re.compile(r"chunked \(budget ([\d,]+)\): (\d+) forwards, largest ([\d,]+) tokens \| the (\d+) requests behind the "
                    r"longest wait ([\d.]+) forwards, ([\d,]+) tokens on average \| score cells ([\d,]+) \(whole blocks\), "
                    r"([\d,]+) causal \| cache read ([\d,]+) rows, peak ([\d,]+) B")


def _expected_chunked(workload: str, num_requests: int, budget: int) -> str:
    """Lesson 08's readout for these inputs, from a direct call of the state function (it runs the engine)."""
    state = l08_chunked.chunked_plan_state(workload, num_requests, budget)
    assert state["chunked"]["timeline"] == l08_chunked.planned_timeline(state["seq_lens"], budget, True)
    return re.sub(r"<div>(.*?)</div>", r"\1\n", l08_chunked.chunked_plan_html(state)).strip()


def test_lesson08_chunked_prefill_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "08_chunked_prefill.ipynb", "cpx",
        r"""() => /chunked \(budget/.test((document.querySelector('.cpx-counts') || {}).innerText || '')
                  && !!document.querySelector('.cpx-figure img')""", "the chunked-prefill explorer")

    workload = page.locator(".cpx-workload select").input_value()
    r, budget = readout(page, "cpx-num-requests"), readout(page, "cpx-budget")
    text = inner_text(page, ".cpx-counts")
    assert text == _expected_chunked(workload, r, budget)
    first = CPX_RE.search(text)
    assert first and int(first[1].replace(",", "")) == budget
    src = page.locator(".cpx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for _ in range(MOVES):  # the budget up by one slider step (16 tokens): the engine runs again
        ms, new_src = move(page, "cpx-budget", ".cpx-figure", ".cpx-counts", "ArrowRight", text_ms)
        latencies.append(ms)
        assert new_src != src, "the timeline was not redrawn"
        src = new_src
        new_budget = readout(page, "cpx-budget")
        assert new_budget == budget + 16, f"ArrowRight moved the budget from {budget} to {new_budget}"
        budget = new_budget
        want = _expected_chunked(workload, r, budget)
        wait_text(page, ".cpx-counts", f"t => t === {want!r}")
        got = CPX_RE.search(inner_text(page, ".cpx-counts"))
        assert got and int(got[1].replace(",", "")) == budget and got[0] != first[0], "the numbers did not change"

    finish(page, widget, "08", latencies, text_ms, console_errors, t_start, capsys)
