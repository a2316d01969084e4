"""What lesson 00 (the setup, one request) draws, explores and checks.

Figures: the course map (``00_course_map``), how tensor parallelism cuts a block's four linear
layers (``00_tp_split``), and the all-reduces of one request against its length and the TP size
(``00_allreduce_growth``). The explorer ``allreduce_explorer`` wraps ``allreduce_state``.
Helpers the notebook calls: ``shard_table``, ``heads_held``, ``follow_request``,
``time_forward``, ``machine_report``. Exercise checkers: ``check_rank_params`` (00.1),
``check_all_reduce_traffic`` (00.2).

Taught in notebooks/00_setup_one_request.ipynb.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from ..core.config import ModelConfig
from ..core.groups import LocalGroup
from ..core.kernels import available_backends, placement, resolve_backend
from ..core.model import Transformer
from ..measure.profile import time_call
from ..style import ATTENTION, COMM, LINEAR, MIN_FONT, NEVER, OTHER, REQUEST, TEXT
from ..tp.dryrun import expected_trace, record_trace
from ..validate import check_int, dtype_name
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import register
from .grading import grade, int_tuple

# ---------------------------------------------------------------------------------------------
# The course map

# (lesson, title, what it shows, claim ids, minutes to work through)
LESSONS = (
    ("00", "One request", "the model and its TP split; 16 all-reduces per forward, whatever N", "S1, C1", 45),
    ("01", "Padding vs one flat batch", "pad rows and wasted score cells; the flat batch and cu_seqlens", "S2, C2, C3", 35),
    ("02", "Linear layers are per token", "LayerNorm, GeLU and the four matmuls never see a request boundary",
     "C4, C5, C6", 35),
    ("03", "Masked vs varlen attention", "the one layer that mixes tokens; 1600 vs 1000 score cells",
     "C7-C10", 60),
    ("04", "TP never sees the requests", "the same 16 all-reduces for 1 or 40 requests; TP=2 equals TP=1",
     "C11, C12", 40),
    ("05", "Where the FLOPs go", "linear vs attention work, arithmetic intensity, a decode preview", "C13, C14, C15", 55),
    ("06", "A prefill engine", "a scheduler under a token budget: padded vs masked vs varlen", "S3 (+ C2, C8, C10, C12)", 60),
    ("07", "Inside the kernel", "one Triton launch for all requests: the grid, causal tiles, online softmax",
     "K1-K5", 50),
    ("08", "Chunked prefill", "a prompt longer than the budget, in chunks over a KV cache: the staircase of cells",
     "P1-P5", 50),
)
# What each lesson is mostly about, in the palette's meanings (a stripe on its box).
_TOPIC = {"00": (COMM,), "01": (REQUEST[0],), "02": (LINEAR,), "03": (ATTENTION,), "04": (COMM,),
          "05": (LINEAR, ATTENTION), "06": (REQUEST[0], LINEAR, ATTENTION, COMM), "07": (ATTENTION,),
          "08": (REQUEST[0], ATTENTION)}


def _wrap(text: str, width: int) -> str:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])


@register("00_course_map", lesson="00", caption="the lessons, what each shows and the claims it proves")
def course_map() -> Figure:
    """One box per lesson, in reading order: title, what it shows, the claim ids it proves.

    A coloured stripe on top of each box says what the lesson is about, in the palette's
    meanings (orange requests, green linear layers, blue attention, purple communication).
    """
    w, h, gap, y = 1.66, 2.45, 0.12, 0.2
    width = 0.24 + len(LESSONS) * (w + gap) - gap
    fig = Figure(figsize=(width, 3.45))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, 3.45)
    ax.axis("off")
    for i, (num, title, shows, claims, minutes) in enumerate(LESSONS):
        x = 0.12 + i * (w + gap)
        ax.add_patch(Rectangle((x, y), w, h, facecolor=NEVER, edgecolor=OTHER, linewidth=1))
        colours = _TOPIC[num]
        for j, c in enumerate(colours):
            ax.add_patch(Rectangle((x + j * w / len(colours), y + h - 0.16), w / len(colours), 0.16, facecolor=c,
                                   edgecolor="none"))
        ax.text(x + 0.08, y + h - 0.3, f"{num}", ha="left", va="top", fontsize=12, fontweight="bold", color=TEXT)
        ax.text(x + w - 0.08, y + h - 0.32, f"~{minutes} min", ha="right", va="top", fontsize=MIN_FONT, color=TEXT)
        ax.text(x + 0.08, y + h - 0.68, _wrap(title, 16), ha="left", va="top", fontsize=MIN_FONT + 1,
                fontweight="bold", color=TEXT)
        ax.text(x + 0.08, y + h - 1.2, _wrap(shows, 19), ha="left", va="top", fontsize=MIN_FONT, color=TEXT)
        ax.text(x + 0.08, y + 0.1, claims, ha="left", va="bottom", fontsize=MIN_FONT, color=TEXT, style="italic")
        if i:
            ax.add_patch(FancyArrowPatch((x - gap + 0.01, y + h / 2), (x - 0.01, y + h / 2), arrowstyle="-|>",
                                         mutation_scale=9, color=OTHER))
    ax.text(0.12, 3.12, f"The course: {len(LESSONS)} lessons, each proving the claims in italics "
            "(prefill only; whole requests and no KV cache until lesson 08)", fontsize=MIN_FONT + 2, color=TEXT, va="center")
    return fig


# ---------------------------------------------------------------------------------------------
# How tensor parallelism cuts a block

def _box(ax, x, y, w, h, colour, text="", hatched=False, gid=None):
    """A labelled rectangle; a hatched one (rank 1) gets white stripes and a white label background."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="white", hatch="///" if hatched else None,
                           linewidth=0.8, gid=gid))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=MIN_FONT, color=TEXT,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5, "alpha": 0.9} if hatched else None)


