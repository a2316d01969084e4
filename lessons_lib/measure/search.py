"""The one "first length where X crosses": bisection over a monotone predicate.

Every crossover the course names is found here: the request length where attention's FLOPs reach the
linear layers', the padded length where attention's waste passes the pad rows', the tokens from which
a linear layer reaches a machine's ridge. The caller says what crossing means (a predicate, false below
the crossover and true from it on); ``first_where`` finds where, in ``O(log(hi - lo))`` calls.

Taught in notebooks/01_flat_batch.ipynb, notebooks/05_flop_regimes.ipynb and notebooks/08_chunked_prefill.ipynb.
"""
from __future__ import annotations

from collections.abc import Callable

from ..validate import check_int


def first_where(predicate: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The smallest integer ``n`` in ``[lo, hi]`` (both included) with ``predicate(n)`` true, or None if
    ``predicate(hi)`` is false.

    ``predicate`` must be monotone on ``[lo, hi]``: false up to some ``n``, true from it on (a predicate
    true at ``lo`` gives ``lo``). It is called at most ``ceil(log2(hi - lo + 1)) + 1`` times, never outside
    ``[lo, hi]``; a non-monotone predicate gets some ``n`` where it turns from false to true, not
    necessarily the first. ``lo`` and ``hi`` must be ints with ``lo <= hi``.
    """
    lo, hi = check_int("lo", lo), check_int("hi", hi)
    if lo > hi:
        raise ValueError(f"lo must be <= hi, got lo={lo}, hi={hi}")
    if not predicate(hi):
        return None
    while lo < hi:  # predicate(hi) holds; the first true lies in [lo, hi]
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi
