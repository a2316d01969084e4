"""What lesson 08 (chunked prefill: when a prompt does not fit) draws, explores and checks.

  the stream        ``stream`` (``serve.workloads.prefill_stream``), ``draft_index``, ``behind``, ``refusal``
  one chunk         ``chunk_mask`` / ``staircase_cells`` (``serve.chunk_costs``), ``mask_text``, ``chunk_rows_error``
  the engine        ``serve``, ``timeline``, ``payloads_match``, ``other_collectives``, ``stacked``, ``same_argmax``,
                    ``recorded_blocks`` (``serve.runs``; what attention really ran, counts: ``OpRecorder.score_counts``),
                    ``planned_timeline`` (``serve.chunk_costs.planned_forwards``), ``error_and_bound`` (``check.close``),
                    ``intensity_table``, ``forward_prices_text`` (H200s, TP=2)
  figures           ``chunk_staircase`` (08_chunk_staircase), ``chunk_timeline`` (08_chunk_timeline)
  break it          ``BUGS`` (the engine's named faults), ``broken``, ``reported_bug``, ``chunk_error_table``
  explorer          ``chunked_plan_state`` / ``chunked_plan_html`` / ``chunked_plan_explorer`` (runs the engine)
  exercises         ``check_capped_scheduler`` (08.1), ``check_budget_choice`` (08.2; ``budget_table``),
                    ``check_bug_report_fix`` (08.3)

Taught in notebooks/08_chunked_prefill.ipynb.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import html
from collections import Counter
from collections.abc import Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Polygon, Rectangle
from torch import Tensor

from .. import faults
from ..core.attention import varlen_attention
from ..core.batch import pack
from ..core.config import ModelConfig
from ..core.model import init_weights
from ..measure.comm import NVLINK, REPEATED_PARTS, crossover_tokens, tp_forward_parts, tp_run_prices
from ..measure.flops import LINEAR_LAYERS, linear_intensity, linear_ridge_tokens, linear_shapes
from ..measure.machines import H200
from ..serve import workloads
from ..serve.chunk_costs import causal_cells_from_masks, draft_finish, fewest_forwards_budget, forward_score_cells, plan_prices
from ..serve.chunk_costs import chunk_mask as chunk_mask  # the engine's, shown by the lesson
from ..serve.chunk_costs import chunk_spans as chunk_spans
from ..serve.chunk_costs import planned_forwards as planned_timeline
from ..serve.chunk_costs import staircase_cells as staircase_cells
from ..serve.engine import Engine
from ..serve.runs import forward_tokens as timeline
from ..serve.runs import other_collectives as other_collectives
from ..serve.runs import payloads_match as payloads_match
from ..serve.runs import run_summary
from ..serve.runs import same_argmax as same_argmax
from ..serve.runs import score_blocks as recorded_blocks
from ..serve.runs import serve_prompts as serve
from ..serve.runs import stacked_outputs as stacked
from ..serve.scheduler import DEFAULT_MAX_NUM_SEQS, Request, Scheduler, chunked_schedule_problem, plan_batches
from ..serve.scheduler import mean_prefill_wait as mean_wait
from ..serve.scheduler import prefill_waits as waits_of
from ..style import ATTENTION, MIN_FONT, NEVER, OTHER, REQUEST, TEXT, WASTE, request_color
from ..validate import check_int
from .check import close as error_and_bound  # the claim rows' (error, bound)
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import register
from .grading import grade

# ---- lesson 06's stream: 24 long-tail prompts under 512 prompt tokens per forward ---------------------------

BUDGET = workloads.PREFILL_STREAM_BUDGET   # lesson 06's max_num_batched_tokens: 512
WHOLE_BUDGET = 2048   # the smallest power of two that admits the 1,776-token draft whole


def stream(cfg: ModelConfig | None = None) -> tuple[list[int], list[list[int]]]:
    """Lesson 06's stream (``serve.workloads.prefill_stream``) with ``cfg``'s vocabulary: ``(lengths, token-id
    prompts)`` in arrival order, the 1,776-token draft included."""
    return workloads.prefill_stream((cfg or ModelConfig()).vocab_size)


def draft_index() -> int:
    """The stream's request that lesson 06 refused: the one longer than the budget."""
    (i,) = [i for i, n in enumerate(stream()[0]) if n > BUDGET]
    return i


def behind(seq_lens: Sequence[int]) -> list[int]:
    """The requests that arrived after the draft."""
    return list(range(draft_index() + 1, len(seq_lens)))


def refusal(cfg: ModelConfig | None = None, weights: dict | None = None) -> str:
    """The capstone's engine (whole prompts only) refusing the draft at submit: its error message."""
    cfg = cfg or ModelConfig()
    engine = Engine(cfg, weights=weights if weights is not None else init_weights(cfg, 0), device="cpu",
                    dtype=torch.float32, max_num_batched_tokens=BUDGET)
    i = draft_index()
    try:
        engine.submit(Request(i, stream(cfg)[1][i]))
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"the engine accepted request {i} under a budget of {BUDGET}")


# ---- one chunk's mask: rows of this chunk, keys of everything so far -------------------------------------

def mask_text(mask: Tensor, start: int = 0) -> str:
    """A chunk's mask as text: one line per query (its token index in the prompt), ``#`` allowed, ``.`` not."""
    lines = ["keys:      " + "".join(str(j % 10) for j in range(mask.shape[1]))]
    lines += [f"query {start + i:3d}: " + "".join("#" if x else "." for x in row.tolist()) for i, row in enumerate(mask)]
    return "\n".join(lines)


