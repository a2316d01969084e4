"""What lesson 01 (padding vs one flat batch) draws, explores and checks.

What padding wastes, the padding server's best grouping and the packer that moves a boundary are the
engine's (``measure.padding``). Figures: ``01_padded_vs_flat``, ``01_token_strip``, ``01_waste_crossover``. Explorer:
``flat_batch_explorer`` over ``flat_run_state`` (the learner's requests run flat and padded under
``OpRecorder``, each compared with itself alone). Exercises: ``check_wrong_requests`` (01.1),
``check_grouping`` (01.2), ``check_unpad_ids`` (01.3).

Taught in notebooks/01_flat_batch.ipynb.
"""
from __future__ import annotations

import functools
import html
import math
from collections.abc import Callable, Sequence

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .. import faults
from ..core.batch import PackedBatch, cumulative, pad, unpack
from ..core.config import ModelConfig
from ..core.model import Transformer
from ..measure.flops import attention_crossover_length
from ..measure.padding import fewest_pad_rows, pad_rows, padding_waste, record_flat_and_padded, waste_crossover, wrong_requests
from ..measure.profile import cpu_threads
from ..measure.search import first_where
from ..measure.tolerance import each_alone, float64_twin, max_abs_diff
from ..style import ATTENTION, LINEAR, MIN_FONT, TEXT, WASTE, cu_ticks, draw_strip, request_color, request_name
from ..validate import check_lengths
from .explore import explorer, ipywidgets_module, parse_lengths, show_figure, tagged
from .figures import ARTICLE_LENS, register
from .grading import Tensor, grade

_SHOWN = 16  # requests drawn one by one; beyond this the picture keeps its totals only


def _nonempty(seq_lens: Sequence[int]) -> list[int]:
    lens = check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    return lens


# ---------------------------------------------------------------------------------------------
# Figures

def _padded_panel(ax, lens: list[int], s: int, side: str = "right", differs=()) -> None:
    """The padded ``[R, s]`` grid, first request on top: per request a Rectangle for its real tokens
    (gid ``real-i``), a hatched one for its pad span (``pad-i``, on ``side``), and a dark outline
    (``differs-padded-i``) if it is in ``differs``."""
    shown = min(len(lens), _SHOWN)
    for i, n in enumerate(lens[:shown]):
        y = shown - 1 - i
        ax.add_patch(Rectangle((s - n if side == "left" else 0, y), n, 0.9, facecolor=request_color(i),
                               edgecolor="white", linewidth=0.5, gid=f"real-{i}"))
        if n < s:
            ax.add_patch(Rectangle((0 if side == "left" else n, y), s - n, 0.9, facecolor=WASTE, edgecolor="white",
                                   hatch="///", linewidth=0.5, gid=f"pad-{i}"))
        if i in differs:
            ax.add_patch(Rectangle((0.15, y + 0.04), s - 0.3, 0.82, facecolor="none", edgecolor=TEXT,
                                   linewidth=2.5 if shown <= 8 else 1.5, gid=f"differs-padded-{i}"))
    ax.set_xlim(0, s)
    ax.set_ylim(0, shown)
    ax.set_yticks([shown - 1 - i + 0.45 for i in range(shown)])
    ax.set_yticklabels([f"{request_name(i)} ({n})" + (" ≠ alone" if i in differs else "")
                        for i, n in enumerate(lens[:shown])], fontsize=MIN_FONT)
    ax.tick_params(axis="x", labelsize=MIN_FONT)


def _flat_panel(ax, lens: list[int], differs=()) -> None:
    """The flat strip of ``Σ L`` rows coloured by request (grey lines between tokens up to 80 of them), ticks
    at ``cu_seqlens`` (a label closer than 1/30 of the strip to the one before is left blank), and a dark
    outline (``differs-flat-i``) round each request in ``differs``."""
    cu = cumulative(lens)
    draw_strip(ax, lens)
    if cu[-1] <= 80:  # token separators that show on both shades of orange (white ones vanish on the light one)
        ax.vlines(range(1, cu[-1]), 0, 1, colors=TEXT, linewidth=0.5, alpha=0.45)
    for i in differs:
        ax.add_patch(Rectangle((cu[i], 0.06), cu[i + 1] - cu[i], 0.88, facecolor="none", edgecolor=TEXT,
                               linewidth=2.5, gid=f"differs-flat-{i}"))
    ax.set_xlim(0, cu[-1])
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    cu_ticks(ax, cu)
    labels, last = [], None
    for c in ax.get_xticks():
        keep = last is None or c == cu[-1] or (c - last >= cu[-1] / 30 and cu[-1] - c >= cu[-1] / 30)
        labels.append(f"{c:g}" if keep else "")
        last = c if keep else last
    ax.set_xticklabels(labels, fontsize=MIN_FONT)


