"""What lesson 03 (masked vs varlen attention, notebooks/03_masked_vs_varlen_attention.ipynb) measures, draws,
explores and checks:

- measured: ``attention_dependency`` (who reads whom, C7, C10), ``kernel_work`` (the engine's Triton kernel's own
  counters beside ``tiling.predict_work``, C10);
- drawn: ``attention_patterns``, the padded, masked and varlen score matrices with one colour per cell category of
  ``attention_categories`` (C2, C8, C10); ``masked_growth``, ``measured_sweep`` (C9); ``tile_grid``, the 128-row tile;
- the attention-run explorer (``attention_run_state`` + ``attention_run_explorer``): the engine's loop, masked,
  padded and varlen backends run on the learner's lengths under ``OpRecorder``; the checkers of exercises 03.1-03.3.
"""
from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Polygon, Rectangle
from matplotlib.ticker import MaxNLocator

from .. import faults
from ..core.attention import attention_ref, block_diag_mask, dense_attention, plain_attention, varlen_attention
from ..core.batch import cumulative, pack, seq_lens_to_cu_seqlens
from ..core.config import ModelConfig
from ..core.kernels import resolve_backend
from ..core.model import Transformer
from ..measure.flops import METHODS, AttentionWaste, attention_cell_grid, attention_cells, attention_waste
from ..measure.kernel_runs import kernel_missing, kernel_qkv, run_kernel
from ..measure.profile import attention_calls, cpu_threads, random_qkv, record_attention, recorded_cells, time_call
from ..measure.recorder import OpRecorder
from ..measure.tolerance import float64_twin, max_abs_diff, tolerance
from ..ops.tiling import cdiv, key_tiles, predict_work
from ..style import CELL_CMAP, CELL_COLORS, CELL_LABELS, MIN_FONT, NEVER, SKIPPED, TEXT, USEFUL, WASTE, WASTED, short_lens
from ..validate import check_int, check_lengths, is_int, lengths
from .explore import explorer, html_table, ipywidgets_module, parse_lengths, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import Tensor, grade, matches, tensor_problem
from .probe import row_dependency

# at import: on a CPU it sets TRITON_INTERPRET before anything else imports Triton (torch.profiler does)
KERNEL_MISSING = kernel_missing()

# ---- claims helpers: what the engine computes, measured ---------------------------------------------

def attention_dependency(seq_lens: Sequence[int], backend: str | None = "loop", causal: bool = True, seed: int = 0) -> Tensor:
    """Bool ``[T, T]``, measured with ``probe.row_dependency``: True where output row i of attention
    changes when input row j does. Each row's q, k and v (one head of 8) are cut from its 24 numbers.
    ``backend=None``: plain attention over all T rows as one sequence (no ``cu_seqlens``)."""
    lens = check_lengths(seq_lens)
    cu = seq_lens_to_cu_seqlens(lens)
    x = torch.randn(sum(lens), 24, generator=torch.Generator().manual_seed(seed))

    def attend(t):                                              # [T, 24] -> [T, 1, 8]
        q, k, v = (t[:, i:i + 8].reshape(-1, 1, 8) for i in (0, 8, 16))
        if backend is None:
            return plain_attention(q, k, v, causal=causal)
        return varlen_attention(q, k, v, cu, causal=causal, backend=backend)

    return row_dependency(attend, x)


def kernel_work(seq_lens: Sequence[int], tile: int, causal: bool = True, seed: int = 0):
    """``kernel_runs.run_kernel``'s counters for one launch on ``kernel_runs.kernel_qkv``'s q, k, v for ``seq_lens``
    (one head of 64, ``tile x tile`` tiles; on a CPU Triton's interpreter runs each program in NumPy: keep the
    lengths to a few tiles), beside ``tiling.predict_work``'s for the same launch: ``(counted, predicted)``, two
    ``tiling.WorkCounts``, or ``(None, why)`` where the kernel does not run."""
    lens = check_lengths(seq_lens)
    if KERNEL_MISSING:
        return None, KERNEL_MISSING
    _, counted = run_kernel(*kernel_qkv(lens, 1, 64, seed=seed), causal=causal, block_m=tile, block_n=tile)
    return counted, predict_work(lens, n_heads=1, block_m=tile, block_n=tile, causal=causal)


# ---- the three pictures -----------------------------------------------------------------------------

def attention_categories(seq_lens: Sequence[int], method: str, causal: bool = False, whole_blocks: bool = False) -> np.ndarray:
    """``flops.attention_cell_grid`` as one code per cell (SKIPPED, USEFUL, WASTED), ``uint8 [n, n]``."""
    useful, computed = attention_cell_grid(seq_lens, method, causal, whole_blocks)
    return np.where(useful, USEFUL, np.where(computed, WASTED, SKIPPED)).astype(np.uint8)


CAUSAL_VARLEN_TITLES = {True: "varlen: our loop\n(whole blocks, upper half masked)",
                        False: "varlen: ideal causal kernel\n(no masked cell computed)"}  # by whole_blocks


def waste_text(w: AttentionWaste, method: str, causal: bool) -> str:
    """``flops.attention_waste``'s wasted cells in words, e.g. ``wasted 1280 = above the diagonal 480 + pad 800``:
    masked above the causal diagonal (causal only) apart from the cells outside the requests' blocks, named for the
    method (padding's pad cells, masking's cross-request cells)."""
    outside = {"padded": "pad", "masked": "cross-request"}.get(method, "outside the blocks")
    diagonal = f"above the diagonal {w.causal} + " if causal else ""
    return f"wasted {w.causal + w.outside} = {diagonal}{outside} {w.outside}"


