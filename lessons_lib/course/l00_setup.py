"""What lesson 00 (the setup, one request) draws, explores and checks.

Figures: the course map (``00_course_map``), how tensor parallelism cuts a block's four linear
layers (``00_tp_split``), the all-reduces of one request against its length and the TP size
(``00_allreduce_growth``), and the alpha-beta model of one all-reduce before any measurement
(``00_alpha_beta_model``; the model itself is ``measure.comm``).
What the all-reduces of a forward cost: the explorer ``comm_cost_explorer``, which records the engine's
forward on the learner's requests (``tp.dryrun.record_requests``) and prices it (``measure.comm.comm_cost_state``),
and times real all-reduces on request (``measure.comm.measure_point`` on ``measure.comm.AllReduceBench``).
Exercise checkers: ``check_tp_plan`` (00.1, on ``tp.plan.rank_params``: what rank 0's real shard holds) and
``check_packing_factor`` (00.2, on ``measure.comm.packing_saving``).

Taught in notebooks/00_setup_one_request.ipynb.
"""
from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.ticker import FuncFormatter, NullLocator

from ..core.config import ModelConfig
from ..measure.comm import (
    DTYPES,
    NVLINK,
    AllReduceBench,
    AlphaBeta,
    about,
    comm_cost_state,
    crossover_tokens,
    measure_point,
    packing_saving,
    ring_bytes_sent,
    ring_time_terms,
)
from ..style import ATTENTION, COMM, LINEAR, MIN_FONT, NEVER, REQUEST, TEXT
from ..tp.dryrun import RECORD_MAX_TOKENS, record_requests
from ..tp.plan import held_by_name, rank_params, tp_sizes
from ..validate import check_int, dtype_name
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import register
from .grading import grade

# ---------------------------------------------------------------------------------------------
# The course map

# (lesson, title, what it shows, claim ids, minutes to work through)
LESSONS = (
    ("00", "One request", "the model and its TP split; 16 all-reduces per forward, whatever N, and their cost",
     "S1, C1", 50),
    ("01", "Padding vs one flat batch", "pad rows and wasted score cells; the flat batch and cu_seqlens", "S2, C2, C3", 40),
    ("02", "Linear layers are per token", "do LayerNorm, GeLU and the four matmuls ever see a request boundary?",
     "C4, C5, C6", 50),
    ("03", "Masked vs varlen attention", "which score cells masked and varlen compute, which they waste",
     "C7-C10", 60),
    ("04", "TP never sees the requests", "does the TP trace change with the packing? does TP=2 compute what TP=1 does?",
     "C11, C12", 60),
    ("05", "Where the FLOPs go", "linear vs attention work, arithmetic intensity, a decode preview", "C13, C14, C15", 55),
    ("06", "A prefill engine", "a scheduler under a token budget: padded vs masked vs varlen", "S3 (+ C2, C8, C10, C12)", 60),
    ("07", "Inside the kernel", "one Triton launch for all requests: the grid, causal tiles, online softmax",
     "K1-K5", 70),
    ("08", "Chunked prefill", "a prompt longer than the budget, in chunks over a KV cache: the staircase of cells",
     "P1-P5", 50),
)
# What each lesson is mostly about, in the palette's meanings (a stripe on its box).
_TOPIC = {"00": (COMM,), "01": (REQUEST[0],), "02": (LINEAR,), "03": (ATTENTION,), "04": (COMM,),
          "05": (LINEAR, ATTENTION), "06": (REQUEST[0], LINEAR, ATTENTION, COMM), "07": (ATTENTION,),
          "08": (REQUEST[0], ATTENTION)}


@register("00_course_map", lesson="00", caption="the lessons, what each shows and the claims it proves")
def course_map() -> Figure:
    """One box per lesson of ``LESSONS``, in reading order: title, what it shows, the claim ids it proves, and a
    stripe on top in the palette's colours of what the lesson is about (``_TOPIC``)."""
    w, h, gap, row_gap, per_row = 1.66, 2.45, 0.12, 0.3, 5  # two rows, so that the text stays readable
    wrap = functools.partial(textwrap.fill, break_long_words=False, break_on_hyphens=False)
    rows = -(-len(LESSONS) // per_row)
    width = 0.24 + per_row * (w + gap) - gap
    height = 0.2 + rows * (h + row_gap) - row_gap + 0.65
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, width), ylim=(0, height))
    ax.axis("off")
    for i, (num, title, shows, claims, minutes) in enumerate(LESSONS):
        row, col = divmod(i, per_row)
        x = 0.12 + col * (w + gap)
        y = 0.2 + (rows - 1 - row) * (h + row_gap)
        ax.add_patch(Rectangle((x, y), w, h, facecolor=NEVER, edgecolor=TEXT, linewidth=1))
        colours = _TOPIC[num]
        for j, c in enumerate(colours):
            ax.add_patch(Rectangle((x + j * w / len(colours), y + h - 0.16), w / len(colours), 0.16, facecolor=c,
                                   edgecolor="none"))
        ax.text(x + 0.08, y + h - 0.3, f"{num}", ha="left", va="top", fontsize=12, fontweight="bold", color=TEXT)
        ax.text(x + w - 0.08, y + h - 0.32, f"~{minutes} min", ha="right", va="top", fontsize=MIN_FONT, color=TEXT)
        ax.text(x + 0.08, y + h - 0.68, wrap(title, 16), ha="left", va="top", fontsize=MIN_FONT + 1,
                fontweight="bold", color=TEXT)
        ax.text(x + 0.08, y + h - 1.2, wrap(shows, 19), ha="left", va="top", fontsize=MIN_FONT, color=TEXT)
        ax.text(x + 0.08, y + 0.1, claims, ha="left", va="bottom", fontsize=MIN_FONT, color=TEXT, style="italic")
        if col:
            ax.add_patch(FancyArrowPatch((x - gap + 0.01, y + h / 2), (x - 0.01, y + h / 2), arrowstyle="-|>",
                                         mutation_scale=9, color=TEXT))
        elif row:  # from the end of the row above down to the start of this one: down, across the gap, down
            mid, last = y + h + row_gap / 2, width - 0.12 - w / 2
            ax.plot([last, last, x + w / 2], [y + h + row_gap - 0.01, mid, mid], color=TEXT, linewidth=0.8,
                    solid_capstyle="butt")
            ax.add_patch(FancyArrowPatch((x + w / 2, mid), (x + w / 2, y + h + 0.01), arrowstyle="-|>",
                                         mutation_scale=9, color=TEXT, linewidth=0.8))
    ax.text(0.12, height - 0.33, f"The course: {len(LESSONS)} lessons, each proving the claims in italics\n"
            "(prefill only; whole requests and no KV cache until lesson 08)", fontsize=MIN_FONT + 2, color=TEXT,
            va="center")
    return fig


