"""Prefill schedules (``serve.schedules``): validity, measures against FCFS, shortest first, the step driver."""
import pytest

from lessons_lib.core.config import ModelConfig
from lessons_lib.serve.scheduler import Scheduler, plan_batches
from lessons_lib.serve.schedules import (
    drive_scheduler,
    passed_over,
    plan_totals,
    schedule_measures,
    schedule_problem,
    schedule_table,
    schedule_within,
    shortest_first_batches,
    totals_text,
)


class Empty(Scheduler):
    def schedule(self):
        return []


def test_s3_schedule_problem_names_what_makes_a_schedule_invalid():
    lens = [10, 30, 20, 5]
    assert schedule_problem([[0, 1], [2, 3]], lens, 40, 4) is None
    assert "exactly once" in schedule_problem([[0, 1], [2]], lens, 40, 4)
    assert "served twice [1]" in schedule_problem([[0, 1], [1, 2, 3]], lens, 60, 4)
    assert "LENGTHS" in schedule_problem([[10, 30], [20, 5]], lens, 40, 4)
    assert "> max_num_batched_tokens=40" in schedule_problem([[0, 1, 3], [2]], lens, 40, 4)
    assert "> max_num_seqs=2" in schedule_problem([[0, 2, 3], [1]], lens, 64, 2)
    assert "empty" in schedule_problem([[0, 1], [], [2, 3]], lens, 40, 4)
    assert "list of batches" in schedule_problem("0,1", lens, 40, 4)


def test_schedule_measures_count_pad_rows_masked_cells_and_fairness():
    lens = [300, 20, 300, 20, 300, 20, 20, 20]
    fcfs_batches = plan_batches(lens, 640, 4)
    base = schedule_measures(lens, fcfs_batches, 640, 4)
    assert base["batches"] == len(fcfs_batches) and base["max_delay"] == 0 and base["overtakes"] == 0
    assert base["pad_rows"] == sum(len(b) * max(lens[i] for i in b) - sum(lens[i] for i in b) for b in fcfs_batches)
    mine = [[1, 3, 5, 6], [7, 0], [2, 4]]  # short ones first: request 2 runs in batch 2, FCFS ran it in batch 0
    m = schedule_measures(lens, mine, 640, 4)
    assert m["pad_rows"] == 0 + 280 + 0
    assert m["masked_wasted"] == (80 ** 2 - 4 * 400) + (320 ** 2 - 300 ** 2 - 400) + (600 ** 2 - 2 * 300 ** 2)
    at = {i: b for b, ids in enumerate(mine) for i in ids}
    at_fcfs = {i: b for b, ids in enumerate(fcfs_batches) for i in ids}
    assert m["max_delay"] == max(at[i] - at_fcfs[i] for i in at) == 2
    assert m["overtakes"] == sum(at[j] < at[i] for i in range(8) for j in range(i + 1, 8))


def test_drive_scheduler_feeds_arrivals_between_steps():
    # FCFS with 2 requests per batch: step 0 sees [5, 6, 7], step 1 adds [8]
    assert drive_scheduler(lambda b, s: Scheduler(b, s), [[5, 6, 7], [8]], 100, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="empty batch"):
        drive_scheduler(lambda b, s: Empty(b, s), [[5]], 100, 2)


def test_sorted_batches_is_shortest_first_within_both_budgets():
    assert shortest_first_batches([92, 56, 36, 73, 36], 128) == [[2, 4, 1], [3], [0]]
    assert shortest_first_batches([1, 1, 1], 10, 2) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="seq_lens"):
        shortest_first_batches([5, 200], 128)


def test_method_totals_count_rows_cells_and_flops_by_whole_blocks():
    from lessons_lib.measure.flops import forward_flops
    cfg = ModelConfig()
    batches = [[10, 30], [5, 5, 40]]
    t = plan_totals(cfg, batches)
    for m in ("padded", "masked", "varlen"):
        assert t[m]["flops_executed"] == sum(forward_flops(cfg, b, m, causal=False).total for b in batches)
        assert t[m]["flops_useful"] == t["varlen"]["flops_executed"]  # useful = what varlen runs, whole blocks
    assert t["varlen"]["cells_computed"] == t["varlen"]["cells_useful"] == 100 + 900 + 25 + 25 + 1600
    assert t["masked"]["cells_computed"] == 40 ** 2 + 50 ** 2 and t["padded"]["pad_rows"] == 20 + 35 + 35


def test_schedule_table_prints_fcfs_beside_the_schedule():
    lens, mine = [300, 20, 300, 20, 300, 20, 20, 20], [[1, 3, 5, 6], [7, 0], [2, 4]]
    base = schedule_measures(lens, plan_batches(lens, 640, 4), 640, 4)
    table = schedule_table(lens, mine, 640, 4).splitlines()
    assert table[1].split()[:3] == ["FCFS", str(base["batches"]), f"{base['pad_rows']:,}"]
    assert table[2].split()[:3] == ["yours", "3", "280"]


def test_passed_over_counts_only_batches_formed_after_the_arrival():
    # request 0 (400 tokens) waits while batches 0, 1 and 2 serve later arrivals (1, then 2, then 3 and 4)
    arrivals = [[400, 10], [10], [10, 10]]
    batches = [[1], [2], [3, 4], [0]]
    assert passed_over(batches, arrivals) == {1: 0, 2: 0, 3: 0, 4: 0, 0: 3}
    assert passed_over([[0, 1], [2]], [[5, 5], [5]]) == {0: 0, 1: 0, 2: 0}


def test_totals_text_prints_one_line_per_method_with_what_it_counts():
    text = totals_text(plan_totals(ModelConfig(), [[10, 30], [5, 5, 40]])).splitlines()
    assert [ln.split()[0] for ln in text] == ["padded", "masked", "varlen"]
    assert all("whole blocks" in ln for ln in text) and "1.00x the useful" in text[2]
    assert "(pad      90)" in text[0] and "(pad       0)" in text[2]


def test_schedule_within_refuses_the_oversize_and_keeps_the_stream_ids():
    lens = [300, 20, 900, 20, 300]                       # request 2 is over the 600-token budget
    batches, m = schedule_within("FCFS", lens, 600)
    assert batches == [[0, 1, 3], [4]]
    assert [i for i, _ in m["delays"]] == [0, 1, 3, 4] and m["max_delay"] == 0
    batches, m = schedule_within("shortest first", [20, 300, 900, 300, 20], 600)
    assert batches == [[0, 4, 1], [3]] and m["pad_rows"] == 2 * 280
    assert dict(m["delays"]) == {0: 0, 1: 0, 3: 0, 4: -1} and m["overtakes"] == 1
    with pytest.raises(ValueError, match="scheduler must be one of"):
        schedule_within("random", lens, 600)
