"""Engine hooks lesson 07 calls: the online-softmax replay (ops.online_softmax), the float64 log-sum-exp reference
(measure.tolerance.reference_lse), the compile report's limits table and PTX counts (ops.compile_report), the
window truth, the flat grid and the occupancy model (tile_costs, best_block_m) of ops.tiling, the recorder's view filter,
the launch picture's cells and totals (ops.tile_picture), the kernel's code cut (faults.kernel.kernel_source_part), its
runs (measure.kernel_runs), the compile claim's builds (compile_report.launcher_and_avoided) and the ops lesson 03's loop
dispatches (measure.loop_dispatch)."""
from __future__ import annotations

import pytest
import torch

from lessons_lib.core.attention import attention_ref
from lessons_lib.course import l07_kernel as L
from lessons_lib.faults import kernel as kernel_faults
from lessons_lib.measure.loop_dispatch import loop_ops, loop_ops_per_request
from lessons_lib.measure.profile import random_qkv
from lessons_lib.measure.recorder import OpRecorder, is_view_op
from lessons_lib.measure.tolerance import reference_lse
from lessons_lib.ops import compile_report, tiling
from lessons_lib.ops.online_softmax import max_growths, online_softmax


def _triton_missing() -> bool:
    try:
        kernel_faults.kernel_module()
    except RuntimeError:
        return True
    return False


needs_triton = pytest.mark.skipif(_triton_missing(), reason="triton not installed (Linux wheels only)")


def test_k5_the_online_softmax_replay_is_the_softmax_and_the_bug_is_not():
    _, _, v, _, row, scores = L.softmax_example()
    s, values = scores[row].double(), v[:, 0].double()
    exact = torch.softmax(s, 0) @ values
    out, steps = online_softmax(s, values, 16)
    assert float((out - exact).abs().max()) < 1e-14
    assert all(st.error < 1e-14 for st in steps) and sum(st.max_grew for st in steps) >= 2
    assert [st.keys_seen for st in steps] == [16, 32, 48, 64]
    bad, bad_steps = online_softmax(s, values, 16, rescale=False)
    assert float((bad - exact).abs().max()) > 1e-2
    assert bad_steps[0].error < 1e-14  # the first tile is right: nothing to rescale yet
    one_tile, _ = online_softmax(s, values, 64, rescale=False)  # a single tile never rescales: no bug to see
    assert float((one_tile - exact).abs().max()) < 1e-14


def test_max_growths_counts_the_key_tiles_after_the_first_where_a_rows_max_grows():
    scores = torch.tensor([[5.0, 0, 0, 0], [0, 1, 2, 3], [3, 2, 1, 0], [0, 1, 0, 2]])
    assert max_growths(scores, 1) == [0, 3, 0, 2] and max_growths(scores, 2) == [0, 1, 0, 1]
    _, _, _, _, row, full = L.softmax_example()
    assert max_growths(full, 16)[row] == max(max_growths(full, 16))


def test_reference_lse_normalises_the_softmax_that_attention_uses():
    q, k, v, cu_q, cu_k = random_qkv([5, 12], 4, 16, seq_lens_k=[9, 12], seed=5)
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()          # 4 query heads on 2 K/V heads
    for causal in (True, False):
        lse = reference_lse(q, k, cu_q, cu_k, causal=causal)   # [H, T_q]
        out = attention_ref(q, k, v, cu_q, cu_k, causal=causal, upcast_dtype=torch.float64)
        for r, (qs, ks) in enumerate(((0, 0), (5, 9))):
            nq, nk = (5, 9) if r == 0 else (12, 12)
            kk, vv = k[ks:ks + nk].double().repeat_interleave(2, 1), v[ks:ks + nk].double().repeat_interleave(2, 1)
            s = torch.einsum("ihd,jhd->hij", q[qs:qs + nq].double(), kk) / 4.0
            if causal:
                s = s.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + nk - nq, float("-inf"))
            p = torch.exp(s - lse[:, qs:qs + nq, None])                 # the probabilities lse normalises
            assert torch.allclose(p.sum(-1), torch.ones(4, nq, dtype=torch.float64))
            assert torch.allclose(torch.einsum("hij,jhd->ihd", p, vv), out[qs:qs + nq])
    q, k, _, cu_q, cu_k = random_qkv([2], 1, 16, seq_lens_k=[0], seed=1)
    assert torch.equal(reference_lse(q, k, cu_q, cu_k, causal=False), torch.full((1, 2), float("-inf"), dtype=torch.float64))


def test_compiler_table_puts_each_targets_limits_beside_its_build():
    cr = pytest.importorskip("lessons_lib.ops.compile_report")
    ok = cr.BuildReport(cr.Build(80, "bfloat16", 64, True, False), 128, 64, 8, 3, 156, 0, 0, 49152)
    spills = cr.BuildReport(cr.Build(90, "bfloat16", 128, True, False), 128, 64, 4, 3, 255, 8, 8, 300_000)
    lines = cr.limits_table([ok, spills]).splitlines()
    assert lines[0].endswith("max regs  max shared  fits") and len(lines) == 3
    assert lines[1].split()[-3:] == ["255", str(cr.MAX_SHARED[80]), "yes"]
    assert lines[2].split()[-3:] == ["255", str(cr.MAX_SHARED[90]), "NO"] and "8/8" in lines[2]


