"""What lesson 04 (TP=2 does not care how the tokens are packed) draws, explores and checks.

Figure ``04_trace_timeline``: one TP=2 forward per rank, all-reduces in purple, the same for
1, 2 and 40 requests. Explorer ``tp_packing_explorer`` wraps ``tp_packing_state``: pack T
tokens as R requests and watch the trace stay while attention's inputs change.
Helpers the notebook calls: ``rank_layers`` (what each rank's four linear layers compute),
``layer0_attention`` (one layer's attention output on a rank), ``tp_ranks_in_threads`` (a real
TP group inside one process, for the exercise). Exercise checkers: ``check_trace_prediction``
(04.1), ``check_row_parallel`` (04.2).

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..core.batch import PackedBatch, cumulative, pack
from ..core.config import ModelConfig
from ..core.groups import LocalGroup, record
from ..core.linear import RowParallelLinear
from ..core.model import Transformer, init_weights
from ..measure.flops import attention_cells
from ..tp.dryrun import record_trace, trace_signature
from ..tp.trace import summarize_trace
from ..validate import check_choice, check_int, check_lengths
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import grade
from .style import ATTENTION, COMM, LINEAR, MIN_FONT, NEVER, OTHER, TEXT, draw_strip, request_color, request_name

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------
# What each rank computes, layer by layer

_LINEARS = (("QKV", "attn.qkv", "column"), ("out proj", "attn.out_proj", "row"),
            ("FFN-up", "mlp.fc_up", "column"), ("FFN-down", "mlp.fc_down", "row"))


@dataclass(frozen=True)
class RankLayer:
    """One linear layer on one rank: input and output shape, the products summed into each
    output number (the rank's input width), and whether an all-reduce follows it."""

    name: str
    split: str          # "column" (keeps some output features) or "row" (a partial sum of all of them)
    x: tuple
    y: tuple
    products: int
    all_reduce: bool

    def __str__(self) -> str:
        after = ", then all-reduce (partial sum)" if self.all_reduce else ", no collective"
        return (f"{self.name:9s} {self.split:6s} [{self.x[0]}, {self.x[1]}] -> [{self.y[0]}, {self.y[1]}]: "
                f"{self.products} products per output number{after}")


class _Stop(Exception):
    """Raised by a hook once it has what it needs: the rest of the forward is not run."""


def _one_layer(cfg: ModelConfig) -> ModelConfig:
    fields = {f: getattr(cfg, f) for f in cfg.__slots__}
    return ModelConfig(**(fields | {"n_layers": 1, "vocab_size": 1, "max_position": 1, "tp_size": 1}))


def rank_layers(cfg: ModelConfig, num_tokens: int, rank: int = 0, world_size: int = 2) -> list[RankLayer]:
    """Layer 0's four linear layers on rank ``rank`` of ``world_size``, MEASURED: forward hooks on the
    model's own modules (cut by ``LocalGroup(rank, world_size)``, the same cut a real rank makes)
    record each input and output shape, and the trace says which layers all-reduce.

    Article's model, TP=2, T tokens: QKV [T,512]->[T,768]; out proj [T,256]->[T,512] partial;
    FFN-up [T,512]->[T,1024]; FFN-down [T,1024]->[T,512] partial.
    """
    t = check_int("num_tokens", num_tokens, 1)
    small = _one_layer(cfg)
    group = LocalGroup(rank, world_size)
    model = Transformer(small, init_weights(small), group=group, attn_backend="masked")
    block, seen = model.layers[0], {}

    def hook(name):
        def remember(_module, inp, out) -> None:  # returns None: the output is left as it is
            seen[name] = (tuple(inp[0].shape), tuple(out.shape))
        return remember
    handles = [block.get_submodule(path).register_forward_hook(hook(name)) for name, path, _ in _LINEARS]
    try:
        model(pack([torch.zeros(t, cfg.d_model, dtype=cfg.dtype)]))
    finally:
        for h in handles:
            h.remove()
    reduced = {r.layer for r in group.trace}
    return [RankLayer(name, split, *seen[name], seen[name][0][1], f"layers.0.{path}" in reduced)
            for name, path, split in _LINEARS]


def layer0_attention(model: Transformer, batch: PackedBatch) -> Tensor:
    """Layer 0's attention output on this model's rank, ``[T, H_local, D]``: what out proj receives.

    Layer 0's input is the embedding, replicated, so a ``LocalGroup(rank, 2)`` stand-in computes
    exactly what a real rank does there (later layers would need the other rank's partial sums).
    """
    got = {}

    def grab(_m, inp):
        got["o"] = inp[0]
        raise _Stop

    handle = model.layers[0].attn.out_proj.register_forward_pre_hook(grab)
    try:
        model(batch)
    except _Stop:
        pass
    finally:
        handle.remove()
    qkv = model.layers[0].attn.qkv
    return got["o"].view(got["o"].shape[0], qkv.n_local_heads, qkv.d_head)   # [T, H_local, D]


# ---------------------------------------------------------------------------------------------
# The figure: one forward on two ranks

def _box(ax, x, y, w, h, color, text="", text_color="white", gid=None, fontsize=MIN_FONT):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white", linewidth=1, gid=gid))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def tp_trace_timeline(traces: Sequence[Sequence], packings: Sequence[Sequence[int]], cfg: ModelConfig | None = None
                      ) -> Figure:
    """Claims C11, C12: one TP forward, one row per rank, from the ranks' collective traces.

    ``traces[r]``: rank r's ``CollectiveRecord`` list (a real ``TPResult.traces`` or a dry run
    per rank); every rank must have the same trace (else real ranks would wait forever). Layer
    0 is drawn in detail (green linear layers with each rank's shapes, blue attention on the
    rank's own heads), the other layers compactly; every all-reduce is one purple bar across all
    ranks (gid ``allreduce-k``), numbered; the replicated embedding and final LayerNorm + LM head
    are grey. ``packings``: request lengths that all produced this trace, drawn underneath.
    """
    cfg = cfg or ModelConfig()
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
    n_ranks, first = len(traces), traces[0][0]
    t, d, hl, dh = first.shape[0], cfg.d_model, cfg.n_heads // n_ranks, cfg.d_head
    fl = cfg.d_ffn // n_ranks
    row_h, gap = 1.0, 0.3
    top = n_ranks * (row_h + gap)
    fig = Figure(figsize=(14, 2.5 + 1.0 * n_ranks + 0.42 * len(packs)))
    ax = fig.add_axes((0.075, 0.01, 0.92, 0.97))
    ax.axis("off")
    # (label on rank 0, shapes above rank 0, colour, width); "AR" = an all-reduce
    detail = [("QKV", f"[T,{d}]\n→[T,{3 * hl * dh}]", LINEAR, 1.45),
              ("attention", f"[T,{hl},{dh}]\nby cu_seqlens", ATTENTION, 1.55),
              ("out proj", f"[T,{hl * dh}]\n→[T,{d}]\npartial", LINEAR, 1.45), ("AR", "", COMM, 0.32),
              ("FFN-up", f"[T,{d}]\n→[T,{fl}]", LINEAR, 1.45), ("FFN-down", f"[T,{fl}]\n→[T,{d}]\npartial", LINEAR, 1.45),
              ("AR", "", COMM, 0.32)]
    compact = [("", "", LINEAR, 0.16), ("", "", ATTENTION, 0.2), ("", "", LINEAR, 0.16), ("AR", "", COMM, 0.2),
               ("", "", LINEAR, 0.32), ("AR", "", COMM, 0.2)]

    def rank_y(r):
        return (n_ranks - 1 - r) * (row_h + gap) + gap / 2

    def replicated(x, text):
        for r in range(n_ranks):
            _box(ax, x, rank_y(r), 0.55, row_h, OTHER, text, text_color=TEXT)
        return x + 0.6

    x = replicated(0.0, "emb")
    k = 0
    for layer in range((len(traces[0]) + 1) // 2):
        x0 = x
        for label, shapes, color, w in (detail if layer == 0 else compact):
            if label == "AR":
                _box(ax, x, 0.05, w, top - 0.1, COMM, gid=f"allreduce-{k}")
                ax.text(x + w / 2, top + 0.05 + (0.45 if layer == 0 else 0), str(k + 1), ha="center", va="bottom",
                        fontsize=MIN_FONT, color=TEXT)
                k += 1
            else:
                for r in range(n_ranks):
                    text = label if r == 0 else (f"heads {r * hl}-{(r + 1) * hl - 1}" if color == ATTENTION and label else "")
                    if r == 0 and color == ATTENTION and label:
                        text = f"attention\nheads 0-{hl - 1}"
                    _box(ax, x, rank_y(r), w, row_h, color, text, gid=f"local-{r}-{layer}")
                if shapes:
                    ax.text(x + w / 2, top + 0.05, shapes, ha="center", va="bottom", fontsize=MIN_FONT, color=TEXT)
            x += w + 0.04
        ax.text((x0 + x) / 2, -0.08, f"layer {layer}", ha="center", va="top", fontsize=MIN_FONT, color=TEXT)
        x += 0.1
    x = replicated(x, "LN\nLM")
    for r in range(n_ranks):
        ax.text(-0.12, rank_y(r) + row_h / 2, f"rank {r}", ha="right", va="center", fontsize=MIN_FONT + 1, color=TEXT)
    shape = f"[{', '.join(map(str, first.shape))}]"
    ax.text(-1.3, top + 0.95,
            f"One forward at TP={n_ranks}: {len(sig)} all-reduces (purple, numbered), each of {shape} {first.dtype}, "
            f"{first.bytes:,} B per rank.\nGreen: linear layers (shapes per rank above); blue: attention on the rank's own "
            f"heads, no collective; grey: embedding, final LayerNorm and LM head, replicated.",
            fontsize=MIN_FONT + 1, color=TEXT, va="bottom")
    # The packings that all produced exactly this trace, as token strips.
    width = 8.0
    for i, lens in enumerate(packs):
        y = -0.75 - 0.48 * i
        scale = width / sum(lens)
        ax.text(-0.12, y + 0.17, _packing_label(lens), ha="right", va="center", fontsize=MIN_FONT, color=TEXT)
        cu = cumulative(lens)
        for j, n in enumerate(lens):
            ax.add_patch(Rectangle((cu[j] * scale, y), n * scale, 0.34, facecolor=request_color(j),
                                   edgecolor="white", linewidth=0.4))
        ax.text(width + 0.2, y + 0.17, f"cu_seqlens = {short_cu(cu)}", va="center", fontsize=MIN_FONT, color=TEXT)
    ax.text(width + 5.2, -0.75 - 0.24 * (len(packs) - 1) + 0.17,
            f"These {len(packs)} packings of the same {t} tokens\ngive exactly this trace, record for record,\n"
            f"on every rank (tp.dryrun.record_trace).", va="center", fontsize=MIN_FONT + 1, color=TEXT)
    ax.set_xlim(-1.3, x + 0.1)
    ax.set_ylim(-0.75 - 0.48 * len(packs), top + 1.75)
    return fig


def _packing_label(lens: list[int]) -> str:
    if len(set(lens)) == 1:
        return f"{len(lens)} x {lens[0]}"
    if len(lens) <= 3:
        return " + ".join(f"{request_name(i)}={n}" for i, n in enumerate(lens))
    return f"{len(lens)} requests"


def short_cu(cu: list[int]) -> str:
    return str(cu) if len(cu) <= 6 else f"[{cu[0]}, {cu[1]}, {cu[2]}, ..., {cu[-1]}] ({len(cu) - 1} requests)"


TP_PACKINGS = ([40], ARTICLE_LENS, [1] * 40)  # the same 40 tokens as 1, 2 and 40 requests


@register("04_trace_timeline", lesson="04",
          caption="one TP=2 forward per rank: 16 all-reduces of [40 x 512] (purple), attention local to each "
                  "rank's heads; identical for 1, 2 and 40 requests (C11, C12)")
def _trace_timeline() -> Figure:
    cfg = ModelConfig()
    runs = [[record_trace(cfg, lens, rank, cfg.tp_size) for rank in range(cfg.tp_size)] for lens in TP_PACKINGS]
    first = trace_signature(runs[0][0])
    if any(trace_signature(t) != first for traces in runs for t in traces):
        raise RuntimeError("the dry-run traces differ between packings or ranks: C12 would not hold")
    return tp_trace_timeline(runs[1], TP_PACKINGS, cfg)


# ---------------------------------------------------------------------------------------------
# The explorer: the same tokens packed differently

PATTERNS = ("equal", "ramp", "one long")
TILE = 128  # query rows per thread block in a FlashAttention-style kernel (for the grid size shown)


def packing_lens(total_tokens: int, num_requests: int, pattern: str = "equal") -> list[int]:
    """``total_tokens`` split into ``num_requests`` requests (each >= 1 token, summing to T).

    "equal": as equal as possible, longer first (40, 3 → [14, 13, 13]); "ramp": request i
    proportional to i+1 (40, 2 → [13, 27]); "one long": the first request takes half the tokens,
    the rest share the other half.
    """
    t = check_int("total_tokens", total_tokens, 1, 1 << 20)
    r = check_int("num_requests", num_requests, 1, t)
    check_choice("pattern", pattern, PATTERNS)
    if pattern == "equal" or r == 1:
        return [t // r + (1 if i < t % r else 0) for i in range(r)]
    if pattern == "one long":
        long = max(1, min(t - (r - 1), t // 2))
        return [long] + packing_lens(t - long, r - 1, "equal")
    spare = t - r                                          # every request has 1 token; share the rest by weight i+1
    weights = range(1, r + 1)
    lens = [1 + spare * w // sum(weights) for w in weights]
    for i in range(t - sum(lens)):                         # rounding leftovers to the longest requests
        lens[r - 1 - i % r] += 1
    return lens


def tp_packing_state(total_tokens: int = 40, num_requests: int = 2, pattern: str = "equal",
                     cfg: ModelConfig | None = None) -> dict:
    """The same T tokens packed as R requests, on every TP rank.

    Traces are dry runs of the model's own code (``tp.dryrun.record_trace``), compared with the
    dry run of the same tokens as ONE request. Keys: ``seq_lens``, ``cu_seqlens``, ``positions``
    (restarting per request), ``max_seqlen``, ``grid`` (R x ceil(max_seqlen / TILE) blocks of a
    FlashAttention-style launch), ``traces`` (per rank), ``trace_text`` (``summarize_trace``
    per rank), ``same_as_one_request`` (per rank), ``heads`` (per rank: first, last head),
    ``cells`` (score cells per head per layer, whole blocks: sum L_i^2), ``cells_per_rank``
    (x heads per rank x layers: what each rank's attention computes, locally).
    """
    cfg = cfg or ModelConfig()
    lens = packing_lens(total_tokens, num_requests, pattern)
    tp = cfg.tp_size
    traces = [record_trace(cfg, lens, r, tp) for r in range(tp)]
    ones = [_one_request_signature(cfg, sum(lens), r) for r in range(tp)]
    cells = attention_cells(lens, "varlen").computed
    hl = cfg.heads_per_rank
    return {"seq_lens": lens, "cu_seqlens": cumulative(lens), "positions": pack([[0] * n for n in lens]).positions.tolist(),
            "max_seqlen": max(lens), "grid": len(lens) * math.ceil(max(lens) / TILE), "traces": traces,
            "trace_text": [summarize_trace(t) for t in traces],
            "same_as_one_request": [trace_signature(t) == s for t, s in zip(traces, ones)],
            "heads": [(r * hl, (r + 1) * hl - 1) for r in range(tp)], "cells": cells,
            "cells_per_rank": cells * hl * cfg.n_layers}


_ONE_REQUEST: dict = {}


def _one_request_signature(cfg: ModelConfig, total: int, rank: int) -> list:
    key = (repr(cfg), total, rank)
    if key not in _ONE_REQUEST:  # the reference does not change while the requests slider moves
        _ONE_REQUEST[key] = trace_signature(record_trace(cfg, [total], rank, cfg.tp_size))
    return _ONE_REQUEST[key]


def _positions_text(lens: list[int]) -> str:
    shown = [f"0..{n - 1}" if n > 1 else "0" for n in lens[:8]]
    return ", ".join(shown) + (f", ... ({len(lens)} runs)" if len(lens) > 8 else "")


def tp_trace_html(state: dict) -> str:
    """What TP sees: one line per rank, then whether it equals one request's trace.

    ``rank 0: 16 × all_reduce [40, 512] float32, 81,920 B each`` ... ``same as 1 request of 40
    tokens: yes``."""
    lines = [f"<div>rank {r}: {text}</div>" for r, text in enumerate(state["trace_text"])]
    same = "yes" if all(state["same_as_one_request"]) else "no"
    return "".join(lines) + f"<div>same as 1 request of {sum(state['seq_lens'])} tokens: {same}</div>"


def tp_attention_html(state: dict) -> str:
    """What attention sees: ``R = 3 | cu_seqlens [0, 14, 27, 40] | positions 0..13, 0..12, 0..12 |
    max_seqlen 14 | grid 3 blocks`` then, per rank, its heads and score cells."""
    cu = state["cu_seqlens"]
    head = (f"<div>R = {len(state['seq_lens'])} | cu_seqlens {short_cu(cu)} | positions "
            f"{_positions_text(state['seq_lens'])} | max_seqlen {state['max_seqlen']} | grid {state['grid']} blocks</div>")
    ranks = "".join(f"<div>rank {r}: heads {a}-{b}, sum L_i^2 = {state['cells']} cells per head per layer, "
                    f"{state['cells_per_rank']} per forward, no collective</div>" for r, (a, b) in enumerate(state["heads"]))
    return head + ranks


def tp_packing_figure(state: dict) -> Figure:
    """Top: the all-reduces of one forward (purple, the same for every packing). Middle: the flat
    tokens coloured by request, positions written under them. Bottom: each rank's score cells
    (whole blocks: blue computed, white never), on its own heads."""
    lens, tp = state["seq_lens"], len(state["traces"])
    t, n_ar = sum(lens), len(state["traces"][0])
    fig = Figure(figsize=(8.4, 5.0))
    gs = fig.add_gridspec(3, tp, height_ratios=(0.55, 0.7, 2.4), hspace=0.75, left=0.04, right=0.98, top=0.93, bottom=0.03)
    ax = fig.add_subplot(gs[0, :])
    ax.axis("off")
    for k in range(n_ar):
        ax.add_patch(Rectangle((k, 0), 0.85, 1, facecolor=COMM, edgecolor="white"))
        ax.text(k + 0.42, 0.5, str(k + 1), ha="center", va="center", fontsize=MIN_FONT, color="white")
    ax.set_xlim(0, max(n_ar, 1))
    ax.set_ylim(0, 1)
    rec = state["traces"][0][0]
    ax.set_title(f"what TP sees: {n_ar} all-reduces of [{rec.shape[0]}, {rec.shape[1]}] on each rank "
                 f"(1 request of {t} tokens: the same)", fontsize=MIN_FONT + 1)
    ax = fig.add_subplot(gs[1, :])
    draw_strip(ax, lens, label_requests=t <= 80)
    if t <= 48:
        for i, p in enumerate(state["positions"]):
            ax.text(i + 0.5, -0.35, str(p), ha="center", va="center", fontsize=MIN_FONT, color=TEXT)
    ax.set_xlim(0, t)
    ax.set_ylim(-0.7, 1)
    ax.axis("off")
    ax.set_title(f"what attention sees: cu_seqlens = {short_cu(state['cu_seqlens'])}, positions restart per request",
                 fontsize=MIN_FONT + 1)
    for r in range(tp):
        ax = fig.add_subplot(gs[2, r])
        ax.add_patch(Rectangle((0, 0), t, t, facecolor=NEVER, edgecolor=OTHER, linewidth=0.8))
        for s, n in zip(state["cu_seqlens"][:-1], lens):
            ax.add_patch(Rectangle((s, t - s - n), n, n, facecolor=ATTENTION, edgecolor="white", linewidth=0.3))
        ax.set_xlim(0, t)
        ax.set_ylim(0, t)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        a, b = state["heads"][r]
        ax.set_title(f"rank {r}, heads {a}-{b}: {state['cells']:,} cells\nper head per layer (whole blocks)",
                     fontsize=MIN_FONT + 1)
    return fig


def tp_packing_explorer(total_tokens: int = 40, num_requests: int = 2, pattern: str = "equal"):
    """VBox class ``tpx``: IntSliders ``tpx-tokens`` (T, 1..96) and ``tpx-num-requests`` (R, 1..T),
    Dropdown ``tpx-pattern``; HTML ``tpx-trace`` (``tp_trace_html``: stays while R and the pattern
    move), HTML ``tpx-attention`` (``tp_attention_html``: changes), Output ``tpx-figure``."""
    w = ipywidgets_module()
    total = tagged(w.IntSlider(value=total_tokens, min=1, max=96, description="tokens T"), "tpx-tokens")
    reqs = tagged(w.IntSlider(value=min(num_requests, total_tokens), min=1, max=total_tokens, description="requests R"),
                  "tpx-num-requests")
    pat = tagged(w.Dropdown(options=list(PATTERNS), value=pattern, description="lengths"), "tpx-pattern")
    trace, attn, out = tagged(w.HTML(), "tpx-trace"), tagged(w.HTML(), "tpx-attention"), tagged(w.Output(), "tpx-figure")

    def update(change=None):
        reqs.max = total.value  # R <= T: every request needs a token (clamps reqs.value too)
        state = tp_packing_state(total.value, reqs.value, pat.value)
        trace.value, attn.value = tp_trace_html(state), tp_attention_html(state)
        show_figure(out, tp_packing_figure(state))

    return explorer("tpx", [total, reqs, pat], [trace, attn, out], update)


# ---------------------------------------------------------------------------------------------
# Exercise 04.1: predict the trace

_CFG_B = ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=77, max_position=64)
_CFG_C = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=512, vocab_size=77, max_position=64)


def _trace_pairs(got) -> list | None:
    try:
        return [(str(name), tuple(int(s) for s in shape)) for name, shape in got]
    except (TypeError, ValueError):
        return None


def check_trace_prediction(fn: Callable[[ModelConfig, list], list]) -> bool:
    """Exercise 04.1: ``fn(cfg, seq_lens) -> [(layer, shape), ...]``, the all-reduces rank 0 makes in
    one TP=2 forward of a flat batch of ``seq_lens`` (C12), in order, e.g.
    ``("layers.0.attn.out_proj", (40, 512))``. The first case is 40 one-token requests on the
    article's model; the others change the packing, the layer count, the widths."""
    cases = [(ModelConfig(), [1] * 40), (ModelConfig(), [10, 30]), (_CFG_B, [3, 1, 5]), (_CFG_C, [9]),
             (_CFG_C, [2] * 6)]

    def judge(got, cfg, lens):
        want = [(r.layer, tuple(r.shape)) for r in record_trace(cfg, lens, 0, 2)]
        pairs = _trace_pairs(got)
        if pairs is None:
            return f"expected a list of (layer name, shape) pairs, got {got!r}"[:300]
        if pairs == want:
            return None
        t, d = sum(lens), cfg.d_model
        n = len(pairs)
        if n == cfg.n_layers:
            return f"got {n} all-reduces, expected {len(want)} - two per layer: attn.out_proj, then mlp.fc_down"
        if n == len(want) * len(lens) and len(lens) > 1:
            return (f"got {n} all-reduces, expected {len(want)} - TP does not loop over requests: one all-reduce "
                    f"carries every flat token of the batch")
        if n in (len(want) + 1, len(want) + 2):
            return (f"got {n} all-reduces, expected {len(want)} - the embedding, the final LayerNorm and the LM head "
                    f"are replicated on every rank here: no collective")
        if n != len(want):
            return f"got {n} all-reduces, expected {len(want)}"
        shapes = {s for _, s in pairs}
        hints = {(max(lens), d): f"the payload is every flat token: T = sum(seq_lens) = {t} rows, not the longest request",
                 (t, d // 2): "each rank's PARTIAL sum has all d_model columns; the all-reduce adds the two partials",
                 (t, cfg.d_ffn // 2): "FFN-down turns the rank's [T, d_ffn/2] hidden into a partial [T, d_model]; "
                                      "the hidden never leaves the rank",
                 (t, cfg.d_ffn): "FFN-down's output has d_model columns, whatever d_ffn is"}
        for shape, hint in hints.items():
            if shape in shapes and shape != (t, d):
                return f"shape {shape}, expected {(t, d)} - {hint}"
        if shapes != {(t, d)}:
            return f"shapes {sorted(shapes)}, expected {(t, d)} - the row-parallel layers' output, [T, d_model]"
        first = next(i for i, (a, b) in enumerate(zip(pairs, want)) if a != b)
        return (f"record {first} is {pairs[first]}, expected {want[first]} - forward order: layers.0.attn.out_proj, "
                f"layers.0.mlp.fc_down, layers.1.attn.out_proj, ...")
    return grade("trace_prediction", fn, cases, judge, "rank 0's real trace for 40 x 1, A+B, and three other models")


# ---------------------------------------------------------------------------------------------
# Exercise 04.2: a row-parallel layer, on real ranks (threads of this process)

@dataclass
class ThreadRank:
    """Rank ``rank`` of a TP group whose ranks are threads of this process: ``all_reduce`` really
    sums over the ranks (every rank waits for the others, as over NCCL or gloo) and records."""

    rank: int
    world_size: int
    _shared: dict = field(repr=False)
    trace: list = field(default_factory=list)

    def all_reduce(self, tensor: Tensor, *, layer: str = "") -> Tensor:
        s = self._shared
        s["slots"][self.rank] = tensor
        s["barrier"].wait()
        total = torch.stack(s["slots"]).sum(0)
        s["barrier"].wait()                      # nobody overwrites a slot before every rank has summed
        self.trace.append(record(total, layer, self.rank, self.world_size))
        tensor.copy_(total)
        return tensor


def tp_ranks_in_threads(world_size: int, fn: Callable[[ThreadRank], object], timeout: float = 20.0) -> list:
    """Run ``fn(rank_group)`` on ``world_size`` threads that form one TP group; results in rank order.

    If a rank raises, the others are released (the barrier is broken) and the first error is
    re-raised here, so a wrong answer never hangs the notebook.
    """
    ws = check_int("world_size", world_size, 1, 16)
    shared = {"slots": [None] * ws, "barrier": threading.Barrier(ws, timeout=timeout)}
    groups = [ThreadRank(r, ws, shared) for r in range(ws)]
    results, errors = [None] * ws, [None] * ws

    def run(r):
        try:
            results[r] = fn(groups[r])
        except BaseException as exc:  # handed back to the caller below
            errors[r] = exc
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ws)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 5)
    failed = [e for e in errors if e is not None]
    if failed:  # the root cause first: the other ranks only saw the broken barrier
        raise next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)), failed[0])
    return [(res, g.trace) for res, g in zip(results, groups)]