def _arrow(ax, a, b, colour=OTHER):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color=colour, linewidth=1.2))


@register("00_tp_split", lesson="00",
          caption="TP=2: QKV and FFN-up cut by output features (bias split), out proj and FFN-down by input "
                  "features (partial sums, one all-reduce, bias whole and added once) (S1)")
def tp_split(cfg: ModelConfig | None = None) -> Figure:
    """How TP cuts a block's linear layers (claim S1).

    Left: a column-parallel layer (QKV, FFN-up) is cut by OUTPUT features; each rank computes
    its own output columns from the whole input, and the bias is split with them: no
    communication. Right: a row-parallel layer (out proj, FFN-down) is cut by INPUT features;
    each rank makes a full-width partial sum, one all-reduce adds them, and the bias, whole on
    every rank, is added once, after the sum. Rank 0 plain, rank 1 hatched; green = linear
    work, purple = communication, grey = activations. Patches carry gids (``col-w-r``,
    ``col-b-r``, ``row-w-r``, ``all-reduce``, ``row-b``).
    """
    cfg = cfg or ModelConfig()
    d, k, f, tp = cfg.d_model, cfg.qkv_dim, cfg.d_ffn, 2  # the figure draws two ranks
    fig = Figure(figsize=(13, 5.6))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 23)
    ax.set_ylim(0, 10)
    ax.axis("off")
    ax.text(0.2, 9.65, f"Tensor parallelism, TP={tp}: how one block's four linear layers are cut", fontsize=MIN_FONT + 4,
            fontweight="bold", color=TEXT, va="center")
    ax.text(0.2, 9.15, "rank 0 plain, rank 1 hatched; green: linear work, purple: communication, grey: activations",
            fontsize=MIN_FONT + 1, color=TEXT, va="center")
    # --- column-parallel: y_r = x W_r^T + b_r -------------------------------------------------------
    ax.text(0.2, 8.4, "column-parallel: QKV, FFN-up", fontsize=MIN_FONT + 3, fontweight="bold", color=TEXT)
    ax.text(0.2, 7.9, "cut by OUTPUT features; each rank reads the whole x", fontsize=MIN_FONT + 1, color=TEXT)
    _box(ax, 0.2, 3.9, 1.7, 3.0, OTHER, f"x\n[T x {d}]\nwhole on\nboth ranks")
    _arrow(ax, (2.0, 5.4), (2.6, 5.4))
    ax.text(4.3, 7.35, "weight W^T [in x out]", ha="center", fontsize=MIN_FONT, color=TEXT)
    _box(ax, 2.7, 3.9, 1.6, 3.3, LINEAR, "rank 0:\nfirst half\nof the\noutputs", gid="col-w-0")
    _box(ax, 4.3, 3.9, 1.6, 3.3, LINEAR, "rank 1:\nsecond\nhalf", hatched=True, gid="col-w-1")
    _box(ax, 2.7, 3.2, 1.6, 0.5, LINEAR, "bias half", gid="col-b-0")
    _box(ax, 4.3, 3.2, 1.6, 0.5, LINEAR, "bias half", hatched=True, gid="col-b-1")
    ax.text(4.3, 2.95, "the bias is split with its outputs", ha="center", va="top", fontsize=MIN_FONT, color=TEXT)
    _arrow(ax, (6.0, 6.3), (6.8, 6.3))
    _arrow(ax, (6.0, 4.6), (6.8, 4.6))
    _box(ax, 6.9, 5.6, 2.5, 1.4, LINEAR, "y0 = x W0^T + b0\n[T x out/2]")
    _box(ax, 6.9, 3.9, 2.5, 1.4, LINEAR, "y1 = x W1^T + b1\n[T x out/2]", hatched=True)
    ax.text(9.5, 6.3, "rank 0", va="center", fontsize=MIN_FONT, color=TEXT)
    ax.text(9.5, 4.6, "rank 1", va="center", fontsize=MIN_FONT, color=TEXT)
    ax.text(0.2, 1.3, f"QKV: [T x {d}] -> [T x {3 * k // tp}] on each rank: Q, K, V of its {cfg.heads_per_rank(tp)} heads\n"
            f"FFN-up: [T x {d}] -> [T x {f // tp}] on each rank: half the FFN\n"
            "no communication: the next layer reads the shard", va="center", fontsize=MIN_FONT + 1, color=TEXT)
    # --- row-parallel: y = sum_r x_r W_r^T, then + b once --------------------------------------------
    x0 = 10.6
    ax.text(x0, 8.4, "row-parallel: out proj, FFN-down", fontsize=MIN_FONT + 3, fontweight="bold", color=TEXT)
    ax.text(x0, 7.9, "cut by INPUT features; each rank makes a full-width partial sum", fontsize=MIN_FONT + 1,
            color=TEXT)
    for r, y0 in ((0, 5.6), (1, 3.6)):
        _box(ax, x0, y0, 1.6, 1.4, OTHER, f"x{r}\n[T x in/2]", hatched=bool(r))
        _arrow(ax, (x0 + 1.65, y0 + 0.7), (x0 + 2.05, y0 + 0.7))
        _box(ax, x0 + 2.1, y0, 1.7, 1.4, LINEAR, f"W{r}^T\n[in/2 x {d}]", hatched=bool(r), gid=f"row-w-{r}")
        _arrow(ax, (x0 + 3.85, y0 + 0.7), (x0 + 4.25, y0 + 0.7))
        _box(ax, x0 + 4.3, y0, 1.8, 1.4, LINEAR, f"partial p{r}\n[T x {d}]", hatched=bool(r))
        _arrow(ax, (x0 + 6.15, y0 + 0.7), (x0 + 6.65, 5.3 if r == 0 else 4.9), COMM)
        ax.text(x0 - 0.05, y0 - 0.05, f"rank {r}", ha="left", va="top", fontsize=MIN_FONT, color=TEXT)
    _box(ax, x0 + 6.7, 4.1, 2.0, 2.0, COMM, "all-reduce\np0 + p1\nsame sum on\nboth ranks", gid="all-reduce")
    _arrow(ax, (x0 + 8.75, 5.1), (x0 + 9.15, 5.1), COMM)
    _box(ax, x0 + 9.2, 5.6, 2.0, 1.4, OTHER, f"sum [T x {d}]")
    _arrow(ax, (x0 + 10.2, 5.55), (x0 + 10.2, 5.15))
    _box(ax, x0 + 9.2, 3.6, 2.0, 1.5, LINEAR, f"+ bias [{d}]\nwhole on each\nrank, added\nONCE", gid="row-b")
    ax.text(x0 + 3.3, 3.05, "the bias is added once, after the sum (added before the all-reduce,\n"
            f"it would be counted {tp} times); its output y is the same on every rank", ha="left", va="top",
            fontsize=MIN_FONT, color=TEXT)
    ax.text(x0, 1.3, f"out proj: [T x {k // tp}] -> partial [T x {d}];  FFN-down: [T x {f // tp}] -> partial [T x {d}]\n"
            f"2 row-parallel layers per block x {cfg.n_layers} blocks = {2 * cfg.n_layers} all-reduces of [T x {d}] "
            "per forward\n(embeddings, LayerNorms and the tied LM head are whole on every rank here: no collective)",
            va="center", fontsize=MIN_FONT + 1, color=TEXT)
    return fig


