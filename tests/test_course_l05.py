"""course.l05_flops: the matmul recorder on the engine, intensity and the crossover rule, the figures,
the roofline explorer and the checkers of lesson 05 (claims C13, C14, C15)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import attempt, by_class, min_font, png_of, stub, texts
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from lessons_lib import faults
from lessons_lib.core.attention import varlen_attention
from lessons_lib.core.batch import pack, seq_lens_to_cu_seqlens
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer
from lessons_lib.course import l05_flops as L
from lessons_lib.course.grading import score
from lessons_lib.measure import flops as F_
from lessons_lib.measure import recorded as R
from lessons_lib.measure.flops import (
    attention_cells,
    attention_crossover_length,
    block_linear_intensity,
    decode_attention_intensity,
    decode_step_parts,
    forward_flops,
    kv_cache_bytes,
    min_decode_batch,
)
from lessons_lib.measure.machines import H200, REFERENCE_CPU, Machine, measured_sweep, throughput_roof
from lessons_lib.measure.profile import wall_scaled
from lessons_lib.measure.recorder import FUSED_ATTENTION_OPS, Matmul, record_matmuls, record_ops
from lessons_lib.style import ATTENTION, LINEAR, MIN_FONT, OTHER, TEXT

SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128)


CFGS = (ModelConfig(), ModelConfig(n_layers=2, d_model=256, n_heads=4, d_head=32, d_ffn=1024),
        ModelConfig(n_layers=4, d_model=512, n_heads=4, d_head=64, d_ffn=1536),
        ModelConfig(n_layers=3, d_model=384, n_heads=6, d_head=64, d_ffn=3072))


def cells_per_head(matmuls):
    """Score cells per head, summed over layers, from the recorded Q K^T shapes ([heads, L_q, d_head] @ [heads,
    d_head, L_k]): the first of each recorded (Q K^T, P V) pair."""
    return sum(m.m * m.n for m in [m for m in matmuls if m.kind == "attention"][::2])


def attention_intensity(lens, n_kv_heads=8, cfg=None, nbytes=2):
    """``measure.flops.prefill_attention_intensity`` in the argument order these tests were written in."""
    return F_.prefill_attention_intensity(cfg or ModelConfig(), lens, n_kv_heads, nbytes)


def controlled(fn):
    """``fn()`` with the engine's control on: K and V repeated per query head before the cache."""
    with faults.injected("kv_repeated_before_cache"):
        return fn()


# --- the recorder ------------------------------------------------------------------------------------------

def test_record_matmuls_sees_mm_addmm_bmm_with_their_shapes():
    x, w, b = torch.randn(5, 3), torch.randn(4, 3), torch.randn(4)
    got = record_matmuls(lambda: (F.linear(x, w), F.linear(x, w, b), torch.randn(2, 5, 3) @ torch.randn(2, 3, 7)))
    assert got == [Matmul("linear", 1, 5, 3, 4), Matmul("linear", 1, 5, 3, 4), Matmul("attention", 2, 5, 3, 7)]
    mm = got[2]
    assert mm.flops == 2 * 2 * 5 * 3 * 7 and mm.bytes(2) == 2 * 2 * (15 + 21 + 35)
    assert mm.intensity(4) == mm.flops / mm.bytes(4)


@pytest.mark.parametrize("lens", [[10, 30], [1] * 12, [7], [3, 3, 3]])
def test_c13_c14_a_forward_reads_each_weight_once_and_attention_costs_sum_l_squared(lens):
    model = Transformer(SMALL, seed=0)
    mm = R.forward_matmuls(model, pack([torch.arange(n) % 300 for n in lens]))
    lin = R.of_kind(mm, "linear")
    assert len(lin) == 4 * SMALL.n_layers and {m.m for m in lin} == {sum(lens)}
    assert sum(m.flops for m in lin) == forward_flops(SMALL, lens).linear
    assert cells_per_head(mm) == SMALL.n_layers * attention_cells(lens, "varlen").computed
    assert sum(m.flops for m in R.of_kind(mm, "attention")) == forward_flops(SMALL, lens).attention
    assert len(R.of_kind(mm, "attention")) == 2 * len(lens) * SMALL.n_layers  # one QK^T and one PV per request


def test_c14_masked_attention_shows_up_as_the_whole_square_and_sdpa_as_pairs():
    model = Transformer(SMALL, seed=0)
    batch = pack([torch.arange(n) for n in (4, 12)])
    masked = R.forward_matmuls(model, batch, "masked")
    assert cells_per_head(masked) == SMALL.n_layers * 16 ** 2
    sdpa = R.forward_matmuls(model, batch, "sdpa")
    assert cells_per_head(sdpa) == SMALL.n_layers * (4 ** 2 + 12 ** 2)
    assert cells_per_head(R.of_kind(sdpa, "linear")) == 0


