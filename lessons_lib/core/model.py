"""A pre-LN GPT-2-style transformer that runs on a flat batch (claim S1).

Block: LN → QKV → varlen attention → out proj → +residual → LN → FFN-up → GeLU(tanh)
→ FFN-down → +residual; final LN. Token and learned position embeddings in front. Every step is
a module, attention included: each layer's ``VarlenAttention`` reads the forward's
``AttentionContext``, so forward hooks see every step of a block.

One model for TP=1 and TP=2: the linear layers are the tensor-parallel classes of ``linear.py``;
give a process group to shard them (default TP=1). Embeddings, LayerNorms and the tied LM head
are replicated (a real deployment would also split the vocabulary), so a forward makes exactly
two all-reduces per layer (out proj, FFN-down): 16 for 8 layers (C1, C12).

Weights: one format everywhere. ``init_weights``, ``hf.full_weights_from_hf`` and a TP=1
model's ``state_dict()`` name the full tensors as ``ModelConfig.weight_shapes`` does; every
rank cuts its shard from them. Taught in notebooks/00_setup_one_request.ipynb and 02.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..validate import check_attention_fn, check_batch, check_padded_ids, check_tp_divides, check_weights
from .attention import VarlenMetadata, attention_forward, padded_attention
from .batch import PackedBatch, cumulative, pack
from .config import ModelConfig, as_config
from .groups import LocalGroup
from .kernels import resolve_backend
from .linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

Tensor = torch.Tensor


def init_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, Tensor]:
    """Full (unsharded) weights in ``cfg.dtype``, GPT-2 init: normal, std 0.02 (0.01 for positions).

    Biases and LayerNorm parameters are small random values rather than 0 / 1, so a bug that
    adds a bias twice or skips a LayerNorm changes the output and a test can see it.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in cfg.weight_shapes().items():
        mean = 1.0 if "ln_" in name and name.endswith(".weight") else 0.0  # LayerNorm scales near 1
        out[name] = (torch.randn(*shape, generator=g) * (0.01 if name == "wpe" else 0.02) + mean).to(cfg.dtype)
    return out


@dataclass(slots=True)
class AttentionContext:
    """What every layer's attention reads in one forward (nano-vllm's ``Context``): ``meta`` (the flat
    batch's ``VarlenMetadata``) and ``backend`` (resolved: a name or your function), or ``key_mask``
    ``[R, S]`` bool for ``forward_padded``; ``kv_cache``: a chunk's cached keys (``Transformer.forward``).
    ``Transformer`` sets it on every layer for one forward."""

    meta: VarlenMetadata | None
    backend: object = None
    key_mask: Tensor | None = None
    kv_cache: object = None


class VarlenAttention(nn.Module):
    """A layer's attention core: ``q [T, H_local, D]``, ``k, v [T, H_kv_local, D]`` → ``o [T, H_local, D]`` (ctx)."""

    def __init__(self, layer: int = 0):
        super().__init__()
        self.layer, self.context = layer, None

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx = self.context
        if ctx is None:
            raise RuntimeError("no AttentionContext: run the layer inside Transformer.forward, or set attn.core.context")
        if ctx.key_mask is not None:  # forward_padded: [R·S, H, D] → [R, S, H, D] → dense masked attention
            return padded_attention(*(x.unflatten(0, ctx.key_mask.shape) for x in (q, k, v)), ctx.key_mask).reshape(q.shape)
        if ctx.kv_cache is not None:  # keys and values [T_k, H_kv, D]: each request's cached ones, then its chunk's
            k, v = ctx.kv_cache.keys_values(self.layer, k, v)
        return attention_forward(q, k, v, ctx.meta, ctx.backend, causal=True)  # causal aligned bottom-right