def _draw_attention(ax, lens: list[int], method: str, causal: bool, whole_blocks: bool, title: str) -> None:
    grid = attention_categories(lens, method, causal, whole_blocks)
    lmax, n = max(lens), len(grid)  # n x n cells: padded's R·Lmax rows, the flat T rows
    ax.imshow(grid, cmap=CELL_CMAP, vmin=0, vmax=2, interpolation="nearest", extent=(0, n, n, 0))
    for side in ax.spines.values():  # a frame, so that never-computed (white) cells have an edge
        side.set_visible(True)
    if method == "padded":  # R separate [Lmax x Lmax] matrices: a frame each, ticks per request
        for i in range(len(lens)):
            ax.add_patch(Rectangle((i * lmax, i * lmax), lmax, lmax, fill=False, edgecolor=TEXT, linewidth=1.4,
                                   gid=f"padded-matrix-{i}"))
        ticks = [(i + 0.5) * lmax for i in range(len(lens))] if len(lens) <= 4 else []
        ax.set_xticks(ticks, [f"req {i}" for i in range(len(ticks))])
        ax.set_yticks(ticks, [f"req {i}" for i in range(len(ticks))])
        ax.set_xlabel(f"{len(lens)} separate {lmax} x {lmax} matrices", fontsize=MIN_FONT)
    else:
        edges = cumulative(lens)
        for e in edges[1:-1]:
            ax.axhline(e, color=TEXT, linewidth=0.6, linestyle=":")
            ax.axvline(e, color=TEXT, linewidth=0.6, linestyle=":")
        ticks = edges if len(edges) <= 6 else []
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
        ax.set_xlabel("key row (flat)", fontsize=MIN_FONT)
    ax.tick_params(labelsize=MIN_FONT, length=2)
    w = attention_waste(lens, method, causal, whole_blocks)
    waste = waste_text(w, method, causal).replace(" + ", " +\n")  # two lines: it fits a panel's width
    ax.set_title(f"{title}\ncomputed {w.computed} | useful {w.useful}\n{waste}", fontsize=MIN_FONT)


@register("03_attention_patterns", lesson="03",
          caption="padded, masked and varlen score cells per head per layer for A, B, whole blocks: "
                  "1800/1600/1000 computed, 1000 useful (C2, C8, C10)")
def attention_patterns(seq_lens: Sequence[int] = ARTICLE_LENS, causal: bool = False) -> Figure:
    """The pictures of claims C2, C8, C10, one axis per panel, the cell counts per head per layer in each title.

    ``causal=False``: whole blocks (the article's pictures). ``causal=True``: only each block's lower triangle is
    useful, and varlen is drawn twice: the engine's loop (whole blocks) and an ideal causal kernel.
    """
    lens = check_lengths(seq_lens)
    panels = [(m, wb) for m in METHODS for wb in ((True, False) if causal and m == "varlen" else (False,))]
    fig = Figure(figsize=(3.4 * len(panels) + 0.6, 4.6))
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (method, whole) in zip(axes, panels):
        title = CAUSAL_VARLEN_TITLES[whole] if causal and method == "varlen" else method
        _draw_attention(ax, lens, method, causal, whole, title)
    axes[0].set_ylabel("query row", fontsize=MIN_FONT)
    fig.legend(handles=[Patch(facecolor=CELL_COLORS[k], edgecolor=TEXT, label=CELL_LABELS[k])
                        for k in (USEFUL, WASTED, SKIPPED)], loc="lower center", ncol=3, fontsize=MIN_FONT, frameon=False)
    kind = ("causal: only each block's lower triangle is useful" if causal
            else "whole blocks, no causal mask (the article's pictures)")
    fig.suptitle(f"score cells per head per layer, lengths {short_lens(lens)}\n{kind}", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.17, top=0.68, wspace=0.4)
    return fig


register("03_causal_patterns", lesson="03",
         caption="the same with the model's causal mask: 520 of the 1000 whole-block cells are useful; the engine's "
                 "loop computes the 1000 and masks 480; an ideal cell-by-cell causal kernel would compute the 520 "
                 "(a tiled kernel computes whole tiles: 128 x 128 drawn in this lesson, 64 x 64 in lesson 07) (C8, C10)")(
    functools.partial(attention_patterns, causal=True))


