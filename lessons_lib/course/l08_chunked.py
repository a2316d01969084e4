"""What lesson 08 (chunked prefill: when a prompt does not fit) draws, explores and checks.

  the hook          ``refusal``: the capstone's engine refusing lesson 06's 1,776-token draft
  one chunk         ``chunk_mask`` / ``mask_text`` / ``chunk_rows_match``: a chunk's causal mask over every key
                    so far (``attention.block_diag_mask`` with ``cu_seqlens_k``, bottom-right aligned);
                    ``chunk_spans``, ``staircase_cells``: the rectangles and their cells
  the engine        ``serve`` (Engine, chunked or whole; the op recorder; rank 0's TP trace), ``timeline``,
                    ``stacked``, ``error_and_bound``, ``recorded_cells`` / ``recorded_blocks`` /
                    ``recorded_cached_rows`` (what attention really ran), ``trace_text``, ``payloads_match``
  waits             ``request_waits``, ``mean_wait``, ``behind``: derived from the engine's forwards only
  figures           ``chunk_staircase`` (08_chunk_staircase), ``chunk_timeline`` (08_chunk_timeline)
  break it          ``BUGS``, ``install``, ``broken``, ``chunk_error_table`` (also tests/breakages_l08.py)
  explorer          ``chunked_plan_state`` / ``chunked_plan_html`` / ``chunked_plan_explorer`` (runs the engine)
  exercises         ``check_capped_scheduler`` (08.1; ``check_chunk_scheduler`` for the plain rule),
                    ``check_budget_choice`` (08.2; ``budget_measures`` / ``budget_table`` to compare budgets),
                    ``check_bug_report_fix`` (08.3)

Taught in notebooks/08_chunked_prefill.ipynb.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Polygon, Rectangle

from ..core.attention import block_diag_mask, varlen_attention
from ..core.config import ModelConfig
from ..core.model import init_weights
from ..measure.flops import linear_intensity
from ..measure.recorder import OpRecorder
from ..measure.tolerance import assert_close, max_abs_diff, tolerance
from ..serve.engine import Engine
from ..serve.scheduler import Request, plan_batches
from ..serve.workloads import make_requests
from ..style import ATTENTION, MIN_FONT, NEVER, OTHER, REQUEST, TEXT, WASTE, request_color
from ..validate import check_int
from . import l06_engine
from .explore import explorer, show_figure
from .figures import register
from .grading import grade
from .l00_setup import NVLINK, AlphaBeta, crossover_tokens, ring_time_terms
from .l05_flops import H200_BYTES_PER_S, H200_PEAK_FLOPS

Tensor = torch.Tensor

BUDGET = l06_engine.ENGINE_STREAM["max_num_batched_tokens"]   # lesson 06's 512 prompt tokens per forward


def stream_lengths() -> list[int]:
    """Lesson 06's 24 prompt lengths, in arrival order (the 1,776-token draft included)."""
    return l06_engine.stream_prompts()[0]


def draft_index() -> int:
    """The stream's request that lesson 06 refused: the one longer than the budget."""
    (i,) = [i for i, n in enumerate(stream_lengths()) if n > BUDGET]
    return i


def refusal(cfg: ModelConfig | None = None, weights: dict | None = None, max_num_batched_tokens: int = BUDGET) -> str:
    """The capstone's engine (whole prompts only) refusing the draft at submit: its error message."""
    cfg = cfg or ModelConfig()
    _, prompts = l06_engine.stream_prompts(cfg)
    engine = Engine(cfg, weights=weights if weights is not None else init_weights(cfg, 0), device="cpu", dtype=torch.float32,
                    max_num_batched_tokens=max_num_batched_tokens)
    i = draft_index()
    try:
        engine.submit(Request(i, prompts[i]))
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"the engine accepted request {i} ({len(prompts[i])} tokens) under a budget of "
                         f"{max_num_batched_tokens}")


# ---- one chunk's mask: rows of this chunk, keys of everything so far -------------------------------------

def chunk_mask(start: int, length: int) -> Tensor:
    """``[length, start + length]`` bool: which keys the queries of tokens ``start .. start+length-1`` of one
    prompt may read. The keys are every token so far (``start`` of them from the KV cache, then the chunk's
    own), so ``cu_seqlens_q = [0, length]`` and ``cu_seqlens_k = [0, start + length]``: the engine's own
    ``block_diag_mask``, causal, aligned bottom-right (query i sees keys ``0 .. start + i``)."""
    start, length = check_int("start", start, 0), check_int("length", length, 1)
    return block_diag_mask([0, length], causal=True, cu_seqlens_k=[0, start + length])


def chunk_spans(chunks: Sequence[int]) -> list[tuple[int, int]]:
    """``[n_0, n_1, ...]`` chunk lengths of one prompt → ``[(start, length), ...]``: chunk c starts after the
    tokens already in the KV cache."""
    spans, start = [], 0
    for c, n in enumerate(chunks):
        spans.append((start, check_int(f"chunks[{c}]", n, 1)))
        start += n
    return spans


def staircase_cells(chunks: Sequence[int]) -> dict:
    """Score cells per head per layer of one prompt run in ``chunks``, counted from the chunks' masks
    (``chunk_mask``): ``computed`` (each chunk's rows × every key so far: whole rectangles), ``allowed``
    (the causal cells the masks keep) and ``masked`` (computed, then masked: above each chunk's diagonal)."""
    computed = allowed = 0
    for start, n in chunk_spans(chunks):
        m = chunk_mask(start, n)
        computed += m.numel()
        allowed += int(m.sum())
    return {"computed": computed, "allowed": allowed, "masked": computed - allowed}


# ---- figure: one prompt cut into chunks ----------------------------------------------------------------

def chunk_staircase(chunks: Sequence[int], title_prefix: str = "") -> Figure:
    """Lesson 08: one prompt of ``L = Σ chunks`` tokens prefilled in chunks.

    Left: one row per forward, the chunk's tokens computed now in orange (gid ``chunk-c``) after the
    tokens read back from the KV cache in grey (``cache-c``). Right: the prompt's ``L × L`` score
    matrix per head per layer; chunk c computes its rows × every key so far, a rectangle: the keys
    from the cache all allowed (blue, ``cached-c``), its own square causal (blue below the diagonal,
    ``diag-c``, vermillion above it: computed, then masked, ``masked-c``). White: never computed
    (the unchunked whole-block kernel computes it, and masks it).
    """
    spans = chunk_spans(chunks)
    total = spans[-1][0] + spans[-1][1]
    fig = Figure(figsize=(10, 5.2))
    left, right = fig.subplots(1, 2, width_ratios=[1.15, 1])
    bar = 0.6
    for c, (s, n) in enumerate(spans):
        if s:
            left.add_patch(Rectangle((0, c - bar / 2), s, bar, facecolor=OTHER, edgecolor="white", gid=f"cache-{c}"))
        left.add_patch(Rectangle((s, c - bar / 2), n, bar, facecolor=REQUEST[0], edgecolor=TEXT, hatch="//",
                                 linewidth=0.8, gid=f"chunk-{c}"))
        left.text(s + n / 2, c, f"{n}", ha="center", va="center", fontsize=MIN_FONT, color=TEXT,
                  bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.8})
        if s:
            left.text(s / 2, c, f"{s} cached", ha="center", va="center", fontsize=MIN_FONT, color="white")
    left.set_xlim(0, total * 1.02)
    left.set_ylim(len(spans) - 0.5, -0.7)
    left.set_yticks(range(len(spans)))
    left.set_yticklabels([f"forward {c}" for c in range(len(spans))], fontsize=MIN_FONT)
    left.set_xlabel("token of the prompt", fontsize=MIN_FONT)
    left.tick_params(axis="x", labelsize=MIN_FONT)
    left.set_title(f"{title_prefix}{total:,} tokens in {len(spans)} chunks: the KV cache grows", fontsize=10)
    for c, (s, n) in enumerate(spans):
        e = s + n
        if s:
            right.add_patch(Rectangle((0, s), s, n, facecolor=ATTENTION, edgecolor="none", gid=f"cached-{c}"))
        right.add_patch(Polygon([(s, s), (s, e), (e, e)], closed=True, facecolor=ATTENTION, edgecolor="none",
                                gid=f"diag-{c}"))
        right.add_patch(Polygon([(s, s), (e, s), (e, e)], closed=True, facecolor=WASTE, edgecolor="none",
                                gid=f"masked-{c}"))
        right.add_patch(Rectangle((0, s), e, n, facecolor="none", edgecolor=TEXT, linewidth=0.8, gid=f"rect-{c}"))
        if e < total:  # right of the rectangle: never computed (outlined, so white reads as a region)
            right.add_patch(Rectangle((e, s), total - e, n, facecolor=NEVER, edgecolor=TEXT, linewidth=0.5,
                                      gid=f"never-{c}"))
        right.text(total * 1.015, s + n / 2, f"{n} x {e:,}", ha="left", va="center",
                   fontsize=MIN_FONT, color=TEXT)
    right.add_patch(Rectangle((0, 0), total, total, facecolor="none", edgecolor=TEXT, linewidth=0.8,
                              linestyle=":"))
    right.set_xlim(0, total * 1.3)
    right.set_ylim(total, 0)
    right.set_aspect("equal")
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


# ---- the rules every chunked schedule keeps (exercise 08.1's checker and the FCFS validator below) -------

def schedule_format_problem(forwards) -> str | None:
    """What makes ``forwards`` not a list of forwards of ``(request index, num_tokens)`` int pairs, or None."""
    if not isinstance(forwards, (list, tuple)) or not all(isinstance(f, (list, tuple)) for f in forwards):
        return f"expected a list of forwards, each a list of (request, num_tokens) pairs, got {forwards!r}"[:300]
    pairs = [c for f in forwards for c in f]
    if not all(isinstance(c, (list, tuple)) and len(c) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                     for x in c) for c in pairs):
        return ("each chunk is a pair (request index, num_tokens) of ints: a chunked forward says how many tokens "
                "each request runs")
    return None


