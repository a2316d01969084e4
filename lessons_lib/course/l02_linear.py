"""What lesson 02 (linear layers work token by token) draws, explores and checks.

- claims helper: ``measure_steps`` (``probe.row_dependency`` and ``measure.batch_invariance.step_report`` on each
  step of the engine's ``Block``: C4, C5; the walk's shapes, the printouts and the int8 scales live there too);
- figures: the walk, the who-reads-whom maps (``dependency_maps``), the QKV shards per rank (``qkv_shards``, C6);
- the module-reach explorer (``module_reach_state`` + ``module_reach_explorer``): the two tests (``two_tests``)
  live on a module of the engine, a BatchNorm1d or one of the learner's;
- exercises 02.1 (a per-request norm), 02.2 (``RowParallelSuspect``: the engine's ``RowParallelLinear``, some
  under one of its named faults) and 02.3 (int8 scales, ``batching_free``).

Taught in notebooks/02_linear_is_per_token.ipynb.
"""
from __future__ import annotations

import functools
import inspect
import textwrap
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from .. import faults
from ..core.batch import cumulative
from ..core.config import ModelConfig
from ..core.groups import LocalGroup
from ..core.linear import QKVParallelLinear
from ..core.model import Transformer, init_weights
from ..measure import batch_invariance as bi
from ..style import ATTENTION, LINEAR, MIN_FONT, NEVER, OTHER, TEXT, request_name
from ..tp.threads import row_parallel_in_threads
from ..validate import check_choice, check_int, check_lengths
from .explore import explorer, ipywidgets_module, parse_lengths, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import grade, matches, tensor_problem
from .probe import row_dependency

Tensor = torch.Tensor
MIXES_ROWS, MIXES_HATCH = "mixes rows", "xx"  # verdict "mixes requests" (BatchNorm training, a mean over tokens...)
OWN_REQUEST = "own request"  # a learner's module that reads other rows of its own request only, and passes both tests
KIND_COLORS = {"per token": OTHER, "linear": LINEAR, "attention": ATTENTION, MIXES_ROWS: OTHER, OWN_REQUEST: OTHER}
KIND_LABELS = {"per token": "other work, row by row", "linear": "linear layer, row by row",
               "attention": "attention (reads rows by cu_seqlens)", MIXES_ROWS: "mixes requests (fails a test)",
               OWN_REQUEST: "reads rows of its own request only"}
LINEAR_LIGHT = "#99D8C7"  # LINEAR green mixed with white: rank 1's half of the same work


# ---- the same steps on a real block of the engine (measure.batch_invariance) ----------------------

def measure_steps(steps: Sequence[bi.BlockStep], seq_lens: Sequence[int]) -> list[bi.StepReport]:
    """For each of ``block_steps``' steps: its who-reads-whom map (``row_dependency``) and ``step_report``
    (each request alone against the flat run, and against the float64 twin alone)."""
    return [bi.step_report(st, seq_lens, row_dependency(st.fn, st.inp).numpy()) for st in steps]


# ---- figures: the walk, who reads whom, the QKV extractors per rank ---------------------------------

def forward_walk_figure(cfg: ModelConfig, seq_lens: Sequence[int], tp_size: int = 2) -> Figure:
    """Claims C4-C6 as a table: one row per step of ``forward_walk``, coloured by kind."""
    steps = bi.forward_walk(cfg, seq_lens, tp_size)
    *first, last = [f"{request_name(i)} = {n}" for i, n in enumerate(seq_lens)]
    batch = f"{', '.join(first)} and {last}" if first else last  # A = 10 and B = 30
    n = len(steps)
    fig = Figure(figsize=(11.6, 0.42 * n + 1.3))
    ax = fig.add_axes((0.01, 0.1, 0.98, 0.8))
    ax.set_xlim(0, 11.6)
    ax.set_ylim(n + 0.6, -0.1)
    ax.axis("off")
    cols = [(0.0, "step"), (2.55, f"on the flat batch (TP=1, T={sum(seq_lens)})"), (5.45, f"on one rank (TP={tp_size})"),
            (9.15, "row i reads")]
    for x, head in cols:
        ax.text(x + 0.05, 0.35, head, fontsize=MIN_FONT + 1, fontweight="bold", va="center", color=TEXT)
    for i, st in enumerate(steps):
        y = i + 1
        ax.add_patch(Rectangle((0.0, y - 0.42), 2.45, 0.84, facecolor=KIND_COLORS[st.kind], edgecolor="white"))
        ax.text(0.08, y, f"{i}. {st.name}" if i else st.name, fontsize=MIN_FONT + 1, va="center",
                color=TEXT if st.kind == "per token" else "white", fontweight="bold")
        ax.text(2.6, y, st.flat, fontsize=MIN_FONT + 1, va="center", family="DejaVu Sans Mono", color=TEXT)
        ax.text(5.5, y, st.per_rank, fontsize=MIN_FONT + 1, va="center", family="DejaVu Sans Mono", color=TEXT)
        ax.text(9.2, y, st.reads, fontsize=MIN_FONT + 1, va="center", color=ATTENTION if st.kind == "attention" else TEXT,
                fontweight="bold" if st.kind == "attention" else "normal")
    fig.legend(handles=[Patch(facecolor=c, label=lab) for lab, c in
                        (("per token: each row alone (C4; embed: a lookup)", OTHER),
                         ("linear: Y = X W^T + b, row by row (C5)", LINEAR),
                         ("attention: mixes rows, needs cu_seqlens (lesson 03)", ATTENTION))],
               loc="lower center", ncol=3, fontsize=MIN_FONT, frameon=False)
    fig.suptitle(f"One block on the flat batch of {batch} tokens: shapes at every step, and the one step that mixes rows",
                 fontsize=MIN_FONT + 2, y=0.97)
    return fig


