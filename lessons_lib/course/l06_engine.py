"""What lesson 06 (the prefill engine, the capstone) draws, explores and checks.

  the stream        ``ENGINE_STREAM``, ``stream_prompts``, ``stream_reference`` (the engine's own
                    varlen outputs on it, float32 and float64, computed once; ``keep_engine_run``
                    hands the lesson's own float32 run over instead of serving the stream again)
  counts            ``method_totals`` / ``totals_text``: rows, cells and FLOPs per method, whole blocks
  figures           ``fcfs_batches`` (06_fcfs_batches), ``batch_waste`` (06_batch_waste)
  explorer          ``prefill_plan_state`` / ``prefill_plan_html`` / ``prefill_plan_explorer``
  schedules         ``schedule_measures``, ``schedule_table``: pad rows, masked cells, fairness
  exercises         ``check_attention_backend`` (06.1, your attention inside ``Engine``),
                    ``check_sorted_schedule`` (06.2, a length-sorting scheduler)
  measured          ``run_methods``, ``throughput_text``, ``time_backend``

Taught in notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import EngFormatter

from ..core.attention import varlen_attention
from ..core.batch import cumulative
from ..core.config import ModelConfig
from ..core.kernels import synchronize
from ..core.model import init_weights
from ..measure.flops import METHODS, attention_cells, forward_flops
from ..measure.profile import random_qkv, time_call
from ..measure.tolerance import max_abs_diff, tolerance
from ..serve.engine import Engine, batch_stats
from ..serve.scheduler import Request, plan_batches
from ..serve.workloads import make_requests, workload_lengths
from ..style import ATTENTION, LINEAR, MIN_FONT, NEVER, OTHER, REQUEST, TEXT, WASTE, request_color
from ..validate import check_int
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import register
from .grading import NOT_YET, WrongAnswer, call_reader, grade

Tensor = torch.Tensor

# ---- the lesson's stream ---------------------------------------------------------------------------

ENGINE_STREAM = dict(workload="long-tail", num_requests=24, max_num_batched_tokens=512, seed=3)  # lesson 06's stream
PROMPT_SEED = 1  # the token ids of the stream's prompts: make_requests(lens, vocab, seed=PROMPT_SEED)

WORKLOAD_PRESETS = {
    "long-tail": {"median": 64, "sigma": 1.0, "max_len": 2048},
    "bimodal": {"short": 50, "long": 5000, "p_long": 0.1},  # the article's 50-token questions beside 5,000-token drafts
    "uniform": {"low": 16, "high": 512},
}


def stream_prompts(cfg: ModelConfig | None = None) -> tuple[list[int], list[list[int]]]:
    """Lesson 06's stream: ``(lengths in arrival order, token-id prompts)``, oversize ones included."""
    cfg = cfg or ModelConfig()
    lens = workload_lengths(ENGINE_STREAM["workload"], ENGINE_STREAM["num_requests"], ENGINE_STREAM["seed"],
                            **WORKLOAD_PRESETS[ENGINE_STREAM["workload"]])
    return lens, make_requests(lens, cfg.vocab_size, seed=PROMPT_SEED)


def _stream_requests(cfg: ModelConfig) -> list[Request]:
    """The stream's requests that fit the budget, asking for every final hidden row."""
    lens, prompts = stream_prompts(cfg)
    budget = ENGINE_STREAM["max_num_batched_tokens"]
    return [Request(i, p, return_hidden=True) for i, p in enumerate(prompts) if lens[i] <= budget]


def _serve_stream(attn_backend="auto", dtype: torch.dtype = torch.float32) -> tuple[dict, list]:
    """``({request_id: hidden [L, d]}, [BatchStats])``: the stream served on the CPU with ``attn_backend``."""
    cfg = ModelConfig()
    engine = Engine(cfg, weights=init_weights(cfg, 0), attn_backend=attn_backend, device="cpu", dtype=dtype,
                    max_num_batched_tokens=ENGINE_STREAM["max_num_batched_tokens"], compute_logits=False)
    outputs = engine.prefill(_stream_requests(cfg))
    return {o.request_id: o.hidden for o in outputs}, engine.stats


_ENGINE_RUNS: dict = {}  # {dtype: (hidden by request id, [BatchStats])}: the engine's own varlen runs of the stream


def _engine_run(dtype: torch.dtype = torch.float32) -> tuple[dict, list]:
    if dtype not in _ENGINE_RUNS:
        _ENGINE_RUNS[dtype] = _serve_stream("auto", dtype)
    return _ENGINE_RUNS[dtype]