def forward_problem(f: int, fwd, left: Sequence[int], seq_lens: Sequence[int], max_num_batched_tokens: int,
                    max_num_seqs: int, cap: int = 0) -> str | None:
    """The first rule forward ``f`` breaks whatever the policy, or None: not empty, one chunk per request, known
    requests, at least one token a chunk and never past the ``left`` tokens of a prompt, no chunk over ``cap``
    (0: no cap), within ``max_num_batched_tokens`` and ``max_num_seqs``. ``left`` is not changed."""
    n = len(seq_lens)
    if not fwd:
        return f"forward {f} is empty: every forward carries at least one chunk"
    ids = [i for i, _ in fwd]
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        return f"forward {f} holds request {twice} twice: one chunk per request per forward"
    for i, t in fwd:
        if not 0 <= i < n:
            return f"forward {f}: unknown request {i} (requests are 0 .. {n - 1})"
        if t < 1:
            return f"forward {f}: request {i} gets {t} tokens: a chunk holds at least one token"
        if t > left[i]:
            return (f"forward {f}: request {i} gets {t} tokens but only {left[i]} of its {seq_lens[i]} are left: "
                    "a chunk continues where the cache ends, never past the prompt")
        if cap and t > cap:
            return (f"forward {f}: request {i} runs {t} tokens > long_prefill_token_threshold={cap}: no chunk may "
                    "exceed the cap")
    tokens = sum(t for _, t in fwd)
    if tokens > max_num_batched_tokens:
        return (f"forward {f} holds {tokens} tokens > max_num_batched_tokens={max_num_batched_tokens}: the chunk "
                "of the request that does not fit is the room LEFT in this forward, not a whole budget")
    if len(fwd) > max_num_seqs:
        return f"forward {f} holds {len(fwd)} requests > max_num_seqs={max_num_seqs}: the budget counts requests too"
    return None


# ---- exercise 08.1: a chunking scheduler -----------------------------------------------------------------

def chunk_schedule_problem(forwards, seq_lens: Sequence[int], max_num_batched_tokens: int,
                           max_num_seqs: int) -> str | None:
    """What makes ``forwards`` (each a list of ``(request index, num_tokens)`` chunks) not the FCFS chunked
    prefill of ``seq_lens``, or None. The rules: every request's tokens exactly once, in order; every
    forward within both budgets and not empty; first come, first served (a request starts only once every
    earlier one has started, and runs to its end before a later one may take its place: only the last chunk
    of a forward may be partial); a forward closes only when full, at ``max_num_seqs``, or when no one waits."""
    n = len(seq_lens)
    problem = schedule_format_problem(forwards)
    if problem:
        return problem
    left = list(seq_lens)
    for f, fwd in enumerate(forwards):
        problem = forward_problem(f, fwd, left, seq_lens, max_num_batched_tokens, max_num_seqs)
        if problem:
            return problem
        ids, tokens = [i for i, _ in fwd], sum(t for _, t in fwd)
        waiting = [i for i in range(n) if left[i]]
        if ids != waiting[:len(ids)]:
            k = next(k for k, (a, b) in enumerate(zip(ids, waiting)) if a != b)
            skipped, head = waiting[k], waiting[0]
            if left[head] < seq_lens[head] and head not in ids:
                return (f"forward {f} leaves request {head} half-prefilled (its cache holds "
                        f"{seq_lens[head] - left[head]} tokens) and runs request {ids[k]} instead: FCFS finishes the "
                        "head request first (put the rest of a chunked request at the FRONT of the queue)")
            return (f"forward {f} runs request {ids[k]} while request {skipped}, which arrived earlier, still waits: "
                    "FCFS never lets a later request jump ahead - when the next request does not fit, chunk it to "
                    "the room left")
        for i, t in fwd[:-1]:
            if t < left[i]:
                return (f"forward {f}: request {i} gets only {t} of its {left[i]} remaining tokens but is not the last "
                        "chunk of the forward: only the request that does not fit is cut")
        for i, t in fwd:
            left[i] -= t
        more = [i for i in range(n) if left[i]]
        if more and tokens < max_num_batched_tokens and len(fwd) < max_num_seqs:
            return (f"forward {f} closes with {max_num_batched_tokens - tokens} tokens of room and request {more[0]} "
                    f"waiting: chunked prefill fills the budget (a prompt of exactly the room left fits whole)")
    if any(left):
        missing = [i for i in range(n) if left[i]]
        return f"requests {missing[:8]} are not finished: {[left[i] for i in missing[:8]]} tokens never scheduled"
    return None


def _schedule_cases() -> list[tuple]:
    return [(stream_lengths(), BUDGET, 256),
            ([3, 1, 2], 1, 256),                        # budget 1: one token per forward
            ([512, 5, 507, 1], 512, 256),               # prompts of exactly the budget, and of exactly the room left
            ([10, 10, 10, 10, 10], 100, 2),             # max_num_seqs closes a forward that has room
            ([1000, 3, 700, 2], 256, 256),              # a prompt of several budgets, then one of nearly three
            ([40, 30, 300, 20, 20], 128, 3)]


def check_chunk_scheduler(fn) -> bool:
    """Exercise 08.1: ``fn(seq_lens, max_num_batched_tokens, max_num_seqs) -> [[(request, num_tokens), ...], ...]``,
    the forwards of FCFS chunked prefill: fill each forward with the waiting requests in arrival order; the
    first one that does not fit gets a chunk of the room left, and its rest stays at the head of the queue.
    Six cases (lesson 06's stream, budget 1, prompts of exactly the budget or the room left, ``max_num_seqs``,
    prompts of several budgets); each must pass ``chunk_schedule_problem``."""
    def judge(got, lens, budget, max_seqs):
        if isinstance(got, (list, tuple)) and got and all(isinstance(f, (list, tuple)) and f and
                                                          all(isinstance(x, int) for x in f) for f in got):
            return ("your forwards hold bare request indices: a chunked forward must also say how many tokens of "
                    "each request it runs - return (request, num_tokens) pairs")
        return chunk_schedule_problem(got, lens, budget, max_seqs)
    return grade("chunk_scheduler", fn, _schedule_cases(), judge,
                 "FCFS chunked prefill on 6 streams: every token once and in order, both budgets, the head chunked")


# ---- the engine's timeline: which request's chunk runs in which forward ------------------------------------

def request_waits(forwards: Sequence[Sequence[tuple]]) -> dict:
    """``{request: (forwards, tokens)}`` from a timeline (each forward a list of ``(request, num_tokens)``):
    how many forwards ran until the one that finished the request's prompt (that one included), and how
    many prompt tokens the engine ran in them: its wait in steps, and in work."""
    out, tokens = {}, 0
    for f, fwd in enumerate(forwards):
        tokens += sum(t for _, t in fwd)
        for i, _ in fwd:
            out[i] = (f + 1, tokens)  # a later chunk overwrites: the wait ends with the last chunk
    return out


def mean_wait(waits: dict, requests: Sequence) -> tuple[float, float]:
    """Mean ``(forwards, tokens)`` of ``request_waits`` over ``requests``."""
    rs = list(requests)
    return (sum(waits[i][0] for i in rs) / len(rs), sum(waits[i][1] for i in rs) / len(rs))


def timeline_cells(forwards: Sequence[Sequence[tuple]]) -> list[int]:
    """Each forward's score cells per head per layer, whole blocks: a chunk of ``t`` tokens of a request that has
    already run ``s`` computes ``t × (s + t)`` (``BatchStats.cells_whole_computed`` of the engine's run)."""
    done: dict = {}
    out = []
    for fwd in forwards:
        cells = 0
        for i, t in fwd:
            s = done.get(i, 0)
            cells += t * (s + t)
            done[i] = s + t
        out.append(cells)
    return out


def chunk_timeline(runs: dict, seq_lens: Sequence[int], draft: int, behind: Sequence[int]) -> Figure:
    """Lesson 08 (P2, P5): each run's forwards one after another on one axis, the prompt tokens run so far.

    ``runs``: ``{label: timeline}`` (each forward a list of ``(request, num_tokens)``). One lane per run: every
    chunk a box as wide as its tokens (orange, two shades for neighbours; the draft's chunks hatched,
    gid ``chunk-<lane>-<forward>-<request>``), a black tick between forwards (``fwd-<lane>-<forward>``). Below
    each lane a mark where each request of ``behind`` finishes (its forward's end, ``done-<lane>-<request>``)
    and their mean (``mean-<lane>``). Under each wide enough forward its number and its score cells per head per
    layer (``timeline_cells``): the x axis counts tokens, not attention.
    """
    labels = list(runs)
    total = sum(seq_lens)
    fig = Figure(figsize=(10, 2.0 * len(labels) + 1.7))
    ax = fig.add_subplot()
    bar = 0.42
    for lane, label in enumerate(labels):
        x, ends = 0, []
        cells = timeline_cells(runs[label])
        for f, fwd in enumerate(runs[label]):
            for i, t in fwd:
                ax.add_patch(Rectangle((x, lane - bar / 2), t, bar, facecolor=request_color(i),
                                       hatch="///" if i == draft else None, edgecolor="white", linewidth=0.5,
                                       gid=f"chunk-{lane}-{f}-{i}"))
                if t >= total / 60:
                    ax.text(x + t / 2, lane, str(i), ha="center", va="center", fontsize=MIN_FONT, color=TEXT,
                            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6} if i == draft else None)
                x += t
            ax.vlines(x, lane - bar / 2 - 0.06, lane + bar / 2 + 0.06, colors=TEXT, linewidth=1.6, gid=f"fwd-{lane}-{f}")
            start = ends[-1] if ends else 0
            if x - start >= total / 40:  # the forward's number (from 0, as the engine's stats count), below its boxes
                name = f"f{f}: {cells[f] / 1000:,.0f}k cells" if x - start >= total / 9 else f"f{f}"
                ax.text((start + x) / 2, lane + bar / 2 + 0.32, name, ha="center", va="center",
                        fontsize=MIN_FONT, color=TEXT, gid=f"fnum-{lane}-{f}")
            ends.append(x)
        done = request_waits(runs[label])
        for i in behind:
            ax.plot([done[i][1]], [lane + bar / 2 + 0.12], marker="v", color=TEXT, markersize=5, gid=f"done-{lane}-{i}")
        at: dict = {}
        for i in behind:  # several finish in one forward: their marks overlap, so count them
            at[done[i][1]] = at.get(done[i][1], 0) + 1
        for x_done, count in at.items():
            if count > 1:
                ax.text(x_done + total * 0.004, lane + bar / 2 + 0.12, f"×{count}", ha="left", va="center",
                        fontsize=MIN_FONT, color=TEXT, gid=f"count-{lane}-{x_done}")
        _, mean_tokens = mean_wait(done, behind)
        ax.plot([mean_tokens], [lane + bar / 2 + 0.2], marker="|", color=TEXT, markersize=14, markeredgewidth=2.5,
                gid=f"mean-{lane}")
        sizes = [sum(t for _, t in fwd) for fwd in runs[label]]
        ax.text(0, lane - bar / 2 - 0.1, f"{label}: {len(sizes)} forwards, largest {max(sizes):,} tokens; "
                f"the {len(behind)} questions behind the draft finish after {mean_tokens:,.0f} tokens on average",
                ha="left", va="bottom", fontsize=MIN_FONT, color=TEXT)
    ax.set_xlim(0, total * 1.04)
    ax.set_ylim(len(labels) - 0.35, -0.75)
    ax.set_yticks([])
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
    height = 2.0 * len(labels) + 1.7
    fig.subplots_adjust(left=0.02, right=0.98, bottom=1.05 / height, top=1 - 0.6 / height)
    return fig