# ---------------------------------------------------------------------------------------------
# How tensor parallelism cuts a block

def _box(ax, x, y, w, h, colour, text="", hatched=False, gid=None):
    """A labelled rectangle; a hatched one (rank 1) gets white stripes and a white label background."""
    edge = TEXT if colour == NEVER else "white"  # activations: white, outlined (and hatched) in ink
    ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor=edge, hatch="///" if hatched else None,
                           linewidth=0.8, gid=gid))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=MIN_FONT, color=TEXT,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5, "alpha": 0.9} if hatched else None)


def _arrow(ax, a, b, colour=TEXT):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color=colour, linewidth=1.2))


@register("00_tp_split", lesson="00",
          caption="TP=2: QKV and FFN-up cut by output features (bias split), out proj and FFN-down by input "
                  "features (partial sums, one all-reduce, bias whole and added once) (S1)")
def tp_split(cfg: ModelConfig | None = None) -> Figure:
    """How TP=2 cuts a block's linear layers (claim S1), with ``cfg``'s sizes: left, column-parallel (QKV, FFN-up)
    by output features, the bias split with them; right, row-parallel (out proj, FFN-down) by input features,
    partial sums, one all-reduce, the bias whole and added once. Rank 0 plain, rank 1 hatched. Patch gids:
    ``col-w-r``, ``col-b-r``, ``row-w-r``, ``all-reduce``, ``row-b``."""
    cfg = cfg or ModelConfig()
    d, k, f, tp = cfg.d_model, cfg.qkv_dim, cfg.d_ffn, 2  # the figure draws two ranks
    fig = Figure(figsize=(13, 5.6))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, 23), ylim=(0, 10))
    ax.axis("off")
    ax.text(0.2, 9.65, f"Tensor parallelism, TP={tp}: how one block's four linear layers are cut", fontsize=MIN_FONT + 4,
            fontweight="bold", color=TEXT, va="center")
    ax.text(0.2, 9.15, "rank 0 plain, rank 1 hatched; green: linear work, purple: communication, white: activations (data)",
            fontsize=MIN_FONT + 1, color=TEXT, va="center")
    # --- column-parallel: y_r = x W_r^T + b_r -------------------------------------------------------
    ax.text(0.2, 8.4, "column-parallel: QKV, FFN-up", fontsize=MIN_FONT + 3, fontweight="bold", color=TEXT)
    ax.text(0.2, 7.9, "cut by OUTPUT features; each rank reads the whole x", fontsize=MIN_FONT + 1, color=TEXT)
    _box(ax, 0.2, 3.9, 1.7, 3.0, NEVER, f"x\n[T x {d}]\nwhole on\nboth ranks")
    _arrow(ax, (2.0, 5.4), (2.6, 5.4))
    ax.text(4.3, 7.35, "fused QKV weight W^T [in x out]", ha="center", fontsize=MIN_FONT, color=TEXT)
    hr = cfg.heads_per_rank(tp)
    sw = 3.2 / (3 * tp)  # Q | K | V, each cut by heads: one stripe per (part, rank)
    for j, part in enumerate("QKV"):
        for r in range(tp):
            x = 2.7 + (j * tp + r) * sw
            heads = f"h{r * hr}-{(r + 1) * hr - 1}"
            _box(ax, x, 3.9, sw, 3.3, LINEAR, hatched=bool(r), gid=f"col-w-{r}" if j == 0 else None)
            ax.text(x + sw / 2, 5.55, f"{part}, heads {heads[1:]}", rotation=90, ha="center", va="center",
                    fontsize=MIN_FONT, color=TEXT, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5, "alpha": 0.9})
            _box(ax, x, 3.2, sw, 0.5, LINEAR, "b", hatched=bool(r), gid=f"col-b-{r}" if j == 0 else None)
    ax.text(4.3, 2.95, f"rank 0: Q, K and V of heads 0-{hr - 1}; the bias is split with its outputs\n"
            f"(FFN-up: simply the first {f // tp} of the {f} hidden units to rank 0)", ha="center", va="top",
            fontsize=MIN_FONT, color=TEXT)
    for r, y0 in ((0, 5.6), (1, 3.9)):
        _arrow(ax, (6.0, y0 + 0.7), (6.8, y0 + 0.7))
        _box(ax, 6.9, y0, 2.5, 1.4, NEVER, f"y{r} = x W{r}^T + b{r}\n[T x out/2]", hatched=bool(r))
        ax.text(9.5, y0 + 0.7, f"rank {r}", va="center", fontsize=MIN_FONT, color=TEXT)
    ax.text(0.2, 1.3, f"QKV: [T x {d}] -> [T x {3 * k // tp}] on each rank: Q, K, V of its {cfg.heads_per_rank(tp)} heads\n"
            f"FFN-up: [T x {d}] -> [T x {f // tp}] on each rank: half the FFN\n"
            "no communication: the next layer reads the shard", va="center", fontsize=MIN_FONT + 1, color=TEXT)
    # --- row-parallel: y = sum_r x_r W_r^T, then + b once --------------------------------------------
    x0 = 10.6
    ax.text(x0, 8.4, "row-parallel: out proj, FFN-down", fontsize=MIN_FONT + 3, fontweight="bold", color=TEXT)
    ax.text(x0, 7.9, "cut by INPUT features; each rank makes a full-width partial sum", fontsize=MIN_FONT + 1,
            color=TEXT)
    for r, y0 in ((0, 5.6), (1, 3.6)):
        _box(ax, x0, y0, 1.6, 1.4, NEVER, f"x{r}\n[T x in/2]", hatched=bool(r))
        _arrow(ax, (x0 + 1.65, y0 + 0.7), (x0 + 2.05, y0 + 0.7))
        _box(ax, x0 + 2.1, y0, 1.7, 1.4, LINEAR, f"W{r}^T\n[in/2 x {d}]", hatched=bool(r), gid=f"row-w-{r}")
        _arrow(ax, (x0 + 3.85, y0 + 0.7), (x0 + 4.25, y0 + 0.7))
        _box(ax, x0 + 4.3, y0, 1.8, 1.4, NEVER, f"partial p{r}\n[T x {d}]", hatched=bool(r))
        _arrow(ax, (x0 + 6.15, y0 + 0.7), (x0 + 6.65, 5.3 if r == 0 else 4.9), COMM)
        ax.text(x0 - 0.05, y0 - 0.05, f"rank {r}", ha="left", va="top", fontsize=MIN_FONT, color=TEXT)
    _box(ax, x0 + 6.7, 4.1, 2.0, 2.0, COMM, "all-reduce\np0 + p1\nsame sum on\nboth ranks", gid="all-reduce")
    _arrow(ax, (x0 + 8.75, 5.1), (x0 + 9.15, 5.1), COMM)
    _box(ax, x0 + 9.2, 5.6, 2.0, 1.4, NEVER, f"sum [T x {d}]")
    _arrow(ax, (x0 + 10.2, 5.55), (x0 + 10.2, 5.15))
    _box(ax, x0 + 9.2, 3.6, 2.0, 1.5, LINEAR, f"+ bias [{d}]\nwhole on each\nrank, added\nONCE", gid="row-b")
    ax.text(x0 + 3.3, 3.05, "the bias is added once, after the sum (added on every\n"
            f"rank before the all-reduce, it would be counted {tp} times);\n"
            "its output y is the same on every rank", ha="left", va="top",
            fontsize=MIN_FONT, color=TEXT)
    ax.text(x0, 1.3, f"out proj: [T x {k // tp}] -> partial [T x {d}];  FFN-down: [T x {f // tp}] -> partial [T x {d}]\n"
            f"2 row-parallel layers per block x {cfg.n_layers} blocks = {2 * cfg.n_layers} all-reduces of [T x {d}] "
            "per forward\n(embeddings, LayerNorms and the tied LM head are whole on every rank here: no collective)",
            va="center", fontsize=MIN_FONT + 1, color=TEXT)
    return fig


