"""Lessons 00, 04, 06 around the notebooks: the TP dry run, the figures and the widgets.

Expected numbers are computed here from the claims' formulas (C1, C12: 2 · n_layers all-reduces of
``T · d_model · itemsize`` bytes; C2, C8, C10 per batch) or from an FCFS scheduler written here,
never copied from the code under test. Widget callbacks run headlessly: set a control's value,
read the HTML and the PNG the callback put into the Output widget.
"""
from __future__ import annotations

import re

import pytest
import torch
from matplotlib.figure import Figure
from test_widgets import by_class, png_of  # widgets by CSS class, the PNG a callback drew

from lessons_lib import ModelConfig
from lessons_lib.core.groups import CollectiveRecord, LocalGroup
from lessons_lib.course import figures, viz, widgets
from lessons_lib.serve.engine import batch_stats
from lessons_lib.serve.scheduler import plan_batches
from lessons_lib.serve.workloads import workload_lengths
from lessons_lib.tp.dryrun import expected_trace, record_trace, trace_signature


def gids(fig: Figure, prefix: str) -> dict:
    """Artists whose gid starts with ``prefix``, by gid."""
    return {a.get_gid(): a for a in fig.findobj(lambda a: (a.get_gid() or "").startswith(prefix))}


# --- tp_dryrun: the formula vs the model's own calls (C1, C12) ---------------------------------

@pytest.mark.parametrize("lens", [[10, 30], [40], [1] * 40, [3, 1, 5]])
def test_c12_dry_run_trace_is_the_formula_whatever_the_packing(tiny_cfg, lens):
    t = sum(lens)
    for rank in (0, 1):
        got = record_trace(tiny_cfg, lens, rank, 2)
        assert len(got) == 2 * tiny_cfg.n_layers
        assert {r.shape for r in got} == {(t, tiny_cfg.d_model)}
        assert {r.bytes for r in got} == {t * tiny_cfg.d_model * 4}
        assert all(r.rank == rank and r.world_size == 2 for r in got)
        assert trace_signature(got) == trace_signature(expected_trace(tiny_cfg, t, rank, 2))
    assert [r.layer for r in got][:2] == ["layers.0.attn.out_proj", "layers.0.mlp.fc_down"]


def test_c1_expected_trace_of_the_article_model():
    cfg = ModelConfig()
    for n in (10, 1000, 10_000):
        trace = expected_trace(cfg, n)
        assert len(trace) == 16 and {r.shape for r in trace} == {(n, 512)} and {r.bytes for r in trace} == {n * 2048}
    bf16 = expected_trace(ModelConfig(dtype=torch.bfloat16), 10)
    assert {(r.dtype, r.bytes) for r in bf16} == {("bfloat16", 10 * 512 * 2)}
    assert expected_trace(cfg, 10, 0, 1) == []  # TP=1 reduces nothing


def test_dry_run_other_world_sizes_and_dtype(tiny_cfg):
    assert trace_signature(record_trace(tiny_cfg, [5, 6], 3, 4)) == trace_signature(expected_trace(tiny_cfg, 11, 3, 4))
    half = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=10, max_position=16,
                       dtype=torch.bfloat16)
    assert trace_signature(record_trace(half, [4], 1, 2)) == trace_signature(expected_trace(half, 4, 1, 2))


def test_recording_group_records_like_a_dist_group_and_does_not_sum():
    g = LocalGroup(1, 2)
    x = torch.ones(3, 8)
    assert g.all_reduce(x, layer="probe") is x
    assert g.trace == [CollectiveRecord("all_reduce", (3, 8), "float32", 96, "probe", 1, 2)]


