"""One prefill run of prompts on the CPU, and what its ``BatchStats`` add up to.

  serve_prompts      prompts through ``Engine`` (chunked or whole), optionally under the op recorder
  forward_tokens     each forward as ``(request, tokens)`` pairs
  run_summary        a run's forwards, waits, cells, cache rows, chunks and times, summed from its ``BatchStats``
  stacked_outputs    one field of every request's ``RequestOutput``, stacked in request order
  same_argmax        do two runs pick the same next token for every request?
  score_blocks       ``(L_q, L_k)`` of every score matrix a recorded run's attention computed
  payloads_match     is every all-reduce of a TP run ``[tokens in that forward, d_model]``?
  other_collectives  a forward's collectives that are not the blocks' two all-reduces
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.config import ModelConfig
from ..core.model import init_weights
from ..measure.recorder import OpRecorder
from .engine import Engine
from .scheduler import DEFAULT_MAX_NUM_SEQS, Request, Scheduler, mean_prefill_wait, prefill_waits


def serve_prompts(prompts: Sequence[Sequence[int]], max_num_batched_tokens: int, chunked: bool,
                  cfg: ModelConfig | None = None, weights: dict | None = None, *, tp_size: int = 1,
                  dtype: torch.dtype = torch.float32, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                  compute_logits: bool = True, requests: Sequence[int] | None = None, record: bool = False,
                  return_hidden: bool = False, scheduler: Scheduler | None = None,
                  engine_class: type[Engine] = Engine) -> dict:
    """Serve ``prompts`` (request i = ``prompts[i]``; only ``requests`` if given) on the CPU with ``engine_class``
    (running ``scheduler`` if given; weights default to ``init_weights(cfg, 0)``), chunked prefill on or off.
    Returns ``{"outputs": {request: RequestOutput}, "stats": [BatchStats] one per forward, "kv_cache_peak_bytes",
    "traces": [rank 0's CollectiveRecords per forward] (TP>1), "recorder": the ``OpRecorder`` of the whole run
    (``record=True``, else None)}``."""
    cfg = cfg or ModelConfig()
    ids = list(range(len(prompts))) if requests is None else list(requests)
    with engine_class(cfg, tp_size=tp_size, weights=weights if weights is not None else init_weights(cfg, 0),
                      device="cpu", dtype=dtype, compute_logits=compute_logits, scheduler=scheduler,
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      enable_chunked_prefill=chunked, record_forwards=tp_size > 1) as engine:
        reqs = [Request(i, list(prompts[i]), return_hidden=return_hidden) for i in ids]
        with OpRecorder() if record else contextlib.nullcontext() as rec:
            outputs = engine.prefill(reqs)
        return {"outputs": {o.request_id: o for o in outputs}, "stats": list(engine.stats), "recorder": rec,
                "kv_cache_peak_bytes": engine.kv_cache_peak_bytes,
                "traces": [list(s.tp_result.traces[0]) for s in engine.stats] if tp_size > 1 else []}


def forward_tokens(forwards: Sequence) -> list[list[tuple]]:
    """Each forward as ``(request, tokens)`` pairs, from ``BatchStats`` (their ``chunks``) or from lists of chunks
    ``(request, start, length)``."""
    return [[(c[0], c[-1]) for c in getattr(fwd, "chunks", fwd)] for fwd in forwards]


def payloads_match(run: dict, d_model: int) -> bool:
    """Is every all-reduce of every forward of a ``serve_prompts`` TP run ``[tokens in that forward, d_model]``
    (one trace per forward)?"""
    return len(run["traces"]) == len(run["stats"]) and all(
        tuple(r.shape) == (s.num_tokens, d_model) for s, trace in zip(run["stats"], run["traces"])
        for r in trace if r.op == "all_reduce")


def other_collectives(trace: Sequence) -> int:
    """Collectives of one forward's trace (``CollectiveRecord``s) that are not a block's all-reduces, after its
    ``attn.out_proj`` and ``mlp.fc_down`` (a KV cache sent between ranks would show up here)."""
    return sum(r.op != "all_reduce" or ".attn.out_proj" not in r.layer and ".mlp.fc_down" not in r.layer
               for r in trace)


def run_summary(run: dict, behind: Sequence[int]) -> dict:
    """A ``serve_prompts`` run from its ``BatchStats``: ``timeline`` (each forward's ``(request, tokens)``),
    ``waits`` (``prefill_waits``), ``mean_behind`` (the mean wait of the requests ``behind``, forwards and tokens;
    ``(0.0, 0.0)`` if none), ``max_forward`` (tokens), ``cells_whole`` / ``cells_causal`` (score cells per head per
    layer), ``cached_tokens`` (cache rows read), ``chunks`` (``{request: chunks}`` of the requests cut into more than
    one chunk), ``kv_cache_peak_bytes`` and ``forward_ms`` (measured)."""
    stats = run["stats"]
    steps = forward_tokens(stats)
    waits = prefill_waits(steps)
    counts = Counter(i for fwd in steps for i, _ in fwd)
    return {"timeline": steps, "waits": waits,
            "mean_behind": mean_prefill_wait(waits, list(behind)) if behind else (0.0, 0.0),
            "max_forward": max(s.num_tokens for s in stats),
            "cells_whole": sum(s.cells_whole_computed for s in stats),
            "cells_causal": sum(s.cells_causal_useful for s in stats),
            "cached_tokens": sum(s.num_cached_tokens for s in stats),
            "chunks": {i: counts[i] for i in sorted(counts) if counts[i] > 1},
            "kv_cache_peak_bytes": run["kv_cache_peak_bytes"], "forward_ms": [1e3 * s.wall_s for s in stats]}


def stacked_outputs(run: dict, what: str, requests: Sequence[int] | None = None) -> Tensor:
    """``[R, ...]``: each request's ``RequestOutput.<what>`` (``last_hidden``, ``logits``, ...) of a ``serve_prompts``
    run, in request order (``requests`` if given, else every request the run served, sorted)."""
    outs = run["outputs"]
    return torch.stack([getattr(outs[i], what) for i in (sorted(outs) if requests is None else requests)])


def same_argmax(a: dict, b: dict) -> bool:
    """Do two ``serve_prompts`` runs (with logits) pick the same next token, the argmax of the logits, for every
    request?"""
    return bool((stacked_outputs(a, "logits").argmax(-1) == stacked_outputs(b, "logits").argmax(-1)).all())


def score_blocks(run: dict) -> list[tuple[int, int]]:
    """``(L_q, L_k)`` of every score matrix the op recorder of a ``serve_prompts(..., record=True)`` run saw
    attention compute, in order, every layer of every forward."""
    return [tuple(shape[-2:]) for shape in run["recorder"].scores]
