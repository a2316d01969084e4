"""Lesson 06's module (lessons_lib/course/l06_engine.py): figures, the prefill-plan explorer, schedule
measures, and the two exercise checkers (your attention inside Engine, a length-sorting scheduler)."""
from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import attempt, by_class, by_gid, png_of, stub

from lessons_lib import ModelConfig
from lessons_lib.course import l06_engine as L
from lessons_lib.course.grading import score
from lessons_lib.serve.engine import batch_stats
from lessons_lib.serve.scheduler import plan_batches
from lessons_lib.serve.workloads import workload_lengths
from lessons_lib.style import MIN_FONT


def fcfs(lens, budget):
    """FCFS written here, independently of the library."""
    batches, cur, used = [], [], 0
    for i, n in enumerate(lens):
        if cur and used + n > budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    return batches + [cur]


# ---- the stream --------------------------------------------------------------------------------------

def test_s3_lesson_stream_is_24_long_tailed_prompts_with_one_over_the_budget():
    lens, prompts = L.stream_prompts()
    assert len(lens) == 24 and [len(p) for p in prompts] == lens
    assert [i for i, n in enumerate(lens) if n > 512] == [9] and lens[9] == 1776
    kept = [n for n in lens if n <= 512]
    assert [[kept[i] for i in b] for b in fcfs(kept, 512)] == [[lens[i] for i in b] for b in plan_batches(
        lens, 512, skip_oversize=True)]
    assert len(plan_batches(lens, 512, skip_oversize=True)) == 5


def test_stack_orders_rows_by_request_id():
    a, b = torch.zeros(2, 3), torch.ones(1, 3)
    assert torch.equal(L.stack({5: b, 1: a}), torch.cat([a, b]))


# ---- figures -------------------------------------------------------------------------------------------

def test_s3_fcfs_batches_draws_every_served_request_and_the_refused_one():
    lens = [10, 30, 5, 60, 2, 2, 700, 40]
    fig = L.fcfs_batches(lens, 64)
    served = [i for i, n in enumerate(lens) if n <= 64]
    for i in served:
        assert by_gid(fig, f"req-{i}").get_width() == lens[i]
        label = by_gid(fig, f"label-{i}")  # every request is labelled, narrow ones beside their bar
        assert label.get_text() == str(i) and label.get_fontsize() >= MIN_FONT
    narrow = L.fcfs_batches([490, 5, 3, 10], 512)  # 5 and 3 tokens of 512 are too narrow for their label
    box = by_gid(narrow, "req-1")
    assert by_gid(narrow, "label-0").get_position()[1] == 0                             # wide: inside its bar
    assert by_gid(narrow, "label-1").get_position()[1] < box.get_y()                    # narrow: above the bar
    assert by_gid(narrow, "label-2").get_position()[1] > box.get_y() + box.get_height()  # the next narrow one: below
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("neighbour" in t for t in legend) and "refused" in legend
    assert by_gid(fig, "refused-6")
    batches = plan_batches(lens, 64, skip_oversize=True)
    for ids in batches:  # requests of one batch sit side by side, in arrival order
        xs = [by_gid(fig, f"req-{i}").get_x() for i in ids]
        assert xs == [sum(lens[j] for j in ids[:k]) for k in range(len(ids))]
    assert "7 requests in 3 batches, 1 refused" in fig.axes[0].get_title()


def test_c2_c8_c10_batch_waste_bars_are_the_per_batch_counts():
    cfg = ModelConfig()
    batches = [[lens_ for lens_ in b] for b in ([10, 30], [5], [60, 2, 2], [40])]
    stats = {m: [batch_stats(cfg, b, m, i) for i, b in enumerate(batches)] for m in ("padded", "masked", "varlen")}
    fig = L.batch_waste(stats, 64)
    for b, lens in enumerate(batches):
        assert by_gid(fig, f"rows-useful-{b}").get_height() == sum(lens)
        assert by_gid(fig, f"rows-pad-{b}").get_height() == len(lens) * max(lens) - sum(lens)
        useful = sum(n * n for n in lens)
        for m, computed in (("padded", len(lens) * max(lens) ** 2), ("masked", sum(lens) ** 2), ("varlen", useful)):
            assert by_gid(fig, f"cells-{m}-useful-{b}").get_height() == useful
            assert by_gid(fig, f"cells-{m}-wasted-{b}").get_height() == computed - useful
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "budget 64 tokens: padded rows go over it" in legend  # 3 x 30 = 90 rows for a 64-token budget
    with pytest.raises(ValueError, match="same batches"):
        L.batch_waste({"varlen": stats["varlen"], "masked": stats["masked"][:-1]})
    with pytest.raises(ValueError, match="empty"):
        L.batch_waste({})


