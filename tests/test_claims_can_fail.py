"""Claims that can fail: for every claim id, turn on the engine's named faults the claim guards against
(tests/breakages.py maps claim ids to ``lessons_lib.faults`` names) and show that the lesson's claim cell
then fails.

Each run executes the lesson in a fresh kernel whose engine has the faults on from start-up
(``LESSONS_FAULTS=<names>``: tests/hooks/sitecustomize.py turns them on in the kernel, and every TP
worker it spawns turns them on at its own start-up), cell by
cell, up to the first cell that proves the claim (``# claim <id>`` on its first line), and
requires that cell to raise ``✗ <id> FAILED``. The whole lessons pass under nbval, so each claim
is shown both ways: holding with the engine whole, failing with it broken.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from breakages import BREAKS
from helpers import claim_cells, install_in_children, run_cells
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
CLAIM_IDS = (["S1", "S2", "S3"] + [f"C{i}" for i in range(1, 16)] + [f"K{i}" for i in range(1, 6)]
             + [f"P{i}" for i in range(1, 6)])
VARIANTS = sorted(k for k in BREAKS if ":" in k)  # more breakages of one claim, "<id>:<variant>", e.g. "C4:gelu"


def test_every_claim_has_a_breakage_and_a_claim_cell():
    claims = {key.split(":")[0] for key in BREAKS}
    assert sorted(claims) == sorted(CLAIM_IDS), f"missing: {sorted(set(CLAIM_IDS) - claims)}"
    for key, b in BREAKS.items():
        nb = nbformat.read(REPO / "notebooks" / f"{b.notebook}.ipynb", as_version=4)
        assert claim_cells(nb, key.split(":")[0]), f"{b.notebook} has no '# claim {key}' cell"


@pytest.mark.parametrize("claim_id", CLAIM_IDS + VARIANTS)
def test_claim_cell_fails_with_the_engine_broken(claim_id, monkeypatch, tmp_path):
    if claim_id not in BREAKS:
        pytest.fail(f"no breakage registered for {claim_id} in tests/breakages.py")
    b = BREAKS[claim_id]
    nb = nbformat.read(REPO / "notebooks" / f"{b.notebook}.ipynb", as_version=4)
    claim = claim_id.split(":")[0]  # a variant fails the same claim cell
    target = claim_cells(nb, claim)[0]
    install_in_children(monkeypatch, "breakages", LESSONS_FAULTS=",".join(b.faults))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(REPO / "notebooks")}})
    with client.setup_kernel():
        errors = {i: "\n".join("\n".join(o.get("traceback", [])) + o.get("evalue", "") for o in outs)
                  for i, outs in run_cells(client, nb, last=target).items()}
    failure = re.sub(r"\x1b\[[0-9;]*m", "", errors.get(target, ""))
    assert f"✗ {claim} FAILED" in failure, (
        f"with '{b.what}', the claim cell {target} of {b.notebook} should fail with '✗ {claim} FAILED'; "
        f"it gave: {failure[-800:] or 'no error'}; earlier errors: "
        f"{ {i: e[-200:] for i, e in errors.items() if e and i != target} }")