def _r_axis(ax, length: int, ylabel: str) -> None:
    """Log-log axes over the number of requests R, each of ``length`` tokens."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"number of requests R (each L = {length} tokens)", fontsize=MIN_FONT + 1)
    ax.set_ylabel(ylabel, fontsize=MIN_FONT + 1)
    ax.tick_params(labelsize=MIN_FONT)


@register("03_masked_growth", lesson="03", caption="masked computes (R L)^2 cells, varlen R L^2, per head per layer (C9)")
def masked_growth(length: int = 64, num_requests: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> Figure:
    """Claim C9: cells computed by masked attention, ``(R·L)²``, against the useful ``R·L²``."""
    rs = list(num_requests)
    masked = [attention_cells([length] * r, "masked").computed for r in rs]
    useful = [attention_cells([length] * r, "varlen").computed for r in rs]
    fig = Figure(figsize=(6.4, 3.8))
    ax = fig.add_subplot()
    ax.fill_between(rs, useful, masked, color=WASTE, alpha=0.35, linewidth=0, label="masked's waste (R² − R)·L²")
    ax.plot(rs, masked, "o-", color=TEXT, label="masked computes (R·L)²")
    ax.plot(rs, useful, "s--", color=TEXT, label="varlen computes R·L² (all useful)")
    _r_axis(ax, length, "score cells per head per layer")
    ax.legend(fontsize=MIN_FONT + 1, frameon=False)
    ax.set_title(f"score cells per head per layer (whole blocks),\nR requests of {length} tokens each", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.15, right=0.97, bottom=0.15, top=0.86)
    return fig


def measured_sweep(rs: Sequence[int], runs: dict, length: int, where: str) -> Figure:
    """``profile.sweep_attention``'s runs of masked and one varlen backend as R grows: time and peak memory, each beside
    slope-2 and slope-1 guides drawn at half the last point (shown in the lesson, never asserted)."""
    (_, masked), (varlen_name, varlen) = runs.items()
    fig = Figure(figsize=(9.6, 4.4))
    axes = fig.subplots(1, 2)
    for ax, key, ylabel in zip(axes, ("ms", "mib"), ("ms per call (fastest of several)", "peak memory of one call (MiB)")):
        ax.plot(list(rs), masked[key], "o-", color=TEXT, label="masked (full T x T scores)")
        ax.plot(list(rs), varlen[key], "s-.", color=TEXT, label=f"varlen ({varlen_name})")
        for slope, ys, style in ((2, masked[key], (0, (6, 3))), (1, varlen[key], (0, (3, 3)))):
            x0, y0 = rs[-1], ys[-1] / 2
            ax.plot(list(rs), [y0 * (r / x0) ** slope for r in rs], color=TEXT, linewidth=0.8, linestyle=style,
                    label=f"guide, slope {slope} (grows like R{'²' if slope == 2 else ''}), drawn at half")
        _r_axis(ax, length, ylabel)
        ax.set_xticks(list(rs), [str(r) for r in rs])
    # one legend for both panels, below them, so that no line runs through its text
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=MIN_FONT, frameon=False)
    axes[0].set_title("time: noisy on a shared machine", fontsize=MIN_FONT + 1)
    axes[1].set_title("memory: the same on every run", fontsize=MIN_FONT + 1)
    fig.suptitle(f"one attention call, 8 heads of 64, measured on {where}", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.29, top=0.86, wspace=0.3)
    return fig


# ---- the 128-row tile -------------------------------------------------------------------------------

def _draw_tiles(ax, n: int, tile: int, x0: float = 0.0) -> int:
    """One request of ``n`` tokens on a ``tile x tile`` grid at ``x0``: computed tiles vermillion (computed, then
    masked and thrown away, as in the causal picture) with an ink edge, skipped tiles white with an ink hatch, the
    cells the causal mask keeps blue on top, the request's end a dashed ink line. Returns the grid's side (``n`` up
    to whole tiles)."""
    side = cdiv(n, tile) * tile
    for m in range(0, n, tile):
        computed, _ = key_tiles(n, n, m, tile, tile, causal=True)
        for j in range(side // tile):
            done = j < computed
            ax.add_patch(Rectangle((x0 + j * tile, m), tile, tile, facecolor=WASTE if done else NEVER,
                                   edgecolor=TEXT, linewidth=0.8,
                                   hatch=None if done else "///", gid="tile-computed" if done else "tile-skipped"))
    ax.add_patch(Polygon([(x0, 0), (x0, n), (x0 + n, n)], closed=True, facecolor=CELL_COLORS[USEFUL], edgecolor="none",
                         gid="cells-kept"))
    for t in range(0, side + 1, tile):  # the tile grid, in ink
        ax.plot([x0 + t, x0 + t], [0, side], color=TEXT, linewidth=0.8)
        ax.plot([x0, x0 + side], [t, t], color=TEXT, linewidth=0.8)
    if n < side:
        ax.plot([x0 + n, x0 + n], [0, side], color=TEXT, linewidth=1.0, linestyle="--")
        ax.plot([x0, x0 + side], [n, n], color=TEXT, linewidth=1.0, linestyle="--")
    return side


@register("03_tile_grid", lesson="03",
          caption="128 x 128 tiles: A's and B's blocks each inside one whole tile (2 tiles, 32,768 cells executed), "
                  "the thrown-away cells of computed tiles (above the diagonal or past the request's end) in vermillion, "
                  "and a 1000-token causal request whose 28 tiles wholly above the diagonal are skipped "
                  "(tiling.predict_work)")
def tile_grid(tile: int = 128, short: Sequence[int] = ARTICLE_LENS, long: int = 1000) -> Figure:
    """The 128-row tile of a FlashAttention-style kernel: A's and B's blocks each inside one whole tile, and a
    ``long``-token causal request on its tile grid with the tiles wholly above the diagonal skipped. Counts in the
    titles from ``tiling.predict_work`` (one head)."""
    lens = check_lengths(short)
    n_long = check_int("long", long, 1)
    ws, wl = (predict_work(x, n_heads=1, block_m=tile, block_n=tile, causal=True) for x in (lens, [n_long]))
    fig = Figure(figsize=(9.6, 4.6))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [len(lens), 2.2]})
    for i, n in enumerate(lens):
        _draw_tiles(left, n, tile, x0=i * (tile + tile // 4))
    left.set_xlim(-4, len(lens) * (tile + tile // 4) - tile // 4 + 4)
    left.set_ylim(tile + 4, -4)
    left.set_xticks([i * (tile + tile // 4) + tile / 2 for i in range(len(lens))],
                    [f"request of {n}" for n in lens], fontsize=MIN_FONT)
    left.set_yticks([0, tile])
    left.set_title(f"lengths {short_lens(lens)}: {ws.tiles} tiles computed,\n{ws.executed_cells} cells executed "
                   f"for {attention_cells(lens, 'varlen', causal=True).useful} kept", fontsize=MIN_FONT + 1)
    side = _draw_tiles(right, n_long, tile)
    right.set_xlim(-8, side + 8)
    right.set_ylim(side + 8, -8)
    right.set_xticks(range(0, side + 1, 2 * tile))
    right.set_yticks(range(0, side + 1, 2 * tile))
    right.set_title(f"one request of {n_long}: {wl.tiles} tiles computed,\n{wl.tiles_skipped} of "
                    f"{wl.tiles + wl.tiles_skipped} skipped (wholly above the diagonal)", fontsize=MIN_FONT + 1)
    for ax in (left, right):
        ax.set_aspect("equal")
        ax.tick_params(labelsize=MIN_FONT, length=2)
        ax.set_xlabel("key position", fontsize=MIN_FONT)
    left.set_ylabel("query position", fontsize=MIN_FONT)
    fig.legend(handles=[Patch(facecolor=CELL_COLORS[USEFUL], edgecolor=TEXT, label="computed tile: cells the causal mask keeps"),
                        Patch(facecolor=WASTE, edgecolor=TEXT,
                              label="computed tile: cells thrown away (above the diagonal or past the end)"),
                        Patch(facecolor=NEVER, edgecolor=TEXT, hatch="///", label="skipped tile"),
                        Line2D([], [], color=TEXT, linewidth=1.0, linestyle="--", label="request's end")],
               loc="lower center", ncol=2, fontsize=MIN_FONT, frameon=False)
    fig.suptitle(f"a tiled kernel ({tile} x {tile} tiles, one head, causal) computes whole tiles", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.21, top=0.8, wspace=0.25)
    return fig


# ---- the attention-run explorer: the engine's backends on the learner's lengths ------------------------

RUN_BACKENDS = ("loop", "masked", "padded", "varlen")
RUN_MAX_REQUESTS, RUN_MAX_LENGTH, RUN_MAX_TOKENS = 16, 512, 1024
RUN_HEADS, RUN_D_HEAD, RUN_TILE, RUN_REPEATS = 8, 64, 128, 2
RUN_DEFAULT = "10, 30"


def run_lengths(lengths) -> list[int]:
    """The explorer's lengths from ``"10, 30, 5"`` or a list of ints: at most ``RUN_MAX_REQUESTS`` requests of
    1..``RUN_MAX_LENGTH`` tokens, ``RUN_MAX_TOKENS`` in all (masked attention stores ``T x T`` scores per head:
    past 1024 rows one call takes seconds on a small CPU)."""
    text = lengths if isinstance(lengths, str) else ", ".join(str(n) for n in check_lengths(lengths))
    lens = parse_lengths(text, max_requests=RUN_MAX_REQUESTS, max_length=RUN_MAX_LENGTH)
    if sum(lens) > RUN_MAX_TOKENS:
        raise ValueError(f"lengths: at most {RUN_MAX_TOKENS} tokens in all (the masked backend stores T x T scores "
                         f"per head), got T = {sum(lens)}; use shorter or fewer requests")
    return lens


def attention_run_state(lengths=RUN_DEFAULT, causal: bool = True) -> dict:
    """Each of ``RUN_BACKENDS`` run once by ``profile.record_attention`` on ``random_qkv`` (8 heads of 64, float32, 1 CPU thread).

    Returns ``{"seq_lens", "causal", "useful", "in_blocks", "bound", "wasted", "causal_masked", "tiled", "rows"}``;
    ``rows[name]``: ``{"backend", "cells"`` (per head, recorded; sdpa: handed in), ``"predicted"``
    (``flops.attention_waste(..., whole_blocks=True)``: masked and padded their whole matrices, the loop and sdpa
    the requests' whole blocks, their upper triangles masked inside or handed with ``is_causal``), ``"scores"``
    (score matrices made), ``"largest_bytes"`` (the largest score tensor handed to a softmax; None: a fused
    kernel), ``"error"`` (max |out - fp64 reference|, against ``bound``), ``"ms"`` (fastest of ``RUN_REPEATS``;
    noisy, never asserted)``}``. ``in_blocks``: the loop's cells, the requests' own blocks; ``wasted["masked" |
    "padded"]``: the cells each computed outside them; ``causal_masked``: ``in_blocks - useful``, above the causal
    diagonal; ``tiled``: ``tiling.predict_work`` for 128 x 128 tiles, one head.
    """
    lens = run_lengths(lengths)
    causal = bool(causal)
    q, k, v, cu = random_qkv(lens, RUN_HEADS, RUN_D_HEAD, seed=0)
    rows = {}
    with cpu_threads(1):  # steadier times, and the same rounding in every process
        ref, ref64 = (attention_ref(q, k, v, cu, causal=causal, upcast_dtype=t) for t in (torch.float32, torch.float64))
        for name in RUN_BACKENDS:
            backend = resolve_backend("auto", "cpu", torch.float32, RUN_D_HEAD) if name == "varlen" else name
            seen = record_attention(q, k, v, cu, backend, causal)
            call = functools.partial(varlen_attention, q, k, v, cu, causal=causal, backend=backend)
            method = name if name in ("masked", "padded") else "varlen"
            rows[name] = {"backend": backend, "cells": seen.cells,
                          "predicted": attention_waste(lens, method, causal, whole_blocks=True).computed,
                          "scores": seen.scores, "largest_bytes": seen.largest_bytes,
                          "error": max_abs_diff(seen.out, ref64), "ms": time_call(call, repeats=RUN_REPEATS, warmup=0) * 1e3}
    useful, in_blocks = attention_cells(lens, "varlen", causal).useful, rows["loop"]["cells"]
    return {"seq_lens": lens, "causal": causal, "useful": useful, "in_blocks": in_blocks, "bound": tolerance(ref, ref64),
            "rows": rows, "wasted": {name: rows[name]["cells"] - in_blocks for name in ("masked", "padded")},
            "causal_masked": in_blocks - useful,
            "tiled": predict_work(lens, n_heads=1, block_m=RUN_TILE, block_n=RUN_TILE, causal=causal)}


def _kib(nbytes: int | None) -> str:
    if nbytes is None:
        return "no full score matrix (fused kernel)"
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes / 1024:.1f} KiB"


def run_label(state: dict, name: str) -> str:
    return {"loop": "loop (one call per request)", "varlen": f"varlen ({state['rows'][name]['backend']})"}.get(name, name)


RUN_COLUMNS = ("backend", "cells computed (sdpa: handed in)", "predicted", "score matrices", "largest stored", "max err vs fp64",
               "ms (this CPU)")


def attention_run_html(state: dict) -> str:
    """A ``<table>``: a header row of ``RUN_COLUMNS``, then one row per backend, e.g. ``loop (one call per
    request) | 1000 | 1000 | 2 | 28.1 KiB | 6.87e-07 | 0.16``."""
    return html_table(RUN_COLUMNS, [(run_label(state, name), r["cells"], r["predicted"], r["scores"], _kib(r["largest_bytes"]),
                                     f"{r['error']:.2e}", f"{r['ms']:.2f}") for name, r in state["rows"].items()])


def attention_run_summary_html(state: dict) -> str:
    """What the rows are measured against (useful cells, error bound, the tiled kernel's prediction), then which of
    masking and padding wastes more outside the requests' blocks; with the causal mask, the cells above the
    diagonal inside the blocks, and what the loop masked against what sdpa was handed."""
    lens, t, m, p = state["seq_lens"], state["tiled"], state["wasted"]["masked"], state["wasted"]["padded"]
    mask = "the causal mask keeps" if state["causal"] else "useful (whole blocks)"
    verdict = "a tie" if m == p else f"{'masking' if m > p else 'padding'} wastes more here"
    html = (f"<div>lengths {lens} | T = {sum(lens)} rows | {RUN_HEADS} heads of {RUN_D_HEAD}, float32 | cells per head | "
            f"{mask}: {state['useful']} | error bound {state['bound']:.2e} | time: this CPU, one thread, fastest of "
            f"{RUN_REPEATS} calls, noisy</div><div>a tiled kernel (128 x 128 tiles, predicted by tiling.predict_work, "
            f"not run here): {t.tiles} tiles, {t.executed_cells} cells executed, {t.cells} in-bounds cells of computed tiles"
            f"</div><div>measured waste outside the requests' blocks (cells computed minus the loop's {state['in_blocks']}): "
            f"masked {m} cross-request cells, padded {p} pad cells per head: {verdict}</div>")
    if not state["causal"]:
        return html
    loop, fused = state["rows"]["loop"], state["rows"]["varlen"]
    return html + (f"<div>not in that waste: the {state['causal_masked']} cells per head above the causal diagonal "
                   "inside the blocks, computed and masked by loop, masked and padded alike: the causal mask's cost, "
                   f"not padding's or masking's</div><div>causal: the loop computed {loop['cells']} cells and masked "
                   f"{loop['cells'] - state['useful']} of them; {fused['backend']} was handed {fused['cells']} cells "
                   "with is_causal, and its CPU kernel stops each query block at the diagonal's key block: what it "
                   "executes is not visible from Python</div>")


def attention_run_predicted_html(state: dict) -> str:
    """``flops.attention_waste`` for the three ways, one ``<div>`` each (``padded: computed 1800 | useful 520 |
    wasted 1280 = above the diagonal 480 + pad 800``): the causal mask's cells apart from padding's and masking's;
    with the causal mask the varlen line is an ideal kernel that computes no masked cell."""
    lens, causal = state["seq_lens"], state["causal"]
    rows = ["<div>flops.attention_waste predicts, for the three ways:</div>"]
    for m in METHODS:
        note = " (an ideal causal kernel: no backend here computes this little)" if causal and m == "varlen" else ""
        w = attention_waste(lens, m, causal)
        rows.append(f"<div>{m}: computed {w.computed} | useful {w.useful} | {waste_text(w, m, causal)}{note}</div>")
    return "".join(rows)


def attention_run_figure(state: dict) -> Figure:
    """Score cells per head of each backend, stacked on a linear axis: useful, thrown away above the causal
    diagonal (cross-hatched), thrown away outside the blocks; a fused kernel's bar (sdpa) white and hatched: what
    it was handed, not what it executed. Beside each bar: the largest score tensor stored and the time."""
    rows = list(state["rows"].values())
    useful = state["useful"]
    fig = Figure(figsize=(8.4, 3.6))
    ax = fig.add_subplot()
    for i, r in enumerate(rows):
        if r["largest_bytes"] is None:  # fused: the recorder read the cells it was handed
            ax.barh(i, r["cells"], color=NEVER, edgecolor=TEXT, hatch="///", linewidth=0.8,
                    label="handed to a fused kernel (what it executes is not visible)")
        else:
            ax.barh(i, useful, color=CELL_COLORS[USEFUL], label=CELL_LABELS[USEFUL])
            if state["causal_masked"]:
                ax.barh(i, state["causal_masked"], left=useful, color=CELL_COLORS[WASTED], edgecolor=TEXT, hatch="\\\\",
                        linewidth=0.5, label="thrown away: above the causal diagonal")
            ax.barh(i, max(r["cells"] - state["in_blocks"], 0), left=state["in_blocks"], color=CELL_COLORS[WASTED],
                    label="thrown away: outside the blocks (cross or pad)")
        ax.text(r["cells"], i, f" {r['cells']}", va="center", fontsize=MIN_FONT)
        stored = "no full score matrix" if r["largest_bytes"] is None else f"stores {_kib(r['largest_bytes'])}"
        ax.text(1.02, i, f"{stored}, {r['ms']:.2f} ms", va="center", fontsize=MIN_FONT,
                transform=ax.get_yaxis_transform())
    ax.set_xlim(0, max(r["cells"] for r in rows) * 1.2)
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.set_yticks(range(len(rows)), [run_label(state, n) for n in state["rows"]], fontsize=MIN_FONT)
    ax.invert_yaxis()
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_xlabel(f"score cells per head (OpRecorder), linear; useful: {useful}", fontsize=MIN_FONT)
    handles, labels = ax.get_legend_handles_labels()
    keep = dict(zip(labels, handles))
    fig.legend(keep.values(), keep.keys(), fontsize=MIN_FONT, loc="lower center", ncol=2, frameon=False)
    kind = "causal" if state["causal"] else "no causal mask"
    tiled = state["tiled"]
    ax.set_title(f"score cells per head, lengths {short_lens(state['seq_lens'])} ({kind}); right: largest score "
                 f"tensor stored, time on this CPU\na 128 x 128 tiled kernel would execute {tiled.executed_cells} "
                 f"cells in {tiled.tiles} tiles", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.22, right=0.74, bottom=0.25, top=0.84)
    return fig


def attention_run_explorer(lengths: str = RUN_DEFAULT, causal: bool = True):
    """VBox class ``arx``: Text ``arx-lengths`` (Enter to run), Checkbox ``arx-causal``; HTML ``arx-status``
    (running / the error for bad input), HTML ``arx-summary`` (lengths, useful cells, bound, tiled kernel),
    HTML ``arx-rows`` (one line per backend), HTML ``arx-predicted`` (``flops.attention_waste`` of the three ways;
    also class ``dbx-counts``, the name the site test reads), Output ``arx-figure`` (measured cells per backend)."""
    w = ipywidgets_module()
    text = tagged(w.Text(value=lengths, description="lengths", continuous_update=False), "arx-lengths")
    causal_box = tagged(w.Checkbox(value=causal, description="causal"), "arx-causal")
    status, summary, rows = tagged(w.HTML(), "arx-status"), tagged(w.HTML(), "arx-summary"), tagged(w.HTML(), "arx-rows")
    predicted = tagged(tagged(w.HTML(), "arx-predicted"), "dbx-counts")
    out = tagged(w.Output(), "arx-figure")

    def update(change=None):
        status.value = "<div>running the four backends ...</div>"
        try:
            state = attention_run_state(text.value, causal_box.value)
        except ValueError as exc:
            status.value = f"<div>not run: {exc} (the numbers below are still those of the last input that ran)</div>"
            return
        summary.value = attention_run_summary_html(state)
        rows.value = attention_run_html(state)
        predicted.value = attention_run_predicted_html(state)
        show_figure(out, attention_run_figure(state))
        status.value = f"<div>ran on lengths {state['seq_lens']}, causal {state['causal']}</div>"

    return explorer("arx", [text, causal_box], [status, summary, rows, predicted, out], update)


# ---- exercises -------------------------------------------------------------------------------------------

def _where_wrong(got: Tensor, want: Tensor, cu: list[int], max_seqlen: int) -> str:
    """Where the first wrong row is; and when a gathered slot past an earlier request's end (row ``cu[j] + p``,
    ``p >= L_j``, clamped to the last row) lands on it, that a pad query's output was written back over it."""
    bad = ((got.double() - want.double()).abs() > 1e-4) | ~torch.isfinite(got)
    rows = bad.flatten(1).any(dim=1).nonzero()
    if not rows.numel():
        return ""
    row, t = int(rows[0]), cu[-1]
    r = bisect.bisect_right(cu, row) - 1
    where = f" (first wrong row {row}: request {r}, position {row - cu[r]})"
    j = next((j for j in range(len(cu) - 1)
              if any(min(cu[j] + p, t - 1) == row for p in range(cu[j + 1] - cu[j], max_seqlen))), None)
    if j is not None:
        clamped = " (clamped to the last row)" if cu[j] + max_seqlen > t else ""
        where += (f". Row {row} is also where a gathered slot past request {j}'s end ({cu[j + 1] - cu[j]} tokens) "
                  f"points{clamped}: a pad query. Writing back all R x max_seqlen slots puts a pad query's output "
                  f"over request {r}'s real row; write back only the slots that hold a token (position < L_i)")
    return where


def _engine_case(fn) -> tuple[float, float]:
    """The reader's function as the attention of a small engine model: (max error vs fp64, bound) against the loop."""
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=100, max_position=64)
    g = torch.Generator().manual_seed(2)
    batch = pack([torch.randint(0, 100, (n,), generator=g) for n in (9, 3, 14)])
    model = Transformer(cfg, seed=1)
    ref = model.forward(batch, attn_backend="loop")
    ref64 = float64_twin(model).forward(batch, attn_backend="loop")
    return max_abs_diff(model.forward(batch, attn_backend=fn), ref64), tolerance(ref, ref64)


