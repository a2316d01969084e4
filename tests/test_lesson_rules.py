"""What a lesson may touch (tests/lesson_rules.py): only the public engine and the course kit.

Every lesson (its notebook's code cells and its module in lessons_lib/course/) is checked, and the
checker is shown to catch each kind of reach: another lesson imported, an underscored engine name,
an engine attribute patched.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from lesson_rules import violations

ROOT = Path(__file__).resolve().parents[1]
LESSON_FILES = sorted((ROOT / "lessons_lib" / "course").glob("l[0-9][0-9]_*.py")) + sorted(
    (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_every_lesson_is_checked():
    numbers = {p.name[1:3] if p.suffix == ".py" else p.name[:2] for p in LESSON_FILES}
    assert len(LESSON_FILES) == 2 * len(numbers) >= 18, [p.name for p in LESSON_FILES]


@pytest.mark.parametrize("path", LESSON_FILES, ids=lambda p: p.name)
def test_a_lesson_touches_only_the_public_engine(path):
    found = violations(path)
    assert not found, "\n".join(found)


BAD = {  # a deliberately bad line of lesson 09, and what the checker must say about it
    "from .l03_attention import block_figure": "imports another lesson (.l03_attention)",
    "from lessons_lib.course import l05_flops": "imports another lesson (lessons_lib.course)",
    "from ..tp.workers import _threads": "imports the private name _threads",
    "from lessons_lib.core import attention\nf = attention._dense": "reads the private name attention._dense",
    "setattr(engine, 'scheduler', s)": "calls setattr()",
    "globals()['pack'] = my_pack": "calls globals()",
    "from lessons_lib.tp.runtime import TPRuntime\nTPRuntime.forward = recorded": "patches TPRuntime.forward",
    "model.layers[0].mlp.fc_up.forward = broken": "patches model.layers[0].mlp.fc_up.forward",
    "x = engine.__dict__": "reaches into engine.__dict__",
}


@pytest.mark.parametrize("line", list(BAD))
def test_the_rules_catch_a_bad_lesson(line):
    found = violations(Path("l09_bad.py"), "import torch\n" + line + "\n")
    assert any(BAD[line] in v for v in found), found


def test_a_lesson_may_use_its_own_module_widgets_and_the_public_api():
    good = ("from lessons_lib.course import l09_bad\nfrom lessons_lib import faults\nfrom lessons_lib.core import attention\n"
            "show(attention.IMPLS['loop'])\nslider.value = 3\nout.outputs = ()\n"
            "with faults.injected('causal_mask_top_left'):\n    pass\n")
    assert violations(Path("09_bad.ipynb"), good) == []
