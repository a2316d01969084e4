"""course.l05_flops: the matmul recorder on the engine, intensity and the crossover rule, the figures,
the FLOP-mix explorer and the checkers of lesson 05 (claims C13, C14, C15)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import attempt, by_class, min_font, png_of, stub
from matplotlib.backends.backend_agg import FigureCanvasAgg

from lessons_lib.core.attention import varlen_attention
from lessons_lib.core.batch import pack, seq_lens_to_cu_seqlens
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer
from lessons_lib.course import l05_flops as L
from lessons_lib.course.grading import score
from lessons_lib.measure.flops import attention_cells, forward_flops
from lessons_lib.style import MIN_FONT

SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128)


# --- the recorder ------------------------------------------------------------------------------------------

def test_record_matmuls_sees_mm_addmm_bmm_with_their_shapes():
    x, w, b = torch.randn(5, 3), torch.randn(4, 3), torch.randn(4)
    got = L.record_matmuls(lambda: (F.linear(x, w), F.linear(x, w, b), torch.randn(2, 5, 3) @ torch.randn(2, 3, 7)))
    assert got == [L.Matmul("linear", 1, 5, 3, 4), L.Matmul("linear", 1, 5, 3, 4), L.Matmul("attention", 2, 5, 3, 7)]
    mm = got[2]
    assert mm.flops == 2 * 2 * 5 * 3 * 7 and mm.bytes(2) == 2 * 2 * (15 + 21 + 35)
    assert mm.intensity(4) == mm.flops / mm.bytes(4)


@pytest.mark.parametrize("lens", [[10, 30], [1] * 12, [7], [3, 3, 3]])
def test_c13_c14_a_forward_reads_each_weight_once_and_attention_costs_sum_l_squared(lens):
    model = Transformer(SMALL, seed=0)
    mm = L.forward_matmuls(model, pack([torch.arange(n) % 300 for n in lens]))
    lin = L.of_kind(mm, "linear")
    assert len(lin) == 4 * SMALL.n_layers and {m.m for m in lin} == {sum(lens)}
    assert sum(m.flops for m in lin) == forward_flops(SMALL, lens).linear
    assert L.score_cells(mm, SMALL.n_heads * SMALL.n_layers, SMALL.d_head) == attention_cells(lens, "varlen").computed
    assert sum(m.flops for m in L.of_kind(mm, "attention")) == forward_flops(SMALL, lens).attention
    assert len(L.of_kind(mm, "attention")) == 2 * len(lens) * SMALL.n_layers  # one QK^T and one PV per request


def test_c14_masked_attention_shows_up_as_the_whole_square_and_sdpa_as_pairs():
    model = Transformer(SMALL, seed=0)
    batch = pack([torch.arange(n) for n in (4, 12)])
    masked = L.forward_matmuls(model, batch, "masked")
    assert L.score_cells(masked, SMALL.n_heads * SMALL.n_layers, SMALL.d_head) == 16 ** 2
    sdpa = L.forward_matmuls(model, batch, "sdpa")
    assert L.score_cells(sdpa, SMALL.n_heads * SMALL.n_layers, SMALL.d_head) == 4 ** 2 + 12 ** 2
    assert L.score_cells(L.of_kind(sdpa, "linear"), 1, 16) == 0


@pytest.mark.parametrize("r", [1, 3, 16])
def test_c15_decode_attention_is_one_query_per_request_at_about_one_flop_per_byte(r):
    mm = L.decode_attention_matmuls(r, kv_len=40, n_heads=2, d_head=8)
    assert len(mm) == 2 * r and all(m.m == 1 for m in mm)
    assert mm[0] == L.Matmul("attention", 2, 1, 8, 40) and mm[1] == L.Matmul("attention", 2, 1, 40, 8)
    assert L.intensity(mm) == pytest.approx(8 * 40 / (8 + 8 * 40 + 40))
    assert L.intensity(mm) == L.intensity(L.decode_attention_shapes(40, 8, 2))


def test_decode_attention_matmuls_run_the_real_kernel_on_what_they_record():
    q, k, v = torch.randn(3, 2, 8), torch.randn(30, 2, 8), torch.randn(30, 2, 8)
    cu_q, cu_k = seq_lens_to_cu_seqlens([1] * 3), seq_lens_to_cu_seqlens([10] * 3)
    mm = L.record_matmuls(lambda: varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend="loop"))
    assert [(m.m, m.n) for m in mm[::2]] == [(1, 10)] * 3


# --- intensity and the crossover --------------------------------------------------------------------------

def test_c13_c15_block_linear_intensity_is_rows_over_one_plus_rows_over_384():
    cfg = ModelConfig()
    for r in (1, 32, 256, 4096):
        assert L.block_linear_intensity(cfg, r) == pytest.approx(r / (1 + r / 384))
    values = [L.block_linear_intensity(cfg, r) for r in (1, 2, 10, 100, 1000, 10**6)]
    assert values == sorted(values) and values[-1] < 384
    assert L.block_linear_intensity(cfg, 64, nbytes=4) == pytest.approx(L.block_linear_intensity(cfg, 64) / 2)


def test_c14_crossover_is_six_d_whole_blocks_and_twelve_d_minus_one_causal():
    cfg = ModelConfig()
    assert L.crossover_length(cfg) == 6 * 512 and L.crossover_length(cfg, causal=True) == 12 * 512 - 1
    for c in (SMALL, ModelConfig(n_layers=1, d_model=96, n_heads=2, d_head=16, d_ffn=200)):
        for causal in (False, True):
            n = L.crossover_length(c, causal)
            f, g = forward_flops(c, [n], "varlen", causal), forward_flops(c, [n - 1], "varlen", causal)
            assert f.attention >= f.linear and g.attention < g.linear


def test_ridge_points():
    assert round(L.H200_PEAK_FLOPS / L.H200_BYTES_PER_S) == 206
    assert list(L.RIDGES.values())[0] == pytest.approx(206, abs=0.1) and 1 < list(L.RIDGES.values())[1] < 50


@pytest.mark.parametrize("cfg", L._CFGS)
@pytest.mark.parametrize("ridge, nbytes", [(206.0, 2), (9.0, 4), (100.0, 2), (1.0, 2), (383.0, 2), (400.0, 2)])
def test_c15_min_decode_batch_is_the_smallest_r_reaching_the_ridge(cfg, ridge, nbytes):
    r = L.min_decode_batch(cfg, ridge, nbytes)
    if r is None:
        assert L.block_linear_intensity(cfg, 10**9, nbytes) < ridge
    else:
        assert L.block_linear_intensity(cfg, r, nbytes) >= ridge - 1e-9
        assert r == 1 or L.block_linear_intensity(cfg, r - 1, nbytes) < ridge


# --- the FLOP mix and its explorer --------------------------------------------------------------------------

def test_c14_flop_mix_state_is_forward_flops_of_three_packings():
    s = L.flop_mix_state(1000)
    assert [r["label"] for r in s["rows"]] == ["1 x 1000", "10 x 100", "100 x 10"]
    for row, f in zip(s["rows"], s["flops"]):
        assert f == forward_flops(ModelConfig(), row["seq_lens"])
        assert row["linear_gflop"] == round(f.linear / 1e9, 2) and row["share"] == round(100 * f.attention_fraction, 1)
    assert s["rows"][0]["share"] == 24.6 and s["rows"][0]["dominated"] == "linear-dominated"
    assert s["crossover"] == 3072 and L.flop_mix_state(1000, "causal")["crossover"] == 6143
    assert L.flop_mix_state(16000)["rows"][0]["dominated"] == "attention-dominated"
    with pytest.raises(ValueError, match="multiple of 100"):
        L.flop_mix_state(1050)
    with pytest.raises(ValueError, match="counting"):
        L.flop_mix_state(1000, "half")


def test_flop_mix_text_formats():
    s = L.flop_mix_state(1000)
    assert L.flop_mix_html(s).startswith(
        "<div>1 x 1000: linear 50.33 GFLOP | attention 16.38 GFLOP | 24.6% attention | linear-dominated</div>")
    assert L.flop_mix_rule(s) == "attention overtakes the linears at L = 3072 tokens per request (whole blocks)"


def test_c14_flop_mix_explorer_callbacks():
    box = L.flop_mix_explorer()
    k = by_class(box)
    tokens, count, table, rule, out = k["frx-tokens"], k["frx-counting"], k["frx-table"], k["frx-rule"], k["frx-figure"]
    assert "frx" in box._dom_classes and (tokens.value, tokens.step, count.value) == (1000, 100, "whole blocks")
    assert table.value == L.flop_mix_html(L.flop_mix_state(1000)) and "3072" in rule.value
    before = png_of(out)
    tokens.value = 8000
    assert "1 x 8000" in table.value and "attention-dominated" in table.value and png_of(out) != before
    count.value = "causal"
    assert "6143" in rule.value and table.value == L.flop_mix_html(L.flop_mix_state(8000, "causal"))


# --- figures --------------------------------------------------------------------------------------------------

def test_c14_flops_bars_heights_are_forward_flops_in_gflop():
    cases = [("a", [1000]), ("b", [100] * 10)]
    fig = L.flops_bars(cases)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    want = [forward_flops(ModelConfig(), lens) for _, lens in cases]
    assert heights == pytest.approx([f.linear / 1e9 for f in want] + [f.attention / 1e9 for f in want])
    with pytest.raises(ValueError, match="cases"):
        L.flops_bars([])


def test_intensity_figure_plots_the_library_formula_and_the_ridges():
    fig = L.intensity_figure(ModelConfig(), decode_r=(1, 32))
    ax = fig.axes[0]
    bf16 = ax.lines[0]
    xs, ys = bf16.get_xdata(), bf16.get_ydata()
    assert all(y == pytest.approx(L.block_linear_intensity(ModelConfig(), int(x))) for x, y in zip(xs, ys))
    labels = " ".join(t.get_text() for t in ax.texts)
    assert "206" in labels and "ridge" in labels and "R = 32: 29.5" in labels
    assert "measured when this course was built" in labels and "EPYC" in labels
    assert "bytes moved" in ax.title.get_text() and "input rows" in ax.title.get_text()
    assert "128 cached tokens" in " ".join(t.get_text() for t in ax.get_legend().get_texts())


def test_intensity_figure_decode_labels_sit_off_the_fp32_line():
    """Each decode label is drawn on the bf16 curve's side away from the fp32 curve (above it, or right of both)."""
    fig = L.intensity_figure(ModelConfig())
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax = fig.axes[0]
    fp32 = ax.lines[1]
    pts = ax.transData.transform(list(zip(fp32.get_xdata(), fp32.get_ydata())))
    renderer = canvas.get_renderer()
    for text in ax.texts:
        if "decode step" not in text.get_text():
            continue
        box = text.get_window_extent(renderer)
        inside = [(x, y) for x, y in pts if box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1]
        assert not inside, f"{text.get_text()!r} overlaps the fp32 curve"