def test_the_compile_claim_compiles_the_launchers_builds_and_the_avoided_tiles(monkeypatch):
    calls = []

    def compile_builds(builds, processes=1, timeout=600, tiles=None):
        calls.append((builds, tiles))
        return ["avoided" if tiles else "launcher's"]

    monkeypatch.setattr(compile_report, "compile_builds", compile_builds)
    assert compile_report.launcher_and_avoided.__wrapped__((80, 90), (64, 128)) == (["launcher's"], ["avoided"])
    builds = {tiles is None: builds for builds, tiles in calls}
    assert [tiles for _, tiles in calls if tiles] == [compile_report.AVOIDED_TILES]
    assert {(b.arch, b.head_dim) for b in builds[True]} == {(80, 64), (80, 128), (90, 64), (90, 128)}
    assert {(b.arch, b.head_dim) for b in builds[False]} == {(80, 128), (80, 64)}
    assert all((b.dtype, b.causal, b.pack_gqa) == ("bfloat16", True, False) for bs in builds.values() for b in bs)
    if not _triton_missing():   # the avoided tiles are not the launcher's own
        tv = kernel_faults.kernel_module()
        for d, tile in compile_report.AVOIDED_TILES[80].items():
            assert tuple(tv.launch_config(d, torch.bfloat16, 80)) != tile


def test_the_loop_dispatches_nine_ops_per_causal_request_five_without_the_mask():
    # lesson 03's loop, views left out: what K1 and the figure count as its launches, one request at a time
    assert loop_ops_per_request() == ["bmm", "mul", "ones", "tril", "bitwise_not", "masked_fill_", "_softmax", "bmm",
                                      "copy_"]
    assert loop_ops_per_request(causal=False) == ["bmm", "mul", "_softmax", "bmm", "copy_"]
    lens = [1 + (7 * i + 5) % 13 for i in range(50)]
    assert len(loop_ops(lens)) == len(loop_ops(lens[:1])) + 49 * 9


@needs_triton
def test_exp2_with_the_folded_scale_has_no_multiply_by_log2e_and_tl_exp_one_per_cell():
    counts = compile_report.exp_instructions(80, 64)   # two native builds, ~20 s
    mine, unfolded = counts["tl.exp2 (the kernel)"], counts["tl.exp"]
    config = kernel_faults.kernel_module().launch_config(64, torch.bfloat16, 80)
    per_thread = config.block_m * config.block_n // (32 * config.num_warps)
    assert mine.mul_log2e == 0 and unfolded.mul_log2e == 2 * per_thread   # the loop's two stages
    assert mine.ex2 == unfolded.ex2 >= 2 * per_thread


def test_window_truth_is_the_kernels_causal_bound_without_a_window():
    for case in L.WINDOW_CASES:
        lq, lk, start, bm, bn, _ = case
        computed, _ = tiling.key_tiles(lq, lk, start, bm, bn, causal=True)
        first, end = tiling.window_key_tiles(lq, lk, start, bm, bn, None)
        assert (first, end) == ((0, computed) if computed else (0, 0)), case
    assert tiling.window_key_tiles(64, 64, 48, 16, 16, 20) == (1, 4)   # rows 48..63 see keys 29..63
    assert tiling.window_key_tiles(64, 64, 32, 16, 16, 8) == (1, 3)    # rows 32..47 see keys 25..47


def test_the_recorder_leaves_views_out_of_what_it_launches():
    assert is_view_op("transpose") and is_view_op("slice") and is_view_op("_unsafe_view")
    assert not any(is_view_op(n) for n in ("bmm", "masked_fill_", "copy_", "_softmax"))
    with pytest.raises(ValueError, match="not an aten op"):
        is_view_op("no_such_op")
    x = torch.randn(4, 6)
    with OpRecorder() as rec:
        (x.t() @ x).view(-1).sum()
    assert [op.name for op in rec.ops] == ["t", "mm", "view", "sum"] and rec.launched() == ["mm", "sum"]


def test_the_flat_grid_leaves_at_most_one_empty_program_per_request():
    for lens, block_q in (([10, 30], 16), ([64, 64], 64), ([65, 3], 64), ([48] * 4, 16)):
        size, real = tiling.flat_grid_size(lens, block_q), sum(tiling.cdiv(n, block_q) for n in lens)
        assert real <= size <= real + len(lens) and size == sum(lens) // block_q + len(lens)
    with pytest.raises(ValueError, match="block_q"):
        tiling.flat_grid_size([10], 0)


