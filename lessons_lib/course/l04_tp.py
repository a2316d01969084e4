"""What lesson 04 (TP=2 does not care how the tokens are packed) draws, explores and checks.

Figures: ``04_two_axes`` (the idea: requests cut the flat rows, TP cuts the heads and features;
attention is one independent problem per (request, head), the all-reduce carries every row) and
``04_trace_timeline`` (one TP=2 forward per rank, all-reduces in purple, the same for 1, 2 and
40 requests; the lesson draws it from the real ranks' records with ``tp_trace_timeline``).
Explorer ``tp_packing_explorer`` wraps ``tp_packing_state``: pack T tokens as R requests and
watch the trace stay while attention's inputs (and the kernel's launch grid) change.
Helpers the notebook calls: ``rank_layers`` (what each rank's four linear layers compute),
``layer0_attention`` (one layer's attention output on a rank). ``vocab_parallel_forward``: the
model with ``tp.vocab``'s vocab-parallel embedding and tied LM head around its blocks, as a real
deployment runs it (on ``tp.threads`` ranks, or dry-run on a ``LocalGroup`` stand-in). Exercise checkers: ``check_vocab_trace``
(04.1, the trace of that forward), ``check_qkv_shard`` (04.2, cut the fused QKV weight by head).

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..core.batch import PackedBatch, cumulative, pack
from ..core.config import ModelConfig
from ..core.groups import CollectiveRecord, LocalGroup
from ..core.linear import QKVParallelLinear
from ..core.model import Transformer, init_weights
from ..measure.flops import attention_cells
from ..measure.recorder import module_io
from ..measure.tolerance import float64_twin
from ..style import ATTENTION, COMM, LINEAR, MIN_FONT, NEVER, OTHER, TEXT, draw_strip, request_color, request_name
from ..tp.dryrun import record_trace, trace_signature
from ..tp.trace import summarize_trace
from ..tp.vocab import ParallelLMHead, VocabParallelEmbedding
from ..validate import check_choice, check_int, check_lengths
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import grade
from .l03_attention import launch_grid

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


def _one_layer(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, n_layers=1, vocab_size=1, max_position=1)


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
    io = module_io(model.layers[0], [path for _, path, _ in _LINEARS],
                   lambda: model(pack([torch.zeros(t, cfg.d_model, dtype=cfg.dtype)])))
    seen = {name: (tuple(io[path][0][0].shape), tuple(io[path][1].shape)) for name, path, _ in _LINEARS}
    reduced = {r.layer for r in group.trace}
    return [RankLayer(name, split, *seen[name], seen[name][0][1], f"layers.0.{path}" in reduced)
            for name, path, split in _LINEARS]


def layer0_attention(model: Transformer, batch: PackedBatch) -> Tensor:
    """Layer 0's attention output on this model's rank, ``[T, H_local, D]``: what its attention core
    returned in one forward of ``batch`` (a forward hook on ``layers.0.attn.core``).

    Layer 0's input is the embedding, replicated, so a ``LocalGroup(rank, 2)`` stand-in computes
    exactly what a real rank does there (later layers would need the other rank's partial sums).
    """
    io = module_io(model, ["layers.0.attn.core"], lambda: model(batch))
    return io["layers.0.attn.core"][1]


# ---------------------------------------------------------------------------------------------
# The idea: two cuts of one forward

def _box(ax, x, y, w, h, color, text="", text_color="white", gid=None, fontsize=MIN_FONT):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white", linewidth=1, gid=gid))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def two_axes_figure(seq_lens: Sequence[int] = ARTICLE_LENS, cfg: ModelConfig | None = None, tp: int = 2) -> Figure:
    """Claims C11, C12, the idea before any count: the flat rows are cut by request (``cu_seqlens``),
    the heads and features by rank (TP). Left: attention in one layer, one blue block per
    (request, head), each its own problem (gid ``block-<request>-<head>``). Right: a row-parallel
    layer, each rank's partial sum of every row, one all-reduce (purple, gid ``allreduce``) for
    all the rows. No trace counts (the lesson asks the reader to predict them)."""
    cfg = cfg or ModelConfig()
    lens = check_lengths(seq_lens)
    if cfg.n_heads % tp:
        raise ValueError(f"tp={tp} must divide n_heads={cfg.n_heads}")
    t, h, hl, cu = sum(lens), cfg.n_heads, cfg.n_heads // tp, cumulative(lens)
    fig = Figure(figsize=(13, 5.2))
    fig.text(0.01, 0.965, f"Two cuts of one forward at TP = {tp}: the requests cut the flat rows (cu_seqlens), "
             "tensor parallelism cuts the heads and the features. Neither cut needs the other.",
             fontsize=MIN_FONT + 2, color=TEXT, va="top")

    ax = fig.add_axes((0.1, 0.07, 0.44, 0.72))
    ax.axis("off")
    gap = 0.8

    def hx(j):  # x of head j: a gap between the ranks
        return j + (j // hl) * gap

    for i, n in enumerate(lens):
        y = t - cu[i + 1]                      # the first request on top
        ax.add_patch(Rectangle((-1.6, y), 1.1, n, facecolor=request_color(i), edgecolor="white"))
        ax.text(-1.7, y + n / 2, f"request {request_name(i)}\n{n} tokens", ha="right", va="center",
                fontsize=MIN_FONT, color=TEXT)
        for j in range(h):
            ax.add_patch(Rectangle((hx(j), y + 0.3), 0.9, n - 0.6, facecolor=ATTENTION, edgecolor="none",
                                   gid=f"block-{i}-{j}"))
    for i in range(1, len(lens)):              # the request cut
        ax.plot([-1.6, hx(h - 1) + 0.9], [t - cu[i]] * 2, color=TEXT, linewidth=1.2, linestyle=(0, (4, 2)))
    for r in range(tp):
        a = hx(r * hl)
        ax.text(a + (hl - 0.1) / 2, t + 1.2, f"rank {r}: heads {r * hl}-{(r + 1) * hl - 1}", ha="center",
                va="bottom", fontsize=MIN_FONT + 1, color=TEXT)
        if r:
            mid = a - gap / 2 - 0.05
            ax.plot([mid, mid], [-0.5, t + 0.5], color=TEXT, linewidth=1.2, linestyle=(0, (4, 2)))
    ax.text(hx(h - 1) + 1.1, t - cu[1] if len(lens) > 1 else t / 2, "  cu_seqlens\n  cuts here", va="center",
            fontsize=MIN_FONT, color=TEXT)
    ax.text(hx(hl) - gap / 2, -1.0, "TP cuts here", ha="center", va="top", fontsize=MIN_FONT, color=TEXT)
    ax.set_title("Attention in one layer: every blue block (one request x one head) is its own problem.\n"
                 "No block reads another, so no cut sends anything across it.", fontsize=MIN_FONT + 1, pad=26)
    ax.set_xlim(-4.6, hx(h - 1) + 3.2)
    ax.set_ylim(-3.2, t + 4)

    ax = fig.add_axes((0.58, 0.07, 0.41, 0.72))
    ax.axis("off")
    for i, n in enumerate(lens):
        y = t - cu[i + 1]
        ax.add_patch(Rectangle((-0.9, y), 0.7, n, facecolor=request_color(i), edgecolor="white"))
    for r in range(tp):
        x = r * 3.4
        _box(ax, x, 0, 2.6, t, LINEAR, f"rank {r}:\npartial sum\nof every row\n[T, d_model]", fontsize=MIN_FONT + 1)
    xa = tp * 3.4 - 0.4
    ax.add_patch(Rectangle((xa, 0), 0.8, t, facecolor=COMM, edgecolor="white", gid="allreduce"))
    ax.text(xa + 0.4, t + 1.2, "all-reduce", ha="center", va="bottom", fontsize=MIN_FONT + 1, color=TEXT)
    _box(ax, xa + 1.2, 0, 2.6, t, LINEAR, "the sum,\n+ bias once:\nthe same on\nevery rank", fontsize=MIN_FONT + 1)
    ax.set_title("A row-parallel layer (out proj, FFN-down): one all-reduce\n"
                 "adds the ranks' partial sums of ALL the rows at once.", fontsize=MIN_FONT + 1, pad=26)
    ax.text(-0.9, -1.0, "It never asks which request a row belongs to.", va="top", fontsize=MIN_FONT + 1, color=TEXT)
    ax.set_xlim(-1.2, xa + 4.2)
    ax.set_ylim(-3.2, t + 4)
    return fig


@register("04_two_axes", lesson="04",
          caption="two cuts of one TP=2 forward: requests cut the flat rows, TP cuts the heads; attention is one "
                  "problem per (request, head), one all-reduce carries every row (C11, C12)")
def _two_axes() -> Figure:
    return two_axes_figure()


# ---------------------------------------------------------------------------------------------
# The trace of one forward on two ranks

def tp_trace_timeline(traces_by_packing: Sequence[Sequence[Sequence]], packings: Sequence[Sequence[int]],
                      cfg: ModelConfig | None = None, source: str = "the ranks' records") -> Figure:
    """Claims C11, C12: one TP forward, one row per rank, from the ranks' collective traces.

    ``traces_by_packing[i][r]``: rank r's ``CollectiveRecord`` list for the batch of request
    lengths ``packings[i]`` (a real ``TPResult.traces`` or a dry run per rank). All must be the
    same, record for record, on every rank and for every packing (else ValueError: real ranks
    would wait forever, or the trace would depend on the packing). Layer 0 is drawn in detail
    (green linear layers with each rank's shapes, blue attention on the rank's own heads), the
    other layers compactly; every all-reduce is one purple bar across all ranks (gid
    ``allreduce-k``), numbered; the replicated embedding and final LayerNorm + LM head are
    grey. The packings are drawn underneath; ``source`` says where the traces came from.
    """
    cfg = cfg or ModelConfig()
    runs = [[list(t) for t in traces] for traces in traces_by_packing]
    packs = [check_lengths(p) for p in packings]
    if not packs or len(packs) != len(runs):
        raise ValueError(f"give one list of per-rank traces per packing: {len(runs)} traces for {len(packs)} packings")
    traces = runs[0]
    if not traces or not traces[0]:
        raise ValueError("traces must hold at least one rank with at least one collective")
    sig = trace_signature(traces[0])
    for i, run in enumerate(runs):
        for r, t in enumerate(run):
            if trace_signature(t) != sig:
                raise ValueError(f"packing {packs[i]}, rank {r}: the trace differs from rank 0's of {packs[0]}")
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
            f"These {len(packs)} packings of the same {t} tokens\ngave exactly this trace, record for record,\n"
            f"on every rank ({source}).", va="center", fontsize=MIN_FONT + 1, color=TEXT)
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
    runs = [[record_trace(cfg, lens, rank, 2) for rank in range(2)] for lens in TP_PACKINGS]
    return tp_trace_timeline(runs, TP_PACKINGS, cfg, source="a dry run, tp.dryrun.record_trace")

# ---------------------------------------------------------------------------------------------
# The explorer: the same tokens packed differently

PATTERNS = ("equal", "ramp", "one long")
# A FlashAttention-style varlen kernel hands each thread block (a group of GPU threads that run
# together on one streaming multiprocessor) one tile of TILE query rows of one request and one
# head. One launch starts ceil(max_seqlen / TILE) x R x heads blocks: its launch grid. The tile
# size is fixed when the kernel is compiled; max_seqlen only decides how many tiles to start
# (a block whose tile lies past its request's end returns at once).
TILE = 128
MAX_TOKENS = 320  # the explorer's T slider: past two tiles, so that max_seqlen can change the grid


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
                     cfg: ModelConfig | None = None, tp_size: int = 2) -> dict:
    """The same T tokens packed as R requests, on every one of ``tp_size`` TP ranks.

    Traces are dry runs of the model's own code (``tp.dryrun.record_trace``), compared with the
    dry run of the same tokens as ONE request. Keys: ``seq_lens``, ``cu_seqlens``, ``positions``
    (restarting per request), ``max_seqlen``, ``tiles`` (ceil(max_seqlen / TILE)), ``grid``
    (tiles x R x heads per rank: the thread blocks of one FlashAttention-style launch on one
    rank), ``traces`` (per rank), ``trace_text`` (``summarize_trace``
    per rank), ``same_as_one_request`` (per rank), ``heads`` (per rank: first, last head),
    ``cells`` (score cells per head per layer, whole blocks: sum L_i^2), ``cells_per_rank``
    (x heads per rank x layers: what each rank's attention computes, locally).
    """
    cfg = cfg or ModelConfig()
    lens = packing_lens(total_tokens, num_requests, pattern)
    tp = tp_size
    traces = [record_trace(cfg, lens, r, tp) for r in range(tp)]
    ones = [_one_request_signature(cfg, sum(lens), r, tp) for r in range(tp)]
    cells = attention_cells(lens, "varlen").computed
    hl = cfg.heads_per_rank(tp)
    reqs, tiles, heads = launch_grid(lens, hl, TILE)
    return {"seq_lens": lens, "cu_seqlens": cumulative(lens), "positions": pack([[0] * n for n in lens]).positions.tolist(),
            "max_seqlen": max(lens), "tiles": tiles, "grid": tiles * reqs * heads, "traces": traces,
            "trace_text": [summarize_trace(t) for t in traces],
            "same_as_one_request": [trace_signature(t) == s for t, s in zip(traces, ones)],
            "heads": [(r * hl, (r + 1) * hl - 1) for r in range(tp)], "cells": cells,
            "cells_per_rank": cells * hl * cfg.n_layers}


def trace_shapes(records: Sequence[CollectiveRecord]) -> list[tuple]:
    """``[(op, shape, layer), ...]``: a trace without rank and dtype (a dry run is float32, a GPU rank bfloat16)."""
    return [(r.op, tuple(r.shape), r.layer) for r in records]


_ONE_REQUEST: dict = {}


def _one_request_signature(cfg: ModelConfig, total: int, rank: int, tp_size: int) -> list:
    key = (repr(cfg), total, rank, tp_size)
    if key not in _ONE_REQUEST:  # the reference does not change while the requests slider moves
        _ONE_REQUEST[key] = trace_signature(record_trace(cfg, [total], rank, tp_size))
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
    max_seqlen 14 | grid 1 tile x 3 requests x 4 heads = 12 blocks`` then, per rank, its heads
    and score cells."""
    cu, r, hl = state["cu_seqlens"], len(state["seq_lens"]), state["heads"][0][1] - state["heads"][0][0] + 1
    tiles = state["tiles"]
    head = (f"<div>R = {r} | cu_seqlens {short_cu(cu)} | positions {_positions_text(state['seq_lens'])} | "
            f"max_seqlen {state['max_seqlen']} | grid {tiles} tile{'s' if tiles > 1 else ''} x {r} "
            f"request{'s' if r > 1 else ''} x {hl} heads = {state['grid']} blocks</div>")
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
    """VBox class ``tpx``: IntSliders ``tpx-tokens`` (T, 1..MAX_TOKENS) and ``tpx-num-requests`` (R, 1..T),
    Dropdown ``tpx-pattern``; HTML ``tpx-trace`` (``tp_trace_html``: stays while R and the pattern
    move), HTML ``tpx-attention`` (``tp_attention_html``: changes), Output ``tpx-figure``."""
    w = ipywidgets_module()
    total = tagged(w.IntSlider(value=total_tokens, min=1, max=MAX_TOKENS, description="tokens T"), "tpx-tokens")
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
# The model with a vocab-parallel embedding and LM head around its blocks (tp.vocab), and Exercise 04.1

def vocab_parallel_forward(model: Transformer, batch: PackedBatch) -> Tensor:
    """The model's forward with its token embedding and tied LM head split by vocabulary over
    ``model.group`` (``tp.vocab.VocabParallelEmbedding`` and ``ParallelLMHead``, cut from the
    model's ``wte``): logits ``[T, V]`` on every rank, equal to ``model.compute_logits(model(batch))``
    at TP=1. Collectives: the embedding's all-reduce ("wte"), the blocks' two per layer, the
    head's all-gather ("lm_head"). The position table stays whole (it is small)."""
    cfg = model.cfg
    embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, group=model.group, dtype=model.dtype)
    embedding = embedding.to(model.device).load_full_(model.wte)
    x = embedding(batch.input_ids) + model.wpe[batch.positions]              # [T, d], every token, every rank
    hidden = model(pack(list(x.split(batch.seq_lens)), device=model.device))  # the blocks and the final LayerNorm
    return ParallelLMHead.tied_to(embedding)(hidden)                          # [T, V/tp] per rank -> [T, V]


_STAND_INS: dict = {}


def _stand_in_model(cfg: ModelConfig, rank: int, world_size: int) -> Transformer:
    key = (repr(cfg), rank, world_size)
    if key not in _STAND_INS:  # the weights do not change a trace; building the article's model is the slow part
        if len(_STAND_INS) >= 8:
            _STAND_INS.clear()
        zeros = {name: torch.zeros(shape, dtype=cfg.dtype) for name, shape in cfg.weight_shapes().items()}
        _STAND_INS[key] = Transformer(cfg, zeros, group=LocalGroup(rank, world_size), attn_backend="masked")
    return _STAND_INS[key]


def vocab_parallel_trace(cfg: ModelConfig, seq_lens: Sequence[int], world_size: int, rank: int = 0) -> list:
    """The collectives rank ``rank`` makes in one ``vocab_parallel_forward`` of requests of
    ``seq_lens`` tokens, dry-run on a stand-in rank (``LocalGroup``): ``[CollectiveRecord, ...]`` in call order."""
    lens = check_lengths(seq_lens)
    model = _stand_in_model(cfg, rank, world_size)
    ids = torch.arange(sum(lens)) * 7 % cfg.vocab_size                 # ids spread over every rank's share
    model.group.trace.clear()
    vocab_parallel_forward(model, pack(list(ids.split(lens))))
    return list(model.group.trace)


_CFG_B = ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=78, max_position=64)
_CFG_C = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=512, vocab_size=80, max_position=64)
_CFG_V = ModelConfig(vocab_size=1000, max_position=64)  # the article's model, a vocabulary that splits evenly


