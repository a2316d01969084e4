"""Lesson 07's course module (lessons_lib/course/l07_kernel.py): the program-by-program picture against the
kernel's own counters, the online-softmax replay, the break-one-line helper, the explorer's state, the
checkers. Kernel runs are kept to a few dozen programs (Triton's interpreter: ~10 ms each)."""
from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import attempt

from lessons_lib import faults
from lessons_lib.course import l07_kernel as L
from lessons_lib.course.explore import parse_query_key_lengths
from lessons_lib.course.grading import WrongAnswer, score
from lessons_lib.faults import kernel as kernel_faults
from lessons_lib.measure import kernel_runs
from lessons_lib.measure.profile import random_qkv
from lessons_lib.measure.tolerance import assert_close, max_abs_diff, tolerance
from lessons_lib.ops import tiling
from lessons_lib.ops.tiling import WorkCounts

needs_kernel = pytest.mark.skipif(L.kernel_module() is None, reason="triton not installed (Linux wheels only)")


# ---- the picture and its totals -----------------------------------------------------------------------

def picture(lens, block_m, block_n, causal, n_heads=1):
    """The counters read off the predicted launch picture of prompts of ``lens``."""
    tiles = L.program_tiles(lens, lens, block_m=block_m, block_n=block_n, causal=causal)
    return L.picture_totals(lens, lens, tiles, block_m=block_m, block_n=block_n, causal=causal, n_heads=n_heads)


def test_k2_the_picture_adds_up_to_the_kernels_counters():
    rng = random.Random(7)
    for _ in range(200):  # the pure picture against the pure predictor, on many mixes
        lens = [rng.randint(0, 90) for _ in range(rng.randint(1, 5))]
        if not max(lens):
            continue
        bm, bn, causal = rng.choice([16, 32, 64]), rng.choice([16, 32, 64]), rng.random() < 0.5
        assert picture(lens, bm, bn, causal, n_heads=2) == tiling.predict_work(lens, n_heads=2, block_m=bm, block_n=bn,
                                                                               causal=causal), (lens, bm, bn, causal)
    tiles = L.program_tiles([70, 5, 20], [70, 5, 20], block_m=16, block_n=16, causal=True)
    assert tiles[1] == [1, -1, -1, -1, -1] and sum(t < 0 for r in tiles for t in r) * 2 == 14


@needs_kernel
def test_k2_the_kernels_counters_equal_the_picture_for_a_long_and_short_mix():
    lens = [70, 5, 20]
    q, k, v, cu = L.kernel_qkv(lens, 2, 16, seed=2)
    _, measured = L.run_kernel(q, k, v, cu, block_m=16, block_n=16)
    assert measured == picture(lens, 16, 16, True, n_heads=2)
    assert measured.early_exits == 14


def test_program_cells_colours_each_cell_by_what_the_kernel_does_with_it():
    assert L.program_tiles([20], [20], block_m=16, block_n=16, causal=True) == [[1, 2]]
    pic = L.program_cells(20, 20, [1, 2], block_m=16, block_n=16, causal=True)
    assert pic.shape == (32, 32)
    assert not (pic[16:] == L.RETURNED).any()  # band 1 holds rows 16..19 of the request: it works
    rows, cols = np.indices((20, 20))
    useful = pic[:20, :20] == L.USEFUL
    assert np.array_equal(useful, cols <= rows)  # exactly the causal lower triangle of the request
    assert (pic[:16, 16:] == L.SKIPPED).all()  # band 0's second key tile is wholly above the diagonal
    assert (pic[20:32, :32][pic[20:32, :32] != L.SKIPPED] == L.WASTED).all()  # rows past the end: computed, thrown away
    short = L.program_cells(5, 5, [1, -1, -1], block_m=16, block_n=16, causal=False)
    assert (short[16:] == L.RETURNED).all() and int((short == L.USEFUL).sum()) == 25


