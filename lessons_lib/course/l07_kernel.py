"""What lesson 07 (inside the kernel) draws, explores, breaks and checks.

The kernel is the engine's (``ops.triton_varlen``), its predictions ``ops.tiling``'s and its one-line bugs the engine's
named faults (``faults.kernel``); its runs (inputs, references, counters) ``measure.kernel_runs``'; the launch
picture's cells and totals ``ops.tile_picture``'s. Here: the launch picture program by program, the online-softmax
replay, the kernel's code for display, what the compiler made of it, the GQA layouts, the kernel explorer, and the
checkers of exercises 07.1-07.3.

Taught in notebooks/07_inside_the_kernel.ipynb.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .. import faults
from ..faults import kernel as kernel_faults
from ..measure.kernel_runs import causal_counts, kernel_missing, kernel_module, kernel_qkv, kernel_refs, run_kernel, run_layout
from ..measure.loop_dispatch import loop_ops, loop_ops_per_request  # noqa: F401 (loop_ops: claim K1)
from ..measure.machines import H200
from ..measure.profile import random_qkv
from ..measure.tolerance import max_abs_diff, tolerance
from ..ops import tiling
from ..ops.compile_report import launcher_and_avoided as compiler_reports  # noqa: F401 (the compile claim)
from ..ops.online_softmax import max_growths, online_softmax
from ..ops.tile_picture import RETURNED, SKIPPED, USEFUL, WASTED, picture_totals, program_cells, program_tiles
from ..ops.tiling import WorkCounts, cdiv
from ..style import ATTENTION, MIN_FONT, NEVER, OTHER, TEXT, WASTE, request_name
from ..validate import check_int, check_lengths
from .explore import explorer, ipywidgets_module, parse_query_key_lengths, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import grade, int_tuple

TILE_SIZES = (16, 32, 64, 128)


# ---- the launch grid, program by program ---------------------------------------------------------------

# The launch picture's colours (``ops.tile_picture``'s cell codes): blue useful, vermillion computed then thrown
# away, white never computed; a program that returned at once is white too, hatched in ink.
CODE_COLORS = {SKIPPED: NEVER, USEFUL: ATTENTION, WASTED: WASTE, RETURNED: NEVER}
RETURNED_HATCH = "///"
CODE_LABELS = {USEFUL: "computed, useful", WASTED: "computed, thrown away (masked or past the end)",
               SKIPPED: "key tile skipped (above the diagonal)", RETURNED: "program returned at once"}


def launch_picture(seqlens_q: Sequence[int], seqlens_k: Sequence[int] | None = None, *, block_m: int, block_n: int,
                   causal: bool, n_heads: int = 1, title: str | None = None, measured: WorkCounts | None = None,
                   figsize=None, names: Sequence[str] | None = None) -> Figure:
    """The launch grid of one head: a panel per request, its programs stacked as row bands coloured by
    ``program_cells``, the request's ``[L_q x L_k]`` block framed. With ``measured`` (the kernel's counters) the
    bands are drawn from its own per-program key tiles and the footer compares the totals with the prediction."""
    lq = check_lengths(seqlens_q, minimum=0, name="seqlens_q")
    lk = lq if seqlens_k is None else check_lengths(seqlens_k, minimum=0, name="seqlens_k")
    own = None if measured is None else measured.program_tiles[0]
    tiles = program_tiles(lq, lk, block_m=block_m, block_n=block_n, causal=causal, measured=own, n_heads=n_heads)
    grid_m = cdiv(max(lq, default=0), block_m)
    widths = [max(1, cdiv(n, block_n)) for n in lk]
    fig = Figure(figsize=figsize or (min(2.0 + 1.6 * sum(widths) ** 0.8 + 0.9 * len(lq), 11.0), 4.3))
    axes = np.atleast_1d(fig.subplots(1, len(lq), gridspec_kw={"width_ratios": widths}))
    cmap = ListedColormap([CODE_COLORS[c] for c in (SKIPPED, USEFUL, WASTED, RETURNED)])
    pics = [program_cells(nq, nk, t, block_m, block_n, causal) for nq, nk, t in zip(lq, lk, tiles)]
    for r, (ax, nq, nk, pic) in enumerate(zip(axes, lq, lk, pics)):
        h, w = pic.shape
        ax.imshow(pic, cmap=cmap, vmin=0, vmax=3, interpolation="nearest", extent=(0, w, h, 0), aspect="auto")
        ax.hlines(range(0, h + 1, block_m), 0, w, color=TEXT, linewidth=0.8)
        ax.vlines(range(0, w + 1, block_n), 0, h, color=TEXT, linewidth=0.6, linestyle=":")
        for m in [m for m, t in enumerate(tiles[r]) if t < 0]:
            ax.add_patch(Rectangle((0, m * block_m), w, block_m, facecolor=NEVER, edgecolor=TEXT, linewidth=0,
                                   hatch=RETURNED_HATCH, gid=f"returned-{r}-{m}"))
        ax.add_patch(Rectangle((0, 0), nk, nq, fill=False, edgecolor=TEXT, linewidth=1.0, gid=f"request-{r}"))
        ax.set_yticks([(m + 0.5) * block_m for m in range(grid_m)],
                      [f"m={m}" for m in range(grid_m)] if r == 0 else [""] * grid_m)
        ax.set_xticks([])
        busy = sum(t >= 0 for t in tiles[r])
        name = request_name(r) if names is None else names[r]
        ax.set_title(f"{name}: {nq} tokens\n{busy} work, {grid_m - busy} return", fontsize=MIN_FONT)
        ax.set_xlabel(f"{nk} keys:\n{w // block_n} key tile{'s' if w > block_n else ''} of {block_n}", fontsize=MIN_FONT)
        ax.tick_params(labelsize=MIN_FONT, length=0)
    axes[0].set_ylabel(f"query tile m ({block_m} rows each)", fontsize=MIN_FONT)
    total = picture_totals(lq, lk, tiles, block_m=block_m, block_n=block_n, causal=causal, n_heads=n_heads)
    useful = n_heads * sum(int((pic == USEFUL).sum()) for pic in pics)
    returned = n_heads * sum(t < 0 for ts in tiles for t in ts)   # what the panels draw hatched
    exits = "" if returned == total.early_exits else f" ({total.early_exits} pass the early-return test, its return gone)"
    foot = (f"grid ({grid_m}, {n_heads}, {len(lq)}) = {total.programs} programs: {returned} return at once{exits} | "
            f"{total.tiles} tiles computed, {total.tiles_skipped} skipped\n"
            f"{total.executed_cells} executed cells: {useful} useful (blue); the kernel's cells counter, "
            f"in-bounds (masked ones included): {total.cells}")
    if measured is not None:
        pred = tiling.predict_work(lq, lk, n_heads=n_heads, block_m=block_m, block_n=block_n, causal=causal)
        foot = ("drawn from the kernel's own per-program key tiles (head 0)\n" + foot + "\nprediction: "
                + ("the same" if pred == total else f"DIFFER: {pred.tiles} tiles, {pred.cells} cells predicted"))
    fig.legend(handles=[Patch(facecolor=CODE_COLORS[c], edgecolor=TEXT, linewidth=0.6, label=CODE_LABELS[c],
                              hatch=RETURNED_HATCH if c == RETURNED else None)
                        for c in (USEFUL, WASTED, SKIPPED, RETURNED)], loc="lower center", ncol=2, fontsize=MIN_FONT,
               frameon=False)
    fig.text(0.5, 0.13, foot, ha="center", va="bottom", fontsize=MIN_FONT, color=TEXT)
    what = "measured by the kernel" if measured is not None else "predicted"
    fig.suptitle(title or f"one launch ({what}), {'causal' if causal else 'non-causal'}, BLOCK_M = {block_m}, "
                 f"BLOCK_N = {block_n}:\neach band is one program (query tile m, head, request)", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.38, top=0.8, wspace=0.15)
    return fig


# ---- online softmax, replayed --------------------------------------------------------------------------

def softmax_example(n_keys: int = 64, d_head: int = 16, seed: int = 3):
    """One request of ``n_keys`` tokens, one head (``random_qkv``), its scores ``q k^T / sqrt(d)`` and the row whose
    max grows in the most key tiles of 16 (ties: the lowest). Returns ``q, k, v, cu, row, scores``."""
    q, k, v, cu = random_qkv([n_keys], n_heads=1, d_head=d_head, seed=seed)
    scores = (q[:, 0] @ k[:, 0].T) / d_head ** 0.5
    growths = max_growths(scores, 16)
    return q, k, v, cu, growths.index(max(growths)), scores


def online_softmax_picture(scores_row: torch.Tensor, values: torch.Tensor, block_n: int) -> Figure:
    """Left: one query's scores, the key tiles, the running max as a step. Right: after each tile, the error of the
    running output against the softmax over the keys seen so far, with the rescale and without."""
    scores_row, values = scores_row.double(), values.double()
    _, good = online_softmax(scores_row, values, block_n, rescale=True)
    _, bad = online_softmax(scores_row, values, block_n, rescale=False)
    n = scores_row.shape[0]
    fig = Figure(figsize=(10.0, 3.9))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.5, 1]})
    top, bottom = float(scores_row.max()), float(scores_row.min())
    for t, start in enumerate(range(0, n, block_n)):
        if t:
            left.axvline(start - 0.5, color=TEXT, linewidth=0.8, linestyle=":")
        left.text(start + block_n / 2 - 0.5, top + 1.9, f"tile {t}", ha="center", fontsize=MIN_FONT, color=TEXT)
    left.plot(range(n), scores_row.tolist(), "o", color=ATTENTION, markersize=3.5, label="score s_j of key j")
    xs = [x for st in good for x in (st.tile * block_n - 0.5, st.keys_seen - 0.5)]
    left.plot(xs, [st.m for st in good for _ in (0, 1)], "-", color=TEXT, linewidth=1.6,
              label="running max m after each tile")
    for st in good:
        if st.max_grew:
            left.text(st.tile * block_n + block_n / 2 - 0.5, top + 0.35, "max grows:\nrescale", fontsize=MIN_FONT,
                      color=TEXT, ha="center", va="bottom")
    left.set_ylim(bottom - 1.6, top + 2.6)
    left.legend(fontsize=MIN_FONT, frameon=False, loc="lower left", ncol=2)
    left.set_xlabel("key j (one request)", fontsize=MIN_FONT)
    left.set_ylabel("score", fontsize=MIN_FONT)
    left.set_title("the kernel sees the keys one tile at a time", fontsize=MIN_FONT + 1)
    floor = 1e-17
    tiles = [st.tile for st in good]
    # errors are not work: both curves in ink, told apart by marker and line style
    right.plot(tiles, [max(st.error, floor) for st in good], "o-", color=TEXT, label="with the rescale (the kernel)")
    right.plot(tiles, [max(st.error, floor) for st in bad], "s--", color=TEXT, markerfacecolor="white",
               label="sum l not rescaled (the bug)")
    right.set(yscale="log", ylim=(floor / 3, 1e6), xlim=(-0.4, tiles[-1] + 0.4))
    right.set_xticks(tiles, [f"after\ntile {t}" for t in tiles])
    right.set_ylabel("max |acc / l - softmax so far|", fontsize=MIN_FONT)
    right.legend(fontsize=MIN_FONT, frameon=False, loc="upper left")
    right.set_title("error of acc / l after each key tile vs the\nsoftmax over the keys seen so far (float64)",
                    fontsize=MIN_FONT + 1)
    for ax in (left, right):
        ax.tick_params(labelsize=MIN_FONT)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.2, top=0.88, wspace=0.28)
    return fig


# ---- the kernel's code, and its one-line bugs ---------------------------------------------------------------

def show_kernel(start: str | None = None, stop: str | None = None):
    """Display (part of) the kernel's code as a Markdown code block."""
    from IPython.display import Markdown
    heading, code = kernel_faults.kernel_source_part(start, stop)
    return Markdown(f"`{heading}`\n\n```python\n{code}\n```")