def chunk_rows_error(start: int = 4, length: int = 4, heads: int = 2, d_head: int = 16, seed: int = 0) -> tuple:
    """``(max |chunk rows - fp64|, the tolerance rule's bound)``: ``varlen_attention`` of queries ``start ..
    start+length-1`` against keys ``0 .. start+length-1`` (``cu_seqlens_q = [0, length]``, ``cu_seqlens_k =
    [0, start + length]``), float32, against the same rows of one causal attention over every token."""
    total = start + length
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, heads, d_head, generator=g) for _ in range(3))
    cu_whole = torch.tensor([0, total], dtype=torch.int32)
    chunk = varlen_attention(q[start:], k, v, torch.tensor([0, length], dtype=torch.int32), cu_whole)
    truth = varlen_attention(q.double(), k.double(), v.double(), cu_whole)[start:]
    return error_and_bound(chunk, varlen_attention(q, k, v, cu_whole)[start:], truth)


# ---- what a forward costs on H200s (TP=2, bf16) -----------------------------------------------------------

def intensity_table(cfg: ModelConfig, token_counts: Sequence[int], tp_sizes: Sequence[int] = (2, 1)) -> str:
    """Each linear layer's FLOP/byte (bf16, one rank) for forwards of ``token_counts`` tokens under each TP size,
    ``*`` where it reaches the H200's ridge (compute-bound), and the tokens from which it does
    (``measure.flops.linear_ridge_tokens``)."""
    lines = [f"bf16, one rank, against an H200's ridge of {H200.ridge:.0f} FLOP/byte (* = at or above it: compute-bound)",
             f"{'':18s}" + "".join(f"{n:>11s}" for n in LINEAR_LAYERS)]
    for tp in tp_sizes:
        for t in token_counts:
            vals = [linear_intensity(t, a, b, 2) for a, b in linear_shapes(cfg, tp)]
            lines.append(f"TP={tp}, {t:4d} tokens " + "".join(f"{v:10.0f}{'*' if v >= H200.ridge else ' '}" for v in vals))
        lines.append(f"TP={tp}, ridge from " + "".join(
            f"{('never' if n is None else f'{n:,}'):>10s} " for n in linear_ridge_tokens(cfg, H200.ridge, tp).values()))
    return "\n".join(lines)


def forward_prices_text(cfg: ModelConfig, runs: dict, all_reduces: int, launches: int) -> str:
    """Runs ``{name: [tokens of each forward]}`` priced by ``measure.comm.tp_run_prices``, as lines: one
    ``BUDGET``-token forward part by part (its roofline verdict with the times), each run's forwards and fixed
    costs, and what the first run's extra forwards add over the second's."""
    p = tp_forward_parts(cfg, BUDGET, all_reduces, launches)
    bound = "compute" if p["arithmetic_s"] >= p["memory_s"] else "memory"
    us = {k: v * 1e6 for k, v in p.items()}
    lines = [f"one {BUDGET}-token forward on one rank, bf16: linear layers {us['arithmetic_s']:.1f} us of arithmetic at "
             f"the peak, {us['memory_s']:.1f} us of memory at {H200.bytes_per_s / 1e12:.1f} TB/s ({bound}-bound by "
             f"{max(p['arithmetic_s'], p['memory_s']) / min(p['arithmetic_s'], p['memory_s']) - 1:.0%}); the weights "
             f"alone {us['weight_pass_s']:.1f} us",
             f"  its {all_reduces} all-reduces of [{BUDGET} x d_model]: {us['all_reduces_s']:.1f} us (each latency "
             f"{us['all_reduce_latency_s']:.1f} us + bandwidth {us['all_reduce_bandwidth_s']:.2f} us; bandwidth would "
             f"match latency only from {crossover_tokens(NVLINK, cfg.d_model, 2):,.0f} rows)",
             f"  its {launches} kernel launches at {H200.launch_s * 1e6:.0f} us each: {us['launches_s']:.0f} us"]
    prices = tp_run_prices(cfg, runs, all_reduces, launches)
    for name, r in prices.items():
        lines.append(f"{name:8s}: {r['forwards']} forwards (largest {r['largest']:,} tokens), "
                     f"{r['forwards'] * all_reduces} all-reduces | " +
                     ", ".join(f"{k[:-2].replace('_', ' ')} {r[k] * 1e6:,.0f} us" for k in REPEATED_PARTS))
    (a, ra), (b, rb) = list(prices.items())[:2]
    extra = {k: (ra[k] - rb[k]) * 1e6 for k in REPEATED_PARTS}
    lines.append(f"{a} - {b}: {ra['forwards'] - rb['forwards']} extra forwards, "
                 f"{(ra['forwards'] - rb['forwards']) * all_reduces} extra all-reduces | " +
                 ", ".join(f"{k[:-2].replace('_', ' ')} +{v:,.0f} us" for k, v in extra.items()) +
                 f" | largest: {max(extra, key=extra.get)[:-2].replace('_', ' ')}")
    return "\n".join(lines)


# ---- figures --------------------------------------------------------------------------------------------

