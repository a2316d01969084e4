"""Measurements on this machine: wall time, peak allocated bytes, and a forward's time split.

Everything here MEASURES, so its numbers vary from run to run and machine to machine.
Lessons show them (cells tagged ``nbval-ignore-output``) next to the exact analytic counts
of ``flops``; tests never assert a timing.

- ``time_call`` / ``peak_bytes``: fastest-of-N wall time; bytes allocated at the peak of one
  call (``torch.profiler`` memory events on the CPU, ``torch.cuda`` statistics on a GPU).
- ``interleaved_best``: the fastest time of several calls timed in turn; ``cpu_threads``: a block on n threads.
- ``measure_attention``: one varlen backend on random q, k, v (claim C9's masked vs varlen); ``sweep_attention``:
  several backends as the number of requests grows, timed in turn; ``record_attention``: one call as ``OpRecorder``
  sees it (cells, score matrices, the largest softmax input); ``recorded_cells``: the score cells it sees each
  backend compute for one batch; ``attention_calls``: which of the engine's attention
  functions a call entered.
- ``forward_time_split``: a model forward split into linear layers, attention and the rest,
  on the model's device (claim C14's measured counterpart).
- ``matmul_throughput``: GFLOP/s of one linear layer against the token count (claim C13).
- ``linear_layers_sampler``: the benchmark's GEMM peak, a model's own linear layers on a workload's batches.
- ``top_ops``: the operators a call spends its CPU time in (``torch.profiler`` self CPU shares).

Taught in notebooks/03_masked_vs_varlen_attention.ipynb and notebooks/05_flop_regimes.ipynb.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.attention import varlen_attention
from ..core.batch import PackedBatch, seq_lens_to_cu_seqlens
from ..core.kernels import synchronize
from ..core.linear import ColumnParallelLinear
from ..validate import check_int, check_lengths

Tensor = torch.Tensor


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, device="cpu") -> float:
    """Fastest of ``repeats`` calls, in seconds (the fastest is the least disturbed by a shared machine)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """Run the block on ``n`` CPU threads (``torch.set_num_threads``; None: leave PyTorch's setting), the count
    restored after: on a shared machine a multi-threaded op waits for its slowest thread, often descheduled."""
    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(check_int("cpu_threads", n, 1))
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def interleaved_best(calls: Mapping[Hashable, Callable[[], object]], rounds: int = 5,
                     device="cpu") -> dict[Hashable, float]:
    """Fastest seconds of each of ``calls`` (key -> a call with no arguments): a warm-up round, then ``rounds``
    rounds that call every one once, in order, synchronizing ``device`` after each. Interleaved, a burst of load
    on a shared machine slows one call of each, not a whole series of one."""
    n = check_int("rounds", rounds, 1)
    best = dict.fromkeys(calls, float("inf"))
    for round_ in range(n + 1):
        for key, call in calls.items():
            t0 = time.perf_counter()
            call()
            synchronize(device)
            if round_:  # round 0 warms up
                best[key] = min(best[key], time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def _quiet_native_stderr():
    """The CPU profiler logs its start and stop on file descriptor 2 from C++; those lines would
    land in a notebook cell's output, so they go to /dev/null for the profiler's lifetime."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (embedded interpreters): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _profile(fn: Callable[[], object], memory: bool, device="cpu"):
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _quiet_native_stderr():
        with profile(activities=activities, profile_memory=memory) as prof:
            fn()
            synchronize(device)
    return prof


def peak_bytes(fn: Callable[[], object], device="cpu") -> int:
    """Bytes allocated at the peak of one call of ``fn``, above what was live before it.

    CPU: the profiler's allocation (op self memory) and free (``[memory]``) events, summed in
    time order. CUDA: ``torch.cuda.max_memory_allocated``. Kernel-internal scratch that never
    goes through PyTorch's allocator is not seen.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    prof = _profile(fn, memory=True)
    deltas = []
    for e in prof.profiler.function_events:
        if e.name == "[memory]":
            deltas.append((e.time_range.start, 1, e.cpu_memory_usage))  # a free (negative)
        elif e.self_cpu_memory_usage > 0:
            deltas.append((e.time_range.start, 0, e.self_cpu_memory_usage))
    live = peak = 0
    for _, _, nbytes in sorted(deltas):
        live += nbytes
        peak = max(peak, live)
    return int(peak)


@dataclass(frozen=True, slots=True)
class AttentionRun:
    """One measured attention call: ``seconds`` (fastest of N) and ``peak_bytes`` (one call)."""

    backend: str
    seq_lens: tuple
    seconds: float
    peak_bytes: int


def random_qkv(seq_lens: Sequence[int], n_heads: int = 8, d_head: int = 64, *, seq_lens_k: Sequence[int] | None = None,
               seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32, fused: bool = False) -> tuple:
    """Random ``q, k, v [T, H, D]`` and int32 ``cu_seqlens [R+1]`` for a batch of requests (lengths may be 0).

    Drawn in float32 from ``seed`` (q, then k, then v), then cast to ``dtype`` on ``device``.
    ``seq_lens_k``: other key/value lengths (``k, v [T_k, H, D]``); then five values come back,
    ``q, k, v, cu_seqlens_q, cu_seqlens_k``. ``fused``: q, k and v are views of one ``[T, 3, H, D]``
    tensor, as the model's QKV projection hands them to attention (not contiguous).
    """
    lens = check_lengths(seq_lens, 0)
    lens_k = lens if seq_lens_k is None else check_lengths(seq_lens_k, 0, "seq_lens_k")
    g = torch.Generator().manual_seed(seed)
    if fused:
        if seq_lens_k is not None:
            raise ValueError("fused q, k, v share their rows: seq_lens_k must be None")
        q, k, v = torch.randn(sum(lens), 3, n_heads, d_head, generator=g).to(device=device, dtype=dtype).unbind(1)
    else:
        q = torch.randn(sum(lens), n_heads, d_head, generator=g)
        k, v = (torch.randn(sum(lens_k), n_heads, d_head, generator=g) for _ in range(2))
        q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    cu = seq_lens_to_cu_seqlens(lens, device=device)
    return (q, k, v, cu) if seq_lens_k is None else (q, k, v, cu, seq_lens_to_cu_seqlens(lens_k, device=device))


def measure_attention(seq_lens: Sequence[int], backend: str, n_heads: int = 8, d_head: int = 64, *,
                      causal: bool = False, repeats: int = 3, device="cpu", dtype: torch.dtype = torch.float32,
                      seed: int = 0) -> AttentionRun:
    """Time and peak memory of ``varlen_attention(..., backend=backend)`` on random inputs."""
    q, k, v, cu = random_qkv(seq_lens, n_heads, d_head, seed=seed, device=device, dtype=dtype)

    def call():
        return varlen_attention(q, k, v, cu, causal=causal, backend=backend)

    seconds = time_call(call, repeats=repeats, device=device)
    return AttentionRun(backend, tuple(int(n) for n in seq_lens), seconds, peak_bytes(call, device))


# Top-level operator names the profiler reports for each part of a forward.
_LINEAR_OPS = ("aten::linear",)
_ATTENTION_OPS = ("aten::scaled_dot_product_attention", "torch_attn::_varlen_attn",
                  "flash_attn::_flash_attn_varlen_forward")


def sweep_attention(rs: Sequence[int], backends: Sequence[str], length: int = 64, n_heads: int = 8, d_head: int = 64,
                    rounds: int = 5, device="cpu", dtype: torch.dtype = torch.float32, threads: int | None = 1) -> dict:
    """``{backend: {"ms": [...], "mib": [...]}}`` in the order of ``rs``: one attention call (not causal) on R requests
    of ``length`` tokens, its fastest time (``interleaved_best`` over every (R, backend) pair) and its peak memory;
    on a CPU on ``threads`` threads."""
    calls = {}
    for r in rs:
        q, k, v, cu = random_qkv([length] * r, n_heads, d_head, seed=r, device=device, dtype=dtype)
        calls |= {(r, b): functools.partial(varlen_attention, q, k, v, cu, causal=False, backend=b) for b in backends}
    with cpu_threads(threads if torch.device(device).type == "cpu" else None):
        best = interleaved_best(calls, rounds, device)
        return {b: {"ms": [best[r, b] * 1e3 for r in rs], "mib": [peak_bytes(calls[r, b], device) / 2**20 for r in rs]}
                for b in backends}


@dataclass(frozen=True, slots=True)
class RecordedAttention:
    """One attention call as ``OpRecorder`` saw it: ``out`` (q's shape and dtype), ``cells`` (score cells of ONE head:
    the recorder's cells over q's head count; a fused backend's are the cells it is handed), ``scores`` (score
    matrices made, ``len(OpRecorder.scores)``), ``largest_bytes`` (bytes of the largest tensor handed to a softmax,
    in q's dtype; None when no softmax ran outside a kernel: a fused backend)."""

    out: Tensor
    cells: int
    scores: int
    largest_bytes: int | None


def record_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, backend: str,
                     causal: bool = False) -> RecordedAttention:
    """``varlen_attention(q, k, v, cu_seqlens, causal=causal, backend=backend)`` run once under ``OpRecorder``."""
    from .recorder import SOFTMAX_OPS, OpRecorder
    with OpRecorder() as rec:
        out = varlen_attention(q, k, v, cu_seqlens, causal=causal, backend=backend)
    softmaxed = [math.prod(op.args[0].shape) for op in rec.named(*SOFTMAX_OPS)]
    return RecordedAttention(out, rec.cells // q.shape[1], len(rec.scores),
                             max(softmaxed) * q.element_size() if softmaxed else None)


