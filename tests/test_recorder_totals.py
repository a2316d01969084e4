"""OpRecorder.linear_rows and flops_by_kind: what every linear layer ran on, and the FLOPs per kind."""
import pytest
import torch
import torch.nn.functional as F

from lessons_lib.measure.recorder import OpRecorder


def test_linear_rows_and_flops_by_kind_count_each_matmul_by_hand():
    x, w1, w2 = torch.randn(5, 3), torch.randn(4, 3), torch.randn(6, 4)
    q, k = torch.randn(2, 7, 8), torch.randn(2, 9, 8)
    with OpRecorder() as rec:
        F.linear(F.linear(x, w1), w2)
        q @ k.transpose(-1, -2)
    assert rec.linear_rows == 5
    assert rec.flops_by_kind == {"linear": 2 * 5 * 3 * 4 + 2 * 5 * 4 * 6, "attention": 2 * 2 * 7 * 8 * 9}


def test_linear_layers_on_different_row_counts_are_refused_with_the_counts():
    with OpRecorder() as rec:
        F.linear(torch.randn(5, 3), torch.randn(4, 3))
        F.linear(torch.randn(2, 3), torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"\[2, 5\]"):
        _ = rec.linear_rows