# ---- the engine, chunked and not ------------------------------------------------------------------------

WHOLE_BUDGET = 2048   # the smallest power of two that admits the 1,776-token draft whole
MAX_NUM_SEQS = 256    # vLLM's default, and the engine's


def serve(prompts: Sequence[Sequence[int]], max_num_batched_tokens: int, chunked: bool, cfg: ModelConfig | None = None,
          weights: dict | None = None, *, tp_size: int = 1, dtype: torch.dtype = torch.float32,
          max_num_seqs: int = MAX_NUM_SEQS, compute_logits: bool = True, requests: Sequence[int] | None = None,
          record: bool = False, return_hidden: bool = False) -> dict:
    """Serve ``prompts`` (request i = ``prompts[i]``; only ``requests`` if given) on the CPU with ``Engine``,
    chunked prefill on or off. Returns ``{"outputs": {request: RequestOutput}, "stats": [BatchStats] one per
    forward, "kv_cache_peak_bytes", "traces": [rank 0's CollectiveRecords per forward] (TP=2), "recorder":
    the ``OpRecorder`` of the whole run (``record=True``, TP=1)}``."""
    cfg = cfg or ModelConfig()
    weights = weights if weights is not None else init_weights(cfg, 0)
    ids = list(range(len(prompts))) if requests is None else list(requests)
    traces: list = []
    with Engine(cfg, tp_size=tp_size, weights=weights, device="cpu", dtype=dtype, compute_logits=compute_logits,
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                enable_chunked_prefill=chunked) as engine, _collect_traces(traces if tp_size > 1 else None):
        reqs = [Request(i, list(prompts[i]), return_hidden=return_hidden) for i in ids]
        if record:
            with OpRecorder() as rec:
                outputs = engine.prefill(reqs)
        else:
            rec, outputs = None, engine.prefill(reqs)
        return {"outputs": {o.request_id: o for o in outputs}, "stats": list(engine.stats),
                "kv_cache_peak_bytes": engine.kv_cache_peak_bytes, "traces": traces, "recorder": rec}


