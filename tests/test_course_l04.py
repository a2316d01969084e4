"""course.l04_tp: what each rank computes, the trace timeline, the packing explorer, the threaded TP
group and the checkers of lesson 04 (claims C11, C12)."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
from helpers import attempt, by_class, min_font, png_of, stub, texts
from matplotlib.figure import Figure

from lessons_lib import faults
from lessons_lib.core.batch import cumulative, pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer, VarlenAttention, init_weights
from lessons_lib.course import claim
from lessons_lib.course import l04_tp as L
from lessons_lib.course.grading import score
from lessons_lib.course.trace_figures import tp_trace_timeline
from lessons_lib.measure.flops import attention_cells
from lessons_lib.measure.recorder import module_io
from lessons_lib.measure.tolerance import max_abs_diff, tolerance
from lessons_lib.serve.kv_cache import PrefillKVCache
from lessons_lib.style import COMM, MIN_FONT
from lessons_lib.tp.dryrun import (
    expected_trace,
    layer0_attention,
    out_proj_partials,
    rank_layers,
    rank_partials,
    record_trace,
    trace_signature,
)
from lessons_lib.tp.kv_plan import kv_heads_for_budget
from lessons_lib.tp.threads import forward_in_threads, tp_ranks_in_threads
from lessons_lib.tp.vocab import vocab_parallel_logits

ROOT = Path(__file__).resolve().parents[1]

SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128)


# --- what each rank computes -----------------------------------------------------------------------------

def test_c12_rank_layers_of_the_article_model_per_rank_and_at_tp1():
    want = [("QKV", (40, 512), (40, 768), 512, False), ("out proj", (40, 256), (40, 512), 256, True),
            ("FFN-up", (40, 512), (40, 1024), 512, False), ("FFN-down", (40, 1024), (40, 512), 1024, True)]
    for rank in (0, 1):
        got = [(r.name, r.x, r.y, r.products, r.all_reduce) for r in rank_layers(ModelConfig(), 40, rank, 2)]
        assert got == want
    tp1 = rank_layers(ModelConfig(), 7, 0, 1)
    assert [(r.x, r.y, r.products, r.all_reduce) for r in tp1] == [
        ((7, 512), (7, 1536), 512, False), ((7, 512), (7, 512), 512, False), ((7, 512), (7, 2048), 512, False),
        ((7, 2048), (7, 512), 2048, False)]
    assert "then all-reduce" in str(rank_layers(SMALL, 3)[1]) and "no collective" in str(rank_layers(SMALL, 3)[0])


def test_c11_layer0_attention_of_each_rank_is_its_heads_of_the_tp1_attention():
    w = init_weights(SMALL, seed=2)
    batch = pack([torch.arange(n) % SMALL.vocab_size for n in (3, 9, 1)])
    full = layer0_attention(Transformer(SMALL, w), batch)
    exact = layer0_attention(Transformer(SMALL, w, dtype=torch.float64), batch)
    assert full.shape == (13, 4, 16)
    for rank in (0, 1):
        got = layer0_attention(Transformer(SMALL, w, group=LocalGroup(rank, 2)), batch)
        heads = slice(2 * rank, 2 * rank + 2)
        assert got.shape == (13, 2, 16)
        assert max_abs_diff(got, exact[:, heads]) <= tolerance(full[:, heads], exact[:, heads])
    other = layer0_attention(Transformer(SMALL, w, group=LocalGroup(1, 2)), batch)
    assert max_abs_diff(other, full[:, :2]) > 1e-3  # rank 1 does not hold heads 0-1: the check can fail


# --- the figures -------------------------------------------------------------------------------------------

def test_c11_c12_two_axes_draws_one_block_per_request_and_head_and_no_trace_count():
    fig = L.two_axes_figure([3, 5, 2], SMALL, tp=2)
    blocks = [p.get_gid() for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("block-")]
    assert sorted(blocks) == sorted(f"block-{i}-{j}" for i in range(3) for j in range(SMALL.n_heads))
    assert sum(p.get_gid() == "allreduce" for ax in fig.axes for p in ax.patches) == 1
    text = " ".join(t.get_text() for t in texts(fig))
    assert "rank 0: heads 0-1" in text and "rank 1: heads 2-3" in text and "all-reduces" not in text
    assert min_font(fig) >= MIN_FONT
    with pytest.raises(ValueError, match="divide"):
        L.two_axes_figure([4], SMALL, tp=3)


def test_c12_trace_timeline_draws_one_purple_bar_per_all_reduce_at_readable_size():
    runs = [[record_trace(SMALL, lens, rank, 2) for rank in (0, 1)] for lens in ([8], [3, 5])]
    fig = tp_trace_timeline(runs, [[8], [3, 5]], SMALL, source="a test")
    bars = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("allreduce-")]
    assert len(bars) == 2 * SMALL.n_layers and {p.get_facecolor()[:3] for p in bars} == {
        tuple(int(COMM[i:i + 2], 16) / 255 for i in (1, 3, 5))}
    assert min_font(fig) >= MIN_FONT
    text = " ".join(t.get_text() for t in texts(fig))
    assert "4 all-reduces" in text and "[8, 64]" in text and "cu_seqlens = [0, 3, 8]" in text and "(a test)" in text


def test_trace_timeline_refuses_ranks_or_packings_that_disagree():
    traces = [record_trace(SMALL, [8], rank, 2) for rank in (0, 1)]
    with pytest.raises(ValueError, match="differs"):
        tp_trace_timeline([[traces[0], traces[1][:-1]]], [[8]], SMALL)
    with pytest.raises(ValueError, match="differs"):  # another T: another trace
        tp_trace_timeline([traces, [record_trace(SMALL, [9], r, 2) for r in (0, 1)]], [[8], [9]], SMALL)
    with pytest.raises(ValueError, match="one list of per-rank traces per packing"):
        tp_trace_timeline([traces], [], SMALL)
    with pytest.raises(ValueError, match="at least one"):
        tp_trace_timeline([[[]]], [[8]], SMALL)


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
    assert L.packing_lens(40, 2, "quarter first") == [10, 30]   # the article's A and B, the explorer's default
    assert L.packing_lens(40, 3, "quarter first") == [10, 15, 15]
    with pytest.raises(ValueError, match="num_requests"):
        L.packing_lens(4, 5)
    with pytest.raises(ValueError, match="pattern"):
        L.packing_lens(40, 2, "random")


def _direct_partials(lens, rank):
    """Rank ``rank``'s layer-0 out-proj partial sums, recomputed on a LocalGroup stand-in (not threads)."""
    cfg = ModelConfig(vocab_size=1000, max_position=2048)
    model = Transformer(cfg, init_weights(cfg, seed=0), group=LocalGroup(rank, 2))
    return out_proj_partials(model, L.explorer_batch(cfg, lens))