# ---------------------------------------------------------------------------------------------
# The all-reduces of one request (C1)

@register("00_allreduce_growth", lesson="00",
          caption="one request of N tokens: 16 all-reduces per forward for every N at TP >= 2 (0 at TP=1); the "
                  "payload grows with N, the ring traffic also with TP (C1)")
def allreduce_growth(cfg: ModelConfig | None = None, tokens: Sequence[int] | None = None) -> Figure:
    """Claim C1: what the ``cfg.all_reduces_per_forward`` all-reduces of one forward move, against the tokens N.

    Left, per all-reduce: the payload on each rank, ``N·d_model·itemsize``, the same at every TP ≥ 2. Right, per forward:
    what all ranks together send in a ring, ``count · p · ring_bytes_sent(payload, p)``, for TP = 2, 4, 8
    (gids ``ring-p``; TP=2, the lesson's, drawn thicker).
    """
    cfg = cfg or ModelConfig()
    tokens = list(tokens) if tokens is not None else sorted({int(v) for v in np.logspace(0, np.log10(16384), 60)})
    item, dtype, count = cfg.dtype.itemsize, dtype_name(cfg.dtype), cfg.all_reduces_per_forward
    payload = [n * cfg.d_model * item for n in tokens]
    fig = Figure(figsize=(9.6, 4.1))
    left, right = fig.subplots(1, 2)
    left.plot(tokens, payload, color=COMM, linewidth=2.5, label=f"N x {cfg.d_model} x {item} B (TP = 2, 4 or 8)")
    left.set_ylabel(f"bytes of one all-reduce, each rank ({dtype})")
    left.set_title("per all-reduce: the payload on each rank", fontsize=MIN_FONT + 1)
    for p, style in {2: "--", 4: "-.", 8: ":"}.items():
        sent = [count * p * ring_bytes_sent(b, p) for b in payload]
        right.plot(tokens, sent, style, color=COMM, linewidth=2.5 if p == 2 else 1.0, gid=f"ring-{p}",
                   label=f"TP={p}: {count} all-reduces x {2 * (p - 1)} payloads")
    right.set_ylabel(f"bytes per forward, all ranks together ({dtype})")
    right.set_title("per forward: what all ranks send together (ring)", fontsize=MIN_FONT + 1)
    for ax in (left, right):
        ax.set(xscale="log", yscale="log", xlabel="tokens N in the request")
        ax.tick_params(labelsize=MIN_FONT)
        ax.legend(fontsize=MIN_FONT, frameon=False, loc="upper left")
    fig.suptitle(f"One request of N tokens: {count} all-reduces per forward for every N at TP >= 2, none at TP = 1",
                 fontsize=MIN_FONT + 2)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.14, top=0.84, wspace=0.3)
    return fig


