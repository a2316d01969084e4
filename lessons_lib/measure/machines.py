"""The machines the course prices its work on: one place for each published or measured number.

A ``Machine`` is what a roofline needs (peak FLOP/s in one dtype, memory bandwidth; ``ridge`` =
their ratio in FLOP/byte: below it a kernel waits for memory, above it for the arithmetic units),
what an occupancy model needs (``n_sms``: programs running side by side), what a launch costs
(``launch_s``) and what one link moves (``link_bytes_per_s``, one direction: the alpha-beta model's
beta, ``measure.comm``).

- ``H200``, ``A100``: NVIDIA's datasheets (SXM parts, dense bf16 tensor cores, without 2:4 sparsity).
- ``REFERENCE_CPU``: the 2-core cloud CPU this course was built on, measured then (the figures drawn
  without running anything use it).
- ``this_cpu()``: this machine, measured once per process (``measure.profile``); varies run to run.

Priced on a machine: a linear layer's roof against T and a measured sweep's verdict (``throughput_roof``,
``sweep_verdict``), a forward's parts (``forward_parts``), with its launch floor
(``forward_roofline``), and a timed forward beside its roofline (``beside_roofline``).

Taught in notebooks/05_flop_regimes.ipynb.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.config import ModelConfig
from ..validate import check_int
from .flops import (
    LINEAR_LAYERS,
    RooflinePart,
    forward_bytes,
    forward_flops,
    linear_intensity,
    roofline_part,
    roofline_seconds,
)
from .profile import matmul_throughput, time_call


def _positive(name: str, value, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"Machine.{name} must be a positive finite number{' or None' if optional else ''}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Machine:
    """One machine's numbers (frozen, hashable).

    ``peak_flops``: FLOP/s of dense matmuls in ``dtype``; ``bytes_per_s``: memory bandwidth (bytes read +
    written per second); ``n_sms``: streaming multiprocessors (GPU) or cores (CPU); ``launch_s``: seconds
    one kernel launch costs the host; ``link_bytes_per_s``: one link, one direction (NVLink: half the
    both-ways figure of a datasheet). None where a number is not known.
    """

    name: str
    peak_flops: float
    bytes_per_s: float
    n_sms: int | None = None
    launch_s: float | None = None
    link_bytes_per_s: float | None = None
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Machine.name must be a non-empty string, got {self.name!r}")
        _positive("peak_flops", self.peak_flops, optional=False)
        _positive("bytes_per_s", self.bytes_per_s, optional=False)
        _positive("launch_s", self.launch_s)
        _positive("link_bytes_per_s", self.link_bytes_per_s)
        if self.n_sms is not None:
            check_int("Machine.n_sms", self.n_sms, 1)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"Machine.dtype must be a floating torch.dtype (the peak's), got {self.dtype!r}")

    @property
    def ridge(self) -> float:
        """FLOP per byte at which the arithmetic takes as long as the bytes: ``peak_flops / bytes_per_s``."""
        return self.peak_flops / self.bytes_per_s

    @property
    def itemsize(self) -> int:
        """Bytes of one number in ``dtype`` (2 for bfloat16, 4 for float32): what the peak was counted in."""
        return self.dtype.itemsize

    def roofline_seconds(self, flops: float, nbytes: float) -> float:
        """The roofline's time of one kernel on this machine: ``max(flops / peak_flops, nbytes / bytes_per_s)``."""
        return roofline_seconds(flops, nbytes, self.peak_flops, self.bytes_per_s)

    def roofline_part(self, flops: float, nbytes: float) -> RooflinePart:
        """``flops`` over ``nbytes`` on this machine's roofline: intensity, seconds, and compute- or memory-bound
        (intensity at or above ``ridge``)."""
        return roofline_part(flops, nbytes, self.peak_flops, self.bytes_per_s)

    def attainable_flops(self, intensity: float) -> float:
        """FLOP/s the roofline allows a kernel of ``intensity`` FLOP/byte: ``min(peak_flops, intensity · bytes_per_s)``."""
        if not 0 <= intensity < math.inf:
            raise ValueError(f"intensity must be a finite FLOP/byte >= 0, got {intensity!r}")
        return min(self.peak_flops, intensity * self.bytes_per_s)


# NVIDIA H200 SXM: 989 TFLOP/s dense bf16 (1,979 with 2:4 sparsity), 4.8 TB/s HBM3e, 132 SMs, NVLink 4 at 900 GB/s
# both ways (450 GB/s one way). NVIDIA A100 SXM 80 GB: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, 108 SMs, NVLink 3 at
# 600 GB/s both ways. A launch: a few microseconds, an order of magnitude assumed (no datasheet gives it).
H200 = Machine("H200 (datasheet)", 989e12, 4.8e12, n_sms=132, launch_s=5e-6, link_bytes_per_s=450e9)
A100 = Machine("A100 (datasheet)", 312e12, 2.039e12, n_sms=108, launch_s=5e-6, link_bytes_per_s=300e9)

