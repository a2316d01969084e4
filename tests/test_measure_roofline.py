"""The decode-step roofline in measure.flops / measure.machines, and measure.profile's timing helpers, against
counts made by hand and a fake clock (no timing is asserted)."""
import dataclasses

import pytest
import torch

from lessons_lib.core.config import ModelConfig
from lessons_lib.measure import profile
from lessons_lib.measure.flops import (
    attention_crossover_length,
    block_linear_intensity,
    decode_attention_intensity,
    decode_step_parts,
    forward_flops,
    linear_terms,
    min_decode_batch,
    roofline_part,
)
from lessons_lib.measure.machines import H200, Machine

CFG = ModelConfig()  # d_model 512, 8 heads of 64, FFN 2048
# by hand: QKV 512 x 1536, out proj 512 x 512, FFN-up 512 x 2048, FFN-down 2048 x 512
W = 512 * 1536 + 512 * 512 + 512 * 2048 + 2048 * 512
A = (512 + 1536) + (512 + 512) + (512 + 2048) + (2048 + 512)


def test_linear_terms_by_hand_and_per_rank():
    assert linear_terms(CFG) == (W, A)
    w2, a2 = linear_terms(CFG, tp_size=2)
    assert w2 == W // 2 and a2 == (512 + 768) + (256 + 512) + (512 + 1024) + (1024 + 512)
    grouped = dataclasses.replace(CFG, n_kv_heads=2)
    assert linear_terms(grouped)[0] == 512 * (512 + 2 * 128) + 512 * 512 + 2 * 512 * 2048


@pytest.mark.parametrize("rows", [1, 7, 384, 10**6])
def test_block_linear_intensity_is_rows_over_one_plus_rows_over_384(rows):
    assert block_linear_intensity(CFG, rows) == pytest.approx(rows / (1 + rows / 384))   # A / W = 1 / 384
    assert block_linear_intensity(CFG, rows, 4) == pytest.approx(rows / (1 + rows / 384) / 2)


@pytest.mark.parametrize("ridge, nbytes", [(H200.ridge, 2), (9.0, 4), (1.0, 2), (383.0, 2), (200.0, 4)])
def test_min_decode_batch_is_the_first_r_a_linear_scan_finds(ridge, nbytes):
    limit = 2 * W / (nbytes * A)                                   # the intensity's ceiling, by hand
    scan = next((r for r in range(1, 200_000) if 2 * r * W / (nbytes * (W + r * A)) >= ridge), None)
    assert min_decode_batch(CFG, ridge, nbytes) == scan
    assert (scan is None) == (ridge >= limit)


def test_decode_attention_intensity_counts_both_matmuls_by_hand():
    g, d, n = 8, 64, 128                  # one K/V head, 8 query heads as rows
    flops = 2 * g * d * n + 2 * g * n * d                          # [G, D] @ [D, L] and [G, L] @ [L, D]
    moved = 2 * ((g * d + d * n + g * n) + (g * n + n * d + g * d))  # bf16, each operand once
    assert decode_attention_intensity(n, d, 2, group=g) == pytest.approx(flops / moved)
    assert decode_attention_intensity(n, d) == pytest.approx(2 * n * d / (2 * (d + n * d + n)))
    assert decode_attention_intensity(n, d, 2, group=g) < g * decode_attention_intensity(n, d)


def test_decode_step_parts_on_the_h200_by_hand():
    step = decode_step_parts(CFG, 256, 128, H200)
    k = 512
    assert (step.linear.flops, step.linear.bytes) == (2 * 256 * W, 2 * (W + 256 * A))
    assert (step.attention.flops, step.attention.bytes) == (256 * 4 * k * 128, 2 * 256 * (2 * k + 2 * k * 128))
    assert step.linear.seconds == pytest.approx(max(2 * 256 * W / 989e12, 2 * (W + 256 * A) / 4.8e12))
    assert step.linear.bound == step.attention.bound == "memory-bound"
    assert step.longer == "attention" and step.seconds == step.linear.seconds + step.attention.seconds
    assert decode_step_parts(CFG, 4096, 8, H200).linear.bound == "compute-bound"
    assert decode_step_parts(CFG, 1, 1000, H200).longer == "linear"


def test_roofline_part_bound_at_the_ridge_and_attainable_flops():
    m = Machine("m", 100.0, 10.0)                                  # ridge 10 FLOP/byte
    assert m.roofline_part(100.0, 10.0).bound == "compute-bound"
    assert m.roofline_part(99.0, 10.0).bound == "memory-bound"
    assert m.roofline_part(50.0, 10.0).seconds == pytest.approx(1.0)  # the bytes at 10 B/s
    assert (m.attainable_flops(2.0), m.attainable_flops(50.0)) == (20.0, 100.0)


def test_bad_input_is_refused():
    for call, message in ((lambda: roofline_part(1.0, 0.0, 1.0, 1.0), "nbytes"),
                          (lambda: H200.attainable_flops(-1.0), "intensity"),
                          (lambda: min_decode_batch(CFG, 0.0), "ridge"),
                          (lambda: decode_step_parts(CFG, 0, 8, H200), "requests"),
                          (lambda: decode_step_parts(CFG, 1, 8, H200, 3), "bytes_per_element"),
                          (lambda: decode_attention_intensity(8, 4, group=0), "group"),
                          (lambda: block_linear_intensity(CFG, 0), "rows")):
        with pytest.raises(ValueError, match=message):
            call()


def test_cpu_threads_sets_and_restores_the_count_even_on_error():
    before = torch.get_num_threads()
    with profile.cpu_threads(1):
        assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError), profile.cpu_threads(1):
        raise RuntimeError
    with profile.cpu_threads(None):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="cpu_threads"), profile.cpu_threads(0):
        pass


def test_interleaved_best_calls_in_turn_and_keeps_each_fastest_after_the_warm_up(monkeypatch):
    order = []
    durations = {"a": iter([100, 5, 3, 4]), "b": iter([100, 7, 9, 2])}   # the warm-up round is the slowest
    now = [0.0]                                                          # the fake clock's time

    def call(key):
        def run():
            order.append(key)
            now[0] += next(durations[key])
        return run

    monkeypatch.setattr(profile.time, "perf_counter", lambda: now[0])
    best = profile.interleaved_best({"a": call("a"), "b": call("b")}, rounds=3)
    assert best == {"a": 3.0, "b": 2.0}
    assert order == ["a", "b"] * 4
    with pytest.raises(ValueError, match="rounds"):
        profile.interleaved_best({"a": call("a")}, rounds=0)


@pytest.mark.parametrize("cfg", [CFG, ModelConfig(n_layers=1, d_model=96, n_heads=2, d_head=48, d_ffn=200)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_crossover_length_is_where_attention_first_reaches_linear(cfg, causal):
    n = attention_crossover_length(cfg, causal)
    above, below = forward_flops(cfg, [n], causal=causal), forward_flops(cfg, [n - 1], causal=causal)
    assert above.attention >= above.linear and below.attention < below.linear
    if cfg is CFG:                                   # by hand: 24 d² per token against 4 d L (whole blocks)
        assert n == (12 * 512 - 1 if causal else 6 * 512)