# ---------------------------------------------------------------------------------------------
# The all-reduces of one request (C1)

DTYPES = ("float32", "bfloat16", "float16")
WORLD_SIZES = (1, 2, 4, 8)
_STYLES = {2: "--", 4: "-.", 8: ":"}


def ring_bytes_sent(payload: int, world_size: int) -> int:
    """Bytes ONE rank sends in one ring all-reduce of ``payload`` bytes: ``2·(p−1)/p · payload``
    (reduce-scatter, then all-gather, each moving ``(p−1)/p`` of the buffer). 0 at ``p = 1``."""
    check_int("world_size", world_size, 1)
    return 2 * (world_size - 1) * payload // world_size


def allreduce_state(num_tokens: int, dtype: str = "float32", world_size: int = 2) -> dict:
    """What one forward of a single N-token request all-reduces (C1), from ``expected_trace``.

    Keys: ``num_tokens``, ``dtype``, ``world_size``, ``count`` (per rank: 2·n_layers, 0 at
    TP=1), ``shape`` (``[N, d_model]``), ``bytes_each`` (one all-reduce's payload on one rank),
    ``bytes_per_forward`` (per rank), ``ring_sent_each`` (bytes ONE rank sends in one ring
    all-reduce: ``2·(p−1)/p · bytes_each``), ``ring_sent_total`` (bytes all ranks together send
    in one forward: ``count · p · ring_sent_each = count · 2·(p−1) · bytes_each``), ``trace``
    (rank 0's ``CollectiveRecord`` list).
    """
    n = check_int("num_tokens", num_tokens, 1, 1 << 24)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if world_size not in WORLD_SIZES:
        raise ValueError(f"world_size must be one of {WORLD_SIZES} (dividing the 8 heads), got {world_size!r}")
    cfg = ModelConfig(dtype=getattr(torch, dtype))
    trace = expected_trace(cfg, n, 0, world_size)
    each = trace[0].bytes if trace else 0
    sent = ring_bytes_sent(each, world_size)
    return {"num_tokens": n, "dtype": dtype, "world_size": world_size, "count": len(trace), "shape": [n, cfg.d_model],
            "bytes_each": each, "bytes_per_forward": sum(r.bytes for r in trace), "ring_sent_each": sent,
            "ring_sent_total": world_size * len(trace) * sent, "trace": trace}


