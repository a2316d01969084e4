"""Deliberate breakages of the engine: for each claim id, the bug that claim guards against.

``tests/test_claims_can_fail.py`` runs a lesson with ``LESSONS_TEST_HOOK=breakages`` and
``LESSONS_BREAK=<claim id>``: tests/hooks/sitecustomize.py imports this module at start-up (in the
notebook's kernel and in every TP worker it spawns) and it applies that one breakage; the test
then checks that the claim's cell fails with ``✗ <id> FAILED``. A claim no breakage can fail
would be a claim that proves nothing.

Each entry: ``BREAKS[id] = Breakage(notebook, what, apply)``; a claim can have more breakages,
each under ``"<id>:<variant>"`` (``breaks(id, ..., variant="gelu")``), whose run needs the same
claim cell to fail. ``apply()`` monkeypatches
``lessons_lib`` in this process. Patch a function where it is LOOKED UP: ``from .attention
import attention_forward`` in ``model.py`` keeps its own reference, so patch both modules.
"""
from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Breakage:
    notebook: str            # the lesson whose claim cell must fail, e.g. "03_masked_vs_varlen_attention"
    what: str                # the bug, in words
    apply: Callable[[], None]


BREAKS: dict[str, Breakage] = {}


def breaks(claim_id: str, notebook: str, what: str, variant: str | None = None):
    """Register ``apply`` as the breakage of ``claim_id`` (checked by the test for every claim id);
    ``variant``: one more breakage of that claim, registered as ``"<claim_id>:<variant>"``."""
    key = claim_id if variant is None else f"{claim_id}:{variant}"

    def deco(apply: Callable[[], None]) -> Callable[[], None]:
        if key in BREAKS:
            raise ValueError(f"{key} has two breakages")
        BREAKS[key] = Breakage(notebook, what, apply)
        return apply
    return deco


def breaks_each(notebook: str, install: Callable[[str], None], table) -> None:
    """Register ``install(bug)`` as the breakage of each ``(claim id, bug, what)`` of ``table`` (lessons whose
    bugs are named variants of one mechanism, e.g. a kernel rebuilt with one line changed)."""
    for claim_id, bug, what in table:
        breaks(claim_id, notebook, what)(functools.partial(install, bug))


# ---- the breakages, one module per lesson: tests/breakages_lNN.py ---------------------------------
# Keep each one the smallest plausible bug a contributor could really introduce, and make it
# break only what its claim is about.
for _module in sorted(Path(__file__).parent.glob("breakages_l*.py")):
    importlib.import_module(_module.stem)

if os.environ.get("LESSONS_BREAK"):
    BREAKS[os.environ["LESSONS_BREAK"]].apply()
