"""Lesson 06's module (lessons_lib/course/l06_engine.py): figures, the prefill-plan explorer, schedule
measures, and the two exercise checkers (your attention inside Engine, a length-sorting scheduler)."""
from __future__ import annotations

import re

import pytest
import torch
from helpers import attempt, by_class, by_gid, png_of, stub

from lessons_lib import ModelConfig
from lessons_lib.course import l06_engine as L
from lessons_lib.course.grading import score
from lessons_lib.course.trace_figures import tp_trace_timeline
from lessons_lib.serve.engine import batch_stats
from lessons_lib.serve.recording import BatchRecord, record_scale, recorded_totals
from lessons_lib.serve.scheduler import Request, Scheduler, plan_batches
from lessons_lib.serve.workloads import prefill_stream, workload_lengths
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
    lens, prompts = prefill_stream()
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

def table(state, name):
    """The readout's table ``name``, as {first cell: row} (and its header under "header")."""
    t = next(t for t in state["readout"]["tables"] if t["name"] == name)
    return {"header": t["header"], **{r[0]: r for r in t["rows"]}}


def _int(s):
    return int(s.replace(",", ""))


def readout_cells(readout):
    """Every text of the readout in the order prefill_plan_html lays it out: title, per table its caption,
    header and cells, then the notes."""
    out = [readout["title"]]
    for t in readout["tables"]:
        out += [t["caption"], *t["header"], *(c for r in t["rows"] for c in r)]
    return out + list(readout["notes"])


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
    backends = table(s, "backends")
    assert backends["header"][1:6] == ["rows computed", "rows useful", "cells computed", "cells useful", "cells wasted"]
    useful = sum(n * n for n in lens)
    for m, rows, cells in (("padded", sum(len(b) * max(b) for b in batches), sum(len(b) * max(b) ** 2 for b in batches)),
                           ("masked", sum(lens), sum(sum(b) ** 2 for b in batches)), ("varlen", sum(lens), useful)):
        assert [_int(c) for c in backends[m][1:6]] == [rows, sum(lens), cells, useful, cells - useful], m
    assert backends["varlen"][6] == "1.00x" and float(backends["padded"][6][:-1]) > 1
    assert s["readout"]["title"].endswith(f"{len(s['batches'])} batches, 32 requests served, 0 refused")
    html = L.prefill_plan_html(s)
    assert all(f">{c}<" in html for c in readout_cells(s["readout"]) if c and "'" not in c)
    one = L.prefill_plan_state("uniform", 1, 4096, seed=0)
    assert one["readout"]["title"].endswith("1 batch, 1 request served, 0 refused")


def test_s3_prefill_plan_refuses_requests_over_the_budget():
    s = L.prefill_plan_state("bimodal", 48, 1024, seed=0)
    assert s["rejected"] and all(s["seq_lens"][i] > 1024 for i in s["rejected"])
    assert sum(len(b) for b in s["batches"]) + len(s["rejected"]) == 48
    assert f"refused (longer than the budget, S3): {len(s['rejected'])}" in L.prefill_plan_html(s)
    assert s["readout"]["title"].endswith(f"{len(s['rejected'])} refused")
    none = L.prefill_plan_state("uniform", 2, 64, seed=0)   # every request refused: no vacuous "= ✓ 0/0"
    assert none["batches"] == [] and [table(none, "backends")[m][-1] for m in ("padded", "masked", "varlen")] == ["nothing ran"] * 3
    with pytest.raises(ValueError, match="workload"):
        L.prefill_plan_state("zipf")
    with pytest.raises(ValueError, match="num_requests"):
        L.prefill_plan_state("uniform", 0)


def test_prefill_plan_explorer_output_changes_with_every_control():
    box = L.prefill_plan_explorer()
    k = by_class(box)
    kind, reqs, budget, text, out = (k[c] for c in ("ppx-workload", "ppx-num-requests", "ppx-budget", "ppx-counts",
                                                    "ppx-figure"))
    assert "ppx" in box._dom_classes and text.value.count("<tr>") == 4 + 2 + 2 + 4  # header + rows, per table
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