def test_c12_packing_state_trace_stays_while_attention_inputs_and_partials_change():
    want = [trace_signature(expected_trace(ModelConfig(), 40, rank, 2)) for rank in (0, 1)]
    seen_cells, seen_cu, seen_partials = set(), set(), set()
    for r, pattern in ((1, "equal"), (2, "equal"), (3, "ramp"), (5, "one long"), (40, "equal")):
        s = L.tp_packing_state(40, r, pattern)
        lens = L.packing_lens(40, r, pattern)
        assert s["seq_lens"] == lens and s["cu_seqlens"] == cumulative(lens) and s["max_seqlen"] == max(lens)
        assert [trace_signature(t) for t in s["traces"]] == want and s["same_as_one_request"] == [True, True]
        assert s["trace_text"] == ["16 × all_reduce [40, 512] float32, 81,920 B each"] * 2
        assert s["positions"] == pack([[0] * n for n in lens]).positions.tolist()
        assert s["cells"] == attention_cells(lens, "varlen").computed and s["cells_per_rank"] == s["cells"] * 4 * 8
        assert s["heads"] == [(0, 3), (4, 7)] and s["outputs_equal"]
        assert s["sum_err"] <= s["sum_allowed"] < 1e-4
        seen_cells.add(s["cells"])
        seen_cu.add(tuple(s["cu_seqlens"]))
        seen_partials.add(tuple(s["partials"][0]))
    # the last token reads only its own request: [20, 20] and the ramp [7, 13, 20] end in the same 20-token request
    assert len(seen_cells) == 5 and len(seen_cu) == 5 and len(seen_partials) == 4
    assert L.tp_packing_state(40, 2)["partials"] == L.tp_packing_state(40, 3, "ramp")["partials"]


@pytest.mark.parametrize("t, r, pattern", [(40, 2, "equal"), (40, 40, "equal"), (23, 4, "ramp")])
def test_c12_packing_state_partials_are_each_rank_s_own_and_add_up(t, r, pattern):
    s = L.tp_packing_state(t, r, pattern)
    lens = L.packing_lens(t, r, pattern)
    direct = [_direct_partials(lens, rank) for rank in (0, 1)]
    for rank in (0, 1):
        got = torch.tensor(s["partials"][rank])
        assert max_abs_diff(got, direct[rank][t - 1, :L.SHOWN]) < 1e-5
        assert s["partial_norms"][rank] == pytest.approx(float(direct[rank][t - 1].norm()), rel=1e-5)
    assert max_abs_diff(torch.tensor(s["partials"][0]), torch.tensor(s["partials"][1])) > 1e-3  # the ranks differ
    assert (s["token"], s["token_request"], s["token_position"]) == (t - 1, r - 1, lens[-1] - 1)


def test_c12_rank_partials_are_what_thread_ranks_send_and_add_up_to_tp1():
    cfg = ModelConfig(vocab_size=1000, max_position=2048)
    weights = init_weights(cfg, seed=0)
    lens = [10, 30]
    batch = L.explorer_batch(cfg, lens)
    sent = rank_partials(cfg, weights, batch, 2)
    assert [tuple(p.shape) for p in sent] == [(40, 512), (40, 512)]
    thread = L.tp_packing_state(40, 2, "equal")  # [20, 20]: the threads' last-token partial sums, real adds
    direct = rank_partials(cfg, weights, L.explorer_batch(cfg, [20, 20]), 2)
    for rank in (0, 1):
        assert max_abs_diff(direct[rank][39, :L.SHOWN], torch.tensor(thread["partials"][rank])) < 1e-5
    tp1 = Transformer(cfg, weights)
    io = module_io(tp1, ["layers.0.attn.out_proj"], lambda: tp1(batch))
    assert max_abs_diff(sent[0] + sent[1] + tp1.layers[0].attn.out_proj.bias, io["layers.0.attn.out_proj"][1]) < 1e-5
    assert max_abs_diff(sent[0], sent[1]) > 1e-2
    four = rank_partials(cfg, weights, batch, 4)
    assert len(four) == 4 and max_abs_diff(sum(four), sent[0] + sent[1]) < 1e-5
    assert rank_partials(cfg, weights, batch, 2, dtype=torch.float64)[0].dtype == torch.float64


