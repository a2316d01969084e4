"""What lesson 01 (padding vs one flat batch) draws, explores and checks.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..core.batch import cumulative, seq_lens_to_cu_seqlens, unpack
from ..validate import check_lengths
from ..measure.flops import attention_cells, executed_tokens
from .explore import explorer, ipywidgets_module, parse_lengths, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import Tensor, grade, int_tuple
from .style import PAD_COLOR, cu_ticks, draw_strip, request_color, request_name, token_strip


def padded_vs_flat(seq_lens: Sequence[int]) -> Figure:
    """Claim C2 vs C3: the padded ``[R, Lmax]`` grid (grey = pad rows) above the flat strip.

    Top axis: one coloured Rectangle per real request span and one grey per pad span.
    """
    lens = check_lengths(seq_lens)
    r, lmax, total = len(lens), max(lens), sum(lens)
    fig = Figure(figsize=(8, 1.2 + 0.32 * min(r, 16) + 1.0))
    gs = fig.add_gridspec(2, 1, height_ratios=[max(1.0, 0.45 * min(r, 16)), 1.0], hspace=0.9)
    top, bottom = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
    for i, n in enumerate(lens):
        y = r - 1 - i
        top.add_patch(Rectangle((0, y), n, 0.9, facecolor=request_color(i), edgecolor="white", linewidth=0.5))
        if n < lmax:
            top.add_patch(Rectangle((n, y), lmax - n, 0.9, facecolor=PAD_COLOR, edgecolor="white",
                                    hatch="///", linewidth=0.5))
    top.set_xlim(0, lmax)
    top.set_ylim(0, r)
    top.set_yticks([r - 1 - i + 0.45 for i in range(r)] if r <= 16 else [])
    top.set_yticklabels([f"{request_name(i)} ({n})" for i, n in enumerate(lens)] if r <= 16 else [], fontsize=8)
    top.set_title(f"padded: [{r} x {lmax} x d] = {r * lmax} rows computed, {total} useful, "
                  f"{r * lmax - total} pad", fontsize=10)
    draw_strip(bottom, lens)
    bottom.set_xlim(0, total)
    bottom.set_ylim(0, 1)
    bottom.set_yticks([])
    cu_ticks(bottom, cumulative(lens))
    bottom.set_title(f"flat: [{total} x d] = {total} rows, all useful; ticks at cu_seqlens", fontsize=10)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    return fig

def flat_batch_state(seq_lens: Sequence[int]) -> dict:
    """Everything the flat-batch explorer shows (claims C2, C3).

    Keys: ``seq_lens``, ``cu_seqlens`` (list), ``padded_rows`` (R·Lmax), ``flat_rows`` (Σ L),
    ``pad_rows``, ``row_ratio`` (padded / flat rows), ``attention`` ({"padded", "varlen"}:
    AttentionCells per head per layer, non-causal).
    """
    lens = check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    cu = cumulative(lens)
    padded, flat = executed_tokens(lens, "padded"), executed_tokens(lens, "varlen")
    return {"seq_lens": lens, "cu_seqlens": cu, "padded_rows": padded, "flat_rows": flat,
            "pad_rows": padded - flat, "row_ratio": padded / flat,
            "attention": {m: attention_cells(lens, m) for m in ("padded", "varlen")}}

def _flat_html(state: dict) -> str:
    a_pad, a_var = state["attention"]["padded"], state["attention"]["varlen"]
    return (f"<div>cu_seqlens: {state['cu_seqlens'] if len(state['cu_seqlens']) <= 17 else '[...]'}</div>"
            f"<div>padded: {state['padded_rows']} rows | flat: {state['flat_rows']} rows | "
            f"pad rows: {state['pad_rows']} | ratio {state['row_ratio']:.2f}x</div>"
            f"<div>attention cells per head per layer: padded {a_pad.computed} | flat (varlen) {a_var.computed}</div>")

def flat_batch_explorer(lengths: str = "10, 30"):
    """VBox class ``fbx``: Text ``fbx-lengths``, HTML ``fbx-counts``, Output ``fbx-figure``.

    Type request lengths; the counts and the padded-vs-flat picture follow. Bad input shows
    the error text in ``fbx-counts`` (class ``fbx-error`` added) instead of raising.
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
        counts.value = _flat_html(state)
        show_figure(out, padded_vs_flat(state["seq_lens"]))

    return explorer("fbx", [text], [counts, out], update)

