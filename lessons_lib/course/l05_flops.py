"""What lesson 05 (where the FLOPs go) draws, explores and checks; the engine records and counts
(``measure.recorded``, ``measure.flops``, ``measure.machines``).

Figures ``05_weight_reuse``, ``05_flops_1x1000_vs_10x100``, ``05_attention_share``, ``05_intensity``; the measured
sweep and time split drawn (``throughput_figure``, ``time_split_figure``). Explorer ``roofline_explorer`` over
``roofline_state`` (a model, a ``measure.machines.Machine``, packings -> FLOPs, bytes, intensity, the roofline's time,
the launch floor) and ``measure.recorded.timed_forward`` (the engine's forward of the knobs' model, recorded and timed).
Exercise checkers ``check_gqa`` (05.1), ``check_packing`` (05.2), ``check_kv_overtakes`` (05.3).

Taught in notebooks/05_flop_regimes.ipynb.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

from ..core.batch import cumulative
from ..core.config import ModelConfig
from ..measure import flops as fl
from ..measure.machines import H200, REFERENCE_CPU, Machine, beside_roofline, forward_roofline
from ..measure.profile import wall_scaled
from ..measure.recorded import TIMED_MAX_FLOPS, TIMED_MAX_TOKENS, timed_forward
from ..measure.recorder import BF16
from ..serve.workloads import packing_lens
from ..style import ATTENTION, LINEAR, MIN_FONT, NEVER, OTHER, REQUEST, TEXT, WASTE
from ..validate import check_int, check_lengths
from .explore import explorer, ipywidgets_module, parse_lengths, show_figure, tagged
from .figures import register
from .grading import grade

# ---------------------------------------------------------------------------------------------
# A decode step part by part on the H200 (measure.flops.decode_step_parts), with what binds first on the GPU


def decode_parts_table(cfg: ModelConfig, kv_lens: Sequence[int], requests: Sequence[int]) -> list[str]:
    """One line per (cache length, R): per layer on the H200, each part's roofline time and bound, then its GPU
    floor (``decode_step_verdicts``: thread blocks and launches), and the longer part (``decode_step_parts``)."""
    def part(v: fl.GpuVerdict, digits: str) -> str:
        return (f"{v.part.seconds * 1e6:8.3g} us ({v.part.bound}, {v.part.intensity:{digits}} FLOP/B; {v.binds} binds: "
                f">= {v.seconds * 1e6:.3g} us)")
    verdicts = {(n, r): fl.decode_step_verdicts(cfg, r, n, H200) for n in kv_lens for r in requests}
    return [f"{n:5d} cached, R = {r:5d}: linear {part(lin, '5.1f')} | attention {part(att, '.2f')} | longer: "
            f"{fl.decode_step_parts(cfg, r, n, H200).longer}" for (n, r), (lin, att) in verdicts.items()]

# ---------------------------------------------------------------------------------------------
# Figures


_ARROW = {"arrowstyle": "-", "color": TEXT, "linewidth": 0.8}   # a label's thin line to its point


def _dress(ax, xlabel: str, ylabel: str, title: str = "", size: int = MIN_FONT + 1, **legend) -> None:
    """``ax``'s axis labels at ``size``, ticks at ``MIN_FONT``, ``title``, and a frameless legend placed by
    ``legend`` (``loc``, ``bbox_to_anchor``) when given."""
    ax.set_xlabel(xlabel, fontsize=size)
    ax.set_ylabel(ylabel, fontsize=size)
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_title(title, fontsize=MIN_FONT + 1)
    if legend:
        ax.legend(fontsize=MIN_FONT, frameon=False, **legend)


def flops_bars(ax, cases: Sequence[tuple[str, Sequence[int]]], cfg: ModelConfig, title: str) -> None:
    """Into ``ax``: stacked bars of whole-forward FLOPs (``forward_flops``, varlen, whole blocks) in GFLOP, linear
    below, attention on top, the attention share above each bar."""
    if not cases:
        raise ValueError("cases is empty: give at least one (label, seq_lens)")
    fwd = [fl.forward_flops(cfg, lens, "varlen") for _, lens in cases]
    lin = np.array([f.linear for f in fwd], dtype=float) / 1e9
    att = np.array([f.attention for f in fwd], dtype=float) / 1e9
    x = np.arange(len(cases))
    ax.bar(x, lin, color=LINEAR, label="linear layers (QKV, out proj, FFN-up, FFN-down)")
    ax.bar(x, att, bottom=lin, color=ATTENTION, label="attention (QKᵀ and PV)")
    for xi, f, top in zip(x, fwd, lin + att):
        ax.text(xi, top, f"{100 * f.attention_fraction:.1f}% attention", ha="center", va="bottom", fontsize=MIN_FONT,
                color=TEXT)
    ax.set_xticks(x, [label for label, _ in cases], fontsize=MIN_FONT + 1)
    ax.set_ylim(0, float((lin + att).max()) * 1.45 or 1.0)
    _dress(ax, "", "GFLOP per forward", title, loc="upper right")


@register("05_flops_1x1000_vs_10x100", lesson="05",
          caption="the same 1000 tokens as 1 x 1000, 10 x 100, 100 x 10: score blocks and whole-forward FLOPs (C14)")
def same_tokens_figure(cfg: ModelConfig | None = None, total: int = 1000, mix: Sequence[int] = (1, 10, 100)) -> Figure:
    """Claim C14: the same ``total`` tokens as R x total/R for each R in ``mix``: each request's score block on
    the T x T square (top), the whole forward's FLOPs, linear and attention (bottom)."""
    cfg = cfg or ModelConfig()
    fig = Figure(figsize=(10, 6.6))
    gs = fig.add_gridspec(2, len(mix), height_ratios=(1, 1.25), hspace=0.45, left=0.08, right=0.98, top=0.9, bottom=0.07)
    cases = [(f"{r} x {total // r}", [total // r] * r) for r in mix]
    for i, (label, lens) in enumerate(cases):   # the T x T score matrix: each request's block computed, the rest never
        ax, t = fig.add_subplot(gs[0, i]), sum(lens)
        ax.add_patch(Rectangle((0, 0), t, t, facecolor=NEVER, edgecolor=TEXT, linewidth=0.8))
        for s, n in zip(cumulative(lens)[:-1], lens):
            ax.add_patch(Rectangle((s, t - s - n), n, n, facecolor=ATTENTION, edgecolor="none"))
        ax.set(xlim=(0, t), ylim=(0, t), aspect="equal", xticks=[], yticks=[])
        ax.set_title(f"{label}: {label}² = {fl.attention_cells(lens, 'varlen').computed:,} cells", fontsize=MIN_FONT + 1)
    flops_bars(fig.add_subplot(gs[1, :]), cases, cfg,
               f"whole forward of the article's model ({cfg.n_layers} layers, d_model {cfg.d_model}), varlen, "
               "whole blocks:\nthe linear work is the same, the attention work drops 10x per step to the right")
    fig.suptitle(f"The same {total:,} tokens, three packings: score cells per head per layer (top, blue = computed) "
                 "and FLOPs (bottom)", fontsize=MIN_FONT + 2)
    return fig


@register("05_attention_share", lesson="05",
          caption="attention's share of the FLOPs against request length, whole blocks and causal, with the crossovers (C14)")
def attention_share_curve(cfg: ModelConfig | None = None, lengths: Sequence[int] | None = None,
                          marks: Sequence[int] = (100, 1000, 8000)) -> Figure:
    """Claim C14: attention's share of a forward's FLOPs against request length L (any number of requests of
    that length), whole blocks (solid) and causal (dashed), the crossovers (``flops.attention_crossover_length``) marked."""
    cfg = cfg or ModelConfig()
    lengths = list(lengths) if lengths is not None else sorted({int(v) for v in np.logspace(1, 5, 160)})
    fig = Figure(figsize=(8, 4.2))
    ax = fig.add_subplot()
    for causal, style in ((False, "-"), (True, "--")):
        share = [100 * fl.forward_flops(cfg, [n], "varlen", causal).attention_fraction for n in lengths]
        ax.plot(lengths, share, style, color=ATTENTION, label="causal (useful cells only)" if causal
                else "whole blocks (the article's count)")
        cross = fl.attention_crossover_length(cfg, causal)
        ax.axvline(cross, color=TEXT, linestyle=style, linewidth=1)
        ax.text(cross * (1.08 if causal else 0.93), 3, f"L = {cross:,}\n({'12' if causal else '6'} x d_model"
                f"{' - 1' if causal else ''})", fontsize=MIN_FONT, color=TEXT, ha="left" if causal else "right")
    ax.axhline(50, color=TEXT, linestyle=":", linewidth=0.8)
    for n in marks:  # below 50 %: the label above-left of the curves; above: right of them, lower down
        s = 100 * fl.forward_flops(cfg, [n], "varlen").attention_fraction
        ax.plot([n], [s], "o", color=ATTENTION)
        at = (n / 5, s + 8) if s < 50 else (n * 2.5, s - 30)
        ax.annotate(f"L = {n:,}: {s:.1f}%", (n, s), xytext=at, ha="left", va="bottom", fontsize=MIN_FONT, color=TEXT,
                    arrowprops=_ARROW)
    ax.set(xscale="log", ylim=(0, 100))
    _dress(ax, "tokens per request L (any number of requests of this length)", "attention's share of the FLOPs (%)",
           f"Attention's share of one forward's FLOPs ({cfg.n_layers} layers, d_model {cfg.d_model}, FFN {cfg.d_ffn}):"
           "\nattention-dominated (share > 50 %) only right of the vertical lines",
           loc="upper left", bbox_to_anchor=(0.0, 0.9))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.14, top=0.86)
    return fig


@register("05_intensity", lesson="05",
          caption="arithmetic intensity of a linear layer vs the rows sharing one weight read, decode steps, "
                  "decode attention, and two machines' ridge points (C13, C15)")
def intensity_figure(cfg: ModelConfig | None = None, decode_r: Sequence[int] = (1, 32, 256), kv_len: int = 128,
                     ridges: Sequence[Machine] = (H200, REFERENCE_CPU)) -> Figure:
    """Claims C13, C15: a block's linear layers' intensity (``block_linear_intensity``, bf16 and fp32) against the
    rows sharing one weight read, decode steps of R requests marked, each request's decode attention
    (``decode_attention_intensity``: q K^T and P V alike), and the ridges of ``ridges`` (each in its own dtype)."""
    cfg = cfg or ModelConfig()
    tokens = np.unique(np.logspace(0, 4.3, 80).astype(int))
    fig = Figure(figsize=(8.6, 4.8))
    ax = fig.add_subplot()
    for nbytes, style, name in ((BF16, "-", "bf16"), (4, "--", "fp32")):
        ax.plot(tokens, [fl.block_linear_intensity(cfg, int(t), nbytes) for t in tokens], style, color=LINEAR,
                label=f"a block's 4 linear layers (d_model {cfg.d_model}, FFN {cfg.d_ffn}), {name}")
    for r in decode_r:  # R = 1: under the attention line; small R: above-left of the bf16 curve; large R: below-right
        y = fl.block_linear_intensity(cfg, r)
        ax.plot([r], [y], "o", color=LINEAR)
        at = ({"xytext": (1.12, 0.46), "va": "top", "arrowprops": _ARROW} if r < 4 else
              {"xytext": (-8, 10), "textcoords": "offset points", "ha": "right", "va": "bottom"} if r < 128 else
              {"xytext": (18, -58), "textcoords": "offset points", "va": "top", "arrowprops": _ARROW})
        ax.annotate(f"decode step, R = {r}: {y:.1f}", (r, y), **{"ha": "left"} | at, fontsize=MIN_FONT, color=TEXT)
    att = fl.decode_attention_intensity(kv_len, cfg.d_head, BF16)
    ax.axhline(att, color=ATTENTION, linewidth=2,
               label=f"decode attention of each request, {kv_len:,} cached tokens (bf16): {att:.2f}, any R")
    for m, style in zip(ridges, (":", "-.")):  # high ridges labelled above-left, low ones below-right
        ax.axhline(m.ridge, color=TEXT, linestyle=style, linewidth=1.2)
        left = m.ridge > 50
        machine, _, how = m.name.partition(" (")
        ax.text(0.6 if left else tokens[-1], m.ridge * 1.12 if left else m.ridge / 1.12,
                f"ridge, {machine}, {'bf16' if m.itemsize == BF16 else 'fp32'}: {m.ridge:.3g} FLOP/byte"
                + (f"\n({how}" if how else ""), fontsize=MIN_FONT, color=TEXT, ha="left" if left else "right",
                va="bottom" if left else "top")
    ax.set(xscale="log", yscale="log", xlim=(0.5, tokens[-1] * 1.3), ylim=(0.3, 3000))
    _dress(ax, "rows that share one read of the weights (prefill: flat tokens T; decode: requests R)",
           "FLOP per byte moved", "Arithmetic intensity = FLOPs / bytes moved, counting the weights, the input rows "
           "and the output rows,\neach moved once (no cache reuse); below a machine's ridge it waits for memory",
           loc="upper left", bbox_to_anchor=(0.0, 1.0))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.13, top=0.88)
    return fig


@register("05_weight_reuse", lesson="05",
          caption="one linear layer reads its weight once for all T flat rows, of any requests: FLOPs grow with T, "
                  "the weight's bytes do not (C13)")
def weight_reuse_figure(d_in: int = 512, d_out: int = 2048, lens: Sequence[int] = (1, 2, 3)) -> Figure:
    """Claim C13, the idea: ``[T, d_in] @ W[d_in, d_out]`` reads W once for all T flat rows, whichever requests
    they come from: one row (top), the rows of several requests (bottom), the FLOP and byte counts under each."""
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
        for x0, width, name, d in ((0.0, 1.6, "x", d_in), (5.6, 2.4, "y", d_out)):   # x and y: rows coloured by request
            for i, n in enumerate(rows):
                for j in range(n):
                    ax.add_patch(Rectangle((x0, y0 + 2.1 - (cu[i] + j + 1) * h), width, h * 0.9,
                                           facecolor=REQUEST[i % 2], edgecolor="white"))
            ax.text(x0 + width / 2, y0 + 2.1 - t * h - 0.12, f"{name} [{t}, {d}]", ha="center", va="top",
                    fontsize=MIN_FONT, color=TEXT)
        ax.text(1.95, y0 + 1.2, "@", ha="center", va="center", fontsize=MIN_FONT + 4, color=TEXT)
        ax.add_patch(Rectangle((2.3, y0), *wbox, facecolor=LINEAR, edgecolor="white", gid=f"weight-{k}"))
        ax.text(2.3 + wbox[0] / 2, y0 + wbox[1] / 2, f"W [{d_in}, {d_out}]\nread once", ha="center", va="center",
                fontsize=MIN_FONT + 1, color="white")
        ax.text(5.25, y0 + 1.2, "=", ha="center", va="center", fontsize=MIN_FONT + 4, color=TEXT)
        ax.text(8.4, y0 + 1.5, f"FLOPs: 2 · {t} · {d_in} · {d_out}" + ("" if k == 0 else f"   ({t} times more)"),
                fontsize=MIN_FONT + 1, color=TEXT)
        ax.text(8.4, y0 + 0.9, f"numbers moved: {d_in} · {d_out} (W, once)\n      + {t} · ({d_in} + {d_out}) (x and y)"
                + ("" if k == 0 else "\nW's part does not grow with T"), fontsize=MIN_FONT + 1, color=TEXT, va="center")
    ax.set(xlim=(-0.1, 14.2), ylim=(0.0, 7.2))
    return fig


# ---------------------------------------------------------------------------------------------
# Measured here (shown, never asserted): one linear layer's throughput against T, a forward's time split


def time_split_figure(splits: Mapping[str, Mapping[str, float]], flops: Mapping[str, fl.ForwardFlops],
                      where: str) -> Figure:
    """One bar per packing: the measured time in ms (``wall_scaled``), linear / attention / other (left); the
    causal FLOPs in GFLOP (right)."""
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
        ax.set_yticks(range(len(names)), names if ax is ax_t else [""] * len(names), fontsize=MIN_FONT)
        ax.invert_yaxis()
        ax.set_xlim(0, ax.get_xlim()[1] * 1.25)
        _dress(ax, xlabel, "", size=MIN_FONT)
    ax_t.legend(fontsize=MIN_FONT, ncol=3, frameon=False, loc="lower left", bbox_to_anchor=(0.0, 1.0))
    fig.suptitle("Time (profiled, this machine) vs FLOPs (causal), same 1,000 tokens", fontsize=MIN_FONT + 1, y=0.98)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.5 / (1.9 + 0.45 * len(names)) + 0.12, top=0.72, wspace=0.12)
    return fig


