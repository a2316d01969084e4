"""Lesson 08's chunked-prefill explorer in the browser: its readout equals a direct call of its state function
(the engine's forwards and cells exactly; each chunked request's error against the unchunked prefill to its two
printed digits; the measured times are not compared), for the default input, after budget moves, and with a bug on.
"""
from __future__ import annotations

import re

from widget_driver import MOVES, finish, inner_text, move, open_explorer, readout, wait_text

from lessons_lib.course import l08_chunked

CPX_RE = re.compile(r"chunked \(budget ([\d,]+)\): (\d+) forwards, largest ([\d,]+) tokens \| the (\d+) requests behind the "
                    r"longest wait ([\d.]+) forwards, ([\d,]+) tokens on average \| score cells ([\d,]+) \(whole blocks\), "
                    r"([\d,]+) causal \| cache read ([\d,]+) rows, peak ([\d,]+) B")
ERR_RE = re.compile(r"(\d+) \((\d+) chunks\) ([\d.e+-]+) (≤|>) ([\d.e+-]+) (✓|✗)")


def _lines(html: str) -> list[str]:
    return [m.strip() for m in re.findall(r"<div>(.*?)</div>", html)]


def _expected(workload: str, num_requests: int, budget: int, bug: str = "none") -> list[str]:
    """Lesson 08's readout lines for these inputs, from a direct call of the state function (it runs the engine)."""
    state = l08_chunked.chunked_plan_state(workload, num_requests, budget, bug=bug)
    if bug == "none":
        assert state["chunked"]["timeline"] == l08_chunked.planned_timeline(state["seq_lens"], budget, True)
    return _lines(l08_chunked.chunked_plan_html(state))


def _same(shown: str, want: list[str]) -> None:
    got = [line.strip() for line in shown.splitlines() if line.strip()]
    assert len(got) == len(want) == 5, got
    assert got[:3] == want[:3]                       # forwards, waits, cells, cache: exact
    a, b = ERR_RE.findall(got[3]), ERR_RE.findall(want[3])
    assert len(a) == len(b) and got[3].split(" | ")[0] == want[3].split(" | ")[0]
    assert got[3].split(" | ")[-1] == want[3].split(" | ")[-1]      # "k of n wrong"
    for x, y in zip(a, b):                            # request, chunks, verdict exact; numbers to print precision
        assert (x[0], x[1], x[3], x[5]) == (y[0], y[1], y[3], y[5]), (x, y)
        for u, v in ((x[2], y[2]), (x[4], y[4])):
            assert abs(float(u) - float(v)) <= 0.11 * abs(float(v)) + 1e-12, (x, y)
    assert got[4].startswith("measured wall time per forward")


def test_lesson08_chunked_prefill_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "08_chunked_prefill.ipynb", "cpx",
        r"""() => /chunked \(budget/.test((document.querySelector('.cpx-counts') || {}).innerText || '')
                  && !!document.querySelector('.cpx-figure img')""", "the chunked-prefill explorer")

    workload = page.locator(".cpx-workload select").input_value()
    r, budget = readout(page, "cpx-num-requests"), readout(page, "cpx-budget")
    text = inner_text(page, ".cpx-counts")
    _same(text, _expected(workload, r, budget))
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
        want = _expected(workload, r, budget)
        wait_text(page, ".cpx-counts", f"t => t.startsWith({want[0]!r}) && !t.includes('running')")
        shown = inner_text(page, ".cpx-counts")
        _same(shown, want)
        got = CPX_RE.search(shown)
        assert got and int(got[1].replace(",", "")) == budget and got[0] != first[0], "the numbers did not change"

    # a bug of the break-it section: the chunked requests' errors jump past the bound
    page.locator(".cpx-bug select").select_option("cache not appended")
    want = _expected(workload, r, budget, "cache not appended")
    wait_text(page, ".cpx-counts", "t => t.includes('bug: cache not appended') && !t.includes('running')")
    shown = inner_text(page, ".cpx-counts")
    _same(shown, want)
    assert "✗" in shown and " 0 of " not in shown

    finish(page, widget, "08", latencies, text_ms, console_errors, t_start, capsys)
