"""measure.flops.attention_cell_grid: the cells of one head's score matrix, counted against attention_cells and
drawn by hand for the article's requests A (10 tokens) and B (30)."""
import numpy as np
import pytest

from lessons_lib.measure.flops import attention_cell_grid, attention_cells

BATCHES = [[10, 30], [5], [1, 1, 1], [7, 1, 12, 3], [30, 10]]


@pytest.mark.parametrize("lens", BATCHES)
@pytest.mark.parametrize("method", ["padded", "masked", "varlen"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_grid_holds_the_cells_attention_cells_counts(lens, method, causal):
    useful, computed = attention_cell_grid(lens, method, causal)
    cells = attention_cells(lens, method, causal)
    assert (int(useful.sum()), int(computed.sum())) == (cells.useful, cells.computed)
    assert not (useful & ~computed).any()                  # nothing useful is left uncomputed


def test_a_and_b_by_hand():
    useful, computed = attention_cell_grid([10, 30], "masked")
    assert useful.shape == (40, 40) and computed.all()
    assert useful[:10, :10].all() and useful[10:, 10:].all() and not useful[:10, 10:].any()
    useful, computed = attention_cell_grid([10, 30], "padded")         # two [30, 30] matrices on the diagonal
    assert useful.shape == (60, 60) and computed[:30, :30].all() and not computed[:30, 30:].any()
    assert useful[:10, :10].all() and not useful[10:30, :30].any()
    useful, _ = attention_cell_grid([10, 30], "varlen", causal=True)
    np.testing.assert_array_equal(useful[:10, :10], np.tril(np.ones((10, 10), dtype=bool)))


def test_whole_blocks_compute_the_blocks_and_keep_the_lower_triangles():
    useful, computed = attention_cell_grid([10, 30], "varlen", causal=True, whole_blocks=True)
    assert (int(useful.sum()), int(computed.sum())) == (10 * 11 // 2 + 30 * 31 // 2, 10 * 10 + 30 * 30)
    assert computed[0, 1:10].all() and not useful[0, 1:10].any() and not computed[:10, 10:].any()


def test_bad_input():
    with pytest.raises(ValueError, match="method"):
        attention_cell_grid([10, 30], "dense")
    with pytest.raises(ValueError, match="seq_lens"):
        attention_cell_grid([10, 0], "masked")
