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
from matplotlib.text import Text

from lessons_lib.course import figures
from lessons_lib.style import MIN_FONT, to_png

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
