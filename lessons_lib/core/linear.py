"""Tensor-parallel linear layers (vLLM / nano-vllm names), cut from one full weight.

Every layer keeps the PyTorch layout ``weight: [out_features, in_features]``, ``y = x @ W^T + b``.
The shards of rank r are cut from the full ("master") weight with ``load_full_``, so TP=1
and TP=2 compute the same function. A linear layer maps each row on its own: it never sees
which request a row belongs to (claim C5).

Taught in notebooks/02_linear_is_per_token.ipynb.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .groups import LocalGroup

Tensor = torch.Tensor


class ColumnParallelLinear(nn.Module):
    """Split the OUTPUT features: ``W = [W_0; W_1; ...]`` (rows), ``Y_r = X W_r^T + b_r``.

    ``[T, in] → [T, out / tp]`` on every rank; no communication (the next row-parallel layer
    consumes the shard).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group = group if group is not None else LocalGroup()
        tp = self.group.world_size
        if out_features % tp:
            raise ValueError(f"out_features={out_features} is not divisible by tp_size={tp}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features // tp, dtype=dtype), requires_grad=False) if bias else None

    def shard_rows(self, full: Tensor) -> Tensor:
        """The rows of a full ``[out, ...]`` tensor that this rank owns."""
        n = self.out_features // self.group.world_size
        return full[self.group.rank * n:(self.group.rank + 1) * n]

    @torch.no_grad()
    def load_full_(self, weight: Tensor, bias: Tensor | None = None) -> ColumnParallelLinear:
        """Copy this rank's rows of the full ``weight [out, in]`` and ``bias [out]`` (any device, cast)."""
        _expect(weight, (self.out_features, self.in_features), "weight")
        self.weight.copy_(self.shard_rows(weight))
        if self.bias is not None:
            _expect(bias, (self.out_features,), "bias")
            self.bias.copy_(self.shard_rows(bias))
        return self

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, in]`` (the weight's dtype and device) → ``[T, out/tp]``, this rank's output features."""
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused Q, K, V projection, sharded by HEAD: rank r owns heads ``[r·H/tp, (r+1)·H/tp)``
    of Q, of K and of V.

    Full weight rows are ``[Q heads 0..H-1 | K heads | V heads]`` (``[3·H·D, d_model]``).
    Per rank: ``[T, d_model] → [T, 3·(H/tp)·D]``, e.g. ``[T, 512] → [T, 768]`` under TP=2 (C6),
    laid out ``[q_local | k_local | v_local]``.
    """

    def __init__(self, d_model: int, n_heads: int, d_head: int, bias: bool = True, *, group=None,
                 dtype: torch.dtype = torch.float32):
        group = group if group is not None else LocalGroup()
        if n_heads % group.world_size:
            raise ValueError(f"n_heads={n_heads} is not divisible by tp_size={group.world_size}")
        self.n_heads, self.d_head = n_heads, d_head
        self.n_local_heads = n_heads // group.world_size
        super().__init__(d_model, 3 * n_heads * d_head, bias, group=group, dtype=dtype)

    def shard_rows(self, full: Tensor) -> Tensor:
        # Cut the same head range out of each of Q, K and V, then stack them.
        per_rank = self.n_local_heads * self.d_head
        r = self.group.rank
        return torch.cat([part[r * per_rank:(r + 1) * per_rank] for part in full.chunk(3)])

    def split(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[T, 3·H_local·D]`` → q, k, v each ``[T, H_local, D]`` (flash-attn layout)."""
        t = qkv.shape[0]
        q, k, v = qkv.view(t, 3, self.n_local_heads, self.d_head).unbind(1)
        return q, k, v


class RowParallelLinear(nn.Module):
    """Split the INPUT features: ``W = [W_0 | W_1 | ...]`` (columns), ``Y = Σ_r X_r W_r^T + b``.

    Rank r holds ``X_r: [T, in / tp]`` and computes a partial ``[T, out]``; one all-reduce sums
    the partials, then the bias is added ONCE (adding it before the reduce would add it tp times).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 dtype: torch.dtype = torch.float32, name: str = ""):
        super().__init__()
        self.group = group if group is not None else LocalGroup()
        tp = self.group.world_size
        if in_features % tp:
            raise ValueError(f"in_features={in_features} is not divisible by tp_size={tp}")
        self.in_features, self.out_features, self.name = in_features, out_features, name
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    @torch.no_grad()
    def load_full_(self, weight: Tensor, bias: Tensor | None = None) -> RowParallelLinear:
        """Copy this rank's columns of the full ``weight [out, in]``, and the whole ``bias [out]``."""
        _expect(weight, (self.out_features, self.in_features), "weight")
        n = self.in_features // self.group.world_size
        self.weight.copy_(weight[:, self.group.rank * n:(self.group.rank + 1) * n])
        if self.bias is not None:
            _expect(bias, (self.out_features,), "bias")
            self.bias.copy_(bias)
        return self

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, in/tp]`` (this rank's input features) → ``[T, out]``, the same on every rank."""
        partial = F.linear(x, self.weight)  # [T, in/tp] -> [T, out], a partial sum on each rank
        y = self.group.all_reduce(partial, layer=self.name)  # [T, out], summed over ranks
        return y if self.bias is None else y + self.bias


def _expect(t: Tensor | None, shape: tuple, what: str) -> None:
    if t is None or tuple(t.shape) != shape:
        raise ValueError(f"full {what} must have shape {shape}, got {None if t is None else tuple(t.shape)}")
