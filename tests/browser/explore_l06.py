"""Lesson 06's prefill-plan explorer in the browser: its readout equals ``course.l06_engine.prefill_plan_state``
for the knobs on screen, the whole stream included (every batch as ``OpRecorder`` saw ``Engine(L.TINY)`` execute
it, per backend, each batch's record checked against its prediction), and the recorded batch's rows and cells
equal ``serve.engine.batch_stats``' prediction for that batch, computed here. Switching the
scheduler from FCFS to shortest first puts it beside FCFS in the fairness table (fewer pad rows, requests served
later, overtakes) and changes the delay table, again equal to a direct call, cell by cell.
"""
from __future__ import annotations

import json

from widget_driver import MOVES, finish, move, open_explorer, readout, wait_text

from lessons_lib.course import l06_engine as L
from lessons_lib.serve.engine import batch_stats

CELLS_JS = ("Array.from(document.querySelectorAll('.ppx-counts caption, .ppx-counts th, .ppx-counts td, "
            ".ppx-counts .ppx-line')).map(e => e.innerText.trim())")


def _knobs(page) -> dict:
    return {"workload": page.locator(".ppx-workload select option:checked").inner_text().strip(),
            "num_requests": readout(page, "ppx-num-requests"),
            "max_num_batched_tokens": readout(page, "ppx-budget"), "batch": readout(page, "ppx-batch"),
            "scheduler": page.locator(".ppx-scheduler select option:checked").inner_text().replace("\xa0", " ").strip()}


def _cells(page) -> list[str]:
    """Every caption, header cell, cell and line of the readout, in page order."""
    return page.evaluate(f"() => {CELLS_JS}")


def _table(page, name: str) -> dict:
    """The readout's table ``name`` as shown: {first cell: [cells]}."""
    rows = page.evaluate(f"""() => Array.from(document.querySelectorAll('.ppx-counts table.ppx-{name} tr'))
        .map(tr => Array.from(tr.querySelectorAll('th, td')).map(c => c.innerText.trim()))""")
    return {r[0]: r for r in rows}


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def readout_cells(readout: dict) -> list[str]:
    """Every text of the readout in the order ``prefill_plan_html`` lays it out (title, then per table its
    caption, header and cells, then the notes): what the page must show."""
    out = [readout["title"]]
    for t in readout["tables"]:
        out += [t["caption"], *t["header"], *(c for r in t["rows"] for c in r)]
    return out + list(readout["notes"])


def _check(page) -> dict:
    """The readout on the page equals a direct call of the library for the knobs on screen, cell by cell."""
    knobs = _knobs(page)
    state = L.prefill_plan_state(**knobs)
    want = readout_cells(state["readout"])
    wait_text(page, ".ppx-counts", f"t => JSON.stringify({CELLS_JS}) === JSON.stringify({json.dumps(want)})")
    assert _cells(page) == want
    b = state["batch"]
    lens = [state["seq_lens"][i] for i in state["batches"][b]]
    backends = {m: r for m, r in _table(page, "backends").items() if m in ("padded", "masked", "varlen")}
    assert all(r[-1] == f"= \u2713 {len(state['batches'])}/{len(state['batches'])}" for r in backends.values()), backends
    recorded = {m: r for m, r in _table(page, "recorded").items() if m in ("padded", "masked", "varlen")}
    assert recorded, f"no recorded method in the readout: {_cells(page)}"
    for m, row in recorded.items():  # the recorder's numbers on screen against batch_stats' prediction, computed here
        k = state["recorded"][m][1]                                  # 1, or the scale of a batch too big to run
        s = batch_stats(L.TINY, [-(-n // k) for n in lens], m)
        assert (_int(row[2]), _int(row[4])) == (s.executed_rows, s.cells_whole_computed), (m, row)
    return state


def test_lesson06_prefill_plan_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "06_prefill_engine.ipynb", "ppx",
        r"""() => !!document.querySelector('.ppx-counts table.ppx-recorded')
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

    # Record another batch: the recorded table changes to that batch's, still equal to the prediction.
    old = _cells(page)
    page.locator(".ppx-batch .noUi-handle").first.focus()
    for _ in range(2):
        page.keyboard.press("ArrowRight")
    wait_text(page, ".ppx-batch .widget-readout", "t => t === '2'")
    state = _check(page)
    assert state["batch"] == 2 and _cells(page) != old

    # Another scheduler: shortest first pads fewer rows than FCFS, beside it in the fairness table, and the
    # delay table now counts requests served later.
    old_delays = _table(page, "delays")
    page.locator(".ppx-scheduler select").select_option("shortest first")
    wait_text(page, ".ppx-counts", "t => t.includes('shortest first:') && !t.includes('running')")
    state = _check(page)
    fair = _table(page, "fairness")
    assert state["scheduler"] == "shortest first" and list(fair) == ["scheduler", "FCFS", "shortest first"], fair
    assert _int(fair["shortest first"][2]) < _int(fair["FCFS"][2]), fair            # pad rows
    assert _int(fair["shortest first"][4]) > 0 and _int(fair["shortest first"][6]) > 0, fair  # served later, overtakes
    assert _table(page, "delays") != old_delays

    finish(page, widget, "06", latencies, text_ms, console_errors, t_start, capsys)
