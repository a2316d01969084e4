"""Interactive explorers for the lessons: thin ipywidgets wrappers over pure functions.

Each explorer has a pure ``*_state`` function that computes every number it shows (the
tests call it directly) and a builder that returns an ``ipywidgets.VBox``. Every control and
readout carries a CSS class (``widget.add_class``) so a browser test can find it; the class
names and text formats of ``diagonal_block_explorer`` and ``flop_regime_explorer`` are a
contract with tests/ (see each docstring).

Figures are rendered to PNG with Agg and put into the ``Output`` widget's ``outputs``
(the same message ``clear_output(wait=True)`` + ``display`` would produce, in one step), so a
callback works, and can be tested, without a running kernel.

Taught in notebooks/00_setup_one_request.ipynb, notebooks/01_flat_batch.ipynb,
notebooks/03_masked_vs_varlen_attention.ipynb, notebooks/04_tp2_invariance.ipynb,
notebooks/05_flop_regimes.ipynb and notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

import base64
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from ..core.batch import cumulative
from ..core.config import ModelConfig
from ..core.validate import check_int, check_lengths
from ..measure.flops import METHODS, attention_cells, executed_tokens, forward_flops
from ..serve.engine import batch_stats
from ..serve.scheduler import plan_batches
from ..serve.workloads import workload_lengths
from ..tp.dryrun import expected_trace, record_trace, trace_signature
from ..tp.trace import summarize_trace
from . import viz

PATTERNS = ("ramp", "equal", "long-tail")
WIDGET_DPI = 80
_LONG_TAIL_SIGMA = 1.0
_LONG_TAIL_SEED = 0


def _widgets():
    import ipywidgets  # imported lazily: the pure functions work without it
    return ipywidgets


def _tagged(widget, css_class: str):
    widget.add_class(css_class)
    return widget


def _explorer(css_class: str, controls: list, readouts: list, update):
    """Wire an explorer: ``update`` runs on every change of a control and once now; the
    controls sit in a row above the readouts, all in a VBox of class ``css_class``."""
    w = _widgets()
    for control in controls:
        control.observe(update, names="value")
    update()
    return _tagged(w.VBox([w.HBox(controls), *readouts]), css_class)


def show_figure(out, fig, dpi: int = WIDGET_DPI) -> None:
    """Replace the content of an ``ipywidgets.Output`` with the figure as an inline PNG."""
    png = base64.b64encode(viz.to_png(fig, dpi=dpi)).decode("ascii")
    w, h = fig.get_size_inches()
    out.outputs = ({"output_type": "display_data",
                    "data": {"image/png": png, "text/plain": f"<Figure {int(w * dpi)}x{int(h * dpi)}>"},
                    "metadata": {}},)


# ---------------------------------------------------------------------------------------------
# Lesson 01: padded vs flat rows for lengths the reader types.

def parse_lengths(text: str, max_requests: int = 64, max_length: int = 4096) -> list[int]:
    """``"10, 30"`` → ``[10, 30]``; commas or spaces; every length in ``[1, max_length]``."""
    if not isinstance(text, str):
        raise ValueError(f"lengths must be a string like '10, 30', got {type(text).__name__}")
    parts = [p for p in text.replace(",", " ").split() if p]
    if not parts:
        raise ValueError("lengths is empty: type request lengths like '10, 30'")
    lens = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise ValueError(f"lengths: {p!r} is not a whole number") from None
        if not 1 <= n <= max_length:
            raise ValueError(f"lengths: every request needs 1..{max_length} tokens, got {n}")
        lens.append(n)
    if len(lens) > max_requests:
        raise ValueError(f"lengths: at most {max_requests} requests, got {len(lens)}")
    return lens


def flat_batch_state(seq_lens: Sequence[int]) -> dict:
    """Everything the flat-batch explorer shows (claims C2, C3).

    Keys: ``seq_lens``, ``cu_seqlens`` (list), ``padded_rows`` (R·Lmax), ``flat_rows`` (Σ L),
    ``pad_rows``, ``row_ratio`` (padded / flat rows), ``attention`` ({"padded", "varlen"}:
    AttentionCells per head per layer, non-causal).
    """
    lens = check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    cu = cumulative(lens)
    padded, flat = executed_tokens(lens, "padded"), executed_tokens(lens, "varlen")
    return {"seq_lens": lens, "cu_seqlens": cu, "padded_rows": padded, "flat_rows": flat,
            "pad_rows": padded - flat, "row_ratio": padded / flat,
            "attention": {m: attention_cells(lens, m) for m in ("padded", "varlen")}}


def _flat_html(state: dict) -> str:
    a_pad, a_var = state["attention"]["padded"], state["attention"]["varlen"]
    return (f"<div>cu_seqlens: {state['cu_seqlens'] if len(state['cu_seqlens']) <= 17 else '[...]'}</div>"
            f"<div>padded: {state['padded_rows']} rows | flat: {state['flat_rows']} rows | "
            f"pad rows: {state['pad_rows']} | ratio {state['row_ratio']:.2f}x</div>"
            f"<div>attention cells per head per layer: padded {a_pad.computed} | flat (varlen) {a_var.computed}</div>")


def flat_batch_explorer(lengths: str = "10, 30"):
    """VBox class ``fbx``: Text ``fbx-lengths``, HTML ``fbx-counts``, Output ``fbx-figure``.

    Type request lengths; the counts and the padded-vs-flat picture follow. Bad input shows
    the error text in ``fbx-counts`` (class ``fbx-error`` added) instead of raising.
    """
    w = _widgets()
    text = _tagged(w.Text(value=lengths, description="lengths", continuous_update=False), "fbx-lengths")
    counts, out = _tagged(w.HTML(), "fbx-counts"), _tagged(w.Output(), "fbx-figure")

    def update(change=None):
        try:
            state = flat_batch_state(parse_lengths(text.value))
        except ValueError as exc:
            counts.add_class("fbx-error")
            counts.value = f"<div>{exc}</div>"
            return
        counts.remove_class("fbx-error")
        counts.value = _flat_html(state)
        show_figure(out, viz.padded_vs_flat(state["seq_lens"]))

    return _explorer("fbx", [text], [counts, out], update)


# ---------------------------------------------------------------------------------------------
# Lesson 03: the diagonal-block explorer (its CSS classes and text are read by tests/browser).

def explorer_seq_lens(num_requests: int, length: int, pattern: str) -> list[int]:
    """Request lengths for ``num_requests`` requests around a base ``length``.

    "ramp": R=1 → [L]; otherwise request i gets ``round(L·(1 + 2i/(R-1)))`` (L to 3L; R=2, L=10 →
    [10, 30], the article's A and B). "equal": [L]·R. "long-tail": lognormal quantiles with
    median L (σ=1), shuffled with a fixed seed: deterministic, each >= 1.
    """
    r = check_int("num_requests", num_requests, 1, 1 << 20)
    n = check_int("length", length, 1, 1 << 30)
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; choose one of {PATTERNS}")
    if pattern == "equal":
        return [n] * r
    if pattern == "ramp":
        return [n] if r == 1 else [round(n * (1 + 2 * i / (r - 1))) for i in range(r)]
    z = [NormalDist().inv_cdf((i + 0.5) / r) for i in range(r)]
    lens = [max(1, round(n * float(np.exp(_LONG_TAIL_SIGMA * zi)))) for zi in z]
    order = np.random.default_rng(_LONG_TAIL_SEED).permutation(r)
    return [lens[int(i)] for i in order]


def diagonal_block_state(num_requests: int, length: int, pattern: str) -> dict:
    """``{"seq_lens": [...], "counts": {method: AttentionCells}}`` for padded, masked, varlen
    (per head per layer, non-causal whole blocks: the article's convention)."""
    lens = explorer_seq_lens(num_requests, length, pattern)
    return {"seq_lens": lens, "counts": {m: attention_cells(lens, m) for m in METHODS}}


def diagonal_block_html(state: dict) -> str:
    """One ``<div>`` per method: ``padded: computed 1800 | useful 1000 | wasted 800``."""
    return "".join(f"<div>{m}: computed {c.computed} | useful {c.useful} | wasted {c.wasted}</div>"
                   for m, c in state["counts"].items())


def diagonal_block_explorer(num_requests: int = 2, length: int = 10, pattern: str = "ramp"):
    """VBox class ``dbx``: sliders ``dbx-num-requests`` (1..16), ``dbx-length`` (1..64), Dropdown
    ``dbx-pattern``, HTML ``dbx-counts`` (one line per method), HTML ``dbx-lengths``, Output
    ``dbx-figure`` (the three attention matrices, redrawn on every change)."""
    w = _widgets()
    reqs = _tagged(w.IntSlider(value=num_requests, min=1, max=16, description="requests R"), "dbx-num-requests")
    base = _tagged(w.IntSlider(value=length, min=1, max=64, description="base length L"), "dbx-length")
    pat = _tagged(w.Dropdown(options=list(PATTERNS), value=pattern, description="pattern"), "dbx-pattern")
    counts, lengths = _tagged(w.HTML(), "dbx-counts"), _tagged(w.HTML(), "dbx-lengths")
    out = _tagged(w.Output(), "dbx-figure")

    def update(change=None):
        state = diagonal_block_state(reqs.value, base.value, pat.value)
        counts.value = diagonal_block_html(state)
        lens = state["seq_lens"]
        lengths.value = f"<div>lengths {lens if len(lens) <= 16 else '...'} | T = {sum(lens)} flat rows</div>"
        show_figure(out, viz.attention_patterns(lens, figsize=(7.5, 3.4), max_pixels=240))

    return _explorer("dbx", [reqs, base, pat], [counts, lengths, out], update)


# ---------------------------------------------------------------------------------------------
# Lesson 05: the FLOP-regime explorer (its CSS classes and text are read by tests/browser).

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
    w = _widgets()
    reqs = _tagged(w.IntSlider(value=num_requests, min=1, max=64, description="requests R"), "frx-num-requests")
    base = _tagged(w.IntSlider(value=length, min=1, max=4096, description="length L"), "frx-length")
    text, out = _tagged(w.HTML(), "frx-flops"), _tagged(w.Output(), "frx-figure")

    def update(change=None):
        state = flop_regime_state(reqs.value, base.value)
        text.value = flop_regime_text(state)
        r, n = reqs.value, base.value
        f = state["flops"]
        title = f"{r} x {n} tokens: {100 * f.attention_fraction:.1f}% attention, {f.dominant} dominates"
        show_figure(out, viz.flops_bars([(f"{r} x {n}", state["seq_lens"])], figsize=(5, 4), title=title))

    return _explorer("frx", [reqs, base], [text, out], update)


# ---------------------------------------------------------------------------------------------
# Lesson 00: the all-reduces of one request of N tokens (claim C1).

DTYPES = ("float32", "bfloat16")


def allreduce_state(num_tokens: int, dtype: str = "float32", world_size: int = 2) -> dict:
    """What one rank all-reduces in one forward of a single N-token request (C1).

    From ``tp_dryrun.expected_trace`` for the article's model in ``dtype``. Keys: ``num_tokens``,
    ``dtype``, ``count``, ``shape`` (``[N, d_model]``), ``bytes_each``, ``bytes_per_forward``
    (per rank), ``trace`` (the ``CollectiveRecord`` list).
    """
    import torch
    n = check_int("num_tokens", num_tokens, 1, 1 << 24)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    cfg = ModelConfig(dtype=getattr(torch, dtype))
    trace = expected_trace(cfg, n, 0, world_size)
    each = trace[0].bytes if trace else 0
    return {"num_tokens": n, "dtype": dtype, "count": len(trace), "shape": [n, cfg.d_model], "bytes_each": each,
            "bytes_per_forward": sum(r.bytes for r in trace), "trace": trace}


def allreduce_text(state: dict) -> str:
    """``16 all-reduces per forward | each [10, 512] float32 = 20,480 B | 327,680 B per forward per rank``."""
    return (f"{state['count']} all-reduces per forward | each {state['shape']} {state['dtype']} = "
            f"{state['bytes_each']:,} B | {state['bytes_per_forward']:,} B per forward per rank")


def allreduce_explorer(num_tokens: int = 10, dtype: str = "float32"):
    """VBox class ``arx``: IntSlider ``arx-tokens`` (1..16384), Dropdown ``arx-dtype``, HTML
    ``arx-text`` (``allreduce_text``), Output ``arx-figure`` (``viz.allreduce_growth`` with N marked)."""
    w = _widgets()
    tokens = _tagged(w.IntSlider(value=num_tokens, min=1, max=16384, description="tokens N"), "arx-tokens")
    kind = _tagged(w.Dropdown(options=list(DTYPES), value=dtype, description="dtype"), "arx-dtype")
    text, out = _tagged(w.HTML(), "arx-text"), _tagged(w.Output(), "arx-figure")

    def update(change=None):
        import torch
        state = allreduce_state(tokens.value, kind.value)
        text.value = f"<div>{allreduce_text(state)}</div>"
        show_figure(out, viz.allreduce_growth(ModelConfig(dtype=getattr(torch, kind.value)), mark=tokens.value))

    return _explorer("arx", [tokens, kind], [text, out], update)


# ---------------------------------------------------------------------------------------------
# Lesson 04: pack the same tokens as 1..R requests; the TP trace does not move (C11, C12).

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
    w = _widgets()
    total = _tagged(w.IntSlider(value=total_tokens, min=1, max=128, description="tokens T"), "tpx-tokens")
    reqs = _tagged(w.IntSlider(value=min(num_requests, total_tokens), min=1, max=total_tokens, description="requests R"),
                   "tpx-num-requests")
    text, out = _tagged(w.HTML(), "tpx-text"), _tagged(w.Output(), "tpx-figure")

    def update(change=None):
        reqs.max = total.value  # R <= T: every request needs a token (clamps reqs.value too)
        state = tp_packing_state(reqs.value, total.value)
        text.value = tp_packing_html(state)
        show_figure(out, viz.token_strip(state["seq_lens"], title=f"{len(state['seq_lens'])} requests, T = {total.value}: "
                                         f"the only thing that changes is cu_seqlens"))

    return _explorer("tpx", [total, reqs], [text, out], update)


# ---------------------------------------------------------------------------------------------
# Lesson 06: the prefill scheduler on a stream of requests, and each method's waste.

WORKLOAD_PRESETS = {
    "long-tail": {"median": 64, "sigma": 1.0, "max_len": 2048},
    "bimodal": {"short": 50, "long": 1500, "p_long": 0.1},
    "uniform": {"low": 16, "high": 512},
}


def prefill_plan_state(workload: str = "long-tail", num_requests: int = 48, max_num_batched_tokens: int = 1024,
                       seed: int = 0) -> dict:
    """A seeded stream of ``workload`` requests (``WORKLOAD_PRESETS``), scheduled, costed per method.

    Keys: ``seq_lens``, ``batches`` (lists of request ids), ``rejected`` (ids),
    ``stats`` ({method: [engine.BatchStats]}, analytic: ``engine.batch_stats``) and ``totals``
    ({method: {"rows", "cells_computed", "cells_useful", "flops_executed", "flops_useful"}}).
    """
    if workload not in WORKLOAD_PRESETS:
        raise ValueError(f"workload must be one of {tuple(WORKLOAD_PRESETS)}, got {workload!r}")
    n = check_int("num_requests", num_requests, 1, 4096)
    budget = check_int("max_num_batched_tokens", max_num_batched_tokens, 1, 1 << 20)
    lens = workload_lengths(workload, n, seed, **WORKLOAD_PRESETS[workload])
    batches = plan_batches(lens, budget, skip_oversize=True)
    rejected = [i for i, n in enumerate(lens) if n > budget]  # S3: a request runs whole or not at all
    cfg = ModelConfig()
    stats = {m: [batch_stats(cfg, [lens[i] for i in ids], m, b, request_ids=ids) for b, ids in enumerate(batches)]
             for m in ("padded", "masked", "varlen")}
    totals = {m: {"rows": sum(s.executed_rows for s in st), "cells_computed": sum(s.attn_cells_computed for s in st),
                  "cells_useful": sum(s.attn_cells_useful for s in st), "flops_executed": sum(s.flops_executed for s in st),
                  "flops_useful": sum(s.flops_useful for s in st)} for m, st in stats.items()}
    return {"seq_lens": lens, "batches": batches, "rejected": rejected, "stats": stats, "totals": totals,
            "max_num_batched_tokens": budget}


def prefill_plan_html(state: dict) -> str:
    """One ``<div>`` per method, ``varlen: rows 4783 | attention cells 886713 (useful 886713) | FLOPs
    executed / useful 1.00x``, then the batches and the rejected requests."""
    lines = []
    for m, t in state["totals"].items():
        ratio = t["flops_executed"] / t["flops_useful"] if t["flops_useful"] else 0.0
        lines.append(f"<div>{m}: rows {t['rows']} | attention cells {t['cells_computed']} (useful {t['cells_useful']}) | "
                     f"FLOPs executed / useful {ratio:.2f}x</div>")
    lens = state["seq_lens"]
    lines.append(f"<div>{len(state['batches'])} batches of at most {state['max_num_batched_tokens']} tokens, "
                 f"{sum(len(b) for b in state['batches'])} requests served</div>")
    rej = state["rejected"]
    lines.append(f"<div>rejected (longer than the budget, S3): {len(rej)}"
                 + (f" - lengths {[lens[i] for i in rej][:8]}" if rej else "") + "</div>")
    return "".join(lines)


def prefill_plan_explorer(workload: str = "long-tail", num_requests: int = 48, max_num_batched_tokens: int = 1024):
    """VBox class ``ppx``: Dropdown ``ppx-workload``, IntSliders ``ppx-num-requests`` (1..256) and
    ``ppx-budget`` (max_num_batched_tokens, 16..8192), HTML ``ppx-counts`` (``prefill_plan_html``),
    Output ``ppx-figure`` (``viz.batch_waste``; empty when every request was rejected)."""
    w = _widgets()
    kind = _tagged(w.Dropdown(options=list(WORKLOAD_PRESETS), value=workload, description="workload"), "ppx-workload")
    reqs = _tagged(w.IntSlider(value=num_requests, min=1, max=256, description="requests"), "ppx-num-requests")
    budget = _tagged(w.IntSlider(value=max_num_batched_tokens, min=16, max=8192, step=16, description="token budget"),
                     "ppx-budget")
    text, out = _tagged(w.HTML(), "ppx-counts"), _tagged(w.Output(), "ppx-figure")

    def update(change=None):
        state = prefill_plan_state(kind.value, reqs.value, budget.value)
        text.value = prefill_plan_html(state)
        if state["batches"]:
            show_figure(out, viz.batch_waste(state["stats"], budget.value))
        else:
            out.outputs = ()

    return _explorer("ppx", [kind, reqs, budget], [text, out], update)