def padded_vs_flat(seq_lens: Sequence[int]) -> Figure:
    """Claims C2 and C3 side by side: left, the padded ``[R, Lmax]`` grid (``_padded_panel``) above the
    flat strip (``_flat_panel``); right, each request's attention score cells per head per layer once
    padded, its own ``L_i²`` (gid ``useful-i``) and the ``Lmax² − L_i²`` padding adds (``wasted-i``)."""
    lens = _nonempty(seq_lens)
    r, lmax, total = len(lens), max(lens), sum(lens)
    shown = min(r, _SHOWN)
    fig = Figure(figsize=(10.5, 3.6 + 0.3 * shown))
    gs = fig.add_gridspec(2, 2, width_ratios=[2.3, 1], height_ratios=[max(1.2, 0.4 * shown), 1.0], hspace=1.0,
                          wspace=0.28)
    top, bottom, cells = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[:, 1])
    _padded_panel(top, lens, lmax)
    top.set_xlabel("row within the request (padded to Lmax)", fontsize=MIN_FONT)
    more = f" (first {shown} of {r} requests drawn)" if r > shown else ""
    top.set_title(f"padded [{r} x {lmax} x d]: {r * lmax} rows computed, {total} useful, {r * lmax - total} pad{more}",
                  fontsize=MIN_FONT + 1)
    _flat_panel(bottom, lens)
    bottom.set_xlabel("flat row: thin grey lines separate the tokens; the numbered ticks are cu_seqlens"
                      if total <= 80 else "flat row; the numbered ticks are cu_seqlens", fontsize=MIN_FONT)
    bottom.set_title(f"flat [{total} x d]: {total} rows, all useful, no batch dimension", fontsize=MIN_FONT + 1)
    for i, n in enumerate(lens[:shown]):
        cells.bar(i, n * n, color=ATTENTION, gid=f"useful-{i}")
        cells.bar(i, lmax * lmax - n * n, bottom=n * n, color=WASTE, hatch="///", edgecolor="white", gid=f"wasted-{i}")
        if shown <= 8:  # the full label fits beside 2-3 bars; up to 8, the ratio alone
            label = f"{lmax * lmax:,} = {lmax * lmax / (n * n):.3g}x\nits own {n * n:,}" if shown <= 3 else \
                f"{lmax * lmax / (n * n):.3g}x"
            cells.text(i, lmax * lmax, label, ha="center", va="bottom", fontsize=MIN_FONT, color=TEXT)
    cells.set_xticks(range(shown))
    cells.set_xticklabels([request_name(i) for i in range(shown)], fontsize=MIN_FONT)
    cells.set_ylim(0, lmax * lmax * 1.3)
    cells.tick_params(axis="y", labelsize=MIN_FONT)
    cells.set_ylabel("score cells per head per layer", fontsize=MIN_FONT)
    cells.set_xlabel("no causal saving counted", fontsize=MIN_FONT)
    cells.set_title("padded: own L² + padding's cells\n(whole blocks, as the article counts)", fontsize=MIN_FONT + 1)
    fig.legend(handles=[Patch(facecolor=request_color(0), label="real token (requests alternate two shades)"),
                        Patch(facecolor=WASTE, hatch="///", edgecolor="white", label="pad row / padding's cells"),
                        Patch(facecolor=ATTENTION, label="useful score cells: $L_i^2$")],
               fontsize=MIN_FONT, frameon=False, loc="lower center", ncol=3)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.24 - 0.005 * shown, top=0.86)
    return fig