def recorded_cells(seq_lens: Sequence[int], backends: Sequence[str] = ("loop", "masked", "padded"),
                   causal: bool = False) -> dict[str, int]:
    """``{backend: cells}``: the score cells of one head (random q, k, v, one head of 4) that ``OpRecorder`` sees
    each backend compute for one batch (``record_attention``). The loop's are the requests' own blocks; what masked
    and padded compute beyond them is their waste (cross-request cells, pad cells). A fused backend counts the cells
    it is handed."""
    q, k, v, cu = random_qkv(list(seq_lens), 1, 4, seed=0)
    return {backend: record_attention(q, k, v, cu, backend, causal).cells for backend in backends}


def attention_calls(call: Callable, *args) -> tuple[object, list[str]]:
    """``call(*args)`` under a profile hook that changes no result: its result, and the engine's attention functions
    that ran inside it (its backends as ``"its 'loop' backend"``, the entry points that reach one by name, the Triton
    kernel as ``"its Triton kernel"``), in the order first entered."""
    from ..core import attention
    codes = {f.__code__: f"its {name!r} backend" for name, f in attention.IMPLS.items()}
    codes |= {f.__code__: f.__name__ for f in (attention.attention_forward, attention.varlen_attention,
                                                 attention.attention_ref, attention.plain_attention,
                                                 attention.padded_attention, attention.dense_attention)}
    seen = []

    def hook(frame, event, arg):
        code = frame.f_code
        name = codes.get(code) or ("its Triton kernel" if code.co_filename.endswith("triton_varlen.py") else None)
        if event == "call" and name and name not in seen:
            seen.append(name)

    old = sys.getprofile()
    sys.setprofile(hook)
    try:
        return call(*args), seen
    finally:
        sys.setprofile(old)


