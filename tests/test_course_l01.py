"""Lesson 01's module: the figures, the flat-batch explorer and the exercise checkers."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import attempt, by_class, gids, png_of, stub

from lessons_lib.core import batch as core_batch
from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer
from lessons_lib.course import l01_flat_batch as L
from lessons_lib.course.grading import score
from lessons_lib.measure import padding
from lessons_lib.measure.tolerance import float64_twin

# ---- figures --------------------------------------------------------------------------------------

def test_c2_padded_vs_flat_draws_real_and_pad_spans_and_the_cells_padding_adds():
    fig = L.padded_vs_flat([10, 30])
    drawn = gids(fig)
    assert {"real-0", "real-1", "pad-0", "useful-0", "wasted-0", "useful-1", "wasted-1"} <= set(drawn)
    assert "pad-1" not in drawn  # B is the longest: nothing to pad
    top, bottom, cells = fig.axes
    pad = next(p for p in top.patches if p.get_gid() == "pad-0")
    assert (pad.get_x(), pad.get_width()) == (10, 20)
    useful = next(p for p in cells.patches if p.get_gid() == "useful-0")
    wasted = next(p for p in cells.patches if p.get_gid() == "wasted-0")
    assert (useful.get_height(), wasted.get_height()) == (100, 800)
    assert list(bottom.get_xticks()) == [0, 10, 40]
    assert "60 rows computed, 40 useful, 20 pad" in top.get_title()


def test_padded_vs_flat_draws_many_requests_and_refuses_none():
    fig = L.padded_vs_flat([3] * 40 + [50])
    assert "first 16 of 41" in fig.axes[0].get_title()
    with pytest.raises(ValueError):
        L.padded_vs_flat([])


def test_c3_flat_positions_restart_at_every_boundary():
    fig = L.flat_positions([10, 30])
    ax = fig.axes[0]
    assert sorted(g for g in gids(fig) if g.startswith("cu-")) == ["cu-0", "cu-1", "cu-2"]
    heights = [round(p.get_height() + p.get_y()) for p in ax.patches if (p.get_gid() or "").startswith("positions-")]
    assert heights == list(range(10)) + list(range(30))
    assert "max_seqlen = 30" in " ".join(t.get_text() for t in ax.texts)


# ---- the explorer ---------------------------------------------------------------------------------

def test_c2_c3_flat_run_state_runs_the_model_both_ways():
    s = L.flat_run_state([3, 17, 5])
    # What pack built, against an independent reading of the requests
    requests = L.request_ids([3, 17, 5])
    assert s["flat"]["input_ids"] == [t for r in requests for t in r.tolist()]
    assert s["flat"]["positions"] == list(range(3)) + list(range(17)) + list(range(5))
    assert (s["flat"]["cu_seqlens"], s["flat"]["cu_dtype"], s["flat"]["max_seqlen"]) == ([0, 3, 20, 25], "int32", 17)
    # What the recorder saw: every linear layer on R x S rows padded, on T rows flat
    assert s["padded_shape"] == [3, 17] and s["rows"] == {"padded": 51, "flat": 25} and s["pad_rows"] == 26
    assert s["cells"] == {"padded": 3 * 17 * 17, "flat": 9 + 289 + 25}
    assert s["largest"]["padded"] == (3, 4, 17, 17) and s["largest"]["flat"] == (4, 17, 17)
    assert s["hidden_bytes"] == {"padded": 51 * 64 * 4, "flat": 25 * 64 * 4}
    assert s["input_bytes"] == {"padded": 51 * 8 + 51, "flat": 25 * 8 * 2 + 4 * 4}
    assert max(s["diff"]["flat"]) < 1e-5 and max(s["diff"]["padded"]) <= max(s["bound"])
    assert s["differs"] == {"flat": [], "padded": []}


def test_c2_flat_run_state_records_what_padding_wastes_in_flops():
    from lessons_lib.measure.flops import forward_flops
    cfg = L.EXPLORER_CONFIG
    for lens, pad_to in (([10, 30], None), ([5, 500], None), ([20, 20, 20], 128)):
        s = L.flat_run_state(lens, pad_to)
        width = pad_to or max(lens)
        # recorded FLOPs against measure.flops' prediction: padded = R requests of the padded length
        for key, want in (("flat", forward_flops(cfg, lens)), ("padded", forward_flops(cfg, [width] * len(lens)))):
            assert s["flops"][key] == {"linear": want.linear, "attention": want.attention}, (lens, key)
        assert s["waste"]["linear"] == s["pad_rows"] * (s["flops"]["flat"]["linear"] // s["rows"]["flat"])
    assert L.flat_run_state([20, 20, 20])["waste"] == {"linear": 0, "attention": 0}
    # the notebook's tour: at width 64, A and B's pad rows waste ~9.6x A's attention; 5, 500 turns it around
    ab, long = L.flat_run_state([10, 30]), L.flat_run_state([5, 500])
    assert 9.5 < ab["waste"]["linear"] / ab["waste"]["attention"] < 9.7
    assert long["waste"]["attention"] > long["waste"]["linear"]
    assert round(long["waste"]["attention"] / 1e6) == 128 and round(long["waste"]["linear"] / 1e6) == 97
    # padding waste: attention wins when S + L > 6 d, not when S > 6 d (recorded at d = 64)
    for n, wins in ((84, False), (85, True)):
        w = L.flat_run_state([300, n])["waste"]
        assert (w["attention"] > w["linear"]) is wins, (n, w)
    assert L.flat_run_state([300, 84])["waste"]["attention"] == L.flat_run_state([300, 84])["waste"]["linear"]
    tour = L.flat_run_state([300, 300, 300, 120])
    assert tour["crossover"]["waste_from"] == 85 and tour["waste"]["attention"] > tour["waste"]["linear"]
    assert (round(tour["waste"]["attention"] / 1e5), round(tour["waste"]["linear"] / 1e5)) == (387, 354)
    assert "crossover" in {p.get_gid() for ax in L.flat_run_figure(tour).axes for p in ax.get_lines()}
    assert "S + L > 6 d = 384: here from L = 85 on" in L.flat_run_text(tour)["padded"]
    assert "here no request does" in L.flat_run_text(ab)["padded"]
    text = L.flat_run_text(long)["padded"]
    assert "in the linear layers and 127.99 MFLOP in attention (linear / attention waste = 0.76x)" in text
    assert ("reach its own linear FLOPs at S = 384 (whole blocks, 6 d) or 767 (causal triangle, about 12 d: a tiled kernel "
            "only for S much longer than its tile; it runs whole tiles); your longest: 500") in text
    gids = {p.get_gid() for ax in L.flat_run_figure(long).axes for p in ax.get_lines()}
    assert "crossover" in gids and "crossover" not in {p.get_gid() for ax in L.flat_run_figure(ab).axes for p in ax.get_lines()}


def test_flat_run_state_pads_to_a_length_and_on_the_left():
    wide = L.flat_run_state([3, 17, 5], pad_to=32)
    assert wide["padded_shape"] == [3, 32] and wide["rows"]["padded"] == 96 and wide["pad_rows"] == 71
    assert wide["differs"]["padded"] == []
    left = L.flat_run_state([3, 17, 5], side="left")
    # forward_padded numbers columns 0..S-1: the requests with pads in front get shifted positions; B has none
    assert min(left["diff"]["padded"][i] for i in (0, 2)) > 1e-2
    text = L.flat_run_text(left)["alone"]
    assert "padded NO" in text and "left padding" in text
    # differs: the requests with a pad slot in front (shorter than S), judged by running them, not by their length
    assert left["differs"] == {"padded": [i for i, n in enumerate([3, 17, 5]) if n < 17], "flat": []}
    assert "differ from themselves alone (outlined in the figure): padded A, C | flat none" in text
    wide_left = L.flat_run_state([3, 17, 5], pad_to=32, side="left")  # now B has pad slots in front too
    assert wide_left["differs"]["padded"] == [0, 1, 2] and wide_left["differs"]["flat"] == []
    assert "padded A, B, C | flat none" in L.flat_run_text(wide_left)["alone"]
    assert "padded none | flat none" in L.flat_run_text(wide)["alone"]
    for bad, match in ((dict(pad_to=10), "pad_to must be an int >= the longest request"),
                       (dict(side="middle"), "side must be"), (dict(pad_to=600), "padded length 600 exceeds max_position=512")):
        with pytest.raises(ValueError, match=match):
            L.flat_run_state([3, 17, 5], **bad)
    with pytest.raises(ValueError, match="at most 1024 tokens in all"):
        L.flat_run_state([500, 500, 100])
    with pytest.raises(ValueError, match="a request of 600 tokens exceeds max_position=512"):
        L.flat_run_state([600, 3])


def test_flat_batch_explorer_follows_the_inputs_and_reports_bad_input():
    box = L.flat_batch_explorer()
    w = by_class(box)
    assert {"fbx-lengths", "fbx-pad-to", "fbx-side", "fbx-flat", "fbx-counts", "fbx-alone", "fbx-figure"} <= set(w)
    assert "cu_seqlens [0, 3, 20, 25] (int32)" in w["fbx-flat"].value
    assert "pad rows computed 26" in w["fbx-counts"].value
    png = png_of(w["fbx-figure"])
    w["fbx-lengths"].value = "5, 7, 20"
    assert "cu_seqlens [0, 5, 12, 32]" in w["fbx-flat"].value and "pad rows computed 28" in w["fbx-counts"].value
    assert png_of(w["fbx-figure"]) != png
    w["fbx-pad-to"].value = "64"
    assert "padded 192 | flat 32 | pad rows computed 160" in w["fbx-counts"].value
    w["fbx-side"].value = "left"
    assert "padded NO" in w["fbx-alone"].value
    w["fbx-lengths"].value = "5, x"
    assert "fbx-error" in w["fbx-counts"]._dom_classes and "not a whole number" in w["fbx-counts"].value
    w["fbx-lengths"].value = "80, 5"
    assert "pad_to must be an int" in w["fbx-counts"].value
    w["fbx-lengths"].value = "20, 20"
    assert "fbx-error" not in w["fbx-counts"]._dom_classes and "pad rows computed 88" in w["fbx-counts"].value


def test_flat_run_figure_draws_the_pad_spans_on_the_chosen_side():
    def spans(ax, prefix):
        return {p.get_gid(): (p.get_x(), p.get_y(), p.get_width()) for p in ax.patches
                if (p.get_gid() or "").startswith(prefix)}
    left = L.flat_run_figure(L.flat_run_state([3, 17, 5], side="left"))
    top = left.axes[0]
    assert {g: (x, w) for g, (x, y, w) in spans(top, "pad").items()} == {"pad-0": (0, 14), "pad-2": (0, 12)}
    assert {g: x for g, (x, y, w) in spans(top, "real").items()} == {"real-0": 14, "real-1": 0, "real-2": 12}
    right = L.flat_run_figure(L.flat_run_state([3, 17, 5]))
    assert {g: x for g, (x, y, w) in spans(right.axes[0], "pad").items()} == {"pad-0": 3, "pad-2": 5}
    assert "51 rows computed (recorded), 26 of them pad" in top.get_title()
    # the requests that differ from themselves alone are outlined on their own row; nothing on the right or the flat strip
    outlined, rows = spans(top, "differs"), spans(top, "real")
    assert set(outlined) == {"differs-padded-0", "differs-padded-2"}
    assert all(abs(outlined[f"differs-padded-{i}"][1] - rows[f"real-{i}"][1]) < 0.5 for i in (0, 2))
    assert [t.get_text() for t in top.get_yticklabels()] == ["A (3) ≠ alone", "B (17)", "C (5) ≠ alone"]
    assert "outlined, 2 of 3: output differs from the request run alone" in top.get_title()
    assert not [g for ax in right.axes + [left.axes[1]] for g in spans(ax, "differs")]
    assert "every request's output = the request run alone" in left.axes[1].get_title()
    broken = dict(L.flat_run_state([3, 17, 5]), differs={"padded": [], "flat": [1]})  # what a broken engine would show
    assert [(x, w) for x, y, w in spans(L.flat_run_figure(broken).axes[1], "differs-flat-1").values()] == [(3, 17)]
    many = L.flat_run_figure(L.flat_run_state([5] * 32, pad_to=128, side="left"))
    assert "(16 of 32 drawn)" in many.axes[0].get_title() and len(many.axes[0].get_yticklabels()) == 16
    assert list(right.axes[1].get_xticks()) == [0, 3, 20, 25]
    tight = L.flat_run_figure(L.flat_run_state([5, 500])).axes[1]  # 0 and 5 would overlap: 5 is left unlabelled
    assert [t.get_text() for t in tight.get_xticklabels()] == ["0", "", "505"]


def test_float64_twin_holds_the_same_weights():
    model = Transformer(ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=50,
                                    max_position=16), seed=0)
    twin = float64_twin(model)
    assert twin.dtype == torch.float64
    assert torch.equal(twin.wte, model.wte.double()) and torch.equal(twin.layers[0].mlp.fc_up.weight,
                                                                     model.layers[0].mlp.fc_up.weight.double())


# ---- exercise checkers -----------------------------------------------------------------------------

def _wrong(lens, bug, k):
    if bug == "late":
        return {k}
    return {k} if lens[k - 1] == 1 else {k - 1, k}


def test_c3_wrong_requests_are_measured_by_running_the_engine():
    # Measured, not derived: the engine's outputs decide, and they follow the causal argument
    for lens, bug, k in L.WRONG_CASES:
        got = padding.wrong_requests(L.explorer_models()[0], L.request_ids(lens), bug, k)[0]
        assert got == _wrong(lens, bug, k), (lens, bug, k)


def test_c3_sampled_rows_a_server_trusting_a_moved_boundary_reads_both_neighbours_wrong():
    model = L.explorer_models()[0]
    for lens, bug, k in L.WRONG_CASES:
        got = padding.sampled_rows(model, L.request_ids(lens), bug, k)
        cu = padding.broken_pack(L.request_ids(lens), bug, k).cu_seqlens.tolist()
        assert got["cu_seqlens"] == cu
        assert got["rows"] == [b - 1 if b > a else None for a, b in zip(cu, cu[1:])]
        # both neighbours of the moved boundary sample a wrong row (the emptied one-token request has none);
        # every other request samples its own last row, within its bound
        assert got["wrong"] == {k - 1, k}, (lens, bug, k)
        for i in set(range(len(lens))) - {k - 1, k}:
            assert got["diff"][i] <= got["bound"][i]
        # what they sample is the last row of the request the moved boundary made, run alone
        for i, (d, b) in enumerate(zip(got["moved_diff"], got["moved_bound"])):
            assert (d is None) == (cu[i + 1] == cu[i]) and (d is None or d <= b), (lens, bug, k, i)
    emptied = padding.sampled_rows(model, L.request_ids([1, 8, 3]), "early", 1)
    assert emptied["rows"][0] is None and emptied["diff"][0] is None
    # the rows of request k-1 at its TRUE boundaries are right when late (01.1), its sampled row is not
    assert 0 not in padding.wrong_requests(model, L.request_ids([10, 30]), "late", 1)[0]
    late = padding.sampled_rows(model, L.request_ids([10, 30]), "late", 1)
    assert late["rows"] == [10, 39] and late["diff"][0] > 1000 * late["bound"][0]


def test_c3_wrong_requests_checker(capsys):
    assert L.check_wrong_requests(_wrong)
    assert L.check_wrong_requests(stub) is False and "not attempted yet" in capsys.readouterr().out
    both = attempt(L.check_wrong_requests, lambda lens, bug, k: {k - 1, k})
    assert "are unchanged" in both and "causal attention" in both and "would still sample it" in both
    single = attempt(L.check_wrong_requests, lambda lens, bug, k: {k} if bug == "late" else {k - 1, k})
    assert "has one token" in single
    assert "numbered 0.." in attempt(L.check_wrong_requests, lambda lens, bug, k: {len(lens)})
    assert "set of request indices" in attempt(L.check_wrong_requests, lambda lens, bug, k: "k")
    capsys.readouterr()
    # Forgetting the one-token case costs exactly one of the seven cases
    assert score(L.check_wrong_requests, lambda lens, bug, k: {k} if bug == "late" else {k - 1, k}, points=7) == 6
    assert "has one token" in capsys.readouterr().out


def _grouping(lens, cap):
    """A test-side answer: longest first, every way to cut that order into ceil(R / cap) runs of <= cap."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    need = math.ceil(len(lens) / cap)

    def cuts(rest, left):
        if not rest:
            return [[]] if left == 0 else []
        return [[rest[:k]] + more for k in range(1, min(cap, len(rest)) + 1) for more in cuts(rest[k:], left - 1)]
    return min(cuts(order, need), key=lambda part: sum(padding.pad_rows([lens[i] for i in g]) for g in part))


