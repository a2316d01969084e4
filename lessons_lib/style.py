"""One look for every figure: a colour-blind-safe palette where each colour means one thing.

Okabe–Ito colours, and the same meaning in every lesson:

==========  =========  ==============================================================
name        colour     means
==========  =========  ==============================================================
REQUEST     orange     a request's tokens (neighbours alternate two shades)
ATTENTION   blue       attention work: a useful score cell, attention FLOPs or time
LINEAR      green      linear-layer work: rows through QKV, out proj, FFN; their FLOPs
WASTE       vermillion computed, then thrown away: pad rows and cells, masked cells
COMM        purple     communication: an all-reduce
OTHER       grey       a fill only: work that is not attention, a linear layer or communication
                       (LayerNorm, GeLU, the residual add, copies, reading cached K/V, a launch's host cost)
NEVER       white      never computed (refused, returned early, empty: white with a hatch or an ink outline)
TEXT        ink        text, outlines, guide and reference lines (told apart by line style), never a meaning
==========  =========  ==============================================================

Shared by the lessons' figures (``course``) and the benchmark's plots (``measure.bench_report``), so it
sits beside them rather than in either. Text is at least ``MIN_FONT`` = 9 pt. Also here: PNG rendering (byte-reproducible) and the
drawing pieces several lessons share (the token strip, ``cu_seqlens`` ticks, a measured series).
"""
from __future__ import annotations

import io
import string
from collections.abc import Mapping, Sequence

from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .core.batch import cumulative
from .validate import check_lengths

REQUEST = ("#E69F00", "#F6CB73")
ATTENTION = "#0072B2"
LINEAR = "#009E73"
WASTE = "#D55E00"
COMM = "#CC79A7"
OTHER = "#999999"
NEVER = "#FFFFFF"
TEXT = "#222222"
MIN_FONT = 9

# Score-cell categories of the attention pictures, and their colours.
SKIPPED, USEFUL, WASTED = 0, 1, 2
CELL_COLORS = {SKIPPED: NEVER, USEFUL: ATTENTION, WASTED: WASTE}
CELL_LABELS = {SKIPPED: "never computed", USEFUL: "useful", WASTED: "computed, thrown away"}
CELL_CMAP = ListedColormap([CELL_COLORS[SKIPPED], CELL_COLORS[USEFUL], CELL_COLORS[WASTED]])


def request_name(i: int) -> str:
    """A, B, ..., Z, then R26, R27, ... (the article calls its requests A and B)."""
    return string.ascii_uppercase[i] if i < 26 else f"R{i}"

def request_color(i: int) -> str:
    """Request i's colour: orange, in two shades that alternate so that neighbours stand apart."""
    return REQUEST[i % 2]

def to_png(fig: Figure, dpi: int = 100, metadata: Mapping | None = None) -> bytes:
    """Render a figure to PNG bytes (Agg). ``metadata`` defaults to none at all, so the bytes
    do not carry matplotlib's version string."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata=dict(metadata) if metadata is not None else {"Software": None})
    return buf.getvalue()

def show(fig: Figure, dpi: int = 100):
    """An ``IPython.display.Image`` of the figure: the last expression of a notebook cell."""
    from IPython.display import Image
    return Image(data=to_png(fig, dpi))

def draw_strip(ax, lens: list[int], y: float = 0.0, height: float = 1.0, label_requests: bool = True) -> None:
    """One row of T cells coloured by request, boundaries at ``cu_seqlens``."""
    cu = cumulative(lens)
    for i, n in enumerate(lens):
        ax.add_patch(Rectangle((cu[i], y), n, height, facecolor=request_color(i), edgecolor="white", linewidth=0.5))
        if label_requests and n >= max(1, cu[-1] // 40):
            ax.text(cu[i] + n / 2, y + height / 2, request_name(i), ha="center", va="center", color=TEXT,
                    fontsize=MIN_FONT, fontweight="bold")
    if cu[-1] <= 80:  # token separators, only where they stay readable
        ax.vlines(range(1, cu[-1]), y, y + height, colors="white", linewidth=0.3)

def cu_ticks(ax, cu: list[int], max_labels: int = 24) -> None:
    shown = cu if len(cu) <= max_labels else cu[:: max(1, len(cu) // max_labels)] + [cu[-1]]
    ax.set_xticks(sorted(set(shown)))
    ax.tick_params(axis="x", labelsize=MIN_FONT)

def token_strip(seq_lens: Sequence[int], title: str | None = None) -> Figure:
    """The flat batch of claim C3: T tokens in one row, coloured by request, ``cu_seqlens`` as ticks.

    One ``Rectangle`` per request; x ticks are exactly the ``cu_seqlens`` values (when at most 24).
    """
    lens = check_lengths(seq_lens)
    cu = cumulative(lens)
    fig = Figure(figsize=(8, 1.9))
    ax = fig.add_subplot()
    draw_strip(ax, lens)
    ax.set_xlim(0, cu[-1])
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    cu_ticks(ax, cu)
    ax.set_xlabel("flat row (token index); ticks at cu_seqlens = " + (str(cu) if len(cu) <= 12 else "[...]"))
    ax.set_title(title or f"flat batch: [{cu[-1]} x d], {len(lens)} requests, no padding, no batch dimension",
                 fontsize=10)
    fig.subplots_adjust(left=0.03, right=0.97, bottom=0.33, top=0.82)
    return fig

# What a measured series of a method is drawn in: its meaning (masked and padded compute waste).
METHOD_COLORS = {"varlen": ATTENTION, "masked": WASTE, "padded": WASTE, "linear": LINEAR, "attention": ATTENTION}
_MARKERS = ("o-", "s--", "^:", "d-.")


def measured_series(x: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str, ylabel: str,
                    title: str, logx: bool = True, logy: bool = True) -> Figure:
    """A line plot of measured numbers (times, bytes) side by side; a series named after a method
    takes that method's colour (``METHOD_COLORS``), any other is ink; markers tell them apart."""
    fig = Figure(figsize=(6, 3.4))
    ax = fig.add_subplot()
    for i, (name, ys) in enumerate(series.items()):
        ax.plot(list(x), list(ys), _MARKERS[i % len(_MARKERS)], color=METHOD_COLORS.get(name, TEXT), label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=MIN_FONT, frameon=False)
    ax.set_title(title, fontsize=9)
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.15, top=0.9)
    return fig

def short_lens(lens: list[int]) -> str:
    return str(lens) if len(lens) <= 8 else f"[{', '.join(map(str, lens[:6]))}, ...] (R={len(lens)})"