def chunk_staircase(chunks: Sequence[int], title_prefix: str = "") -> Figure:
    """Lesson 08: one prompt of ``L = Σ chunks`` tokens prefilled in chunks.

    Left: one row per forward, the chunk's tokens computed now (gid ``chunk-c``) after the tokens read back from
    the KV cache (``cache-c``). Right: the prompt's ``L × L`` score matrix per head per layer; chunk c computes its
    rows × every key so far: the cached keys (``cached-c``), its own square causal (``diag-c`` below the diagonal,
    ``masked-c`` above it: computed, then masked), outlined (``rect-c``); right of it never computed (``never-c``).
    """
    spans = chunk_spans(chunks)
    total = spans[-1][0] + spans[-1][1]
    fig = Figure(figsize=(10, 5.2))
    left, right = fig.subplots(1, 2, width_ratios=[1.15, 1])
    bar, small = 0.6, {"ha": "center", "va": "center", "fontsize": MIN_FONT}
    for c, (s, n) in enumerate(spans):
        e = s + n
        if s:   # left: the rows read back from the cache; right: this chunk's rows x the cached keys
            left.add_patch(Rectangle((0, c - bar / 2), s, bar, facecolor=OTHER, edgecolor="white", gid=f"cache-{c}"))
            left.text(s / 2, c, f"{s} cached", color="white", **small)
            right.add_patch(Rectangle((0, s), s, n, facecolor=ATTENTION, edgecolor="none", gid=f"cached-{c}"))
        left.add_patch(Rectangle((s, c - bar / 2), n, bar, facecolor=REQUEST[0], edgecolor=TEXT, hatch="//",
                                 linewidth=0.8, gid=f"chunk-{c}"))
        left.text(s + n / 2, c, f"{n}", color=TEXT, bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.8},
                  **small)
        right.add_patch(Polygon([(s, s), (s, e), (e, e)], closed=True, facecolor=ATTENTION, edgecolor="none",
                                gid=f"diag-{c}"))
        right.add_patch(Polygon([(s, s), (e, s), (e, e)], closed=True, facecolor=WASTE, edgecolor="none",
                                gid=f"masked-{c}"))
        right.add_patch(Rectangle((0, s), e, n, facecolor="none", edgecolor=TEXT, linewidth=0.8, gid=f"rect-{c}"))
        if e < total:  # right of the rectangle: never computed (outlined, so white reads as a region)
            right.add_patch(Rectangle((e, s), total - e, n, facecolor=NEVER, edgecolor=TEXT, linewidth=0.5,
                                      gid=f"never-{c}"))
        right.text(total * 1.015, s + n / 2, f"{n} x {e:,}", ha="left", va="center", fontsize=MIN_FONT, color=TEXT)
    left.set(xlim=(0, total * 1.02), ylim=(len(spans) - 0.5, -0.7), yticks=range(len(spans)))
    left.set_yticklabels([f"forward {c}" for c in range(len(spans))], fontsize=MIN_FONT)
    left.set_xlabel("token of the prompt", fontsize=MIN_FONT)
    left.tick_params(axis="x", labelsize=MIN_FONT)
    left.set_title(f"{title_prefix}{total:,} tokens in {len(spans)} chunks: the KV cache grows", fontsize=10)
    right.add_patch(Rectangle((0, 0), total, total, facecolor="none", edgecolor=TEXT, linewidth=0.8, linestyle=":"))
    right.set(xlim=(0, total * 1.3), ylim=(total, 0), aspect="equal")
    right.set_xlabel("key (every token so far)", fontsize=MIN_FONT)
    right.set_ylabel("query (this chunk's tokens)", fontsize=MIN_FONT)
    right.tick_params(labelsize=MIN_FONT)
    fig.legend(handles=[Patch(facecolor=REQUEST[0], edgecolor=TEXT, hatch="//", label="chunk: computed now (hatched)"),
                        Patch(facecolor=OTHER, label="K, V read from the KV cache"),
                        Patch(facecolor=ATTENTION, label="score cell: useful (causal)"),
                        Patch(facecolor=WASTE, label="computed, then masked"),
                        Patch(facecolor=NEVER, edgecolor=TEXT, linewidth=0.8, label="never computed (outlined)")],
               loc="lower center", ncol=3, fontsize=MIN_FONT, frameon=False)
    right.set_title("score cells per head per layer:\neach chunk's rows x every key so far\n(counted in claim P4)",
                    fontsize=10)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.22, top=0.84, wspace=0.25)
    return fig


def chunk_timeline(runs: dict, seq_lens: Sequence[int], draft: int, behind: Sequence[int]) -> Figure:
    """Lesson 08 (P2, P5): each run's forwards one after another on one axis, the prompt tokens run so far.

    ``runs``: ``{label: timeline}``. One lane per run: every chunk a box as wide as its tokens (the draft's hatched,
    gid ``chunk-<lane>-<forward>-<request>``), a tick between forwards (``fwd-<lane>-<forward>``), a mark where each
    request of ``behind`` finishes (``done-<lane>-<request>``) and their mean (``mean-<lane>``); under each wide
    enough forward its number and score cells per head per layer (``serve.chunk_costs.forward_score_cells``).
    """
    total, pitch = sum(seq_lens), 1.5   # lanes 1.5 apart: a run's title clears the forward labels above it
    height = 1.7 * (pitch * (len(runs) - 1) + 1.65) + 1.65
    fig = Figure(figsize=(10, height))
    ax = fig.add_subplot()
    bar, small = 0.42, {"va": "center", "fontsize": MIN_FONT, "color": TEXT}
    for lane, (label, steps) in enumerate(runs.items()):
        y = lane * pitch
        x, start = 0, 0
        cells = forward_score_cells(steps)
        for f, fwd in enumerate(steps):
            for i, t in fwd:
                ax.add_patch(Rectangle((x, y - bar / 2), t, bar, facecolor=request_color(i),
                                       hatch="///" if i == draft else None, edgecolor="white", linewidth=0.5,
                                       gid=f"chunk-{lane}-{f}-{i}"))
                if t >= total / 60:
                    ax.text(x + t / 2, y, str(i), ha="center", **small,
                            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6} if i == draft else None)
                x += t
            ax.vlines(x, y - bar / 2 - 0.06, y + bar / 2 + 0.06, colors=TEXT, linewidth=1.6, gid=f"fwd-{lane}-{f}")
            if x - start >= total / 40:  # the forward's number (from 0, as the engine's stats count), below its boxes
                name = f"f{f}: {cells[f] / 1000:,.0f}k cells" if x - start >= total / 9 else f"f{f}\n{cells[f] / 1000:,.0f}k"
                ax.text((start + x) / 2, y + bar / 2 + 0.36, name, ha="center", gid=f"fnum-{lane}-{f}", **{**small, "va": "top"})
            start = x
        done = waits_of(steps)
        for i in behind:
            ax.plot([done[i][1]], [y + bar / 2 + 0.12], marker="v", color=TEXT, markersize=5, gid=f"done-{lane}-{i}")
        for x_done, count in Counter(done[i][1] for i in behind).items():  # marks in one forward overlap: count them
            if count > 1:
                ax.text(x_done + total * 0.004, y + bar / 2 + 0.12, f"×{count}", ha="left",
                        gid=f"count-{lane}-{x_done}", **small)
        sizes, waits = [sum(t for _, t in fwd) for fwd in steps], "no request arrived after the longest"
        if behind:  # the longest last: nothing behind it, no mean to mark
            _, mean_tokens = mean_wait(done, behind)
            ax.plot([mean_tokens], [y + bar / 2 + 0.2], marker="|", color=TEXT, markersize=14, markeredgewidth=2.5,
                    gid=f"mean-{lane}")
            waits = f"the {len(behind)} questions behind the draft finish after {mean_tokens:,.0f} tokens on average"
        ax.text(0, y - bar / 2 - 0.1, f"{label}: {len(sizes)} forwards, largest {max(sizes):,} tokens; {waits}",
                ha="left", va="bottom", fontsize=MIN_FONT, color=TEXT)
    ax.set(xlim=(0, total * 1.04), ylim=((len(runs) - 1) * pitch + 0.9, -0.75), yticks=[])
    ax.set_xlabel("prompt tokens run so far (forwards one after another, numbered f0, f1, ...; a black tick ends "
                  "a forward)", fontsize=MIN_FONT)
    ax.tick_params(axis="x", labelsize=MIN_FONT)
    fig.legend(handles=[Patch(facecolor=REQUEST[0], label="a request's chunk (two shades tell neighbours apart)"),
                        Patch(facecolor=REQUEST[0], hatch="///", edgecolor="white", label=f"the draft (request {draft})"),
                        Line2D([], [], marker="v", color=TEXT, linestyle="", label="a question behind it finishes"),
                        Line2D([], [], marker="|", color=TEXT, linestyle="", markersize=12, markeredgewidth=2.5,
                               label="their mean")],
               loc="lower center", ncol=2, fontsize=MIN_FONT, frameon=False)
    ax.set_title("The stream's forwards, prompt tokens on the x axis: the work done when each request finishes\n"
                 "(under each forward: its score cells per head per layer, whole blocks; they grow with the cache)",
                 fontsize=10)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=1.05 / height, top=1 - 0.6 / height)
    return fig


