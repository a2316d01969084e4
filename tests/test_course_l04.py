"""course.l04_tp: what each rank computes, the trace timeline, the packing explorer, the threaded TP
group and the checkers of lesson 04 (claims C11, C12)."""
from __future__ import annotations

import re

import pytest
import torch
from helpers import attempt, by_class, min_font, png_of, stub, texts
from matplotlib.figure import Figure

from lessons_lib.core.batch import cumulative, pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.course import l04_tp as L
from lessons_lib.course.grading import score
from lessons_lib.measure.flops import attention_cells
from lessons_lib.measure.tolerance import max_abs_diff, tolerance
from lessons_lib.style import COMM, MIN_FONT
from lessons_lib.tp.dryrun import expected_trace, record_trace, trace_signature
from lessons_lib.tp.threads import tp_ranks_in_threads

SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128)


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
    fig = L.tp_trace_timeline(runs, [[8], [3, 5]], SMALL, source="a test")
    bars = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("allreduce-")]
    assert len(bars) == 2 * SMALL.n_layers and {p.get_facecolor()[:3] for p in bars} == {
        tuple(int(COMM[i:i + 2], 16) / 255 for i in (1, 3, 5))}
    assert min_font(fig) >= MIN_FONT
    text = " ".join(t.get_text() for t in texts(fig))
    assert "4 all-reduces" in text and "[8, 64]" in text and "cu_seqlens = [0, 3, 8]" in text and "(a test)" in text


def test_trace_timeline_refuses_ranks_or_packings_that_disagree():
    traces = [record_trace(SMALL, [8], rank, 2) for rank in (0, 1)]
    with pytest.raises(ValueError, match="differs"):
        L.tp_trace_timeline([[traces[0], traces[1][:-1]]], [[8]], SMALL)
    with pytest.raises(ValueError, match="differs"):  # another T: another trace
        L.tp_trace_timeline([traces, [record_trace(SMALL, [9], r, 2) for r in (0, 1)]], [[8], [9]], SMALL)
    with pytest.raises(ValueError, match="one list of per-rank traces per packing"):
        L.tp_trace_timeline([traces], [], SMALL)
    with pytest.raises(ValueError, match="at least one"):
        L.tp_trace_timeline([[[]]], [[8]], SMALL)


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
        assert s["heads"] == [(0, 3), (4, 7)] and s["tiles"] == 1 and s["grid"] == r * 4
        seen_cells.add(s["cells"])
        seen_cu.add(tuple(s["cu_seqlens"]))
    assert len(seen_cells) == 5 and len(seen_cu) == 5


def test_packing_html_formats():
    s = L.tp_packing_state(40, 3, "equal")
    trace = L.tp_trace_html(s)
    assert trace.count("<div>rank ") == 2 and "same as 1 request of 40 tokens: yes" in trace
    attn = L.tp_attention_html(s)
    assert ("R = 3 | cu_seqlens [0, 14, 27, 40] | positions 0..13, 0..12, 0..12 | max_seqlen 14 | "
            "grid 1 tile x 3 requests x 4 heads = 12 blocks") in attn
    assert "rank 1: heads 4-7, sum L_i^2 = 534 cells per head per layer, 17088 per forward" in attn
    assert isinstance(L.tp_packing_figure(s), Figure) and min_font(L.tp_packing_figure(s)) >= MIN_FONT