@register("00_alpha_beta_model", lesson="00",
          caption="the alpha-beta model (not a measurement) of ONE ring all-reduce of [N x 512] at TP=2 on an assumed "
                  "NVLink-like link: the latency term is flat, the bandwidth term grows with N; they cross at N*, twice "
                  "as far out in bfloat16 as in float32 (C1)")
def alpha_beta_model() -> Figure:
    """The alpha-beta model before any measurement: ``ring_time_terms`` of one TP=2 all-reduce of ``[N, 512]``
    against N on ``measure.comm.NVLINK`` (an assumed NVLink-like link). Gids: ``latency``, ``bandwidth-float32``,
    ``bandwidth-bfloat16``, ``total-float32``, ``total-bfloat16`` and each dtype's N* (``crossover_tokens``),
    ``crossover-float32``, ``crossover-bfloat16``."""
    fit, p, d_model = NVLINK, 2, 512
    ns = np.unique(np.logspace(0, np.log10(65536), 120).astype(int))
    fig = Figure(figsize=(9.6, 4.6))
    ax = fig.subplots()
    items = {dt: getattr(torch, dt).itemsize for dt in ("float32", "bfloat16")}
    terms = {dt: [ring_time_terms(fit, int(n) * d_model * item, p) for n in ns] for dt, item in items.items()}
    lat = [1e6 * t[0] for t in terms["float32"]]
    ax.plot(ns, [1e6 * sum(t) for t in terms["float32"]], color=COMM, linewidth=2.8, gid="total-float32",
            label="model total, float32: latency + bandwidth")
    ax.plot(ns, lat, "--", color=TEXT, linewidth=1.4, gid="latency",
            label=f"latency term 2(p-1) alpha = {lat[0]:.3g} us (any N, any dtype)")
    for dt, style, width in (("float32", ":", 1.8), ("bfloat16", "-.", 1.4)):
        ax.plot(ns, [1e6 * t[1] for t in terms[dt]], style, color=TEXT, linewidth=width, gid=f"bandwidth-{dt}",
                label=f"bandwidth term 2(p-1)/p S/beta, {dt} (S = N x {d_model} x {items[dt]} B)")
    ax.plot(ns, [1e6 * sum(t) for t in terms["bfloat16"]], "-.", color=COMM, linewidth=1.8, gid="total-bfloat16",
            label="model total, bfloat16: the same latency, half the bandwidth term")
    for dt, y in (("float32", 0.06), ("bfloat16", 0.012)):
        star = crossover_tokens(fit, d_model, items[dt], p)
        ax.axvline(star, color=TEXT, linestyle=(0, (1, 3)) if dt == "float32" else (0, (4, 2, 1, 2)), linewidth=1,
                   gid=f"crossover-{dt}")
        ax.text(star * 1.1, lat[0] * y, f"N* = {star:,.0f} tokens\n({dt})", fontsize=MIN_FONT, color=TEXT, va="center",
                bbox={"facecolor": NEVER, "edgecolor": "none", "pad": 1})
    ax.text(1.3, lat[0] * 1.35, "left of N*: latency-dominated; right of it: bandwidth-dominated", fontsize=MIN_FONT,
            color=TEXT)
    ax.set(xscale="log", yscale="log", ylim=(1e-3 * lat[0], 400 * lat[0]),  # room for the legend above the curves
           xlabel=f"tokens N in the forward (payload [N x {d_model}] on each rank)", ylabel="us for ONE all-reduce (model)")
    ax.tick_params(labelsize=MIN_FONT)
    ax.legend(fontsize=MIN_FONT, frameon=False, loc="upper left")
    fig.suptitle(f"A model, not a measurement: one ring all-reduce, TP = {p}, alpha = {fit.alpha_s * 1e6:.3g} us per "
                 f"step, beta = {fit.beta / 1e9:.3g} GB/s", fontsize=MIN_FONT + 2)
    ax.set_title("assumed: each of the 2(p-1) steps costs alpha + (S/p)/beta; fixed alpha and beta; no overlap "
                 "with compute", fontsize=MIN_FONT)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.12, top=0.86)
    return fig


# ---------------------------------------------------------------------------------------------
# The explorer: what the all-reduces of a forward cost, packed or one request per forward (C1)

