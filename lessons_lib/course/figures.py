"""Every figure a lesson shows, written into ``figures/`` by one command, byte for byte reproducible.

    python -m lessons_lib.course.figures            # all figures -> figures/
    python -m lessons_lib.course.figures --list     # names, lessons, captions
    python -m lessons_lib.course.figures --out DIR --only 03_attention_patterns

A figure is a zero-argument builder registered under a name that starts with its lesson
number (``NN_what``). Builders draw only from exact numbers or fixed seeds, so running
the command twice writes identical bytes: Agg renders the PNG, the rc settings are reset to
matplotlib's defaults plus ``STYLE``, and the PNG carries no metadata (no version, no date).

Adding a figure for another lesson::

    @register("04_trace_timeline", lesson="04", caption="...")
    def _trace_timeline():
        return viz.some_figure(...)

A notebook shows the same bytes with ``figures.show(name)``.

Taught in every lesson that shows a figure (notebooks/01_flat_batch.ipynb onwards).
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import matplotlib
from matplotlib.figure import Figure

from ..core.config import ModelConfig
from . import viz

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "figures"
DPI = 100
# Only what differs from matplotlib's defaults; everything else is reset by rcdefaults().
STYLE = {"font.family": "DejaVu Sans", "axes.spines.top": False, "axes.spines.right": False,
         "savefig.facecolor": "white", "figure.facecolor": "white", "svg.hashsalt": "lessons",
         "image.interpolation": "nearest"}
_NAME = re.compile(r"^\d\d_[a-z0-9_]+$")


@dataclass(frozen=True)
class FigureSpec:
    name: str      # file stem, "NN_what"
    lesson: str    # "NN", the notebook that shows it
    caption: str
    build: Callable[[], Figure]


REGISTRY: dict[str, FigureSpec] = {}


def register(name: str, lesson: str, caption: str):
    """Decorator: add a zero-argument Figure builder to the registry under ``name``."""
    if not _NAME.match(name):
        raise ValueError(f"figure name must look like 'NN_what' (lesson number, snake case), got {name!r}")
    if not name.startswith(lesson + "_"):
        raise ValueError(f"figure name {name!r} must start with its lesson number {lesson!r}")

    def deco(fn: Callable[[], Figure]) -> Callable[[], Figure]:
        if name in REGISTRY:
            raise ValueError(f"figure {name!r} is registered twice")
        REGISTRY[name] = FigureSpec(name, lesson, caption, fn)
        return fn
    return deco


@contextlib.contextmanager
def style():
    """matplotlib's defaults plus STYLE, whatever the user's matplotlibrc says."""
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update(STYLE)
        yield


def _spec(name: str) -> FigureSpec:
    if name not in REGISTRY:
        raise ValueError(f"unknown figure {name!r}; registered: {sorted(REGISTRY)}")
    return REGISTRY[name]


def build(name: str) -> Figure:
    """The registered figure, drawn under ``style()``."""
    spec = _spec(name)
    with style():
        fig = spec.build()
    if not isinstance(fig, Figure):
        raise TypeError(f"figure builder {name!r} returned {type(fig).__name__}, not a matplotlib Figure")
    return fig


def render(name: str) -> bytes:
    """PNG bytes of a registered figure, exactly what ``write`` puts in the file."""
    fig = build(name)
    with style():
        return viz.to_png(fig, dpi=DPI)


def show(name: str):
    """Inline image of a registered figure for a notebook (same bytes as ``figures/<name>.png``)."""
    from IPython.display import Image
    return Image(data=render(name))


def write(names: Iterable[str] | None = None, out_dir: str | pathlib.Path = DEFAULT_DIR) -> list[pathlib.Path]:
    """Write ``<out_dir>/<name>.png`` for each name (default: all registered). Returns the paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in sorted(names) if names is not None else sorted(REGISTRY):
        path = out / f"{name}.png"
        path.write_bytes(render(name))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    matplotlib.use("Agg")  # a command-line run never needs a GUI
    ap = argparse.ArgumentParser(prog="python -m lessons_lib.course.figures", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_DIR), help="output folder (default: figures/ of the repo)")
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME", help="write only these figures")
    ap.add_argument("--list", action="store_true", help="list the registered figures and exit")
    args = ap.parse_args(argv)
    if args.list:
        for spec in sorted(REGISTRY.values(), key=lambda s: s.name):
            print(f"{spec.name:32s} lesson {spec.lesson}  {spec.caption}")
        return 0
    if args.only is not None:
        for n in args.only:
            _spec(n)
    for path in write(args.only, args.out):
        print(path)
    return 0


