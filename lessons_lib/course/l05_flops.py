"""What lesson 05 (where the FLOPs go) draws, explores, measures and checks.

The engine's matmuls, recorded: ``measure.recorder.record_matmuls`` runs any call under the
op recorder and returns every matrix multiply PyTorch executed (``aten.mm``/``addmm``: the
linear layers; ``aten.bmm`` and the fused attention kernels: attention) with its shapes, so
FLOPs, score cells and arithmetic intensity are computed from what the engine really ran. ``forward_matmuls`` does
it for a model forward, ``decode_attention_matmuls`` for one decode step's attention, ``gqa_decode_matmuls`` for
one real decode step with as many K/V heads as you choose. ``engine_kv_cache_bytes``: what the engine's prefill KV
cache holds, measured, with as many K/V heads as you choose (grouped-query attention); both take ``repeat_kv``, the
control with K and V repeated per query head.

Figures ``05_intensity`` (intensity against rows per weight read, with two machines' ridge
points), ``05_flops_1x1000_vs_10x100`` (the same tokens, three packings) and
``05_attention_share`` (attention's share against request length). Explorer ``roofline_explorer``
wraps ``roofline_state`` (a model, a machine, packings -> FLOPs, bytes, intensity, the roofline's
time) and ``measure_here`` (this CPU's peak and bandwidth and one engine forward, timed once).
Exercise checkers: ``check_gqa`` (05.1), ``check_packing`` (05.2), ``check_kv_overtakes`` (05.3).

Taught in notebooks/05_flop_regimes.ipynb.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

from ..core.attention import varlen_attention
from ..core.batch import PackedBatch, cumulative, seq_lens_to_cu_seqlens
from ..core.config import ModelConfig
from ..measure.flops import (
    ForwardFlops,
    forward_bytes,
    forward_flops,
    kv_heads,
    linear_flops_per_token,
    roofline_seconds,
)
from ..measure.recorder import BF16, Matmul, record_matmuls
from ..style import ATTENTION, LINEAR, MIN_FONT, NEVER, OTHER, REQUEST, TEXT, WASTE
from ..validate import check_int, check_lengths
from .explore import explorer, ipywidgets_module, parse_lengths, show_figure, tagged
from .figures import register
from .grading import grade

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------
# Two machines' ridge points (peak FLOP/s over memory bandwidth): below the ridge a kernel waits
# for memory, above it for the arithmetic units.
#
# GPU: NVIDIA H200 SXM, published: 989 TFLOP/s dense BF16 tensor-core peak (1,979 with 2:4
# sparsity), 4.8 TB/s HBM3e  ->  989e12 / 4.8e12 = 206 FLOP/byte.
H200_PEAK_FLOPS, H200_BYTES_PER_S = 989e12, 4.8e12
# CPU: the 2-core AMD EPYC (Zen 4, AVX-512) virtual machine this course was built on, torch 2.13,
# measured with other jobs sharing the machine, so the best of many runs is kept: fp32 GEMM
# peak = the best of about 60 calls of measure.profile.matmul_throughput(2048, 2048, 2048) and
# (4096, 512, 2048): 183 GFLOP/s (typical under load: 85; 2 cores x 32 FLOP/cycle x ~2.9 GHz
# allows about 185); copy bandwidth = the best of about 80 copies of a 256 MiB fp32 tensor
# (y.copy_(x), read + write counted): 20.3 GB/s  ->  183e9 / 20.3e9 = 9.0 FLOP/byte.
CPU_PEAK_FLOPS, CPU_BYTES_PER_S = 183e9, 20.3e9
RIDGES = {"H200, bf16 (published peaks)": H200_PEAK_FLOPS / H200_BYTES_PER_S,
          "a 2-core cloud CPU, fp32 (measured when this course was built)": CPU_PEAK_FLOPS / CPU_BYTES_PER_S}

# ---------------------------------------------------------------------------------------------
# The engine's matmuls, recorded (by measure.recorder)


def forward_matmuls(model, batch: PackedBatch, attn_backend: str = "loop") -> list[Matmul]:
    """The matmuls of one forward of ``model`` on ``batch`` ("loop": the article's per-request loop)."""
    return record_matmuls(lambda: model(batch, attn_backend=attn_backend))


def decode_attention_matmuls(num_requests: int, kv_len: int, n_heads: int = 8, d_head: int = 64,
                             backend: str = "loop") -> list[Matmul]:
    """One decode step's attention: each of R requests brings ONE new query and attends its own
    ``kv_len`` cached keys and values (``cu_seqlens_q = [0, 1, ..., R]``, ``cu_seqlens_k`` in
    steps of ``kv_len``), run by ``varlen_attention``. Random values; only the shapes matter."""
    r = check_int("num_requests", num_requests, 1, 4096)
    n = check_int("kv_len", kv_len, 1, 1 << 20)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(r, n_heads, d_head, generator=g)                    # [R, H, D]: one query per request
    k, v = (torch.randn(r * n, n_heads, d_head, generator=g) for _ in range(2))  # [R·L_kv, H, D]
    cu_q, cu_k = seq_lens_to_cu_seqlens([1] * r), seq_lens_to_cu_seqlens([n] * r)
    return record_matmuls(lambda: varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend=backend))


def engine_decode_matmuls(model, num_requests: int, kv_len: int, attn_backend: str = "loop") -> list[Matmul]:
    """The matmuls of one real decode step of the engine: R requests of ``kv_len - 1`` prompt tokens are
    prefilled into a ``serve.kv_cache.PrefillKVCache``, then ``Transformer.forward(kv_cache=...)`` runs
    one new token per request (``num_computed_tokens = kv_len - 1``), recorded; each new query attends
    ``kv_len`` keys (its cached ones and its own)."""
    from ..core.batch import pack
    from ..serve.kv_cache import PrefillKVCache
    r, n = check_int("num_requests", num_requests, 1, 4096), check_int("kv_len", kv_len, 2, 1 << 20)
    cache, ids = PrefillKVCache.for_model(model), list(range(r))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n - 1,), generator=g) for _ in ids]
    with torch.no_grad():
        step = cache.step(ids, [0] * r, [n - 1] * r, [True] * r)
        model(pack(prompts), kv_cache=step, attn_backend=attn_backend)
        step.finish()
        step = cache.step(ids, [n - 1] * r, [1] * r, [False] * r)
        new = pack([[7]] * r, num_computed_tokens=[n - 1] * r)
        return record_matmuls(lambda: model(new, kv_cache=step, attn_backend=attn_backend))