# The engine's kernel faults, in the lesson's order, and what each does on K2's mix (prefill: L_k = L_q):
# (the counters that move, whether the output leaves the tolerance). The break-it cell checks the table.
BUG_EFFECTS = {"kernel_no_early_return": ("tiles, masked_tiles", "no"),
               "kernel_causal_bound_one_tile_late": ("tiles, tiles_skipped, cells, masked_tiles", "no"),
               "kernel_sum_not_rescaled": ("none", "yes"), "kernel_columns_past_end_kept": ("none", "yes"),
               "kernel_every_key_tile_masked": ("masked_tiles", "no"), "kernel_diagonal_tile_unmasked": ("masked_tiles", "yes"),
               "kernel_causal_diagonal_top_left": ("none", "no"), "kernel_cells_counted_whole_tile": ("cells", "no"),
               "kernel_exp_in_base_e": ("none", "yes")}
KERNEL_BUGS = tuple(BUG_EFFECTS)
BUG_COUNTERS = ("early_exits", "tiles", "tiles_skipped", "cells", "masked_tiles")   # what the break-it cell compares


def guess_report(guess: dict, seen: dict) -> str:
    """Your prediction per bug beside what the kernel did: ``seen[bug] = (counters moved, outside)``."""
    lines = []
    for bug, (moved, outside) in seen.items():
        g = guess.get(bug, ("?", "?"))
        mark = "no guess yet" if "?" in tuple(g) else "right" if tuple(g) == (moved, outside) else "differs"
        lines.append(f"{bug}: you said {g}, the kernel did {(moved, outside)}: {mark}")
    return "\n".join(lines)


