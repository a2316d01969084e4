"""What lesson 03 (masked vs varlen attention) draws, explores and checks.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import NormalDist

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..core.attention import attention_ref, block_diag_mask, plain_attention
from ..core.batch import cumulative, seq_lens_to_cu_seqlens
from ..validate import check_int, check_lengths
from ..measure.flops import METHODS, attention_cells
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import Tensor, grade, int_tuple, matches, tensor_problem
from .l01_flat_batch import LENS_CASES
from .style import CELL_CMAP, CELL_COLORS, CELL_LABELS, SKIPPED, USEFUL, WASTED, short_lens


def attention_categories(seq_lens: Sequence[int], method: str, causal: bool = False,
                         max_pixels: int | None = None) -> np.ndarray:
    """The score matrix of one head in one layer, one code per cell (SKIPPED, USEFUL, WASTED).

    ``masked`` and ``varlen`` are ``[T, T]`` over the flat rows. ``padded`` is drawn as the
    ``[R·Lmax, R·Lmax]`` block-diagonal of its R separate ``[Lmax, Lmax]`` matrices, so all
    three pictures share one layout. Counting the codes of the full-size grid gives exactly
    ``flops.attention_cells(seq_lens, method, causal)``.

    ``max_pixels``: sample at most that many rows/columns (for drawing large batches); the
    sampled grid is a picture, not a count.
    Returns ``uint8 [n, n]``.
    """
    lens = check_lengths(seq_lens)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    lens_a = np.asarray(lens, dtype=np.int64)
    if method == "padded":
        lmax = int(lens_a.max())
        n = len(lens) * lmax
        idx = _sample(n, max_pixels)
        rid, pos = idx // lmax, idx % lmax
        real = pos < lens_a[rid]
    else:
        n = int(lens_a.sum())
        idx = _sample(n, max_pixels)
        owner = np.repeat(np.arange(len(lens)), lens_a)
        starts = np.concatenate([[0], np.cumsum(lens_a)[:-1]])
        rid = owner[idx]
        pos = idx - starts[rid]
        real = np.ones_like(idx, dtype=bool)
    same = rid[:, None] == rid[None, :]
    need = same & real[:, None] & real[None, :]
    if causal:
        need &= pos[:, None] >= pos[None, :]
    computed = {"padded": same, "masked": np.ones_like(same), "varlen": need}[method]
    return np.where(need, USEFUL, np.where(computed, WASTED, SKIPPED)).astype(np.uint8)

def _sample(n: int, max_pixels: int | None) -> np.ndarray:
    if max_pixels is None or n <= max_pixels:
        return np.arange(n)
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
    return (np.arange(max_pixels) * n + n // 2) // max_pixels  # cell centres, evenly spread

def _draw_attention(ax, lens: list[int], method: str, causal: bool, max_pixels: int | None) -> None:
    grid = attention_categories(lens, method, causal, max_pixels)
    lmax = max(lens)
    n = len(lens) * lmax if method == "padded" else sum(lens)
    ax.imshow(grid, cmap=CELL_CMAP, vmin=0, vmax=2, interpolation="nearest", extent=(0, n, n, 0))
    for side in ax.spines.values():  # a frame, so never-computed (white) cells have an edge
        side.set_visible(True)
    edges = [i * lmax for i in range(len(lens) + 1)] if method == "padded" else cumulative(lens)
    if len(edges) <= 65:
        for e in edges[1:-1]:
            ax.axhline(e, color="#555555", linewidth=0.5)
            ax.axvline(e, color="#555555", linewidth=0.5)
    ticks = edges if len(edges) <= 6 else []
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.tick_params(labelsize=7, length=2)
    c = attention_cells(lens, method, causal)
    ax.set_title(f"{method}\ncomputed {c.computed}\nuseful {c.useful} | wasted {c.wasted}", fontsize=8)
    ax.set_xlabel("key row" + (" (per padded request)" if method == "padded" else ""), fontsize=7)

def attention_patterns(seq_lens: Sequence[int], methods: Sequence[str] = METHODS, causal: bool = False,
                       figsize=(8.4, 3.8), max_pixels: int | None = 400) -> Figure:
    """The three attention pictures of claims C2, C8, C10 side by side, one axis per method.

    Each title carries ``attention_cells`` counts (per head per layer; ``causal=False`` is the
    article's whole-block convention).
    """
    lens = check_lengths(seq_lens)
    fig = Figure(figsize=figsize)
    axes = fig.subplots(1, len(methods))
    axes = np.atleast_1d(axes)
    for ax, method in zip(axes, methods):
        _draw_attention(ax, lens, method, causal, max_pixels)
    axes[0].set_ylabel("query row", fontsize=7)
    fig.legend(handles=[Patch(facecolor=CELL_COLORS[k], edgecolor="#888888", label=CELL_LABELS[k])
                        for k in (USEFUL, WASTED, SKIPPED)], loc="lower center", ncol=3, fontsize=7, frameon=False)
    kind = "causal (lower triangles useful)" if causal else "whole blocks, non-causal (article's count)"
    fig.suptitle(f"score cells per head per layer, lengths {short_lens(lens)}: {kind}", fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.18, top=0.74, wspace=0.35)
    return fig

def masked_growth(length: int = 64, num_requests: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> Figure:
    """Claim C9: cells computed by masked attention, ``(R·L)²``, against the useful ``R·L²``."""
    rs = list(num_requests)
    masked = [attention_cells([length] * r, "masked").computed for r in rs]
    useful = [attention_cells([length] * r, "varlen").computed for r in rs]
    fig = Figure(figsize=(6, 3.4))
    ax = fig.add_subplot()
    ax.plot(rs, masked, "o-", color=CELL_COLORS[WASTED], label="masked computes (R*L)^2")
    ax.plot(rs, useful, "o-", color=CELL_COLORS[USEFUL], label="varlen computes R*L^2 (all useful)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"number of requests R (each L={length} tokens)")
    ax.set_ylabel("score cells per head per layer")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title("masked waste grows like R^2, useful work like R", fontsize=9)
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.15, top=0.9)
    return fig

PATTERNS = ("ramp", "equal", "long-tail")

_LONG_TAIL_SIGMA = 1.0

_LONG_TAIL_SEED = 0

def explorer_seq_lens(num_requests: int, length: int, pattern: str) -> list[int]:
    """Request lengths for ``num_requests`` requests around a base ``length``.

    "ramp": R=1 → [L]; otherwise request i gets ``round(L·(1 + 2i/(R-1)))`` (L to 3L; R=2, L=10 →
    [10, 30], the article's A and B). "equal": [L]·R. "long-tail": lognormal quantiles with
    median L (σ=1), shuffled with a fixed seed: deterministic, each >= 1.
    """
    r = check_int("num_requests", num_requests, 1, 1 << 20)
    n = check_int("length", length, 1, 1 << 30)
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; choose one of {PATTERNS}")
    if pattern == "equal":
        return [n] * r
    if pattern == "ramp":
        return [n] if r == 1 else [round(n * (1 + 2 * i / (r - 1))) for i in range(r)]
    z = [NormalDist().inv_cdf((i + 0.5) / r) for i in range(r)]
    lens = [max(1, round(n * float(np.exp(_LONG_TAIL_SIGMA * zi)))) for zi in z]
    order = np.random.default_rng(_LONG_TAIL_SEED).permutation(r)
    return [lens[int(i)] for i in order]

def diagonal_block_state(num_requests: int, length: int, pattern: str) -> dict:
    """``{"seq_lens": [...], "counts": {method: AttentionCells}}`` for padded, masked, varlen
    (per head per layer, non-causal whole blocks: the article's convention)."""
    lens = explorer_seq_lens(num_requests, length, pattern)
    return {"seq_lens": lens, "counts": {m: attention_cells(lens, m) for m in METHODS}}

def diagonal_block_html(state: dict) -> str:
    """One ``<div>`` per method: ``padded: computed 1800 | useful 1000 | wasted 800``."""
    return "".join(f"<div>{m}: computed {c.computed} | useful {c.useful} | wasted {c.wasted}</div>"
                   for m, c in state["counts"].items())

def diagonal_block_explorer(num_requests: int = 2, length: int = 10, pattern: str = "ramp"):
    """VBox class ``dbx``: sliders ``dbx-num-requests`` (1..16), ``dbx-length`` (1..64), Dropdown
    ``dbx-pattern``, HTML ``dbx-counts`` (one line per method), HTML ``dbx-lengths``, Output
    ``dbx-figure`` (the three attention matrices, redrawn on every change)."""
    w = ipywidgets_module()
    reqs = tagged(w.IntSlider(value=num_requests, min=1, max=16, description="requests R"), "dbx-num-requests")
    base = tagged(w.IntSlider(value=length, min=1, max=64, description="base length L"), "dbx-length")
    pat = tagged(w.Dropdown(options=list(PATTERNS), value=pattern, description="pattern"), "dbx-pattern")
    counts, lengths = tagged(w.HTML(), "dbx-counts"), tagged(w.HTML(), "dbx-lengths")
    out = tagged(w.Output(), "dbx-figure")

    def update(change=None):
        state = diagonal_block_state(reqs.value, base.value, pat.value)
        counts.value = diagonal_block_html(state)
        lens = state["seq_lens"]
        lengths.value = f"<div>lengths {lens if len(lens) <= 16 else '...'} | T = {sum(lens)} flat rows</div>"
        show_figure(out, attention_patterns(lens, figsize=(7.5, 3.4), max_pixels=240))

    return explorer("dbx", [reqs, base, pat], [counts, lengths, out], update)

def _qkv_cases(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for lens, h, d in (([10, 30], 2, 8), ([3, 1, 5], 1, 4), ([6], 2, 4)):
        t = sum(lens)
        q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
        out.append((q, k, v, seq_lens_to_cu_seqlens(lens)))
    return out

def check_causal_varlen(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> bool:
    """Exercise 03.1: ``fn(q, k, v, cu_seqlens) -> [T, H, D]``, the article's loop with a causal
    mask inside each request's block (query i sees keys 0..i of its own request)."""
    def judge(got, q, k, v, cu):
        want = attention_ref(q, k, v, cu, causal=True)
        problem = tensor_problem(got, want, atol=1e-5)
        if problem is None:
            return None
        if matches(got, attention_ref(q, k, v, cu, causal=False), 1e-5):
            return problem + " - no causal mask: set scores above the diagonal of each block to -inf"
        if matches(got, plain_attention(q, k, v, causal=True), 1e-5):
            return problem + " - queries read other requests' keys: slice q, k, v with cu_seqlens"
        if matches(got, attention_ref(q, k, v, cu, causal=True, softmax_scale=1.0), 1e-5):
            return problem + " - scale the scores by 1 / sqrt(d_head) before the softmax"
        return problem
    return grade("causal_varlen", fn, _qkv_cases(4), judge, "equals the padded fp32 reference on 3 batches")

def check_masked_cells(fn: Callable[[list], tuple]) -> bool:
    """Exercise 03.2: ``fn(seq_lens) -> (computed, useful, wasted)`` of MASKED attention (C8)."""
    def judge(got, lens):
        c = attention_cells(lens, "masked")
        want = (c.computed, c.useful, c.wasted)
        got, problem = int_tuple(got, "computed, useful, wasted")
        if problem or got == want:
            return problem
            return None
        hint = ""
        if got[1] == sum(n * (n + 1) // 2 for n in lens):
            hint = " - count whole diagonal blocks (the article's convention): useful = sum of L_i^2"
        elif got[0] == sum(n * n for n in lens):
            hint = " - masked attention computes the whole T x T matrix before masking"
        return f"got {got}, expected {want}{hint}"
    return grade("masked_cells", fn, [(list(c),) for c in LENS_CASES], judge,
                  "computed T^2, useful sum L_i^2, wasted the rest, on 5 batches")

def check_doc_mask(fn: Callable[[Tensor], Tensor]) -> bool:
    """Exercise 03.3: ``fn(cu_seqlens) -> bool [T, T]``, True where query row and key row belong to
    the same request (the non-causal block-diagonal mask)."""
    def judge(got, cu):
        want = block_diag_mask(cu, causal=False)
        if not isinstance(got, Tensor):
            return f"expected a bool tensor, got {type(got).__name__}"
        if tuple(got.shape) != tuple(want.shape):
            return f"shape {list(got.shape)}, expected {list(want.shape)} (T x T, T = cu_seqlens[-1])"
        if got.dtype != torch.bool:
            return f"dtype {got.dtype}, expected torch.bool"
        if torch.equal(got, want):
            return None
        if torch.equal(got, ~want):
            return "the mask is inverted: True means 'may attend' (same request)"
        wrong = (got != want).nonzero()[0].tolist()
        return f"{int((got != want).sum())} cells differ, e.g. [query {wrong[0]}, key {wrong[1]}]"
    cases = [(seq_lens_to_cu_seqlens(c),) for c in LENS_CASES]
    return grade("doc_mask", fn, cases, judge, "block-diagonal mask equals block_diag_mask on 5 batches")

@register("03_attention_patterns", lesson="03",
          caption="padded, masked and varlen score matrices for A, B: 1800/1600/1000 computed, 1000 useful (C2, C8, C10)")
def _attention_patterns() -> Figure:
    return attention_patterns(ARTICLE_LENS)

@register("03_masked_growth", lesson="03", caption="masked computes (R L)^2 cells, varlen R L^2 (C9)")
def _masked_growth() -> Figure:
    return masked_growth(64)