@register("08_chunk_staircase", lesson="08",
          caption="Lesson 06's 1,776-token draft prefilled alone in chunks of 512: the KV cache grows, and its "
                  "attention becomes a staircase of rectangles, each chunk's rows x every key so far (P4)")
def _chunk_staircase() -> Figure:
    chunks = [n for fwd in planned_timeline([stream()[0][draft_index()]], BUDGET, True) for _, n in fwd]
    return chunk_staircase(chunks, "the draft alone: ")


@register("08_chunk_timeline", lesson="08",
          caption="Lesson 06's stream chunked under 512 tokens per forward, and whole under 2,048: where each "
                  "request finishes, in prompt tokens run so far (P2, P5)")
def _chunk_timeline() -> Figure:
    lens = stream()[0]
    return chunk_timeline({f"chunked, {BUDGET} per forward": planned_timeline(lens, BUDGET, True),
                           f"whole prompts, {WHOLE_BUDGET:,} per forward": planned_timeline(lens, WHOLE_BUDGET, False)},
                          lens, draft_index(), behind(lens))


# ---- break it: the engine's named faults the claims guard against -------------------------------------------

# the bugs of the break-it cells, by the engine's fault names (``lessons_lib.faults``); exercise 08.3's bug
# report is one of them, under a neutral name so that the learner diagnoses it
BUGS = {"cache not appended": "chunk_ignores_cached_keys", "causal top-left": "causal_mask_top_left",
        "chunk takes a whole budget": "chunk_takes_whole_budget",
        "chunked request to the back": "chunked_request_to_the_back", "bug report": "chunk_positions_restart_at_zero"}
REPORTED_BUG = "bug report"
EXPLORER_BUGS = ("none", *BUGS)   # the explorer's bug menu

# A small model (2 layers, d_model 64) for the break-it cells, exercise 08.3 and the max_num_seqs rerun, and a
# smaller one (1 layer, d_model 32) for the explorer, which runs the engine on every move: the forwards, chunks and
# score cells per head per layer do not depend on the model's size; the errors, the cache bytes and the times do.
EXPLORER_CFG = ModelConfig(n_layers=2, d_model=64, n_heads=2, d_head=32, d_ffn=256, vocab_size=512, max_position=8192)
EXPLORE_RUN_CFG = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=512, max_position=8192)


@functools.cache
def weights_of(cfg: ModelConfig) -> dict:
    """``init_weights(cfg, 0)``, made once per config."""
    return init_weights(cfg, 0)


def broken(bug: str):
    """``with broken("causal top-left"): ...``: the engine runs with that bug (a key of ``BUGS``) inside the block."""
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose one of {sorted(BUGS)}")
    return faults.injected(BUGS[bug])


def reported_bug():
    """``with reported_bug(): ...``: the engine as exercise 08.3's bug report ran it ("chunked prefill is wrong after
    the first chunk"), inside the block only."""
    return broken(REPORTED_BUG)


def recorded_draft_blocks() -> list[tuple[int, int]]:
    """The draft served alone, chunked under ``BUDGET`` on ``EXPLORER_CFG`` under the op recorder: the ``(L_q, L_k)``
    of its score matrix in each forward, layer 0's (run it inside ``broken(...)`` to see what a bug does)."""
    cfg = EXPLORER_CFG
    run = serve([stream(cfg)[1][draft_index()]], BUDGET, True, cfg, weights_of(cfg), compute_logits=False, record=True)
    return recorded_blocks(run)[::cfg.n_layers]


@functools.lru_cache(maxsize=32)
def _unchunked(cfg: ModelConfig, prompts: tuple, return_hidden: bool = False) -> dict:
    """``prompts`` (a tuple of token-id tuples) prefilled whole on ``cfg``, computed once: ``{"budget": the smallest
    power of two that admits the longest, "whole": float32 run, "truth": float64 run}`` (no chunking bug touches
    them)."""
    budget = 1 << (max(map(len, prompts)) - 1).bit_length()
    runs = {key: serve(prompts, budget, False, cfg, weights_of(cfg), dtype=dt, compute_logits=False,
                       return_hidden=return_hidden) for key, dt in (("whole", torch.float32), ("truth", torch.float64))}
    return {"budget": budget, **runs}