# ---- grouped-query attention: the two layouts -------------------------------------------------------------------

GQA_HEADS, GQA_KV_HEADS = 8, 2          # G = 4 query heads per K/V head
GQA_DECODE = ([1, 1, 4], [100, 40, 64])   # (L_q, L_k): two decode steps and a 4-token chunk after cached keys
GQA_PREFILL = ([64], [64])              # one prefill of whole tiles


def run_gqa(lens_q: Sequence[int], lens_k: Sequence[int], pack_gqa: bool | None, *, block_m: int = 16,
            block_n: int = 16, causal: bool = True) -> dict:
    """``kernel_runs.run_layout`` on ``GQA_HEADS`` query heads of 16 over ``GQA_KV_HEADS`` K/V heads."""
    return run_layout(lens_q, lens_k, GQA_HEADS, GQA_KV_HEADS, 16, pack_gqa, block_m=block_m, block_n=block_n,
                      causal=causal)


# ---- figures --------------------------------------------------------------------------------------------------

@register("07_launch_grid", lesson="07",
          caption="one causal launch over requests of 100, 20 and 60 tokens at 32 x 32 tiles: 12 programs, each a band "
                  "of key tiles computed, partly thrown away, skipped above the diagonal, or returned at once")
def _launch_grid() -> Figure:
    # named C, D, E: not the course's A (10 tokens) and B (30)
    fig = launch_picture([100, 20, 60], block_m=32, block_n=32, causal=True, figsize=(9.0, 5.6), names=("C", "D", "E"))
    a = fig.axes[0]  # C's last program: rows 96-127 of its tile, of which only 96-99 exist
    a.annotate("rows 96-99: C's only\n4 real rows here", xy=(64, 98), xytext=(64, 116), ha="center", va="center",
               fontsize=MIN_FONT, color=TEXT, arrowprops={"arrowstyle": "->", "color": TEXT},
               bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": TEXT})
    return fig


@register("07_online_softmax", lesson="07",
          caption="one query's keys in four tiles of 16: the running max grows, the rescale keeps the running "
                  "answer exact; without it the sum is wrong")
def _online_softmax() -> Figure:
    _, _, v, _, row, scores = softmax_example()
    return online_softmax_picture(scores[row], v[:, 0], 16)


@register("07_short_request_tile", lesson="07",
          caption="A's 10 tokens in one 64 x 64 tile beside a 250-token request: whole tiles either way")
def _short_tile() -> Figure:
    return launch_picture([ARTICLE_LENS[0], 250], block_m=64, block_n=64, causal=False, figsize=(9.0, 5.0), names=("A", "F"),
                          title="non-causal, 64 x 64 tiles: a 10-token request still executes a whole tile")


@register("07_fifty_launches", lesson="07",
          caption="50 requests served one launch per request (each paying the launch cost; lesson 03's causal loop "
                  "launches 9 kernels per request, loop_ops_per_request) and by the kernel (one launch, 50 programs side "
                  "by side); schematic")
def launches_picture(n_requests: int = 50) -> Figure:
    """Lesson 03's loop against the kernel, as launches: the loop's ``n_requests`` launches of grid
    ``(1, 1, 1)``, one after the other, each preceded by the host's launch cost; the kernel's one launch of
    grid ``tiling.launch_grid(13, 1, n_requests)``, its programs side by side. Schematic: time is not to scale."""
    grid = tiling.launch_grid(13, 1, n_requests)
    fig = Figure(figsize=(9.0, 2.9))
    ax = fig.subplots()
    cost, work, cols, x0, side = 1.0, 0.5, 25, 6.0, 0.9
    for y, launches in ((1.55, n_requests), (0.1, 1)):   # the loop's launches, then the kernel's one
        xs = [i * (cost + work) for i in range(launches)]
        ax.broken_barh([(x, cost) for x in xs], (y, 0.5), facecolors=OTHER, edgecolor="white", linewidth=0.4)
        ax.broken_barh([(x + cost, work) for x in xs], (y, 0.5), facecolors=ATTENTION, edgecolor="white", linewidth=0.4)
    # the kernel's programs, zoomed: one small square each, in rows, all running during the same short interval
    rows_n = cdiv(grid[2], cols)
    for row in range(rows_n):
        ax.broken_barh([(x0 + c * side, side * 0.85) for c in range(min(cols, grid[2] - row * cols))],
                       (0.1 + row * 0.5 / rows_n, 0.4 / rows_n), facecolors=ATTENTION, edgecolor=TEXT, linewidth=0.3)
    for y in (0.1, 0.6):  # guide lines from the kernel's work bar to its zoom
        ax.plot([cost + work, x0 - 0.2], [y, y], color=TEXT, linewidth=0.6, linestyle=":")
    ax.text(0, 2.2, f"lesson 03's loop as one launch per request: {n_requests} launches, one after the other "
            f"(the real loop, causal, launches {len(loop_ops_per_request())} kernels each)", fontsize=MIN_FONT, color=TEXT,
            va="bottom")
    ax.text(x0 + cols * side + 0.8, 0.35, f"the kernel: 1 launch of grid {grid},\nits {grid[2]} programs side by "
            "side (zoomed)", fontsize=MIN_FONT, color=TEXT, va="center")
    ax.set(xlim=(-0.5, n_requests * (cost + work) + 0.5), ylim=(-0.35, 2.75), xticks=[], yticks=[])
    ax.set_xlabel("time (schematic, not to scale)", fontsize=MIN_FONT)
    ax.spines[["top", "right", "left"]].set_visible(False)
    fig.legend(handles=[Patch(facecolor=OTHER, label="a launch (host cost)"),
                        Patch(facecolor=ATTENTION, label="the programs' work")], loc="upper right", ncol=2,
               fontsize=MIN_FONT, frameon=False)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.14, top=0.86)
    return fig