def stream_reference(dtype: torch.dtype = torch.float32) -> dict:
    """The engine's own varlen answer on lesson 06's stream (``init_weights(ModelConfig(), 0)``, CPU):
    ``{request_id: final hidden rows [L, d_model]}`` in ``dtype``. Computed once per dtype; float64
    is the truth of the tolerance rule, float32 the trusted computation beside it."""
    return _engine_run(dtype)[0]


def keep_engine_run(outputs: Sequence, stats: Sequence) -> int:
    """Keep the lesson's own float32 varlen run of the stream (``Engine`` with its defaults on the CPU,
    ``init_weights(ModelConfig(), 0)``, ``return_hidden=True``) as ``stream_reference(torch.float32)``:
    exercise 06.1 then compares your attention with it, and times yours against it, without serving
    the stream a second time. Returns the number of requests kept; raises ValueError when ``outputs``
    are not the stream's served requests in float32 with their hidden rows."""
    lens, _ = stream_prompts()
    budget = ENGINE_STREAM["max_num_batched_tokens"]
    hidden = {o.request_id: o.hidden for o in outputs}
    want = [i for i, n in enumerate(lens) if n <= budget]
    if sorted(hidden) != want or any(h is None or h.dtype != torch.float32 or h.shape[0] != lens[i]
                                     for i, h in hidden.items()):
        raise ValueError("keep_engine_run wants the float32 outputs, with hidden rows, of every request of lesson 06's "
                         f"stream that fits the budget ({len(want)} requests)")
    _ENGINE_RUNS[torch.float32] = (hidden, list(stats))
    return len(hidden)


def stack(outputs: Mapping) -> Tensor:
    """``{request_id: [L, d]}`` → ``[Σ L, d]`` in request-id order (the stream's flat rows)."""
    return torch.cat([outputs[i] for i in sorted(outputs)])


# ---- counts per method, one convention --------------------------------------------------------------

def whole_block_flops(cfg: ModelConfig, s) -> int:
    """FLOPs a batch executes, counted like its cells: whole blocks (``flops.forward_flops(causal=False)``),
    i.e. the ``BatchStats``' own ``flops_whole_executed`` (``cfg`` kept for the callers)."""
    return s.flops_whole_executed


def _totals(cfg: ModelConfig, stats: Sequence) -> dict:
    """``method_totals``'s counts for one method, summed over its ``BatchStats`` (whole blocks)."""
    return {"rows": sum(s.executed_rows for s in stats), "pad_rows": sum(s.padding_rows for s in stats),
            "cells_computed": sum(s.cells_whole_computed for s in stats),
            "cells_useful": sum(s.cells_whole_useful for s in stats),
            "flops_executed": sum(whole_block_flops(cfg, s) for s in stats),
            "flops_useful": sum(s.flops_whole_useful for s in stats)}


def method_totals(cfg: ModelConfig, batches: Sequence[Sequence[int]]) -> dict:
    """``{method: {"rows", "pad_rows", "cells_computed", "cells_useful", "flops_executed", "flops_useful"}}``
    over ``batches`` (lists of request lengths), analytic. One convention for every number: whole
    blocks, cells per head per layer and FLOPs of the whole forward (``forward_flops(causal=False)``:
    ``BatchStats``' ``cells_whole_*`` and ``flops_whole_*``; its ``flops_causal_*`` count the other way)."""
    return {m: _totals(cfg, [batch_stats(cfg, b, m) for b in batches]) for m in METHODS}


def totals_text(totals: Mapping[str, Mapping]) -> str:
    """One line per method of ``method_totals``: rows (pad rows), cells and FLOPs, each with what it counts."""
    lines = []
    for m, t in totals.items():
        fl = t["flops_executed"] / t["flops_useful"] if t["flops_useful"] else 0.0
        lines.append(f"{m:7s} rows {t['rows']:>9,} (pad {t['pad_rows']:>7,}) | score cells, whole blocks "
                     f"{t['cells_computed']:>13,} ({t['cells_computed'] / t['cells_useful']:.2f}x the useful) | "
                     f"FLOPs, whole blocks: {fl:.2f}x the useful")
    return "\n".join(lines)


# ---- figure: how FCFS packs the stream -------------------------------------------------------------

def fcfs_batches(seq_lens: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int = 256) -> Figure:
    """Lesson 06 (S3): the FCFS batches of a stream, one row per batch, requests as orange boxes.

    Each batch is a row of its requests in arrival order (labelled with their index when wide
    enough), the room left up to the budget is white, the budget is a dashed line; a request
    longer than the budget has a grey row of its own at the bottom: it is refused, never split.
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
        ax.add_patch(Rectangle((x, b - bar / 2), budget - x, bar, facecolor=NEVER, edgecolor=OTHER, linewidth=0.5,
                               linestyle=":"))
    for r, i in enumerate(refused):
        y = len(batches) + r
        ax.add_patch(Rectangle((0, y - bar / 2), xmax, bar, facecolor=OTHER, edgecolor="white", gid=f"refused-{i}"))
        ax.text(budget * 0.02, y, f"request {i}: {lens[i]:,} tokens > {budget:,}: refused at submit, never split",
                ha="left", va="center", fontsize=MIN_FONT, color="white", fontweight="bold")
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
                        Patch(facecolor=NEVER, edgecolor=OTHER, linestyle=":", label="room left under the budget"),
                        Patch(facecolor=OTHER, label="refused")],
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
    bottom.set_ylim(0, tallest * 1.3)
    bottom.set_ylabel("score cells\nper head per layer", fontsize=MIN_FONT)
    bottom.yaxis.set_major_formatter(EngFormatter(sep=""))
    bottom.legend(handles=[Patch(facecolor=ATTENTION, label="useful"),
                           Patch(facecolor=WASTE, hatch="///", edgecolor="white", label="pad cells (P)"),
                           Patch(facecolor=WASTE, hatch="...", edgecolor="white", label="masked cells (M)")],
                  fontsize=MIN_FONT, frameon=False, loc="upper right", ncol=3)
    cells = {m: sum(s.cells_whole_computed for s in runs[m]) for m in methods}
    bottom.set_title("score cells computed, whole blocks (P padded, M masked, V varlen): "
                     + ", ".join(f"{m[0].upper()} {cells[m]:,}" for m in methods), fontsize=10)
    bottom.set_xticks(range(n))
    every = max(1, math.ceil(n / 12))
    bottom.set_xticklabels([(f"batch {b}\nR={s.num_seqs}" if n <= 12 else str(b)) if b % every == 0 else ""
                            for b, s in enumerate(base)], fontsize=MIN_FONT)
    for ax in (top, bottom):
        ax.tick_params(axis="y", labelsize=MIN_FONT)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.1, top=0.94, hspace=0.3)
    return fig


# ---- the explorer ----------------------------------------------------------------------------------

def prefill_plan_state(workload: str = "long-tail", num_requests: int = 48, max_num_batched_tokens: int = 1024,
                       seed: int = 0) -> dict:
    """A seeded stream of ``workload`` requests (``WORKLOAD_PRESETS``), scheduled FCFS, costed per method.

    Keys: ``workload``, ``seq_lens``, ``batches`` (lists of request ids), ``rejected`` (ids),
    ``max_num_batched_tokens``, ``stats`` ({method: [engine.BatchStats]}, analytic:
    ``engine.batch_stats``) and ``totals`` (``method_totals``: rows, pad rows, cells and FLOPs, all
    counted by whole blocks).
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
             for m in METHODS}
    totals = {m: _totals(cfg, stats[m]) for m in METHODS}
    return {"workload": workload, "seq_lens": lens, "batches": batches, "rejected": rejected, "stats": stats,
            "totals": totals, "max_num_batched_tokens": budget}


def prefill_plan_html(state: dict) -> str:
    """The explorer's readout: one ``<div>`` for the schedule, one per method, one for the refused."""
    lens, budget = state["seq_lens"], state["max_num_batched_tokens"]
    served = sum(len(b) for b in state["batches"])
    nb = len(state["batches"])
    lines = [f"<div>{state['workload']}, {len(lens)} requests, max_num_batched_tokens = {budget}: "
             f"{nb} batch{'es' if nb != 1 else ''}, {served} request{'s' if served != 1 else ''} served</div>"]
    for m, t in state["totals"].items():
        ratio = t["flops_executed"] / t["flops_useful"] if t["flops_useful"] else 0.0
        lines.append(f"<div>{m}: rows {t['rows']:,} (pad {t['pad_rows']:,}) | attention cells {t['cells_computed']:,} "
                     f"(wasted {t['cells_computed'] - t['cells_useful']:,}) | FLOPs executed / useful {ratio:.2f}x "
                     "(whole blocks)</div>")
    rej = state["rejected"]
    lines.append(f"<div>refused (longer than the budget, S3): {len(rej)}"
                 + (f" - lengths {[lens[i] for i in rej][:8]}" if rej else "") + "</div>")
    return "".join(lines)


