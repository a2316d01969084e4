"""Claim cells (course/check.py) and the one tolerance rule (measure/tolerance.py)."""
import pytest
import torch

from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.course.check import at_least, at_most, claim, close
from lessons_lib.measure.tolerance import max_abs_diff, tolerance


def test_claim_prints_the_table_and_one_tick_line(capsys):
    claim("C8", "masked: computed 1600", [("computed cells", 40 * 40, 1600), ("wasted", 600, at_least(1))])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["check", "value", "expected"]
    assert out[1].split() == ["✓", "computed", "cells", "1,600", "1,600"]
    assert out[2].split() == ["✓", "wasted", "600", "≥", "1"]
    assert out[-1] == "✓ C8 masked: computed 1600"


def test_claim_failure_names_the_claim_the_row_and_the_numbers():
    with pytest.raises(AssertionError) as err:
        claim("C8", "masked: computed 1600", [("computed", 1599, 1600), ("useful", 1000, 1000)])
    msg = str(err.value)
    assert "✗ C8 FAILED: masked: computed 1600" in msg and "check 'computed': got 1,599, expected 1,600" in msg
    assert "✓ useful" in msg and "✗ computed" in msg  # the whole table comes with the error


def test_bounds_hold_and_fail():
    claim("X", "bounds", [("small", 1e-7, at_most(2e-7)), ("big", 3, at_least(3))])
    with pytest.raises(AssertionError, match="expected ≤ 1e-07"):
        claim("X", "bounds", [("small", 2e-7, at_most(1e-7))])


def test_tolerance_is_twice_the_trusted_error_plus_rounding():
    ref64 = torch.tensor([1.0, -3.0], dtype=torch.float64)
    ref = torch.tensor([1.0 + 1e-6, -3.0])
    eps = torch.finfo(torch.float32).eps
    err = (ref.double() - ref64).abs().max().item()  # 1e-6 rounded to fp32
    assert err > 0 and tolerance(ref, ref64) == pytest.approx(2 * err + 2 * eps * 3.0, rel=1e-9)
    assert tolerance(ref.bfloat16(), ref64, torch.bfloat16) > 100 * tolerance(ref, ref64)  # dtype-aware


def test_close_uses_the_rule_on_a_real_model():
    """Flat batch vs float64: allowed twice the error of one request at a time, in fp32 and bf16."""
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=300, max_position=64)
    w = init_weights(cfg)
    reqs = [torch.arange(n) for n in (10, 30)]
    ref64 = Transformer(cfg, w, dtype=torch.float64)(pack(reqs))
    for dtype in (torch.float32, torch.bfloat16):
        model = Transformer(cfg, w, dtype=dtype)
        flat, alone = model(pack(reqs)), torch.cat(model.forward_each(reqs))
        err, bound = close(flat, alone, ref64)
        assert err <= bound, dtype
    broken = flat.clone()
    broken[3] += 0.5  # one row off by far more than bf16 rounding
    err, bound = close(broken, alone, ref64)
    assert err > bound
    assert max_abs_diff(broken, flat) == pytest.approx(0.5, abs=0.01)
