"""course.l02_linear: the walk through a block, its measurements, the figures, the module-reach explorer
and the checkers of lesson 02 (claims C4, C5, C6)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import attempt, by_class, min_font, png_of, stub, texts
from matplotlib.figure import Figure

from lessons_lib import ModelConfig, faults
from lessons_lib.course import l02_linear as L
from lessons_lib.course.grading import score
from lessons_lib.measure import batch_invariance as bi
from lessons_lib.style import MIN_FONT
from lessons_lib.tp.threads import row_parallel_in_threads

# --- the walk ------------------------------------------------------------------------------------------

def test_c4_c6_forward_walk_shapes_come_from_the_config():
    steps = bi.forward_walk(ModelConfig(), [10, 30])
    assert [s.name for s in steps] == ["embed (token + position)", "LayerNorm", "QKV proj", "attention", "out proj",
                                       "residual add", "LayerNorm", "FFN-up", "GeLU", "FFN-down", "residual add"]
    by_name = {s.name: s for s in steps}
    assert by_name["QKV proj"].flat == "[40 x 512] -> [40 x 1536]"
    assert by_name["QKV proj"].per_rank == "[40 x 512] -> [40 x 768]"
    assert by_name["FFN-down"].per_rank == "[40 x 1024] -> [40 x 512] + all-reduce"
    assert [s.name for s in steps if s.reads != "row i only"] == ["attention"]
    # attention as the block calls it, the shapes measure_steps reports: fused QKV in, heads x d_head out
    assert (by_name["attention"].flat, by_name["attention"].per_rank) == ("[40 x 1536] -> [40 x 512]",
                                                                          "[40 x 768] -> [40 x 256]")
    assert by_name["out proj"].flat.startswith(by_name["attention"].flat.split(" -> ")[1])
    tp4 = {s.name: s for s in bi.forward_walk(ModelConfig(), [5], tp_size=4)}
    assert tp4["QKV proj"].per_rank == "[5 x 512] -> [5 x 384]" and tp4["out proj"].per_rank.startswith("[5 x 128]")


def test_forward_walk_figure_is_a_figure_with_readable_text():
    fig = L.forward_walk_figure(ModelConfig(), [10, 30])
    assert isinstance(fig, Figure)
    assert any("[40 x 768]" in t.get_text() for t in texts(fig))
    assert "A = 10 and B = 30 tokens" in fig._suptitle.get_text() and "[10, 30]" not in fig._suptitle.get_text()
    assert "batch of A = 1, B = 2, C = 3 and D = 4 tokens:" in L.forward_walk_figure(ModelConfig(), [1, 2, 3, 4])._suptitle.get_text()
    assert "batch of A = 7 tokens:" in L.forward_walk_figure(ModelConfig(), [7])._suptitle.get_text()
    assert min_font(fig) >= MIN_FONT


def test_c4_c5_measure_steps_finds_the_identity_except_in_attention(block_run):
    model, x, lens = block_run
    reports = L.measure_steps(bi.block_steps(model, x, lens), lens)
    for r in reports:
        assert r.err <= r.bound, r
        if r.kind == "attention":
            assert r.off_diagonal == 3 * 2 // 2 + 9 * 8 // 2 and r.cross_request == 0  # causal, inside each request
            assert r.reads == "rows ≤ i of its own request"
        else:
            assert r.off_diagonal == 0 and r.reads == "row i only"
    assert "row i only" in bi.format_reports(reports) and "A: numbers differ" in bi.rounding_lines(reports, lens)
    for r in reports:
        assert len(r.differ_per_request) == len(lens)
        # bit-identical by construction: an add is one correctly rounded operation per number (IEEE 754), and the
        # loop backend runs each request's attention with the same shapes alone as in the batch. LayerNorm's row
        # sum and GeLU's code paths are the kernel's choice: not asserted here (C4 holds them to the tolerance)
        if r.name.startswith("residual add") or r.kind == "attention":
            assert r.differ_per_request == (0, 0) and r.padded_differ == 0, r


def test_c4_the_residual_adds_are_measured_on_the_engines_block(block_run):
    model, x, lens = block_run
    with faults.injected("residual_add_off_by_one_row"):  # each add takes the sublayer output of the row before
        reports = {r.name: r for r in L.measure_steps(bi.block_steps(model, x, lens), lens)}
    for name in ("residual add 1", "residual add 2"):  # row i reads row i - 1 (row 0 row 11): twice across A | B
        assert reports[name].off_diagonal == 12 and reports[name].cross_request == 2, reports[name]
    assert reports["LayerNorm 1"].off_diagonal == 0  # the modules themselves are whole


def test_c5_measure_steps_catches_a_layer_that_mixes_rows(block_run):
    _, x, lens = block_run
    def centre(t, rows=slice(None)):  # a "layer" with statistics over the tokens
        return t - t.mean(dim=0)
    mixed = L.measure_steps([bi.BlockStep("centre", "per token", centre, centre, x, centre(x))], lens)[0]
    assert mixed.off_diagonal == 12 * 11 and mixed.cross_request == 2 * 3 * 9 and mixed.reads == "other requests too"


# --- figures -------------------------------------------------------------------------------------------

def test_dependency_maps_checks_shapes_counts_pairs_and_names_the_requests():
    eye = np.eye(40, dtype=bool)
    fig = L.dependency_maps({"per token": eye}, [10, 30])
    ax = fig.axes[0]
    assert "40 of 1600 pairs" in ax.get_title()
    assert list(ax.get_xticks()) == [0, 10, 40] and list(ax.get_xticks(minor=True)) == [5, 25]
    assert [t.get_text() for t in ax.get_xticklabels(minor=True)] == ["A", "B"]
    assert [t.get_text() for t in ax.get_yticklabels(minor=True)] == ["A", "B"]
    with pytest.raises(ValueError, match="must be"):
        L.dependency_maps({"bad": np.eye(5, dtype=bool)}, [10, 30])


def test_c6_qkv_shards_shade_each_head_by_the_rank_that_holds_it():
    from matplotlib.colors import to_hex
    cfg = ModelConfig()
    for tp in (2, 4):   # Q, K and V sections each hold heads 0..H-1; rank r holds heads [r·H/tp, (r+1)·H/tp)
        heads = L.qkv_shards(cfg, tp_size=tp).axes[0].patches
        assert [p.get_x() for p in heads] == list(range(0, 3 * cfg.qkv_dim, cfg.d_head))
        shades = [(L.LINEAR, L.LINEAR_LIGHT)[h // cfg.heads_per_rank(tp) % 2] for _ in "QKV" for h in range(cfg.n_heads)]
        assert [to_hex(p.get_facecolor()) for p in heads] == [to_hex(c) for c in shades], tp


def test_c6_qkv_shards_uses_the_palette_and_says_what_each_rank_computes():
    fig = L.qkv_shards(ModelConfig(), tokens=40)
    colors = {tuple(np.round(p.get_facecolor()[:3], 3)) for p in fig.axes[0].patches}
    from matplotlib.colors import to_rgb
    assert colors == {tuple(np.round(to_rgb(c), 3)) for c in (L.LINEAR, L.LINEAR_LIGHT)}
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["rank 0: heads 0-3, 768 extractors: [40 x 512] -> [40 x 768]",
                      "rank 1: heads 4-7, 768 extractors: [40 x 512] -> [40 x 768]"]
    assert min_font(fig) >= MIN_FONT


# --- the module-reach explorer ------------------------------------------------------------------------------

def _block_diag_causal(lens):
    t = sum(lens)
    want = np.zeros((t, t), bool)
    start = 0
    for n in lens:
        want[start:start + n, start:start + n] = np.tril(np.ones((n, n), bool))
        start += n
    return want


def test_c4_c5_c10_module_reach_measures_the_engines_modules():
    lens = [3, 5, 2]
    eye = np.eye(10, dtype=bool)
    for name in ("LayerNorm (block.ln_1)", "QKV linear (block.attn.qkv)", "out proj (block.attn.out_proj)",
                 "GeLU (block.mlp.act)", "FFN: up, GeLU, down (block.mlp)", "residual adds (block, attention's output zeroed)",
                 "BatchNorm1d, eval mode (running stats)", "yours: softmax over each row"):
        s = L.module_reach_state(name, lens)
        np.testing.assert_array_equal(s["dep"], eye, err_msg=name)
        assert (s["reads"], s["verdict"], s["other_requests"]) == ("row i only", L.SAFE, 0), name
        assert s["alone_ok"] and s["alone_differ"] == [] and s["alone_max_diff"] <= s["alone_bound"], name
    att = L.module_reach_state("attention with cu_seqlens (block.attn.core)", lens)
    np.testing.assert_array_equal(att["dep"], _block_diag_causal(lens))
    assert att["own_request"] == 3 + 10 + 1 and att["verdict"] == L.SAFE and att["reads"] == "rows ≤ i of its own request"
    one = L.module_reach_state("attention told one sequence, cu = [0, T]", lens)
    np.testing.assert_array_equal(one["dep"], np.tril(np.ones((10, 10), bool)))
    assert one["other_requests"] == 3 * 5 + 8 * 2 and one["verdict"] == L.MIXES


def test_module_reach_catches_modules_that_mix_requests():
    bn = L.module_reach_state("BatchNorm1d, training mode", [4, 6])
    assert bn["pairs"] == 100 and bn["other_requests"] == 2 * 4 * 6 and bn["verdict"] == L.MIXES
    cs = L.module_reach_state("yours: cumsum over the tokens", [4, 6])
    assert cs["other_requests"] == 6 * 4 and cs["own_request"] == 6 + 15   # B's rows read all of A's
    back = L.module_reach_state("yours: cumsum over the tokens", [6, 4])
    assert back["other_requests"] == 4 * 6
    assert L.module_reach_state("yours: mean over the tokens", [4, 6])["pairs"] == 100
    assert "mixes requests" in L.module_reach_text(cs) and "across requests 24" in L.module_reach_text(cs)


def test_module_reach_needs_both_tests_reach_alone_is_not_enough():
    """t + arange(T) and t / T read row i only, yet a request alone gets other numbers than in the batch."""
    for name, differ in (("yours: positions from the flat index, t + arange(T)", ["B"]),
                         ("yours: divide by the batch size, t / T", ["A", "B"])):
        s = L.module_reach_state(name, [10, 30])
        assert s["reach_ok"] and s["other_requests"] == 0 and s["reads"] == "row i only", name
        assert s["alone_differ"] == differ and s["alone_max_diff"] > 1e3 * s["alone_bound"], name
        assert s["verdict"] == L.MIXES and "differ: " + ", ".join(differ) in L.module_reach_text(s), name
    pos = L.module_reach_state("yours: positions from the flat index, t + arange(T)", [10, 30])
    assert pos["alone_max_diff"] == pytest.approx(10.0)   # B's rows are shifted by A's 10 rows
    bn = L.module_reach_state("BatchNorm1d, training mode", [10, 30])
    assert not bn["reach_ok"] and bn["alone_differ"] == ["A", "B"]


def test_add_reach_module_and_bad_inputs():
    L.add_reach_module("shift by one token", lambda t: torch.roll(t, 1, dims=0))
    s = L.module_reach_state("yours: shift by one token", [2, 3])
    assert s["other_requests"] == 2 and s["diagonal"] == 0   # row 2 reads row 1 (A), row 0 reads row 4 (B)
    with pytest.raises(ValueError, match="one row per input row"):
        L.add_reach_module("sum", lambda t: t.sum(0, keepdim=True))
        L.module_reach_state("yours: sum", [2, 3])
    with pytest.raises(ValueError, match="a one-token batch has no variance: BatchNorm cannot even run on it"):
        L.module_reach_state("BatchNorm1d, training mode", [1, 39])
    with pytest.raises(ValueError, match="at most 16 requests and 120 tokens"):
        L.module_reach_state("GeLU (block.mlp.act)", [100, 30])
    with pytest.raises(ValueError, match="module"):
        L.module_reach_state("nonsense", [2])
    with pytest.raises(ValueError, match="seq_lens"):
        L.module_reach_state("GeLU (block.mlp.act)", [3, 0])
    with pytest.raises(ValueError, match="name"):
        L.add_reach_module("  ", lambda t: t)
    with pytest.raises(ValueError, match="fn must be"):
        L.add_reach_module("x", 3)


def test_who_reads_whom_panels_use_one_colour_per_kind():
    panels, colors = L.who_reads_whom_panels([10, 30])
    assert list(colors.values()) == [L.OTHER, L.LINEAR, L.ATTENTION, L.ATTENTION]
    assert [int(p.sum()) for p in panels.values()] == [40, 40, 820, 520]


def test_module_reach_explorer_contract_and_callbacks():
    import ipywidgets as w
    box = L.module_reach_explorer()
    assert "mrx" in box._dom_classes
    k = by_class(box)
    pick, text, verdict, out = k["mrx-module"], k["mrx-lengths"], k["mrx-verdict"], k["mrx-figure"]
    assert isinstance(pick, w.Dropdown) and "BatchNorm1d, training mode" in pick.options
    assert isinstance(text, w.Text) and text.value == "10, 30"
    assert verdict.value == f"<div>{L.module_reach_text(L.module_reach_state(pick.value, [10, 30]))}</div>"
    first = png_of(out)
    pick.value = "LayerNorm (block.ln_1)"
    assert "safe to batch flat" in verdict.value and png_of(out) != first
    second = png_of(out)
    text.value = "3, 4, 5"
    assert "cu_seqlens [0, 3, 7, 12]" in verdict.value and png_of(out) != second
    text.value = "3, x"
    assert "mrx-error" in verdict._dom_classes and "not a whole number" in verdict.value
    text.value = "4"
    assert "mrx-error" not in verdict._dom_classes


def test_module_reach_figure_text_is_readable():
    fig = L.module_reach_figure(L.module_reach_state("yours: cumsum over the tokens", [10, 30]))
    assert "mixes requests: 300 pairs across requests, alone != batched: B" in fig._suptitle.get_text().replace("\n", " ")
    assert min_font(fig) >= MIN_FONT
    from test_figures import _agg_renderer, clipped_texts
    for name in ("yours: cumsum over the tokens", "attention told one sequence, cu = [0, T]"):
        fig = L.module_reach_figure(L.module_reach_state(name, [10, 30]))
        assert not clipped_texts(fig, _agg_renderer(fig)), name


def test_modules_that_mix_rows_are_drawn_in_their_own_colour_and_the_residual_add_is_other_work():
    kinds = {name: L.module_reach_state(name, [3, 4])["kind"] for name in (
        "BatchNorm1d, training mode", "yours: mean over the tokens", "yours: cumsum over the tokens",
        "residual adds (block, attention's output zeroed)", "yours: softmax over each row", "BatchNorm1d, eval mode (running stats)")}
    assert list(kinds.values()) == [L.MIXES_ROWS] * 3 + ["per token"] * 3, kinds
    assert L.KIND_COLORS[L.MIXES_ROWS] == L.KIND_COLORS["per token"] == L.OTHER  # grey, told apart by a hatch (not waste)
    fig = L.module_reach_figure(L.module_reach_state("yours: mean over the tokens", [3, 4]))
    assert "mixes requests" in fig.legends[0].get_texts()[0].get_text()
    assert fig.legends[0].get_patches()[0].get_hatch() == L.MIXES_HATCH
    assert {p.get_hatch() for p in fig.axes[1].patches} == {L.MIXES_HATCH}
    fig = L.module_reach_figure(L.module_reach_state("LayerNorm (block.ln_1)", [3, 4]))
    assert {p.get_hatch() for p in fig.axes[1].patches} == {None} and fig.axes[1].get_xscale() == "log"


def test_module_reach_colour_follows_the_verdict():
    """A module that passes both tests is never drawn vermillion, one that fails always is."""
    def state(name, lens):
        s = L.module_reach_state(name, lens)
        return s["verdict"], s["kind"]
    assert state("yours: cumsum over the tokens", [40]) == (L.SAFE, L.OWN_REQUEST)       # one request: safe
    assert state("BatchNorm1d, training mode", [40]) == (L.SAFE, L.OWN_REQUEST)
    assert L.KIND_COLORS[L.OWN_REQUEST] == L.OTHER
    for name in ("yours: divide by the batch size, t / T", "yours: positions from the flat index, t + arange(T)",
                 "attention told one sequence, cu = [0, T]", "yours: cumsum over the tokens"):
        assert state(name, [10, 30]) == (L.MIXES, L.MIXES_ROWS), name
    assert state("attention told one sequence, cu = [0, T]", [40]) == (L.SAFE, "attention")


def test_add_reach_module_takes_cu_seqlens_and_the_bound_has_no_floor():
    def request_mean(t, cu):   # request-aware: subtract each request's own mean
        out = torch.empty_like(t)
        for s, e in zip(cu[:-1], cu[1:]):
            out[s:e] = t[s:e] - t[s:e].mean(0)
        return out
    L.add_reach_module("request mean", request_mean)
    s = L.module_reach_state("yours: request mean", [10, 30])
    assert s["verdict"] == L.SAFE and s["kind"] == L.OWN_REQUEST and s["own_request"] == 10 * 9 + 30 * 29
    L.add_reach_module("request mean, eps kwarg", lambda t, cu, eps=0.0: request_mean(t, cu) + eps)
    assert L.module_reach_state("yours: request mean, eps kwarg", [10, 30])["verdict"] == L.SAFE
    L.add_reach_module("one arg with a default", lambda t, scale=2.0: t * scale)   # called as fn(t)
    assert L.module_reach_state("yours: one arg with a default", [3, 4])["verdict"] == L.SAFE
    L.add_reach_module("tiny t / T", lambda t: t / t.shape[0] * 1e-6)   # under an absolute floor of 1e-5 it would pass
    tiny = L.module_reach_state("yours: tiny t / T", [10, 30])
    assert tiny["verdict"] == L.MIXES and tiny["alone_differ"] == ["A", "B"]


# --- exercises -------------------------------------------------------------------------------------------

def _request_norm(x, cu, eps):
    out = torch.empty_like(x)
    for s, e in zip(cu[:-1], cu[1:]):
        rows = x[s:e]  # written out here (PyTorch's batch_norm refuses a one-token batch in training mode)
        out[s:e] = (rows - rows.mean(0)) / torch.sqrt(rows.var(0, unbiased=False) + eps)
    return out


def test_request_norm_reference_matches_pytorch_and_the_checker(capsys):
    x = torch.randn(9, 5)
    torch.testing.assert_close(L.request_norm(x, [0, 4, 9], 1e-5),
                               torch.cat([F.batch_norm(x[:4], None, None, training=True, eps=1e-5),
                                          F.batch_norm(x[4:], None, None, training=True, eps=1e-5)]))
    assert L.check_request_norm(_request_norm)
    assert "no pair across requests" in capsys.readouterr().out
    assert L.check_request_norm(stub) is False
    assert "not attempted" in capsys.readouterr().out


def _stats_over(x, cu, eps, rows_of):  # each request normalised with the statistics of rows_of(s, e)
    out = torch.empty_like(x)
    for s, e in zip(cu[:-1], cu[1:]):
        a, b = rows_of(s, e)
        rows = x[max(a, 0):b]
        out[s:e] = (x[s:e] - rows.mean(0)) / torch.sqrt(rows.var(0, unbiased=False) + eps)
    return out


def test_request_norm_checker_explains_typical_mistakes():
    def plain(x, cu, eps):  # BatchNorm over all the flat rows
        return F.batch_norm(x, None, None, training=True, eps=eps)
    assert "statistics over ALL the tokens" in attempt(L.check_request_norm, plain)
    assert score(L.check_request_norm, plain, points=2) == 0.4  # 1 of 5
    assert "LayerNorm" in attempt(L.check_request_norm, lambda x, cu, eps: F.layer_norm(x, (x.shape[1],), eps=eps))

    def no_eps(x, cu, eps):
        return torch.cat([(x[s:e] - x[s:e].mean(0)) / x[s:e].std(0, unbiased=False) for s, e in zip(cu[:-1], cu[1:])])
    assert "no eps" in attempt(L.check_request_norm, no_eps)

    def unbiased(x, cu, eps):
        return torch.cat([(x[s:e] - x[s:e].mean(0)) / torch.sqrt(x[s:e].var(0) + eps) for s, e in zip(cu[:-1], cu[1:])])
    assert "unbiased variance" in attempt(L.check_request_norm, unbiased)

    def padded(x, cu, eps):  # the lesson-01 layout: every request padded with zeros to the longest
        longest, out = max(e - s for s, e in zip(cu[:-1], cu[1:])), torch.empty_like(x)
        for s, e in zip(cu[:-1], cu[1:]):
            p = torch.cat([x[s:e], x.new_zeros(longest - (e - s), x.shape[1])])
            out[s:e] = (x[s:e] - p.mean(0)) / torch.sqrt(p.var(0, unbiased=False) + eps)
        return out
    assert "the padded layout" in attempt(L.check_request_norm, padded)
    for rows_of in (lambda s, e: (s, e + 1), lambda s, e: (s - 1, e), lambda s, e: (s + 1, e), lambda s, e: (s, e - 1)):
        assert "off by one at a request boundary" in attempt(L.check_request_norm,
                                                             lambda x, cu, eps, r=rows_of: _stats_over(x, cu, eps, r))

    def one_token_left_alone(x, cu, eps):  # a special case where the formula already gives the answer
        out = _request_norm(x, cu, eps)
        for s, e in zip(cu[:-1], cu[1:]):
            if e - s == 1:
                out[s] = x[s]
        return out
    assert "the one-token request(s) at row(s) [7] are not" in attempt(L.check_request_norm, one_token_left_alone)
    assert score(L.check_request_norm, one_token_left_alone, points=2) == 1.2  # 3 of 5: two batches hold one

    def sneaky(x, cu, eps):  # right values, but divides by the number of rows of the batch it is given
        return _request_norm(x, cu, eps) * (40 / x.shape[0] if x.shape[0] in (10, 30) else 1.0)
    assert "no row-to-row map shows" in attempt(L.check_request_norm, sneaky)

    def only_the_dep_batch_wrong(x, cu, eps):  # right values, but peeks one row past A in the A, B batch
        return _stats_over(x, cu, eps, lambda s, e: (s, e + 1)) if x.shape[1] == 16 and len(x) == 40 and \
            float(x[10:].abs().mean()) < 5 else _request_norm(x, cu, eps)
    assert "off by one at the boundary" in attempt(L.check_request_norm, only_the_dep_batch_wrong)


def _diagnose(suspect):
    per_rank, sent = suspect.run(torch.randn(5, suspect.in_features))
    if not all(torch.allclose(y, per_rank[0], atol=1e-5) for y in per_rank):
        return "all-reduce before the matmul" if sent[0] else "no all-reduce"
    zero, _ = suspect.run(torch.zeros(1, suspect.in_features))
    return "correct" if torch.allclose(zero[0][0], suspect.bias, atol=1e-5) else "bias on every rank"


def test_row_parallel_suspects_behave_as_named():
    x = torch.randn(4, 12)
    want = L.RowParallelSuspect("correct", 12, 5, 3, seed=2)
    full = F.linear(x, want._weight, want.bias)
    outs, traces = want.run(x)
    for y, trace in zip(outs, traces):   # the engine's RowParallelLinear on 3 thread ranks = the unsharded layer
        torch.testing.assert_close(y, full)
        assert [(r.op, r.shape) for r in trace] == [("all_reduce", (4, 5))]
    twice, _ = L.RowParallelSuspect("bias on every rank", 12, 5, 3, seed=2).run(x)
    torch.testing.assert_close(twice[1], full + 2 * want.bias)
    early, early_trace = L.RowParallelSuspect("all-reduce before the matmul", 12, 5, 3, seed=2).run(x)
    assert early_trace[0][0].shape == (4, 4) and not torch.allclose(early[0], early[1])
    none, none_trace = L.RowParallelSuspect("no all-reduce", 12, 5, 3, seed=2).run(x)
    assert none_trace == [[], [], []] and not torch.allclose(none[0], full)
    assert {n: _diagnose(s) for n, s in L.row_parallel_suspects().items()} == {
        "layer_1": "bias on every rank", "layer_2": "correct", "layer_3": "no all-reduce",
        "layer_4": "all-reduce before the matmul"}
    assert faults.active() == ()   # each suspect's fault is on only while it runs
    with pytest.raises(ValueError, match="x must be"):
        want.run(torch.randn(4, 11))
    with pytest.raises(ValueError, match="divisible"):
        L.RowParallelSuspect("correct", 10, 5, 3)


def test_row_parallel_diagnosis_checker_explains_wrong_rules(capsys):
    assert L.check_row_parallel_diagnosis(_diagnose)
    assert "2 x the bias" in attempt(L.check_row_parallel_diagnosis, lambda s: "correct")

    def shape_only(s):  # reads the payload shape, not whether the ranks agree
        _, sent = s.run(torch.randn(3, s.in_features))
        if not sent[0]:
            return "no all-reduce"
        if sent[0][0].shape[1] != s.out_features:
            return "all-reduce before the matmul"
        zero, _ = s.run(torch.zeros(1, s.in_features))
        return "correct" if torch.allclose(zero[0][0], s.bias, atol=1e-5) else "bias on every rank"
    message = attempt(L.check_row_parallel_diagnosis, shape_only)
    assert "ranks DISAGREE" in message and "the sum came too early" in message
    assert score(L.check_row_parallel_diagnosis, shape_only, points=2) == 2 * 7 / 8
    assert "answer one of" in attempt(L.check_row_parallel_diagnosis, lambda s: "broken")
    assert L.check_row_parallel_diagnosis(stub) is False


def test_batching_free_measures_which_int8_scales_keep_batching_free():
    free = {s: L.batching_free(lambda t, s=s: bi.fake_int8(t, s))["free"] for s in bi.QUANT_SCHEMES}
    assert free == {"per-tensor static": True, "per-tensor dynamic": False, "per-feature dynamic": False,
                    "per-token dynamic": True}


def _quantizer(scale):
    def quantize(x):
        s = scale(x)
        s = torch.where(s > 0, s, torch.ones_like(s))
        return torch.clamp(torch.round(x / s), -127, 127) * s
    return quantize


def test_int8_quantizer_checker_explains_wrong_answers(capsys):
    assert L.check_int8_quantizer(lambda x: bi.fake_int8(x, "per-token dynamic"))
    assert "a scale per token" in capsys.readouterr().out
    assert L.check_int8_quantizer(stub) is False
    for scheme in bi.QUANT_SCHEMES[:3]:
        assert f"that is the {scheme} scale" in attempt(L.check_int8_quantizer, lambda x, s=scheme: bi.fake_int8(x, s))
    # the scale servers use, but its batching measured: a static scale passes the engine test, fails the clamp
    assert score(L.check_int8_quantizer, lambda x: bi.fake_int8(x, "per-tensor static"), points=2) == 0.4  # 1 of 5
    # one scale for the whole tensor: right on one token only (a decode step), where it is the token's own max
    assert score(L.check_int8_quantizer, lambda x: bi.fake_int8(x, "per-tensor dynamic"), points=2) == 0.4
    per_token_of_the_batch_max = _quantizer(lambda x: x.abs().amax(-1, keepdim=True).max().expand(len(x), 1) / 127)
    assert "per-tensor dynamic" in attempt(L.check_int8_quantizer, per_token_of_the_batch_max)
    assert "clamped" in attempt(L.check_int8_quantizer, _quantizer(lambda x: torch.tensor(0.02)))
    assert "clamped" in attempt(L.check_int8_quantizer, _quantizer(lambda x: x.abs().mean(-1, keepdim=True) / 60))
    assert "coarser grid than needed" in attempt(L.check_int8_quantizer,
                                                 _quantizer(lambda x: x.abs().amax(-1, keepdim=True) / 63))
    # no rounding at all: on one token that is each number its own scale, i.e. a scale that changes along k
    assert "changes along the summed axis" in attempt(L.check_int8_quantizer, lambda x: x.clone())
    unrounded = torch.tensor([[1.0, 0.3, 0.011], [0.5, 0.2, 0.7]])
    assert "not on one grid" in L._int8_problem(unrounded, unrounded)

    def unguarded(x):
        s = x.abs().amax(dim=-1, keepdim=True) / 127
        return torch.clamp(torch.round(x / s), -127, 127) * s
    assert "0 / 0 = NaN" in attempt(L.check_int8_quantizer, unguarded)

    def right_values_batch_dependent(x):  # per token on the value inputs, per tensor on the engine's A, B batch
        return bi.fake_int8(x, "per-tensor dynamic" if x.shape[1] == L.REACH_CFG.d_model else "per-token dynamic")
    assert "not safe to batch flat, measured" in attempt(L.check_int8_quantizer, right_values_batch_dependent)


def test_c6_column_and_row_parallel_agree_with_the_full_layer_up_to_rounding():
    """What the split guarantees on every machine: each rank's weight is the full weight's rows of its heads
    (copied exactly), and the joined / summed outputs are within the tolerance rule of float64. Whether the
    bits match is the math library's choice of kernel path: never asserted (the notebook prints it)."""
    from lessons_lib.core.groups import LocalGroup
    from lessons_lib.core.linear import QKVParallelLinear
    from lessons_lib.measure.tolerance import tolerance
    g = torch.Generator().manual_seed(3)
    h, w, b = torch.randn(40, 512, generator=g), torch.randn(1536, 512, generator=g) / 23, torch.randn(1536, generator=g)
    full = QKVParallelLinear(512, 8, 64).load_full_(w, b)
    ranks = [QKVParallelLinear(512, 8, 64, group=LocalGroup(r, 2)).load_full_(w, b) for r in (0, 1)]
    for r, layer in enumerate(ranks):   # Q, K and V rows of heads 4r .. 4r+3
        assert torch.equal(layer.weight, torch.cat([w[s * 512 + r * 256:s * 512 + (r + 1) * 256] for s in range(3)]))
    parts = [layer.split(layer(h)) for layer in ranks]
    joined = torch.stack([torch.cat([p[i] for p in parts], dim=1) for i in range(3)])
    want64 = torch.stack(full.split(F.linear(h.double(), w.double(), b.double())))
    assert (joined.double() - want64).abs().max() <= tolerance(torch.stack(full.split(full(h))), want64)
    wo, bo = torch.randn(512, 512, generator=g) / 23, torch.randn(512, generator=g)
    outs, _ = row_parallel_in_threads(wo, bo, h, tp=2)
    exact = F.linear(h.double(), wo.double(), bo.double())
    assert all((y.double() - exact).abs().max() <= tolerance(F.linear(h, wo, bo), exact) for y in outs)


def test_module_reach_draws_test_2_row_by_row():
    """The explorer's side panel: each row's max |alone - flat|, in units of the bound, from the state."""
    s = L.module_reach_state("yours: divide by the batch size, t / T", [10, 30])
    gap = s["alone_row_diff"]
    assert gap.shape == (40,) and gap.max() == s["alone_max_diff"] and (gap > s["alone_bound"]).all()
    bars = [p.get_width() for p in L.module_reach_figure(s).axes[1].patches]
    assert len(bars) == 40 and np.allclose(bars, gap / s["alone_bound"])
    s = L.module_reach_state("yours: cumsum over the tokens", [10, 30])   # A is the prefix: A alone = A flat
    assert (s["alone_row_diff"][:10] == 0).all() and (s["alone_row_diff"][10:] > s["alone_bound"]).all()
    s = L.module_reach_state("QKV linear (block.attn.qkv)", [10, 30])
    assert (s["alone_row_diff"] <= s["alone_bound"]).all() and s["verdict"] == L.SAFE
