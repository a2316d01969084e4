"""Every figure a lesson shows, by name: a registry, byte-for-byte rendering, one command.

    python -m lessons_lib.course.figures            # all figures -> figures/
    python -m lessons_lib.course.figures --list     # names, lessons, captions
    python -m lessons_lib.course.figures --out DIR --only 03_attention_patterns

A figure is a zero-argument builder registered, in its lesson's module (``course/lNN_*.py``),
under a name that starts with the lesson number (``NN_what``). Builders draw only from exact
numbers or fixed seeds; the PNG is rendered by Agg under matplotlib's defaults plus ``STYLE``
and carries no metadata, so running the command twice writes identical bytes. A notebook
shows the same bytes with ``figures.show(name)``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import pathlib
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import matplotlib
from matplotlib.figure import Figure

from ..style import to_png

LESSON_MODULES = ("l00_setup", "l01_flat_batch", "l02_linear", "l03_attention", "l04_tp", "l05_flops", "l06_engine", "l07_kernel",
                  "l08_chunked")
ROOT = pathlib.Path(__file__).resolve().parents[2]

DEFAULT_DIR = ROOT / "figures"

DPI = 100

STYLE = {"font.family": "DejaVu Sans", "font.size": 10, "axes.spines.top": False, "axes.spines.right": False,
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

def load_lessons() -> None:
    """Import every lesson module, so that all their figures are registered."""
    for module in LESSON_MODULES:
        importlib.import_module(f"{__package__}.{module}")


def _spec(name: str) -> FigureSpec:
    if name not in REGISTRY:
        load_lessons()
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
        return to_png(fig, dpi=DPI)

def show(name: str):
    """Inline image of a registered figure for a notebook (same bytes as ``figures/<name>.png``)."""
    from IPython.display import Image
    return Image(data=render(name))

def write(names: Iterable[str] | None = None, out_dir: str | pathlib.Path = DEFAULT_DIR) -> list[pathlib.Path]:
    """Write ``<out_dir>/<name>.png`` for each name (default: all registered). Returns the paths."""
    load_lessons()
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
    load_lessons()
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

ARTICLE_LENS = [10, 30]

if __name__ == "__main__":
    # Run as a script this file is ``__main__``; the lessons register into the imported module.
    from lessons_lib.course.figures import main as _main
    sys.exit(_main())
