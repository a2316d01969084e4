"""course.probe: which output rows an operation lets each input row change (C4, C5, C7, C10)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lessons_lib.core.attention import block_diag_mask, plain_attention, varlen_attention
from lessons_lib.core.batch import seq_lens_to_cu_seqlens
from lessons_lib.course.probe import row_dependency, who_reads_whom


def test_c4_c5_per_row_operations_give_the_identity():
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    # A constant bump would be invisible to LayerNorm; the probe's ramp is not.
    for fn in (lambda t: F.layer_norm(t, (8,)), lambda t: F.gelu(t @ w.T), lambda t: t + 1):
        assert torch.equal(row_dependency(fn, x), torch.eye(12, dtype=torch.bool))


def test_row_dependency_sees_mixing():
    x = torch.randn(6, 3)
    assert torch.equal(row_dependency(lambda t: t.cumsum(0), x), torch.ones(6, 6, dtype=torch.bool).tril())
    assert row_dependency(lambda t: t.sum(0, keepdim=True), x).shape == (1, 6)


def test_c7_c10_attention_dependency_is_the_mask():
    lens = [3, 5, 2]
    cu = seq_lens_to_cu_seqlens(lens)
    x = torch.randn(sum(lens), 12, generator=torch.Generator().manual_seed(2))

    def split(t):
        return t[:, :4].reshape(-1, 1, 4), t[:, 4:8].reshape(-1, 1, 4), t[:, 8:].reshape(-1, 1, 4)

    assert torch.equal(row_dependency(lambda t: varlen_attention(*split(t), cu, backend="loop"), x),
                       block_diag_mask(cu, causal=True))
    assert torch.equal(row_dependency(lambda t: plain_attention(*split(t)), x),
                       torch.ones(10, 10, dtype=torch.bool).tril())


def test_c4_c7_c10_who_reads_whom_maps_of_the_lesson_figure():
    maps = who_reads_whom([10, 30])
    per_token, plain, varlen = maps.values()
    assert (per_token == torch.eye(40, dtype=torch.bool).numpy()).all()
    assert (plain == torch.ones(40, 40, dtype=torch.bool).tril().numpy()).all()
    assert (varlen == block_diag_mask(seq_lens_to_cu_seqlens([10, 30]), causal=True).numpy()).all()


def test_row_dependency_rejects_bad_input():
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        row_dependency(lambda t: t, torch.arange(4))
    with pytest.raises(ValueError, match="fn must return"):
        row_dependency(lambda t: 3.0, torch.randn(2, 2))
