"""What one tensor-parallel rank does in a forward, recorded: the instrumentation of TP.

``traced_forward(model, batch)`` runs ``model.Transformer`` once on a rank and reports:

- every collective (``CollectiveRecord``s the ``DistGroup`` appended): 2 per layer, attention
  out proj and FFN-down, each ``[T, d_model]``: 16 of ``[T, 512]`` for the article (C1, C12);
- QKV output shape per layer, from a forward hook (``[T, 768]`` per rank under TP=2, C6);
- collectives issued inside attention: the trace length when QKV returns equals the trace
  length when out proj starts (C11);
- optionally (``comm_debug=True``) PyTorch's own count from
  ``torch.distributed.tensor.debug.CommDebugMode``, which must equal the trace length (so no
  collective bypasses the trace). On torch 2.13 + gloo CommDebugMode DOES count a plain
  ``dist.all_reduce`` (as ``c10d.allreduce_``); importing it costs ≈ 1-2 s, hence opt-in.

``Fault`` injects a failure mid-forward (tests/test_tp_faults.py). ``forward_worker`` and
``shard_checks`` are ready-made workers for ``workers.launch``.

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import torch

from ..core.batch import PackedBatch, pack
from ..core.config import ModelConfig
from ..core.groups import CollectiveRecord
from ..core.kernels import synchronize
from ..core.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..core.model import Transformer, init_weights
from ..validate import check_int

Tensor = torch.Tensor


@dataclass(slots=True)
class Fault:
    """An injected worker fault (for the fault tests and the lesson's "what if a rank dies").

    kind: "raise" (RuntimeError), "sigkill" (the process kills itself) or "hang" (sleeps
    forever); it fires on ``rank`` just before layer ``layer``'s attention out proj, i.e. in the
    middle of a forward, after ``2·layer`` all-reduces.
    """

    kind: str
    rank: int = 1
    layer: int = 0

    def __post_init__(self):
        if self.kind not in ("raise", "sigkill", "hang"):
            raise ValueError(f"Fault.kind must be 'raise', 'sigkill' or 'hang', got {self.kind!r}")
        for name in ("rank", "layer"):
            setattr(self, name, check_int(f"Fault.{name}", getattr(self, name), 0))

    def fire(self, rank: int) -> None:
        if rank != self.rank:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault on rank {rank} before layer {self.layer}'s out proj")
        if self.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # "hang": never returns; the caller's deadline must catch it
            time.sleep(3600)


@dataclass(slots=True)
class ForwardReport:
    """What one rank saw during one forward.

    records: the all-reduces of this forward (``CollectiveRecord``), in call order.
    qkv_shapes: QKV output shape per layer, e.g. ``(T, 768)`` under TP=2.
    attn_collectives: per layer, collectives issued between QKV output and out proj input.
    comm_debug_count: c10d collectives counted by ``CommDebugMode`` over the whole forward
    (None unless ``comm_debug=True``).
    forward_s: wall seconds of the forward on this rank.
    """

    records: list
    qkv_shapes: list
    attn_collectives: list
    comm_debug_count: int | None
    forward_s: float


def comm_debug_mode():
    """A fresh ``torch.distributed.tensor.debug.CommDebugMode`` (imported on first use)."""
    from torch.distributed.tensor.debug import CommDebugMode  # heavy import (≈ 1-2 s): only when asked
    return CommDebugMode()


def traced_forward(model: Transformer, batch: PackedBatch, *, fault: Fault | None = None,
                   comm_debug: bool = False, kv_cache=None) -> tuple[Tensor, ForwardReport]:
    """Run ``model(batch)`` once with the instrumentation of the module docstring.

    ``batch`` on the model's device. Returns ``(hidden [T, d_model] on that device, ForwardReport)``;
    ``forward_s`` includes the device's kernels (synchronized). Works on TP=1 too (no records).
    comm_debug: also count c10d collectives with PyTorch's CommDebugMode. kv_cache: a chunked
    forward's ``KVCacheStep`` (``Transformer.forward``'s ``kv_cache``).
    """
    group = model.group
    start = len(group.trace)
    qkv_shapes: list[tuple] = []
    attn_collectives: list[int] = []
    mark = [0]

    def after_qkv(_mod, _inp, out):
        qkv_shapes.append(tuple(out.shape))
        mark[0] = len(group.trace)

    def make_before_out_proj(layer: int):
        def before_out_proj(_mod, _inp):
            attn_collectives.append(len(group.trace) - mark[0])  # attention ran in between
            if fault is not None and fault.layer == layer:
                fault.fire(group.rank)
        return before_out_proj

    handles = []
    for i, block in enumerate(model.layers):
        handles.append(block.attn.qkv.register_forward_hook(after_qkv))
        handles.append(block.attn.out_proj.register_forward_pre_hook(make_before_out_proj(i)))
    try:
        comm = comm_debug_mode() if comm_debug else contextlib.nullcontext()
        with comm:
            synchronize(model.device)  # the batch's copy to the device is not the forward's time
            t0 = time.perf_counter()
            out = model(batch, kv_cache=kv_cache)  # [T, d_model]
            synchronize(out.device)
            forward_s = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    return out, ForwardReport(list(group.trace[start:]), qkv_shapes, attn_collectives,
                              comm.get_total_counts() if comm_debug else None, forward_s)


def format_trace(records: list[CollectiveRecord]) -> str:
    """One line per collective: ``rank r  #k  all_reduce  [T, 512] float32  N B  layer``."""
    return "\n".join(f"rank {r.rank}  #{i:2d}  {r.op}  {list(r.shape)}  {r.dtype}  {r.bytes:,} B  {r.layer}"
                     for i, r in enumerate(records))


