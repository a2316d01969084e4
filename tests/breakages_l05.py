"""Breakages of the claims lesson 05 proves (see breakages.py)."""
from breakages import breaks


@breaks("C13", "05_flop_regimes",
        "the linear layers run their rows in chunks of 16 (one F.linear per chunk): every weight is read "
        "ceil(T / 16) times per forward instead of once")
def _linear_in_chunks_of_16():
    import torch
    import torch.nn.functional as F

    from lessons_lib.core import linear

    def column(self, x):
        return torch.cat([F.linear(rows, self.weight, self.bias) for rows in x.split(16)])

    def row(self, x):
        partial = torch.cat([F.linear(rows, self.weight) for rows in x.split(16)])
        y = self.group.all_reduce(partial, layer=self.name)
        return y if self.bias is None else y + self.bias

    linear.ColumnParallelLinear.forward = column
    linear.RowParallelLinear.forward = row


@breaks("C14", "05_flop_regimes",
        "the loop backend computes every query against every key of the flat batch and masks the rest "
        "(the masked method under the varlen name)")
def _loop_is_masked():
    from lessons_lib.core import attention

    attention.IMPLS["loop"] = attention.IMPLS["masked"]


@breaks("C15", "05_flop_regimes", "the model runs a batch one request at a time (no flat batch): each weight sees one "
        "request's rows per matmul")
def _one_request_at_a_time():
    import torch

    from lessons_lib.core import batch as batch_module
    from lessons_lib.core import model

    real = model.Transformer.forward

    def forward(self, batch, *, attn_backend=None, kv_cache=None):
        if batch.num_seqs == 1 or kv_cache is not None:   # a cached step is left whole: the cache is per batch
            return real(self, batch, attn_backend=attn_backend, kv_cache=kv_cache)
        rows = batch.input_ids if batch.input_ids is not None else batch.hidden
        cu = batch.cu_seqlens.tolist()
        parts = [batch_module.pack([rows[s:e]], device=rows.device) for s, e in zip(cu[:-1], cu[1:])]
        return torch.cat([real(self, p, attn_backend=attn_backend) for p in parts])

    model.Transformer.forward = forward


@breaks("C15", "05_flop_regimes", "the attention core repeats K and V for every query head of its group before the "
        "KV cache (a repeat_kv in the wrong place): the output is unchanged, but the cache holds n_heads K/V heads per "
        "token instead of n_kv_heads, and decode attention reads each K/V head once per query head", variant="gqa")
def _kv_repeated_per_query_head():
    from lessons_lib.core import model

    real = model.VarlenAttention.forward

    def forward(self, q, k, v):
        g = q.shape[1] // k.shape[1]
        return real(self, q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))

    model.VarlenAttention.forward = forward


@breaks("C15", "05_flop_regimes", "the loop backend repeats K and V for every query head of its group after the KV cache "
        "(the group not packed): the cache keeps n_kv_heads, but each shared K/V head is read once per query head, in "
        "m = 1 matmuls", variant="unpacked")
def _gqa_group_not_packed():
    from lessons_lib.core import attention

    real = attention.IMPLS["loop"]

    def loop(q, k, v, meta, causal, scale):
        g = q.shape[1] // k.shape[1]
        return real(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), meta, causal, scale)

    attention.IMPLS["loop"] = loop
