"""widgets: the pure state functions, and the callbacks driven headlessly by setting widget values."""
from __future__ import annotations

import base64
import re
import statistics

import ipywidgets as w
import pytest

from lessons_lib import ModelConfig
from lessons_lib.course import widgets
from lessons_lib.measure.flops import attention_cells, forward_flops

LINE = re.compile(r"(padded|masked|varlen): computed (\d+) \| useful (\d+) \| wasted (\d+)")


def by_class(box) -> dict:
    """Every descendant widget by its CSS classes (what a browser test selects on)."""
    found = {}

    def walk(node):
        for child in getattr(node, "children", ()):
            for cls in child._dom_classes:
                found[cls] = child
            walk(child)
    walk(box)
    return found


def png_of(out: w.Output) -> bytes:
    (msg,) = out.outputs
    assert msg["output_type"] == "display_data"
    data = base64.b64decode(msg["data"]["image/png"])
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return data


# --- lesson 03: diagonal-block explorer -----------------------------------------------------

def test_explorer_seq_lens_ramp_equal_and_article_case():
    assert widgets.explorer_seq_lens(2, 10, "ramp") == [10, 30]
    assert widgets.explorer_seq_lens(1, 7, "ramp") == [7]
    r, n = 5, 9
    assert widgets.explorer_seq_lens(r, n, "ramp") == [round(n * (1 + 2 * i / (r - 1))) for i in range(r)]
    assert widgets.explorer_seq_lens(4, 6, "equal") == [6, 6, 6, 6]


def test_explorer_seq_lens_long_tail_is_deterministic_positive_and_centred():
    a = widgets.explorer_seq_lens(15, 40, "long-tail")
    assert a == widgets.explorer_seq_lens(15, 40, "long-tail")
    assert len(a) == 15 and min(a) >= 1
    assert 30 <= statistics.median(a) <= 50
    assert max(a) > 3 * 40  # a long tail, not a ramp
    assert min(widgets.explorer_seq_lens(16, 1, "long-tail")) == 1
    assert widgets.explorer_seq_lens(1, 12, "long-tail") == [12]


@pytest.mark.parametrize("args, match", [((0, 10, "ramp"), "num_requests"), ((2, 0, "ramp"), "length"),
                                         ((2, 10, "zipf"), "pattern"), ((2.0, 10, "ramp"), "num_requests")])
def test_explorer_seq_lens_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        widgets.explorer_seq_lens(*args)


@pytest.mark.parametrize("r, n, pattern", [(2, 10, "ramp"), (7, 13, "long-tail"), (16, 64, "equal")])
def test_c8_diagonal_block_state_counts_are_attention_cells(r, n, pattern):
    state = widgets.diagonal_block_state(r, n, pattern)
    assert state["seq_lens"] == widgets.explorer_seq_lens(r, n, pattern)
    assert set(state["counts"]) == {"padded", "masked", "varlen"}
    for method, cells in state["counts"].items():
        assert cells == attention_cells(state["seq_lens"], method)


def test_c8_diagonal_block_explorer_contract_and_callbacks():
    box = widgets.diagonal_block_explorer()
    assert isinstance(box, w.VBox) and "dbx" in box._dom_classes
    k = by_class(box)
    reqs, base, pat, counts, out = k["dbx-num-requests"], k["dbx-length"], k["dbx-pattern"], k["dbx-counts"], k["dbx-figure"]
    assert isinstance(reqs, w.IntSlider) and (reqs.min, reqs.max, reqs.value, reqs.description) == (1, 16, 2, "requests R")
    assert isinstance(base, w.IntSlider) and (base.min, base.max, base.value, base.description) == (1, 64, 10, "base length L")
    assert isinstance(pat, w.Dropdown) and list(pat.options) == ["ramp", "equal", "long-tail"] and pat.value == "ramp"
    assert isinstance(counts, w.HTML) and isinstance(out, w.Output)
    assert LINE.findall(counts.value) == [("padded", "1800", "1000", "800"), ("masked", "1600", "1000", "600"),
                                          ("varlen", "1000", "1000", "0")]
    assert counts.value.count("<div>") == 3
    first = png_of(out)

    for r, n, p in [(5, 20, "ramp"), (9, 33, "long-tail"), (16, 64, "equal"), (1, 1, "ramp")]:
        reqs.value, base.value, pat.value = r, n, p
        state = widgets.diagonal_block_state(r, n, p)
        lines = LINE.findall(counts.value)
        assert [m for m, *_ in lines] == ["padded", "masked", "varlen"]
        for method, computed, useful, wasted in lines:
            c = state["counts"][method]
            assert (int(computed), int(useful), int(wasted)) == (c.computed, c.useful, c.wasted)
        assert png_of(out) != first  # redrawn
    assert "T = 1 " in k["dbx-lengths"].value


