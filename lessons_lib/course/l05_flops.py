"""What lesson 05 (FLOP regimes) draws, explores and checks.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from ..core.config import ModelConfig
from ..validate import check_int
from ..measure.flops import decode_attention_intensity, forward_flops, linear_intensity
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import register
from .grading import grade
from .style import CELL_COLORS, USEFUL, WASTED


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

def flop_regime_state(num_requests: int, length: int) -> dict:
    """``{"seq_lens": [L]·R, "flops": forward_flops(ModelConfig(), [L]·R, "varlen")}``."""
    r = check_int("num_requests", num_requests, 1, 1 << 20)
    n = check_int("length", length, 1, 1 << 30)
    lens = [n] * r
    return {"seq_lens": lens, "flops": forward_flops(ModelConfig(), lens, "varlen")}

def flop_regime_text(state: dict) -> str:
    """Exactly ``linear <int> | attention <int> | dominant <linear|attention>``."""
    f = state["flops"]
    return f"linear {f.linear} | attention {f.attention} | dominant {f.dominant}"

def flop_regime_explorer(num_requests: int = 10, length: int = 100):
    """VBox class ``frx``: sliders ``frx-num-requests`` (1..64) and ``frx-length`` (1..4096), HTML
    ``frx-flops`` (``flop_regime_text``), Output ``frx-figure`` (stacked FLOPs bar)."""
    w = ipywidgets_module()
    reqs = tagged(w.IntSlider(value=num_requests, min=1, max=64, description="requests R"), "frx-num-requests")
    base = tagged(w.IntSlider(value=length, min=1, max=4096, description="length L"), "frx-length")
    text, out = tagged(w.HTML(), "frx-flops"), tagged(w.Output(), "frx-figure")

    def update(change=None):
        state = flop_regime_state(reqs.value, base.value)
        text.value = flop_regime_text(state)
        r, n = reqs.value, base.value
        f = state["flops"]
        title = f"{r} x {n} tokens: {100 * f.attention_fraction:.1f}% attention, {f.dominant} dominates"
        show_figure(out, flops_bars([(f"{r} x {n}", state["seq_lens"])], figsize=(5, 4), title=title))

    return explorer("frx", [reqs, base], [text, out], update)

_CFGS = [ModelConfig(), ModelConfig(n_layers=2, d_model=256, n_heads=4, d_head=32, d_ffn=1024, tp_size=1)]

def check_attention_flops(fn: Callable[[ModelConfig, list], int]) -> bool:
    """Exercise 05.1: ``fn(cfg, seq_lens) -> int``, attention FLOPs of one whole varlen forward
    (non-causal whole blocks, ``QK^T`` and ``PV``)."""
    cases = [(cfg, lens) for cfg in _CFGS for lens in ([1000], [100] * 10, [10, 30], [7, 1, 12])]

    def judge(got, cfg, lens):
        want = forward_flops(cfg, lens, "varlen").attention
        if got == want:
            return None
        if not isinstance(got, (int, float)) or got == 0:
            return f"got {got!r}, expected {want}"
        ratio = want / got
        if len(lens) > 1 and got == sum(lens) ** 2 * cfg.n_layers * cfg.n_heads * 4 * cfg.d_head:
            return f"got {got}, expected {want} - that counts the whole T x T matrix (masked); varlen computes sum L_i^2"
        factors = [(cfg.n_layers, "n_layers"), (cfg.n_heads, "n_heads"), (cfg.n_layers * cfg.n_heads, "n_layers x n_heads"),
                   (2, "2: there are two matmuls, QK^T and PV"),
                   (4, "4: each cell costs 4 x d_head FLOPs, 2 in QK^T and 2 in PV")]
        hint = " or ".join(text for value, text in factors if math.isclose(ratio, value))
        return f"got {got}, expected {want}" + (f" - off by a factor {ratio:g}: missing {hint}?" if hint else "")
    return grade("attention_flops", fn, cases, judge, "n_layers x n_heads x sum(L_i^2) x 4 x d_head on 8 cases")

def check_crossover(fn: Callable[[ModelConfig], int]) -> bool:
    """Exercise 05.2: ``fn(cfg) -> int``, the smallest single-request length L whose attention
    FLOPs (non-causal) reach the linear FLOPs."""
    def judge(got, cfg):
        want = _crossover(cfg)
        if got == want:
            return None
        if isinstance(got, (int, float)) and abs(got - want) <= 1:
            return f"got {got}, expected {want} - off by one: find the SMALLEST L with attention >= linear"
        return f"got {got!r}, expected {want}"
    return grade("crossover", fn, [(c,) for c in _CFGS], judge, "attention overtakes the linears at the right length")

def _crossover(cfg: ModelConfig) -> int:
    def attention_below(n: int) -> bool:
        f = forward_flops(cfg, [n])
        return f.attention < f.linear

    lo, hi = 1, 1
    while attention_below(hi):
        hi *= 2
    while lo < hi:  # smallest L with attention >= linear (both grow monotonically in L)
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if attention_below(mid) else (lo, mid)
    return lo

def check_linear_intensity(fn: Callable[[int, int, int, int], float]) -> bool:
    """Exercise 05.3: ``fn(tokens, d_in, d_out, bytes_per_element) -> float``: FLOP per byte of
    ``[T, d_in] @ [d_in, d_out]`` reading the weight once (C13)."""
    cases = [(1, 512, 2048, 2), (40, 512, 1536, 4), (1000, 512, 512, 4), (4096, 2048, 512, 2)]

    def judge(got, t, d_in, d_out, nbytes):
        want = linear_intensity(t, d_in, d_out, nbytes)
        if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-6):
            return None
        hint = ""
        if isinstance(got, (int, float)) and math.isclose(got, 2 * t * d_in * d_out / (nbytes * d_in * d_out), rel_tol=1e-6):
            hint = " - count the bytes of the activations too: the input [T, d_in] and the output [T, d_out]"
        return f"got {got!r}, expected {want:.4f}{hint}"
    return grade("linear_intensity", fn, cases, judge, "FLOP / byte = 2 T d_in d_out / (bytes (weight + input + output))")

@register("05_flops_1x1000_vs_10x100", lesson="05",
          caption="same 1000 tokens: 1 x 1000 vs 10 x 100 vs 100 x 10, whole-forward FLOPs (C14)")
def _flops_bars() -> Figure:
    return flops_bars([("1 x 1000", [1000]), ("10 x 100", [100] * 10), ("100 x 10", [10] * 100)],
                          ModelConfig(), figsize=(6, 4))

@register("05_attention_share", lesson="05", caption="attention share of FLOPs against request length (C14)")
def _attention_share() -> Figure:
    return attention_share_curve(ModelConfig(), marks=(100, 1000, 8000))

@register("05_intensity", lesson="05", caption="arithmetic intensity of a linear layer vs tokens, and decode (C13, C15)")
def _intensity() -> Figure:
    return intensity_curves()