def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


def comm_cost_text(state: dict) -> str:
    """The readouts, one per line (the format the browser test parses)."""
    s = state
    r = s["requests"]
    lines = [f"alpha = {s['alpha_s'] * 1e6:.3g} us per step, beta = {s['beta'] / 1e9:.3g} GB/s ({s['source']})",
             f"N = {s['num_tokens']}: {s['count']} all-reduces per forward (2 x {s['n_layers']} layers), each "
             f"[{s['num_tokens']}, {s['d_model']}] {s['dtype']} = {s['bytes_each']:,} B",
             f"one all-reduce (ring, TP={s['world_size']}): latency {_us(s['latency_s'])} + bandwidth "
             f"{_us(s['bandwidth_s'])} = {_us(s['one_s'])}, {s['dominated']}-dominated"
             + (f" (extrapolated: alpha and beta were fitted to a ring of {s['extrapolated']} ranks, not measured "
                f"at TP={s['world_size']})" if s.get("extrapolated") else ""),
             f"per forward: {s['count']} x {_us(s['one_s'])} = {_us(s['forward_s'])}",
             f"crossover: N* ~ {about(s['crossover'])} tokens (latency dominates below, bandwidth above; the same for "
             "any number of layers)"]
    if r > 1:
        lens = s["lens"]
        shown = f"{lens[0]}" if len(set(lens)) == 1 else f"{min(lens)}-{max(lens)}"
        lines.append(f"the same {s['num_tokens']} tokens as {r} requests of {shown}: packed in one forward "
                     f"{s['count']} all-reduces, {_us(s['forward_s'])} | one forward each {s['separate_count']} "
                     f"all-reduces, {_us(s['separate_s'])} ({s['separate_s'] / s['forward_s']:.1f} x)")
    return "\n".join(lines)


def comm_cost_figure(state: dict, measured: Mapping | None = None, probe: Mapping | None = None) -> Figure:
    """Left: all-reduce time per forward against N (log-log) under the state's alpha and beta: the model (purple),
    its latency term (dashed) and bandwidth term (dotted), the crossover N* (dash-dot), the chosen N (square),
    and ``measured`` (``AllReduceBench.measure``'s dict) as black dots at the N whose payload they carried, x count,
    and ``probe`` (``measure_point``'s dict) as a star (gid ``probe``); both only at their own TP size and d_model.
    Right: the state's tokens packed in one forward vs one forward per request, latency (hatched) + bandwidth."""
    s = state
    fit = AlphaBeta(s["alpha_s"], s["beta"])
    p, count, row = s["world_size"], s["count"], s["bytes_each"] // s["num_tokens"]  # row: bytes of one token
    ns = np.unique(np.logspace(0, np.log10(max(16384, s["num_tokens"])), 80).astype(int))
    lat, bw = (1e3 * count * np.array([ring_time_terms(fit, int(n) * row, p) for n in ns])).T  # ms
    fig = Figure(figsize=(10.4, 4.3))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.1, 1]})
    left.plot(ns, np.add(lat, bw), color=COMM, linewidth=2.5, label="alpha-beta model: latency + bandwidth", gid="model")
    left.plot(ns, lat, "--", color=TEXT, linewidth=1, label=f"latency term {count} x 2(p-1) alpha", gid="latency")
    left.plot(ns, bw, ":", color=TEXT, linewidth=1.3, label=f"bandwidth term {count} x 2(p-1)/p S/beta", gid="bandwidth")
    left.axvline(s["crossover"], color=TEXT, linestyle="-.", linewidth=1, gid="crossover")
    left.plot([s["num_tokens"]], [1e3 * s["forward_s"]], "s", color=COMM, markeredgecolor=TEXT, markersize=8, gid="mark")
    if probe and probe["world_size"] == p and probe["d_model"] == s["d_model"]:
        left.plot([probe["bytes"] / row], [1e3 * count * probe["seconds"]], "*", color=TEXT, markersize=13, gid="probe",
                  label=f"measured now: N = {probe['tokens']}, float32, x {count} (placed by bytes)")
    if measured and measured["world_size"] == p:
        xs = [b / row for b in measured["bytes"]]
        left.plot(xs, [1e3 * count * t for t in measured["seconds"]], "o", color=TEXT, markersize=5, gid="measured",
                  label=f"measured here ({measured['backend']}, TP={measured['world_size']}): one all-reduce x {count}, "
                        "placed by bytes")
    left.set(xscale="log", yscale="log")
    for axis in (left.xaxis, left.yaxis):  # no minor ticks, plain labels: mathtext ticks are most of the drawing time
        axis.set_minor_locator(NullLocator())
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    left.set_xlabel(f"tokens N in the forward ([N, {s['d_model']}] {s['dtype']} per all-reduce)")
    left.set_ylabel("ms of all-reduce per forward")
    left.set_title(f"{count} all-reduces per forward: N* ~ {about(s['crossover'])} tokens", fontsize=MIN_FONT + 1)
    left.legend(fontsize=MIN_FONT, frameon=False, loc="upper left")
    r = s["requests"]
    sep_lat = s["separate_count"] * s["latency_s"]
    bars = [("1 forward,\npacked", count * s["latency_s"], count * s["bandwidth_s"]),
            (f"{r} forward{'s' if r > 1 else ''},\none per request", sep_lat, s["separate_s"] - sep_lat)]
    for i, (_, lt, bt) in enumerate(bars):
        right.bar(i, lt * 1e3, color=COMM, edgecolor=TEXT, hatch="///", gid=f"bar-latency-{i}",
                  label="latency" if i == 0 else None)
        right.bar(i, bt * 1e3, bottom=lt * 1e3, color=COMM, edgecolor=TEXT, gid=f"bar-bandwidth-{i}",
                  label="bandwidth" if i == 0 else None)
    right.set_xticks([0, 1], [b[0] for b in bars])
    right.set_ylabel("ms of all-reduce")
    right.set_title(f"{s['num_tokens']} tokens as {r} request{'s' if r > 1 else ''}", fontsize=MIN_FONT + 1)
    right.legend(fontsize=MIN_FONT, frameon=False, loc="upper left")
    right.set_ylim(0, 1.25 * max(sum(b[1:]) for b in bars) * 1e3)
    for ax in (left, right):
        ax.tick_params(labelsize=MIN_FONT)
    fig.suptitle(f"All-reduce time under alpha = {s['alpha_s'] * 1e6:.3g} us, beta = {s['beta'] / 1e9:.3g} GB/s "
                 f"(TP={p}): N = {s['num_tokens']} is {s['dominated']}-dominated", fontsize=MIN_FONT + 2)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.86, wspace=0.28)
    return fig