def forward_time_split(model, batch: PackedBatch, repeats: int = 2) -> dict[str, float]:
    """Seconds of one forward spent in linear layers, in attention and elsewhere, on the model's device.

    Runs ``model.forward(batch)`` (attention "auto") under the profiler, fastest of ``repeats``.
    On the CPU it sums the inclusive CPU time of ``aten::linear`` and of the attention ops; on
    CUDA the device (kernel) time under them, since CPU time there only measures launches.
    "other" is the rest (LayerNorm, GeLU, residual adds, copies; on the CPU also profiler
    overhead). Also returns ``wall``, timed without the profiler.
    """
    def run():
        return model.forward(batch, attn_backend="auto")

    cuda = model.device.type == "cuda"
    wall = time_call(run, repeats=repeats, device=model.device)
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        prof = _profile(run, memory=False, device=model.device)
        events = prof.key_averages()
        total = (sum(_device_time(ev, self_only=True) for ev in events) if cuda else time.perf_counter() - t0)
        parts = {"linear": 0.0, "attention": 0.0}
        for ev in events:
            part = "linear" if ev.key in _LINEAR_OPS else "attention" if ev.key in _ATTENTION_OPS else None
            if part:
                parts[part] += _device_time(ev) if cuda else ev.cpu_time_total / 1e6
        parts["other"] = max(total - parts["linear"] - parts["attention"], 0.0)
        parts["profiled_total"] = total
        if best is None or total < best["profiled_total"]:
            best = parts
    best["wall"] = wall
    return best