def chunk_error_table(prompt: Sequence[int] | None = None) -> str:
    """One prompt (default: the draft; ids taken modulo the vocabulary) served on ``EXPLORER_CFG`` chunked under
    ``BUDGET`` and whole: for each chunk, the max error of its final hidden rows against the float64 unchunked
    prefill beside the tolerance rule's bound, ✓ or ✗."""
    cfg = EXPLORER_CFG
    ids = tuple(t % cfg.vocab_size for t in (prompt if prompt is not None else stream(cfg)[1][draft_index()]))
    chunked = serve([ids], BUDGET, True, cfg, weights_of(cfg), compute_logits=False, return_hidden=True)
    whole = _unchunked(cfg, (ids,), True)
    spans = [(s, n) for st in chunked["stats"] for _, s, n in st.chunks]
    lines = [f"{len(ids):,} tokens in {len(spans)} chunks ({cfg.n_layers} layers, d_model {cfg.d_model}, "
             f"{cfg.n_heads} heads of {cfg.d_head}):"]
    for c, (s, n) in enumerate(spans):
        err, bound = error_and_bound(*(r["outputs"][0].hidden[s:s + n] for r in (chunked, whole["whole"], whole["truth"])))
        lines.append(f"  chunk {c} (rows {s:4d}..{s + n - 1:4d}): max |chunked - fp64| = {err:8.1e}, allowed "
                     f"{bound:.1e} {'✓' if err <= bound else '✗'}")
    return "\n".join(lines)


# ---- the explorer: the engine's chunked run of a workload, against whole prompts ---------------------------


def chunked_plan_state(workload: str = "long-tail", num_requests: int = 16, max_num_batched_tokens: int = 512,
                       seed: int = 3, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, bug: str = "none") -> dict:
    """A seeded stream of ``workload`` served by ``Engine`` on ``EXPLORE_RUN_CFG``, chunked under
    ``max_num_batched_tokens`` with ``bug`` (one of ``EXPLORER_BUGS``) on, and whole (float32 and float64).

    Keys: ``seq_lens``, ``longest``, ``behind``, ``whole_budget``, ``bug``, ``chunks`` and ``errors`` (``{request:
    (max |chunked last hidden - fp64 whole|, bound)}``) of the requests cut into chunks, and per run (``"chunked"``,
    ``"whole"``) its ``budget`` and ``serve.runs.run_summary`` of the requests behind the longest; the chunked run
    also ``cells_causal_masks`` (``causal_cells_from_masks`` with the bug still on)."""
    if bug not in EXPLORER_BUGS:
        raise ValueError(f"bug must be one of {EXPLORER_BUGS}, got {bug!r}")
    n = check_int("num_requests", num_requests, 1, 256)
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens, 1, 1 << 16)
    lens, prompts = workloads.preset_stream(workload, n, seed, EXPLORE_RUN_CFG.vocab_size)   # checks the workload
    whole = _unchunked(EXPLORE_RUN_CFG, tuple(map(tuple, prompts)))
    longest = max(range(n), key=lambda i: (lens[i], -i))
    after = list(range(longest + 1, n))
    with contextlib.nullcontext() if bug == "none" else broken(bug):
        run = serve(prompts, budget, True, EXPLORE_RUN_CFG, weights_of(EXPLORE_RUN_CFG), max_num_seqs=max_num_seqs,
                    compute_logits=False)
        masks_causal = causal_cells_from_masks(run["stats"])
    state = {"workload": workload, "seq_lens": lens, "longest": longest, "behind": after, "bug": bug,
             "max_num_batched_tokens": budget, "whole_budget": whole["budget"],
             "chunked": {**run_summary(run, after), "budget": budget, "cells_causal_masks": masks_causal},
             "whole": {**run_summary(whole["whole"], after), "budget": whole["budget"]}}
    state["chunks"] = state["chunked"]["chunks"]
    state["errors"] = {i: error_and_bound(*(r["outputs"][i].last_hidden for r in (run, whole["whole"], whole["truth"])))
                       for i in state["chunks"]}
    return state


def chunked_plan_html(state: dict) -> str:
    """The explorer's readout: one ``<div>`` per run (forwards, largest, the wait of the requests behind the
    longest, cells, cache), one for the longest request, one with each chunked request's error against the
    unchunked prefill, then the measured times (noisy)."""
    lens, i = state["seq_lens"], state["longest"]
    lines = []
    for name in ("chunked", "whole"):
        r, masks = state[name], ""
        f, t = r["mean_behind"]
        if name == "chunked":
            masks = (f" | causal cells its chunks' masks keep (the engine's mask function, bug "
                     f"{'off' if state['bug'] == 'none' else 'on'}): {r['cells_causal_masks']:,}")
        if name == "whole" and r["budget"] < state["chunked"]["budget"]:
            masks = (f" | the whole run's budget is the smallest power of two admitting the longest prompt, "
                     f"{r['budget']:,}: smaller than the chunk budget here")
        wait = (f"the {len(state['behind'])} requests behind the longest wait {f:.1f} forwards, {t:,.0f} tokens on "
                f"average" if state["behind"] else "no request arrived after the longest")
        lines.append(f"<div>{name} (budget {r['budget']:,}): {len(r['timeline'])} forwards, largest {r['max_forward']:,} "
                     f"tokens | {wait} | score cells {r['cells_whole']:,} (whole blocks), "
                     f"{r['cells_causal']:,} causal | cache read {r['cached_tokens']:,} rows, peak "
                     f"{r['kv_cache_peak_bytes']:,} B | scheduled (BatchStats): forwards, cells, cache rows{masks}</div>")
    ch = [f for f, fwd in enumerate(state["chunked"]["timeline"]) if i in dict(fwd)]
    lines.append(f"<div>the longest, request {i} ({lens[i]:,} tokens): chunked, in forwards {ch[0]}..{ch[-1]} "
                 f"({len(ch)} chunks); whole, in forward {state['whole']['waits'][i][0] - 1}</div>")
    errs = state["errors"]
    shown = [f"{j} ({state['chunks'][j]} chunks) {e:.1e} {'≤' if e <= b else '>'} {b:.1e} {'✓' if e <= b else '✗'}"
             for j, (e, b) in errs.items()]
    lines.append(f"<div>bug: {state['bug']} | measured: max |chunked last hidden - fp64 unchunked| of each request cut into "
                 f"chunks, against the tolerance rule's bound: {', '.join(shown[:8]) or 'no request was cut'}"
                 f"{f', {len(errs) - 8} more' if len(errs) > 8 else ''} | "
                 f"{sum(e > b for e, b in errs.values())} of {len(errs)} wrong</div>")
    ms, wms = sorted(state["chunked"]["forward_ms"]), sorted(state["whole"]["forward_ms"])
    lines.append(f"<div>measured wall time per forward (this CPU, small model, noisy): chunked median "
                 f"{ms[len(ms) // 2]:.1f} ms, longest {ms[-1]:.1f} ms over {len(ms)}; whole (run once per stream) "
                 f"median {wms[len(wms) // 2]:.1f} ms, longest {wms[-1]:.1f} ms over {len(wms)}</div>")
    return "".join(lines)