def allreduce_text(state: dict) -> str:
    """The readouts, separated by `` | ``: ``TP=2: 16 all-reduces per forward on each rank | ...``."""
    p = state["world_size"]
    if state["count"] == 0:
        return (f"TP={p}: 0 all-reduces - one rank holds every weight, its row-parallel outputs are already "
                "complete, there is nobody to add partial sums with | 0 B moved")
    return (f"TP={p}: {state['count']} all-reduces per forward on each rank | each {state['shape']} {state['dtype']} = "
            f"{state['bytes_each']:,} B on every rank, whatever the TP size | {state['bytes_per_forward']:,} B per "
            f"forward on each rank | ring all-reduce: each rank sends 2(p-1)/p = {2 * (p - 1) / p:g} x its payload = "
            f"{state['ring_sent_each']:,} B per all-reduce; all {p} ranks together send {state['ring_sent_total']:,} B "
            "per forward")


@register("00_allreduce_growth", lesson="00",
          caption="one request of N tokens: 16 all-reduces per forward for every N at TP >= 2 (0 at TP=1); the "
                  "payload grows with N, the ring traffic also with TP (C1)")
def allreduce_growth(cfg: ModelConfig | None = None, tokens: Sequence[int] | None = None, mark: int | None = None,
                     measured: Mapping[int, Sequence] | None = None, world_size: int = 2) -> Figure:
    """Claim C1: what the 16 all-reduces of one forward move, against the tokens N of one request.

    The count, ``2·n_layers`` (``cfg.all_reduces_per_forward``, what ``tp.dryrun.expected_trace``
    records) at any TP ≥ 2 and 0 at TP=1, is in the title. Left, per all-reduce: the payload on
    each rank, ``N·d_model·itemsize``, the same for every TP ≥ 2. Right, per forward: the bytes all ranks together send with a
    ring all-reduce, ``count · 2·(p−1) · payload``, for TP = 2, 4, 8 (gids ``ring-p``; the one
    of ``world_size`` drawn thicker). ``measured``: ``{N: trace}`` of real ranks, drawn as black
    markers on the left (gids ``measured-bytes-N``). ``mark``: one N to highlight (the explorer's
    slider): a square on the payload (gid ``mark``) and on the line of ``world_size`` (gid
    ``mark-ring``).
    """
    cfg = cfg or ModelConfig()
    if world_size not in WORLD_SIZES:
        raise ValueError(f"world_size must be one of {WORLD_SIZES}, got {world_size!r}")
    tokens = list(tokens) if tokens is not None else sorted({int(v) for v in np.logspace(0, np.log10(16384), 60)})
    item = cfg.dtype.itemsize
    dtype = dtype_name(cfg.dtype)
    count = cfg.all_reduces_per_forward
    payload = [n * cfg.d_model * item for n in tokens]
    fig = Figure(figsize=(9.6, 4.1))
    left, right = fig.subplots(1, 2)
    left.plot(tokens, payload, color=COMM, linewidth=2.5, label=f"N x {cfg.d_model} x {item} B (TP = 2, 4 or 8)")
    left.set_ylabel(f"bytes of one all-reduce, each rank ({dtype})")
    left.set_title("per all-reduce: the payload on each rank", fontsize=MIN_FONT + 1)
    for p, style in _STYLES.items():
        sent = [count * p * ring_bytes_sent(b, p) for b in payload]
        right.plot(tokens, sent, style, color=COMM, linewidth=2.5 if p == world_size else 1.0, gid=f"ring-{p}",
                   label=f"TP={p}: {count} all-reduces x {2 * (p - 1)} payloads")
    right.set_ylabel(f"bytes per forward, all ranks together ({dtype})")
    right.set_title("per forward: what all ranks send together (ring)", fontsize=MIN_FONT + 1)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens N in the request")
        ax.tick_params(labelsize=MIN_FONT)
    for n, trace in sorted((measured or {}).items()):
        trace = list(trace)
        left.plot([n], [trace[0].bytes if trace else 0], "o", color=TEXT, gid=f"measured-bytes-{n}")
    if measured:
        left.plot([], [], "o", color=TEXT, label="measured, real TP=2 ranks")
    title = f"One request of N tokens: {count} all-reduces per forward for every N at TP >= 2, none at TP = 1"
    if mark is not None:
        each = int(mark) * cfg.d_model * item
        for ax in (left, right):
            ax.axvline(mark, color=OTHER, linestyle=":", linewidth=1)
        if world_size > 1:
            left.plot([mark], [each], "s", color=COMM, markeredgecolor=TEXT, gid="mark")
            right.plot([mark], [count * world_size * ring_bytes_sent(each, world_size)], "s", color=COMM,
                       markeredgecolor=TEXT, gid="mark-ring")
            title = (f"N = {mark}, TP = {world_size}: {count} all-reduces of [{mark} x {cfg.d_model}] {dtype}, "
                     f"{each:,} B each")
        else:
            title = f"N = {mark}, TP = 1: no all-reduce (one rank holds every weight)"
    fig.suptitle(title, fontsize=MIN_FONT + 2)
    left.legend(fontsize=MIN_FONT, frameon=False, loc="upper left")
    right.legend(fontsize=MIN_FONT, frameon=False, loc="upper left")
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.14, top=0.84, wspace=0.3)
    return fig