def test_prefill_plan_scheduler_trades_pad_rows_for_masked_cells_and_delay():
    fcfs_s = L.prefill_plan_state("long-tail", 48, 768, batch=None)
    srt = L.prefill_plan_state("long-tail", 48, 768, batch=None, scheduler="shortest first")
    lens = srt["seq_lens"]
    assert fcfs_s["batches"] == fcfs(lens, 768)
    assert sorted(i for b in srt["batches"] for i in b) == list(range(48))
    assert all(sum(lens[i] for i in b) <= 768 for b in srt["batches"])
    assert sum(len(b) * max(lens[i] for i in b) for b in srt["batches"]) < fcfs_s["totals"]["padded"]["rows"]
    assert srt["totals"]["masked"]["cells_computed"] > fcfs_s["totals"]["masked"]["cells_computed"]
    # delay against FCFS, by hand: batch index under shortest first minus under FCFS
    at = {i: b for b, ids in enumerate(srt["batches"]) for i in ids}
    at0 = {i: b for b, ids in enumerate(fcfs_s["batches"]) for i in ids}
    later = [at[i] - at0[i] for i in range(48) if at[i] > at0[i]]
    overtakes = sum(at[j] < at[i] for i in range(48) for j in range(i + 1, 48))
    assert later and overtakes > 0
    # the fairness table: FCFS beside shortest first, the waste and the delays counted here by hand
    fair = table(srt, "fairness")
    for k, x, n_later, worst, over in (("FCFS", fcfs_s, 0, 0, 0), ("shortest first", srt, len(later), max(later),
                                                                   overtakes)):
        pad = sum(len(b) * max(lens[i] for i in b) for b in x["batches"]) - sum(lens)
        wasted = sum(sum(lens[i] for i in b) ** 2 - sum(lens[i] ** 2 for i in b) for b in x["batches"])
        assert [_int(c) for c in fair[k][2:]] == [pad, wasted, n_later, worst, over], fair[k]
    assert list(table(fcfs_s, "fairness")) == ["header", "FCFS"]
    delays = table(srt, "delays")
    d_all = [at[i] - at0[i] for i in range(48)]
    assert {int(h): _int(c) for h, c in zip(delays["header"][1:], delays["requests"][1:])} == \
        {d: d_all.count(d) for d in set(d_all)}
    assert table(fcfs_s, "delays")["requests"] == ["requests", "48"]
    with pytest.raises(ValueError, match="scheduler"):
        L.prefill_plan_state(scheduler="random")


def test_prefill_plan_default_batch_is_recorded_for_every_method():
    s = L.prefill_plan_state()
    assert all(k == 1 for _, k in s["recorded"].values())   # the default batch runs as scheduled
    lens = [s["seq_lens"][i] for i in s["batches"][0]]
    rec = table(s, "recorded")
    for m in ("padded", "masked", "varlen"):  # the recorder's numbers on screen beside batch_stats', computed here
        p, (r, _) = batch_stats(L.TINY, lens, m), s["recorded"][m]
        assert rec[m][1] == "as scheduled"
        assert [_int(c) for c in rec[m][2:6]] == [r.rows, p.executed_rows, r.cells, p.cells_whole_computed]
        assert rec[m][6] == "= \u2713"