def chunked_plan_explorer(workload: str = "long-tail", num_requests: int = 16, max_num_batched_tokens: int = 512):
    """VBox class ``cpx``: Dropdowns ``cpx-workload`` and ``cpx-bug`` (``EXPLORER_BUGS``), IntSliders
    ``cpx-num-requests`` (1..64) and ``cpx-budget`` (128..2048, steps of 16), HTML ``cpx-counts``
    (``chunked_plan_html``; "running..." while the engine runs), Output ``cpx-figure`` (``chunk_timeline``)."""
    w = ipywidgets_module()
    kind = tagged(w.Dropdown(options=list(workloads.WORKLOAD_PRESETS), value=workload, description="workload"), "cpx-workload")
    reqs = tagged(w.IntSlider(value=num_requests, min=1, max=64, description="requests"), "cpx-num-requests")
    # below 128 tokens a move runs hundreds of forwards: over 2 s on a busy CPU
    budget = tagged(w.IntSlider(value=max_num_batched_tokens, min=128, max=2048, step=16, description="chunk budget"),
                    "cpx-budget")
    bug = tagged(w.Dropdown(options=list(EXPLORER_BUGS), value="none", description="bug"), "cpx-bug")
    text, out = tagged(w.HTML(), "cpx-counts"), tagged(w.Output(), "cpx-figure")

    def update(change=None):
        text.value = "<div>running...</div>" + text.value
        try:
            state = chunked_plan_state(kind.value, reqs.value, budget.value, bug=bug.value)
            fig = chunk_timeline({f"chunked, {state['max_num_batched_tokens']:,}": state["chunked"]["timeline"],
                                  f"whole, {state['whole_budget']:,}": state["whole"]["timeline"]},
                                 state["seq_lens"], state["longest"], state["behind"])
        except ValueError as e:  # say so, rather than leave the last figure under a new readout
            text.value, out.outputs = f"<div>error: {html.escape(str(e))}</div>", ()
            return
        text.value = chunked_plan_html(state)
        show_figure(out, fig)

    return explorer("cpx", [kind, reqs, budget, bug], [text, out], update)


# ---- exercise 08.1: a chunk cap (vLLM's long_prefill_token_threshold) --------------------------------------

def _capped_cases() -> list[tuple]:
    return [(stream()[0], BUDGET, 256, 128),      # lesson 06's stream: the draft capped at 128 a forward
            ([3, 1, 2], 1, 256, 1),                    # budget 1
            ([700, 40, 30], 256, 256, 256),            # cap = budget: the cap changes nothing
            ([700, 40, 30], 256, 256, 1000),           # cap > budget: still nothing
            ([600, 10, 10, 10], 200, 2, 64),           # max_num_seqs closes a forward that still has room
            ([300, 50, 500, 20], 256, 256, 100),       # two long prompts capped, short ones between them
            ([90, 5], 64, 256, 0)]                     # cap 0: no cap (vLLM's default)


def check_capped_scheduler(fn) -> bool:
    """Exercise 08.1: ``fn(seq_lens, max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold)`` →
    forwards of chunked prefill with a per-request chunk cap, on 7 cases; any schedule keeping the rules of
    ``serve.scheduler.chunked_schedule_problem`` passes."""
    return grade("capped_scheduler", fn, _capped_cases(), chunked_schedule_problem,
                 "chunked prefill with a chunk cap on 7 cases: the cap, both budgets, arrival order, the room filled, cap 0")


def capped_finish(fn, cap: int, max_num_batched_tokens: int = BUDGET) -> dict:
    """The stream under ``fn``'s capped scheduler, read by ``serve.chunk_costs.draft_finish``: ``{"draft": forward
    its last chunk runs in, "before": how many of the questions behind it finish in an earlier forward, "forwards":
    how many forwards}`` (counted from 1)."""
    lens = stream()[0]
    return draft_finish(fn(lens, max_num_batched_tokens, DEFAULT_MAX_NUM_SEQS, cap), draft_index(), behind(lens))


def engine_capped_finish(cap: int, max_num_batched_tokens: int = BUDGET) -> dict:
    """``capped_finish`` of the stream as ``Engine`` serves it with ``Scheduler(long_prefill_token_threshold=cap)``
    (cap 0: none), on the small model: the engine's own forwards (``BatchStats``)."""
    sched = Scheduler(max_num_batched_tokens, DEFAULT_MAX_NUM_SEQS, enable_chunked_prefill=True,
                      long_prefill_token_threshold=cap or None)
    run = serve(stream(EXPLORER_CFG)[1], max_num_batched_tokens, True, EXPLORER_CFG, weights_of(EXPLORER_CFG),
                compute_logits=False, scheduler=sched)
    return draft_finish(timeline(run["stats"]), draft_index(), behind(stream()[0]))


