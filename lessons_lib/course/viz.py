"""Figures of the course as pure functions: numbers in, a matplotlib ``Figure`` out.

Nothing here touches pyplot's global state: every function builds its own ``Figure``, so a
notebook, a widget callback and ``python -m lessons_lib.figures`` draw the same picture
from the same numbers. ``show(fig)`` turns a figure into an inline PNG for a notebook.

Colours: a request keeps one colour everywhere (``request_color``). In attention pictures
blue is a useful score cell, orange a computed but wasted one (masked or padding), white a
cell that is never computed.

Taught in notebooks/00_setup_one_request.ipynb, notebooks/01_flat_batch.ipynb,
notebooks/02_linear_is_per_token.ipynb, notebooks/03_masked_vs_varlen_attention.ipynb,
notebooks/04_tp2_invariance.ipynb, notebooks/05_flop_regimes.ipynb and notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

import io
import string
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..core.batch import cumulative
from ..core.config import ModelConfig
from ..core.groups import LocalGroup
from ..core.linear import QKVParallelLinear
from ..core.validate import check_lengths
from ..measure.flops import METHODS, attention_cells, decode_attention_intensity, forward_flops, linear_intensity
from ..tp.dryrun import expected_trace, trace_signature

_PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
            "#ccb974", "#64b5cd")
SKIPPED, USEFUL, WASTED = 0, 1, 2
CELL_COLORS = {SKIPPED: "#ffffff", USEFUL: "#3b6fb6", WASTED: "#f28e2b"}
CELL_LABELS = {SKIPPED: "never computed", USEFUL: "useful", WASTED: "computed, wasted"}
_CELL_CMAP = ListedColormap([CELL_COLORS[SKIPPED], CELL_COLORS[USEFUL], CELL_COLORS[WASTED]])
PAD_COLOR = "#d9d9d9"


def request_name(i: int) -> str:
    """A, B, ..., Z, then R26, R27, ... (the article calls its requests A and B)."""
    return string.ascii_uppercase[i] if i < 26 else f"R{i}"


def request_color(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


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


def _strip(ax, lens: list[int], y: float = 0.0, height: float = 1.0, label_requests: bool = True) -> None:
    """One row of T cells coloured by request, boundaries at ``cu_seqlens``."""
    cu = cumulative(lens)
    for i, n in enumerate(lens):
        ax.add_patch(Rectangle((cu[i], y), n, height, facecolor=request_color(i), edgecolor="white", linewidth=0.5))
        if label_requests and n >= max(1, cu[-1] // 40):
            ax.text(cu[i] + n / 2, y + height / 2, request_name(i), ha="center", va="center", color="white",
                    fontsize=9, fontweight="bold")
    if cu[-1] <= 80:  # token separators, only where they stay readable
        ax.vlines(range(1, cu[-1]), y, y + height, colors="white", linewidth=0.3)


def _cu_ticks(ax, cu: list[int], max_labels: int = 24) -> None:
    shown = cu if len(cu) <= max_labels else cu[:: max(1, len(cu) // max_labels)] + [cu[-1]]
    ax.set_xticks(sorted(set(shown)))
    ax.tick_params(axis="x", labelsize=8)


def token_strip(seq_lens: Sequence[int], title: str | None = None) -> Figure:
    """The flat batch of claim C3: T tokens in one row, coloured by request, ``cu_seqlens`` as ticks.

    One ``Rectangle`` per request; x ticks are exactly the ``cu_seqlens`` values (when at most 24).
    """
    lens = check_lengths(seq_lens)
    cu = cumulative(lens)
    fig = Figure(figsize=(8, 1.9))
    ax = fig.add_subplot()
    _strip(ax, lens)
    ax.set_xlim(0, cu[-1])
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    _cu_ticks(ax, cu)
    ax.set_xlabel("flat row (token index); ticks at cu_seqlens = " + (str(cu) if len(cu) <= 12 else "[...]"))
    ax.set_title(title or f"flat batch: [{cu[-1]} x d], {len(lens)} requests, no padding, no batch dimension",
                 fontsize=10)
    fig.subplots_adjust(left=0.03, right=0.97, bottom=0.33, top=0.82)
    return fig


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
    _strip(bottom, lens)
    bottom.set_xlim(0, total)
    bottom.set_ylim(0, 1)
    bottom.set_yticks([])
    _cu_ticks(bottom, cumulative(lens))
    bottom.set_title(f"flat: [{total} x d] = {total} rows, all useful; ticks at cu_seqlens", fontsize=10)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    return fig


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
    ax.imshow(grid, cmap=_CELL_CMAP, vmin=0, vmax=2, interpolation="nearest", extent=(0, n, n, 0))
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
    fig.suptitle(f"score cells per head per layer, lengths {_short(lens)}: {kind}", fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.18, top=0.74, wspace=0.35)
    return fig


def _short(lens: list[int]) -> str:
    return str(lens) if len(lens) <= 8 else f"[{', '.join(map(str, lens[:6]))}, ...] (R={len(lens)})"


def dependency_maps(panels: Mapping[str, np.ndarray], seq_lens: Sequence[int]) -> Figure:
    """Who reads whom: for each panel a bool ``[T_out, T_in]`` map, True where output row i
    changed when input row j was perturbed (see ``probe.row_dependency``). Request
    boundaries are drawn at ``cu_seqlens``."""
    lens = check_lengths(seq_lens)
    cu = cumulative(lens)
    fig = Figure(figsize=(3.0 * len(panels), 3.4))
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    cmap = ListedColormap(["#ffffff", "#222222"])
    for ax, (title, dep) in zip(axes, panels.items()):
        dep = np.asarray(dep, dtype=bool)
        if dep.shape != (cu[-1], cu[-1]):
            raise ValueError(f"panel {title!r} must be [T, T] = {(cu[-1], cu[-1])}, got {dep.shape}")
        ax.imshow(dep, cmap=cmap, vmin=0, vmax=1, interpolation="nearest", extent=(0, cu[-1], cu[-1], 0))
        for e in cu[1:-1]:
            ax.axhline(e, color=request_color(1), linewidth=0.8)
            ax.axvline(e, color=request_color(1), linewidth=0.8)
        ax.set_xticks(cu)
        ax.set_yticks(cu)
        ax.tick_params(labelsize=7)
        ax.set_title(f"{title}\n{int(dep.sum())} of {dep.size} pairs", fontsize=8)
        ax.set_xlabel("perturbed input row j", fontsize=7)
    axes[0].set_ylabel("output row i that changed", fontsize=7)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.15, top=0.82, wspace=0.35)
    return fig


def qkv_shards(cfg: ModelConfig, tokens: int = 40) -> Figure:
    """Claim C6: which rows of the fused QKV weight ``[3·H·D, d_model]`` each TP rank owns.

    The owner of every row is computed by ``QKVParallelLinear.shard_rows`` on one-process
    stand-in groups (rank r of ``cfg.tp_size``), not drawn by hand.
    """
    owner = qkv_row_owners(cfg)
    k = cfg.qkv_dim
    fig = Figure(figsize=(8, 2.5))
    ax = fig.add_subplot()
    for rank in range(cfg.tp_size):
        rows = np.flatnonzero(owner == rank)
        for start, stop in _runs(rows):
            ax.add_patch(Rectangle((start, 0), stop - start, 1, facecolor=request_color(rank + 2), edgecolor="none"))
    for h in range(0, 3 * cfg.n_heads + 1):
        ax.axvline(h * cfg.d_head, color="white", linewidth=0.6)
    for part, name in enumerate("QKV"):
        ax.axvline(part * k, color="black", linewidth=1.2)
        ax.text(part * k + k / 2, 1.08, f"{name}: {cfg.n_heads} heads x {cfg.d_head}", ha="center", fontsize=8)
    ax.set_xlim(0, 3 * k)
    ax.set_ylim(0, 1.25)
    ax.set_yticks([])
    ax.set_xlabel(f"output feature of the full QKV projection (3 x {cfg.n_heads} x {cfg.d_head} = {3 * k})", fontsize=8)
    per_rank = 3 * cfg.heads_per_rank * cfg.d_head
    ax.legend(handles=[Patch(facecolor=request_color(r + 2), label=f"rank {r}: [{tokens} x {cfg.d_model}] -> "
                             f"[{tokens} x {per_rank}]") for r in range(cfg.tp_size)],
              loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=min(cfg.tp_size, 4), fontsize=8, frameon=False)
    ax.set_title(f"TP={cfg.tp_size}: each rank owns the Q, K and V rows of its {cfg.heads_per_rank} heads",
                 fontsize=10, pad=16)
    fig.subplots_adjust(left=0.03, right=0.97, bottom=0.42, top=0.8)
    return fig


def qkv_row_owners(cfg: ModelConfig) -> np.ndarray:
    """``int [3·H·D]``: the TP rank that holds each output row of the full QKV weight."""
    import torch
    n = 3 * cfg.qkv_dim
    owner = np.full(n, -1, dtype=np.int64)
    ids = torch.arange(n)
    for rank in range(cfg.tp_size):
        # A linear layer only reads rank and world_size from its group to cut its shard.
        layer = QKVParallelLinear(cfg.d_model, cfg.n_heads, cfg.d_head, bias=False,
                                  group=LocalGroup(rank, cfg.tp_size))
        owner[layer.shard_rows(ids).numpy()] = rank
    return owner


def _runs(sorted_idx: np.ndarray):
    if sorted_idx.size == 0:
        return
    start = prev = int(sorted_idx[0])
    for i in sorted_idx[1:]:
        i = int(i)
        if i != prev + 1:
            yield start, prev + 1
            start = i
        prev = i
    yield start, prev + 1


def flops_bars(cases: Sequence[tuple[str, Sequence[int]]], cfg: ModelConfig | None = None,
               method: str = "varlen", causal: bool = False, figsize=(5, 4), title: str | None = None) -> Figure:
    """Stacked bars of whole-forward FLOPs (``flops.forward_flops``), linear below, attention on top.

    One bar per ``(label, seq_lens)`` case; heights in GFLOP; the attention share is written
    above each bar.
    """
    cfg = cfg or ModelConfig()
    if not cases:
        raise ValueError("cases is empty: give at least one (label, seq_lens)")
    fl = [forward_flops(cfg, lens, method, causal) for _, lens in cases]
    lin = np.array([f.linear for f in fl], dtype=float) / 1e9
    att = np.array([f.attention for f in fl], dtype=float) / 1e9
    x = np.arange(len(cases))
    fig = Figure(figsize=figsize)
    ax = fig.add_subplot()
    ax.bar(x, lin, color="#8c8c8c", label="linear (QKV, out proj, FFN up/down)")
    ax.bar(x, att, bottom=lin, color=CELL_COLORS[USEFUL], label="attention (QK^T, PV)")
    for xi, f, top in zip(x, fl, lin + att):
        pct = 100 * f.attention_fraction
        ax.text(xi, top, f"{pct:.1f}% attn" if pct < 10 else f"{pct:.0f}% attn", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels([label for label, _ in cases], fontsize=8)
    ax.set_ylabel("GFLOP per forward")
    ax.set_ylim(0, float((lin + att).max()) * 1.35 or 1.0)
    ax.legend(fontsize=7, loc="upper right", frameon=False)
    ax.set_title(title or f"whole-forward FLOPs ({method}, {'causal' if causal else 'whole blocks'})", fontsize=9)
    fig.subplots_adjust(left=0.15, right=0.97, bottom=0.12, top=0.9)
    return fig


def attention_share_curve(cfg: ModelConfig | None = None, lengths: Sequence[int] | None = None,
                          marks: Sequence[int] = (100, 1000), causal: bool = False) -> Figure:
    """Claim C14: attention's share of forward FLOPs against request length L.

    For R equal requests the share does not depend on R (both parts scale with R), so one
    curve covers every batch of equal lengths; the dashed line is where attention overtakes
    the linear layers.
    """
    cfg = cfg or ModelConfig()
    lengths = list(lengths) if lengths is not None else sorted({int(v) for v in np.logspace(0, 5, 120)})
    share = [100 * forward_flops(cfg, [n], "varlen", causal).attention_fraction for n in lengths]
    fig = Figure(figsize=(6, 3.4))
    ax = fig.add_subplot()
    ax.plot(lengths, share, color=CELL_COLORS[USEFUL])
    ax.axhline(50, color="#888888", linestyle="--", linewidth=0.8)
    for n in marks:
        s = 100 * forward_flops(cfg, [n], "varlen", causal).attention_fraction
        ax.plot([n], [s], "o", color=CELL_COLORS[WASTED])
        ax.annotate(f"L={n}: {s:.0f}%", (n, s), textcoords="offset points", xytext=(-8, 8), ha="right", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("tokens per request L (any number of requests of this length)")
    ax.set_ylabel("attention share of FLOPs (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{cfg.n_layers} layers, d={cfg.d_model}: attention overtakes the linears above the dashed line",
                 fontsize=9)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.15, top=0.9)
    return fig


def intensity_curves(d_in: int = 512, d_out: int = 2048, tokens: Sequence[int] | None = None,
                     kv_lens: Sequence[int] = (100, 1000, 10000), d_head: int = 64) -> Figure:
    """Claims C13 and C15: FLOP per byte of a linear layer ``[T, d_in] @ [d_in, d_out]`` against T
    (fp32 and bf16), and one decode step's ``q K^T`` (about 1 whatever the KV length)."""
    tokens = list(tokens) if tokens is not None else [int(v) for v in np.unique(np.logspace(0, 4.2, 60).astype(int))]
    fig = Figure(figsize=(6, 3.6))
    ax = fig.add_subplot()
    for nbytes, name in ((4, "fp32"), (2, "bf16")):
        ax.plot(tokens, [linear_intensity(t, d_in, d_out, nbytes) for t in tokens], label=f"linear {d_in}->{d_out}, {name}")
    dec = [decode_attention_intensity(n, d_head) for n in kv_lens]
    ax.plot([1] * len(kv_lens), dec, "s", color=CELL_COLORS[WASTED], label=f"decode q K^T (bf16), L_kv in {list(kv_lens)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens T in the flat batch (rows that share one weight read)")
    ax.set_ylabel("arithmetic intensity (FLOP / byte)")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    ax.set_title("more flat tokens -> more FLOPs per weight byte; decode (T=1) sits near 1", fontsize=9)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.15, top=0.9)
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