def test_k3_causal_computes_n_plus_1_over_2n_of_the_tiles():
    for block in (16, 32, 64):
        n = 256 // block
        causal = tiling.predict_work([256], block_m=block, block_n=block, causal=True)
        full = tiling.predict_work([256], block_m=block, block_n=block, causal=False)
        assert picture([256], block, block, True) == causal and Fraction(causal.tiles, full.tiles) == Fraction(n + 1, 2 * n)
    if L.kernel_module() is not None:
        q, k, v, cu = L.kernel_qkv([128], 1, 16, seed=3)
        assert L.run_kernel(q, k, v, cu, block_m=32, block_n=32)[1].tiles == 10  # 1 + 2 + 3 + 4


def test_k4_a_short_request_uses_a_sliver_of_its_tile():
    pic = L.program_cells(10, 10, [1], block_m=64, block_n=64, causal=False)
    assert int((pic == L.USEFUL).sum()) == 100 and int((pic == L.WASTED).sum()) == 4096 - 100
    w = tiling.predict_work([10], block_m=64, block_n=64, causal=False)
    assert (w.cells, w.executed_cells) == (100, 4096)
    if L.kernel_module() is not None:
        q, k, v, cu = L.kernel_qkv([10], 1, 16, seed=4)
        out, measured = L.run_kernel(q, k, v, cu, causal=False, block_m=64, block_n=64)
        assert (measured.cells, measured.executed_cells) == (100, 4096)
        assert_close(out, *L.kernel_refs(q, k, v, cu, causal=False), "a 10-token request in a 64x64 tile")