def workload_controls(prefix: str, workload: str, num_requests: int, max_requests: int, budget: int, max_budget: int,
                      budget_label: str = "token budget") -> tuple:
    """The controls of a stream explorer: Dropdown ``{prefix}-workload``, IntSliders ``{prefix}-num-requests``
    (1..max_requests) and ``{prefix}-budget`` (16..max_budget, steps of 16), HTML ``{prefix}-counts``, Output
    ``{prefix}-figure``. Used by lesson 06's and lesson 08's explorers."""
    w = ipywidgets_module()
    kind = tagged(w.Dropdown(options=list(WORKLOAD_PRESETS), value=workload, description="workload"), f"{prefix}-workload")
    reqs = tagged(w.IntSlider(value=num_requests, min=1, max=max_requests, description="requests"),
                  f"{prefix}-num-requests")
    slider = tagged(w.IntSlider(value=budget, min=16, max=max_budget, step=16, description=budget_label), f"{prefix}-budget")
    return kind, reqs, slider, tagged(w.HTML(), f"{prefix}-counts"), tagged(w.Output(), f"{prefix}-figure")


def prefill_plan_explorer(workload: str = "long-tail", num_requests: int = 48, max_num_batched_tokens: int = 1024):
    """VBox class ``ppx``: Dropdown ``ppx-workload``, IntSliders ``ppx-num-requests`` (1..256) and
    ``ppx-budget`` (max_num_batched_tokens, 16..8192), HTML ``ppx-counts`` (``prefill_plan_html``),
    Output ``ppx-figure`` (``batch_waste``; empty when every request was refused)."""
    kind, reqs, budget, text, out = workload_controls("ppx", workload, num_requests, 256, max_num_batched_tokens, 8192)

    def update(change=None):
        state = prefill_plan_state(kind.value, reqs.value, budget.value)
        text.value = prefill_plan_html(state)
        if state["batches"]:
            show_figure(out, batch_waste(state["stats"], budget.value))
        else:
            out.outputs = ()

    return explorer("ppx", [kind, reqs, budget], [text, out], update)


# ---- schedules: validity (S3) and the three measures ------------------------------------------------

def schedule_problem(batches, seq_lens: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int) -> str | None:
    """What makes ``batches`` (lists of request indices) an invalid prefill schedule, or None.

    Valid (S3): every request exactly once, so whole in one batch; no empty batch; every batch
    within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests.
    """
    n = len(seq_lens)
    if not isinstance(batches, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in batches):
        return f"expected a list of batches, each a list of request indices, got {batches!r}"[:300]
    flat = [i for b in batches for i in b]
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in flat):
        return "a batch holds request indices (ints), not tokens or requests"
    if sorted(flat) != list(range(n)):
        if sorted(flat) == sorted(seq_lens):
            return "your batches hold the requests' LENGTHS; return their indices (0 .. n-1) instead"
        missing = sorted(set(range(n)) - set(flat))
        twice = sorted({i for i in flat if flat.count(i) > 1})
        return ("every request must be served exactly once, whole, in one batch (S3): "
                + (f"missing {missing[:8]} " if missing else "") + (f"served twice {twice[:8]} " if twice else "")
                + (f"unknown {sorted(set(flat) - set(range(n)))[:8]}" if set(flat) - set(range(n)) else "")).strip()
    for b, ids in enumerate(batches):
        if not ids:
            return f"batch {b} is empty: every forward must carry at least one request"
        tokens = sum(seq_lens[i] for i in ids)
        if tokens > max_num_batched_tokens:
            return (f"batch {b} holds {tokens} tokens > max_num_batched_tokens={max_num_batched_tokens}: "
                    "close a batch before the next request would overflow it")
        if len(ids) > max_num_seqs:
            return f"batch {b} holds {len(ids)} requests > max_num_seqs={max_num_seqs}: the budget counts requests too"
    return None