def _by_arrival(lens, cap):
    return [list(range(i, min(i + cap, len(lens)))) for i in range(0, len(lens), cap)]


def _longest_first_full(lens, cap):
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    return [order[i:i + cap] for i in range(0, len(order), cap)]


def test_c2_grouping_checker(capsys):
    # hand-counted: 100 alone and the three 1s together pad nothing; 30/29/31 and 5/6/7 pad 2 + 2 rows
    assert padding.fewest_pad_rows((100, 1, 1, 1), 3)[0] == 0
    assert padding.fewest_pad_rows((5, 30, 7, 29, 6, 31), 3)[0] == (31 * 3 - 90) + (7 * 3 - 18)
    assert L.check_grouping(_grouping)
    assert L.check_grouping(stub) is False
    assert "where you cut matters" in attempt(L.check_grouping, _longest_first_full)
    assert "pays for that length" in attempt(L.check_grouping, lambda lens, cap: _by_arrival(lens, cap) if lens == [9, 2, 8, 3, 7]
                                             else _grouping(lens, cap))
    assert "exactly once" in attempt(L.check_grouping, lambda lens, cap: [[n] for n in lens])
    assert "need only" in attempt(L.check_grouping, lambda lens, cap: [[i] for i in range(len(lens))])
    assert "1..3 requests" in attempt(L.check_grouping, lambda lens, cap: [list(range(len(lens))), []])
    capsys.readouterr()
    earned = score(L.check_grouping, _by_arrival, points=len(L.GROUPING_CASES))
    assert 0 < earned < len(L.GROUPING_CASES) and "is possible" in capsys.readouterr().out
    assert padding.pad_rows([10, 30]) == 20