def dependency_maps(panels: Mapping[str, np.ndarray], seq_lens: Sequence[int],
                    colors: Mapping[str, str] | None = None) -> Figure:
    """Who reads whom: for each panel a bool ``[T_out, T_in]`` map, True where output row i
    changed when input row j was perturbed (see ``probe.row_dependency``). Request
    boundaries are drawn at ``cu_seqlens`` (dashed, numbered ticks), each request's name between
    its boundaries (minor ticks); ``colors`` gives each panel's True colour."""
    cu = cumulative(check_lengths(seq_lens))
    fig = Figure(figsize=(3.4 * len(panels), 4.0))
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (title, dep) in zip(axes, panels.items()):
        dep = np.asarray(dep, dtype=bool)
        if dep.shape != (cu[-1], cu[-1]):
            raise ValueError(f"panel {title!r} must be [T, T] = {(cu[-1], cu[-1])}, got {dep.shape}")
        color = (colors or {}).get(title, ATTENTION if "attention" in title else LINEAR)
        ax.imshow(dep, cmap=ListedColormap([NEVER, color]), vmin=0, vmax=1, interpolation="nearest",
                  extent=(0, cu[-1], cu[-1], 0))
        for side in ax.spines.values():
            side.set_visible(True)
        mids = [(a + b) / 2 for a, b in zip(cu[:-1], cu[1:])]  # each request's name between its boundaries
        for axis, boundary in ((ax.xaxis, ax.axvline), (ax.yaxis, ax.axhline)):
            axis.set_ticks(cu)
            axis.set_ticks(mids, [request_name(i) for i in range(len(cu) - 1)], minor=True, fontweight="bold")
            for e in cu[1:-1]:
                boundary(e, color=TEXT, linewidth=0.8, linestyle="--")
        ax.tick_params(which="minor", length=0, labelsize=MIN_FONT + 1, labelcolor=TEXT)
        ax.tick_params(labelsize=MIN_FONT)
        ax.set_title(f"{title}\n{int(dep.sum())} of {dep.size} pairs", fontsize=MIN_FONT + 1)
        ax.set_xlabel("perturbed input row j", fontsize=MIN_FONT)
    axes[0].set_ylabel("output row i that changed", fontsize=MIN_FONT)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.14, top=0.8, wspace=0.3)
    return fig


