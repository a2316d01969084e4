"""measure.batch_invariance (a block cut into its steps, each request alone vs the flat run), measure.tolerance's
ulp32 and summation_orders, and tp.threads.row_parallel_in_threads: the engine side of lesson 02."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lessons_lib.core.attention import VarlenMetadata
from lessons_lib.core.model import AttentionContext
from lessons_lib.measure import batch_invariance as bi
from lessons_lib.measure.tolerance import summation_orders, ulp32
from lessons_lib.tp.threads import row_parallel_in_threads


def test_reach_counts_sorts_pairs_by_request_and_direction():
    eye = np.eye(5, dtype=bool)
    assert bi.reach_counts(eye, [2, 3]) == {"diagonal": 5, "own_request": 0, "other_requests": 0, "later": 0,
                                            "reads": "row i only", "across_from": []}
    causal = np.tril(np.ones((5, 5), bool))
    seen = bi.reach_counts(causal, [2, 3])
    assert (seen["own_request"], seen["other_requests"], seen["reads"]) == (1 + 3, 6, "other requests too")
    assert seen["across_from"] == [0, 1]          # A's two rows reach B's; no row of B reaches A
    peek = np.eye(5, dtype=bool)
    peek[1, 2] = True                              # row 1 (A's last) changed by row 2 (B's first): one row across
    assert bi.reach_counts(peek, [2, 3])["across_from"] == [2]
    assert bi.reach_counts(causal, [5])["reads"] == "rows ≤ i of its own request"   # one request: causal
    assert bi.reach_counts(np.ones((5, 5), bool), [5])["reads"] == "rows of its own request"


def test_alone_vs_batched_names_the_requests_a_batch_changes():
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(1))
    same = bi.alone_vs_batched(lambda t, cu: t * 2, x, [3, 4])
    assert same["differ"] == [] and same["max_diff"] == 0.0 and same["row_diff"].shape == (7,)
    by_t = bi.alone_vs_batched(lambda t, cu: t / t.shape[0], x, [3, 4])   # divides by the batch's row count
    assert by_t["differ"] == ["A", "B"] and by_t["max_diff"] > by_t["bound"]
    with pytest.raises(ValueError, match="one row per input row"):
        bi.alone_vs_batched(lambda t, cu: t[:1], x, [3, 4])


def test_attention_context_is_cleared_after_the_block(block_run):
    model, x, _ = block_run
    with bi.attention_context(model, [0, 3, 12], "loop"):
        assert model.layers[0].attn.core.context is not None
    assert model.layers[0].attn.core.context is None


def test_block_sum_is_the_blocks_own_add(block_run):
    model, x, _ = block_run
    b = model.layers[0]
    with bi.attention_context(model, [0, 3, 12], "loop"):
        whole = b(x)
        zero_mlp = bi.block_sum(b, x, {"mlp.fc_down": torch.zeros_like(x)}, "")   # the second add adds 0
        first = bi.block_sum(b, x, {}, "ln_2")                                     # x + attention's output
    assert torch.equal(zero_mlp, first) and not torch.equal(first, whole)
    assert torch.equal(first + b.mlp(b.ln_2(first)), whole)


def test_module_step_runs_one_module_of_the_block_and_attention_by_cu_seqlens(block_run):
    model, x, lens = block_run
    b = model.layers[0]
    assert torch.equal(bi.module_step(model, "ln_1")(x, [0, 12]), b.ln_1(x))
    core = bi.module_step(model, "attn.core")
    qkv = b.attn.qkv(b.ln_1(x))
    flat = core(qkv, [0, 3, 12])
    assert flat.shape == (12, 64) and b.attn.core.context is None    # [T, 3·H·D] -> [T, H·D], context cleared
    alone = torch.cat([core(qkv[:3], [0, 3]), core(qkv[3:], [0, 9])])
    torch.testing.assert_close(flat, alone)                            # each request's rows see their own request
    assert not torch.allclose(core(qkv, [0, 12])[3:], flat[3:])      # told one sequence: B reads A


def test_fake_int8_scales_and_the_rows_each_reads():
    # Seeded, and inside the calibrated range (127 levels of CALIBRATED_SCALE): a static scale clamps beyond it
    x = (torch.randn(6, 10, generator=torch.Generator().manual_seed(0)) * 2).clamp(-0.98 * 127 * bi.CALIBRATED_SCALE,
                                                                                  0.98 * 127 * bi.CALIBRATED_SCALE)
    for scheme in bi.QUANT_SCHEMES:
        err = (bi.fake_int8(x, scheme) - x).abs()
        assert err.max() <= 1.0, scheme
    tok = bi.fake_int8(x, "per-token dynamic")
    assert ((tok - x).abs() <= x.abs().amax(-1, keepdim=True) / 127 / 2 + 1e-6).all()
    assert torch.equal(bi.fake_int8(torch.zeros(2, 3), "per-tensor dynamic"), torch.zeros(2, 3))
    assert bi.fake_int8(torch.full((1, 2), 100.0), "per-tensor static").max() == 127 * bi.CALIBRATED_SCALE  # clamped
    big = torch.cat([x, x * 300])     # rows 300 times larger below x: which scales change x's own rows?
    moved = {s: not torch.equal(bi.fake_int8(big, s)[:6], bi.fake_int8(x, s)) for s in bi.QUANT_SCHEMES}
    assert moved == {"per-tensor static": False, "per-tensor dynamic": True, "per-feature dynamic": True,
                     "per-token dynamic": False}
    with pytest.raises(ValueError, match="scheme"):
        bi.fake_int8(x, "per-row")


def test_c4_c5_block_steps_chain_to_the_block_itself_bit_for_bit(block_run):
    model, x, lens = block_run
    steps = bi.block_steps(model, x, lens)
    assert [s.kind for s in steps].count("linear") == 4 and [s.kind for s in steps].count("attention") == 1
    model.set_context(AttentionContext(VarlenMetadata.build([0, 3, 12]), "loop"))
    try:
        want = model.layers[0](x)
    finally:
        model.set_context(None)
    assert torch.equal(steps[-1].out, want)
    for a, b in zip(steps, steps[1:]):  # each step's input is the previous step's output
        assert b.inp is a.out


def test_ulp32_is_the_gap_to_the_next_float32():
    assert ulp32(1.0) == ulp32(1.858) == ulp32(-1.5) == 2.0 ** -23
    assert ulp32(0.99) == 2.0 ** -24 and ulp32(2.0) == 2.0 ** -22
    eps = torch.finfo(torch.float32).eps
    for v in (0.3, 1.858, 7.0, 123.4):  # between 1 and 2 times eps * |v|: "eps * |v|" is not one ULP
        assert eps * v / 2 < ulp32(v) <= eps * v


def test_block_steps_rejects_rows_that_do_not_match(block_run):
    model, x, _ = block_run
    with pytest.raises(ValueError, match="rows"):
        bi.block_steps(model, x, [3, 8])
    with pytest.raises(ValueError, match="whole requests"):
        bi._cu_of([0, 3, 12], slice(2, 12))


def test_c5_summation_orders_differ_only_by_rounding():
    fwd, bwd, exact = summation_orders(512)
    tol = 512 * torch.finfo(torch.float32).eps * 600
    assert abs(fwd - exact) < tol and abs(bwd - exact) < tol
    assert fwd != bwd  # this seed shows the non-associativity the lesson explains


def test_c6_run_row_parallel_sums_the_halves_once():
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(7, 12, generator=g), torch.randn(5, 12, generator=g), torch.randn(5, generator=g)
    for tp in (1, 2, 3, 4):
        outs, traces = row_parallel_in_threads(w, b, x, tp)
        assert len(outs) == tp and all(torch.allclose(y, F.linear(x, w, b), atol=1e-5) for y in outs)
        assert all([r.shape for r in t] == [(7, 5)] for t in traces)


def test_c5_rows_alone_bits_counts_and_its_lines():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(40, 64, generator=g), torch.randn(96, 64, generator=g)
    rows = bi.rows_alone_bits(lambda t: F.linear(t, w), x, (1, 10, 40))
    assert [(m, n) for m, _, n in rows] == [(1, 96), (10, 960), (40, 3840)]
    assert all(0 <= d <= n for _, d, n in rows) and rows[-1][1] == 0   # all 40 rows: the same call, the same bits
    assert bi.rows_alone_bits(lambda t: t.cumsum(0) * 0 + t.mean(0), x, (10,))[0][1] > 0   # B's rows reach A's
    with pytest.raises(ValueError, match="m must be"):
        bi.rows_alone_bits(lambda t: t, x, (41,))