def throughput_figure(tokens: Sequence[int], gflops: Sequence[float], label: str, where: str,
                      roof: tuple[Sequence[int], Sequence[float]] | None = None) -> Figure:
    """Measured GFLOP/s against T (a tick and a label at each point); with ``roof`` = (T values, GFLOP/s) the
    roofline, dashed."""
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
    ax.set(xscale="log", xticks=list(tokens), xticklabels=[str(t) for t in tokens])
    ax.minorticks_off()
    ax.set_ylim(0, max(list(gflops) + list(roof[1] if roof is not None else [])) * 1.35 or 1.0)
    _dress(ax, "rows T (flat tokens through one weight read)", "GFLOP/s",
           f"measured on {where}: fastest of several runs (shown, never asserted)", loc="upper left")
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.17, top=0.9)
    return fig


# ---------------------------------------------------------------------------------------------
# The roofline explorer: a model, a machine, packings of the same tokens -> FLOPs, bytes, intensity, the
# roofline's time and the launch floor; and the engine's forward of that model, recorded and timed here.

def model_of(d_model: int = 512, d_ffn: int = 2048, n_heads: int = 8, n_kv_heads: int = 8,
             n_layers: int = 8) -> ModelConfig:
    """The explorer's model from its knobs (d_head = d_model / n_heads), each knob checked."""
    d, h = check_int("d_model", d_model, 8, 1 << 16), check_int("n_heads", n_heads, 1, 1024)
    if d % h:
        raise ValueError(f"n_heads must divide d_model (d_head = d_model / n_heads): {d} / {h} is not whole")
    return ModelConfig(n_layers=check_int("n_layers", n_layers, 1, 1024), d_model=d, n_heads=h, d_head=d // h,
                       n_kv_heads=n_kv_heads, d_ffn=check_int("d_ffn", d_ffn, 1, 1 << 18))