def test_c14_recorded_flops_are_what_the_engine_ran():
    assert R.recorded_flops(SMALL, [10, 30]) == forward_flops(SMALL, [10, 30])
    with faults.injected("loop_backend_runs_masked"):       # the engine broken: the record follows, the count does not
        assert R.recorded_flops(SMALL, [10, 30]).attention == forward_flops(SMALL, [10, 30], "masked").attention


def test_c14_fused_attention_intensity_counts_the_recorded_sdpa_calls_by_hand():
    model = Transformer(SMALL, seed=0)
    rec = record_ops(lambda: model(pack([torch.arange(n) for n in (10, 30)]), attn_backend="sdpa"))
    # per layer, k = 64: causal 2 k L (L + 1) FLOPs per request over Q, K, V, O of 2 bytes, 4 k T numbers
    want = sum(2 * 64 * n * (n + 1) for n in (10, 30)) / (2 * 4 * 64 * 40)
    assert R.fused_attention_intensity(rec) == pytest.approx(want)
    assert R.fused_attention_intensity(rec, nbytes=4) == pytest.approx(want / 2)
    assert {op.name for op in rec.ops} & set(FUSED_ATTENTION_OPS)
    with pytest.raises(ValueError, match="no fused attention"):
        R.fused_attention_intensity(record_ops(lambda: model(pack([torch.arange(5)]), attn_backend="loop")))


@pytest.mark.parametrize("r", [1, 3, 16])
def test_c15_decode_attention_is_one_query_per_request_at_about_one_flop_per_byte(r):
    mm = R.decode_attention_matmuls(r, kv_len=40, n_heads=2, d_head=8)
    assert len(mm) == 2 * r and all(m.m == 1 for m in mm)
    assert mm[0] == Matmul("attention", 2, 1, 8, 40) and mm[1] == Matmul("attention", 2, 1, 40, 8)
    assert R.intensity(mm) == pytest.approx(8 * 40 / (8 + 8 * 40 + 40))
    assert R.intensity(mm) == pytest.approx(decode_attention_intensity(40, 8, 2))


def test_decode_attention_matmuls_run_the_real_kernel_on_what_they_record():
    q, k, v = torch.randn(3, 2, 8), torch.randn(30, 2, 8), torch.randn(30, 2, 8)
    cu_q, cu_k = seq_lens_to_cu_seqlens([1] * 3), seq_lens_to_cu_seqlens([10] * 3)
    mm = record_matmuls(lambda: varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend="loop"))
    assert [(m.m, m.n) for m in mm[::2]] == [(1, 10)] * 3


# --- intensity and the crossover --------------------------------------------------------------------------

def test_c13_c15_block_linear_intensity_is_rows_over_one_plus_rows_over_384():
    cfg = ModelConfig()
    for r in (1, 32, 256, 4096):
        assert block_linear_intensity(cfg, r) == pytest.approx(r / (1 + r / 384))
    values = [block_linear_intensity(cfg, r) for r in (1, 2, 10, 100, 1000, 10**6)]
    assert values == sorted(values) and values[-1] < 384
    assert block_linear_intensity(cfg, 64, 4) == pytest.approx(block_linear_intensity(cfg, 64) / 2)


def test_c14_crossover_is_six_d_whole_blocks_and_twelve_d_minus_one_causal():
    cfg = ModelConfig()
    assert attention_crossover_length(cfg) == 6 * 512 and attention_crossover_length(cfg, causal=True) == 12 * 512 - 1
    for c in (SMALL, ModelConfig(n_layers=1, d_model=96, n_heads=2, d_head=16, d_ffn=200)):
        for causal in (False, True):
            n = attention_crossover_length(c, causal)
            f, g = forward_flops(c, [n], "varlen", causal), forward_flops(c, [n - 1], "varlen", causal)
            assert f.attention >= f.linear and g.attention < g.linear


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("ridge, nbytes", [(206.0, 2), (9.0, 4), (100.0, 2), (1.0, 2), (383.0, 2), (400.0, 2)])
def test_c15_min_decode_batch_is_the_smallest_r_reaching_the_ridge(cfg, ridge, nbytes):
    r = min_decode_batch(cfg, ridge, nbytes)
    if r is None:
        assert block_linear_intensity(cfg, 10**9, nbytes) < ridge
    else:
        assert block_linear_intensity(cfg, r, nbytes) >= ridge - 1e-9
        assert r == 1 or block_linear_intensity(cfg, r - 1, nbytes) < ridge


