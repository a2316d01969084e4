"""Request-length workloads for benchmarks and load tests, each reproducible from a seed.

The four mixes FlashAttention's varlen benchmarks and serving papers use:

==========  ==========================================================  =========================
name        lengths                                                     what it stresses
==========  ==========================================================  =========================
constant    every request ``length`` tokens                             nothing: padding is free
uniform     uniform integers in ``[low, high]``                         mild padding waste
long-tail   lognormal (median ``median``, shape ``sigma``), clipped      a few long prompts among
            to ``[min_len, max_len]``                                   many short ones
bimodal     ``short`` tokens, or ``long`` tokens with prob ``p_long``   "a 50-token question beside
                                                                        a 5,000-token draft"
==========  ==========================================================  =========================

Every generator returns a list of Python ints (lengths); ``make_requests`` turns lengths into
token-id lists, and ``generate(name, n, seed, **kw)`` does both. Same seed → same lists.

Used by the benchmark, the TP demo and notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

import math

import numpy as np

from ..validate import check_int

WORKLOADS = ("constant", "uniform", "long-tail", "bimodal")
# The generators' settings the lessons' streams and explorers use: workload_lengths(name, n, seed, **WORKLOAD_PRESETS[name]).
WORKLOAD_PRESETS = {
    "long-tail": {"median": 64, "sigma": 1.0, "max_len": 2048},
    "bimodal": {"short": 50, "long": 5000, "p_long": 0.1},  # the article's 50-token questions beside 5,000-token drafts
    "uniform": {"low": 16, "high": 512},
}


def constant_lengths(n: int, length: int = 256) -> list[int]:
    """``n`` requests of ``length`` tokens each (no seed needed: nothing is random)."""
    return [check_int("length", length, 1)] * check_int("n", n, 0)


def uniform_lengths(n: int, low: int = 16, high: int = 1024, seed: int = 0) -> list[int]:
    """``n`` lengths drawn uniformly from the integers ``[low, high]``."""
    n, low, high = check_int("n", n, 0), check_int("low", low, 1), check_int("high", high, 1)
    if high < low:
        raise ValueError(f"high={high} must be >= low={low}")
    return np.random.default_rng(check_int("seed", seed, 0)).integers(low, high + 1, size=n).tolist()


def long_tail_lengths(n: int, median: int = 128, sigma: float = 1.0, min_len: int = 1, max_len: int = 2048,
                      seed: int = 0) -> list[int]:
    """``n`` lognormal lengths: ``round(median · exp(sigma · N(0, 1)))`` clipped to ``[min_len, max_len]``.

    With ``sigma=1`` about 16 % of requests are longer than ``2.7 × median`` and 2 % longer than
    ``7.4 × median``: most prompts are short, a few are long — the shape of real chat traffic.

    Taught in notebooks/04_tp2_invariance.ipynb.
    """
    n, median = check_int("n", n, 0), check_int("median", median, 1)
    min_len, max_len = check_int("min_len", min_len, 1), check_int("max_len", max_len, 1)
    if max_len < min_len:
        raise ValueError(f"max_len={max_len} must be >= min_len={min_len}")
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be a finite float >= 0, got {sigma!r}")
    raw = np.random.default_rng(check_int("seed", seed, 0)).lognormal(math.log(median), sigma, size=n)
    return np.clip(np.rint(raw), min_len, max_len).astype(np.int64).tolist()


def bimodal_lengths(n: int, short: int = 50, long: int = 5000, p_long: float = 0.1, seed: int = 0) -> list[int]:
    """``n`` lengths, each ``long`` with probability ``p_long``, else ``short``.

    The default is the article's "a 50-token question beside a 5,000-token draft".

    Taught in notebooks/06_prefill_engine.ipynb.
    """
    n, short, long = check_int("n", n, 0), check_int("short", short, 1), check_int("long", long, 1)
    if isinstance(p_long, bool) or not isinstance(p_long, (int, float)) or not 0.0 <= p_long <= 1.0:
        raise ValueError(f"p_long must be a probability in [0, 1], got {p_long!r}")
    draws = np.random.default_rng(check_int("seed", seed, 0)).random(n) < p_long
    return [long if d else short for d in draws.tolist()]


def fixed_total_mixes(total_tokens: int, num_requests: list[int]) -> dict[int, list[int]]:
    """Split ``total_tokens`` into R equal requests for each R (C14: 1 × 1000 vs 10 × 100).

    Every R must divide ``total_tokens`` so each mix holds exactly the same tokens.
    """
    total = check_int("total_tokens", total_tokens, 1)
    out = {}
    for r in num_requests:
        r = check_int("num_requests", r, 1)
        if total % r:
            raise ValueError(f"num_requests={r} does not divide total_tokens={total}")
        out[r] = [total // r] * r
    return out


def make_requests(lengths: list[int], vocab_size: int = 50257, seed: int = 0) -> list[list[int]]:
    """Token-id lists of the given lengths, ids uniform in ``[0, vocab_size)``.

    Returns one list of Python ints per request (what ``Engine.submit`` takes).

    Taught in notebooks/06_prefill_engine.ipynb.
    """
    vocab_size = check_int("vocab_size", vocab_size, 1)
    lengths = [check_int(f"lengths[{i}]", n, 1) for i, n in enumerate(lengths)]
    ids = np.random.default_rng(check_int("seed", seed, 0)).integers(0, vocab_size, size=sum(lengths))
    cuts = np.cumsum([0] + lengths)
    return [ids[cuts[i]:cuts[i + 1]].tolist() for i in range(len(lengths))]


def workload_lengths(name: str, n: int, seed: int = 0, **kw) -> list[int]:
    """Lengths of workload ``name`` (one of ``WORKLOADS``); ``kw`` go to its generator."""
    if name == "constant":
        return constant_lengths(n, **kw)
    if name == "uniform":
        return uniform_lengths(n, seed=seed, **kw)
    if name == "long-tail":
        return long_tail_lengths(n, seed=seed, **kw)
    if name == "bimodal":
        return bimodal_lengths(n, seed=seed, **kw)
    raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS}")


def generate(name: str, n: int, seed: int = 0, vocab_size: int = 50257, **kw) -> list[list[int]]:
    """``n`` token-id requests of workload ``name``; ``kw`` go to the length generator."""
    return make_requests(workload_lengths(name, n, seed, **kw), vocab_size, seed + 1)


# ---- the prefill stream lessons 06 and 08 serve -----------------------------------------------------------

# 24 long-tail requests (WORKLOAD_PRESETS["long-tail"], length seed 3), their token ids drawn with seed 1, served
# under a budget of 512 prompt tokens per forward: 23 fit, one 1,776-token draft does not.
PREFILL_STREAM = {"workload": "long-tail", "num_requests": 24, "seed": 3}
PREFILL_STREAM_PROMPT_SEED = 1
PREFILL_STREAM_BUDGET = 512  # max_num_batched_tokens the lessons serve the stream under


def preset_stream(name: str, num_requests: int, seed: int, vocab_size: int = 50257,
                  prompt_seed: int = PREFILL_STREAM_PROMPT_SEED) -> tuple[list[int], list[list[int]]]:
    """A seeded stream of workload ``name`` under its ``WORKLOAD_PRESETS`` settings: ``(lengths in arrival order,
    token-id prompts)``, prompt ``i`` a list of ``lengths[i]`` Python ints in ``[0, vocab_size)`` drawn with
    ``prompt_seed``. ValueError for a workload with no preset."""
    lens = preset_lengths(name, num_requests, seed)
    return lens, make_requests(lens, vocab_size, seed=prompt_seed)


def preset_lengths(name: str, num_requests: int, seed: int) -> list[int]:
    """``num_requests`` seeded lengths of workload ``name`` under its ``WORKLOAD_PRESETS`` settings, in arrival
    order. ValueError for a workload with no preset."""
    if name not in WORKLOAD_PRESETS:
        raise ValueError(f"workload must be one of {tuple(WORKLOAD_PRESETS)}, got {name!r}")
    return workload_lengths(name, num_requests, seed, **WORKLOAD_PRESETS[name])


def trickle_arrivals(first: int = 400, per_step: int = 6, steps: int = 12, low: int = 8, high: int = 40,
                     seed: int = 5) -> list[list[int]]:
    """A starvation probe for a scheduler: ``steps`` waves of arrivals (lengths), each ``per_step`` integers in
    ``[low, high)`` drawn with ``seed``, the first wave led by one ``first``-token request."""
    rng = np.random.default_rng(seed)
    waves = [rng.integers(low, high, per_step).tolist() for _ in range(steps)]
    return [[first] + waves[0]] + waves[1:]


def prefill_stream(vocab_size: int = 50257) -> tuple[list[int], list[list[int]]]:
    """The prefill stream of lessons 06 and 08 (``PREFILL_STREAM``, prompts by ``PREFILL_STREAM_PROMPT_SEED``):
    ``(lengths in arrival order, token-id prompts)``, the request longer than ``PREFILL_STREAM_BUDGET`` included.

    Taught in notebooks/06_prefill_engine.ipynb and notebooks/08_chunked_prefill.ipynb.
    """
    return preset_stream(PREFILL_STREAM["workload"], PREFILL_STREAM["num_requests"], PREFILL_STREAM["seed"],
                         vocab_size)


PACKING_PATTERNS = ("equal", "ramp", "one long", "quarter first")


def packing_lens(total_tokens: int, num_requests: int, pattern: str = "equal") -> list[int]:
    """``total_tokens`` split into ``num_requests`` requests (each >= 1 token, summing to T), by ``pattern``
    (one of ``PACKING_PATTERNS``).

    "equal": as equal as possible, longer first (40, 3 → [14, 13, 13]); "ramp": request i
    proportional to i+1 (40, 2 → [13, 27]); "one long": the first request takes half the tokens,
    the rest share the other half; "quarter first": the first request takes a quarter of the tokens,
    the rest share the others (40, 2 → [10, 30], the article's A and B).
    """
    t = check_int("total_tokens", total_tokens, 1, 1 << 20)
    r = check_int("num_requests", num_requests, 1, t)
    if pattern not in PACKING_PATTERNS:
        raise ValueError(f"pattern must be one of {PACKING_PATTERNS}, got {pattern!r}")
    if pattern == "equal" or r == 1:
        return [t // r + (1 if i < t % r else 0) for i in range(r)]
    if pattern in ("one long", "quarter first"):
        first = max(1, min(t - (r - 1), t // (2 if pattern == "one long" else 4)))
        return [first] + packing_lens(t - first, r - 1, "equal")
    spare = t - r                                          # every request has 1 token; share the rest by weight i+1
    weights = range(1, r + 1)
    lens = [1 + spare * w // sum(weights) for w in weights]
    for i in range(t - sum(lens)):                         # rounding leftovers to the longest requests
        lens[r - 1 - i % r] += 1
    return lens