def measured_series(x: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str, ylabel: str,
                    title: str, logx: bool = True, logy: bool = True) -> Figure:
    """A plain line plot of measured numbers (times, bytes) side by side; used for
    measurements shown in a lesson, never for the committed figures."""
    fig = Figure(figsize=(6, 3.4))
    ax = fig.add_subplot()
    for i, (name, ys) in enumerate(series.items()):
        ax.plot(list(x), list(ys), "o-", color=request_color(i), label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title, fontsize=9)
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.15, top=0.9)
    return fig


def time_split_bars(rows: Sequence[tuple[str, Mapping[str, float]]],
                    parts: Sequence[str] = ("linear", "attention", "other")) -> Figure:
    """Horizontal 100 % bars: for each row label, the share of each part (measured time or
    analytic FLOPs, as the label says)."""
    fig = Figure(figsize=(7, 0.6 + 0.45 * len(rows)))
    ax = fig.add_subplot()
    colors = {"linear": "#8c8c8c", "attention": CELL_COLORS[USEFUL], "other": "#e0c060"}
    for y, (_label, values) in enumerate(rows):
        total = sum(values.get(p, 0.0) for p in parts) or 1.0
        left = 0.0
        for p in parts:
            w = 100 * values.get(p, 0.0) / total
            ax.barh(y, w, left=left, color=colors.get(p, "#cccccc"), label=p if y == 0 else None)
            if w >= 7:
                ax.text(left + w / 2, y, f"{w:.0f}%", ha="center", va="center", fontsize=7)
            left += w
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share (%)")
    ax.legend(fontsize=7, ncol=len(parts), frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    height = 0.5 + 0.45 * len(rows)
    fig.subplots_adjust(left=0.3, right=0.97, bottom=0.5 / height, top=1 - 0.35 / height)
    return fig


# ---------------------------------------------------------------------------------------------
# Lessons 00, 04, 06: tensor-parallel traces and the prefill engine's batches.

def allreduce_growth(cfg: ModelConfig | None = None, tokens: Sequence[int] | None = None, mark: int | None = None,
                     measured: Mapping[int, Sequence] | None = None, world_size: int = 2) -> Figure:
    """Claim C1: all-reduces per forward (left) and bytes per all-reduce (right) against the
    tokens N of one request, from ``tp_dryrun.expected_trace``.

    ``measured``: ``{N: trace}`` of real ranks (``TPResult.traces[0]``), drawn as markers on the
    formula's lines (artists with gid ``measured-count-N`` / ``measured-bytes-N``).
    ``mark``: one N to highlight (the widget's slider).
    """
    cfg = cfg or ModelConfig()
    tokens = list(tokens) if tokens is not None else sorted({int(v) for v in np.logspace(0, np.log10(16384), 60)})
    traces = {n: expected_trace(cfg, n, 0, world_size) for n in tokens}
    counts = [len(traces[n]) for n in tokens]
    nbytes = [traces[n][0].bytes if traces[n] else 0 for n in tokens]
    fig = Figure(figsize=(8, 3.3))
    left, right = fig.subplots(1, 2)
    left.plot(tokens, counts, color=CELL_COLORS[USEFUL], label="formula: 2 x n_layers")
    left.set_ylim(0, max(counts + [1]) * 1.5)
    left.set_ylabel("all-reduces per forward")
    left.set_title(f"count: {counts[0]} for every N", fontsize=9)
    right.plot(tokens, nbytes, color=CELL_COLORS[WASTED], label=f"formula: N x {cfg.d_model} x {cfg.dtype.itemsize} B")
    right.set_yscale("log")
    right.set_ylabel("bytes per all-reduce (one rank)")
    right.set_title(f"payload: [N x {cfg.d_model}] {str(cfg.dtype).replace('torch.', '')}, grows like N", fontsize=9)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("tokens N in the request")
    for n, trace in sorted((measured or {}).items()):
        trace = list(trace)
        left.plot([n], [len(trace)], "o", color="black", gid=f"measured-count-{n}")
        right.plot([n], [trace[0].bytes if trace else 0], "o", color="black", gid=f"measured-bytes-{n}")
        right.annotate(f"N={n}: {trace[0].bytes:,} B" if trace else f"N={n}", (n, trace[0].bytes if trace else 1),
                       textcoords="offset points", xytext=(-6, 6), ha="right", fontsize=7)
    if measured:
        left.plot([], [], "o", color="black", label="real TP=2 trace")
        right.plot([], [], "o", color="black", label="real TP=2 trace")
    if mark is not None:
        trace = expected_trace(cfg, int(mark), 0, world_size)
        left.axvline(mark, color="#888888", linestyle=":", linewidth=1)
        right.axvline(mark, color="#888888", linestyle=":", linewidth=1)
        right.plot([mark], [trace[0].bytes if trace else 0], "s", color=CELL_COLORS[WASTED], gid="mark")
        fig.suptitle(f"N = {mark}: {len(trace)} all-reduces of [{mark} x {cfg.d_model}], "
                     f"{trace[0].bytes if trace else 0:,} B each", fontsize=9)
    for ax in (left, right):
        ax.legend(fontsize=7, frameon=False, loc="upper left")
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.16, top=0.82 if mark is not None else 0.88, wspace=0.32)
    return fig