# --- the roofline explorer ----------------------------------------------------------------------------------

FAKE_CPU = Machine("this CPU, measured", 100e9, 10e9, dtype=torch.float32)  # given by hand: ridge 10 FLOP/byte
HERE_LENS = [128] * 4
HERE_CFG = ModelConfig(n_layers=2, d_model=256, n_heads=4, d_head=64, d_ffn=1024, vocab_size=1000, max_position=1024)


def fake_forward(cfg, lens, seconds=0.05):
    """What ``measure.recorded.timed_forward`` returns, given by hand: 100 recorded ops, the whole-block FLOPs."""
    return {"cfg": cfg, "seq_lens": list(lens), "seconds": seconds, "ops": 100, "flops": forward_flops(cfg, lens)}


def test_roofline_state_counts_by_hand_on_the_h200():
    s = L.roofline_state()   # the article's model, bf16, H200 datasheet, 1 x 1000, 10 x 100, typed 300, 40
    assert [r["label"] for r in s["rows"]] == ["1 x 1000", "10 x 100", "typed 300, 40"]
    assert s["machine"].ridge == pytest.approx(989e12 / 4.8e12)
    w, a = 3 * 512 * 512 + 512 * 512 + 2 * 512 * 2048, 8192             # weights, row numbers per layer
    for row in s["rows"]:
        lin, att = row["linear"], row["attention"]
        t = sum(row["seq_lens"])
        assert lin.flops == 8 * t * 2 * w
        assert lin.bytes == 8 * 2 * (w + t * a)
        assert att.bytes == 8 * 2 * t * 4 * 512                        # Q, K, V, O once
        assert row["floor"] == 5 * 8 * H200.launch_s                   # 4 GEMMs and 1 attention per layer
        cells = sum(n * (n + 1) // 2 for n in row["seq_lens"])
        assert att.flops == 8 * 8 * cells * 4 * 64
        for part in (lin, att):
            assert part.intensity == part.flops / part.bytes
            assert part.seconds == max(part.flops / 989e12, part.bytes / 4.8e12)
            assert part.bound == ("compute-bound" if part.intensity >= 989e12 / 4.8e12 else "memory-bound")
    assert [r["attention"].bound for r in s["rows"]] == ["compute-bound", "memory-bound", "memory-bound"]
    assert s["rows"][0]["linear"].bound == "compute-bound" and s["measured"] is None


def test_roofline_state_gqa_shrinks_kv_bytes_and_qkv_not_attention_flops():
    full, grouped = L.roofline_state(n_kv_heads=8), L.roofline_state(n_kv_heads=2)
    for f, g in zip(full["rows"], grouped["rows"]):
        assert g["attention"].flops == f["attention"].flops
        t = sum(f["seq_lens"])
        assert f["attention"].bytes - g["attention"].bytes == 8 * 2 * t * 2 * (512 - 128)
        assert f["linear"].flops - g["linear"].flops == 8 * t * 2 * 512 * 2 * (512 - 128)


def test_roofline_state_packings_machine_and_bad_input():
    s = L.roofline_state(machine=FAKE_CPU, total=1000, requests=3, lengths=[5, 6], nbytes=4)
    assert [r["seq_lens"] for r in s["rows"]] == [[1000], [334, 333, 333], [5, 6]]
    assert s["rows"][1]["label"] == "3 x ~333" and s["machine"].ridge == 10.0
    assert L.machine_line(s) == "this CPU, measured: peak 100.0 GFLOP/s, bandwidth 10.00 GB/s, ridge 10.0 FLOP/byte"
    with pytest.raises(ValueError, match="n_heads must divide d_model"):
        L.roofline_state(n_heads=3)
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=8"):
        L.roofline_state(n_kv_heads=3)
    with pytest.raises(ValueError, match="lengths"):
        L.roofline_state(lengths="10, 0")
    with pytest.raises(ValueError, match="more than the tokens"):
        L.roofline_state(total=5, requests=6)
    with pytest.raises(ValueError, match="bytes_per_element"):
        L.roofline_state(nbytes=3)
    with pytest.raises(ValueError, match="machine"):
        L.roofline_state(machine=("x", 1e9, 1e9))


def test_roofline_lines_format():
    line = L.roofline_lines(L.roofline_state())[0]
    assert line.startswith("1 x 1000: linear 50.33 GFLOP 181.40 MB 277.5 FLOP/B compute-bound ")
    assert " | attention 8.20 GFLOP 32.77 MB 250.2 FLOP/B compute-bound " in line and "| predicted " in line
    assert line.endswith("| launch floor 0.2 ms (40 kernels at least): launch latency binds first")


def test_measured_point_is_predicted_from_the_forward_measured():
    fw = fake_forward(HERE_CFG, HERE_LENS)
    s = L.roofline_state(machine=FAKE_CPU, here={"machine": FAKE_CPU, "forward": fw})
    m = s["measured"]
    f = forward_flops(HERE_CFG, HERE_LENS, causal=True)
    assert m["causal_flops"] == f.total and m["seconds"] == 0.05 and m["floor"] == 0.0   # FAKE_CPU: no launch cost
    lin_b = 2 * 4 * ((256 * 768 + 256 * 256 + 2 * 256 * 1024) + 512 * (1024 + 512 + 1280 + 1280))
    att_b = 2 * 4 * 512 * 4 * 256
    assert m["bytes"] == lin_b + att_b
    assert m["predicted"] == pytest.approx(max(f.linear / 100e9, lin_b / 10e9) + max(f.attention / 100e9, att_b / 10e9))
    assert "50.000 ms measured" in L.measured_line(s) and "(= forward_flops' whole blocks" in L.measured_line(s)


def test_roofline_explorer_callbacks():
    fw = fake_forward(L.model_of(), [300, 40])
    fake_timer = fake_forward
    box = L.roofline_explorer(FAKE_CPU, timer=fake_timer)
    k = by_class(box)
    assert "frx" in box._dom_classes
    table, out, err = k["frx-table"], k["frx-figure"], k["frx-error"]
    want = L.roofline_state(machine=H200, here={"machine": FAKE_CPU, "forward": fw})
    assert table.value == "".join(f"<div>{x}</div>" for x in L.roofline_lines(want))
    before = png_of(out)
    k["frx-machine"].value = FAKE_CPU.name
    assert "ridge 10.0" in k["frx-machine-line"].value and png_of(out) != before
    assert k["frx-bytes"].value == 4                      # the measured CPU's peak is fp32: the bytes follow
    k["frx-bytes"].value = 2
    assert "mixes dtypes" in k["frx-machine-line"].value
    k["frx-machine"].value = H200.name
    assert k["frx-bytes"].value == 2 and "mixes" not in k["frx-machine-line"].value
    k["frx-heads"].value = 4
    assert list(k["frx-kvheads"].options) == [1, 2, 4] and k["frx-kvheads"].value == 4
    k["frx-lengths"].value = "10, x"
    assert "not a whole number" in err.value
    k["frx-lengths"].value = "40"
    assert err.value == "" and "typed 40:" in table.value
    assert "50.000 ms measured" in k["frx-measured"].value and "lengths 40 " in k["frx-measured"].value
    k["frx-lengths"].value = "1000, 1000"                 # past the timed forward's bound: said, not timed
    assert "not timed" in k["frx-measured"].value and "typed 1000, 1000:" in table.value


def test_wall_scaled_keeps_proportions_and_sums_to_wall():
    t = wall_scaled({"linear": 0.6, "attention": 0.3, "other": 0.3, "wall": 0.9})
    assert math.isclose(sum(t.values()), 0.9) and math.isclose(t["linear"] / t["attention"], 2.0)
    with pytest.raises(ValueError, match="positive"):
        wall_scaled({"linear": 0.0, "attention": 0.0, "other": 0.0, "wall": 1.0})


def test_time_split_figure_bars_are_wall_ms_and_gflop():
    splits = {"a": {"linear": 0.6, "attention": 0.3, "other": 0.3, "wall": 0.9},
              "b": {"linear": 0.5, "attention": 0.1, "other": 0.4, "wall": 1.2}}
    fl = {"a": forward_flops(ModelConfig(n_layers=2), [1000], causal=True),
          "b": forward_flops(ModelConfig(n_layers=2), [100] * 10, causal=True)}
    fig = L.time_split_figure(splits, fl, "cpu")
    ax_t, ax_f = fig.axes
    ends = lambda ax: sorted({round(p.get_x() + p.get_width(), 6) for p in ax.patches})
    assert ends(ax_t)[-2:] == [900.0, 1200.0] or set(ends(ax_t)) >= {900.0, 1200.0}
    assert round(fl["a"].total / 1e9, 6) in ends(ax_f) and round(fl["b"].total / 1e9, 6) in ends(ax_f)
    assert "FLOPs (causal)" in fig._suptitle.get_text()


# --- figures --------------------------------------------------------------------------------------------------

def test_c14_flops_bars_heights_are_forward_flops_in_gflop():
    cases = [("a", [1000]), ("b", [100] * 10)]
    ax = Figure().add_subplot()
    L.flops_bars(ax, cases, ModelConfig(), "t")
    heights = [p.get_height() for p in ax.patches]
    want = [forward_flops(ModelConfig(), lens) for _, lens in cases]
    assert heights == pytest.approx([f.linear / 1e9 for f in want] + [f.attention / 1e9 for f in want])
    with pytest.raises(ValueError, match="cases"):
        L.flops_bars(ax, [], ModelConfig(), "t")


def test_intensity_figure_plots_the_library_formula_and_the_ridges():
    fig = L.intensity_figure(ModelConfig(), decode_r=(1, 32))
    ax = fig.axes[0]
    bf16 = ax.lines[0]
    xs, ys = bf16.get_xdata(), bf16.get_ydata()
    assert all(y == pytest.approx(block_linear_intensity(ModelConfig(), int(x))) for x, y in zip(xs, ys))
    labels = " ".join(t.get_text() for t in ax.texts)
    assert "206" in labels and "ridge" in labels and "R = 32: 29.5" in labels
    assert "measured when this course was built" in labels and f"{REFERENCE_CPU.ridge:.3g} FLOP/byte" in labels
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
        box = Text.get_window_extent(text, renderer)      # the label itself, not its leader line
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
    machine, got = measured_sweep([1, 4], 16, 32, threads=1, rounds=1)
    assert len(got) == 2 and all(g > 0 for g in got) and torch.get_num_threads() == before
    assert machine.n_sms == 1 and machine.peak_flops > 0 and machine.bytes_per_s > 0
    fig = L.throughput_figure([1, 8, 64], [5.0, 20.0, 40.0], "FFN-up", "cpu, 1 thread")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "8", "64"] and ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.texts] == ["5", "20", "40"] and min_font(fig) >= MIN_FONT
    with pytest.raises(ValueError, match="one throughput per T"):
        L.throughput_figure([1, 2], [1.0], "x", "y")