def roofline_state(d_model: int = 512, d_ffn: int = 2048, n_heads: int = 8, n_kv_heads: int = 8, n_layers: int = 8,
                   nbytes: int = BF16, machine: Machine = H200, total: int = 1000, requests: int = 10,
                   lengths: Sequence[int] | str = "300, 40", here: dict | None = None) -> dict:
    """Per packing (``1 x T``, ``R x T/R``, the ``lengths`` typed) of ``model_of``'s model on ``machine``, at
    ``nbytes`` per number: ``machines.forward_roofline`` (causal FLOPs over bytes, the launch floor).
    ``here`` = ``{"machine", "forward"}`` (``timed_forward``'s result) adds ``measured``: that forward beside its
    roofline time and its recorded ops' launch floor. Keys: ``cfg``, ``n_kv_heads``, ``nbytes``, ``machine``,
    ``rows`` (``{"label", "seq_lens"}`` and ``forward_roofline``'s keys), ``measured`` (or None)."""
    cfg = model_of(d_model, d_ffn, n_heads, n_kv_heads, n_layers)
    if not isinstance(machine, Machine):
        raise ValueError(f"machine must be a measure.machines.Machine, got {machine!r}")
    typed = parse_lengths(lengths, max_requests=256, max_length=1 << 16) if isinstance(lengths, str) \
        else check_lengths(lengths)
    if not typed:
        raise ValueError("lengths is empty: type request lengths like '700, 200, 100'")
    t = check_int("tokens T", total, 1, 1 << 20)
    r = check_int("requests R", requests, 1, 1 << 20)
    if r > t:
        raise ValueError(f"requests R = {r} is more than the tokens T = {t}: every request needs a token")
    packs = [(f"1 x {t}", [t]), (f"{r} x {t // r}" if t % r == 0 else f"{r} x ~{t / r:.0f}", packing_lens(t, r)),
             ("typed " + ", ".join(map(str, typed)), list(typed))]
    rows = [{"label": label, "seq_lens": lens} | forward_roofline(cfg, lens, machine, nbytes) for label, lens in packs]
    measured = beside_roofline(here["forward"], here["machine"]) if here and here.get("forward") else None
    return {"cfg": cfg, "n_kv_heads": cfg.n_kv_heads, "nbytes": nbytes, "machine": machine, "rows": rows,
            "measured": measured}


