"""What lesson 06 (the prefill engine, the capstone) draws, explores and checks.

  the stream   ``serve.workloads.prefill_stream`` under ``BUDGET``; ``stream_reference`` (its varlen answer)
  figures      ``fcfs_batches`` (06_fcfs_batches), ``batch_waste`` (06_batch_waste), 06_tp_trace
  explorer     ``prefill_plan_state`` / ``prefill_plan_html`` / ``prefill_plan_explorer``
  C9           ``masked_waste_sweep`` (recorded)
  TP=2         ``tp_dry_traces`` (the records: ``Engine(record_forwards=True)``'s ``BatchStats.tp_result``)
  exercises    ``check_bucket_scheduler`` (06.1), ``check_masked_counterexample`` (06.2)

Taught in notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from html import escape

import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import EngFormatter

from ..core.config import ModelConfig
from ..core.model import init_weights
from ..measure.flops import METHODS
from ..serve.engine import Engine, batch_stats
from ..serve.recording import record_scaled, record_served, recorded_totals
from ..serve.scheduler import Request, Scheduler, plan_batches
from ..serve.schedules import (
    SCHEDULES,
    drive_scheduler,
    passed_over,
    schedule_measures,
    schedule_problem,
    schedule_table,
    schedule_within,
    shortest_first_batches,
    stats_totals,
    with_schedule,
)
from ..serve.workloads import (
    PREFILL_STREAM,
    PREFILL_STREAM_BUDGET,
    WORKLOAD_PRESETS,
    prefill_stream,
    preset_lengths,
    trickle_arrivals,
    workload_lengths,
)
from ..serve.workloads import PREFILL_STREAM_PROMPT_SEED as PROMPT_SEED
from ..style import ATTENTION, LINEAR, MIN_FONT, NEVER, REQUEST, TEXT, WASTE, request_color
from ..tp.dryrun import record_trace
from ..validate import check_int
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import register
from .grading import WrongAnswer, grade
from .trace_figures import tp_trace_timeline

Tensor = torch.Tensor

# ---- the lesson's stream ---------------------------------------------------------------------------

BUDGET = PREFILL_STREAM_BUDGET  # lesson 06's stream (serve.workloads.prefill_stream) is served under 512 tokens


# The recorded runs' model: one layer, width 8 (rows and score cells do not depend on the width).
TINY = ModelConfig(n_layers=1, d_model=8, n_heads=1, d_head=8, d_ffn=16, vocab_size=97, max_position=8192)


@functools.cache
def _tiny_weights() -> dict:
    """``init_weights(TINY, 0)``, made once (the recorded runs count rows and cells: any weights do)."""
    return init_weights(TINY, 0)


@functools.cache
def stream_reference(dtype: torch.dtype = torch.float32) -> dict:
    """The engine's own varlen answer on lesson 06's stream (``init_weights(ModelConfig(), 0)``, CPU, the requests
    within the budget): ``{request_id: final hidden rows [L, d_model]}`` in ``dtype``, computed once per dtype;
    float64 is the truth of the tolerance rule."""
    cfg = ModelConfig()
    lens, prompts = prefill_stream(cfg.vocab_size)
    engine = Engine(cfg, weights=init_weights(cfg, 0), device="cpu", dtype=dtype, max_num_batched_tokens=BUDGET,
                    compute_logits=False)
    outputs = engine.prefill([Request(i, p, return_hidden=True) for i, p in enumerate(prompts) if lens[i] <= BUDGET])
    return {o.request_id: o.hidden for o in outputs}


def stack(outputs: Mapping) -> Tensor:
    """``{request_id: [L, d]}`` → ``[Σ L, d]`` in request-id order (the stream's flat rows)."""
    return torch.cat([outputs[i] for i in sorted(outputs)])


# ---- figure: how FCFS packs the stream -------------------------------------------------------------

def fcfs_batches(seq_lens: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int = 256) -> Figure:
    """Lesson 06 (S3): the FCFS batches of a stream, one row per batch, requests as orange boxes.

    Each batch is a row of its requests in arrival order (labelled with their index when wide
    enough), the room left up to the budget is white, the budget is a dashed line; a request
    longer than the budget has a hatched, empty row of its own at the bottom: it is refused, never split.
    Gids: ``req-<i>`` per served request, ``refused-<i>`` per refused one.
    """
    lens = [check_int(f"seq_lens[{i}]", n, 1) for i, n in enumerate(seq_lens)]
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    batches = plan_batches(lens, budget, max_num_seqs, skip_oversize=True)
    refused = [i for i, n in enumerate(lens) if n > budget]
    rows = len(batches) + len(refused)
    height = 0.55 * rows + 1.8
    fig = Figure(figsize=(8, height))
    ax = fig.add_subplot()
    xmax = budget * 1.12
    left, right = 0.24, 0.98
    pt_per_token = (right - left) * 8 * 72 / xmax
    bar = 0.56
    for b, ids in enumerate(batches):
        x, above = 0, True
        for k, i in enumerate(ids):
            ax.add_patch(Rectangle((x, b - bar / 2), lens[i], bar, facecolor=request_color(k), edgecolor="white",
                                   linewidth=0.8, gid=f"req-{i}"))
            if lens[i] * pt_per_token >= 0.62 * MIN_FONT * len(str(i)) + 3:  # the label fits inside
                y, va, above = b, "center", True
            else:  # a narrow request: its label just above the bar (below it, after another narrow one)
                y, va = (b - bar / 2 - 0.02, "bottom") if above else (b + bar / 2 + 0.02, "top")
                above = not above
            ax.text(x + lens[i] / 2, y, str(i), ha="center", va=va, fontsize=MIN_FONT, color=TEXT, gid=f"label-{i}")
            x += lens[i]
        ax.add_patch(Rectangle((x, b - bar / 2), budget - x, bar, facecolor=NEVER, edgecolor=TEXT, linewidth=0.5,
                               linestyle=":"))
    for r, i in enumerate(refused):
        y = len(batches) + r
        ax.add_patch(Rectangle((0, y - bar / 2), xmax, bar, facecolor=NEVER, edgecolor=TEXT, hatch="xx",
                               linewidth=0.8, gid=f"refused-{i}"))
        ax.text(budget * 0.02, y, f"request {i}: {lens[i]:,} tokens > {budget:,}: refused at submit, never split",
                ha="left", va="center", fontsize=MIN_FONT, color=TEXT, fontweight="bold",
                bbox=dict(facecolor=NEVER, edgecolor="none", pad=1.5))
    ax.axvline(budget, color=TEXT, linestyle="--", linewidth=1)
    ax.text(budget, -0.75, f"max_num_batched_tokens = {budget:,}", ha="right", va="bottom", fontsize=MIN_FONT)
    ax.set_xlim(0, xmax)
    ax.set_ylim(rows - 0.5, -0.9)
    ax.set_yticks(range(rows))
    ax.set_yticklabels([f"batch {b}: {len(ids)} req, {sum(lens[i] for i in ids)} tok" for b, ids in enumerate(batches)]
                       + ["refused"] * len(refused), fontsize=MIN_FONT)
    ax.set_xlabel("tokens in the batch (requests in arrival order, labelled with their index)", fontsize=MIN_FONT)
    ax.tick_params(axis="x", labelsize=MIN_FONT)
    fig.legend(handles=[Patch(facecolor=REQUEST[0], label="a request"),
                        Patch(facecolor=REQUEST[1], label="its neighbour (two shades only tell them apart)"),
                        Patch(facecolor=NEVER, edgecolor=TEXT, linestyle=":", label="room left under the budget"),
                        Patch(facecolor=NEVER, edgecolor=TEXT, hatch="xx", label="refused")],
               loc="lower center", ncol=2, fontsize=MIN_FONT, frameon=False)
    served = sum(len(ids) for ids in batches)
    ax.set_title(f"FCFS under a {budget:,}-token budget: {served} requests in {len(batches)} batches, "
                 f"{len(refused)} refused", fontsize=10, pad=16)
    fig.subplots_adjust(left=left, right=right, bottom=1.25 / height, top=1 - 0.45 / height)
    return fig


# ---- figure: rows and cells per batch, three methods -----------------------------------------------

_HATCH = {"padded": "///", "masked": "...", "varlen": ""}


def batch_waste(stats: Mapping[str, Sequence], max_num_batched_tokens: int | None = None) -> Figure:
    """Lesson 06 (C2, C8, C10): one group of bars per batch, for the same batches run three ways.

    ``stats[method]``: that method's ``engine.BatchStats`` list (the scheduler does not depend on
    the method). Top: rows through the linear layers, the tokens in green (gid ``rows-useful-b``)
    and the padded method's pad rows on top in vermillion (``rows-pad-b``); the budget dashed.
    Bottom: attention score cells per head per layer (whole blocks), one bar per method
    (P, M, V): useful in blue (``cells-<method>-useful-b``), computed and thrown away in
    vermillion (``cells-<method>-wasted-b``; hatched ``///`` for pad cells, ``...`` for masked cells).
    """
    if not stats:
        raise ValueError("stats is empty: give {method: [BatchStats, ...]}")
    methods = [m for m in METHODS if m in stats] + [m for m in stats if m not in METHODS]
    runs = {m: list(stats[m]) for m in methods}
    base = runs[methods[0]]
    n = len(base)
    for m in methods:
        if [s.num_tokens for s in runs[m]] != [s.num_tokens for s in base]:
            raise ValueError(f"stats[{m!r}] does not describe the same batches as stats[{methods[0]!r}]")
    fig = Figure(figsize=(8, 6))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1.5])
    for b, s in enumerate(base):
        top.bar(b, s.num_tokens, 0.8, color=LINEAR, gid=f"rows-useful-{b}")
        if "padded" in runs:
            p = runs["padded"][b]
            top.bar(b, p.padding_rows, 0.8, bottom=s.num_tokens, color=WASTE, hatch=_HATCH["padded"],
                    edgecolor="white", gid=f"rows-pad-{b}")
    handles = [Patch(facecolor=LINEAR, label="tokens (every method)"),
               Patch(facecolor=WASTE, hatch="///", edgecolor="white", label="+ pad rows (padded only)")]
    if max_num_batched_tokens is not None:
        top.axhline(max_num_batched_tokens, color=TEXT, linestyle="--", linewidth=0.8, gid="budget")
        over = "padded" in runs and any(s.executed_rows > max_num_batched_tokens for s in runs["padded"])
        handles.append(Line2D([], [], color=TEXT, linestyle="--", linewidth=0.8,
                              label=f"budget {max_num_batched_tokens:,} tokens" + (": padded rows go over it" if over else "")))
    top.set_ylim(0, max(max(s.executed_rows for s in runs[m]) for m in methods) * 1.6)
    top.set_ylabel("rows", fontsize=MIN_FONT)
    top.legend(handles=handles, fontsize=MIN_FONT, frameon=False, loc="upper left", ncol=2)
    rows = {m: sum(s.executed_rows for s in runs[m]) for m in methods}
    top.set_title("rows through the linear layers: " + ", ".join(f"{m} {rows[m]:,}" for m in methods), fontsize=10)
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        for b, s in enumerate(runs[m]):
            x = b - 0.4 + (j + 0.5) * width
            bottom.bar(x, s.cells_whole_useful, width * 0.92, color=ATTENTION, gid=f"cells-{m}-useful-{b}")
            bottom.bar(x, s.cells_whole_wasted, width * 0.92, bottom=s.cells_whole_useful, color=WASTE,
                       hatch=_HATCH.get(m, ""), edgecolor="white", gid=f"cells-{m}-wasted-{b}")
            if n <= 12:
                bottom.text(x, s.cells_whole_computed, m[0].upper(), ha="center", va="bottom", fontsize=MIN_FONT)
    tallest = max(s.cells_whole_computed for m in methods for s in runs[m])
    for b in range(n if n <= 12 else 0):  # a batch whose bars are too short to see gets its counts written
        counts = [runs[m][b].cells_whole_computed for m in methods]
        if max(counts) < 0.04 * tallest:
            text = (f"{counts[0]:,} cells each" if len(set(counts)) == 1
                    else "\n".join(f"{m[0].upper()} {c:,}" for m, c in zip(methods, counts)))
            bottom.annotate(text, (b, max(counts)), xytext=(0, 14), textcoords="offset points", ha="center",
                            va="bottom", fontsize=MIN_FONT, gid=f"cells-small-{b}")
    bottom.set_ylim(0, tallest * 1.3)
    bottom.set_ylabel("score cells\nper head per layer", fontsize=MIN_FONT)
    bottom.yaxis.set_major_formatter(EngFormatter(sep=""))
    bottom.legend(handles=[Patch(facecolor=ATTENTION, label="useful"),
                           Patch(facecolor=WASTE, hatch="///", edgecolor="white", label="pad cells (P)"),
                           Patch(facecolor=WASTE, hatch="...", edgecolor="white", label="masked cells (M)")],
                  fontsize=MIN_FONT, frameon=False, loc="upper right", ncol=3)
    cells = {m: sum(s.cells_whole_computed for s in runs[m]) for m in methods}
    bottom.set_title("score cells computed per head per layer, whole blocks (P padded, M masked, V varlen)\n"
                     + ", ".join(f"{m} {cells[m]:,}" for m in methods), fontsize=10)
    bottom.set_xticks(range(n))
    every = max(1, math.ceil(n / 12))
    bottom.set_xticklabels([(f"batch {b}\nR={s.num_seqs}" if n <= 12 else str(b)) if b % every == 0 else ""
                            for b, s in enumerate(base)], fontsize=MIN_FONT)
    for ax in (top, bottom):
        ax.tick_params(axis="y", labelsize=MIN_FONT)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.1, top=0.94, hspace=0.4)
    return fig


