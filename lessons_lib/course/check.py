"""Claim cells: a small table of named checks, then one ``✓`` line, or an error with the numbers.

A claim cell builds its checks as rows ``(check, value, expected)`` and calls
``claim(id, text, rows)``. The table shows what is proved; a row whose value differs from its
expected value makes the cell fail with an AssertionError that names the claim and the row:

    check                         value    expected
    ✓ computed cells per head      1600    1600
    ✓ wasted                        600    600
    ✓ C8 masked: computed 1600, useful 1000, wasted 600

``expected`` may be a value (compared with ``==``) or a ``Bound`` such as ``at_most(x)``.
``close`` compares two float computations by the one tolerance rule of ``measure.tolerance``.

Record mode: with the environment variable ``LESSONS_CLAIMS_RECORD=<path.jsonl>``, ``claim`` appends
one JSON line per row (``claim``, ``row``, ``value``, ``expected``, ``ok``, ``faults``: the names of
``lessons_lib.faults`` on in this process) and prints a failed claim instead of raising, so that a
notebook runs to its end (``tools/claims_coverage.py``).

Used by every lesson in notebooks/ and by the tests.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import faults
from ..measure.tolerance import max_abs_diff, tolerance

__all__ = ["RECORD_ENV", "Bound", "at_least", "at_most", "claim", "close", "max_abs_diff", "check_rows"]

RECORD_ENV = "LESSONS_CLAIMS_RECORD"


@dataclass(frozen=True)
class Bound:
    """An expected value that is a condition: ``holds(value)`` and how to print it."""

    text: str
    holds: Callable[[object], bool]

    def __str__(self) -> str:
        return self.text


def at_most(limit, unit: str = "") -> Bound:
    return Bound(f"≤ {_fmt(limit)}{unit}", lambda v: v <= limit)


def at_least(limit, unit: str = "") -> Bound:
    return Bound(f"≥ {_fmt(limit)}{unit}", lambda v: v >= limit)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-3 or abs(v) >= 1e6 else f"{v:,.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _ok(value, expected) -> bool:
    return expected.holds(value) if isinstance(expected, Bound) else value == expected


def check_rows(rows) -> list[tuple[str, object, object, bool]]:
    """``[(check, value, expected, ok), ...]`` for rows ``(check, value, expected)``."""
    return [(name, value, expected, bool(_ok(value, expected))) for name, value, expected in rows]


def _plain(v):
    """``v`` as JSON can hold it: numbers, strings, bools and None as they are, a one-element tensor as its number,
    anything else (a ``Bound``, a tuple, a shape) as the text the table prints."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    return v if v is None or isinstance(v, (bool, int, float, str)) else _fmt(v)


def _record(path: str, claim_id: str, checked) -> None:
    on = list(faults.active())
    with open(path, "a", encoding="utf-8") as f:
        for n, v, e, ok in checked:
            f.write(json.dumps({"claim": claim_id, "row": n, "value": _plain(v), "expected": _plain(e), "ok": ok,
                                "faults": on}, ensure_ascii=False) + "\n")


def claim(claim_id: str, text: str, rows) -> None:
    """Print the checks as a table and ``✓ <id> <text>``; raise AssertionError on the first failed row
    (in record mode, see the module doc: append the rows to the record and print the failure instead)."""
    checked = check_rows(rows)
    width = max([len("check")] + [len(n) for n, *_ in checked])
    lines = [f"  {'check':<{width}}  {'value':>14}  expected"]
    lines += [f"{'✓' if ok else '✗'} {n:<{width}}  {_fmt(v):>14}  {_fmt(e)}" for n, v, e, ok in checked]
    failed = [(n, v, e) for n, v, e, ok in checked if not ok]
    record = os.environ.get(RECORD_ENV)
    if record:
        _record(record, claim_id, checked)
    if failed:
        n, v, e = failed[0]
        message = (f"✗ {claim_id} FAILED: {text}\n  check {n!r}: got {_fmt(v)}, expected {_fmt(e)}\n"
                   + "\n".join(lines))
        if not record:
            raise AssertionError(message)
        print(message)
        return
    print("\n".join(lines))
    print(f"✓ {claim_id} {text}")


def close(out: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor) -> tuple[float, float]:
    """``out`` against the float64 truth ``ref64``, allowed twice the error of the trusted ``ref`` plus rounding
    (``measure.tolerance``). Returns ``(error, bound)`` without judging: a claim row ``(what, error,
    at_most(bound))`` does, so a broken engine shows its row ✗ instead of stopping the cell first."""
    return max_abs_diff(out, ref64), tolerance(ref, ref64, out.dtype)
