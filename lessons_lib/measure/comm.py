"""The alpha-beta model of a ring all-reduce, and its fit to measured all-reduces.

A ring all-reduce of S bytes over p ranks takes 2(p-1) steps (p-1 to reduce-scatter, p-1 to
all-gather); in each step every rank sends S/p bytes to its neighbour, which costs
``alpha + (S/p)/beta``. So

    t(S) = 2(p-1)·alpha  +  2(p-1)/p · S/beta      (latency term + bandwidth term)

- ``AlphaBeta``: the two numbers and where they come from; ``NVLINK``: a datasheet-like fast link.
- ``ring_bytes_sent``, ``ring_time_terms``, ``all_reduce_seconds``: what one all-reduce sends and costs.
- ``crossover_tokens``: the rows N of a ``[N, d_model]`` payload from which bandwidth outweighs latency.
- ``fit_alpha_beta``: alpha and beta read off measured times (relative least squares); ``fit_misses``, how far
  the fit misses its own points, and ``about``, a number printed to the digits that mean anything.
- ``comm_cost_state``: count, payloads and modelled time of one TP forward's all-reduces, packed or one per request;
  ``packing_saving``: how many times more the all-reduces of separate forwards cost than one packed forward.
- ``AllReduceBench``: real all-reduces timed on spawned ranks (``time_all_reduces`` on each rank); ``measure_point``:
  one such timing beside the model's time of the same payload.

Taught in notebooks/00_setup_one_request.ipynb and notebooks/08_chunked_prefill.ipynb.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..validate import check_int
from .machines import H200


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """One link under the ring model (see the module): ``alpha_s`` seconds of latency per step (>= 0),
    ``beta`` bytes per second of one link in one direction (> 0); ``source`` says where they come from."""

    alpha_s: float
    beta: float
    source: str = ""

    def __post_init__(self) -> None:
        for name, value, zero_ok in (("alpha_s", self.alpha_s, True), ("beta", self.beta, False)):
            finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not finite or value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"AlphaBeta.{name} must be a finite {'non-negative' if zero_ok else 'positive'} "
                                 f"number, got {value!r}")


# NVLink 4 moves 900 GB/s per GPU counting both directions (H200.link_bytes_per_s: 450 GB/s one way); the 5 us per
# ring step is an assumed order of magnitude, not a datasheet value.
NVLINK = AlphaBeta(5e-6, H200.link_bytes_per_s, "NVLink 4 (H200), datasheet-like: 450 GB/s one way, 5 us per step assumed")


def _ring_size(world_size: int) -> int:
    return check_int("world_size", world_size, 2, 1024)


def ring_bytes_sent(payload: int, world_size: int) -> int:
    """Bytes ONE rank sends in one ring all-reduce of ``payload`` bytes: ``2·(p-1)/p · payload``
    (reduce-scatter, then all-gather, each moving ``(p-1)/p`` of the buffer). 0 at ``p = 1``."""
    check_int("world_size", world_size, 1)
    return 2 * (world_size - 1) * check_int("payload", payload, 0) // world_size


def ring_time_terms(fit: AlphaBeta, payload_bytes: float, world_size: int = 2) -> tuple[float, float]:
    """``(latency, bandwidth)`` seconds of ONE ring all-reduce of ``payload_bytes`` on each rank:
    ``2(p-1)·alpha`` and ``2(p-1)/p · S/beta``."""
    p = _ring_size(world_size)
    if isinstance(payload_bytes, bool) or not isinstance(payload_bytes, (int, float)) or not payload_bytes >= 0:
        raise ValueError(f"payload_bytes must be a non-negative number, got {payload_bytes!r}")
    return 2 * (p - 1) * fit.alpha_s, 2 * (p - 1) * payload_bytes / (p * fit.beta)


def all_reduce_seconds(fit: AlphaBeta, payload_bytes: float, world_size: int = 2) -> float:
    """The model's time of one ring all-reduce of ``payload_bytes`` per rank: latency + bandwidth."""
    return sum(ring_time_terms(fit, payload_bytes, world_size))


