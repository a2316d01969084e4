"""course.l03_attention: the score-cell pictures, the cell counter on the engine's backends, the
explorer and the checkers of lesson 03 (claims C7-C10)."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from helpers import attempt, by_class, png_of, stub, varlen_loop
from matplotlib.figure import Figure

from lessons_lib.core.attention import VarlenMetadata, attention_forward, block_diag_mask, causal_mask, varlen_attention
from lessons_lib.core.batch import seq_lens_to_cu_seqlens
from lessons_lib.course import l03_attention as L
from lessons_lib.course.explore import html_table
from lessons_lib.course.grading import score
from lessons_lib.measure.batch_invariance import reach_counts
from lessons_lib.measure.flops import attention_cells, attention_waste
from lessons_lib.measure.profile import random_qkv, recorded_cells
from lessons_lib.measure.recorder import OpRecorder
from lessons_lib.style import MIN_FONT, SKIPPED, TEXT, USEFUL, WASTED

BATCHES = [[10, 30], [3, 1, 5], [7], [1, 1], [4, 9, 2, 9]]
LINE = re.compile(r"(padded|masked|varlen): computed (\d+) \| useful (\d+) \| wasted (\d+) = "
                  r"(?:above the diagonal (\d+) \+ )?(?:pad|cross-request|outside the blocks) (\d+)")


# --- pictures ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lens", BATCHES)
@pytest.mark.parametrize("method", ["padded", "masked", "varlen"])
@pytest.mark.parametrize("causal", [False, True])
def test_c8_attention_categories_count_exactly_what_flops_counts(lens, method, causal):
    counts = np.bincount(L.attention_categories(lens, method, causal).ravel(), minlength=3)
    cells = attention_cells(lens, method, causal)
    assert (counts[USEFUL], counts[USEFUL] + counts[WASTED], counts[WASTED]) == (cells.useful, cells.computed, cells.wasted)


def test_c8_article_pictures_hold_the_article_numbers():
    grid = L.attention_categories([10, 30], "masked")
    assert grid.shape == (40, 40)
    assert (grid[:10, :10] == USEFUL).all() and (grid[10:, 10:] == USEFUL).all()
    assert (grid[:10, 10:] == WASTED).all() and (grid[10:, :10] == WASTED).all()
    assert (L.attention_categories([10, 30], "varlen")[:10, 10:] == SKIPPED).all()
    padded = L.attention_categories([10, 30], "padded")
    assert padded.shape == (60, 60) and (padded[:10, :10] == USEFUL).all() and (padded[10:30, :30] == WASTED).all()
    assert int((L.attention_categories([10, 30], "varlen", causal=True) == USEFUL).sum()) == 10 * 11 // 2 + 30 * 31 // 2


def test_attention_categories_bad_input():
    assert L.attention_categories([3, 5], "masked").dtype == np.uint8
    with pytest.raises(ValueError, match="method"):
        L.attention_categories([10, 30], "dense")
    with pytest.raises(ValueError, match="seq_lens"):
        L.attention_categories([10, 0], "masked")


@pytest.mark.parametrize("causal", [False, True])
def test_c10_attention_patterns_show_the_categories_counts_and_what_is_counted(causal):
    fig = L.attention_patterns([10, 30], causal=causal)
    axes = [ax for ax in fig.axes if ax.images]
    panels = [("padded", False), ("masked", False)] + ([("varlen", True), ("varlen", False)] if causal else [("varlen", False)])
    assert len(axes) == len(panels)
    for ax, (method, whole) in zip(axes, panels):
        np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()),
                                      L.attention_categories([10, 30], method, causal, whole_blocks=whole))
        c = attention_waste([10, 30], method, causal, whole)
        assert f"computed {c.computed} | useful {c.useful}" in ax.get_title()
        assert L.waste_text(c, method, causal).replace(" + ", " +\n") in ax.get_title()  # on two lines
        assert ax.title.get_fontsize() >= MIN_FONT
    title = fig._suptitle.get_text()
    assert "per head per layer" in title and ("causal" in title if causal else "whole blocks" in title)
    if causal:  # the two conventions of the lesson, each named in its panel
        assert "our loop" in axes[2].get_title() and "computed 1000" in axes[2].get_title() and "wasted 480 = above the diagonal 480" in axes[2].get_title()
        assert "causal kernel" in axes[3].get_title() and "computed 520" in axes[3].get_title()


def test_c10_whole_block_varlen_computes_the_blocks_and_masks_the_upper_triangles():
    grid = L.attention_categories([10, 30], "varlen", causal=True, whole_blocks=True)
    counts = np.bincount(grid.ravel(), minlength=3)
    assert (counts[USEFUL], counts[WASTED]) == (520, 480)
    assert (grid[:10, 10:] == SKIPPED).all() and (grid[0, 1:10] == WASTED).all()
    assert L.waste_text(attention_waste([10, 30], "varlen", True, True), "varlen", True) == \
        "wasted 480 = above the diagonal 480 + outside the blocks 0"
    assert L.waste_text(attention_waste([10, 30], "padded", False), "padded", False) == "wasted 800 = pad 800"
    # whole_blocks only changes the causal varlen picture
    np.testing.assert_array_equal(L.attention_categories([3, 5], "masked", True, whole_blocks=True),
                                  L.attention_categories([3, 5], "masked", True))


def test_padded_panel_frames_each_request_s_own_matrix():
    fig = L.attention_patterns([10, 30])
    padded = fig.axes[0]
    frames = [p for p in padded.patches if (p.get_gid() or "").startswith("padded-matrix-")]
    assert [(f.get_x(), f.get_y(), f.get_width()) for f in frames] == [(0, 0, 30), (30, 30, 30)]
    assert [t.get_text() for t in padded.get_xticklabels()] == ["req 0", "req 1"]
    assert "2 separate 30 x 30 matrices" in padded.get_xlabel()


def test_c9_masked_growth_lines_are_the_formulas():
    fig = L.masked_growth(8, (1, 2, 4))
    masked, varlen = fig.axes[0].lines
    assert list(masked.get_ydata()) == [(r * 8) ** 2 for r in (1, 2, 4)]
    assert list(varlen.get_ydata()) == [r * 64 for r in (1, 2, 4)]
    title = fig.axes[0].get_title()
    assert "per head per layer" in title and "R²" not in title  # the title must not answer the predict prompt


def test_measured_sweep_draws_time_and_memory():
    runs = {"masked": {"ms": [1.0, 4.0], "mib": [0.5, 2.0]}, "sdpa": {"ms": [1.0, 2.0], "mib": [0.5, 1.0]}}
    fig = L.measured_sweep([1, 2], runs, 64, "cpu")
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    for ax, key in zip(fig.axes, ("ms", "mib")):
        lines = ax.lines
        assert [list(line.get_ydata()) for line in lines[:2]] == [runs["masked"][key], runs["sdpa"][key]]
        # reference slopes 2 and 1 at half the last point (beside the data, not over it); every line in ink,
        # the backends told apart by style
        half = [runs["masked"][key][-1] / 8, runs["masked"][key][-1] / 2], [runs["sdpa"][key][-1] / 4, runs["sdpa"][key][-1] / 2]
        assert [list(line.get_ydata()) for line in lines[2:]] == list(half)
        assert all(line.get_color() == TEXT for line in lines) and [line.get_linestyle() for line in lines] == ["-", "-.", "--", "--"]
    assert "noisy" in fig.axes[0].get_title() and "memory" in fig.axes[1].get_title()
    assert "varlen (sdpa)" in [t.get_text() for t in fig.legends[0].get_texts()]


# --- what the engine computes ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, cells", [("loop", 1000), ("masked", 1600), ("padded", 1800), ("sdpa", 1000)])
def test_c8_c10_recorded_score_cells_on_the_engine_backends(backend, cells):
    q, k, v, cu = random_qkv([10, 30], n_heads=2, d_head=8)
    with OpRecorder() as seen:
        varlen_attention(q, k, v, cu, causal=False, backend=backend)
    assert seen.cells == 2 * cells


def test_c10_the_recorder_sees_each_block_and_the_matmuls():
    q, k, v, cu = random_qkv([10, 30], n_heads=1, d_head=8)
    with OpRecorder() as seen:
        varlen_attention(q, k, v, cu, backend="loop")
    assert [s[-2:] for s in seen.scores] == [(10, 10), (30, 30)] and len(seen.matmuls) == 4
    with OpRecorder() as nothing:
        torch.ones(3) + 1
    assert (nothing.cells, nothing.matmuls) == (0, [])


def test_c7_c10_attention_dependency_and_cross_pairs():
    cu = seq_lens_to_cu_seqlens([3, 5])
    assert torch.equal(L.attention_dependency([3, 5]), block_diag_mask(cu, causal=True))
    # the notebook's C7 count of pairs across requests: batch_invariance.reach_counts on the measured map
    assert reach_counts(L.attention_dependency([3, 5], backend=None, causal=False), [3, 5])["other_requests"] == 2 * 3 * 5
    assert reach_counts(L.attention_dependency([3, 5], backend=None, causal=True), [3, 5])["other_requests"] == 3 * 5


# --- the attention-run explorer ---------------------------------------------------------------------------

ROW = re.compile(r"<tr><td[^>]*>([^<]+)</td><td[^>]*>(\d+)</td><td[^>]*>(\d+)</td><td[^>]*>(\d+)</td><td[^>]*>([^<]+)</td>"
                 r"<td[^>]*>([^<]+)</td><td[^>]*>([\d.]+)</td></tr>")


def test_c8_c10_attention_run_state_measures_what_each_backend_computes_for_a_and_b():
    s = L.attention_run_state("10, 30", causal=True)
    rows = s["rows"]
    assert s["seq_lens"] == [10, 30] and s["useful"] == 55 + 465
    # the article's numbers, from the lengths by hand: whole blocks, T^2, R * Lmax^2
    assert {n: r["cells"] for n, r in rows.items()} == {"loop": 1000, "masked": 1600, "padded": 1800, "varlen": 1000}
    assert all(r["cells"] == r["predicted"] for r in rows.values())
    assert (rows["loop"]["scores"], rows["masked"]["scores"], rows["padded"]["scores"]) == (2, 1, 1)
    h = L.RUN_HEADS
    assert rows["loop"]["largest_bytes"] == 4 * h * 30 * 30          # one request's [H, 30, 30] at a time
    assert rows["masked"]["largest_bytes"] == 4 * h * 40 * 40        # the whole [H, T, T]
    assert rows["padded"]["largest_bytes"] == 4 * 2 * h * 30 * 30    # [R, H, Lmax, Lmax]
    assert rows["varlen"]["backend"] == "sdpa" and rows["varlen"]["largest_bytes"] is None
    assert all(r["error"] <= s["bound"] for r in rows.values())
    assert all(r["ms"] > 0 for r in rows.values())
    assert s["tiled"].tiles == 2 and s["tiled"].executed_cells == 2 * 128 * 128 and s["tiled"].cells == 1000


@pytest.mark.parametrize("lens", [[5], [1, 1, 1], [7, 1, 12, 3], [100, 3]])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_run_state_counts_follow_the_lengths(lens, causal):
    s = L.attention_run_state(lens, causal=causal)
    t, lmax = sum(lens), max(lens)
    want = {"loop": sum(n * n for n in lens), "masked": t * t, "padded": len(lens) * lmax * lmax,
            "varlen": sum(n * n for n in lens)}
    assert {n: r["cells"] for n, r in s["rows"].items()} == want
    assert {n: r["predicted"] for n, r in s["rows"].items()} == want
    assert s["rows"]["loop"]["scores"] == len(lens)
    assert s["useful"] == sum(n * (n + 1) // 2 if causal else n * n for n in lens)
    assert all(r["error"] <= s["bound"] for r in s["rows"].values())


def test_attention_run_state_numbers_equal_a_direct_recorder_call():
    s = L.attention_run_state("7, 1, 12", causal=False)
    q, k, v, cu = random_qkv([7, 1, 12], L.RUN_HEADS, L.RUN_D_HEAD, seed=0)
    with OpRecorder() as rec:
        varlen_attention(q, k, v, cu, causal=False, backend="masked")
    assert s["rows"]["masked"]["cells"] == rec.cells // L.RUN_HEADS == 20 * 20


@pytest.mark.parametrize("text, match", [("10, 0", "1..512"), ("", "empty"), ("10, x", "not a whole number"),
                                         ("600", "1..512"), (", ".join(["5"] * 17), "at most 16"),
                                         ("500, 500, 100", "at most 1024 tokens"), ([3, 0], "must be >= 1, got 0"),
                                         ([], "empty")])
def test_attention_run_state_rejects_bad_lengths(text, match):
    with pytest.raises(ValueError, match=match):
        L.attention_run_state(text)


def test_attention_run_html_lines_and_predicted_block():
    s = L.attention_run_state("10, 30", causal=True)
    rows = ROW.findall(L.attention_run_html(s))
    assert [r[0] for r in rows] == ["loop (one call per request)", "masked", "padded", "varlen (sdpa)"]
    assert [int(r[1]) for r in rows] == [1000, 1600, 1800, 1000]
    pred = LINE.findall(L.attention_run_predicted_html(s))
    assert pred == [("padded", "1800", "520", "1280", "480", "800"), ("masked", "1600", "520", "1080", "480", "600"),
                    ("varlen", "520", "520", "0", "0", "0")]
    summary = L.attention_run_summary_html(s)
    assert "the causal mask keeps: 520" in summary and "32768 cells executed" in summary
    assert "1000 in-bounds cells of computed tiles" in summary  # predict_work's cells, named as in lesson 07 (K4)
    assert ("measured waste outside the requests' blocks (cells computed minus the loop's 1000): masked 600 "
            "cross-request cells, padded 800 pad cells per head: padding wastes more here") in summary
    assert "the 480 cells per head above the causal diagonal inside the blocks" in summary  # 1000 - 520, on a line of its own


@pytest.mark.parametrize("lens, verdict", [([10, 30], "padding wastes more"), ([300, 5, 5, 5], "padding wastes more"), ([1, 50, 50], "masking wastes more"),
                                           ([100, 100, 100], "masking wastes more"), ([4], "a tie")])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_run_state_says_which_of_masking_and_padding_wastes_more(lens, verdict, causal):
    s = L.attention_run_state(lens, causal=causal)
    t, r, lmax = sum(lens), len(lens), max(lens)
    blocks = sum(n * n for n in lens)
    # by hand: outside the blocks, the same with or without the causal mask; its triangles on their own
    assert s["wasted"] == {"masked": t * t - blocks, "padded": r * lmax * lmax - blocks}
    assert s["causal_masked"] == (sum(n * (n - 1) // 2 for n in lens) if causal else 0)
    summary = L.attention_run_summary_html(s)
    assert verdict in summary
    assert ("above the causal diagonal" in summary) == causal


def test_equal_lengths_pad_nothing_even_with_the_causal_mask():
    s = L.attention_run_state("100, 100, 100", causal=True)
    assert s["wasted"]["padded"] == 0 and s["causal_masked"] == 3 * 100 * 99 // 2
    assert "padded 0 pad cells per head" in L.attention_run_summary_html(s)
    # the predicted block: padded's wasted cells are all the causal mask's, none padding's
    assert ("padded", "30000", "15150", "14850", "14850", "0") in LINE.findall(L.attention_run_predicted_html(s))


def test_attention_run_explorer_contract_and_callbacks():
    import ipywidgets as w
    box = L.attention_run_explorer()
    assert isinstance(box, w.VBox) and "arx" in box._dom_classes
    k = by_class(box)
    text, causal, rows, out = k["arx-lengths"], k["arx-causal"], k["arx-rows"], k["arx-figure"]
    assert isinstance(text, w.Text) and text.value == "10, 30" and isinstance(causal, w.Checkbox) and causal.value
    assert "dbx-counts" in k["arx-predicted"]._dom_classes  # the site test reads the predicted block by this name
    assert [int(r[1]) for r in ROW.findall(rows.value)] == [1000, 1600, 1800, 1000]
    first = png_of(out)
    text.value = "10, 30, 5"
    assert [int(r[1]) for r in ROW.findall(rows.value)] == [1025, 45 ** 2, 3 * 900, 1025]
    assert png_of(out) != first
    causal.value = False
    assert "useful (whole blocks): 1025" in k["arx-summary"].value
    before = rows.value
    text.value = "10, 0"
    assert "not run: lengths: every request needs 1..512 tokens, got 0" in k["arx-status"].value and rows.value == before


def test_attention_run_figure_text_inside_and_ink_guides():
    from lessons_lib.style import OTHER
    fig = L.attention_run_figure(L.attention_run_state("10, 30", causal=True))
    ax = fig.axes[0]
    assert all(line.get_color() != OTHER for line in ax.get_lines())
    state = L.attention_run_state("10, 30", causal=True)
    fig = L.attention_run_figure(state)
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear"   # stacked bars on a log axis misstate the proportions
    texts = [t.get_text().strip() for t in ax.texts]
    assert texts[::2] == ["1000", "1600", "1800", "1000"]
    assert texts[1::2][1].startswith(f"stores {L._kib(4 * L.RUN_HEADS * 40 * 40)}") and "no full score matrix" in texts[7]


# --- exercises -------------------------------------------------------------------------------------------

def _one_launch(q, k, v, cu_seqlens, max_seqlen):
    starts, lens = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    pos = torch.arange(max_seqlen)
    real, rows = pos < lens[:, None], (starts[:, None] + pos).clamp(max=q.shape[0] - 1)
    qp, kp, vp = (x[rows].transpose(1, 2) for x in (q, k, v))
    scores = (qp @ kp.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
        torch.ones(max_seqlen, max_seqlen, dtype=torch.bool).triu(1), float("-inf"))
    out, flat = (scores.softmax(-1) @ vp).transpose(1, 2), torch.empty_like(q)
    flat[rows[real]] = out[real]
    return flat


def backend(fn):
    """A test function of ``(q, k, v, cu_seqlens, max_seqlen)`` behind the engine's whole backend contract."""
    def call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None):
        return fn(q, k, v, cu_seqlens_q, max_seqlen_q)
    return call