def test_prefill_plan_records_a_scaled_down_copy_of_a_batch_too_big_to_run_here():
    s = L.prefill_plan_state("bimodal", 48, 8192, batch=0)          # a draft's batch: 25,000,000 cells and more
    lens = [s["seq_lens"][i] for i in s["batches"][0]]
    rec = table(s, "recorded")
    ks = {m: s["recorded"][m][1] for m in ("padded", "masked", "varlen")}
    k = ks["padded"]
    assert set(ks.values()) == {k} and k > 1                        # one copy for all three: the rows compare
    assert k == max(record_scale(L.TINY, lens, m, L.RECORD_LIMIT) for m in ks)             # the method that needs the most shrinking
    assert any(record_scale(L.TINY, lens, m, L.RECORD_LIMIT) < k for m in ks)             # ...which one method alone would not need
    scaled = [-(-n // k) for n in lens]                               # each length / k, rounded up
    assert max(batch_stats(L.TINY, scaled, m).cells_whole_computed for m in ks) <= L.RECORD_LIMIT < max(
        batch_stats(L.TINY, [-(-n // (k - 1)) for n in lens], m).cells_whole_computed for m in ks)
    for m in ks:
        r, p = s["recorded"][m][0], batch_stats(L.TINY, scaled, m)
        assert (r.rows, r.cells) == (p.executed_rows, p.cells_whole_computed)
        assert rec[m][1] == f"each / {k}, rounded up" and rec[m][6] == "= \u2713"
    assert s["recorded"]["varlen"][0].rows == s["recorded"]["masked"][0].rows == sum(scaled)
    assert record_scale(L.TINY, [10, 20], "padded", L.RECORD_LIMIT) == 1


# ---- exercise 06.1: a bucketing scheduler ----------------------------------------------------------

class Bucket(Scheduler):
    """Shortest first, except that a request passed over ``bound`` times goes first (oldest first)."""
    bound = L.MAX_PASSED_OVER

    def schedule(self):
        passes = self.passes = getattr(self, "passes", {})
        queue = list(self.waiting)
        due = [r for r in queue if passes.get(r.request_id, 0) >= getattr(self, "bound", L.MAX_PASSED_OVER)]
        batch, used = [], 0
        for r in due + sorted((r for r in queue if r not in due), key=len):
            if len(batch) == self.max_num_seqs:
                break
            if used + len(r) <= self.max_num_batched_tokens:
                batch.append(r)
                used += len(r)
            elif r in due:
                break
        newest = max(r.request_id for r in batch)
        for r in queue:
            if r not in batch and r.request_id < newest:
                passes[r.request_id] = passes.get(r.request_id, 0) + 1
        for r in batch:
            self.waiting.remove(r)
        return batch


class ShortestFirst(Bucket):
    bound = 10 ** 9  # nobody is ever due: starvation


class NoSeqLimit(Bucket):
    def schedule(self):
        self.max_num_seqs = 10 ** 9  # forgets the request budget
        return super().schedule()


class Empty(Scheduler):
    def schedule(self):
        return []


class Stub(Scheduler):
    def schedule(self):
        raise NotImplementedError


def test_bucket_scheduler_checker_passes_a_bounded_design_and_prints_the_trade_off(capsys):
    assert L.check_bucket_scheduler(Bucket)
    out = capsys.readouterr().out
    assert re.search(r"^FCFS\s+5\s+2,095", out, re.M) and "max delay" in out
    m = re.search(r"padded engine's linear layers: yours ([\d,]+), FCFS ([\d,]+)", out)
    assert m and int(m[1].replace(",", "")) < int(m[2].replace(",", "")) == 4064  # FCFS: sum of R x Lmax, by hand below
    kept = [n for n in prefill_stream()[0] if n <= 512]
    assert sum(len(b) * max(kept[i] for i in b) for b in fcfs(kept, 512)) == 4064
    assert L.check_bucket_scheduler(Stub) is False and "not attempted" in capsys.readouterr().out


@pytest.mark.parametrize("answer, hint", [
    (Scheduler, "these are FCFS's batches"),
    (ShortestFirst, "passed over"),
    (NoSeqLimit, "> max_num_seqs"),
    (Empty, "empty batch"),
])
def test_bucket_scheduler_checker_explains_wrong_designs(answer, hint):
    assert hint in attempt(L.check_bucket_scheduler, answer)


def test_bucket_scheduler_checker_gives_partial_marks_and_refuses_a_non_scheduler(capsys):
    assert 0 < score(L.check_bucket_scheduler, ShortestFirst, 3) < 3
    assert score(L.check_bucket_scheduler, Scheduler, 3) < score(L.check_bucket_scheduler, Bucket, 3) == 3
    with pytest.raises(AssertionError, match="subclass of Scheduler"):
        L.check_bucket_scheduler(int)
    assert L.check_bucket_scheduler(Bucket.schedule)  # a bare schedule(self) is made a Scheduler method
    assert issubclass(L.with_schedule(Bucket.schedule), Scheduler)
    with pytest.raises(ValueError, match="schedule"):
        L.with_schedule(3)


# ---- exercise 06.2: a counter-example, measured ----------------------------------------------------

def test_masked_counterexample_checker(capsys):
    assert L.check_masked_counterexample(lambda: ([92, 56, 36, 73, 36], 128))
    out = capsys.readouterr().out
    rows, cells = 92 + 2 * 56 + 2 * 73, 92 ** 2 + 92 ** 2 + 109 ** 2     # FCFS [92] [56, 36] [73, 36], recorded
    assert f"FCFS    [[92], [56, 36], [73, 36]]: padded rows {rows}, masked cells {cells:,}" in out
    assert "sorted  [[36, 36, 56], [73], [92]]: padded rows 333, masked cells 30,177" in out
    assert "not more" in attempt(L.check_masked_counterexample, lambda: ([100, 10, 100, 10], 110))
    assert "did not pad fewer" in attempt(L.check_masked_counterexample, lambda: ([10, 10, 10], 100))
    assert "no request over the budget" in attempt(L.check_masked_counterexample, lambda: ([300], 256))
    assert "expected (seq_lens" in attempt(L.check_masked_counterexample, lambda: [5, 5])
    assert L.check_masked_counterexample(stub) is False


# ---- measured --------------------------------------------------------------------------------------

def test_c11_tp_dry_traces_equal_what_each_worker_recorded_and_draw_one_packing():
    from lessons_lib.core.model import init_weights
    from lessons_lib.serve.engine import Engine
    from lessons_lib.tp.dryrun import trace_signature
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=97, max_position=256)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 7]
    with Engine(cfg, tp_size=2, weights=init_weights(cfg, 0), device="cpu", dtype=torch.float32,
                record_forwards=True) as eng:
        eng.prefill([Request(i, p) for i, p in enumerate(prompts)])
    (stats,) = eng.stats
    res = stats.tp_result
    assert res.all_reduce_counts == [4, 4]
    assert [trace_signature(t) for t in res.traces] == [trace_signature(t) for t in L.tp_dry_traces(cfg, [3, 5, 7])]
    fig = tp_trace_timeline([res.traces], [[3, 5, 7]], cfg)
    assert any("on every rank" in t.get_text() for t in fig.axes[0].texts)


def test_tp_trace_figure_labels_keep_clear_of_each_other():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = L._tp_trace()
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    boxes = [(t.get_text(), t.get_window_extent(renderer).padded(2)) for t in fig.axes[0].texts if t.get_text().strip()]
    close = [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if ba.overlaps(bb)]
    assert close == []                        # every label at least 4 px from every other
    assert all(fig.bbox.contains(bb.x1, bb.y0) and bb.x0 >= 0 for _, bb in boxes)   # and inside the figure


def test_explorer_records_the_whole_stream_and_its_tables_read_the_records():
    s = L.prefill_plan_state("long-tail", 20, 512, seed=0, batch=None, scheduler="shortest first")
    lens = s["seq_lens"]
    schedules = {"shortest first": s["batches"], "FCFS": plan_batches(lens, 512)}   # none refused at this budget
    assert set(s["counts"]) == set(schedules)
    for name, batches in schedules.items():
        for m in ("padded", "masked", "varlen"):            # the records, summed, against the prediction per batch
            pred = [batch_stats(L.TINY, [lens[i] for i in b], m) for b in batches]
            c = s["counts"][name][m]
            assert (c["rows"], c["cells"]) == (sum(p.executed_rows for p in pred), sum(p.cells_whole_computed for p in pred))
            assert (c["checked"], c["differs"], c["scaled"]) == (len(batches), [], 0)
    fair = table(s, "fairness")
    for name in schedules:
        c = s["counts"][name]
        assert fair[name][2:4] == [f"{c['padded']['rows'] - c['varlen']['rows']:,}",
                                   f"{c['masked']['cells'] - c['varlen']['cells']:,}"]
    assert all(row[-1].startswith("= \u2713") for k, row in table(s, "backends").items() if k != "header")
    # a record that is not the prediction is reported, batch by batch
    lie = BatchRecord("padded", (0,), (1,), 1, ())
    fake = {m: [(lie, 1)] for m in ("padded", "masked", "varlen")}
    assert recorded_totals(L.TINY, [5], [[0]], fake)["padded"]["differs"] == [0]