# ---- exercise 08.2: a budget chosen for what chunking really costs ----------------------------------------

BUDGET_STEP = 16    # the budgets exercise 08.2 chooses from: multiples of 16
MAX_PROBES = 3      # engine measurements exercise 08.2 allows per case
# (seq_lens, draft, max_budget, max_cache_rows), or ("stream", max_budget, max_cache_rows) for lesson 06's stream
_BUDGET_CASES = [("stream", 768, 1400), ("stream", 512, 1600), ("stream", 768, 2000), ([450, 100, 30, 700, 60], 3, 512, 400),
                 ([100, 412, 1000, 40, 40], 2, 512, 600), ([60, 2000, 30], 1, 1024, 1400), ([90, 700, 10, 10], 1, 256, 600),
                 ([5, 7, 20, 3], 2, 64, 0)]


def budget_prices(seq_lens: Sequence[int], draft: int, max_num_batched_tokens: int, engine: bool = False) -> dict:
    """What serving ``seq_lens`` chunked under ``max_num_batched_tokens`` costs, by the engine's scheduler plan
    (``plan_batches``), or with ``engine=True`` as ``Engine`` ran it (its ``BatchStats``, on ``EXPLORE_RUN_CFG``):
    ``budget`` and ``serve.chunk_costs.plan_prices`` (the S1 model's all-reduces at TP=2; the wait of the requests
    behind ``draft``)."""
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens, 1, 1 << 16)
    if engine:
        prompts = workloads.make_requests(list(seq_lens), EXPLORE_RUN_CFG.vocab_size, seed=workloads.PREFILL_STREAM_PROMPT_SEED)
        run = serve(prompts, budget, True, EXPLORE_RUN_CFG, weights_of(EXPLORE_RUN_CFG), compute_logits=False)
        plan = [s.chunks for s in run["stats"]]
    else:
        plan = plan_batches(list(seq_lens), budget, enable_chunked_prefill=True)
    return {"budget": budget, **plan_prices(plan, seq_lens, range(draft + 1, len(seq_lens)), ModelConfig().n_layers)}


def budget_table(budgets: Sequence[int]) -> str:
    """``budget_prices`` of lesson 06's stream under each budget, one line each."""
    head = (f"{'budget':>6s} {'forwards':>8s} {'all-reduces':>11s} {'largest':>7s} {'cache held':>10s} "
            f"{'wait (fwd)':>10s} {'wait (tok)':>10s}")
    rows = [budget_prices(stream()[0], draft_index(), b) for b in budgets]
    return "\n".join([head] + [f"{m['budget']:6d} {m['forwards']:8d} {m['all_reduces']:11d} {m['largest']:7d} "
                               f"{m['cache_rows_held']:10,d} {m['wait_forwards']:10.2f} {m['wait_tokens']:10,.0f}"
                               for m in rows])


def _prices_text(p: dict) -> str:
    return (f"under {p['budget']}: {p['forwards']} forwards ({p['all_reduces']} all-reduces at TP=2), "
            f"{p['cache_rows_held']:,} cache rows held between forwards, the requests behind the draft wait "
            f"{p['wait_tokens']:,.1f} tokens")


def check_budget_choice(fn) -> bool:
    """Exercise 08.2: ``fn(seq_lens, draft, max_budget, max_cache_rows, measure) -> max_num_batched_tokens``: the
    multiple of ``BUDGET_STEP`` up to ``max_budget`` within ``max_cache_rows`` held between forwards with the fewest
    forwards; ties: the least mean wait in tokens behind ``draft``, then the smaller budget (``fewest_forwards_budget``).
    ``measure(budget)`` returns ``budget_prices``' forwards, cache rows held and wait, at most ``MAX_PROBES`` calls a
    case; the engine's scheduler is off while ``fn`` runs (fault ``scheduler_refused``). Eight cases; the stream's
    answer is then served by ``Engine`` itself."""
    probes: list[int] = []

    def expand(case):
        return (stream()[0], draft_index(), *case[1:]) if case[0] == "stream" else case

    def run(*case):
        seq_lens, d, top, cap = expand(case)
        probes.clear()
        table = {b: budget_prices(seq_lens, d, b) for b in range(BUDGET_STEP, top + 1, BUDGET_STEP)}  # planned now

        def measure(budget):
            budget = check_int("budget", budget, 1, 1 << 16)
            probes.append(budget)
            if len(probes) > MAX_PROBES:
                raise RuntimeError(f"measure was called {len(probes)} times (budgets {probes}): at most {MAX_PROBES} - "
                                   "work out where each forward ends from the lengths, and measure only to confirm")
            if budget not in table:
                raise RuntimeError(f"measure({budget}): the budgets of this case are the multiples of {BUDGET_STEP} "
                                   f"from {BUDGET_STEP} to {top}")
            return {k: table[budget][k] for k in ("forwards", "cache_rows_held", "wait_tokens")}
        with faults.injected("scheduler_refused"):
            return fn(list(seq_lens), d, top, cap, measure)

    def judge(got, *case):
        seq_lens, d, top, cap = expand(case)
        if isinstance(got, bool) or not isinstance(got, int):
            return f"expected an int (a max_num_batched_tokens), got {got!r}"[:200]
        if not (BUDGET_STEP <= got <= top and got % BUDGET_STEP == 0):
            return f"got {got}: the budget is a multiple of {BUDGET_STEP} from {BUDGET_STEP} to {top}"
        want = fewest_forwards_budget(seq_lens, range(d + 1, len(seq_lens)), top, cap, BUDGET_STEP)
        mine, best = budget_prices(seq_lens, d, got), budget_prices(seq_lens, d, want)
        if case[0] == "stream":   # served by Engine itself, beside the plan at the lesson's budget
            print(f"  Engine {_prices_text(budget_prices(seq_lens, d, got, engine=True))} | planned "
                  f"{_prices_text(budget_prices(seq_lens, d, BUDGET))}")
        if got == want:
            return None
        ctx = f"{sum(seq_lens):,} tokens, cache limit {cap:,} rows; {_prices_text(mine)}; {_prices_text(best)}"
        if mine["cache_rows_held"] > cap:
            return (ctx + f". Over the limit: request {mine['held_by']} has {mine['cache_rows_held']:,} rows cached after "
                    f"forward {mine['held_after']}: a boundary between forwards falls late in a long prompt")
        if mine["forwards"] > best["forwards"]:
            return ctx + ". Each extra forward pays a pass over the weights, its all-reduces and its launches again"
        if round(mine["wait_tokens"], 6) > round(best["wait_tokens"], 6):
            return ctx + ". The same forwards: the tie goes to the shorter wait of the requests behind the draft"
        return ctx + f". The same forwards and wait: the tie goes to the smaller budget, {want} (shorter steps)"
    return grade("budget_choice", run, _BUDGET_CASES, judge,
                 f"the fewest forwards within the cache, on {len(_BUDGET_CASES)} streams, the stream's run by Engine")


