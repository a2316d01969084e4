"""Lesson 04's TP packing explorer in the browser: the attention readout follows the packing, the TP trace does not.
"""
from __future__ import annotations

import math
import re

from widget_driver import MOVES, finish, inner_text, move, open_explorer, readout, slider_max, step_right, wait_text

from lessons_lib.core.batch import cumulative, pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.course import l04_tp
from lessons_lib.measure import flops
from lessons_lib.tp.dryrun import expected_trace, record_trace, trace_signature
from lessons_lib.tp.trace import summarize_trace

TRACE_RE = re.compile(r"rank (\d): (.+)")
ATTN_RE = re.compile(r"R = (\d+) \| cu_seqlens (\[[^\]]*\](?: \(\d+ requests\))?) \| positions (.+) \| max_seqlen (\d+) \| "
                     r"grid (\d+) tiles? x (\d+) requests? x (\d+) heads = (\d+) blocks")
RANK_RE = re.compile(r"rank (\d): heads (\d+)-(\d+), sum L_i\^2 = (\d+) cells per head per layer, (\d+) per forward")

# A kernel whose status reads "Idle" but is not yet connected drops a Run All clicked then:

def _expected_tp(total: int, num_requests: int, pattern: str) -> tuple[str, dict]:
    """What the lesson 04 explorer must show, recomputed from the dry run, ``pack`` and ``attention_cells``."""
    lens = l04_tp.packing_lens(total, num_requests, pattern)
    assert sum(lens) == total and len(lens) == num_requests
    cfg = ModelConfig()
    traces = [record_trace(cfg, lens, rank, 2) for rank in (0, 1)]
    assert all(trace_signature(t) == trace_signature(expected_trace(cfg, total, rank, 2)) for rank, t in enumerate(traces))
    trace_text = "\n".join(f"rank {rank}: {summarize_trace(t)}" for rank, t in enumerate(traces))
    trace_text += f"\nsame as 1 request of {total} tokens: yes"
    cells = flops.attention_cells(lens, "varlen").computed
    tiles = math.ceil(max(lens) / l04_tp.TILE)
    return trace_text, {"R": num_requests, "cu": cumulative(lens), "max_seqlen": max(lens), "tiles": tiles,
                        "grid": tiles * num_requests * cfg.heads_per_rank(2), "cells": cells,
                        "per_forward": cells * cfg.heads_per_rank(2) * cfg.n_layers,
                        "positions_restart": pack([[0] * n for n in lens]).positions.tolist().count(0)}


def _parse_attention(text: str) -> dict:
    head = ATTN_RE.search(text)
    ranks = RANK_RE.findall(text)
    assert head and len(ranks) == 2, f"attention readout not in the documented format: {text!r}"
    cells = {int(c) for *_, c, _ in ranks}
    assert len(cells) == 1 and [(int(a), int(b)) for _, a, b, _, _ in ranks] == [(0, 3), (4, 7)]
    shown_cu = head[2]
    tiles, requests, heads, grid = (int(head[i]) for i in (5, 6, 7, 8))
    assert requests == int(head[1]) and tiles * requests * heads == grid, f"the grid does not add up: {head[0]!r}"
    return {"R": int(head[1]), "cu": shown_cu, "max_seqlen": int(head[4]), "tiles": tiles, "grid": grid,
            "cells": cells.pop(),
            "per_forward": int(ranks[0][4]),
            "positions_restart": sum(e.strip() == "0" or e.strip().startswith("0..") for e in head[3].split(","))}


def _check_attention(text: str, want: dict) -> None:
    got = _parse_attention(text)
    assert got["cu"] == l04_tp.short_cu(want["cu"]), (got["cu"], want["cu"])
    for key in ("R", "max_seqlen", "tiles", "grid", "cells", "per_forward"):
        assert got[key] == want[key], (key, got[key], want[key])
    if want["R"] <= 8:  # every run of positions is listed: each starts at 0
        assert got["positions_restart"] == want["positions_restart"]


def test_lesson04_tp_packing_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "04_tp2_invariance.ipynb", "tpx",
        r"""() => /same as 1 request/.test((document.querySelector('.tpx-trace') || {}).innerText || '')
                  && !!document.querySelector('.tpx-figure img')""", "the TP packing explorer")

    pattern = page.locator(".tpx-pattern select").input_value()
    total, r = readout(page, "tpx-tokens"), readout(page, "tpx-num-requests")
    want_trace, want_attn = _expected_tp(total, r, pattern)
    trace = inner_text(page, ".tpx-trace")
    assert trace == want_trace
    _check_attention(inner_text(page, ".tpx-attention"), want_attn)
    src = page.locator(".tpx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for _ in range(MOVES - 1):  # more requests, the same tokens: the trace must not move
        r, src = step_right(page, "tpx", ".tpx-attention", r, src, latencies, text_ms)
        _, want_attn = _expected_tp(total, r, pattern)
        wait_text(page, ".tpx-attention", f"t => t.includes('R = {r} |')")
        _check_attention(inner_text(page, ".tpx-attention"), want_attn)
        assert inner_text(page, ".tpx-trace") == trace, "the TP trace moved although only the packing changed"
    # End on the tokens slider: more tokens, and now the trace changes (only its T)
    ms, new_src = move(page, "tpx-tokens", ".tpx-figure", ".tpx-trace", "End", text_ms)
    latencies.append(ms)
    assert new_src != src
    total = readout(page, "tpx-tokens")
    max_tokens = slider_max(page, "tpx-tokens")
    assert total == max_tokens, f"End on the tokens slider left T={total}, slider max is {max_tokens}"
    want_trace, want_attn = _expected_tp(total, r, pattern)
    wait_text(page, ".tpx-trace", f"t => t === {want_trace!r}")
    assert f"[{total}, 512]" in inner_text(page, ".tpx-trace") and inner_text(page, ".tpx-trace") != trace
    wait_text(page, ".tpx-attention", f"t => t.includes('cu_seqlens {l04_tp.short_cu(want_attn['cu'])}')")
    _check_attention(inner_text(page, ".tpx-attention"), want_attn)
    trace, src = inner_text(page, ".tpx-trace"), new_src
    # Home on the requests slider: ONE request of T tokens, longer than a tile: max_seqlen adds tiles to the grid
    ms, new_src = move(page, "tpx-num-requests", ".tpx-figure", ".tpx-attention", "Home", text_ms)
    latencies.append(ms)
    assert new_src != src and readout(page, "tpx-num-requests") == 1
    _, want_attn = _expected_tp(total, 1, pattern)
    assert want_attn["tiles"] > 1, f"T = {total} does not exceed one tile of {l04_tp.TILE}"
    wait_text(page, ".tpx-attention", "t => t.includes('R = 1 |')")
    _check_attention(inner_text(page, ".tpx-attention"), want_attn)
    assert inner_text(page, ".tpx-trace") == trace, "the TP trace moved although only the packing changed"

    finish(page, widget, "04", latencies, text_ms, console_errors, t_start, capsys)