# ---------------------------------------------------------------------------------------------
# The figures. A = 10 tokens, B = 30 tokens (S2) unless a caption says otherwise.
ARTICLE_LENS = [10, 30]


@register("01_token_strip", lesson="01", caption="A and B flattened into 40 rows, ticks at cu_seqlens = [0, 10, 40] (C3)")
def _token_strip() -> Figure:
    return viz.token_strip(ARTICLE_LENS)


@register("01_padded_vs_flat", lesson="01", caption="padding to [2 x 30] (20 pad rows) vs the flat [40] rows (C2, C3)")
def _padded_vs_flat() -> Figure:
    return viz.padded_vs_flat(ARTICLE_LENS)


@register("02_who_reads_whom", lesson="02",
          caption="which input rows change which output rows: per-token layers vs attention (C4, C5, C7, C10)")
def _who_reads_whom() -> Figure:
    from .probe import who_reads_whom
    return viz.dependency_maps(who_reads_whom(ARTICLE_LENS), ARTICLE_LENS)


@register("02_qkv_shards", lesson="02", caption="TP=2: rank 0 and rank 1 each own Q, K, V rows of 4 heads, [40 x 768] (C6)")
def _qkv_shards() -> Figure:
    return viz.qkv_shards(ModelConfig(), tokens=sum(ARTICLE_LENS))


@register("03_attention_patterns", lesson="03",
          caption="padded, masked and varlen score matrices for A, B: 1800/1600/1000 computed, 1000 useful (C2, C8, C10)")
def _attention_patterns() -> Figure:
    return viz.attention_patterns(ARTICLE_LENS)


@register("03_masked_growth", lesson="03", caption="masked computes (R L)^2 cells, varlen R L^2 (C9)")
def _masked_growth() -> Figure:
    return viz.masked_growth(64)


@register("05_flops_1x1000_vs_10x100", lesson="05",
          caption="same 1000 tokens: 1 x 1000 vs 10 x 100 vs 100 x 10, whole-forward FLOPs (C14)")
def _flops_bars() -> Figure:
    return viz.flops_bars([("1 x 1000", [1000]), ("10 x 100", [100] * 10), ("100 x 10", [10] * 100)],
                          ModelConfig(), figsize=(6, 4))


@register("05_attention_share", lesson="05", caption="attention share of FLOPs against request length (C14)")
def _attention_share() -> Figure:
    return viz.attention_share_curve(ModelConfig(), marks=(100, 1000, 8000))


@register("05_intensity", lesson="05", caption="arithmetic intensity of a linear layer vs tokens, and decode (C13, C15)")
def _intensity() -> Figure:
    return viz.intensity_curves()


# Lessons 00, 04, 06 (tensor parallelism and the prefill engine). No figure starts processes:
# traces come from tp_dryrun (the model's own code on a recording stand-in group), which lesson
# 04 checks against a real two-process run.
TP_PACKINGS = ([40], ARTICLE_LENS, [1] * 40)  # the same 40 tokens as 1, 2 and 40 requests
ENGINE_STREAM = dict(workload="long-tail", num_requests=24, max_num_batched_tokens=512, seed=3)  # lesson 06's stream


@register("00_allreduce_growth", lesson="00",
          caption="one request of N tokens under TP=2: 16 all-reduces per forward for every N, each [N x 512] fp32 (C1)")
def _allreduce_growth() -> Figure:
    return viz.allreduce_growth(ModelConfig())


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
    return viz.tp_trace_timeline(runs[1], TP_PACKINGS, heads_per_rank=cfg.heads_per_rank,
                                 qkv_width=3 * cfg.heads_per_rank * cfg.d_head)


@register("06_batch_waste", lesson="06",
          caption="24 long-tailed requests under a 512-token budget (one of 1776 tokens rejected): rows and attention "
                  "cells per batch, padded vs masked vs varlen (C2, C8, C10)")
def _batch_waste() -> Figure:
    from .widgets import prefill_plan_state
    state = prefill_plan_state(**ENGINE_STREAM)
    return viz.batch_waste(state["stats"], state["max_num_batched_tokens"])

if __name__ == "__main__":
    sys.exit(main())