def allreduce_explorer(num_tokens: int = 10, dtype: str = "float32", world_size: int = 2):
    """VBox class ``arx``: IntSlider ``arx-tokens`` (1..16384), Dropdown ``arx-world-size`` (1, 2, 4, 8),
    Dropdown ``arx-dtype``, HTML ``arx-text`` (``allreduce_text``), Output ``arx-figure``
    (``allreduce_growth`` with N marked and the TP size drawn thicker)."""
    w = ipywidgets_module()
    tokens = tagged(w.IntSlider(value=num_tokens, min=1, max=16384, description="tokens N"), "arx-tokens")
    size = tagged(w.Dropdown(options=list(WORLD_SIZES), value=world_size, description="TP size"), "arx-world-size")
    kind = tagged(w.Dropdown(options=list(DTYPES), value=dtype, description="dtype"), "arx-dtype")
    text, out = tagged(w.HTML(), "arx-text"), tagged(w.Output(), "arx-figure")

    def update(change=None):
        state = allreduce_state(tokens.value, kind.value, size.value)
        text.value = "<div>" + "</div><div>".join(allreduce_text(state).split(" | ")) + "</div>"
        show_figure(out, allreduce_growth(ModelConfig(dtype=getattr(torch, kind.value)), mark=tokens.value,
                                          world_size=size.value))

    return explorer("arx", [tokens, size, kind], [text, out], update)


# ---------------------------------------------------------------------------------------------
# What the notebook reads off the model

def _cut(full: tuple, shard: tuple) -> str:
    if full == shard:
        return "whole (replicated)"
    if full[0] != shard[0]:
        return "split: output features"
    return "split: input features"