# The 2-core AMD EPYC (Zen 4, AVX-512) virtual machine this course was built on, torch 2.13, measured with other
# jobs sharing it, the best of many runs kept: fp32 GEMM peak, the best of about 60 calls of
# measure.profile.matmul_throughput(2048, 2048, 2048) and (4096, 512, 2048), 183 GFLOP/s (typical under load: 85;
# 2 cores x 32 FLOP/cycle x ~2.9 GHz allow about 185); copy bandwidth, the best of about 80 copies of a 256 MiB fp32
# tensor (y.copy_(x), read + write counted), 20.3 GB/s.
REFERENCE_CPU = Machine("a 2-core cloud CPU (measured when this course was built)", 183e9, 20.3e9, n_sms=2,
                        dtype=torch.float32)

_GEMM = 1024              # this_cpu's peak: the fastest fp32 [1024, 1024] @ [1024, 1024]
_COPY_ELEMENTS = 8 << 20  # this_cpu's bandwidth: the fastest copy of a 32 MiB fp32 tensor
_LAUNCHES = 200           # this_cpu's launch cost: the mean of 200 one-element adds, fastest of the repeats


@functools.cache
def this_cpu(repeats: int = 5) -> Machine:
    """This machine's CPU, measured once per process and ``repeats`` (``measure.profile``), in float32:
    ``peak_flops`` the fastest ``[1024, 1024] @ [1024, 1024]`` (``matmul_throughput``), ``bytes_per_s`` the
    fastest copy of a 32 MiB tensor (read + write counted), ``n_sms`` torch's threads, ``launch_s`` one
    one-element op (the host's cost per op), no link. A shared machine slows every number: they are lower
    bounds, shown and never asserted."""
    n = check_int("repeats", repeats, 1, 100)
    peak = matmul_throughput(_GEMM, _GEMM, _GEMM, repeats=n) * 1e9
    x = torch.ones(_COPY_ELEMENTS)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * x.element_size() / time_call(lambda: y.copy_(x), repeats=n)
    one = torch.ones(1)

    def launches():
        for _ in range(_LAUNCHES):
            torch.add(one, one)
    launch = time_call(launches, repeats=n) / _LAUNCHES
    threads = torch.get_num_threads()
    return Machine(f"this CPU, {threads} thread{'s' * (threads > 1)} (measured)", peak, bandwidth, n_sms=threads, launch_s=launch,
                   dtype=torch.float32)


def measured_sweep(tokens: list[int] | tuple[int, ...], d_in: int = 512, d_out: int = 2048, threads: int = 1,
                   rounds: int = 5) -> tuple[Machine, list[float]]:
    """A linear layer's GFLOP/s on ``[T, d_in] @ [d_in, d_out]`` for each T of ``tokens`` (fp32, CPU) and the roof to
    draw them under, measured together: on ``threads`` threads, in the same rounds (``profile.interleaved_best``),
    the peak as ``this_cpu``'s (the fastest ``[1024, 1024] @ [1024, 1024]``) and the bandwidth (the fastest copy of
    32 MiB). Returns ``(Machine, [GFLOP/s per T])``; shown, never asserted."""
    import torch.nn.functional as F

    from .profile import cpu_threads, interleaved_best
    ts = [check_int("tokens", t, 1) for t in tokens]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(check_int("d_out", d_out, 1), check_int("d_in", d_in, 1), generator=g)
    rows = torch.randn(max(ts), d_in, generator=g)
    a, b = torch.randn(_GEMM, _GEMM, generator=g), torch.randn(_GEMM, _GEMM, generator=g)
    x = torch.ones(_COPY_ELEMENTS)
    y = torch.empty_like(x)
    calls = {"peak": lambda: a @ b, "copy": lambda: y.copy_(x)} | {t: (lambda t=t: F.linear(rows[:t], w)) for t in ts}
    with cpu_threads(check_int("threads", threads, 1)):
        best = interleaved_best(calls, rounds=rounds)
    machine = Machine(f"this CPU, {threads} thread{'s' * (threads > 1)} (measured beside the sweep)",
                      2 * _GEMM ** 3 / best["peak"], 2 * x.numel() * x.element_size() / best["copy"], n_sms=threads,
                      dtype=torch.float32)
    return machine, [2 * t * d_in * d_out / best[t] / 1e9 for t in ts]