def test_batch_waste_uses_the_course_palette():
    from matplotlib.colors import to_hex

    from lessons_lib.style import ATTENTION, LINEAR, WASTE
    cfg = ModelConfig()
    stats = {m: [batch_stats(cfg, [10, 30], m)] for m in ("padded", "masked", "varlen")}
    fig = L.batch_waste(stats)
    assert to_hex(by_gid(fig, "rows-useful-0").get_facecolor()) == LINEAR.lower()
    assert to_hex(by_gid(fig, "rows-pad-0").get_facecolor()) == WASTE.lower()
    assert to_hex(by_gid(fig, "cells-masked-useful-0").get_facecolor()) == ATTENTION.lower()
    assert to_hex(by_gid(fig, "cells-masked-wasted-0").get_facecolor()) == WASTE.lower()


# ---- the explorer ---------------------------------------------------------------------------------------

LINE = re.compile(r"<div>(padded|masked|varlen): rows ([\d,]+) \(pad ([\d,]+)\) \| attention cells ([\d,]+) "
                  r"\(wasted ([\d,]+)\) \| FLOPs executed / useful (\d+\.\d\d)x \(whole blocks\)</div>")


def _int(s):
    return int(s.replace(",", ""))


def test_prefill_plan_state_totals_are_the_sums_of_the_batches():
    s = L.prefill_plan_state("long-tail", 32, 512, seed=0)
    lens = s["seq_lens"]
    batches = [[lens[i] for i in b] for b in s["batches"]]
    assert s["batches"] == fcfs(lens, 512) and s["rejected"] == []
    t = s["totals"]
    assert t["padded"]["rows"] == sum(len(b) * max(b) for b in batches)
    assert t["padded"]["pad_rows"] == t["padded"]["rows"] - sum(lens)
    assert t["masked"]["rows"] == t["varlen"]["rows"] == sum(lens)
    assert t["masked"]["cells_computed"] == sum(sum(b) ** 2 for b in batches)
    assert t["padded"]["cells_computed"] == sum(len(b) * max(b) ** 2 for b in batches)
    assert t["varlen"]["cells_computed"] == t["varlen"]["cells_useful"] == sum(n * n for n in lens)
    lines = LINE.findall(L.prefill_plan_html(s))
    assert [m for m, *_ in lines] == ["padded", "masked", "varlen"]
    for m, rows, pad, cells, wasted, _ in lines:
        assert (_int(rows), _int(pad), _int(cells)) == (t[m]["rows"], t[m]["pad_rows"], t[m]["cells_computed"])
        assert _int(wasted) == t[m]["cells_computed"] - t[m]["cells_useful"]
    assert lines[2][5] == "1.00"
    assert f"{len(s['batches'])} batches, 32 requests served" in L.prefill_plan_html(s)
    one = L.prefill_plan_state("uniform", 1, 4096, seed=0)
    assert "1 batch, 1 request served" in L.prefill_plan_html(one)


def test_method_totals_count_rows_cells_and_flops_by_whole_blocks():
    from lessons_lib.measure.flops import forward_flops
    cfg = ModelConfig()
    batches = [[10, 30], [5, 5, 40]]
    t = L.method_totals(cfg, batches)
    for m in ("padded", "masked", "varlen"):
        assert t[m]["flops_executed"] == sum(forward_flops(cfg, b, m, causal=False).total for b in batches)
        assert t[m]["flops_useful"] == t["varlen"]["flops_executed"]  # useful = what varlen runs, whole blocks
    assert t["varlen"]["cells_computed"] == t["varlen"]["cells_useful"] == 100 + 900 + 25 + 25 + 1600
    assert t["masked"]["cells_computed"] == 40 ** 2 + 50 ** 2 and t["padded"]["pad_rows"] == 20 + 35 + 35
    for b in batches:
        for m in ("padded", "masked", "varlen"):
            assert L.whole_block_flops(cfg, batch_stats(cfg, b, m)) == forward_flops(cfg, b, m, causal=False).total
    text = L.totals_text(t).splitlines()
    assert [ln.split()[0] for ln in text] == ["padded", "masked", "varlen"]
    assert all("whole blocks" in ln for ln in text) and "1.00x the useful" in text[2]