def test_throughput_figure_draws_the_roof_beside_the_sweep():
    roof = throughput_roof([1, 24, 4096], 512, 2048, Machine("cpu", 100e9, 10e9, dtype=torch.float32))
    fig = L.throughput_figure([1, 24, 4096], [14.0, 90.0, 190.0], "FFN-up", "cpu", ([1, 24, 4096], roof))
    assert len(fig.axes[0].lines) == 2 and "roofline" in fig.axes[0].get_legend().get_texts()[0].get_text()
    assert fig.axes[0].get_ylim()[1] >= 190 and min_font(fig) >= MIN_FONT


def test_attention_share_curve_crosses_half_at_the_crossover():
    fig = L.attention_share_curve(ModelConfig(), lengths=[100, 3071, 3072, 10000], marks=())
    whole = fig.axes[0].lines[0].get_ydata()
    assert whole[1] < 50 <= whole[2]


# --- exercises ----------------------------------------------------------------------------------------------

def _gqa_heads(cfg, lens, ridge):          # closed form, without attention_intensity
    k, t, s = cfg.qkv_dim, sum(lens), sum(n * (n + 1) for n in lens)
    fits = [kv for kv in range(1, cfg.n_heads + 1)
            if cfg.n_heads % kv == 0 and kv * cfg.d_head * 2 * t * ridge <= k * s - 2 * t * ridge * k]
    return max(fits, default=None)