def test_weight_reuse_figure_draws_one_weight_per_panel_and_no_intensity():
    fig = L.weight_reuse_figure(lens=(1, 2, 3))
    ax = fig.axes[0]
    assert sorted(p.get_gid() for p in ax.patches if p.get_gid()) == ["weight-0", "weight-1"]
    text = " ".join(t.get_text() for t in ax.texts)
    assert "x [6, 512]" in text and "2 · 6 · 512 · 2048" in text and "FLOP/byte" not in text


def test_throughput_sweep_restores_threads_and_figure_labels_each_t():
    before = torch.get_num_threads()
    got = L.throughput_sweep([1, 4], 16, 32, repeats=1)
    assert len(got) == 2 and all(g > 0 for g in got) and torch.get_num_threads() == before
    fig = L.throughput_figure([1, 8, 64], [5.0, 20.0, 40.0], "FFN-up", "cpu, 1 thread")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8", "64"] and ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.texts] == ["5", "20", "40"] and min_font(fig) >= MIN_FONT
    with pytest.raises(ValueError, match="one throughput per T"):
        L.throughput_figure([1, 2], [1.0], "x", "y")


def test_attention_share_curve_crosses_half_at_the_crossover():
    fig = L.attention_share_curve(ModelConfig(), lengths=[100, 3071, 3072, 10000], marks=())
    whole = fig.axes[0].lines[0].get_ydata()
    assert whole[1] < 50 <= whole[2]


