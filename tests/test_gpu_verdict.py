"""measure.flops' GPU floor under the roofline: thread blocks of a GEMM and of varlen FlashAttention, and what binds
first (``gpu_verdict``): launch latency, occupancy or the roofline's own bound."""
from __future__ import annotations

import pytest

from lessons_lib.core.config import ModelConfig
from lessons_lib.measure.flops import (
    attention_thread_blocks,
    decode_step_parts,
    decode_step_verdicts,
    gemm_thread_blocks,
    gpu_verdict,
)
from lessons_lib.measure.machines import H200, Machine


def test_thread_blocks_are_output_tiles_and_query_tiles():
    assert gemm_thread_blocks(1000, 2048) == 8 * 16            # ceil(1000 / 128) x 2048 / 128
    assert gemm_thread_blocks(1, 1) == 1
    assert attention_thread_blocks([1000], 8) == 8 * 8         # 8 query tiles of 128, 8 heads
    assert attention_thread_blocks([100] * 10, 8) == 10 * 8    # one tile per request per head
    with pytest.raises(ValueError, match="rows"):
        gemm_thread_blocks(0, 16)


def test_gpu_verdict_says_what_binds_first():
    gpu = Machine("gpu", 100e12, 1e12, n_sms=100, launch_s=1e-6)   # ridge 100 FLOP/byte
    tiny = gpu_verdict(1e6, 1e3, gpu, blocks=1000)                    # 10 ns of arithmetic: one launch is longer
    assert tiny.binds == "launch latency" and tiny.seconds == 1e-6
    few = gpu_verdict(1e9, 1e6, gpu, blocks=25)                       # 10 us at peak, a quarter of the SMs busy
    assert few.binds == "occupancy" and few.seconds == pytest.approx(40e-6) and few.occupancy == 0.25
    full = gpu_verdict(1e9, 1e8, gpu, blocks=400)                     # 10 FLOP/byte: memory-bound, 100 us
    assert full.binds == "memory-bound" and full.seconds == pytest.approx(100e-6)
    assert "400 thread blocks for 100 SMs" in str(full) and "the roofline (memory-bound) binds first" in str(full)
    with pytest.raises(ValueError, match="n_sms and launch_s"):
        gpu_verdict(1e9, 1e6, Machine("cpu", 1e9, 1e9), blocks=1)


def test_h200_1x1000_attention_at_d_model_512_is_launch_bound_and_at_4096_compute_bound():
    # one layer, causal, bf16: 4 · d_head · heads · L(L + 1) / 2 FLOPs over Q, K, V, O (2 bytes each)
    for heads, d_head, binds in ((8, 64, "launch latency"), (32, 128, "compute-bound")):
        k = heads * d_head
        v = gpu_verdict(4 * k * 1000 * 1001 // 2, 2 * 4 * 1000 * k, H200, attention_thread_blocks([1000], heads))
        assert v.part.bound == "compute-bound" and v.binds == binds


def test_decode_step_verdicts_count_the_step_s_gemm_tiles_and_attention_blocks():
    cfg = ModelConfig()                                    # d_model 512, 8 heads, FFN 2048
    lin, att = decode_step_verdicts(cfg, 1, 128, H200)
    p = decode_step_parts(cfg, 1, 128, H200)
    assert (lin.part, att.part) == (p.linear, p.attention)
    assert lin.blocks == 1536 // 128 + 512 // 128 + 2048 // 128 + 512 // 128 and lin.kernels == 4   # one tile row
    assert att.blocks == 8 and att.kernels == 1            # one block per request and head
    assert decode_step_verdicts(cfg, 300, 128, H200)[0].blocks == 3 * 36 and lin.binds == "launch latency"