def _row_cases():
    g = torch.Generator().manual_seed(4)
    cases = []
    for t, d_in, d_out, tp, bias in ((5, 8, 6, 2, True), (40, 16, 12, 2, True), (3, 12, 4, 4, True),
                                      (7, 8, 6, 1, True), (4, 8, 6, 2, False)):
        x = torch.randn(t, d_in, generator=g, dtype=torch.float64)
        w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
        b = torch.randn(d_out, generator=g, dtype=torch.float64) if bias else None
        cases.append((x, w, b, tp))
    return cases


def check_row_parallel(fn: Callable) -> bool:
    """Exercise 04.2: ``fn(x_local, weight_local, bias, group) -> [T, d_out]``, one row-parallel layer on
    one rank: ``x_local [T, d_in/tp]`` and ``weight_local [d_out, d_in/tp]`` are this rank's slices,
    ``bias [d_out]`` (or None) is whole on every rank, ``group`` has ``rank``, ``world_size`` and
    ``all_reduce(tensor, layer=...)``. Run on 1, 2 and 4 ranks (threads that really sum) and
    compared with ``x @ weight.T + bias``; last, plugged into the model (TP=2 on two threads) in
    place of ``RowParallelLinear.forward`` and compared with TP=1 by the tolerance rule."""
    def run(*case):
        if case[0] == "model":
            return _plugged_model(fn, case[1])
        x, w, b, tp = case
        n = x.shape[1] // tp

        def per_rank(group):
            sl = slice(group.rank * n, (group.rank + 1) * n)
            return fn(x[:, sl].clone(), w[:, sl].clone(), None if b is None else b.clone(), group)
        return tp_ranks_in_threads(tp, per_rank)

    def judge(outs, *case):
        if case[0] == "model":
            err, bound, err1 = outs
            return None if err <= bound else (
                f"the model at TP=2 with your layer is {err:.3g} from the float64 answer; TP=1 is {err1:.3g} "
                f"(allowed: {bound:.3g}, twice TP=1's error plus rounding)")
        return _row_problem(outs, *case)

    cases = _row_cases() + [("model", _CFG_C)]
    return grade("row_parallel", fn=run, cases=cases, judge=judge,
                 done="1, 2 and 4 ranks, with and without a bias, and inside the model at TP=2")