def _num(x: float) -> str:
    """FLOPs, bytes, seconds in engineering units: ``50.33 G``, ``812 k``."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.2f} "


def roofline_lines(state: dict) -> list[str]:
    """One line per packing: ``1 x 1000: linear 50.33 GFLOP 181.40 MB 277.5 FLOP/B compute-bound 0.05089 ms |
    attention ... | predicted 0.05918 ms | launch floor 0.2 ms (40 kernels): launch latency binds first``."""
    out = []
    for row in state["rows"]:
        parts = [f"{p} {_num(row[p].flops)}FLOP {_num(row[p].bytes)}B {row[p].intensity:.1f} FLOP/B "
                 f"{row[p].bound} {row[p].seconds * 1e3:.4g} ms" for p in ("linear", "attention")]
        out.append(f"{row['label']}: " + " | ".join(parts) + f" | predicted {row['seconds'] * 1e3:.4g} ms | launch "
                   f"floor {row['floor'] * 1e3:.4g} ms ({row['kernels']} kernels at least): {row['binds']} binds first")
    return out


def machine_line(state: dict) -> str:
    m = state["machine"]
    return (f"{m.name}: peak {m.peak_flops / 1e9:.1f} GFLOP/s, bandwidth {m.bytes_per_s / 1e9:.2f} GB/s, "
            f"ridge {m.ridge:.1f} FLOP/byte")


def measured_line(state: dict) -> str:
    """The engine's forward of the explorer's model, recorded and timed here, beside its roofline time (a lower
    bound) and its recorded ops' launch floor."""
    m = state["measured"]
    if m is None:
        return "measured here: not taken"
    c, rec, whole = m["cfg"], m["flops"], m["whole_blocks"]
    same = "=" if (rec.linear, rec.attention) == (whole.linear, whole.attention) else "differs from"
    return (f"measured here: the engine's forward of this model ({c.n_layers} layers, d_model {c.d_model}, {c.n_heads} "
            f"heads ({c.n_kv_heads} K/V), FFN {c.d_ffn}, fp32) on lengths {', '.join(map(str, m['seq_lens']))} "
            f"({m['machine'].name}): {m['seconds'] * 1e3:.3f} ms measured, {m['predicted'] * 1e3:.3f} ms predicted by "
            f"its roofline, a lower bound: measured = {m['seconds'] / m['predicted']:.1f} x the bound. Recorded: "
            f"{rec.total / 1e9:.2f} GFLOP of matmuls ({same} forward_flops' whole blocks, {whole.total / 1e9:.2f}: the attention "
            f"kernel was handed whole blocks; what it executes is not visible here, lesson 03) and {m['ops']} ops, "
            f"{m['floor'] * 1e3:.3f} ms at this CPU's cost per op "
            "(LayerNorm, GeLU, residuals, copies and per-op overhead are what the roofline leaves out)")


