"""probe.row_dependency finds who reads whom; profile measures (its numbers are checked for
meaning, never for speed)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lessons_lib import ModelConfig, Transformer, pack
from lessons_lib.core.attention import block_diag_mask, plain_attention, varlen_attention
from lessons_lib.core.batch import seq_lens_to_cu_seqlens
from lessons_lib.course.probe import row_dependency, who_reads_whom
from lessons_lib.measure import profile


def test_c4_c5_per_row_operations_give_the_identity():
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    # A constant bump would be invisible to LayerNorm; the probe's ramp is not.
    for fn in (lambda t: F.layer_norm(t, (8,)), lambda t: F.gelu(t @ w.T), lambda t: t + 1):
        assert torch.equal(row_dependency(fn, x), torch.eye(12, dtype=torch.bool))


def test_row_dependency_sees_mixing():
    x = torch.randn(6, 3)
    assert torch.equal(row_dependency(lambda t: t.cumsum(0), x), torch.ones(6, 6, dtype=torch.bool).tril())
    assert row_dependency(lambda t: t.sum(0, keepdim=True), x).shape == (1, 6)


def test_c7_c10_attention_dependency_is_the_mask():
    lens = [3, 5, 2]
    cu = seq_lens_to_cu_seqlens(lens)
    x = torch.randn(sum(lens), 12, generator=torch.Generator().manual_seed(2))

    def split(t):
        return t[:, :4].reshape(-1, 1, 4), t[:, 4:8].reshape(-1, 1, 4), t[:, 8:].reshape(-1, 1, 4)

    assert torch.equal(row_dependency(lambda t: varlen_attention(*split(t), cu, backend="loop"), x),
                       block_diag_mask(cu, causal=True))
    assert torch.equal(row_dependency(lambda t: plain_attention(*split(t)), x),
                       torch.ones(10, 10, dtype=torch.bool).tril())


def test_c4_c7_c10_who_reads_whom_maps_of_the_lesson_figure():
    maps = who_reads_whom([10, 30])
    per_token, plain, varlen = maps.values()
    assert (per_token == torch.eye(40, dtype=torch.bool).numpy()).all()
    assert (plain == torch.ones(40, 40, dtype=torch.bool).tril().numpy()).all()
    assert (varlen == block_diag_mask(seq_lens_to_cu_seqlens([10, 30]), causal=True).numpy()).all()


def test_row_dependency_rejects_bad_input():
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        row_dependency(lambda t: t, torch.arange(4))
    with pytest.raises(ValueError, match="fn must return"):
        row_dependency(lambda t: 3.0, torch.randn(2, 2))


def test_c9_masked_attention_allocates_the_score_matrix_varlen_does_not():
    lens, heads, d = [64] * 8, 4, 16
    t = sum(lens)
    masked = profile.measure_attention(lens, "masked", heads, d, repeats=1)
    varlen = profile.measure_attention(lens, "sdpa", heads, d, repeats=1)
    scores = heads * t * t * 4  # one fp32 [H, T, T] score tensor
    assert masked.peak_bytes >= scores
    assert varlen.peak_bytes < scores
    assert masked.seconds > 0 and varlen.seconds > 0
    assert masked.seq_lens == tuple(lens)


def test_peak_bytes_sees_a_known_allocation():
    n = 1 << 20
    assert profile.peak_bytes(lambda: torch.empty(n, dtype=torch.float32).fill_(1.0)) >= 4 * n


def test_time_call_and_matmul_throughput_validate_and_measure():
    assert profile.time_call(lambda: None, repeats=2) >= 0
    with pytest.raises(ValueError, match="repeats"):
        profile.time_call(lambda: None, repeats=0)
    assert profile.matmul_throughput(8, 16, 32, repeats=1) > 0
    with pytest.raises(ValueError, match="tokens"):
        profile.matmul_throughput(0)


def test_c14_forward_time_split_accounts_for_the_forward():
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=100, max_position=64)
    model = Transformer(cfg, seed=0)
    batch = pack([torch.randint(0, 100, (n,)) for n in (20, 30)])
    split = profile.forward_time_split(model, batch, repeats=1)
    assert set(split) == {"linear", "attention", "other", "profiled_total", "wall"}
    assert split["linear"] > 0 and split["attention"] > 0 and split["other"] >= 0
    assert split["linear"] + split["attention"] <= split["profiled_total"] * 1.05


def test_random_qkv_shapes():
    q, k, v, cu = profile.random_qkv([3, 4], 2, 8)
    assert q.shape == k.shape == v.shape == (7, 2, 8)
    assert cu.tolist() == [0, 3, 7] and cu.dtype == torch.int32