# ---- the kernel explorer ----------------------------------------------------------------------------------

MAX_PROGRAMS = 48     # the interpreter runs programs one by one: a bigger launch would stall the widget
EXPLORER_HEADS, EXPLORER_D = 1, 16
NO_BUG = "none (the real kernel)"
COUNTER_FIELDS = ("programs", "early_exits", "tiles", "tiles_skipped", "cells")


@functools.lru_cache(maxsize=16)
def _explorer_inputs(lens_q: tuple, lens_k: tuple, causal: bool):
    """``kernel_qkv`` and ``kernel_refs`` for the typed lengths: a slider move reuses them."""
    q, k, v, cu_q, cu_k = kernel_qkv(lens_q, EXPLORER_HEADS, EXPLORER_D, seq_lens_k=lens_k,
                                     seed=sum(lens_q) + 7 * (sum(lens_k) - sum(lens_q)))
    return (q, k, v, cu_q, cu_k, *kernel_refs(q, k, v, cu_q, cu_k, causal=causal))


def kernel_state(lengths: str, block_m: int = 16, block_n: int = 16, causal: bool = True, bug: str = NO_BUG) -> dict:
    """Run the kernel once (one head of 16; ``bug``: ``NO_BUG`` or a fault of ``KERNEL_BUGS``, injected for the run)
    on the typed lengths (``parse_query_key_lengths``): ``{"seq_lens", "seq_lens_k", "grid", "block_m", "block_n",
    "causal", "bug", "predicted", "measured", "tiles", "error", "bound", "ran", "why", "ms"}``. ``tiles`` are drawn
    from the kernel's own per-program counts where it ran, else predicted; without Triton, or over ``MAX_PROGRAMS``
    programs under the interpreter, it does not run (``ran`` False, ``why`` says why)."""
    lens, lens_k = parse_query_key_lengths(lengths)
    bm, bn = (check_int(n, b, 16, 128) for n, b in (("block_m", block_m), ("block_n", block_n)))
    if bug != NO_BUG and bug not in KERNEL_BUGS:
        raise ValueError(f"unknown kernel bug {bug!r}; choose one of {sorted(KERNEL_BUGS)}")
    predicted = tiling.predict_work(lens, lens_k, n_heads=EXPLORER_HEADS, block_m=bm, block_n=bn, causal=causal)
    why, measured, error, bound, ms = kernel_missing(), None, None, None, None
    if why is None and kernel_module().INTERPRETED and predicted.programs > MAX_PROGRAMS:
        why = (f"{predicted.programs} programs: more than {MAX_PROGRAMS} under the CPU interpreter (one at a time); "
               "shorter lengths or bigger tiles")
    if why is None:
        q, k, v, cu_q, cu_k, ref, ref64 = _explorer_inputs(tuple(lens), tuple(lens_k), bool(causal))
        t0 = time.perf_counter()
        with faults.injected(*([] if bug == NO_BUG else [bug])):
            out, measured = run_kernel(q, k, v, cu_q, cu_k, causal=causal, block_m=bm, block_n=bn)
        ms, error, bound = (time.perf_counter() - t0) * 1e3, max_abs_diff(out, ref64), tolerance(ref, ref64)
    own = None if measured is None else measured.program_tiles[0]
    return {"seq_lens": lens, "seq_lens_k": lens_k, "grid": tiling.launch_grid(max(lens), EXPLORER_HEADS, len(lens), bm),
            "block_m": bm, "block_n": bn, "causal": bool(causal), "bug": bug, "predicted": predicted,
            "measured": measured, "error": error, "bound": bound, "ran": measured is not None, "why": why, "ms": ms,
            "tiles": program_tiles(lens, lens_k, block_m=bm, block_n=bn, causal=causal, measured=own)}


