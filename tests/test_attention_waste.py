"""``flops.attention_waste``: the computed score cells split by why they were computed, counted against the
cell-by-cell grid of ``flops.attention_cell_grid`` and the requests' blocks drawn from the lengths."""
from __future__ import annotations

import numpy as np
import pytest

from lessons_lib.measure.flops import METHODS, attention_cell_grid, attention_cells, attention_waste


def blocks(lens, method):
    """Bool ``[n, n]``: the cells inside a request's own block whose row and column hold a token."""
    if method == "padded":
        lmax = max(lens)
        rid, pos = np.divmod(np.arange(len(lens) * lmax), lmax)
        real = pos < np.asarray(lens)[rid]
    else:
        rid, real = np.repeat(np.arange(len(lens)), lens), np.ones(sum(lens), dtype=bool)
    return (rid[:, None] == rid[None, :]) & real[:, None] & real[None, :]


@pytest.mark.parametrize("lens", [[10, 30], [100, 100, 100], [1, 1, 1], [7, 1, 12, 3]])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("whole", [False, True])
def test_the_parts_are_the_grid_s_cells(lens, method, causal, whole):
    useful, computed = attention_cell_grid(lens, method, causal, whole_blocks=whole)
    inside = blocks(lens, method)
    w = attention_waste(lens, method, causal, whole_blocks=whole)
    assert w.useful == int(useful.sum()) and w.computed == int(computed.sum())
    assert w.causal == int((computed & inside & ~useful).sum())
    assert w.outside == int((computed & ~inside).sum())
    assert w.computed == w.useful + w.causal + w.outside


def test_equal_lengths_pad_nothing_and_the_causal_mask_is_not_padding():
    w = attention_waste([100, 100, 100], "padded", causal=True)
    assert w.outside == 0 and w.causal == 3 * 100 * 99 // 2
    assert attention_cells([100, 100, 100], "padded", causal=True).wasted == w.causal  # the old count mixed them


def test_bad_input():
    with pytest.raises(ValueError, match="method"):
        attention_waste([3], "dense")
    with pytest.raises(ValueError):
        attention_waste([3, 0], "masked")
