"""Helpers shared by several test files (fixtures live in conftest.py)."""
from __future__ import annotations

import base64
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest
import torch

from lessons_lib.measure.profile import random_qkv

if TYPE_CHECKING:  # matplotlib is imported by the figure tests only
    from matplotlib.figure import Figure
    from matplotlib.text import Text


TESTS = Path(__file__).resolve().parent


def install_in_children(monkeypatch, module: str, **env: str) -> None:
    """Every Python process started after this (a notebook's kernel, the TP workers it spawns)
    imports ``tests/<module>.py`` at start-up, e.g. ``breakages`` or ``kernel_doubles``: this
    test's environment puts tests/hooks/sitecustomize.py first on ``PYTHONPATH`` (see there).
    ``env``: more variables for those processes (``LESSONS_BREAK="C1"``)."""
    monkeypatch.setenv("LESSONS_TEST_HOOK", module)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS / "hooks"), str(TESTS), str(TESTS.parent)]))
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def children() -> set[int]:
    """Live child processes of this test process, except multiprocessing's resource tracker
    (started once by the first spawn and kept for the session, by design)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def by_class(box) -> dict:
    """Every descendant widget of an explorer by its CSS classes (what a browser test selects on)."""
    found = {}

    def walk(node):
        for child in getattr(node, "children", ()):
            for cls in child._dom_classes:
                found[cls] = child
            walk(child)
    walk(box)
    return found


def png_of(out) -> bytes:
    """The PNG an explorer's callback put into an ``ipywidgets.Output``."""
    (msg,) = out.outputs
    assert msg["output_type"] == "display_data"
    data = base64.b64decode(msg["data"]["image/png"])
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return data


def stub(*args, **kwargs):
    """The exercise stub a lesson hands out."""
    raise NotImplementedError


def attempt(check, fn) -> str:
    """Run an exercise checker on a wrong answer; return its explanation."""
    with pytest.raises(AssertionError) as info:
        check(fn)
    return str(info.value)


def varlen_loop(q, k, v, cu, causal=True, scale=None, cross=False):
    """The article's loop, written independently of lessons_lib; ``cross=True`` ignores cu_seqlens."""
    out, cu = torch.empty_like(q), cu.tolist()
    if cross:
        cu = [0, cu[-1]]
    for s, e in zip(cu[:-1], cu[1:]):
        sc = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        if causal:
            sc = sc.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v[s:e])
    return out


def make_qkv(lens_q, lens_k=None, heads=2, d_head=32, seed=0, dtype=torch.float32, device="cpu"):
    """``measure.profile.random_qkv`` with its key lengths: ``q, k, v, cu_seqlens_q, cu_seqlens_k``."""
    return random_qkv(lens_q, heads, d_head, seq_lens_k=lens_q if lens_k is None else lens_k, seed=seed,
                      device=device, dtype=dtype)


# ---- figures ------------------------------------------------------------------------------------------

def _with_gid(fig: Figure) -> list:
    return [a for ax in fig.axes for a in ax.get_children() if a.get_gid()]


def gids(fig: Figure) -> list[str]:
    """The gid of every artist of every axes that has one, in drawing order (repeats kept)."""
    return [a.get_gid() for a in _with_gid(fig)]


def by_gid(fig: Figure, name: str):
    """The one artist of ``fig`` whose gid is ``name`` (fails unless there is exactly one)."""
    found = [a for a in _with_gid(fig) if a.get_gid() == name]
    assert len(found) == 1, f"{name}: {len(found)} artists"
    return found[0]


def texts(fig: Figure) -> list[Text]:
    """Every text a reader sees: each axes' texts, title, axis labels and tick labels (non-empty ones),
    every legend entry (the axes' legends, then the figure's), the figure's non-empty texts (suptitle included)."""
    axes = [t for ax in fig.axes for t in ax.texts + [ax.title, ax.xaxis.label, ax.yaxis.label]
            + ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
    legends = [t for leg in [ax.get_legend() for ax in fig.axes] + fig.legends if leg for t in leg.get_texts()]
    return axes + legends + [t for t in fig.texts if t.get_text()]


def min_font(fig: Figure) -> float:
    """The smallest font size among ``texts(fig)``."""
    return min(t.get_fontsize() for t in texts(fig))


# ---- notebooks ----------------------------------------------------------------------------------------

def claim_cells(nb, claim_id: str) -> list[int]:
    """Indices of the code cells whose first line is a ``# claim`` comment naming ``claim_id``."""
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
            and re.match(rf"#\s*claim\b.*\b{claim_id}\b", c.source.split("\n", 1)[0])]


def run_cells(client, nb, last: int | None = None) -> dict[int, list[dict]]:
    """Execute ``nb``'s code cells in ``client``'s kernel (an nbclient ``NotebookClient`` inside
    ``setup_kernel()``), one at a time up to and including cell ``last`` (default: all). A cell that raises
    does not stop the next. Returns, per code cell index run, its error outputs (empty list: it ran)."""
    from nbclient.exceptions import CellExecutionError
    errors: dict[int, list[dict]] = {}
    for i, cell in enumerate(nb.cells[:None if last is None else last + 1]):
        if cell.cell_type != "code":
            continue
        try:
            client.execute_cell(cell, i)
        except CellExecutionError:
            pass
        errors[i] = [o for o in cell.outputs if o.output_type == "error"]
    return errors


class FakeBench:
    """Stands in for AllReduceBench's ranks: a fixed time per payload, no processes."""
    world_size = 2

    def measure(self, tokens, d_model, repeats=5, warmup=2, first_warmup=2):
        return {"tokens": list(tokens), "bytes": [n * d_model * 4 for n in tokens], "seconds": [1e-3] * len(tokens),
                "backend": "fake", "world_size": 2}
