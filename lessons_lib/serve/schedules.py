"""Prefill schedules as data: other plans than FCFS, a step driver for any ``Scheduler``, and the measures of a plan.

A schedule is a list of batches, each a list of request indices into ``seq_lens`` (prompt lengths in arrival
order). ``plan_batches`` (``serve.scheduler``) is FCFS; ``shortest_first_batches`` sorts the whole queue;
``drive_scheduler`` runs a ``Scheduler`` step by step with arrivals between steps. ``schedule_problem`` says what
makes a schedule invalid (S3: every request once, whole; every batch within both budgets) and
``schedule_measures`` prices a valid one against FCFS: pad rows, masked cells wasted, delays, overtakes
(``schedule_table`` prints both); ``passed_over`` counts, with arrivals, how often a request watched later arrivals
served first; ``plan_totals`` sums ``batch_stats``' rows, cells and FLOPs per method over a plan (``totals_text``
prints it); ``schedule_within`` plans a stream by name (``SCHEDULES``), refusing the requests over the budget.

Taught in notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..measure.flops import METHODS, attention_cells, executed_tokens
from ..validate import check_int
from .engine import batch_stats
from .scheduler import Request, Scheduler, plan_batches


def shortest_first_batches(seq_lens: Sequence[int], max_num_batched_tokens: int,
                           max_num_seqs: int = 256) -> list[list[int]]:
    """Shortest first over the whole stream (ties in arrival order), cut into batches within both budgets as the
    ``Scheduler`` cuts a queue (``plan_batches`` of the sorted queue): a list of batches of request indices.
    ValueError for a length below 1 or above the budget."""
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    lens = [check_int(f"seq_lens[{i}]", n, 1, budget) for i, n in enumerate(seq_lens)]
    order = sorted(range(len(lens)), key=lambda i: (lens[i], i))
    return [[order[j] for j in batch] for batch in plan_batches([lens[i] for i in order], budget, max_num_seqs)]


def with_schedule(schedule: Callable) -> type:
    """A ``Scheduler`` subclass whose ``schedule(self)`` is ``schedule``: ``Engine`` takes it as
    ``Engine(..., scheduler=with_schedule(fn)(max_num_batched_tokens, max_num_seqs))``."""
    if not callable(schedule):
        raise ValueError(f"with_schedule takes a function schedule(self), got {schedule!r}"[:200])
    return type(f"Scheduler_{getattr(schedule, '__name__', 'yours')}", (Scheduler,), {"schedule": schedule})


def drive_scheduler(make: Callable[[int, int], Scheduler], arrivals: Sequence[Sequence[int]],
                    max_num_batched_tokens: int, max_num_seqs: int, max_steps: int = 10_000) -> list[list[int]]:
    """Drive ``make(max_num_batched_tokens, max_num_seqs)`` step by step: at step s the requests of ``arrivals[s]``
    (lengths) are added (ids numbered in arrival order), then ``schedule()`` forms one batch. Returns the batches
    as request ids. ValueError when a step returns an empty batch while requests wait, something other than a list
    of the waiting ``Request`` objects, or more than ``max_steps`` batches."""
    sched = make(max_num_batched_tokens, max_num_seqs)
    batches, step, rid, known = [], 0, 0, {}
    while step < len(arrivals) or sched.waiting:
        for n in (arrivals[step] if step < len(arrivals) else []):
            known[rid] = Request(rid, [1] * n)
            sched.add(known[rid])
            rid += 1
        step += 1
        if not sched.waiting:
            continue
        batch = sched.schedule()
        if not isinstance(batch, list) or not all(isinstance(r, Request) for r in batch):
            raise ValueError(f"schedule() must return a list of Request objects, got {batch!r}"[:200])
        if not batch:
            raise ValueError(f"schedule() returned an empty batch at step {step - 1} while {len(sched.waiting)} "
                             "requests waited: every forward must carry at least one request")
        for r in batch:
            if known.get(r.request_id) is not r:
                raise ValueError(f"schedule() returned request {r.request_id!r}, which was not waiting")
        batches.append([r.request_id for r in batch])
        if len(batches) > max_steps:
            raise ValueError(f"more than {max_steps} batches: does schedule() take requests out of self.waiting?")
    return batches


def schedule_problem(batches, seq_lens: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int) -> str | None:
    """What makes ``batches`` (lists of request indices) an invalid prefill schedule, or None.

    Valid (S3): every request exactly once, so whole in one batch; no empty batch; every batch
    within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests.
    """
    n = len(seq_lens)
    if not isinstance(batches, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in batches):
        return f"expected a list of batches, each a list of request indices, got {batches!r}"[:300]
    flat = [i for b in batches for i in b]
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in flat):
        return "a batch holds request indices (ints), not tokens or requests"
    if sorted(flat) != list(range(n)):
        if sorted(flat) == sorted(seq_lens):
            return "your batches hold the requests' LENGTHS; return their indices (0 .. n-1) instead"
        missing = sorted(set(range(n)) - set(flat))
        twice = sorted({i for i in flat if flat.count(i) > 1})
        return ("every request must be served exactly once, whole, in one batch (S3): "
                + (f"missing {missing[:8]} " if missing else "") + (f"served twice {twice[:8]} " if twice else "")
                + (f"unknown {sorted(set(flat) - set(range(n)))[:8]}" if set(flat) - set(range(n)) else "")).strip()
    for b, ids in enumerate(batches):
        if not ids:
            return f"batch {b} is empty: every forward must carry at least one request"
        tokens = sum(seq_lens[i] for i in ids)
        if tokens > max_num_batched_tokens:
            return (f"batch {b} holds {tokens} tokens > max_num_batched_tokens={max_num_batched_tokens}: "
                    "close a batch before the next request would overflow it")
        if len(ids) > max_num_seqs:
            return f"batch {b} holds {len(ids)} requests > max_num_seqs={max_num_seqs}: the budget counts requests too"
    return None


def schedule_measures(seq_lens: Sequence[int], batches: Sequence[Sequence[int]], max_num_batched_tokens: int,
                      max_num_seqs: int = 256) -> dict:
    """The measures of a valid schedule, against FCFS (``plan_batches``) on the same stream.

    ``pad_rows``: rows a padded engine adds (``flops.executed_tokens``); ``masked_wasted``: cross-request score
    cells a masked engine computes and throws away, per head per layer (``flops.attention_cells``); ``delays``: per
    request, the batches it is served after its FCFS batch, ``max_delay`` their largest (0 at least);
    ``overtakes``: pairs where a later arrival is served in an earlier batch; ``batches``: forwards.
    """
    fcfs = plan_batches(seq_lens, max_num_batched_tokens, max_num_seqs)
    at = {i: b for b, ids in enumerate(batches) for i in ids}
    at_fcfs = {i: b for b, ids in enumerate(fcfs) for i in ids}
    delays = [at[i] - at_fcfs[i] for i in range(len(seq_lens))]
    lens = [[seq_lens[i] for i in ids] for ids in batches]
    return {"batches": len(batches), "pad_rows": sum(executed_tokens(b, "padded") - sum(b) for b in lens),
            "masked_wasted": sum(attention_cells(b, "masked").wasted for b in lens),
            "delays": delays, "max_delay": max([0] + delays),
            "overtakes": sum(at[j] < at[i] for i in range(len(seq_lens)) for j in range(i + 1, len(seq_lens)))}


def schedule_table(seq_lens: Sequence[int], batches: Sequence[Sequence[int]], max_num_batched_tokens: int,
                   max_num_seqs: int = 256, name: str = "yours") -> str:
    """FCFS and ``batches`` side by side on the same stream, one line each: batches, pad rows, masked cells wasted,
    max delay and overtakes (``schedule_measures``), under a header line."""
    fcfs = plan_batches(seq_lens, max_num_batched_tokens, max_num_seqs)
    rows = {"FCFS": schedule_measures(seq_lens, fcfs, max_num_batched_tokens, max_num_seqs),
            name: schedule_measures(seq_lens, batches, max_num_batched_tokens, max_num_seqs)}
    head = f"{'':8s} {'batches':>7s} {'pad rows':>9s} {'masked cells wasted':>20s} {'max delay':>9s} {'overtakes':>9s}"
    return "\n".join([head] + [f"{k:8s} {m['batches']:7d} {m['pad_rows']:9,d} {m['masked_wasted']:20,d} "
                               f"{m['max_delay']:9d} {m['overtakes']:9d}" for k, m in rows.items()])


def passed_over(batches: Sequence[Sequence[int]], arrivals: Sequence[Sequence[int]]) -> dict[int, int]:
    """``{request id: batches that served a later arrival before it}`` for ``drive_scheduler``'s ``batches`` of
    ``arrivals`` (ids in arrival order), counting only batches formed after it arrived (batch b forms at step b)."""
    arrived = dict(enumerate(s for s, wave in enumerate(arrivals) for _ in wave))
    served_at = {i: b for b, ids in enumerate(batches) for i in ids}
    return {i: sum(1 for b in range(served_at[i]) if arrived[i] <= b and any(j > i for j in batches[b]))
            for i in served_at}


def stats_totals(stats: Sequence) -> dict:
    """``BatchStats`` of one method summed: ``{"rows", "pad_rows", "cells_computed", "cells_useful",
    "flops_executed", "flops_useful"}``, cells per head per layer and FLOPs of whole forwards, by whole blocks."""
    return {"rows": sum(s.executed_rows for s in stats), "pad_rows": sum(s.padding_rows for s in stats),
            "cells_computed": sum(s.cells_whole_computed for s in stats),
            "cells_useful": sum(s.cells_whole_useful for s in stats),
            "flops_executed": sum(s.flops_whole_executed for s in stats),
            "flops_useful": sum(s.flops_whole_useful for s in stats)}


def plan_totals(cfg, batches: Sequence[Sequence[int]]) -> dict:
    """``{method: stats_totals}`` over ``batches`` (lists of request lengths) for ``ModelConfig`` ``cfg``,
    predicted by ``batch_stats`` (nothing runs)."""
    return {m: stats_totals([batch_stats(cfg, b, m) for b in batches]) for m in METHODS}


def totals_text(totals: dict) -> str:
    """One line per method of ``plan_totals``: rows (pad rows), cells and FLOPs, each with what it counts."""
    lines = []
    for m, t in totals.items():
        fl = t["flops_executed"] / t["flops_useful"] if t["flops_useful"] else 0.0
        lines.append(f"{m:7s} rows {t['rows']:>9,} (pad {t['pad_rows']:>7,}) | score cells, whole blocks "
                     f"{t['cells_computed']:>13,} ({t['cells_computed'] / t['cells_useful']:.2f}x the useful) | "
                     f"FLOPs, whole blocks: {fl:.2f}x the useful")
    return "\n".join(lines)


SCHEDULES = {"FCFS": plan_batches, "shortest first": shortest_first_batches}  # name -> (seq_lens, budget) -> batches


def schedule_within(scheduler: str, seq_lens: Sequence[int], max_num_batched_tokens: int) -> tuple[list[list[int]], dict]:
    """``(batches of request ids into seq_lens, schedule_measures)`` of the requests that fit the budget (the others
    are refused, S3) planned by ``SCHEDULES[scheduler]``; ``delays`` become ``(request id, batches later than under
    FCFS)`` pairs. ValueError for a scheduler not in ``SCHEDULES``."""
    if scheduler not in SCHEDULES:
        raise ValueError(f"scheduler must be one of {tuple(SCHEDULES)}, got {scheduler!r}")
    kept = [i for i, n in enumerate(seq_lens) if n <= max_num_batched_tokens]
    sub = [seq_lens[i] for i in kept]
    local = SCHEDULES[scheduler](sub, max_num_batched_tokens)
    measures = schedule_measures(sub, local, max_num_batched_tokens)
    measures["delays"] = [(kept[i], d) for i, d in enumerate(measures["delays"])]
    return [[kept[i] for i in ids] for ids in local], measures
