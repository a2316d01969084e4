"""How the exercises are checked: run the reader's function on several cases, compare each with
the library's own answer, and explain a wrong one.

A lesson's checker (``check_*`` in ``course/lNN_*.py``) calls ``grade(name, fn, cases, judge)``:
``judge(got, *case)`` returns None when the answer is right, else what is wrong (with a hint
where a typical mistake is recognised). Two modes:

- a learner's check (the default): prints ``✓`` when every case is right, prints "not attempted
  yet" while the function still raises ``NotImplementedError`` (the stub a lesson hands out), and
  raises ``WrongAnswer`` at the first wrong case, with the input, the answer and the hint;
- a grader's score (``score(check, fn, points)``, used by the classroom release's grade cells):
  every case runs, the points are the share of right cases, the first explanation is printed,
  and the points are returned as the cell's value (nbgrader reads it as partial credit).

The expected answers come from ``lessons_lib`` itself, and the cases include inputs other than
the lesson's A=10, B=30, so that a hard-coded answer fails.
"""
from __future__ import annotations

import contextvars
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.config import ModelConfig
from ..validate import dtype_name

Tensor = torch.Tensor
NOT_YET = object()


class WrongAnswer(AssertionError):
    """The reader's function gave a wrong answer (the message says which input and why)."""


@dataclass
class Tally:
    """What ``score`` counts: right cases, all cases, and the first explanation."""

    right: int = 0
    total: int = 0
    messages: list = field(default_factory=list)


_SCORING: contextvars.ContextVar[Tally | None] = contextvars.ContextVar("scoring", default=None)


def call_reader(name: str, fn: Callable, *args) -> Any:
    """Run the reader's function; a stub's NotImplementedError becomes the NOT_YET marker."""
    if not callable(fn):
        raise WrongAnswer(f"{name}: expected a function, got {type(fn).__name__}")
    try:
        return fn(*args)
    except NotImplementedError:
        return NOT_YET
    except Exception as exc:
        raise WrongAnswer(f"{name}: your function raised {type(exc).__name__}: {exc}\n  input: {describe_args(args)}") \
            from exc


def describe_args(args) -> str:
    """The inputs of a case, short enough to read: big tensors as their shape, lists of them abbreviated."""
    def one(a):
        if isinstance(a, Tensor):
            return f"tensor{list(a.shape)}" if a.numel() > 8 else f"tensor({a.tolist()})"
        if isinstance(a, ModelConfig):
            return (f"ModelConfig(n_layers={a.n_layers}, d_model={a.d_model}, n_heads={a.n_heads}, d_head={a.d_head}, "
                    f"d_ffn={a.d_ffn}, vocab_size={a.vocab_size}, max_position={a.max_position}, "
                    f"dtype={dtype_name(a.dtype)})")
        if isinstance(a, (list, tuple)) and any(isinstance(x, Tensor) for x in a):
            inner = ", ".join(one(x) for x in a[:4]) + (", ..." if len(a) > 4 else "")
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        text = repr(a)
        return text if len(text) <= 200 else text[:200] + " ..."
    return ", ".join(one(a) for a in args)


def _not_attempted(name: str) -> None:
    print(f"… {name}: not attempted yet - replace `raise NotImplementedError` with your code, then run the cell again")


def grade(name: str, fn: Callable, cases: list[tuple], judge: Callable[..., str | None], done: str) -> bool:
    """Call ``fn(*case)`` for each case; ``judge(got, *case)`` returns None or what is wrong."""
    tally = _SCORING.get()
    for case in cases:
        try:
            got = call_reader(name, fn, *case)
            problem = None if got is NOT_YET else judge(got, *case)
        except WrongAnswer as exc:  # the reader's function raised: say what it raised
            got, problem = None, str(exc).removeprefix(f"{name}: ").split("\n  input:")[0]
        if got is NOT_YET:
            _not_attempted(name)
            if tally is not None:
                tally.total += len(cases)
                tally.messages.append(f"{name}: not attempted")
            return False
        if tally is not None:
            tally.total += 1
            tally.right += problem is None
            if problem:
                tally.messages.append(f"{name}: wrong answer for input {describe_args(case)}\n  {problem}")
        elif problem:
            raise WrongAnswer(f"{name}: wrong answer for input {describe_args(case)}\n  {problem}")
    if tally is not None and tally.right < tally.total:
        return False
    print(f"✓ {name}: {done}")
    return True


def score(check: Callable[[Callable], bool], fn: Callable, points: float) -> float:
    """Points earned by ``fn`` under the checker ``check``: ``points × right cases / all cases``.

    Prints one line with the points and the first explanation of a wrong case, and returns the
    points (a grade cell's value: nbgrader takes a number as partial credit). A further test a
    checker makes after its cases (e.g. "each row read only itself") counts as one more case.
    """
    tally = Tally()
    token = _SCORING.set(tally)
    try:
        with warnings.catch_warnings():  # a grade cell's stderr would score 0: a warning is not a wrong answer
            warnings.simplefilter("ignore")
            check(fn)
    except WrongAnswer as exc:
        tally.total += 1
        tally.messages.append(str(exc))
    finally:
        _SCORING.reset(token)
    earned = round(points * tally.right / tally.total, 2) if tally.total else 0.0
    print(f"Grade of {getattr(fn, '__name__', 'your function')}: {earned:g} of {points:g} points "
          f"({tally.right} of {tally.total} cases right)")
    if tally.messages:
        print(tally.messages[0])
    return earned


def tensor_problem(got, want: Tensor, atol: float, rtol: float = 0.0) -> str | None:
    """What is wrong with a tensor answer (type, shape, dtype, values), or None."""
    if not isinstance(got, Tensor):
        return f"expected a tensor of shape {list(want.shape)}, got {type(got).__name__}"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if not got.is_floating_point():
        return f"dtype {got.dtype}, expected a floating tensor"
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if not torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol):
        return f"values differ from the reference by up to {diff:.3g} (tolerance {atol:g})"
    return None


def int_tuple(got, names: str):
    """The reader's tuple as ints, or a message when it is not a tuple of len(names.split(", ")) numbers."""
    n = len(names.split(", "))
    if not isinstance(got, (tuple, list)) or len(got) != n or not all(isinstance(v, (int, float)) for v in got):
        return None, f"expected a tuple ({names}), got {got!r}"
    return tuple(int(v) for v in got), None


def matches(got, want: Tensor, atol: float) -> bool:
    """Does a tensor answer equal ``want`` (used to recognise a typical mistake)?"""
    return isinstance(got, Tensor) and tuple(got.shape) == tuple(want.shape) and bool(
        torch.allclose(got.double(), want.double(), atol=atol))
