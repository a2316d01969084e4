"""Lesson 00's all-reduce cost explorer in the browser: its readout equals ``comm_cost_state`` for the input shown.

The widget shows the alpha and beta it runs on (the kernel's fit of this machine's all-reduces, three
significant digits, or the NVLink preset); the test reads them off the page and recomputes every other
number with a direct call of ``lessons_lib``, before and after moving the tokens, the requests, the TP size and
the network. Every move runs the engine's forward on the requests shown (``tp.dryrun.record_requests``); its line
must equal a direct call. "measure" times real all-reduces on the notebook's two ranks: the time itself cannot be recomputed,
but the model's time printed beside it must equal ``measure.comm.all_reduce_seconds`` for the payload and network shown.
"""
from __future__ import annotations

import re

from widget_driver import MOVES, finish, inner_text, move, open_explorer, readout, slider_max, wait_text

from lessons_lib.course import l00_setup
from lessons_lib.measure.comm import AlphaBeta, all_reduce_seconds, comm_cost_state
from lessons_lib.tp.dryrun import record_requests

HEAD_RE = re.compile(r"alpha = ([\d.e+-]+) us per step, beta = ([\d.e+-]+) GB/s \((.+)\)")
PROBE_RE = re.compile(r"measured now over (\w+) \(TP=2\): one all-reduce of \[(\d+), (\d+)\] float32 = ([\d,]+) B "
                      r"took ([\d,.]+) us \| the model says ([\d,.]+) us")


def _fit(page) -> AlphaBeta:
    text = inner_text(page, ".abx-text")
    head = HEAD_RE.match(text.splitlines()[0])
    assert head, f"the first readout line is not in the documented format: {text!r}"
    return AlphaBeta(float(f"{head[1]}e-6"), float(f"{head[2]}e9"), head[3])


def _expected(page) -> str:
    """What the readout must say, from the alpha and beta it shows and the controls' values."""
    fit = _fit(page)  # a fit of this machine's two ranks is extrapolated at another TP size, and says so
    state = comm_cost_state(readout(page, "abx-tokens"), fit,
                                      int(page.locator(".abx-d-model select").input_value()),
                                      page.locator(".abx-dtype select").input_value(),
                                      int(page.locator(".abx-layers select").input_value()), readout(page, "abx-requests"),
                                      int(page.locator(".abx-tp select").input_value()),
                                      2 if fit.source.startswith("this machine") else None)
    return l00_setup.comm_cost_text(state)


def _check(page) -> str:
    text = inner_text(page, ".abx-text")
    want = _expected(page)
    assert text == want, f"the readout is not what lessons_lib computes:\n{text}\n!=\n{want}"
    return text


def test_lesson00_comm_cost_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "00_setup_one_request.ipynb", "abx",
        r"""() => /crossover: N\*/.test((document.querySelector('.abx-text') || {}).innerText || '')
                  && !!document.querySelector('.abx-figure img')""", "the all-reduce cost explorer")

    text = _check(page)
    assert "this machine, fitted" in text
    src = page.locator(".abx-figure img").first.get_attribute("src")
    latencies, text_ms = [], []
    for _ in range(MOVES - 2):  # one more token each: new numbers, new figure
        n = readout(page, "abx-tokens")
        ms, new_src = move(page, "abx-tokens", ".abx-figure", ".abx-text", "ArrowRight", text_ms)
        latencies.append(ms)
        assert new_src != src and readout(page, "abx-tokens") == n + 1
        src = new_src
        new_text = _check(page)
        assert new_text != text
        text = new_text
    # Two requests instead of one: the same tokens, twice the all-reduces when each is its own forward.
    ms, src = move(page, "abx-requests", ".abx-figure", ".abx-text", "ArrowRight", text_ms)
    latencies.append(ms)
    text = _check(page)
    assert "as 2 requests" in text and "one forward each 32 all-reduces" in text
    # Every move records the engine's own trace of the requests shown, equal to a direct record_requests.
    wait_text(page, ".abx-recorded", "t => t.startsWith('recorded')", timeout=30_000)
    want = l00_setup.record_text(record_requests(readout(page, "abx-tokens"), readout(page, "abx-requests"),
                                                 int(page.locator(".abx-layers select").input_value()),
                                                 page.locator(".abx-dtype select").input_value(),
                                                 int(page.locator(".abx-tp select").input_value())))
    assert inner_text(page, ".abx-recorded") == want and "the same, record by record" in want
    # Measure at this N on the two real ranks: "running..." then a line whose model time is the library's.
    page.locator(".abx-measure button, button.abx-measure").first.click()
    wait_text(page, ".abx-measured", "t => t.startsWith('measured now')", timeout=10_000)
    probe = PROBE_RE.search(inner_text(page, ".abx-measured"))
    assert probe, inner_text(page, ".abx-measured")
    assert int(probe[2]) == readout(page, "abx-tokens") and int(probe[4].replace(",", "")) == int(probe[2]) * 512 * 4
    model_us = all_reduce_seconds(_fit(page), int(probe[4].replace(",", ""))) * 1e6
    assert probe[6] == f"{model_us:,.1f}", (probe[6], model_us)
    assert float(probe[5].replace(",", "")) > 0
    # TP = 4: the ring has more steps, every number follows.
    before = inner_text(page, ".abx-text")
    page.locator(".abx-tp select").select_option("4")
    wait_text(page, ".abx-text", "t => t.includes('ring, TP=4')")
    text = _check(page)
    assert text != before and "extrapolated: alpha and beta were fitted to a ring of 2 ranks" in text
    # The datasheet-like link: alpha and beta change, every number follows.
    page.locator(".abx-network select").select_option(label="NVLink 4 (datasheet-like)")
    wait_text(page, ".abx-text", "t => t.includes('beta = 450 GB/s')")
    _check(page)
    ms, src = move(page, "abx-tokens", ".abx-figure", ".abx-text", "End", text_ms)
    latencies.append(ms)
    assert readout(page, "abx-tokens") == slider_max(page, "abx-tokens")
    text = _check(page)
    assert "bandwidth-dominated" in text.splitlines()[2], text

    finish(page, widget, "00", latencies, text_ms, console_errors, t_start, capsys)