def pct(x: float) -> str:
    """A share as a percent, one significant digit under 1 % (never a nonzero share printed as 0%)."""
    return f"{x:.0%}" if x >= 0.01 or x == 0 else f"{100 * x:.1g}%"


def kernel_counts_html(state: dict) -> str:
    """One ``<div>`` per counter: ``programs: measured 4 | predicted 4 | picture 4``, then the executed cells."""
    pic = picture_totals(state["seq_lens"], state["seq_lens_k"], state["tiles"], block_m=state["block_m"],
                         block_n=state["block_n"], causal=state["causal"])
    p, m = state["predicted"], state["measured"]
    rows = [f"<div>{f}: measured {'not run' if m is None else getattr(m, f)} | predicted {getattr(p, f)} | "
            f"picture {getattr(pic, f)}</div>" for f in COUNTER_FIELDS]
    share = [f"{w.executed_cells} for {w.cells} inside the requests ({pct(w.cells / max(1, w.executed_cells))})"
             for w in (m, p) if w is not None]
    rows.append(f"<div>executed cells (tiles x {p.block_m} x {p.block_n}): measured "
                f"{'not run' if m is None else share[0]} | predicted {share[-1]}</div>")
    return "".join(rows)


def kernel_status_html(state: dict) -> str:
    if not state["ran"]:
        return f"<div>kernel not run: {state['why']}</div>"
    ok = "within" if state["error"] <= state["bound"] else "OUTSIDE"
    which = "" if state["bug"] == NO_BUG else f" with the bug '{state['bug']}'"
    return (f"<div>kernel ran{which}: grid {state['grid']} in {state['ms']:.0f} ms | max |out - fp64 reference| = "
            f"{state['error']:.2e}, {ok} the bound {state['bound']:.2e}</div>")


def kernel_explorer(lengths: str = "10, 30", block_m: int = 16, block_n: int = 16, causal: bool = True,
                    bug: str = NO_BUG):
    """VBox class ``k7x``: Text ``k7x-lengths`` (``L`` or ``L_q:L_k``, Enter to run), SelectionSliders ``k7x-block-m``
    and ``k7x-block-n``, Checkbox ``k7x-causal``, Dropdown ``k7x-bug``; HTML ``k7x-status`` and ``k7x-counts``,
    Output ``k7x-figure`` (the launch picture of ``kernel_state``)."""
    w = ipywidgets_module()
    text = tagged(w.Text(value=lengths, description="lengths", continuous_update=False), "k7x-lengths")
    bm = tagged(w.SelectionSlider(options=list(TILE_SIZES), value=block_m, description="BLOCK_M"), "k7x-block-m")
    bn = tagged(w.SelectionSlider(options=list(TILE_SIZES), value=block_n, description="BLOCK_N"), "k7x-block-n")
    causal_box = tagged(w.Checkbox(value=causal, description="causal"), "k7x-causal")
    bug_box = tagged(w.Dropdown(options=[NO_BUG, *KERNEL_BUGS], value=bug, description="bug"), "k7x-bug")
    status, counts, out = tagged(w.HTML(), "k7x-status"), tagged(w.HTML(), "k7x-counts"), tagged(w.Output(), "k7x-figure")

    def update(change=None):
        status.value = "<div>running the kernel ...</div>"
        try:
            state = kernel_state(text.value, bm.value, bn.value, causal_box.value, bug_box.value)
        except ValueError as exc:
            status.value = f"<div>{exc}</div>"
            return
        status.value = kernel_status_html(state)
        counts.value = kernel_counts_html(state)
        show_figure(out, launch_picture(state["seq_lens"], state["seq_lens_k"], block_m=state["block_m"],
                                        block_n=state["block_n"], causal=state["causal"], measured=state["measured"],
                                        figsize=(8.6, 5.2)))

    return explorer("k7x", [text, bm, bn, causal_box, bug_box], [status, counts, out], update)


# ---- exercises ---------------------------------------------------------------------------------------------

