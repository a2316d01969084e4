"""The Triton kernel's online softmax (``triton_varlen``), replayed for one query row in PyTorch, tile by tile.

``online_softmax(scores, values, block_n)`` walks the keys ``block_n`` at a time with the kernel's running max
``m``, running sum ``l`` and accumulator ``acc`` (rescaled by ``α = exp(m − m')`` when the max grows) and reports,
after every key tile, how far ``acc / l`` is from the exact softmax over the keys seen so far. ``rescale=False``
replays the kernel's fault ``kernel_sum_not_rescaled``. Natural base here (the kernel's base 2 gives the same numbers).

Taught in notebooks/07_inside_the_kernel.ipynb (K5).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..measure.tolerance import max_abs_diff
from ..validate import check_int


@dataclass(frozen=True)
class SoftmaxStep:
    """After key tile ``tile``: the running max ``m``, sum ``l_sum``, and how far ``acc / l`` is from the exact
    softmax-weighted sum over the keys seen so far."""

    tile: int
    keys_seen: int
    m: float
    l_sum: float
    max_grew: bool
    error: float


def online_softmax(scores: torch.Tensor, values: torch.Tensor, block_n: int, rescale: bool = True
                   ) -> tuple[torch.Tensor, list[SoftmaxStep]]:
    """One query row's ``softmax(scores) @ values`` the kernel's way, ``block_n`` keys at a time. ``scores [n]``,
    ``values [n, d]``, computed in their dtype. Returns the output ``[d]`` and one ``SoftmaxStep`` per key tile
    (errors against a float64 softmax of the keys seen so far)."""
    check_int("block_n", block_n, 1)
    if scores.dim() != 1 or values.dim() != 2 or values.shape[0] != scores.shape[0]:
        raise ValueError(f"online_softmax: scores [n] and values [n, d], got {tuple(scores.shape)} and "
                         f"{tuple(values.shape)}")
    m = torch.tensor(float("-inf"), dtype=scores.dtype)
    l_sum = torch.zeros((), dtype=scores.dtype)
    acc = torch.zeros(values.shape[1], dtype=scores.dtype)
    steps = []
    for t, start in enumerate(range(0, scores.shape[0], block_n)):
        s, v = scores[start:start + block_n], values[start:start + block_n]
        m_new = torch.maximum(m, s.max())
        p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
        l_sum = (l_sum * alpha if rescale else l_sum) + p.sum()
        acc = acc * alpha + p @ v
        grew, m = bool(m_new > m) and t > 0, m_new
        seen = min(scores.shape[0], start + block_n)
        exact = torch.softmax(scores[:seen].double(), 0) @ values[:seen].double()
        steps.append(SoftmaxStep(t, seen, float(m), float(l_sum), grew, max_abs_diff(acc / l_sum, exact)))
    return acc / l_sum, steps


def max_growths(scores: torch.Tensor, block_n: int) -> list[int]:
    """Per query row of ``scores [n_q, n_k]``: in how many key tiles after the first its running max grows."""
    check_int("block_n", block_n, 1)
    tile_max = torch.stack([scores[:, s:s + block_n].max(1).values for s in range(0, scores.shape[1], block_n)], 1)
    return (tile_max[:, 1:] > torch.cummax(tile_max, 1).values[:, :-1]).sum(1).tolist()