def test_causal_varlen_checker_passes_one_launch_and_plugs_it_into_the_engine(capsys):
    assert L.check_causal_varlen(backend(_one_launch))
    assert L.check_causal_varlen(stub) is False and "not attempted" in capsys.readouterr().out


def test_causal_varlen_checker_gives_a_per_request_loop_partial_marks(capsys):
    def loop(q, k, v, cu, m):
        return varlen_loop(q, k, v, cu)
    assert "one per request" in attempt(L.check_causal_varlen, backend(loop))
    assert score(L.check_causal_varlen, backend(loop), points=3) == 2.4  # 4 of 5 cases: all but "one launch"
    assert "not grow with R" in capsys.readouterr().out


def test_causal_varlen_checker_fails_the_engines_sdpa_path_that_groups_equal_lengths(capsys):
    # sdpa batches requests of equal length into one call: with few distinct lengths its matmul count looks
    # constant, so the checker's 12-request probe uses 12 distinct lengths
    def sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None):
        return varlen_attention(q, k, v, cu_seqlens_q, causal=causal, softmax_scale=softmax_scale, backend="sdpa")
    why = attempt(L.check_causal_varlen, sdpa)
    assert "hands the attention to the engine (varlen_attention -> attention_forward -> its 'sdpa' backend" in why
    assert score(L.check_causal_varlen, sdpa, points=3) == 2.4  # right on every batch, but not one launch

    def per_length(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None):
        out, cu, (h, d) = torch.empty_like(q), cu_seqlens_q.tolist(), q.shape[1:]  # sdpa's grouping, by hand
        lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
        for n in sorted(set(lens)):
            rows = torch.cat([torch.arange(s, s + n) for s, m in zip(cu[:-1], lens) if m == n])
            qg, kg, vg = (x[rows].view(-1, n, h, d).transpose(1, 2) for x in (q, k, v))
            g = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=softmax_scale)
            out[rows] = g.transpose(1, 2).reshape(-1, h, d)
        return out
    assert "per distinct length" in attempt(L.check_causal_varlen, per_length)