def _gqa_by_group(cfg, lens, ridge):       # the decode factor applied to prefill: intensity x group
    plain = attention_intensity(lens, cfg.n_heads, cfg)
    fits = [kv for kv in range(1, cfg.n_heads + 1) if cfg.n_heads % kv == 0 and plain * cfg.n_heads / kv >= ridge]
    return max(fits, default=None)


def test_gqa_answers_cover_every_verdict():
    verdicts = [F_.gqa_heads_for_ridge(*case) for case in L._GQA_CASES]
    assert verdicts == [_gqa_heads(*case) for case in L._GQA_CASES]
    assert None in verdicts and 8 in verdicts and 1 in verdicts and 2 in verdicts   # none, no grouping, all, 6-head
    assert math.isclose(F_.gqa_intensity_ceiling(ModelConfig()), 2 * 512 / (512 + 64))
    cfg = ModelConfig()
    assert math.isclose(attention_intensity([1000], 1, cfg) / attention_intensity([1000], 8, cfg),
                        F_.gqa_intensity_ceiling(cfg))


def test_gqa_checker_explains_wrong_answers():
    assert L.check_gqa(_gqa_heads)
    assert "not by the group factor" in attempt(L.check_gqa, _gqa_by_group)
    assert "no grouping is enough" in attempt(L.check_gqa, lambda c, s, r: _gqa_heads(c, s, r) or 1)
    assert "no grouping at all is needed" in attempt(L.check_gqa, lambda c, s, r: _gqa_heads(c, s, r) and 1)
    assert "got None" in attempt(L.check_gqa, lambda c, s, r: None)
    assert "divisor of n_heads" in attempt(L.check_gqa, lambda c, s, r: 5)
    assert "< ridge" in attempt(L.check_gqa, lambda c, s, r: c.n_heads if _gqa_heads(c, s, r) else None)


