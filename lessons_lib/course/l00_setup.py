"""What lesson 00 (the setup, one request) draws, explores and checks.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure

from ..core.config import ModelConfig
from ..core.groups import LocalGroup
from ..core.model import Transformer
from ..validate import check_int
from ..tp.dryrun import expected_trace, record_trace
from .explore import explorer, ipywidgets_module, show_figure, tagged
from .figures import register
from .grading import grade, int_tuple
from .style import CELL_COLORS, USEFUL, WASTED


def allreduce_growth(cfg: ModelConfig | None = None, tokens: Sequence[int] | None = None, mark: int | None = None,
                     measured: Mapping[int, Sequence] | None = None, world_size: int = 2) -> Figure:
    """Claim C1: all-reduces per forward (left) and bytes per all-reduce (right) against the
    tokens N of one request, from ``tp_dryrun.expected_trace``.

    ``measured``: ``{N: trace}`` of real ranks (``TPResult.traces[0]``), drawn as markers on the
    formula's lines (artists with gid ``measured-count-N`` / ``measured-bytes-N``).
    ``mark``: one N to highlight (the widget's slider).
    """
    cfg = cfg or ModelConfig()
    tokens = list(tokens) if tokens is not None else sorted({int(v) for v in np.logspace(0, np.log10(16384), 60)})
    traces = {n: expected_trace(cfg, n, 0, world_size) for n in tokens}
    counts = [len(traces[n]) for n in tokens]
    nbytes = [traces[n][0].bytes if traces[n] else 0 for n in tokens]
    fig = Figure(figsize=(8, 3.3))
    left, right = fig.subplots(1, 2)
    left.plot(tokens, counts, color=CELL_COLORS[USEFUL], label="formula: 2 x n_layers")
    left.set_ylim(0, max(counts + [1]) * 1.5)
    left.set_ylabel("all-reduces per forward")
    left.set_title(f"count: {counts[0]} for every N", fontsize=9)
    right.plot(tokens, nbytes, color=CELL_COLORS[WASTED], label=f"formula: N x {cfg.d_model} x {cfg.dtype.itemsize} B")
    right.set_yscale("log")
    right.set_ylabel("bytes per all-reduce (one rank)")
    right.set_title(f"payload: [N x {cfg.d_model}] {str(cfg.dtype).replace('torch.', '')}, grows like N", fontsize=9)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("tokens N in the request")
    for n, trace in sorted((measured or {}).items()):
        trace = list(trace)
        left.plot([n], [len(trace)], "o", color="black", gid=f"measured-count-{n}")
        right.plot([n], [trace[0].bytes if trace else 0], "o", color="black", gid=f"measured-bytes-{n}")
        right.annotate(f"N={n}: {trace[0].bytes:,} B" if trace else f"N={n}", (n, trace[0].bytes if trace else 1),
                       textcoords="offset points", xytext=(-6, 6), ha="right", fontsize=7)
    if measured:
        left.plot([], [], "o", color="black", label="real TP=2 trace")
        right.plot([], [], "o", color="black", label="real TP=2 trace")
    if mark is not None:
        trace = expected_trace(cfg, int(mark), 0, world_size)
        left.axvline(mark, color="#888888", linestyle=":", linewidth=1)
        right.axvline(mark, color="#888888", linestyle=":", linewidth=1)
        right.plot([mark], [trace[0].bytes if trace else 0], "s", color=CELL_COLORS[WASTED], gid="mark")
        fig.suptitle(f"N = {mark}: {len(trace)} all-reduces of [{mark} x {cfg.d_model}], "
                     f"{trace[0].bytes if trace else 0:,} B each", fontsize=9)
    for ax in (left, right):
        ax.legend(fontsize=7, frameon=False, loc="upper left")
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.16, top=0.82 if mark is not None else 0.88, wspace=0.32)
    return fig

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
    ``arx-text`` (``allreduce_text``), Output ``arx-figure`` (``allreduce_growth`` with N marked)."""
    w = ipywidgets_module()
    tokens = tagged(w.IntSlider(value=num_tokens, min=1, max=16384, description="tokens N"), "arx-tokens")
    kind = tagged(w.Dropdown(options=list(DTYPES), value=dtype, description="dtype"), "arx-dtype")
    text, out = tagged(w.HTML(), "arx-text"), tagged(w.Output(), "arx-figure")

    def update(change=None):
        import torch
        state = allreduce_state(tokens.value, kind.value)
        text.value = f"<div>{allreduce_text(state)}</div>"
        show_figure(out, allreduce_growth(ModelConfig(dtype=getattr(torch, kind.value)), mark=tokens.value))

    return explorer("arx", [tokens, kind], [text, out], update)

_SMALL_CFGS = [ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128),
               ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=77, max_position=40,
                           tp_size=3),
               ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=32, d_ffn=128, vocab_size=50, max_position=16)]

