"""measure.machines' pricing of lesson 05's measurements (``throughput_roof``, ``sweep_verdict``, ``forward_parts``,
``forward_roofline``, ``beside_roofline``) and measure.recorded's ``timed_forward`` (a real engine forward, recorded and timed)."""
from __future__ import annotations

import pytest
import torch

from lessons_lib.core.config import ModelConfig
from lessons_lib.measure.flops import forward_flops, linear_intensity
from lessons_lib.measure.machines import (
    Machine,
    beside_roofline,
    forward_parts,
    forward_roofline,
    sweep_verdict,
    throughput_roof,
)
from lessons_lib.measure.recorded import timed_forward
from lessons_lib.serve.workloads import packing_lens

CPU = Machine("cpu", 100e9, 10e9, dtype=torch.float32)          # given by hand: ridge 10 FLOP/byte
SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, n_kv_heads=2, d_ffn=128)


def test_throughput_roof_is_the_roofline_and_the_verdict_follows_the_numbers():
    roof = throughput_roof([1, 24, 4096], 512, 2048, CPU)
    assert roof[0] == pytest.approx(linear_intensity(1, 512, 2048, 4) * 10e9 / 1e9) and roof[0] < 5   # memory roof
    assert roof[-1] == 100.0                                                                           # the flat peak
    # a sweep that beats the peak and sits above the memory roof at T = 1: both said, with the numbers
    said = sweep_verdict([1, 24, 4096], [14.0, 90.0, 190.0], roof, 100e9, 4)
    assert "beats the peak measured beside it (100) by 1.9x" in said[0] and "T = 1:" in said[1] and "4 MiB" in said[1]
    # a sweep under its roof everywhere: neither is claimed
    said = sweep_verdict([1, 24, 4096], [r * 0.9 for r in roof], roof, 100e9, 4)
    assert said == ["no point beats the peak measured beside it (100 GFLOP/s; best 90)", "no point lies above the memory roof"]
    with pytest.raises(ValueError, match="one roof value per T"):
        sweep_verdict([1, 2], [1.0, 2.0], [1.0], 100e9, 4)
    with pytest.raises(ValueError, match="tokens"):
        throughput_roof([0], 512, 2048, CPU)


def test_forward_parts_are_causal_flops_over_bytes_on_the_machine():
    lin, att = forward_parts(SMALL, [30, 10], CPU, nbytes=4)
    f = forward_flops(SMALL, [30, 10], causal=True)
    assert (lin.flops, att.flops) == (f.linear, f.attention)
    assert att.bytes == 2 * 4 * 40 * (2 * 64 + 2 * 32)             # Q and O all heads, K and V 2 K/V heads, per layer
    assert att.seconds == max(att.flops / 100e9, att.bytes / 10e9) and lin.intensity == lin.flops / lin.bytes


def test_forward_roofline_adds_one_gemm_per_linear_layer_and_one_attention_kernel_per_layer():
    slow = Machine("launch-heavy", 100e9, 10e9, launch_s=1e-3, dtype=torch.float32)
    r = forward_roofline(SMALL, [30, 10], slow, nbytes=4)
    lin, att = forward_parts(SMALL, [30, 10], slow, nbytes=4)
    assert (r["linear"], r["attention"], r["seconds"]) == (lin, att, lin.seconds + att.seconds)
    assert r["kernels"] == 2 * 5 and r["floor"] == pytest.approx(10e-3)     # 2 layers: 4 GEMMs + 1 attention each
    assert r["part_floor"] == pytest.approx({"linear": 8e-3, "attention": 2e-3})
    assert r["binds"] == "launch latency" and r["floor"] >= r["seconds"]
    fast = forward_roofline(SMALL, [30, 10], CPU, nbytes=4)                # no launch cost known: floor 0
    assert fast["floor"] == 0.0 and fast["binds"] == "the roofline"


def test_timed_forward_times_the_engine_on_the_lengths_given_and_refuses_too_many():
    point = timed_forward(SMALL, [30, 10], repeats=1)
    assert point["seq_lens"] == [30, 10] and point["seconds"] > 0 and point["cfg"].n_kv_heads == 2
    want = forward_flops(SMALL, [30, 10])                 # recorded: the kernel computes each block whole
    assert (point["flops"].linear, point["flops"].attention) == (want.linear, want.attention) and point["ops"] > 20
    fast = Machine("gpu-like", 1e12, 1e11, launch_s=1e-6)
    m = beside_roofline(point, fast)
    lin, att = forward_parts(point["cfg"], [30, 10], fast, 4)
    assert m["predicted"] == lin.seconds + att.seconds and m["floor"] == point["ops"] * 1e-6
    assert m["whole_blocks"] == want and m["causal_flops"] < want.total and m["seconds"] == point["seconds"]
    with pytest.raises(ValueError, match="at most 1024 tokens"):
        timed_forward(SMALL, [600, 600])
    with pytest.raises(ValueError, match=r"seq_lens\[1\] must be >= 1"):
        timed_forward(SMALL, [3, 0])
    assert packing_lens(10, 4) == [3, 3, 2, 2]             # the explorer's R x T/R packing