def test_s3_prefill_plan_refuses_requests_over_the_budget():
    s = L.prefill_plan_state("bimodal", 48, 1024, seed=0)
    assert s["rejected"] and all(s["seq_lens"][i] > 1024 for i in s["rejected"])
    assert sum(len(b) for b in s["batches"]) + len(s["rejected"]) == 48
    assert f"refused (longer than the budget, S3): {len(s['rejected'])}" in L.prefill_plan_html(s)
    with pytest.raises(ValueError, match="workload"):
        L.prefill_plan_state("zipf")
    with pytest.raises(ValueError, match="num_requests"):
        L.prefill_plan_state("uniform", 0)


def test_prefill_plan_explorer_output_changes_with_every_control():
    box = L.prefill_plan_explorer()
    k = by_class(box)
    kind, reqs, budget, text, out = (k[c] for c in ("ppx-workload", "ppx-num-requests", "ppx-budget", "ppx-counts",
                                                    "ppx-figure"))
    assert "ppx" in box._dom_classes and len(LINE.findall(text.value)) == 3
    seen_text, seen_png = {text.value}, {png_of(out)}
    for control, value in ((budget, 4096), (reqs, 20), (kind, "uniform"), (kind, "bimodal")):
        control.value = value
        assert text.value not in seen_text and png_of(out) not in seen_png, f"{control} = {value} changed nothing"
        seen_text.add(text.value)
        seen_png.add(png_of(out))
    assert "bimodal, 20 requests, max_num_batched_tokens = 4096" in text.value
    budget.value = 1024  # the 5,000-token drafts cannot run whole: refused, the 50-token questions served
    lens = workload_lengths("bimodal", 20, 0, **L.WORKLOAD_PRESETS["bimodal"])
    served = sum(n <= 1024 for n in lens)
    assert f"{served} requests served" in text.value
    assert f"refused (longer than the budget, S3): {20 - served}" in text.value
    budget.value = 32  # every request is longer than the budget: nothing to draw
    assert "0 requests served" in text.value and out.outputs == ()


# ---- schedules ------------------------------------------------------------------------------------------

def test_s3_schedule_problem_names_what_makes_a_schedule_invalid():
    lens = [10, 30, 20, 5]
    assert L.schedule_problem([[0, 1], [2, 3]], lens, 40, 4) is None
    assert "exactly once" in L.schedule_problem([[0, 1], [2]], lens, 40, 4)
    assert "served twice [1]" in L.schedule_problem([[0, 1], [1, 2, 3]], lens, 60, 4)
    assert "LENGTHS" in L.schedule_problem([[10, 30], [20, 5]], lens, 40, 4)
    assert "> max_num_batched_tokens=40" in L.schedule_problem([[0, 1, 3], [2]], lens, 40, 4)
    assert "> max_num_seqs=2" in L.schedule_problem([[0, 2, 3], [1]], lens, 64, 2)
    assert "empty" in L.schedule_problem([[0, 1], [], [2, 3]], lens, 40, 4)
    assert "list of batches" in L.schedule_problem("0,1", lens, 40, 4)


def test_schedule_measures_count_pad_rows_masked_cells_and_fairness():
    lens = [300, 20, 300, 20, 300, 20, 20, 20]
    fcfs_batches = plan_batches(lens, 640, 4)
    base = L.schedule_measures(lens, fcfs_batches, 640, 4)
    assert base["batches"] == len(fcfs_batches) and base["max_delay"] == 0 and base["overtakes"] == 0
    assert base["pad_rows"] == sum(len(b) * max(lens[i] for i in b) - sum(lens[i] for i in b) for b in fcfs_batches)
    mine = [[1, 3, 5, 6], [7, 0], [2, 4]]  # short ones first: request 2 runs in batch 2, FCFS ran it in batch 0
    m = L.schedule_measures(lens, mine, 640, 4)
    assert m["pad_rows"] == 0 + 280 + 0
    assert m["masked_wasted"] == (80 ** 2 - 4 * 400) + (320 ** 2 - 300 ** 2 - 400) + (600 ** 2 - 2 * 300 ** 2)
    at = {i: b for b, ids in enumerate(mine) for i in ids}
    at_fcfs = {i: b for b, ids in enumerate(fcfs_batches) for i in ids}
    assert m["max_delay"] == max(at[i] - at_fcfs[i] for i in at) == 2
    assert m["overtakes"] == sum(at[j] < at[i] for i in range(8) for j in range(i + 1, 8))
    table = L.schedule_table(lens, mine, 640, 4).splitlines()
    assert table[1].split()[:3] == ["FCFS", str(base["batches"]), f"{base['pad_rows']:,}"]
    assert table[2].split()[:3] == ["yours", "3", "280"]