# ---- the explorer ----------------------------------------------------------------------------------

RECORD_LIMIT = 1_000_000  # score cells per head per layer above which the explorer records a scaled-down copy


@functools.lru_cache(maxsize=256)
def record_batch(lens: tuple, max_num_batched_tokens: int) -> dict:
    """``serve.recording.record_scaled`` on ``Engine(TINY)`` under ``RECORD_LIMIT``: ``{method: (BatchRecord, k)}``.
    Kept: an explorer move records only the batches it has not run before."""
    return record_scaled(TINY, _tiny_weights(), lens, max_num_batched_tokens, RECORD_LIMIT, PROMPT_SEED)


def record_stream(seq_lens: Sequence[int], batches: Sequence[Sequence[int]], max_num_batched_tokens: int) -> dict:
    """Every batch of ``batches`` (request ids into ``seq_lens``) by ``record_batch``: ``{method: [(BatchRecord, k)
    per batch]}``, what ``Engine(TINY)`` EXECUTED for the whole stream."""
    runs = [record_batch(tuple(seq_lens[i] for i in ids), max_num_batched_tokens) for ids in batches]
    return {m: [run[m] for run in runs] for m in METHODS}


def prefill_plan_state(workload: str = "long-tail", num_requests: int = 48, max_num_batched_tokens: int = 768,
                       seed: int = 0, batch: int | None = 0, scheduler: str = "FCFS", record: bool = True) -> dict:
    """A seeded stream of ``workload`` requests (``preset_lengths``), scheduled by ``scheduler`` (``schedule_within``:
    FCFS = ``plan_batches``, shortest first = ``shortest_first_batches``), costed per method.

    Keys: ``workload``, ``seq_lens``, ``batches`` (lists of request ids), ``rejected`` (ids),
    ``max_num_batched_tokens``, ``scheduler``; ``stats`` ({method: [BatchStats]}, ``batch_stats``) and ``totals``
    (``serve.schedules.stats_totals``); ``measures`` and ``counts`` ({schedule: ``schedule_measures`` with
    ``delays``} and {schedule: ``serve.recording.recorded_totals``} for the scheduler and, beside another one, FCFS:
    every batch recorded per method);
    ``batch`` (the index shown, clipped to the last batch; None: none) and ``recorded`` (that batch's
    ``{method: (BatchRecord, k)}``, ``{}`` when none); ``readout`` (``prefill_plan_readout``). With
    ``record=False`` only the plan and its predictions (nothing runs): no ``measures``, ``counts``, ``recorded``,
    ``readout``.
    """
    n = check_int("num_requests", num_requests, 1, 4096)
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens, 1, 1 << 20)
    lens = preset_lengths(workload, n, seed)
    batches, measures = schedule_within(scheduler, lens, budget)
    cfg = ModelConfig()
    stats = {m: [batch_stats(cfg, [lens[i] for i in ids], m, b, request_ids=ids) for b, ids in enumerate(batches)]
             for m in METHODS}
    state = {"workload": workload, "seq_lens": lens, "batches": batches, "scheduler": scheduler,
             "rejected": [i for i, n in enumerate(lens) if n > budget], "max_num_batched_tokens": budget,
             "stats": stats, "totals": {m: stats_totals(stats[m]) for m in METHODS}}
    if not record:
        return state
    pick = None if batch is None or not batches else min(check_int("batch", batch, 0), len(batches) - 1)
    stream = record_stream(lens, batches, budget)
    schedules = {scheduler: (batches, measures, stream)}
    if scheduler != "FCFS" and batches:
        fcfs, fcfs_measures = schedule_within("FCFS", lens, budget)
        schedules = {"FCFS": (fcfs, fcfs_measures, record_stream(lens, fcfs, budget)), **schedules}
    state.update(measures={k: v[1] for k, v in schedules.items()},
                 counts={k: recorded_totals(TINY, lens, v[0], v[2]) for k, v in schedules.items()},
                 batch=pick, recorded={} if pick is None else {m: stream[m][pick] for m in METHODS})
    state["readout"] = prefill_plan_readout(state)
    return state