def _zero_model(cfg: ModelConfig, n_kv_heads: int, max_position: int, repeat_kv: bool):
    """``cfg``'s model with ``n_kv_heads`` K/V heads at TP = 1 on the CPU, one zero seen as every weight (nothing
    allocated; the shapes are what matters) and a vocabulary of 8. ``repeat_kv``: the control, each layer's
    attention core gets K and V repeated for every query head of its group (``repeat_interleave``, Hugging Face's
    ``repeat_kv``) BEFORE the KV cache and the backend, through a forward pre-hook: the same output, MHA's shapes."""
    from ..core.model import Transformer
    small = dataclasses.replace(cfg, n_kv_heads=n_kv_heads, vocab_size=8, max_position=max_position)
    zero = torch.zeros((), dtype=small.dtype)
    model = Transformer(small, {name: zero.expand(shape) for name, shape in small.weight_shapes().items()})
    if repeat_kv:
        def repeat(core, args):
            q, k, v = args
            return q, k.repeat_interleave(q.shape[1] // k.shape[1], dim=1), v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        for layer in model.layers:
            layer.attn.core.register_forward_pre_hook(repeat)
    return model


def engine_kv_cache_bytes(cfg: ModelConfig, seq_lens: Sequence[int], n_kv_heads: int, repeat_kv: bool = False) -> int:
    """The bytes the engine's KV cache holds after one prefill of requests of ``seq_lens`` tokens, every
    request kept for decode, MEASURED: ``cfg``'s model built with ``n_kv_heads`` K/V heads
    (``ModelConfig(n_kv_heads=...)``, its ``n_heads`` query heads unchanged) at TP = 1 on the CPU, in
    ``cfg.dtype``, prefilled into a ``serve.kv_cache.PrefillKVCache``; its ``nbytes``. Zero weights and a
    vocabulary of 8: neither changes what the cache holds, and the model builds fast. ``repeat_kv=True``: the
    control, K and V repeated per query head before they are cached."""
    from ..core.batch import pack
    from ..serve.kv_cache import PrefillKVCache
    lens = check_lengths(seq_lens)
    model = _zero_model(cfg, n_kv_heads, max(lens), repeat_kv)
    cache, ids = PrefillKVCache.for_model(model), list(range(len(lens)))
    with torch.no_grad():
        step = cache.step(ids, [0] * len(lens), lens, [True] * len(lens))
        model(pack([torch.zeros(n, dtype=torch.long) for n in lens]), kv_cache=step)
        step.finish()
    return cache.nbytes


def gqa_decode_matmuls(cfg: ModelConfig, n_kv_heads: int, num_requests: int, kv_len: int,
                       repeat_kv: bool = False) -> list[Matmul]:
    """``engine_decode_matmuls`` on ``cfg``'s model with ``n_kv_heads`` K/V heads (zero weights, TP = 1, CPU,
    the ``loop`` backend): under GQA the backend packs a group's G query heads as the rows of ONE matmul on
    their K/V head (``[H_kv, G·1, D] @ [H_kv, D, L_kv]`` per request, FlashAttention-3's pack_gqa), so each
    cached number is read once for G queries. ``repeat_kv=True``: the control, K/V repeated per query head."""
    return engine_decode_matmuls(_zero_model(cfg, n_kv_heads, kv_len, repeat_kv), num_requests, kv_len)


def packed_decode_attention_intensity(kv_len: int, d_head: int, group: int, nbytes: int = BF16) -> float:
    """FLOP per byte of one request's decode attention on one K/V head with its ``group`` query heads packed
    as rows, counted per matmul as ``intensity`` counts them: ``Q K^T`` ``[G, D] @ [D, L]`` and ``P V``
    ``[G, L] @ [L, D]``, ``4·G·D·L`` FLOPs over ``nbytes · 2 · (G·D + D·L + G·L)`` bytes (queries, K or V,
    scores, outputs). ``group = 1``: ``measure.flops.decode_attention_intensity``; the K/V term is shared by
    the G rows, the query and score terms grow with G, so the gain is a little under G."""
    n, d, g = (check_int(name, x, 1, 1 << 20) for name, x in (("kv_len", kv_len), ("d_head", d_head), ("group", group)))
    return 4 * g * d * n / (nbytes * 2 * (g * d + d * n + g * n))


def of_kind(matmuls: Sequence[Matmul], kind: str) -> list[Matmul]:
    return [mm for mm in matmuls if mm.kind == kind]


def intensity(matmuls: Sequence[Matmul], nbytes: int = BF16) -> float:
    """FLOP per byte of a group of matmuls: all their FLOPs over all their bytes."""
    return sum(mm.flops for mm in matmuls) / sum(mm.bytes(nbytes) for mm in matmuls)


def score_cells(matmuls: Sequence[Matmul], heads_x_layers: int, d_head: int) -> int:
    """Score cells per head per layer from the recorded attention matmuls: ``Q K^T`` and ``P V``
    each cost ``2 · d_head`` FLOPs per cell, so cells = attention FLOPs / (4 · d_head · heads · layers)."""
    return sum(mm.flops for mm in of_kind(matmuls, "attention")) // (4 * d_head * heads_x_layers)


# ---------------------------------------------------------------------------------------------
# The crossover rule and the FLOP mix


def crossover_length(cfg: ModelConfig, causal: bool = False) -> int:
    """The smallest request length L at which attention's FLOPs reach the linear layers'
    (``measure.flops.forward_flops`` on one request; the share does not depend on how many
    requests of that length there are). Whole blocks: 6 · d_model for the article's model;
    causal: 12 · d_model - 1."""
    def below(n: int) -> bool:
        f = forward_flops(cfg, [n], "varlen", causal)
        return f.attention < f.linear

    lo, hi = 1, 1
    while below(hi):
        hi *= 2
    while lo < hi:  # both parts grow monotonically with L
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if below(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------------------------------------
# Figures


def flops_bars(cases: Sequence[tuple[str, Sequence[int]]], cfg: ModelConfig | None = None, causal: bool = False,
               ax=None, title: str | None = None, flops: Sequence[ForwardFlops] | None = None) -> Figure | None:
    """Stacked bars of whole-forward FLOPs (``forward_flops``, varlen), linear (green) below,
    attention (blue) on top, in GFLOP; the attention share above each bar. Draws into ``ax`` if
    given (returns None), else returns a new Figure. ``flops``: the cases' ``ForwardFlops`` when
    the caller already holds them (``flop_mix_state``'s), in the order of ``cases``."""
    cfg = cfg or ModelConfig()
    if not cases:
        raise ValueError("cases is empty: give at least one (label, seq_lens)")
    fig = None
    if ax is None:
        fig = Figure(figsize=(5.5, 4))
        ax = fig.add_subplot()
        fig.subplots_adjust(left=0.15, right=0.97, bottom=0.12, top=0.88)
    fl = list(flops) if flops is not None else [forward_flops(cfg, lens, "varlen", causal) for _, lens in cases]
    lin = np.array([f.linear for f in fl], dtype=float) / 1e9
    att = np.array([f.attention for f in fl], dtype=float) / 1e9
    x = np.arange(len(cases))
    ax.bar(x, lin, color=LINEAR, label="linear layers (QKV, out proj, FFN-up, FFN-down)")
    ax.bar(x, att, bottom=lin, color=ATTENTION, label="attention (QKᵀ and PV)")
    for xi, f, top in zip(x, fl, lin + att):
        ax.text(xi, top, f"{100 * f.attention_fraction:.1f}% attention", ha="center", va="bottom", fontsize=MIN_FONT,
                color=TEXT)
    ax.set_xticks(x)
    ax.set_xticklabels([label for label, _ in cases], fontsize=MIN_FONT + 1)
    ax.set_ylabel("GFLOP per forward", fontsize=MIN_FONT + 1)
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_ylim(0, float((lin + att).max()) * 1.45 or 1.0)
    ax.legend(fontsize=MIN_FONT, loc="upper right", frameon=False)
    ax.set_title(title or f"whole forward, {cfg.n_layers} layers ({'causal' if causal else 'whole blocks'})",
                 fontsize=MIN_FONT + 1)
    return fig


def _blocks(ax, lens: list[int], title: str) -> None:
    """The T x T score matrix: each request's diagonal block (blue, computed), the rest never computed."""
    t = sum(lens)
    ax.add_patch(Rectangle((0, 0), t, t, facecolor=NEVER, edgecolor=TEXT, linewidth=0.8))
    for s, n in zip(cumulative(lens)[:-1], lens):
        ax.add_patch(Rectangle((s, t - s - n), n, n, facecolor=ATTENTION, edgecolor="none"))
    ax.set_xlim(0, t)
    ax.set_ylim(0, t)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=MIN_FONT + 1)


@register("05_flops_1x1000_vs_10x100", lesson="05",
          caption="the same 1000 tokens as 1 x 1000, 10 x 100, 100 x 10: score blocks and whole-forward FLOPs (C14)")
def same_tokens_figure(cfg: ModelConfig | None = None, total: int = 1000, mix: Sequence[int] = (1, 10, 100)) -> Figure:
    """Claim C14: the same ``total`` tokens as R x total/R for each R in ``mix``. Top: each
    request's score block on the T x T square (whole blocks, per head per layer); bottom: the
    whole forward's FLOPs, linear vs attention."""
    cfg = cfg or ModelConfig()
    fig = Figure(figsize=(10, 6.6))
    gs = fig.add_gridspec(2, len(mix), height_ratios=(1, 1.25), hspace=0.45, left=0.08, right=0.98, top=0.9, bottom=0.07)
    cases = []
    for i, r in enumerate(mix):
        lens = [total // r] * r
        cases.append((f"{r} x {total // r}", lens))
        cells = sum(n * n for n in lens)
        _blocks(fig.add_subplot(gs[0, i]), lens, f"{r} x {total // r}: {r} x {total // r}² = {cells:,} cells")
    flops_bars(cases, cfg, ax=fig.add_subplot(gs[1, :]),
               title=f"whole forward of the article's model ({cfg.n_layers} layers, d_model {cfg.d_model}), varlen, "
                     "whole blocks:\nthe linear work is the same, the attention work drops 10x per step to the right")
    fig.suptitle(f"The same {total:,} tokens, three packings: score cells per head per layer (top, blue = computed) "
                 "and FLOPs (bottom)", fontsize=MIN_FONT + 2)
    return fig


@register("05_attention_share", lesson="05",
          caption="attention's share of the FLOPs against request length, whole blocks and causal, with the crossovers (C14)")
def attention_share_curve(cfg: ModelConfig | None = None, lengths: Sequence[int] | None = None,
                          marks: Sequence[int] = (100, 1000, 8000)) -> Figure:
    """Claim C14: attention's share of a forward's FLOPs against request length L, whole blocks
    (solid) and causal (dashed). For R requests of length L the share does not depend on R, so one
    curve covers every batch of equal lengths; the vertical lines are the crossovers
    (``crossover_length``: 6 · d_model and 12 · d_model - 1 for the article's model)."""
    cfg = cfg or ModelConfig()
    lengths = list(lengths) if lengths is not None else sorted({int(v) for v in np.logspace(1, 5, 160)})
    fig = Figure(figsize=(8, 4.2))
    ax = fig.add_subplot()
    for causal, style in ((False, "-"), (True, "--")):
        share = [100 * forward_flops(cfg, [n], "varlen", causal).attention_fraction for n in lengths]
        ax.plot(lengths, share, style, color=ATTENTION, label="causal (useful cells only)" if causal
                else "whole blocks (the article's count)")
        cross = crossover_length(cfg, causal)
        ax.axvline(cross, color=TEXT, linestyle=style, linewidth=1)
        ax.text(cross * (1.08 if causal else 0.93), 3, f"L = {cross:,}\n({'12' if causal else '6'} x d_model"
                f"{' - 1' if causal else ''})", fontsize=MIN_FONT, color=TEXT, ha="left" if causal else "right")
    ax.axhline(50, color=TEXT, linestyle=":", linewidth=0.8)
    for n in marks:  # below 50 %: the label above-left of the curves; above: right of them, lower down
        s = 100 * forward_flops(cfg, [n], "varlen").attention_fraction
        ax.plot([n], [s], "o", color=ATTENTION)
        at = (n / 5, s + 8) if s < 50 else (n * 2.5, s - 30)
        ax.annotate(f"L = {n:,}: {s:.1f}%", (n, s), xytext=at, ha="left", va="bottom", fontsize=MIN_FONT, color=TEXT,
                    arrowprops={"arrowstyle": "-", "color": TEXT, "linewidth": 0.8})
    ax.set_xscale("log")
    ax.set_xlabel("tokens per request L (any number of requests of this length)", fontsize=MIN_FONT + 1)
    ax.set_ylabel("attention's share of the FLOPs (%)", fontsize=MIN_FONT + 1)
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_ylim(0, 100)
    ax.legend(fontsize=MIN_FONT, frameon=False, loc="upper left", bbox_to_anchor=(0.0, 0.9))
    ax.set_title(f"Attention's share of one forward's FLOPs ({cfg.n_layers} layers, d_model {cfg.d_model}, "
                 f"FFN {cfg.d_ffn}):\nattention-dominated (share > 50 %) only right of the vertical lines",
                 fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.14, top=0.86)
    return fig


def block_linear_intensity(cfg: ModelConfig, rows: int, nbytes: int = BF16) -> float:
    """FLOP per byte of a block's four linear layers (QKV, out proj, FFN-up, FFN-down; the whole
    layer, TP=1 view) on ``rows`` rows: the weights, the input rows and the output rows each move
    once. Prefill: rows = T flat tokens; a decode step: rows = R requests (one new token each)."""
    r = check_int("rows", rows, 1)
    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    return intensity([Matmul("linear", 1, r, a, b) for a, b in ((d, 3 * k), (k, d), (d, f), (f, d))], nbytes)


@register("05_intensity", lesson="05",
          caption="arithmetic intensity of a linear layer vs the rows sharing one weight read, decode steps, "
                  "decode attention, and two machines' ridge points (C13, C15)")
def intensity_figure(cfg: ModelConfig | None = None, decode_r: Sequence[int] = (1, 32, 256), kv_len: int = 128,
                     ridges: Mapping[str, float] | None = None) -> Figure:
    """Claims C13, C15: arithmetic intensity of a block's four linear layers
    (``block_linear_intensity``) against the rows that share one read of the weights (bf16 and
    fp32), the decode steps of R requests (marked), each request's decode attention (about 1,
    whatever R), and the ridge points of two machines: below a ridge, that machine waits for memory."""
    cfg = cfg or ModelConfig()
    ridges = RIDGES if ridges is None else ridges
    tokens = np.unique(np.logspace(0, 4.3, 80).astype(int))
    fig = Figure(figsize=(8.6, 4.8))
    ax = fig.add_subplot()
    for nbytes, style, name in ((BF16, "-", "bf16"), (4, "--", "fp32")):
        ax.plot(tokens, [block_linear_intensity(cfg, int(t), nbytes) for t in tokens], style, color=LINEAR,
                label=f"a block's 4 linear layers (d_model {cfg.d_model}, FFN {cfg.d_ffn}), {name}")
    for r in decode_r:  # R = 1: under the attention line; small R: above-left of the bf16 curve; large R: below-right
        y = block_linear_intensity(cfg, r)
        ax.plot([r], [y], "o", color=LINEAR)
        label = f"decode step, R = {r}: {y:.1f}"
        if r < 4:
            ax.annotate(label, (r, y), xytext=(1.12, 0.46), ha="left", va="top", fontsize=MIN_FONT, color=TEXT,
                        arrowprops={"arrowstyle": "-", "color": TEXT, "linewidth": 0.8})
        else:
            below = r >= 128
            ax.annotate(label, (r, y), textcoords="offset points", xytext=(18, -58) if below else (-8, 10),
                        ha="left" if below else "right", va="top" if below else "bottom", fontsize=MIN_FONT, color=TEXT,
                        arrowprops={"arrowstyle": "-", "color": TEXT, "linewidth": 0.8} if below else None)
    att = intensity(decode_attention_shapes(kv_len, cfg.d_head, cfg.n_heads))
    ax.axhline(att, color=ATTENTION, linewidth=2,
               label=f"decode attention of each request, {kv_len:,} cached tokens (bf16): {att:.2f}, any R")
    for (name, ridge), style in zip(ridges.items(), (":", "-.")):  # high ridges labelled above-left, low ones below-right
        ax.axhline(ridge, color=TEXT, linestyle=style, linewidth=1.2)
        left = ridge > 50
        machine, _, how = name.partition(" (")
        ax.text(0.6 if left else tokens[-1], ridge * 1.12 if left else ridge / 1.12,
                f"ridge, {machine}: {ridge:.3g} FLOP/byte" + (f"\n({how}" if how else ""), fontsize=MIN_FONT,
                color=TEXT, ha="left" if left else "right", va="bottom" if left else "top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(0.5, tokens[-1] * 1.3)
    ax.set_ylim(0.3, 3000)
    ax.set_xlabel("rows that share one read of the weights (prefill: flat tokens T; decode: requests R)",
                  fontsize=MIN_FONT + 1)
    ax.set_ylabel("FLOP per byte moved", fontsize=MIN_FONT + 1)
    ax.tick_params(labelsize=MIN_FONT)
    ax.legend(fontsize=MIN_FONT, frameon=False, loc="upper left", bbox_to_anchor=(0.0, 1.0))
    ax.set_title("Arithmetic intensity = FLOPs / bytes moved, counting the weights, the input rows and the output "
                 "rows,\neach moved once (no cache reuse); below a machine's ridge it waits for memory",
                 fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.13, top=0.88)
    return fig


def decode_attention_shapes(kv_len: int, d_head: int = 64, n_heads: int = 8) -> list[Matmul]:
    """One request's decode attention as matmuls: ``q K^T`` ``[1, D] @ [D, L_kv]`` and ``P V``
    ``[1, L_kv] @ [L_kv, D]``, per head (what ``decode_attention_matmuls`` records per request)."""
    return [Matmul("attention", n_heads, 1, d_head, kv_len), Matmul("attention", n_heads, 1, kv_len, d_head)]


@register("05_weight_reuse", lesson="05",
          caption="one linear layer reads its weight once for all T flat rows, of any requests: FLOPs grow with T, "
                  "the weight's bytes do not (C13)")
def weight_reuse_figure(d_in: int = 512, d_out: int = 2048, lens: Sequence[int] = (1, 2, 3)) -> Figure:
    """Claim C13, the idea: a linear layer ``[T, d_in] @ W[d_in, d_out]`` reads its weight once for
    all T flat rows, whichever requests they come from. Top: one row meets W; bottom: the rows of
    several requests (orange shades) share the same single read of W (green). The FLOP and byte
    formulas are written under each; no intensity value (the lesson asks the reader to predict it)."""
    lens = [int(n) for n in lens]
    fig = Figure(figsize=(10, 4.6))
    ax = fig.add_axes((0.01, 0.02, 0.98, 0.86))
    ax.axis("off")
    fig.text(0.01, 0.97, "One linear layer, y = x @ W: the weight W is read once per forward, however many rows x has",
             fontsize=MIN_FONT + 2, color=TEXT, va="top")
    wbox = (2.6, 2.2)                                   # drawn size of W (d_in tall, d_out wide)
    panels = (([1], 4.3, "T = 1 row"), (lens, 0.3, f"T = {sum(lens)} rows of {len(lens)} requests, packed flat"))
    for k, (rows, y0, label) in enumerate(panels):
        t = sum(rows)
        h = 0.28                                        # drawn height of one row
        cu = cumulative(rows)
        ax.text(0.0, y0 + 2.55, label, fontsize=MIN_FONT + 1, color=TEXT, fontweight="bold")
        for i, n in enumerate(rows):                   # x [T, d_in]: rows coloured by request
            for j in range(n):
                ax.add_patch(Rectangle((0.0, y0 + 2.1 - (cu[i] + j + 1) * h), 1.6, h * 0.9,
                                       facecolor=REQUEST[i % 2], edgecolor="white"))
        ax.text(0.8, y0 + 2.1 - t * h - 0.12, f"x [{t}, {d_in}]", ha="center", va="top", fontsize=MIN_FONT, color=TEXT)
        ax.text(1.95, y0 + 1.2, "@", ha="center", va="center", fontsize=MIN_FONT + 4, color=TEXT)
        ax.add_patch(Rectangle((2.3, y0), *wbox, facecolor=LINEAR, edgecolor="white", gid=f"weight-{k}"))
        ax.text(2.3 + wbox[0] / 2, y0 + wbox[1] / 2, f"W [{d_in}, {d_out}]\nread once", ha="center", va="center",
                fontsize=MIN_FONT + 1, color="white")
        ax.text(5.25, y0 + 1.2, "=", ha="center", va="center", fontsize=MIN_FONT + 4, color=TEXT)
        for i, n in enumerate(rows):                   # y [T, d_out]: one output row per input row
            for j in range(n):
                ax.add_patch(Rectangle((5.6, y0 + 2.1 - (cu[i] + j + 1) * h), 2.4, h * 0.9,
                                       facecolor=REQUEST[i % 2], edgecolor="white"))
        ax.text(6.8, y0 + 2.1 - t * h - 0.12, f"y [{t}, {d_out}]", ha="center", va="top", fontsize=MIN_FONT, color=TEXT)
        ax.text(8.4, y0 + 1.5, f"FLOPs: 2 · {t} · {d_in} · {d_out}" + ("" if k == 0 else f"   ({t} times more)"),
                fontsize=MIN_FONT + 1, color=TEXT)
        ax.text(8.4, y0 + 0.9, f"numbers moved: {d_in} · {d_out} (W, once)\n      + {t} · ({d_in} + {d_out}) (x and y)"
                + ("" if k == 0 else "\nW's part does not grow with T"), fontsize=MIN_FONT + 1, color=TEXT, va="center")
    ax.set_xlim(-0.1, 14.2)
    ax.set_ylim(0.0, 7.2)
    return fig


def time_split_bars(rows: Sequence[tuple[str, Mapping[str, float]]],
                    parts: Sequence[str] = ("linear", "attention", "other")) -> Figure:
    """Horizontal 100 % bars: for each row label, the share of each part (measured time or
    analytic FLOPs, as the label says). Linear green, attention blue, other grey."""
    fig = Figure(figsize=(8, 0.9 + 0.5 * len(rows)))
    ax = fig.add_subplot()
    colors = {"linear": LINEAR, "attention": ATTENTION, "other": OTHER}
    for y, (_label, values) in enumerate(rows):
        total = sum(values.get(p, 0.0) for p in parts) or 1.0
        left = 0.0
        for p in parts:
            w = 100 * values.get(p, 0.0) / total
            ax.barh(y, w, left=left, color=colors.get(p, OTHER), label=p if y == 0 else None)
            if w >= 7:
                ax.text(left + w / 2, y, f"{w:.0f}%", ha="center", va="center", fontsize=MIN_FONT, color="white")
            left += w
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in rows], fontsize=MIN_FONT)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share (%)", fontsize=MIN_FONT)
    ax.tick_params(labelsize=MIN_FONT)
    ax.legend(fontsize=MIN_FONT, ncol=len(parts), frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    height = 0.9 + 0.5 * len(rows)
    fig.subplots_adjust(left=0.3, right=0.97, bottom=0.55 / height, top=1 - 0.4 / height)
    return fig


# ---------------------------------------------------------------------------------------------
# Measured: one linear layer's throughput against T (shown, never asserted)


def throughput_sweep(tokens: Sequence[int], d_in: int = 512, d_out: int = 2048, device="cpu",
                     dtype: torch.dtype = torch.float32, repeats: int = 10, cpu_threads: int | None = 1) -> list[float]:
    """GFLOP/s of ``F.linear`` on ``[T, d_in] @ [d_in, d_out]`` for each T (``profile.matmul_throughput``:
    a warm-up call, then the fastest of ``repeats``). On the CPU it runs with ``cpu_threads``
    threads (then restores the count): with two threads a small product is split across both
    cores and each call waits for the slower one; on a machine whose cores are shared with other
    work that wait dwarfs a product of a few MFLOP and draws deep, random dips at small T."""
    from ..measure.profile import matmul_throughput
    cpu = torch.device(device).type == "cpu"
    before = torch.get_num_threads()
    if cpu and cpu_threads:
        torch.set_num_threads(cpu_threads)
    try:
        return [matmul_throughput(check_int("tokens", t, 1), d_in, d_out, repeats=repeats, device=device, dtype=dtype)
                for t in tokens]
    finally:
        torch.set_num_threads(before)


def throughput_roof(tokens: Sequence[int], d_in: int, d_out: int, peak: float, bytes_per_s: float,
                    nbytes: int = 4) -> list[float]:
    """The roofline's GFLOP/s for ``[T, d_in] @ [d_in, d_out]`` at each T: ``min(peak, intensity x
    bandwidth)``, the intensity from ``measure.flops.linear_intensity`` (the weight and the T rows
    moved once from memory, no reuse across calls)."""
    from ..measure.flops import linear_intensity
    return [min(peak, linear_intensity(check_int("tokens", t, 1), d_in, d_out, nbytes) * bytes_per_s) / 1e9
            for t in tokens]


def sweep_verdict(tokens: Sequence[int], gflops: Sequence[float], roof: Sequence[float], peak: float,
                  weight_mib: float) -> list[str]:
    """Sentences on how a measured sweep (GFLOP/s) sits against its roofline (``throughput_roof``),
    computed from the numbers: whether its best point beats the measured peak (then that peak, and
    the ridge from it, are lower bounds), and which points lie above the memory roof (a weight the
    repeated calls keep in the caches)."""
    if not (len(tokens) == len(gflops) == len(roof)) or not tokens:
        raise ValueError("need one throughput and one roof value per T")
    out = []
    best, top = max(gflops), peak / 1e9
    if best > 1.05 * top:
        out.append(f"the sweep's best ({best:.0f} GFLOP/s) beats the measured peak ({top:.0f}) by {best / top:.1f}x: "
                   "that peak is a lower bound on this run, and so are the ridge and the T printed above")
    else:
        out.append(f"no point beats the measured peak ({top:.0f} GFLOP/s; best {best:.0f})")
    above = [t for t, g, r in zip(tokens, gflops, roof) if r < top and g > 1.05 * r]
    if above:
        out.append(f"above the memory roof at T = {', '.join(map(str, above))}: the roof reads the {weight_mib:g} MiB "
                   "weight from memory on every call, but the repeated calls find it in the CPU's caches")
    else:
        out.append("no point lies above the memory roof")
    return out


def throughput_figure(tokens: Sequence[int], gflops: Sequence[float], label: str, where: str,
                      roof: tuple[Sequence[int], Sequence[float]] | None = None) -> Figure:
    """Measured GFLOP/s against the rows T (log x with a tick at each measured T, linear y), one
    line in the linear layers' green, each point labelled with its value; with ``roof`` = (T values,
    GFLOP/s at each: ``throughput_roof`` over a fine grid of T) the roofline, dashed in the text colour."""
    if len(tokens) != len(gflops) or not tokens:
        raise ValueError(f"need one throughput per T: {len(tokens)} T, {len(gflops)} values")
    if roof is not None and len(roof[0]) != len(roof[1]):
        raise ValueError(f"roof: need one value per T: {len(roof[0])} T, {len(roof[1])} values")
    fig = Figure(figsize=(7, 3.4))
    ax = fig.add_subplot()
    if roof is not None:
        ax.plot(list(roof[0]), list(roof[1]), "--", color=TEXT, linewidth=1.2,
                label="roofline: min(measured peak, intensity x copy bandwidth)")
    ax.plot(list(tokens), list(gflops), "o-", color=LINEAR, label=label)
    for t, g in zip(tokens, gflops):
        ax.annotate(f"{g:.0f}", (t, g), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=MIN_FONT,
                    color=TEXT)
    ax.set_xscale("log")
    ax.set_xticks(list(tokens))
    ax.set_xticklabels([str(t) for t in tokens])
    ax.minorticks_off()
    ax.set_ylim(0, max(list(gflops) + list(roof[1] if roof is not None else [])) * 1.35 or 1.0)
    ax.set_xlabel("rows T (flat tokens through one weight read)", fontsize=MIN_FONT + 1)
    ax.set_ylabel("GFLOP/s", fontsize=MIN_FONT + 1)
    ax.tick_params(labelsize=MIN_FONT)
    ax.legend(fontsize=MIN_FONT, frameon=False, loc="upper left")
    ax.set_title(f"measured on {where}: fastest of several runs (shown, never asserted)", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.17, top=0.9)
    return fig


def time_splits(model, batches: Mapping[str, PackedBatch], repeats: int = 3, warmup: int = 3) -> dict[str, dict]:
    """``profile.forward_time_split`` of each batch (fastest of ``repeats``), after ``warmup`` forwards of
    every batch: a process's first forwards on new shapes pay for fresh memory pages and kernel
    set-up, which made the first packing measured look far slower than the next one."""
    for _ in range(check_int("warmup", warmup, 0)):
        for batch in batches.values():
            model(batch)
    from ..measure.profile import forward_time_split
    return {name: forward_time_split(model, batch, repeats=repeats) for name, batch in batches.items()}


# ---------------------------------------------------------------------------------------------
# The roofline explorer: a model, a machine, packings of the same tokens -> FLOPs, bytes, intensity,
# the roofline's time; plus one forward of the real engine timed here, beside its prediction.

H200 = ("H200 (datasheet)", H200_PEAK_FLOPS, H200_BYTES_PER_S)
HERE_CFG = ModelConfig(n_layers=2, d_model=256, n_heads=4, d_head=64, d_ffn=1024, vocab_size=1000, max_position=1024)
HERE_LENS = (128,) * 4  # the measured forward: 4 requests of 128 tokens on HERE_CFG, fp32, on this CPU


def measure_here(repeats: int = 5, forward: bool = True) -> dict:
    """This CPU's roofline, measured once (``measure.profile``): peak = the fastest fp32
    ``[1024, 1024] @ [1024, 1024]`` (``matmul_throughput``), bandwidth = the fastest copy of a 32 MiB
    fp32 tensor (read + write counted, ``time_call``); and, with ``forward``, one real forward of
    ``HERE_CFG`` on ``HERE_LENS`` timed by ``time_call``. Keys: ``machine`` (name, FLOP/s, bytes/s),
    ``forward`` (``{"cfg", "seq_lens", "seconds"}`` or None). Varies run to run; never asserted."""
    from ..core.batch import pack
    from ..core.model import Transformer
    from ..measure.profile import matmul_throughput, time_call
    n = check_int("repeats", repeats, 1, 100)
    peak = matmul_throughput(1024, 1024, 1024, repeats=n) * 1e9
    x = torch.ones(8 << 20)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * x.element_size() / time_call(lambda: y.copy_(x), repeats=n)
    point = None
    if forward:
        model = Transformer(HERE_CFG, seed=0)
        g = torch.Generator().manual_seed(0)
        batch = pack([torch.randint(0, HERE_CFG.vocab_size, (m,), generator=g) for m in HERE_LENS])
        with torch.no_grad():
            seconds = time_call(lambda: model(batch), repeats=n, warmup=2)
        point = {"cfg": HERE_CFG, "seq_lens": list(HERE_LENS), "seconds": seconds}
    return {"machine": ("this CPU, measured", peak, bw), "forward": point}


def _machine(machine) -> tuple[str, float, float]:
    try:
        name, peak, bw = machine
    except (TypeError, ValueError):
        raise ValueError(f"machine must be (name, peak FLOP/s, bytes/s), got {machine!r}") from None
    if not (isinstance(peak, (int, float)) and isinstance(bw, (int, float)) and peak > 0 and bw > 0):
        raise ValueError(f"machine {name!r}: peak FLOP/s and bytes/s must be positive numbers, got {peak!r}, {bw!r}")
    return str(name), float(peak), float(bw)


def packing_lengths(total: int, requests: int) -> list[int]:
    """``total`` tokens as ``requests`` requests of as equal lengths as whole tokens allow."""
    t, r = check_int("tokens T", total, 1), check_int("requests R", requests, 1)
    if r > t:
        raise ValueError(f"requests R = {r} is more than the tokens T = {t}: every request needs a token")
    return [t // r + (i < t % r) for i in range(r)]


def _part(flops: int, nbytes: int, peak: float, bw: float) -> dict:
    seconds = roofline_seconds(flops, nbytes, peak, bw)
    return {"flops": flops, "bytes": nbytes, "intensity": flops / nbytes, "seconds": seconds,
            "bound": "compute-bound" if flops / peak >= nbytes / bw else "memory-bound"}


def roofline_state(d_model: int = 512, d_ffn: int = 2048, n_heads: int = 8, n_kv_heads: int = 8, n_layers: int = 8,
                   nbytes: int = BF16, machine=H200, total: int = 1000, requests: int = 10,
                   lengths: Sequence[int] | str = "700, 200, 100", here: dict | None = None) -> dict:
    """Each packing's linear and attention FLOPs (``measure.flops.forward_flops``, causal: the useful cells,
    a lower bound on what a tiled causal kernel computes), bytes (``forward_bytes``), intensity and roofline
    time (``roofline_seconds``) on ``machine`` = (name, FLOP/s, bytes/s); d_head = d_model / n_heads. Packings: ``1 x T``,
    ``R x T/R`` (as equal as whole tokens allow) and the ``lengths`` typed. ``here``
    (``measure_here``'s): its measured forward beside the roofline's time for it on ``here``'s machine.
    Keys: ``cfg``, ``n_kv_heads``, ``nbytes``, ``machine``, ``ridge``, ``rows`` (per packing
    ``{"label", "seq_lens", "linear": part, "attention": part, "seconds"}``, part = ``{"flops",
    "bytes", "intensity", "seconds", "bound"}``), ``measured`` (or None)."""
    d, h = check_int("d_model", d_model, 8, 1 << 16), check_int("n_heads", n_heads, 1, 1024)
    if d % h:
        raise ValueError(f"n_heads must divide d_model (d_head = d_model / n_heads): {d} / {h} is not whole")
    cfg = ModelConfig(n_layers=check_int("n_layers", n_layers, 1, 1024), d_model=d, n_heads=h, d_head=d // h,
                      d_ffn=check_int("d_ffn", d_ffn, 1, 1 << 18))
    kv = kv_heads(cfg, n_kv_heads)
    name, peak, bw = _machine(machine)
    typed = parse_lengths(lengths, max_requests=256, max_length=1 << 16) if isinstance(lengths, str) \
        else check_lengths(lengths)
    if not typed:
        raise ValueError("lengths is empty: type request lengths like '700, 200, 100'")
    t = check_int("tokens T", total, 1, 1 << 20)
    r = check_int("requests R", requests, 1, 1 << 20)
    packs = [(f"1 x {t}", [t]), (f"{r} x {t // r}" if t % r == 0 else f"{r} x ~{t / r:.0f}", packing_lengths(t, r)),
             ("typed " + ", ".join(map(str, typed)), list(typed))]
    rows = []
    for label, lens in packs:
        f = forward_flops(cfg, lens, "varlen", causal=True, n_kv_heads=kv)
        b = forward_bytes(cfg, lens, n_kv_heads=kv, bytes_per_element=nbytes)
        lin, att = _part(f.linear, b.linear, peak, bw), _part(f.attention, b.attention, peak, bw)
        rows.append({"label": label, "seq_lens": lens, "linear": lin, "attention": att,
                     "seconds": lin["seconds"] + att["seconds"]})
    measured = None
    if here and here.get("forward"):
        hname, hpeak, hbw = _machine(here["machine"])
        fw = here["forward"]
        f = forward_flops(fw["cfg"], fw["seq_lens"], "varlen", causal=True)
        b = forward_bytes(fw["cfg"], fw["seq_lens"], bytes_per_element=4)
        predicted = (roofline_seconds(f.linear, b.linear, hpeak, hbw)
                     + roofline_seconds(f.attention, b.attention, hpeak, hbw))
        measured = {"cfg": fw["cfg"], "seq_lens": fw["seq_lens"], "seconds": fw["seconds"], "predicted": predicted,
                    "flops": f.total, "bytes": b.total, "machine": (hname, hpeak, hbw)}
    return {"cfg": cfg, "n_kv_heads": kv, "nbytes": nbytes, "machine": (name, peak, bw), "ridge": peak / bw,
            "rows": rows, "measured": measured}


def _num(x: float) -> str:
    """FLOPs, bytes, seconds in engineering units: ``50.33 G``, ``812 k``."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.2f} "


def roofline_lines(state: dict) -> list[str]:
    """One line per packing: ``1 x 1000: linear 50.33 GFLOP 181.40 MB 277.5 FLOP/B compute-bound 0.05089 ms |
    attention 8.20 GFLOP 32.77 MB 250.2 FLOP/B compute-bound 0.008292 ms | predicted 0.05918 ms``."""
    out = []
    for row in state["rows"]:
        parts = [f"{p} {_num(row[p]['flops'])}FLOP {_num(row[p]['bytes'])}B {row[p]['intensity']:.1f} FLOP/B "
                 f"{row[p]['bound']} {row[p]['seconds'] * 1e3:.4g} ms" for p in ("linear", "attention")]
        out.append(f"{row['label']}: " + " | ".join(parts) + f" | predicted {row['seconds'] * 1e3:.4g} ms")
    return out


def machine_line(state: dict) -> str:
    name, peak, bw = state["machine"]
    return f"{name}: peak {peak / 1e9:.1f} GFLOP/s, bandwidth {bw / 1e9:.2f} GB/s, ridge {state['ridge']:.1f} FLOP/byte"


def measured_line(state: dict) -> str:
    """The timed engine forward beside its roofline time; the roofline is a lower bound on time."""
    m = state["measured"]
    if m is None:
        return "measured here: not taken (call measure_here() first)"
    c = m["cfg"]
    lens = ", ".join(map(str, m["seq_lens"]))
    return (f"measured here: one engine forward of lengths {lens} ({c.n_layers} layers, d_model {c.d_model}, fp32) on "
            f"{m['machine'][0]}: {m['seconds'] * 1e3:.3f} ms measured, {m['predicted'] * 1e3:.3f} ms predicted by its "
            f"roofline at this reduced width (not the table's model), a lower bound: measured = "
            f"{m['seconds'] / m['predicted']:.1f} x the bound (the roofline assumes peak FLOP/s and full bandwidth "
            "at once, each operand moved once; the engine also runs LayerNorm, GeLU and residual passes and pays "
            "Python and per-call overhead)")


def roofline_figure(state: dict) -> Figure:
    """Log-log roofline of ``state``'s machine: attainable FLOP/s = min(peak, intensity x bandwidth),
    the ridge (dotted ink), each packing's linear (green) and attention (blue) points at their
    intensity on the roof; the measured forward (ink ring: achieved FLOP/s) beside its predicted point
    (ink cross) when the machine is the one it was measured on."""
    name, peak, bw = state["machine"]
    ridge = state["ridge"]
    fig = Figure(figsize=(7.6, 4.2))
    ax = fig.add_subplot()
    pts = [row[p]["intensity"] for row in state["rows"] for p in ("linear", "attention")]
    m = state["measured"]
    if m is not None and m["machine"] == state["machine"]:
        pts.append(m["flops"] / m["bytes"])
    lo, hi = min(pts + [ridge]) / 4, max(pts + [ridge]) * 4
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(xs, np.minimum(peak, xs * bw), "-", color=TEXT, linewidth=1.5, label=f"roof of {name}")
    ax.axvline(ridge, color=TEXT, linestyle=":", linewidth=1)
    ax.text(ridge * 1.1, peak * 0.02, f"ridge\n{ridge:.1f} FLOP/B", fontsize=MIN_FONT, color=TEXT, ha="left")
    markers = ("o", "s", "^")                          # one shape per packing, one colour per part
    for i, (row, mk) in enumerate(zip(state["rows"], markers)):
        for part, color in (("linear", LINEAR), ("attention", ATTENTION)):
            x = row[part]["intensity"]
            ax.plot([x], [min(peak, x * bw)], mk, color=color, markersize=8,
                    label=("linear layers" if part == "linear" else "attention") if i == 0 else None)
    fig.text(0.62, 0.3, "packings (marker shapes):\n" + "\n".join(
        f"{s} {row['label'] if len(row['label']) <= 26 else row['label'][:25] + '…'}"
        for s, row in zip("●■▲", state["rows"])), fontsize=MIN_FONT, color=TEXT, va="top")
    if m is not None and m["machine"] == state["machine"]:
        x = m["flops"] / m["bytes"]
        ax.plot([x], [m["flops"] / m["predicted"]], "x", color=TEXT, markersize=9, label="engine forward: predicted")
        ax.plot([x], [m["flops"] / m["seconds"]], "o", markerfacecolor=NEVER, markeredgecolor=TEXT, markersize=9,
                label="engine forward: measured here")
    ylo, yhi = peak / 2e3, peak * 3
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(ylo, yhi)
    # Fixed decade ticks, no minor ticks: the explorer redraws this on every knob move, and matplotlib's
    # automatic log ticks cost most of a redraw.
    for axis, (a, b) in ((ax.xaxis, (lo, hi)), (ax.yaxis, (ylo, yhi))):
        decades = [10.0 ** e for e in range(math.ceil(math.log10(a)), math.floor(math.log10(b)) + 1)]
        axis.set_major_locator(FixedLocator(decades))
        axis.set_major_formatter(FixedFormatter([_num(v).replace(".00", "").strip() for v in decades]))
        axis.set_minor_locator(NullLocator())
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)", fontsize=MIN_FONT + 1)
    ax.set_ylabel("attainable FLOP/s = min(peak, intensity x bandwidth)", fontsize=MIN_FONT)
    ax.tick_params(labelsize=MIN_FONT)
    ax.legend(fontsize=MIN_FONT, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    c = state["cfg"]
    fig.text(0.02, 0.97, f"Roofline of {name}: d_model {c.d_model}, {c.n_heads} heads ({state['n_kv_heads']} K/V), "
             f"FFN {c.d_ffn}, {c.n_layers} layers, {state['nbytes']} B/number", fontsize=MIN_FONT + 1, color=TEXT,
             va="top")
    fig.subplots_adjust(left=0.11, right=0.6, bottom=0.13, top=0.9)
    return fig


D_MODELS, BYTES = (128, 256, 512, 768, 1024, 2048, 4096, 8192), ((("bf16 (2 B)"), 2), (("fp32 (4 B)"), 4))


def roofline_explorer(here: dict | None = None, timer: Callable[[Sequence[int]], dict] | None = None):
    """VBox class ``frx``. Model: Dropdown ``frx-dmodel``, IntText ``frx-dffn``, Dropdown ``frx-heads``,
    Dropdown ``frx-kvheads`` (the divisors of the heads), IntSlider ``frx-layers``, Dropdown ``frx-bytes``;
    machine: Dropdown ``frx-machine`` (``here``'s measured CPU when given, the H200's datasheet);
    packing: IntSlider ``frx-tokens`` (T), IntSlider ``frx-requests`` (R), Text ``frx-lengths``.
    Readouts: HTML ``frx-machine-line``, ``frx-table`` (``roofline_lines``), ``frx-measured``
    (``measured_line``: with ``here``, ``timer`` (default ``forward_here``) times the engine on the typed
    lengths, once per new lengths, "running…" meanwhile), ``frx-error`` (a bad input, named), Output
    ``frx-figure``. Choosing the measured CPU switches the dtype to fp32 (its peak is fp32), the H200 to
    bf16; a dtype that differs from the machine's is flagged in ``frx-machine-line``."""
    timer = timer or forward_here
    timed: dict = {}
    w = ipywidgets_module()
    machines = {H200[0]: H200}
    if here is not None:
        machines = {here["machine"][0]: _machine(here["machine"])} | machines
    dm = tagged(w.Dropdown(options=list(D_MODELS), value=512, description="d_model"), "frx-dmodel")
    ffn = tagged(w.BoundedIntText(value=2048, min=1, max=1 << 18, description="d_ffn"), "frx-dffn")
    heads = tagged(w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=8, description="heads"), "frx-heads")
    kvh = tagged(w.Dropdown(options=[1, 2, 4, 8], value=8, description="KV heads"), "frx-kvheads")
    layers = tagged(w.IntSlider(value=8, min=1, max=96, description="layers"), "frx-layers")
    nb = tagged(w.Dropdown(options=list(BYTES), value=BF16, description="dtype"), "frx-bytes")
    mach = tagged(w.Dropdown(options=list(machines), value=H200[0], description="machine"), "frx-machine")
    tokens = tagged(w.IntSlider(value=1000, min=100, max=16000, step=100, description="tokens T"), "frx-tokens")
    reqs = tagged(w.IntSlider(value=10, min=1, max=100, description="requests R"), "frx-requests")
    lens = tagged(w.Text(value="700, 200, 100", description="lengths", continuous_update=False), "frx-lengths")
    mline, table = tagged(w.HTML(), "frx-machine-line"), tagged(w.HTML(), "frx-table")
    meas, err, out = tagged(w.HTML(), "frx-measured"), tagged(w.HTML(), "frx-error"), tagged(w.Output(), "frx-figure")

    def measured_for(typed: str):
        """``here`` with its forward replaced by the engine timed on the typed lengths (cached)."""
        if here is None:
            return None
        try:
            lens = parse_lengths(typed, max_requests=256, max_length=1 << 16)
        except ValueError:
            return here
        if tuple(lens) not in timed:
            if sum(lens) > HERE_MAX_TOKENS or max(lens) > HERE_CFG.max_position:
                timed[tuple(lens)] = None
            else:
                meas.value = "<div>measured here: running…</div>"
                timed[tuple(lens)] = timer(lens)
        point = timed[tuple(lens)]
        return None if point is None else {"machine": here["machine"], "forward": point}

    def update(change=None):
        if change is not None and change.get("owner") is mach:   # the dtype the machine's peak is for
            nb.unobserve(update, names="value")
            nb.value = BF16 if machines[mach.value] == H200 else 4
            nb.observe(update, names="value")
        if change is not None and change.get("owner") is heads:  # KV heads: the divisors of the heads
            opts = [k for k in range(1, heads.value + 1) if heads.value % k == 0]
            keep = kvh.value if kvh.value in opts else heads.value
            kvh.unobserve(update, names="value")
            kvh.options, kvh.value = opts, keep
            kvh.observe(update, names="value")
        try:
            state = roofline_state(dm.value, ffn.value, heads.value, kvh.value, layers.value, nb.value,
                                   machines[mach.value], tokens.value, reqs.value, lens.value,
                                   measured_for(lens.value))
        except ValueError as exc:
            err.value = f"<div style='color:{WASTE}'>{exc}</div>"
            return
        err.value = ""
        want = BF16 if machines[mach.value] == H200 else 4
        warn = "" if nb.value == want else (f"<div style='color:{WASTE}'>this machine's peak is for "
                                            f"{'bf16' if want == BF16 else 'fp32'}: the bytes use {nb.value} "
                                            f"B per number, so the ridge comparison mixes dtypes</div>")
        mline.value = f"<div>{machine_line(state)}</div>" + warn
        table.value = "".join(f"<div>{line}</div>" for line in roofline_lines(state))
        if state["measured"] is None and here is not None:
            meas.value = (f"<div>measured here: not timed (the timed forward takes at most {HERE_MAX_TOKENS} "
                          f"tokens and {HERE_CFG.max_position} per request; type fewer)</div>")
        else:
            meas.value = f"<div>{measured_line(state)}</div>"
        show_figure(out, roofline_figure(state))

    box = explorer("frx", [dm, ffn, heads, kvh, layers, nb], [w.HBox([mach, tokens, reqs, lens]), mline, table, meas,
                                                              err, out], update)
    for c in (mach, tokens, reqs, lens):
        c.observe(update, names="value")
    return box


# ---------------------------------------------------------------------------------------------
# Exercises

_CFGS = (ModelConfig(), ModelConfig(n_layers=2, d_model=256, n_heads=4, d_head=32, d_ffn=1024),
         ModelConfig(n_layers=4, d_model=512, n_heads=4, d_head=64, d_ffn=1536),
         ModelConfig(n_layers=3, d_model=384, n_heads=6, d_head=64, d_ffn=3072))


_CFG_ODD = ModelConfig(n_layers=2, d_model=64, n_heads=3, d_head=16, d_ffn=100)  # k = 48: nothing divides


_CFG_6 = ModelConfig(n_layers=3, d_model=384, n_heads=6, d_head=64, d_ffn=1536)   # 6 heads: K/V groups of 1, 2, 3, 6
_H200_RIDGE = H200_PEAK_FLOPS / H200_BYTES_PER_S
_GQA_CASES = ((ModelConfig(), [1000], _H200_RIDGE), (ModelConfig(), [700], _H200_RIDGE),
              (ModelConfig(), [500], _H200_RIDGE), (ModelConfig(), [300], _H200_RIDGE),
              (ModelConfig(), [100] * 10, _H200_RIDGE), (_CFG_6, [600, 16, 16], _H200_RIDGE),
              (ModelConfig(), [100] * 10, 30.0))


def gqa_heads_for_ridge(cfg: ModelConfig, seq_lens: Sequence[int], ridge: float) -> int | None:
    """Exercise 05.1's answer: the largest ``n_kv_heads`` (a divisor of ``cfg.n_heads``) whose prefill
    attention (causal FLOPs over the fused-kernel bytes, bf16: ``attention_intensity``) reaches ``ridge``,
    or None when even one K/V head leaves it below."""
    fits = [kv for kv in range(1, cfg.n_heads + 1)
            if cfg.n_heads % kv == 0 and attention_intensity(seq_lens, kv, cfg) >= ridge]
    return max(fits, default=None)


def gqa_intensity_ceiling(cfg: ModelConfig) -> float:
    """How much grouping can raise prefill attention's intensity at most (one K/V head against
    ``n_heads``): the bytes per token per layer fall from ``2k + 2k`` (Q, O, K, V) to ``2k + 2 d_head``,
    the FLOPs stay: ``2k / (k + d_head)``, under 2 whatever the group."""
    k = cfg.qkv_dim
    return 2 * k / (k + cfg.d_head)


def check_gqa(fn: Callable[[ModelConfig, list, float], int | None]) -> bool:
    """Exercise 05.1: ``fn(cfg, seq_lens, ridge) -> n_kv_heads or None``: the largest K/V head count
    (a divisor of ``cfg.n_heads``: the fewest heads shared, the least quality given away) whose causal
    prefill attention, Q, K, V and O moved once in bf16 (``attention_intensity``), reaches ``ridge``;
    None when no grouping is enough. The cases include one already compute-bound without grouping, two
    where no grouping is enough, and a model of 6 heads."""
    def judge(got, cfg, lens, ridge):
        want = gqa_heads_for_ridge(cfg, lens, ridge)
        if got == want and (got is None or isinstance(got, int)):
            return None
        h = cfg.n_heads
        plain = attention_intensity(lens, h, cfg)
        by_group = max((kv for kv in range(1, h + 1) if h % kv == 0 and plain * h / kv >= ridge), default=None)
        trap = (f" - grouping divides only the K and V bytes, not by the group factor: Q and O keep all {h} heads, "
                f"so one K/V head raises the intensity at most {gqa_intensity_ceiling(cfg):.2f}x ({plain:.0f} -> "
                f"{attention_intensity(lens, 1, cfg):.0f} FLOP/byte here); x group is decode's factor, where the "
                f"cache is read for one query") if got == by_group and by_group != want else ""
        if got is not None and (isinstance(got, bool) or not isinstance(got, int) or not 1 <= got <= h or h % got):
            return f"expected None or a divisor of n_heads = {h} (each K/V head serves a whole group), got {got!r}"
        if got is None:
            return (f"got None, expected {want} - with {want} K/V heads attention reaches "
                    f"{attention_intensity(lens, want, cfg):.0f} FLOP/byte, at or above the ridge {ridge:g}")
        x = attention_intensity(lens, got, cfg)
        if want is None:
            return (f"got {got}, expected None - with {got} K/V heads attention reaches {x:.0f} FLOP/byte, below the "
                    f"ridge {ridge:g}, and even one K/V head only {attention_intensity(lens, 1, cfg):.0f}: no grouping "
                    f"is enough; only longer requests can get there{trap}")
        if x < ridge:
            return (f"got {got}, expected {want} - with {got} K/V heads attention reaches {x:.0f} FLOP/byte "
                    f"< ridge {ridge:g}{trap}")
        return (f"got {got}, expected {want} - compute-bound ({x:.0f} FLOP/byte), but {want} K/V heads already reach "
                f"the ridge ({attention_intensity(lens, want, cfg):.0f}): every extra head shared gives away quality "
                f"for nothing" + (" - here no grouping at all is needed" if want == h else ""))
    return grade("gqa", fn, list(_GQA_CASES), judge,
                 "7 cases: one already compute-bound, some carried over by grouping, two that no grouping can rescue")


def check_crossover(fn: Callable[[ModelConfig, bool], int]) -> bool:
    """Exercise 05.2: ``fn(cfg, causal) -> int``, the smallest request length L at which attention's
    FLOPs reach the linear layers' (``forward_flops`` of one request), for models whose d_ffn is
    not always 4 x d_model and whose k = n_heads x d_head is not always d_model; one of them
    (``_CFG_ODD``) makes every division uneven, so a rounded-down answer fails there."""
    cases = [(cfg, causal) for cfg in _CFGS + (_CFG_ODD,) for causal in (False, True)]

    def judge(got, cfg, causal):
        want = crossover_length(cfg, causal)
        if got == want:
            return None
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return f"expected an int, got {got!r}"
        d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
        if got in (6 * d, 12 * d, 12 * d - 1) and want not in (6 * d, 12 * d - 1):
            return (f"got {got}, expected {want} - 6 x d_model holds only when k = n_heads x d_head = d_model and d_ffn = "
                    f"4 x d_model; here k = {k}, d_ffn = {f}: start from linear_flops_per_token")
        if causal and got == crossover_length(cfg, False):
            return f"got {got}, expected {want} - causal counts about half the cells: the crossover roughly doubles"
        if not causal and got == crossover_length(cfg, True):
            return f"got {got}, expected {want} - that is the causal answer; causal=False counts whole L x L blocks"
        lin = linear_flops_per_token(cfg) // cfg.n_layers             # per token per layer
        with_d = -(-lin // (2 * d)) - 1 if causal else -(-lin // (4 * d))  # d_model where k belongs
        if k != d and abs(got - with_d) <= 1:
            return f"got {got}, expected {want} - attention's width is k = n_heads x d_head = {k}, not d_model = {d}"
        floor = lin // (2 * k) - 1 if causal else lin // (4 * k)
        if got == floor:
            return (f"got {got}, expected {want} - rounded down: here the division is not exact, and at L = {got} "
                    f"attention is still below the linear layers; the crossover is the smallest whole L with attention "
                    f">= linear: round up")
        if abs(got - want) <= 1:
            return f"got {got}, expected {want} - off by one: the SMALLEST L with attention >= linear"
        return f"got {got}, expected {want}"
    return grade("crossover", fn, cases, judge, "5 models, whole blocks and causal")


def _linear_terms(cfg: ModelConfig) -> tuple[int, int]:
    """(weight numbers per layer, activation numbers per row per layer) of the four linear layers."""
    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    shapes = ((d, 3 * k), (k, d), (d, f), (f, d))
    return sum(a * b for a, b in shapes), sum(a + b for a, b in shapes)


def min_decode_batch(cfg: ModelConfig, ridge: float, nbytes: int = BF16) -> int | None:
    """The smallest R whose decode step's linear layers reach ``ridge`` FLOP/byte
    (``block_linear_intensity`` with rows = R), or None when no R does: the intensity only approaches
    ``2 W / (nbytes · A)`` (W weight numbers, A activation numbers per row)."""
    w, a = _linear_terms(cfg)
    rho = Fraction(ridge).limit_denominator(10**6) * nbytes
    if 2 * w <= rho * a:
        return None
    return max(1, math.ceil(rho * w / (2 * w - rho * a)))


def decode_step_parts(cfg: ModelConfig, requests: int, kv_len: int, nbytes: int = BF16, machine=None) -> dict:
    """Per layer, a decode step of R = ``requests`` requests, each with ``kv_len`` cached tokens (no GQA),
    part by part on ``machine`` = (name, FLOP/s, bytes/s) (default the H200's datasheet). Each part is its
    own kernel, so each meets its own roofline: its time is ``max(FLOPs / peak, bytes / bandwidth)``
    (``roofline_seconds``), and the step's is the sum. ``"linear"``: ``2 R W`` FLOPs over the weights once
    and each request's A activation numbers (``block_linear_intensity`` with rows = R); ``"attention"``
    (fused-kernel byte model, the scores stay on chip): ``4 k kv_len`` FLOPs per request (``QKᵀ`` and
    ``PV``) over its query and output (2k numbers) and its cached K and V (``2 k kv_len``). Keys: the two
    parts (``{"flops", "bytes", "intensity", "seconds", "bound"}``), ``"seconds"`` and ``"longer"`` (the
    part that takes longer)."""
    r, n = check_int("requests", requests, 1), check_int("kv_len", kv_len, 1)
    _, peak, bw = _machine(machine or H200)
    w, a = _linear_terms(cfg)
    k = cfg.qkv_dim
    lin = _part(2 * r * w, nbytes * (w + r * a), peak, bw)
    att = _part(r * 4 * k * n, nbytes * r * (2 * k + 2 * k * n), peak, bw)
    return {"linear": lin, "attention": att, "seconds": lin["seconds"] + att["seconds"],
            "longer": "attention" if att["seconds"] > lin["seconds"] else "linear"}


def decode_parts_table(cfg: ModelConfig, kv_lens: Sequence[int], requests: Sequence[int], machine=None) -> list[str]:
    """One line per (cache length, R): each part's roofline time in µs and its bound (``decode_step_parts``)."""
    out = []
    for n in kv_lens:
        for r in requests:
            p = decode_step_parts(cfg, r, n, machine=machine)
            lin, att = p["linear"], p["attention"]
            out.append(f"{n:5d} cached, R = {r:5d}: linear {lin['seconds'] * 1e6:9.4g} us ({lin['bound']}, "
                       f"{lin['intensity']:5.1f} FLOP/B) | attention {att['seconds'] * 1e6:9.4g} us ({att['bound']}, "
                       f"{att['intensity']:.2f} FLOP/B) | longer: {p['longer']}")
    return out


def kv_read_overtakes_from(cfg: ModelConfig, ridge: float, nbytes: int, kv_len: int) -> int | None:
    """Exercise 05.3's answer: the smallest R from which a decode step's attention takes longer than its
    linear layers, each part timed by its own roofline (``decode_step_parts``), on a machine of ridge
    ``ridge`` (time in units of bytes / bandwidth: a part takes ``max(FLOPs / ridge, bytes)``); None
    when the linear layers stay the longer part for every R.

    Per request attention takes ``a = max(4k n / ridge, nbytes 2k (n + 1))``, the linear layers
    ``max(2 R W / ridge, nbytes (W + R A))``: attention is longer iff ``a > 2W / ridge`` (the linear
    layers' compute time per request, whatever R) and ``R (a - nbytes A) > nbytes W`` (their memory time)."""
    w, a_rows = _linear_terms(cfg)
    k, n = cfg.qkv_dim, check_int("kv_len", kv_len, 1)
    rho = Fraction(ridge).limit_denominator(10**6)
    a = max(Fraction(4 * k * n) / rho, Fraction(nbytes * 2 * k * (n + 1)))
    if a <= 2 * w / rho or a <= nbytes * a_rows:
        return None
    return math.floor(nbytes * w / (a - nbytes * a_rows)) + 1


def _kv_read_bytes_only(cfg: ModelConfig, nbytes: int, kv_len: int) -> int | None:
    """The tempting answer to Exercise 05.3: both parts timed by their bytes alone (the linear layers
    taken as memory-bound whatever R)."""
    w, a_rows = _linear_terms(cfg)
    c = nbytes * 2 * cfg.qkv_dim * (kv_len + 1)
    return None if c <= nbytes * a_rows else nbytes * w // (c - nbytes * a_rows) + 1


_KV_CASES = ((ModelConfig(), _H200_RIDGE, 2, 128), (ModelConfig(), _H200_RIDGE, 2, 1000),
             (ModelConfig(), _H200_RIDGE, 2, 8), (ModelConfig(), _H200_RIDGE, 2, 1),
             (ModelConfig(), 9.0, 4, 128), (ModelConfig(), 9.0, 4, 1024), (_CFGS[1], _H200_RIDGE, 2, 64))


def check_kv_overtakes(fn: Callable[[ModelConfig, float, int, int], int | None]) -> bool:
    """Exercise 05.3: ``fn(cfg, ridge, nbytes, kv_len) -> int or None``: the smallest R from which a
    decode step's attention (each request's KV read) takes longer than its linear layers, each part
    timed by its own roofline; None when it never does. Cases: the H200 with short and long caches, a
    CPU-like ridge of 9 in fp32, another model; two of them are where the linear layers turn
    compute-bound before the KV read catches up, and a bytes-only comparison gives a number."""
    def judge(got, cfg, ridge, nbytes, kv_len):
        want = kv_read_overtakes_from(cfg, ridge, nbytes, kv_len)
        if got == want and (got is None or (isinstance(got, int) and not isinstance(got, bool))):
            return None
        if got is not None and (isinstance(got, bool) or not isinstance(got, int) or got < 1):
            return f"expected a positive int (or None), got {got!r}"
        w, _ = _linear_terms(cfg)
        lin_batch = min_decode_batch(cfg, ridge, nbytes)
        if want is None and got is not None:
            p = decode_step_parts(cfg, got, kv_len, nbytes, ("ridge", ridge, 1.0))
            why = ""
            if p["linear"]["bound"] == "compute-bound":
                why = (f" - at R = {got} the linear layers are compute-bound (from R = {lin_batch}): their time is "
                       f"their FLOPs at peak, 2 R W, and grows with R exactly as fast as the KV read, which stays "
                       f"shorter ({p['attention']['seconds']:.4g} against {p['linear']['seconds']:.4g} byte-times)")
            return f"got {got}, expected None{why}"
        if got is None:
            p = decode_step_parts(cfg, want, kv_len, nbytes, ("ridge", ridge, 1.0))
            return (f"got None, expected {want} - at R = {want} attention takes {p['attention']['seconds']:.4g} "
                    f"byte-times, the linear layers {p['linear']['seconds']:.4g}")
        if abs(got - want) == 1:
            return f"got {got}, expected {want} - off by one: the smallest R at which attention takes longer"
        return f"got {got}, expected {want}"
    return grade("kv_overtakes", fn, list(_KV_CASES), judge,
                 "7 cases: the H200 and a CPU-like ridge, short and long caches, another model")


# ---------------------------------------------------------------------------------------------
# Exercise 05.2: design a packing whose attention is compute-bound on an H200

PACK_MIN_LEN = 16                               # a chat turn: every request of the packing has at least this
_PACK_CASES = ((4096, 8), (4096, 1), (2048, 2), (8192, 8), (512, 8))


def attention_intensity(seq_lens: Sequence[int], n_kv_heads: int = 8, cfg: ModelConfig | None = None,
                        nbytes: int = BF16) -> float:
    """Causal attention's FLOPs over its bytes (Q, K, V, O once: ``forward_bytes``) for one forward of
    ``seq_lens``: a token-weighted mean over the requests, so long requests carry it."""
    cfg = cfg or ModelConfig()
    f = forward_flops(cfg, seq_lens, "varlen", causal=True, n_kv_heads=n_kv_heads)
    return f.attention / forward_bytes(cfg, seq_lens, n_kv_heads=n_kv_heads, bytes_per_element=nbytes).attention


def _most_compute_bound_requests(total: int, n_kv_heads: int = 8, ridge: float = H200_PEAK_FLOPS / H200_BYTES_PER_S,
                                min_len: int = PACK_MIN_LEN, cfg: ModelConfig | None = None) -> int | None:
    """The most requests (each >= ``min_len`` tokens, ``total`` in all) whose causal attention still
    reaches ``ridge`` FLOP/byte, or None when even one request of ``total`` tokens does not. For a fixed
    count the sum of L² is largest with one long request and the rest at ``min_len``, so that shape is
    searched (``attention_intensity`` falls as the count grows)."""
    t = check_int("total", total, min_len)
    best = None
    for n in range(1, t // min_len + 1):
        lens = [t - (n - 1) * min_len] + [min_len] * (n - 1)
        if attention_intensity(lens, n_kv_heads, cfg) < ridge:
            break
        best = n
    return best


def check_packing(fn: Callable[[int, int], Sequence[int] | None]) -> bool:
    """Exercise 05.2: ``fn(total, n_kv_heads) -> list of lengths or None``: a packing of exactly ``total``
    tokens, every request >= ``PACK_MIN_LEN``, whose causal attention is compute-bound on an H200 (bf16,
    the article's model with ``n_kv_heads`` K/V heads), with at least 90 % as many requests as the
    most any such packing has (``_most_compute_bound_requests``); None when no packing is compute-bound."""
    ridge = H200_PEAK_FLOPS / H200_BYTES_PER_S

    def judge(got, total, kv):
        most = _most_compute_bound_requests(total, kv, ridge)
        one = attention_intensity([total], kv)
        if most is None:
            if got is None:
                return None
            return (f"got {got!r}, expected None - even one request of all {total} tokens reaches only {one:.0f} "
                    f"FLOP/byte, below the H200's ridge {ridge:.0f}: no packing of {total} tokens is compute-bound")
        if got is None:
            return (f"got None, expected a packing - one request of {total} tokens reaches {one:.0f} FLOP/byte, "
                    f"above the ridge {ridge:.0f}")
        if isinstance(got, (str, bytes)) or not isinstance(got, Sequence) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in got):
            return f"expected a list of int lengths (or None), got {got!r}"
        if sum(got) != total or not got or min(got) < PACK_MIN_LEN:
            return (f"got {len(got)} requests summing to {sum(got)}, shortest {min(got) if got else None} - the packing "
                    f"must hold exactly {total} tokens, every request at least {PACK_MIN_LEN}")
        x = attention_intensity(got, kv)
        if x < ridge:
            return (f"got {len(got)} requests, attention {x:.0f} FLOP/byte < ridge {ridge:.0f}: memory-bound - "
                    f"attention's intensity is the token-weighted mean of each request's (about L/4 with 8 K/V heads): "
                    f"equal or short requests keep it low; one long request carries it")
        if len(got) < 0.9 * most:
            return (f"compute-bound ({x:.0f} FLOP/byte), but only {len(got)} requests; {most} fit - "
                    f"the long request carries the intensity: give it just enough tokens and make every other "
                    f"request as short as allowed")
        return None
    return grade("packing", fn, list(_PACK_CASES), judge,
                 "5 cases: 512 to 8,192 tokens, 1 to 8 K/V heads, one where no packing works")


# ---------------------------------------------------------------------------------------------
# The explorer's timed forward: the engine on the learner's lengths, at a reduced width

HERE_MAX_TOKENS = 1024


def forward_here(seq_lens: Sequence[int], repeats: int = 2, cfg: ModelConfig | None = None) -> dict:
    """Time one real engine forward of ``cfg`` (default ``HERE_CFG``: 2 layers, d_model 256, fp32, on
    the CPU) on ``seq_lens`` (at most ``HERE_MAX_TOKENS`` tokens, so it stays under a second):
    ``{"cfg", "seq_lens", "seconds"}`` (fastest of ``repeats``; the first call on new lengths builds the model and batch)."""
    from ..core.batch import pack
    from ..core.model import Transformer
    from ..measure.profile import time_call
    cfg = cfg or HERE_CFG
    lens = check_lengths(seq_lens)
    if sum(lens) > HERE_MAX_TOKENS:
        raise ValueError(f"the timed forward takes at most {HERE_MAX_TOKENS} tokens, got {sum(lens)}")
    if max(lens) > cfg.max_position:
        raise ValueError(f"the timed forward takes requests of at most {cfg.max_position} tokens, got {max(lens)}")
    key = (repr(cfg), tuple(lens))
    if key not in _HERE_MODELS:
        _HERE_MODELS.clear()
        g = torch.Generator().manual_seed(0)
        _HERE_MODELS[key] = (Transformer(cfg, seed=0),
                             pack([torch.randint(0, cfg.vocab_size, (m,), generator=g) for m in lens]))
    model, batch = _HERE_MODELS[key]
    with torch.no_grad():
        seconds = time_call(lambda: model(batch), repeats=check_int("repeats", repeats, 1, 20), warmup=0)
    return {"cfg": cfg, "seq_lens": list(lens), "seconds": seconds}


_HERE_MODELS: dict = {}


# ---------------------------------------------------------------------------------------------
# Measured time split, drawn in milliseconds of wall time beside the FLOPs

def wall_scaled(split: Mapping[str, float]) -> dict[str, float]:
    """``forward_time_split``'s parts rescaled so they add up to its ``wall`` time (the profiler's own
    overhead inflates the parts on the CPU; their proportions are kept)."""
    parts = {p: float(split[p]) for p in ("linear", "attention", "other")}
    total = sum(parts.values())
    if not total > 0 or not split.get("wall", 0) > 0:
        raise ValueError(f"a time split needs positive parts and wall, got {dict(split)!r}")
    return {p: v * split["wall"] / total for p, v in parts.items()}


def time_split_figure(splits: Mapping[str, Mapping[str, float]], flops: Mapping[str, ForwardFlops],
                      where: str) -> Figure:
    """Two panels, one bar per packing: left, the measured time in ms (``wall_scaled``: the profiled
    parts scaled to the wall time), linear / attention / other; right, the causal FLOPs in GFLOP."""
    names = list(splits)
    fig = Figure(figsize=(9.2, 1.9 + 0.45 * len(names)))
    ax_t, ax_f = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for y, name in enumerate(names):
        t, left = wall_scaled(splits[name]), 0.0
        for p, color in (("linear", LINEAR), ("attention", ATTENTION), ("other", OTHER)):
            ax_t.barh(y, 1e3 * t[p], left=left, color=color, label=p if y == 0 else None)
            left += 1e3 * t[p]
        ax_t.text(left, y, f" {left:.0f} ms", va="center", fontsize=MIN_FONT, color=TEXT)
        f, left = flops[name], 0.0
        for p, color in (("linear", LINEAR), ("attention", ATTENTION)):
            ax_f.barh(y, getattr(f, p) / 1e9, left=left, color=color)
            left += getattr(f, p) / 1e9
        ax_f.text(left, y, f" {left:.1f}", va="center", fontsize=MIN_FONT, color=TEXT)
    for ax, xlabel in ((ax_t, f"time per forward (ms), profiled parts scaled to wall time, {where}"),
                       (ax_f, "FLOPs per forward (GFLOP), causal")):
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names if ax is ax_t else [""] * len(names), fontsize=MIN_FONT)
        ax.invert_yaxis()
        ax.set_xlim(0, ax.get_xlim()[1] * 1.25)
        ax.set_xlabel(xlabel, fontsize=MIN_FONT)
        ax.tick_params(labelsize=MIN_FONT)
    ax_t.legend(fontsize=MIN_FONT, ncol=3, frameon=False, loc="lower left", bbox_to_anchor=(0.0, 1.0))
    fig.suptitle("Time (profiled, this machine) vs FLOPs (causal), same 1,000 tokens", fontsize=MIN_FONT + 1,
                 y=0.98)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.5 / (1.9 + 0.45 * len(names)) + 0.12, top=0.72, wspace=0.12)
    return fig