# (len_q, len_k, tile_start, block_m, block_n, window): chunks with more keys than queries, tiles hanging past
# the end, windows narrower and wider than a tile, and plain causal (window None)
WINDOW_CASES = [(64, 64, 32, 16, 16, None), (20, 50, 16, 16, 16, None), (10, 10, 0, 64, 64, None),
                (64, 64, 48, 16, 16, 20), (64, 64, 32, 16, 16, 8), (40, 100, 16, 16, 16, 24), (30, 30, 16, 16, 16, 16),
                (100, 100, 96, 32, 16, 40), (5, 9, 0, 16, 16, 3), (128, 128, 64, 32, 32, 64), (16, 80, 0, 16, 16, 1)]
CHUNK_MIX = ([20, 10], [50, 10])   # (L_q, L_k) per request: a 20-token chunk after 30 cached keys, and a whole prompt


def _window_hint(ans, want, len_q, len_k, start, block_m, block_n, window) -> str:
    """What a wrong ``(first, end)`` of exercise 07.1 gets wrong: each plausible mistake that gives that answer (several
    can), else which way the range errs."""
    off, last = len_k - len_q, min(start + block_m, len_q) - 1
    lo = max(0, start + off - (window or 0) + 1)
    tiles = functools.partial(tiling.window_key_tiles, block_n=block_n, window=window)  # (len_q, len_k, start, block_m)
    first_wrong = window is not None and ans[0] != want[0]
    mistakes = [
        (len_k != len_q and ans == tiles(len_q, len_q, start, block_m), "with more keys than queries the diagonal is "
         f"bottom-right aligned: row i sees keys up to i + L_k - L_q = i + {off}"),
        (ans[1] != want[1] and ans[1] == tiles(len_q, len_k, start, 1)[1], "your end is what the tile's FIRST row needs; "
         f"the LAST real row, min(tile_start + BLOCK_M, L_q) - 1 = {last}, sees the furthest key"),
        (first_wrong and ans[0] == tiles(len_q, len_k, last, 1)[0], "your first tile is where the LAST row's window "
         f"starts; the FIRST row {start} reaches furthest back, to key {lo}"),
        (first_wrong and lo > 0 and ans[0] == (lo - 1) // block_n, f"the window holds W = {window} keys, "
         f"j > i + L_k - L_q - W: row {start}'s first key is {lo}, not {lo - 1}"),
        (first_wrong and ans[0] == cdiv(lo, block_n), f"key {lo} lies INSIDE key tile {lo // block_n}: the first tile "
         "is lo // BLOCK_N, rounded down, not up")]
    fits = [why for fit, why in mistakes if fit]
    if fits:
        return "; or ".join(fits)
    if ans[0] > want[0] or ans[1] < want[1]:
        return "your range misses key tiles a real row sees: the output would be wrong"
    return "more key tiles than the rows see (the output stays right, but the kernel computes tiles wholly masked)"


def check_window_tiles(fn: Callable[[int, int, int, int, int, int | None], tuple]) -> bool:
    """Exercise 07.1: ``fn(len_q, len_k, tile_start, block_m, block_n, window) -> (first, end)``, the smallest
    range of key tiles ``[first, end)`` the query tile must compute. Then, with ``window=None`` on a chunk
    mix (L_k > L_q), the key tiles your ranges add up to against what the engine's kernel counts itself."""
    def run(kind, *case):
        if kind == "tiles":
            return fn(*case)
        lens_q, lens_k, block_m, block_n = case
        total = 0
        for nq, nk in zip(lens_q, lens_k):
            for start in range(0, nq, block_m):
                got = fn(nq, nk, start, block_m, block_n, None)
                ans, problem = int_tuple(got, "first, end")
                if problem:
                    return got
                total += ans[1] - ans[0]
        return total

    def judge(got, kind, *case):
        if kind == "kernel":   # the whole mix's key tiles
            want = causal_counts(*case, MAX_PROGRAMS).tiles
            return None if got == want else (f"your ranges add up to {got} key tiles for L_q = {case[0]}, L_k = {case[1]} "
                                             f"(BLOCK {case[2]} x {case[3]}, causal); the engine's kernel counts {want}")
        ans, problem = int_tuple(got, "first, end")
        want = tiling.window_key_tiles(*case)
        return problem or (None if ans == want else f"got {ans}, expected {want}: {_window_hint(ans, want, *case)}")

    run.__name__ = getattr(fn, "__name__", "fn")
    cases = [("tiles", *c) for c in WINDOW_CASES] + [("kernel", *CHUNK_MIX, 16, 16)]
    return grade("window_tiles", run, cases, judge, f"the key tiles of {len(WINDOW_CASES)} query tiles (causal and "
                 "sliding window), and the kernel's own count for a chunk mix")


# ---- exercise 07.2: vLLM's flat grid -------------------------------------------------------------------

FLAT_CASES = [([10, 30], 16), ([100, 5, 20], 32), ([64, 64], 64), ([65, 3], 64), ([16, 48, 33], 16),
              ([300, 20, 20, 20], 64), ([7], 16), ([32, 32, 32], 16)]


