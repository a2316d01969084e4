"""Lesson 04's TP packing explorer in the browser: each rank's partial sums follow the packing and differ
between the ranks, the recorded all-reduce trace does not move; tp = 4 shows four ranks of two heads, and
a broken cut (the plain column cut of QKV) turns the sum line to NO while the trace stays.
"""
from __future__ import annotations

import re

import torch
from widget_driver import MOVES, finish, inner_text, move, open_explorer, readout, slider_max, step_right, wait_text

from lessons_lib.core.batch import cumulative
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.course import l04_tp
from lessons_lib.course.trace_figures import short_cu
from lessons_lib.measure import flops
from lessons_lib.tp.dryrun import expected_trace, record_trace, trace_signature
from lessons_lib.tp.trace import summarize_trace

CFG = ModelConfig(vocab_size=1000, max_position=2048)  # the explorer's model: the article's, a small vocabulary
ATTN_RE = re.compile(r"R = (\d+) \| cu_seqlens (\[[^\]]*\](?: \(\d+ requests\))?) \| positions (.+) \| max_seqlen (\d+)")
RANK_RE = re.compile(r"rank (\d): heads (\d+)-(\d+) \| sum L_i\^2 = (\d+) cells per head per layer \(whole blocks; "
                     r"the causal mask keeps (\d+)\), (\d+) per forward \| "
                     r"out proj partial, token (\d+): norm ([\d.]+) \[([^\]]*), \.\.\.\]")
SUM_RE = re.compile(r"rank 0(?: \+ rank \d)*, (?:bias once|bias on every rank) = TP=1 out proj, all (\d+) tokens: "
                    r"max \|sum - float64\| = (\S+), allowed (\S+): (yes|NO)")
_STAND_INS: dict = {}


def _partials(lens: list[int], rank: int, tp: int = 2, cut: str = l04_tp.ENGINE_CUT) -> torch.Tensor:
    """Rank ``rank``'s layer-0 out-proj partial sums for the explorer's batch, on a LocalGroup stand-in
    (not the explorer's threads): layer 0's input is replicated, so a stand-in sends what a real rank sends."""
    key = (rank, tp, cut)
    if key not in _STAND_INS:
        w = _STAND_INS.setdefault("weights", init_weights(CFG, seed=0))
        with l04_tp.cut_faults(cut):  # the naive cut is built with the fault on; the bias cut is added below
            _STAND_INS[key] = Transformer(CFG, w, group=LocalGroup(rank, tp))
    model = _STAND_INS[key]
    sent = l04_tp.out_proj_partials(model, l04_tp.explorer_batch(CFG, lens))
    return sent + model.layers[0].attn.out_proj.bias if cut == l04_tp.BIAS_CUT else sent