def test_gqa_checker_partial_marks(capsys):
    assert L.check_gqa(stub) is False
    assert "not attempted" in capsys.readouterr().out
    assert 0 < score(L.check_gqa, _gqa_by_group, points=2) < 2   # right where the factor does not decide


def test_c15_decode_step_part_by_part_on_the_h200():
    cfg, ridge = ModelConfig(), H200.ridge
    # the KV read is memory-bound for every R and cache; the linear layers turn compute-bound from min_decode_batch
    r = min_decode_batch(cfg, ridge)
    assert decode_step_parts(cfg, r - 1, 8, H200).linear.bound == "memory-bound"
    assert decode_step_parts(cfg, r, 8, H200).linear.bound == "compute-bound"
    assert all(decode_step_parts(cfg, rr, n, H200).attention.bound == "memory-bound"
               for rr in (1, 256, 4096) for n in (1, 8, 128, 1000))
    # 8 cached tokens, R = 4096: linear 26.1 us (its FLOPs at peak; its bytes need 15.3), the KV read 15.7 us
    p = decode_step_parts(cfg, 4096, 8, H200)
    assert p.linear.seconds == pytest.approx(26.06e-6, rel=1e-3)
    assert p.attention.seconds == pytest.approx(15.73e-6, rel=1e-3) and p.longer == "linear"
    assert decode_step_parts(cfg, 4096, 128, H200).longer == "attention"
    assert decode_step_parts(cfg, 1, 1000, H200).longer == "linear"          # one request: the weight read
    # the step's time is the sum of the parts' roofline times, each max(compute, memory)
    assert p.seconds == pytest.approx(max(p.linear.flops / 989e12, p.linear.bytes / 4.8e12)
                                         + p.attention.bytes / 4.8e12)


def test_c15_decode_step_parts_count_the_recorded_matmuls():
    cfg, r, kv = ModelConfig(), 4, 128
    layer = Transformer(dataclasses.replace(cfg, n_layers=1, vocab_size=1000, max_position=256), seed=0)
    lin = R.of_kind(R.forward_matmuls(layer, pack([[7]] * r), "sdpa"), "linear")
    att = R.decode_attention_matmuls(r, kv_len=kv)
    p = decode_step_parts(cfg, r, kv, H200)
    assert p.linear.flops == sum(m.flops for m in lin) and p.linear.bytes == sum(m.bytes(2) for m in lin)
    assert p.attention.flops == sum(m.flops for m in att)
    assert p.attention.bytes == sum(m.bytes(2) for m in att) - 2 * 2 * cfg.n_heads * r * kv   # less the scores


def test_c15_engine_decode_step_runs_the_recorded_decode_shapes():
    cfg = ModelConfig()
    layer = Transformer(dataclasses.replace(cfg, n_layers=1, vocab_size=1000, max_position=256), seed=0)
    mm = R.engine_decode_matmuls(layer, 3, 40)
    assert R.of_kind(mm, "attention") == R.decode_attention_matmuls(3, kv_len=40)
    assert [m.m for m in R.of_kind(mm, "linear")] == [3] * 4


def test_c15_engine_kv_cache_bytes_counts_k_v_heads_not_query_heads():
    # counted by hand: layers x (K and V) x tokens x K/V heads x d_head x bytes per number
    for kv in (4, 2, 1):
        assert R.engine_kv_cache_bytes(SMALL, [3, 5], kv) == 2 * 2 * 8 * kv * 16 * 4
    bf16 = dataclasses.replace(SMALL, dtype=torch.bfloat16)
    assert R.engine_kv_cache_bytes(bf16, [7], 1) == 2 * 2 * 7 * 1 * 16 * 2
    with pytest.raises(ValueError, match="n_kv_heads"):
        R.engine_kv_cache_bytes(SMALL, [3], 3)                               # 3 K/V heads cannot serve 4 query heads