def roofline_figure(state: dict) -> Figure:
    """Log-log roofline of ``state``'s machine (ridge dotted), each packing's linear and attention points at FLOPs /
    max(roofline time, its launches at ``launch_s``): under the roof where launch latency binds; the
    measured forward (ring) beside its prediction (cross) when measured on that machine."""
    machine = state["machine"]
    name, peak, bw, ridge = machine.name, machine.peak_flops, machine.bytes_per_s, machine.ridge
    fig = Figure(figsize=(7.6, 4.2))
    ax = fig.add_subplot()
    m = state["measured"] if state["measured"] is not None and state["measured"]["machine"] == machine else None
    mx = [] if m is None else [m["causal_flops"] / m["bytes"]]      # the measured forward's intensity, when drawn
    pts = [row[p].intensity for row in state["rows"] for p in ("linear", "attention")] + mx + [ridge]
    lo, hi = min(pts) / 4, max(pts) * 4
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(xs, np.minimum(peak, xs * bw), "-", color=TEXT, linewidth=1.5, label=f"roof of {name}")
    ax.axvline(ridge, color=TEXT, linestyle=":", linewidth=1)
    ax.text(ridge * 1.1, peak * 0.02, f"ridge\n{ridge:.1f} FLOP/B", fontsize=MIN_FONT, color=TEXT, ha="left")
    ys = []
    for i, (row, mk) in enumerate(zip(state["rows"], ("o", "s", "^"))):   # one shape per packing, one colour per part
        for part, color in (("linear", LINEAR), ("attention", ATTENTION)):
            x, p, floor = row[part].intensity, row[part], row["part_floor"][part]
            ys.append(min(peak, x * bw) if p.seconds >= floor else p.flops / floor)
            ax.plot([x], [ys[-1]], mk, color=color, markersize=8,
                    label=("linear layers" if part == "linear" else "attention") if i == 0 else None)
    fig.text(0.62, 0.3, "packings (marker shapes):\n" + "\n".join(
        f"{s} {row['label'] if len(row['label']) <= 26 else row['label'][:25] + '…'}"
        for s, row in zip("●■▲", state["rows"])), fontsize=MIN_FONT, color=TEXT, va="top")
    if m is not None:
        ax.plot(mx, [m["causal_flops"] / m["predicted"]], "x", color=TEXT, markersize=9, label="engine forward: predicted")
        ax.plot(mx, [m["causal_flops"] / m["seconds"]], "o", markerfacecolor=NEVER, markeredgecolor=TEXT, markersize=9,
                label="engine forward: measured here")
    ylo, yhi = min([peak / 2e3] + [y / 2 for y in ys]), peak * 3
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(ylo, yhi))
    # fixed decade ticks, no minor ones: the explorer redraws on every knob move, automatic log ticks cost most of it
    for axis, (a, b) in ((ax.xaxis, (lo, hi)), (ax.yaxis, (ylo, yhi))):
        decades = [10.0 ** e for e in range(math.ceil(math.log10(a)), math.floor(math.log10(b)) + 1)]
        axis.set_major_locator(FixedLocator(decades))
        axis.set_major_formatter(FixedFormatter([_num(v).replace(".00", "").strip() for v in decades]))
        axis.set_minor_locator(NullLocator())
    _dress(ax, "arithmetic intensity (FLOP per byte moved)",
           "FLOP/s (points: FLOPs / max(roofline, launches))",
           size=MIN_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    c = state["cfg"]
    fig.text(0.02, 0.97, f"Roofline of {name}: d_model {c.d_model}, {c.n_heads} heads ({state['n_kv_heads']} K/V), FFN "
             f"{c.d_ffn}, {c.n_layers} layers, {state['nbytes']} B/number", fontsize=MIN_FONT + 1, color=TEXT, va="top")
    fig.subplots_adjust(left=0.11, right=0.6, bottom=0.13, top=0.9)
    return fig


D_MODELS, BYTES = (128, 256, 512, 768, 1024, 2048, 4096, 8192), ((("bf16 (2 B)"), 2), (("fp32 (4 B)"), 4))


def roofline_explorer(here: Machine | None = None, timer: Callable[[ModelConfig, Sequence[int]], dict] | None = None):
    """VBox class ``frx``: model knobs (``frx-dmodel``, ``frx-dffn``, ``frx-heads``, ``frx-kvheads``: divisors of the
    heads, ``frx-layers``, ``frx-bytes``), ``frx-machine`` (``here``, this CPU's ``Machine``, when given; the H200),
    ``frx-tokens``, ``frx-requests``, ``frx-lengths``; readouts ``frx-machine-line``, ``frx-table``, ``frx-measured``
    (with ``here``: ``timer``, default ``recorded.timed_forward``, runs the engine's forward of the knobs' model on
    the typed lengths, recorded and timed, once per model and lengths), ``frx-error``, ``frx-figure``. The dtype
    follows the machine's peak; a mismatch is flagged."""
    timer = timer or timed_forward
    w = ipywidgets_module()
    machines = {m.name: m for m in ((here, H200) if here is not None else (H200,))}
    dm = tagged(w.Dropdown(options=list(D_MODELS), value=512, description="d_model"), "frx-dmodel")
    ffn = tagged(w.BoundedIntText(value=2048, min=1, max=1 << 18, description="d_ffn"), "frx-dffn")
    heads = tagged(w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=8, description="heads"), "frx-heads")
    kvh = tagged(w.Dropdown(options=[1, 2, 4, 8], value=8, description="KV heads"), "frx-kvheads")
    layers = tagged(w.IntSlider(value=8, min=1, max=96, description="layers"), "frx-layers")
    nb = tagged(w.Dropdown(options=list(BYTES), value=BF16, description="dtype"), "frx-bytes")
    mach = tagged(w.Dropdown(options=list(machines), value=H200.name, description="machine"), "frx-machine")
    tokens = tagged(w.IntSlider(value=1000, min=100, max=16000, step=100, description="tokens T"), "frx-tokens")
    reqs = tagged(w.IntSlider(value=10, min=1, max=100, description="requests R"), "frx-requests")
    lens = tagged(w.Text(value="300, 40", description="lengths", continuous_update=False), "frx-lengths")
    mline, table = tagged(w.HTML(), "frx-machine-line"), tagged(w.HTML(), "frx-table")
    meas, err, out = tagged(w.HTML(), "frx-measured"), tagged(w.HTML(), "frx-error"), tagged(w.Output(), "frx-figure")

    @functools.cache
    def timed(cfg: ModelConfig, typed: tuple[int, ...]) -> dict | None:
        """``timer``'s forward of ``cfg`` on the ``typed`` lengths, once per model and lengths; None past the timed
        forward's bounds."""
        if sum(typed) > TIMED_MAX_TOKENS or fl.forward_flops(cfg, typed).total > TIMED_MAX_FLOPS:
            return None
        meas.value = "<div>measured here: running…</div>"
        return timer(cfg, typed)

    def update(change=None):
        if change is not None and change.get("owner") is mach:   # the dtype the machine's peak is for
            nb.unobserve(update, names="value")
            nb.value = machines[mach.value].itemsize
            nb.observe(update, names="value")
        if change is not None and change.get("owner") is heads:  # KV heads: the divisors of the heads
            opts = [k for k in range(1, heads.value + 1) if heads.value % k == 0]
            keep = kvh.value if kvh.value in opts else heads.value
            kvh.unobserve(update, names="value")
            kvh.options, kvh.value = opts, keep
            kvh.observe(update, names="value")
        machine = machines[mach.value]
        try:
            state = roofline_state(dm.value, ffn.value, heads.value, kvh.value, layers.value, nb.value, machine,
                                   tokens.value, reqs.value, lens.value)
        except ValueError as exc:
            err.value = f"<div style='color:{WASTE}'>{exc}</div>"
            return
        err.value = ""
        forward = None if here is None else timed(state["cfg"], tuple(state["rows"][-1]["seq_lens"]))
        if forward is not None:                  # the typed lengths' forward, timed here: roofline_state's ``here``
            state["measured"] = beside_roofline(forward, here)
        warn = "" if nb.value == machine.itemsize else (
            f"<div style='color:{WASTE}'>this machine's peak is for {str(machine.dtype).removeprefix('torch.')}: "
            f"the bytes use {nb.value} B per number, so the ridge comparison mixes dtypes</div>")
        mline.value = f"<div>{machine_line(state)}</div>" + warn
        table.value = "".join(f"<div>{line}</div>" for line in roofline_lines(state))
        if state["measured"] is None and here is not None:
            meas.value = (f"<div>measured here: not timed (the forward timed here takes at most {TIMED_MAX_TOKENS} "
                          f"tokens and {TIMED_MAX_FLOPS / 1e9:g} GFLOP; type fewer tokens or make the model smaller)</div>")
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