@contextlib.contextmanager
def _collect_traces(into: list | None):
    """While serving under TP=2: keep rank 0's collective trace of every forward the runtime hands the engine
    (``TPResult.traces[0]``), in order. Nothing is changed in what runs."""
    if into is None:
        yield
        return
    from ..tp.runtime import TPRuntime
    real = TPRuntime.forward

    def forward(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        into.append(list(result.traces[0]))
        return result
    TPRuntime.forward = forward
    try:
        yield
    finally:
        TPRuntime.forward = real


def timeline(stats: Sequence) -> list[list[tuple]]:
    """The forwards of a run, each a list of ``(request, num_tokens)``: which request's chunk ran in which forward
    (``BatchStats.chunks``; a whole prompt is one chunk)."""
    return [[(i, n) for i, _, n in s.chunks] for s in stats]


def stacked(run: dict, what: str, requests: Sequence | None = None) -> Tensor:
    """``[R, ...]``: each request's ``RequestOutput.<what>`` (``last_hidden`` or ``logits``), in request order
    (only ``requests`` if given)."""
    outs = run["outputs"]
    return torch.stack([getattr(outs[i], what) for i in (sorted(outs) if requests is None else requests)])


def same_argmax(a: dict, b: dict) -> bool:
    """Do two runs pick the same next token (argmax of the logits) for every request?"""
    return bool((stacked(a, "logits").argmax(-1) == stacked(b, "logits").argmax(-1)).all())


def recorded_blocks(run: dict) -> list[tuple[int, int]]:
    """``(L_q, L_k)`` of every score matrix attention computed in ``run`` (``serve(record=True)``), every layer,
    in order: what the op recorder saw executed, whatever the backend (a call over several sequences of equal
    lengths is one entry)."""
    return [tuple(shape[-2:]) for shape in run["recorder"].scores]


def recorded_cells(run: dict, cfg: ModelConfig | None = None) -> int:
    """Score cells per head per layer attention computed in ``run`` (``serve(record=True)``): the recorder's
    cells (every head of every layer) divided by heads × layers."""
    cfg = cfg or ModelConfig()
    total = run["recorder"].cells
    per, rest = divmod(total, cfg.n_heads * cfg.n_layers)
    if rest:
        raise AssertionError(f"{total} cells recorded, not a multiple of {cfg.n_heads} heads x {cfg.n_layers} layers")
    return per


def recorded_cached_rows(run: dict, cfg: ModelConfig | None = None) -> int:
    """Keys read beyond each block's own queries, per head per layer, from the recorder: ``Σ (L_k - L_q)`` over
    every score matrix (a call over several sequences counts each): the keys and values that came from the cache."""
    cfg = cfg or ModelConfig()
    total = sum(math.prod(shape[:-2]) * (shape[-1] - shape[-2]) for shape in run["recorder"].scores)
    per, rest = divmod(total, cfg.n_heads * cfg.n_layers)
    if rest:
        raise AssertionError(f"{total} cached key rows recorded, not a multiple of heads x layers")
    return per


def _per_head_layer(total: int, cfg: ModelConfig, what: str) -> int:
    per, rest = divmod(total, cfg.n_heads * cfg.n_layers)
    if rest:
        raise AssertionError(f"{total} {what} recorded, not a multiple of {cfg.n_heads} heads x {cfg.n_layers} layers")
    return per


def recorded_query_rows(run: dict, cfg: ModelConfig | None = None) -> int:
    """Query rows of every score matrix the recorder saw (``Σ L_q``, every sequence of a call counted), per head
    per layer: the tokens whose attention actually ran, from the kernels' own blocks, not from the scheduler."""
    cfg = cfg or ModelConfig()
    return _per_head_layer(sum(math.prod(s[:-2]) * s[-2] for s in run["recorder"].scores), cfg, "query rows")


def recorded_cells_wider_than(run: dict, num_keys: int, cfg: ModelConfig | None = None) -> int:
    """Score cells per head per layer of the recorded blocks with more than ``num_keys`` keys (``L_k > num_keys``)."""
    cfg = cfg or ModelConfig()
    total = sum(math.prod(s[:-2]) * s[-2] * s[-1] for s in run["recorder"].scores if s[-1] > num_keys)
    return _per_head_layer(total, cfg, "cells")


def causal_cells_from_masks(stats: Sequence) -> int:
    """Causal cells per head per layer of a run, counted from the masks: every chunk ``(request, cached, new)``
    of every forward's ``BatchStats.chunks`` gets its own ``chunk_mask`` and its allowed cells are summed
    (not ``BatchStats.cells_causal_useful``)."""
    return sum(int(chunk_mask(s, n).sum()) for st in stats for _, s, n in st.chunks)


def causal_cells_of_chunks(chunks: Sequence[int]) -> int:
    """Causal cells per head per layer of one prompt run in ``chunks`` (chunk c starts where chunk c-1 ended),
    summed from each chunk's ``chunk_mask`` (whatever ``causal_mask`` is installed)."""
    return sum(int(chunk_mask(s, n).sum()) for s, n in chunk_spans(chunks))


H200_RIDGE = H200_PEAK_FLOPS / H200_BYTES_PER_S    # lesson 05's ridge: 989 TFLOP/s bf16 over 4.8 TB/s, ~206
LINEAR_LAYERS = ("QKV", "out proj", "FFN-up", "FFN-down")


def linear_shapes(cfg: ModelConfig, tp_size: int = 1) -> dict:
    """``(d_in, d_out)`` of each linear layer of a block on ONE rank under TP=``tp_size`` (lesson 04's cut): QKV and
    FFN-up split their outputs (column-parallel), out proj and FFN-down their inputs (row-parallel)."""
    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    if k % tp_size or f % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide qkv_dim {k} and d_ffn {f}")
    return dict(zip(LINEAR_LAYERS, ((d, 3 * k // tp_size), (k // tp_size, d), (d, f // tp_size), (f // tp_size, d))))


def linear_intensities(cfg: ModelConfig, num_tokens: int, tp_size: int = 1, nbytes: int = 2) -> dict:
    """FLOP per byte of each linear layer of one rank for a forward of ``num_tokens`` tokens, in ``nbytes``-byte
    elements (``measure.flops.linear_intensity``: the weight read once for all the tokens)."""
    return {name: linear_intensity(num_tokens, a, b, nbytes) for name, (a, b) in linear_shapes(cfg, tp_size).items()}


def ridge_tokens(cfg: ModelConfig, tp_size: int = 1, ridge: float = H200_RIDGE, nbytes: int = 2,
                 limit: int = 1 << 16) -> dict:
    """The fewest tokens a forward needs for each linear layer of one rank to reach ``ridge`` FLOP/byte (to be
    compute-bound), or None if it never does up to ``limit`` tokens (its intensity saturates below the ridge)."""
    out = {}
    for name, (a, b) in linear_shapes(cfg, tp_size).items():
        if linear_intensity(limit, a, b, nbytes) < ridge:
            out[name] = None
            continue
        lo, hi = 1, limit                       # intensity grows with the tokens: bisect for the first at the ridge
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if linear_intensity(mid, a, b, nbytes) >= ridge else (mid + 1, hi)
        out[name] = lo
    return out


def intensity_table(cfg: ModelConfig, token_counts: Sequence[int], tp_sizes: Sequence[int] = (2, 1),
                    ridge: float = H200_RIDGE) -> str:
    """Each linear layer's FLOP/byte (bf16, one rank) for forwards of ``token_counts`` tokens under each TP size,
    marked ``*`` where it reaches ``ridge`` (compute-bound), and the tokens from which it does."""
    lines = [f"bf16, one rank, against an H200's ridge of {ridge:.0f} FLOP/byte (* = at or above it: compute-bound)",
             f"{'':18s}" + "".join(f"{n:>11s}" for n in LINEAR_LAYERS)]
    for tp in tp_sizes:
        for t in token_counts:
            vals = linear_intensities(cfg, t, tp)
            lines.append(f"TP={tp}, {t:4d} tokens " + "".join(
                f"{v:10.0f}{'*' if v >= ridge else ' '}" for v in vals.values()))
        lines.append(f"TP={tp}, ridge from " + "".join(
            f"{('never' if n is None else f'{n:,}'):>10s} " for n in ridge_tokens(cfg, tp, ridge).values()))
    return "\n".join(lines)


def forward_prices(cfg: ModelConfig, forwards: dict, all_reduces_per_forward: int, num_tokens: int = BUDGET,
                   tp_size: int = 2, nbytes: int = 2) -> dict:
    """What forwards cost on H200s at TP=``tp_size`` in ``nbytes``-byte values, beside their arithmetic, for runs
    given as ``{run: [tokens of each forward]}`` (the engine's ``BatchStats``), each forward making
    ``all_reduces_per_forward`` all-reduces of ``[its tokens, d_model]`` (recorded under TP=2, P3), priced by
    lesson 00's NVLink alpha-beta model. For one ``num_tokens``-token forward: the linear layers' ``arithmetic_s``
    at ``H200_PEAK_FLOPS`` and ``memory_s`` (weights and activations moved, ``linear_intensity``) on one rank,
    ``weight_pass_s`` (one rank's block weights read once at ``H200_BYTES_PER_S``), one all-reduce's
    ``all_reduce_latency_s`` and ``all_reduce_bandwidth_s``, and ``crossover_tokens`` (the payload rows from which
    bandwidth outweighs latency). Per run (``runs``): ``forwards``, ``all_reduces``, ``weights_s`` (one weight pass
    per forward) and ``all_reduce_s``."""
    fit = AlphaBeta(NVLINK["alpha_s"], NVLINK["beta"], "nvlink")
    shapes = linear_shapes(cfg, tp_size).values()
    weight_bytes = cfg.n_layers * nbytes * sum(a * b for a, b in shapes)
    flops = cfg.n_layers * sum(2 * num_tokens * a * b for a, b in shapes)           # the linear layers' arithmetic
    moved = cfg.n_layers * sum(2 * num_tokens * a * b / linear_intensity(num_tokens, a, b, nbytes) for a, b in shapes)
    latency, bandwidth = ring_time_terms(fit, num_tokens * cfg.d_model * nbytes, tp_size)
    pass_s = weight_bytes / H200_BYTES_PER_S

    def all_reduce_s(tokens):
        return all_reduces_per_forward * sum(ring_time_terms(fit, tokens * cfg.d_model * nbytes, tp_size))
    return {"arithmetic_s": flops / H200_PEAK_FLOPS, "memory_s": moved / H200_BYTES_PER_S, "weight_pass_s": pass_s,
            "all_reduce_latency_s": latency, "all_reduce_bandwidth_s": bandwidth,
            "crossover_tokens": crossover_tokens(fit, cfg.d_model, nbytes, tp_size), "num_tokens": num_tokens,
            "runs": {run: {"forwards": len(t), "all_reduces": len(t) * all_reduces_per_forward,
                           "largest": max(t), "weights_s": len(t) * pass_s, "all_reduce_s": sum(map(all_reduce_s, t))}
                     for run, t in forwards.items()}}


def forward_prices_text(prices: dict) -> str:
    """``forward_prices`` as lines: the per-forward prices, then each run's forwards, all-reduces and times."""
    p = prices
    lines = [f"the linear layers of one {p['num_tokens']}-token forward on one rank, bf16: arithmetic "
             f"{p['arithmetic_s'] * 1e6:.1f} us at the peak, memory {p['memory_s'] * 1e6:.1f} us at the bandwidth",
             f"one all-reduce of [{p['num_tokens']} x d_model], bf16, NVLink (lesson 00): latency "
             f"{p['all_reduce_latency_s'] * 1e6:.1f} us + bandwidth {p['all_reduce_bandwidth_s'] * 1e6:.2f} us; bandwidth "
             f"would match latency only from {p['crossover_tokens']:,.0f} rows",
             f"one pass over one rank's block weights, bf16 at {H200_BYTES_PER_S / 1e12:.1f} TB/s: "
             f"{p['weight_pass_s'] * 1e6:.1f} us"]
    for run, r in p["runs"].items():
        lines.append(f"{run:8s}: {r['forwards']} forwards (largest {r['largest']:,} tokens), {r['all_reduces']} "
                     f"all-reduces: {r['all_reduce_s'] * 1e6:,.0f} us; weight passes: {r['weights_s'] * 1e6:,.0f} us")
    return "\n".join(lines)


def cache_peak_rows(stats: Sequence, seq_lens: Sequence[int]) -> dict:
    """Token rows (per layer, K and V together) the prefill KV cache must hold at its peak, summed from the
    forwards' chunks ``(request, cached, new)``. ``copy``: this engine's (``torch.cat``): while a forward runs,
    the cached rows read (``cached``) beside the new copies of the requests that continue (``cached + new``).
    ``in_place``: a cache written in place (preallocated blocks): the rows held between forwards.
    ``in_forward``: that cache during a forward, where (as in vLLM) every scheduled token's K and V is written
    into its blocks before attention runs: each chunk's cached rows plus its new ones, summed over the forward."""
    copy = in_place = in_forward = 0
    for st in stats:
        kept = sum(s + n for i, s, n in st.chunks if s + n < seq_lens[i])
        copy = max(copy, sum(s for _, s, _ in st.chunks) + kept)
        in_place = max(in_place, kept)
        in_forward = max(in_forward, sum(s + n for _, s, n in st.chunks))
    return {"copy": copy, "in_place": in_place, "in_forward": in_forward}


def seq_limited_forwards(max_num_seqs: int = 4) -> list:
    """Lesson 06's stream served chunked under ``BUDGET`` by ``Engine`` with ``max_num_seqs`` requests at most per
    forward, on the small model (EXPLORER_CFG) (the forwards do not depend on the model's size): its ``BatchStats``."""
    cfg = EXPLORER_CFG
    ids = [[t % cfg.vocab_size for t in p] for p in stream()[1]]
    return serve(ids, BUDGET, True, cfg, _EXPLORER_WEIGHTS.setdefault("w", init_weights(cfg, 0)),
                 max_num_seqs=check_int("max_num_seqs", max_num_seqs, 1), compute_logits=False)["stats"]


def wait_seconds(stats: Sequence) -> dict:
    """``{request: seconds}``: the measured ``BatchStats.wall_s`` of every forward up to the one that finished
    the request's prompt (that one included). Varies from run to run: shown, never asserted."""
    out, t = {}, 0.0
    for st in stats:
        t += st.wall_s
        for i, _, _ in st.chunks:
            out[i] = t
    return out


def behind(seq_lens: Sequence[int]) -> list[int]:
    """The requests that arrived after the draft (lesson 06's stream)."""
    d = draft_index()
    return list(range(d + 1, len(seq_lens)))


def cached_tokens(stats) -> int:
    """Keys and values read back from the KV cache in one forward, per head per layer (``num_cached_tokens``)."""
    return stats.num_cached_tokens


def trace_text(trace: Sequence) -> str:
    """One forward's collective trace in one line: each distinct (op, shape) and how often."""
    from collections import Counter
    counts = Counter((r.op, tuple(r.shape)) for r in trace)
    return ", ".join(f"{n} x {op} {list(shape)}" for (op, shape), n in counts.items()) or "no collective"


def payloads_match(run: dict, d_model: int) -> bool:
    """Is every all-reduce of every forward ``[tokens in that forward, d_model]``?"""
    return all(tuple(r.shape) == (s.num_tokens, d_model) for s, trace in zip(run["stats"], run["traces"])
               for r in trace if r.op == "all_reduce") and len(run["traces"]) == len(run["stats"])


def other_collectives(trace: Sequence) -> int:
    """Collectives of one forward that are not the blocks' all-reduces (the cache would show up here)."""
    return sum(r.op != "all_reduce" or ".attn.out_proj" not in r.layer and ".mlp.fc_down" not in r.layer
               for r in trace)


def stream(cfg: ModelConfig | None = None) -> tuple[list[int], list[list[int]]]:
    """Lesson 06's stream: ``(lengths, token-id prompts)`` in arrival order, the draft included."""
    return l06_engine.stream_prompts(cfg)


def mask_text(mask: Tensor, start: int = 0) -> str:
    """A chunk's mask as text: one line per query (its token index in the prompt), ``#`` allowed, ``.`` not."""
    lines = ["keys:      " + "".join(str(j % 10) for j in range(mask.shape[1]))]
    lines += [f"query {start + i:3d}: " + "".join("#" if x else "." for x in row.tolist()) for i, row in enumerate(mask)]
    return "\n".join(lines)


_CHUNK_ROWS_ERROR: dict = {}


def chunk_rows_error(start: int = 4, length: int = 4, heads: int = 2, d_head: int = 16, seed: int = 0) -> tuple:
    """``(max |chunk rows - fp64|, the tolerance rule's bound)`` of ``chunk_rows_match``'s comparison (which
    raises when they differ): for a claim table."""
    key = (start, length, heads, d_head, seed)
    if key not in _CHUNK_ROWS_ERROR:
        with contextlib.redirect_stdout(None):
            chunk_rows_match(*key)
    return _CHUNK_ROWS_ERROR[key]


def recorded_draft_blocks(cfg: ModelConfig | None = None) -> list[tuple[int, int]]:
    """The draft served alone, chunked under ``BUDGET``, on ``cfg`` (default: the small model, EXPLORER_CFG) under the
    op recorder: the ``(L_q, L_k)`` of its score matrix in each forward, layer 0's (the recorder's own blocks; run
    it inside ``broken(...)`` to see what a bug does to them)."""
    cfg = cfg or EXPLORER_CFG
    weights = init_weights(cfg, 0) if cfg is not EXPLORER_CFG else _EXPLORER_WEIGHTS.setdefault("w", init_weights(cfg, 0))
    ids = [[t % cfg.vocab_size for t in stream()[1][draft_index()]]]
    run = serve(ids, BUDGET, True, cfg, weights, compute_logits=False, record=True)
    return [tuple(shape[-2:]) for shape in run["recorder"].scores][::cfg.n_layers]


def chunk_rows_match(start: int = 4, length: int = 4, heads: int = 2, d_head: int = 16, seed: int = 0) -> str:
    """``varlen_attention`` of one chunk (queries ``start .. start+length-1``, keys ``0 .. start+length-1``:
    ``cu_seqlens_q = [0, length]``, ``cu_seqlens_k = [0, start + length]``) against the same rows of one causal
    attention over the whole ``start + length`` tokens, in float32 by the tolerance rule (float64 truth).
    Returns the line it prints; raises AssertionError with the numbers when they differ."""
    total = start + length
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, heads, d_head, generator=g) for _ in range(3))
    cu_whole = torch.tensor([0, total], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, length], dtype=torch.int32), cu_whole
    chunk = varlen_attention(q[start:], k, v, cu_q, cu_k)
    whole = varlen_attention(q, k, v, cu_whole)[start:]
    truth = varlen_attention(q.double(), k.double(), v.double(), cu_whole)[start:]
    _CHUNK_ROWS_ERROR[(start, length, heads, d_head, seed)] = (max_abs_diff(chunk, truth), tolerance(whole, truth, chunk.dtype))
    assert_close(chunk, whole, truth, f"the chunk's rows {start}..{total - 1} vs the whole attention's")
    line = (f"rows {start}..{total - 1}: chunk (cu_seqlens_q [0, {length}], cu_seqlens_k [0, {total}]) = the whole "
            f"causal attention over {total} tokens, within the tolerance rule")
    print(line)
    return line


# ---- registered figures (the engine's own scheduler: plan_batches) ------------------------------------------

def planned_timeline(seq_lens: Sequence[int], max_num_batched_tokens: int, chunked: bool,
                     max_num_seqs: int = MAX_NUM_SEQS) -> list[list[tuple]]:
    """The engine scheduler's forwards for bare lengths (``plan_batches``), as ``timeline`` gives a run's."""
    plan = plan_batches(seq_lens, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill=chunked)
    if chunked:
        return [[(i, n) for i, _, n in fwd] for fwd in plan]
    return [[(i, seq_lens[i]) for i in fwd] for fwd in plan]


@register("08_chunk_staircase", lesson="08",
          caption="Lesson 06's 1,776-token draft prefilled alone in chunks of 512: the KV cache grows, and its "
                  "attention becomes a staircase of rectangles, each chunk's rows x every key so far (P4)")
def _chunk_staircase() -> Figure:
    lens = stream_lengths()
    d = draft_index()
    chunks = [n for fwd in plan_batches([lens[d]], BUDGET, enable_chunked_prefill=True) for _, _, n in fwd]
    return chunk_staircase(chunks, "the draft alone: ")


@register("08_chunk_timeline", lesson="08",
          caption="Lesson 06's stream chunked under 512 tokens per forward, and whole under 2,048: where each "
                  "request finishes, in prompt tokens run so far (P2, P5)")
def _chunk_timeline() -> Figure:
    lens = stream_lengths()
    return chunk_timeline({f"chunked, {BUDGET} per forward": planned_timeline(lens, BUDGET, True),
                           f"whole prompts, {WHOLE_BUDGET:,} per forward": planned_timeline(lens, WHOLE_BUDGET, False)},
                          lens, draft_index(), behind(lens))


# ---- break it: the bugs the claims guard against (the lesson's break-it cells and tests/breakages_l08.py) ----

def _patch(module, name: str, value) -> Callable[[], None]:
    old = getattr(module, name)
    setattr(module, name, value)
    return lambda: setattr(module, name, old)


def _bug_report() -> list:
    """Exercise 08.3's bug report (its diagnosis is the exercise; tests/breakages_l08.py says what it is)."""
    from ..core import model

    def embed(self, batch):
        if batch.input_ids is None:
            return batch.hidden
        cu = batch.cu_seqlens.tolist()
        restart = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1], cu[1:])]).to(batch.positions.device)
        return self.wte[batch.input_ids] + self.wpe[restart]
    return [_patch(model.Transformer, "embed", embed)]


