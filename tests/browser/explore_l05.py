"""Lesson 05's roofline explorer in the browser: its lines equal ``course.l05_flops.roofline_state``
(``measure.flops.forward_flops`` / ``forward_bytes`` / ``roofline_seconds``) for the knobs on screen.
"""
from __future__ import annotations

import re

import torch
from widget_driver import MOVES, finish, inner_text, move, open_explorer, readout, wait_text

from lessons_lib.course import l05_flops
from lessons_lib.measure import flops
from lessons_lib.measure.machines import H200, Machine

LINE_RE = re.compile(r"(.+?): linear ([\d.]+ [kMGT]?)FLOP ([\d.]+ [kMGT]?)B ([\d.]+) FLOP/B (compute|memory)-bound "
                     r"([\d.e+-]+) ms \| attention ([\d.]+ [kMGT]?)FLOP ([\d.]+ [kMGT]?)B ([\d.]+) FLOP/B "
                     r"(compute|memory)-bound ([\d.e+-]+) ms \| predicted ([\d.e+-]+) ms \| launch floor ([\d.e+-]+) ms "
                     r"\(\d+ kernels at least\): (launch latency|the roofline) binds first")


def _lines(page) -> list[str]:
    lines = [x.strip() for x in inner_text(page, ".frx-table").splitlines() if x.strip()]
    assert len(lines) == 3 and all(LINE_RE.fullmatch(x) for x in lines), f"roofline lines not in the format: {lines}"
    return lines


def _knobs(page) -> dict:
    sel = lambda cls: page.locator(f".{cls} select")
    return {"d_model": int(sel("frx-dmodel").locator("option:checked").inner_text()),
            "d_ffn": int(page.locator(".frx-dffn input").input_value()),
            "n_heads": int(sel("frx-heads").locator("option:checked").inner_text()),
            "n_kv_heads": int(sel("frx-kvheads").locator("option:checked").inner_text()),
            "n_layers": readout(page, "frx-layers"),
            "nbytes": 2 if "bf16" in sel("frx-bytes").locator("option:checked").inner_text() else 4,
            "total": readout(page, "frx-tokens"), "requests": readout(page, "frx-requests"),
            "lengths": page.locator(".frx-lengths input").input_value()}


def _expected(knobs: dict, machine=H200) -> tuple[list[str], dict]:
    """A direct call of the library for the knobs read off the page; the FLOPs cross-checked against
    measure.flops alone."""
    state = l05_flops.roofline_state(machine=machine, **knobs)
    for row in state["rows"]:
        f = flops.forward_flops(state["cfg"], row["seq_lens"], causal=True, n_kv_heads=knobs["n_kv_heads"])
        assert (row["linear"].flops, row["attention"].flops) == (f.linear, f.attention)
    return l05_flops.roofline_lines(state), state


def test_lesson05_roofline_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "05_flop_regimes.ipynb", "frx",
        r"""() => /predicted/.test((document.querySelector('.frx-table') || {}).innerText || '')
                  && !!document.querySelector('.frx-figure img')""", "the roofline explorer")

    assert "H200" in page.locator(".frx-machine select option:checked").inner_text()
    want, state = _expected(_knobs(page))
    assert _lines(page) == want
    assert inner_text(page, ".frx-machine-line") == l05_flops.machine_line(state)
    assert re.search(r"[\d.]+ ms measured, [\d.]+ ms predicted", inner_text(page, ".frx-measured"))
    src = page.locator(".frx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for key in ["ArrowRight"] * MOVES:            # tokens T up by 100 each: numbers and figure follow
        ms, new_src = move(page, "frx-tokens", ".frx-figure", ".frx-table", key, text_ms)
        latencies.append(ms)
        assert new_src != src, "the roofline figure was not redrawn"
        src = new_src
        knobs = _knobs(page)
        want, _ = _expected(knobs)
        wait_text(page, ".frx-table", f"t => t.startsWith('1 x {knobs['total']}:')")
        assert _lines(page) == want

    # Grouped-query attention: 1 K/V head. Attention FLOPs stay, its bytes and the linear FLOPs drop.
    before = [LINE_RE.fullmatch(x) for x in _lines(page)]
    page.locator(".frx-kvheads select").select_option(label="1")
    knobs = _knobs(page)
    assert knobs["n_kv_heads"] == 1
    want, _ = _expected(knobs)
    wait_text(page, ".frx-table", f"t => t.split('\\n')[0] === {want[0]!r}")
    after = [LINE_RE.fullmatch(x) for x in _lines(page)]
    assert _lines(page) == want
    assert all(a[7] == b[7] and a[8] != b[8] and a[2] != b[2] for a, b in zip(after, before)), (after, before)

    # Typed lengths (Enter commits the text).
    page.locator(".frx-lengths input").fill("3000, 40")
    page.locator(".frx-lengths input").press("Enter")
    wait_text(page, ".frx-table", "t => t.includes('typed 3000, 40:')")
    assert _lines(page) == _expected(_knobs(page))[0]
    wait_text(page, ".frx-measured", "t => t.includes('not timed')")   # 3,040 tokens: past the timed forward's bound

    # This CPU, measured: FLOPs and bytes do not depend on the machine; its ridge is what its line says.
    page.locator(".frx-machine select").select_option(index=0)
    wait_text(page, ".frx-machine-line", "t => t.startsWith('this CPU')")
    m = re.fullmatch(r"(this CPU.*?): peak ([\d.]+) GFLOP/s, bandwidth ([\d.]+) GB/s, ridge ([\d.]+) FLOP/byte",
                     inner_text(page, ".frx-machine-line"))
    assert m, inner_text(page, ".frx-machine-line")
    cpu = Machine(m[1], float(m[2]) * 1e9, float(m[3]) * 1e9, dtype=torch.float32)
    want, _ = _expected(_knobs(page), cpu)
    got = [LINE_RE.fullmatch(x) for x in _lines(page)]
    for g, w in zip(got, (LINE_RE.fullmatch(x) for x in want)):
        machine_free = (1, 2, 3, 4, 7, 8, 9)         # label, FLOPs, bytes, intensity of both parts
        assert [g[i] for i in machine_free] == [w[i] for i in machine_free], (g[0], w[0])

    assert _knobs(page)["nbytes"] == 4, "the measured CPU's peak is fp32: the dtype follows the machine"

    # The engine timed on the typed lengths: its roofline time is the library's for those lengths on this CPU.
    page.locator(".frx-lengths input").fill("300, 40")
    page.locator(".frx-lengths input").press("Enter")
    wait_text(page, ".frx-measured", "t => t.includes('lengths 300, 40 (')", timeout=20_000)
    mm = re.search(r"([\d.]+) ms measured, ([\d.]+) ms predicted", inner_text(page, ".frx-measured"))
    assert mm and float(mm[1]) > 0, inner_text(page, ".frx-measured")
    knobs = _knobs(page)                               # the forward ran the model the knobs describe
    cfg = l05_flops.model_of(knobs["d_model"], knobs["d_ffn"], knobs["n_heads"], knobs["n_kv_heads"], knobs["n_layers"])
    fw = {"cfg": cfg, "seq_lens": [300, 40], "seconds": float(mm[1]) / 1e3, "ops": 1,
          "flops": flops.forward_flops(cfg, [300, 40])}
    direct = l05_flops.roofline_state(machine=cpu, here={"machine": cpu, "forward": fw})["measured"]["predicted"]
    assert abs(float(mm[2]) - direct * 1e3) <= 1e-3 + 0.01 * direct * 1e3, (mm[2], direct)

    finish(page, widget, "05", latencies, text_ms, console_errors, t_start, capsys)