def flat_positions(seq_lens: Sequence[int]) -> Figure:
    """Claim C3: what travels with the flat rows. One bar per flat row, its height the token's
    position (0, 1, ... restarting for every request), coloured by request; dashed lines at
    ``cu_seqlens`` (gid ``cu-i``), and ``max_seqlen`` (the longest request) marked."""
    lens = _nonempty(seq_lens)
    cu = cumulative(lens)
    fig = Figure(figsize=(10, 3.0))
    ax = fig.add_subplot()
    for i, n in enumerate(lens):
        ax.bar([cu[i] + j + 0.5 for j in range(n)], [j + 0.6 for j in range(n)], bottom=-0.6, width=0.85, color=request_color(i),
               edgecolor="none", gid=f"positions-{i}")
        if n >= max(1, cu[-1] // 20):
            ax.text(cu[i] + n / 2, max(lens) * 1.02, f"{request_name(i)}: rows {cu[i]}..{cu[i + 1] - 1}", ha="center",
                    va="bottom", fontsize=MIN_FONT, color=TEXT)
    for i, c in enumerate(cu):
        ax.axvline(c, color=TEXT, linestyle="--", linewidth=0.8, gid=f"cu-{i}")
    ax.axhline(max(lens) - 1, color=TEXT, linestyle=":", linewidth=0.8)
    ax.text(cu[-1], max(lens) - 1, f" max_seqlen = {max(lens)}\n (positions 0..{max(lens) - 1})", va="center",
            ha="left", fontsize=MIN_FONT, color=TEXT)
    ax.set_xlim(0, cu[-1])
    ax.set_ylim(-0.6, max(lens) * 1.22)
    cu_ticks(ax, cu)
    ax.tick_params(labelsize=MIN_FONT)
    ax.set_xlabel(f"flat row (one bar per token); the numbered ticks are cu_seqlens = {cu if len(cu) <= 12 else '[...]'}",
                  fontsize=MIN_FONT)
    ax.set_ylabel("position id", fontsize=MIN_FONT)
    ax.set_title(f"flat batch [{cu[-1]} x d]: each request's positions restart at 0 at its cu_seqlens boundary",
                 fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.07, right=0.85, bottom=0.17, top=0.88)
    return fig


def waste_crossover_figure(cfg: ModelConfig, lens: Sequence[int] = (10, 1100), longest: int = 4000) -> Figure:
    """Per layer, what padding a request of L tokens to S = L+1 .. ``longest`` wastes (``padding_waste``) in its
    pad rows (linear layers) and in attention (whole blocks), one panel per L; a dashed line (gid ``from-S-<L>``)
    at the shortest S where attention wastes more."""
    fig = Figure(figsize=(9, 3.4))
    axes = fig.subplots(1, len(lens), sharey=True, squeeze=False)[0]
    for ax, n in zip(axes, lens):
        sizes = list(range(n + 1, longest + 1))
        waste = [padding_waste(cfg, s, n) for s in sizes]
        ax.plot(sizes, [w["linear"] // cfg.n_layers / 1e9 for w in waste], color=LINEAR, linewidth=2,
                label="pad rows through the linear layers", gid=f"linear-{n}")
        ax.plot(sizes, [w["attention"] // cfg.n_layers / 1e9 for w in waste], color=ATTENTION, linewidth=2,
                label="attention (whole blocks)", gid=f"attention-{n}")
        from_s = first_where(lambda s, n=n: padding_waste(cfg, s, n)["attention"] > padding_waste(cfg, s, n)["linear"],
                             n + 1, longest) if sizes else None
        if from_s is not None:
            ax.axvline(from_s, color=TEXT, linestyle="--", linewidth=1.2, gid=f"from-S-{n}")
            right = from_s > longest * 0.6
            ax.text(from_s + (-0.01 if right else 0.01) * longest, ax.get_ylim()[1] * 0.92,
                    f"S = {from_s:,}\nS + L = {from_s + n:,}", ha="right" if right else "left", va="top",
                    fontsize=MIN_FONT, color=TEXT)
        ax.set_title(f"a request of L = {n:,} tokens padded to S", fontsize=MIN_FONT + 1)
        ax.set_xlabel("padded length S (tokens)", fontsize=MIN_FONT)
        ax.tick_params(labelsize=MIN_FONT)
    axes[0].set_ylabel("wasted GFLOP per layer", fontsize=MIN_FONT)
    axes[0].legend(fontsize=MIN_FONT, loc="center left", bbox_to_anchor=(0.0, 0.6), frameon=False)
    fig.suptitle(f"d_model = {cfg.d_model}: attention's waste passes the pad rows' where S + L > 6 d = "
                 f"{6 * cfg.d_model:,} (dashed)", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.8, wspace=0.08)
    return fig


# ---------------------------------------------------------------------------------------------
# Explorer

# The explorer's model: the course's architecture at a tiny width, so that a forward of a few
# hundred tokens takes milliseconds (the batching does not depend on the width). It runs on one CPU thread
# (cpu_threads(1)): its matmuls are too small to share (measured: ~40 ms vs ~400 ms an update on a busy machine).
EXPLORER_CONFIG = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=1000,
                              max_position=512)
PAD_SIDES = ("right", "left")
EXPLORER_MAX_TOKENS = 1024  # all requests together: the explorer stays interactive


@functools.lru_cache(maxsize=1)
def explorer_models() -> tuple[Transformer, Transformer]:
    """The explorer's float32 model (``EXPLORER_CONFIG``, seed 0) and its float64 twin."""
    model = Transformer(EXPLORER_CONFIG, seed=0)
    return model, float64_twin(model)


def request_ids(seq_lens: Sequence[int]) -> list[Tensor]:
    """One int64 token-id tensor ``[L]`` per request, on the CPU: request i of length L gets the same L ids
    every time (seeded by i and L)."""
    return [torch.randint(0, EXPLORER_CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(1000 * i + n))
            for i, n in enumerate(check_lengths(seq_lens))]


def _alone_runs(model: Transformer, twin: Transformer, requests: Sequence) -> list[tuple[Tensor, Tensor, float]]:
    """``each_alone`` on one CPU thread."""
    with cpu_threads(1):
        return each_alone(model, requests, twin)


@functools.lru_cache(maxsize=256)  # request i of length n has the same ids every time: run it alone once
def _alone(i: int, n: int) -> tuple[Tensor, Tensor, float]:
    """``_alone_runs`` of request i of length n (``request_ids``) on the explorer's models."""
    return _alone_runs(*explorer_models(), [request_ids([1] * i + [n])[i]])[0]


def _diff(out: Tensor, ref64: Tensor) -> float:
    """max |out - ref64|, or inf when a broken batch gives the request another number of rows."""
    return max_abs_diff(out, ref64) if out.shape == ref64.shape else math.inf


def flat_run_state(seq_lens: Sequence[int], pad_to: int | None = None, side: str = "right") -> dict:
    """Run the requests of ``seq_lens`` through the explorer's model flat and padded (claims C2, C3).

    pad_to: the padded length (None: the longest request); side: "right" or "left" padding.
    Keys: ``seq_lens``, ``side``, ``padded_shape`` ``[R, S]``; ``flat``: what ``pack`` built
    (``input_ids``, ``positions``, ``cu_seqlens`` lists, ``cu_dtype``, ``max_seqlen``). As ``OpRecorder``
    saw them, {"padded", "flat"}: ``rows`` (of every linear layer), ``cells`` (score cells per head per
    layer), ``largest`` (the largest score matrix's shape), ``flops`` ({"linear", "attention"}, whole
    blocks); ``pad_rows`` and ``waste`` (padded − flat). ``crossover``: ``attention_crossover_length``
    whole blocks (``blocks``) and causal (``causal``), plus
    ``waste_from`` (``waste_crossover`` at S). ``input_bytes`` / ``hidden_bytes``: {"padded", "flat"}.
    (``measure.padding.record_flat_and_padded`` runs and records.)
    Per request, against the request run alone: ``diff`` ({"padded", "flat"}: max |out − out64|),
    ``bound`` (the tolerance rule), ``differs`` ({"padded", "flat"}: the indices beyond it).
    """
    lens = _nonempty(seq_lens)
    if sum(lens) > EXPLORER_MAX_TOKENS:
        raise ValueError(f"at most {EXPLORER_MAX_TOKENS} tokens in all for the explorer, got {sum(lens)}")
    run = record_flat_and_padded(explorer_models()[0], request_ids(lens), pad_to, side)
    alone = [_alone(i, n) for i, n in enumerate(lens)]
    diff = {k: [_diff(o, r64) for o, (_, r64, _) in zip(v, alone)] for k, v in run.pop("out").items()}
    bound = [b for *_, b in alone]
    batch, cfg = run.pop("batch"), EXPLORER_CONFIG
    return {**run, "seq_lens": lens, "side": side, "pad_rows": run["rows"]["padded"] - run["rows"]["flat"],
            "flat": {"input_ids": batch.input_ids.tolist(), "positions": batch.positions.tolist(),
                     "cu_seqlens": batch.cu_seqlens.tolist(), "cu_dtype": str(batch.cu_seqlens.dtype).removeprefix("torch."),
                     "max_seqlen": batch.max_seqlen},
            "crossover": {"blocks": attention_crossover_length(cfg), "causal": attention_crossover_length(cfg, True),
                          "waste_from": waste_crossover(cfg, run["padded_shape"][1])},
            "diff": diff, "bound": bound,
            "differs": {k: [i for i, d in enumerate(v) if d > bound[i]] for k, v in diff.items()}}


def flat_run_figure(state: dict) -> Figure:
    """The explorer's picture of ``flat_run_state``: the padded ``[R, S]`` ids on the side chosen
    (``_padded_panel``) above the flat stream (``_flat_panel``); the requests in ``state["differs"]``
    outlined and marked "≠ alone"; a dashed line (gid ``crossover``) at ``waste_from``."""
    lens, (r, s) = state["seq_lens"], state["padded_shape"]
    shown = min(r, _SHOWN)
    wrong = {k: set(v) for k, v in state["differs"].items()}
    fig = Figure(figsize=(9, 2.1 + 0.18 * shown))
    gs = fig.add_gridspec(2, 1, height_ratios=[max(1.0, 0.3 * shown), 0.45], hspace=max(0.6, 1.4 - 0.05 * shown))
    top, bottom = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
    _padded_panel(top, lens, s, state["side"], wrong["padded"])
    cross = state["crossover"]["waste_from"]
    if cross is not None:  # a request whose tokens reach this column wastes more in attention than in its pad rows
        top.axvline(cross, color=TEXT, linestyle="--", linewidth=1.2, gid="crossover")
        top.text(cross, 0.08, f" L ≥ {cross}: attention wastes more than the pad rows (S + L > 6 d) ",
                 ha="left" if cross < s / 2 else "right", va="bottom", fontsize=MIN_FONT, color=TEXT,
                 bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1})
    more = f" ({shown} of {r} drawn)" if r > shown else ""
    verdict = {k: (f"outlined, {len(v)} of {r}: output differs from the request run alone" if v else
                   "every request's output = the request run alone") for k, v in wrong.items()}
    top.set_title(f"padded [{r} x {s}], {state['side']} padding{more}: {state['rows']['padded']} rows computed "
                  f"(recorded), {state['pad_rows']} of them pad (hatched)\n{verdict['padded']}", fontsize=MIN_FONT + 1)
    _flat_panel(bottom, lens, sorted(wrong["flat"]))
    bottom.set_title(f"flat [{sum(lens)}]: {state['rows']['flat']} rows computed (recorded), none of them pad; "
                     f"ticks = cu_seqlens\n{verdict['flat']}", fontsize=MIN_FONT + 1)
    fig.subplots_adjust(left=0.14, right=0.98, bottom=0.1, top=0.84)
    return fig


def _short(xs: list, n: int = 24) -> str:
    return str(xs) if len(xs) <= n else f"[{', '.join(map(str, xs[:n]))}, ...] ({len(xs)} in all)"


def _mflop(n: int) -> str:
    return f"{n / 1e6:,.2f} MFLOP"


def _kib(n: int) -> str:
    return f"{n:,} B" if n < 10_240 else f"{n / 1024:,.1f} KiB"


def flat_run_text(state: dict) -> dict[str, str]:
    """The explorer's three readouts as plain lines: ``flat`` (what pack built), ``padded`` (what the
    recorder saw both ways, and memory), ``alone`` (each request against itself alone)."""
    f, r, c, big = state["flat"], state["rows"], state["cells"], state["largest"]
    flat = "\n".join([f"input_ids {_short(f['input_ids'])}", f"positions {_short(f['positions'])}",
                      f"cu_seqlens {_short(f['cu_seqlens'])} ({f['cu_dtype']}) | max_seqlen {f['max_seqlen']}"])
    shape = state["padded_shape"]
    fl, waste, cross = state["flops"], state["waste"], state["crossover"]
    ratio = ("no waste" if not waste["linear"] and not waste["attention"] else
             f"linear / attention waste = {waste['linear'] / waste['attention']:.3g}x" if waste["attention"] else
             "attention wastes nothing")
    padded = "\n".join([
        f"padded ids [{shape[0]} x {shape[1]}] ({state['side']} padding) | flat ids [{len(f['input_ids'])}]",
        f"rows through every linear layer (recorded): padded {r['padded']} | flat {r['flat']} | "
        f"pad rows computed {state['pad_rows']}",
        f"score cells per head per layer (recorded): padded {c['padded']} | flat {c['flat']}",
        f"inputs: padded {_kib(state['input_bytes']['padded'])} | flat {_kib(state['input_bytes']['flat'])}; "
        f"hidden states: padded {_kib(state['hidden_bytes']['padded'])} | flat {_kib(state['hidden_bytes']['flat'])}",
        f"FLOPs of the forward (recorded, whole blocks): linear padded {_mflop(fl['padded']['linear'])} | flat "
        f"{_mflop(fl['flat']['linear'])}; attention padded {_mflop(fl['padded']['attention'])} | flat "
        f"{_mflop(fl['flat']['attention'])}",
        f"padding wastes {_mflop(waste['linear'])} in the linear layers and {_mflop(waste['attention'])} in attention"
        f" ({ratio})",
        f"one request's own attention FLOPs reach its own linear FLOPs at S = {cross['blocks']} (whole blocks, 6 d) "
        f"or {cross['causal']} (causal triangle, about 12 d: a tiled kernel only for S much longer than its tile; "
        f"it runs whole tiles); your longest: {max(state['seq_lens'])}",
        f"padding a request of L tokens to S = {shape[1]} wastes more in attention than in its pad rows when "
        f"S + L > 6 d = {cross['blocks']}: " + (f"here from L = {cross['waste_from']} on (dashed line)"
                                                if cross["waste_from"] is not None else "here no request does"),
        f"largest score matrix (recorded): padded {list(big['padded'])} = {_kib(4 * math.prod(big['padded']))} | "
        f"flat {list(big['flat'])} = {_kib(4 * math.prod(big['flat']))} (float32; the leading number is heads x "
        "requests: attention runs requests of equal length as one batched matmul)"])
    diff, differs = state["diff"], state["differs"]
    lines = [f"{request_name(i)} ({n}): flat {diff['flat'][i]:.1e} {'DIFFERS' if i in differs['flat'] else '='} | "
             f"padded {diff['padded'][i]:.1e} {'DIFFERS' if i in differs['padded'] else '='} | bound {state['bound'][i]:.1e}"
             for i, n in enumerate(state["seq_lens"][:_SHOWN])]
    if len(state["seq_lens"]) > _SHOWN:
        lines.append(f"... {len(state['seq_lens']) - _SHOWN} more requests")
    ok = {k: not v for k, v in differs.items()}
    lines.append(f"every request equals itself alone: flat {'yes' if ok['flat'] else 'NO'} | "
                 f"padded {'yes' if ok['padded'] else 'NO'}")
    names = {k: ", ".join(request_name(i) for i in v) or "none" for k, v in differs.items()}
    lines.append(f"differ from themselves alone (outlined in the figure): padded {names['padded']} | flat {names['flat']}")
    if not ok["padded"] and state["side"] == "left":
        lines.append("left padding: forward_padded numbers the columns 0..S-1, so a request with p pad rows "
                     "in front gets positions p.. instead of 0..")
    return {"flat": flat, "padded": padded, "alone": "\n".join(lines)}


def _pre(text: str) -> str:
    return f"<pre style='margin:0;font-size:12px'>{html.escape(text)}</pre>"


def flat_batch_explorer(lengths: str = "3, 17, 5", pad_to: str = "longest", side: str = "right"):
    """VBox class ``fbx``: Text ``fbx-lengths``, Dropdowns ``fbx-pad-to`` and ``fbx-side``; HTML
    ``fbx-flat`` (what pack built), ``fbx-counts`` (what the recorder saw, padded vs flat, and
    memory), ``fbx-alone`` (each request's max |diff| from itself alone, under the tolerance rule);
    Output ``fbx-figure`` (``flat_run_figure``).

    Every change runs the typed requests through the explorer's model both ways (``flat_run_state``);
    bad input shows its error in ``fbx-counts`` (class ``fbx-error``).
    """
    w = ipywidgets_module()
    text = tagged(w.Text(value=lengths, description="lengths", continuous_update=False), "fbx-lengths")
    pad_box = tagged(w.Dropdown(options=["longest", "32", "64", "128"], value=pad_to, description="pad to"), "fbx-pad-to")
    side_box = tagged(w.Dropdown(options=list(PAD_SIDES), value=side, description="pad side"), "fbx-side")
    flat, counts, alone = (tagged(w.HTML(), f"fbx-{k}") for k in ("flat", "counts", "alone"))
    out = tagged(w.Output(), "fbx-figure")

    def update(change=None):
        try:
            lens = parse_lengths(text.value, max_requests=32, max_length=EXPLORER_CONFIG.max_position)
            state = flat_run_state(lens, None if pad_box.value == "longest" else int(pad_box.value), side_box.value)
        except ValueError as exc:
            counts.add_class("fbx-error")
            counts.value, flat.value, alone.value = _pre(str(exc)), "", ""
            return
        counts.remove_class("fbx-error")
        shown = flat_run_text(state)
        flat.value, counts.value, alone.value = (_pre(shown[k]) for k in ("flat", "padded", "alone"))
        show_figure(out, flat_run_figure(state))

    return explorer("fbx", [text, pad_box, side_box], [flat, counts, alone, out], update)


# ---------------------------------------------------------------------------------------------
# Exercises

# (seq_lens, bug, k): the packer put boundary k (1 <= k <= R-1) one row late or early (measure.padding.broken_pack).
WRONG_CASES = [([10, 30], "late", 1), ([10, 30], "early", 1), ([4, 6, 5], "late", 2), ([4, 6, 5], "early", 1),
               ([1, 8, 3], "early", 1), ([6, 2, 7, 3], "late", 1), ([6, 2, 7, 3], "early", 3)]


@functools.lru_cache(maxsize=64)  # a checker asks for the same few cases again and again
def _wrong_requests(seq_lens: tuple[int, ...], bug: str, k: int) -> tuple[frozenset[int], tuple[float, ...]]:
    """``measure.padding.wrong_requests`` of ``request_ids(seq_lens)`` on the explorer's models."""
    model, twin = explorer_models()
    return wrong_requests(model, request_ids(seq_lens), bug, k, twin)


# Why request i is (or is not) changed by boundary k moved one row: the causal argument, keyed by (bug, i - k);
# "early one token" is request k-1 when it has a single token; any other request does not touch the boundary.
WHY = {("late", -1): "{r}'s own rows, cut at the true boundaries, are unchanged: it gains request {k}'s first token AFTER "
                     "them, and causal attention lets each row see only the rows before it (a server trusting the broken "
                     "cu_seqlens would still sample it from that extra row: see below the exercise)",
       ("late", 0): "{r} lost its first token: its other rows no longer see it, and their positions start one lower",
       ("early", -1): "{r} handed its last token to request {k}: that row now has position 0 and sees only itself, and "
                      "the last row is the one a server samples from",
       ("early one token", -1): "{r} has one token: handed to request {k} it becomes that request's first row, "
                                "position 0, seeing only itself - exactly what it is alone",
       ("early", 0): "{r} gained a foreign first row: every one of its rows sees it, at shifted positions",
       "untouched": "{r} does not touch boundary {k}: its rows, keys and positions are all its own"}


def _why(i: int, lens: list[int], bug: str, k: int) -> str:
    key = (bug, i - k) if (bug, i - k, lens[i]) != ("early", -1, 1) else ("early one token", -1)
    return WHY.get(key, WHY["untouched"]).format(r=f"request {i} ({request_name(i)})", k=k)


def check_wrong_requests(fn: Callable[[list, str, int], object]) -> bool:
    """Exercise 01.1: ``fn(seq_lens, bug, k) -> the set of request indices whose output differs from
    the request run alone`` when boundary ``k`` is one row ``bug`` ("late" / "early"); graded by running
    ``measure.padding.broken_pack`` through the engine (``measure.padding.wrong_requests``)."""
    def judge(got, lens, bug, k):
        try:
            said = {int(i) for i in got}
        except (TypeError, ValueError):
            return f"expected a set of request indices like {{1}}, got {got!r}"
        if not said <= set(range(len(lens))):
            return f"{sorted(said)}: the requests are numbered 0..{len(lens) - 1}"
        wrong, diffs = _wrong_requests(tuple(lens), bug, k)
        if said == wrong:
            return None
        notes = [_why(i, lens, bug, k) + f" (engine: max |diff| {diffs[i]:.1e})"
                 for i in sorted(said ^ wrong)]
        return f"you said {sorted(said)}, the engine finds {sorted(wrong)} wrong: " + "; ".join(notes)
    return grade("wrong_requests", fn, WRONG_CASES, judge,
                 "rows cut at the TRUE boundaries: late, only request k's rows go wrong; early, k-1's and k's, "
                 "unless k-1 has a single token")


def _as_list(x):
    return x.tolist() if isinstance(x, Tensor) else list(x) if isinstance(x, (list, tuple)) else x


GROUPING_CASES = [([100, 1, 1, 1], 3), ([1, 10, 10], 2), ([5, 30, 7, 29, 6, 31], 3), ([9, 2, 8, 3, 7], 2),
                  ([12, 12, 12, 12], 4), ([40, 3, 38, 5, 36, 4, 2], 3), ([6], 1), ([4, 50, 4, 49, 4], 4)]


def check_grouping(fn: Callable[[list, int], object]) -> bool:
    """Exercise 01.2: ``fn(seq_lens, max_num_seqs) -> groups``: a list of lists of request indices, each
    request in exactly one group, at most ``max_num_seqs`` per group, ``ceil(R / max_num_seqs)`` groups
    (a padding server runs as few forwards as it can); each group is padded to its own longest request.
    The checker compares the pad rows with the fewest possible, found by trying every split."""
    def judge(got, lens, cap):
        need = math.ceil(len(lens) / cap)
        got = _as_list(got)
        if not isinstance(got, list) or not all(isinstance(_as_list(g), list) for g in got):
            return f"expected a list of groups (lists of request indices), got {got!r}"
        groups = [[int(i) if isinstance(i, int) else i for i in _as_list(g)] for g in got]
        flat = [i for g in groups for i in g]
        if not all(isinstance(i, int) for i in flat) or sorted(flat) != list(range(len(lens))):
            return (f"the groups {groups} must hold each request index 0..{len(lens) - 1} exactly once "
                    "(indices, not lengths)")
        if any(not g or len(g) > cap for g in groups):
            return f"the groups {groups}: every group needs 1..{cap} requests (max_num_seqs = {cap})"
        if len(groups) != need:
            return (f"{len(groups)} groups, but {len(lens)} requests at most {cap} per forward need only {need}: "
                    "the server runs as few forwards as it can (more groups would trade forwards for padding)")
        mine = sum(pad_rows([lens[i] for i in g]) for g in groups)
        best, split = fewest_pad_rows(tuple(lens), cap)
        if mine > best:
            spans = sorted((min(lens[i] for i in g), max(lens[i] for i in g)) for g in groups)
            sorted_runs = all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))
            longest = max(range(len(lens)), key=lens.__getitem__)
            home = next(len(g) for g in groups if longest in g)
            hint = (f" - your groups are runs of similar lengths, but where you cut matters: the longest request "
                    f"({lens[longest]} tokens) sets Lmax for the {home} requests of its group"
                    if sorted_runs else
                    " - the longest request of a group sets Lmax for all of it: a short request in a long one's group "
                    "pays for that length")
            return (f"lengths {lens}, max_num_seqs {cap}: your groups {groups} pad {mine} rows, but {best} is possible, "
                    f"e.g. {[list(g) for g in split]}{hint}")
        return None
    return grade("grouping", fn, GROUPING_CASES, judge,
                 "sort by length, keep neighbours together, and choose where to cut: which group gets the remainder "
                 "when max_num_seqs does not divide R changes the padding")