def _cache_not_appended() -> list:
    """Each chunk attends to its own keys only: its keys are cached, but the cached ones are never put in front
    of them (and ``cu_seqlens_k`` is ``cu_seqlens_q``)."""
    from ..core import attention, model
    from ..serve import kv_cache
    real_kv, real_build = kv_cache.KVCacheStep.keys_values, attention.VarlenMetadata.build

    def keys_values(self, layer, k, v):
        real_kv(self, layer, k, v)  # the chunk's keys still go into the cache
        return k, v                 # ... but attention never reads the cached ones

    class Meta(attention.VarlenMetadata):
        @classmethod
        def build(cls, cu_q, cu_k=None, device="cpu", max_seqlen_q=None, max_seqlen_k=None):
            return real_build(cu_q, None, device, max_seqlen_q, max_seqlen_q)
    return [_patch(kv_cache.KVCacheStep, "keys_values", keys_values), _patch(model, "VarlenMetadata", Meta)]


def _causal_top_left() -> list:
    """The causal mask of a chunk aligned top-left: query i sees keys 0..i of the rectangle, not 0..i + L_k - L_q."""
    from ..core import attention

    def causal_mask(lq, lk, device=None):
        return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
    return [_patch(attention, "causal_mask", causal_mask)]


def _chunk_takes_whole_budget() -> list:
    """The head request's chunk is a whole budget, not the room left in the forward."""
    from ..serve import scheduler as sched_mod
    real = sched_mod.Scheduler.schedule_chunks

    def schedule_chunks(self):
        if not self.enable_chunked_prefill:
            return real(self)
        chunks, tokens = [], 0
        while self.waiting and len(chunks) < self.max_num_seqs and tokens < self.max_num_batched_tokens:
            req = self.waiting[0]
            n = min(len(req) - req.num_computed_tokens, self.max_num_batched_tokens)  # the bug: no "- tokens"
            chunks.append(sched_mod.ScheduledChunk(req, req.num_computed_tokens, n))
            req.num_computed_tokens += n
            tokens += n
            if req.num_computed_tokens < len(req):
                break
            self.waiting.popleft()
        return chunks
    return [_patch(sched_mod.Scheduler, "schedule_chunks", schedule_chunks)]


def _chunked_to_the_back() -> list:
    """A chunked request goes to the back of the queue (round robin) instead of staying at its head."""
    from ..serve import scheduler as sched_mod
    real = sched_mod.Scheduler.schedule_chunks

    def schedule_chunks(self):
        chunks = real(self)
        if chunks and self.waiting and self.waiting[0] is chunks[-1].request and not chunks[-1].is_last:
            self.waiting.rotate(-1)
        return chunks
    return [_patch(sched_mod.Scheduler, "schedule_chunks", schedule_chunks)]


BUGS = {"bug report": _bug_report, "cache not appended": _cache_not_appended,
        "causal top-left": _causal_top_left, "chunk takes a whole budget": _chunk_takes_whole_budget,
        "chunked request to the back": _chunked_to_the_back}


def install(bug: str) -> Callable[[], None]:
    """Break the engine the way ``bug`` (a key of ``BUGS``) says, in this process; returns the undo."""
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose one of {sorted(BUGS)}")
    undos = BUGS[bug]()
    return lambda: [undo() for undo in reversed(undos)]


# Exercise 08.3's bug report: one of ``BUGS``, under a neutral name so that the learner diagnoses it.
REPORTED_BUG = "bug report"


@contextlib.contextmanager
def reported_bug():
    """``with reported_bug(): ...``: the engine as the bug report of exercise 08.3 ran it ("chunked prefill is wrong
    after the first chunk"), inside the block only."""
    with broken(REPORTED_BUG):
        yield


@contextlib.contextmanager
def broken(bug: str):
    """``with broken("causal top-left"): ...``: the engine runs with that bug inside the block only."""
    undo = install(bug)
    try:
        yield
    finally:
        undo()


# ---- the explorer: the engine's chunked run of a workload, against whole prompts ---------------------------

# A small model (2 layers, d_model 64) for the break-it cells, exercise 08.3 and the max_num_seqs rerun: the
# forwards, chunks and score cells per head per layer do not depend on the model's size.
EXPLORER_CFG = ModelConfig(n_layers=2, d_model=64, n_heads=2, d_head=32, d_ffn=256, vocab_size=512, max_position=8192)
_EXPLORER_WEIGHTS: dict = {}


def explorer_cfg_text() -> str:
    c = EXPLORER_CFG
    return f"{c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads of {c.d_head}"


# The explorer runs the engine's chunked prefill on every move, on a smaller model still (1 layer, d_model 32),
# and the unchunked run (float32 and the float64 truth) once per stream: it does not depend on the chunk budget or
# on a chunking bug. Forwards, chunks, waits and score cells do not depend on the model's size; the cache bytes,
# the errors and the times do (they are this small model's).
EXPLORE_RUN_CFG = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=512, max_position=8192)
_EXPLORE_RUN_WEIGHTS: dict = {}
# the break-it bugs the explorer can switch on; exercise 08.3's is there under its neutral name
EXPLORER_BUGS = ("none", "cache not appended", "causal top-left", "chunk takes a whole budget",
                 "chunked request to the back", REPORTED_BUG)
_WHOLE_RUNS: dict = {}


def _explore_weights() -> dict:
    if "w" not in _EXPLORE_RUN_WEIGHTS:
        _EXPLORE_RUN_WEIGHTS["w"] = init_weights(EXPLORE_RUN_CFG, 0)
    return _EXPLORE_RUN_WEIGHTS["w"]


def _whole_runs(workload: str, n: int, seed: int) -> tuple:
    """``(lengths, prompts, whole budget, {"whole": run, "truth": float64 run})`` of one stream, computed once."""
    key = (workload, n, seed)
    if key not in _WHOLE_RUNS:
        if len(_WHOLE_RUNS) > 32:
            _WHOLE_RUNS.clear()
        lens = l06_engine.workload_lengths(workload, n, seed, **l06_engine.WORKLOAD_PRESETS[workload])
        prompts = make_requests(lens, EXPLORE_RUN_CFG.vocab_size, seed=l06_engine.PROMPT_SEED)
        whole_budget = 1 << (max(lens) - 1).bit_length()
        runs = {name: serve(prompts, whole_budget, False, EXPLORE_RUN_CFG, _explore_weights(), dtype=dt,
                            compute_logits=False) for name, dt in (("whole", torch.float32), ("truth", torch.float64))}
        _WHOLE_RUNS[key] = (lens, prompts, whole_budget, runs)
    return _WHOLE_RUNS[key]


def _run_summary(run: dict, budget: int, after: list) -> dict:
    steps = timeline(run["stats"])
    waits = request_waits(steps)
    return {"timeline": steps, "waits": waits, "budget": budget,
            "mean_behind": mean_wait(waits, after) if after else (0.0, 0.0),
            "max_forward": max(s.num_tokens for s in run["stats"]),
            "cells_whole": sum(s.cells_whole_computed for s in run["stats"]),
            "cells_causal": sum(s.cells_causal_useful for s in run["stats"]),
            "cached_tokens": sum(s.num_cached_tokens for s in run["stats"]),
            "kv_cache_peak_bytes": run["kv_cache_peak_bytes"],
            "forward_ms": [1e3 * s.wall_s for s in run["stats"]]}


