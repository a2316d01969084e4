"""Claim cells: one ``✓`` line when a claim holds, an AssertionError with the numbers when not.

Used by every lesson in notebooks/ and by the tests.
"""
from __future__ import annotations

import torch


def _fmt(numbers: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in numbers.items())


def claim(claim_id: str, text: str, ok: bool, **numbers) -> None:
    """Print ``✓ <id> <text>`` if ``ok``; otherwise raise AssertionError naming the claim and numbers."""
    if not ok:
        raise AssertionError(f"✗ {claim_id} FAILED: {text}" + (f" ({_fmt(numbers)})" if numbers else ""))
    print(f"✓ {claim_id} {text}")


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 0.0) -> float:
    """Assert ``|a - b| <= atol + rtol * |b|`` elementwise; return the max abs difference.

    The error message names ``what`` and gives the max abs difference and the tolerance,
    so a learner sees how far off a broken engine is.
    """
    diff = max_abs_diff(a, b)
    if not torch.allclose(a.detach().double(), b.detach().double(), atol=atol, rtol=rtol, equal_nan=False):
        raise AssertionError(f"{what}: max abs diff {diff:.3e} exceeds atol={atol:g}, rtol={rtol:g}")
    return diff
