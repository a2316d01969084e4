"""What chunked prefill costs, as the engine counts it: waits (serve.scheduler.prefill_waits), the rules of a
chunked schedule (chunked_schedule_problem), the KV cache's rows held (serve.kv_cache.cache_rows_held), the
linear layers' ridge (measure.flops.linear_ridge_tokens) and one TP forward priced part by part
(measure.comm.tp_forward_parts). Each checked against a hand count or an independent computation."""
from __future__ import annotations

import pytest

from lessons_lib import ModelConfig, init_weights
from lessons_lib.measure.comm import NVLINK, all_reduce_seconds, tp_forward_parts
from lessons_lib.measure.flops import kv_cache_bytes, linear_intensity, linear_ridge_tokens
from lessons_lib.measure.machines import H200
from lessons_lib.serve.engine import Engine
from lessons_lib.serve.kv_cache import cache_rows_held
from lessons_lib.serve.scheduler import Request, chunked_schedule_problem, mean_prefill_wait, plan_batches, prefill_waits

SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=4096)


def test_prefill_waits_end_with_the_last_chunk():
    steps = [[(0, 4)], [(0, 2), (1, 2)], [(1, 1)]]
    assert prefill_waits(steps) == {0: (2, 8), 1: (3, 9)}
    chunks = [[(0, 0, 4)], [(0, 4, 2), (1, 0, 2)], [(1, 2, 1)]]        # the same run as (request, start, length)
    assert prefill_waits(chunks) == prefill_waits(steps)
    assert mean_prefill_wait(prefill_waits(steps), [0, 1]) == (2.5, 8.5)
    with pytest.raises(ValueError, match="non-empty list of requests"):
        mean_prefill_wait(prefill_waits(steps), [])
    with pytest.raises(ValueError, match="requests the run served"):
        mean_prefill_wait(prefill_waits(steps), [7])


def test_the_scheduler_s_chunked_plans_keep_the_rules():
    for lens, budget, seqs, cap in (([700, 40, 30], 256, 256, 0), ([600, 10, 10, 10], 200, 2, 64),
                                    ([300, 50, 500, 20], 256, 256, 100), ([3, 1, 2], 1, 256, 0)):
        plan = plan_batches(lens, budget, seqs, enable_chunked_prefill=True, long_prefill_token_threshold=cap or None)
        assert chunked_schedule_problem([[(i, n) for i, _, n in f] for f in plan], lens, budget, seqs, cap) is None


def test_chunked_schedule_problem_accepts_another_schedule_and_names_each_broken_rule():
    # two requests of 6 under a budget of 8, cap 5: (5, 3) then (1, 3) is the scheduler's; (4, 4) then (2, 2) keeps the rules
    assert chunked_schedule_problem([[(0, 4), (1, 4)], [(0, 2), (1, 2)]], [6, 6], 8, 256, 5) is None
    assert chunked_schedule_problem([[(0, 5), (1, 3)], [(0, 1), (1, 3)]], [6, 6], 8, 256, 5) is None
    assert "room" in chunked_schedule_problem([[(0, 4), (1, 3)], [(0, 2), (1, 3)]], [6, 6], 8, 256, 5)
    assert "arrival order" in chunked_schedule_problem([[(1, 5), (2, 3)], [(0, 6), (2, 3)]], [6, 6, 6], 8, 256, 5)
    assert "exceed the cap" in chunked_schedule_problem([[(0, 6), (1, 2)], [(1, 4)]], [6, 6], 8, 256, 5)
    assert "room LEFT" in chunked_schedule_problem([[(0, 6), (1, 6)]], [6, 6], 8, 256, 0)
    assert "counts requests" in chunked_schedule_problem([[(0, 1), (1, 1), (2, 1)]], [1, 1, 1], 8, 2, 0)
    assert "not finished" in chunked_schedule_problem([[(0, 6), (1, 2)]], [6, 6], 8, 256, 0)
    assert "should not exist" in chunked_schedule_problem([[(0, 6)], [(0, 1)]], [6], 8, 256, 0)
    assert "pair (request index" in chunked_schedule_problem([[0, 1]], [6, 6], 8, 256, 0)


def test_cache_rows_held_by_hand_and_as_the_cache_measured_it():
    # one prompt of 10 in chunks 4, 4, 2 beside a fresh 3: the copy peaks in forward 1 (4 old + 8 new rows)
    plan = [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 2), (1, 0, 3)]]
    assert cache_rows_held(plan, [10, 3]) == {"copy": 12, "in_place": 8, "in_forward": 13, "held_by": 0,
                                              "held_after": 1}
    lens = [30, 25, 7]
    with Engine(SMALL, weights=init_weights(SMALL, 0), max_num_batched_tokens=16, enable_chunked_prefill=True) as eng:
        eng.prefill([Request(i, [(5 * i + t) % SMALL.vocab_size for t in range(n)]) for i, n in enumerate(lens)])
        rows = cache_rows_held(eng.stats, lens)
        assert eng.kv_cache_peak_bytes == rows["copy"] * kv_cache_bytes(SMALL, [1], bytes_per_element=4) > 0
    assert rows["in_place"] == max(s + n for f in plan_batches(lens, 16, enable_chunked_prefill=True)
                                   for i, s, n in f if s + n < lens[i])


def test_linear_ridge_tokens_is_the_first_token_count_at_the_ridge():
    cfg = ModelConfig()
    for tp in (1, 2):
        found = linear_ridge_tokens(cfg, H200.ridge, tp)
        for (a, b), n in zip(((512, 1536 // tp), (512 // tp, 512), (512, 2048 // tp), (2048 // tp, 512)), found.values()):
            if n is None:
                assert linear_intensity(1 << 16, a, b, 2) < H200.ridge
            else:
                assert linear_intensity(n, a, b, 2) >= H200.ridge > linear_intensity(n - 1, a, b, 2)
    assert linear_ridge_tokens(cfg, H200.ridge, 2)["out proj"] is None
    with pytest.raises(ValueError, match="ridge"):
        linear_ridge_tokens(cfg, 0.0)


def test_tp_forward_parts_by_hand():
    cfg, n = SMALL, 48          # TP=2 shapes by hand: QKV 64 x 96, out 32 x 64, up 64 x 128, down 128 x 64
    shapes = [(64, 96), (32, 64), (64, 128), (128, 64)]
    parts = tp_forward_parts(cfg, n, launches=10)
    weights = sum(a * b for a, b in shapes)
    assert parts["arithmetic_s"] == pytest.approx(2 * 2 * n * weights / H200.peak_flops)
    assert parts["weight_pass_s"] == pytest.approx(2 * 2 * weights / H200.bytes_per_s)
    assert parts["memory_s"] == pytest.approx(2 * 2 * (weights + n * sum(a + b for a, b in shapes)) / H200.bytes_per_s)
    assert parts["all_reduces_s"] == pytest.approx(4 * all_reduce_seconds(NVLINK, n * 64 * 2, 2))
    assert parts["all_reduce_latency_s"] + parts["all_reduce_bandwidth_s"] == pytest.approx(
        all_reduce_seconds(NVLINK, n * 64 * 2, 2))
    assert parts["launches_s"] == pytest.approx(10 * H200.launch_s)
    assert tp_forward_parts(cfg, n, all_reduces=0)["all_reduces_s"] == 0
    with pytest.raises(ValueError, match="num_tokens"):
        tp_forward_parts(cfg, 0)