@pytest.mark.parametrize("call, match", [
    (lambda c: expected_trace(c, 0), "num_tokens"), (lambda c: expected_trace(c, 4, 2, 2), "rank=2"),
    (lambda c: expected_trace("cfg", 4), "cfg"), (lambda c: record_trace(c, []), "empty"),
    (lambda c: record_trace(c, [0, 3]), r"seq_lens\[0\]"), (lambda c: record_trace(c, [300]), "max_position"),
    (lambda c: record_trace(c, [3], 0, 3), "world_size=3"), (lambda c: LocalGroup(0, 0), "world_size"),
])
def test_dry_run_rejects_bad_input(tiny_cfg, call, match):
    with pytest.raises(ValueError, match=match):
        call(tiny_cfg)


# --- viz -----------------------------------------------------------------------------------------

def test_c1_allreduce_growth_draws_the_formula_and_the_measured_points():
    cfg = ModelConfig()
    measured = {10: expected_trace(cfg, 10), 1000: expected_trace(cfg, 1000)}
    fig = viz.allreduce_growth(cfg, tokens=[1, 10, 100, 1000], mark=300, measured=measured)
    left, right = fig.axes
    assert list(left.lines[0].get_ydata()) == [16] * 4
    assert list(right.lines[0].get_ydata()) == [n * 512 * 4 for n in (1, 10, 100, 1000)]
    pts = gids(fig, "measured-")
    assert set(pts) == {"measured-count-10", "measured-bytes-10", "measured-count-1000", "measured-bytes-1000"}
    assert list(pts["measured-bytes-1000"].get_ydata()) == [1000 * 2048]
    assert list(gids(fig, "mark")["mark"].get_ydata()) == [300 * 2048]


def test_c12_trace_timeline_one_bar_per_all_reduce_and_refuses_mismatched_ranks(tiny_cfg):
    traces = [record_trace(tiny_cfg, [10, 30], r, 2) for r in (0, 1)]
    fig = viz.tp_trace_timeline(traces, [[40], [10, 30]], heads_per_rank=2, qkv_width=24)
    bars = gids(fig, "allreduce-")
    assert sorted(bars) == sorted(f"allreduce-{k}" for k in range(2 * tiny_cfg.n_layers))
    locals_ = gids(fig, "local-")
    assert len(locals_) == 2 * len(bars)
    attn = [a for g, a in locals_.items() if a.get_facecolor()[:3] == locals_["local-0-0"].get_facecolor()[:3]]
    assert len(attn) == 2 * tiny_cfg.n_layers  # one attention step per layer per rank
    with pytest.raises(ValueError, match="rank 1"):
        viz.tp_trace_timeline([traces[0], traces[1][:-1]], [[40]])
    with pytest.raises(ValueError, match="packings"):
        viz.tp_trace_timeline(traces, [])


def _fcfs(lens, budget):
    batches, cur, used = [], [], 0
    for n in lens:
        if used + n > budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(n)
        used += n
    return batches + [cur]


def test_batch_waste_bars_are_the_per_batch_counts():
    cfg = ModelConfig()
    batches = _fcfs([10, 30, 5, 60, 2, 2, 40], 64)
    stats = {m: [batch_stats(cfg, b, m, i) for i, b in enumerate(batches)] for m in ("padded", "masked", "varlen")}
    fig = viz.batch_waste(stats, 64)
    for b, lens in enumerate(batches):
        assert gids(fig, f"rows-useful-{b}")[f"rows-useful-{b}"].get_height() == sum(lens)
        assert gids(fig, f"rows-pad-{b}")[f"rows-pad-{b}"].get_height() == len(lens) * max(lens) - sum(lens)
        heights = {m: gids(fig, f"cells-{m}-{b}")[f"cells-{m}-{b}"].get_height() for m in stats}
        assert heights == {"padded": len(lens) * max(lens) ** 2, "masked": sum(lens) ** 2,
                           "varlen": sum(n * n for n in lens)}
    with pytest.raises(ValueError, match="same batches"):
        viz.batch_waste({"varlen": stats["varlen"], "masked": stats["masked"][:-1]})


