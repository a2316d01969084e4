"""Interactive explorers for the lessons: thin ipywidgets wrappers over pure functions.

Each explorer has a pure ``*_state`` function that computes every number it shows (the
tests call it directly) and a builder that returns an ``ipywidgets.VBox``. Every control and
readout carries a CSS class (``widget.add_class``) so a browser test can find it; the class
names and text formats of ``diagonal_block_explorer`` and ``flop_regime_explorer`` are a
contract with tests/ (see each docstring).

Figures are rendered to PNG with Agg and put into the ``Output`` widget's ``outputs``
(the same message ``clear_output(wait=True)`` + ``display`` would produce, in one step), so a
callback works, and can be tested, without a running kernel.

Taught in notebooks/01_flat_batch.ipynb, notebooks/03_masked_vs_varlen_attention.ipynb and
notebooks/05_flop_regimes.ipynb.
"""
from __future__ import annotations

import base64
from statistics import NormalDist
from typing import Sequence

import numpy as np

from . import viz
from .batch import _check_lengths
from .config import ModelConfig
from .flops import METHODS, attention_cells, executed_tokens, forward_flops

PATTERNS = ("ramp", "equal", "long-tail")
WIDGET_DPI = 80
_LONG_TAIL_SIGMA = 1.0
_LONG_TAIL_SEED = 0


def _widgets():
    import ipywidgets  # imported lazily: the pure functions work without it
    return ipywidgets


def _int_arg(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def _tagged(widget, css_class: str):
    widget.add_class(css_class)
    return widget


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
    lens = _check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
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

    text.observe(update, names="value")
    update()
    return _tagged(w.VBox([text, counts, out]), "fbx")


# ---------------------------------------------------------------------------------------------
# Lesson 03: the diagonal-block explorer (contract: /work/briefs/widget_contract.md).

def explorer_seq_lens(num_requests: int, length: int, pattern: str) -> list[int]:
    """Request lengths for ``num_requests`` requests around a base ``length``.

    "ramp": R=1 → [L]; otherwise request i gets ``round(L·(1 + 2i/(R-1)))`` (L to 3L; R=2, L=10 →
    [10, 30], the article's A and B). "equal": [L]·R. "long-tail": lognormal quantiles with
    median L (σ=1), shuffled with a fixed seed: deterministic, each >= 1.
    """
    r = _int_arg("num_requests", num_requests, 1, 1 << 20)
    n = _int_arg("length", length, 1, 1 << 30)
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

    for control in (reqs, base, pat):
        control.observe(update, names="value")
    update()
    return _tagged(w.VBox([w.HBox([reqs, base, pat]), counts, lengths, out]), "dbx")


# ---------------------------------------------------------------------------------------------
# Lesson 05: the FLOP-regime explorer (contract: /work/briefs/widget_contract.md).

def flop_regime_state(num_requests: int, length: int) -> dict:
    """``{"seq_lens": [L]·R, "flops": forward_flops(ModelConfig(), [L]·R, "varlen")}``."""
    r = _int_arg("num_requests", num_requests, 1, 1 << 20)
    n = _int_arg("length", length, 1, 1 << 30)
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

    for control in (reqs, base):
        control.observe(update, names="value")
    update()
    return _tagged(w.VBox([w.HBox([reqs, base]), text, out]), "frx")
