"""What a chunked prefill schedule costs, from its forwards alone (no model run).

  forward_score_cells     each forward's score cells per head per layer, whole blocks
  plan_prices             a schedule's forwards, all-reduces, largest forward, cache rows held and waits
  fewest_forwards_budget  the token budget with the fewest forwards within a cache limit (a search over plans)

A schedule is a list of forwards, each a list of chunks ``(request, start, length)`` (a chunked ``plan_batches``
plan, or ``BatchStats.chunks``); ``forward_score_cells`` also takes ``(request, length)`` pairs.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..validate import check_int
from .kv_cache import cache_rows_held
from .scheduler import DEFAULT_MAX_NUM_SEQS, mean_prefill_wait, plan_batches, prefill_waits


def forward_score_cells(forwards: Sequence[Sequence[tuple]]) -> list[int]:
    """Each forward's score cells per head per layer, whole blocks: a chunk of ``t`` tokens of a request that has
    already run ``s`` computes ``t × (s + t)`` (``BatchStats.cells_whole_computed``). Chunks are ``(request,
    length)`` or ``(request, start, length)``; the start is taken from the tokens run so far, in order."""
    done: Counter = Counter()
    out = []
    for fwd in forwards:
        pairs = [(c[0], c[-1]) for c in fwd]
        out.append(sum(t * (done[i] + t) for i, t in pairs))
        done.update(dict(pairs))
    return out


def plan_prices(plan: Sequence[Sequence[tuple]], seq_lens: Sequence[int], behind: Sequence[int],
                n_layers: int) -> dict:
    """A chunked schedule of requests with prompt lengths ``seq_lens``: ``forwards`` (each a pass over the weights),
    ``all_reduces`` (2 per block per forward at TP>1), ``largest`` (tokens of the largest forward),
    ``cache_rows_held`` / ``held_by`` / ``held_after`` (``cache_rows_held``' in-place peak between forwards) and
    ``wait_forwards`` / ``wait_tokens``, the mean ``prefill_waits`` of the requests ``behind`` (non-empty)."""
    held = cache_rows_held(plan, seq_lens)
    f, t = mean_prefill_wait(prefill_waits(plan), list(behind))
    return {"forwards": len(plan), "all_reduces": 2 * check_int("n_layers", n_layers, 1) * len(plan),
            "largest": max(sum(c[-1] for c in fwd) for fwd in plan), "cache_rows_held": held["in_place"],
            "held_by": held["held_by"], "held_after": held["held_after"], "wait_forwards": f, "wait_tokens": t}


def fewest_forwards_budget(seq_lens: Sequence[int], behind: Sequence[int], max_budget: int, max_cache_rows: int,
                           step: int, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> int:
    """Among the multiples of ``step`` up to ``max_budget`` whose chunked plan (``plan_batches``) holds at most
    ``max_cache_rows`` cache rows between forwards, the budget of fewest forwards; ties: the least mean wait in
    tokens of the requests ``behind``, then the smaller budget. ValueError if no budget keeps the limit."""
    step, top = check_int("step", step, 1), check_int("max_budget", max_budget, 1)
    prices = {b: plan_prices(plan_batches(list(seq_lens), b, max_num_seqs, enable_chunked_prefill=True), seq_lens,
                             behind, 1) for b in range(step, top + 1, step)}
    fits = [b for b, p in prices.items() if p["cache_rows_held"] <= max_cache_rows]
    if not fits:
        raise ValueError(f"no budget up to {max_budget} keeps the cache within {max_cache_rows} rows")
    return min(fits, key=lambda b: (prices[b]["forwards"], round(prices[b]["wait_tokens"], 6), b))