def throughput_roof(tokens: Sequence[int], d_in: int, d_out: int, machine: Machine) -> list[float]:
    """The roofline's GFLOP/s for ``[T, d_in] @ [d_in, d_out]`` at each T on ``machine``, in its dtype
    (``Machine.attainable_flops`` of ``flops.linear_intensity``)."""
    return [machine.attainable_flops(linear_intensity(check_int("tokens", t, 1), d_in, d_out, machine.itemsize)) / 1e9
            for t in tokens]


def sweep_verdict(tokens: Sequence[int], gflops: Sequence[float], roof: Sequence[float], peak: float,
                  weight_mib: float) -> list[str]:
    """Two sentences from a measured sweep (GFLOP/s per T) and its ``roof``: whether the sweep's best beats the
    ``peak`` (FLOP/s) measured beside it (then it and the ridge are lower bounds), and which points lie above the
    memory roof (a ``weight_mib`` weight kept in the caches). ValueError unless one value per T."""
    if not (len(tokens) == len(gflops) == len(roof)) or not tokens:
        raise ValueError("need one throughput and one roof value per T")
    best, top = max(gflops), peak / 1e9
    out = [f"the sweep's best ({best:.0f} GFLOP/s) beats the peak measured beside it ({top:.0f}) by {best / top:.1f}x: "
           "that peak is a lower bound, and so are the ridge and the T printed above" if best > 1.05 * top
           else f"no point beats the peak measured beside it ({top:.0f} GFLOP/s; best {best:.0f})"]
    above = [t for t, g, r in zip(tokens, gflops, roof) if r < top and g > 1.05 * r]
    out.append(f"above the memory roof at T = {', '.join(map(str, above))}: the roof reads the {weight_mib:g} MiB "
               "weight from memory on every call, but the repeated calls find it in the CPU's caches" if above
               else "no point lies above the memory roof")
    return out


def forward_parts(cfg: ModelConfig, seq_lens: Sequence[int], machine: Machine,
                  nbytes: int = 2) -> tuple[RooflinePart, RooflinePart]:
    """A whole varlen forward's (linear, attention) on ``machine``: ``Machine.roofline_part`` of
    ``flops.forward_flops`` (causal) over ``flops.forward_bytes`` at ``nbytes`` per number."""
    f = forward_flops(cfg, seq_lens, "varlen", causal=True)
    b = forward_bytes(cfg, seq_lens, bytes_per_element=nbytes)
    return machine.roofline_part(f.linear, b.linear), machine.roofline_part(f.attention, b.attention)


def forward_roofline(cfg: ModelConfig, seq_lens: Sequence[int], machine: Machine, nbytes: int = 2) -> dict:
    """A whole varlen forward on ``machine``: ``{"linear", "attention"}`` (``forward_parts``), ``"seconds"`` (the
    two one after the other), ``"kernels"`` (the fewest launches: per layer one GEMM per ``flops.LINEAR_LAYERS``
    entry and one attention kernel), ``"floor"`` (those launches at ``machine.launch_s``, 0 when unknown),
    ``"part_floor"`` (the same per part: ``{"linear", "attention"}``) and ``"binds"``: ``"launch latency"`` when
    the floor reaches the roofline's time, else ``"the roofline"``."""
    lin, att = forward_parts(cfg, seq_lens, machine, nbytes)
    per_layer = {"linear": len(LINEAR_LAYERS), "attention": 1}
    kernels = cfg.n_layers * sum(per_layer.values())
    part_floor = {part: cfg.n_layers * k * (machine.launch_s or 0.0) for part, k in per_layer.items()}
    seconds, floor = lin.seconds + att.seconds, kernels * (machine.launch_s or 0.0)
    return {"linear": lin, "attention": att, "seconds": seconds, "kernels": kernels, "floor": floor,
            "part_floor": part_floor, "binds": "launch latency" if floor >= seconds else "the roofline"}


def beside_roofline(forward: dict, machine: Machine) -> dict:
    """``recorded.timed_forward``'s result with its roofline on ``machine`` (fp32 bytes): ``forward`` plus
    ``predicted`` (s, a lower bound), ``causal_flops``, ``bytes``, ``machine``, ``whole_blocks`` (the
    ``ForwardFlops`` the kernel computes, whole blocks) and ``floor`` (its recorded ops at ``machine.launch_s``)."""
    cfg, lens = forward["cfg"], forward["seq_lens"]
    lin, att = forward_parts(cfg, lens, machine, 4)
    return forward | {"predicted": lin.seconds + att.seconds, "causal_flops": lin.flops + att.flops,
                      "bytes": lin.bytes + att.bytes, "machine": machine, "whole_blocks": forward_flops(cfg, lens),
                      "floor": forward["ops"] * (machine.launch_s or 0.0)}