def test_max_seqlen_sizes_the_launch_grid_not_the_trace():
    one, two = L.tp_packing_state(300, 1), L.tp_packing_state(300, 2, "one long")
    assert (one["tiles"], one["grid"]) == (3, 12) and (two["max_seqlen"], two["tiles"], two["grid"]) == (150, 2, 16)
    assert one["trace_text"] == two["trace_text"]
    assert "grid 3 tiles x 1 request x 4 heads = 12 blocks" in L.tp_attention_html(one)
    many = L.tp_packing_state(300, 30)
    assert (many["tiles"], many["grid"]) == (1, 120)


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
    assert tokens.max == L.MAX_TOKENS > L.TILE
    tokens.value = 4  # fewer tokens than requests: R is clamped to T
    assert reqs.max == 4 and reqs.value == 4
    assert "16 × all_reduce [4, 512] float32, 8,192 B each" in trace.value


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


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_forward_on_real_ranks_gives_the_tp1_logits(tp):
    w = init_weights(VOCAB, seed=1)
    batch = pack([torch.arange(n) * 13 % 100 for n in (5, 9, 2)])
    tp1 = Transformer(VOCAB, w)
    exact = Transformer(VOCAB, w, dtype=torch.float64)
    ref, ref64 = tp1.compute_logits(tp1(batch)), exact.compute_logits(exact(batch))
    outs = tp_ranks_in_threads(tp, lambda g: L.vocab_parallel_forward(Transformer(VOCAB, w, group=g), batch))
    for logits, trace in outs:
        assert logits.shape == (16, 100) and max_abs_diff(logits, ref64) <= tolerance(ref, ref64)
        assert len(trace) == 2 + 2 * VOCAB.n_layers  # a real group records even alone (DistGroup does too)
    if tp > 1:  # the dry run on a stand-in rank asks for exactly what a real rank did
        got = [(r.op, r.layer, r.shape) for r in outs[0][1]]
        assert got == [(r.op, r.layer, r.shape) for r in L.vocab_parallel_trace(VOCAB, [5, 9, 2], tp)]
        assert got[0] == ("all_reduce", "wte", (16, 64)) and got[-1] == ("all_gather", "lm_head", (16, 100 // tp))


def test_vocab_parallel_forward_needs_each_rank_s_rows():
    """Without the embedding's all-reduce a token whose id the rank does not keep has no embedding: the
    check can fail."""
    w = init_weights(VOCAB, seed=1)
    batch = pack([torch.arange(12) * 13 % 100])
    tp1 = Transformer(VOCAB, w)
    ref = tp1.compute_logits(tp1(batch))
    rank0 = L.vocab_parallel_forward(Transformer(VOCAB, w, group=LocalGroup(0, 2)), batch)
    assert max_abs_diff(rank0, ref) > 1e-3


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

def _qkv(full, n_heads, rank, tp, *, heads=None, per_head=False, width=None):
    k = full.shape[0] // 3
    d_head, hl = k // n_heads, n_heads // tp
    heads = range(rank * hl, (rank + 1) * hl) if heads is None else heads(rank, tp, n_heads)
    if width is not None:  # d_model where k belongs
        n = width(full) // tp
        return torch.cat([p[rank * n:(rank + 1) * n] for p in full.chunk(3)])
    if per_head:
        return torch.cat([p[h * d_head:(h + 1) * d_head] for h in heads for p in full.chunk(3)])
    return torch.cat([p[h * d_head:(h + 1) * d_head] for p in full.chunk(3) for h in heads])


def test_c11_qkv_shard_checker_accepts_the_reference_and_the_engine():
    assert L.check_qkv_shard(_qkv)
    assert L.check_qkv_shard(L.engine_qkv_shard)


def test_c11_qkv_shard_checker_names_typical_mistakes():
    check = L.check_qkv_shard
    plain = lambda f, h, r, tp: f[r * (f.shape[0] // tp):(r + 1) * (f.shape[0] // tp)]
    assert "plain column-parallel cut" in attempt(check, plain)
    strided = lambda f, h, r, tp: _qkv(f, h, r, tp, heads=lambda r, tp, n: range(r, n, tp))
    assert "contiguous range" in attempt(check, strided)
    assert "interleaved head by head" in attempt(check, lambda f, h, r, tp: _qkv(f, h, r, tp, per_head=True))
    only_q = lambda f, h, r, tp: f.chunk(3)[0][r * (f.shape[0] // 3 // tp):(r + 1) * (f.shape[0] // 3 // tp)]
    assert "Q, K AND V" in attempt(check, only_q)
    assert "expected a tensor" in attempt(check, lambda f, h, r, tp: None)


def test_qkv_shard_checker_sees_d_model_used_for_k():
    """Cases where n_heads x d_head != d_model: d_model / tp rows per third is wrong there."""
    d_model_width = lambda f, h, r, tp: _qkv(f, h, r, tp, width=lambda full: full.shape[1] if full.dim() == 2 else full.shape[0] // 3)
    assert "not d_model" in attempt(L.check_qkv_shard, d_model_width)


def test_qkv_shard_checker_plugs_the_answer_into_the_model():
    """Right on every direct case but wrong inside the model: only the model case can catch it."""
    calls = []

    def right_until_the_model(full, n_heads, rank, tp):
        calls.append(tp)
        if len(calls) > len(L._QKV_CASES):  # the model: rank 1 gets rank 0's heads
            return _qkv(full, n_heads, 0, tp)
        return _qkv(full, n_heads, rank, tp)
    assert "plugged into the model" in attempt(L.check_qkv_shard, right_until_the_model)


def test_qkv_shard_checker_stub_and_partial_marks(capsys):
    assert L.check_qkv_shard(stub) is False
    assert "not attempted" in capsys.readouterr().out
    plain = lambda f, h, r, tp: f[r * (f.shape[0] // tp):(r + 1) * (f.shape[0] // tp)]
    got = score(L.check_qkv_shard, plain, points=2)
    assert 0 < got < 2  # right at tp = 1 only
    assert re.search(r"[\d.]+ of 2 points \(1 of 7 cases right\)", capsys.readouterr().out)