def test_c12_rank_partials_of_a_request_ignore_a_request_before_it_but_not_a_cut_inside_it():
    weights = init_weights(SMALL, seed=0)
    ids = torch.randint(0, SMALL.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    alone = rank_partials(SMALL, weights, pack([ids[6:]]), 2)
    after = rank_partials(SMALL, weights, pack([ids[:6], ids[6:]]), 2)
    cut = rank_partials(SMALL, weights, pack(list(ids[6:].split(7))), 2)
    for rank in (0, 1):
        assert max_abs_diff(after[rank][6:], alone[rank]) < 1e-6
        assert max_abs_diff(cut[rank][:7], alone[rank][:7]) < 1e-6       # causal: the first piece sees the same
        assert max_abs_diff(cut[rank][7:], alone[rank][7:]) > 1e-2       # the second piece lost the first 7
    with pytest.raises(ValueError):
        rank_partials(SMALL, weights, pack([ids]), 3)                  # 4 heads do not split over 3 ranks


def test_packing_state_sum_check_can_fail():
    """A rank that sent twice its partial sums would be caught by the sum row."""
    s = L.tp_packing_state(40, 2)
    rank0 = L._explorer_models(ModelConfig(vocab_size=1000, max_position=2048), 2, L.ENGINE_CUT)[0][0]
    layer = rank0.layers[0].attn.out_proj
    with torch.no_grad():
        layer.weight.mul_(2)
    try:
        bad = L.tp_packing_state(40, 2)
    finally:
        with torch.no_grad():
            layer.weight.div_(2)
    assert bad["sum_err"] > 100 * bad["sum_allowed"] and s["sum_err"] <= s["sum_allowed"]
    assert "allowed" in L.tp_ranks_html(bad) and L.tp_ranks_html(bad).endswith(": NO</div>")


def test_packing_html_formats():
    s = L.tp_packing_state(40, 3, "equal")
    trace = L.tp_trace_html(s)
    assert trace.count("<div>rank ") == 2 and "same as 1 request of 40 tokens: yes" in trace
    attn = L.tp_attention_html(s)
    assert "R = 3 | cu_seqlens [0, 14, 27, 40] | positions 0..13, 0..12, 0..12 | max_seqlen 14" in attn
    ranks = L.tp_ranks_html(s)
    assert "token 39 = request C, position 12" in ranks
    assert re.search(r"rank 1: heads 4-7 \| sum L_i\^2 = 534 cells per head per layer \(whole blocks; the causal mask "
                     r"keeps 287\), 17088 per forward \| "
                     r"out proj partial, token 39: norm \d\.\d{4} \[([+-]\d\.\d{4}, ){6}\.\.\.\]", ranks)
    assert "rank 0 + rank 1, bias once = TP=1 out proj, all 40 tokens" in ranks and ranks.endswith(": yes</div>")
    fig = L.tp_packing_figure(s)
    assert isinstance(fig, Figure) and min_font(fig) >= MIN_FONT
    with pytest.raises(ValueError, match="at most 160 tokens"):
        L.explorer_batch(ModelConfig(), [100, 100])


@pytest.mark.parametrize("cut", L.CUTS)
def test_packing_figure_at_tp1_draws_no_collectives_for_every_cut(cut):
    s = L.tp_packing_state(40, 3, tp_size=1, cut=cut)
    assert s["traces"] == [[]]  # one rank: nothing to all-reduce, and the figure must still draw
    fig = L.tp_packing_figure(s)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "no collectives" in texts and not any("all-reduces of" in t for t in texts)
    assert not any("after the all-reduce" in t or "all-reduce:" in t for t in texts)  # no sum group either
    assert min_font(fig) >= MIN_FONT
    box = L.tp_packing_explorer(tp_size=1, cut=cut)  # the explorer shows it without an error
    k = by_class(box)
    assert "no collectives" in k["tpx-trace"].value and png_of(k["tpx-figure"])
    k["tpx-num-requests"].value = 5
    assert "R = 5 |" in k["tpx-attention"].value and png_of(k["tpx-figure"])


def test_c12_packing_explorer_callbacks():
    box = L.tp_packing_explorer()
    k = by_class(box)
    tokens, reqs, pattern = k["tpx-tokens"], k["tpx-num-requests"], k["tpx-pattern"]
    trace, attn, ranks, out = k["tpx-trace"], k["tpx-attention"], k["tpx-ranks"], k["tpx-figure"]
    assert "tpx" in box._dom_classes and (tokens.value, reqs.value, pattern.value) == (40, 2, "quarter first")
    before_trace, before_attn, before_ranks, before_png = trace.value, attn.value, ranks.value, png_of(out)
    assert "cu_seqlens [0, 10, 40]" in before_attn  # the article's A = 10, B = 30
    reqs.value = 5
    assert trace.value == before_trace and attn.value != before_attn and png_of(out) != before_png
    assert ranks.value != before_ranks
    pattern.value = "one long"
    assert trace.value == before_trace and "cu_seqlens [0, 20, 25, 30, 35, 40]" in attn.value
    assert tokens.max == L.MAX_TOKENS
    tokens.value = 4  # fewer tokens than requests: R is clamped to T
    assert reqs.max == 4 and reqs.value == 4
    assert "16 × all_reduce [4, 512] float32, 8,192 B each" in trace.value


def test_c11_c12_explorer_tp_and_cut_change_the_ranks_and_can_turn_the_sum_red():
    good = {tp: L.tp_packing_state(40, 3, tp_size=tp) for tp in L.TP_SIZES}
    for tp, s in good.items():
        assert s["heads"] == [(r * 8 // tp, (r + 1) * 8 // tp - 1) for r in range(tp)]
        assert len(s["partials"]) == tp and s["sum_err"] <= s["sum_allowed"] and all(s["same_as_one_request"])
    assert good[1]["trace_text"] == ["no collectives"] and good[4]["partials"] != good[2]["partials"]
    for cut in (L.NAIVE_CUT, L.BIAS_CUT):
        bad = L.tp_packing_state(40, 3, tp_size=2, cut=cut)
        assert bad["sum_err"] > 100 * bad["sum_allowed"], cut  # the line turns red...
        assert bad["trace_text"] == good[2]["trace_text"]       # ...while the trace does not move
        assert L.tp_ranks_html(bad).endswith(": NO</div>") and "color:" in L.tp_ranks_html(bad)
    at_tp1 = L.tp_packing_state(40, 3, tp_size=1, cut=L.BIAS_CUT)  # one rank: its bias IS added once
    assert at_tp1["sum_err"] <= at_tp1["sum_allowed"]
    with pytest.raises(ValueError, match="cut must be one of"):
        L.tp_packing_state(40, 3, cut="rows")
    box = L.tp_packing_explorer()
    k = by_class(box)
    before = k["tpx-ranks"].value
    k["tpx-tp"].value = 4
    assert len(re.findall(r"<div>rank \d: heads", k["tpx-ranks"].value)) == 4 and k["tpx-ranks"].value != before
    k["tpx-cut"].value = L.NAIVE_CUT
    assert k["tpx-ranks"].value.endswith(": NO</div>")


def test_c11_c12_packing_state_per_token_errors_show_each_broken_cut_s_pattern():
    """The figure's bottom panel: every token's error after the all-reduce. Within the bound for the
    engine's cut; far above it for both broken cuts: nearly one value for every token with the bias
    on every rank (tp - 1 biases, one row), a spread of values with the wrong heads."""
    states = {cut: L.tp_packing_state(40, 3, tp_size=2, cut=cut) for cut in L.CUTS}
    for cut, s in states.items():
        errs = s["token_errors"]
        assert len(errs) == 40 and max(errs) == pytest.approx(s["sum_err"], rel=1e-12), cut
    assert max(states[L.ENGINE_CUT]["token_errors"]) <= states[L.ENGINE_CUT]["sum_allowed"]
    spread = {}
    for cut in (L.NAIVE_CUT, L.BIAS_CUT):
        errs, allowed = states[cut]["token_errors"], states[cut]["sum_allowed"]
        assert min(errs) > 100 * allowed, cut                   # every token is caught, not only the worst
        spread[cut] = (max(errs) - min(errs)) / max(errs)
    assert spread[L.BIAS_CUT] < 1e-3 < 0.1 < spread[L.NAIVE_CUT], spread
    bias = states[L.BIAS_CUT]
    assert all(e == pytest.approx(bias["extra_bias"], rel=1e-3) for e in bias["token_errors"])  # on the dotted line
    assert not all(e == pytest.approx(bias["extra_bias"], rel=0.1) for e in states[L.NAIVE_CUT]["token_errors"])
    fig = L.tp_packing_figure(states[L.NAIVE_CUT])
    stems = [c for c in fig.axes[1].collections if len(c.get_segments()) == 40]
    assert len(stems) == 1 and any("worst" in t.get_text() for t in texts(fig)) and min_font(fig) >= MIN_FONT
    assert any(t.get_text().startswith("(tp-1)·max|bias| = ") for t in texts(fig))


def test_c11_c12_control_variants_fail_the_tolerance_rule():
    w = init_weights(SMALL, seed=3)
    batch = pack([torch.arange(n) % SMALL.vocab_size for n in (4, 6)])
    tp1, exact = Transformer(SMALL, w)(batch), Transformer(SMALL, w, dtype=torch.float64)(batch)
    bound = tolerance(tp1, exact)
    for cut in L.CUTS:
        with L.cut_faults(cut):
            error = max_abs_diff(forward_in_threads(SMALL, w, batch, 2), exact)
        assert error <= bound if cut == L.ENGINE_CUT else error > 100 * bound, cut
    assert L.CAUGHT.holds(2.0) and not L.CAUGHT.holds(0.5)


# --- the model on ranks as threads (tp.threads) ----------------------------------------------------------

def test_c12_a_tp2_model_on_threads_equals_tp1():
    w = init_weights(SMALL, seed=3)
    batch = pack([torch.arange(n) % SMALL.vocab_size for n in (4, 6)])
    tp1, exact = Transformer(SMALL, w)(batch), Transformer(SMALL, w, dtype=torch.float64)(batch)
    outs = tp_ranks_in_threads(2, lambda g: Transformer(SMALL, w, group=g)(batch))
    assert torch.equal(outs[0][0], outs[1][0])
    assert max_abs_diff(outs[0][0], exact) <= tolerance(tp1, exact)
    assert len(outs[0][1]) == 2 * SMALL.n_layers


# --- the vocab-parallel forward and exercise 04.1 ---------------------------------------------------------

VOCAB = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=100, max_position=32)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_trace_is_what_real_ranks_record(tp):
    """The checker's dry run on a stand-in rank asks for exactly what a real rank of the engine's forward did."""
    w = init_weights(VOCAB, seed=1)
    batch = pack([torch.arange(n) * 13 % 100 for n in (5, 9, 2)])
    outs = tp_ranks_in_threads(tp, lambda g: vocab_parallel_logits(Transformer(VOCAB, w, group=g), batch))
    got = [(r.op, r.layer, r.shape) for r in outs[0][1]]
    assert got == [(r.op, r.layer, r.shape) for r in L.vocab_parallel_trace(VOCAB, [5, 9, 2], tp)]
    assert got[0] == ("all_reduce", "wte", (16, 64)) and got[-1] == ("all_gather", "lm_head", (16, 100 // tp))


def _vocab(cfg, lens, tp, *, blocks_per_layer=2, layers=None, wte=("all_reduce", None), head=("all_gather", None),
           per_request=False, order=False):
    if tp == 1:
        return []
    t, d, v = sum(lens), cfg.d_model, cfg.vocab_size
    parts = ("attn.qkv", "attn.out_proj", "mlp.fc_up", "mlp.fc_down") if blocks_per_layer == 4 else \
        ("attn.out_proj", "mlp.fc_down")[:blocks_per_layer] if blocks_per_layer < 3 else \
        ("attn.qkv", "attn.out_proj", "mlp.fc_down")
    n_layers = cfg.n_layers if layers is None else layers
    rows = [t] if not per_request else list(lens)
    blocks = [("all_reduce", f"layers.{i}.{p}", (n, d)) for n in rows for i in range(n_layers) for p in parts]
    out = []
    if wte[0]:
        out.append((wte[0], "wte", wte[1] or (t, d)))
    out += blocks
    if head[0]:
        out.append((head[0], "lm_head", head[1] or (t, v // tp)))
    return out[::-1] if order else out


def test_c12_vocab_trace_checker_accepts_the_reference_and_names_typical_mistakes():
    check = L.check_vocab_trace
    assert check(_vocab)
    assert "this model has cfg.n_layers = 3" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, layers=8))
    assert "column-parallel" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, blocks_per_layer=3))
    assert "TP does not loop over requests" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, per_request=True))
    assert "no collective for the embedding" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, wte=(None,)))
    assert "ADDED (all_reduce)" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, wte=("all_gather", None)))
    assert "not by columns" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, wte=("all_reduce", (sum(s), c.d_model // tp))))
    assert "no collective for the LM head" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, head=(None,)))
    assert "times the bytes" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, head=("all_reduce", (sum(s), c.vocab_size))))
    assert "what this rank contributes" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, head=("all_gather", (sum(s), c.vocab_size))))
    assert "nothing to add up" in attempt(check, lambda c, s, tp: _vocab(c, s, max(tp, 2)))
    assert "order of the forward" in attempt(check, lambda c, s, tp: _vocab(c, s, tp, order=True))
    assert "position table" in attempt(check, lambda c, s, tp: _vocab(c, s, tp) + [("all_reduce", "wpe", (1, 1))])
    assert "(op, layer, shape) triples" in attempt(check, lambda c, s, tp: 18)