def _unpad_ids(ids, mask, columns=False, first_l=False, by_id=False, keep=False, cu_dtype=torch.int32):
    real = (ids != 0) if by_id else mask
    lens = real.sum(1)
    cu = torch.zeros(len(lens) + 1, dtype=cu_dtype)
    cu[1:] = torch.cumsum(lens, 0)
    if keep:
        return ids.flatten(), torch.arange(ids.numel()), cu
    flat = torch.cat([ids[b, :int(n)] for b, n in enumerate(lens)]) if first_l else ids[real]
    pos = torch.arange(ids.shape[1]).expand_as(ids)[real] if columns else torch.cat([torch.arange(int(n)) for n in lens])
    return flat, pos, cu


def test_c3_unpad_ids_checker(capsys):
    assert L.check_unpad_ids(_unpad_ids)
    assert L.check_unpad_ids(stub) is False
    cols = attempt(L.check_unpad_ids, lambda i, m: _unpad_ids(i, m, columns=True))
    assert "engine refuses" in cols and "not the column" in cols
    assert "LEFT" in attempt(L.check_unpad_ids, lambda i, m: _unpad_ids(i, m, first_l=True))
    assert "a real token can have id 0" in attempt(L.check_unpad_ids, lambda i, m: _unpad_ids(i, m, by_id=True))

    def ids_by_id(ids, mask):  # ids kept where ids != 0, boundaries from the mask: the engine refuses the counts
        flat, pos, cu = _unpad_ids(ids, mask)
        return ids[ids != 0], pos, cu
    refused = attempt(L.check_unpad_ids, ids_by_id)
    assert "engine refuses" in refused and "a real token can have id 0" in refused, refused
    assert "still holds the pad tokens" in attempt(L.check_unpad_ids, lambda i, m: _unpad_ids(i, m, keep=True))
    assert "int32" in attempt(L.check_unpad_ids, lambda i, m: _unpad_ids(i, m, cu_dtype=torch.int64))
    assert "three tensors" in attempt(L.check_unpad_ids, lambda i, m: (i, m))

    def with_pack(ids, mask):  # the exercise forbids pack: the checker refuses it, then gives it back
        b = core_batch.pack([ids[r][mask[r]] for r in range(ids.shape[0])])
        return b.input_ids, b.positions, b.cu_seqlens
    assert "pack is switched off" in attempt(L.check_unpad_ids, with_pack)
    assert core_batch.pack is pack and len(pack([torch.tensor([1, 2])]).input_ids) == 2
    capsys.readouterr()
    # Taking the first L columns is right on the two right-padded batches only (the mixed one has a left row)
    assert score(L.check_unpad_ids, lambda i, m: _unpad_ids(i, m, first_l=True), points=6) == 2
    assert "LEFT" in capsys.readouterr().out