def test_time_split_bars_fill_100_percent():
    fig = L.time_split_bars([("a", {"linear": 3.0, "attention": 1.0, "other": 0.0}), ("b", {"linear": 1.0})])
    ax = fig.axes[0]
    ends = {}
    for p in ax.patches:
        ends[p.get_y()] = max(ends.get(p.get_y(), 0), p.get_x() + p.get_width())
    assert all(math.isclose(v, 100) for v in ends.values())


# --- exercises ----------------------------------------------------------------------------------------------

def _attn_flops(cfg, lens):
    return cfg.n_layers * cfg.n_heads * sum(n * n for n in lens) * 4 * cfg.d_head


def test_c14_attention_flops_checker():
    assert L.check_attention_flops(_attn_flops)
    assert "n_layers" in attempt(L.check_attention_flops, lambda c, s: _attn_flops(c, s) // c.n_layers)
    assert "4 x d_head" in attempt(L.check_attention_flops, lambda c, s: _attn_flops(c, s) // 4)
    masked = lambda c, s: c.n_layers * c.n_heads * sum(s) ** 2 * 4 * c.d_head
    assert "masked" in attempt(L.check_attention_flops, masked)
    causal = lambda c, s: forward_flops(c, s, causal=True).attention
    assert "causal" in attempt(L.check_attention_flops, causal)
    msg = attempt(L.check_attention_flops, lambda c, s: _attn_flops(c, s) // 2)
    assert "off by a factor 2: count both matmuls, QK^T and PV" in msg and "missing" not in msg
    average = lambda c, s: c.n_layers * c.n_heads * sum(s) ** 2 / len(s) * 4 * c.d_head
    assert "average length" in attempt(L.check_attention_flops, average)
    width_d = lambda c, s: c.n_layers * sum(n * n for n in s) * 4 * c.d_model
    assert "not d_model" in attempt(L.check_attention_flops, width_d)


def test_attention_flops_checker_partial_marks(capsys):
    assert L.check_attention_flops(stub) is False
    assert "not attempted" in capsys.readouterr().out
    average = lambda c, s: c.n_layers * c.n_heads * sum(s) ** 2 // len(s) * 4 * c.d_head
    assert 0 < score(L.check_attention_flops, average, points=2) < 2  # right when all lengths are equal


def _crossover(cfg, causal):
    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    linear = 2 * (3 * d * k + k * d + 2 * d * f)
    return -(-linear // (2 * k)) - 1 if causal else -(-linear // (4 * k))


def test_c14_crossover_checker():
    assert L.check_crossover(_crossover)
    check = L.check_crossover
    assert "6 x d_model holds only" in attempt(check, lambda c, causal: (12 * c.d_model - 1) if causal else 6 * c.d_model)
    assert "about half the cells" in attempt(check, lambda c, causal: _crossover(c, False))
    assert "off by one" in attempt(check, lambda c, causal: _crossover(c, causal) + 1)

    def floor(c, causal):  # right where the division is exact, too small where it is not
        d, k, f = c.d_model, c.qkv_dim, c.d_ffn
        linear = 2 * (3 * d * k + k * d + 2 * d * f)
        return linear // (2 * k) - 1 if causal else linear // (4 * k)
    assert "rounded down" in attempt(check, floor)
    assert 0 < score(check, floor, points=2) < 2

    def with_d(c, causal):  # the linear cost right, attention's width taken as d_model
        d, k, f = c.d_model, c.qkv_dim, c.d_ffn
        linear = 2 * (3 * d * k + k * d + 2 * d * f)
        return -(-linear // (2 * d)) - 1 if causal else -(-linear // (4 * d))
    assert "not d_model" in attempt(check, with_d)


def test_crossover_checker_stub_and_partial_marks(capsys):
    assert L.check_crossover(stub) is False
    assert "not attempted" in capsys.readouterr().out
    rule = lambda c, causal: (12 * c.d_model - 1) if causal else 6 * c.d_model
    got = score(L.check_crossover, rule, points=2)
    assert 0 < got < 2


def test_c15_decode_batch_checker():
    assert L.check_decode_batch(L.min_decode_batch)
    check = L.check_decode_batch
    assert "only the weight bytes" in attempt(check, lambda c, ridge, nb: math.ceil(ridge * nb / 2))
    assert "never passes" in attempt(check, lambda c, ridge, nb: L.min_decode_batch(c, ridge, nb) or 10**6)
    assert "off by one" in attempt(check, lambda c, ridge, nb: (L.min_decode_batch(c, ridge, nb) or 0) + 1 or None)
    weights_only = lambda c, ridge, nb: math.ceil(ridge * nb / 2)
    assert 0 <= score(check, weights_only, points=2) < 2
    assert L.check_decode_batch(stub) is False


def test_time_splits_warm_up_every_batch_then_split_each():
    model = Transformer(SMALL, seed=0)
    batches = {"one": pack([torch.arange(12)]), "three": pack([torch.arange(n) for n in (4, 4, 4)])}
    calls = []
    real = model.forward

    def counting(batch, **kw):
        calls.append(batch.num_seqs)
        return real(batch, **kw)
    model.forward = counting
    got = L.time_splits(model, batches, repeats=1, warmup=2)
    assert set(got) == {"one", "three"} and all(v["wall"] > 0 and v["linear"] >= 0 for v in got.values())
    assert calls[:4] == [1, 3, 1, 3]  # the warm-up forwards come first, for every batch
    with pytest.raises(ValueError, match="warmup"):
        L.time_splits(model, batches, warmup=-1)
