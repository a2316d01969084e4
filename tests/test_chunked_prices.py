"""What chunked prefill costs, as the engine counts it: waits (serve.scheduler.prefill_waits), the rules of a
chunked schedule (chunked_schedule_problem), the KV cache's rows held (serve.kv_cache.cache_rows_held), the
linear layers' ridge (measure.flops.linear_ridge_tokens) and one TP forward priced part by part
(measure.comm.tp_forward_parts). Each checked against a hand count or an independent computation."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lessons_lib import ModelConfig, init_weights
from lessons_lib.measure.comm import NVLINK, all_reduce_seconds, tp_forward_parts, tp_run_prices
from lessons_lib.measure.flops import kv_cache_bytes, linear_intensity, linear_ridge_tokens
from lessons_lib.measure.machines import H200
from lessons_lib.serve.chunk_costs import fewest_forwards_budget, forward_score_cells, plan_prices
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


def _served(lens, budget, chunked=True):
    """An Engine run of prompts of ``lens`` under the op recorder: (its BatchStats, the recorder)."""
    from lessons_lib.measure.recorder import OpRecorder
    with Engine(SMALL, weights=init_weights(SMALL, 0), max_num_batched_tokens=budget,
                enable_chunked_prefill=chunked) as eng, OpRecorder() as rec:
        eng.prefill([Request(i, [(3 * i + t) % SMALL.vocab_size for t in range(n)]) for i, n in enumerate(lens)])
    return list(eng.stats), rec


def test_score_counts_per_head_per_layer_as_the_engine_ran_them():
    stats, rec = _served([12, 7], 5)           # request 0 in chunks 5, 5, 2; request 1 in 3, 4
    counts = rec.score_counts(SMALL.n_heads, SMALL.n_layers, wider_than=7)
    assert counts["cells"] == sum(s.cells_whole_computed for s in stats) == 5 * 5 + 5 * 10 + 2 * 12 + 3 * 3 + 4 * 7
    assert counts["query_rows"] == 12 + 7
    assert counts["cached_rows"] == sum(s.num_cached_tokens for s in stats) == 5 + 10 + 3
    assert counts["cells_wider"] == 5 * 10 + 2 * 12
    with pytest.raises(ValueError, match="not a multiple of 3 heads"):
        rec.score_counts(3, SMALL.n_layers)


def test_forward_score_cells_are_the_engine_s_whole_blocks():
    for chunked, budget in ((True, 5), (False, 32)):
        stats, _ = _served([12, 7, 3], budget, chunked)
        assert forward_score_cells([s.chunks for s in stats]) == [s.cells_whole_computed for s in stats]
    assert forward_score_cells([[(0, 4)], [(0, 2), (1, 2)]]) == [16, 2 * 6 + 2 * 2]


def test_plan_prices_by_hand():
    plan = [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 2), (1, 0, 3)]]     # as in the cache test above
    p = plan_prices(plan, [10, 3], [1], n_layers=8)
    assert (p["forwards"], p["all_reduces"], p["largest"]) == (3, 3 * 16, 5)
    assert (p["cache_rows_held"], p["held_by"], p["held_after"]) == (8, 0, 1)
    assert (p["wait_forwards"], p["wait_tokens"]) == (3, 13)


def test_fewest_forwards_budget_searches_the_plans():
    lens = [90, 700, 10, 10]
    # under budget b: ceil(810 / b) forwards; rows held: request 1 cut at a boundary p, p - 90 of its rows cached
    def by_hand(b):
        held = max((p - 90 for p in range(b, 810, b) if 90 < p < 790), default=0)
        return -(-810 // b), held
    fits = [b for b in range(16, 257, 16) if by_hand(b)[1] <= 600]
    assert fewest_forwards_budget(lens, [2, 3], 256, 600, 16) == min(fits, key=lambda b: (by_hand(b)[0], b))
    with pytest.raises(ValueError, match="no budget up to 256"):
        fewest_forwards_budget(lens, [2, 3], 256, 100, 16)


def test_tp_run_prices_sum_the_parts_per_forward():
    cfg = ModelConfig()
    prices = tp_run_prices(cfg, {"a": [512, 512, 100], "b": [1124]}, 16, 40)
    assert prices["a"]["forwards"] == 3 and prices["b"]["largest"] == 1124
    one = tp_forward_parts(cfg, 512, 16, 40)
    assert prices["a"]["weight_pass_s"] == pytest.approx(3 * one["weight_pass_s"])    # a pass per forward
    assert prices["a"]["launches_s"] == pytest.approx(3 * 40 * H200.launch_s)
    assert prices["b"]["all_reduces_s"] == pytest.approx(tp_forward_parts(cfg, 1124, 16, 40)["all_reduces_s"])


def test_chunk_masks_and_their_cells_by_hand():
    from lessons_lib import faults
    from lessons_lib.serve.chunk_costs import causal_cells_from_masks, chunk_mask, chunk_spans, staircase_cells
    assert chunk_mask(2, 2).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert chunk_spans([3, 4, 5]) == [(0, 3), (3, 4), (7, 5)]
    c = staircase_cells([4, 4, 2])                       # rectangles 4x4, 4x8, 2x10; causal 10 * 11 / 2
    assert c == {"computed": 16 + 32 + 20, "allowed": 55, "masked": 68 - 55}
    forwards = [[(0, 0, 4)], [(0, 4, 4), (1, 0, 3)]]
    assert causal_cells_from_masks(forwards) == 8 * 9 // 2 + 3 * 4 // 2
    with faults.injected("causal_mask_top_left"):        # the masks come from the engine's mask function
        assert causal_cells_from_masks(forwards) < 8 * 9 // 2 + 3 * 4 // 2
    with pytest.raises(ValueError, match="length"):
        chunk_mask(0, 0)


def test_serve_prompts_and_run_summary_are_the_engine_s():
    from lessons_lib.serve.runs import run_summary, serve_prompts
    prompts = [[t % SMALL.vocab_size for t in range(12)], [5] * 7]
    run = serve_prompts(prompts, 5, True, SMALL, record=True)
    s = run_summary(run, [1])
    assert s["timeline"] == [[(0, 5)], [(0, 5)], [(0, 2), (1, 3)], [(1, 4)]]
    assert s["waits"] == prefill_waits(s["timeline"]) and s["mean_behind"] == (4, 19)
    assert s["max_forward"] == 5 and s["cached_tokens"] == 5 + 10 + 3
    assert s["cells_whole"] == run["recorder"].score_counts(SMALL.n_heads, SMALL.n_layers)["cells"]
    assert run_summary(run, [])["mean_behind"] == (0.0, 0.0) and len(s["forward_ms"]) == 4
    whole = serve_prompts(prompts, 16, False, SMALL, requests=[1])
    assert list(whole["outputs"]) == [1] and whole["recorder"] is None and whole["traces"] == []


def test_forward_tokens_and_planned_forwards_are_the_scheduler_s():
    from lessons_lib.serve.chunk_costs import planned_forwards
    from lessons_lib.serve.runs import forward_tokens
    stats, _ = _served([12, 7], 5)
    assert forward_tokens(stats) == [[(0, 5)], [(0, 5)], [(0, 2), (1, 3)], [(1, 4)]]
    assert planned_forwards([12, 7], 5, True) == forward_tokens(stats)
    assert planned_forwards([12, 7, 3], 16, False) == [[(0, 12)], [(1, 7), (2, 3)]]
    assert planned_forwards([12, 7, 3], 16, False, max_num_seqs=1) == [[(0, 12)], [(1, 7)], [(2, 3)]]


def test_payloads_match_and_other_collectives_read_a_tp_run_s_traces():
    from lessons_lib.core.groups import CollectiveRecord
    from lessons_lib.serve.runs import other_collectives, payloads_match

    def ar(rows, layer):
        return CollectiveRecord("all_reduce", (rows, 64), "float32", rows * 256, layer, 0, 2)
    stats, _ = _served([6, 3], 16)                       # one forward of 9 tokens
    trace = [ar(9, "layers.0.attn.out_proj"), ar(9, "layers.0.mlp.fc_down")]
    assert payloads_match({"stats": stats, "traces": [trace]}, 64) and other_collectives(trace) == 0
    assert not payloads_match({"stats": stats, "traces": [[ar(6, "layers.0.attn.out_proj")]]}, 64)
    assert not payloads_match({"stats": stats, "traces": []}, 64)
    kv = CollectiveRecord("all_gather", (9, 4, 16), "float32", 0, "layers.0.attn.kv", 0, 2)
    assert other_collectives([*trace, kv, ar(9, "layers.0.attn.qkv")]) == 2


def test_draft_finish_by_hand():
    from lessons_lib.serve.chunk_costs import draft_finish
    # request 0 (the long one) in chunks of 4; request 1 passes it in forward 2, request 2 finishes with it
    forwards = [[(0, 4)], [(0, 2), (1, 2)], [(0, 4), (2, 1)]]
    assert draft_finish(forwards, 0, [1, 2]) == {"draft": 3, "before": 1, "forwards": 3}
    assert draft_finish([[(0, 0, 4)], [(0, 4, 2), (1, 0, 2)]], 0, [1]) == {"draft": 2, "before": 0, "forwards": 2}
    assert draft_finish([[(1, 5)], [(0, 9)]], 0, [1]) == {"draft": 2, "before": 1, "forwards": 2}


def test_stacked_outputs_same_argmax_and_score_blocks_read_a_run():
    from lessons_lib.serve.runs import run_summary, same_argmax, score_blocks, serve_prompts, stacked_outputs
    prompts = [[t % SMALL.vocab_size for t in range(12)], [5] * 7]
    chunked = serve_prompts(prompts, 5, True, SMALL, record=True)
    whole = serve_prompts(prompts, 16, False, SMALL)
    logits = stacked_outputs(chunked, "logits")
    assert logits.shape == (2, SMALL.vocab_size)
    assert torch.equal(logits[1], chunked["outputs"][1].logits)
    assert torch.equal(stacked_outputs(chunked, "logits", [1, 0])[0], logits[1])
    assert same_argmax(chunked, whole)
    flipped = {"outputs": {i: dataclasses.replace(o, logits=-o.logits) for i, o in whole["outputs"].items()}}
    assert not same_argmax(chunked, flipped)
    # chunks of request 0: 5 x 5, 5 x 10, 2 x 12; request 1: 3 x 3, 4 x 7; one block per layer per chunk
    assert sorted(set(score_blocks(chunked))) == [(2, 12), (3, 3), (4, 7), (5, 5), (5, 10)]
    assert len(score_blocks(chunked)) == 5 * SMALL.n_layers
    assert run_summary(chunked, [1])["chunks"] == {0: 3, 1: 2}
    assert run_summary(whole, [1])["chunks"] == {}
