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

from ..validate import check_kv_heads_split, check_n_kv_heads
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
        self.in_features, self.out_features = in_features, out_features
        n = self.output_size_per_partition
        self.weight = nn.Parameter(torch.empty(n, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False) if bias else None

    @property
    def output_size_per_partition(self) -> int:  # vLLM's name: this rank's output features
        if self.out_features % self.group.world_size:
            raise ValueError(f"out_features={self.out_features} is not divisible by tp_size={self.group.world_size}")
        return self.out_features // self.group.world_size

    def shard_rows(self, full: Tensor) -> Tensor:
        """The rows of a full ``[out, ...]`` tensor that this rank owns."""
        n = self.output_size_per_partition
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
    """The fused Q, K, V projection, sharded by HEAD (vLLM's), with ``n_kv_heads`` K/V heads (default ``n_heads``).

    Full weight rows are ``[Q heads 0..H-1 | K heads 0..H_kv-1 | V heads]`` (``[(H + 2·H_kv)·D, d_model]``).
    Rank r owns query heads ``[r·H/tp, (r+1)·H/tp)`` and ``n_local_kv_heads = H_kv/tp`` K/V heads, or when
    ``tp > H_kv`` ONE, head ``r // num_kv_head_replicas`` (replicated on ``tp / H_kv`` ranks): its queries'.
    Per rank: ``[T, d_model] → [T, (H_local + 2·H_kv_local)·D]``, e.g. ``[T, 512] → [T, 768]`` under TP=2 (C6).
    """

    def __init__(self, d_model: int, n_heads: int, d_head: int, n_kv_heads: int | None = None, bias: bool = True, *,
                 group=None, dtype: torch.dtype = torch.float32):
        tp = (group if group is not None else LocalGroup()).world_size
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, check_n_kv_heads("n_kv_heads", n_kv_heads, n_heads), d_head
        check_kv_heads_split(self.n_kv_heads, tp, n_heads=n_heads)
        self.n_local_heads, self.n_local_kv_heads = n_heads // tp, max(self.n_kv_heads // tp, 1)
        self.num_kv_head_replicas = max(tp // self.n_kv_heads, 1)   # ranks holding each K/V head
        self.local_sizes = [self.n_local_heads * d_head] + [self.n_local_kv_heads * d_head] * 2  # q, k, v widths
        super().__init__(d_model, (n_heads + 2 * self.n_kv_heads) * d_head, bias, group=group, dtype=dtype)

    @property
    def output_size_per_partition(self) -> int:  # more than out_features / tp when K/V heads are replicated
        return sum(self.local_sizes)

    def shard_rows(self, full: Tensor) -> Tensor:
        # This rank's query heads of Q, its K/V heads (vLLM's kv shard_id, shared by replicas) of K and of V.
        (r, s), (nq, nkv, _) = (self.group.rank, self.group.rank // self.num_kv_head_replicas), self.local_sizes
        q, k, v = full.split([self.n_heads * self.d_head, self.n_kv_heads * self.d_head, self.n_kv_heads * self.d_head])
        return torch.cat([q[r * nq:(r + 1) * nq], k[s * nkv:(s + 1) * nkv], v[s * nkv:(s + 1) * nkv]])

    def split(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[T, (H_local + 2·H_kv_local)·D]`` → q ``[T, H_local, D]``, k, v ``[T, H_kv_local, D]`` (flash-attn layout, views)."""
        return tuple(x.unflatten(1, (-1, self.d_head)) for x in qkv.split(self.local_sizes, dim=1))


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