def measure_text(point: Mapping) -> str:
    """One readout line for ``measure_point``'s dict (the format the browser test parses)."""
    return (f"measured now over {point['backend']} (TP={point['world_size']}): one all-reduce of "
            f"[{point['tokens']}, {point['d_model']}] float32 = {point['bytes']:,} B took {_us(point['seconds'])} | "
            f"the model says {_us(point['model_s'])} ({point['seconds'] / point['model_s']:.2f} x)")


def record_text(point: Mapping) -> str:
    """One readout line for ``tp.dryrun.record_requests``' dict (the format the browser test parses)."""
    lens, packed, separate = point["lens"], point["packed"], point["separate"]
    shapes = sorted({tuple(rec.shape) for t in separate for rec in t})
    return (f"recorded (the engine's forward on rank 0 of TP={point['world_size']}, {point['n_layers']} layers, "
            f"{point['dtype']}, d_model {point['d_model']}): {len(lens)} request(s) of {lens[0] if len(set(lens)) == 1 else lens}"
            f" packed: {len(packed)} all-reduces of {list(packed[0].shape)} | one forward each: "
            f"{sum(map(len, separate))} all-reduces of {' or '.join(str(list(sh)) for sh in shapes)} | the calculator "
            f"(expected_trace): {'the same, record by record' if point['agrees'] else 'DIFFERENT'}")


def comm_cost_explorer(measured: Mapping, measured_fit: AlphaBeta, num_tokens: int = 64,
                       bench: AllReduceBench | None = None):
    """VBox class ``abx``: IntSlider ``abx-tokens`` (1..16384), IntSlider ``abx-requests`` (1..64),
    Dropdowns ``abx-d-model``, ``abx-dtype``, ``abx-layers``, ``abx-tp`` (the TP size: 2, 4, 8), ``abx-network``;
    HTML ``abx-recorded``: on every move, the engine's forward on the chosen requests recorded on rank 0
    (``record_requests``, up to ``RECORD_MAX_TOKENS`` tokens; "running..." while it runs), beside the calculator
    (``record_text``); Button ``abx-measure`` (times real all-reduces at the chosen N and d_model on ``bench``'s
    ranks: "running..." while it runs), HTML ``abx-measured`` (``measure_text``), HTML ``abx-text``
    (``comm_cost_text``, one div per line), Output ``abx-figure`` (``comm_cost_figure``). ``measured``:
    ``AllReduceBench.measure``'s dict, drawn while the network is this machine's (``measured_fit``; the other:
    ``measure.comm.NVLINK``)."""
    w = ipywidgets_module()
    tokens = tagged(w.IntSlider(value=num_tokens, min=1, max=16384, description="tokens N"), "abx-tokens")
    reqs = tagged(w.IntSlider(value=1, min=1, max=64, description="requests"), "abx-requests")
    d_model = tagged(w.Dropdown(options=[512, 1024, 4096, 8192], value=512, description="d_model"), "abx-d-model")
    kind = tagged(w.Dropdown(options=list(DTYPES), value="float32", description="dtype"), "abx-dtype")
    layers = tagged(w.Dropdown(options=[8, 32, 80], value=8, description="layers"), "abx-layers")
    tp = tagged(w.Dropdown(options=[2, 4, 8], value=2, description="TP size"), "abx-tp")
    net = tagged(w.Dropdown(options=[("this machine (fitted)", measured_fit), ("NVLink 4 (datasheet-like)", NVLINK)],
                            value=measured_fit, description="network"), "abx-network")
    button = tagged(w.Button(description="measure at this N"), "abx-measure")
    rec_text = tagged(w.HTML("<div>running...</div>"), "abx-recorded")
    probe_text = tagged(w.HTML("<div>measure: times real all-reduces at the chosen N and d_model on the "
                               f"{bench.world_size if bench else 2} ranks</div>"), "abx-measured")
    text, out = tagged(w.HTML(), "abx-text"), tagged(w.Output(), "abx-figure")
    last: dict = {}

    def update(change=None):
        here = net.value is measured_fit
        try:
            state = comm_cost_state(tokens.value, net.value, d_model.value, kind.value, layers.value, reqs.value,
                                    tp.value, measured["world_size"] if here else None)
        except ValueError as exc:  # e.g. more requests than tokens
            text.value = f"<div>{exc}</div>"
            return
        text.value = "<div>" + "</div><div>".join(comm_cost_text(state).splitlines()) + "</div>"
        show_figure(out, comm_cost_figure(state, measured if here else None, last.get("probe")))
        record()

    def measure(_=None):
        if bench is None:
            probe_text.value = "<div>no ranks to measure on: pass bench=AllReduceBench()</div>"
            return
        probe_text.value = "<div>running...</div>"
        try:
            last["probe"] = measure_point(bench, tokens.value, d_model.value, net.value)
        except ValueError as exc:  # too large a payload
            probe_text.value = f"<div>{exc}</div>"
            return
        probe_text.value = f"<div>{measure_text(last['probe'])}</div>"
        update()

    def record():
        if tokens.value > RECORD_MAX_TOKENS:
            rec_text.value = (f"<div>not recorded: the recorder runs up to {RECORD_MAX_TOKENS:,} tokens; above, the "
                              "count and payloads are expected_trace's, which every recording matched</div>")
            return
        rec_text.value = "<div>running...</div>"
        point = record_requests(tokens.value, reqs.value, layers.value, kind.value, tp.value)
        rec_text.value = f"<div>{record_text(point)}</div>"

    button.on_click(measure)
    return explorer("abx", [tokens, reqs, d_model, kind, layers, tp, net],
                    [rec_text, w.HBox([button, probe_text]), text, out], update)