def test_c15_engine_kv_cache_bytes_is_measured_on_the_engine():
    """Break the engine (K and V repeated for every query head before the cache): the measurement follows,
    while the count from the config does not."""
    with faults.injected("kv_repeated_before_cache"):
        assert R.engine_kv_cache_bytes(SMALL, [3, 5], 1) == 4 * kv_cache_bytes(SMALL, [3, 5], n_kv_heads=1,
                                                                               bytes_per_element=4)


def test_c15_gqa_decode_packs_a_group_as_rows_of_one_matmul():
    """With H_kv K/V heads of H, each request's decode attention is [H_kv, G, D] @ [H_kv, D, L_kv] (G = H / H_kv
    query rows per K/V head) and back; the control (K/V repeated per query head) runs MHA's [H, 1, D] shapes."""
    for kv in (4, 2, 1):
        att = R.of_kind(R.gqa_decode_matmuls(SMALL, kv, 3, 10), "attention")
        g = SMALL.n_heads // kv
        assert sorted({(m.batch, m.m, m.k, m.n) for m in att}) == [(kv, g, 10, 16), (kv, g, 16, 10)]
        assert len(att) == 2 * 3 * SMALL.n_layers                 # QK^T and PV, per request, per layer
        control = controlled(lambda kv=kv: R.of_kind(R.gqa_decode_matmuls(SMALL, kv, 3, 10), "attention"))
        assert sorted({(m.batch, m.m, m.k, m.n) for m in control}) == [(4, 1, 10, 16), (4, 1, 16, 10)]
    one_kv = R.of_kind(R.gqa_decode_matmuls(SMALL, 1, 3, 10), "attention")
    mha = R.of_kind(R.gqa_decode_matmuls(SMALL, 4, 3, 10), "attention")
    assert R.intensity(one_kv) > 2 * R.intensity(mha)          # 2.8x: K/V read once for 4 query rows


def test_c15_packed_decode_attention_intensity_by_hand():
    # G = 2, D = 4, L = 8, bf16: 4·2·4·8 = 256 FLOPs over 2 · 2 · (8 + 32 + 16) = 224 bytes
    assert decode_attention_intensity(8, 4, 2, group=2) == pytest.approx(256 / 224)
    assert decode_attention_intensity(128, 64, 2, group=1) == pytest.approx(decode_attention_intensity(128, 64, 2))
    att = R.of_kind(R.gqa_decode_matmuls(SMALL, 2, 1, 8), "attention")   # recorded: G = 2, D = 16, L = 8
    assert R.intensity(att) == pytest.approx(4 * 2 * 16 * 8 / (2 * 2 * (2 * 16 + 16 * 8 + 2 * 8)))
    with pytest.raises(ValueError, match="group"):
        decode_attention_intensity(8, 4, group=0)


def test_c15_engine_kv_cache_bytes_control_repeats_k_v_per_query_head():
    for kv in (4, 2, 1):
        assert controlled(lambda kv=kv: R.engine_kv_cache_bytes(SMALL, [3, 5], kv)) == 2 * 2 * 8 * 4 * 16 * 4


@pytest.mark.parametrize("case", L._KV_CASES)
def test_c15_kv_read_overtakes_from_is_the_first_r_by_roofline_search(case):
    cfg, ridge, nbytes, kv = case
    machine = Machine("m", ridge * 1e9, 1e9)
    first = next((r for r in range(1, 20_000) if decode_step_parts(cfg, r, kv, machine, nbytes).longer == "attention"),
                 None)
    assert F_.decode_kv_overtakes_from(cfg, ridge, nbytes, kv) == first


def _kv_read_bytes_only(cfg, nbytes, kv_len):
    """The tempting answer to Exercise 05.3: both parts timed by their bytes alone (the linear layers taken
    as memory-bound whatever R); W weight numbers, A activation numbers per row of the four linear layers."""
    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    w, a = 3 * d * k + k * d + 2 * d * f, (d + 3 * k) + (k + d) + 2 * (d + f)
    c = nbytes * 2 * k * (kv_len + 1)
    return None if c <= nbytes * a else nbytes * w // (c - nbytes * a) + 1


