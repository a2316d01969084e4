"""course.l04_tp: what each rank computes, the trace timeline, the packing explorer, the threaded TP
group and the checkers of lesson 04 (claims C11, C12)."""
from __future__ import annotations

import re
import threading

import pytest
import torch
from helpers import attempt, by_class, png_of, stub
from matplotlib.figure import Figure

from lessons_lib.core.batch import cumulative, pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.course import figures
from lessons_lib.course import l04_tp as L
from lessons_lib.course.grading import score
from lessons_lib.course.style import COMM, MIN_FONT
from lessons_lib.measure.flops import attention_cells
from lessons_lib.measure.tolerance import max_abs_diff, tolerance
from lessons_lib.tp.dryrun import expected_trace, record_trace, trace_signature

SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128)


def _texts(fig: Figure):
    return [t for ax in fig.axes for t in ax.texts + [ax.title, ax.xaxis.label, ax.yaxis.label] if t.get_text()] + \
        [t for t in fig.texts if t.get_text()]


def _min_font(fig: Figure) -> float:
    return min(t.get_fontsize() for t in _texts(fig))


# --- what each rank computes -----------------------------------------------------------------------------

def test_c12_rank_layers_of_the_article_model_per_rank_and_at_tp1():
    want = [("QKV", (40, 512), (40, 768), 512, False), ("out proj", (40, 256), (40, 512), 256, True),
            ("FFN-up", (40, 512), (40, 1024), 512, False), ("FFN-down", (40, 1024), (40, 512), 1024, True)]
    for rank in (0, 1):
        got = [(r.name, r.x, r.y, r.products, r.all_reduce) for r in L.rank_layers(ModelConfig(), 40, rank, 2)]
        assert got == want
    tp1 = L.rank_layers(ModelConfig(), 7, 0, 1)
    assert [(r.x, r.y, r.products, r.all_reduce) for r in tp1] == [
        ((7, 512), (7, 1536), 512, False), ((7, 512), (7, 512), 512, False), ((7, 512), (7, 2048), 512, False),
        ((7, 2048), (7, 512), 2048, False)]
    assert "then all-reduce" in str(L.rank_layers(SMALL, 3)[1]) and "no collective" in str(L.rank_layers(SMALL, 3)[0])


def test_c11_layer0_attention_of_each_rank_is_its_heads_of_the_tp1_attention():
    w = init_weights(SMALL, seed=2)
    batch = pack([torch.arange(n) % SMALL.vocab_size for n in (3, 9, 1)])
    full = L.layer0_attention(Transformer(SMALL, w), batch)
    exact = L.layer0_attention(Transformer(SMALL, w, dtype=torch.float64), batch)
    assert full.shape == (13, 4, 16)
    for rank in (0, 1):
        got = L.layer0_attention(Transformer(SMALL, w, group=LocalGroup(rank, 2)), batch)
        heads = slice(2 * rank, 2 * rank + 2)
        assert got.shape == (13, 2, 16)
        assert max_abs_diff(got, exact[:, heads]) <= tolerance(full[:, heads], exact[:, heads])
    other = L.layer0_attention(Transformer(SMALL, w, group=LocalGroup(1, 2)), batch)
    assert max_abs_diff(other, full[:, :2]) > 1e-3  # rank 1 does not hold heads 0-1: the check can fail


# --- the figure --------------------------------------------------------------------------------------------

def test_c12_trace_timeline_draws_one_purple_bar_per_all_reduce_at_readable_size():
    traces = [record_trace(SMALL, [3, 5], rank, 2) for rank in (0, 1)]
    fig = L.tp_trace_timeline(traces, [[8], [3, 5]], SMALL)
    bars = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("allreduce-")]
    assert len(bars) == 2 * SMALL.n_layers and {p.get_facecolor()[:3] for p in bars} == {
        tuple(int(COMM[i:i + 2], 16) / 255 for i in (1, 3, 5))}
    assert _min_font(fig) >= MIN_FONT
    text = " ".join(t.get_text() for t in _texts(fig))
    assert "4 all-reduces" in text and "[8, 64]" in text and "cu_seqlens = [0, 3, 8]" in text


def test_trace_timeline_refuses_ranks_that_disagree_and_missing_packings():
    traces = [record_trace(SMALL, [8], rank, 2) for rank in (0, 1)]
    with pytest.raises(ValueError, match="differs"):
        L.tp_trace_timeline([traces[0], traces[1][:-1]], [[8]], SMALL)
    with pytest.raises(ValueError, match="packings"):
        L.tp_trace_timeline(traces, [], SMALL)
    with pytest.raises(ValueError, match="at least one"):
        L.tp_trace_timeline([[]], [[8]], SMALL)