def chunked_plan_state(workload: str = "long-tail", num_requests: int = 16, max_num_batched_tokens: int = 512,
                       seed: int = 3, max_num_seqs: int = MAX_NUM_SEQS, bug: str = "none") -> dict:
    """A seeded stream of ``workload`` (lesson 06's presets) served by ``Engine`` on ``EXPLORE_RUN_CFG``: chunked
    prefill under ``max_num_batched_tokens`` (with ``bug``, one of ``EXPLORER_BUGS``, switched on), and whole
    prompts under the smallest power of two that admits the longest one (float32 and float64, once per stream).

    Keys: ``seq_lens``, ``longest`` (request index), ``behind`` (the requests after it), ``whole_budget``, ``bug``,
    ``errors`` (``{request: (max |chunked last hidden - float64 unchunked|, the tolerance rule's bound)}`` for
    every request the chunked run cut into more than one chunk), and per run (``"chunked"``, ``"whole"``):
    ``timeline`` (the engine's forwards, ``(request, num_tokens)`` each), ``waits`` (``request_waits``),
    ``mean_behind`` (forwards, tokens), ``max_forward`` (tokens), ``cells_whole`` and ``cells_causal`` (score cells
    per head per layer, the engine's ``BatchStats``), ``cached_tokens`` (K, V rows read back from the cache, per
    layer per head), ``kv_cache_peak_bytes`` (the engine's) and ``forward_ms`` (each forward's measured wall time);
    the chunked run also ``cells_causal_masks``: the causal cells its chunks' masks keep, each mask built by the
    engine's own mask function while ``bug`` is still on (``causal_cells_from_masks``), so a mask bug shows here
    while ``cells_causal``, the schedule's count, does not move.
    """
    if workload not in l06_engine.WORKLOAD_PRESETS:
        raise ValueError(f"workload must be one of {tuple(l06_engine.WORKLOAD_PRESETS)}, got {workload!r}")
    if bug not in EXPLORER_BUGS:
        raise ValueError(f"bug must be one of {EXPLORER_BUGS}, got {bug!r}")
    n = check_int("num_requests", num_requests, 1, 256)
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens, 1, 1 << 16)
    lens, prompts, whole_budget, whole = _whole_runs(workload, n, seed)
    longest = max(range(n), key=lambda i: (lens[i], -i))
    after = list(range(longest + 1, n))
    with contextlib.nullcontext() if bug == "none" else broken(bug):
        run = serve(prompts, budget, True, EXPLORE_RUN_CFG, _explore_weights(), max_num_seqs=max_num_seqs,
                    compute_logits=False)
        masks_causal = causal_cells_from_masks(run["stats"])  # the engine's mask function, the bug still on
    state = {"workload": workload, "seq_lens": lens, "longest": longest, "behind": after, "bug": bug,
             "max_num_batched_tokens": budget, "whole_budget": whole_budget,
             "chunked": _run_summary(run, budget, after), "whole": _run_summary(whole["whole"], whole_budget, after)}
    state["chunked"]["cells_causal_masks"] = masks_causal
    cut = sorted(i for i in range(n) if sum(i == j for fwd in state["chunked"]["timeline"] for j, _ in fwd) > 1)
    state["chunks"] = {i: sum(i == j for fwd in state["chunked"]["timeline"] for j, _ in fwd) for i in cut}
    state["errors"] = {i: error_and_bound(*(r["outputs"][i].last_hidden for r in (run, whole["whole"], whole["truth"])))
                       for i in cut}
    return state


def chunked_plan_html(state: dict) -> str:
    """The explorer's readout: one ``<div>`` per run (forwards, largest, the wait of the requests behind the
    longest, cells, cache), one for the longest request, one with each chunked request's error against the
    unchunked prefill (from the engine's runs), then the measured times (noisy)."""
    lens, i = state["seq_lens"], state["longest"]
    lines = []
    for name in ("chunked", "whole"):
        r = state[name]
        f, t = r["mean_behind"]
        lines.append(f"<div>{name} (budget {r['budget']:,}): {len(r['timeline'])} forwards, largest {r['max_forward']:,} "
                     f"tokens | the {len(state['behind'])} requests behind the longest wait {f:.1f} forwards, "
                     f"{t:,.0f} tokens on average | score cells {r['cells_whole']:,} (whole blocks), "
                     f"{r['cells_causal']:,} causal | cache read {r['cached_tokens']:,} rows, peak "
                     f"{r['kv_cache_peak_bytes']:,} B | scheduled (BatchStats): forwards, cells, cache rows"
                     + (f" | causal cells its chunks' masks keep (the engine's mask function, bug "
                        f"{'off' if state['bug'] == 'none' else 'on'}): {r['cells_causal_masks']:,}"
                        if "cells_causal_masks" in r else "") + "</div>")
    ch = [f for f, fwd in enumerate(state["chunked"]["timeline"]) if i in dict(fwd)]
    lines.append(f"<div>the longest, request {i} ({lens[i]:,} tokens): chunked, in forwards {ch[0]}..{ch[-1]} "
                 f"({len(ch)} chunks); whole, in forward {state['whole']['waits'][i][0] - 1}</div>")
    errs = state["errors"]
    bad = sum(e > b for e, b in errs.values())
    shown = ", ".join(f"{j} ({state['chunks'][j]} chunks) {e:.1e} {'≤' if e <= b else '>'} {b:.1e} "
                      f"{'✓' if e <= b else '✗'}" for j, (e, b) in list(errs.items())[:8])
    more = f", {len(errs) - 8} more" if len(errs) > 8 else ""
    lines.append(f"<div>bug: {state['bug']} | measured: max |chunked last hidden - fp64 unchunked| of each request cut into "
                 f"chunks, against the tolerance rule's bound: {shown or 'no request was cut'}{more} | "
                 f"{bad} of {len(errs)} wrong</div>")
    ms = sorted(state["chunked"]["forward_ms"])
    wms = sorted(state["whole"]["forward_ms"])
    lines.append(f"<div>measured wall time per forward (this CPU, small model, noisy): chunked median "
                 f"{ms[len(ms) // 2]:.1f} ms, longest {ms[-1]:.1f} ms over {len(ms)}; whole (run once per stream) "
                 f"median {wms[len(wms) // 2]:.1f} ms, longest {wms[-1]:.1f} ms over {len(wms)}</div>")
    return "".join(lines)


def chunked_plan_explorer(workload: str = "long-tail", num_requests: int = 16, max_num_batched_tokens: int = 512):
    """VBox class ``cpx``: Dropdowns ``cpx-workload`` and ``cpx-bug`` (``EXPLORER_BUGS``), IntSliders
    ``cpx-num-requests`` (1..64) and ``cpx-budget`` (128..2048), HTML ``cpx-counts`` (``chunked_plan_html``;
    "running..." while the engine runs), Output ``cpx-figure`` (``chunk_timeline`` of both runs)."""
    kind, reqs, budget, text, out = l06_engine.workload_controls("cpx", workload, num_requests, 64, max_num_batched_tokens,
                                                                2048, "chunk budget")
    from .explore import ipywidgets_module, tagged
    bug = tagged(ipywidgets_module().Dropdown(options=list(EXPLORER_BUGS), value="none", description="bug"), "cpx-bug")
    budget.min = 128  # below it a move runs hundreds of forwards: over 2 s on a busy CPU

    def update(change=None):
        text.value = "<div>running...</div>" + text.value
        state = chunked_plan_state(kind.value, reqs.value, budget.value, bug=bug.value)
        text.value = chunked_plan_html(state)
        show_figure(out, chunk_timeline({f"chunked, {state['max_num_batched_tokens']:,}": state["chunked"]["timeline"],
                                         f"whole, {state['whole_budget']:,}": state["whole"]["timeline"]},
                                        state["seq_lens"], state["longest"], state["behind"]))

    return explorer("cpx", [kind, reqs, budget, bug], [text, out], update)


# ---- exercise 08.1: a chunk cap (vLLM's long_prefill_token_threshold) --------------------------------------

def _capped_reference(seq_lens, max_num_batched_tokens, max_num_seqs, cap):
    """FCFS chunked prefill with a per-request chunk cap (``cap`` 0: none): each forward takes the unfinished
    requests in arrival order, each ``min(its rest, cap, room left)`` tokens, until the forward is full, holds
    ``max_num_seqs`` requests, or nobody waits. (The engine has no cap: this is the checker's own rule.)"""
    left, forwards = list(seq_lens), []
    limit = cap if cap else max_num_batched_tokens
    while any(left):
        fwd, room = [], max_num_batched_tokens
        for i, rest in enumerate(left):
            if not room or len(fwd) == max_num_seqs:
                break
            if rest:
                take = min(rest, limit, room)
                fwd.append((i, take))
                left[i] -= take
                room -= take
        forwards.append(fwd)
    return forwards


def _capped_cases() -> list[tuple]:
    lens = stream_lengths()
    return [(lens, BUDGET, 256, 128),                  # lesson 06's stream: the draft capped at 128 a forward
            ([3, 1, 2], 1, 256, 1),                    # budget 1
            ([700, 40, 30], 256, 256, 256),            # cap = budget: the cap changes nothing
            ([700, 40, 30], 256, 256, 1000),           # cap > budget: still nothing
            ([600, 10, 10, 10], 200, 2, 64),           # max_num_seqs closes a forward that still has room
            ([300, 50, 500, 20], 256, 256, 100),       # two long prompts capped, short ones between them
            ([90, 5], 64, 256, 0)]                     # cap 0: no cap (vLLM's default)


def capped_schedule_problem(got, seq_lens, max_num_batched_tokens, max_num_seqs, cap) -> str | None:
    """The first rule of a capped chunked prefill that ``got`` breaks, in words, or None. Any schedule that keeps
    the rules passes (``_capped_reference`` is one of them, not the only one): every request's tokens exactly once,
    in order, never past its prompt; every forward non-empty, within ``max_num_batched_tokens`` and
    ``max_num_seqs``, no chunk over the cap (``cap`` 0: no cap); a forward holds the first unfinished requests in
    arrival order; and it fills its room: it closes with room left and fewer than ``max_num_seqs`` requests only
    when every unfinished request is in it, each with ``min(its rest, the cap)`` tokens."""
    problem = schedule_format_problem(got)
    if problem:
        return problem
    n, limit = len(seq_lens), cap if cap else max_num_batched_tokens
    left = list(seq_lens)
    for f, fwd in enumerate(got):
        fwd = [tuple(c) for c in fwd]
        if not any(left):
            return f"{len(got)} forwards, but every prompt is finished after forward {f - 1}: forward {f} should not exist"
        problem = forward_problem(f, fwd, left, seq_lens, max_num_batched_tokens, max_num_seqs, cap)
        if problem:
            return problem
        ids, tokens = [i for i, _ in fwd], sum(t for _, t in fwd)
        waiting = [i for i in range(n) if left[i]]
        if sorted(ids) != waiting[:len(ids)]:
            skipped = next(i for i in waiting if i not in ids)
            return (f"forward {f} runs request {max(ids)} while request {skipped}, which arrived earlier, is unfinished "
                    "and not in it: a forward takes the unfinished requests in arrival order")
        if tokens < max_num_batched_tokens:
            short = [(i, t) for i, t in fwd if t < min(left[i], limit)]
            if short:
                i, t = short[0]
                why = (" - long_prefill_token_threshold=0 means no cap (vLLM's default)" if cap == 0 else
                       "")
                return (f"forward {f} has {max_num_batched_tokens - tokens} tokens of room, yet request {i} gets only "
                        f"{t} of the {min(left[i], limit)} it may run{why}")
            if len(fwd) < max_num_seqs and len(fwd) < len(waiting):
                return (f"forward {f} closes with {max_num_batched_tokens - tokens} tokens of room while request "
                        f"{waiting[len(fwd)]} waits: a capped chunk does not end the forward, the room left goes to "
                        "the requests behind it (that is the point of the cap)")
        for i, t in fwd:
            left[i] -= t
    if any(left):
        missing = [i for i in range(n) if left[i]]
        return f"requests {missing[:8]} are not finished: {[left[i] for i in missing[:8]]} tokens never scheduled"
    return None