def schedule_measures(seq_lens: Sequence[int], batches: Sequence[Sequence[int]], max_num_batched_tokens: int,
                      max_num_seqs: int = 256, cfg: ModelConfig | None = None) -> dict:
    """The three measures of a valid schedule, against FCFS (``plan_batches``) on the same stream.

    ``pad_rows``: rows a padded engine adds (``batch_stats(..., "padded").padding_rows``);
    ``masked_wasted``: cross-request score cells a masked engine computes and throws away, per
    head per layer (``flops.attention_cells(..., "masked").wasted``); fairness: ``max_delay`` = the
    most batches a request is served after its FCFS batch (0 = nobody later than FCFS),
    ``overtakes`` = pairs where a later arrival is served in an earlier batch. Also
    ``batches`` (forwards) and ``flops_ratio`` (executed / useful FLOPs of the padded engine, whole blocks).
    """
    cfg = cfg or ModelConfig()
    fcfs = plan_batches(seq_lens, max_num_batched_tokens, max_num_seqs)
    at = {i: b for b, ids in enumerate(batches) for i in ids}
    at_fcfs = {i: b for b, ids in enumerate(fcfs) for i in ids}
    padded = [batch_stats(cfg, [seq_lens[i] for i in ids], "padded") for ids in batches]
    return {"batches": len(batches), "pad_rows": sum(s.padding_rows for s in padded),
            "masked_wasted": sum(attention_cells([seq_lens[i] for i in ids], "masked").wasted for ids in batches),
            "max_delay": max([0] + [at[i] - at_fcfs[i] for i in at]),
            "overtakes": sum(at[j] < at[i] for i in range(len(seq_lens)) for j in range(i + 1, len(seq_lens))),
            "flops_ratio": sum(whole_block_flops(cfg, s) for s in padded)
            / sum(forward_flops(cfg, [seq_lens[i] for i in ids], "padded", useful_only=True).total for ids in batches)}


def schedule_table(seq_lens: Sequence[int], batches: Sequence[Sequence[int]], max_num_batched_tokens: int,
                   max_num_seqs: int = 256, name: str = "yours") -> str:
    """FCFS and ``batches`` side by side on the same stream: the lines ``schedule_measures`` counts."""
    fcfs = plan_batches(seq_lens, max_num_batched_tokens, max_num_seqs)
    rows = {"FCFS": schedule_measures(seq_lens, fcfs, max_num_batched_tokens, max_num_seqs),
            name: schedule_measures(seq_lens, batches, max_num_batched_tokens, max_num_seqs)}
    head = f"{'':8s} {'batches':>7s} {'pad rows':>9s} {'masked cells wasted':>20s} {'max delay':>9s} {'overtakes':>9s}"
    return "\n".join([head] + [f"{k:8s} {m['batches']:7d} {m['pad_rows']:9,d} {m['masked_wasted']:20,d} "
                               f"{m['max_delay']:9d} {m['overtakes']:9d}" for k, m in rows.items()])


# ---- exercise 06.1: your attention inside the engine -----------------------------------------------

STREAM_CASE = "lesson 06's stream, served by Engine(attn_backend=your function)"
_ATTN_CASES = [("one request", [10], 2, 16), ("A and B", [10, 30], 2, 16),
               ("five requests, two of the same length", [7, 1, 12, 7, 3], 4, 64), (STREAM_CASE,)]


def _qkv(lens: list[int], heads: int, d_head: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random q, k, v ``[T, H, D]`` as the engine hands them over (views of one ``[T, 3, H, D]``
    tensor: not contiguous) and int32 ``cu_seqlens``."""
    return random_qkv(lens, heads, d_head, seed=seed + 7 * len(lens), fused=True)


def as_backend(fn: Callable, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
    """``fn`` called exactly as the engine calls an attention backend (``flash_attn_varlen_func``'s
    contract) for causal self-attention: keys are the queries' own rows, scale ``1 / sqrt(D)``."""
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, softmax_scale=1.0 / math.sqrt(q.shape[-1]))


def _attn64(q, k, v, cu, causal=True, scale=None, whole=False):
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32) if whole else cu
    return varlen_attention(q.double(), k.double(), v.double(), cu, causal=causal, softmax_scale=scale, backend="loop")


def _near(got: Tensor, want: Tensor) -> bool:
    return tuple(got.shape) == tuple(want.shape) and max_abs_diff(got, want) <= 1e-4


