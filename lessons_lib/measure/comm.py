"""The alpha-beta model of a ring all-reduce, and its fit to measured all-reduces.

A ring all-reduce of S bytes over p ranks takes 2(p-1) steps (p-1 to reduce-scatter, p-1 to
all-gather); in each step every rank sends S/p bytes to its neighbour, which costs
``alpha + (S/p)/beta``. So

    t(S) = 2(p-1)·alpha  +  2(p-1)/p · S/beta      (latency term + bandwidth term)

- ``AlphaBeta``: the two numbers and where they come from; ``NVLINK``: a datasheet-like fast link.
- ``ring_bytes_sent``, ``ring_time_terms``, ``all_reduce_seconds``: what one all-reduce sends and costs.
- ``crossover_tokens``: the rows N of a ``[N, d_model]`` payload from which bandwidth outweighs latency.
- ``fit_alpha_beta``: alpha and beta read off measured times (relative least squares).

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