def _expected(total: int, num_requests: int, pattern: str, tp: int = 2, cut: str = l04_tp.ENGINE_CUT
              ) -> tuple[str, dict]:
    """What the explorer must show, recomputed from the dry run, ``attention_cells`` and stand-in ranks."""
    lens = l04_tp.packing_lens(total, num_requests, pattern)
    assert sum(lens) == total and len(lens) == num_requests
    traces = [record_trace(CFG, lens, rank, tp) for rank in range(tp)]
    assert all(trace_signature(t) == trace_signature(expected_trace(CFG, total, rank, tp)) for rank, t in enumerate(traces))
    trace_text = "\n".join(f"rank {rank}: {summarize_trace(t)}" for rank, t in enumerate(traces))
    trace_text += f"\nsame as 1 request of {total} tokens: yes"
    cells = flops.attention_cells(lens, "varlen").computed
    kept = sum(n * (n + 1) // 2 for n in lens)                  # the causal triangles, diagonals included
    partials = [_partials(lens, rank, tp, cut)[total - 1] for rank in range(tp)]
    return trace_text, {"R": num_requests, "cu": cumulative(lens), "max_seqlen": max(lens), "cells": cells, "kept": kept, "tp": tp,
                        "ok": "yes" if cut == l04_tp.ENGINE_CUT else "NO",
                        "per_forward": cells * CFG.heads_per_rank(tp) * CFG.n_layers, "token": total - 1,
                        "partials": [p[:l04_tp.SHOWN] for p in partials], "norms": [float(p.norm()) for p in partials]}


def _check(page, want: dict) -> list[list[float]]:
    """The attention line and the per-rank lines equal the direct computation; returns the shown partials."""
    head = ATTN_RE.search(inner_text(page, ".tpx-attention"))
    assert head, f"attention readout not in the documented format: {inner_text(page, '.tpx-attention')!r}"
    assert int(head[1]) == want["R"] and head[2] == short_cu(want["cu"]) and int(head[4]) == want["max_seqlen"]
    text = inner_text(page, ".tpx-ranks")
    ranks = RANK_RE.findall(text)
    tp, hl = want["tp"], 8 // want["tp"]
    assert len(ranks) == tp, f"per-rank readout not in the documented format: {text!r}"
    shown = []
    for rank, (r, a, b, cells, kept, per_forward, token, norm, numbers) in enumerate(ranks):
        assert (int(r), int(a), int(b)) == (rank, hl * rank, hl * rank + hl - 1)
        assert (int(cells), int(kept), int(per_forward), int(token)) == (want["cells"], want["kept"],
                                                                         want["per_forward"], want["token"])
        values = [float(v) for v in numbers.split(", ")]
        assert torch.allclose(torch.tensor(values), want["partials"][rank], atol=6e-5), (values, want["partials"][rank])
        assert abs(float(norm) - want["norms"][rank]) < 6e-5
        shown.append(values)
    assert tp == 1 or shown[0] != shown[1], "both ranks show the same partial sums"
    total = SUM_RE.search(text)
    assert total and int(total[1]) == want["token"] + 1 and total[4] == want["ok"], text
    assert (float(total[2]) <= float(total[3])) == (want["ok"] == "yes"), text
    return shown


def test_lesson04_tp_packing_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "04_tp2_invariance.ipynb", "tpx",
        r"""() => /same as 1 request/.test((document.querySelector('.tpx-trace') || {}).innerText || '')
                  && /allowed/.test((document.querySelector('.tpx-ranks') || {}).innerText || '')
                  && !!document.querySelector('.tpx-figure img')""", "the TP packing explorer")

    pattern = page.locator(".tpx-pattern select").input_value()
    total, r = readout(page, "tpx-tokens"), readout(page, "tpx-num-requests")
    want_trace, want = _expected(total, r, pattern)
    trace = inner_text(page, ".tpx-trace")
    assert trace == want_trace
    seen = [_check(page, want)]
    src = page.locator(".tpx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for _ in range(MOVES - 1):  # more requests, the same tokens: the partial sums move, the trace must not
        r, src = step_right(page, "tpx", ".tpx-ranks", r, src, latencies, text_ms)
        _, want = _expected(total, r, pattern)
        wait_text(page, ".tpx-attention", f"t => t.includes('R = {r} |')")
        seen.append(_check(page, want))
        assert inner_text(page, ".tpx-trace") == trace, "the TP trace moved although only the packing changed"
    assert len({tuple(s[0]) for s in seen}) > 1, "rank 0's partial sums never changed with the packing"
    # End on the tokens slider: more tokens, and now the trace changes (only its T)
    ms, new_src = move(page, "tpx-tokens", ".tpx-figure", ".tpx-trace", "End", text_ms)
    latencies.append(ms)
    assert new_src != src
    total = readout(page, "tpx-tokens")
    assert total == slider_max(page, "tpx-tokens") == l04_tp.MAX_TOKENS
    want_trace, want = _expected(total, r, pattern)
    wait_text(page, ".tpx-trace", f"t => t === {want_trace!r}")
    assert f"[{total}, 512]" in inner_text(page, ".tpx-trace") and inner_text(page, ".tpx-trace") != trace
    wait_text(page, ".tpx-ranks", f"t => t.includes('token {total - 1}:')")
    _check(page, want)
    trace, src = inner_text(page, ".tpx-trace"), new_src
    # Home on the requests slider: ONE request of T tokens; the trace stays
    ms, new_src = move(page, "tpx-num-requests", ".tpx-figure", ".tpx-ranks", "Home", text_ms)
    latencies.append(ms)
    assert new_src != src and readout(page, "tpx-num-requests") == 1
    _, want = _expected(total, 1, pattern)
    wait_text(page, ".tpx-attention", "t => t.includes('R = 1 |')")
    _check(page, want)
    assert inner_text(page, ".tpx-trace") == trace, "the TP trace moved although only the packing changed"
    # tp = 4: four ranks of two heads each, their own partial sums, still the same sum
    r = 3
    move(page, "tpx-num-requests", ".tpx-figure", ".tpx-ranks", "ArrowRight", text_ms)
    move(page, "tpx-num-requests", ".tpx-figure", ".tpx-ranks", "ArrowRight", text_ms)
    wait_text(page, ".tpx-attention", f"t => t.includes('R = {r} |')")
    page.locator(".tpx-tp select").select_option("4")
    wait_text(page, ".tpx-ranks", "t => t.includes('rank 3: heads 6-7')")
    want_trace, want = _expected(total, r, pattern, tp=4)
    wait_text(page, ".tpx-trace", f"t => t === {want_trace!r}")
    four = _check(page, want)
    # a broken cut: the plain column cut of QKV; the trace stays, the sum line says NO
    page.locator(".tpx-cut select").select_option(label=l04_tp.NAIVE_CUT)
    wait_text(page, ".tpx-ranks", "t => t.endsWith('NO') || t.includes(': NO')")
    _, want = _expected(total, r, pattern, tp=4, cut=l04_tp.NAIVE_CUT)
    assert inner_text(page, ".tpx-trace") == want_trace, "the trace moved although only the cut changed"
    assert _check(page, want) != four, "the naive cut shows the same partial sums"

    finish(page, widget, "04", latencies, text_ms, console_errors, t_start, capsys)
