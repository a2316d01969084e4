"""A pre-LN GPT-2-style transformer that runs on a flat batch (claim S1).

Block: LN → QKV → varlen attention → out proj → +residual → LN → FFN-up → GeLU(tanh)
→ FFN-down → +residual; final LN. Token and learned position embeddings in front.

One model for TP=1 and TP=2: the linear layers are the tensor-parallel classes of
``linear.py``; pass a process group to shard them (default: one process, TP=1). Embeddings,
LayerNorms and the tied LM head are replicated, so a forward makes exactly two all-reduces
per layer (out proj, FFN-down) and nothing else: 16 for the article's 8 layers (C1, C12).

Weights live in a "full" state dict (``init_weights``), from which every rank cuts its shard.

Taught in notebooks/00_setup_one_request.ipynb and notebooks/02_linear_is_per_token.ipynb.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import padded_attention, resolve_backend, varlen_attention
from .batch import PackedBatch, pack
from .config import ModelConfig
from .linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .parallel import LocalGroup

Tensor = torch.Tensor


def init_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, Tensor]:
    """Full (unsharded) weights, GPT-2 init (normal, std 0.02).

    Biases and LayerNorm parameters are small random values rather than 0 / 1, so a bug that
    adds a bias twice or skips a LayerNorm changes the output and a test can see it.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.02, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).to(cfg.dtype)

    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    w = {"wte": normal(cfg.vocab_size, d), "wpe": normal(cfg.max_position, d, std=0.01)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        w |= {p + "ln_1.weight": normal(d, mean=1.0), p + "ln_1.bias": normal(d),
              p + "attn.qkv.weight": normal(3 * k, d), p + "attn.qkv.bias": normal(3 * k),
              p + "attn.out_proj.weight": normal(d, k), p + "attn.out_proj.bias": normal(d),
              p + "ln_2.weight": normal(d, mean=1.0), p + "ln_2.bias": normal(d),
              p + "mlp.fc_up.weight": normal(f, d), p + "mlp.fc_up.bias": normal(f),
              p + "mlp.fc_down.weight": normal(d, f), p + "mlp.fc_down.bias": normal(d)}
    w |= {"ln_f.weight": normal(d, mean=1.0), "ln_f.bias": normal(d)}
    return w


class Block(nn.Module):
    """One pre-LN block on rank ``group.rank``: ``[T, d] → [T, d]``, two all-reduces."""

    def __init__(self, cfg: ModelConfig, index: int, group):
        super().__init__()
        kw = dict(group=group, dtype=cfg.dtype)
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.qkv = QKVParallelLinear(cfg.d_model, cfg.n_heads, cfg.d_head, **kw)
        self.out_proj = RowParallelLinear(cfg.qkv_dim, cfg.d_model, name=f"layers.{index}.attn.out_proj", **kw)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.fc_up = ColumnParallelLinear(cfg.d_model, cfg.d_ffn, **kw)
        self.fc_down = RowParallelLinear(cfg.d_ffn, cfg.d_model, name=f"layers.{index}.mlp.fc_down", **kw)

    def forward(self, x: Tensor, attn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        t = x.shape[0]
        q, k, v = self.qkv.split(self.qkv(self.ln_1(x)))  # each [T, H_local, D]
        o = attn(q, k, v).reshape(t, -1)                   # [T, H_local*D]: this rank's heads only
        x = x + self.out_proj(o)                           # all-reduce #1 -> [T, d]
        h = F.gelu(self.fc_up(self.ln_2(x)), approximate="tanh")  # [T, d_ffn/tp]
        return x + self.fc_down(h)                         # all-reduce #2 -> [T, d]


class Transformer(nn.Module):
    """The course's GPT-2-style model.

    cfg: sizes. ``cfg.tp_size`` is the deployment the config describes; the actual split
    follows ``group`` (None = one process, TP=1).
    weights: full state dict from ``init_weights`` or ``hf.from_hf_gpt2`` (default: init_weights(cfg, seed)).
    attn_backend: default attention backend for ``forward`` (see attention.BACKENDS).
    """

    def __init__(self, cfg: ModelConfig | None = None, weights: dict[str, Tensor] | None = None, *,
                 seed: int = 0, group=None, attn_backend: str = "auto"):
        super().__init__()
        self.cfg = cfg = cfg if cfg is not None else ModelConfig()
        self.group = group if group is not None else LocalGroup()
        if cfg.n_heads % self.group.world_size or cfg.d_ffn % self.group.world_size:
            raise ValueError(f"group world_size={self.group.world_size} must divide n_heads={cfg.n_heads} "
                             f"and d_ffn={cfg.d_ffn}")
        self.attn_backend = attn_backend
        self.wte = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype), requires_grad=False)
        self.wpe = nn.Parameter(torch.empty(cfg.max_position, cfg.d_model, dtype=cfg.dtype), requires_grad=False)
        self.layers = nn.ModuleList(Block(cfg, i, self.group) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.load_full_weights_(weights if weights is not None else init_weights(cfg, seed))

    @torch.no_grad()
    def load_full_weights_(self, w: dict[str, Tensor]) -> "Transformer":
        """Copy this rank's shard of every full weight into the model."""
        missing = [n for n in init_weight_names(self.cfg) if n not in w]
        if missing:
            raise ValueError(f"weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
        for n in init_weight_names(self.cfg):
            if not isinstance(w[n], Tensor) or w[n].device.type == "meta":
                what = "a tensor on the meta device" if isinstance(w[n], Tensor) else type(w[n]).__name__
                raise ValueError(f"weights[{n!r}] must be a tensor with values, got {what}")
        d = self.cfg.d_model
        for name, shape in [("wte", (self.cfg.vocab_size, d)), ("wpe", (self.cfg.max_position, d)),
                            ("ln_f.weight", (d,)), ("ln_f.bias", (d,))] + [
                (f"layers.{i}.{ln}.{p}", (d,)) for i in range(self.cfg.n_layers)
                for ln in ("ln_1", "ln_2") for p in ("weight", "bias")]:
            if tuple(w[name].shape) != shape:
                raise ValueError(f"weights[{name!r}] must have shape {shape} for this config, "
                                 f"got {tuple(w[name].shape)}")
        self.wte.copy_(w["wte"])
        self.wpe.copy_(w["wpe"])
        for i, b in enumerate(self.layers):
            p = f"layers.{i}."
            for ln in ("ln_1", "ln_2"):
                getattr(b, ln).weight.copy_(w[p + ln + ".weight"])
                getattr(b, ln).bias.copy_(w[p + ln + ".bias"])
            b.qkv.load_full_(w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"])
            b.out_proj.load_full_(w[p + "attn.out_proj.weight"], w[p + "attn.out_proj.bias"])
            b.fc_up.load_full_(w[p + "mlp.fc_up.weight"], w[p + "mlp.fc_up.bias"])
            b.fc_down.load_full_(w[p + "mlp.fc_down.weight"], w[p + "mlp.fc_down.bias"])
        self.ln_f.weight.copy_(w["ln_f.weight"])
        self.ln_f.bias.copy_(w["ln_f.bias"])
        return self

    def embed(self, batch: PackedBatch) -> Tensor:
        """``[T]`` ids + ``[T]`` positions → ``[T, d]`` (or the batch's own hidden rows).

        Expects a batch that passed ``check_batch`` (``forward`` does that first).
        """
        if batch.input_ids is None:
            return batch.hidden
        ids = batch.input_ids
        return self.wte[ids] + self.wpe[batch.positions]

    @torch.no_grad()
    def forward(self, batch: PackedBatch, *, attn_backend: str | None = None) -> Tensor:
        """Flat forward: a PackedBatch of T tokens → final hidden states ``[T, d_model]``.

        No padding anywhere; ``batch.cu_seqlens`` reaches only the attention call.
        """
        if not isinstance(batch, PackedBatch):
            raise ValueError(f"forward takes a PackedBatch (see batch.pack), got {type(batch).__name__}")
        if batch.positions.device != self.wte.device:
            raise ValueError(f"batch is on {batch.positions.device} but the model is on {self.wte.device}")
        check_batch(self.cfg, batch)
        backend = resolve_backend(attn_backend or self.attn_backend, self.wte.device, self.cfg.dtype)
        cu, max_len = batch.cu_seqlens, batch.max_seqlen

        def attn(q, k, v):
            return varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=True, backend=backend)

        x = self.embed(batch)  # [T, d]
        for block in self.layers:
            x = block(x, attn)
        return self.ln_f(x)

    @torch.no_grad()
    def forward_padded(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The naive way, for comparison: ``[R, S]`` right-padded ids + ``[R, S]`` bool mask
        → ``[R, S, d]``. Pad rows go through every layer too (their outputs are garbage)."""
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids and attention_mask must both be [R, S], got {tuple(input_ids.shape)} "
                             f"and {tuple(attention_mask.shape)}")
        r, s = input_ids.shape
        if s > self.cfg.max_position:
            raise ValueError(f"padded length {s} exceeds max_position={self.cfg.max_position}")
        positions = torch.arange(s, device=input_ids.device).expand(r, s)
        x = (self.wte[input_ids] + self.wpe[positions]).reshape(r * s, -1)  # [R*S, d]
        mask = attention_mask.bool()

        def attn(q, k, v):  # [R*S, H, D] -> [R, S, H, D] -> masked dense attention
            shape = (r, s, *q.shape[1:])
            return padded_attention(q.view(shape), k.view(shape), v.view(shape), mask, causal=True).reshape(q.shape)

        for block in self.layers:
            x = block(x, attn)
        return self.ln_f(x).view(r, s, -1)

    def forward_each(self, requests: Sequence, **kw) -> list[Tensor]:
        """Per-request reference: one forward per request, ``[L_i, d]`` each."""
        return [self.forward(pack([req], device=self.wte.device), **kw) for req in requests]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Tied LM head (replicated on every rank): ``[N, d] → [N, vocab_size]``."""
        return hidden @ self.wte.T


def check_batch(cfg: ModelConfig, batch: PackedBatch) -> list[int]:
    """Refuse a batch a model of ``cfg`` cannot run, before any compute; return ``cu_seqlens`` as a list.

    The batch's own fields must agree (``PackedBatch.validate``); token ids must lie in the
    vocabulary and every request within ``max_position``; hidden rows must be ``[T, d_model]``
    in ``cfg.dtype`` and finite. ``Transformer.forward`` calls it, and so does the TP runtime in
    the caller, before any worker sees the batch.
    """
    cu = batch.validate()  # cu_seqlens, seq_lens, max_seqlen and positions agree (hand-built batches)
    longest = max(cu[i + 1] - cu[i] for i in range(len(cu) - 1))
    if batch.input_ids is not None:
        ids = batch.input_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            raise ValueError(f"batch.input_ids must be in [0, vocab_size={cfg.vocab_size}), "
                             f"got min {int(ids.min())}, max {int(ids.max())}")
        if longest > cfg.max_position:  # max_seqlen is only an upper bound: the real lengths decide
            raise ValueError(f"a request of {longest} tokens exceeds max_position={cfg.max_position}")
    else:
        x = batch.hidden
        if x.dim() != 2 or x.shape[1] != cfg.d_model or x.dtype != cfg.dtype:
            raise ValueError(f"batch.hidden must be [T, d_model={cfg.d_model}] {cfg.dtype}, got "
                             f"{tuple(x.shape)} {x.dtype}")
        if not torch.isfinite(x).all():
            row = int((~torch.isfinite(x)).any(1).nonzero()[0, 0])
            raise ValueError(f"batch.hidden contains NaN or Inf (first at row {row})")
    return cu


def init_weight_names(cfg: ModelConfig) -> list[str]:
    names = ["wte", "wpe", "ln_f.weight", "ln_f.bias"]
    for i in range(cfg.n_layers):
        for part in ("ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.out_proj.weight",
                     "attn.out_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.fc_up.weight", "mlp.fc_up.bias",
                     "mlp.fc_down.weight", "mlp.fc_down.bias"):
            names.append(f"layers.{i}.{part}")
    return names