def _device_time(ev, self_only: bool = False) -> float:
    """Seconds of GPU kernel time of a profiler event (the attribute was renamed cuda → device)."""
    name = ("self_" if self_only else "") + ("device_time_total" if hasattr(ev, "device_time_total") else "cuda_time_total")
    return getattr(ev, name) / 1e6


def matmul_throughput(tokens: int, d_in: int = 512, d_out: int = 2048, repeats: int = 5, device="cpu",
                      dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of ``F.linear`` on ``[tokens, d_in]`` with a ``[d_out, d_in]`` weight (fastest of N)."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d_in, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(d_out, d_in, generator=g).to(device=device, dtype=dtype)
    seconds = time_call(lambda: F.linear(x, w), repeats=repeats, device=device)
    return 2 * tokens * d_in * d_out / seconds / 1e9


def linear_layers_sampler(tokens: Sequence[int], shapes: Sequence[tuple[int, int]], *, repeats: int = 2, device="cpu",
                          dtype: torch.dtype = torch.float32, seed: int = 0) -> Callable[[], float]:
    """A GEMM-peak sampler on a model's OWN linear layers: ``sample()`` → FLOP/s (fastest of ``repeats`` passes).

    One pass runs a ``ColumnParallelLinear`` with bias (TP=1: the class, hence the kernel, the model's layers
    run) of every ``(d_in, d_out)`` in ``shapes`` (one block's layers, ``flops.linear_shapes``) on ``[T, d_in]``
    random rows, for every ``T`` of ``tokens`` (a workload's batch sizes): the matmuls of one layer of the
    forward, nothing else, on ``device`` in ``dtype``. Inputs and weights are drawn once, here; every sample
    reuses them.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not tokens or min(tokens) < 1:
        raise ValueError(f"tokens must be a non-empty list of batch sizes >= 1, got {list(tokens)}")
    g = torch.Generator().manual_seed(seed)
    rows = {d_in: torch.randn(max(tokens), d_in, generator=g).to(device=device, dtype=dtype) for d_in, _ in shapes}
    layers = [(d_in, ColumnParallelLinear(d_in, d_out, dtype=dtype).load_full_(
        torch.randn(d_out, d_in, generator=g) * 0.02, torch.randn(d_out, generator=g)).to(device)) for d_in, d_out in shapes]
    flops = 2 * sum(tokens) * sum(d_in * d_out for d_in, d_out in shapes)

    @torch.no_grad()
    def one_layer():
        for t in tokens:
            for d_in, layer in layers:
                layer(rows[d_in][:t])

    def sample() -> float:
        return flops / time_call(one_layer, repeats=repeats, warmup=0, device=device)
    return sample


def top_ops(fn: Callable[[], object], n: int = 8, device="cpu") -> list[tuple[str, float, float]]:
    """Where one call of ``fn`` spends its time: the ``n`` operators with the most self CPU time, as
    ``(name, seconds, share of all self CPU time)``, from ``torch.profiler`` (run ``fn`` once before, warm)."""
    events = _profile(fn, memory=False, device=device).key_averages()
    total = sum(ev.self_cpu_time_total for ev in events)
    top = sorted(events, key=lambda ev: ev.self_cpu_time_total, reverse=True)[:n]
    return [(ev.key, ev.self_cpu_time_total / 1e6, ev.self_cpu_time_total / total) for ev in top]


def time_splits(model, batches: Mapping[Hashable, PackedBatch], repeats: int = 3, warmup: int = 3) -> dict:
    """``forward_time_split`` of each batch (fastest of ``repeats``) after ``warmup`` forwards of every batch (a
    process's first forwards on new shapes pay for fresh memory pages): ``{key: split}``."""
    for _ in range(check_int("warmup", warmup, 0)):
        for batch in batches.values():
            model(batch)
    return {name: forward_time_split(model, batch, repeats=repeats) for name, batch in batches.items()}


def wall_scaled(split: Mapping[str, float]) -> dict[str, float]:
    """``forward_time_split``'s ``linear``, ``attention`` and ``other`` rescaled to add up to its ``wall`` time,
    proportions kept (the profiled parts include the profiler's overhead; the wall time does not)."""
    parts = {p: float(split[p]) for p in ("linear", "attention", "other")}
    total = sum(parts.values())
    if not total > 0 or not split.get("wall", 0) > 0:
        raise ValueError(f"a time split needs positive parts and wall, got {dict(split)!r}")
    return {p: v * split["wall"] / total for p, v in parts.items()}