# ---------------------------------------------------------------------------------------------
# Exercises

_SMALL_CFGS = [ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128),
               ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=77, max_position=40),
               ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=32, d_ffn=128, vocab_size=50, max_position=16)]


def tp_plan(cfg: ModelConfig, budget: int, count=None) -> tuple[int, bool] | None:
    """Exercise 00.1's answer: the plan ``(tp_size, vocab_parallel)`` with the fewest ranks at which one rank holds
    at most ``budget`` parameters, and among those the one WITHOUT a vocab-parallel embedding (it only adds
    collectives outside the blocks); None when no plan fits. ``count(cfg, tp, vocab_parallel)``: ``rank_params``
    by default (a slip's count, for the hints)."""
    check_int("budget", budget, 1)
    count = count or rank_params
    return next(((p, vp) for p in tp_sizes(cfg) for vp in (False, True) if count(cfg, p, vp) <= budget), None)


def _plan_hint(got, cfg: ModelConfig, budget: int) -> str:
    """Why the plan ``got`` is not the one wanted: what rank 0 really holds there, and the usual slip."""
    sizes, want = tp_sizes(cfg), tp_plan(cfg, budget)
    if got is None:
        facts = [f"tp_size={want[0]}, vocab_parallel={want[1]} fits: rank 0 holds {rank_params(cfg, *want):,} <= "
                 f"{budget:,}"]
    else:
        tp, vp = got
        if tp not in sizes:
            return (f"tp_size={tp} cannot split this model: the engine needs whole heads and whole FFN units per "
                    f"rank, so tp_size must divide n_heads={cfg.n_heads} and d_ffn={cfg.d_ffn}: {sizes}")
        held = rank_params(cfg, tp, vp)
        if held > budget:
            facts = [f"at tp_size={tp}, vocab_parallel={vp} rank 0 holds {held:,} parameters, over the budget of "
                     f"{budget:,}"]
        elif want is not None and want[0] < tp:
            facts = [f"tp_size={want[0]} already fits with vocab_parallel={want[1]} (rank 0 holds "
                     f"{rank_params(cfg, *want):,} <= {budget:,}): fewer GPUs for one copy of the model"]
        else:  # the same TP size, vocab-parallel where it is not needed
            facts = [f"tp_size={tp} fits with the token table whole (rank 0 holds {rank_params(cfg, tp, False):,} <= "
                     f"{budget:,}): a vocab-parallel embedding there buys nothing and adds collectives outside the "
                     "blocks"]
    if want is None:
        facts.append(f"no plan fits: even at tp_size={sizes[-1]} with a vocab-parallel embedding rank 0 holds "
                     f"{rank_params(cfg, sizes[-1], True):,}, because the rest of the replicated part does not shrink "
                     "with the TP size (return None)")
    wpe = held_by_name(cfg, 1)["wpe"]
    slips = (  # (a slip's count of rank 0's parameters, what it misses): the first whose plan is ``got`` is said
        (lambda c, t, vp: rank_params(c, t, vp) - (wpe * (t - 1) // t if vp else 0),
         "a vocab-parallel embedding cuts the token table only: the position table wpe stays whole"),
        (lambda c, t, vp: rank_params(c, 1) / t,  # every parameter cut t ways
         "not everything is split: the embeddings, the LayerNorms and the row-parallel biases are whole on every "
         "rank, so a rank's share never falls below that replicated part"),
        (lambda c, t, vp: budget + 1 if vp else rank_params(c, t),  # never vocab-parallel
         "the vocab-parallel embedding is yours to choose: cutting wte (and the tied LM head) into "
         "ceil(vocab_size / tp_size) rows lets a smaller TP size fit"))
    facts += [hint for count, hint in slips if got == tp_plan(cfg, budget, count)][:1]
    return "; ".join(facts)


def check_tp_plan(fn: Callable[[ModelConfig, int], tuple[int, bool] | None]) -> bool:
    """Exercise 00.1: ``fn(cfg, budget) -> (tp_size, vocab_parallel) | None``: the plan with the fewest ranks
    (a TP size that divides ``n_heads`` and ``d_ffn``) at which ONE rank holds at most ``budget`` parameters,
    without a vocab-parallel embedding unless only it makes that TP size fit; None if no plan fits
    (``tp_plan``). Checked against the parameters of rank 0's real shard (``rank_params``) on three
    configurations, with budgets set between the real per-rank counts."""
    a, b, c = _SMALL_CFGS
    cases = [(a, rank_params(a, 1)),              # the whole model fits: (1, False)
             (a, rank_params(a, 2)),              # exactly the TP=2 share, wte whole: (2, False)
             (a, rank_params(a, 2) - 1),          # one short: vocab-parallel keeps TP=2
             (a, rank_params(a, 2, True) - 1),    # one short of that: TP=4
             (a, rank_params(a, 4, True) - 1),    # below every share: None
             (b, rank_params(b, 2, True) - 1),    # heads 6: TP=3, not 4
             (b, rank_params(b, 3, True)),
             (c, rank_params(c, 2, True)),
             (c, rank_params(c, 1) - 1)]

    def judge(got, cfg, budget):
        want = tp_plan(cfg, budget)
        ok = got is None or (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], int)
                             and not isinstance(got[0], bool) and isinstance(got[1], bool))
        if not ok:
            return f"return a pair (tp_size: int, vocab_parallel: bool) or None, got {got!r}"
        if got == want:
            return None
        return f"got {got!r}, expected {want!r} - {_plan_hint(got, cfg, budget)}"
    return grade("tp_plan", fn, cases, judge,
                 f"the plan matches rank 0's real shard on {len(cases)} cases")