def check_flat_grid(fn: Callable[[list, int], list]) -> bool:
    """Exercise 07.2: ``fn(seq_lens, block_q) -> [(request, q_block), ...]``, one pair per program of one K/V head's
    column of vLLM's flat grid, ``⌊T / BLOCK_Q⌋ + R`` programs: each request's programs contiguous, in request order,
    its token tiles 0, 1, 2, ... in order, every real tile exactly once (the rest return at once)."""
    def judge(got, lens, block_m):
        size = tiling.flat_grid_size(lens, block_m)
        try:
            pairs = [tuple(int(x) for x in p) for p in got]
        except (TypeError, ValueError):
            pairs = [()]
        if any(len(p) != 2 for p in pairs):
            return f"expected a list of (request, q_block) pairs, one per program; got {got!r}"[:300]
        if len(pairs) != size:
            return (f"got {len(pairs)} programs; the host knows only T = {sum(lens)} tokens and R = {len(lens)} "
                    f"requests: the flat grid has floor(T / BLOCK_Q) + R = {size} programs per K/V head")
        if any(not 0 <= r < len(lens) or m < 0 for r, m in pairs):
            return f"every pair needs a request in 0..{len(lens) - 1} and a tile q_block >= 0; got {pairs}"
        rounds = ("floor(cu_r / BLOCK_Q) alone (floor(cu_r / BLOCK_M) in a grid per query head) rounds down: a request "
                  "whose start is not a multiple of BLOCK_Q needs one extra slot for its ragged tile (the + r)")
        if [r for r, _ in pairs] != sorted(r for r, _ in pairs) or pairs[0] != (0, 0):
            return (f"got {pairs}: the requests' programs must come in request order from (0, 0), so that a program "
                    f"finds its request by a binary search over where each starts. Two with the same first program? {rounds}")
        for r, n in enumerate(lens):
            ms = [m for rr, m in pairs if rr == r]
            if ms != list(range(len(ms))):
                return f"got {pairs}: request {r}'s programs must be its tiles 0, 1, 2, ... in order; got {ms}"
            if len(ms) < cdiv(n, block_m):
                return (f"got {pairs}: request {r} ({n} tokens) has {cdiv(n, block_m)} query tiles but only {len(ms)} "
                        f"programs: tile {len(ms)} is never computed. {rounds}")
        flat_exits = size - sum(cdiv(n, block_m) for n in lens)
        rect = causal_counts(lens, lens, block_m, 64, 24)
        print(f"  {lens} at BLOCK_Q = {block_m}: flat grid {size} programs, {flat_exits} return at once; the rectangular "
              f"grid {rect.programs}, {rect.early_exits} return at once (the kernel's counters, one head, BLOCK_M = BLOCK_Q)")
        return None
    return grade("flat_grid", fn, FLAT_CASES, judge,
                 f"a flat grid for {len(FLAT_CASES)} mixes, every real query tile once, in request order")


def check_flat_worse(fn: Callable[[], tuple]) -> bool:
    """Exercise 07.2, the counter-example: ``fn() -> (seq_lens, block_q)``, a mix (not one of ``FLAT_CASES``) whose
    flat grid of ``⌊T / BLOCK_Q⌋ + R`` programs is larger than the rectangular ``⌈max_seqlen / BLOCK_Q⌉ · R``
    (one head; the rectangle counted by ``tiling.predict_work``)."""
    def judge(got):
        try:
            lens, block_m = [int(n) for n in got[0]], int(got[1])
        except (TypeError, ValueError, IndexError):
            return f"expected (seq_lens, block_q), got {got!r}"[:200]
        if not lens or min(lens) < 1 or len(lens) > 64 or sum(lens) > 16384 or block_m not in TILE_SIZES:
            return f"got {got!r}: 1 to 64 lengths >= 1, at most 16384 tokens, BLOCK_Q one of {TILE_SIZES}"[:300]
        if any(lens == c[0] and block_m == c[1] for c in FLAT_CASES):
            return "that mix is one of the checker's cases above: find one of your own"
        flat = tiling.flat_grid_size(lens, block_m)
        rect = tiling.predict_work(lens, n_heads=1, block_m=block_m, block_n=64, causal=True)
        need = sum(cdiv(n, block_m) for n in lens)
        print(f"  {lens[:8]}{' ...' if len(lens) > 8 else ''} at BLOCK_Q = {block_m}: {need} real token tiles; flat "
              f"grid {flat} programs, rectangle {rect.programs} ({rect.early_exits} of them return at once)")
        if flat <= rect.programs:
            return (f"the flat grid ({flat}) is not larger than the rectangle ({rect.programs}). The rectangle wastes "
                    "slots when lengths differ; the flat grid's + R slots are wasted when no request has a ragged "
                    "last tile. Which lengths leave the rectangle nothing to waste?")
        return None
    return grade("flat_worse", fn, [()], judge, "a mix where the flat grid starts more programs than the rectangle")


# ---- exercise 07.3: tile size, K/V traffic and occupancy -------------------------------------------------

TILE_BN = 64   # BLOCK_N held fixed in exercise 07.3, with d_head 64 in bf16 (tiling.tile_costs / best_block_m's)
TILE = {"block_n": TILE_BN, "d_head": 64, "nbytes": 2}
TILE_CASES = [(lens, heads, H200.n_sms) for lens, heads in (([300, 20, 20, 20], 8), ([4096], 8), ([10] * 12, 8),
              ([2000], 1), ([500, 3], 16), ([1000, 50, 50, 50], 4), ([700] + [20] * 7, 4), ([1000, 50], 32))]
TRAP_MAX_TOKENS, TRAP_MAX_HEADS = 16384, 64   # the counter-example's bounds


def tile_work(lens, n_heads, block_m) -> WorkCounts:
    """``tiling.predict_work`` of a causal launch at ``block_m`` x ``TILE_BN`` (exercise 07.3's counters: programs,
    early_exits, tiles, ``kv_bytes_read(64, 2)``, executed_cells)."""
    return tiling.predict_work(lens, n_heads=n_heads, block_m=block_m, block_n=TILE_BN, causal=True)