def tp_trace_timeline(traces: Sequence[Sequence], packings: Sequence[Sequence[int]], heads_per_rank: int | None = None,
                      qkv_width: int | None = None) -> Figure:
    """Claims C11, C12: one forward on each TP rank as a timeline, one row per rank.

    ``traces[r]``: rank r's ``CollectiveRecord`` list (a real ``TPResult.traces`` or a
    ``tp_dryrun.record_trace`` per rank); every rank must have the same trace (else the real
    ranks would hang in a collective). Between two all-reduces a rank computes locally: QKV and
    attention before an ``attn.out_proj`` all-reduce (blue: the only step that reads
    ``cu_seqlens``), the FFN before an ``mlp.fc_down`` one (grey). Each all-reduce is one
    orange bar across all ranks (gid ``allreduce-k``). ``packings``: the request lengths that
    all produced this trace, listed under the timeline.
    """
    traces = [list(t) for t in traces]
    if not traces or not traces[0]:
        raise ValueError("traces must hold at least one rank with at least one collective")
    sig = trace_signature(traces[0])
    for r, t in enumerate(traces[1:], start=1):
        if trace_signature(t) != sig:
            raise ValueError(f"rank {r}'s trace differs from rank 0's: real ranks would wait on each other forever")
    packs = [check_lengths(p) for p in packings]
    if not packs:
        raise ValueError("packings is empty: give the request lengths that produced the trace")
    n_ranks, n_ops = len(traces), len(sig)
    first = traces[0][0]
    fig = Figure(figsize=(11, 1.3 + 0.5 * n_ranks))
    ax = fig.add_subplot()
    attn_color, ffn_color, ar_color = CELL_COLORS[USEFUL], "#bbbbbb", CELL_COLORS[WASTED]
    x = 0.6
    ax.text(0.3, n_ranks - 0.5, "embed", ha="center", va="center", rotation=90, fontsize=6, color="#555555")
    for k, rec in enumerate(traces[0]):
        is_attn = rec.layer.endswith("attn.out_proj")
        for r in range(n_ranks):
            y = n_ranks - 1 - r
            ax.add_patch(Rectangle((x, y + 0.15), 1.3, 0.7, facecolor=attn_color if is_attn else ffn_color,
                                   edgecolor="white", gid=f"local-{r}-{k}"))
            ax.text(x + 0.65, y + 0.5, "attn" if is_attn else "FFN", ha="center", va="center", fontsize=6,
                    color="white" if is_attn else "black")
        ax.add_patch(Rectangle((x + 1.4, 0.1), 0.4, n_ranks - 0.2, facecolor=ar_color, edgecolor="none",
                               gid=f"allreduce-{k}"))
        ax.text(x + 1.6, n_ranks + 0.05, f"{k}", ha="center", va="bottom", fontsize=6, color=ar_color)
        if is_attn and rec.layer.startswith("layers."):
            ax.text(x + 1.9, -0.15, rec.layer.split(".")[1], ha="center", va="top", fontsize=7)
        x += 2.0
    ax.text(x + 0.2, n_ranks - 0.5, "ln_f", ha="center", va="center", rotation=90, fontsize=6, color="#555555")
    ax.set_xlim(0, x + 0.5)
    ax.set_ylim(-0.9, n_ranks + 0.5)
    ax.set_yticks([n_ranks - 1 - r + 0.5 for r in range(n_ranks)])
    ax.set_yticklabels([f"rank {r}" for r in range(n_ranks)], fontsize=8)
    ax.set_xticks([])
    ax.text(0, -0.62, "layer", fontsize=7, ha="left", va="top")
    for side in ("bottom", "left"):
        ax.spines[side].set_visible(False)
    shape = f"[{', '.join(map(str, first.shape))}]"
    heads = f" on its {heads_per_rank} heads" if heads_per_rank else ""
    qkv = f"QKV -> [{first.shape[0]}, {qkv_width}], " if qkv_width else "QKV, "
    ax.legend(handles=[Patch(facecolor=attn_color, label=f"{qkv}varlen attention{heads}: reads cu_seqlens, no collective"),
                       Patch(facecolor=ffn_color, label="LN, FFN-up, GeLU, FFN-down (local)"),
                       Patch(facecolor=ar_color, label=f"all-reduce {shape} {first.dtype}, {first.bytes:,} B per rank")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)
    cus = " | ".join(str(cumulative(p)) if len(p) <= 4 else f"[0, {p[0]}, ..., {sum(p)}] ({len(p)} requests)" for p in packs)
    ax.set_title(f"one forward, TP={n_ranks}: {n_ops} all-reduces, the same on every rank and for every packing\n"
                 f"cu_seqlens = {cus}", fontsize=9)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.17, top=0.78)
    return fig


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
