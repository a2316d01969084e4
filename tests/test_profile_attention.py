"""The attention measurements of ``measure.profile`` that lesson 03 runs: ``sweep_attention`` (time and memory as
the number of requests grows), ``record_attention`` (one call as ``OpRecorder`` sees it), ``recorded_cells`` (the
cells it sees each backend compute) and
``attention_calls`` (which of the engine's attention functions a call entered)."""
from __future__ import annotations

import sys

import pytest
import torch

from lessons_lib.core.attention import varlen_attention
from lessons_lib.measure import profile
from lessons_lib.measure.flops import attention_cells


def test_sweep_attention_times_and_measures_every_pair_and_restores_the_threads():
    threads = torch.get_num_threads()
    runs = profile.sweep_attention((1, 4), ("masked", "loop"), length=16, n_heads=2, d_head=8, rounds=2)
    assert torch.get_num_threads() == threads
    assert set(runs) == {"masked", "loop"}
    for r in runs.values():
        assert len(r["ms"]) == len(r["mib"]) == 2 and all(x > 0 for x in r["ms"])
    # masked stores T x T scores per head: 16x the memory for 4x the rows; the loop only its blocks
    assert runs["masked"]["mib"][1] > 8 * runs["masked"]["mib"][0]
    assert runs["loop"]["mib"][1] < runs["masked"]["mib"][1] / 4
    with pytest.raises(ValueError, match="rounds"):
        profile.sweep_attention((1,), ("loop",), rounds=0)


def test_recorded_cells_are_the_engine_counts():
    # counted on the running backends; they agree with flops.attention_cells, an independent prediction
    for lens in ([10, 30], [1, 64], [5, 9, 2], [7], [4] + [1] * 8):
        c = profile.recorded_cells(lens)
        assert c["masked"] - c["loop"] == attention_cells(lens, "masked").wasted
        assert c["padded"] - c["loop"] == attention_cells(lens, "padded").wasted
        assert c["loop"] == sum(n * n for n in lens)
    assert profile.recorded_cells([10, 30], ("loop", "sdpa"), causal=True) == {"loop": 1000, "sdpa": 1000}  # handed


@pytest.mark.parametrize("backend, cells, scores, largest", [
    ("loop", 10 * 10 + 30 * 30, 2, 3 * 30 * 30),     # one request's [H, L, L] at a time
    ("masked", 40 * 40, 1, 3 * 40 * 40),              # the whole [H, T, T]
    ("padded", 2 * 30 * 30, 1, 2 * 3 * 30 * 30),      # [R, H, Lmax, Lmax]
    ("sdpa", 10 * 10 + 30 * 30, 2, None),             # handed to a fused kernel: no softmax outside it
])
def test_record_attention_sees_cells_score_matrices_and_the_largest_softmax_input(backend, cells, scores, largest):
    q, k, v, cu = profile.random_qkv([10, 30], n_heads=3, d_head=8, dtype=torch.float64)
    r = profile.record_attention(q, k, v, cu, backend, causal=True)
    assert (r.cells, r.scores) == (cells, scores)
    assert r.largest_bytes == (None if largest is None else 8 * largest)   # float64: 8 bytes a cell
    assert torch.equal(r.out, varlen_attention(q, k, v, cu, causal=True, backend=backend))


def test_attention_calls_names_the_engine_functions_entered_and_changes_nothing():
    q, k, v, cu = profile.random_qkv([3, 5], 2, 8)
    out, called = profile.attention_calls(lambda: varlen_attention(q, k, v, cu, backend="loop"))
    assert called == ["varlen_attention", "attention_forward", "its 'loop' backend"]
    assert torch.equal(out, varlen_attention(q, k, v, cu, backend="loop"))
    assert profile.attention_calls(lambda: (q @ k.transpose(-1, -2)).softmax(-1))[1] == []
    assert sys.getprofile() is None