def test_new_figures_are_registered_for_their_lessons():
    for name, lesson in (("00_allreduce_growth", "00"), ("04_trace_timeline", "04"), ("06_batch_waste", "06")):
        assert figures.REGISTRY[name].lesson == lesson
    assert len(gids(figures.build("04_trace_timeline"), "allreduce-")) == 16


# --- widgets: lesson 00 ----------------------------------------------------------------------------

def test_c1_allreduce_state_and_text():
    s = widgets.allreduce_state(1000)
    assert (s["count"], s["shape"], s["bytes_each"], s["bytes_per_forward"]) == (16, [1000, 512], 2_048_000, 16 * 2_048_000)
    assert widgets.allreduce_text(s) == ("16 all-reduces per forward | each [1000, 512] float32 = 2,048,000 B | "
                                         "32,768,000 B per forward per rank")
    assert widgets.allreduce_state(10, "bfloat16")["bytes_each"] == 10 * 512 * 2
    for bad, match in (((0,), "num_tokens"), ((10, "fp8"), "dtype"), ((1.5,), "num_tokens")):
        with pytest.raises(ValueError, match=match):
            widgets.allreduce_state(*bad)


def test_c1_allreduce_explorer_callbacks():
    box = widgets.allreduce_explorer()
    assert "arx" in box._dom_classes
    k = by_class(box)
    tokens, dtype, text, out = k["arx-tokens"], k["arx-dtype"], k["arx-text"], k["arx-figure"]
    assert (tokens.min, tokens.max, tokens.value) == (1, 16384, 10) and dtype.options == ("float32", "bfloat16")
    assert "each [10, 512] float32 = 20,480 B" in text.value
    before = png_of(out)
    tokens.value = 4096
    assert f"each [4096, 512] float32 = {4096 * 2048:,} B" in text.value and png_of(out) != before
    dtype.value = "bfloat16"
    assert f"= {4096 * 1024:,} B" in text.value and text.value.startswith("<div>16 all-reduces")


# --- widgets: lesson 04 ----------------------------------------------------------------------------

@pytest.mark.parametrize("t, r", [(40, 1), (40, 3), (40, 40), (7, 2)])
def test_split_tokens(t, r):
    lens = widgets.split_tokens(t, r)
    assert len(lens) == r and sum(lens) == t and max(lens) - min(lens) <= 1 and lens == sorted(lens, reverse=True)


def test_split_tokens_rejects_more_requests_than_tokens():
    with pytest.raises(ValueError, match="num_requests"):
        widgets.split_tokens(4, 5)


def test_c12_tp_packing_state_trace_does_not_move():
    for r in (1, 2, 40):
        s = widgets.tp_packing_state(r)
        lens = widgets.split_tokens(40, r)
        assert s["seq_lens"] == lens and s["cu_seqlens"][-1] == 40 and len(s["cu_seqlens"]) == r + 1
        assert s["same_as_one_request"] == [True, True]
        assert s["summary"] == "16 × all_reduce [40, 512] float32, 81,920 B each"
        assert s["attn_cells"] == sum(n * n for n in lens) and s["attn_cells_per_rank"] == s["attn_cells"] * 4 * 8


def test_c12_tp_packing_explorer_callbacks():
    box = widgets.tp_packing_explorer()
    k = by_class(box)
    total, reqs, text, out = k["tpx-tokens"], k["tpx-num-requests"], k["tpx-text"], k["tpx-figure"]
    assert "tpx" in box._dom_classes and (total.value, reqs.value) == (40, 2)
    assert "cu_seqlens [0, 20, 40]" in text.value and "rank 0: yes, rank 1: yes" in text.value
    before = png_of(out)
    reqs.value = 40
    assert "40 requests" in text.value and "16 × all_reduce [40, 512]" in text.value and png_of(out) != before
    total.value = 10  # fewer tokens than requests: R is clamped to T
    assert reqs.max == 10 and reqs.value == 10
    assert "16 × all_reduce [10, 512] float32, 20,480 B each" in text.value


