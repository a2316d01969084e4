"""measure.profile: timing, peak memory, GEMM throughput and the time split (measured; never a timed assertion)."""
from __future__ import annotations

import pytest
import torch

from lessons_lib import ModelConfig, Transformer, pack
from lessons_lib.measure import profile


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


def test_linear_layers_sampler_measures_and_validates():
    sample = profile.linear_layers_sampler([5, 9], [(16, 48), (16, 16), (16, 64), (64, 16)], repeats=1)
    assert sample() > 0 and sample() > 0  # reusable: inputs drawn once
    with pytest.raises(ValueError, match="repeats"):
        profile.linear_layers_sampler([4], [(8, 8)], repeats=0)
    with pytest.raises(ValueError, match="tokens"):
        profile.linear_layers_sampler([], [(8, 8)])


def test_top_ops_sees_a_matmul():
    a = torch.randn(256, 256)
    ops = profile.top_ops(lambda: (a @ a).relu(), n=3)
    names = [name for name, _, _ in ops]
    assert "aten::mm" in names and all(0 <= share <= 1 for _, _, share in ops)