def _packing_hint(got: float, fit: AlphaBeta, n: int, k: int, target: float, p: int) -> str:
    """What saving the reader's factor really gives, and the usual slip behind it."""
    if not got > 0:
        return "alpha and beta stay positive: the factor must be a positive number"
    try:
        saving = packing_saving(replace(fit, alpha_s=fit.alpha_s * got), n, k, p)
    except ValueError:
        return ""
    lines = [f"with alpha x {got:.4g} packing saves {saving:.4g}x, not {target:g}x"]
    want_u = (k - target) / (k * (target - 1))
    u = n / crossover_tokens(fit, 512, 4, p)
    slips = [(want_u / u, "upside down: a SMALLER alpha x beta makes the bytes weigh more against the latency, and "
                          "the bytes grow with the packed tokens, so the saving falls"),
             (u / want_u * p / 2, "the TP size enters N* = p x alpha x beta / (d x s): do not plug in p = 2"),
             (u / want_u * p, f"p = {p} is missing from the ratio: each ring step moves only S/p bytes, so one "
                              "request's bytes term over its latency term is S / (p x alpha x beta) = N / N*, not "
                              "S / (alpha x beta); your ratio is p times too large")]
    known = next((hint for value, hint in slips if np.isclose(got, value, rtol=1e-6)), None)
    # no known slip: say what the factor did to the one number the saving depends on
    lines.append(known or f"the saving k (1 + u) / (1 + k u) depends only on u, one request's bytes term over its "
                          f"latency term (here k = {k}); your factor moves u from {u:.4g} to {u / got:.4g}, and "
                          f"{target:g}x needs u = {want_u:.4g}; u scales like 1 / alpha and like 1 / beta, not like "
                          "the saving itself")
    return "; ".join(lines)


def check_packing_factor(fn: Callable[[AlphaBeta, int, int, float, int], float | None]) -> bool:
    """Exercise 00.2: ``fn(fit, num_tokens, requests, target, world_size) -> factor | None``: the factor by
    which alpha alone, or beta alone, must be multiplied so that ``requests`` requests of ``num_tokens`` tokens
    each cost exactly ``target`` times more all-reduce time as separate forwards than packed into one (the
    article's model, float32, a ring of ``world_size`` ranks); None at ``world_size = 1`` (no all-reduce).
    Checked by running ``comm_cost_state`` on the scaled networks (``packing_saving``), to a relative 1e-6."""
    here, nvlink, mid = AlphaBeta(40e-6, 1.3e9), NVLINK, AlphaBeta(20e-6, 10e9)
    cases = [(here, 64, 8, 2.0, 2), (here, 10, 8, 2.0, 2), (nvlink, 1000, 8, 2.0, 2), (here, 64, 4, 3.0, 2),
             (mid, 200, 8, 2.0, 4), (nvlink, 500, 16, 4.0, 8), (here, 64, 8, 2.0, 1)]

    def judge(got, fit, n, k, target, p):
        if p == 1:
            return None if got is None else (f"got {got!r}, expected None - at TP=1 a forward makes no all-reduce "
                                             "(LocalGroup.all_reduce returns its tensor untouched), so there is no "
                                             "communication for packing to save")
        if got is None or isinstance(got, bool) or not isinstance(got, (int, float)) or not np.isfinite(got):
            return f"return a number (the factor), got {got!r}"
        scaled = [replace(fit, alpha_s=fit.alpha_s * got), replace(fit, beta=fit.beta * got)] if got > 0 else []
        if scaled and all(np.isclose(packing_saving(f, n, k, p), target, rtol=1e-6) for f in scaled):
            return None
        return _packing_hint(got, fit, n, k, target, p)
    return grade("packing_factor", fn, cases, judge,
                 f"on {len(cases)} cases, alpha or beta scaled by your factor makes packing save exactly the target")