def summarize_trace(records: list[CollectiveRecord]) -> str:
    """``16 × all_reduce [40, 512] float32, 81,920 B each`` (groups equal records)."""
    groups: dict[tuple, int] = {}
    for r in records:
        key = (r.op, r.shape, r.dtype, r.bytes)
        groups[key] = groups.get(key, 0) + 1
    return "; ".join(f"{n} × {op} {list(shape)} {dtype}, {b:,} B each" for (op, shape, dtype, b), n in groups.items()) \
        or "no collectives"



# ----------------------------------------------------------------------------------------------
# Ready-made workers for workers.launch

def forward_worker(group, cfg: ModelConfig, batch: PackedBatch, *, seed: int = 0, fault: Fault | None = None,
                   comm_debug: bool = False):
    """A ``launch`` worker: build this rank's shard of ``init_weights(cfg, seed)`` and run one
    traced forward. Returns ``(hidden [T, d_model], ForwardReport)``.

    ``launch(forward_worker, 2, args=(cfg, batch))`` is ``tp_forward`` spelled out.
    """
    model = Transformer(cfg, init_weights(cfg, seed), group=group).to(group.device)
    out, report = traced_forward(model, batch.to(group.device), fault=fault, comm_debug=comm_debug)
    return out.cpu(), report


def shard_checks(group, cfg: ModelConfig, seed: int = 0, seq_lens: tuple = (10, 30)) -> dict:
    """A ``launch`` worker: the layers of ``linear.py`` on a real group, checked by the caller.

    Returns this rank's row-parallel output (bias added after the all-reduce, as it should be),
    the buggy variant (bias added before the all-reduce, i.e. tp times), the column-parallel
    and QKV shards, layer 0's attention output on this rank's heads, and what CommDebugMode
    counted for one plain all-reduce. Every tensor lives on ``group.device`` (NCCL takes CUDA
    tensors only); the results come back on the CPU.
    """
    g, dev = torch.Generator().manual_seed(seed), group.device

    def randn(*shape, scale=1.0):  # the same values on every rank (one seed), on this rank's device
        return (torch.randn(*shape, generator=g) * scale).to(dev)

    d, k, kv, f = cfg.d_model, cfg.qkv_dim, cfg.kv_dim, cfg.d_ffn
    x = randn(sum(seq_lens), d)                                 # [T, d], the same on every rank
    w_row, b_row = randn(d, f, scale=0.02), randn(d)
    row = RowParallelLinear(f, d, group=group, name="check.row").to(dev).load_full_(w_row, b_row)
    h = randn(x.shape[0], f)                                    # [T, f] full input of the row layer
    n = f // group.world_size
    h_local = h[:, group.rank * n:(group.rank + 1) * n]         # [T, f/tp]: what this rank holds
    y_row = row(h_local)                                        # [T, d]
    partial_plus_bias = torch.nn.functional.linear(h_local, row.weight, row.bias)  # the bug: bias on every rank
    y_row_bug = group.all_reduce(partial_plus_bias, layer="check.row_bias_before_reduce")
    w_col, b_col = randn(f, d, scale=0.02), randn(f)
    y_col = ColumnParallelLinear(d, f, group=group).to(dev).load_full_(w_col, b_col)(x)  # [T, f/tp]
    w_qkv, b_qkv = randn(k + 2 * kv, d, scale=0.02), randn(k + 2 * kv)  # rows [Q | K | V]
    qkv = QKVParallelLinear(d, cfg.n_heads, cfg.d_head, cfg.n_kv_heads, group=group).to(dev).load_full_(w_qkv, b_qkv)
    y_qkv = qkv(x)                                              # [T, (H_local + 2·H_kv_local)·D]

    model = Transformer(cfg, init_weights(cfg, seed), group=group, device=dev)
    captured = {}
    handle = model.layers[0].attn.out_proj.register_forward_pre_hook(lambda _m, inp: captured.setdefault("o", inp[0].clone()))
    trace_before = len(group.trace)
    batch = pack([torch.arange(n_tok) % cfg.vocab_size for n_tok in seq_lens], device=dev)
    with comm_debug_mode() as comm_model:
        model(batch)
    handle.remove()
    model_records = len(group.trace) - trace_before
    with comm_debug_mode() as comm_one:
        group.all_reduce(torch.ones(3, 512, device=dev), layer="check.commdebugmode")
    cpu = {name: t.cpu() for name, t in (("y_row", y_row), ("y_row_bug", y_row_bug), ("y_col", y_col),
                                          ("y_qkv", y_qkv), ("attn_out_layer0", captured["o"]))}
    return cpu | {"model_records": model_records,
            "model_comm_debug": comm_model.get_total_counts(),
            "comm_debug_one": comm_one.get_total_counts(),
            "comm_debug_ops": sorted(str(op) for op in comm_one.get_comm_counts())}



def forward_checks(group, configs: list, seed: int = 0, seq_lens: tuple = (10, 30)) -> list[tuple]:
    """A ``launch`` worker: for each config in turn, this rank's shard of ``Transformer(cfg, init_weights(cfg,
    seed))`` runs one traced forward of requests ``arange(n) % vocab_size`` for ``n`` in ``seq_lens``.

    Returns per config ``(hidden [T, d_model], ForwardReport, layer 0's qkv weight [out/rank, d_model])``,
    tensors on the CPU: one launch checks several configs (e.g. grouped-query attention's K/V head counts).
    """
    out = []
    for cfg in configs:
        model = Transformer(cfg, init_weights(cfg, seed), group=group, device=group.device)
        batch = pack([torch.arange(n) % cfg.vocab_size for n in seq_lens], device=group.device)
        hidden, report = traced_forward(model, batch)
        out.append((hidden.cpu(), report, model.layers[0].attn.qkv.weight.cpu()))
    return out
