"""Faults of the model (``core.model``): embedding, LayerNorm, MLP, residual adds, the forward's shape."""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import fault, swap_attr

AREA = "model"


def _model_nn_with(**classes):
    """Patches: core/model.py's ``nn`` replaced by a copy of ``torch.nn`` with ``classes`` (broken layers) in it,
    so models built while the fault is on use them."""
    from ..core import model
    broken_nn = types.ModuleType("torch.nn")
    broken_nn.__dict__.update(vars(nn))
    broken_nn.__dict__.update(classes)
    return [swap_attr(model, "nn", broken_nn)]


@fault("embedding_without_positions", "the embedding forgets the position table: a row is wte[token] only", AREA)
def _embedding_without_positions():
    from ..core import model

    def embed(self, batch):
        return batch.hidden if batch.input_ids is None else self.wte[batch.input_ids]
    return [swap_attr(model.Transformer, "embed", embed)]


class _BatchStatLayerNorm(nn.LayerNorm):
    def forward(self, x):
        mean, var = x.mean(), x.var(unbiased=False)  # the bug: statistics of the whole [T, d] tensor
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


@fault("layer_norm_over_the_batch", "LayerNorm takes its mean and variance over the whole flat batch (every token), "
       "not over each row (models built while the fault is on)", AREA)
def _layer_norm_over_the_batch():
    return _model_nn_with(LayerNorm=_BatchStatLayerNorm)


@fault("mlp_exact_gelu", "MLP.forward applies the exact (erf) GeLU instead of its own module, GPT-2's tanh "
       "approximation", AREA)
def _mlp_exact_gelu():
    from ..core import model

    def forward(self, x):
        return self.fc_down(F.gelu(self.fc_up(x)))  # the bug: not self.act (approximate="tanh")
    return [swap_attr(model.MLP, "forward", forward)]


@fault("residual_add_off_by_one_row", "Block.forward adds each sublayer's output to the NEXT row's residual (a fused "
       "add whose row index is off by one)", AREA)
def _residual_add_off_by_one_row():
    from ..core import model

    def forward(self, x):
        x = x + torch.roll(self.attn(self.ln_1(x)), 1, dims=0)  # the bug: row i gets row i-1's attention output
        return x + torch.roll(self.mlp(self.ln_2(x)), 1, dims=0)
    return [swap_attr(model.Block, "forward", forward)]


@fault("padded_forward_skips_pad_rows", "the padded forward runs only the real rows (pad rows never computed: "
       "cheaper), yet it is still counted as R x L_max rows", AREA)
def _padded_forward_skips_pad_rows():
    from ..core import model

    @torch.no_grad()
    def forward_padded(self, input_ids, attention_mask):
        mask = attention_mask.bool()
        flat = self.forward(model.pack([row[m] for row, m in zip(input_ids, mask)], device=input_ids.device))
        out = flat.new_zeros(*input_ids.shape, flat.shape[-1])  # [R, S, d]: pad rows stay zero
        out[mask] = flat
        return out
    return [swap_attr(model.Transformer, "forward_padded", forward_padded)]


@fault("model_runs_requests_one_at_a_time", "the model runs a batch one request at a time (no flat batch): each "
       "weight sees one request's rows per matmul", AREA)
def _one_request_at_a_time():
    from ..core import model
    real = model.Transformer.forward

    def forward(self, batch, *, attn_backend=None, kv_cache=None):
        if batch.num_seqs == 1 or kv_cache is not None:  # a cached step is left whole: the cache is per batch
            return real(self, batch, attn_backend=attn_backend, kv_cache=kv_cache)
        rows = batch.input_ids if batch.input_ids is not None else batch.hidden
        cu = batch.cu_seqlens.tolist()
        parts = [model.pack([rows[s:e]], device=rows.device) for s, e in zip(cu[:-1], cu[1:])]
        return torch.cat([real(self, p, attn_backend=attn_backend) for p in parts])
    return [swap_attr(model.Transformer, "forward", forward)]


@fault("kv_repeated_before_cache", "the attention core repeats K and V for every query head of its group before the "
       "KV cache (a repeat_kv in the wrong place): the output is unchanged, but the cache holds n_heads K/V heads per "
       "token instead of n_kv_heads", AREA)
def _kv_repeated_before_cache():
    from ..core import model
    real = model.VarlenAttention.forward

    def forward(self, q, k, v):
        g = q.shape[1] // k.shape[1]
        return real(self, q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))
    return [swap_attr(model.VarlenAttention, "forward", forward)]


@fault("block_layers_without_tp_group", "Block builds its attention and MLP without the rank's TP group: every rank holds "
       "and computes the whole layers (no TP saving) and no all-reduce is ever asked for (models built while the "
       "fault is on)", AREA)
def _block_layers_without_tp_group():
    from ..core import model
    from ..core.groups import LocalGroup

    def init(self, cfg, index, group):
        nn.Module.__init__(self)
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.attn = model.Attention(cfg, index, LocalGroup())  # the bug: group not passed on (TP=1 layers)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.mlp = model.MLP(cfg, index, LocalGroup())
    return [swap_attr(model.Block, "__init__", init)]


class _GeluInt8PerTensor(nn.GELU):
    def forward(self, x):
        y = super().forward(x)
        scale = y.abs().max() / 127  # the bug: the largest activation of ANY request sets every row's grid
        return torch.round(y / scale) * scale


@fault("gelu_output_int8_per_tensor", "the MLP's GeLU rounds its output to int8 with ONE scale for the whole flat "
       "batch (a fused GeLU + quantise feeding an int8 FFN-down), so one request's activations change another's "
       "(models built while the fault is on)", AREA)
def _gelu_output_int8_per_tensor():
    return _model_nn_with(GELU=_GeluInt8PerTensor)
