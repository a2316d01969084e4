"""What lesson 04 (TP=2 does not care how the tokens are packed) draws, explores and checks: figures
``04_two_axes``, ``04_trace_timeline``, ``04_gqa_replicas``; the broken cuts of the control rows as the engine's
named faults (``CUTS``, ``cut_faults``); explorer ``tp_packing_explorer``; exercise checkers ``check_vocab_trace``
(04.1), ``check_kv_plan`` (04.2), ``check_cut_diagnosis`` (04.3), ``check_layout`` (04.4). Taught in
notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Polygon, Rectangle
from matplotlib.ticker import MaxNLocator

from .. import faults
from ..core.batch import PackedBatch, cumulative, pack
from ..core.config import ModelConfig
from ..core.model import Transformer, init_weights
from ..measure.flops import attention_cells
from ..measure.tolerance import tolerance
from ..serve.workloads import PACKING_PATTERNS, packing_lens
from ..style import ATTENTION, COMM, LINEAR, MIN_FONT, NEVER, OTHER, TEXT, request_color, request_name
from ..tp.dryrun import expected_trace, layer0_model, out_proj_partials, record_trace, trace_signature
from ..tp.kv_plan import GiB, KVPlan, best_layout, engine_kv_plan, layout_cache_bytes, run_kv_plan
from ..tp.threads import TapGroup, module_error_in_threads, tapped_forward
from ..tp.trace import summarize_trace
from ..tp.vocab import pad_vocab_size, vocab_parallel_trace
from ..validate import check_choice, check_int, check_lengths
from .check import Bound
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import grade, int_tuple
from .trace_figures import short_cu, tp_trace_timeline

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------
# The idea: two cuts of one forward

def _box(ax, x, y, w, h, color, text="", text_color="white", gid=None, fontsize=MIN_FONT):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white", linewidth=1, gid=gid))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


@register("04_two_axes", lesson="04",
          caption="two cuts of one TP=2 forward: requests cut the flat rows, TP cuts the heads; attention is one "
                  "problem per (request, head), one all-reduce carries every row (C11, C12)")
def two_axes_figure(seq_lens: Sequence[int] = ARTICLE_LENS, cfg: ModelConfig | None = None, tp: int = 2) -> Figure:
    """Claims C11, C12, before any count: the flat rows cut by request (``cu_seqlens``), the heads and features
    by rank. Left: attention in one layer, per head its T x T scores (ink outline) with one blue causal block per
    request (gid ``block-<request>-<head>``); right: a row-parallel layer whose one all-reduce (purple, gid
    ``allreduce``) adds every row's partial sums. No trace counts (the lesson asks the reader to predict them)."""
    cfg = cfg or ModelConfig()
    lens = check_lengths(seq_lens)
    t, h, hl, cu = sum(lens), cfg.n_heads, cfg.heads_per_rank(tp), cumulative(lens)
    fig = Figure(figsize=(13, 5.2))
    fig.text(0.01, 0.965, f"Two cuts of one forward at TP = {tp}: the requests cut the flat rows (cu_seqlens), "
             "tensor parallelism cuts the heads and the features. Neither cut needs the other.",
             fontsize=MIN_FONT + 2, color=TEXT, va="top")

    ax, bx = fig.add_axes((0.1, 0.07, 0.44, 0.72)), fig.add_axes((0.58, 0.07, 0.41, 0.72))  # attention, a linear
    ax.axis("off")
    bx.axis("off")
    gap = 0.8

    def hx(j):  # x of head j: a gap between the ranks
        return j + (j // hl) * gap

    for i, n in enumerate(lens):
        y = t - cu[i + 1]                      # the first request on top
        ax.add_patch(Rectangle((-1.6, y), 1.1, n, facecolor=request_color(i), edgecolor="white"))
        bx.add_patch(Rectangle((-0.9, y), 0.7, n, facecolor=request_color(i), edgecolor="white"))
        ax.text(-1.7, y + n / 2, f"request {request_name(i)}\n{n} tokens", ha="right", va="center",
                fontsize=MIN_FONT, color=TEXT)
        for j in range(h):  # head j's score matrix, keys across: request i's causal block, its own keys only
            x0, x1 = hx(j) + 0.05 + 0.8 * cu[i] / t, hx(j) + 0.05 + 0.8 * cu[i + 1] / t
            ax.add_patch(Polygon([(x0, y + n), (x0, y), (x1, y)], closed=True, facecolor=ATTENTION, edgecolor="none",
                                 gid=f"block-{i}-{j}"))
    for j in range(h):                         # the whole T x T of a head: white where nothing is computed
        ax.add_patch(Rectangle((hx(j) + 0.05, 0), 0.8, t, facecolor="none", edgecolor=TEXT, linewidth=0.6))
    for i in range(1, len(lens)):              # the request cut
        ax.plot([-1.6, hx(h - 1) + 0.9], [t - cu[i]] * 2, color=TEXT, linewidth=1.2, linestyle=(0, (4, 2)))
    for r in range(tp):
        a = hx(r * hl)
        ax.text(a + (hl - 0.1) / 2, t + 1.2, f"rank {r}: heads {r * hl}-{(r + 1) * hl - 1}", ha="center",
                va="bottom", fontsize=MIN_FONT + 1, color=TEXT)
        _box(bx, r * 3.4, 0, 2.6, t, LINEAR, f"rank {r}: input\n[T, {hl * cfg.d_head}], its\n"
             f"heads {r * hl}-{(r + 1) * hl - 1}\n→ partial sum\nof every row\n[T, {cfg.d_model}]", fontsize=MIN_FONT + 1)
        if r:
            mid = a - gap / 2 - 0.05
            ax.plot([mid, mid], [-0.5, t + 0.5], color=TEXT, linewidth=1.2, linestyle=(0, (4, 2)))
    ax.text(hx(h - 1) + 1.1, t - cu[1] if len(lens) > 1 else t / 2, "  cu_seqlens\n  cuts here", va="center",
            fontsize=MIN_FONT, color=TEXT)
    ax.text(hx(hl) - gap / 2, -1.0, "TP cuts here", ha="center", va="top", fontsize=MIN_FONT, color=TEXT)
    ax.set_title("Attention in one layer, per head the T x T scores (queries down, keys across): one blue\n"
                 "block per request and head. The white cells between requests are never computed.",
                 fontsize=MIN_FONT + 1, pad=26)
    ax.set(xlim=(-4.6, hx(h - 1) + 3.2), ylim=(-3.2, t + 4))

    xa = tp * 3.4 - 0.4
    bx.add_patch(Rectangle((xa, 0), 0.8, t, facecolor=COMM, edgecolor="white", gid="allreduce"))
    bx.text(xa + 0.4, t + 1.2, "all-reduce", ha="center", va="bottom", fontsize=MIN_FONT + 1, color=TEXT)
    bx.add_patch(Rectangle((xa + 1.2, t / 2), 2.6, t / 2, facecolor=NEVER, edgecolor=TEXT, linewidth=0.8))
    bx.text(xa + 2.5, 3 * t / 4, f"the sum\n[T, {cfg.d_model}]", ha="center", va="center", fontsize=MIN_FONT + 1,
            color=TEXT)                        # an activation: white, as in 00_tp_split
    _box(bx, xa + 1.2, 0, 2.6, t / 2 - 0.5, LINEAR, "+ bias once:\nthe same on\nevery rank", fontsize=MIN_FONT + 1,
         gid="bias-once")                      # the bias step: green (linear work), as in 00_tp_split
    bx.set_title("A row-parallel layer (out proj, FFN-down): one all-reduce\n"
                 "adds the ranks' partial sums of ALL the rows at once.", fontsize=MIN_FONT + 1, pad=26)
    bx.text(-0.9, -1.0, "It never asks which request a row belongs to.", va="top", fontsize=MIN_FONT + 1, color=TEXT)
    bx.set(xlim=(-1.2, xa + 4.2), ylim=(-3.2, t + 4))
    return fig


# ---------------------------------------------------------------------------------------------
# The trace of one forward on two ranks (drawn by the kit's ``trace_figures.tp_trace_timeline``)

TP_PACKINGS = ([40], ARTICLE_LENS, [1] * 40)  # the same 40 tokens as 1, 2 and 40 requests


@register("04_trace_timeline", lesson="04",
          caption="one TP=2 forward per rank: 16 all-reduces of [40 x 512] (purple), attention local to each "
                  "rank's heads, no LM head (the forward returns hidden states); identical for 1, 2 and 40 requests "
                  "(C11, C12)")
def _trace_timeline() -> Figure:
    cfg = ModelConfig()
    runs = [[record_trace(cfg, lens, rank, 2) for rank in range(2)] for lens in TP_PACKINGS]
    return tp_trace_timeline(runs, TP_PACKINGS, cfg, source="a dry run, tp.dryrun.record_trace", lm_head=False)

# ---------------------------------------------------------------------------------------------
# The explorer: the same tokens packed differently

PATTERNS = PACKING_PATTERNS  # the explorer's "lengths" dropdown
ENGINE_CUT, NAIVE_CUT, BIAS_CUT = "head-wise (the engine's)", "naive column cut of QKV", "bias on every rank"
CUTS = (ENGINE_CUT, NAIVE_CUT, BIAS_CUT)  # the explorer's "cut" dropdown; the last two are the breakages of C11, C12
TP_SIZES = (1, 2, 4, 8)                   # the explorer's tp dropdown: 8 heads, so 8, 4, 2 or 1 heads per rank
CAUGHT = Bound("> 1: fails the bound (✗ expected)", lambda v: v > 1)  # a control row: a broken variant is caught

# The engine's named faults behind each broken cut (``faults.FAULTS[name].what`` says the bug)
CUT_FAULTS = {ENGINE_CUT: (), NAIVE_CUT: ("qkv_sharded_as_one_block",), BIAS_CUT: ("row_parallel_bias_on_every_rank",)}


def cut_faults(cut: str):
    """A context manager that turns on ``cut``'s faults (``CUT_FAULTS``) for the models built and run inside it."""
    check_choice("cut", cut, CUTS)
    return faults.injected(*CUT_FAULTS[cut])


MAX_TOKENS = 160  # the explorer's T slider
TAPPED = "layers.0.attn.out_proj"  # the all-reduce whose inputs (each rank's partial sums) the explorer shows
SHOWN = 6  # numbers of one token's partial sums printed per rank (of d_model)


@functools.lru_cache(maxsize=6)  # a few (tp, cut) pairs: going back to one costs no rebuild
def _explorer_models(cfg: ModelConfig, tp: int, cut: str) -> tuple[list[Transformer], tuple[Transformer, Transformer]]:
    """One model per rank on a ``tp.threads.TapGroup``, built under ``cut_faults(cut)``, and layer 0 alone at TP=1
    in float32 and in float64 (loop attention): the reference of the ranks' sum. Weights ``init_weights(seed=0)``."""
    weights = init_weights(cfg, seed=0)
    one, w1 = layer0_model(cfg, weights)
    with cut_faults(cut):
        ranks = [Transformer(cfg, weights, group=TapGroup(r, tp, TAPPED)) for r in range(tp)]
    return ranks, (Transformer(one, w1), Transformer(one, w1, dtype=torch.float64, attn_backend="loop"))


def explorer_batch(cfg: ModelConfig, seq_lens: Sequence[int]) -> PackedBatch:
    """The explorer's batch: the first T of its fixed token ids (seed 0), cut into ``seq_lens``."""
    lens = check_lengths(seq_lens)
    if sum(lens) > MAX_TOKENS:
        raise ValueError(f"the explorer packs at most {MAX_TOKENS} tokens, got {sum(lens)}")
    ids = torch.randint(0, cfg.vocab_size, (MAX_TOKENS,), generator=torch.Generator().manual_seed(0))
    return pack(list(ids[:sum(lens)].split(lens)))


def tp_packing_state(total_tokens: int = 40, num_requests: int = 2, pattern: str = "equal",
                     cfg: ModelConfig | None = None, tp_size: int = 2, cut: str = ENGINE_CUT) -> dict:
    """The same T tokens packed as R requests (``packing_lens``), run on ``tp_size`` thread ranks that really add,
    built and run under ``cut_faults(cut)``. Keys: ``seq_lens``, ``cu_seqlens``, ``positions``, ``max_seqlen``;
    ``traces`` (each rank's collectives), ``trace_text``, ``same_as_one_request`` (per rank: the trace equals
    ``expected_trace`` of T tokens, one request's); ``heads`` (per rank: first, last), ``cells`` (score cells per
    head per layer, whole blocks), ``causal_cells`` (those the causal mask keeps), ``cells_per_rank`` (per
    forward); ``token`` (T - 1), ``token_request``, ``token_position``; ``partials`` (per rank, the first ``SHOWN``
    numbers it handed to layer 0's out-proj all-reduce for that token), ``partial_norms``; ``token_errors`` (per
    token, max |the ranks' sum, plus the bias once unless the cut added it on every rank, - TP=1's out proj in
    float64|), ``sum_err`` (their max),
    ``sum_allowed`` (the tolerance rule's bound), ``extra_bias`` ((tp - 1)·max|bias|); ``cut``, ``tp``, ``d_model``;
    ``outputs_equal`` (every rank ended with the same hidden states)."""
    cfg = cfg or ModelConfig(vocab_size=1000, max_position=2048)
    lens = packing_lens(total_tokens, num_requests, pattern)
    tp = check_int("tp_size", tp_size, 1, 16)
    hl = cfg.heads_per_rank(tp)
    ranks, tp1 = _explorer_models(cfg, tp, cut)
    batch = explorer_batch(cfg, lens)
    with cut_faults(cut):
        runs = tapped_forward(ranks, batch)
    traces, partials = [trace for *_, trace in runs], [sent for _, sent, _ in runs]
    bias = tp1[1].layers[0].attn.out_proj.bias.detach()  # float64
    with torch.no_grad():  # TP=1's layer 0 out proj, in float32 and float64
        ref, ref64 = (out_proj_partials(model, batch) + model.layers[0].attn.out_proj.bias for model in tp1)
    total = torch.stack([p.double() for p in partials]).sum(0) + (0 if cut == BIAS_CUT else bias.double())
    one = trace_signature(expected_trace(cfg, sum(lens), 0, tp))  # a signature carries no rank: rank 0's for all
    cells, kept = (attention_cells(lens, "varlen", causal=c) for c in (False, True))
    token = sum(lens) - 1
    return {"seq_lens": lens, "cu_seqlens": cumulative(lens), "positions": batch.positions.tolist(),
            "max_seqlen": max(lens), "traces": traces, "trace_text": [summarize_trace(t) for t in traces],
            "same_as_one_request": [trace_signature(t) == one for t in traces],
            "heads": [(r * hl, (r + 1) * hl - 1) for r in range(tp)], "cells": cells.computed, "causal_cells": kept.useful,
            "cells_per_rank": cells.computed * hl * cfg.n_layers, "token": token, "token_request": len(lens) - 1,
            "token_position": lens[-1] - 1, "partials": [p[token, :SHOWN].tolist() for p in partials],
            "partial_norms": [float(p[token].norm()) for p in partials],
            "sum_err": float((total - ref64).abs().max()), "sum_allowed": tolerance(ref, ref64),
            "token_errors": (total - ref64).abs().amax(dim=1).tolist(),
            "extra_bias": float((tp - 1) * bias.double().abs().max()),
            "cut": cut, "tp": tp, "d_model": cfg.d_model,
            "outputs_equal": all(torch.equal(runs[0][0], out) for out, *_ in runs)}


def tp_trace_html(state: dict) -> str:
    """What TP sees: ``rank 0: 16 × all_reduce [40, 512] float32, 81,920 B each`` per rank, then ``same as 1
    request of 40 tokens: yes``."""
    lines = [f"<div>rank {r}: {text}</div>" for r, text in enumerate(state["trace_text"])]
    same = "yes" if all(state["same_as_one_request"]) else "no"
    return "".join(lines) + f"<div>same as 1 request of {sum(state['seq_lens'])} tokens: {same}</div>"


def tp_attention_html(state: dict) -> str:
    """What attention sees, the same on every rank: ``R = 3 | cu_seqlens [0, 14, 27, 40] | positions
    0..13, 0..12, 0..12 | max_seqlen 14``."""
    lens = state["seq_lens"]
    positions = ", ".join(f"0..{n - 1}" if n > 1 else "0" for n in lens[:8]) + (
        f", ... ({len(lens)} runs)" if len(lens) > 8 else "")
    return (f"<div>R = {len(lens)} | cu_seqlens {short_cu(state['cu_seqlens'])} | positions {positions} | "
            f"max_seqlen {state['max_seqlen']}</div>")


def tp_ranks_html(state: dict) -> str:
    """What each rank holds and sends, one line per rank: ``rank 0: heads 0-3 | sum L_i^2 = 800 cells per head per
    layer (whole blocks; the causal mask keeps 420), 25600 per forward | out proj partial, token 39: norm 1.2345
    [+0.1234, ...]``, then the measured sum: ``rank 0 + rank 1, bias once = TP=1 out proj, all 40 tokens: max |sum -
    float64| = 1.2e-07, allowed 2.4e-07: yes`` (red ``NO`` when the cut is broken; ``bias on every rank`` then)."""
    t, name = state["token"], request_name(state["token_request"])
    lines = [f"<div>rank {r}: heads {a}-{b} | sum L_i^2 = {state['cells']} cells per head per layer (whole blocks; the "
             f"causal mask keeps {state['causal_cells']}), {state['cells_per_rank']} per forward | out proj partial, token "
             f"{t}: norm {state['partial_norms'][r]:.4f} [{', '.join(f'{v:+.4f}' for v in state['partials'][r])}, ...]</div>"
             for r, (a, b) in enumerate(state["heads"])]
    ranks = " + ".join(f"rank {r}" for r in range(len(state["heads"])))
    ok = state["sum_err"] <= state["sum_allowed"]
    bias = "bias on every rank" if state.get("cut") == BIAS_CUT else "bias once"
    style = "" if ok else ' style="color:#c0392b;font-weight:bold"'
    return (f"<div>token {t} = request {name}, position {state['token_position']}</div>" + "".join(lines)
            + f"<div{style}>{ranks}, {bias} = TP=1 out proj, all {t + 1} tokens: max |sum - float64| = "
              f"{state['sum_err']:.1e}, allowed {state['sum_allowed']:.1e}: {'yes' if ok else 'NO'}</div>")


def tp_packing_figure(state: dict) -> Figure:
    """The explorer's picture of ``tp_packing_state``: the all-reduces of one forward, the flat tokens by request,
    each rank's partial sums for the last token and their sum, every token's error / allowed on a log scale."""
    lens, tp = state["seq_lens"], len(state["traces"])
    t, n_ar, d_model = sum(lens), len(state["traces"][0]), state["d_model"]
    fig = Figure(figsize=(8.4, 6.4))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.axis("off")
    ax.set(xlim=(0, 100), ylim=(-17, 60))
    ratios = [e / state["sum_allowed"] for e in state["token_errors"]]  # every token's error / allowed, linear axis
    top = 1.15 * max(max(ratios), 1.0)                                  # limits from the data: nothing clipped
    err = fig.add_axes((0.08, 0.02, 0.9, 0.13))
    err.set(ylim=(0, top), xlim=(-0.5, t - 0.5), xticks=[])
    err.vlines(range(t), 0, ratios, colors=TEXT, linewidth=max(0.4, min(2.0, 45 / t)))
    what = "every token after the all-reduce: max |sum" if tp > 1 else "every token (tp = 1): max |out proj"
    err.set_title(f"{what} - float64| / allowed (linear scale); least {min(ratios):.1e}, worst {max(ratios):.1e}",
                  fontsize=MIN_FONT + 1, color=TEXT)
    lines = [(1.0, (0, (4, 2)), "allowed")]
    extra = state["extra_bias"] / state["sum_allowed"]  # what the bias on every rank adds to every token
    if tp > 1 and extra <= top:
        lines.append((extra, (0, (1, 1.5)), f"(tp-1)·max|bias| = {extra:.1e}"))
    for y, style, label in lines:
        err.axhline(y, color=TEXT, linewidth=0.8, linestyle=style)
        err.text(t - 0.5, y, label, ha="right", va="bottom", fontsize=MIN_FONT, color=TEXT,
                 bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    err.yaxis.set_major_locator(MaxNLocator(3))
    err.spines[["top", "right"]].set_visible(False)
    x0, width = 8.0, 90.0
    if n_ar:
        rec = state["traces"][0][0]
        top = f"what TP sees: {n_ar} all-reduces of [{rec.shape[0]}, {rec.shape[1]}] on each rank"
    else:
        top = "what TP sees: nothing (tp = 1: one rank holds every head)"
        ax.add_patch(Rectangle((x0, 49), width, 5, facecolor=NEVER, edgecolor=TEXT, linewidth=0.8, hatch="//"))
        ax.text(x0 + width / 2, 51.5, "no collectives", ha="center", va="center", fontsize=MIN_FONT + 1, color=TEXT,
                bbox={"facecolor": NEVER, "edgecolor": "none", "pad": 1.5})
    ax.text(x0 + width / 2, 58.5, f"{top} (1 request of {t} tokens: the same)", ha="center", va="top",
            fontsize=MIN_FONT + 1, color=TEXT)
    step = width / max(n_ar, 1)
    for k in range(n_ar):
        ax.add_patch(Rectangle((x0 + k * step, 49), 0.85 * step, 5, facecolor=COMM, edgecolor="white"))
        ax.text(x0 + (k + 0.425) * step, 51.5, str(k + 1), ha="center", va="center", fontsize=MIN_FONT, color="white")
    ax.text(x0 + width / 2, 45.5, f"what attention sees: cu_seqlens = {short_cu(state['cu_seqlens'])}; positions "
            f"restart at 0 in every request", ha="center", va="top", fontsize=MIN_FONT + 1, color=TEXT)
    scale, cu = width / t, cumulative(lens)
    for i, n in enumerate(lens):
        ax.add_patch(Rectangle((x0 + cu[i] * scale, 36), n * scale, 5, facecolor=request_color(i), edgecolor="white",
                               linewidth=0.5))
        if n * scale >= 2.5 and len(lens) <= 26:
            ax.text(x0 + (cu[i] + n / 2) * scale, 38.5, request_name(i), ha="center", va="center", fontsize=MIN_FONT,
                    fontweight="bold", color=TEXT)
        if len(lens) <= 12:
            ax.text(x0 + (cu[i] + 0.5) * scale, 35.2, "0", ha="center", va="top", fontsize=MIN_FONT, color=TEXT)
    if t <= 80:
        ax.vlines([x0 + j * scale for j in range(1, t)], 36, 41, colors="white", linewidth=0.3)
    parts = state["partials"]
    groups = parts + [[sum(c) for c in zip(*parts)]] if tp > 1 else parts  # each rank's partials, then their sum
    n = len(parts[0])
    lim = max(abs(v) for g in groups for v in g) or 1.0
    sends = "each rank sends to all-reduce 1" if tp > 1 else "rank 0 computes (no all-reduce)"
    ax.text(x0 + width / 2, 30.5, f"layer 0, out proj, token {state['token']} (the last): the first {n} of "
            f"{d_model} numbers {sends}", ha="center", va="top", fontsize=MIN_FONT + 1, color=TEXT)
    bars = fig.add_axes((0.08, 0.26, 0.9, 0.234))   # the bars: the same numbers on every group's scale
    bars.set(ylim=(-lim, lim), xlim=(-0.2, len(groups) * (n + 2) - 2), xticks=[])
    for r, values in enumerate(groups):
        g0 = r * (n + 2)
        bars.bar([g0 + i for i in range(n)], values, 0.75, align="edge", color=LINEAR if r < tp else COMM)
        a, b = state["heads"][min(r, tp - 1)]
        label = (f"rank 0 (heads {a}-{b}) holds every\nhead: nothing to add" if tp == 1 else
                 f"rank {r}\nheads {a}-{b}" if r < tp and tp > 2 else
                 f"rank {r} (heads {a}-{b}) sends\nits partial sums" if r < tp else
                 "all-reduce:\nthe sum" if tp > 2 else "after the all-reduce: their\nsum, the same on every rank")
        bars.text(g0 + n / 2, 1.1 * lim, label, ha="center", va="bottom", fontsize=MIN_FONT, color=TEXT)
        if r:
            bars.text(g0 - 1.1, 0, "+" if r < tp else "=", ha="center", va="center", fontsize=MIN_FONT + 3, color=TEXT)
    bars.axhline(0, color=TEXT, linewidth=0.8)
    bars.set_yticks([-lim, lim], labels=[f"{-lim:+.3f}", f"{lim:+.3f}"])
    bars.spines[["top", "right", "bottom"]].set_visible(False)
    for axes in (err, bars):
        axes.tick_params(labelsize=MIN_FONT, colors=TEXT)
    return fig


def tp_packing_explorer(total_tokens: int = 40, num_requests: int = 2, pattern: str = "quarter first", tp_size: int = 2,
                        cut: str = ENGINE_CUT):
    """VBox class ``tpx``: IntSliders ``tpx-tokens`` (T, 1..MAX_TOKENS) and ``tpx-num-requests`` (R, 1..T),
    Dropdowns ``tpx-pattern``, ``tpx-tp`` (``TP_SIZES``) and ``tpx-cut`` (``CUTS``); HTML ``tpx-trace``
    (``tp_trace_html``), ``tpx-attention`` (``tp_attention_html``), ``tpx-ranks`` (``tp_ranks_html``); Output
    ``tpx-figure`` (``tp_packing_figure``)."""
    w = ipywidgets_module()
    total = tagged(w.IntSlider(value=total_tokens, min=1, max=MAX_TOKENS, description="tokens T"), "tpx-tokens")
    reqs = tagged(w.IntSlider(value=min(num_requests, total_tokens), min=1, max=total_tokens, description="requests R"),
                  "tpx-num-requests")
    pat = tagged(w.Dropdown(options=list(PATTERNS), value=pattern, description="lengths"), "tpx-pattern")
    check_choice("tp_size", tp_size, TP_SIZES)
    check_choice("cut", cut, CUTS)
    tps = tagged(w.Dropdown(options=list(TP_SIZES), value=tp_size, description="tp"), "tpx-tp")
    cuts = tagged(w.Dropdown(options=list(CUTS), value=cut, description="cut"), "tpx-cut")
    trace, attn = tagged(w.HTML(), "tpx-trace"), tagged(w.HTML(), "tpx-attention")
    ranks, out = tagged(w.HTML(), "tpx-ranks"), tagged(w.Output(), "tpx-figure")

    def update(change=None):
        reqs.max = total.value  # R <= T: every request needs a token (clamps reqs.value too)
        state = tp_packing_state(total.value, reqs.value, pat.value, tp_size=tps.value, cut=cuts.value)
        trace.value, attn.value, ranks.value = tp_trace_html(state), tp_attention_html(state), tp_ranks_html(state)
        show_figure(out, tp_packing_figure(state))

    return explorer("tpx", [total, reqs, pat, tps, cuts], [trace, attn, ranks, out], update)


# ---------------------------------------------------------------------------------------------
# Exercise 04.1: the trace of the model with a vocab-parallel embedding and LM head (tp.vocab)

_CFG_B = ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=78, max_position=64)
_CFG_C = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=512, vocab_size=80, max_position=64)
_CFG_V = ModelConfig(vocab_size=1000, max_position=64)  # the article's model, a vocabulary that splits evenly