def crossover_tokens(fit: AlphaBeta, d_model: int, itemsize: int, world_size: int = 2) -> float:
    """The N at which one all-reduce of ``[N, d_model]`` (``itemsize`` bytes a number) spends as long on
    bandwidth as on latency: ``2(p-1)/p · N·d·s/beta = 2(p-1)·alpha``, so ``N* = p·alpha·beta / (d·s)``.
    Below N* latency dominates. The number of layers does not move it (both terms are paid per all-reduce)."""
    p = _ring_size(world_size)
    d, s = check_int("d_model", d_model, 1), check_int("itemsize", itemsize, 1, 16)
    return p * fit.alpha_s * fit.beta / (d * s)


def _significant(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


def fit_alpha_beta(payload_bytes: Sequence[float], seconds: Sequence[float], world_size: int = 2,
                   source: str = "fitted", digits: int = 3) -> AlphaBeta:
    """Fit ``t = a + b·S`` to measured all-reduce times of ``payload_bytes`` per rank over ``world_size``
    ranks, then read the ring model off it: ``alpha = a / 2(p-1)``, ``beta = 2(p-1) / (p·b)``.

    Least squares on RELATIVE errors (each point weighs 1/t: the sizes span orders of magnitude, and a plain
    fit would ignore the small ones, which show the latency). A negative intercept (noise on a link with almost
    no latency) is refitted through the origin: alpha = 0. Both are rounded to ``digits`` significant digits.
    ValueError if the inputs are ragged, not positive and finite, fewer than two distinct sizes, or if the
    times do not grow with the payload.
    """
    p = _ring_size(world_size)
    s, t = np.asarray(payload_bytes, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if s.ndim != 1 or s.shape != t.shape:
        raise ValueError(f"payload_bytes and seconds must be two lists of the same length, got {s.shape} and {t.shape}")
    if not (np.all(np.isfinite(s)) and np.all(s > 0) and np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError("payload_bytes and seconds must be positive finite numbers")
    if len(set(s.tolist())) < 2:
        raise ValueError(f"need at least two distinct payload sizes to fit a line, got {sorted(set(s.tolist()))}")
    w = 1.0 / t
    (a, b), *_ = np.linalg.lstsq(np.stack([w, s * w], axis=1), np.ones_like(t), rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(s * w) / np.sum((s * w) ** 2))
    if not b > 0:
        raise ValueError("the measured times do not grow with the payload: no bandwidth can be fitted "
                         f"(slope {b:.3g} s per byte); measure larger payloads")
    return AlphaBeta(_significant(a / (2 * (p - 1)), digits), _significant(2 * (p - 1) / (p * b), digits), source)


def tp_forward_parts(cfg, num_tokens: int, all_reduces: int | None = None, launches: int = 0, machine=H200,
                     link: AlphaBeta = NVLINK, tp_size: int = 2) -> dict:
    """One forward of ``num_tokens`` tokens of model ``cfg`` (a ``ModelConfig``) on one rank of ``machine`` under
    TP=``tp_size``, numbers of ``machine.itemsize`` bytes, part by part in seconds: ``arithmetic_s`` (every block's
    linear layers, ``measure.flops.linear_shapes``, at ``peak_flops``), ``memory_s`` (their weights read once plus
    their rows in and out, at ``bytes_per_s``), ``weight_pass_s`` (the weights alone), ``all_reduce_latency_s`` and
    ``all_reduce_bandwidth_s`` (one all-reduce of ``[num_tokens, d_model]`` on ``link``, ``ring_time_terms``),
    ``all_reduces_s`` (``all_reduces`` of them; default 2 per block, after its two row-parallel layers) and
    ``launches_s`` (``launches`` kernel launches at ``machine.launch_s``, 0 when the machine has none)."""
    from .flops import linear_shapes
    n, nb = check_int("num_tokens", num_tokens, 1), machine.itemsize
    ar = 2 * cfg.n_layers if all_reduces is None else check_int("all_reduces", all_reduces, 0)
    shapes = linear_shapes(cfg, tp_size)
    latency, bandwidth = ring_time_terms(link, n * cfg.d_model * nb, tp_size)
    return {"arithmetic_s": cfg.n_layers * sum(2 * n * a * b for a, b in shapes) / machine.peak_flops,
            "memory_s": cfg.n_layers * nb * sum(a * b + n * (a + b) for a, b in shapes) / machine.bytes_per_s,
            "weight_pass_s": cfg.n_layers * nb * sum(a * b for a, b in shapes) / machine.bytes_per_s,
            "all_reduce_latency_s": latency, "all_reduce_bandwidth_s": bandwidth,
            "all_reduces_s": ar * (latency + bandwidth),
            "launches_s": check_int("launches", launches, 0) * (machine.launch_s or 0.0)}


REPEATED_PARTS = ("weight_pass_s", "all_reduces_s", "launches_s")   # what every forward pays again, whatever its tokens


def tp_run_prices(cfg, runs: dict, all_reduces: int, launches: int) -> dict:
    """Runs ``{name: [tokens of each forward]}`` priced forward by forward with ``tp_forward_parts`` (H200s, TP=2,
    ``all_reduces`` all-reduces and ``launches`` kernel launches per forward): per run ``forwards``, ``largest``
    (tokens) and, summed over its forwards, the seconds of each of ``REPEATED_PARTS``."""
    return {name: {"forwards": len(t), "largest": max(t),
                   **{k: sum(tp_forward_parts(cfg, n, all_reduces, launches)[k] for n in t) for k in REPEATED_PARTS}}
            for name, t in runs.items()}


def fit_misses(fit: AlphaBeta, measured: dict) -> list[float]:
    """Measured / modelled time of each payload of ``measured`` (``AllReduceBench.measure``'s dict: ``bytes``,
    ``seconds``, ``world_size``) under ``fit``: 1 where the line goes through the point. How far a fit misses its
    own points says how many digits of alpha, beta and N* mean anything."""
    return [t / all_reduce_seconds(fit, b, measured["world_size"]) for b, t in zip(measured["bytes"], measured["seconds"])]


def about(x: float, digits: int = 1) -> str:
    """``x`` to ``digits`` significant digits, written out with thousands separators: one digit is an order of
    magnitude (``about(259.3)`` is ``"300"``, ``about(1836.2, 2)`` is ``"1,800"``, ``about(0.0412)`` is ``"0.04"``).
    How the course prints a number read off a fit that misses its own points. ValueError for a negative or
    non-finite ``x``."""
    if isinstance(x, bool) or not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
        raise ValueError(f"about() takes a non-negative finite number, got {x!r}")
    v = float(f"{x:.{check_int('digits', digits, 1, 6)}g}")
    if v == 0:  # a fit with no latency (alpha = 0) has N* = 0
        return "0"
    return f"{v:,.{max(0, digits - 1 - math.floor(math.log10(v)))}f}"


DTYPES = ("float32", "bfloat16", "float16")


def comm_cost_state(num_tokens: int, fit: AlphaBeta, d_model: int = 512, dtype: str = "float32", n_layers: int = 8,
                    requests: int = 1, world_size: int = 2, fitted_world_size: int | None = None) -> dict:
    """What the all-reduces of one TP forward of ``num_tokens`` tokens cost under ``fit`` (count and payloads from
    ``tp.dryrun.expected_trace``, times from ``ring_time_terms``), and the same tokens as ``requests`` forwards.

    Keys: the inputs, ``alpha_s``, ``beta``, ``source``, ``count``, ``bytes_each``, ``latency_s``, ``bandwidth_s``,
    ``one_s`` (one all-reduce), ``forward_s``, ``dominated``, ``crossover`` (N*), ``lens`` (``serve.workloads.packing_lens``),
    ``separate_count``, ``separate_s``, ``extrapolated`` (``fitted_world_size`` when it is not ``world_size``: a
    fit carried to another ring, else None). ValueError on bad sizes, more requests than tokens, another dtype."""
    import torch

    from ..core.config import ModelConfig
    from ..serve.workloads import packing_lens
    from ..tp.dryrun import expected_trace
    n = check_int("num_tokens", num_tokens, 1, 1 << 20)
    r = check_int("requests", requests, 1, 4096)
    if r > n:
        raise ValueError(f"requests must be at most num_tokens (each request has at least one token), got "
                         f"requests={r} > num_tokens={n}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    p = check_int("world_size", world_size, 2, 1024)
    fitted = None if fitted_world_size is None else check_int("fitted_world_size", fitted_world_size, 2, 1024)
    cfg = ModelConfig(n_layers=check_int("n_layers", n_layers, 1, 256), d_model=check_int("d_model", d_model, 1, 1 << 15),
                      dtype=getattr(torch, dtype))
    trace = expected_trace(cfg, n, 0, p)
    count, each = len(trace), trace[0].bytes
    lat, bw = ring_time_terms(fit, each, p)
    lens = packing_lens(n, r)
    separate = [expected_trace(cfg, m, 0, p) for m in lens]
    return {"num_tokens": n, "d_model": cfg.d_model, "dtype": dtype, "n_layers": cfg.n_layers, "requests": r,
            "world_size": p, "alpha_s": fit.alpha_s, "beta": fit.beta, "source": fit.source, "count": count,
            "bytes_each": each, "latency_s": lat, "bandwidth_s": bw, "one_s": lat + bw, "forward_s": count * (lat + bw),
            "dominated": "latency" if lat >= bw else "bandwidth",
            "crossover": crossover_tokens(fit, cfg.d_model, cfg.dtype.itemsize, p), "lens": lens,
            "separate_count": sum(len(t) for t in separate),
            "separate_s": sum(all_reduce_seconds(fit, rec.bytes, p) for t in separate for rec in t),
            "extrapolated": fitted if fitted not in (None, p) else None}


def packing_saving(fit: AlphaBeta, num_tokens: int, requests: int, world_size: int = 2) -> float:
    """How many times more all-reduce time ``requests`` requests of ``num_tokens`` tokens each cost as separate
    forwards than packed into one forward (the article's model, float32): ``comm_cost_state``'s ``separate_s``
    over its ``forward_s``. ValueError on bad sizes, as ``comm_cost_state``."""
    n, k = check_int("num_tokens", num_tokens, 1), check_int("requests", requests, 1, 4096)
    state = comm_cost_state(n * k, fit, requests=k, world_size=world_size)
    return state["separate_s"] / state["forward_s"]


# ---- real all-reduces, timed on spawned ranks ------------------------------------------------------------

AR_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)  # the [N, 512] float32 payloads AllReduceBench.measure times by default
AR_REPEATS = 9
MAX_MEASURE_ELEMENTS = 1 << 22  # 16 MiB of float32: one timing of a few all-reduces stays well under 2 s on a CPU


def time_all_reduces(group, sizes: Sequence[int], repeats: int = AR_REPEATS, warmup: int = 2,
                     first_warmup: int = 20) -> list[list[float]]:
    """On one rank: for each element count in ``sizes``, the seconds of ``repeats`` all-reduces of a float32
    tensor through the rank's ``DistGroup``, each started right after a barrier (no rank times its wait for the
    other), after ``warmup`` untimed ones (``first_warmup`` for the first size: a fresh group's setup)."""
    import time

    import torch
    import torch.distributed as dist
    out = []
    for j, numel in enumerate(sizes):
        x = torch.ones(int(numel), device=group.device)
        times = []
        skip = first_warmup if j == 0 else warmup
        for i in range(skip + repeats):
            x.fill_(1.0)
            dist.barrier(group=group.process_group)
            t0 = time.perf_counter()
            group.all_reduce(x, layer="timing")
            if i >= skip:
                times.append(time.perf_counter() - t0)
        out.append(times)
    return out


def _timing_loop(group, channel) -> None:
    """Worker loop of ``AllReduceBench``: one ``time_all_reduces`` per command, until "close" or EOF."""
    from ..tp.workers import commands
    for _, sizes, repeats, warmup, first_warmup in commands(channel):
        group.trace.clear()
        times = time_all_reduces(group, sizes, repeats, warmup, first_warmup)
        channel.send((times, list(dict.fromkeys(rec.bytes for rec in group.trace))))


class AllReduceBench:
    """``world_size`` spawned ranks (``tp.workers.WorkerPool``) kept alive to time real all-reduces (through
    ``DistGroup.all_reduce``) on request: spawned once, on the first ``measure``; ``close()`` (or the end of the
    process) ends them."""

    def __init__(self, world_size: int = 2, timeout: float = 60.0):
        self.world_size = check_int("world_size", world_size, 2, 8)
        self.timeout = timeout
        self.pool = None
        self.backend = None

    def _ranks(self):
        from ..tp.workers import WorkerPool
        if self.pool is None or self.pool.closed:
            self.pool = WorkerPool(self.world_size, timeout=self.timeout, verbose=False, name="allreduce-bench")
            self.pool.start(_timing_loop)
            self.backend = self.pool.backend
        return self.pool

    def measure(self, tokens: Sequence[int] = AR_TOKENS, d_model: int = 512, repeats: int = AR_REPEATS,
                warmup: int = 2, first_warmup: int = 20) -> dict:
        """Time real all-reduces of ``[N, d_model]`` float32 payloads for each N of ``tokens``.

        Returns ``{"tokens", "bytes" (each payload, as the ranks' traces recorded it), "seconds" (per payload:
        the median over ``repeats`` of the slower rank), "backend", "world_size"}``. A wall-clock measurement:
        shown and fitted, never asserted. ValueError (before anything is spawned) for repeated or bad sizes, or a
        payload over ``MAX_MEASURE_ELEMENTS``.
        """
        ns = [check_int("tokens", n, 1, 1 << 16) for n in tokens]
        d = check_int("d_model", d_model, 1, 1 << 14)
        reps = check_int("repeats", repeats, 1, 100)
        if not ns or len(set(ns)) != len(ns):
            raise ValueError(f"tokens must be distinct positive integers, got {list(tokens)}")
        if max(ns) * d > MAX_MEASURE_ELEMENTS:
            raise ValueError(f"N x d_model = {max(ns) * d:,} elements is too large to time here: at most "
                             f"{MAX_MEASURE_ELEMENTS:,} (16 MiB of float32)")
        pool = self._ranks()
        pool.broadcast(("time", [n * d for n in ns], reps, check_int("warmup", warmup, 0, 100),
                        check_int("first_warmup", first_warmup, 0, 100)))
        out = pool.collect("result", what="timing all-reduces")
        medians = [[float(np.median(ts)) for ts in times] for times, _ in out]
        return {"tokens": ns, "bytes": out[0][1], "seconds": [max(col) for col in zip(*medians)],
                "backend": self.backend, "world_size": self.world_size}

    def close(self) -> None:
        if self.pool is not None and not self.pool.closed:
            self.pool.broadcast(("close",))
            self.pool.close()


def measure_point(bench: AllReduceBench, num_tokens: int, d_model: int, fit: AlphaBeta) -> dict:
    """Time real all-reduces of ``[num_tokens, d_model]`` float32 on ``bench``'s ranks (5 timed after 2 untimed;
    refused above ``MAX_MEASURE_ELEMENTS``) and put the alpha-beta model's time of the same payload beside it.
    Keys: ``tokens``, ``d_model``, ``bytes``, ``seconds`` (measured), ``model_s`` (``all_reduce_seconds`` on
    ``fit``), ``backend``, ``world_size``."""
    m = bench.measure([num_tokens], d_model, repeats=5, warmup=2, first_warmup=2)
    return {"tokens": m["tokens"][0], "d_model": d_model, "bytes": m["bytes"][0], "seconds": m["seconds"][0],
            "model_s": all_reduce_seconds(fit, m["bytes"][0], m["world_size"]), "backend": m["backend"],
            "world_size": m["world_size"]}