class Attention(nn.Module):
    """QKV (column-parallel by head) → attention core on this rank's heads → out proj (row-parallel)."""

    def __init__(self, cfg: ModelConfig, index: int, group):
        super().__init__()
        self.qkv = QKVParallelLinear(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.n_kv_heads, group=group, dtype=cfg.dtype)
        self.core = VarlenAttention(index)
        self.out_proj = RowParallelLinear(cfg.qkv_dim, cfg.d_model, group=group, dtype=cfg.dtype,
                                          name=f"layers.{index}.attn.out_proj")

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv.split(self.qkv(x))    # q [T, H_local, D], k and v [T, H_kv_local, D]
        o = self.core(q, k, v).flatten(1)        # [T, H_local·D]: this rank's heads only
        return self.out_proj(o)                  # all-reduce → [T, d]


class MLP(nn.Module):
    """FFN-up (column-parallel) → GeLU(tanh) → FFN-down (row-parallel)."""

    def __init__(self, cfg: ModelConfig, index: int, group):
        super().__init__()
        self.fc_up = ColumnParallelLinear(cfg.d_model, cfg.d_ffn, group=group, dtype=cfg.dtype)
        self.act = nn.GELU(approximate="tanh")
        self.fc_down = RowParallelLinear(cfg.d_ffn, cfg.d_model, group=group, dtype=cfg.dtype,
                                         name=f"layers.{index}.mlp.fc_down")

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_down(self.act(self.fc_up(x)))  # [T, d_ffn/tp] → all-reduce → [T, d]


class Block(nn.Module):
    """One pre-LN block on rank ``group.rank``: ``[T, d] → [T, d]``, two all-reduces. Each step is a module
    a hook can read (``ln_1, attn.qkv, attn.core, attn.out_proj, ln_2, mlp.fc_up, mlp.act, mlp.fc_down``);
    the first residual is ``ln_2``'s input, the second the block's output."""

    def __init__(self, cfg: ModelConfig, index: int, group):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.attn = Attention(cfg, index, group)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.mlp = MLP(cfg, index, group)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))          # all-reduce #1
        return x + self.mlp(self.ln_2(x))        # all-reduce #2


