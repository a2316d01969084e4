"""Which of the engine's named faults (``lessons_lib.faults``) each claim guards against.

``BREAKS[claim id] = Breakage(notebook, faults)``: the lesson whose claim cell must fail, and the
faults that, turned on together, must make it fail with ``✗ <id> FAILED``. A claim can have more
breakages, each under ``"<id>:<variant>"``, whose run needs the same claim cell to fail. A claim no
fault can fail would be a claim that proves nothing.

``tests/test_claims_can_fail.py`` runs a lesson with ``LESSONS_FAULTS=<names>``:
tests/hooks/sitecustomize.py turns them on at start-up in the notebook's kernel (and TP workers
turn them on at their own start-up). The rows live per lesson in tests/breakages_lNN.py.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from lessons_lib.faults import FAULTS


@dataclass(frozen=True)
class Breakage:
    notebook: str            # the lesson whose claim cell must fail, e.g. "03_masked_vs_varlen_attention"
    faults: tuple[str, ...]  # names in lessons_lib.faults.FAULTS

    @property
    def what(self) -> str:
        return "; ".join(FAULTS[name].what for name in self.faults)


BREAKS: dict[str, Breakage] = {}


def breaks(claim_id: str, notebook: str, *faults: str, variant: str | None = None) -> None:
    """Register ``faults`` as a breakage of ``claim_id`` (``variant``: one more, as ``"<claim_id>:<variant>"``)."""
    key = claim_id if variant is None else f"{claim_id}:{variant}"
    if key in BREAKS:
        raise ValueError(f"{key} has two breakages")
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        raise ValueError(f"{key}: unknown faults {unknown} (or none given)")
    BREAKS[key] = Breakage(notebook, tuple(faults))


for _module in sorted(Path(__file__).parent.glob("breakages_l*.py")):
    importlib.import_module(_module.stem)