def _attention_problem(got, lens: list[int], heads: int, d_head: int) -> str | None:
    q, k, v, cu = _qkv(lens, heads, d_head)
    want64 = _attn64(q, k, v, cu)
    want = varlen_attention(q, k, v, cu, causal=True, backend="loop")
    t = q.shape[0]
    if not isinstance(got, Tensor):
        return f"expected a tensor [T, H, D] = {[t, heads, d_head]}, got {type(got).__name__}"
    if tuple(got.shape) != tuple(q.shape):
        hint = (" - FlashAttention's layout is [T, H, D]: transpose your [H, T, D] back"
                if tuple(got.shape) == (heads, t, d_head) else "")
        return f"shape {list(got.shape)}, expected q's shape {list(q.shape)}{hint}"
    if got.dtype != q.dtype:
        return f"dtype {got.dtype}, expected q's dtype {q.dtype}: the engine keeps one dtype end to end"
    if not torch.isfinite(got).all():
        rows = torch.nonzero(~torch.isfinite(got).reshape(t, -1).all(1)).flatten().tolist()
        return (f"NaN or inf in rows {rows[:6]}: a row whose scores are all -inf has no key to read - "
                "mask only the keys AFTER each query (triu(diagonal=1)), never its own")
    err, bound = max_abs_diff(got, want64), tolerance(want, want64, got.dtype)
    if err <= bound:
        return None
    alternatives = [
        (_attn64(q, k, v, cu, causal=False), "not causal: query j of a request may read only keys 0..j of ITS request - "
         "mask the upper triangle of each [L_i x L_i] block"),
        (_attn64(q, k, v, cu, whole=True), "cu_seqlens ignored: request A's queries read B's keys (C7) - slice q, k, v "
         "to rows cu_seqlens[i]:cu_seqlens[i+1] and attend within the slice"),
        (_attn64(q, k, v, cu, causal=False, whole=True), "neither causal nor per request: slice by cu_seqlens, then mask "
         "the upper triangle of each request's block"),
        (_attn64(q, k, v, cu, scale=1.0), "scores not scaled: multiply Q K^T by 1/sqrt(d_head)"),
        (_attn64(q, k, v, cu, scale=1.0 / d_head), "scale is 1/sqrt(d_head), not 1/d_head"),
        (_attn64(q, k, v, cu, scale=1.0 / math.sqrt(heads * d_head)),
         "scale by 1/sqrt(d_head) with d_head = q.shape[-1], one head's width, not all heads' H*D"),
    ]
    for alt, hint in alternatives:
        if _near(got, alt):
            return f"values differ from the reference by up to {err:.2g} - {hint}"
    cu_list = cumulative(lens)
    spans = list(zip(cu_list[:-1], cu_list[1:]))
    wrong = [i for i, (s, e) in enumerate(spans) if max_abs_diff(got[s:e], want64[s:e]) > bound]
    for i in wrong:
        s, e = spans[i]
        for j, (s2, e2) in enumerate(spans):
            if j != i and e2 - s2 == e - s and _near(got[s:e], want64[s2:e2]):
                return (f"request {i}'s rows {s}..{e - 1} hold request {j}'s output - each output goes back into its "
                        "own rows, out[cu_seqlens[i]:cu_seqlens[i+1]]")
    for j, (s, e) in reversed(list(enumerate(spans))):
        if s > 0 and _near(got[:e - s], want64[s:e]):
            return (f"request {j}'s output sits at rows 0..{e - s - 1}, not at its own rows {s}..{e - 1} - write request "
                    "i's output into out[cu_seqlens[i]:cu_seqlens[i+1]]")
    for i in wrong:
        s, e = spans[i]
        where = f"request {i} (rows {s}..{e - 1}) is wrong"
        if not got[s:e].abs().any():
            return f"{where}: its rows are all zero, never written - write its output into out[cu[i]:cu[i+1]]"
        return f"{where}: off by up to {max_abs_diff(got[s:e], want64[s:e]):.2g} (allowed {bound:.1g})"
    return f"values differ from the reference by up to {err:.2g} (allowed {bound:.1g})"


def _stream_problem(got: dict) -> str | None:
    ref, ref64 = stream_reference(torch.float32), stream_reference(torch.float64)
    out, want, want64 = stack(got), stack(ref), stack(ref64)
    err, bound = max_abs_diff(out, want64), tolerance(want, want64, out.dtype)
    if err <= bound:
        return None
    for i in sorted(ref):
        e = max_abs_diff(got[i], ref64[i])
        if e > tolerance(ref[i], ref64[i], got[i].dtype):
            return (f"request {i} ({ref[i].shape[0]} tokens): final hidden rows off by up to {e:.2g}, allowed "
                    f"{bound:.1g} - your function passes the small cases but not inside the engine; there q, k, v are "
                    "views of one tensor (use reshape, not view) and a batch holds up to 10 requests")
    return f"final hidden rows off by up to {err:.2g} (allowed {bound:.1g})"


