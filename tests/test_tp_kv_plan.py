"""tp.kv_plan: the engine's grouped-query plan under TP, a given plan run on thread ranks, and layouts sized from it."""
import pytest

from lessons_lib.tp.kv_plan import GiB, KVPlan, best_layout, engine_kv_plan, layout_cache_bytes, run_kv_plan


def test_the_engines_plan_runs_right_and_a_shifted_one_does_not():
    plan = engine_kv_plan(8, 2, 4, 1, 4, 4)                      # tp 4 > 2 K/V heads: each held on 2 ranks
    assert plan.kv_heads == ((0,), (0,), (1,), (1,)) and plan.replicas == 2
    error, allowed = run_kv_plan(8, 2, 4, plan.kv_heads)
    assert error <= allowed
    error, allowed = run_kv_plan(8, 2, 4, [[1], [1], [0], [0]])  # each rank's queries read the other group's K/V
    assert error > 10 * allowed


def test_a_plan_the_engine_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match="rank 0"):
        run_kv_plan(8, 4, 2, [[0], [2]])                        # 2 K/V heads per rank, one given
    with pytest.raises(ValueError, match="one per rank"):
        run_kv_plan(8, 4, 2, [[0, 1]])


def test_best_layout_fits_the_budget_on_the_engine_and_no_more_heads_would():
    args = (8, 16, 4, 4, 2, 8, 64)                               # 8 heads of 16, 4 layers, 4 GPUs, bf16, 8 x 64 tokens
    budget = layout_cache_bytes(8, 2, 16, 4, 2, 8, 64, 2, 1, 2)  # what 2 K/V heads cost at tp 2, dp 2
    kv, tp, pp, dp = best_layout(*args, budget)
    assert tp * pp * dp == 4 and layout_cache_bytes(8, kv, 16, 4, 2, 8, 64, tp, pp, dp) <= budget
    assert kv >= 2
    assert best_layout(*args, 1) is None
    assert GiB == 1 << 30


def test_holders_are_the_ranks_of_each_kv_head():
    assert engine_kv_plan(8, 2, 4, 1, 4, 4).holders == {0: (0, 1), 1: (2, 3)}   # tp 4 > 2 K/V heads: 2 copies each
    assert engine_kv_plan(8, 4, 4, 1, 2, 4).holders == {0: (0,), 1: (0,), 2: (1,), 3: (1,)}
    assert KVPlan((), ((1,), (0,), (1,)), 0).holders == {1: (0, 2), 0: (1,)}
