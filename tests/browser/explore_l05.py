"""Lesson 05's FLOP-mix explorer in the browser: its table equals ``measure.flops`` for every T.
"""
from __future__ import annotations

import re

from widget_driver import MOVES, finish, inner_text, move, open_explorer, readout, slider_max, wait_text

from lessons_lib.core.config import ModelConfig
from lessons_lib.course import l05_flops
from lessons_lib.measure import flops

MIX_RE = re.compile(r"(\d+) x (\d+): linear ([\d.]+) GFLOP \| attention ([\d.]+) GFLOP \| ([\d.]+)% attention \| "
                    r"(linear|attention)-dominated")

def _parse_mix(text: str) -> list[tuple]:
    rows = [MIX_RE.fullmatch(line.strip()) for line in text.splitlines() if line.strip()]
    assert rows and all(rows), f"FLOP-mix widget text not in the documented format: {text!r}"
    return [(int(m[1]), int(m[2]), m[3], m[4], m[5], m[6]) for m in rows]


def _expected_mix(total: int, counting: str) -> list[tuple]:
    """Recomputed from measure.flops alone: 1 x T, 10 x T/10, 100 x T/100, GFLOP to 2 decimals."""
    state = l05_flops.flop_mix_state(total, counting)
    out = []
    for r, row in zip((1, 10, 100), state["rows"]):
        lens = [total // r] * r
        assert row["seq_lens"] == lens
        f = flops.forward_flops(ModelConfig(), lens, "varlen", causal=counting == "causal")
        out.append((r, total // r, f"{f.linear / 1e9:.2f}", f"{f.attention / 1e9:.2f}",
                    f"{100 * f.attention_fraction:.1f}", "attention" if f.attention > f.linear else "linear"))
    return out


def test_lesson05_flop_mix_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "05_flop_regimes.ipynb", "frx",
        r"""() => /-dominated/.test((document.querySelector('.frx-table') || {}).innerText || '')
                  && !!document.querySelector('.frx-figure img')""", "the FLOP-mix explorer")

    counting = page.locator(".frx-counting select").input_value()
    total = readout(page, "frx-tokens")
    assert _parse_mix(inner_text(page, ".frx-table")) == _expected_mix(total, counting)
    assert inner_text(page, ".frx-rule").endswith(f"L = {l05_flops.crossover_length(ModelConfig(), counting == 'causal')} "
                                             f"tokens per request ({counting})")
    src = page.locator(".frx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    # Small steps first (100 tokens each), then End (the slider's max), where 1 x T is attention-dominated.
    for key in ["ArrowRight"] * (MOVES - 1) + ["End"]:
        ms, new_src = move(page, "frx-tokens", ".frx-figure", ".frx-table", key, text_ms)
        latencies.append(ms)
        assert new_src != src, "the FLOPs figure was not redrawn"
        src = new_src
        total = readout(page, "frx-tokens")
        want = _expected_mix(total, counting)
        wait_text(page, ".frx-table", f"t => t.startsWith('1 x {total}:')")
        assert _parse_mix(inner_text(page, ".frx-table")) == want
    max_tokens = slider_max(page, "frx-tokens")
    assert total == max_tokens, f"End on the tokens slider left T={total}, slider max is {max_tokens}"
    assert _parse_mix(inner_text(page, ".frx-table"))[0][-1] == "attention", "1 x T_max should be attention-dominated"

    finish(page, widget, "05", latencies, text_ms, console_errors, t_start, capsys)


K7_RE = re.compile(r"(programs|early_exits|tiles|tiles_skipped|cells): measured (\d+|not run) \| predicted (\d+) \| picture (\d+)")