def _model_params(cfg: ModelConfig, tp_size: int = 1) -> int:
    """Parameters rank 0 really holds: built from the model's own classes (one-process stand-in group)."""
    model = Transformer(cfg, seed=0, group=LocalGroup(0, tp_size))
    return sum(p.numel() for p in model.parameters())

def check_param_count(fn: Callable[[ModelConfig], int]) -> bool:
    """Exercise 00.1: ``fn(cfg) -> int``, the parameters of the whole model (TP=1), LM head tied."""
    def judge(got, cfg):
        want = _model_params(cfg)
        if got == want:
            return None
        d, n = cfg.d_model, cfg.n_layers
        hints = {want + cfg.vocab_size * d: "the LM head is tied to the token embedding (logits = h @ wte^T): count it once",
                 want - cfg.max_position * d: "the learned position embedding wpe [max_position, d_model] is a parameter too",
                 want - cfg.vocab_size * d: "the token embedding wte [vocab_size, d_model] is a parameter too",
                 want - n * (3 * cfg.qkv_dim + d + cfg.d_ffn + d): "count the biases of the four linear layers",
                 want - (4 * n + 2) * d: "LayerNorms have a weight and a bias of d_model each: ln_1, ln_2 per layer, ln_f"}
        hint = hints.get(got, "")
        return f"got {got!r}, expected {want}" + (f" - {hint}" if hint else "")
    return grade("param_count", fn, [(c,) for c in _SMALL_CFGS], judge, "matches the real model on 3 configs")

def check_rank_params(fn: Callable[[ModelConfig, int], int]) -> bool:
    """Exercise 00.2: ``fn(cfg, tp_size) -> int``, the parameters ONE rank holds under TP=tp_size."""
    cases = [(c, tp) for c in _SMALL_CFGS for tp in (1, 2, 3) if c.n_heads % tp == 0 and c.d_ffn % tp == 0]

    def judge(got, cfg, tp):
        want = _model_params(cfg, tp)
        if got == want:
            return None
        total = _model_params(cfg)
        replicated = total - (total - want) * tp // (tp - 1) if tp > 1 else 0
        hint = ""
        if tp > 1 and isinstance(got, (int, float)) and got * tp == total:
            hint = " - not everything is split: embeddings, LayerNorms and the row-parallel biases are whole on every rank"
        elif tp > 1 and got == want - replicated:
            hint = " - add the replicated parameters (embeddings, LayerNorms, row-parallel biases) that every rank keeps"
        elif tp > 1 and got == want - 2 * cfg.n_layers * cfg.d_model * (tp - 1) // tp:
            hint = (" - the biases of out proj and FFN-down are not split: each rank keeps the whole [d_model] bias "
                    "and adds it once, after the all-reduce")
        return f"got {got!r}, expected {want} for tp_size={tp}{hint}"
    return grade("rank_params", fn, cases, judge, f"matches each rank's real shard on {len(cases)} layouts")

def check_all_reduce_bytes(fn: Callable[[ModelConfig, int], tuple]) -> bool:
    """Exercise 00.3: ``fn(cfg, num_tokens) -> (count, bytes_each)``: the all-reduces one rank makes
    in one TP=2 forward of a single request, and the bytes of each (in ``cfg.dtype``) (C1)."""
    cases = [(_SMALL_CFGS[0], 10), (_SMALL_CFGS[0], 111), (ModelConfig(n_layers=3, d_model=64, n_heads=4,
             d_head=16, d_ffn=128, vocab_size=50, max_position=64, dtype=torch.bfloat16), 7)]

    def judge(got, cfg, n):
        trace = record_trace(cfg, [n], 0, 2)  # the model's own code on a recording stand-in for rank 0
        want = (len(trace), trace[0].bytes)
        got, problem = int_tuple(got, "count, bytes_each")
        if problem or got == want:
            return problem
        size = torch.empty((), dtype=cfg.dtype).element_size()
        hint = ""
        if got[0] == cfg.n_layers:
            hint = " - two per layer: after the attention out proj and after FFN-down"
        elif got[1] == n * cfg.d_ffn * size or got[1] == n * cfg.d_ffn * size // 2:
            hint = " - the all-reduce carries the row-parallel layer's OUTPUT, [N, d_model], not its input"
        elif got[1] * 2 == want[1]:
            hint = " - each rank all-reduces a full [N, d_model] partial sum, not half of it"
        elif got[1] == n * cfg.d_model:
            hint = f" - bytes, not elements: {cfg.dtype} has {size} bytes per element"
        return f"got {got}, expected {want}{hint}"
    return grade("all_reduce_bytes", fn, cases, judge, "2 x n_layers all-reduces of N x d_model x itemsize bytes, on 3 cases")

@register("00_allreduce_growth", lesson="00",
          caption="one request of N tokens under TP=2: 16 all-reduces per forward for every N, each [N x 512] fp32 (C1)")
def _allreduce_growth() -> Figure:
    return allreduce_growth(ModelConfig())