def prefill_plan_readout(state: dict) -> dict:
    """The explorer's readout as data, so that the widget only renders it (``prefill_plan_html``).

    ``{"title": str, "tables": [{"name", "caption", "header", "rows"}], "notes": [str]}``, every cell a string.
    Tables: ``backends`` (the whole stream per method as recorded, against useful, and executed / useful FLOPs);
    ``fairness`` (each schedule's waste as recorded and its delays); ``delays`` (how many requests are served how
    many batches later than under FCFS); ``recorded`` (the chosen batch per method beside ``batch_stats``'
    prediction). Notes: the refused requests.
    """
    lens, budget, sched = state["seq_lens"], state["max_num_batched_tokens"], state["scheduler"]
    served, nb, rej = sum(len(b) for b in state["batches"]), len(state["batches"]), state["rejected"]
    title = (f"{state['workload']}, {len(lens)} request{'s' if len(lens) != 1 else ''}, "
             f"max_num_batched_tokens = {budget}, {sched}: "
             f"{nb} batch{'es' if nb != 1 else ''}, {served} request{'s' if served != 1 else ''} served, "
             f"{len(rej)} refused")
    counts = state["counts"][sched]
    rows = []
    for m, t in state["totals"].items():
        c = counts[m]
        ratio = f"{t['flops_executed'] / t['flops_useful']:.2f}x" if t["flops_useful"] else "-"
        check = ("nothing ran" if not nb else f"= \u2713 {c['checked']}/{nb}" if not c["differs"] else
                 f"differs \u2717 batch {', '.join(map(str, c['differs'][:4]))}")
        rows.append([m, f"{c['rows']:,}", f"{c['useful_rows']:,}", f"{c['cells']:,}", f"{c['useful_cells']:,}",
                     f"{c['cells'] - c['useful_cells']:,}", ratio, check])
    scaled = counts["varlen"]["scaled"]
    tables = [{"name": "backends", "caption": "whole stream, per backend, as EXECUTED: every batch run once per "
               "backend on Engine(L.TINY) under OpRecorder (cells per head per layer, whole L x L blocks), beside "
               "the useful counts; FLOPs are counted for the S1 model"
               + (f"; {scaled} batch{'es' if scaled != 1 else ''} over {RECORD_LIMIT:,} cells ran as a scaled "
                  "copy (checked against its own prediction; counted here at full length by batch_stats)"
                  if scaled else ""),
               "header": ["backend", "rows computed", "rows useful", "cells computed", "cells useful",
                          "cells wasted", "FLOPs computed / useful", "recorded vs predicted"], "rows": rows}]
    if state["batches"]:
        fair = []
        for name, ms in state["measures"].items():
            c = state["counts"][name]
            later = sum(d > 0 for _, d in ms["delays"])
            fair.append([name, f"{ms['batches']:,}", f"{c['padded']['rows'] - c['varlen']['rows']:,}",
                         f"{c['masked']['cells'] - c['varlen']['cells']:,}", f"{later:,}", f"{ms['max_delay']:,}",
                         f"{ms['overtakes']:,}"])
        tables.append({"name": "fairness", "caption": "the scheduler's trade: waste as recorded (pad rows: padded's "
                       "rows less varlen's; masked cells wasted: masked's cells less varlen's) against fairness (delay: "
                       "batches later than under FCFS; overtakes: pairs where a later arrival runs first)",
                       "header": ["scheduler", "batches", "pad rows", "masked cells wasted", "served later",
                                  "max delay", "overtakes"], "rows": fair})
        delays = state["measures"][sched]["delays"]
        hist = Counter(d for _, d in delays)
        worst = max(((d, i) for i, d in delays), default=(0, None))
        tables.append({"name": "delays", "caption": "per request: batches later than under FCFS"
                       + (f" (most delayed: request {worst[1]}, {lens[worst[1]]} tokens)" if worst[0] > 0 else ""),
                       "header": ["batches later"] + [f"{d:+d}" if d else "0" for d in sorted(hist)],
                       "rows": [["requests"] + [f"{hist[d]:,}" for d in sorted(hist)]]})
    b = state["batch"]
    if b is not None:
        rec_rows = []
        for m, (rec, k) in state["recorded"].items():
            pred = batch_stats(TINY, [-(-lens[i] // k) for i in state["batches"][b]], m)
            sides = sorted({sh[-1] for sh in rec.score_shapes})
            ok = (rec.rows, rec.cells) == (pred.executed_rows, pred.cells_whole_computed)
            rec_rows.append([m, "as scheduled" if k == 1 else f"each / {k}, rounded up", f"{rec.rows:,}",
                             f"{pred.executed_rows:,}", f"{rec.cells:,}", f"{pred.cells_whole_computed:,}",
                             "= \u2713" if ok else "differs \u2717",
                             ", ".join(map(str, sides[:4])) + (" ..." if len(sides) > 4 else "")])
        tables.append({"name": "recorded", "caption": f"batch {b} ({len(state['batches'][b])} requests, "
                       f"{state['stats']['varlen'][b].num_tokens:,} tokens) as EXECUTED: one forward per backend "
                       "under OpRecorder (Engine(L.TINY)), beside batch_stats' prediction for the lengths run "
                       f"(a batch over {RECORD_LIMIT:,} cells under any backend runs as one scaled-down copy, "
                       "the same for all three)",
                       "header": ["backend", "lengths run", "rows recorded", "rows predicted", "cells recorded",
                                  "cells predicted", "recorded vs predicted", "score matrix sides"], "rows": rec_rows})
    notes = [f"refused (longer than the budget, S3): {len(rej)}"
             + (f" - lengths {[lens[i] for i in rej][:8]}" if rej else "")]
    return {"title": title, "tables": tables, "notes": notes}


_TABLE_CSS = "border-collapse:collapse;margin:4px 0;font-variant-numeric:tabular-nums;font-size:12px"


def prefill_plan_html(state: dict) -> str:
    """The explorer's readout, ``state["readout"]`` rendered: a title line, one small table per part
    (numbers right-aligned), then the notes. It computes nothing."""
    r = state["readout"]
    out = [f"<div class='ppx-line'><b>{escape(r['title'])}</b></div>"]
    for t in r["tables"]:
        def cell(tag, k, text):
            side = "left" if k == 0 else "right"
            return f"<{tag} style='padding:1px 8px;white-space:nowrap;text-align:{side}'>{escape(text)}</{tag}>"
        head = "".join(cell("th", k, h) for k, h in enumerate(t["header"]))
        body = "".join("<tr>" + "".join(cell("td", k, c) for k, c in enumerate(row)) + "</tr>" for row in t["rows"])
        out.append(f"<table class='ppx-{t['name']}' style='{_TABLE_CSS}'><caption style='text-align:left'>"
                   f"{escape(t['caption'])}</caption><tr>{head}</tr>{body}</table>")
    out += [f"<div class='ppx-line'>{escape(n)}</div>" for n in r["notes"]]
    return "".join(out)


def prefill_plan_explorer(workload: str = "long-tail", num_requests: int = 48, max_num_batched_tokens: int = 768,
                          scheduler: str = "FCFS"):
    """VBox class ``ppx``: Dropdowns ``ppx-workload`` and ``ppx-scheduler``, IntSliders ``ppx-num-requests`` (1..256),
    ``ppx-budget`` (max_num_batched_tokens, 16..8192, steps of 16) and ``ppx-batch`` (the batch shown as recorded,
    clipped to the last one), HTML ``ppx-counts`` (``prefill_plan_html``), Output ``ppx-figure`` (``batch_waste``;
    empty when every request was refused)."""
    w = ipywidgets_module()
    kind = tagged(w.Dropdown(options=list(WORKLOAD_PRESETS), value=workload, description="workload"), "ppx-workload")
    sched = tagged(w.Dropdown(options=list(SCHEDULES), value=scheduler, description="scheduler"), "ppx-scheduler")
    reqs = tagged(w.IntSlider(value=num_requests, min=1, max=256, description="requests"), "ppx-num-requests")
    budget = tagged(w.IntSlider(value=max_num_batched_tokens, min=16, max=8192, step=16, description="token budget"),
                    "ppx-budget")
    pick = tagged(w.IntSlider(value=0, min=0, max=64, description="record batch"), "ppx-batch")
    text, out = tagged(w.HTML(), "ppx-counts"), tagged(w.Output(), "ppx-figure")

    def update(change=None):
        text.value = "<div>running...</div>" + text.value
        knobs = dict(workload=kind.value, num_requests=reqs.value, max_num_batched_tokens=budget.value,
                     batch=pick.value, scheduler=sched.value)
        plan = prefill_plan_state(**knobs, record=False)  # the figure first: predictions, nothing runs
        if plan["batches"]:
            show_figure(out, batch_waste(plan["stats"], budget.value))
        else:
            out.outputs = ()
        text.value = prefill_plan_html(prefill_plan_state(**knobs))  # then every batch run under the recorder

    return explorer("ppx", [kind, sched, reqs, budget, pick], [text, out], update)


# ---- C9: masked's waste per useful cell, recorded -----------------------------------------------------

def masked_waste_sweep(length: int = 32, requests: Sequence[int] = (1, 2, 4, 8)) -> dict[int, float]:
    """C9 measured: for each ``R`` in ``requests``, ``R`` requests of ``length`` tokens run as ONE forward of
    ``Engine(TINY)`` per method under the op recorder (``record_batch``): ``{R: (masked cells - varlen cells) /
    varlen cells}``, both counts recorded, the waste per useful cell of masking R equal lengths."""
    cells = {r: {m: rec.cells for m, (rec, _) in record_batch((length,) * r, r * length).items()} for r in requests}
    return {r: (c["masked"] - c["varlen"]) / c["varlen"] for r, c in cells.items()}


# ---- TP=2: one batch as each rank ran it -------------------------------------------------------------

TP_BATCH = 1  # the stream's batch drawn under TP=2: ten requests


def tp_dry_traces(cfg: ModelConfig, seq_lens: Sequence[int]) -> list[list]:
    """Each rank's collective trace for a batch of ``seq_lens`` at TP=2 by ``tp.dryrun.record_trace``
    (the same forward on local stand-in groups: no workers)."""
    return [record_trace(cfg, list(seq_lens), rank, 2) for rank in range(2)]


# ---- registered figures ----------------------------------------------------------------------------

@register("06_fcfs_batches", lesson="06",
          caption="Lesson 06's 24 long-tailed requests under FCFS and a 512-token budget: 23 in 5 batches, the "
                  "1,776-token one refused whole (S3)")
def _fcfs_batches() -> Figure:
    return fcfs_batches(prefill_stream()[0], BUDGET)


@register("06_batch_waste", lesson="06",
          caption="The same 5 batches run padded, masked and varlen: rows through the linear layers and attention "
                  "cells per batch, useful vs thrown away (C2, C8, C10)")
def _batch_waste() -> Figure:
    state = prefill_plan_state(**PREFILL_STREAM, max_num_batched_tokens=BUDGET, batch=None)
    return batch_waste(state["stats"], state["max_num_batched_tokens"])


@register("06_tp_trace", lesson="06",
          caption="Batch 1 of lesson 06's stream (ten requests) under TP=2, each rank's collective trace: "
                  "16 all-reduces, attention on each rank's own 4 heads with no collective (C11, C12)")
def _tp_trace() -> Figure:
    cfg = ModelConfig()
    lens, _ = prefill_stream(cfg.vocab_size)
    ids = plan_batches(lens, BUDGET, skip_oversize=True)[TP_BATCH]
    sizes = [lens[i] for i in ids]
    return tp_trace_timeline([tp_dry_traces(cfg, sizes)], [sizes], cfg, source="dry run; TPRuntime's checked equal")


# ---- exercise 06.1: a budget-aware bucketing scheduler, plugged into the engine ---------------------

MAX_PASSED_OVER = 2  # 06.1's fairness bound: a request may see at most this many batches serve later arrivals first

IN_ENGINE = "lesson 06's stream served by Engine(TINY, method='padded') with your scheduler, under OpRecorder"


def _bucket_cases() -> list[tuple]:
    lens, budget = prefill_stream()[0], BUDGET
    kept = [n for n in lens if n <= budget]
    return [("lesson 06's stream, all waiting at once", [kept], budget, 256),
            ("bimodal: 50-token questions beside 1,500-token drafts", [workload_lengths(
                "bimodal", 40, 2, short=50, long=1500, p_long=0.2)], 2048, 256),
            ("long-tail, at most 6 requests per batch", [workload_lengths("long-tail", 48, 1, median=64, sigma=1.0,
                                                                          max_len=1024)], 1024, 6),
            ("a 400-token request, then 6 short ones arriving at every step", trickle_arrivals(), 512, 256),
            (IN_ENGINE, [kept], budget, 256)]


def _bucket_problem(batches, arrivals, budget, max_seqs) -> str | None:
    lens = [n for wave in arrivals for n in wave]
    problem = schedule_problem(batches, lens, budget, max_seqs)
    if problem:
        return problem
    over = passed_over(batches, arrivals)
    worst = max(over, key=over.get)
    if over[worst] > MAX_PASSED_OVER:
        return (f"request {worst} ({lens[worst]} tokens) waited while {over[worst]} batches served requests that arrived "
                f"after it (the bound is MAX_PASSED_OVER = {MAX_PASSED_OVER}): grouping by length starves it - what would "
                "your scheduler have to remember about each waiting request to see that it has been passed over too often, "
                "and what must it then do with that request?")
    if len(arrivals) == 1:
        fcfs = plan_batches(lens, budget, max_seqs)
        mine, base = (schedule_measures(lens, b, budget, max_seqs)["pad_rows"] for b in (batches, fcfs))
        if mine >= base:
            if [list(b) for b in batches] == fcfs:
                return ("these are FCFS's batches: which waiting requests, not only those at the head, could share "
                        "a batch without padding each other?")
            return (f"valid and fair, but {mine:,} pad rows where FCFS pads {base:,}: which waiting "
                    "requests pad each other least when they share a batch?")
    return None


def _engine_problem(got: dict, lens: Sequence[int], budget: int, max_seqs: int) -> str | None:
    if got["served"] != list(range(len(lens))):
        return f"the engine served requests {got['served'][:10]}..., not each of the {len(lens)} exactly once"
    problem = _bucket_problem(got["batches"], [lens], budget, max_seqs)
    if problem:
        return "inside the engine: " + problem
    if got["rows"] >= got["fcfs_rows"]:
        return (f"the padded engine ran {got['rows']:,} rows through its linear layers with your scheduler, "
                f"{got['fcfs_rows']:,} with FCFS's batches: no saving where it counts")
    return None


def check_bucket_scheduler(answer) -> bool:
    """Exercise 06.1: ``answer`` is a function ``schedule(self)`` (made a ``Scheduler`` method by
    ``with_schedule``) or a ``Scheduler`` subclass; ``schedule`` returns the next batch, a list of
    ``Request`` taken out of ``self.waiting``. Probed on 4 generated streams (``drive_scheduler``: one
    ``schedule()`` per step, new arrivals between steps) and once inside ``Engine``: valid
    (``schedule_problem``), fair (nobody passed over by more than ``MAX_PASSED_OVER`` batches), worth it (fewer
    pad rows than FCFS when everything waits at once; inside the engine fewer rows RECORDED through the linears)."""
    if isinstance(answer, type) and issubclass(answer, Scheduler):
        cls = answer
    elif callable(answer) and not isinstance(answer, type):
        cls = with_schedule(answer)
    else:
        raise WrongAnswer(f"bucket_scheduler: expected schedule(self) or a subclass of Scheduler, got {answer!r}"[:200])
    cases, in_engine = _bucket_cases(), {}

    def run(what, arrivals, budget, seqs):
        if what == IN_ENGINE:
            lens = arrivals[0]
            fcfs_rows = sum(len(b) * max(lens[i] for i in b) for b in plan_batches(lens, budget, seqs))
            in_engine.update(record_served(TINY, _tiny_weights(), cls(budget, seqs), lens, prompt_seed=PROMPT_SEED),
                             fcfs_rows=fcfs_rows)
            return in_engine
        return drive_scheduler(cls, arrivals, budget, seqs)

    def judge(got, what, arrivals, budget, seqs):
        if what == IN_ENGINE:
            return _engine_problem(got, arrivals[0], budget, seqs)
        return _bucket_problem(got, arrivals, budget, seqs)

    ok = grade("bucket_scheduler", run, cases, judge,
               f"valid batches, nobody passed over more than {MAX_PASSED_OVER} times, fewer pad rows than FCFS on 4 "
               "streams, and fewer rows recorded through the padded engine's linear layers")
    if ok:
        lens, budget, seqs = cases[0][1][0], cases[0][2], cases[0][3]
        print("lesson 06's stream:\n" + schedule_table(lens, drive_scheduler(cls, [lens], budget, seqs), budget, seqs))
        print(f"rows recorded through the padded engine's linear layers: yours {in_engine['rows']:,}, "
              f"FCFS {in_engine['fcfs_rows']:,}")
    return ok


# ---- exercise 06.2: a counter-example, measured ------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _both_schedules(lens: tuple, budget: int) -> tuple:
    """``(FCFS's batches, shortest first's, recorded_totals of each)`` for a stream, kept per stream: the counts as
    EXECUTED, every batch run by ``record_stream`` (rows through the linears, cells per head per layer)."""
    plans = plan_batches(list(lens), budget), shortest_first_batches(lens, budget)
    return *plans, *(recorded_totals(TINY, lens, p, record_stream(lens, p, budget)) for p in plans)


_CE_CASES = [("a valid stream: 1 to 12 requests, none over the budget, budget 1..256",),
             ("shortest first pads fewer rows than FCFS (recorded through the padded engine)",),
             ("shortest first makes the masked engine compute more score cells (recorded)",)]


def check_masked_counterexample(fn: Callable[[], tuple]) -> bool:
    """Exercise 06.2: ``fn() -> (seq_lens, max_num_batched_tokens)``: at most 12 requests, each at most the
    budget, budget at most 256. Both schedules, FCFS (``plan_batches``) and shortest-first (``shortest_first_batches``),
    are RUN through the padded and the masked engine under the recorder (``record_stream``); three checks,
    one point each: a valid stream, sorting pads fewer rows, and sorting makes masked compute MORE cells."""
    answers = []

    def run(what):
        answers.append(fn())
        return answers[-1]

    def judge(got, what):
        if not (isinstance(got, tuple) and len(got) == 2):
            return f"expected (seq_lens, max_num_batched_tokens), got {got!r}"[:200]
        lens, budget = got
        if not (isinstance(budget, int) and not isinstance(budget, bool) and 1 <= budget <= 256):
            return f"max_num_batched_tokens must be an int in 1..256, got {budget!r}"
        if not (isinstance(lens, (list, tuple)) and 1 <= len(lens) <= 12
                and all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= budget for n in lens)):
            return f"seq_lens must be 1 to 12 ints, each in 1..{budget} (no request over the budget), got {lens!r}"[:200]
        if what == _CE_CASES[0][0]:
            return None
        _, _, a, b = _both_schedules(tuple(lens), budget)
        if what == _CE_CASES[1][0]:
            if b["padded"]["rows"] < a["padded"]["rows"]:
                return None
            return (f"sorting did not pad fewer rows: {b['padded']['rows']} recorded against FCFS's {a['padded']['rows']} - "
                    "FCFS must put a short request beside a long one")
        if b["masked"]["cells"] > a["masked"]["cells"]:
            return None
        return (f"the masked engine computed {b['masked']['cells']:,} cells for the sorted batches against FCFS's "
                f"{a['masked']['cells']:,}: not more. Masked pays T^2 per batch, so for the same tokens it pays most when "
                "they sit in few, full batches: find lengths where FCFS leaves batches half empty and sorting packs "
                "the short requests together")

    ok = grade("masked_counterexample", run, _CE_CASES, judge,
               "a stream on which sorting by length pads fewer rows but makes masked compute more cells (recorded)")
    if ok:
        lens, budget = answers[-1]
        fcfs, srt, a, b = _both_schedules(tuple(lens), budget)
        print(f"stream {list(lens)}, budget {budget}\n  FCFS    {[[lens[i] for i in x] for x in fcfs]}: padded rows "
              f"{a['padded']['rows']}, masked cells {a['masked']['cells']:,}\n  sorted  {[[lens[i] for i in x] for x in srt]}: "
              f"padded rows {b['padded']['rows']}, masked cells {b['masked']['cells']:,}")
    return ok