def check_capped_scheduler(fn) -> bool:
    """Exercise 08.1: ``fn(seq_lens, max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold)`` →
    forwards of chunked prefill with a per-request chunk cap, on 7 cases (the stream, budget 1, a cap equal to and
    above the budget, ``max_num_seqs``, two capped prompts, cap 0); any schedule keeping the rules of
    ``capped_schedule_problem`` passes."""
    return grade("capped_scheduler", fn, _capped_cases(), capped_schedule_problem,
                 "chunked prefill with a chunk cap on 7 cases: the cap, both budgets, arrival order, the room filled, cap 0")


def capped_finish(fn, cap: int, max_num_batched_tokens: int = BUDGET) -> dict:
    """The stream under ``fn``'s capped scheduler: ``{"draft": forward its last chunk runs in, "before": how many
    of the questions behind it finish in an earlier forward, "forwards": how many forwards}`` (forwards counted from 1)."""
    lens = stream_lengths()
    waits = request_waits(fn(lens, max_num_batched_tokens, MAX_NUM_SEQS, cap))
    d = draft_index()
    return {"draft": waits[d][0], "forwards": max(w[0] for w in waits.values()),
            "before": sum(waits[i][0] < waits[d][0] for i in behind(lens))}


# ---- exercise 08.2: a budget, chosen with numbers ----------------------------------------------------------

BUDGET_STEP = 16  # the budgets exercise 08.2 chooses from: multiples of 16 (and the explorer's slider step)


def budget_measures(max_num_batched_tokens: int) -> dict:
    """Lesson 06's stream under chunked prefill and this budget, as the engine's scheduler plans it
    (``plan_batches(enable_chunked_prefill=True)``): ``forwards`` (each one pass over the weights and, under TP=2,
    ``2 * n_layers`` all-reduces: ``all_reduces`` for the S1 model), ``max_forward`` (tokens), ``cache_rows_held``
    (the most token rows per layer a cache written in place holds between forwards, ``cache_peak_rows``), and the
    questions behind the draft's mean wait ``wait_forwards`` / ``wait_tokens`` (``request_waits``)."""
    return dict(_budget_measures(check_int("max_num_batched_tokens", max_num_batched_tokens, 1, 1 << 16)))


@functools.lru_cache(maxsize=512)
def _budget_measures(budget: int) -> tuple:
    lens = stream_lengths()
    plan = plan_batches(lens, budget, enable_chunked_prefill=True)
    f, t = mean_wait(request_waits([[(i, n) for i, _, n in fwd] for fwd in plan]), behind(lens))
    return tuple({"budget": budget, "forwards": len(plan), "all_reduces": 2 * ModelConfig().n_layers * len(plan),
                  "max_forward": max(sum(n for *_, n in fwd) for fwd in plan),
                  "cache_rows_held": _held(plan, lens)[0], "wait_forwards": f, "wait_tokens": t}.items())


def budget_table(budgets: Sequence[int]) -> str:
    """``budget_measures`` of each budget, one line each."""
    head = (f"{'budget':>6s} {'forwards':>8s} {'all-reduces':>11s} {'largest':>7s} {'cache held':>10s} "
            f"{'wait (fwd)':>10s} {'wait (tok)':>10s}")
    rows = [budget_measures(b) for b in budgets]
    return "\n".join([head] + [f"{m['budget']:6d} {m['forwards']:8d} {m['all_reduces']:11d} {m['max_forward']:7d} "
                               f"{m['cache_rows_held']:10,d} {m['wait_forwards']:10.2f} {m['wait_tokens']:10,.0f}"
                               for m in rows])


def _held(forwards, seq_lens: Sequence[int]) -> tuple[int, int | None, int | None]:
    """``(rows, request, forward)``: the most token rows a cache written in place holds between forwards (the rows
    of the requests not finished after a forward), the request holding most of them and the forward after which."""
    best = (0, None, None)
    for f, fwd in enumerate(forwards):
        kept = [(s + n, i) for i, s, n in fwd if s + n < seq_lens[i]]
        if sum(r for r, _ in kept) > best[0]:
            best = (sum(r for r, _ in kept), max(kept)[1], f)
    return best


# ---- exercise 08.2: a budget chosen for what chunking really costs ----------------------------------------

_plan = plan_batches        # the engine's scheduler plan, kept for the checker while exercise 08.2 switches it off
MAX_PROBES = 3              # engine measurements exercise 08.2 allows per case
# (seq_lens, draft, max_budget, max_cache_rows), or ("stream", max_budget, max_cache_rows) for lesson 06's stream
_BUDGET_CASES = [("stream", 768, 1400), ("stream", 512, 1600), ("stream", 768, 2000), ([450, 100, 30, 700, 60], 3, 512, 400),
                 ([100, 412, 1000, 40, 40], 2, 512, 600), ([60, 2000, 30], 1, 1024, 1400), ([90, 700, 10, 10], 1, 256, 600),
                 ([5, 7, 20, 3], 2, 64, 0)]


def budget_prices(seq_lens: Sequence[int], draft: int, max_num_batched_tokens: int) -> dict:
    """What serving ``seq_lens`` chunked under ``max_num_batched_tokens`` costs, by the engine's scheduler plan
    (``plan_batches``): ``forwards`` (each a pass over the weights, and 2 x n_layers all-reduces under TP=2),
    ``cache_rows_held`` (the most token rows a cache written in place holds between forwards), ``held_by`` /
    ``held_after`` (the request holding most of them, and the forward after which), ``wait_tokens`` (the mean
    prompt tokens run until each request behind ``draft`` finishes)."""
    plan = _plan(list(seq_lens), check_int("max_num_batched_tokens", max_num_batched_tokens, 1),
                 enable_chunked_prefill=True)
    held, by, after = _held(plan, seq_lens)
    after_draft = list(range(draft + 1, len(seq_lens)))
    wait = mean_wait(request_waits([[(i, n) for i, _, n in fwd] for fwd in plan]), after_draft)[1]
    return {"forwards": len(plan), "cache_rows_held": held, "held_by": by, "held_after": after, "wait_tokens": wait}


def best_budget(seq_lens: Sequence[int], draft: int, max_budget: int, max_cache_rows: int) -> int:
    """Exercise 08.2's answer, by the engine's scheduler plan for every candidate: among the multiples of
    ``BUDGET_STEP`` up to ``max_budget`` whose cache held between forwards stays within ``max_cache_rows``, the
    fewest forwards; ties: the least mean wait in tokens of the requests behind ``draft``, then the smaller budget."""
    prices = {b: budget_prices(seq_lens, draft, b) for b in range(BUDGET_STEP, max_budget + 1, BUDGET_STEP)}
    fits = [b for b, p in prices.items() if p["cache_rows_held"] <= max_cache_rows]
    if not fits:
        raise ValueError(f"no budget up to {max_budget} keeps the cache within {max_cache_rows} rows")
    return min(fits, key=lambda b: (prices[b]["forwards"], round(prices[b]["wait_tokens"], 6), b))


@functools.lru_cache(maxsize=64)
def engine_budget_prices(seq_lens: tuple, draft: int, max_num_batched_tokens: int) -> tuple:
    """``(forwards, cache rows held, mean wait in tokens behind draft)`` as ``Engine`` really ran ``seq_lens``
    chunked (its ``BatchStats``) on the explorer's one-layer model (``EXPLORE_RUN_CFG``)."""
    prompts = make_requests(list(seq_lens), EXPLORE_RUN_CFG.vocab_size, seed=l06_engine.PROMPT_SEED)
    stats = serve(prompts, max_num_batched_tokens, True, EXPLORE_RUN_CFG, _explore_weights(), compute_logits=False)["stats"]
    wait = mean_wait(request_waits(timeline(stats)), list(range(draft + 1, len(seq_lens))))[1]
    return len(stats), cache_peak_rows(stats, seq_lens)["in_place"], wait


@contextlib.contextmanager
def _no_scheduler():
    """Inside: the engine's scheduler and this module's measures raise (exercise 08.2 measures through its probe)."""
    from ..serve import scheduler as sched_mod

    def refuse(*args, **kwargs):
        raise RuntimeError(f"exercise 08.2 measures only through measure(budget), at most {MAX_PROBES} times: "
                           "without plan_batches, the Scheduler or L.budget_measures")
    undos = [_patch(sched_mod, "plan_batches", refuse), _patch(sched_mod.Scheduler, "schedule_chunks", refuse),
             _patch(sched_mod.Scheduler, "schedule", refuse)]
    g = globals()
    old = {k: g[k] for k in ("plan_batches", "budget_measures", "budget_table", "planned_timeline",
                             "budget_prices", "best_budget", "engine_budget_prices")}
    g.update({k: refuse for k in old})
    try:
        yield
    finally:
        g.update(old)
        for undo in reversed(undos):
            undo()


def _prices_text(p: dict, budget: int) -> str:
    return (f"under {budget}: {p['forwards']} forwards ({p['forwards'] * 2 * ModelConfig().n_layers} all-reduces at "
            f"TP=2), {p['cache_rows_held']:,} cache rows held, the requests behind wait {p['wait_tokens']:,.1f} tokens")