_CFG_6 = ModelConfig(n_layers=3, d_model=384, n_heads=6, d_head=64, d_ffn=1536)   # 6 heads: K/V groups of 1, 2, 3, 6
_GQA_CASES = tuple((ModelConfig(), lens, H200.ridge) for lens in ([1000], [700], [500], [300], [100] * 10)) + (
    (_CFG_6, [600, 16, 16], H200.ridge), (ModelConfig(), [100] * 10, 30.0))


def check_gqa(fn: Callable[[ModelConfig, list, float], int | None]) -> bool:
    """Exercise 05.1: ``fn(cfg, seq_lens, ridge) -> n_kv_heads or None``, ``measure.flops.gqa_heads_for_ridge``'s
    answer: the largest K/V head count (a divisor of ``cfg.n_heads``) whose causal prefill attention reaches ``ridge``."""
    def judge(got, cfg, lens, ridge):
        want = fl.gqa_heads_for_ridge(cfg, lens, ridge)
        if got == want and (got is None or isinstance(got, int)):
            return None
        h, ai = cfg.n_heads, lambda kv: fl.prefill_attention_intensity(cfg, lens, kv)
        if got is not None and (isinstance(got, bool) or not isinstance(got, int) or not 1 <= got <= h or h % got):
            return f"expected None or a divisor of n_heads = {h} (each K/V head serves a whole group), got {got!r}"
        if got is None:
            return (f"got None, expected {want} - with {want} K/V heads attention reaches {ai(want):.0f} FLOP/byte, at or "
                    f"above the ridge {ridge:g}")
        by_group = max((kv for kv in range(1, h + 1) if h % kv == 0 and ai(h) * h / kv >= ridge), default=None)
        trap = (f" - grouping divides only the K and V bytes, not by the group factor: Q and O keep all {h} heads, "
                f"so one K/V head raises the intensity at most {fl.gqa_intensity_ceiling(cfg):.2f}x ({ai(h):.0f} -> "
                f"{ai(1):.0f} FLOP/byte here); x group is decode's factor, where the cache is read for one query"
                ) if got == by_group and by_group != want else ""
        if want is None:
            return (f"got {got}, expected None - with {got} K/V heads attention reaches {ai(got):.0f} FLOP/byte, below "
                    f"the ridge {ridge:g}, and even one K/V head only {ai(1):.0f}: no grouping is enough; only longer "
                    f"requests can get there{trap}")
        if ai(got) < ridge:
            return (f"got {got}, expected {want} - with {got} K/V heads attention reaches {ai(got):.0f} FLOP/byte "
                    f"< ridge {ridge:g}{trap}")
        return (f"got {got}, expected {want} - compute-bound ({ai(got):.0f} FLOP/byte), but {want} K/V heads already reach "
                f"the ridge ({ai(want):.0f}): every extra head shared gives away quality for nothing"
                + (" - here no grouping at all is needed" if want == h else ""))
    return grade("gqa", fn, list(_GQA_CASES), judge,
                 "7 cases: one already compute-bound, some carried over by grouping, two that no grouping can rescue")


