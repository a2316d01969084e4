"""What lesson 04 (TP=2 invariance) draws, explores and checks.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..core.attention import attention_ref, plain_attention
from ..core.batch import cumulative, seq_lens_to_cu_seqlens
from ..core.config import ModelConfig
from ..validate import check_int, check_lengths
from ..measure.flops import attention_cells
from ..tp.dryrun import record_trace, trace_signature
from ..tp.trace import summarize_trace
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import Tensor, grade, matches, tensor_problem
from .l00_setup import _SMALL_CFGS
from .style import CELL_COLORS, USEFUL, WASTED, token_strip


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

def split_tokens(total_tokens: int, num_requests: int) -> list[int]:
    """``total_tokens`` split into ``num_requests`` requests as equal as possible, longer first
    (``split_tokens(40, 3) == [14, 13, 13]``)."""
    t = check_int("total_tokens", total_tokens, 1, 1 << 20)
    r = check_int("num_requests", num_requests, 1, t)
    return [t // r + (1 if i < t % r else 0) for i in range(r)]

def tp_packing_state(num_requests: int, total_tokens: int = 40, world_size: int = 2) -> dict:
    """The same ``total_tokens`` packed as ``num_requests`` requests, run on every TP rank.

    The traces are dry runs of the model's own code (``tp_dryrun.record_trace``), compared with
    the dry run of the same tokens as ONE request. Keys: ``seq_lens``, ``cu_seqlens``,
    ``traces`` (per rank), ``same_as_one_request`` (per rank, bool), ``summary``
    (``tp.summarize_trace`` of rank 0), ``heads_per_rank``, ``attn_cells`` (per head per layer,
    varlen: Σ L_i²) and ``attn_cells_per_rank`` (× heads per rank × layers: what each rank's
    attention computes, locally).
    """
    lens = split_tokens(total_tokens, num_requests)
    cfg = ModelConfig(tp_size=world_size)
    traces = [record_trace(cfg, lens, r, world_size) for r in range(world_size)]
    ones = [_one_request_signature(sum(lens), r, world_size) for r in range(world_size)]
    cells = attention_cells(lens, "varlen").computed
    return {"seq_lens": lens, "cu_seqlens": cumulative(lens), "traces": traces,
            "same_as_one_request": [trace_signature(t) == s for t, s in zip(traces, ones)],
            "summary": summarize_trace(traces[0]), "heads_per_rank": cfg.heads_per_rank, "attn_cells": cells,
            "attn_cells_per_rank": cells * cfg.heads_per_rank * cfg.n_layers}

_ONE_REQUEST: dict = {}

def _one_request_signature(total: int, rank: int, world_size: int) -> list:
    key = (total, rank, world_size)
    if key not in _ONE_REQUEST:  # the reference does not change while the slider moves
        _ONE_REQUEST[key] = trace_signature(record_trace(ModelConfig(tp_size=world_size), [total], rank, world_size))
    return _ONE_REQUEST[key]

def tp_packing_html(state: dict) -> str:
    """Three ``<div>`` lines: the packing, the trace (with ``same as 1 request: yes|no`` per rank),
    and each rank's local attention work."""
    cu = state["cu_seqlens"]
    same = ", ".join(f"rank {r}: {'yes' if s else 'no'}" for r, s in enumerate(state["same_as_one_request"]))
    shown = cu if len(cu) <= 12 else f"[0, ..., {cu[-1]}]"
    return (f"<div>{len(state['seq_lens'])} requests | cu_seqlens {shown}</div>"
            f"<div>trace per rank: {state['summary']} | same as 1 request: {same}</div>"
            f"<div>attention on each rank: {state['heads_per_rank']} heads, sum L_i^2 = {state['attn_cells']} cells per head "
            f"per layer, {state['attn_cells_per_rank']} per forward, no collective</div>")

def tp_packing_explorer(num_requests: int = 2, total_tokens: int = 40):
    """VBox class ``tpx``: IntSliders ``tpx-num-requests`` (1..T) and ``tpx-tokens`` (1..128), HTML
    ``tpx-text`` (``tp_packing_html``), Output ``tpx-figure`` (the flat token strip)."""
    w = ipywidgets_module()
    total = tagged(w.IntSlider(value=total_tokens, min=1, max=128, description="tokens T"), "tpx-tokens")
    reqs = tagged(w.IntSlider(value=min(num_requests, total_tokens), min=1, max=total_tokens, description="requests R"),
                   "tpx-num-requests")
    text, out = tagged(w.HTML(), "tpx-text"), tagged(w.Output(), "tpx-figure")

    def update(change=None):
        reqs.max = total.value  # R <= T: every request needs a token (clamps reqs.value too)
        state = tp_packing_state(reqs.value, total.value)
        text.value = tp_packing_html(state)
        show_figure(out, token_strip(state["seq_lens"], title=f"{len(state['seq_lens'])} requests, T = {total.value}: "
                                         f"the only thing that changes is cu_seqlens"))

    return explorer("tpx", [total, reqs], [text, out], update)