def test_c3_figures_say_what_their_ticks_mark():
    flat = L.padded_vs_flat([10, 30]).axes[1]
    assert "thin grey lines separate the tokens" in flat.get_xlabel() and "numbered ticks are cu_seqlens" in flat.get_xlabel()
    assert "thin grey" not in L.padded_vs_flat([50, 40]).axes[1].get_xlabel()  # no token lines drawn beyond 80 rows
    assert "cu_seqlens = [0, 10, 40]" in L.flat_positions([10, 30]).axes[0].get_xlabel()


def test_c2_waste_crossover_figure_marks_s_plus_l_past_6d():
    c = ModelConfig(n_layers=2, vocab_size=1000, max_position=64)

    def lines(fig):
        return {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}
    drawn = lines(L.waste_crossover_figure(c))
    for n in (10, 1100):
        from_s = drawn[f"from-S-{n}"].get_xdata()[0]
        assert from_s + n == 6 * c.d_model + 1, (n, from_s)
        sizes = list(drawn[f"linear-{n}"].get_xdata())
        lin, att = drawn[f"linear-{n}"].get_ydata(), drawn[f"attention-{n}"].get_ydata()
        i = sizes.index(from_s)
        assert att[i] > lin[i] and att[i - 1] <= lin[i - 1]
    assert not [g for g in lines(L.waste_crossover_figure(c, (10,), 2000)) if g.startswith("from-S")]