PACK_MIN_LEN = 16                               # a chat turn: every request of the packing has at least this
_PACK_CASES = ((4096, 8), (4096, 1), (2048, 2), (8192, 8), (512, 8))


def check_packing(fn: Callable[[int, int], Sequence[int] | None]) -> bool:
    """Exercise 05.2: ``fn(total, n_kv_heads) -> lengths or None``: exactly ``total`` tokens, every request >=
    ``PACK_MIN_LEN``, causal attention compute-bound on the H200 (bf16, the article's model), with at least 90 %
    as many requests as the most any such packing has; None when no packing is compute-bound."""
    ridge = H200.ridge

    def judge(got, total, kv):
        most = fl.most_compute_bound_requests(ModelConfig(), total, kv, ridge, PACK_MIN_LEN)
        one = fl.prefill_attention_intensity(ModelConfig(), [total], kv)
        if most is None:
            return None if got is None else (f"got {got!r}, expected None - even one request of all {total} tokens reaches "
                                             f"only {one:.0f} FLOP/byte, below the H200's ridge {ridge:.0f}: no packing of "
                                             f"{total} tokens is compute-bound")
        if got is None:
            return (f"got None, expected a packing - one request of {total} tokens reaches {one:.0f} FLOP/byte, "
                    f"above the ridge {ridge:.0f}")
        if isinstance(got, (str, bytes)) or not isinstance(got, Sequence) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in got):
            return f"expected a list of int lengths (or None), got {got!r}"
        if sum(got) != total or not got or min(got) < PACK_MIN_LEN:
            return (f"got {len(got)} requests summing to {sum(got)}, shortest {min(got) if got else None} - the packing "
                    f"must hold exactly {total} tokens, every request at least {PACK_MIN_LEN}")
        x = fl.prefill_attention_intensity(ModelConfig(), got, kv)
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