def qkv_shards(cfg: ModelConfig, tokens: int = 40, tp_size: int = 2) -> Figure:
    """Claim C6: the ``3·H·D`` rows of the fused QKV weight are feature extractors; each TP rank
    owns those of its heads (in Q, in K and in V) and runs them on every token."""
    k, hr = cfg.qkv_dim, cfg.heads_per_rank(tp_size)
    owner = np.full(3 * k, -1)  # the rank that holds each row, by the engine's own cut (one-process stand-in groups)
    for rank in range(tp_size):
        layer = QKVParallelLinear(cfg.d_model, cfg.n_heads, cfg.d_head, bias=False, group=LocalGroup(rank, tp_size))
        owner[layer.shard_rows(torch.arange(3 * k)).numpy()] = rank
    shades = [LINEAR, LINEAR_LIGHT]
    hatches = ["", "//"]
    fig = Figure(figsize=(10, 2.9))
    ax = fig.add_axes((0.03, 0.36, 0.94, 0.42))
    for h in range(3 * cfg.n_heads + 1):
        ax.axvline(h * cfg.d_head, color="white", linewidth=1.0)
    for part, name in enumerate("QKV"):
        ax.axvline(part * k, color=TEXT, linewidth=1.5)
        ax.text(part * k + k / 2, 1.12, f"{name}: {cfg.n_heads} heads x {cfg.d_head} extractors", ha="center",
                fontsize=MIN_FONT + 1)
        for h in range(cfg.n_heads):  # a head's extractors, all on the rank that owns its first row
            start = part * k + h * cfg.d_head
            shade = owner[start] % 2
            ax.add_patch(Rectangle((start, 0), cfg.d_head, 1, facecolor=shades[shade], hatch=hatches[shade],
                                   edgecolor="white", linewidth=0.0))
            ax.text(start + cfg.d_head / 2, 0.5, f"h{h}", ha="center", va="center", fontsize=MIN_FONT,
                    color="white" if shade == 0 else TEXT)
    ax.set_xlim(0, 3 * k)
    ax.set_xticks(range(0, 3 * k + 1, k // 2))  # only ticks inside the row range (no label past the last row)
    ax.set_ylim(0, 1.3)
    ax.set_yticks([])
    for side in ("left", "top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_xlabel(f"row of the full QKV weight = one feature extractor ({3 * k} in all)", fontsize=MIN_FONT + 1)
    per_rank = 3 * hr * cfg.d_head
    fig.legend(handles=[Patch(facecolor=shades[r % 2], hatch=hatches[r % 2], edgecolor="white",
                              label=f"rank {r}: heads {r * hr}-{(r + 1) * hr - 1}, "
                                    f"{per_rank} extractors: [{tokens} x {cfg.d_model}] -> [{tokens} x {per_rank}]")
                        for r in range(tp_size)],
               loc="lower center", ncol=min(tp_size, 2), fontsize=MIN_FONT + 1, frameon=False)
    fig.suptitle(f"TP={tp_size}, QKV projection: each rank owns the Q, K and V extractors of its "
                 f"{hr} heads and runs them on all {tokens} tokens", fontsize=MIN_FONT + 2, y=0.97)
    return fig


def who_reads_whom_panels(seq_lens: Sequence[int] = ARTICLE_LENS) -> tuple[dict, dict]:
    """The lesson figure's four measured maps (``module_reach_state``) and the colour of each: the colour
    of the module's kind (the kind of work it is), not of the explorer's verdict."""
    modules = reach_modules()
    picks = {"LayerNorm (per token)": "LayerNorm (block.ln_1)", "QKV linear": "QKV linear (block.attn.qkv)",
             "attention told one sequence": "attention told one sequence, cu = [0, T]",
             "attention with cu_seqlens": "attention with cu_seqlens (block.attn.core)"}
    states = {title: module_reach_state(name, seq_lens) for title, name in picks.items()}
    return ({t: s["dep"] for t, s in states.items()},
            {t: KIND_COLORS[modules[picks[t]].kind] for t in states})


@register("02_forward_walk", lesson="02",
          caption="the embedding and the ten steps of a block on [40 x 512]: shapes at TP=1 and per rank, who row i reads")
def _forward_walk() -> Figure:
    return forward_walk_figure(ModelConfig(), ARTICLE_LENS)


@register("02_who_reads_whom", lesson="02",
          caption="which input rows change which output rows, measured on the engine's block: LayerNorm (grey), "
                  "QKV (green), attention without and with cu_seqlens (blue) (C4, C5, C7, C10)")
def _who_reads_whom() -> Figure:
    panels, colors = who_reads_whom_panels(ARTICLE_LENS)
    fig = dependency_maps(panels, ARTICLE_LENS, colors)
    fig.suptitle("Pairs (i, j) where perturbing input row j changed output row i, measured by row_dependency on "
                 "the engine's block (A = 10, B = 30 tokens)", fontsize=MIN_FONT + 2, color=TEXT)
    fig.subplots_adjust(top=0.76)
    return fig


@register("02_qkv_shards", lesson="02",
          caption="TP=2: each rank owns the Q, K, V extractors of its 4 heads, [40 x 512] -> [40 x 768] (C6)")
def _qkv_shards() -> Figure:
    return qkv_shards(ModelConfig(), tokens=sum(ARTICLE_LENS))


# ---- the module-reach explorer: which rows does a module let a row read? -------------------------------

REACH_CFG = ModelConfig(n_layers=1, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=50, max_position=64)
MAX_REACH_TOKENS, MAX_REACH_REQUESTS = 120, 16
SAFE, MIXES = "safe to batch flat", "mixes requests"


@dataclass(frozen=True)
class ReachModule:
    """A module for the explorer: ``fn(t [T, width], cu_seqlens) -> [T, ...]``, its palette kind ("per token",
    "linear", "attention", ``MIXES_ROWS``; None for a learner's: the measured map decides) and its input width."""

    fn: Callable
    kind: str
    width: int


@functools.cache
def reach_model() -> Transformer:
    """A one-block model of the engine at ``REACH_CFG`` (fixed seed): the maps are bools, they do not depend on the sizes."""
    return Transformer(REACH_CFG, init_weights(REACH_CFG, seed=0))


def _engine_modules() -> dict[str, ReachModule]:
    model, cfg = reach_model(), REACH_CFG
    b, d, k, f = model.layers[0], cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    step = functools.partial(bi.module_step, model, backend="masked")
    core = step("attn.core")

    def residual_adds(t, cu):  # the Block's own two adds, with attention's output (out proj) zeroed: t + mlp(ln_2(t))
        with bi.attention_context(model, cu, "masked"):
            return bi.block_sum(b, t, {"attn.out_proj": torch.zeros_like(t)}, "")

    train_bn, eval_bn = torch.nn.BatchNorm1d(d), torch.nn.BatchNorm1d(d)
    eval_bn.running_mean.normal_(generator=torch.Generator().manual_seed(12))
    eval_bn.eval()
    return {
        "LayerNorm (block.ln_1)": ReachModule(step("ln_1"), "per token", d),
        "QKV linear (block.attn.qkv)": ReachModule(step("attn.qkv"), "linear", d),
        "attention with cu_seqlens (block.attn.core)": ReachModule(core, "attention", 3 * k),
        "attention told one sequence, cu = [0, T]": ReachModule(lambda t, cu: core(t, [0, cu[-1]]), "attention", 3 * k),
        "out proj (block.attn.out_proj)": ReachModule(step("attn.out_proj"), "linear", k),
        "GeLU (block.mlp.act)": ReachModule(step("mlp.act"), "per token", f),
        "FFN: up, GeLU, down (block.mlp)": ReachModule(step("mlp"), "linear", d),
        "residual adds (block, attention's output zeroed)": ReachModule(residual_adds, "per token", d),
        "BatchNorm1d, training mode": ReachModule(lambda t, cu: train_bn(t), MIXES_ROWS, d),
        "BatchNorm1d, eval mode (running stats)": ReachModule(lambda t, cu: eval_bn(t), "per token", d),
    }


# Modules a learner defines: name -> fn(t [T, d], cu_seqlens) -> [T, ...]. Five to start; add yours with
# add_reach_module.
_OWN_MODULES: dict[str, Callable] = {
    "yours: softmax over each row": lambda t, cu: torch.softmax(t, dim=-1),
    "yours: mean over the tokens": lambda t, cu: t.mean(dim=0, keepdim=True).expand_as(t),
    "yours: cumsum over the tokens": lambda t, cu: t.cumsum(dim=0),
    "yours: positions from the flat index, t + arange(T)": lambda t, cu: t + torch.arange(t.shape[0])[:, None],
    "yours: divide by the batch size, t / T": lambda t, cu: t / t.shape[0],
}


def _takes_cu_seqlens(fn: Callable) -> bool:
    """Whether ``fn`` takes two positional arguments (``t, cu_seqlens``) rather than one (``t``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin with no signature: called as fn(t)
        return False
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return len(required) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def add_reach_module(name: str, fn: Callable) -> None:
    """Add your own module to the explorer: ``fn(t [T, d_model]) -> [T, ...]``, or
    ``fn(t, cu_seqlens) -> [T, ...]`` for a module that needs the request boundaries (``cu_seqlens`` a
    list of ints; a request run alone gets ``[0, its length]``). One output row per token."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise ValueError(f"fn must be a function t -> tensor or (t, cu_seqlens) -> tensor, got {type(fn).__name__}")
    run = fn if _takes_cu_seqlens(fn) else (lambda t, cu, fn=fn: fn(t))
    _OWN_MODULES["yours: " + name.strip().removeprefix("yours: ")] = run


def reach_modules() -> dict[str, ReachModule]:
    """Every module the explorer offers: the engine's own, two BatchNorm1d, and the learner's."""
    own = {name: ReachModule(fn, None, REACH_CFG.d_model) for name, fn in _OWN_MODULES.items()}  # kind: measured
    return {**_engine_modules(), **own}


@torch.no_grad()
def two_tests(fn: Callable[[Tensor, list[int]], Tensor], x: Tensor, seq_lens: Sequence[int]) -> dict:
    """The explorer's two tests of ``fn(t, cu_seqlens)`` on the flat rows ``x [T, ...]`` of ``seq_lens``:
    ``{"dep" (the map ``row_dependency`` measures, bool [T, T]), "pairs"}``, ``reach_counts``' keys, ``"reach_ok"``,
    ``alone_vs_batched``'s ``max_diff, bound, differ, row_diff`` (each row's max |alone - flat|) as ``"alone_max_diff"``,
    ..., ``"alone_ok"``, and ``"free"``: both tests pass."""
    cu = cumulative(check_lengths(seq_lens))
    dep = row_dependency(lambda t: fn(t, cu), x).numpy()
    seen, alone = bi.reach_counts(dep, seq_lens), bi.alone_vs_batched(fn, x, seq_lens)
    return {"dep": dep, "pairs": int(dep.sum()), **seen, "reach_ok": seen["other_requests"] == 0,
            **{f"alone_{key}": alone[key] for key in ("max_diff", "bound", "differ", "row_diff")},
            "alone_ok": not alone["differ"], "free": seen["other_requests"] == 0 and not alone["differ"]}


def module_reach_state(module: str, seq_lens: Sequence[int] = ARTICLE_LENS) -> dict:
    """The two tests a module must pass to be batched flat, on random rows (fixed seed) of ``seq_lens``:
    1. reach: no pair (i, j) of ``row_dependency`` across a request boundary; 2. alone vs batched
    (``alone_vs_batched``). A module can pass 1 and fail 2 (``t / T``, positions from the flat row index).

    Returns ``{"module", "kind", "seq_lens", "cu_seqlens"}``, ``two_tests``' keys and ``"verdict"``: ``SAFE`` only
    when both tests pass.
    """
    modules = reach_modules()
    check_choice("module", module, tuple(modules))
    lens = check_lengths(seq_lens)
    if len(lens) > MAX_REACH_REQUESTS or sum(lens) > MAX_REACH_TOKENS:
        raise ValueError(f"lengths: at most {MAX_REACH_REQUESTS} requests and {MAX_REACH_TOKENS} tokens in all "
                         f"(the explorer runs the module once per row), got {len(lens)} requests, {sum(lens)} tokens")
    m, cu = modules[module], cumulative(lens)
    x = torch.randn(cu[-1], m.width, generator=torch.Generator().manual_seed(5))
    try:
        tests = two_tests(m.fn, x, lens)
    except Exception as exc:  # a learner's module, or BatchNorm on one token: say so, never a wrong map
        if "Expected more than 1 value per channel" in str(exc):
            raise ValueError(f"{module} on lengths {lens}: a request of one token is run alone as a one-token "
                             "batch, and a one-token batch has no variance: BatchNorm cannot even run on it") from None
        raise ValueError(f"{module} failed on {cu[-1]} rows: {type(exc).__name__}: {exc}") from None
    verdict = SAFE if tests["free"] else MIXES
    if verdict == MIXES:  # the colour follows the verdict, whatever the module's kind
        kind = MIXES_ROWS
    elif m.kind in (None, MIXES_ROWS):  # a learner's module, or BatchNorm in training mode on one request
        kind = OWN_REQUEST if tests["own_request"] else "per token"
    else:
        kind = m.kind
    return {"module": module, "kind": kind, "seq_lens": lens, "cu_seqlens": cu, **tests, "verdict": verdict}


def module_reach_text(state: dict) -> str:
    """``<module> on cu_seqlens [...]: 40 of 1600 pairs change | diagonal 40 | same request 0 | across requests 0
    | row i reads row i only | alone vs batched: max |diff| 0.0e+00 (bound 1.2e-05), differ: none | verdict``."""
    t = state["cu_seqlens"][-1]
    differ = ", ".join(state["alone_differ"]) or "none"
    return (f"{state['module']} on cu_seqlens {state['cu_seqlens']}: {state['pairs']} of {t * t} pairs change | "
            f"diagonal {state['diagonal']} | same request {state['own_request']} | "
            f"across requests {state['other_requests']} | row i reads {state['reads']} | "
            f"alone vs batched: max |diff| {state['alone_max_diff']:.1e} (bound {state['alone_bound']:.1e}), "
            f"differ: {differ} | {state['verdict']}")


def module_reach_figure(state: dict) -> Figure:
    """The measured who-reads-whom map of ``state``, request boundaries dashed, coloured by kind (legend),
    and beside it, row by row, test 2: each row's max |alone - flat| against the bound (dashed); the verdict
    is wrapped to the figure's width."""
    title = "\n".join(textwrap.wrap(state["module"], 44))  # a long name of the learner's own stays inside
    fig = dependency_maps({title: state["dep"]}, state["seq_lens"], colors={title: KIND_COLORS[state["kind"]]})
    fig.set_size_inches(6.6, 5.0)
    top = 0.72 if "\n" in title else 0.75
    fig.subplots_adjust(left=0.11, right=0.64, bottom=0.17, top=top)
    ax_map = fig.axes[0]
    ax = fig.add_axes((0.72, 0.17, 0.25, top - 0.17))
    t, gap, bound = state["cu_seqlens"][-1], np.asarray(state["alone_row_diff"], dtype=float), state["alone_bound"]
    # in units of the bound (a bound of 0, all outputs 0: any gap is infinitely many bounds, drawn at 2)
    ratio = np.where(gap == 0, 0.0, gap / bound if bound > 0 else np.inf)
    ratio = np.nan_to_num(ratio, nan=2.0, posinf=2.0)  # a NaN fails the test too: drawn past the bound
    ax.barh(np.arange(t) + 0.5, ratio, height=1.0, color=KIND_COLORS[state["kind"]], edgecolor=TEXT, linewidth=0.3,
            hatch=MIXES_HATCH if state["kind"] == MIXES_ROWS else None)  # mixing: grey, hatched (vermillion is waste)
    ax.axvline(1.0, color=TEXT, linewidth=0.9, linestyle="--")
    for e in state["cu_seqlens"][1:-1]:
        ax.axhline(e, color=TEXT, linewidth=0.8, linestyle="--")
    ax.set(xscale="log", xlim=(min(0.1, float(ratio[ratio > 0].min(initial=0.2)) / 2), max(2.0, float(ratio.max()) * 2)))
    ax.set(ylim=(t, 0), yticks=state["cu_seqlens"], yticklabels=[])
    ax.xaxis.set_major_formatter(FuncFormatter(  # short labels: 1e5, not 100000, on a log axis of many decades
        lambda v, _: f"{v:g}" if 0.01 <= v < 1000 else f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")))
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_title("test 2, row by row:\n|alone - flat| / bound", fontsize=MIN_FONT + 1)
    ax.set_xlabel("- - the bound (1)", fontsize=MIN_FONT)
    ax_map.set_position(ax_map.get_position())
    alone = "alone = batched" if state["alone_ok"] else "alone != batched: " + ", ".join(state["alone_differ"])
    verdict = f"{state['verdict']}: {state['other_requests']} pairs across requests, {alone}"
    fig.suptitle("\n".join(textwrap.wrap(verdict, 46)), fontsize=MIN_FONT + 1, color=TEXT, fontweight="bold", y=0.98)
    fig.legend(handles=[Patch(facecolor=KIND_COLORS[state["kind"]], edgecolor=TEXT, linewidth=0.6,
                              hatch=ax.patches[0].get_hatch(), label=f"pair changes; kind: {KIND_LABELS[state['kind']]}")],
               loc="lower center", fontsize=MIN_FONT, frameon=False)
    return fig


def module_reach_explorer(module: str = "yours: cumsum over the tokens", lengths: str = "10, 30"):
    """VBox class ``mrx``: Dropdown ``mrx-module``, Text ``mrx-lengths``, HTML ``mrx-verdict`` (the
    ``module_reach_text`` line), Output ``mrx-figure``. Bad input shows its error (class ``mrx-error``)."""
    w = ipywidgets_module()
    pick = tagged(w.Dropdown(options=list(reach_modules()), value=module, description="module",
                             layout=w.Layout(width="420px")), "mrx-module")
    text = tagged(w.Text(value=lengths, description="lengths", continuous_update=False), "mrx-lengths")
    verdict, out = tagged(w.HTML(), "mrx-verdict"), tagged(w.Output(), "mrx-figure")

    def update(change=None):
        try:
            state = module_reach_state(pick.value, parse_lengths(text.value, MAX_REACH_REQUESTS, MAX_REACH_TOKENS))
        except ValueError as exc:
            verdict.add_class("mrx-error")
            verdict.value = f"<div>{exc}</div>"
            return
        verdict.remove_class("mrx-error")
        verdict.value = f"<div>{module_reach_text(state)}</div>"
        show_figure(out, module_reach_figure(state))

    return explorer("mrx", [pick, text], [verdict, out], update)


# ---- exercises -------------------------------------------------------------------------------------

def _flat(seq_lens: Sequence[int], d: int, seed: int) -> Tensor:
    return torch.randn(sum(seq_lens), d, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


def _stats_norm(x: Tensor, cu: Sequence[int], eps: float, start: int = 0, stop: int = 0, unbiased: bool = False,
                eps_outside: bool = False) -> Tensor:
    """Each request's rows ``s:e`` (of ``cu``) of ``x [T, d]`` normalised feature by feature with the mean and
    variance of the rows ``s + start:e + stop`` (clipped to ``x``): exercise 02.1's norm and its slips."""
    out = torch.empty_like(x)
    for s, e in zip(cu[:-1], cu[1:]):
        rows = x[max(s + start, 0):min(e + stop, len(x))]
        mean, var = rows.mean(0), rows.var(0, unbiased=unbiased)
        out[s:e] = (x[s:e] - mean) / ((var.sqrt() + eps) if eps_outside else torch.sqrt(var + eps))
    return out


def request_norm(x: Tensor, cu_seqlens: Sequence[int], eps: float) -> Tensor:
    """BatchNorm's statistics taken per REQUEST: each feature of request r is normalised with its mean and
    biased variance over the rows ``cu_seqlens[r]:cu_seqlens[r+1]`` only. ``[T, d] -> [T, d]``."""
    return _stats_norm(x, list(cu_seqlens), eps)


def _same(got, want: Tensor, atol: float = 1e-4) -> bool:
    """``matches`` where NaN in the same places counts as equal (a typical mistake may give NaN)."""
    return isinstance(got, Tensor) and tuple(got.shape) == tuple(want.shape) and got.is_floating_point() and bool(
        torch.allclose(got.double(), want.double(), atol=atol, equal_nan=True))


BOUNDARY_SLIPS = (  # exercise 02.1's off-by-ones: which rows request r's statistics take, shifts of start and stop
    ("one row too many: rows cu[r]:cu[r+1] + 1 take the next request's first row", 0, 1),
    ("one row too early: rows cu[r] - 1:cu[r+1] take the previous request's last row", -1, 0),
    ("one row too few: rows cu[r] + 1:cu[r+1] drop the request's first row", 1, 0),
    ("one row too few: rows cu[r]:cu[r+1] - 1 drop the request's last row", 0, -1))


def _request_norm_slips(x: Tensor, cu: list[int], eps: float) -> list[tuple[Tensor, str]]:
    """What the typical wrong answers of exercise 02.1 give on ``(x, cu, eps)``, each with its explanation."""
    spans = list(zip(cu[:-1], cu[1:]))
    longest = max(e - s for s, e in spans)
    padded = [torch.cat([x[s:e], x.new_zeros(longest - (e - s), x.shape[1])]) for s, e in spans]  # [longest, d] each
    with warnings.catch_warnings():  # a slip's variance of one row (or none) warns: the slip, not the learner's
        warnings.simplefilter("ignore")
        return [
            (F.batch_norm(x, None, None, training=True, eps=eps), "statistics over ALL the tokens of the flat batch: "
             "that is plain BatchNorm, and A's numbers depend on B's. Which rows are request r's, and only its?"),
            (torch.cat([(x[s:e] - p.mean(0)) / torch.sqrt(p.var(0, unbiased=False) + eps) for (s, e), p in
                        zip(spans, padded)]),
             f"statistics over the padded layout: a shorter request's pad rows of zeros enter its mean and variance "
             f"(both divide by the longest length, {longest}, not by the request's own), so its numbers depend on the "
             "longest request beside it"),
            (F.layer_norm(x, (x.shape[1],), eps=eps), "you normalised each ROW over its features (LayerNorm): that was "
             "safe already; BatchNorm normalises each FEATURE over tokens, and that is what the model was trained with"),
            (_stats_norm(x, cu, eps, unbiased=True), "the unbiased variance (divide by n - 1): F.batch_norm normalises "
             "with the biased one (divide by n), and n - 1 = 0 for a one-token request"),
            (_stats_norm(x, cu, eps, eps_outside=True), "eps added outside the square root: F.batch_norm computes "
             "(x - mean) / sqrt(var + eps)"),
            (_stats_norm(x, cu, 0.0), "no eps: a one-token request has variance 0, and 0 / 0 is NaN"),
        ] + [(_stats_norm(x, cu, eps, start, stop),
              f"off by one at a request boundary ({name}); request r is exactly the rows cu[r] to cu[r+1] - 1")
             for name, start, stop in BOUNDARY_SLIPS]


def check_request_norm(fn: Callable[[Tensor, list, float], Tensor]) -> bool:
    """Exercise 02.1: ``fn(x [T, d], cu_seqlens, eps) -> [T, d]``: on a batch of one request exactly
    ``F.batch_norm(x, None, None, training=True, eps=eps)``, and safe to batch flat. Checked on values
    (one request; A, B with B far from A; three requests with a one-token one in the middle; one-token
    requests at both ends), each wrong value matched against the typical slips, then with the explorer's
    two tests (``two_tests``) on the flat A, B batch."""
    lens = list(ARTICLE_LENS)
    dep_x, cu_ab = _flat(lens, 16, 7), cumulative(lens)
    ab = _flat(lens, 16, 2)
    ab[lens[0]:] = ab[lens[0]:] * 5 + 20                               # B far from A: whole-batch statistics show
    cases = [(_flat([24], 16, 1), [0, 24], 1e-5), (ab, cu_ab, 1e-5),
             (_flat([7, 1, 12], 8, 3), [0, 7, 8, 20], 1e-3), (_flat([1, 5, 1], 8, 4), [0, 1, 6, 7], 1e-3),
             (dep_x, cu_ab, 1e-5)]

    def judge(got, x, cu, eps):
        if x is dep_x:  # the explorer's two tests, on the learner's layer
            tests = two_tests(lambda t, c: fn(t, c, eps), x, lens)
            if readers := tests["across_from"]:  # input rows that reach the other request
                where = (f"only row {readers[0]} reaches across, one of the two rows at the boundary (cu[1] - 1 = "
                         f"{lens[0] - 1}, cu[1] = {lens[0]}): off by one at the boundary" if len(readers) == 1 and
                         readers[0] in (lens[0] - 1, lens[0]) else
                         f"{len(readers)} input rows reach the other request: the statistics read across the boundary")
                return f"row_dependency: {tests['other_requests']} pairs across requests - {where}"
            if tests["alone_differ"]:
                return (f"row_dependency finds no pair across requests, but request(s) {', '.join(tests['alone_differ'])} "
                        f"run alone get other numbers than in the batch (max |diff| {tests['alone_max_diff']:.2g}): the layer "
                        "depends on the batch in a way no row-to-row map shows (on T, on the longest request, or on "
                        "the flat row index)")
            return None
        want = request_norm(x, cu, eps)
        problem = tensor_problem(got, want, atol=1e-4)
        if problem is None:
            return None
        if isinstance(got, Tensor) and tuple(got.shape) == tuple(want.shape):
            for slip, why in _request_norm_slips(x, cu, eps):
                if not _same(slip, want) and _same(got, slip):
                    return f"{problem} - {why}"
            singles = [s for s, e in zip(cu[:-1], cu[1:]) if e - s == 1]
            others = [i for i in range(len(x)) if i not in singles]
            if singles and got.is_floating_point() and _same(got[others], want[others]):
                return (f"{problem} - every request of two or more tokens is right; the one-token request(s) at row(s) "
                        f"{singles} are not. Its mean is the token itself and its biased variance 0: what does "
                        "(x - mean) / sqrt(var + eps) give, with no special case?")
            if got.is_floating_point() and not torch.isfinite(got).all():
                return problem + " - NaN or inf: a one-token request has variance 0 (and an empty slice a NaN mean)"
        return problem

    return grade("request_norm", fn, cases, judge,
                 "each request normalised over its own tokens - no pair across requests, and each request alone "
                 "gets its rows of the flat batch: BatchNorm's idea made safe to batch flat")


# Exercise 02.2: four row-parallel layers, each the engine's RowParallelLinear under one of its named faults (or
# none); the learner sees outputs and traces only.
ROW_PARALLEL_FAULTS = {"correct": (), "bias on every rank": ("row_parallel_bias_on_every_rank",),
                       "all-reduce before the matmul": ("row_parallel_all_reduce_before_matmul",),
                       "no all-reduce": ("row_parallel_no_all_reduce",)}
ROW_PARALLEL_VERDICTS = tuple(ROW_PARALLEL_FAULTS)


class RowParallelSuspect:
    """A row-parallel layer ``[T, in] -> [T, out]`` on ``world_size`` ranks (threads that really
    all-reduce, ``tp.threads``), with the full weight hidden: you may only run it.

    ``run(x [T, in])`` gives ``(outputs, traces)``: each rank's output ``[T, out]`` (rank r is handed
    its slice ``x[:, r·in/tp : (r+1)·in/tp]``, as in a real TP forward) and each rank's list of
    collectives (``CollectiveRecord``: ``op``, ``shape``, ...). ``bias`` is the full bias ``[out]``
    (what the right layer adds once); ``in_features``, ``out_features``, ``world_size`` as named.
    """

    def __init__(self, verdict: str, in_features: int, out_features: int, world_size: int, seed: int = 0):
        check_choice("verdict", verdict, ROW_PARALLEL_VERDICTS)
        self._faults = ROW_PARALLEL_FAULTS[verdict]
        self.in_features = check_int("in_features", in_features, 1)
        self.out_features = check_int("out_features", out_features, 1)
        self.world_size = check_int("world_size", world_size, 2, 8)
        if in_features % world_size:
            raise ValueError(f"in_features={in_features} is not divisible by world_size={world_size}")
        g = torch.Generator().manual_seed(seed)
        self._weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
        self.bias = torch.randn(out_features, generator=g) + 1.0

    def run(self, x: Tensor) -> tuple[list[Tensor], list[list]]:
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != self.in_features or not x.is_floating_point():
            got = f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a float tensor [T, {self.in_features}], got {got}")
        with faults.injected(*self._faults):
            return row_parallel_in_threads(self._weight, self.bias, x.float(), self.world_size)

    def __repr__(self) -> str:
        return (f"RowParallelSuspect(in_features={self.in_features}, out_features={self.out_features}, "
                f"world_size={self.world_size})")


def row_parallel_suspects() -> dict[str, RowParallelSuspect]:
    """The four layers of the lesson (in=16, out=6, TP=2), under names that do not give the bug away."""
    order = ("bias on every rank", "correct", "no all-reduce", "all-reduce before the matmul")
    return {f"layer_{i + 1}": RowParallelSuspect(v, 16, 6, 2, seed=i) for i, v in enumerate(order)}


def _evidence(s: RowParallelSuspect) -> str:
    """What the outputs and traces show (computed by running the suspect), for the checker's hints."""
    outs, traces = s.run(torch.randn(4, s.in_features, generator=torch.Generator().manual_seed(9)))
    zero, _ = s.run(torch.zeros(2, s.in_features))
    agree = all(torch.allclose(o, outs[0], atol=1e-5) for o in outs)
    times = (zero[0][0] / s.bias).mean().item()
    shapes = sorted({tuple(r.shape) for r in traces[0]})
    return (f"its ranks {'agree' if agree else 'DISAGREE'} on a random x; on x = 0 rank 0 gives {times:.2f} x bias; "
            f"rank 0 made {len(traces[0])} all-reduce(s)" + (f" of shape {shapes}" if shapes else "") +
            f" (a [T, out] partial would be [T, {s.out_features}], an input slice [T, {s.in_features // s.world_size}])")


def check_row_parallel_diagnosis(fn: Callable[[RowParallelSuspect], str]) -> bool:
    """Exercise 02.2: ``fn(suspect) -> one of ROW_PARALLEL_VERDICTS``, found by running the suspect
    (``suspect.run(x)``) on inputs of your choice: its outputs and its collective trace, nothing else."""
    truth = {RowParallelSuspect(v, i, o, tp, seed=10 + k): v for k, (v, i, o, tp) in enumerate((
        ("bias on every rank", 16, 6, 2), ("correct", 16, 6, 2), ("no all-reduce", 12, 5, 3),
        ("all-reduce before the matmul", 16, 6, 2), ("bias on every rank", 12, 4, 4), ("correct", 8, 3, 4),
        ("all-reduce before the matmul", 16, 8, 2),   # in/tp = out: the payload shape alone cannot tell
        ("no all-reduce", 16, 8, 2)))}

    def judge(got, s):
        want = truth[s]
        if got == want:
            return None
        if got not in ROW_PARALLEL_VERDICTS:
            return f"answer one of {list(ROW_PARALLEL_VERDICTS)}, got {got!r}"
        hints = {"correct": "the right layer: every rank gives the same [T, out], exactly the bias on x = 0, one "
                            "all-reduce of the [T, out] partial",
                 "bias on every rank": f"the ranks agree, but x = 0 gives {s.world_size} x the bias: each rank added b "
                                       "before the sum",
                 "all-reduce before the matmul": "it all-reduces, yet the ranks disagree: the sum came too early "
                                                 "(of the input slices), so each rank multiplies by its own W_r",
                 "no all-reduce": "no collective at all: each rank returns its own partial plus b, and they disagree"}
        return f"not '{got}': {_evidence(s)}. What fits is: {hints[want]}"

    return grade("row_parallel_diagnosis", fn, [(s,) for s in truth], judge,
                 "each suspect named from its outputs and its trace, for TP = 2, 3 and 4")


def batching_free(quantize: Callable[[Tensor], Tensor], seq_lens: Sequence[int] = ARTICLE_LENS) -> dict:
    """The engine's QKV linear (``REACH_CFG``'s block) with its input quantised by ``quantize``, run through
    the explorer's two tests on a flat batch whose requests differ in size (B's numbers 30 times A's): ``two_tests``'
    dict (``"other_requests"``: pairs across requests, ``"alone_differ"``: requests whose rows alone differ, ``"free"``)."""
    lens = check_lengths(seq_lens)
    qkv = reach_model().layers[0].attn.qkv
    x = torch.randn(sum(lens), REACH_CFG.d_model, generator=torch.Generator().manual_seed(13))
    x[lens[0]:] *= 30
    return two_tests(lambda t, cu: qkv(quantize(t)), x, lens)


_WHY = {"per-tensor static": "a constant scale, fixed offline: batching stays free, but it cannot know the next request's "
                             "size, and a number beyond 127 levels of it is clamped",
        "per-tensor dynamic": "one scale for the whole [T, d]: the largest number of ANY request sets every request's "
                              "grid (a scale per row that all take the batch max is the same thing)",
        "per-feature dynamic": "one scale per feature k: it changes along the summed axis, so it cannot leave the int32 "
                               "sum, and each feature's max runs over every request's tokens"}


def _int8_problem(have: Tensor, x: Tensor) -> str | None:
    """Which constraint of exercise 02.3 a wrong quantiser output ``have`` of ``x [T, d]`` breaks, or None."""
    for other in bi.QUANT_SCHEMES[:3]:
        if matches(have, bi.fake_int8(x, other), 1e-6):
            return f"that is the {other} scale: {_WHY[other]}"
    if not have.is_floating_point() or not torch.isfinite(have).all():
        return "NaN or inf: a row of zeros has max 0, so s = 0 and 0 / 0 = NaN: give it any non-zero scale"
    row_max, got_max = x.abs().amax(-1), have.abs().amax(-1)
    step = row_max / 127                                                 # the finest grid that clamps nothing
    clamped = (got_max < row_max - step / 2 - 1e-6).nonzero().flatten().tolist()
    if clamped:
        return (f"row(s) {clamped[:4]} clamped: their largest |x| is {float(row_max[clamped[0]]):.3g}, your largest "
                f"level there {float(got_max[clamped[0]]):.3g} (constraint 2: no number may be clamped)")
    err = (have - x).abs().amax(-1)
    coarse = (err > step / 2 * (1 + 1e-4) + 1e-7).nonzero().flatten().tolist()
    if coarse:
        r = coarse[0]
        return (f"row(s) {coarse[:4]} on a coarser grid than needed: row {r} rounds to within {float(err[r]):.3g}, but "
                f"a grid that clamps nothing can round it to within max|x| / 254 = {float(step[r] / 2):.3g} "
                "(constraint 3: the finest grid)")
    levels = have / step.clamp_min(1e-30)[:, None]
    if not torch.allclose(levels, levels.round(), atol=1e-3):
        return ("the values are not on one grid of ±127 levels per row: each number rounded on its own scale (or not at "
                "all) is not int8 with one scale the int32 sum can take out")
    return None


def check_int8_quantizer(fn: Callable[[Tensor], Tensor]) -> bool:
    """Exercise 02.3: ``fn(x [T, d]) -> [T, d]``, symmetric int8 fake quantisation (dequantised) whose scale
    can be taken out of the matmul's int32 sum, keeps batching free, clamps nothing and is as fine as
    these allow. Checked on values (one token; a row of zeros; rows 300 times apart; numbers far beyond the
    calibrated range), each wrong value named by the constraint it breaks, then fed to the engine's QKV linear on a flat
    A, B batch with B 30 times A (``batching_free``, measured)."""
    g = torch.Generator().manual_seed(5)
    zeros = torch.randn(12, 32, generator=g) * 2
    zeros[4] = 0                                                         # a row of zeros
    apart = torch.cat([torch.randn(3, 16, generator=g) * 1e-2, torch.randn(5, 16, generator=g) * 3])
    batched = torch.randn(40, REACH_CFG.d_model, generator=g)          # stands for batching_free's flat A, B
    one_token = torch.randn(1, 32, generator=g) * 3                     # a decode step: per tensor = per token here
    cases = [(one_token,), (zeros,), (apart,), (torch.randn(6, 16, generator=g) * 40,), (batched,)]

    def judge(got, x):
        if x is batched:  # the explorer's two tests on the engine's QKV linear fed by the learner's quantiser
            measured = batching_free(fn)
            if measured["free"]:
                return None
            return (f"not safe to batch flat, measured on the engine's QKV linear: {measured['other_requests']} row pairs "
                    f"across requests, request(s) that differ alone vs batched: {', '.join(measured['alone_differ']) or 'none'} "
                    f"(max |diff| {measured['alone_max_diff']:.3g}): the scale of A's rows reads B's numbers (constraint 1)")
        problem = tensor_problem(got, bi.fake_int8(x, "per-token dynamic"), atol=1e-6, rtol=1e-5)
        if problem is None:
            return None
        if isinstance(got, Tensor) and tuple(got.shape) == tuple(x.shape) and (why := _int8_problem(got.detach(), x)):
            return f"{problem} - {why}"
        return problem

    return grade("int8_quantizer", fn, cases, judge, "a scale per token, from its own features: the int32 sum can take it "
                 "out, no request sets another's grid, nothing is clamped, and the grid is the finest that allows")
