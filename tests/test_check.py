"""check.claim / check.close: what a lesson's claim cell prints, and how it fails."""
import pytest
import torch

from lessons_lib.course.check import claim, close, max_abs_diff


def test_claim_prints_one_tick_line(capsys):
    claim("C8", "masked: computed 1600", 40 * 40 == 1600, computed=1600)
    assert capsys.readouterr().out == "✓ C8 masked: computed 1600\n"


def test_claim_failure_names_the_claim_and_numbers(capsys):
    with pytest.raises(AssertionError, match=r"C8 FAILED: masked .*computed=1599, expected=1600"):
        claim("C8", "masked", False, computed=1599, expected=1600)
    assert capsys.readouterr().out == ""  # no tick on failure


def test_close_returns_the_measured_difference():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = a + torch.tensor([0.0, 2.0**-18, -(2.0**-17)])  # powers of two: exact in float32 near 1..3
    assert close(a, b, "rows", atol=1e-5) == 2.0**-17


def test_close_failure_reports_diff_and_tolerance():
    a = torch.zeros(3)
    with pytest.raises(AssertionError, match=r"A alone vs flat: max abs diff 1\.000e-03 exceeds atol=1e-05"):
        close(a, a + torch.tensor([0.0, 1e-3, 0.0]), "A alone vs flat", atol=1e-5)


def test_close_rejects_nan_and_shape_mismatch():
    with pytest.raises(AssertionError, match="x: max abs diff nan"):
        close(torch.tensor([float("nan")]), torch.tensor([float("nan")]), "x")
    with pytest.raises(AssertionError, match=r"shape mismatch: \(2,\) vs \(3,\)"):
        close(torch.zeros(2), torch.zeros(3), "shapes")


def test_max_abs_diff_is_computed_in_float64():
    a = torch.tensor([1.0], dtype=torch.float32)
    b = torch.tensor([1.0 + 1e-12], dtype=torch.float64)  # below fp32 resolution, visible in fp64
    assert max_abs_diff(a, b) == pytest.approx(1e-12, rel=1e-3)
    assert max_abs_diff(torch.zeros(0), torch.zeros(0)) == 0.0
