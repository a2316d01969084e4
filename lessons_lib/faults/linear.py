"""Faults of the tensor-parallel linear layers and their collectives (``core.linear``, ``core.groups``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import fault, swap_attr

AREA = "linear"


@fault("qkv_sharded_as_one_block", "QKVParallelLinear cuts the fused [Q | K | V] weight like a plain column-parallel "
       "layer: rank r takes contiguous rows (rank 0: Q of all heads and half of K), not Q, K and V of its own heads "
       "(models built while the fault is on)", AREA)
def _qkv_sharded_as_one_block():
    from ..core import linear
    return [swap_attr(linear.QKVParallelLinear, "shard_rows", linear.ColumnParallelLinear.shard_rows)]


def kv_replicas_round_robin(self, full: torch.Tensor) -> torch.Tensor:
    """``QKVParallelLinear.shard_rows`` with replicated K/V heads dealt round-robin (rank r keeps K/V head
    ``r % n_kv_heads``, not ``r // num_kv_head_replicas``): shapes, cache bytes and replica count stay right, but a
    rank's queries read another group's K and V. ``full``: the fused weight or bias, rows ``[Q | K | V]``."""
    r, (nq, nkv, _) = self.group.rank, self.local_sizes
    s = r % self.n_kv_heads if self.num_kv_head_replicas > 1 else r
    q, k, v = full.split([self.n_heads * self.d_head, self.n_kv_heads * self.d_head, self.n_kv_heads * self.d_head])
    return torch.cat([q[r * nq:(r + 1) * nq], k[s * nkv:(s + 1) * nkv], v[s * nkv:(s + 1) * nkv]])


@fault("kv_replicas_dealt_round_robin", "under TP with more ranks than K/V heads, the replicated K/V heads are dealt "
       "round-robin: a rank's queries read another group's K and V (models built while the fault is on)", AREA)
def _kv_replicas_dealt_round_robin():
    from ..core import linear
    return [swap_attr(linear.QKVParallelLinear, "shard_rows", kv_replicas_round_robin)]


@fault("all_reduce_in_64k_buckets", "the real all-reduce is sent in buckets of at most 64 KiB, so the number of "
       "all-reduces grows with the tokens in the batch", "tp")
def _all_reduce_in_buckets():
    import torch.distributed as dist

    from ..core import groups

    def all_reduce(self, tensor, *, layer=""):
        rows = max(1, 65536 // (tensor[0].numel() * tensor.element_size()))
        for chunk in tensor.split(rows):  # row blocks of a contiguous tensor: contiguous views, reduced in place
            dist.all_reduce(chunk, op=dist.ReduceOp.SUM, group=self.process_group)
            self.trace.append(groups.record(chunk, layer, self.rank, self.world_size))
        return tensor
    return [swap_attr(groups.DistGroup, "all_reduce", all_reduce)]


def _fake_int8(x):
    scale = x.abs().max() / 127  # the bug: the largest value of ANY request sets every row's grid
    return torch.round(x / scale) * scale


@fault("activations_int8_per_tensor", "the linear layers round their input to int8 with ONE scale for the whole "
       "batch (per-tensor dynamic quantisation), so one request's values change another's rows", AREA)
def _per_tensor_activation_scale():
    from ..core import linear

    def column_forward(self, x):
        return F.linear(_fake_int8(x), self.weight, self.bias)

    def row_forward(self, x):
        y = self.group.all_reduce(F.linear(_fake_int8(x), self.weight), layer=self.name)
        return y if self.bias is None else y + self.bias
    return [swap_attr(linear.ColumnParallelLinear, "forward", column_forward),  # QKVParallelLinear inherits it
            swap_attr(linear.RowParallelLinear, "forward", row_forward)]


@fault("row_parallel_bias_on_every_rank", "RowParallelLinear adds the bias on every rank before the all-reduce, so "
       "the sum holds it tp times", AREA)
def _bias_on_every_rank():
    from ..core import linear

    def forward(self, x):
        return self.group.all_reduce(F.linear(x, self.weight, self.bias), layer=self.name)  # the bug: b on each rank
    return [swap_attr(linear.RowParallelLinear, "forward", forward)]


@fault("row_parallel_all_reduce_before_matmul", "RowParallelLinear all-reduces its input slices [T, in/tp] and then "
       "multiplies by its own weight shard: the sum is taken of the wrong thing", AREA)
def _reduce_before_matmul():
    from ..core import linear

    def forward(self, x):
        return F.linear(self.group.all_reduce(x.clone(), layer=self.name), self.weight, self.bias)
    return [swap_attr(linear.RowParallelLinear, "forward", forward)]


@fault("row_parallel_no_all_reduce", "RowParallelLinear never all-reduces: each rank keeps its partial sum", AREA)
def _no_all_reduce():
    from ..core import linear

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)
    return [swap_attr(linear.RowParallelLinear, "forward", forward)]


@fault("linear_rows_in_chunks_of_16", "the linear layers run their rows in chunks of 16 (one F.linear per chunk): "
       "every weight is read ceil(T / 16) times per forward instead of once", AREA)
def _linear_in_chunks_of_16():
    from ..core import linear

    def column(self, x):
        return torch.cat([F.linear(rows, self.weight, self.bias) for rows in x.split(16)])

    def row(self, x):
        y = self.group.all_reduce(torch.cat([F.linear(rows, self.weight) for rows in x.split(16)]), layer=self.name)
        return y if self.bias is None else y + self.bias
    return [swap_attr(linear.ColumnParallelLinear, "forward", column),
            swap_attr(linear.RowParallelLinear, "forward", row)]
