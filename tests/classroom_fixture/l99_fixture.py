"""The checkers of the classroom fixture (tests/classroom_fixture/99_fixture.ipynb): a fake lesson
with two exercises, so that tests/test_classroom.py can build, release and grade without
depending on the real lessons' content. Written like a lesson's module, with
``lessons_lib.course.grading.grade``: each judge recognises one typical mistake and says why.
"""
from __future__ import annotations

import torch

from lessons_lib.course.grading import grade, tensor_problem


def check_total(fn) -> bool:
    """Exercise 99.1: ``fn(xs) -> int``, the sum of a list of ints."""
    cases = [([1, 2, 3],), ([],), ([5],), ([-1, 4, 10],)]

    def judge(got, xs):
        want = sum(xs)
        if got == want:
            return None
        hint = ""
        if xs and got == sum(xs[:-1]):
            hint = " - the last element is missing: range(len(xs) - 1) stops one too early"
        elif xs and got == sum(xs[1:]):
            hint = " - the first element is missing: start at index 0"
        return f"got {got!r}, expected {want}{hint}"

    return grade("total", fn, cases, judge, "the sum of 4 lists, the empty one included")


def check_causal_mask(fn) -> bool:
    """Exercise 99.2: ``fn(n) -> bool [n, n]``, True where query row i may read key row j (j <= i)."""
    cases = [(1,), (2,), (4,), (7,)]

    def judge(got, n):
        want = torch.ones(n, n, dtype=torch.bool).tril()
        if isinstance(got, torch.Tensor) and got.dtype == torch.bool and got.shape == want.shape:
            if torch.equal(got, want):
                return None
            if torch.equal(got, want.T):
                return "the mask is transposed: row i is the query, it may read keys j <= i (tril, not triu)"
            if torch.equal(got, want.tril(diagonal=-1)):
                return "a query must read itself: keep the diagonal (tril(diagonal=0))"
            return "wrong cells: True where j <= i, False elsewhere"
        problem = tensor_problem(got, want.float(), atol=0) if not isinstance(got, torch.Tensor) else None
        return problem or f"expected a bool tensor of shape [{n}, {n}], got {getattr(got, 'dtype', type(got).__name__)}"

    return grade("causal_mask", fn, cases, judge, "the causal mask for n = 1, 2, 4, 7")
