"""figures: one command writes every lesson figure, byte for byte the same on every run."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import min_font
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from lessons_lib.course import figures
from lessons_lib.style import MIN_FONT, OTHER, TEXT, to_png

ROOT = Path(__file__).resolve().parents[1]
figures.load_lessons()  # every lesson's figures registered before the tests are collected


def test_figures_command_is_byte_for_byte_reproducible(tmp_path):
    """Once in this process, once as the command in a fresh interpreter (another hash seed)."""
    a = figures.write(out_dir=tmp_path / "a")
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "lessons_lib.course.figures", "--out", str(tmp_path / "b")], cwd=tmp_path,
                   env=env, check=True, capture_output=True, timeout=300)
    b = sorted((tmp_path / "b").iterdir())
    assert [p.name for p in a] == [f"{n}.png" for n in sorted(figures.REGISTRY)]
    for pa, pb in zip(a, b):
        data = pa.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert data == pb.read_bytes(), f"{pa.name} differs between two runs"
        assert b"Software" not in data  # no matplotlib version in the file


def test_every_registered_figure_is_committed_and_every_committed_figure_is_registered():
    committed = {p.stem for p in (ROOT / "figures").glob("*.png")}
    assert set(figures.REGISTRY) <= committed, f"run `make figures`: missing {sorted(set(figures.REGISTRY) - committed)}"
    assert committed <= set(figures.REGISTRY), f"stale files in figures/: {sorted(committed - set(figures.REGISTRY))}"


def test_registry_names_match_their_lessons_notebooks():
    for spec in figures.REGISTRY.values():
        assert spec.name.startswith(spec.lesson + "_")
        assert list((ROOT / "notebooks").glob(f"{spec.lesson}_*.ipynb")), f"no notebook for lesson {spec.lesson}"


def test_notebooks_show_only_registered_figures_of_their_own_lesson():
    shown = 0
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb_path.read_text())["cells"]
        for name in re.findall(r'figures\.show\("([^"]+)"\)', "\n".join("".join(c["source"]) for c in cells)):
            assert name in figures.REGISTRY, f"{nb_path.name} shows unregistered figure {name!r}"
            assert name.startswith(nb_path.name[:2] + "_"), f"{nb_path.name} shows another lesson's figure {name!r}"
            shown += 1
    assert shown >= len([s for s in figures.REGISTRY.values() if s.lesson in ("01", "02", "03", "05")])


def test_build_render_and_show_agree():
    fig = figures.build("01_token_strip")
    assert isinstance(fig, Figure)
    png = figures.render("01_token_strip")
    assert figures.show("01_token_strip").data == png


def test_register_validates_names_and_duplicates():
    with pytest.raises(ValueError, match="NN_what"):
        figures.register("TokenStrip", lesson="01", caption="")
    with pytest.raises(ValueError, match="lesson number"):
        figures.register("02_strip", lesson="01", caption="")
    with pytest.raises(ValueError, match="twice"):
        figures.register("01_token_strip", lesson="01", caption="")(lambda: Figure())
    with pytest.raises(ValueError, match="unknown figure"):
        figures.build("99_nothing")


def test_main_lists_and_writes_only_what_is_asked(tmp_path, capsys):
    assert figures.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in figures.REGISTRY)
    assert figures.main(["--out", str(tmp_path), "--only", "03_attention_patterns"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["03_attention_patterns.png"]
    with pytest.raises(ValueError, match="unknown figure"):
        figures.main(["--out", str(tmp_path), "--only", "03_nothing"])


@pytest.mark.parametrize("name", sorted(figures.REGISTRY))
def test_every_registered_figure_builds_in_its_lesson_with_text_of_at_least_9_pt(name):
    """Each registered figure: a Figure, registered under its own lesson's number, and readable on
    a laptop: titles, labels, ticks, legends and annotations, as built and once drawn."""
    spec = figures.REGISTRY[name]
    assert spec.name == name and spec.lesson == name[:2]
    fig = figures.build(name)
    assert isinstance(fig, Figure)
    assert min_font(fig) >= MIN_FONT  # as built, every text (visible or not)
    with figures.style():
        to_png(fig)  # drawing creates the tick labels
    small = [f"{name}: {t.get_text()[:40]!r} at {t.get_fontsize():g} pt" for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.get_fontsize() < MIN_FONT]
    assert not small, "\n".join(small[:30])


def test_the_lessons_figures_are_registered():
    """The figures the lessons show are there (the parametrized test above checks only what is registered)."""
    assert {"00_course_map", "00_tp_split", "00_allreduce_growth", "01_padded_vs_flat", "01_token_strip",
            "04_trace_timeline", "04_two_axes", "05_intensity", "05_flops_1x1000_vs_10x100", "05_attention_share",
            "05_weight_reuse", "06_fcfs_batches", "06_batch_waste", "07_launch_grid", "07_online_softmax", "07_fifty_launches",
            "07_short_request_tile"} <= set(figures.REGISTRY)


def _drawn(name: str):
    """The registered figure, drawn once (tick labels exist), and its renderer."""
    fig = figures.build(name)
    return fig, _agg_renderer(fig)


def _agg_renderer(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    with figures.style():
        canvas.draw()
    return canvas.get_renderer()


def clipped_texts(fig, renderer, tolerance_px: float = 1.0) -> list[str]:
    """Every visible, non-empty text whose drawn box leaves the figure's canvas (cut in the PNG)."""
    box = fig.bbox
    tick_labels, drawn_ticks = set(), set()
    for ax in fig.axes:  # an axis keeps Text objects for ticks it no longer draws (outside its limits)
        for axis in ax._axis_map.values():
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                tick_labels |= {id(tick.label1), id(tick.label2)}
            if not (ax.get_visible() and ax.axison and axis.get_visible()):
                continue
            for tick in axis._update_ticks():
                drawn_ticks |= {id(tick.label1), id(tick.label2)}
    out = []
    for t in fig.findobj(Text):
        if not (t.get_visible() and t.get_text().strip()) or (id(t) in tick_labels and id(t) not in drawn_ticks):
            continue
        e = t.get_window_extent(renderer)
        if (e.x0 < box.x0 - tolerance_px or e.y0 < box.y0 - tolerance_px
                or e.x1 > box.x1 + tolerance_px or e.y1 > box.y1 + tolerance_px):
            out.append(f"{t.get_text()[:50]!r} spans x {e.x0:.0f}..{e.x1:.0f}, y {e.y0:.0f}..{e.y1:.0f} "
                       f"of a {box.width:.0f} x {box.height:.0f} canvas")
    return out