def check_attention_backend(fn: Callable) -> bool:
    """Exercise 06.1: ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
    softmax_scale=None) -> [T, H, D]`` (``flash_attn_varlen_func``'s contract, what ``Engine(attn_backend=fn)``
    calls), here causal self-attention of each request over its own rows.

    Three small cases against the library's varlen attention (float64 truth, the tolerance rule),
    then the capstone: lesson 06's stream served by the engine with ``fn`` in every layer, every
    request's final hidden rows compared with the engine's own varlen backend. Recognised
    mistakes: not causal, ``cu_seqlens`` ignored, a wrong scale, rows written in the wrong place,
    the ``[H, T, D]`` layout, NaN rows.
    """
    if not callable(fn):
        raise WrongAnswer(f"attention_backend: expected a function, got {type(fn).__name__}")
    served = []

    def run(what, lens=None, heads=None, d_head=None):
        if what == STREAM_CASE:
            hidden, stats = _serve_stream(fn)
            served.append(stats)
            return hidden
        q, k, v, cu = _qkv(lens, heads, d_head)
        return as_backend(fn, q, k, v, cu, max(lens))

    def judge(got, what, lens=None, heads=None, d_head=None):
        return _stream_problem(got) if what == STREAM_CASE else _attention_problem(got, lens, heads, d_head)

    ok = grade("attention_backend", run, _ATTN_CASES, judge,
               "matches varlen on 3 small cases, and serves lesson 06's stream inside Engine with every request's "
               "hidden rows within the tolerance rule of the engine's own backend")
    if ok and served:
        print(stream_table(served[-1], _engine_run(torch.float32)[1]))
    return ok


def stream_table(yours: Sequence, engine: Sequence) -> str:
    """Lesson 06's stream served twice, batch by batch: your attention's forward time against the
    engine's own varlen backend (``BatchStats.wall_s``, one run each; shown, never asserted)."""
    if [s.request_ids for s in yours] != [s.request_ids for s in engine]:
        raise ValueError("the two runs did not serve the same batches")
    lines = ["your attention served lesson 06's stream (CPU, float32; one run each, timings vary):",
             f"{'batch':>5s} {'R':>3s} {'T':>5s} {'max_seqlen':>10s} {'yours ms':>9s} {'engine ms':>9s}"]
    for a, b in zip(yours, engine):
        lines.append(f"{a.index:5d} {a.num_seqs:3d} {a.num_tokens:5d} {a.max_seqlen:10d} {a.wall_s * 1e3:9.1f} "
                     f"{b.wall_s * 1e3:9.1f}")
    ta, tb = sum(s.wall_s for s in yours), sum(s.wall_s for s in engine)
    lines.append(f"total: yours {ta:.2f} s, the engine's own backend {tb:.2f} s"
                 + (f" ({ta / tb:.2f}x)" if tb else ""))
    return "\n".join(lines)


def time_backend(fn: Callable, repeats: int = 1) -> str:
    """Wall-clock of lesson 06's stream served with ``fn`` and with the engine's own varlen backend
    (CPU, float32; shown, never asserted). A stub gives "not attempted yet"."""
    if call_reader("time_backend", lambda: _probe(fn)) is NOT_YET:
        return "time_backend: not attempted yet - write your attention function first"
    times = {name: time_call(lambda backend=backend: _serve_stream(backend), repeats=repeats, warmup=0)
             for name, backend in (("yours", fn), ("engine (auto)", "auto"))}
    ratio = times["yours"] / times["engine (auto)"]
    return " | ".join(f"{k}: {v:.2f} s" for k, v in times.items()) + f" | yours / engine: {ratio:.2f}x"


def _probe(fn: Callable):
    q, k, v, cu = _qkv([3, 2], 1, 8)
    return as_backend(fn, q, k, v, cu, 3)


# ---- exercise 06.2: a length-sorting scheduler -----------------------------------------------------

def _sort_cases() -> list[tuple]:
    lens, _ = stream_prompts()
    kept = [n for n in lens if n <= ENGINE_STREAM["max_num_batched_tokens"]]
    return [(kept, ENGINE_STREAM["max_num_batched_tokens"], 256),
            (workload_lengths("long-tail", 64, 1, median=64, sigma=1.0, max_len=1024), 1024, 8),
            (workload_lengths("bimodal", 40, 2, short=50, long=1500, p_long=0.2), 2048, 256),
            (workload_lengths("uniform", 32, 4, low=16, high=512), 1024, 6),
            ([300, 20, 300, 20, 300, 20, 20, 20], 640, 4)]


