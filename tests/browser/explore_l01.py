"""Lesson 01's flat-batch explorer in the browser: what it shows equals a direct call of the library for the
lengths typed and the padding chosen, and follows every change.
"""
from __future__ import annotations

import re

from widget_driver import ARM_PROBE_JS, UPDATE_TIMEOUT_MS, finish, inner_text, open_explorer, wait_text

from lessons_lib.core.batch import pack
from lessons_lib.course import l01_flat_batch
from lessons_lib.measure import flops

ROWS_RE = re.compile(r"rows through every linear layer \(recorded\): padded (\d+) \| flat (\d+) \| pad rows computed (\d+)")
VERDICT_RE = re.compile(r"every request equals itself alone: flat (yes|NO) \| padded (yes|NO)")
DIFFERS_RE = re.compile(r"differ from themselves alone \(outlined in the figure\): padded (.+) \| flat (.+)")


def _expected(lengths: str, pad_to: str, side: str) -> dict:
    """The explorer's readouts for these inputs, from a direct call of the library (it runs the model)."""
    lens = [int(x) for x in lengths.replace(",", " ").split()]
    state = l01_flat_batch.flat_run_state(lens, None if pad_to == "longest" else int(pad_to), side)
    # Independent of the module's bookkeeping: pack itself, and what measure.flops predicts
    batch = pack(l01_flat_batch.request_ids(lens))
    assert state["flat"]["cu_seqlens"] == batch.cu_seqlens.tolist() and state["flat"]["positions"] == batch.positions.tolist()
    s = max(lens) if pad_to == "longest" else int(pad_to)
    assert state["rows"] == {"padded": len(lens) * s, "flat": flops.executed_tokens(lens, "varlen")}
    cfg = l01_flat_batch.EXPLORER_CONFIG  # the FLOPs the recorder saw, against measure.flops' prediction
    for key, want in (("flat", flops.forward_flops(cfg, lens)), ("padded", flops.forward_flops(cfg, [s] * len(lens)))):
        assert state["flops"][key] == {"linear": want.linear, "attention": want.attention}, key
    text = l01_flat_batch.flat_run_text(state)
    return {"flat": text["flat"], "counts": text["padded"], "verdict": VERDICT_RE.search(text["alone"]).group(0),
            "differs": DIFFERS_RE.search(text["alone"]).group(0), "differs_idx": state["differs"], "s": s,
            "marks": re.findall(r"(=|DIFFERS) \|", text["alone"]), "rows": state["rows"], "pad_rows": state["pad_rows"]}


def _check(page, want: dict) -> None:
    wait_text(page, ".fbx-flat", f"t => t === {want['flat']!r}")
    assert inner_text(page, ".fbx-counts") == want["counts"]
    alone = inner_text(page, ".fbx-alone")
    assert VERDICT_RE.search(alone).group(0) == want["verdict"]
    assert re.findall(r"(=|DIFFERS) \|", alone) == want["marks"]  # per request: flat, padded (the diffs' last bits vary)
    assert DIFFERS_RE.search(alone).group(0) == want["differs"]  # the requests the figure outlines
    assert f"at S = {6 * l01_flat_batch.EXPLORER_CONFIG.d_model} (whole blocks, 6 d)" in inner_text(page, ".fbx-counts")
    assert f"S + L > 6 d = {6 * l01_flat_batch.EXPLORER_CONFIG.d_model}: here " in inner_text(page, ".fbx-counts")
    got = ROWS_RE.search(inner_text(page, ".fbx-counts"))
    assert got and [int(x) for x in got.groups()] == [want["rows"]["padded"], want["rows"]["flat"], want["pad_rows"]]


def _timed(page, act, latencies: list, text_ms: list, src: str) -> str:
    """Run ``act`` (typing + Enter, or a key on a dropdown); record key -> new figure on screen; return its src."""
    page.evaluate(ARM_PROBE_JS, [".fbx-figure", ".fbx-flat"])
    act()
    page.wait_for_function("() => window.__probe.t1 !== null", timeout=UPDATE_TIMEOUT_MS)
    probe = page.evaluate("() => window.__probe")
    latencies.append(probe["t1"] - probe["t0"])
    if probe["tText"] is not None:
        text_ms.append(probe["tText"] - probe["t0"])
    assert probe["src"] != src, "the figure was not redrawn"
    return probe["src"]


def _new_src(page, src: str) -> str:
    """Wait for the figure to be redrawn (a dropdown's change: no key press to time)."""
    page.wait_for_function(f"""() => {{ const img = document.querySelector('.fbx-figure img');
        return !!img && img.src !== {src!r}; }}""", timeout=UPDATE_TIMEOUT_MS)
    return page.locator(".fbx-figure img").first.get_attribute("src")


def test_lesson01_flat_batch_explorer(lab_server, browser_context, capsys):
    page, widget, console_errors, t_start = open_explorer(
        browser_context, lab_server, "01_flat_batch.ipynb", "fbx",
        r"""() => /every request equals itself alone/.test((document.querySelector('.fbx-alone') || {}).innerText || '')
                  && !!document.querySelector('.fbx-figure img')""", "the flat-batch explorer")

    box, pad_to, side = page.locator(".fbx-lengths input"), page.locator(".fbx-pad-to select"), page.locator(".fbx-side select")
    lengths = box.input_value()
    want = _expected(lengths, pad_to.input_value(), side.input_value())
    _check(page, want)
    src = page.locator(".fbx-figure img").first.get_attribute("src")

    latencies, text_ms = [], []
    for lengths in ("5, 7, 20", "3, 50, 7, 7", "20, 20, 20", "10, 30"):  # typed lengths: everything follows
        def type_lengths(text=lengths):
            box.fill(text)
            box.press("Enter")
        src = _timed(page, type_lengths, latencies, text_ms, src)
        now = _expected(lengths, pad_to.input_value(), side.input_value())
        assert now["flat"] != want["flat"], "new lengths, the same flat batch"
        _check(page, now)
        want = now

    # Pad further (pad to 32): more pad rows recorded, the flat side unchanged
    pad_to.select_option("32")
    wait_text(page, ".fbx-counts", "t => t.includes('[2 x 32]')")
    src = _new_src(page, src)
    now = _expected(lengths, "32", side.input_value())
    _check(page, now)
    assert now["pad_rows"] > want["pad_rows"] and now["rows"]["flat"] == want["rows"]["flat"]

    # Left padding: forward_padded's positions 0..S-1 make the short request's padded output wrong, the flat one right
    side.select_option("left")
    wait_text(page, ".fbx-counts", "t => t.includes('(left padding)')")
    src = _new_src(page, src)
    left = _expected(lengths, "32", "left")
    _check(page, left)
    assert left["verdict"] == "every request equals itself alone: flat yes | padded NO"
    # the outlined requests are those with a pad slot in front (shorter than the padded length): both of 10, 30 at 32
    lens = [int(x) for x in lengths.replace(",", " ").split()]
    assert left["differs_idx"] == {"padded": [i for i, n in enumerate(lens) if n < left["s"]], "flat": []}
    assert left["differs"].endswith("padded A, B | flat none")

    # Bad input: the error is shown, not stale numbers
    box.fill("10, 0")
    box.press("Enter")
    wait_text(page, ".fbx-counts", "t => t.includes('every request needs 1..')")
    assert "fbx-error" in (page.locator(".fbx-counts").get_attribute("class") or "")

    finish(page, widget, "01", latencies, text_ms, console_errors, t_start, capsys)
