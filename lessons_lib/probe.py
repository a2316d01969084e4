"""Who reads whom: find out by experiment which input rows an operation lets each output row see.

``row_dependency(fn, x)`` perturbs one input row at a time and records which output rows
change at all (bit-level comparison). Rows of a flat batch that an operation keeps apart
come out bit-identical, because their arithmetic is the same instruction for instruction:
same shapes, same kernels, untouched inputs.

- a per-token stack (LayerNorm, a linear layer, GeLU, residual) gives the identity: each
  output row reads only its own input row (claims C4, C5);
- plain attention over the flat rows gives a full (or causal) square: A reads B (C7);
- varlen attention gives the block diagonal of ``cu_seqlens`` (C10).

Taught in notebooks/02_linear_is_per_token.ipynb and notebooks/03_masked_vs_varlen_attention.ipynb.
"""
from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor


@torch.no_grad()
def row_dependency(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Bool ``[T_out, T_in]``: True where output row i changes when input row j is perturbed.

    fn: maps ``[T, ...]`` to ``[T_out, ...]`` (row-major: row = token).
    x: ``[T, ...]`` float input; the perturbation added to row j is a ramp from -1 to 1, not
    a constant, because LayerNorm ignores a constant shift of a row.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor [T, ...], got {type(x).__name__ if not isinstance(x, torch.Tensor) else (x.dtype, tuple(x.shape))}")
    base = fn(x)
    if not isinstance(base, torch.Tensor) or base.dim() < 1:
        raise ValueError("fn must return a tensor [T_out, ...]")
    t_in, t_out = x.shape[0], base.shape[0]
    bump = torch.linspace(-1.0, 1.0, x[0].numel(), dtype=x.dtype, device=x.device).view(x.shape[1:])
    dep = torch.zeros(t_out, t_in, dtype=torch.bool)
    for j in range(t_in):
        xj = x.clone()
        xj[j] += bump
        out = fn(xj)
        dep[:, j] = (out != base).reshape(t_out, -1).any(dim=1).cpu()
    return dep