# ---- exercise 06.1: your attention inside the engine ------------------------------------------------

def loop(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, causal=True, softmax_scale=None, *, scale=None,
         whole=False, place="own", layout="THD"):
    out, cu = torch.zeros_like(q), cu_seqlens.tolist()
    assert cu == cu_seqlens_k.tolist() and max_seqlen == max_seqlen_k  # self-attention: every key is a query's row
    cu = [0, cu[-1]] if whole else cu
    scale = (1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale) if scale is None else scale(q)
    for s, e in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))
        sc = qi @ ki.transpose(1, 2) * scale
        if causal:
            sc = sc.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        o = (sc.softmax(-1) @ vi).transpose(0, 1)
        if place == "own":
            out[s:e] = o
        else:
            out[:e - s] = o  # every request written at the top
    return out.transpose(0, 1) if layout == "HTD" else out


def test_attention_checker_passes_the_loop_and_waits_for_a_stub(capsys):
    assert L.check_attention_backend(loop)
    out = capsys.readouterr().out
    assert "your attention served lesson 06's stream" in out and re.search(r"^total: yours [\d.]+ s", out, re.M)
    assert len(re.findall(r"^\s+\d+\s+\d+\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+$", out, re.M)) == 5  # one row per batch
    assert L.check_attention_backend(stub) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_keep_engine_run_takes_the_lesson_s_own_run_and_refuses_anything_else():
    from lessons_lib.serve.engine import Engine
    ref, stats = L._engine_run(torch.float32)
    saved = dict(L._ENGINE_RUNS)
    try:
        outputs = [type("Out", (), {"request_id": i, "hidden": h})() for i, h in ref.items()]
        assert L.keep_engine_run(outputs, stats) == 23 and L.stream_reference(torch.float32) == ref
        with pytest.raises(ValueError, match="23 requests"):
            L.keep_engine_run(outputs[:-1], stats)
        with pytest.raises(ValueError, match="float32"):
            L.keep_engine_run([type("Out", (), {"request_id": o.request_id, "hidden": o.hidden.double()})()
                               for o in outputs], stats)
    finally:
        L._ENGINE_RUNS.clear()
        L._ENGINE_RUNS.update(saved)
    assert Engine  # the run the lesson keeps is an Engine's


def test_stream_table_lines_up_the_two_runs():
    cfg = ModelConfig()
    mine = [batch_stats(cfg, b, "varlen", i, wall_s=0.5, request_ids=[i]) for i, b in enumerate([[10, 30], [5]])]
    theirs = [batch_stats(cfg, b, "varlen", i, wall_s=0.25, request_ids=[i]) for i, b in enumerate([[10, 30], [5]])]
    text = L.stream_table(mine, theirs)
    assert "total: yours 1.00 s, the engine's own backend 0.50 s (2.00x)" in text
    assert text.splitlines()[2].split() == ["0", "2", "40", "30", "500.0", "250.0"]
    with pytest.raises(ValueError, match="same batches"):
        L.stream_table(mine, theirs[:1])


@pytest.mark.parametrize("mistake, hint", [
    (dict(causal=False), "not causal"),
    (dict(whole=True), "cu_seqlens ignored"),
    (dict(scale=lambda q: 1.0), "not scaled"),
    (dict(scale=lambda q: 1 / q.shape[-1]), "not 1/d_head"),
    (dict(scale=lambda q: 1 / math.sqrt(q.shape[1] * q.shape[2])), "one head's width"),
    (dict(place="top"), "not at its own rows"),
    (dict(layout="HTD"), "transpose your [H, T, D] back"),
])
def test_attention_checker_explains_typical_mistakes(mistake, hint):
    assert hint in attempt(L.check_attention_backend, lambda *a, **kw: loop(*a, **(kw | mistake)))


def test_attention_checker_recognises_swapped_rows_nan_rows_and_wrong_dtype():
    def swapped(*a, **kw):
        out, cu = loop(*a, **kw), a[3]
        if len(cu) == 6:  # requests 0 and 3 both have 7 tokens: their outputs swapped
            out[[*range(0, 7), *range(20, 27)]] = out[[*range(20, 27), *range(0, 7)]].clone()
        return out

    def nan_rows(*a, **kw):
        out = loop(*a, **kw)
        out[-1] = float("nan")
        return out
    assert "hold request 3's output" in attempt(L.check_attention_backend, swapped)
    assert "NaN" in attempt(L.check_attention_backend, nan_rows)
    assert "dtype" in attempt(L.check_attention_backend, lambda *a, **kw: loop(*a, **kw).double())
    assert "expected a tensor" in attempt(L.check_attention_backend, lambda *a, **kw: loop(*a, **kw).tolist())