def test_registered_timeline_builds_with_9pt_text():
    fig = figures.build("04_trace_timeline")
    assert isinstance(fig, Figure) and _min_font(fig) >= MIN_FONT


# --- the explorer ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", L.PATTERNS)
@pytest.mark.parametrize("t, r", [(40, 1), (40, 2), (40, 3), (40, 40), (7, 6), (96, 17), (1, 1)])
def test_packing_lens_split_exactly_t_tokens_into_r_requests(pattern, t, r):
    lens = L.packing_lens(t, r, pattern)
    assert sum(lens) == t and len(lens) == r and min(lens) >= 1


def test_packing_lens_patterns_and_bad_input():
    assert L.packing_lens(40, 3) == [14, 13, 13]
    assert L.packing_lens(40, 2, "ramp") == [13, 27]
    assert L.packing_lens(40, 5, "one long")[0] == 20
    with pytest.raises(ValueError, match="num_requests"):
        L.packing_lens(4, 5)
    with pytest.raises(ValueError, match="pattern"):
        L.packing_lens(40, 2, "random")


def test_c12_packing_state_trace_stays_while_attention_inputs_change():
    base = L.tp_packing_state(40, 1)
    want = [trace_signature(expected_trace(ModelConfig(), 40, rank, 2)) for rank in (0, 1)]
    seen_cells, seen_cu = set(), set()
    for r, pattern in ((1, "equal"), (2, "equal"), (3, "ramp"), (5, "one long"), (40, "equal")):
        s = L.tp_packing_state(40, r, pattern)
        lens = L.packing_lens(40, r, pattern)
        assert s["seq_lens"] == lens and s["cu_seqlens"] == cumulative(lens) and s["max_seqlen"] == max(lens)
        assert [trace_signature(t) for t in s["traces"]] == want and s["same_as_one_request"] == [True, True]
        assert s["trace_text"] == base["trace_text"] == ["16 × all_reduce [40, 512] float32, 81,920 B each"] * 2
        assert s["positions"] == pack([[0] * n for n in lens]).positions.tolist()
        assert s["cells"] == attention_cells(lens, "varlen").computed and s["cells_per_rank"] == s["cells"] * 4 * 8
        assert s["heads"] == [(0, 3), (4, 7)] and s["grid"] == r * -(-max(lens) // L.TILE)
        seen_cells.add(s["cells"])
        seen_cu.add(tuple(s["cu_seqlens"]))
    assert len(seen_cells) == 5 and len(seen_cu) == 5


def test_packing_html_formats():
    s = L.tp_packing_state(40, 3, "equal")
    trace = L.tp_trace_html(s)
    assert trace.count("<div>rank ") == 2 and "same as 1 request of 40 tokens: yes" in trace
    attn = L.tp_attention_html(s)
    assert "R = 3 | cu_seqlens [0, 14, 27, 40] | positions 0..13, 0..12, 0..12 | max_seqlen 14 | grid 3 blocks" in attn
    assert "rank 1: heads 4-7, sum L_i^2 = 534 cells per head per layer, 17088 per forward" in attn
    assert isinstance(L.tp_packing_figure(s), Figure) and _min_font(L.tp_packing_figure(s)) >= MIN_FONT


def test_c12_packing_explorer_callbacks():
    box = L.tp_packing_explorer()
    k = by_class(box)
    tokens, reqs, pattern = k["tpx-tokens"], k["tpx-num-requests"], k["tpx-pattern"]
    trace, attn, out = k["tpx-trace"], k["tpx-attention"], k["tpx-figure"]
    assert "tpx" in box._dom_classes and (tokens.value, reqs.value, pattern.value) == (40, 2, "equal")
    before_trace, before_attn, before_png = trace.value, attn.value, png_of(out)
    assert "cu_seqlens [0, 20, 40]" in before_attn
    reqs.value = 5
    assert trace.value == before_trace and attn.value != before_attn and png_of(out) != before_png
    pattern.value = "one long"
    assert trace.value == before_trace and "cu_seqlens [0, 20, 25, 30, 35, 40]" in attn.value
    tokens.value = 4  # fewer tokens than requests: R is clamped to T
    assert reqs.max == 4 and reqs.value == 4
    assert "16 × all_reduce [4, 512] float32, 8,192 B each" in trace.value


# --- the threaded TP group ----------------------------------------------------------------------------------

def test_threaded_ranks_really_sum_and_record():
    outs = L.tp_ranks_in_threads(3, lambda g: g.all_reduce(torch.full((2, 2), float(g.rank + 1)), layer="x"))
    for out, trace in outs:
        assert torch.equal(out, torch.full((2, 2), 6.0)) and [r.layer for r in trace] == ["x"]


def test_threaded_ranks_raise_the_root_cause_without_hanging():
    def fn(g):
        if g.rank == 1:
            raise KeyError("rank 1 broke")
        return g.all_reduce(torch.ones(1))
    t0 = threading.active_count()
    with pytest.raises(KeyError, match="rank 1 broke"):
        L.tp_ranks_in_threads(2, fn, timeout=5)
    assert threading.active_count() <= t0


def test_c12_a_tp2_model_on_threads_equals_tp1():
    w = init_weights(SMALL, seed=3)
    batch = pack([torch.arange(n) % SMALL.vocab_size for n in (4, 6)])
    tp1, exact = Transformer(SMALL, w)(batch), Transformer(SMALL, w, dtype=torch.float64)(batch)
    outs = L.tp_ranks_in_threads(2, lambda g: Transformer(SMALL, w, group=g)(batch))
    assert torch.equal(outs[0][0], outs[1][0])
    assert max_abs_diff(outs[0][0], exact) <= tolerance(tp1, exact)
    assert len(outs[0][1]) == 2 * SMALL.n_layers


# --- exercise 04.1 ----------------------------------------------------------------------------------------

def _trace(cfg, lens, *, shape=None, per_request=False, per_layer=2, extra=0):
    t = sum(lens)
    parts = ("attn.out_proj", "mlp.fc_down")[:per_layer]
    rows = [(f"layers.{i}.{p}", shape(cfg, lens) if shape else (t, cfg.d_model)) for i in range(cfg.n_layers) for p in parts]
    if per_request:
        rows = [(n, (length, cfg.d_model)) for length in lens for n, _ in rows]
    return [("wte", (t, cfg.d_model))] * extra + rows


def test_c12_trace_checker_accepts_the_reference_and_names_typical_mistakes():
    assert L.check_trace_prediction(_trace)
    check = L.check_trace_prediction
    assert "TP does not loop over requests" in attempt(check, lambda c, s: _trace(c, s, per_request=True))
    assert "two per layer" in attempt(check, lambda c, s: _trace(c, s, per_layer=1))
    assert "replicated" in attempt(check, lambda c, s: _trace(c, s, extra=1))
    assert "PARTIAL sum has all d_model columns" in attempt(check, lambda c, s: _trace(c, s, shape=lambda c, s: (sum(s), c.d_model // 2)))
    assert "whatever d_ffn is" in attempt(check, lambda c, s: _trace(c, s, shape=lambda c, s: (sum(s), c.d_ffn)))
    assert "order" in attempt(check, lambda c, s: list(reversed(_trace(c, s))))
    assert "(layer name, shape)" in attempt(check, lambda c, s: 16)


def test_trace_checker_stub_and_partial_marks(capsys):
    assert L.check_trace_prediction(stub) is False
    assert "not attempted" in capsys.readouterr().out
    article_only = lambda cfg, lens: _trace(ModelConfig(), lens)
    assert score(L.check_trace_prediction, article_only, points=2) == pytest.approx(0.8)
    assert score(L.check_trace_prediction, _trace, points=2) == 2


# --- exercise 04.2 ----------------------------------------------------------------------------------------

def _row(x, w, b, group, *, bias_first=False, reduce=True, bias=True, rank0_bias=False):
    if bias_first and b is not None:
        y = x @ w.T + b
    elif rank0_bias and b is not None:
        y = x @ w.T + (b if group.rank == 0 else 0)
    else:
        y = x @ w.T
    if reduce:
        y = group.all_reduce(y, layer="t")
    if b is not None and bias and not bias_first and not rank0_bias:
        y = y + b
    return y


def test_c12_row_parallel_checker_accepts_both_right_answers():
    assert L.check_row_parallel(_row)
    assert L.check_row_parallel(lambda x, w, b, g: _row(x, w, b, g, rank0_bias=True))


def test_c12_row_parallel_checker_names_typical_mistakes():
    check = L.check_row_parallel
    msg = attempt(check, lambda x, w, b, g: _row(x, w, b, g, bias_first=True))
    assert "(tp - 1) x bias" in msg and "trace is the same" in msg
    assert "never called group.all_reduce" in attempt(check, lambda x, w, b, g: _row(x, w, b, g, reduce=False))
    assert "bias is missing" in attempt(check, lambda x, w, b, g: _row(x, w, b, g, bias=False))
    assert "expected a tensor" in attempt(check, lambda x, w, b, g: None)


def test_row_parallel_checker_stub_and_partial_marks(capsys):
    assert L.check_row_parallel(stub) is False
    assert "not attempted" in capsys.readouterr().out
    got = score(L.check_row_parallel, lambda x, w, b, g: _row(x, w, b, g, bias_first=True), points=2)
    assert 0 < got < 2  # right at TP=1 and without a bias, wrong elsewhere
    assert re.search(r"[\d.]+ of 2 points \(2 of 6 cases right\)", capsys.readouterr().out)
