"""Lesson 07's kernel explorer in the browser: its counters equal a direct run of the kernel.
"""
from __future__ import annotations

import re

from widget_driver import finish, inner_text, move, open_explorer, readout, wait_text

from lessons_lib.course import l07_kernel
from lessons_lib.ops import tiling

K7_RE = re.compile(r"(programs|early_exits|tiles|tiles_skipped|cells): measured (\d+|not run) \| predicted (\d+) \| picture (\d+)")

def _k7_numbers(page) -> dict:
    text = inner_text(page, ".k7x-counts")
    found = {f: (m, int(p), int(pic)) for f, m, p, pic in K7_RE.findall(text)}
    assert set(found) == {"programs", "early_exits", "tiles", "tiles_skipped", "cells"}, f"counts not in format: {text!r}"
    return found


def _k7_expected(lengths: str, block_m: int, block_n: int, causal: bool, bug: str = l07_kernel.NO_BUG
                 ) -> tuple[dict, str]:
    """The explorer's numbers recomputed here: the kernel run directly (same seed, same bug), the tiling predictor."""
    state = l07_kernel.kernel_state(lengths, block_m, block_n, causal, bug)
    want = {}
    for f in ("programs", "early_exits", "tiles", "tiles_skipped", "cells"):
        predicted = getattr(tiling.predict_work(state["seq_lens"], state["seq_lens_k"], block_m=block_m, block_n=block_n,
                                                causal=causal), f)
        measured = str(getattr(state["measured"], f)) if state["ran"] else "not run"
        want[f] = (measured, predicted, int(measured) if state["ran"] else predicted)  # drawn from the measured
    error = f"max |out - fp64 reference| = {state['error']:.2e}" if state["ran"] else "kernel not run"
    return want, error


def _k7_check(page, lengths: str, block_m: int, block_n: int, causal: bool, bug: str = l07_kernel.NO_BUG) -> None:
    want, error = _k7_expected(lengths, block_m, block_n, causal, bug)
    wait_text(page, ".k7x-counts", f"t => t.includes('programs: measured {want['programs'][0]} | predicted "
                                     f"{want['programs'][1]} |') && t.includes('cells: measured {want['cells'][0]} |') "
                                     f"&& t.includes('tiles: measured {want['tiles'][0]} |')")
    assert _k7_numbers(page) == want
    assert error in inner_text(page, ".k7x-status")


def test_lesson07_kernel_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "07_inside_the_kernel.ipynb", "k7x",
        r"""() => /programs: measured/.test((document.querySelector('.k7x-counts') || {}).innerText || '')
                  && !!document.querySelector('.k7x-figure img')""", "the kernel explorer")

    lengths = page.locator(".k7x-lengths input").input_value()
    causal = page.locator(".k7x-causal input").is_checked()
    block_m, block_n = readout(page, "k7x-block-m"), readout(page, "k7x-block-n")
    _k7_check(page, lengths, block_m, block_n, causal)
    first = _k7_numbers(page)
    src = page.locator(".k7x-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for slider in ("k7x-block-m", "k7x-block-m", "k7x-block-n"):  # 16 -> 32 -> 64 rows, then 16 -> 32 keys
        ms, new_src = move(page, slider, ".k7x-figure", ".k7x-counts", "ArrowRight", text_ms)
        latencies.append(ms)
        assert new_src != src, "the launch picture was not redrawn"
        src = new_src
        block_m, block_n = readout(page, "k7x-block-m"), readout(page, "k7x-block-n")
        _k7_check(page, lengths, block_m, block_n, causal)
    assert (block_m, block_n) == (64, 32)
    assert _k7_numbers(page) != first, "new tile sizes, the same numbers"

    # Type new lengths: the numbers follow the input (a long + short mix, so some programs return at once)
    box = page.locator(".k7x-lengths input")
    box.fill("100, 5, 20")
    box.press("Enter")
    _k7_check(page, "100, 5, 20", block_m, block_n, causal)
    assert int(_k7_numbers(page)["early_exits"][1]) > 0

    # Pick a bug: the kernel runs with one line changed and its tiles leave the prediction
    page.locator(".k7x-bug select").select_option(label="kernel_no_early_return")
    _k7_check(page, "100, 5, 20", block_m, block_n, causal, "kernel_no_early_return")
    tiles = _k7_numbers(page)["tiles"]
    if tiles[0] != "not run":
        assert int(tiles[0]) > tiles[1], f"no early return, yet the kernel's tiles equal the prediction: {tiles}"
        assert "with the bug 'kernel_no_early_return'" in inner_text(page, ".k7x-status")

    # A chunk after cached keys (L_q:L_k), the real kernel: the counters follow the key lengths too
    page.locator(".k7x-bug select").select_option(label=l07_kernel.NO_BUG)
    box.fill("30:80, 5")
    box.press("Enter")
    _k7_check(page, "30:80, 5", block_m, block_n, causal)
    assert "OUTSIDE" not in inner_text(page, ".k7x-status")

    finish(page, widget, "07", latencies, text_ms, console_errors, t_start, capsys)