def test_causal_varlen_checker_refuses_the_engines_own_backends():
    # one line that calls the engine's padded backend: one launch, fewer than T x T cells, right values;
    # the exercise asks for the launch itself, so the checker names the engine code it ran
    def padded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None):
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, backend="padded")
    why = attempt(L.check_causal_varlen, padded)
    assert "its 'padded' backend" in why and "the launch is the engine's, not yours" in why
    assert score(L.check_causal_varlen, padded, points=3) == 2.4
    def with_causal_mask(q, k, v, cu_seqlens, max_seqlen):  # the engine's mask helpers are allowed
        starts, lens = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        pos = torch.arange(max_seqlen)
        real, rows = pos < lens[:, None], (starts[:, None] + pos).clamp(max=q.shape[0] - 1)
        qp, kp, vp = (x[rows].transpose(1, 2) for x in (q, k, v))
        scores = (qp @ kp.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
            ~causal_mask(max_seqlen, max_seqlen), float("-inf"))
        out, flat = (scores.softmax(-1) @ vp).transpose(1, 2), torch.empty_like(q)
        flat[rows[real]] = out[real]
        return flat
    assert L.check_causal_varlen(backend(with_causal_mask))


def test_causal_varlen_checker_explains_typical_mistakes():
    def meta_call(causal=True, scale=None):
        def fn(q, k, v, cu, m):
            return attention_forward(q, k, v, VarlenMetadata.build(cu.tolist()), "padded", causal=causal, softmax_scale=scale)
        return fn

    def diagonal_hidden(q, k, v, cu, m):
        out, c = torch.empty_like(q), cu.tolist()
        for s, e in zip(c[:-1], c[1:]):
            sc = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]).masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(0),
                                                                          float("-inf"))
            out[s:e] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v[s:e])
        return out

    assert "no causal mask" in attempt(L.check_causal_varlen, backend(meta_call(causal=False)))
    assert "1 / sqrt(d_head)" in attempt(L.check_causal_varlen, backend(meta_call(scale=1.0)))
    assert "other requests' keys" in attempt(L.check_causal_varlen,
                                             backend(lambda q, k, v, cu, m: varlen_loop(q, k, v, cu, cross=True)))
    assert "must see ITSELF" in attempt(L.check_causal_varlen, backend(diagonal_hidden))

    def gathered_no_causal(q, k, v, cu, m):       # the one-launch gather with the causal mask forgotten
        starts, lens = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
        pos = torch.arange(m)
        real, rows = pos < lens[:, None], (starts[:, None] + pos).clamp(max=q.shape[0] - 1)
        qp, kp, vp = (x[rows].transpose(1, 2) for x in (q, k, v))
        out, flat = ((qp @ kp.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ vp).transpose(1, 2), torch.empty_like(q)
        flat[rows[real]] = out[real]
        return flat

    assert "causal mask missing: query 0 of request 0 reads later keys" in attempt(L.check_causal_varlen,
                                                                                    backend(gathered_no_causal))


def test_causal_varlen_checker_names_pad_slots_written_back(capsys):
    def all_slots(q, k, v, cu_seqlens, max_seqlen):  # gathers right, but writes back every slot of [R, max_seqlen]
        flat = _one_launch(q, k, v, cu_seqlens, max_seqlen)
        starts, lens = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        rows = (starts[:, None] + torch.arange(max_seqlen)).clamp(max=q.shape[0] - 1)
        pad = torch.arange(max_seqlen) >= lens[:, None]
        flat[rows[pad]] = 7.0  # a pad query's output lands on a real row
        return flat
    why = attempt(L.check_causal_varlen, backend(all_slots))
    assert "first wrong row" in why and "pad query" in why and "position < L_i" in why
    assert 0 < score(L.check_causal_varlen, backend(all_slots), points=3) < 3


def test_where_wrong_names_the_request_and_the_pad_slot_behind_a_row():
    cu = [0, 4, 10, 16, 18]
    want = torch.zeros(18, 1, 1)
    got = want.clone()
    got[5] = 1.0                                 # request 1, position 1: slot 5 of request 0 (4 tokens, max 6)
    assert "first wrong row 5: request 1, position 1" in L._where_wrong(got, want, cu, 6)
    assert "past request 0's end" in L._where_wrong(got, want, cu, 6)
    got = want.clone()
    got[17] = 1.0                                # the last row: where the clamped slots of request 3 land
    assert "clamped" in L._where_wrong(got, want, cu, 6)
    got = want.clone()
    got[12] = 1.0                                # request 2, position 2: no pad slot reaches it
    assert "pad" not in L._where_wrong(got, want, cu, 6) and L._where_wrong(want, want, cu, 6) == ""


def _counter(rule, k):
    return [1, k, k] if rule == "unequal" else [k] + [1] * (k - 1)


def test_counter_example_checker():
    assert L.check_counter_example(_counter)
    # the naive counter-example to "unequal": two requests, ratio k: padding still wastes more; half the cases
    naive = lambda rule, k: [1, k] if rule == "unequal" else _counter(rule, k)
    why = attempt(L.check_counter_example, naive)
    assert "padding still wastes more" in why and "masking wastes 20 cells per head and padding 99" in why
    assert score(L.check_counter_example, naive, points=2) == 1
    # equal lengths for "crowded": masking wastes more
    crowd = lambda rule, k: _counter(rule, k) if rule == "unequal" else [8] * k
    assert "masking still wastes more" in attempt(L.check_counter_example, crowd)
    # a tie breaks nothing: [4, 1 x 8] has T² = 144 = R · Lmax², equal wastes
    tie = lambda rule, k: _counter(rule, k) if rule == "unequal" else [4] + [1] * 8
    assert "a tie: masking wastes exactly as much as padding, not less" in attempt(L.check_counter_example, tie)
    # the rule's own condition is checked before the wastes: ratio, count, the limits, the type
    assert "only 5 times the shortest" in attempt(L.check_counter_example, lambda rule, k: [2, 10, 10])
    few = lambda rule, k: _counter(rule, k) if rule == "unequal" else [100, 1]
    assert "2 requests; the rule speaks of batches of at least 8" in attempt(L.check_counter_example, few)
    assert "at most 64 requests and 2048 tokens" in attempt(
        L.check_counter_example, lambda rule, k: [1, 2000, 2000] if rule == "unequal" else _counter(rule, k))
    assert "expected a non-empty list" in attempt(L.check_counter_example, lambda rule, k: "yes")
    assert "expected a non-empty list" in attempt(L.check_counter_example, lambda rule, k: [1.0, 10.0, 10.0])


def test_counter_cases_refute_plausible_rules():
    # each rule holds on the naive batch (two requests of ratio k; k equal requests), so it needs a real counter-example
    for rule, k in L.COUNTER_CASES:
        naive = [1, k] if rule == "unequal" else [8] * k
        c = recorded_cells(naive)
        assert (c["padded"] > c["masked"]) if rule == "unequal" else (c["masked"] > c["padded"])
    assert L.check_counter_example(_counter)  # while the reference batches meet each rule's condition and break it


def _rows(cu):
    lens = (cu[1:] - cu[:-1]).long()
    req = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return req, torch.arange(int(cu[-1])) - cu[:-1].long()[req], lens


def _document(bottom_right=True):
    def make(cu_q, cu_k):
        (rq, pq, lq), (rk, pk, lk) = _rows(cu_q), _rows(cu_k)
        shift = (lk - lq)[rq] if bottom_right else torch.zeros_like(rq)
        return lambda qi, ki: (rq[qi] == rk[ki]) & (pk[ki] <= pq[qi] + shift[qi])
    return make


def test_document_mask_checker():
    right = _document()
    assert L.check_document_mask(right)
    top_left = attempt(L.check_document_mask, _document(bottom_right=False))
    assert "top-left" in top_left and "bottom-right" in top_left and "masked path" in top_left
    assert 0 < score(L.check_document_mask, _document(bottom_right=False), points=2) < 2
    assert "plain causal" in attempt(L.check_document_mask, lambda cq, ck: (lambda qi, ki: ki <= qi))
    assert "no causal part" in attempt(L.check_document_mask,
                                       lambda cq, ck: (lambda qi, ki: _rows(cq)[0][qi] == _rows(ck)[0][ki]))
    assert "inverted" in attempt(L.check_document_mask, lambda cq, ck: (lambda qi, ki: ~right(cq, ck)(qi, ki)))
    assert "expected a function" in attempt(L.check_document_mask, lambda cq, ck: block_diag_mask(cq, causal=True))
    assert "bool [T_q, T_k]" in attempt(L.check_document_mask, lambda cq, ck: (lambda qi, ki: (ki <= qi).int()))
    odd = attempt(L.check_document_mask, lambda cq, ck: (lambda qi, ki: (ki <= qi) & (qi % 2 == 0)))
    assert "cells differ, e.g. query row 1, key row 0: got False, expected True" in odd


def test_causal_varlen_checker_rejects_the_masked_way():
    def masked_way(q, k, v, cu, m):  # one launch, right values: the whole T x T scores and block_diag_mask
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~block_diag_mask(cu, causal=True), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    why = attempt(L.check_causal_varlen, backend(masked_way))
    assert "this is the masked way: T² cells" in why
    assert score(L.check_causal_varlen, backend(masked_way), points=3) == 2.4


def test_tile_grid_counts_and_hatches():
    from lessons_lib.style import NEVER, OTHER
    fig = L.tile_grid()
    left, right = fig.axes
    assert "2 tiles computed" in left.get_title() and "32768 cells executed for 520 kept" in left.get_title()
    assert "36 tiles computed" in right.get_title() and "28 of 64 skipped" in right.get_title()
    skipped = [p for p in right.patches if p.get_gid() == "tile-skipped"]
    assert len(skipped) == 28 and all(p.get_hatch() and p.get_facecolor()[:3] == (1.0, 1.0, 1.0) for p in skipped)
    assert len([p for p in right.patches if p.get_gid() == "tile-computed"]) == 36
    assert NEVER == "#FFFFFF" and all(line.get_color() != OTHER for ax in fig.axes for line in ax.get_lines())


def test_the_lesson_s_tile_numbers_are_what_predict_work_counts():
    from lessons_lib.ops.tiling import predict_work
    ab = predict_work([10, 30], n_heads=1, block_m=128, block_n=128, causal=True)
    assert (ab.tiles, ab.executed_cells, ab.cells) == (2, 32_768, 1000)         # cells 11, 29 and the summary
    long = predict_work([1000], n_heads=1, block_m=128, block_n=128, causal=True)
    assert (long.tiles_skipped, long.tiles + long.tiles_skipped) == (28, 64)   # "28 of the 64 tiles"


@pytest.mark.parametrize("tile", [64, 128])
def test_kernel_work_counts_the_triton_kernel_and_matches_the_prediction(tile):
    counted, predicted = L.kernel_work([10, 30], tile)
    assert counted.as_dict() == predicted.as_dict()
    # by hand: A and B each in one tile, one head, causal: no tile above a diagonal, no program returns at once
    assert (counted.programs, counted.early_exits, counted.tiles, counted.tiles_skipped) == (2, 0, 2, 0)
    assert counted.executed_cells == 2 * tile * tile and counted.cells == 10 * 10 + 30 * 30


def test_kit_html_table_escapes_and_refuses_ragged_rows():
    table = html_table(("a", "b"), [(1, "x < y")])
    assert table.count("<tr>") == 2 and "<td style='padding:0 8px'>x &lt; y</td>" in table and ">a</th>" in table
    with pytest.raises(ValueError, match="1 values for 2 columns"):
        html_table(("a", "b"), [(1,)])
