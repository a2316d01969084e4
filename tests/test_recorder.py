"""The one op recorder (measure/recorder.py): matmuls with their shapes, score matrices of
softmax and fused attention, every tensor created."""
import torch
import torch.nn.functional as F

from lessons_lib.measure.recorder import FUSED_ATTENTION_OPS, Matmul, Op, OpRecorder, _describe, record_matmuls, record_ops


def test_matmul_ops_become_matmuls_with_their_shapes():
    x, w, b = torch.randn(5, 3), torch.randn(4, 3), torch.randn(4)
    got = record_matmuls(lambda: (F.linear(x, w), F.linear(x, w, b), torch.randn(2, 5, 3) @ torch.randn(2, 3, 7),
                                  torch.randn(6, 3) @ torch.randn(3)))
    assert got == [Matmul("linear", 1, 5, 3, 4), Matmul("linear", 1, 5, 3, 4), Matmul("attention", 2, 5, 3, 7),
                   Matmul("linear", 1, 6, 3, 1)]


def test_softmax_and_sdpa_scores_count_every_head_and_block():
    q, k, v = torch.randn(1, 3, 10, 8), torch.randn(1, 3, 12, 8), torch.randn(1, 3, 12, 8)
    with OpRecorder() as rec:
        (q @ k.transpose(-1, -2)).softmax(-1)
        F.scaled_dot_product_attention(q, k, v)
    assert rec.scores[0] == (1, 3, 10, 12) and rec.cells == 2 * 3 * 10 * 12
    fused = [op for op in rec.ops if op.name in FUSED_ATTENTION_OPS]
    assert len(fused) == 1 and rec.matmuls[-2:] == [Matmul("attention", 3, 10, 8, 12), Matmul("attention", 3, 10, 12, 8)]


def test_a_varlen_kernel_counts_one_block_per_request():
    """A [T, H, d] kernel call with cu_seqlens (as the flash / torch varlen kernels are called on a GPU)."""
    rec, q, cu = OpRecorder(), torch.empty(40, 2, 8), torch.tensor([0, 10, 40])
    rec.ops.append(Op("_varlen_attn", tuple(_describe(x) for x in (q, q, q, cu, cu, 30, 30)), ((40, 2, 8),)))
    assert rec.scores == [(2, 10, 10), (2, 30, 30)] and rec.cells == 2 * (100 + 900)
    assert [m.flops for m in rec.matmuls] == [2 * 2 * 10 * 8 * 10] * 2 + [2 * 2 * 30 * 8 * 30] * 2


def test_outputs_and_nothing_recorded_outside():
    rec = record_ops(lambda: torch.ones(3, 4) + 1)
    assert ("add", (3, 4)) in rec.outputs and rec.cells == 0 and rec.matmuls == []
    torch.ones(2) @ torch.ones(2)
    assert rec.matmuls == []

