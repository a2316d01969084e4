"""viz: every figure is a pure function of its numbers; pictures agree with flops' exact counts."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle

from lessons_lib import ModelConfig
from lessons_lib.course import viz
from lessons_lib.measure.flops import attention_cells, decode_attention_intensity, forward_flops, linear_intensity

BATCHES = [[10, 30], [3, 1, 5], [7], [1, 1], [4, 9, 2, 9]]


def _cu(lens):
    return [0] + list(np.cumsum(lens))


@pytest.mark.parametrize("lens", BATCHES)
@pytest.mark.parametrize("method", ["padded", "masked", "varlen"])
@pytest.mark.parametrize("causal", [False, True])
def test_c8_attention_categories_count_exactly_what_flops_counts(lens, method, causal):
    grid = viz.attention_categories(lens, method, causal)
    counts = np.bincount(grid.ravel(), minlength=3)
    cells = attention_cells(lens, method, causal)
    assert counts[viz.USEFUL] == cells.useful
    assert counts[viz.USEFUL] + counts[viz.WASTED] == cells.computed
    assert counts[viz.WASTED] == cells.wasted


def test_c8_article_pictures_hold_the_article_numbers():
    grid = viz.attention_categories([10, 30], "masked")
    assert grid.shape == (40, 40)
    assert (grid[:10, :10] == viz.USEFUL).all() and (grid[10:, 10:] == viz.USEFUL).all()
    assert (grid[:10, 10:] == viz.WASTED).all() and (grid[10:, :10] == viz.WASTED).all()
    varlen = viz.attention_categories([10, 30], "varlen")
    assert (varlen[:10, 10:] == viz.SKIPPED).all()
    padded = viz.attention_categories([10, 30], "padded")
    assert padded.shape == (60, 60)
    assert (padded[:10, :10] == viz.USEFUL).all() and (padded[10:30, :30] == viz.WASTED).all()
    assert (padded[:30, 30:] == viz.SKIPPED).all()


def test_attention_categories_sampling_bounds_the_picture_and_rejects_bad_input():
    grid = viz.attention_categories([100] * 10, "masked", max_pixels=64)
    assert grid.shape == (64, 64)
    assert grid.dtype == np.uint8
    with pytest.raises(ValueError, match="method"):
        viz.attention_categories([10, 30], "dense")
    with pytest.raises(ValueError, match="seq_lens"):
        viz.attention_categories([10, 0], "masked")


def test_c3_token_strip_has_one_rectangle_per_request_and_cu_seqlens_ticks():
    fig = viz.token_strip([10, 30])
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    rects = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert [r.get_width() for r in rects] == [10, 30]
    assert [r.get_x() for r in rects] == [0, 10]
    assert list(ax.get_xticks()) == [0, 10, 40]


def test_c2_padded_vs_flat_draws_real_and_pad_spans():
    lens = [4, 9, 2]
    fig = viz.padded_vs_flat(lens)
    top, bottom = fig.axes
    widths = sorted(p.get_width() for p in top.patches)
    lmax = max(lens)
    assert widths == sorted(lens + [lmax - n for n in lens if n < lmax])
    assert f"{len(lens) * lmax} rows computed" in top.get_title()
    assert list(bottom.get_xticks()) == _cu(lens)


def test_c10_attention_patterns_show_the_categories_and_counts():
    lens = [10, 30]
    fig = viz.attention_patterns(lens)
    axes = [ax for ax in fig.axes if ax.images]
    assert len(axes) == 3
    for ax, method in zip(axes, ("padded", "masked", "varlen")):
        img = ax.images[0]
        assert isinstance(img, AxesImage)
        np.testing.assert_array_equal(np.asarray(img.get_array()), viz.attention_categories(lens, method))
        c = attention_cells(lens, method)
        assert f"computed {c.computed}" in ax.get_title() and f"wasted {c.wasted}" in ax.get_title()


def test_c6_qkv_row_owners_follow_the_head_split():
    cfg = ModelConfig()
    owner = viz.qkv_row_owners(cfg)
    rows = np.arange(3 * cfg.qkv_dim)
    head = (rows % cfg.qkv_dim) // cfg.d_head  # Q, K and V sections each hold heads 0..H-1
    np.testing.assert_array_equal(owner, head // cfg.heads_per_rank)
    assert [int((owner == r).sum()) for r in range(cfg.tp_size)] == [768, 768]
    assert isinstance(viz.qkv_shards(cfg), Figure)


def test_dependency_maps_checks_shapes_and_counts_pairs():
    eye = np.eye(40, dtype=bool)
    fig = viz.dependency_maps({"per token": eye}, [10, 30])
    assert "40 of 1600" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match="panel"):
        viz.dependency_maps({"bad": np.eye(5, dtype=bool)}, [10, 30])


def test_c14_flops_bars_heights_are_forward_flops():
    cfg = ModelConfig()
    cases = [("1 x 1000", [1000]), ("10 x 100", [100] * 10)]
    fig = viz.flops_bars(cases, cfg)
    bars = fig.axes[0].patches
    assert len(bars) == 4  # linear then attention, one of each per case
    for i, (_, lens) in enumerate(cases):
        f = forward_flops(cfg, lens)
        assert bars[i].get_height() == pytest.approx(f.linear / 1e9)
        assert bars[2 + i].get_height() == pytest.approx(f.attention / 1e9)
        assert bars[2 + i].get_y() == pytest.approx(f.linear / 1e9)
    with pytest.raises(ValueError, match="cases"):
        viz.flops_bars([])


def test_c13_c15_intensity_curves_plot_the_library_formulas():
    fig = viz.intensity_curves(tokens=[1, 10, 100], kv_lens=(100, 1000))
    lines = fig.axes[0].get_lines()
    assert list(lines[0].get_ydata()) == [linear_intensity(t, 512, 2048, 4) for t in (1, 10, 100)]
    assert list(lines[1].get_ydata()) == [linear_intensity(t, 512, 2048, 2) for t in (1, 10, 100)]
    assert list(lines[2].get_ydata()) == [decode_attention_intensity(n, 64) for n in (100, 1000)]


def test_c9_masked_growth_lines():
    fig = viz.masked_growth(8, (1, 2, 4))
    masked, useful = fig.axes[0].get_lines()
    assert list(masked.get_ydata()) == [(r * 8) ** 2 for r in (1, 2, 4)]
    assert list(useful.get_ydata()) == [r * 64 for r in (1, 2, 4)]


def test_c14_attention_share_curve_crosses_half_where_flops_say():
    cfg = ModelConfig()
    fig = viz.attention_share_curve(cfg, lengths=[100, 3072, 10000], marks=())
    ys = list(fig.axes[0].get_lines()[0].get_ydata())
    assert ys[0] < 50 and ys[1] == pytest.approx(50) and ys[2] > 50


def test_time_split_bars_fill_100_percent():
    fig = viz.time_split_bars([("a", {"linear": 3.0, "attention": 1.0, "other": 0.0}), ("b", {"linear": 1.0})])
    ax = fig.axes[0]
    widths = [p.get_width() for p in ax.patches]
    assert sum(widths[:3]) == pytest.approx(100) and sum(widths[3:]) == pytest.approx(100)


def test_to_png_is_deterministic_and_carries_no_version():
    png1, png2 = viz.to_png(viz.token_strip([3, 4])), viz.to_png(viz.token_strip([3, 4]))
    assert png1[:8] == b"\x89PNG\r\n\x1a\n"
    assert png1 == png2
    assert b"matplotlib" not in png1 and b"Software" not in png1


def test_measured_series_draws_each_series():
    fig = viz.measured_series([1, 2], {"a": [1.0, 2.0], "b": [3.0, 4.0]}, "x", "y", "t")
    assert [list(line.get_ydata()) for line in fig.axes[0].get_lines()] == [[1.0, 2.0], [3.0, 4.0]]