# --- lesson 05: FLOP-regime explorer -----------------------------------------------------------

def test_c14_flop_regime_state_is_forward_flops():
    state = widgets.flop_regime_state(10, 100)
    assert state["seq_lens"] == [100] * 10
    assert state["flops"] == forward_flops(ModelConfig(), [100] * 10, "varlen")
    with pytest.raises(ValueError, match="length"):
        widgets.flop_regime_state(1, 0)


def test_c14_flop_regime_explorer_contract_and_callbacks():
    box = widgets.flop_regime_explorer()
    assert "frx" in box._dom_classes
    k = by_class(box)
    reqs, base, text, out = k["frx-num-requests"], k["frx-length"], k["frx-flops"], k["frx-figure"]
    assert (reqs.min, reqs.max, reqs.value) == (1, 64, 10) and (base.min, base.max, base.value) == (1, 4096, 100)
    first = png_of(out)
    for r, n in [(10, 100), (1, 4096), (64, 1), (3, 3072)]:
        reqs.value, base.value = r, n
        f = forward_flops(ModelConfig(), [n] * r, "varlen")
        dominant = "attention" if f.attention > f.linear else "linear"
        assert text.value == f"linear {f.linear} | attention {f.attention} | dominant {dominant}"
        if (r, n) in ((1, 4096), (64, 1)):  # one long request vs many one-token requests
            assert dominant == ("attention" if n == 4096 else "linear")
    assert png_of(out) != first


# --- lesson 01: flat-batch explorer ------------------------------------------------------------

def test_parse_lengths_accepts_commas_and_spaces_and_names_bad_values():
    assert widgets.parse_lengths("10, 30") == [10, 30]
    assert widgets.parse_lengths(" 3 4,5 ") == [3, 4, 5]
    for bad, match in [("", "empty"), ("10, x", "'x'"), ("0", "1..4096"), ("5000", "1..4096"), (",".join(["1"] * 65), "at most 64")]:
        with pytest.raises(ValueError, match=match):
            widgets.parse_lengths(bad)


def test_c2_c3_flat_batch_state_numbers():
    s = widgets.flat_batch_state([10, 30])
    assert (s["padded_rows"], s["flat_rows"], s["pad_rows"]) == (60, 40, 20)
    assert s["cu_seqlens"] == [0, 10, 40] and s["row_ratio"] == pytest.approx(1.5)
    assert s["attention"]["padded"].computed == 1800 and s["attention"]["varlen"].computed == 1000


def test_c2_flat_batch_explorer_updates_and_reports_bad_input():
    box = widgets.flat_batch_explorer()
    k = by_class(box)
    text, counts, out = k["fbx-lengths"], k["fbx-counts"], k["fbx-figure"]
    assert "padded: 60 rows | flat: 40 rows | pad rows: 20" in counts.value
    first = png_of(out)
    text.value = "5, 7, 20"
    s = widgets.flat_batch_state([5, 7, 20])
    assert f"padded: {s['padded_rows']} rows | flat: {s['flat_rows']} rows | pad rows: {s['pad_rows']}" in counts.value
    assert png_of(out) != first
    text.value = "5, seven"
    assert "fbx-error" in counts._dom_classes and "'seven' is not a whole number" in counts.value
    text.value = "8"
    assert "fbx-error" not in counts._dom_classes and "pad rows: 0" in counts.value