# ---- exercise 08.3: a bug report ----------------------------------------------------------------

_POSITION_CASES = [([14, 0, 0], [83, 36, 41]), ([0], [5]), ([512], [512]), ([1750, 0, 0], [26, 80, 45]),
                   ([7, 3], [1, 2])]
ENGINE_POSITIONS_CASE = "the draft, chunked under 512 on the small model, with your answer in every forward"


def _draft_with_positions(fn) -> dict:
    """The draft served chunked on ``EXPLORER_CFG`` with ``fn(num_computed_tokens, seq_lens)`` giving every forward's
    positions, and unchunked: ``{"chunked", "whole", "truth"}`` last hidden states ``[1, d]``."""
    class LearnersPositions(Engine):   # vLLM's prepare_inputs, the positions replaced by the learner's
        def prepare_inputs(self, chunks):
            batch = super().prepare_inputs(chunks)
            got = fn(list(batch.num_computed_tokens), list(batch.seq_lens))
            return dataclasses.replace(batch, positions=torch.as_tensor(got, dtype=torch.int64))

    prompt = stream(EXPLORER_CFG)[1][draft_index()]
    run = serve([prompt], BUDGET, True, EXPLORER_CFG, weights_of(EXPLORER_CFG), compute_logits=False,
                engine_class=LearnersPositions)
    whole = _unchunked(EXPLORER_CFG, (tuple(prompt),), True)
    return {"chunked": stacked(run, "last_hidden"), **{k: whole[k]["outputs"][0].hidden[-1:] for k in ("whole", "truth")}}


def check_bug_report_fix(fn) -> bool:
    """Exercise 08.3: ``fn(num_computed_tokens, seq_lens)``: the quantity of a flat chunked batch that the bug
    report's engine (``reported_bug``) gets wrong, as the intact engine computes it. Five batches against the
    engine's own ``pack``; then the draft served chunked on ``EXPLORER_CFG`` with YOUR tensor in every forward,
    against its unchunked prefill (the tolerance rule). Another input of the forward (``cu_seqlens_q``/``_k``, a
    mask) is told what the instruments say about it."""
    def run(done, lens=None):
        return _draft_with_positions(fn) if done == ENGINE_POSITIONS_CASE else fn(list(done), list(lens))

    def judge(got, done, lens=None):
        if done == ENGINE_POSITIONS_CASE:
            err, bound = error_and_bound(got["chunked"], got["whole"], got["truth"])
            return None if err <= bound else (f"inside the engine the draft's last hidden state is off by {err:.2g} "
                                              f"(allowed {bound:.1g})")
        want = pack([[0] * n for n in lens], num_computed_tokens=list(done)).positions
        if not isinstance(got, Tensor):
            return f"expected a tensor (the quantity of the batch the broken engine gets wrong), got {type(got).__name__}"
        cu_q = torch.cumsum(torch.tensor([0, *lens]), 0)
        cu_k = torch.cumsum(torch.tensor([0, *(c + n for c, n in zip(done, lens))]), 0)
        for name, cu in (("cu_seqlens_k", cu_k), ("cu_seqlens_q", cu_q)):
            if got.dim() == 1 and got.shape == cu.shape and torch.equal(got.long(), cu):
                return (f"that is {name}, and the broken engine gets it right: under reported_bug() the recorder's "
                        "blocks (recorded_draft_blocks) are n x (s + n), exactly the intact ones. Rule out the next "
                        "suspect")
        if got.dim() == 2 and got.dtype == torch.bool:
            return ("a mask: the broken engine's masks are right, chunk_mask and chunk_rows_error give the intact "
                    "answer under reported_bug(), and attention alone matches the whole prompt. What else does a "
                    "forward take per row?")
        if tuple(got.shape) != tuple(want.shape):
            return f"shape {list(got.shape)}, expected [{sum(lens)}]: one value per row of the flat batch"
        if got.dtype != torch.int64:
            return f"dtype {got.dtype}, expected torch.int64 (an index into the position embeddings)"
        known = [(want, None),
                 (torch.cat([torch.arange(n) for n in lens]), "positions restart at 0 in every chunk: that is what the "
                  "bug report's engine does - the second chunk's tokens get the embeddings of positions 0, 1, ... and "
                  "the model reads them as the start of a new prompt; start request i at num_computed_tokens[i]"),
                 (torch.arange(sum(lens)), "positions run 0..T-1 across the whole batch: they restart for every "
                  "REQUEST, at its cached length"),
                 (want + 1, "off by one: the first new token of a request with c cached tokens sits at position c "
                  "(0-based)")]
        return next((hint for tensor, hint in known if torch.equal(got, tensor)),
                    f"values {got.tolist()[:12]}..., the engine's are {want.tolist()[:12]}...")

    return grade("bug_report_fix", run, [*_POSITION_CASES, (ENGINE_POSITIONS_CASE,)], judge,
                 "the quantity the bug report's engine gets wrong, on 5 chunked batches as the engine's pack gives "
                 "it, and the draft served chunked with yours equals its unchunked prefill")