def test_vocab_trace_checker_stub_and_partial_marks(capsys):
    assert L.check_vocab_trace(stub) is False
    assert "not attempted" in capsys.readouterr().out
    replicated = lambda c, s, tp: _vocab(c, s, tp, wte=(None,), head=(None,))  # the course's own model's trace
    assert score(L.check_vocab_trace, replicated, points=2) == pytest.approx(0.4)   # right only at tp = 1
    assert score(L.check_vocab_trace, _vocab, points=2) == 2


# --- exercise 04.2 ----------------------------------------------------------------------------------------

def test_c11_engine_kv_plan_is_measured_on_the_engine():
    # vLLM's rule, counted by hand: tp >= n_kv_heads -> one K/V head per rank, rank r holds head r // (tp / n_kv_heads)
    plan = L.engine_kv_plan(64, 8, 128, 80, 16, 2)
    assert plan.kv_heads == tuple((r // 2,) for r in range(16)) and plan.replicas == 2
    assert plan.q_heads[5] == (20, 21, 22, 23)
    assert plan.bytes_per_token == 2 * 1 * 128 * 80 * 2                       # K and V of one head, 80 layers, bf16
    assert L.engine_kv_plan(64, 8, 128, 80, 8, 2).bytes_per_token == plan.bytes_per_token  # no shrinking past tp = 8
    llama8 = L.engine_kv_plan(32, 8, 128, 32, 2, 2)
    assert llama8.kv_heads == ((0, 1, 2, 3), (4, 5, 6, 7)) and llama8.bytes_per_token == 65536 and llama8.replicas == 1
    assert L.engine_kv_plan(16, 1, 64, 24, 4, 2).kv_heads == ((0,),) * 4                      # multi-query
    assert L.engine_kv_plan(8, 8, 64, 8, 1, 4).bytes_per_token == 2 * 8 * 64 * 8 * 4          # tp = 1: every head


def test_engine_kv_plan_is_what_real_thread_ranks_cache():
    """The stand-in ranks (LocalGroup) cache what ranks that really all-reduce cache: a grouped-query model
    with 12 query and 4 K/V heads on 2 thread ranks, prefilled through the engine's own cache."""
    cfg = ModelConfig(n_layers=3, d_model=24, n_heads=12, n_kv_heads=4, d_head=8, d_ffn=48, vocab_size=32, max_position=16)
    weights = init_weights(cfg, seed=0)

    def run(group):
        model = Transformer(cfg, weights, group=group)
        cache = PrefillKVCache.for_model(model)
        step = cache.step(["a", "b"], [0, 0], [5, 2], [True, True])
        model(pack([torch.arange(5), torch.arange(2)]), kv_cache=step)
        step.finish()
        return cache.nbytes // 7
    per_token = [out for out, _ in tp_ranks_in_threads(2, run)]
    assert per_token == [L.engine_kv_plan(12, 4, 8, 3, 2, 4).bytes_per_token] * 2 == [2 * 2 * 8 * 3 * 4] * 2


def test_engine_kv_plan_refuses_what_the_engine_refuses():
    for args, match in (((12, 2, 64, 1, 3, 2), "multiple"), ((8, 0, 64, 1, 2, 2), "n_kv_heads"),
                        ((8, 3, 64, 1, 2, 2), "divide n_heads"), ((8, 8, 64, 1, 2, 3), "bytes_per_number")):
        with pytest.raises(ValueError, match=match):
            L.engine_kv_plan(*args)


def _reference_kv_plan(h, kv, dh, layers, tp, nb):
    """Exercise 04.2's answer, written here from the rule (the notebook's reference solution)."""
    group, local = h // kv, h // tp
    held = [sorted({q // group for q in range(r * local, (r + 1) * local)}) for r in range(tp)]
    return held, 2 * len(held[0]) * dh * layers * nb


def _kv(h, kv, dh, layers, tp, nb, *, floor=False, strided=False, k_only=False, per_layer=False, q_heads=False,
        share=False, numbers=False, zero=False):
    heads, nbytes = _reference_kv_plan(h, kv, dh, layers, tp, nb)
    if floor and tp > kv:
        heads = [[] for _ in range(tp)]
    if strided and tp < kv:
        heads = [list(range(r, kv, tp)) for r in range(tp)]
    held = len(heads[0]) or 1
    nbytes = 2 * (h // tp if q_heads else held) * dh * layers * nb
    if k_only:
        nbytes //= 2
    if per_layer:
        nbytes //= layers
    if numbers:
        nbytes //= nb
    if share and tp > kv:
        nbytes = 2 * kv * dh * layers * nb // tp
    if zero:
        nbytes = 2 * (kv // tp) * dh * layers * nb
    return heads, nbytes


def test_c11_kv_plan_checker_accepts_the_reference_and_names_typical_mistakes():
    check = L.check_kv_plan
    assert check(_kv)
    assert "REPLICATED, here on 4 ranks" in attempt(check, lambda *a: _kv(*a, floor=True))   # multi-query comes first
    assert "contiguous range" in attempt(check, lambda *a: _kv(*a, strided=True))
    k_only, numbers = attempt(check, lambda *a: _kv(*a, k_only=True)), attempt(check, lambda *a: _kv(*a, numbers=True))
    assert "K AND V" in k_only and "bytes per number" not in k_only      # told apart by a second call at 4 B
    assert "x 2 bytes per number" in numbers and "K AND V" not in numbers
    assert "every one of the" in attempt(check, lambda *a: _kv(*a, per_layer=True))
    assert "query heads: the cache holds K/V heads" in attempt(check, lambda *a: _kv(*a, q_heads=True))
    assert "cannot shrink below one head" in attempt(check, lambda *a: _kv(*a, share=True))
    assert "a replicated rank holds one whole head" in attempt(check, lambda *a: _kv(*a, zero=True))
    heads, nbytes = _reference_kv_plan(64, 8, 128, 80, 16, 2)              # 70B at tp = 16, half the bytes
    half = L._kv_problem((heads, nbytes // 2), L.engine_kv_plan(64, 8, 128, 80, 16, 2), 64, 8, 128, 80, 16, 2)
    assert half.index("cannot shrink below one head") < half.index("K AND V")   # the heads are right: replication first
    assert "expected (kv_heads, kv_bytes)" in attempt(check, lambda *a: 7)
    assert "one per rank" in attempt(check, lambda *a: ([[0]], 1))


def test_kv_plan_checker_takes_its_truth_from_the_engine(monkeypatch):
    """Break the ENGINE: its attention core repeats K and V for every query head of a group before the cache
    (outputs unchanged, the cache G times larger). The checker then refuses the right answer with the broken
    engine's own numbers: its truth is the engine, not a formula."""
    real = VarlenAttention.forward

    def repeated(self, q, k, v):
        g = q.shape[1] // k.shape[1]
        return real(self, q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))
    L.engine_kv_plan.cache_clear()
    monkeypatch.setattr(VarlenAttention, "forward", repeated)
    try:
        assert "the engine's rank 0 cache holds 262,144 B per token" in attempt(L.check_kv_plan, _kv)  # 16 heads, not 4
    finally:
        L.engine_kv_plan.cache_clear()


def test_kv_plan_checker_stub_and_partial_marks(capsys):
    assert L.check_kv_plan(stub) is False
    assert "not attempted" in capsys.readouterr().out
    got = score(L.check_kv_plan, lambda *a: _kv(*a, floor=True), points=2)
    assert 0 < got < 2  # wrong only where tp > n_kv_heads
    assert re.search(r"[\d.]+ of 2 points \(4 of 6 cases right\)", capsys.readouterr().out)


def _gqa_claim_cell() -> str:
    cells = [c for c in nbformat.read(ROOT / "notebooks" / "04_tp2_invariance.ipynb", as_version=4).cells
             if c.cell_type == "code" and c.source.startswith("# claim C11") and "engine_kv_plan" in c.source]
    assert len(cells) == 1
    return cells[0].source


def test_c11_gqa_claim_cell_holds_and_fails_with_round_robin_replicas(capsys):
    """Lesson 04's grouped-query C11 cell, run as it is: it holds on the engine, and fails when replicated K/V
    heads are dealt round-robin (shapes, bytes and replica count unchanged: only the heads-read rows catch it)."""
    source = _gqa_claim_cell()
    L.engine_kv_plan.cache_clear()
    exec(source, {"L": L, "claim": claim})
    L.engine_kv_plan.cache_clear()
    try:
        with faults.injected("kv_replicas_dealt_round_robin"), pytest.raises(AssertionError, match="C11 FAILED"):
            exec(source, {"L": L, "claim": claim})
    finally:
        L.engine_kv_plan.cache_clear()
    assert "each rank's K/V heads = those its query heads read" in capsys.readouterr().out


def test_gqa_replicas_figure_is_drawn_from_the_engine_plan(monkeypatch):
    fig = L.gqa_replicas_figure(32, 8, 128, 2, 16)
    gids = [p.get_gid() for ax in fig.axes for p in ax.patches if p.get_gid()]
    kv = [g for g in gids if g.startswith("kv-")]
    assert len([g for g in gids if g.startswith("q-")]) == 32 and len(kv) == 16
    assert sorted(kv) == sorted(f"kv-{r}-{r // 2}" for r in range(16))          # head j on ranks 2j and 2j + 1
    fake = L.KVPlan(((0,), (1,)), ((1,), (0,)), 7)                                 # whatever the plan says is drawn
    monkeypatch.setattr(L, "engine_kv_plan", lambda *a: fake)
    gids = [p.get_gid() for ax in L.gqa_replicas_figure(2, 2, 8, 1, 2).axes for p in ax.patches if p.get_gid()]
    assert sorted(gids) == ["kv-0-1", "kv-1-0", "q-0-0", "q-1-1"]
    assert min_font(L.gqa_replicas_figure(32, 8, 128, 2, 16)) >= MIN_FONT


def test_kv_heads_for_budget_is_measured_candidate_by_candidate():
    # 12 query heads of 16, 2 layers, fp32, tp = 4: per rank 2 x max(kv / 4, 1) heads x 16 x 2 layers x 4 B per token
    best, table = kv_heads_for_budget(12, 16, 2, 4, 4, num_tokens=10, budget_bytes=2 * 1 * 16 * 2 * 4 * 10)
    assert best == 4                                       # one head per rank fits; 12 (3 per rank) does not
    assert table[0] == (1, 1, 4, 2560, True)
    assert table[2][0] == 3 and "cannot split n_kv_heads=3" in table[2][1]   # the engine's refusal, not a row
    assert table[-1] == (12, 3, 1, 3 * 2560, False)
    assert kv_heads_for_budget(12, 16, 2, 4, 4, num_tokens=10, budget_bytes=2559)[0] is None
    for args, match in (((12, 16, 2, 8, 4, 10, 1), "tp=8 must divide n_heads=12"), ((12, 16, 2, 4, 3, 10, 1), "bytes_per_number")):
        with pytest.raises(ValueError, match=match):
            kv_heads_for_budget(*args)


# --- Exercise 04.4: a layout whose every GPU's cache fits ------------------------------------------------------

def _layout(h, dh, layers, gpus, nb, reqs, tokens, budget, *, tp_only=False):
    """Exercise 04.4's answer, written here from the rule: the most K/V heads, then tp <= n_kv_heads (no copies)."""
    kvs = sorted((d for d in range(1, h + 1) if h % d == 0), reverse=True)
    for kv in kvs:
        for tp in ([gpus] if tp_only else [t for t in range(1, min(kv, gpus) + 1) if gpus % t == 0 and kv % t == 0]):
            for pp in (p for p in range(1, gpus // tp + 1) if (gpus // tp) % p == 0 and layers % p == 0):
                dp = gpus // (tp * pp)
                if h % tp == 0 and reqs % dp == 0 and (tp % kv == 0 or kv % tp == 0) and \
                        2 * max(kv // tp, 1) * dh * (layers // pp) * nb * (reqs // dp) * tokens <= budget:
                    return kv, tp, pp, dp
    return None


def test_layout_cache_bytes_is_measured_on_the_engine():
    # 12 query heads, 4 K/V heads of 16, 2 layers, fp32; 6 requests of 10 tokens on tp 2 x pp 2 x dp 3
    assert L.layout_cache_bytes(12, 4, 16, 2, 4, 6, 10, 2, 2, 3) == 2 * 2 * 16 * 1 * 4 * 2 * 10
    assert L.layout_cache_bytes(12, 2, 16, 2, 4, 6, 10, 4, 1, 1) == 2 * 1 * 16 * 2 * 4 * 6 * 10   # replicated: 1 head
    for args, match in (((12, 4, 16, 2, 4, 6, 10, 2, 3, 1), "pp=3 must divide n_layers=2"),
                        ((12, 4, 16, 2, 4, 6, 10, 2, 1, 4), "dp=4 must divide num_requests=6"),
                        ((12, 4, 16, 2, 4, 6, 10, 3, 1, 1), "cannot split")):
        with pytest.raises(ValueError, match=match):
            L.layout_cache_bytes(*args)


def test_layout_checker_accepts_the_reference_and_explains_the_replication_trap():
    assert L.check_layout(_layout)
    tp_all = attempt(L.check_layout, lambda *a: _layout(*a, tp_only=True) or (1, a[3], 1, 1))
    assert "replicates each K/V head on 8 ranks" in tp_all and "data or pipeline parallelism" in tp_all
    fewer = attempt(L.check_layout, lambda *a: (w := _layout(*a)) and (w[0] // 2, *w[1:]))
    assert "but 4 fit too" in fewer
    assert "got None, but 4 K/V heads fit" in attempt(L.check_layout, lambda *a: None)
    assert "use each once" in attempt(L.check_layout, lambda *a: (4, 4, 1, 1))
    assert "must divide n_heads" in attempt(L.check_layout, lambda *a: (3, 1, 1, 8))
    assert "expected a tuple (n_kv_heads, tp, pp, dp)" in attempt(L.check_layout, lambda *a: "tp=4")


# --- Exercise 04.3: which cut is broken ----------------------------------------------------------

def _diagnose(error, bias, allowed, tp):
    if float(error.abs().max()) <= allowed:
        return L.ENGINE_CUT
    if float((error - (tp - 1) * bias.double()).abs().max()) <= allowed:
        return L.BIAS_CUT
    return L.NAIVE_CUT


def test_c11_c12_cut_evidence_is_rounding_a_bias_row_or_a_per_token_error():
    error, bias, allowed, tp = L.cut_evidence(L.ENGINE_CUT, 2, [10, 30])
    assert tuple(error.shape) == (40, 64) and error.dtype == torch.float64 and float(error.abs().max()) <= allowed
    error, bias, allowed, _ = L.cut_evidence(L.BIAS_CUT, 4, [3, 9])
    assert max_abs_diff(error, (3 * bias.double()).expand_as(error)) <= allowed < 1e-5  # tp - 1 = 3 extra biases
    error, bias, allowed, _ = L.cut_evidence(L.NAIVE_CUT, 2, [10, 30])
    assert float((error - error[0]).abs().max()) > 1e-2                                   # each token its own error
    for cut in L.CUTS:                                                                    # tp = 1: nothing to break
        error, _, allowed, _ = L.cut_evidence(cut, 1, [4, 8])
        assert float(error.abs().max()) <= allowed


def test_cut_diagnosis_checker_accepts_the_reference_and_names_typical_mistakes(capsys):
    assert L.check_cut_diagnosis(_diagnose)
    assert L.check_cut_diagnosis(stub) is False and "not attempted" in capsys.readouterr().out
    big_is_naive = attempt(L.check_cut_diagnosis, lambda e, b, a, tp: L.ENGINE_CUT if float(e.abs().max()) <= a
                           else L.NAIVE_CUT)
    assert "the same row for every token" in big_is_naive
    big_is_bias = attempt(L.check_cut_diagnosis, lambda e, b, a, tp: L.ENGINE_CUT if float(e.abs().max()) <= a
                          else L.BIAS_CUT)
    assert "differs from token to token" in big_is_bias
    tp1_broken = attempt(L.check_cut_diagnosis, lambda e, b, a, tp: L.NAIVE_CUT if tp == 1 else _diagnose(e, b, a, tp))
    assert "at tp = 1 there is nothing to cut" in tp1_broken
    assert "one of L.CUTS" in attempt(L.check_cut_diagnosis, lambda *a: "broken")
    assert "something is broken" in attempt(L.check_cut_diagnosis, lambda *a: L.ENGINE_CUT)
    assert score(L.check_cut_diagnosis, lambda e, b, a, tp: L.ENGINE_CUT if float(e.abs().max()) <= a
                 else L.NAIVE_CUT, points=2) == pytest.approx(1.5)
