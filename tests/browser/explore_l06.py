"""Lesson 06's prefill-plan explorer in the browser: its readout equals ``course.l06_engine.prefill_plan_state``
for the knobs on screen, the recorded batch included (what ``OpRecorder`` saw ``Engine(L.TINY)`` execute),
and the recorded rows and cells equal ``serve.engine.batch_stats``' prediction for that batch. Switching the
scheduler from FCFS to shortest first changes the per-batch pad rows / masked cells and the delay line, again
equal to a direct call.
"""
from __future__ import annotations

import re

from widget_driver import MOVES, finish, inner_text, move, open_explorer, readout, wait_text

from lessons_lib.course import l06_engine as L
from lessons_lib.serve.engine import batch_stats

REC_RE = re.compile(r"(padded|masked|varlen): recorded rows ([\d,]+), cells ([\d,]+), .* = predicted rows ([\d,]+), "
                    r"cells ([\d,]+)")


def _knobs(page) -> dict:
    return {"workload": page.locator(".ppx-workload select option:checked").inner_text().strip(),
            "num_requests": readout(page, "ppx-num-requests"),
            "max_num_batched_tokens": readout(page, "ppx-budget"), "batch": readout(page, "ppx-batch"),
            "scheduler": page.locator(".ppx-scheduler select option:checked").inner_text().replace("\xa0", " ").strip()}


def _expected(knobs: dict) -> tuple[list[str], dict]:
    """A direct call of the library for the knobs read off the page, as the lines the readout shows."""
    state = L.prefill_plan_state(**knobs)
    html = L.prefill_plan_html(state)
    lines = [re.sub(r"<[^>]+>", "", x).strip() for x in re.split(r"</div>", html) if x.strip()]
    return lines, state


def _lines(page) -> list[str]:
    return [x.strip() for x in inner_text(page, ".ppx-counts").splitlines() if x.strip()]


def _check(page) -> dict:
    knobs = _knobs(page)
    want, state = _expected(knobs)
    wait_text(page, ".ppx-counts", f"t => t.split('\\n').map(s => s.trim()).filter(s => s).join('|') === {'|'.join(want)!r}")
    got = _lines(page)
    assert got == want
    b = state["batch"]
    lens = [state["seq_lens"][i] for i in state["batches"][b]]
    recorded = [REC_RE.search(x) for x in got if "recorded rows" in x]
    assert recorded, f"no recorded method in the readout: {got}"
    for m in recorded:  # the recorder's numbers on screen against batch_stats' prediction, computed here
        s = batch_stats(L.TINY, lens, m[1])
        assert (int(m[2].replace(",", "")), int(m[3].replace(",", ""))) == (s.executed_rows, s.cells_whole_computed)
    return state


def test_lesson06_prefill_plan_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "06_prefill_engine.ipynb", "ppx",
        r"""() => /recorded rows/.test((document.querySelector('.ppx-counts') || {}).innerText || '')
                  && !!document.querySelector('.ppx-figure img')""", "the prefill-plan explorer")
    before = _check(page)
    src = page.locator(".ppx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for _ in range(MOVES):                      # the budget down by 16 each: batches, counts and figure follow
        ms, new_src = move(page, "ppx-budget", ".ppx-figure", ".ppx-counts", "ArrowLeft", text_ms)
        latencies.append(ms)
        assert new_src != src, "the batch-waste figure was not redrawn"
        src = new_src
        state = _check(page)
    assert state["max_num_batched_tokens"] == before["max_num_batched_tokens"] - 16 * MOVES
    assert state["batches"] != before["batches"]

    # Record another batch: the recorded lines change to that batch's, still equal to the prediction.
    old = _lines(page)
    page.locator(".ppx-batch .noUi-handle").first.focus()
    for _ in range(2):
        page.keyboard.press("ArrowRight")
    wait_text(page, ".ppx-batch .widget-readout", "t => t === '2'")
    state = _check(page)
    assert state["batch"] == 2 and _lines(page) != old

    # Another scheduler: shortest first pads fewer rows, and the delay line now names requests served later.
    old = _lines(page)
    page.locator(".ppx-scheduler select").select_option("shortest first")
    wait_text(page, ".ppx-counts", "t => t.includes('shortest first:') && !t.includes('running')")
    state = _check(page)
    assert state["scheduler"] == "shortest first" and _lines(page) != old
    assert any("served later, at most" in x for x in _lines(page)), _lines(page)
    per = [x for x in _lines(page) if x.startswith("per batch")]
    assert per and per != [x for x in old if x.startswith("per batch")]

    finish(page, widget, "06", latencies, text_ms, console_errors, t_start, capsys)