def _row_problem(outs, x, w, b, tp) -> str | None:
    n = x.shape[1] // tp
    want = x @ w.T + (b if b is not None else 0)
    got = [o for o, _ in outs]
    if not all(isinstance(o, Tensor) and tuple(o.shape) == tuple(want.shape) for o in got):
        shapes = [tuple(o.shape) if isinstance(o, Tensor) else type(o).__name__ for o in got]
        return f"expected a tensor of shape {list(want.shape)} on every rank, got {shapes}"
    reduces = [len(tr) for _, tr in outs]
    if tp > 1 and any(c != 1 for c in reduces):
        return (f"all-reduces per rank {reduces}, expected 1 each: one all-reduce sums the partial outputs "
                f"{list(want.shape)}" + ("; you never called group.all_reduce" if max(reduces) == 0 else ""))
    if tp > 1 and any(tr[0].shape != tuple(want.shape) for _, tr in outs):
        return f"the all-reduce carried {list(outs[0][1][0].shape)}, expected {list(want.shape)}: the partial output"
    bad = [r for r, o in enumerate(got) if not torch.allclose(o.double(), want, atol=1e-9)]
    if not bad:
        return None
    o = got[bad[0]].double()
    if b is not None and torch.allclose(o, want + (tp - 1) * b, atol=1e-9):
        return (f"every row is off by (tp - 1) x bias = {tp - 1} x b: the bias was added on every rank BEFORE the "
                f"all-reduce, so the sum carries it {tp} times. The trace is the same as a correct layer's "
                f"(one all-reduce of {list(want.shape)}): only the values show this bug")
    if b is not None and torch.allclose(o, want - b, atol=1e-9):
        return "the bias is missing: add it once, after the all-reduce"
    sl = slice(bad[0] * n, (bad[0] + 1) * n)
    partial = x[:, sl] @ w[:, sl].T
    if any(torch.allclose(o, partial + extra, atol=1e-9) for extra in (0, b if b is not None else 0)):
        return f"rank {bad[0]} returned its own partial sum: return what the all-reduce gives back (plus the bias)"
    return f"rank {bad[0]}: values differ from x @ W.T + b by up to {(o - want).abs().max().item():.3g}"


