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

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..core.attention import plain_attention, varlen_attention
from ..core.batch import seq_lens_to_cu_seqlens

Tensor = torch.Tensor


@torch.no_grad()
def row_dependency(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Bool ``[T_out, T_in]``: True where output row i changes when input row j is perturbed.

    fn: maps ``[T, ...]`` to ``[T_out, ...]`` (row-major: row = token).
    x: ``[T, ...]`` float input; the perturbation added to row j is a ramp from -1 to 1, not
    a constant, because LayerNorm ignores a constant shift of a row.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a floating tensor [T, ...], got {got}")
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


def who_reads_whom(seq_lens: Sequence[int], d_model: int = 64, n_heads: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Three measured dependency maps (bool ``[T, T]``) for one flat batch, built from plain torch ops
    and the attention functions with small random weights, not from the engine's ``Block`` (the
    lesson's figure and explorer use ``l02_linear.module_reach_state`` on the engine's modules;
    ``tests/test_probe.py`` uses this one to test the probe on its own):

    - "LN + FFN + residual (per token)": LayerNorm → FFN-up → GeLU → FFN-down → residual add;
    - "plain causal attention on flat rows": attention over all T rows as one sequence (C7);
    - "varlen causal attention": the same q, k, v through ``varlen_attention`` with ``cu_seqlens`` (C10).

    Small random weights (fixed seed); the maps are bools, so they do not depend on rounding.
    """
    g = torch.Generator().manual_seed(seed)
    d, h = d_model, n_heads
    cu = seq_lens_to_cu_seqlens(seq_lens)
    x = torch.randn(int(cu[-1]), d, generator=g)
    w_up, w_down = torch.randn(4 * d, d, generator=g) / 8, torch.randn(d, 4 * d, generator=g) / 16
    w_qkv = torch.randn(3 * d, d, generator=g) / 8

    def per_token(t):
        return t + F.gelu(F.layer_norm(t, (d,)) @ w_up.T, approximate="tanh") @ w_down.T

    def qkv(t):  # [T, d] -> q, k, v each [T, H, d/H]
        return (F.layer_norm(t, (d,)) @ w_qkv.T).view(t.shape[0], 3, h, d // h).unbind(1)

    return {"LN + FFN + residual (per token)": row_dependency(per_token, x).numpy(),
            "plain causal attention on flat rows": row_dependency(lambda t: plain_attention(*qkv(t)), x).numpy(),
            "varlen causal attention": row_dependency(lambda t: varlen_attention(*qkv(t), cu, backend="loop"), x).numpy()}
