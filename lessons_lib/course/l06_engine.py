"""What lesson 06 (the prefill engine) draws, explores and checks.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..core.config import ModelConfig
from ..validate import check_int
from ..measure.flops import METHODS
from ..serve.engine import batch_stats
from ..serve.scheduler import plan_batches
from ..serve.workloads import workload_lengths
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import register
from .grading import WrongAnswer, grade, int_tuple
from .l00_setup import _SMALL_CFGS
from .style import CELL_COLORS, PAD_COLOR, USEFUL, WASTED, request_color


def batch_waste(stats: Mapping[str, Sequence], max_num_batched_tokens: int | None = None) -> Figure:
    """Lesson 06: the prefill engine's batches, one bar group per batch.

    ``stats[method]``: that method's ``engine.BatchStats`` list for the same schedule (the
    scheduler does not depend on the method). Top: rows through the linear layers per batch,
    useful tokens (blue, gid ``rows-useful-b``) and the padded method's pad rows on top (grey,
    gid ``rows-pad-b``), the token budget dashed. Bottom: attention score cells computed per
    head per layer by each method (gid ``cells-<method>-b``, log scale); varlen's are all useful.
    """
    if not stats:
        raise ValueError("stats is empty: give {method: [BatchStats, ...]}")
    methods = [m for m in METHODS if m in stats] + [m for m in stats if m not in METHODS]
    runs = {m: list(stats[m]) for m in methods}
    n = len(runs[methods[0]])
    for m in methods:
        if len(runs[m]) != n or [s.num_tokens for s in runs[m]] != [s.num_tokens for s in runs[methods[0]]]:
            raise ValueError(f"stats[{m!r}] does not describe the same batches as stats[{methods[0]!r}]")
    base = runs[methods[0]]
    xs = np.arange(n)
    fig = Figure(figsize=(8, 5.2))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for b, s in enumerate(base):
        top.bar(b, s.num_tokens, color=CELL_COLORS[USEFUL], gid=f"rows-useful-{b}")
        if "padded" in runs:
            p = runs["padded"][b]
            top.bar(b, p.executed_rows - p.num_tokens, bottom=s.num_tokens, color=PAD_COLOR, hatch="///",
                    edgecolor="white", gid=f"rows-pad-{b}")
    if max_num_batched_tokens is not None:
        top.axhline(max_num_batched_tokens, color="#555555", linestyle="--", linewidth=0.8)
        top.text(n - 0.5, max_num_batched_tokens, f"max_num_batched_tokens = {max_num_batched_tokens}", ha="right",
                 va="bottom", fontsize=7)
    top.set_ylabel("rows per batch")
    top.set_ylim(0, max(max(s.executed_rows for s in runs[m]) for m in methods) * 1.3)
    top.legend(handles=[Patch(facecolor=CELL_COLORS[USEFUL], label="useful tokens (varlen, masked)"),
                        Patch(facecolor=PAD_COLOR, hatch="///", label="+ pad rows (padded)")],
               fontsize=7, frameon=False, loc="upper left", ncol=2)
    width = 0.8 / len(methods)
    colors = {"padded": "#8c8c8c", "masked": CELL_COLORS[WASTED], "varlen": CELL_COLORS[USEFUL]}
    for i, m in enumerate(methods):
        vals = [s.attn_cells_computed for s in runs[m]]
        for b, v in enumerate(vals):
            bottom.bar(b - 0.4 + (i + 0.5) * width, v, width, color=colors.get(m, request_color(i)),
                       gid=f"cells-{m}-{b}", label=m if b == 0 else None)
    bottom.set_yscale("log")
    low = min(s.attn_cells_computed for m in methods for s in runs[m])
    bottom.set_ylim(max(1, low) / 2, max(s.attn_cells_computed for m in methods for s in runs[m]) * 8)
    bottom.set_ylabel("attention cells computed\n(per head per layer)")
    bottom.legend(fontsize=7, frameon=False, ncol=len(methods), loc="upper left")
    bottom.set_xticks(xs)
    bottom.set_xticklabels([f"{b}\nR={s.num_seqs}" for b, s in enumerate(base)] if n <= 24 else
                           [str(b) if b % max(1, n // 12) == 0 else "" for b in range(n)], fontsize=7)
    bottom.set_xlabel("batch (in scheduling order)")
    tot = {m: sum(s.attn_cells_computed for s in runs[m]) for m in methods}
    useful = sum(s.attn_cells_useful for s in base)
    rows = {m: sum(s.executed_rows for s in runs[m]) for m in methods}
    toks = sum(s.num_tokens for s in base)
    top.set_title(f"{n} batches, {sum(s.num_seqs for s in base)} requests, {toks:,} tokens; rows executed: "
                  + ", ".join(f"{m} {rows[m]:,}" for m in methods), fontsize=9)
    bottom.set_title("attention cells: " + ", ".join(f"{m} {tot[m]:,}" for m in methods) + f" (useful {useful:,})",
                     fontsize=9)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.12, top=0.93, hspace=0.3)
    return fig

WORKLOAD_PRESETS = {
    "long-tail": {"median": 64, "sigma": 1.0, "max_len": 2048},
    "bimodal": {"short": 50, "long": 1500, "p_long": 0.1},
    "uniform": {"low": 16, "high": 512},
}

def prefill_plan_state(workload: str = "long-tail", num_requests: int = 48, max_num_batched_tokens: int = 1024,
                       seed: int = 0) -> dict:
    """A seeded stream of ``workload`` requests (``WORKLOAD_PRESETS``), scheduled, costed per method.

    Keys: ``seq_lens``, ``batches`` (lists of request ids), ``rejected`` (ids),
    ``stats`` ({method: [engine.BatchStats]}, analytic: ``engine.batch_stats``) and ``totals``
    ({method: {"rows", "cells_computed", "cells_useful", "flops_executed", "flops_useful"}}).
    """
    if workload not in WORKLOAD_PRESETS:
        raise ValueError(f"workload must be one of {tuple(WORKLOAD_PRESETS)}, got {workload!r}")
    n = check_int("num_requests", num_requests, 1, 4096)
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens, 1, 1 << 20)
    lens = workload_lengths(workload, n, seed, **WORKLOAD_PRESETS[workload])
    batches = plan_batches(lens, budget, skip_oversize=True)
    rejected = [i for i, n in enumerate(lens) if n > budget]  # S3: a request runs whole or not at all
    cfg = ModelConfig()
    stats = {m: [batch_stats(cfg, [lens[i] for i in ids], m, b, request_ids=ids) for b, ids in enumerate(batches)]
             for m in ("padded", "masked", "varlen")}
    totals = {m: {"rows": sum(s.executed_rows for s in st), "cells_computed": sum(s.attn_cells_computed for s in st),
                  "cells_useful": sum(s.attn_cells_useful for s in st), "flops_executed": sum(s.flops_executed for s in st),
                  "flops_useful": sum(s.flops_useful for s in st)} for m, st in stats.items()}
    return {"seq_lens": lens, "batches": batches, "rejected": rejected, "stats": stats, "totals": totals,
            "max_num_batched_tokens": budget}

def prefill_plan_html(state: dict) -> str:
    """One ``<div>`` per method, ``varlen: rows 4783 | attention cells 886713 (useful 886713) | FLOPs
    executed / useful 1.00x``, then the batches and the rejected requests."""
    lines = []
    for m, t in state["totals"].items():
        ratio = t["flops_executed"] / t["flops_useful"] if t["flops_useful"] else 0.0
        lines.append(f"<div>{m}: rows {t['rows']} | attention cells {t['cells_computed']} (useful {t['cells_useful']}) | "
                     f"FLOPs executed / useful {ratio:.2f}x</div>")
    lens = state["seq_lens"]
    lines.append(f"<div>{len(state['batches'])} batches of at most {state['max_num_batched_tokens']} tokens, "
                 f"{sum(len(b) for b in state['batches'])} requests served</div>")
    rej = state["rejected"]
    lines.append(f"<div>rejected (longer than the budget, S3): {len(rej)}"
                 + (f" - lengths {[lens[i] for i in rej][:8]}" if rej else "") + "</div>")
    return "".join(lines)

def prefill_plan_explorer(workload: str = "long-tail", num_requests: int = 48, max_num_batched_tokens: int = 1024):
    """VBox class ``ppx``: Dropdown ``ppx-workload``, IntSliders ``ppx-num-requests`` (1..256) and
    ``ppx-budget`` (max_num_batched_tokens, 16..8192), HTML ``ppx-counts`` (``prefill_plan_html``),
    Output ``ppx-figure`` (``batch_waste``; empty when every request was rejected)."""
    w = ipywidgets_module()
    kind = tagged(w.Dropdown(options=list(WORKLOAD_PRESETS), value=workload, description="workload"), "ppx-workload")
    reqs = tagged(w.IntSlider(value=num_requests, min=1, max=256, description="requests"), "ppx-num-requests")
    budget = tagged(w.IntSlider(value=max_num_batched_tokens, min=16, max=8192, step=16, description="token budget"),
                     "ppx-budget")
    text, out = tagged(w.HTML(), "ppx-counts"), tagged(w.Output(), "ppx-figure")

    def update(change=None):
        state = prefill_plan_state(kind.value, reqs.value, budget.value)
        text.value = prefill_plan_html(state)
        if state["batches"]:
            show_figure(out, batch_waste(state["stats"], budget.value))
        else:
            out.outputs = ()

    return explorer("ppx", [kind, reqs, budget], [text, out], update)

def check_fcfs_schedule(fn: Callable[[list, int], list]) -> bool:
    """Exercise 06.1: ``fn(seq_lens, max_num_batched_tokens) -> [[request index, ...], ...]``: FCFS
    batches of whole requests within the token budget (what ``engine.Scheduler`` does). A request
    longer than the budget must raise ``ValueError`` (S3: no chunked prefill)."""
    cases = [([10, 30], 64), ([300, 300, 500, 100], 700), ([5] * 9, 12), ([64, 1, 64, 1, 64], 65), ([7], 7)]

    def judge(got, lens, budget):
        want = plan_batches(lens, budget, max_num_seqs=1 << 20)   # engine.Scheduler's batches
        try:
            got = [[int(i) for i in b] for b in got]
        except (TypeError, ValueError):
            return f"expected a list of batches (lists of request indices), got {got!r}"
        if got == want:
            return None
        flat = [i for b in got for i in b]
        if sorted(flat) != list(range(len(lens))):
            return f"got {got}, expected {want} - every request must be served exactly once"
        for b in got:
            if sum(lens[i] for i in b) > budget:
                return f"got {got}, expected {want} - batch {b} holds {sum(lens[i] for i in b)} tokens > budget {budget}"
        if flat != sorted(flat):
            return (f"got {got}, expected {want} - first come, first served: a later request never overtakes a "
                    "waiting one, even when it would fill the hole")
        return f"got {got}, expected {want} - close a batch only when the next request does not fit"
    ok = grade("fcfs_schedule", fn, [(list(lens), b) for lens, b in cases], judge,
                "FCFS batches within the budget on 5 streams")
    if not ok:
        return ok
    lens, budget = [100, 900, 50], 512
    try:
        got = fn(list(lens), budget)
    except ValueError:
        return ok
    except Exception as exc:
        raise WrongAnswer(f"fcfs_schedule: for {lens} with budget {budget} raise ValueError, not {type(exc).__name__}: {exc}") \
            from exc
    raise WrongAnswer(f"fcfs_schedule: for {lens} with budget {budget} you returned {got!r} - request 1 has 900 tokens, "
                 "more than the budget: it can never run whole (S3), so raise ValueError")

def check_stream_waste(fn: Callable[[list], tuple]) -> bool:
    """Exercise 06.2: ``fn(batches) -> (pad_rows, masked_wasted_cells)`` summed over a stream;
    ``batches`` is a list of batches, each a list of request lengths. Cells per head per layer,
    whole blocks (the article's count)."""
    cases = [[[10, 30]], [[10, 30], [40], [5, 5, 20]], [[1, 7, 3], [64, 2], [16] * 4], [[100], [3, 300, 30]]]
    cfg = _SMALL_CFGS[0]

    def judge(got, batches):
        pad = sum(batch_stats(cfg, b, "padded").padding_rows for b in batches)
        masked = sum(batch_stats(cfg, b, "masked").masked_cells for b in batches)
        want = (pad, masked)
        got, problem = int_tuple(got, "pad_rows, masked_wasted_cells")
        if problem or got == want:
            return problem
        lens = [n for b in batches for n in b]
        hint = ""
        if len(batches) > 1 and got[0] == len(lens) * max(lens) - sum(lens):
            hint = " - each batch pads to its OWN longest request, not the stream's"
        elif len(batches) > 1 and got[1] == sum(lens) ** 2 - sum(n * n for n in lens):
            hint = " - masking is per batch: only requests in the same batch share a score matrix"
        elif got[1] == masked // 2:
            hint = " - count both off-diagonal blocks, A's queries on B's keys and B's on A's"
        return f"got {got}, expected {want}{hint}"
    return grade("stream_waste", fn, [(c,) for c in cases], judge, "pad rows and masked cells summed batch by batch, 4 streams")

ENGINE_STREAM = dict(workload="long-tail", num_requests=24, max_num_batched_tokens=512, seed=3)  # lesson 06's stream

@register("06_batch_waste", lesson="06",
          caption="24 long-tailed requests under a 512-token budget (one of 1776 tokens rejected): rows and attention "
                  "cells per batch, padded vs masked vs varlen (C2, C8, C10)")
def _batch_waste() -> Figure:

    state = prefill_plan_state(**ENGINE_STREAM)
    return batch_waste(state["stats"], state["max_num_batched_tokens"])
