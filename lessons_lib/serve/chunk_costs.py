"""What a chunked prefill schedule costs, from its forwards alone (no model run).

  chunk_mask              the keys one chunk's queries may read (bottom-right causal over every key so far)
  chunk_spans             a prompt's chunk lengths as ``(start, length)``
  staircase_cells         score cells of one prompt run in chunks: computed, allowed by the masks, masked
  causal_cells_from_masks causal cells the chunks' masks keep, over forwards of chunks
  planned_forwards        the scheduler's plan for bare lengths, each forward as ``(request, tokens)``
  forward_score_cells     each forward's score cells per head per layer, whole blocks
  plan_prices             a schedule's forwards, all-reduces, largest forward, cache rows held and waits
  fewest_forwards_budget  the token budget with the fewest forwards within a cache limit (a search over plans)
  draft_finish            where one long request finishes in a schedule, and how many of those behind it pass it

A schedule is a list of forwards, each a list of chunks ``(request, start, length)`` (a chunked ``plan_batches``
plan, or ``BatchStats.chunks``); ``forward_score_cells`` also takes ``(request, length)`` pairs.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import Tensor

from ..core.attention import block_diag_mask
from ..validate import check_int
from .kv_cache import cache_rows_held
from .scheduler import DEFAULT_MAX_NUM_SEQS, mean_prefill_wait, plan_batches, prefill_waits


def chunk_mask(start: int, length: int) -> Tensor:
    """``[length, start + length]`` bool: the keys the queries of tokens ``start .. start+length-1`` may read,
    ``block_diag_mask([0, length], causal=True, cu_seqlens_k=[0, start + length])`` (bottom-right)."""
    start, length = check_int("start", start, 0), check_int("length", length, 1)
    return block_diag_mask([0, length], causal=True, cu_seqlens_k=[0, start + length])


def chunk_spans(chunks: Sequence[int]) -> list[tuple[int, int]]:
    """Chunk lengths of one prompt → ``[(start, length), ...]``: chunk c starts where chunk c-1 ended."""
    spans, start = [], 0
    for c, n in enumerate(chunks):
        spans.append((start, check_int(f"chunks[{c}]", n, 1)))
        start += n
    return spans


def staircase_cells(chunks: Sequence[int]) -> dict:
    """Score cells per head per layer of one prompt run in ``chunks``, from the chunks' masks: ``computed``
    (whole rectangles), ``allowed`` (what the masks keep) and ``masked`` (computed, then masked)."""
    masks = [chunk_mask(s, n) for s, n in chunk_spans(chunks)]
    computed, allowed = sum(m.numel() for m in masks), sum(int(m.sum()) for m in masks)
    return {"computed": computed, "allowed": allowed, "masked": computed - allowed}


def causal_cells_from_masks(forwards: Sequence) -> int:
    """Causal cells per head per layer that the chunks' masks keep (``chunk_mask``, whatever fault is on), for
    forwards given as their chunks ``(request, start, length)`` (a ``BatchStats``' ``chunks``, or the stats)."""
    return sum(int(chunk_mask(s, n).sum()) for fwd in forwards for _, s, n in getattr(fwd, "chunks", fwd))


def planned_forwards(seq_lens: Sequence[int], max_num_batched_tokens: int, chunked: bool,
                     max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> list[list[tuple]]:
    """``plan_batches`` for bare lengths, chunked prefill on or off, each forward as ``(request, tokens)`` pairs
    (a whole prompt's tokens are its length)."""
    plan = plan_batches(list(seq_lens), max_num_batched_tokens, max_num_seqs, enable_chunked_prefill=chunked)
    return [[(i, n) for i, _, n in fwd] if chunked else [(i, seq_lens[i]) for i in fwd] for fwd in plan]


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


def draft_finish(forwards: Sequence[Sequence[tuple]], draft: int, behind: Sequence[int]) -> dict:
    """``prefill_waits`` of a schedule (chunks ``(request, tokens)`` or ``(request, start, tokens)``) read for one
    long request ``draft``: ``{"draft": the forward its last chunk runs in, "before": how many requests of ``behind``
    finish in an earlier forward, "forwards": the forward the last request finishes in}``, forwards counted from 1."""
    waits = prefill_waits(forwards)
    return {"draft": waits[draft][0], "forwards": max(w[0] for w in waits.values()),
            "before": sum(waits[i][0] < waits[draft][0] for i in behind)}