def grey_strokes(fig) -> list[str]:
    """Every line, outline or edge drawn in ``style.OTHER`` grey. Grey means one thing course-wide: a
    FILL for work that is not attention, a linear layer or communication; strokes use ``style.TEXT``."""
    from matplotlib.collections import Collection
    from matplotlib.colors import same_color, to_rgba_array
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def grey(colours) -> bool:
        return any(c[3] > 0 and same_color(c[:3], OTHER) for c in to_rgba_array(colours))

    out = []
    for a in fig.findobj(lambda a: isinstance(a, (Line2D, Patch, Collection)) and a.get_visible()):
        if isinstance(a, Line2D):
            if a.get_linestyle() not in ("None", "", " ") and grey(a.get_color()):
                out.append(f"line {a.get_label()!r}")
            elif a.get_marker() not in ("None", "", " ", None) and grey(a.get_markerfacecolor()):
                out.append(f"markers {a.get_label()!r}")
        elif isinstance(a, Patch):
            if a.get_linewidth() > 0 and grey(a.get_edgecolor()):
                out.append(f"{type(a).__name__} edge (gid {a.get_gid()!r})")
        elif len(a.get_linewidths()) and max(a.get_linewidths()) > 0 and len(a.get_edgecolors()) and grey(a.get_edgecolors()):
            out.append(f"{type(a).__name__} strokes")
    return out


@pytest.mark.parametrize("name", sorted(figures.REGISTRY))
def test_every_figure_keeps_its_text_on_the_canvas_and_grey_for_fills(name):
    fig, renderer = _drawn(name)
    cut = clipped_texts(fig, renderer)
    assert not cut, f"{name}: text cut at the canvas edge:\n" + "\n".join(cut[:10])
    strokes = grey_strokes(fig)
    assert not strokes, (f"{name}: grey (style.OTHER) used for strokes; guides, outlines and reference lines are "
                         "style.TEXT:\n" + "\n".join(sorted(set(strokes))[:10]))


def test_the_figure_checks_catch_a_cut_title_and_a_grey_guide_line():
    fig = Figure(figsize=(3, 2))
    ax = fig.add_subplot()
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title("a title far too long to fit on a three-inch wide canvas, cut at the right edge")
    ax.axhline(0.5, color=OTHER)
    ax.add_patch(Rectangle((0, 0), 0.2, 0.2, facecolor=OTHER, edgecolor="white"))  # a grey fill is allowed
    renderer = _agg_renderer(fig)
    assert len(clipped_texts(fig, renderer)) == 1
    assert len(grey_strokes(fig)) == 1
    ax.set_title("short")
    ax.lines[0].set_color(TEXT)
    assert clipped_texts(fig, renderer) == [] and grey_strokes(fig) == []