def _vocab_problem(got: list, want: list, cfg: ModelConfig, lens: list, tp: int) -> str:
    t, d, v, n = sum(lens), cfg.d_model, cfg.vocab_size, 2 * cfg.n_layers
    vl = pad_vocab_size(v, tp) // tp  # the logits a rank computes: its share of the padded vocabulary
    if tp == 1:
        return (f"got {len(got)} records, expected none: at tp = 1 there is no other rank, so nothing to add up "
                f"or gather")
    blocks = [g for g in got if g[1].startswith("layers.")]
    nb = len(blocks)
    count_hints = ((nb == 16, f"two per layer, and this model has cfg.n_layers = {cfg.n_layers}"),
                   (nb in (3 * cfg.n_layers, 4 * cfg.n_layers), "QKV and FFN-up are column-parallel, each rank keeps "
                    "its own output features and has nothing to add up; only out proj and FFN-down end in an all-reduce"),
                   (len(lens) > 1 and nb == n * len(lens), "TP does not loop over requests, one all-reduce carries "
                    "every flat row of the batch"),
                   (True, "two per layer (out proj, FFN-down)"))
    if nb != n:
        return f"got {nb} all-reduces in the blocks, expected {n}: " + next(hint for seen, hint in count_hints if seen)
    others = [g for g in got if not g[1].startswith("layers.") and g[1] not in ("wte", "lm_head")]
    (w_op, _, w_shape), (h_op, _, h_shape) = (([g for g in got if g[1] == name] or [(None,) * 3])[0]
                                              for name in ("wte", "lm_head"))
    shapes = {g[2] for g in blocks}
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), 0)
    hints = (  # the first that applies: what the wrong answer most likely got wrong, in the order of the forward
        (any("wpe" in g[1] or "pos" in g[1] for g in others),
         "the position table stays whole on every rank (it is small): no collective for the positions"),
        (bool(others), f"unexpected records {others[:2]}: besides the blocks' all-reduces, only 'wte' and 'lm_head' "
                       f"communicate"),
        (w_op is None, f"no collective for the embedding: rank r keeps only the rows of ids [r·V/tp, (r+1)·V/tp), so a "
                       f"token whose id another rank keeps gets zeros here. What turns {tp} such [T, d_model] tensors "
                       f"into every token's embedding on every rank?"),
        (w_op == "all_gather", "the embedding's pieces are whole rows (all d_model columns) for the ranks' own ids and "
                               "zeros elsewhere: they must be ADDED (all_reduce), not put side by side"),
        (w_shape == (t, d // tp), "the table is split by rows (token ids), not by columns: every rank's rows are "
                                  "d_model wide, [T, d_model]"),
        (w_shape != (t, d), f"the embedding's all-reduce carries {w_shape}, expected {(t, d)}: every flat token, "
                            f"d_model wide"),
        (h_op is None, f"no collective for the LM head: it is tied to the split table, so rank r computes only the "
                       f"logits of its own ids, [T, V/tp] = {(t, vl)}; every rank needs all {v}"),
        (h_op == "all_reduce" and h_shape == (t, v),
         "an all-reduce of [T, V] with zeros outside each rank's columns gives the right logits, but a ring "
         "all-reduce moves 2 times the bytes of a ring all-gather of the same [T, V] (per rank 2(tp-1)/tp "
         "of it, against (tp-1)/tp). Both are fixed-shape here: unlike the embedding, where the rank that "
         "holds a token's row depends on its id (so the zero-filled all-reduce is the fixed-shape way), "
         "rank r's logits are always the same V/tp columns for every token: gather them "
         "(all_gather of [T, V/tp])"),
        (h_op == "all_reduce",
         "the LM head's pieces are different columns (different ids), not partial sums: gather them (all_gather)"),
        (h_shape == (t, v), f"record what this rank contributes to the all-gather: its own logits, {(t, vl)}, not the "
                            f"gathered {(t, v)}"),
        (h_shape != (t, vl), f"the LM head's all-gather carries {h_shape}, expected {(t, vl)}: every flat token, V/tp "
                             f"columns"),
        (shapes != {(t, d)} and (max(lens), d) in shapes,
         f"the blocks' payload is every flat token: T = sum(seq_lens) = {t} rows, not the longest request"),
        (shapes != {(t, d)}, f"the blocks' all-reduces carry {sorted(shapes)}, expected {(t, d)}: [T, d_model]"),
        (len(got) != len(want), f"got {len(got)} records, expected {len(want)}"),
        (True, f"record {first} is {got[first]}, expected {want[first]}: in the order of the forward, embedding first, "
               f"then layer 0's out proj and FFN-down, layer 1's, ..., the LM head last"))
    return next(text for seen, text in hints if seen)


def check_vocab_trace(fn: Callable[[ModelConfig, list, int], list]) -> bool:
    """Exercise 04.1: ``fn(cfg, seq_lens, tp) -> [(op, layer, shape), ...]``, the collectives rank 0 makes in one
    forward with the embedding and the tied LM head split by vocabulary over ``tp`` ranks
    (``tp.vocab.vocab_parallel_logits``), in call order; ``op`` "all_reduce" or "all_gather", ``shape`` what the
    rank sends. Compared with ``vocab_parallel_trace``."""
    cases = [(_CFG_V, [1] * 12, 2), (_CFG_V, [10, 30], 2), (_CFG_B, [3, 1, 5], 3), (_CFG_C, [9], 4),
             (_CFG_C, [2] * 6, 1)]

    def judge(got, cfg, lens, tp):
        try:
            triples = [(str(op), str(layer), tuple(int(s) for s in shape)) for op, layer, shape in got]
        except (TypeError, ValueError):
            return f"expected a list of (op, layer, shape) triples like ('all_reduce', 'wte', (40, 512)), got {got!r}"[:300]
        want = [(r.op, r.layer, tuple(r.shape)) for r in vocab_parallel_trace(cfg, lens, tp)]
        return None if triples == want else _vocab_problem(triples, want, cfg, list(lens), tp)
    return grade("vocab_trace", fn, cases, judge, "the article's model at tp = 2 (12 x 1 and A+B), tp = 3, tp = 4, tp = 1")


# ---------------------------------------------------------------------------------------------
# Exercise 04.2: grouped-query attention under TP, which K/V heads each rank holds, measured on the engine

@register("04_gqa_replicas", lesson="04",
          caption="grouped-query attention at TP = 16: 32 query heads in 8 groups, each K/V head held whole on the 2 "
                  "ranks of its group, from the engine's plan (C11, Exercise 04.2)")
def gqa_replicas_figure(n_heads: int = 32, n_kv_heads: int = 8, d_head: int = 128, n_layers: int = 32,
                        tp: int = 16) -> Figure:
    """Grouped-query attention drawn from the engine's plan (``engine_kv_plan``, bf16): one column per rank, its
    query heads (gid ``q-<rank>-<head>``) over the K/V heads its QKV shard keeps (gid ``kv-<rank>-<head>``), a
    bracket under each K/V head's replicas, and the cache a token leaves on one rank."""
    plan = engine_kv_plan(n_heads, n_kv_heads, d_head, n_layers, tp, 2)
    fig = Figure(figsize=(13, 4))
    ax = fig.add_axes((0.01, 0.02, 0.98, 0.7))
    ax.axis("off")
    for r, (qs, kvs) in enumerate(zip(plan.q_heads, plan.kv_heads)):  # rank r's column: x = 1.25 r, 1 wide
        x = r * 1.25
        for y, heads, color, kind, name in ((2.1, qs, ATTENTION, "q", "q"), (1.0, kvs, OTHER, "kv", "K/V ")):
            w = 1 / len(heads)
            for i, j in enumerate(heads):
                _box(ax, x + i * w, y, w, 0.8, color, f"{name}{j}", gid=f"{kind}-{r}-{j}")
        ax.text(x + 0.5, 3.0, f"rank {r}", ha="center", va="bottom", fontsize=MIN_FONT, color=TEXT)
    for j, ranks in sorted(plan.holders.items()):
        x0, x1 = ranks[0] * 1.25, ranks[-1] * 1.25 + 1
        ax.plot([x0, x0, x1, x1], [0.85, 0.7, 0.7, 0.85], color=TEXT, linewidth=1.5)
        ax.text((x0 + x1) / 2, 0.6, f"K/V head {j}: {len(ranks)} cop{'ies' if len(ranks) > 1 else 'y'}", ha="center",
                va="top", fontsize=MIN_FONT, color=TEXT)
    ax.set(xlim=(-0.1, tp * 1.25), ylim=(0.1, 3.5))
    fig.text(0.01, 0.97, f"{n_heads} query heads in {n_kv_heads} groups of {n_heads // n_kv_heads} over {tp} ranks, as the "
             f"engine shards them (QKVParallelLinear): a rank's query heads read\nthe K/V head(s) of their group, which every "
             f"rank of that group holds whole", fontsize=MIN_FONT + 2, color=TEXT, va="top")
    fig.text(0.01, 0.83, f"num_kv_head_replicas = {plan.replicas}; one token leaves {plan.bytes_per_token:,} B in each "
             f"rank's cache ({n_layers} layers, d_head {d_head}, bf16): K and V of its {len(plan.kv_heads[0])} head(s), "
             "not a share of one", fontsize=MIN_FONT + 1, color=TEXT, va="top")
    return fig


# (n_heads, n_kv_heads, d_head, n_layers, tp, bytes_per_number): Llama-3-8B-like at tp = 2 and 8, one K/V head
# for all (multi-query: 4 replicas, the plainest replication, first), a 70B-like at tp = 16 (more ranks than K/V
# heads), groups of 3 (float32), and the course's own model (every head its own K/V, float32) at tp = 2.
_KV_CASES = ((32, 8, 128, 32, 2, 2), (32, 8, 128, 32, 8, 2), (16, 1, 64, 24, 4, 2), (64, 8, 128, 80, 16, 2),
             (12, 4, 64, 10, 2, 4), (8, 8, 64, 8, 2, 4))


def _kv_problem(got, plan: KVPlan, h, kv, dh, layers, tp, nbytes, fn: Callable | None = None) -> str | None:
    """What is wrong with ``got`` for one case, or None. ``fn``: the learner's function, asked again at 4 bytes per
    number to tell "K alone" from "numbers, not bytes" (both halve the bytes in bf16)."""
    try:
        heads, total = [sorted(int(x) for x in rank) for rank in got[0]], got[1]
        if isinstance(total, bool) or not float(total).is_integer():
            raise TypeError
        total = int(total)
    except (TypeError, ValueError, IndexError):
        return f"expected (kv_heads, kv_bytes): a list of K/V head lists, one per rank, and an int; got {got!r}"[:300]
    if len(heads) != tp:
        return f"{len(heads)} lists of K/V heads, expected one per rank: tp = {tp}"
    try:                                 # the plan itself, run in the engine: right when its forward is
        error, allowed = run_kv_plan(h, kv, tp, heads)
        ran = (f"your kv_heads, run in the engine (each of {tp} thread ranks computes K and V of the heads you gave "
               f"it): |rank 0 - float64 TP = 1| = {error:.1e}, {error / allowed:,.0f} x the allowed {allowed:.1e}")
    except ValueError as refused:
        error, allowed, ran = float("inf"), 0.0, f"the engine cannot run your kv_heads: {refused}"
    group = h // kv
    for r, (mine, right, q) in enumerate(zip(heads, plan.kv_heads, plan.q_heads)):
        if error <= allowed or mine == list(right):
            continue
        queries = f"{q[0]}-{q[-1]}" if len(q) > 1 else q[0]
        ask = f"the engine's rank {r} holds query heads {queries} and K/V heads {list(right)}"
        if not mine:
            return (f"{ran}. Rank {r} holds no K/V head, but {ask} (query head q reads K/V head q // (n_heads / "
                    f"n_kv_heads) = q // {group}). With tp = {tp} > n_kv_heads = {kv}, n_kv_heads // tp is 0: each K/V "
                    f"head must be REPLICATED, here on {plan.replicas} ranks")
        if tp <= kv and mine == list(range(r, kv, tp)):
            return (f"{ran}. Rank {r}: K/V heads {mine} (every tp-th), but {ask}: its query heads are a contiguous "
                    f"range, and q // {group} of each of them is its K/V head")
        return f"{ran}. Rank {r}: K/V heads {mine}, but {ask} (query head q reads K/V head q // {group})"
    want, held, local = plan.bytes_per_token, len(plan.kv_heads[0]), len(plan.q_heads[0])
    if total == want:
        return None
    hints = []
    if plan.replicas > 1:  # the heads are right: the likeliest slip is the replication, so it comes first
        hints += [(0, f"n_kv_heads // tp = {kv} // {tp} = 0 here; a replicated rank holds one whole head"),
                  (want * kv // tp, f"a replicated head is stored whole on each of the {plan.replicas} ranks that "
                                    f"hold it: a rank's share cannot shrink below one head")]
    k_alone = (want // 2, "that is K alone: the cache keeps K AND V, two numbers per head per dimension")
    numbers = (want // nbytes, f"that counts numbers, not bytes: x {nbytes} bytes per number")
    if k_alone[0] == numbers[0] and total == k_alone[0] and fn is not None:  # bf16: both halve; ask at 4 B
        try:
            other = int(fn(h, kv, dh, layers, tp, 4)[1])
        except Exception:  # the learner's code at another size: any failure just leaves both hints
            other = None
        k_alone, numbers = ((k_alone, (None, "")) if other == want * 4 // nbytes // 2 else
                            ((None, ""), numbers) if other == want // nbytes else (k_alone, numbers))
    hints += [k_alone,
              (want // layers, f"that is one layer: every one of the {layers} layers caches its own K and V"),
              numbers,
              (want * local // held, f"that counts the rank's {local} query heads: the cache holds K/V heads, {held} "
                                     f"on each rank"),
              (want * kv // held, f"that is every K/V head: a rank caches only the {held} it holds"),
              (want * tp, f"that is all {tp} ranks' caches together: kv_bytes is ONE rank's")]
    hint = "; or ".join(dict.fromkeys(text for value, text in hints if value == total))
    return (f"kv_bytes = {total:,}, but the engine's rank 0 cache holds {want:,} B per token (a prefill, measured) "
            f"= 2 x {held} K/V head(s) x d_head {dh} x {layers} layers x {nbytes} B" + (f": {hint}" if hint else ""))


def check_kv_plan(fn: Callable[[int, int, int, int, int, int], tuple]) -> bool:
    """Exercise 04.2: ``fn(n_heads, n_kv_heads, d_head, n_layers, tp, bytes_per_number) ->
    (kv_heads, kv_bytes)``: the K/V heads each rank holds (one list per rank) and the bytes of K and
    V one token adds to a rank's cache, all layers. ``kv_heads`` is run in the engine (``run_kv_plan``),
    ``kv_bytes`` compared with a prefill's cache on the engine's ranks (``engine_kv_plan``)."""
    return grade("kv_plan", fn, list(_KV_CASES), lambda got, *case: _kv_problem(got, engine_kv_plan(*case), *case, fn=fn),
                 "the engine's ranks and caches: tp below, equal to and above the K/V heads, multi-query, groups of 3, "
                 "the course's model")


# ---------------------------------------------------------------------------------------------
# Exercise 04.4: a server's layout for a grouped-query model, each GPU's cache measured on the engine

# (n_heads, d_head, n_layers, gpus, bytes_per_number, num_requests, tokens_per_request, budget): Llama-3-8B's sizes
# on 8 GPUs, 256 requests of 8,192 tokens, with 24 GiB a GPU (no K/V head count fits at TP = 8), with 40 GiB (TP = 8
# fits) and with 3 GiB (nothing fits); Llama-3-70B's sizes on 16 GPUs, 64 requests, 16 GiB (TP = 16 does not fit).
_LAYOUT_CASES = ((32, 128, 32, 8, 2, 256, 8192, 24 * GiB), (32, 128, 32, 8, 2, 256, 8192, 40 * GiB),
                 (32, 128, 32, 8, 2, 256, 8192, 3 * GiB), (64, 128, 80, 16, 2, 64, 8192, 16 * GiB))


def _layout_problem(got, h, dh, layers, gpus, nbytes, reqs, tokens, budget) -> str | None:
    want = best_layout(h, dh, layers, gpus, nbytes, reqs, tokens, budget)
    gib = lambda b: f"{b / GiB:g} GiB"
    if want is not None:
        best = (f"at tp = {want[1]}, pp = {want[2]}, dp = {want[3]} the engine's rank holds "
                f"{gib(layout_cache_bytes(h, want[0], dh, layers, nbytes, reqs, tokens, *want[1:]))}")
    if got is None:
        return None if want is None else f"got None, but {want[0]} K/V heads fit: {best} of a {gib(budget)} budget"
    ints, bad = int_tuple(got, "n_kv_heads, tp, pp, dp")
    if bad:
        return f"{bad[:300]}; or None when no layout fits"
    kv, tp, pp, dp = ints
    if kv < 1 or h % kv:
        return f"n_kv_heads = {kv} must divide n_heads = {h}: each K/V head serves a whole group"
    if tp * pp * dp != gpus:
        return f"tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp}, but the server has {gpus} GPUs: use each once"
    try:
        held = layout_cache_bytes(h, kv, dh, layers, nbytes, reqs, tokens, tp, pp, dp)
    except ValueError as refused:
        return f"the layout does not split: {refused}"
    replicas = engine_kv_plan(h, kv, dh, layers // pp, tp, nbytes).replicas
    where = f"at tp = {tp}, pp = {pp}, dp = {dp} the engine's rank holds {gib(held)} (measured)"
    if held > budget:
        why = (f": tp = {tp} > n_kv_heads = {kv} replicates each K/V head on {replicas} ranks, so every rank keeps a "
               f"whole head; fewer TP ranks (tp <= n_kv_heads) with data or pipeline parallelism for the other GPUs "
               f"share the cache instead" if replicas > 1 else ": more pipeline stages or data-parallel replicas "
               "split the layers or the requests over more GPUs, or fewer K/V heads shrink every token")
        return f"{kv} K/V heads: {where}, over the {gib(budget)} budget" + why + (
            "; here no layout fits even one K/V head: return None" if want is None else "")
    if want is None or kv > want[0]:
        raise RuntimeError(f"{got} fits on the engine ({gib(held)}) beyond the rule's best {want}")
    if kv < want[0]:
        return f"{kv} K/V heads fit ({where}), but {want[0]} fit too: {best}; every head shared costs quality"
    return None


def check_layout(fn: Callable[..., tuple | None]) -> bool:
    """Exercise 04.4: ``fn(n_heads, d_head, n_layers, gpus, bytes_per_number, num_requests, tokens_per_request,
    budget_bytes) -> (n_kv_heads, tp, pp, dp) or None``: the most K/V heads for which some layout of the GPUs
    (tp · pp · dp = gpus) keeps every GPU's KV cache within the budget, and that layout. The layout returned is
    built on the engine and its cache measured (``layout_cache_bytes``)."""
    return grade("layout", fn, list(_LAYOUT_CASES), _layout_problem,
                 "the layouts built on the engine: TP = 8 too big, TP = 8 fits, nothing fits, the 70B on 16 GPUs")


# ---------------------------------------------------------------------------------------------
# Exercise 04.3: name the broken cut from what the ranks computed

_CFG_CUT = ModelConfig(n_layers=1, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=64, max_position=64)


def cut_evidence(cut: str, tp: int, seq_lens: Sequence[int], cfg: ModelConfig | None = None) -> tuple:
    """What a doctor of a TP forward sees, for ranks built and run under ``cut_faults(cut)`` on ``tp``
    thread ranks that really add: ``(error, bias, allowed, tp)``. ``error`` ``[T, d_model]``, float64: rank
    0's layer-0 out proj output (after its all-reduce and bias) minus the one-process out proj in float64;
    ``bias`` the out proj's bias; ``allowed`` the tolerance rule's bound of the one-process float32 result."""
    cfg = cfg or _CFG_CUT
    tp = check_int("tp", tp, 1, cfg.n_heads)
    with cut_faults(cut):
        error, bias, allowed = module_error_in_threads(cfg, init_weights(cfg, seed=0), explorer_batch(cfg, seq_lens),
                                                       tp, TAPPED)
    return error, bias, allowed, tp


# (tp, seq_lens, which cut): the checker's cases; the cut is hidden from the reader's function
_CUT_CASES = ((2, [10, 30], ENGINE_CUT), (2, [10, 30], BIAS_CUT), (2, [10, 30], NAIVE_CUT), (4, [1] * 12, BIAS_CUT),
              (4, [5, 7], NAIVE_CUT), (4, [3, 9], ENGINE_CUT), (1, [12], NAIVE_CUT), (1, [4, 8], BIAS_CUT))


@functools.lru_cache(maxsize=1)  # computed once per process; the checker hands out copies
def _cut_evidences() -> tuple:
    return tuple(cut_evidence(cut, tp, lens) for tp, lens, cut in _CUT_CASES)


def _cut_problem(got, want: str, error: Tensor, bias: Tensor, allowed: float, tp: int) -> str | None:
    if got not in CUTS:
        return f"return one of L.CUTS {CUTS}, got {got!r}"[:300]
    if got == want or (tp == 1 and got == ENGINE_CUT):
        return None
    worst = float(error.abs().max())
    spread = float((error - error[0]).abs().max())             # how much the error differs between tokens
    extra = float((error - (tp - 1) * bias.double()).abs().max())
    hints = ((tp == 1, f"at tp = 1 there is nothing to cut: one rank holds the whole QKV and adds the bias once; the "
                       f"error {worst:.1e} is within the bound {allowed:.1e}, so the answer is {ENGINE_CUT!r}"),
             (want == ENGINE_CUT, f"max |error| = {worst:.1e} is within the allowed {allowed:.1e}: the ranks computed "
                                  f"the right out proj"),
             (got == ENGINE_CUT, f"max |error| = {worst:.1e} is {worst / allowed:,.0f} times the allowed "
                                 f"{allowed:.1e}: something is broken"),
             (want == BIAS_CUT, f"the error is the same row for every token (rows differ by at most {spread:.1e}) and "
                                f"equals (tp - 1) x the bias to within {extra:.1e}: tp - 1 extra biases, not wrong heads "
                                f"(wrong heads give every token its own error)"),
             (True, f"the error differs from token to token (rows differ by up to {spread:.1e}) and is not (tp - 1) x "
                    f"the bias (off by {extra:.1e}): an extra bias would add the same row to every token; the heads are "
                    f"wrong"))
    return next(text for seen, text in hints if seen)


def check_cut_diagnosis(fn: Callable[[Tensor, Tensor, float, int], str]) -> bool:
    """Exercise 04.3: ``fn(error, bias, allowed, tp) -> cut``, one of ``CUTS``: which cut explains the evidence of
    ``cut_evidence`` (the engine's when the result is right, also at tp = 1, where every cut computes the right thing)."""
    cases = [(tp, list(lens), f"mystery {i + 1}") for i, (tp, lens, _) in enumerate(_CUT_CASES)]
    evidence = {case[2]: (e.clone(), b.clone(), a, tp) for case, (e, b, a, tp) in zip(cases, _cut_evidences())}
    truth = {case[2]: cut for case, (*_, cut) in zip(cases, _CUT_CASES)}
    return grade("cut_diagnosis", fn=lambda tp, lens, name: fn(*evidence[name]), cases=cases,
                 judge=lambda got, tp, lens, name: _cut_problem(got, truth[name], *evidence[name]),
                 done="the engine's cut, the naive QKV cut and the bias on every rank, at tp = 1, 2 and 4")