def test_attention_checker_gives_partial_marks(capsys):
    # ignoring cu_seqlens is right for one request and wrong for several: 1 case of 4
    assert score(L.check_attention_backend, lambda *a, **kw: loop(*a, **kw, whole=True), 3) == 0.75
    assert score(L.check_attention_backend, stub, 3) == 0
    assert "cu_seqlens ignored" in capsys.readouterr().out


def test_attention_checker_fails_a_function_that_is_wrong_only_inside_the_engine():
    def flaky(*a, **kw):  # right on the small cases, wrong once a batch holds many requests
        out = loop(*a, **kw)
        return out * 1.01 if len(a[3]) > 6 else out
    assert "passes the small cases but not inside the engine" in attempt(L.check_attention_backend, flaky)


def test_time_backend_waits_for_a_stub():
    assert "not attempted yet" in L.time_backend(stub)


# ---- exercise 06.2: a length-sorting scheduler ----------------------------------------------------

def window_sorted(lens, budget, max_seqs, window=16, check_seqs=True):
    batches = []
    for start in range(0, len(lens), window):
        batch, used = [], 0
        for i in sorted(range(start, min(start + window, len(lens))), key=lambda i: lens[i]):
            if batch and (used + lens[i] > budget or (check_seqs and len(batch) == max_seqs)):
                batches.append(batch)
                batch, used = [], 0
            batch.append(i)
            used += lens[i]
        batches.append(batch)
    return batches


def test_sorted_schedule_checker_passes_sorting_designs_and_prints_the_trade_off(capsys):
    assert L.check_sorted_schedule(window_sorted)
    out = capsys.readouterr().out
    assert "pad rows" in out and "max delay" in out and re.search(r"^FCFS\s+5\s+2,095", out, re.M)
    assert L.check_sorted_schedule(lambda lens, b, s: window_sorted(lens, b, s, window=len(lens)))  # a global sort
    assert L.check_sorted_schedule(stub) is False


@pytest.mark.parametrize("answer, hint", [
    (lambda lens, b, s: plan_batches(lens, b, s), "these are FCFS's batches"),
    (lambda lens, b, s: [[lens[i] for i in bb] for bb in window_sorted(lens, b, s)], "LENGTHS"),
    (lambda lens, b, s: window_sorted(lens, b, s)[:-1], "exactly once"),
    (lambda lens, b, s: [sorted(range(len(lens)), key=lambda i: lens[i])[k:k + 4] for k in range(0, len(lens), 4)],
     "> max_num_batched_tokens"),
    (lambda lens, b, s: window_sorted(lens, b, s, check_seqs=False), "> max_num_seqs"),
    (lambda lens, b, s: window_sorted(lens, b, s, window=4), "cannot regroup"),
])
def test_sorted_schedule_checker_explains_invalid_and_useless_answers(answer, hint):
    assert hint in attempt(L.check_sorted_schedule, answer)


def test_sorted_schedule_checker_gives_partial_marks(capsys):
    # a window as wide as one batch of 4 regroups nothing on the last stream only: 4 of 5
    assert score(L.check_sorted_schedule, lambda lens, b, s: window_sorted(lens, b, s, window=4), 2) == 1.6
    # ignoring max_num_seqs breaks the two streams that bound it: 3 of 5
    assert score(L.check_sorted_schedule, lambda lens, b, s: window_sorted(lens, b, s, check_seqs=False), 2) == 1.2
    assert score(L.check_sorted_schedule, lambda lens, b, s: plan_batches(lens, b, s), 2) == 0


# ---- measured --------------------------------------------------------------------------------------

def test_run_methods_and_throughput_text(tiny_cfg):
    from lessons_lib import init_weights
    from lessons_lib.serve.scheduler import Request
    reqs = [Request(i, list(range(n))) for i, n in enumerate([10, 30, 5, 60])]
    stats = L.run_methods(tiny_cfg, init_weights(tiny_cfg, 0), reqs, 64, device="cpu", dtype=torch.float32)
    assert list(stats) == ["padded", "masked", "varlen"]
    assert all([s.request_ids for s in st] == [[0, 1, 2], [3]] for st in stats.values())
    lines = L.throughput_text(stats, tiny_cfg).splitlines()
    assert [ln.split()[0] for ln in lines] == ["padded", "masked", "varlen"]
    assert "1.00x varlen's throughput" in lines[2]
