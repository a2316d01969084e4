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

from ..validate import check_kv_heads_split, is_int
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
    def output_size_per_partition(self) -> int:
        """This rank's output features (vLLM's name): ``out_features / tp``."""
        tp = self.group.world_size
        if self.out_features % tp:
            raise ValueError(f"out_features={self.out_features} is not divisible by tp_size={tp}")
        return self.out_features // tp

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
    """The fused Q, K, V projection, sharded by HEAD (vLLM's ``QKVParallelLinear``), grouped-query
    attention included: ``n_kv_heads`` K/V heads (default ``n_heads``), each read by
    ``n_heads / n_kv_heads`` consecutive query heads.

    Full weight rows are ``[Q heads 0..H-1 | K heads 0..H_kv-1 | V heads]`` (``[(H + 2·H_kv)·D, d_model]``).
    Rank r owns query heads ``[r·H/tp, (r+1)·H/tp)`` and ``n_local_kv_heads`` K/V heads: ``H_kv/tp`` of them,
    or, when ``tp > H_kv``, the ONE head ``r // num_kv_head_replicas`` (each K/V head replicated on
    ``num_kv_head_replicas = tp / H_kv`` ranks, as vLLM does). Either way rank r's query heads read only
    its own K/V heads. Per rank: ``[T, d_model] → [T, (H_local + 2·H_kv_local)·D]``, e.g.
    ``[T, 512] → [T, 768]`` under TP=2 without GQA (C6), laid out ``[q_local | k_local | v_local]``.
    """

    def __init__(self, d_model: int, n_heads: int, d_head: int, n_kv_heads: int | None = None, bias: bool = True, *,
                 group=None, dtype: torch.dtype = torch.float32):
        group = group if group is not None else LocalGroup()
        tp = group.world_size
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if not is_int(n_kv_heads) or n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads!r} must be a positive int dividing n_heads={n_heads}")
        if n_heads % tp:
            raise ValueError(f"n_heads={n_heads} is not divisible by tp_size={tp}")
        check_kv_heads_split(n_kv_heads, tp)
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_head
        self.n_local_heads = n_heads // tp
        self.num_kv_head_replicas = max(tp // n_kv_heads, 1)   # ranks holding each K/V head
        self.n_local_kv_heads = max(n_kv_heads // tp, 1)
        super().__init__(d_model, (n_heads + 2 * n_kv_heads) * d_head, bias, group=group, dtype=dtype)

    @property
    def output_size_per_partition(self) -> int:
        """``(n_local_heads + 2·n_local_kv_heads)·d_head``: more than ``out_features / tp`` when K/V heads are replicated."""
        return (self.n_local_heads + 2 * self.n_local_kv_heads) * self.d_head

    def shard_rows(self, full: Tensor) -> Tensor:
        # Cut this rank's query heads out of Q and its K/V heads out of K and of V, then stack them.
        d, r = self.d_head, self.group.rank
        q, k, v = full.split([self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d])
        nq, nkv = self.n_local_heads * d, self.n_local_kv_heads * d
        kv_shard = r // self.num_kv_head_replicas   # vLLM's kv shard_id: several ranks may share it
        return torch.cat([q[r * nq:(r + 1) * nq], k[kv_shard * nkv:(kv_shard + 1) * nkv],
                          v[kv_shard * nkv:(kv_shard + 1) * nkv]])

    def split(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[T, (H_local + 2·H_kv_local)·D]`` → q ``[T, H_local, D]``, k, v ``[T, H_kv_local, D]`` (flash-attn layout, views)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.n_local_heads * self.d_head, self.n_local_kv_heads * self.d_head,
                             self.n_local_kv_heads * self.d_head], dim=1)
        return q.view(t, self.n_local_heads, self.d_head), *(x.view(t, self.n_local_kv_heads, self.d_head) for x in (k, v))


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