def test_c15_kv_overtakes_checker():
    assert L.check_kv_overtakes(F_.decode_kv_overtakes_from)
    check = L.check_kv_overtakes
    bytes_only = lambda c, ridge, nb, kv: _kv_read_bytes_only(c, nb, kv)
    assert "compute-bound" in attempt(check, bytes_only)
    assert 0 < score(check, bytes_only, points=2) < 2                      # right where the linear layers stay memory-bound
    ref = F_.decode_kv_overtakes_from
    assert "off by one" in attempt(check, lambda c, ridge, nb, kv: (ref(c, ridge, nb, kv) or -1) + 1 or None)
    assert "expected None" in attempt(check, lambda c, ridge, nb, kv: ref(c, ridge, nb, kv) or 10**6)
    assert "got None, expected" in attempt(check, lambda c, ridge, nb, kv: None)
    assert L.check_kv_overtakes(stub) is False


def test_roofline_figure_keeps_text_on_the_canvas_ink_lines_and_points_on_the_roof():
    fw = fake_forward(HERE_CFG, HERE_LENS)
    s = L.roofline_state(machine=FAKE_CPU, here={"machine": FAKE_CPU, "forward": fw},
                         lengths="3000, 2000, 1000, 500, 100, 7")
    fig = L.roofline_figure(s)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer, (w, h) = canvas.get_renderer(), canvas.get_width_height()
    for t in texts(fig):
        box = t.get_window_extent(renderer)
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= w and box.y1 <= h, t.get_text()
    assert min_font(fig) >= MIN_FONT
    ax = fig.axes[0]
    assert all(line.get_color() != OTHER for line in ax.get_lines())
    roof = ax.get_lines()[0]
    assert roof.get_color() == TEXT and max(roof.get_ydata()) == 100e9          # the peak, flat past the ridge
    points = {(line.get_marker(), line.get_color()): line.get_xdata()[0] for line in ax.get_lines()[2:8]}
    assert points[("o", LINEAR)] == s["rows"][0]["linear"].intensity
    assert points[("s", ATTENTION)] == s["rows"][1]["attention"].intensity


def _packing_by_hand(total, kv):
    """One long request and the rest at 16 tokens, grown until attention drops below the H200's ridge;
    causal attention per layer: 2 k L (L + 1) FLOPs for 2 T (2 k + 2 kv d_head) bytes (k = 512, bf16)."""
    best = None
    for n in range(1, total // 16 + 1):
        lens = [total - 16 * (n - 1)] + [16] * (n - 1)
        if sum(2 * 512 * x * (x + 1) for x in lens) / (2 * total * (1024 + 128 * kv)) < 989e12 / 4.8e12:
            break
        best = lens
    return best


def test_c14_packing_checker_takes_a_design_and_explains_wrong_ones(capsys):
    assert L.check_packing(_packing_by_hand)
    assert [len(_packing_by_hand(t, kv) or []) for t, kv in L._PACK_CASES] == [
        F_.most_compute_bound_requests(ModelConfig(), t, kv, H200.ridge, L.PACK_MIN_LEN) or 0 for t, kv in L._PACK_CASES]
    assert _packing_by_hand(512, 8) is None and len(_packing_by_hand(4096, 8)) == 142
    check = L.check_packing
    assert "token-weighted mean" in attempt(check, lambda t, kv: [64] * (t // 64))       # equal short requests
    assert "only 1 requests" in attempt(check, lambda t, kv: [t] if t > 512 else None)  # compute-bound, one request
    assert "expected None" in attempt(check, lambda t, kv: _packing_by_hand(t, kv) or [t])  # 512 tokens cannot
    assert "exactly 4096 tokens" in attempt(check, lambda t, kv: [t - 1])
    assert 0 < score(check, lambda t, kv: [t] if t > 512 else None, points=2) < 2
    assert L.check_packing(stub) is False
    assert "not attempted" in capsys.readouterr().out


def test_c14_attention_intensity_of_one_long_request_passes_the_h200_ridge():
    # causal per layer: 2 k L (L + 1) FLOPs; Q, K, V, O: 4 k L numbers of 2 bytes  ->  (L + 1) / 4 FLOP/byte
    assert attention_intensity([1000]) == pytest.approx(1001 / 4)
    assert attention_intensity([1000]) > H200.ridge > attention_intensity([100] * 10)
    # one K/V head: K and V shrink to 64 numbers per token -> 1024 L (L + 1) / (2 L (1024 + 128))
    assert attention_intensity([1000], n_kv_heads=1) == pytest.approx(1024 * 1001 / 2304)