_KV_CASES = tuple((ModelConfig(), H200.ridge, 2, n) for n in (128, 1000, 8, 1)) + (
    (ModelConfig(), 9.0, 4, 128), (ModelConfig(), 9.0, 4, 1024),
    (ModelConfig(n_layers=2, d_model=256, n_heads=4, d_head=32, d_ffn=1024), H200.ridge, 2, 64))


def check_kv_overtakes(fn: Callable[[ModelConfig, float, int, int], int | None]) -> bool:
    """Exercise 05.3: ``fn(cfg, ridge, nbytes, kv_len) -> int or None``, ``measure.flops.decode_kv_overtakes_from``'s. Cases:
    the H200 with short and long caches, a CPU-like ridge of 9 in fp32, another model; in two of them the
    linear layers turn compute-bound before the KV read catches up, and a bytes-only comparison gives a number."""
    def judge(got, cfg, ridge, nbytes, kv_len):
        want = fl.decode_kv_overtakes_from(cfg, ridge, nbytes, kv_len)
        if got == want and (got is None or (isinstance(got, int) and not isinstance(got, bool))):
            return None
        if got is not None and (isinstance(got, bool) or not isinstance(got, int) or got < 1):
            return f"expected a positive int (or None), got {got!r}"
        p = fl.decode_step_parts(cfg, want or got, kv_len, Machine("ridge", ridge, 1.0), nbytes)  # time in byte-times
        if want is None:
            why = (f" - at R = {got} the linear layers are compute-bound (from R = "
                   f"{fl.min_decode_batch(cfg, ridge, nbytes)}): their time is their FLOPs at peak, 2 R W, and grows "
                   f"with R exactly as fast as the KV read, which stays shorter ({p.attention.seconds:.4g} "
                   f"against {p.linear.seconds:.4g} byte-times)") if p.linear.bound == "compute-bound" else ""
            return f"got {got}, expected None{why}"
        if got is None:
            return (f"got None, expected {want} - at R = {want} attention takes {p.attention.seconds:.4g} "
                    f"byte-times, the linear layers {p.linear.seconds:.4g}")
        if abs(got - want) == 1:
            return f"got {got}, expected {want} - off by one: the smallest R at which attention takes longer"
        return f"got {got}, expected {want}"
    return grade("kv_overtakes", fn, list(_KV_CASES), judge,
                 "7 cases: the H200 and a CPU-like ridge, short and long caches, another model")
