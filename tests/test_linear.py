"""linear.py in one process: shards cut from one full weight recombine to the full layer.

Ranks are simulated by groups that only carry ``rank`` / ``world_size``; the same layers over
a real two-process group are checked in tests/test_tp.py::test_shards_on_a_real_group.
Runs in well under a second.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from lessons_lib.tp.threads import tp_ranks_in_threads


def _full(out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g) * 0.02, torch.randn(out_f, generator=g), torch.randn(40, in_f, generator=g)


def test_C5_tp1_layers_equal_F_linear():
    w, b, x = _full(96, 64)
    ref = F.linear(x, w, b)
    assert torch.equal(ColumnParallelLinear(64, 96).load_full_(w, b)(x), ref)
    w2, b2, _ = _full(64, 96, seed=1)
    h = torch.randn(40, 96)
    assert torch.equal(RowParallelLinear(96, 64).load_full_(w2, b2)(h), F.linear(h, w2, b2))


@pytest.mark.parametrize("tp", [2, 4])
def test_column_shards_concatenate_to_full(tp):
    w, b, x = _full(96, 64)
    shards = [ColumnParallelLinear(64, 96, group=LocalGroup(r, tp)).load_full_(w, b)(x) for r in range(tp)]
    assert all(s.shape == (40, 96 // tp) for s in shards)
    torch.testing.assert_close(torch.cat(shards, dim=1), F.linear(x, w, b), rtol=0, atol=0)


def test_C6_qkv_rank_owns_its_heads_of_q_k_and_v():
    d, heads, dh, tp = 512, 8, 64, 2
    w, b, x = _full(3 * heads * dh, d)
    q, k, v = F.linear(x, w, b).chunk(3, dim=1)  # each [T, 512]: heads 0..7
    for r in range(tp):
        layer = QKVParallelLinear(d, heads, dh, group=LocalGroup(r, tp)).load_full_(w, b)
        y = layer(x)
        assert y.shape == (40, 768), "C6: QKV per rank is [T, 3·4·64] = [T, 768] under TP=2"
        own = slice(r * 4 * dh, (r + 1) * 4 * dh)  # heads [4r, 4r+4)
        torch.testing.assert_close(y, torch.cat([q[:, own], k[:, own], v[:, own]], dim=1), rtol=0, atol=0)
        ql, kl, vl = layer.split(y)
        assert ql.shape == kl.shape == vl.shape == (40, 4, dh)
        torch.testing.assert_close(kl.reshape(40, -1), k[:, own], rtol=0, atol=0)


def test_row_parallel_adds_bias_once_not_tp_times():
    tp, d_in, d_out = 2, 128, 64
    w, b, _ = _full(d_out, d_in)
    h = torch.randn(40, d_in)
    n = d_in // tp
    parts = [h[:, r * n:(r + 1) * n] for r in range(tp)]
    full = F.linear(h, w, b)
    outs = tp_ranks_in_threads(tp, lambda g: RowParallelLinear(d_in, d_out, group=g, name="x").load_full_(w, b)(parts[g.rank]))
    for y, trace in outs:  # ranks as threads: the all-reduce really sums the partials
        torch.testing.assert_close(y, full, rtol=1e-6, atol=1e-6)
        assert [(r.layer, r.shape) for r in trace] == [("x", (40, d_out))]  # one all-reduce of [T, d_out], before the bias
    # The bug avoided: bias added on every rank before the reduce -> (tp - 1) extra biases.
    buggy = sum(F.linear(parts[r], w[:, r * n:(r + 1) * n], b) for r in range(tp))
    torch.testing.assert_close(buggy - full, (tp - 1) * b.expand_as(full), rtol=0, atol=1e-5)
    assert (buggy - full).abs().max() > 0.1  # large enough that any TP=1 vs TP=2 test would catch it


def test_bad_shapes_and_splits_are_named():
    w, b, _ = _full(96, 64)
    with pytest.raises(ValueError, match=r"full weight must have shape \(96, 64\), got \(64, 96\)"):
        ColumnParallelLinear(64, 96).load_full_(w.T, b)
    with pytest.raises(ValueError, match="out_features=96 is not divisible by tp_size=5"):
        ColumnParallelLinear(64, 96, group=LocalGroup(0, 5))
    with pytest.raises(ValueError, match="in_features=96 is not divisible by tp_size=5"):
        RowParallelLinear(96, 64, group=LocalGroup(0, 5))
    with pytest.raises(ValueError, match="n_heads=8 is not divisible by tp_size=3"):
        QKVParallelLinear(512, 8, 64, group=LocalGroup(0, 3))
