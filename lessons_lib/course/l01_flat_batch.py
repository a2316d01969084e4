"""What lesson 01 (padding vs one flat batch) draws, explores and checks.

Figures: ``01_padded_vs_flat`` (the padded grid above the flat strip, and what padding costs in
attention score cells) and ``01_token_strip`` (the flat batch's positions, restarting at every
``cu_seqlens`` boundary). The explorer ``flat_batch_explorer`` wraps ``flat_batch_state``.
Exercise checkers: ``check_pack``, ``check_padding_extremes``, ``check_unpad``.

Taught in notebooks/01_flat_batch.ipynb.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..core.batch import cumulative, pack, unpad_input
from ..measure.flops import attention_cells, executed_tokens
from ..measure.tolerance import float64_twin  # noqa: F401 - lesson 01 shows it as L.float64_twin
from ..style import ATTENTION, MIN_FONT, OTHER, TEXT, WASTE, cu_ticks, draw_strip, request_color, request_name
from ..validate import check_lengths
from .explore import explorer, ipywidgets_module, parse_lengths, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import Tensor, grade

_SHOWN = 16  # requests drawn one by one; beyond this the picture keeps its totals only


def padded_vs_flat(seq_lens: Sequence[int]) -> Figure:
    """Claims C2 and C3 side by side for any lengths.

    Left, top: the padded ``[R, Lmax]`` grid, one orange Rectangle per request (gid
    ``real-i``) and one hatched vermillion per pad span (gid ``pad-i``). Left, bottom: the flat
    strip of ``Σ L`` rows (thin white lines between tokens) with numbered ticks at
    ``cu_seqlens``. Right: attention score cells per head per layer of each request once
    padded: its own ``L_i²`` (blue, useful) and the ``Lmax² − L_i²`` padding adds
    (vermillion), gids ``useful-i`` / ``wasted-i``.
    """
    lens = check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    r, lmax, total = len(lens), max(lens), sum(lens)
    shown = min(r, _SHOWN)
    fig = Figure(figsize=(10.5, 3.6 + 0.3 * shown))
    gs = fig.add_gridspec(2, 2, width_ratios=[2.3, 1], height_ratios=[max(1.2, 0.4 * shown), 1.0], hspace=1.0,
                          wspace=0.28)
    top, bottom, cells = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[:, 1])
    for i, n in enumerate(lens[:shown]):
        y = shown - 1 - i
        top.add_patch(Rectangle((0, y), n, 0.9, facecolor=request_color(i), edgecolor="white", linewidth=0.5,
                                gid=f"real-{i}"))
        if n < lmax:
            top.add_patch(Rectangle((n, y), lmax - n, 0.9, facecolor=WASTE, edgecolor="white", hatch="///",
                                    linewidth=0.5, gid=f"pad-{i}"))
    top.set_xlim(0, lmax)
    top.set_ylim(0, shown)
    top.set_yticks([shown - 1 - i + 0.45 for i in range(shown)])
    top.set_yticklabels([f"{request_name(i)} ({n})" for i, n in enumerate(lens[:shown])], fontsize=MIN_FONT)
    top.tick_params(axis="x", labelsize=MIN_FONT)
    top.set_xlabel("row within the request (padded to Lmax)", fontsize=MIN_FONT)
    more = f" (first {shown} of {r} requests drawn)" if r > shown else ""
    top.set_title(f"padded [{r} x {lmax} x d]: {r * lmax} rows computed, {total} useful, {r * lmax - total} pad{more}",
                  fontsize=MIN_FONT + 1)
    draw_strip(bottom, lens)
    bottom.set_xlim(0, total)
    bottom.set_ylim(0, 1)
    bottom.set_yticks([])
    cu_ticks(bottom, cumulative(lens))
    bottom.tick_params(axis="x", labelsize=MIN_FONT)
    bottom.set_xlabel("flat row: thin white lines separate the tokens; the numbered ticks are cu_seqlens"
                      if total <= 80 else "flat row; the numbered ticks are cu_seqlens", fontsize=MIN_FONT)
    bottom.set_title(f"flat [{total} x d]: {total} rows, all useful, no batch dimension", fontsize=MIN_FONT + 1)
    for i, n in enumerate(lens[:shown]):
        cells.bar(i, n * n, color=ATTENTION, gid=f"useful-{i}")
        cells.bar(i, lmax * lmax - n * n, bottom=n * n, color=WASTE, hatch="///", edgecolor="white", gid=f"wasted-{i}")
        if shown <= 8:  # the full label fits beside 2-3 bars; up to 8, the ratio alone
            label = f"{lmax * lmax:,} = {lmax * lmax / (n * n):.3g}x\nits own {n * n:,}" if shown <= 3 else \
                f"{lmax * lmax / (n * n):.3g}x"
            cells.text(i, lmax * lmax, label, ha="center", va="bottom", fontsize=MIN_FONT, color=TEXT)
    cells.set_xticks(range(shown))
    cells.set_xticklabels([request_name(i) for i in range(shown)], fontsize=MIN_FONT)
    cells.set_ylim(0, lmax * lmax * 1.3)
    cells.tick_params(axis="y", labelsize=MIN_FONT)
    cells.set_title("score cells per head per layer once\npadded: own L² + what padding adds", fontsize=MIN_FONT + 1)
    fig.legend(handles=[Patch(facecolor=request_color(0), label="real token (requests alternate two shades)"),
                        Patch(facecolor=WASTE, hatch="///", edgecolor="white", label="pad row / padding's cells"),
                        Patch(facecolor=ATTENTION, label="useful score cells: L_i²")],
               fontsize=MIN_FONT, frameon=False, loc="lower center", ncol=3)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.24 - 0.005 * shown, top=0.86)
    return fig


def flat_positions(seq_lens: Sequence[int]) -> Figure:
    """Claim C3: what travels with the flat rows. One bar per flat row, its height the token's
    position (0, 1, ... restarting for every request), coloured by request; dashed lines at
    ``cu_seqlens`` (gid ``cu-i``), and ``max_seqlen`` (the longest request) marked."""
    lens = check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    cu = cumulative(lens)
    fig = Figure(figsize=(10, 3.0))
    ax = fig.add_subplot()
    for i, n in enumerate(lens):
        ax.bar([cu[i] + j + 0.5 for j in range(n)], [j + 0.6 for j in range(n)], bottom=-0.6, width=0.85, color=request_color(i),
               edgecolor="none", gid=f"positions-{i}")
        if n >= max(1, cu[-1] // 20):
            ax.text(cu[i] + n / 2, max(lens) * 1.02, f"{request_name(i)}: rows {cu[i]}..{cu[i + 1] - 1}", ha="center",
                    va="bottom", fontsize=MIN_FONT, color=TEXT)
    for i, c in enumerate(cu):
        ax.axvline(c, color=OTHER, linestyle="--", linewidth=1, gid=f"cu-{i}")
    ax.axhline(max(lens) - 1, color=OTHER, linestyle=":", linewidth=1)
    ax.text(cu[-1], max(lens) - 1, f" max_seqlen = {max(lens)}\n (positions 0..{max(lens) - 1})", va="center",
            ha="left", fontsize=MIN_FONT, color=TEXT)
    ax.set_xlim(0, cu[-1])
    ax.set_ylim(-0.6, max(lens) * 1.22)
    cu_ticks(ax, cu)
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_xlabel(f"flat row (one bar per token); the numbered ticks are cu_seqlens = {cu if len(cu) <= 12 else '[...]'}",
                  fontsize=MIN_FONT)
    ax.set_ylabel("position id", fontsize=MIN_FONT)
    ax.set_title(f"flat batch [{cu[-1]} x d]: each request's positions restart at 0 at its cu_seqlens boundary",
                 fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.07, right=0.85, bottom=0.17, top=0.88)
    return fig


def flat_batch_state(seq_lens: Sequence[int]) -> dict:
    """Everything the flat-batch explorer shows (claims C2, C3).

    Keys: ``seq_lens``, ``cu_seqlens`` (list), ``max_seqlen``, ``padded_rows`` (R·Lmax),
    ``flat_rows`` (Σ L), ``pad_rows``, ``row_ratio`` (padded / flat rows), ``attention``
    ({"padded", "varlen"}: AttentionCells per head per layer, whole blocks).
    """
    lens = check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    padded, flat = executed_tokens(lens, "padded"), executed_tokens(lens, "varlen")
    return {"seq_lens": lens, "cu_seqlens": cumulative(lens), "max_seqlen": max(lens), "padded_rows": padded,
            "flat_rows": flat, "pad_rows": padded - flat, "row_ratio": padded / flat,
            "attention": {m: attention_cells(lens, m) for m in ("padded", "varlen")}}


def flat_batch_html(state: dict) -> str:
    a_pad, a_var = state["attention"]["padded"], state["attention"]["varlen"]
    cu = state["cu_seqlens"]
    return (f"<div>cu_seqlens = {cu if len(cu) <= 17 else '[...]'} | max_seqlen = {state['max_seqlen']}</div>"
            f"<div>rows: padded {state['padded_rows']} | flat {state['flat_rows']} | "
            f"pad {state['pad_rows']} | ratio {state['row_ratio']:.2f}x</div>"
            f"<div>score cells per head per layer: padded {a_pad.computed:,} | flat (varlen) {a_var.computed:,} | "
            f"ratio {a_pad.computed / a_var.computed:.2f}x</div>")


def flat_batch_explorer(lengths: str = "10, 30"):
    """VBox class ``fbx``: Text ``fbx-lengths``, HTML ``fbx-counts``, Output ``fbx-figure``.

    Type request lengths; the counts and ``padded_vs_flat`` follow. Bad input shows the error
    text in ``fbx-counts`` (class ``fbx-error`` added) instead of raising.
    """
    w = ipywidgets_module()
    text = tagged(w.Text(value=lengths, description="lengths", continuous_update=False), "fbx-lengths")
    counts, out = tagged(w.HTML(), "fbx-counts"), tagged(w.Output(), "fbx-figure")

    def update(change=None):
        try:
            state = flat_batch_state(parse_lengths(text.value))
        except ValueError as exc:
            counts.add_class("fbx-error")
            counts.value = f"<div>{exc}</div>"
            return
        counts.remove_class("fbx-error")
        counts.value = flat_batch_html(state)
        show_figure(out, padded_vs_flat(state["seq_lens"]))

    return explorer("fbx", [text], [counts, out], update)


# ---------------------------------------------------------------------------------------------
# Exercises

LENS_CASES = [[10, 30], [5], [1, 1, 1], [7, 1, 12, 3], [30, 10]]


def _token_cases(seed: int = 3) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 1000, (n,), generator=g).tolist() for n in lens]
            for lens in ([10, 30], [4], [6], [1, 1, 1], [7, 1, 12, 3])]


def _as_list(x):
    return x.tolist() if isinstance(x, Tensor) else list(x) if isinstance(x, (list, tuple)) else x


def check_pack(fn: Callable[[list], tuple]) -> bool:
    """Exercise 01.1: ``fn(requests) -> (input_ids [T] int64, positions [T] int64, cu_seqlens [R+1]
    int32, max_seqlen int)`` for a list of token-id lists, graded against ``core.batch.pack``."""
    def judge(got, requests):
        want = pack(requests)
        if not isinstance(got, (tuple, list)) or len(got) != 4:
            return f"expected a tuple (input_ids, positions, cu_seqlens, max_seqlen), got {got!r}"
        ids, pos, cu, mx = got
        for name, t in (("input_ids", ids), ("positions", pos), ("cu_seqlens", cu)):
            if not isinstance(t, Tensor):
                return f"{name} must be a tensor (the kernel takes tensors), got {type(t).__name__}"
        lens, total = want.seq_lens, want.num_tokens
        if ids.tolist() != want.input_ids.tolist():
            return "input_ids differ - concatenate the requests' token ids in order, nothing in between"
        if pos.tolist() != want.positions.tolist():
            if pos.tolist() == list(range(total)):
                return ("positions run 0..T-1 across the whole batch - they restart at 0 for every request, "
                        "as if each ran alone (else request B's first token gets position 10 and a different embedding)")
            if pos.tolist() == [p + 1 for p in want.positions.tolist()]:
                return "positions start at 0, not 1"
            return f"positions {pos.tolist()[:12]}... expected {want.positions.tolist()[:12]}..."
        if cu.tolist() != want.cu_seqlens.tolist():
            if cu.tolist() == want.cu_seqlens.tolist()[1:]:
                return "cu_seqlens has R + 1 entries: it starts with 0 (request i owns rows cu[i] .. cu[i+1]-1)"
            if cu.tolist() == [0] + lens:
                return "cu_seqlens is cumulative: each entry adds the next length to the previous one"
            return f"cu_seqlens {cu.tolist()}, expected {want.cu_seqlens.tolist()}"
        if cu.dtype != torch.int32:
            return f"cu_seqlens is {cu.dtype}; varlen kernels (FlashAttention, vLLM) take int32"
        if isinstance(mx, bool) or not isinstance(mx, int):
            return f"max_seqlen must be a Python int, got {type(mx).__name__}"
        if mx != want.max_seqlen:
            hint = " - the longest request, not the total" if mx == total else ""
            return f"max_seqlen {mx}, expected {want.max_seqlen}{hint}"
        return None
    return grade("pack", fn, [(c,) for c in _token_cases()], judge,
                 "input_ids, restarting positions, int32 cu_seqlens and max_seqlen agree with pack on 5 batches")


EXTREME_CASES = [(40, 2), (100, 4), (10, 3), (7, 7), (50, 3), (1000, 10)]


def pad_rows(lens: Sequence[int]) -> int:
    """Pad rows of a padded batch: ``R · Lmax − Σ L``."""
    return len(lens) * max(lens) - sum(lens)


def check_padding_extremes(fn: Callable[[int, int], tuple]) -> bool:
    """Exercise 01.2: ``fn(total, num_requests) -> (worst, best)``: two lists of ``num_requests``
    positive lengths adding up to ``total``; ``worst`` makes padding add the most pad rows, ``best``
    the fewest."""
    def judge(got, total, r):
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return f"expected a pair (worst, best) of length lists, got {got!r}"
        most, least = (r - 1) * (total - r), r * math.ceil(total / r) - total
        for name, lens, want in (("worst", got[0], most), ("best", got[1], least)):
            lens = _as_list(lens)
            if not isinstance(lens, list) or len(lens) != r or not all(isinstance(n, int) for n in lens):
                return f"{name}: expected a list of {r} ints, got {lens!r}"
            if min(lens) < 1:
                return f"{name} {lens}: every request needs at least one token (pack rejects an empty prompt)"
            if sum(lens) != total:
                hint = (f" - when {r} does not divide {total}, give the remainder to some requests, one token each"
                        if name == "best" and len(set(lens)) == 1 else "")
                return f"{name} {lens} holds {sum(lens)} tokens, not {total}{hint}"
            if pad_rows(lens) != want:
                hint = (" - the pad rows are R x Lmax - T: make one request as long as the others allow (all the others "
                        "1 token)" if name == "worst" else
                        " - the longest request sets Lmax for everyone: spread the tokens as evenly as possible")
                return f"{name} {lens} gives {pad_rows(lens)} pad rows, but {want} is possible{hint}"
        return None
    return grade("padding_extremes", fn, EXTREME_CASES, judge,
                 "worst: one long request among 1-token ones, (R-1)(T-R) pad rows; best: lengths within one token "
                 "of each other, R*ceil(T/R) - T pad rows")


def _unpad_cases(seed: int = 5) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    cases = []
    for lens, s, left in (([10, 30], 30, False), ([3, 1, 5], 5, False), ([4, 4], 4, False), ([2, 5], 5, True),
                          ([6, 1, 3], 6, True)):
        mask = torch.zeros(len(lens), s, dtype=torch.bool)
        for b, n in enumerate(lens):
            mask[b, s - n:] = True if left else False
            mask[b, :n] = False if left else True
        x = torch.randn(len(lens), s, 4, generator=g) * mask[..., None]
        cases.append((x, mask))
    return cases


def check_unpad(fn: Callable[[Tensor, Tensor], tuple]) -> bool:
    """Exercise 01.3: ``fn(padded [B, S, d], mask [B, S] bool) -> (flat [T, d], cu_seqlens [B+1] int32)``,
    graded against ``core.batch.unpad_input`` (FlashAttention's ``bert_padding.unpad_input``)."""
    def judge(got, x, mask):
        flat, _, cu, _, _ = unpad_input(x, mask)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return f"expected a pair (flat, cu_seqlens), got {type(got).__name__}"
        g_flat, g_cu = got
        if not isinstance(g_flat, Tensor) or not isinstance(g_cu, Tensor):
            return "return two tensors: flat [T, d] and cu_seqlens [B+1]"
        if tuple(g_flat.shape) != tuple(flat.shape):
            if tuple(g_flat.shape) == (x.shape[0] * x.shape[1], x.shape[2]):
                return f"flat has shape {list(g_flat.shape)}: it still holds the pad rows - keep only rows where mask is True"
            return f"flat has shape {list(g_flat.shape)}, expected {list(flat.shape)}"
        if not torch.equal(g_flat, flat):
            right = torch.cat([x[b, :int(n)] for b, n in enumerate(mask.sum(1))])
            if torch.equal(g_flat, right):
                return ("right rows count, wrong rows: this mask has its pads on the LEFT (as generation batches often "
                        "do) - select the rows the mask marks, not the first L of each request")
            return "flat holds the wrong rows - in order: request 0's real rows, then request 1's, ..."
        if g_cu.tolist() != cu.tolist():
            if g_cu.tolist() == cu.tolist()[1:]:
                return "cu_seqlens has B + 1 entries: it starts with 0"
            if g_cu.tolist() == [x.shape[1] * b for b in range(x.shape[0] + 1)]:
                return "cu_seqlens counts real tokens (mask.sum per request), not the padded length S"
            return f"cu_seqlens {g_cu.tolist()}, expected {cu.tolist()}"
        if g_cu.dtype != torch.int32:
            return f"cu_seqlens is {g_cu.dtype}; varlen kernels take int32"
        return None
    return grade("unpad", fn, _unpad_cases(), judge,
                 "flat rows and int32 cu_seqlens agree with unpad_input on 5 batches, left padding included")


# ---------------------------------------------------------------------------------------------
# Registered figures

@register("01_padded_vs_flat", lesson="01",
          caption="A=10, B=30: padded [2 x 30] (20 pad rows; A's scores 900 cells instead of 100) vs flat [40] (C2, C3)")
def _padded_vs_flat() -> Figure:
    return padded_vs_flat(ARTICLE_LENS)


@register("01_token_strip", lesson="01",
          caption="the flat batch's positions restart at every cu_seqlens boundary [0, 10, 40]; max_seqlen = 30 (C3)")
def _token_strip() -> Figure:
    return flat_positions(ARTICLE_LENS)