def test_launch_picture_says_whether_the_kernels_counters_agree():
    lens = [100, 20, 60]
    total = tiling.predict_work(lens, block_m=32, block_n=32, causal=True)
    tiles = L.program_tiles(lens, lens, block_m=32, block_n=32, causal=True)
    same = WorkCounts(program_tiles=(tuple(t for request in tiles for t in request),))   # one head: m + 4 r
    fig = L.launch_picture(lens, block_m=32, block_n=32, causal=True, measured=same)
    text = " ".join(t.get_text() for t in fig.texts)
    assert "12 programs: 5 return at once" in text and "the same" in text
    useful = sum(int((L.program_cells(n, n, t, 32, 32, True) == L.USEFUL).sum()) for n, t in zip(lens, tiles))
    assert useful == sum(n * (n + 1) // 2 for n in lens)  # the causal triangles: blue, counted apart from in-bounds
    assert f"{useful} useful (blue)" in text and f"in-bounds (masked ones included): {total.cells}" in text
    off = WorkCounts(program_tiles=(tuple(max(t, 1) for request in tiles for t in request),))  # no program returns
    fig = L.launch_picture(lens, block_m=32, block_n=32, causal=True, measured=off)
    text = " ".join(t.get_text() for t in fig.texts)
    assert "DIFFER" in text
    # the footer agrees with the panels: no program returned, though 5 pass the early-return test
    assert "0 return at once (5 pass the early-return test" in text
    assert all(a.get_title().endswith("4 work, 0 return") for a in fig.axes)
    assert (L.pct(0.004), L.pct(0.06), L.pct(0)) == ("0.4%", "6%", "0%")



def test_launch_picture_hatches_exactly_the_programs_that_return():
    """A returned program is white with an ink hatch (not grey: grey is a fill for other work); one hatched band
    per program the kernel's prediction says returns, for one head."""
    lens = [100, 20, 60]
    fig = L.launch_picture(lens, block_m=32, block_n=32, causal=True)
    hatched = [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("returned-")]
    assert len(hatched) == tiling.predict_work(lens, block_m=32, block_n=32, causal=True).early_exits == 5
    assert all(p.get_hatch() == L.RETURNED_HATCH for p in hatched)
    assert L.CODE_COLORS[L.RETURNED] == L.CODE_COLORS[L.SKIPPED]  # both white: the hatch tells them apart

# ---- online softmax -------------------------------------------------------------------------------------

# ---- the kernel's source, and one line of it changed -------------------------------------------------------

@needs_kernel
def test_each_kernel_bug_moves_a_counter_or_the_output_and_the_real_kernel_comes_back():
    lens = [40, 5]
    q, k, v, cu = L.kernel_qkv(lens, 1, 16, seed=9)
    effects = {}
    for bug in L.KERNEL_BUGS:
        causal = bug != "kernel_columns_past_end_kept"
        want = tiling.predict_work(lens, block_m=16, block_n=16, causal=causal)
        with faults.injected(bug):
            out, counts = L.run_kernel(q, k, v, cu, causal=causal, block_m=16, block_n=16)
        ref, ref64 = L.kernel_refs(q, k, v, cu, causal=causal)
        wrong = max_abs_diff(out, ref64) > tolerance(ref, ref64)
        effects[bug] = (counts.tiles != want.tiles, counts.masked_tiles != want.masked_tiles, wrong)
        if bug == "kernel_cells_counted_whole_tile":   # the only bug that moves nothing but the cells
            assert counts.cells == counts.executed_cells > want.cells
        out, counts = L.run_kernel(q, k, v, cu, causal=causal, block_m=16, block_n=16)   # the real kernel is back
        assert counts.as_dict() == want.as_dict() and max_abs_diff(out, ref64) <= tolerance(ref, ref64)
    assert effects == {"kernel_no_early_return": (True, True, False), "kernel_causal_bound_one_tile_late": (True, True, False),
                       "kernel_sum_not_rescaled": (False, False, True), "kernel_columns_past_end_kept": (False, False, True),
                       "kernel_every_key_tile_masked": (False, True, False),
                       "kernel_diagonal_tile_unmasked": (False, True, True),
                       "kernel_causal_diagonal_top_left": (False, False, False),   # a prefill: L_k = L_q hides it
                       "kernel_cells_counted_whole_tile": (False, False, False),
                       "kernel_exp_in_base_e": (False, False, True)}
    (lens_q, lens_k) = L.CHUNK_MIX   # a chunk after cached keys shows it
    q, _, _, cu_q = L.kernel_qkv(lens_q, 1, 16, seed=30)
    _, k, v, cu_k = L.kernel_qkv(lens_k, 1, 16, seed=31)
    ref, ref64 = L.kernel_refs(q, k, v, cu_q, cu_k)
    assert_close(L.run_kernel(q, k, v, cu_q, cu_k, block_m=16, block_n=16)[0], ref, ref64, "a chunk after cached keys")
    with faults.injected("kernel_causal_diagonal_top_left"):
        assert max_abs_diff(L.run_kernel(q, k, v, cu_q, cu_k, block_m=16, block_n=16)[0], ref64) > tolerance(ref, ref64)


def test_the_lessons_bugs_are_the_engines_kernel_faults():
    # every one-line kernel fault (LINE_CHANGES) is the lesson's; a launcher fault of the area (lesson 03's) is not
    assert set(L.KERNEL_BUGS) == set(kernel_faults.LINE_CHANGES) <= {n for n, f in faults.FAULTS.items() if f.area == "kernel"}
    for bug in L.KERNEL_BUGS:   # each names one line of the current kernel, shown by the break-it cell
        old, new = kernel_faults.LINE_CHANGES[bug]
        assert "# CHANGED, was: " + old in kernel_faults.changed_source(old, new)


# ---- the fast paths, the compiler, grouped-query attention -----------------------------------------------------

@needs_kernel
def test_pack_gqa_loads_each_kv_tile_once_per_group_on_decode_and_the_same_on_whole_tiles():
    g = L.GQA_HEADS // L.GQA_KV_HEADS
    per_head, packed = (L.run_gqa(*L.GQA_DECODE, p) for p in (False, True))
    for run in (per_head, packed):
        assert run["counts"] == run["predicted"] and run["error"] <= run["bound"]
    assert per_head["grid"] == (1, L.GQA_HEADS, 3) and packed["grid"] == (1, L.GQA_KV_HEADS, 3)
    assert per_head["counts"].tiles == g * packed["counts"].tiles and per_head["counts"].cells == packed["counts"].cells
    assert L.run_gqa(*L.GQA_DECODE, None)["packed"] and not L.run_gqa(*L.GQA_PREFILL, None)["packed"]


@needs_kernel
def test_count_launches_sees_through_a_swapped_kernel():
    tv = L.kernel_module()
    q, k, v, cu = L.kernel_qkv([3, 5, 2], 1, 16, seed=1)
    with faults.injected("kernel_no_early_return"), tv.count_launches() as grids:
        tv.triton_varlen_attention(q, k, v, cu, block_m=16, block_n=16)
    assert grids == [(1, 1, 3)]


# ---- the explorer ------------------------------------------------------------------------------------------

def test_kernel_state_runs_the_kernel_and_its_numbers_follow_the_input():
    a = L.kernel_state("10, 30", 16, 16, True)
    assert a["seq_lens"] == [10, 30] and a["grid"] == (2, 1, 2)
    assert a["predicted"] == tiling.predict_work([10, 30], block_m=16, block_n=16, causal=True)
    assert L.picture_totals([10, 30], [10, 30], a["tiles"], block_m=16, block_n=16, causal=True) == a["predicted"]
    if L.kernel_module() is not None:
        assert a["ran"] and a["measured"] == a["predicted"] and a["error"] <= a["bound"]
    b = L.kernel_state("10 30 64", 32, 16, False)
    assert b["predicted"] == tiling.predict_work([10, 30, 64], block_m=32, block_n=16, causal=False)
    assert b["predicted"] != a["predicted"]
    html = L.kernel_counts_html(b)
    assert f"programs: measured {b['measured'].programs if b['ran'] else 'not run'} | predicted 6 | picture 6" in html
    big = L.kernel_state("512, 512", 16, 16, True)  # 64 programs: more than the interpreter is allowed here
    if L.kernel_module() is not None and L.kernel_module().INTERPRETED:
        assert not big["ran"] and "more than 48" in big["why"] and "kernel not run" in L.kernel_status_html(big)
    with pytest.raises(ValueError, match="not a whole number"):
        L.kernel_state("10, x")
    with pytest.raises(ValueError, match="unknown kernel bug"):
        L.kernel_state("10, 30", bug="no such bug")


def test_the_explorer_takes_a_chunk_as_query_and_key_lengths():
    assert parse_query_key_lengths("20:50, 10") == ([20, 10], [50, 10])
    assert parse_query_key_lengths("10 30") == ([10, 30], [10, 30])
    for bad, phrase in (("50:20", "fewer keys than queries"), ("1:2:3", "more than one"), ("", "empty"),
                        ("20:x", "not a whole number")):
        with pytest.raises(ValueError, match=phrase):
            parse_query_key_lengths(bad)
    state = L.kernel_state("20:50, 10", 16, 16, True)
    assert state["seq_lens"] == [20, 10] and state["seq_lens_k"] == [50, 10]
    assert state["predicted"] == tiling.predict_work([20, 10], [50, 10], block_m=16, block_n=16, causal=True)
    if state["ran"]:
        assert state["measured"] == state["predicted"] and state["error"] <= state["bound"]
        broken = L.kernel_state("20:50, 10", 16, 16, True, "kernel_causal_diagonal_top_left")
        assert broken["error"] > broken["bound"]          # the chunk's rows lose their cached keys' offset


@needs_kernel
def test_kernel_state_with_a_bug_runs_the_broken_kernel():
    late = L.kernel_state("70, 5", 16, 16, True, bug="kernel_no_early_return")
    assert late["ran"] and late["measured"] != late["predicted"] and late["error"] <= late["bound"]
    assert late["measured"].tiles > late["predicted"].tiles and late["measured"].cells == late["predicted"].cells
    assert "with the bug 'kernel_no_early_return'" in L.kernel_status_html(late)
    wrong = L.kernel_state("70, 5", 16, 16, True, bug="kernel_sum_not_rescaled")
    assert wrong["measured"] == wrong["predicted"] and wrong["error"] > wrong["bound"]
    assert "OUTSIDE" in L.kernel_status_html(wrong)
    assert not faults.active() and L.kernel_state("70, 5")["error"] <= late["bound"]


@needs_kernel
def test_the_explorer_picture_is_drawn_from_the_kernels_per_program_counts():
    # the real kernel: its per-program tiles are the prediction's, program by program
    real = L.kernel_state("100, 5, 20", 32, 32, True)
    predicted = [t for r in L.program_tiles([100, 5, 20], [100, 5, 20], block_m=32, block_n=32, causal=True) for t in r]
    assert list(real["measured"].program_tiles[0]) == predicted and real["measured"].tiles == sum(t for t in predicted if t > 0)
    # the bug: the 6 programs past an end compute a tile each; the picture draws 18 tiles, the prediction 12
    late = L.kernel_state("100, 5, 20", 32, 32, True, bug="kernel_no_early_return")
    assert -1 not in late["measured"].program_tiles[0] and sum(map(sum, late["tiles"])) == 18
    assert late["predicted"].tiles == 12 and "tiles: measured 18 | predicted 12 | picture 18" in L.kernel_counts_html(late)
    # the executed-cells footer shows the kernel's 18 tiles x 32 x 32, the prediction's 12 x 32 x 32 beside it
    cells = late["predicted"].cells
    assert (f"measured {18 * 32 * 32} for {cells} inside the requests" in L.kernel_counts_html(late)
            and f"predicted {12 * 32 * 32} for {cells}" in L.kernel_counts_html(late))
    fig = L.launch_picture([100, 5, 20], block_m=32, block_n=32, causal=True, measured=late["measured"])
    text = " ".join(t.get_text() for t in fig.texts)
    assert "drawn from the kernel's own" in text and "DIFFER: 12 tiles" in text
    assert not [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("returned")]


def test_without_triton_the_state_and_the_checkers_fall_back_to_the_prediction(monkeypatch):
    why = "the Triton kernel does not run here (ModuleNotFoundError: No module named 'triton')"

    def missing():
        raise RuntimeError(why)

    L.kernel_missing.cache_clear()
    monkeypatch.setattr(kernel_faults, "kernel_module", missing)
    try:
        state = L.kernel_state("10, 30")
        assert not state["ran"] and "Linux wheels only" in state["why"] and state["predicted"].programs == 4
        assert "No module named 'triton'" in L.kernel_missing() and L.kernel_module() is None
        assert L.check_flat_grid(_flat_grid) and L.check_window_tiles(_reference_window)
        with pytest.raises(RuntimeError, match="does not run here"):
            L.run_kernel(*random_qkv([3], 1, 16))
    finally:
        L.kernel_missing.cache_clear()


def test_the_explorer_widget_updates_on_new_lengths():
    pytest.importorskip("ipywidgets")
    box = L.kernel_explorer("10, 30")
    text = next(c for c in box.children[0].children if "k7x-lengths" in c._dom_classes)
    counts = next(c for c in box.children if "k7x-counts" in c._dom_classes)
    before = counts.value
    text.value = "5, 50"
    assert counts.value != before and "predicted 8" in counts.value  # grid (4, 1, 2)
    text.value = "oops"
    status = next(c for c in box.children if "k7x-status" in c._dom_classes)
    assert "not a whole number" in status.value


# ---- the checkers ------------------------------------------------------------------------------------------

def _reference_window(len_q, len_k, tile_start, block_m, block_n, window):
    off, last_row = len_k - len_q, min(tile_start + block_m, len_q) - 1
    hi = min(len_k, last_row + 1 + off)
    lo = 0 if window is None else max(0, tile_start + off - window + 1)
    return (0, 0) if last_row < tile_start or hi <= lo else (lo // block_n, -(-hi // block_n))


def _flat_grid(seq_lens, block_m, extra=1):
    """vLLM's map: request r starts at floor(cu_r / BLOCK_M) + extra * r (extra=0 is the typical mistake)."""
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    first = [cu[r] // block_m + extra * r for r in range(len(seq_lens))]
    pairs = []
    for i in range(sum(seq_lens) // block_m + len(seq_lens)):
        r = max(j for j in range(len(seq_lens)) if first[j] <= i)
        pairs.append((r, i - first[r]))
    return pairs


def _reference_tiles(seq_lens, n_heads, n_sms, busy=True):
    """Written from the lengths, not from the module: a causal launch lasts at least as long as its longest
    program, the last query tile of the longest request, which walks ceil(L_max / 64) key tiles; the SMs it keeps
    busy on average are its key tiles over that (busy=False: the grid's programs, the naive count)."""
    costs = {}
    for bm in L.TILE_SIZES:
        grid = n_heads * len(seq_lens) * -(-max(seq_lens) // bm)
        w = tiling.predict_work(seq_lens, n_heads=n_heads, block_m=bm, block_n=64, causal=True)
        costs[bm] = (w.tiles / -(-max(seq_lens) // 64) if busy else grid, w.tiles * 64 * 64 * 2 * 2, w.tiles * bm * 64)
    full = [bm for bm in L.TILE_SIZES if costs[bm][0] >= n_sms]
    if full:
        return min(full, key=lambda bm: (costs[bm][1], costs[bm][2]))
    return min(L.TILE_SIZES, key=lambda bm: (-costs[bm][0], costs[bm][2]))


def _working_programs(seq_lens, n_heads, n_sms):
    """The previous model: every program that computes a tile counts as a busy SM, however few tiles it walks."""
    work = {bm: L.tile_work(seq_lens, n_heads, bm) for bm in L.TILE_SIZES}
    busy = {bm: w.programs - w.early_exits for bm, w in work.items()}
    full = [bm for bm in busy if busy[bm] >= n_sms]
    if full:
        return min(full, key=lambda bm: (work[bm].kv_bytes_read(64, 2), work[bm].executed_cells))
    return min(L.TILE_SIZES, key=lambda bm: (-busy[bm], work[bm].executed_cells))


def test_the_checkers_accept_the_references(capsys):
    assert L.check_window_tiles(_reference_window)
    assert L.check_flat_grid(_flat_grid)
    assert L.check_tiles(_reference_tiles)
    assert L.check_grid_trap(lambda: ([1000] + [30] * 7, 4))
    assert L.check_flat_worse(lambda: ([48] * 4, 16))
    assert capsys.readouterr().out.count("✓") == 5


def _window_with(first=None, end=None):
    """The reference with its first or its end computed another (wrong) way."""
    def fn(lq, lk, s, bm, bn, w):
        f, e = _reference_window(lq, lk, s, bm, bn, w)
        if (f, e) == (0, 0):
            return f, e
        return (f if first is None else first(lq, lk, s, bm, bn, w)), (e if end is None else end(lq, lk, s, bm, bn, w))
    return fn


@pytest.mark.parametrize("wrong, phrase", [
    (_window_with(end=lambda lq, lk, s, bm, bn, w: -(-min(lk, s + 1 + lk - lq) // bn)), "FIRST row"),
    (lambda lq, lk, s, bm, bn, w: _reference_window(lq, lq, s, bm, bn, w), "bottom-right aligned"),   # ignores L_k - L_q
    (_window_with(first=lambda lq, lk, s, bm, bn, w: 0 if w is None else
                  max(0, min(s + bm, lq) - 1 + lk - lq - w + 1) // bn), "LAST row's window"),
    (_window_with(first=lambda lq, lk, s, bm, bn, w: 0 if w is None else max(0, s + lk - lq - w) // bn), "holds W"),
    (_window_with(first=lambda lq, lk, s, bm, bn, w: 0 if w is None else -(-max(0, s + lk - lq - w + 1) // bn)),
     "rounded down"),
    (lambda lq, lk, s, bm, bn, w: (0, -(-lk // bn)), "more key tiles than the rows see"),       # every key tile
    (lambda lq, lk, s, bm, bn, w: (_reference_window(lq, lk, s, bm, bn, w)[0], _reference_window(lq, lk, s, bm, bn, w)[0] + 1),
     "misses key tiles"),                                                                     # one key tile only
])
def test_window_checker_explains_a_wrong_range(wrong, phrase):
    with pytest.raises(WrongAnswer, match=phrase):
        L.check_window_tiles(wrong)


def test_window_checker_compares_with_the_kernels_count_on_a_chunk():
    # right on every tile it is shown, wrong only where L_k > L_q and the tile is not the first: the kernel catches it
    assert kernel_runs.causal_counts(*L.CHUNK_MIX, 16, 16, L.MAX_PROGRAMS) == tiling.predict_work(*L.CHUNK_MIX, block_m=16, block_n=16)


def test_tiles_checker_explains_the_grid_count_and_the_re_reads():
    # counting every program of the grid: the early exits of the short requests look like busy SMs
    assert "return at once" in attempt(L.check_tiles, lambda lens, h, s: _reference_tiles(lens, h, s, busy=False))
    assert "do not finish together" in attempt(L.check_tiles, _working_programs)
    assert "re-reads" in attempt(L.check_tiles, lambda lens, h, s: 16 if len(lens) == 1 else _reference_tiles(lens, h, s))
    assert "one of" in attempt(L.check_tiles, lambda lens, h, s: 48)


def test_the_counter_example_checkers_refuse_a_mix_that_proves_nothing(capsys):
    assert "both counts pick" in attempt(L.check_grid_trap, lambda: ([4000], 8))          # no early exits at all
    assert "find one of your own" in attempt(L.check_grid_trap, lambda: ([300, 20, 20, 20], 8))
    assert "not larger than the rectangle" in attempt(L.check_flat_worse, lambda: ([100, 5, 20, 7], 32))
    assert "find one of your own" in attempt(L.check_flat_worse, lambda: ([64, 64], 64))
    assert "expected (seq_lens, n_heads)" in attempt(L.check_grid_trap, lambda: 5)
    # the printed counts are the prediction's: the flat grid 16 against the rectangle's 12 for 4 x 48 at 16
    L.check_flat_worse(lambda: ([48] * 4, 16))
    assert "flat grid 16 programs, rectangle 12" in capsys.readouterr().out


def test_flat_grid_never_loses_a_tile_and_the_checker_explains_one_that_does():
    for lens, bm in L.FLAT_CASES:
        pairs = _flat_grid(lens, bm)
        real = {(r, m) for r, n in enumerate(lens) for m in range(-(-n // bm))}
        assert real <= set(pairs) and len(pairs) == sum(lens) // bm + len(lens)
    with pytest.raises(WrongAnswer, match="the same first program|never computed"):
        L.check_flat_grid(lambda lens, bm: _flat_grid(lens, bm, extra=0))   # right only where every cu_r is a multiple
    with pytest.raises(WrongAnswer, match=r"floor\(T / BLOCK_Q\) \+ R"):
        L.check_flat_grid(lambda lens, bm: [(r, m) for r, n in enumerate(lens) for m in range(-(-n // bm))])
    with pytest.raises(WrongAnswer, match="tiles 0, 1, 2"):
        L.check_flat_grid(lambda lens, bm: [(0, 0)] + [(r, 5) for r, _ in _flat_grid(lens, bm)[1:]])


def test_flat_grid_checker_prints_the_kernels_rectangular_early_exits(capsys):
    assert L.check_flat_grid(_flat_grid)
    out = capsys.readouterr().out
    # [300, 20, 20, 20] at 64: the rectangle (5, 1, 4) leaves 12 programs empty, the flat grid of 9 programs one
    assert "flat grid 9 programs, 1 return at once; the rectangular grid 20, 12 return at once" in out
    rect = kernel_runs.causal_counts([100, 5, 20], [100, 5, 20], 32, 64, 24)
    assert (rect.programs, rect.early_exits) == (12, 6)


def test_kv_bytes_read_grow_as_block_m_shrinks():
    w64, w16 = (tiling.predict_work([1024], block_m=b, block_n=64) for b in (64, 16))
    assert w16.kv_bytes_read(64) > 3 * w64.kv_bytes_read(64)        # about 4x: L^2 d / BLOCK_M
    assert w64.kv_bytes_read(64, 2) == w64.tiles * 64 * 64 * 2 * 2
    with pytest.raises(ValueError, match="d_head"):
        w64.kv_bytes_read(0)


def test_tiles_checker_explains_occupancy_and_kv_traffic():
    with pytest.raises(WrongAnswer, match="re-reads"):
        L.check_tiles(lambda lens, h, s: 16)       # fills the GPU but re-reads K/V four times
    with pytest.raises(WrongAnswer, match="SMs sit idle"):
        L.check_tiles(lambda lens, h, s: 128 if lens == [500, 3] else _reference_tiles(lens, h, s))  # 42 SMs busy
    with pytest.raises(WrongAnswer, match="must be one of"):
        L.check_tiles(lambda lens, h, s: 48)
    with pytest.raises(WrongAnswer, match="no choice keeps"):
        L.check_tiles(lambda lens, h, s: _reference_tiles(lens, h, s) if len(lens) > 1 else 128)


def test_a_grade_gives_partial_credit_with_the_explanation(capsys):
    points = score(L.check_tiles, lambda lens, h, s: 16, points=2)
    out = capsys.readouterr().out
    assert 0 < points < 2 and "re-reads" in out


def test_every_kernel_run_of_the_lesson_takes_bfloat16_on_cuda_and_float32_on_the_cpu(monkeypatch):
    kd = kernel_runs.kernel_dtype
    assert kd("cuda") == kd(torch.device("cuda", 1)) == torch.bfloat16
    assert kd("cpu") == torch.float32 and kernel_runs.KERNEL_DTYPE == kd(kernel_runs.KERNEL_DEVICE)
    q, k, v, cu_q, cu_k = L.kernel_qkv([3, 5], 2, 16, seq_lens_k=[4, 6], device="cpu")
    assert (q.dtype, k.shape, cu_k.tolist()) == (torch.float32, (10, 2, 16), [0, 4, 10])

    class Built(Exception):
        pass

    def record(*args, device, dtype, **kwargs):   # stops each helper where it has built its inputs
        raise Built(torch.device(device).type, dtype)

    monkeypatch.setattr(kernel_runs, "KERNEL_DEVICE", torch.device("cuda"))   # as on a GPU machine, without one
    monkeypatch.setattr(kernel_runs, "random_qkv", record)
    helpers = {"kernel_qkv": lambda: L.kernel_qkv([3], 1, 16),
               "the explorer": lambda: L._explorer_inputs.__wrapped__((3,), (5,), True)}
    if L.kernel_module() is not None:   # without Triton these fall back to the prediction and build nothing
        helpers.update({"run_gqa": lambda: L.run_gqa(*L.GQA_DECODE, None),
                        "the checkers' kernel runs": lambda: kernel_runs.causal_counts([3], [5], 16, 16, 48)})
    for name, build in helpers.items():
        with pytest.raises(Built) as built:
            build()
        assert built.value.args == ("cuda", torch.bfloat16), name