LENS_CASES = [[10, 30], [5], [1, 1, 1], [7, 1, 12, 3], [30, 10]]

def check_cu_seqlens(fn: Callable[[list], list]) -> bool:
    """Exercise 01.1: ``fn(seq_lens) -> cu_seqlens`` as a list of ints (``[10, 30] -> [0, 10, 40]``)."""
    def judge(got, lens):
        want = seq_lens_to_cu_seqlens(lens).tolist()
        if isinstance(got, Tensor):
            got = got.tolist()
        if not isinstance(got, (list, tuple)):
            return f"expected a list of ints, got {type(got).__name__}"
        got = list(got)
        if got == want:
            return None
        hint = ""
        if len(got) == len(lens):
            hint = " - cu_seqlens has R + 1 entries: it starts with 0"
        elif got == [0] + list(lens):
            hint = " - it is cumulative: each entry adds the next length to the previous entry"
        elif got and got[-1] != sum(lens):
            hint = f" - the last entry must be the total token count {sum(lens)}"
        return f"got {got}, expected {want}{hint}"
    return grade("cu_seqlens", fn, [(list(c),) for c in LENS_CASES], judge,
                  "cu_seqlens = [0, L0, L0+L1, ...] on 5 batches")

def check_padding_rows(fn: Callable[[list], tuple]) -> bool:
    """Exercise 01.2: ``fn(seq_lens) -> (padded_rows, useful_rows)`` of the padded layout (C2)."""
    def judge(got, lens):
        want = (executed_tokens(lens, "padded"), executed_tokens(lens, "varlen"))
        got, problem = int_tuple(got, "padded_rows, useful_rows")
        if problem or got == want:
            return problem
            return None
        hint = ""
        if got[0] == max(lens) * max(lens):
            hint = " - padded rows are R x Lmax (every request is padded to the longest)"
        elif got[0] == sum(lens):
            hint = " - that is the flat row count; padding adds Lmax - L_i rows to each request"
        elif got[0] == want[0] - want[1]:
            hint = " - that is the pad-row count; the first number is all rows the padded batch computes"
        return f"got {got}, expected {want}{hint}"
    return grade("padding_rows", fn, [(list(c),) for c in LENS_CASES], judge,
                  "padded rows R x Lmax and useful rows sum(L) on 5 batches")

def check_split_flat(fn: Callable[[Tensor, Tensor], list]) -> bool:
    """Exercise 01.3: ``fn(x [T, d], cu_seqlens) -> list of [L_i, d]`` (unpack by hand)."""
    def judge(got, x, cu):
        want = unpack(x, cu)
        if not isinstance(got, (list, tuple)):
            return f"expected a list of tensors, got {type(got).__name__}"
        if len(got) != len(want):
            return f"got {len(got)} pieces, expected {len(want)} (one per request, len(cu_seqlens) - 1)"
        for i, (g, w) in enumerate(zip(got, want)):
            if not isinstance(g, Tensor) or tuple(g.shape) != tuple(w.shape):
                shape = list(g.shape) if isinstance(g, Tensor) else type(g).__name__
                return (f"request {i} has shape {shape}, expected {list(w.shape)} - request i owns rows "
                        f"cu_seqlens[i] .. cu_seqlens[i+1] - 1 (the end is exclusive)")
            if not torch.equal(g, w):
                return f"request {i} holds the wrong rows - slice x[cu_seqlens[i]:cu_seqlens[i+1]]"
        return None
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randn(sum(c), 4, generator=g), seq_lens_to_cu_seqlens(c)) for c in LENS_CASES]
    return grade("split_flat", fn, cases, judge, "flat rows split back into requests on 5 batches")

@register("01_token_strip", lesson="01", caption="A and B flattened into 40 rows, ticks at cu_seqlens = [0, 10, 40] (C3)")
def _token_strip() -> Figure:
    return token_strip(ARTICLE_LENS)

@register("01_padded_vs_flat", lesson="01", caption="padding to [2 x 30] (20 pad rows) vs the flat [40] rows (C2, C3)")
def _padded_vs_flat() -> Figure:
    return padded_vs_flat(ARTICLE_LENS)
