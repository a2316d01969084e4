"""Helpers shared by several test files (fixtures live in conftest.py)."""
from __future__ import annotations

import base64
import math

import psutil
import pytest
import torch


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


def stub(*args):
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