def _as_backend(fn: Callable, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> Tensor:
    """``fn`` called as the engine calls an attention backend, for causal self-attention with scale ``1 / sqrt(D)``."""
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, softmax_scale=1.0 / math.sqrt(q.shape[-1]))


def _reads_later_keys(fn: Callable, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int) -> int | None:
    """The first request whose query 0 changes when the key and value of a later row of its request change (a causal
    query 0 reads key 0 only), measured with ``probe.row_dependency`` on ``fn`` (NaN read as 0); None if none does."""
    def attend(kv):  # [T, 2, H, D] -> fn's output for the fixed queries
        return _as_backend(fn, q, kv[:, 0].contiguous(), kv[:, 1].contiguous(), cu, max_seqlen).nan_to_num()
    try:
        dep = row_dependency(attend, torch.stack((k, v), 1))
    except Exception:  # the answer is already wrong; this only refines the message
        return None
    return next((j for j, (s, e) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1:])) if dep[s, s + 1:e].any()), None)


def _one_launch(fn: Callable) -> tuple | object:
    """``fn``'s matmuls for 2 and for 12 requests of distinct lengths (the sdpa path makes one call per distinct
    length), its score cells per head and T for 12, and the engine's attention functions it called."""
    made, engine = [], []
    for lens in ([5, 3], [5, 3, 8, 1, 12, 2, 7, 4, 10, 6, 11, 9]):
        q, k, v, cu = random_qkv(lens, 2, 8, seed=7)
        with OpRecorder() as seen:
            got, called = attention_calls(_as_backend, fn, q, k, v, cu, max(lens))
        if not isinstance(got, Tensor):
            return got
        made.append(len(seen.matmuls))
        engine += [c for c in called if c not in engine]
    # the softmaxed scores, or (no softmax op seen) the largest matmul output: a hand-written softmax hides no T x T
    cells = seen.cells or max((mm.batch * mm.m * mm.n for mm in seen.matmuls), default=0)
    return (*made, (cells // q.shape[1], q.shape[0]), engine)


def _launch_problem(got) -> str | None:
    if not (isinstance(got, tuple) and len(got) == 4):
        return f"expected a tensor [T, H, D], got {type(got).__name__}"
    small, big, (cells, t), engine = got
    if engine:
        return (f"your function hands the attention to the engine ({' -> '.join(engine)}, in "
                "lessons_lib.core.attention): the launch is the engine's, not yours. Write it from matmuls, "
                "a causal mask and a softmax over one gathered [R, max_seqlen] batch (see the hint); "
                "block_diag_mask and causal_mask are allowed")
    if cells >= t * t:
        return (f"this is the masked way: T² cells. For 12 requests (T = {t}) your function computed {cells} "
                f"score cells per head, at least the whole T x T = {t * t}, most of them across requests. "
                "Gather each request's own rows into an [R, max_seqlen] batch instead")
    if small != big:
        return (f"your function made {small} matmuls for 2 requests and {big} for 12 of distinct lengths: one per "
                "request (like the engine's loop) or per distinct length (like its sdpa path). Gather every request "
                "into one [R, max_seqlen] batch (see the hint) so that the number of matmuls does not grow with R")
    return None


def check_causal_varlen(fn: Callable) -> bool:
    """Exercise 03.1: ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
    softmax_scale=None) -> [T, H, D]``, causal varlen attention in ONE batched computation (as many matmuls
    for 2 requests as for 12), with the engine's backend contract (it is plugged into a model as one)."""
    batches = (([10, 30], 2, 8, 4), ([3, 1, 5], 1, 4, 5), ([4, 6, 6, 2], 2, 8, 6))  # lengths, heads, d_head, seed
    cases = [(*random_qkv(lens, h, d, seed=seed), max(lens)) for lens, h, d, seed in batches] + [("engine",), ("one launch",)]

    def judge(got, *case):
        if case == ("engine",):
            err, bound = got
            return None if err <= bound else (f"plugged into a 2-layer model as its attention, the output is off by "
                                              f"{err:.2e} (allowed {bound:.2e})")
        if case == ("one launch",):
            return _launch_problem(got)
        q, k, v, cu, m = case
        want = attention_ref(q, k, v, cu, causal=True)
        problem = tensor_problem(got, want, atol=1e-5)
        if problem is None:
            return None
        if matches(got, attention_ref(q, k, v, cu, causal=False), 1e-5):
            return problem + " - no causal mask: query i of a request may only see keys 0..i of that request"
        later = _reads_later_keys(fn, q, k, v, cu, m)
        if later is not None:
            return problem + (f" - causal mask missing: query 0 of request {later} reads later keys of its request "
                              "(changing its keys 1.. changes its output). Mask keys j > i in every request")
        if matches(got, plain_attention(q, k, v, causal=True), 1e-5):
            return problem + " - queries read other requests' keys: each request needs its own rows only"
        if matches(got, attention_ref(q, k, v, cu, causal=True, softmax_scale=1.0), 1e-5):
            return problem + " - scale the scores by 1 / sqrt(d_head) before the softmax"
        if not isinstance(got, Tensor) or got.shape != want.shape:
            return problem
        if got.is_floating_point() and not torch.isfinite(got).all():
            problem += " - NaN: some query has every key masked. A query must see ITSELF: mask keys j > i " \
                       "(triu(diagonal=1)), not j >= i"
        return problem + _where_wrong(got, want, cu.tolist(), m)

    def run(*case):
        if case == ("engine",):
            return _engine_case(fn)
        return _one_launch(fn) if case == ("one launch",) else _as_backend(fn, *case)

    run.__name__ = getattr(fn, "__name__", "fn")
    return grade("causal_varlen", run, cases, judge,
                 "causal varlen on 3 batches, inside a 2-layer model, with the same number of matmuls for 2 or 12 requests "
                 "and no call into the engine's attention")


# Exercise 03.2: counter-examples to two plausible rules of thumb. Each case is (rule, k); the batch the reader
# returns is RUN on the engine's masked, padded and loop backends under OpRecorder, and the wastes are measured.
COUNTER_RULES = {  # rule: (the rule of thumb, the question asked when a batch keeps it)
    "unequal": ("when the longest request is at least k times the shortest, padding wastes more than masking",
                "A rule about the shortest request cannot see how many requests are near the longest: what do "
                "several long requests do to masking's pairs, and to padding's pad cells?"),
    "crowded": ("when a batch holds at least k requests, masking wastes more than padding",
                "Many requests do not make pairs costly if most of them are small: what does one long request "
                "among them do to padding, and what to masking?"),
}
COUNTER_CASES = (("unequal", 10), ("unequal", 100), ("unequal", 500), ("crowded", 8), ("crowded", 16), ("crowded", 48))
COUNTER_MAX_TOKENS, COUNTER_MAX_REQUESTS = 2048, 64


def check_counter_example(fn: Callable[[str, int], list]) -> bool:
    """Exercise 03.2: ``fn(rule, k) -> list of lengths`` breaking ``COUNTER_RULES[rule][0]`` for this ``k`` (whole
    blocks, no causal mask): ``"unequal"``, longest >= k x shortest and masking wastes MORE than padding;
    ``"crowded"``, at least k requests and masking wastes LESS. Measured by ``profile.recorded_cells`` on ``COUNTER_CASES``."""
    def judge(got, rule, k):  # first what makes got no batch for this case (type, limits, the rule's condition)
        if not isinstance(got, (list, tuple)) or not got or not all(is_int(n) for n in got):
            return f"expected a non-empty list of request lengths (ints), got {got!r}"
        lens = [int(n) for n in got]
        if min(lens) < 1 or sum(lens) > COUNTER_MAX_TOKENS or len(lens) > COUNTER_MAX_REQUESTS:
            return (f"lengths {lens}: every request needs at least 1 token, at most {COUNTER_MAX_REQUESTS} requests "
                    f"and {COUNTER_MAX_TOKENS} tokens in all (this batch: {len(lens)} requests, {sum(lens)} tokens)")
        if rule == "unequal" and max(lens) < k * min(lens):
            return (f"lengths {lens}: the longest is only {max(lens) / min(lens):.3g} times the shortest; the rule "
                    f"speaks of batches where it is at least {k} times")
        if rule == "crowded" and len(lens) < k:
            return f"lengths {lens}: {len(lens)} requests; the rule speaks of batches of at least {k}"
        cells = recorded_cells(lens)
        m, p = cells["masked"] - cells["loop"], cells["padded"] - cells["loop"]
        if (m > p) if rule == "unequal" else (m < p):
            return None
        verdict = ("a tie: masking wastes exactly as much as padding, not " + ("more" if rule == "unequal" else "less")
                   if m == p else ("padding still wastes more" if rule == "unequal" else "masking still wastes more"))
        longest = max(lens)
        pads = ", ".join(f"{longest}² − {n}²" for n in sorted(set(lens)) if n < longest) or "nothing"
        return (f"lengths {lens}: the rule {COUNTER_RULES[rule][0]!r} (k = {k}) still holds: measured on the engine's "
                f"backends, masking wastes {m} cells per head and padding {p}: {verdict}. Padding's waste is the pad "
                f"cells of every request shorter than the longest ({pads}, once per such request); masking's is the "
                f"cells between every pair of different requests (2 · L_i · L_j a pair). {COUNTER_RULES[rule][1]}")

    return grade("counter_example", fn, list(COUNTER_CASES), judge,
                 f"all {len(COUNTER_CASES)} batches break their rule, measured on the engine's masked, padded and "
                 "loop backends")


# Exercise 03.3's batches: (query lengths, key lengths); the last two have more keys than queries (a cached prefix)
DOCUMENT_CASES = [(c, c) for c in ([10, 30], [5], [1, 1, 1], [7, 1, 12, 3], [30, 10])]
DOCUMENT_CASES += [([3, 2], [5, 2]), ([1, 4, 2], [6, 4, 9])]


def _wrong_masks(cu_q: Tensor, cu_k: Tensor) -> list[tuple[Tensor, str]]:
    """The usual slips of exercise 03.3 as masks (the top-left one from the engine's named fault), each with what it means."""
    right = block_diag_mask(cu_q, causal=True, cu_seqlens_k=cu_k)
    with faults.injected("causal_mask_top_left"):
        top_left = block_diag_mask(cu_q, causal=True, cu_seqlens_k=cu_k)
    return [(~right, "the mask is inverted: True means 'may attend'"),
            (block_diag_mask(cu_q, causal=False, cu_seqlens_k=cu_k),
             "no causal part: a query also reads later tokens of its own request"),
            (torch.ones_like(right).tril(), "plain causal over the flat rows: B's queries read A's keys (add: same request)"),
            (top_left, "the causal diagonal starts at the top-left. With more keys than queries (a cached prefix of "
                       "L_k - L_q tokens), query i of a request is token L_k - L_q + i: it sees keys 0..i + L_k - L_q "
                       "(causal aligned bottom-right)")]


def check_document_mask(fn: Callable[[Tensor, Tensor], Callable]) -> bool:
    """Exercise 03.3: ``fn(cu_seqlens_q, cu_seqlens_k) -> mask_mod``; ``mask_mod(q_idx, kv_idx)`` takes two
    broadcastable integer tensors of flat row indices and returns a bool tensor, True where query row ``q_idx`` may
    read key row ``kv_idx`` (same request, causal aligned bottom-right as ``flash_attn_varlen_func``). The checker
    plugs the mask into ``attention.dense_attention`` (the masked path: every cell computed, the mask applied) and
    compares the output with the engine's varlen loop."""
    def judge(got, cu_q, cu_k):
        tq, tk = int(cu_q[-1]), int(cu_k[-1])
        want = block_diag_mask(cu_q, causal=True, cu_seqlens_k=cu_k)
        if not callable(got):
            return f"expected a function mask_mod(q_idx, kv_idx), got {type(got).__name__}"
        try:
            grid = got(torch.arange(tq)[:, None], torch.arange(tk)[None, :])
        except Exception as exc:  # explain any failure of the reader's mask_mod
            return f"mask_mod(q_idx [T_q, 1], kv_idx [1, T_k]) raised {type(exc).__name__}: {exc}"
        if not isinstance(grid, Tensor) or grid.shape != want.shape or grid.dtype != torch.bool:
            shown = f"{grid.dtype} {list(grid.shape)}" if isinstance(grid, Tensor) else type(grid).__name__
            return f"mask_mod on [T_q, 1] and [1, T_k] index tensors must give bool [T_q, T_k] = {list(want.shape)}, got {shown}"
        q, k, v, _, _ = random_qkv(lengths(cu_q.tolist()), 2, 8, seq_lens_k=lengths(cu_k.tolist()), seed=tq)
        out = dense_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), grid, 8 ** -0.5).transpose(0, 1)
        ref = varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend="loop")
        if matches(out, ref, 1e-5):
            return None
        err = f"plugged into the engine's masked path, the output is off by {max_abs_diff(out, ref):.2e}: "
        slip = next((why for mask, why in _wrong_masks(cu_q, cu_k) if torch.equal(grid, mask)), None)
        if slip:
            return err + slip
        qi, ki = (grid != want).nonzero()[0].tolist()
        return err + (f"{int((grid != want).sum())} cells differ, e.g. query row {qi}, key row {ki}: got "
                      f"{bool(grid[qi, ki])}, expected {bool(want[qi, ki])}")

    cases = [(seq_lens_to_cu_seqlens(q), seq_lens_to_cu_seqlens(k)) for q, k in DOCUMENT_CASES]
    return grade("document_mask", fn, cases, judge,
                 f"your mask in the engine's masked path equals varlen on {len(cases)} batches, cached prefixes included")