def check_budget_choice(fn) -> bool:
    """Exercise 08.2: ``fn(seq_lens, draft, max_budget, max_cache_rows, measure) -> max_num_batched_tokens``, a
    multiple of ``BUDGET_STEP`` up to ``max_budget`` whose cache held between forwards (written in place) stays within
    ``max_cache_rows``, with the fewest forwards; ties: the least mean wait in tokens of the requests behind ``draft``,
    then the smaller budget. ``measure(budget)`` returns ``budget_prices`` from the engine's scheduler plan, at most
    ``MAX_PROBES`` calls per case; the scheduler itself is switched off while ``fn`` runs. Eight cases (lesson 06's
    stream among them); the stream's answer is then served by ``Engine`` itself."""
    lens0 = stream_lengths()
    probes: list[int] = []
    table: dict[int, dict] = {}      # the case's prices per budget, planned before the scheduler is switched off

    def expand(case):
        return (lens0, draft_index(), *case[1:]) if case[0] == "stream" else case

    def measure(budget):
        budget = check_int("budget", budget, 1, 1 << 16)
        probes.append(budget)
        if len(probes) > MAX_PROBES:
            raise RuntimeError(f"measure was called {len(probes)} times (budgets {probes}): at most {MAX_PROBES} - "
                               "work out where each forward ends from the lengths, and measure only to confirm")
        if budget not in table:
            raise RuntimeError(f"measure({budget}): the budgets of this case are the multiples of {BUDGET_STEP} "
                               f"from {BUDGET_STEP} to {max(table)}")
        return {k: table[budget][k] for k in ("forwards", "cache_rows_held", "wait_tokens")}

    def run(*case):
        seq_lens, d, top, cap = expand(case)
        probes.clear()
        table.clear()
        table.update({b: budget_prices(seq_lens, d, b) for b in range(BUDGET_STEP, top + 1, BUDGET_STEP)})
        with _no_scheduler():
            return fn(list(seq_lens), d, top, cap, measure)

    def judge(got, *case):
        seq_lens, d, top, cap = expand(case)
        if isinstance(got, bool) or not isinstance(got, int):
            return f"expected an int (a max_num_batched_tokens), got {got!r}"[:200]
        if not (BUDGET_STEP <= got <= top and got % BUDGET_STEP == 0):
            return f"got {got}: the budget is a multiple of {BUDGET_STEP} from {BUDGET_STEP} to {top}"
        want = best_budget(seq_lens, d, top, cap)
        mine, best = budget_prices(seq_lens, d, got), budget_prices(seq_lens, d, want)
        if case[0] == "stream":
            f, held, wait = engine_budget_prices(tuple(seq_lens), d, got)
            at_512 = budget_prices(seq_lens, d, BUDGET)
            print(f"  Engine at {got} tokens per forward: {f} forwards, {held:,} cache rows held between forwards, the "
                  f"questions behind the draft wait {wait:,.1f} tokens (at {BUDGET}: {at_512['forwards']} forwards, "
                  f"{at_512['cache_rows_held']:,} rows, {at_512['wait_tokens']:,.1f} tokens)")
        if got == want:
            return None
        ctx = f"{sum(seq_lens):,} tokens, cache limit {cap:,} rows; {_prices_text(mine, got)}; {_prices_text(best, want)}"
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


def _engine_positions(num_computed_tokens, seq_lens) -> Tensor:
    from ..core.batch import pack
    return pack([[0] * n for n in seq_lens], num_computed_tokens=list(num_computed_tokens)).positions


ENGINE_POSITIONS_CASE = "the draft, chunked under 512 on the small model, with your answer in every forward"


def _draft_with_positions(fn) -> dict:
    """The draft served chunked on ``EXPLORER_CFG`` with ``fn`` giving the positions of every forward's rows,
    and unchunked (float32 and float64): ``{"chunked", "whole", "truth"}`` last hidden states ``[1, d]``."""
    from ..core import batch as batch_mod
    from ..serve import engine as engine_mod
    real = batch_mod.pack

    def pack(requests, device=None, num_computed_tokens=None):
        out = real(requests, device=device, num_computed_tokens=num_computed_tokens)
        if num_computed_tokens is not None:
            got = fn(list(num_computed_tokens), list(out.seq_lens))
            out.positions = torch.as_tensor(got, dtype=torch.int64).to(out.positions.device)
        return out
    cfg, d = EXPLORER_CFG, draft_index()
    if "w" not in _EXPLORER_WEIGHTS:
        _EXPLORER_WEIGHTS["w"] = init_weights(cfg, 0)
    prompt = make_requests([stream_lengths()[d]], cfg.vocab_size, seed=l06_engine.PROMPT_SEED)
    undo = _patch(engine_mod, "pack", pack)
    try:
        chunked = serve(prompt, BUDGET, True, cfg, _EXPLORER_WEIGHTS["w"], compute_logits=False)
    finally:
        undo()
    whole, truth = (serve(prompt, WHOLE_BUDGET, False, cfg, _EXPLORER_WEIGHTS["w"], dtype=dt, compute_logits=False)
                    for dt in (torch.float32, torch.float64))
    return {k: stacked(r, "last_hidden") for k, r in (("chunked", chunked), ("whole", whole), ("truth", truth))}


_UNCHUNKED: dict = {}


def chunk_error_table(prompt: Sequence[int] | None = None, cfg: ModelConfig | None = None) -> str:
    """One prompt (default: the draft) served chunked under ``BUDGET`` and whole, on ``cfg`` (default: the
    small model, EXPLORER_CFG; the prompt's ids are taken modulo its vocabulary): for each chunk, the max error of its
    final hidden rows against the float64 unchunked prefill, and the bound of the tolerance rule. With the engine
    whole every line ends in ✓; a broken engine (``broken``) shows which chunks go wrong."""
    cfg = cfg or EXPLORER_CFG
    weights = init_weights(cfg, 0) if cfg is not EXPLORER_CFG else _EXPLORER_WEIGHTS.setdefault("w", init_weights(cfg, 0))
    ids = [[t % cfg.vocab_size for t in (prompt if prompt is not None else stream()[1][draft_index()])]]
    key = (id(cfg), tuple(ids[0]))
    if key not in _UNCHUNKED:  # the unchunked rows do not depend on a chunking bug: computed once
        _UNCHUNKED[key] = {name: serve(ids, WHOLE_BUDGET, False, cfg, weights, dtype=dt, compute_logits=False,
                                       return_hidden=True)["outputs"][0].hidden
                           for name, dt in (("whole", torch.float32), ("truth", torch.float64))}
    chunked = serve(ids, BUDGET, True, cfg, weights, compute_logits=False, return_hidden=True)
    rows = {"chunked": chunked["outputs"][0].hidden, **_UNCHUNKED[key]}
    spans = [(s, n) for st in chunked["stats"] for _, s, n in st.chunks]
    lines = [f"{len(ids[0]):,} tokens in {len(spans)} chunks ({explorer_cfg_text() if cfg is EXPLORER_CFG else 'cfg'}):"]
    for c, (s, n) in enumerate(spans):
        got, ref, ref64 = (rows[k][s:s + n] for k in ("chunked", "whole", "truth"))
        err, bound = max_abs_diff(got, ref64), tolerance(ref, ref64, got.dtype)
        lines.append(f"  chunk {c} (rows {s:4d}..{s + n - 1:4d}): max |chunked - fp64| = {err:8.1e}, allowed "
                     f"{bound:.1e} {'✓' if err <= bound else '✗'}")
    return "\n".join(lines)


def check_bug_report_fix(fn) -> bool:
    """Exercise 08.3: ``fn(num_computed_tokens, seq_lens)``: the quantity of a flat chunked batch (request i brings
    ``seq_lens[i]`` tokens after ``num_computed_tokens[i]`` cached ones) that the bug report's engine
    (``reported_bug``) gets wrong, as the intact engine computes it. Five batches against the engine's own; then
    the draft served chunked on the small model (EXPLORER_CFG) with YOUR tensor in every forward, against its
    unchunked prefill (the tolerance rule, float64 truth). An answer that is another input of the forward
    (``cu_seqlens_q``/``_k``, a mask) is told what the instruments say about that input."""
    def run(done, lens=None):
        if done == ENGINE_POSITIONS_CASE:
            return _draft_with_positions(fn)
        return fn(list(done), list(lens))

    def judge(got, done, lens=None):
        if done == ENGINE_POSITIONS_CASE:
            err, bound = max_abs_diff(got["chunked"], got["truth"]), tolerance(got["whole"], got["truth"])
            return None if err <= bound else (f"inside the engine the draft's last hidden state is off by {err:.2g} "
                                              f"(allowed {bound:.1g})")
        want = _engine_positions(done, lens)
        if not isinstance(got, Tensor):
            return (f"expected a tensor (the quantity of the batch the broken engine gets wrong), got "
                    f"{type(got).__name__}")
        cu_q = torch.cumsum(torch.tensor([0, *lens]), 0)
        cu_k = torch.cumsum(torch.tensor([0, *(c + n for c, n in zip(done, lens))]), 0)
        if got.dim() == 1 and got.numel() == len(lens) + 1 and (torch.equal(got.long(), cu_k) or torch.equal(got.long(), cu_q)):
            which = "cu_seqlens_k" if torch.equal(got.long(), cu_k) else "cu_seqlens_q"
            return (f"that is {which}, and the broken engine gets it right: under reported_bug() the recorder's blocks "
                    f"(recorded_draft_blocks) are n x (s + n), exactly the intact ones. Rule out the next suspect")
        if got.dim() == 2 and got.dtype == torch.bool:
            return ("a mask: the broken engine's masks are right, chunk_mask and chunk_rows_error give the intact "
                    "answer under reported_bug(), and attention alone matches the whole prompt. What else does a "
                    "forward take per row?")
        if tuple(got.shape) != tuple(want.shape):
            return f"shape {list(got.shape)}, expected [{sum(lens)}]: one value per row of the flat batch"
        if got.dtype != torch.int64:
            return f"dtype {got.dtype}, expected torch.int64 (an index into the position embeddings)"
        if torch.equal(got, want):
            return None
        if torch.equal(got, torch.cat([torch.arange(n) for n in lens])):
            return ("positions restart at 0 in every chunk: that is what the bug report's engine does - the second "
                    "chunk's tokens get the embeddings of positions 0, 1, ... and the model reads them as the start of "
                    "a new prompt; start request i at num_computed_tokens[i]")
        if torch.equal(got, torch.arange(sum(lens))):
            return "positions run 0..T-1 across the whole batch: they restart for every REQUEST, at its cached length"
        if torch.equal(got, want + 1):
            return "off by one: the first new token of a request with c cached tokens sits at position c (0-based)"
        return f"values {got.tolist()[:12]}..., the engine's are {want.tolist()[:12]}..."

    return grade("bug_report_fix", run, [*_POSITION_CASES, (ENGINE_POSITIONS_CASE,)], judge,
                 "the quantity the bug report's engine gets wrong, on 5 chunked batches as the engine's pack gives "
                 "it, and the draft served chunked with yours equals its unchunked prefill")


def error_and_bound(out: Tensor, ref: Tensor, ref64: Tensor) -> tuple[float, float]:
    """``(max |out - ref64|, the tolerance rule's bound)`` without raising: a claim cell puts both in its table,
    so a wrong answer fails the claim with its numbers (``check.close`` would raise before the table)."""
    return max_abs_diff(out, ref64), tolerance(ref, ref64, out.dtype)