class Transformer(nn.Module):
    """The course's GPT-2-style model.

    cfg: sizes (default: the article's). weights: full weights, see the module doc (default
    ``init_weights(cfg, seed)``). group: the rank's process group (default TP=1).
    attn_backend: default attention backend of ``forward`` (``kernels.BACKENDS`` or "auto").
    device, dtype: where the parameters go and their dtype (default: the CPU, and the dtype of the
    given weights, else ``cfg.dtype``): float64 weights make a float64 model, never a silent cast.
    """

    def __init__(self, cfg: ModelConfig | None = None, weights: dict[str, Tensor] | None = None, *,
                 seed: int = 0, group=None, attn_backend: str = "auto", device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg = as_config(cfg)
        self.group = group if group is not None else LocalGroup()
        check_tp_divides(cfg, "group world_size", self.group.world_size)
        self.attn_backend = check_attention_fn(attn_backend)
        weights = weights if weights is not None else init_weights(cfg, seed)
        wte = weights.get("wte") if isinstance(weights, dict) else None
        built = replace(cfg, dtype=dtype or (wte.dtype if isinstance(wte, Tensor) and wte.is_floating_point() else cfg.dtype))
        self.wte = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model, dtype=built.dtype), requires_grad=False)
        self.wpe = nn.Parameter(torch.empty(cfg.max_position, cfg.d_model, dtype=built.dtype), requires_grad=False)
        self.layers = nn.ModuleList(Block(built, i, self.group) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, dtype=built.dtype)
        self.load_full_weights_(weights)
        if device is not None:
            self.to(device=device)

    @property
    def device(self) -> torch.device:
        return self.wte.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (``model.to(torch.bfloat16)`` changes it; ``cfg.dtype`` does not)."""
        return self.wte.dtype

    @torch.no_grad()
    def load_full_weights_(self, weights: dict[str, Tensor]) -> Transformer:
        """Copy this rank's shard of every full weight into the model (casting to its dtype)."""
        check_weights(weights, self.cfg.weight_shapes())
        for name, module in self.named_modules():
            prefix = name + "." if name else ""
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.load_full_(weights[prefix + "weight"], weights[prefix + "bias"])
            elif isinstance(module, nn.LayerNorm):
                module.weight.copy_(weights[prefix + "weight"])
                module.bias.copy_(weights[prefix + "bias"])
        self.wte.copy_(weights["wte"])
        self.wpe.copy_(weights["wpe"])
        return self

    def embed(self, batch: PackedBatch) -> Tensor:
        """``[T]`` ids + ``[T]`` positions → ``[T, d]`` (or the batch's own hidden rows)."""
        if batch.input_ids is None:
            return batch.hidden
        return self.wte[batch.input_ids] + self.wpe[batch.positions]

    @torch.no_grad()
    def forward(self, batch: PackedBatch, *, attn_backend=None, kv_cache=None) -> Tensor:
        """Flat forward: a PackedBatch of T tokens → final hidden states ``[T, d_model]``.

        batch: on the model's device (``input_ids [T]`` int64, ``cu_seqlens [R+1]`` int32, ...).
        attn_backend: overrides the model's (a name of ``kernels.BACKENDS``, "auto", or your function).
        kv_cache: chunked prefill (``batch.num_computed_tokens``): ``keys_values(layer, k, v)`` puts each
        request's cached keys before its chunk's (``serve.kv_cache.KVCacheStep``); ``cu_seqlens_k`` counts both.
        Returns ``[T, d_model]`` in the weights' dtype, on their device. The batch is checked once,
        here; ``cu_seqlens`` reaches only attention, through one ``VarlenMetadata`` for all layers.
        """
        cu = check_batch(self.cfg, batch, self.device, self.dtype, cached=kv_cache is not None)
        backend = resolve_backend(attn_backend or self.attn_backend, self.device, self.dtype, self.cfg.d_head)
        meta = VarlenMetadata(batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen, cu, cu)
        if any(batch.num_computed_tokens or ()):
            meta = VarlenMetadata.build(cu, cumulative(c + n for c, n in zip(batch.num_computed_tokens, batch.seq_lens)),
                                        self.device, batch.max_seqlen)
        return self._run(self.embed(batch), AttentionContext(meta, check_attention_fn(backend), kv_cache=kv_cache))

    def set_context(self, ctx: AttentionContext | None) -> None:
        """Hand ``ctx`` to every layer's attention core (None: outside a forward)."""
        for block in self.layers:
            block.attn.core.context = ctx

    def _run(self, x: Tensor, ctx: AttentionContext) -> Tensor:  # blocks + final LN on x [T, d], under ctx
        self.set_context(ctx)
        try:
            for block in self.layers:
                x = block(x)
        finally:
            self.set_context(None)  # a context never outlives its forward (its masks, its batch)
        return self.ln_f(x)

    @torch.no_grad()
    def forward_padded(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The naive way, for comparison: ``[R, S]`` right-padded ids + ``[R, S]`` bool mask
        → ``[R, S, d]``. Pad rows go through every layer too (their outputs are garbage)."""
        r, s = check_padded_ids(self.cfg, input_ids, attention_mask)
        positions = torch.arange(s, device=input_ids.device).expand(r, s)
        x = (self.wte[input_ids] + self.wpe[positions]).reshape(r * s, -1)  # [R·S, d]
        return self._run(x, AttentionContext(None, key_mask=attention_mask.bool())).view(r, s, -1)

    def forward_each(self, requests: Sequence, **kw) -> list[Tensor]:
        """Per-request reference: one forward per request, ``[L_i, d]`` each."""
        return [self.forward(pack([req], device=self.device), **kw) for req in requests]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Tied LM head (replicated on every rank): ``[N, d] → [N, vocab_size]``."""
        return hidden @ self.wte.T