def _plugged_model(fn: Callable, cfg: ModelConfig) -> tuple[float, float, float]:
    """The model at TP=2 on two threads with ``fn`` as every row-parallel layer's forward:
    ``(|TP=2 - fp64|, the tolerance rule's bound, |TP=1 - fp64|)``."""
    from ..measure.tolerance import max_abs_diff, tolerance
    weights = init_weights(cfg, seed=1)
    batch = pack([torch.arange(n) % cfg.vocab_size for n in (5, 9, 2)])
    tp1 = Transformer(cfg, weights)(batch)
    exact = Transformer(cfg, weights, attn_backend="loop", dtype=torch.float64)(batch)

    def forward(self, x):
        return fn(x, self.weight, self.bias, self.group)
    real = RowParallelLinear.forward
    RowParallelLinear.forward = forward
    try:
        outs = tp_ranks_in_threads(2, lambda group: Transformer(cfg, weights, group=group)(batch))
    finally:
        RowParallelLinear.forward = real
    return max_abs_diff(outs[0][0], exact), tolerance(tp1, exact), max_abs_diff(tp1, exact)


__all__ = ["RankLayer", "rank_layers", "layer0_attention", "tp_trace_timeline", "packing_lens", "tp_packing_state",
           "tp_trace_html", "tp_attention_html", "tp_packing_figure", "tp_packing_explorer", "check_trace_prediction",
           "ThreadRank", "tp_ranks_in_threads", "check_row_parallel"]