def shard_table(full: Transformer, shard: Transformer, layer: int = 0) -> list[tuple[str, list, list, str]]:
    """``(parameter, TP=1 shape, shape on the shard's rank, how it is cut)`` for one block's parameters."""
    mine = dict(shard.layers[layer].named_parameters())
    return [(name, list(p.shape), list(mine[name].shape), _cut(tuple(p.shape), tuple(mine[name].shape)))
            for name, p in full.layers[layer].named_parameters()]


def format_table(rows: Sequence[tuple], headers: Sequence[str]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def heads_held(weights: Mapping[str, torch.Tensor], shard: Transformer, layer: int = 0) -> dict[str, list[int]]:
    """Which heads of Q, K and V a rank's fused QKV weight holds, found by matching each
    ``d_head``-row block of the shard against the full weight: ``{"Q": [0, 1, 2, 3], "K": ..., "V": ...}``."""
    cfg = shard.cfg
    full = weights[f"layers.{layer}.attn.qkv.weight"].to(shard.dtype)       # [3·H·D, d]: Q heads | K heads | V heads
    mine = shard.layers[layer].attn.qkv.weight.detach().cpu()              # [3·H_local·D, d]
    blocks = {(part, h): full[(i * cfg.n_heads + h) * cfg.d_head:(i * cfg.n_heads + h + 1) * cfg.d_head]
              for i, part in enumerate("QKV") for h in range(cfg.n_heads)}
    found: dict[str, list[int]] = {"Q": [], "K": [], "V": []}
    for j in range(mine.shape[0] // cfg.d_head):
        block = mine[j * cfg.d_head:(j + 1) * cfg.d_head]
        match = next((key for key, b in blocks.items() if torch.equal(b, block)), None)
        if match is not None:
            found[match[0]].append(match[1])
    return found


def row_spans(layer) -> list[tuple[int, int]]:
    """The rows of the full weight a column-parallel ``layer`` keeps on its rank, as ``(start, stop)`` runs,
    read off the layer's own ``shard_rows`` (e.g. ``[(0, 256), (512, 768), (1024, 1280)]`` for rank 0's QKV)."""
    return consecutive_runs(layer.shard_rows(torch.arange(layer.out_features)).tolist())


def consecutive_runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers (each one more than the last), as ``(start, stop)``:
    ``[0, 1, 2, 5, 6]`` → ``[(0, 3), (5, 7)]``."""
    idx = np.asarray(values, dtype=np.int64)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    stops = np.concatenate([idx[breaks], [idx[-1]]]) + 1
    return list(zip(starts.tolist(), stops.tolist()))


def follow_request(model: Transformer, run: Callable[[], object]) -> tuple[list, list, object]:
    """Run ``run()`` with hooks on ``model``: ``(calls, block_outputs, result)`` where ``calls``
    lists ``(part, output shape)`` of layer 0's parts in call order, ``block_outputs`` the output
    shape of every block, and ``result`` what ``run()`` returned."""
    calls, block_out = [], []
    blk0 = model.layers[0]
    parts = ("ln_1", "attn.qkv", "attn.out_proj", "ln_2", "mlp.fc_up", "mlp.fc_down")
    hooks = [blk0.get_submodule(p).register_forward_hook(lambda m, i, o, p=p: calls.append((p, list(o.shape))))
             for p in parts]
    hooks += [b.register_forward_hook(lambda m, i, o: block_out.append(list(o.shape))) for b in model.layers]
    try:
        result = run()
    finally:
        for h in hooks:
            h.remove()
    return calls, block_out, result


def time_forward(model: Transformer, batch, repeats: int = 1) -> float:
    """Seconds of the fastest of ``repeats`` forwards of ``model`` on ``batch`` (no gradients): a wall-clock
    time to show, never to assert."""
    repeats = check_int("repeats", repeats, 1)
    with torch.no_grad():
        return time_call(lambda: model(batch), repeats=repeats, warmup=0, device=model.device)


def backend_rows(device, dtype: torch.dtype, head_dim: int | None = None) -> list[tuple[str, str, str]]:
    """``(backend, "yes"/"no", reason)`` for every attention backend on ``device`` in ``dtype``."""
    return [(name, "yes" if s.available else "no", s.reason)
            for name, s in available_backends(device, dtype, head_dim).items()]


def machine_report(head_dim: int = 64) -> str:
    """The appendix of lesson 00: device and dtype the engine picks, every attention backend with
    why (not) for the CPU and, with a GPU, CUDA in float16 / bfloat16 / float32, the TP backend
    for two ranks, and the cores."""
    from ..tp.workers import resolve_dist_backend
    device, dtype = placement()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines = [f"device: {device.type} | dtype: {dtype_name(dtype)} | torch {torch.__version__} | "
             f"CPU cores: {cores} | torch threads: {torch.get_num_threads()} | GPUs: {gpus}"]
    places = [("cpu", torch.float32)] + ([("cuda", t) for t in (torch.float16, torch.bfloat16, torch.float32)] if gpus else [])
    for dev, dt in places:
        name = dtype_name(dt)
        lines += ["", f"attention backends on {dev}, {name}, head dim {head_dim}: "
                  f"auto -> {resolve_backend('auto', dev, dt, head_dim)}"]
        lines.append(format_table(backend_rows(dev, dt, head_dim), ("backend", "runs", "why (not)")))
    tp = resolve_dist_backend("auto", 2, device)
    lines += ["", f"TP=2 collectives: {tp}" + ("" if tp == "nccl" else " (NCCL needs one GPU per rank)")]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Exercises

_SMALL_CFGS = [ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128),
               ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=77, max_position=40),
               ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=32, d_ffn=128, vocab_size=50, max_position=16)]


def _parts(cfg: ModelConfig, tp_size: int = 1) -> dict[str, int]:
    """Parameters rank 0 really holds, by kind: built from the model's own classes (one-process stand-in group).

    Kinds: ``wte``, ``wpe``, ``ln`` (ln_1 and ln_2 of every block), ``ln_f``, ``col_w`` / ``col_b`` (QKV and
    FFN-up), ``row_w`` / ``row_b`` (out proj and FFN-down).
    """
    model = Transformer(cfg, seed=0, group=LocalGroup(0, tp_size))
    parts = dict.fromkeys(("wte", "wpe", "ln", "ln_f", "col_w", "col_b", "row_w", "row_b"), 0)
    for name, p in model.named_parameters():
        if name in ("wte", "wpe"):
            kind = name
        elif name.startswith("ln_f."):
            kind = "ln_f"
        elif ".ln_" in name:
            kind = "ln"
        else:
            kind = ("col_" if (".qkv." in name or ".fc_up." in name) else "row_") + name.rsplit(".", 1)[1][0]
        parts[kind] += p.numel()
    return parts


def _rank_params_hint(got, cfg: ModelConfig, tp: int) -> str:
    """The typical slip behind a wrong parameter count, or ""."""
    parts = _parts(cfg, tp)
    want = sum(parts.values())
    whole = _parts(cfg) if tp > 1 else parts
    total = sum(whole.values())
    replicated = parts["wte"] + parts["wpe"] + parts["ln"] + parts["ln_f"] + parts["row_b"]
    hints = []
    if tp > 1:  # first: a count right at TP=1 (all its cases passed) and wrong here is about the split
        hints += [
            (total / tp, "not everything is split: embeddings, LayerNorms and the row-parallel biases are whole on "
                         "every rank"),
            (want - replicated, "add the replicated parameters (embeddings, LayerNorms, row-parallel biases) that "
                                "every rank keeps"),
            (want - parts["row_b"] + parts["row_b"] / tp,
             "the biases of out proj and FFN-down are not split: each rank keeps the whole [d_model] bias and adds it "
             "once, after the all-reduce"),
            (want + parts["col_b"] * (tp - 1),
             "the biases of QKV and FFN-up ARE split: a column-parallel rank computes only its output features, so it "
             "needs only their bias entries"),
            (total, f"that is the whole model: at tp_size={tp} each rank keeps only its share of the split layers"),
        ]
    hints += [
        (want + parts["wte"], "the LM head is tied to the token embedding (logits = h @ wte^T): count wte once"),
        (want - parts["wpe"], "the learned position embedding wpe [max_position, d_model] is a parameter too"),
        (want - parts["wte"], "the token embedding wte [vocab_size, d_model] is a parameter too"),
        (want - parts["ln_f"], "the final LayerNorm ln_f, after the last block, has a weight and a bias too"),
        (want - parts["ln"], "every block has two LayerNorms (ln_1, ln_2), each a weight and a bias of d_model"),
        (want - parts["ln"] - parts["ln_f"],
         "LayerNorms have a weight and a bias of d_model each: ln_1, ln_2 per block, and ln_f"),
        (want - parts["col_b"] - parts["row_b"], "count the biases of the four linear layers"),
    ]
    for value, hint in hints:
        if got == value:
            return hint
    if got in _article_counts() and cfg != ModelConfig():
        return ("that is the article's model; the checker uses other configurations: compute from cfg's fields "
                "(d_model, qkv_dim, d_ffn, n_layers, vocab_size, max_position)")
    return ""


def _article_counts() -> set[int]:
    """The article's model (``ModelConfig()``): its parameters, and what one rank of TP=2 holds.

    Written out, not built (a 59 M-parameter model takes seconds); a test checks them against the
    real model. A checker that meets one of these on a small configuration has met a hard-coded answer.
    """
    cfg = ModelConfig()
    d, k, f, n = cfg.d_model, cfg.qkv_dim, cfg.d_ffn, cfg.n_layers
    whole = cfg.vocab_size * d + cfg.max_position * d + n * (2 * 2 * d + 2 * d) + 2 * d
    cut = n * (3 * k * d + 3 * k + k * d + f * d + f + d * f)
    return {whole + cut, whole + cut // 2}


def check_rank_params(fn: Callable[[ModelConfig, int], int]) -> bool:
    """Exercise 00.1: ``fn(cfg, tp_size) -> int``, the parameters ONE rank holds under TP=tp_size
    (at tp_size=1: the whole model, LM head tied), on three configurations and TP = 1, 2, 3."""
    cases = [(c, tp) for c in _SMALL_CFGS for tp in (1, 2, 3) if c.n_heads % tp == 0 and c.d_ffn % tp == 0]

    def judge(got, cfg, tp):
        want = sum(_parts(cfg, tp).values())
        if got == want:
            return None
        hint = _rank_params_hint(got, cfg, tp)
        return f"got {got!r}, expected {want} for tp_size={tp}" + (f" - {hint}" if hint else "")
    return grade("rank_params", fn, cases, judge,
                 f"matches the real model (tp_size=1) and each rank's real shard on {len(cases)} layouts")


def check_all_reduce_traffic(fn: Callable[[ModelConfig, int, int], tuple]) -> bool:
    """Exercise 00.2: ``fn(cfg, num_tokens, world_size) -> (count, bytes_each)``: the all-reduces
    one rank makes in one forward of a single request under TP=world_size, and the bytes of each
    (in ``cfg.dtype``); ``(0, 0)`` at TP=1 (C1)."""
    # d_ffn = 3 x d_model: a 4-byte guess in bfloat16 (N x d_model x 4) is not N x d_ffn x 2 by chance
    bf16 = ModelConfig(n_layers=3, d_model=64, n_heads=4, d_head=16, d_ffn=192, vocab_size=50, max_position=64,
                       dtype=torch.bfloat16)
    cases = [(_SMALL_CFGS[0], 10, 2), (_SMALL_CFGS[0], 111, 4), (bf16, 7, 2), (_SMALL_CFGS[1], 9, 3),
             (_SMALL_CFGS[0], 5, 1)]

    def judge(got, cfg, n, tp):
        trace = record_trace(cfg, [n], 0, tp)  # the model's own code on a recording stand-in for rank 0
        want = (len(trace), trace[0].bytes if trace else 0)
        got, problem = int_tuple(got, "count, bytes_each")
        if problem or got == want:
            return problem
        size = cfg.dtype.itemsize
        hint = ""
        if tp == 1:
            hint = (" - with one rank there is nobody to add partial sums with: the row-parallel layer already "
                    "holds its whole input, so its output is complete and nothing is all-reduced")
        elif got[0] == 16 and want[0] != 16:
            hint = (f" - 16 is the article's model (8 layers); count from cfg: two per layer, this config has "
                    f"{cfg.n_layers} layers")
        elif got[0] == cfg.n_layers:
            hint = " - two per layer: after the attention out proj and after FFN-down"
        elif got[1] * tp == want[1]:
            hint = (" - the payload does not shrink with TP: each rank all-reduces a full [N, d_model] partial sum, "
                    "not a 1/tp slice")
        elif got[1] == n * cfg.d_model:
            hint = f" - bytes, not elements: {cfg.dtype} has {size} bytes per element"
        elif got[1] in (n * cfg.d_model * s for s in (2, 4, 8) if s != size):
            hint = (f" - {cfg.dtype} has {size} bytes per element: take the itemsize from cfg.dtype "
                    "(torch.empty((), dtype=cfg.dtype).element_size())")
        elif got[1] in (n * cfg.d_ffn * size, n * cfg.d_ffn * size // tp):
            hint = " - the all-reduce carries the row-parallel layer's OUTPUT, [N, d_model], not its input"
        return f"got {got}, expected {want} (TP={tp}){hint}"
    return grade("all_reduce_traffic", fn, cases, judge,
                 "2 x n_layers all-reduces of N x d_model x itemsize bytes at TP >= 2, none at TP=1, on 5 cases")