def check_sorted_schedule(fn: Callable[[list, int, int], list]) -> bool:
    """Exercise 06.2: ``fn(seq_lens, max_num_batched_tokens, max_num_seqs) -> [[request index, ...], ...]``,
    a scheduler that groups requests of similar length, on 5 streams (no request over the budget).

    Each stream: the batches must be valid (``schedule_problem``: every request once, whole; both
    budgets) and pad fewer rows than FCFS on the same stream. Then the three measures of the
    reader's scheduler against FCFS on lesson 06's stream are printed (``schedule_table``).
    """
    cases = _sort_cases()

    def judge(got, lens, budget, max_seqs):
        problem = schedule_problem(got, lens, budget, max_seqs)
        if problem:
            return problem
        got = [[int(i) for i in b] for b in got]
        fcfs = plan_batches(lens, budget, max_seqs)
        mine, base = (schedule_measures(lens, b, budget, max_seqs)["pad_rows"] for b in (got, fcfs))
        if mine < base:
            return None
        if got == fcfs:
            return ("these are FCFS's batches: sort the waiting requests by length (over a window of several "
                    "batches) so that similar lengths share a batch")
        return (f"valid, but {mine:,} pad rows, FCFS pads {base:,}: similar lengths must share a batch - a window no "
                "wider than one batch cannot regroup anything; sort over a wider window")
    ok = grade("sorted_schedule", fn, cases, judge, "valid batches (S3) with fewer pad rows than FCFS on 5 streams")
    if ok:
        lens, budget, max_seqs = cases[0]
        print("lesson 06's stream:\n" + schedule_table(lens, call_reader("sorted_schedule", fn, list(lens), budget,
                                                                        max_seqs), budget, max_seqs))
    return ok


# ---- measured: the three methods on the device -----------------------------------------------------

def run_methods(cfg: ModelConfig, weights: dict, requests: Sequence[Request], max_num_batched_tokens: int,
                device=None, dtype: torch.dtype | None = None) -> dict:
    """Serve ``requests`` with each method on ``device`` (after one warm-up batch): ``{method: [BatchStats]}``
    with each batch's measured ``wall_s``."""
    out = {}
    for method in METHODS:
        engine = Engine(cfg, weights=weights, method=method, device=device, dtype=dtype, compute_logits=False,
                        max_num_batched_tokens=max_num_batched_tokens)
        engine.prefill([Request("warm-up", requests[0].prompt_token_ids)])
        synchronize(engine.device)
        engine.prefill([Request(r.request_id, r.prompt_token_ids) for r in requests])
        out[method] = engine.stats
    return out


def throughput_text(stats: Mapping[str, Sequence], cfg: ModelConfig | None = None) -> str:
    """One line per method from measured ``BatchStats``: seconds, prompt tokens per second (pad rows
    not counted), executed GFLOP/s (whole blocks, ``whole_block_flops``: what the engine's backends
    compute), and throughput relative to varlen."""
    cfg = cfg or ModelConfig()
    secs = {m: sum(s.wall_s for s in st) for m, st in stats.items()}
    tokens = {m: sum(s.num_tokens for s in st) for m, st in stats.items()}
    ref = tokens.get("varlen", 0) / secs["varlen"] if secs.get("varlen") else None
    lines = []
    for m, st in stats.items():
        tps = tokens[m] / secs[m] if secs[m] else float("nan")
        gflops = sum(whole_block_flops(cfg, s) for s in st) / secs[m] / 1e9 if secs[m] else float("nan")
        rel = f" | {tps / ref:4.2f}x varlen's throughput" if ref else ""
        lines.append(f"{m:7s} {secs[m]:7.3f} s | {tps:9,.0f} tokens/s | {gflops:7.1f} GFLOP/s executed{rel}")
    return "\n".join(lines)


# ---- registered figures ----------------------------------------------------------------------------

@register("06_fcfs_batches", lesson="06",
          caption="Lesson 06's 24 long-tailed requests under FCFS and a 512-token budget: 23 in 5 batches, the "
                  "1,776-token one refused whole (S3)")
def _fcfs_batches() -> Figure:
    lens, _ = stream_prompts()
    return fcfs_batches(lens, ENGINE_STREAM["max_num_batched_tokens"])


@register("06_batch_waste", lesson="06",
          caption="The same 5 batches run padded, masked and varlen: rows through the linear layers and attention "
                  "cells per batch, useful vs thrown away (C2, C8, C10)")
def _batch_waste() -> Figure:
    state = prefill_plan_state(**ENGINE_STREAM)
    return batch_waste(state["stats"], state["max_num_batched_tokens"])
