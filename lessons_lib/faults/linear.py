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


@fault("all_reduce_sums_in_bfloat16", "the real all-reduce sends its payload in bfloat16 to halve the bytes (the "
       "trace still records the float32 tensor the layer handed over): every partial sum is rounded to 8 bits of "
       "mantissa before it is added", "tp")
def _all_reduce_sums_in_bfloat16():
    import torch.distributed as dist

    from ..core import groups

    def all_reduce(self, tensor, *, layer=""):
        wire = tensor.to(torch.bfloat16)
        dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.process_group)
        tensor.copy_(wire)
        self.trace.append(groups.record(tensor, layer, self.rank, self.world_size))
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


@fault("qkv_computed_whole_on_every_rank", "QKVParallelLinear is not cut: every rank computes Q, K and V of ALL heads "
       "([T, (H + 2 H_kv) D]), then keeps its own heads' columns for attention: the result is right, the QKV output "
       "is tp times as wide and its FLOPs are not split (models built while the fault is on)", AREA)
def _qkv_computed_whole():
    from ..core import linear
    cls = linear.QKVParallelLinear
    real_shard, real_split = cls.shard_rows, cls.split

    def split(self, qkv):
        return real_split(self, real_shard(self, qkv.T).T)   # the rank's heads, picked out of every head's columns
    return [swap_attr(cls, "output_size_per_partition", property(lambda self: self.out_features)),
            swap_attr(cls, "shard_rows", lambda self, full: full), swap_attr(cls, "split", split)]


@fault("attention_gathers_every_head", "Attention all-gathers every rank's attention output before its out proj and "
       "keeps its own heads' columns again: the result is right, but each layer makes one more collective, between "
       "QKV and out proj, of [T, H_local D]", AREA)
def _attention_gathers_every_head():
    from ..core import model

    def forward(self, x):
        q, k, v = self.qkv.split(self.qkv(x))
        o = self.core(q, k, v).flatten(1)                                   # [T, H_local D]
        every = self.qkv.group.all_gather(o, layer=self.out_proj.name.replace("out_proj", "core"))
        n, r = o.shape[1], self.qkv.group.rank
        return self.out_proj(every[:, r * n:(r + 1) * n] if every.shape[1] > n else o)
    return [swap_attr(model.Attention, "forward", forward)]


@fault("kv_block_rank_mod_replicas", "QKVParallelLinear picks a replicated K/V head as rank % num_kv_head_replicas "
       "instead of rank // num_kv_head_replicas (past tp = n_kv_heads): shapes and cache bytes stay right, but only "
       "the first K/V heads are ever held, on too many ranks (models built while the fault is on)", AREA)
def _kv_block_rank_mod_replicas():
    from ..core import linear

    def shard_rows(self, full):
        r, (nq, nkv, _) = self.group.rank, self.local_sizes
        s = r % self.num_kv_head_replicas if self.num_kv_head_replicas > 1 else r   # the bug: % for //
        q, k, v = full.split([self.n_heads * self.d_head, self.n_kv_heads * self.d_head, self.n_kv_heads * self.d_head])
        return torch.cat([q[r * nq:(r + 1) * nq], k[s * nkv:(s + 1) * nkv], v[s * nkv:(s + 1) * nkv]])
    return [swap_attr(linear.QKVParallelLinear, "shard_rows", shard_rows)]


@fault("column_parallel_bias_whole", "ColumnParallelLinear (QKV, FFN-up) cuts its weight by output features but keeps "
       "the WHOLE bias on every rank: each rank holds out_features bias values for out_features / tp outputs, and a "
       "TP forward fails on the shape (models built while the fault is on)", AREA)
def _column_parallel_bias_whole():
    from torch import nn

    from ..core import linear
    real_init = linear.ColumnParallelLinear.__init__

    def init(self, in_features, out_features, bias=True, *, group=None, dtype=torch.float32):
        real_init(self, in_features, out_features, bias, group=group, dtype=dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)

    @torch.no_grad()
    def load_full_(self, weight, bias=None):
        self.weight.copy_(self.shard_rows(weight))
        if self.bias is not None:
            self.bias.copy_(bias)  # the bug: the whole bias, not this rank's rows of it
        return self
    return [swap_attr(linear.ColumnParallelLinear, "__init__", init),
            swap_attr(linear.ColumnParallelLinear, "load_full_", load_full_)]


@fault("row_parallel_bias_sharded", "RowParallelLinear (out proj, FFN-down) cuts its bias like a column-parallel one: "
       "rank r keeps out_features / tp bias values and adds them to its own slice of the summed output only, so "
       "the ranks' outputs differ and each lacks the rest of the bias (models built while the fault is on)", AREA)
def _row_parallel_bias_sharded():
    from torch import nn

    from ..core import linear
    real_init = linear.RowParallelLinear.__init__

    def init(self, in_features, out_features, bias=True, *, group=None, dtype=torch.float32, name=""):
        real_init(self, in_features, out_features, bias, group=group, dtype=dtype, name=name)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // self.group.world_size, dtype=dtype),
                                     requires_grad=False)

    @torch.no_grad()
    def load_full_(self, weight, bias=None):
        n, r = self.in_features // self.group.world_size, self.group.rank
        self.weight.copy_(weight[:, r * n:(r + 1) * n])
        if self.bias is not None:
            m = self.bias.numel()
            self.bias.copy_(bias[r * m:(r + 1) * m])  # the bug: this rank's slice of the bias only
        return self

    def forward(self, x):
        y = self.group.all_reduce(F.linear(x, self.weight), layer=self.name)
        if self.bias is None:
            return y
        m, r = self.bias.numel(), self.group.rank
        return torch.cat([y[:, :r * m], y[:, r * m:(r + 1) * m] + self.bias, y[:, (r + 1) * m:]], dim=1)
    return [swap_attr(linear.RowParallelLinear, "__init__", init),
            swap_attr(linear.RowParallelLinear, "load_full_", load_full_),
            swap_attr(linear.RowParallelLinear, "forward", forward)]


@fault("all_reduce_twice", "RowParallelLinear's summed output is all-reduced a second time (the layer and its caller "
       "both reduce): every rank holds the same doubled sum, and a TP forward makes 4 all-reduces per block, not 2", AREA)
def _all_reduce_twice():
    from ..core import linear

    def forward(self, x):
        y = self.group.all_reduce(F.linear(x, self.weight), layer=self.name)
        y = self.group.all_reduce(y, layer=self.name)  # the bug: a second reduce of an already summed tensor
        return y if self.bias is None else y + self.bias
    return [swap_attr(linear.RowParallelLinear, "forward", forward)]