def check_tiles(fn: Callable[[list, int, int], int]) -> bool:
    """Exercise 07.3: ``fn(seq_lens, n_heads, n_sms) -> block_m`` from ``TILE_SIZES`` (BLOCK_N = 64, causal,
    d = 64, bf16): the fewest K/V bytes read among the choices that keep ``n_sms`` SMs busy on average while the
    launch runs (``tiling.tile_costs``: its key tiles over its longest program's); if none does, the most busy SMs; ties
    broken by fewest executed cells."""
    def judge(got, lens, heads, n_sms):
        try:
            ans = int(got)
        except (TypeError, ValueError):
            return f"expected one BLOCK_M, got {got!r}"
        if ans not in TILE_SIZES:
            return f"got {ans}: BLOCK_M must be one of {TILE_SIZES}"
        want = tiling.best_block_m(lens, heads, n_sms, TILE_SIZES, **TILE)
        if ans == want:
            return None
        w, span = tile_work(lens, heads, ans), tiling.longest_program(lens, ans, TILE_BN)
        (p, kv, cells), (wp, wkv, wcells) = (tiling.tile_costs(lens, heads, bm, **TILE) for bm in (ans, want))
        working = w.programs - w.early_exits
        mine = (f"BLOCK_M = {ans}: {w.tiles} key tiles, the longest program {span} of them, {p:.1f} SMs busy on average, "
                f"{kv / 2 ** 20:.2f} MiB of K/V read, {cells} executed cells")
        best = f"BLOCK_M = {want}: {wp:.1f} SMs busy, {wkv / 2 ** 20:.2f} MiB, {wcells} cells"
        why = ""
        if p < n_sms and w.programs >= n_sms > working:
            why = (f" The grid starts {w.programs} programs, enough for {n_sms} SMs on paper, but {w.early_exits} of "
                   "them return at once (tiles past a short request's end) and keep no SM busy.")
        elif p < n_sms <= working:
            why = (f" {working} programs compute, enough for {n_sms} SMs on paper, but they do not finish together: while "
                   f"the longest walks its {span} key tiles, the short requests' programs are long done, their SMs idle.")
        if p < n_sms <= wp:
            return f"{mine}.{why or f' {n_sms - p:.0f} of the {n_sms} SMs sit idle on average.'} {best} keeps all {n_sms} busy"
        if p < wp:
            return (f"{mine}.{why} Here no choice keeps the {n_sms} SMs busy, so take the most busy: {best}. A bigger "
                    "tile only adds wasted cells when the machine is not full anyway")
        if kv > wkv:
            return (f"{mine}; {best} also keeps the SMs busy and reads {kv / wkv:.1f}x less: each query tile re-reads its "
                    "request's keys and values, so K/V traffic grows as L^2 d / BLOCK_M (bytes the kernel loads; on a "
                    "GPU re-reads of a request that fits in L2 mostly hit the cache, not HBM)")
        return f"{mine}; {best} (the same K/V bytes and busy SMs, fewer executed cells)"
    return grade("tiles", fn, TILE_CASES, judge,
                 f"the BLOCK_M of least K/V traffic that keeps the GPU busy, {len(TILE_CASES)} mixes")


def check_grid_trap(fn: Callable[[], tuple]) -> bool:
    """Exercise 07.3, the counter-example: ``fn() -> (seq_lens, n_heads)``, a mix (not one of ``TILE_CASES``) for
    which counting the grid's programs picks another BLOCK_M than counting the SMs kept busy (``tiling.tile_costs``), on
    ``H200.n_sms`` SMs."""
    def judge(got):
        try:
            lens, heads = [int(n) for n in got[0]], int(got[1])
        except (TypeError, ValueError, IndexError):
            return f"expected (seq_lens, n_heads), got {got!r}"[:200]
        if not lens or min(lens) < 1 or sum(lens) > TRAP_MAX_TOKENS or not 1 <= heads <= TRAP_MAX_HEADS:
            return (f"got {got!r}: lengths >= 1, at most {TRAP_MAX_TOKENS} tokens in all, 1 to {TRAP_MAX_HEADS} "
                    "heads")[:300]
        if any(sorted(lens) == sorted(c[0]) and heads == c[1] for c in TILE_CASES):
            return "that mix is one of the checker's cases above: find one of your own"
        naive, real = (tiling.best_block_m(lens, heads, H200.n_sms, TILE_SIZES, **TILE, busy=b) for b in (False, True))
        rows = ", ".join(f"{bm}: {tile_work(lens, heads, bm).programs} programs, "
                         f"{tiling.tile_costs(lens, heads, bm, **TILE)[0]:.1f} SMs busy" for bm in TILE_SIZES)
        print(f"  {lens[:8]}{' ...' if len(lens) > 8 else ''} x {heads} heads: {rows}")
        if naive == real:
            return (f"both counts pick BLOCK_M = {real} here. A trap needs a tile size whose grid reaches {H200.n_sms} "
                    "programs while its work keeps far fewer SMs busy (programs that return at once, or walk one key "
                    "tile while the longest walks many): one long request sizes every request's slots, so put short "
                    "ones beside it")
        print(f"  counting the grid picks BLOCK_M = {naive}, counting the SMs kept busy {real}")
        return None
    return grade("grid_trap", fn, [()], judge, "a mix where the grid's program count misleads the choice of BLOCK_M")