def _triples(got) -> list | None:
    try:
        out = [(str(op), str(layer), tuple(int(s) for s in shape)) for op, layer, shape in got]
    except (TypeError, ValueError):
        return None
    return out


def _vocab_problem(got: list, want: list, cfg: ModelConfig, lens: list, tp: int) -> str:
    t, d, v, n = sum(lens), cfg.d_model, cfg.vocab_size, 2 * cfg.n_layers
    if tp == 1:
        return (f"got {len(got)} records, expected none: at tp = 1 there is no other rank, so nothing to add up "
                f"or gather")
    blocks = [g for g in got if g[1].startswith("layers.")]
    nb = len(blocks)
    if nb == 16 != n:
        return (f"got 16 all-reduces in the blocks, expected {n}: two per layer, and this model has "
                f"cfg.n_layers = {cfg.n_layers}")
    if nb in (3 * cfg.n_layers, 4 * cfg.n_layers) and nb != n:
        return (f"got {nb} all-reduces in the blocks, expected {n}: QKV and FFN-up are column-parallel, each rank "
                f"keeps its own output features and has nothing to add up; only out proj and FFN-down end in an "
                f"all-reduce")
    if len(lens) > 1 and nb == n * len(lens):
        return (f"got {nb} all-reduces in the blocks, expected {n}: TP does not loop over requests, one all-reduce "
                f"carries every flat row of the batch")
    if nb != n:
        return f"got {nb} all-reduces in the blocks, expected {n}: two per layer (out proj, FFN-down)"
    wte = [g for g in got if g[1] == "wte"]
    head = [g for g in got if g[1] == "lm_head"]
    others = [g for g in got if not g[1].startswith("layers.") and g[1] not in ("wte", "lm_head")]
    if others:
        if any("wpe" in g[1] or "pos" in g[1] for g in others):
            return "the position table stays whole on every rank (it is small): no collective for the positions"
        return f"unexpected records {others[:2]}: besides the blocks' all-reduces, only 'wte' and 'lm_head' communicate"
    if not wte:
        return (f"no collective for the embedding: rank r keeps only the rows of ids [r·V/tp, (r+1)·V/tp), so a token "
                f"whose id another rank keeps gets zeros here. What turns {tp} such [T, d_model] tensors into every "
                f"token's embedding on every rank?")
    if wte[0][0] == "all_gather":
        return ("the embedding's pieces are whole rows (all d_model columns) for the ranks' own ids and zeros "
                "elsewhere: they must be ADDED (all_reduce), not put side by side")
    if wte[0][2] != (t, d):
        if wte[0][2] == (t, d // tp):
            return "the table is split by rows (token ids), not by columns: every rank's rows are d_model wide, [T, d_model]"
        return f"the embedding's all-reduce carries {wte[0][2]}, expected {(t, d)}: every flat token, d_model wide"
    if not head:
        return (f"no collective for the LM head: it is tied to the split table, so rank r computes only the logits of "
                f"its own ids, [T, V/tp] = {(t, v // tp)}; every rank needs all {v}")
    if head[0][0] == "all_reduce":
        if head[0][2] == (t, v):
            return (f"an all-reduce of [T, V] with zeros outside each rank's columns gives the right logits but moves "
                    f"{tp} times the bytes: the pieces are different columns, gather them (all_gather of [T, V/tp])")
        return "the LM head's pieces are different columns (different ids), not partial sums: gather them (all_gather)"
    if head[0][2] == (t, v):
        return f"record what this rank contributes to the all-gather: its own logits, {(t, v // tp)}, not the gathered {(t, v)}"
    if head[0][2] != (t, v // tp):
        return f"the LM head's all-gather carries {head[0][2]}, expected {(t, v // tp)}: every flat token, V/tp columns"
    shapes = {g[2] for g in blocks}
    if shapes != {(t, d)}:
        if (max(lens), d) in shapes:
            return f"the blocks' payload is every flat token: T = sum(seq_lens) = {t} rows, not the longest request"
        return f"the blocks' all-reduces carry {sorted(shapes)}, expected {(t, d)}: [T, d_model]"
    if len(got) != len(want):
        return f"got {len(got)} records, expected {len(want)}"
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    return (f"record {first} is {got[first]}, expected {want[first]}: in the order of the forward, embedding first, "
            f"then layer 0's out proj and FFN-down, layer 1's, ..., the LM head last")


def check_vocab_trace(fn: Callable[[ModelConfig, list, int], list]) -> bool:
    """Exercise 04.1: ``fn(cfg, seq_lens, tp) -> [(op, layer, shape), ...]``, the collectives rank 0
    makes in one forward when the embedding and the tied LM head are split by vocabulary over
    ``tp`` ranks (``vocab_parallel_forward``), in call order; ``op`` is "all_reduce" or
    "all_gather", ``shape`` what the rank sends. Compared with a dry run of that forward on a
    stand-in rank (``vocab_parallel_trace``): the article's model, a 3-layer model at tp = 3, a
    2-layer one at tp = 4, and tp = 1."""
    cases = [(_CFG_V, [1] * 12, 2), (_CFG_V, [10, 30], 2), (_CFG_B, [3, 1, 5], 3), (_CFG_C, [9], 4),
             (_CFG_C, [2] * 6, 1)]

    def judge(got, cfg, lens, tp):
        triples = _triples(got)
        if triples is None:
            return f"expected a list of (op, layer, shape) triples like ('all_reduce', 'wte', (40, 512)), got {got!r}"[:300]
        want = [(r.op, r.layer, tuple(r.shape)) for r in vocab_parallel_trace(cfg, lens, tp)]
        return None if triples == want else _vocab_problem(triples, want, cfg, list(lens), tp)
    return grade("vocab_trace", fn, cases, judge, "the article's model at tp = 2 (12 x 1 and A+B), tp = 3, tp = 4, tp = 1")


# ---------------------------------------------------------------------------------------------
# Exercise 04.2: cut the fused QKV weight by head

_QKV_CASES = ((8, 4, 32, 2, 0, False), (8, 4, 32, 2, 1, False), (8, 4, 32, 2, 1, True), (6, 8, 96, 3, 2, False),
              (8, 4, 32, 4, 3, True), (4, 8, 32, 1, 0, False))    # n_heads, d_head, d_model, tp, rank, bias
_MODEL_CASE = "your function as every rank's cut, in a model at TP=2"
_CFG_QKV = ModelConfig(n_layers=1, d_model=48, n_heads=4, d_head=16, d_ffn=96, vocab_size=50, max_position=32)


def _qkv_full(n_heads, d_head, d_model, bias, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (3 * n_heads * d_head,) if bias else (3 * n_heads * d_head, d_model)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def engine_qkv_shard(full: Tensor, n_heads: int, rank: int, tp: int) -> Tensor:
    """What the engine's ``QKVParallelLinear.shard_rows`` cuts for rank ``rank`` of ``tp``."""
    d_head = full.shape[0] // (3 * n_heads)
    layer = QKVParallelLinear(full.shape[-1] if full.dim() == 2 else 1, n_heads, d_head, group=LocalGroup(rank, tp))
    return _ENGINE_CUT(layer, full)   # the engine's method, also while the checker plugs a reader's cut in


_ENGINE_CUT = QKVParallelLinear.shard_rows


def _heads_rows(full, heads, n_heads):
    """Rows of Q, K and V of the given heads, laid out [q | k | v]."""
    d_head = full.shape[0] // (3 * n_heads)
    return torch.cat([part[h * d_head:(h + 1) * d_head] for part in full.chunk(3) for h in heads])


def _qkv_problem(got, full, n_heads, rank, tp) -> str | None:
    want = engine_qkv_shard(full, n_heads, rank, tp)
    if not isinstance(got, Tensor):
        return f"expected a tensor of shape {list(want.shape)}, got {type(got).__name__}"
    if tuple(got.shape) == tuple(want.shape) and torch.equal(got.double(), want):
        return None
    k, hl = full.shape[0] // 3, n_heads // tp
    d_head = k // n_heads
    ours = list(range(rank * hl, (rank + 1) * hl))
    if tuple(got.shape) != tuple(want.shape):
        rows = got.shape[0] if got.dim() else 0
        if full.dim() == 2 and full.shape[1] != k and rows != 3 * hl * d_head:
            return (f"{rows} rows, expected {want.shape[0]}: each of Q, K and V has n_heads x d_head = {k} rows, not "
                    f"d_model = {full.shape[1]} (here they differ); a rank keeps (n_heads / tp) x d_head = "
                    f"{hl * d_head} rows of each")
        if rows == k // tp:
            return (f"{rows} rows, expected {want.shape[0]}: the rank needs Q, K AND V of its heads, "
                    f"(n_heads / tp) x d_head rows of each")
        return f"shape {list(got.shape)}, expected {list(want.shape)}: 3 x (n_heads / tp) x d_head rows"
    n = full.shape[0] // tp
    if torch.equal(got.double(), full[rank * n:(rank + 1) * n]):
        return (f"that is a plain column-parallel cut, rows {rank * n}..{(rank + 1) * n - 1} of [Q | K | V]: they are "
                f"not Q, K and V of the same heads. A rank needs heads {ours[0]}-{ours[-1]} out of EACH third")
    strided = list(range(rank, n_heads, tp))
    if strided != ours and torch.equal(got.double(), _heads_rows(full, strided, n_heads)):
        return (f"heads {strided}: a rank's heads must be the contiguous range {ours[0]}-{ours[-1]}, because out proj "
                f"(row-parallel) holds the matching contiguous slice of its input features")
    per_head = torch.cat([part[h * d_head:(h + 1) * d_head] for h in ours for part in full.chunk(3)])
    if torch.equal(got.double(), per_head):
        return ("the right rows, interleaved head by head: QKVParallelLinear.split reads a rank's rows as "
                "[q of its heads | k of its heads | v of its heads]")
    return f"values differ from rows of heads {ours[0]}-{ours[-1]} of Q, K and V, laid out [q | k | v]"


def _qkv_in_model(fn: Callable, cfg: ModelConfig) -> list[tuple[float, float]]:
    """``fn`` as every rank's QKV cut (in place of ``QKVParallelLinear.shard_rows``), on stand-in ranks
    of TP=2: per rank, (|its layer-0 attention - TP=1's same heads in float64|, the tolerance rule's bound)."""
    from ..measure.tolerance import max_abs_diff, tolerance
    weights = init_weights(cfg, seed=3)
    batch = pack([torch.arange(n) % cfg.vocab_size for n in (5, 9, 2)])
    model = Transformer(cfg, weights)
    full = layer0_attention(model, batch)
    exact = layer0_attention(float64_twin(model), batch)
    real = QKVParallelLinear.shard_rows
    QKVParallelLinear.shard_rows = lambda self, t: fn(t.clone(), self.n_heads, self.group.rank, self.group.world_size)
    try:
        per_rank = [layer0_attention(Transformer(cfg, weights, group=LocalGroup(r, 2)), batch) for r in (0, 1)]
    finally:
        QKVParallelLinear.shard_rows = real
    hl = cfg.n_heads // 2
    out = []
    for r, got in enumerate(per_rank):
        heads = slice(r * hl, (r + 1) * hl)
        out.append((max_abs_diff(got, exact[:, heads]), tolerance(full[:, heads], exact[:, heads])))
    return out


def check_qkv_shard(fn: Callable[[Tensor, int, int, int], Tensor]) -> bool:
    """Exercise 04.2: ``fn(full, n_heads, rank, tp) -> Tensor``: rank ``rank``'s rows of the fused QKV
    weight ``full [3·n_heads·d_head, d_model]`` (rows: Q of heads 0..H-1, then K, then V) or of
    its bias ``[3·n_heads·d_head]``, laid out ``[q | k | v]`` of the rank's own heads. Compared with
    the engine's ``QKVParallelLinear.shard_rows`` (tp = 1, 2, 3, 4; a model whose n_heads x d_head
    is not d_model), then plugged into a model at TP=2 as every rank's cut: each rank's attention
    must be its heads of the one-process attention, by the tolerance rule."""
    cases = [(_qkv_full(h, dh, d, b, seed=h + d + tp + r), h, r, tp) for h, dh, d, tp, r, b in _QKV_CASES]
    cases.append((_MODEL_CASE, _CFG_QKV))

    def run(*case):
        if case[0] == _MODEL_CASE:
            return _qkv_in_model(fn, case[1])
        full, h, r, tp = case
        return fn(full.clone(), h, r, tp)

    def judge(got, *case):
        if case[0] == _MODEL_CASE:
            hl = case[1].n_heads // 2
            for r, (err, bound) in enumerate(got):
                if err > bound:
                    return (f"plugged into the model as every rank's QKV cut, rank {r}'s attention is {err:.3g} away "
                            f"from heads {r * hl}-{(r + 1) * hl - 1} of the one-process attention (allowed {bound:.3g})")
            return None
        return _qkv_problem(got, *case)
    return grade("qkv_shard", fn=run, cases=cases, judge=judge,
                 done="tp = 1, 2, 3 and 4, weights and biases, and inside the model at TP=2")


__all__ = ["RankLayer", "rank_layers", "layer0_attention", "two_axes_figure", "tp_trace_timeline", "packing_lens",
           "tp_packing_state", "tp_trace_html", "tp_attention_html", "tp_packing_figure", "tp_packing_explorer",
           "trace_shapes", "vocab_parallel_forward",
           "vocab_parallel_trace", "check_vocab_trace", "engine_qkv_shard", "check_qkv_shard"]