# --- widgets: lesson 06 ----------------------------------------------------------------------------

def test_s3_plan_batches_is_fcfs_and_skips_oversize():
    lens = [300, 300, 500, 100, 900, 20]
    batches = plan_batches(lens, 700, skip_oversize=True)
    assert 4 not in {i for b in batches for i in b}
    kept = [n for i, n in enumerate(lens) if i != 4]
    assert [[lens[i] for i in b] for b in batches] == _fcfs(kept, 700)
    with pytest.raises(ValueError, match="request 4 has 900 prompt tokens, more than max_num_batched_tokens=700"):
        plan_batches(lens, 700)


LINE = re.compile(r"<div>(padded|masked|varlen): rows (\d+) \| attention cells (\d+) \(useful (\d+)\) \| "
                  r"FLOPs executed / useful (\d+\.\d\d)x</div>")


def test_prefill_plan_state_totals_are_the_sums_of_the_batches():
    s = widgets.prefill_plan_state("long-tail", 32, 512, seed=0)
    batches = [[s["seq_lens"][i] for i in b] for b in s["batches"]]
    assert batches == _fcfs(s["seq_lens"], 512) and s["rejected"] == []
    t = s["totals"]
    assert t["padded"]["rows"] == sum(len(b) * max(b) for b in batches)
    assert t["masked"]["rows"] == t["varlen"]["rows"] == sum(s["seq_lens"])
    assert t["masked"]["cells_computed"] == sum(sum(b) ** 2 for b in batches)
    assert t["padded"]["cells_computed"] == sum(len(b) * max(b) ** 2 for b in batches)
    assert t["varlen"]["cells_computed"] == t["varlen"]["cells_useful"] == sum(n * n for n in s["seq_lens"])
    lines = LINE.findall(widgets.prefill_plan_html(s))
    assert [m for m, *_ in lines] == ["padded", "masked", "varlen"]
    assert all(int(rows) == t[m]["rows"] and int(cells) == t[m]["cells_computed"] for m, rows, cells, *_ in lines)
    assert lines[2][4] == "1.00"


def test_s3_prefill_plan_rejects_requests_over_the_budget():
    s = widgets.prefill_plan_state("bimodal", 48, 1024, seed=0)
    assert s["rejected"] and all(s["seq_lens"][i] > 1024 for i in s["rejected"])
    assert sum(len(b) for b in s["batches"]) + len(s["rejected"]) == 48
    assert f"rejected (longer than the budget, S3): {len(s['rejected'])}" in widgets.prefill_plan_html(s)
    with pytest.raises(ValueError, match="workload"):
        widgets.prefill_plan_state("zipf")


def test_prefill_plan_explorer_callbacks():
    box = widgets.prefill_plan_explorer()
    k = by_class(box)
    kind, reqs, budget, text, out = (k[c] for c in ("ppx-workload", "ppx-num-requests", "ppx-budget", "ppx-counts",
                                                    "ppx-figure"))
    assert "ppx" in box._dom_classes and len(LINE.findall(text.value)) == 3
    before = png_of(out)
    budget.value = 4096
    assert "batches of at most 4096 tokens" in text.value and png_of(out) != before
    kind.value = "bimodal"
    budget.value = 1024  # the 1500-token drafts cannot run whole: rejected, the 50-token questions served
    lens = workload_lengths("bimodal", 48, 0, **widgets.WORKLOAD_PRESETS["bimodal"])
    served = sum(n <= 1024 for n in lens)
    assert 0 < served < 48 and f"{served} requests served" in text.value
    assert f"rejected (longer than the budget, S3): {48 - served}" in text.value
    budget.value = 32  # every request is longer than the budget: nothing to draw
    assert "0 requests served" in text.value and out.outputs == ()
