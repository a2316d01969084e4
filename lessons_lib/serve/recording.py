"""What the engine EXECUTED for given batches, read off ``measure.recorder.OpRecorder`` (not predicted).

``record_batches`` serves each batch as exactly one forward of ``Engine(method=...)`` under the recorder and returns
one ``BatchRecord`` per batch: the rows of every linear-layer matmul and the attention score cells per head per
layer, to be held against ``serve.engine.batch_stats``' prediction for the same lengths. ``record_scale`` says how
far to shrink a batch too big to run here (every length divided by ``k``, rounded up: the same mix and layout), and
``recorded_totals`` sums a whole plan's records per method beside the prediction, batch by batch. ``record_scaled``
records one batch under every method, shrunk alike when too big; ``record_served`` serves a stream with any
``Scheduler`` and reads the rows the linear layers saw.

Taught in notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..core.config import ModelConfig
from ..measure.flops import METHODS
from ..measure.recorder import OpRecorder
from ..measure.search import first_where
from .engine import Engine, batch_stats
from .scheduler import Request, Scheduler
from .workloads import make_requests


@dataclass(frozen=True)
class BatchRecord:
    """What one forward of ``Engine(method=...)`` EXECUTED, read by ``OpRecorder`` (not predicted).

    linear_rows: the rows ``m`` of every linear-layer matmul (4 per block); cells: score cells computed per
    head per layer (every score matrix the softmax or a fused kernel saw, over ``n_heads · n_layers``);
    score_shapes: those score matrices' shapes, in order; wall_s: the forward's wall-clock, recorder included."""

    method: str
    request_ids: tuple
    linear_rows: tuple
    cells: float
    score_shapes: tuple
    wall_s: float = 0.0

    @property
    def rows(self) -> int:
        """Rows through the linear layers; ValueError if the linear layers did not all see the same rows."""
        if len(set(self.linear_rows)) != 1:
            raise ValueError(f"the linear layers saw different row counts {sorted(set(self.linear_rows))}")
        return self.linear_rows[0]


def record_batches(cfg: ModelConfig, weights: dict, method: str, batches: Sequence[Sequence[Request]],
                   max_num_batched_tokens: int, device="cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[list, list[BatchRecord]]:
    """Serve each batch of ``batches`` (lists of ``Request``) as ONE forward of ``Engine(method=method)`` under
    an ``OpRecorder``: ``(outputs of every request, [BatchRecord per batch])``. Raises ValueError when a batch
    does not run as one forward (it does not fit the budgets)."""
    engine = Engine(cfg, weights=weights, method=method, device=device, dtype=dtype, compute_logits=False,
                    max_num_batched_tokens=max_num_batched_tokens)
    outputs, records = [], []
    per = cfg.n_heads * cfg.n_layers
    for b, reqs in enumerate(batches):
        with OpRecorder() as rec:
            outputs += engine.prefill([Request(r.request_id, r.prompt_token_ids, r.return_hidden) for r in reqs])
        if len(engine.stats) != 1:
            raise ValueError(f"batch {b} ran as {len(engine.stats)} forwards, not one: it does not fit the budgets")
        cells = rec.cells
        records.append(BatchRecord(method, tuple(r.request_id for r in reqs),
                                   tuple(m.m for m in rec.matmuls if m.kind == "linear"),
                                   cells // per if cells % per == 0 else cells / per, tuple(rec.scores),
                                   engine.stats[0].wall_s))
    return outputs, records


def record_scale(cfg: ModelConfig, lens: Sequence[int], method: str, limit: int) -> int:
    """The smallest integer ``k >= 1`` such that the batch ``[ceil(L / k) for L in lens]`` computes at most ``limit``
    score cells per head per layer under ``method`` on ``cfg`` (``batch_stats``): 1 when ``lens`` fits, ``max(lens)``
    when no ``k`` does."""
    def fits(k):
        return batch_stats(cfg, [-(-n // k) for n in lens], method).cells_whole_computed <= limit
    return first_where(fits, 1, max(lens)) or max(lens)


def recorded_totals(cfg: ModelConfig, seq_lens: Sequence[int], batches: Sequence[Sequence[int]],
                    recorded: Mapping[str, Sequence]) -> dict:
    """Per method, a plan's rows and score cells per head per layer as RECORDED, beside ``batch_stats``' prediction.

    ``batches``: request ids into ``seq_lens``; ``recorded[method]``: one ``(BatchRecord, k)`` per batch, the batch
    run with every length divided by ``k``, rounded up (1: as planned). Returns ``{method: {"rows", "cells",
    "useful_rows", "useful_cells", "checked", "scaled", "differs"}}``: a batch recorded as a scaled copy (``k > 1``,
    counted in ``scaled``) counts the prediction for its full lengths; ``checked``: batches whose record equals
    the prediction for the lengths they ran; ``differs``: the indices of the others."""
    out = {}
    for m in METHODS:
        c = {"rows": 0, "cells": 0, "useful_rows": 0, "useful_cells": 0, "checked": 0, "scaled": 0, "differs": []}
        for b, (ids, (rec, k)) in enumerate(zip(batches, recorded[m])):
            lens = [seq_lens[i] for i in ids]
            ran, full = batch_stats(cfg, [-(-n // k) for n in lens], m), batch_stats(cfg, lens, m)
            if (rec.rows, rec.cells) == (ran.executed_rows, ran.cells_whole_computed):
                c["checked"] += 1
            else:
                c["differs"].append(b)
            c["rows"] += rec.rows if k == 1 else full.executed_rows
            c["cells"] += rec.cells if k == 1 else full.cells_whole_computed
            c["useful_rows"] += full.num_tokens
            c["useful_cells"] += full.cells_whole_useful
            c["scaled"] += k > 1
        out[m] = c
    return out


def record_scaled(cfg: ModelConfig, weights: dict, lens: Sequence[int], max_num_batched_tokens: int, limit: int,
                  prompt_seed: int = 0) -> dict:
    """The batch of lengths ``lens`` run as ONE forward per method (``record_batches``, prompts by ``make_requests``
    with ``prompt_seed``): ``{method: (BatchRecord, k)}``, ``k`` the largest ``record_scale`` over the methods, the
    same for all: a batch over ``limit`` cells per head per layer under some method runs as one copy with every
    length divided by ``k``, rounded up (the same mix, the same layout)."""
    k = max(record_scale(cfg, lens, m, limit) for m in METHODS)
    scaled = [-(-n // k) for n in lens]
    reqs = [Request(i, p) for i, p in enumerate(make_requests(scaled, cfg.vocab_size, seed=prompt_seed))]
    budget = max(max_num_batched_tokens, sum(scaled))
    return {m: (record_batches(cfg, weights, m, [reqs], budget)[1][0], k) for m in METHODS}


def record_served(cfg: ModelConfig, weights: dict, scheduler: Scheduler, seq_lens: Sequence[int],
                  method: str = "padded", prompt_seed: int = 0) -> dict:
    """Requests of ``seq_lens`` (prompts by ``make_requests`` with ``prompt_seed``) served by ``Engine(cfg,
    method=method, scheduler=scheduler)`` on CPU in float32 under ``OpRecorder``: ``{"served": request ids, sorted,
    "batches": request ids per forward, "rows": rows through the linear layers, summed over the forwards}``."""
    engine = Engine(cfg, weights=weights, method=method, device="cpu", dtype=torch.float32, compute_logits=False,
                    scheduler=scheduler)
    with OpRecorder() as rec:
        outputs = engine.prefill(make_requests(list(seq_lens), cfg.vocab_size, seed=prompt_seed))
    rows = sum(m.m for m in rec.matmuls if m.kind == "linear") // (4 * cfg.n_layers)
    return {"served": sorted(o.request_id for o in outputs), "batches": [list(s.request_ids) for s in engine.stats],
            "rows": rows}