def check_rank_attention(fn: Callable[..., Tensor]) -> bool:
    """Exercise 04.1: ``fn(q, k, v, cu_seqlens, rank, world_size) -> [T, H / world_size, D]``: causal
    varlen attention for the heads rank ``rank`` owns, from the full ``[T, H, D]`` q, k, v (C11)."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for lens, h, d, rank, tp in (([10, 30], 8, 8, 1, 2), ([3, 1, 5], 4, 4, 0, 2), ([6, 2], 6, 4, 2, 3), ([5], 2, 4, 0, 1)):
        q, k, v = (torch.randn(sum(lens), h, d, generator=g) for _ in range(3))
        cases.append((q, k, v, seq_lens_to_cu_seqlens(lens), rank, tp))

    def judge(got, q, k, v, cu, rank, tp):
        hl = q.shape[1] // tp
        full = attention_ref(q, k, v, cu, causal=True)                  # [T, H, D]
        want = full[:, rank * hl:(rank + 1) * hl]
        problem = tensor_problem(got, want, atol=1e-5)
        if problem is None:
            return None
        if matches(got, full, 1e-5) and tp > 1:
            return problem + " - that is every head; keep only this rank's H / world_size heads"
        if tp > 1 and matches(got, full[:, rank::tp], 1e-5):
            return problem + f" - rank r owns a contiguous block of heads, [r*H/tp, (r+1)*H/tp), not every {tp}-th head"
        sl = slice(rank * hl, (rank + 1) * hl)
        if matches(got, plain_attention(q[:, sl], k[:, sl], v[:, sl], causal=True), 1e-5):
            return problem + " - the requests read each other: slice each request with cu_seqlens"
        if matches(got, attention_ref(q[:, sl], k[:, sl], v[:, sl], cu, causal=False), 1e-5):
            return problem + " - the model is causal: a query reads only the keys at or before it in its request"
        return problem
    return grade("rank_attention", fn, cases, judge, "each rank's heads, varlen and causal, on 4 layouts")

def _trace_pairs(got) -> list | None:
    try:
        return [(str(name), tuple(int(s) for s in shape)) for name, shape in got]
    except (TypeError, ValueError):
        return None

def check_trace_prediction(fn: Callable[[ModelConfig, list], list]) -> bool:
    """Exercise 04.2: ``fn(cfg, seq_lens) -> [(layer, shape), ...]``, the all-reduces rank 0 makes in
    one TP=2 forward of a flat batch of ``seq_lens`` (C12), in order, e.g.
    ``("layers.0.attn.out_proj", (40, 512))``."""
    cfg_a = _SMALL_CFGS[0]
    cfg_b = ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=77, max_position=40)
    cases = [(cfg_a, [10, 30]), (cfg_a, [40]), (cfg_a, [1] * 40), (cfg_b, [3, 1, 5]), (cfg_b, [9])]

    def judge(got, cfg, lens):
        want = [(r.layer, tuple(r.shape)) for r in record_trace(cfg, lens, 0, 2)]
        pairs = _trace_pairs(got)
        if pairs is None:
            return f"expected a list of (layer name, shape) pairs, got {got!r}"[:300]
        if pairs == want:
            return None
        t, d = sum(lens), cfg.d_model
        if len(pairs) == cfg.n_layers:
            return f"got {len(pairs)} all-reduces, expected {len(want)} - two per layer: attn.out_proj, then mlp.fc_down"
        if len(pairs) == len(want) * len(lens) and len(lens) > 1:
            return (f"got {len(pairs)} all-reduces, expected {len(want)} - TP does not loop over requests: one "
                    f"all-reduce carries the whole flat batch")
        if len(pairs) != len(want):
            return f"got {len(pairs)} all-reduces, expected {len(want)}"
        shapes = {s for _, s in pairs}
        if shapes == {(max(lens), d)} and len(lens) > 1:
            return f"shape {(max(lens), d)}, expected {(t, d)} - the payload is every flat token, T = sum(seq_lens) = {t}"
        if shapes != {(t, d)}:
            return f"shapes {sorted(shapes)}, expected {(t, d)} - the row-parallel layers' output, [T, d_model]"
        first = next(i for i, (a, b) in enumerate(zip(pairs, want)) if a != b)
        return (f"record {first} is {pairs[first]}, expected {want[first]} - forward order: layers.0.attn.out_proj, "
                f"layers.0.mlp.fc_down, layers.1.attn.out_proj, ...")
    return grade("trace_prediction", fn, cases, judge, "the real model's trace, for 1, 2, 3 and 40 requests")

TP_PACKINGS = ([40], ARTICLE_LENS, [1] * 40)  # the same 40 tokens as 1, 2 and 40 requests

@register("04_trace_timeline", lesson="04",
          caption="one TP=2 forward per rank: attention local (reads cu_seqlens), 16 all-reduces of [40 x 512], "
                  "identical for 1, 2 and 40 requests (C11, C12)")
def _trace_timeline() -> Figure:
    from ..tp.dryrun import record_trace, trace_signature
    cfg = ModelConfig()
    runs = [[record_trace(cfg, lens, rank, cfg.tp_size) for rank in range(cfg.tp_size)] for lens in TP_PACKINGS]
    first = trace_signature(runs[0][0])
    if any(trace_signature(t) != first for traces in runs for t in traces):
        raise RuntimeError("the dry-run traces differ between packings or ranks: C12 would not hold")
    return tp_trace_timeline(runs[1], TP_PACKINGS, heads_per_rank=cfg.heads_per_rank,
                                 qkv_width=3 * cfg.heads_per_rank * cfg.d_head)
