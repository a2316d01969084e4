"""What every lesson has, read from the notebooks themselves: no test plumbing in the cells a learner
reads, a "the same thing in real systems" panel, and an exploration that a browser test drives."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PROJECTS = {"vLLM": r"\bvLLM\b", "nano-vllm": r"nano-vllm", "FlashAttention": r"FlashAttention|flash-attention|flash_attn",
            "Hugging Face": r"Hugging Face|transformers"}


def _cells(path: Path):
    return nbformat.read(path, as_version=4).cells


def real_systems_panel(cells) -> str | None:
    """The markdown cell headed "The same thing in real systems", or None."""
    for c in cells:
        if c.cell_type == "markdown" and re.search(r"^#+\s*The same thing in real systems", c.source, re.M | re.I):
            return c.source
    return None


def panel_problems(panel: str | None) -> list[str]:
    if panel is None:
        return ['no markdown cell headed "The same thing in real systems"']
    named = [p for p, rx in PROJECTS.items() if re.search(rx, panel)]
    files = set(re.findall(r"[\w./-]+\.(?:py|cu|h|cpp)\b", panel))
    problems = []
    if len(named) < 2:
        problems.append(f"the panel names {named or 'no project'}; it should place the idea in at least two of {list(PROJECTS)}")
    if len(files) < 2:
        problems.append(f"the panel names {sorted(files) or 'no source file'}; name the files (and functions) read")
    return problems


def test_there_are_lessons():
    assert len(LESSONS) >= 9, [p.name for p in LESSONS]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_no_nbval_comment_lines_in_learner_cells(path):
    """nbval's marks are cell tags (``nbval-ignore-output``), not comment lines a learner has to read past."""
    bad = [i for i, c in enumerate(_cells(path)) if c.cell_type == "code" and re.search(r"^\s*#\s*NBVAL_", c.source, re.M)]
    assert not bad, f"{path.name}: cells {bad} carry '# NBVAL_...' lines; tag the cells instead"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_every_lesson_places_its_idea_in_real_systems(path):
    problems = panel_problems(real_systems_panel(_cells(path)))
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_the_panel_check_refuses_an_empty_or_vague_panel():
    assert panel_problems(None)
    assert panel_problems("## The same thing in real systems\nvLLM does this too.")
    assert not panel_problems("## The same thing in real systems\n- vLLM: `vllm/v1/attention/backends/flash_attn.py` ...\n"
                              "- nano-vllm: `nanovllm/engine/model_runner.py` `prepare_prefill` ...")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_every_lesson_exploration_has_a_browser_test(path):
    """Each lesson's explorer is driven in a real browser by ``tests/browser/explore_lNN.py``, collected
    into ``test_widgets_browser.py`` (one JupyterLab for all of them)."""
    nn = path.name[:2]
    driver = ROOT / "tests" / "browser" / f"explore_l{nn}.py"
    assert driver.is_file(), f"lesson {nn} has no browser test {driver.relative_to(ROOT)}"
    tests = re.findall(rf"^def (test_lesson{nn}_\w+)\(", driver.read_text(), re.M)
    assert tests, f"{driver.name} defines no test_lesson{nn}_... function"
    collected = (ROOT / "tests" / "browser" / "test_widgets_browser.py").read_text()
    missing = [t for t in tests if not re.search(rf"^from explore_l{nn} import .*\b{t}\b", collected, re.M)]
    assert not missing, f"test_widgets_browser.py does not import {missing} from explore_l{nn}"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_every_lesson_is_a_valid_notebook_without_outputs(path):
    """Valid against its own nbformat version (e.g. no cell ids in a 4.4 file), committed without outputs."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    with_outputs = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not with_outputs, f"{path.name}: cells {with_outputs} are committed with outputs"
