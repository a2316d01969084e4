"""measure.search.first_where against a linear scan (drawn by hypothesis), its call count and its refusals."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons_lib.core.config import ModelConfig
from lessons_lib.measure.flops import forward_flops
from lessons_lib.measure.search import first_where


def _scan(predicate, lo, hi):
    """The definition, one n at a time."""
    return next((n for n in range(lo, hi + 1) if predicate(n)), None)


@settings(max_examples=300, deadline=None)
@given(lo=st.integers(-50, 50), width=st.integers(0, 200), step=st.integers(-100, 300))
def test_first_where_is_the_linear_scan(lo, width, step):
    hi = lo + width
    calls = []

    def crossed(n):
        calls.append(n)
        return n >= step
    assert first_where(crossed, lo, hi) == _scan(lambda n: n >= step, lo, hi)
    assert all(lo <= n <= hi for n in calls)
    assert len(calls) <= math.ceil(math.log2(width + 1)) + 1


def test_first_where_finds_the_flop_crossover_a_scan_finds():
    """A real use: the first request length where attention's FLOPs reach the linear layers' (whole blocks)."""
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=4, d_head=16, d_ffn=256)

    def attention_wins(n):
        f = forward_flops(cfg, [n])
        return f.attention >= f.linear
    assert first_where(attention_wins, 1, 10_000) == _scan(attention_wins, 1, 10_000) == 6 * 64


@pytest.mark.parametrize("lo, hi, match", [(5, 4, "lo must be <= hi, got lo=5, hi=4"), (1.5, 4, "lo must be an int"),
                                           (0, True, "hi must be an int")])
def test_first_where_refuses_bad_bounds(lo, hi, match):
    with pytest.raises(ValueError, match=match):
        first_where(lambda n: True, lo, hi)