def _unpad_id_cases() -> list[tuple[Tensor, Tensor]]:
    """Padded id batches ``(ids [B, S], mask [B, S])``: right, left and mixed padding, and real tokens
    equal to the pad id 0 (so a mask cannot be guessed from the ids)."""
    cases = []
    for lens, pad_to, side in (([10, 30], None, "right"), ([3, 1, 5], 8, "right"), ([2, 5], None, "left"),
                               ([6, 1, 3], 7, "left"), ([4, 4], 6, "left")):
        requests = request_ids(lens)
        requests[0][0] = 0  # a real token whose id is the pad value
        cases.append(pad(requests, pad_to=pad_to, side=side))
    ids, mask = pad(request_ids([5, 2, 4]), pad_to=6)  # one request right-padded, one left, one full
    left_ids, left_mask = pad(request_ids([5, 2, 4]), pad_to=6, side="left")
    ids[1], mask[1] = left_ids[1], left_mask[1]
    cases.append((ids, mask))
    return cases


def check_unpad_ids(fn: Callable[[Tensor, Tensor], tuple]) -> bool:
    """Exercise 01.3: ``fn(ids [B, S], mask [B, S] bool) -> (input_ids [T], positions [T], cu_seqlens [B+1])``:
    a flat batch the engine runs; graded by running it through the explorer's model and comparing each
    request with the request run alone (the real tokens of row b, in order)."""
    def judge(got, ids, mask):
        if not isinstance(got, (tuple, list)) or len(got) != 3 or not all(isinstance(t, Tensor) for t in got):
            return f"expected three tensors (input_ids, positions, cu_seqlens), got {got!r}"
        g_ids, g_pos, g_cu = got
        requests = [ids[b][mask[b]] for b in range(ids.shape[0])]
        lens = [len(r) for r in requests]
        if g_cu.dim() != 1 or g_cu.numel() != len(lens) + 1:
            return f"cu_seqlens needs B + 1 = {len(lens) + 1} entries (it starts with 0), got {g_cu.tolist()}"
        if g_cu.dtype != torch.int32:
            return f"cu_seqlens is {g_cu.dtype}; varlen kernels take int32"
        if g_ids.numel() == ids.numel() and g_ids.numel() != sum(lens):
            return f"input_ids has all {ids.numel()} cells: it still holds the pad tokens - keep the cells mask marks"
        got_lens = [int(b) - int(a) for a, b in zip(g_cu.tolist(), g_cu.tolist()[1:])]
        try:
            batch = PackedBatch(g_ids, None, g_pos, g_cu, max(got_lens + [0]), got_lens)
            with cpu_threads(1):
                out = explorer_models()[0].forward(batch)
        except ValueError as exc:  # the engine's own batch check: say what it refused
            by_id = int((ids != 0).sum())
            hint = (" - positions count inside each request, not the column of the padded batch (left padding "
                    "puts a request's first token in a later column)" if "positions" in str(exc) else
                    f" - input_ids has {g_ids.numel()} tokens and cu_seqlens counts {int(g_cu[-1])}, the mask marks "
                    f"{sum(lens)}: one of them was counted with ids != 0, which drops a real token whose id is the pad "
                    "id 0 (a real token can have id 0); take the cells mask marks for both"
                    if by_id != sum(lens) and by_id in (g_ids.numel(), int(g_cu[-1])) else "")
            return f"the engine refuses this batch: {exc}{hint}"
        if got_lens != lens:
            hint = (" - count the cells mask marks (ids == 0 is no test: a real token can have id 0)"
                    if got_lens == [int((r != 0).sum()) for r in ids] else "")
            return f"cu_seqlens {g_cu.tolist()} gives lengths {got_lens}, the mask says {lens}{hint}"
        for b, (part, (_, r64, bound)) in enumerate(zip(unpack(out, g_cu), _alone_runs(*explorer_models(), requests))):
            if (err := max_abs_diff(part, r64)) > bound:
                first_columns = ids[b][:lens[b]]
                right = torch.equal(g_ids[g_cu[b]:g_cu[b + 1]], first_columns) and not torch.equal(first_columns, requests[b])
                hint = (" - its mask has the pads on the LEFT: take the cells mask marks, not the first L columns"
                        if right else " - request b's real tokens, in their order, go between cu_seqlens[b] and cu_seqlens[b+1]")
                return f"request {b}'s output differs from it alone (max |diff| {err:.1e} > bound {bound:.1e}){hint}"
        return None
    def without_pack(*args):  # the exercise builds the flat stream from the mask itself: the engine's pack refuses
        with faults.injected("pack_refused"):
            return fn(*args)
    return grade("unpad_ids", without_pack if callable(fn) else fn, _unpad_id_cases(), judge,
                 "the engine runs your flat batch and each request equals itself alone, on right-, left- and "
                 "mixed-padded batches")


# ---------------------------------------------------------------------------------------------
# Registered figures

@register("01_padded_vs_flat", lesson="01",
          caption="A=10, B=30: padded [2 x 30] (20 pad rows; A's scores 900 cells instead of 100) vs flat [40] (C2, C3)")
def _padded_vs_flat() -> Figure:
    return padded_vs_flat(ARTICLE_LENS)


@register("01_token_strip", lesson="01",
          caption="the flat batch's positions restart at every cu_seqlens boundary [0, 10, 40]; max_seqlen = 30 (C3)")
def _token_strip() -> Figure:
    return flat_positions(ARTICLE_LENS)


@register("01_waste_crossover", lesson="01",
          caption="d = 512, per layer: padding L = 10 or 1,100 tokens to S wastes more in attention than in the pad "
                  "rows once S + L > 6 d = 3,072 (C2)")
def _waste_crossover() -> Figure:
    return waste_crossover_figure(ModelConfig(n_layers=2, vocab_size=1000, max_position=64))