def test_busy_sms_is_key_tiles_over_the_longest_programs():
    lens = [1000] + [30] * 7
    work = tiling.predict_work(lens, n_heads=4, block_m=128, block_n=64, causal=True)
    longest = tiling.longest_program(lens, 128, 64)
    assert longest == tiling.cdiv(1000, 64)            # the long request's last query tile walks every key tile
    assert tiling.busy_sms(work, longest) == work.tiles / longest < work.programs
    assert tiling.longest_program([], 64, 64) == 0 and tiling.busy_sms(work, 0) == 0.0


def test_kernel_source_part_is_the_files_text_with_its_line_numbers():
    heading, code = kernel_faults.kernel_source_part()
    lines = kernel_faults.KERNEL_FILE.read_text().splitlines()
    first, last = (int(x) for x in heading.split("lines ")[1].split(":")[0].split("-"))
    assert heading.startswith("lessons_lib/ops/triton_varlen.py, lines ")
    assert code.splitlines() == lines[first - 1:last]
    assert code.startswith("@triton.jit\ndef _varlen_fwd_kernel(")
    part = kernel_faults.kernel_source_part(start="m_new = tl.maximum", stop="if COUNT:")[1]
    assert part.strip().startswith("m_new = tl.maximum") and "l_i = l_i * alpha" in part and "tiles += 1" not in part
    with pytest.raises(ValueError, match="is not in the kernel's source"):
        kernel_faults.kernel_source_part(start="no such line")


def test_tile_picture_totals_are_the_predicted_counters():
    from lessons_lib.ops import tile_picture as tp
    for lens, bm, bn, causal in (([70, 5, 20], 16, 16, True), ([100, 20, 60], 32, 16, False), ([33], 16, 64, True)):
        tiles = tp.program_tiles(lens, lens, block_m=bm, block_n=bn, causal=causal)
        got = tp.picture_totals(lens, lens, tiles, block_m=bm, block_n=bn, causal=causal, n_heads=3)
        assert got == tiling.predict_work(lens, n_heads=3, block_m=bm, block_n=bn, causal=causal), (lens, bm, bn)
    pic = tp.program_cells(20, 20, [1, 2], 16, 16, True)
    assert int((pic == tp.USEFUL).sum()) == 20 * 21 // 2 and not (pic == tp.RETURNED).any()
    assert (tp.program_cells(5, 5, [1, -1], 16, 16, False)[16:] == tp.RETURNED).all()
    with pytest.raises(ValueError, match="len_q"):
        tp.program_cells(-1, 5, [1], 16, 16, True)


def test_best_block_m_reads_least_kv_among_tiles_that_fill_the_sms():
    lens, heads = [1000] + [30] * 7, 4
    costs = {bm: tiling.tile_costs(lens, heads, bm, 64, 64) for bm in (16, 32, 64, 128)}
    for bm, (sms, kv, cells) in costs.items():
        w = tiling.predict_work(lens, n_heads=heads, block_m=bm, block_n=64, causal=True)
        assert (sms, kv, cells) == (w.tiles / tiling.longest_program(lens, bm, 64), w.kv_bytes_read(64), w.executed_cells)
        assert tiling.tile_costs(lens, heads, bm, 64, 64, busy=False)[0] == w.programs
    naive = tiling.best_block_m(lens, heads, 132, (16, 32, 64, 128), 64, 64, busy=False)
    real = tiling.best_block_m(lens, heads, 132, (16, 32, 64, 128), 64, 64)
    assert naive != real   # the grid's program count misleads: the notebook's trap
    full = [bm for bm, c in costs.items() if c[0] >= 132]
    assert real == (min(full, key=lambda bm: costs[bm][1]) if full else max(costs, key=lambda bm: costs[bm][0]))
    with pytest.raises(ValueError, match="block_ms is empty"):
        tiling.best_block_m(lens, heads, 132, (), 64, 64)


@needs_triton
def test_causal_counts_run_the_kernel_only_up_to_max_programs():
    from lessons_lib import faults
    from lessons_lib.measure import kernel_runs
    lens_q, lens_k = [20, 5], [50, 5]
    want = tiling.predict_work(lens_q, lens_k, block_m=16, block_n=16, causal=True)
    assert kernel_runs.causal_counts(lens_q, lens_k, 16, 16, 48) == want
    with faults.injected("kernel_no_early_return"):    # the counters tell a kernel run from the prediction
        assert kernel_runs.causal_counts(lens_q, lens_k, 16, 16, 48).tiles > want.tiles
        assert kernel_runs.causal_counts(lens_q, lens_k, 16, 16, want.programs - 1) == want


@needs_triton
def test_run_layout_packs_the_kv_heads_and_matches_the_prediction():
    from lessons_lib.measure import kernel_runs
    per_head, packed = (kernel_runs.run_layout([1, 3], [40, 20], 4, 2, 16, p) for p in (False, True))
    assert (per_head["grid"][1], per_head["packed"], packed["grid"][1], packed["packed"]) == (4, False, 2, True)
    for run in (per_head, packed):
        assert run["counts"] == run["predicted"] and run["error"] <= run["bound"]
    assert per_head["counts"].tiles == 2 * packed["counts"].tiles   # G = 2 decode rows share each K/V tile's load
    assert per_head["counts"].cells == packed["counts"].cells
