"""Lesson 01's module: the figures, the flat-batch explorer and the exercise checkers."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import attempt, by_class, gids, png_of, stub

from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer
from lessons_lib.course import l01_flat_batch as L
from lessons_lib.course.grading import score

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

def test_c2_c3_flat_batch_state_numbers():
    s = L.flat_batch_state([10, 30])
    assert (s["padded_rows"], s["flat_rows"], s["pad_rows"], s["max_seqlen"]) == (60, 40, 20, 30)
    assert s["cu_seqlens"] == [0, 10, 40] and s["row_ratio"] == pytest.approx(1.5)
    assert (s["attention"]["padded"].computed, s["attention"]["varlen"].computed) == (1800, 1000)
    three = L.flat_batch_state([10, 30, 5])
    assert (three["pad_rows"], three["cu_seqlens"]) == (3 * 30 - 45, [0, 10, 40, 45])
    assert L.flat_batch_html(s) != L.flat_batch_html(three)
    with pytest.raises(ValueError):
        L.flat_batch_state([])


def test_flat_batch_explorer_follows_the_lengths_and_reports_bad_input():
    box = L.flat_batch_explorer()
    w = by_class(box)
    assert {"fbx-lengths", "fbx-counts", "fbx-figure"} <= set(w)
    assert "cu_seqlens = [0, 10, 40]" in w["fbx-counts"].value
    png = png_of(w["fbx-figure"])
    w["fbx-lengths"].value = "5, 7, 20"
    assert "cu_seqlens = [0, 5, 12, 32]" in w["fbx-counts"].value and "pad 28" in w["fbx-counts"].value
    assert png_of(w["fbx-figure"]) != png
    w["fbx-lengths"].value = "5, x"
    assert "fbx-error" in w["fbx-counts"]._dom_classes and "not a whole number" in w["fbx-counts"].value
    w["fbx-lengths"].value = "20, 20"
    assert "fbx-error" not in w["fbx-counts"]._dom_classes and "pad 0" in w["fbx-counts"].value


def test_float64_twin_holds_the_same_weights():
    model = Transformer(ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=50,
                                    max_position=16), seed=0)
    twin = L.float64_twin(model)
    assert twin.dtype == torch.float64
    assert torch.equal(twin.wte, model.wte.double()) and torch.equal(twin.layers[0].mlp.fc_up.weight,
                                                                     model.layers[0].mlp.fc_up.weight.double())


# ---- exercise checkers -----------------------------------------------------------------------------

def _pack(requests, restart=True, lead_zero=True, cu_dtype=torch.int32, max_total=False):
    lens = [len(r) for r in requests]
    ids = torch.tensor([t for r in requests for t in r])
    pos = torch.cat([torch.arange(n) for n in lens]) if restart else torch.arange(sum(lens))
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=cu_dtype)
    return ids, pos, cu if lead_zero else cu[1:], sum(lens) if max_total else max(lens)


def test_c3_pack_checker(capsys):
    assert L.check_pack(_pack)
    assert L.check_pack(stub) is False and "not attempted yet" in capsys.readouterr().out
    assert "restart at 0" in attempt(L.check_pack, lambda r: _pack(r, restart=False))
    assert "starts with 0" in attempt(L.check_pack, lambda r: _pack(r, lead_zero=False))
    assert "int32" in attempt(L.check_pack, lambda r: _pack(r, cu_dtype=torch.int64))
    assert "not the total" in attempt(L.check_pack, lambda r: _pack(r, max_total=True))
    assert "must be a tensor" in attempt(L.check_pack, lambda r: ([1], [0], [0, 1], 1))
    capsys.readouterr()
    # Positions that never restart pass only the two single-request batches.
    assert score(L.check_pack, lambda r: _pack(r, restart=False), points=5) == 2
    assert "restart at 0" in capsys.readouterr().out


def _extremes(total, r):
    q, extra = divmod(total, r)
    return [total - r + 1] + [1] * (r - 1), [q + 1] * extra + [q] * (r - extra)


def test_c2_padding_extremes_checker(capsys):
    assert L.check_padding_extremes(_extremes)
    assert L.check_padding_extremes(stub) is False
    assert "at least one token" in attempt(L.check_padding_extremes, lambda t, r: ([t] + [0] * (r - 1), _extremes(t, r)[1]))
    assert "remainder" in attempt(L.check_padding_extremes, lambda t, r: (_extremes(t, r)[0], [t // r] * r))
    assert "as long as the others allow" in attempt(L.check_padding_extremes,
                                                    lambda t, r: (_extremes(t, r)[1], _extremes(t, r)[1]))
    assert "as evenly as possible" in attempt(L.check_padding_extremes,
                                              lambda t, r: (_extremes(t, r)[0], _extremes(t, r)[0]))
    capsys.readouterr()
    # An equal split is right where num_requests divides total: 4 of the 6 cases.
    earned = score(L.check_padding_extremes, lambda t, r: (_extremes(t, r)[0], [t // r] * r), points=6)
    assert earned == 4 and "remainder" in capsys.readouterr().out
    assert sum(math.ceil(t / r) * r > t for t, r in L.EXTREME_CASES) == 2
    assert L.pad_rows([10, 30]) == 20


def _unpad(padded, mask, right_only=False, keep_pads=False, cu_from_s=False, cu_dtype=torch.int32):
    if keep_pads:
        flat = padded.reshape(-1, padded.shape[-1])
    elif right_only:
        flat = torch.cat([padded[b, :int(n)] for b, n in enumerate(mask.sum(1))])
    else:
        flat = padded[mask]
    lens = [mask.shape[1]] * mask.shape[0] if cu_from_s else mask.sum(1).tolist()
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=cu_dtype)
    return flat, cu


def test_c3_unpad_checker(capsys):
    assert L.check_unpad(_unpad)
    assert L.check_unpad(stub) is False
    assert "still holds the pad rows" in attempt(L.check_unpad, lambda x, m: _unpad(x, m, keep_pads=True))
    assert "LEFT" in attempt(L.check_unpad, lambda x, m: _unpad(x, m, right_only=True))
    assert "not the padded length" in attempt(L.check_unpad, lambda x, m: _unpad(x, m, cu_from_s=True))
    assert "int32" in attempt(L.check_unpad, lambda x, m: _unpad(x, m, cu_dtype=torch.int64))
    capsys.readouterr()
    # Assuming right padding passes the three right-padded batches of five.
    assert score(L.check_unpad, lambda x, m: _unpad(x, m, right_only=True), points=5) == 3
    assert "LEFT" in capsys.readouterr().out


def test_lens_cases_stay_for_lesson_03():
    assert L.LENS_CASES[0] == [10, 30] and all(min(c) >= 1 for c in L.LENS_CASES)
    assert pack([torch.arange(n) for n in L.LENS_CASES[3]]).cu_seqlens.tolist() == [0, 7, 8, 20, 23]


def test_c3_figures_say_what_their_ticks_mark():
    flat = L.padded_vs_flat([10, 30]).axes[1]
    assert "thin white lines separate the tokens" in flat.get_xlabel() and "numbered ticks are cu_seqlens" in flat.get_xlabel()
    assert "thin white" not in L.padded_vs_flat([50, 40]).axes[1].get_xlabel()  # no token lines drawn beyond 80 rows
    assert "cu_seqlens = [0, 10, 40]" in L.flat_positions([10, 30]).axes[0].get_xlabel()
