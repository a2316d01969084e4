"""The model's sizes (claim S1) and the one table of its weights' names and shapes.

Taught in notebooks/00_setup_one_request.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..validate import check_int, check_n_kv_heads, check_tp_divides

# One block's weights: name → shape as a function of (d_model, k = n_heads·d_head, kv = n_kv_heads·d_head, d_ffn).
# PyTorch layout: a linear weight is [out_features, in_features]; qkv's rows are [Q | K | V].
_BLOCK = {"ln_1.weight": lambda d, k, kv, f: (d,), "ln_1.bias": lambda d, k, kv, f: (d,),
          "attn.qkv.weight": lambda d, k, kv, f: (k + 2 * kv, d), "attn.qkv.bias": lambda d, k, kv, f: (k + 2 * kv,),
          "attn.out_proj.weight": lambda d, k, kv, f: (d, k), "attn.out_proj.bias": lambda d, k, kv, f: (d,),
          "ln_2.weight": lambda d, k, kv, f: (d,), "ln_2.bias": lambda d, k, kv, f: (d,),
          "mlp.fc_up.weight": lambda d, k, kv, f: (f, d), "mlp.fc_up.bias": lambda d, k, kv, f: (f,),
          "mlp.fc_down.weight": lambda d, k, kv, f: (d, f), "mlp.fc_down.bias": lambda d, k, kv, f: (d,)}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes of the GPT-2-style model the course runs.

    Defaults are the article's (S1): 8 layers, d_model=512, 8 heads of d_head=64 (so
    k = n_heads · d_head = 512), FFN hidden 4 · 512 = 2048. ``n_kv_heads``: grouped-query attention's K/V
    heads, dividing ``n_heads`` (None: ``n_heads``, GPT-2's multi-head attention). ``vocab_size`` is GPT-2's;
    ``max_position`` covers the 10,000-token request of claim C1. ``dtype`` is the
    dtype ``init_weights`` creates; a built model's dtype is its weights' (``model.to(...)``).
    The TP size is not a size of the model: it is an argument of what runs it
    (``Transformer(group=...)``, ``TPRuntime(world_size=2)``, ``Engine(tp_size=2)``).

    Frozen and hashable: a cache keys on the config itself (``functools.cache``); vary one with
    ``dataclasses.replace(cfg, ...)``. ``n_kv_heads`` is resolved when the config is made, so
    ``replace(cfg, n_heads=16)`` keeps the old config's resolved ``n_kv_heads`` (8 from the default):
    pass ``n_kv_heads`` too (``None`` again means "as many as n_heads").
    """

    n_layers: int = 8
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int | None = None
    d_head: int = 64
    d_ffn: int = 2048
    vocab_size: int = 50257
    max_position: int = 16384
    dtype: torch.dtype = field(default=torch.float32)
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "d_head", "d_ffn", "vocab_size", "max_position"):
            check_int(f"ModelConfig.{name}", getattr(self, name), 1)
        object.__setattr__(self, "n_kv_heads", check_n_kv_heads("ModelConfig.n_kv_heads", self.n_kv_heads, self.n_heads))
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"ModelConfig.layer_norm_eps must be a float in (0, 1), got {eps!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"ModelConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")

    @property
    def qkv_dim(self) -> int:
        """k = n_heads · d_head, the width of Q (and of the attention output)."""
        return self.n_heads * self.d_head

    @property
    def kv_dim(self) -> int:
        """n_kv_heads · d_head, the width of K (and of V): ``qkv_dim`` without grouped-query attention."""
        return self.n_kv_heads * self.d_head

    def heads_per_rank(self, tp_size: int) -> int:
        """The query heads each of ``tp_size`` ranks owns (``tp_size`` must split the heads, K/V heads and FFN)."""
        check_tp_divides(self, "tp_size", tp_size)
        return self.n_heads // tp_size

    @property
    def all_reduces_per_forward(self) -> int:
        """Two row-parallel layers per block (attention out proj, FFN-down): 2 · n_layers."""
        return 2 * self.n_layers

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every full (unsharded) weight: ``{"wte": (vocab, d), ..., "layers.0.attn.qkv.weight": (k + 2·kv, d), ...}``.

        These are the names of ``Transformer.state_dict()`` at TP=1, of ``init_weights`` and of
        ``hf.full_weights_from_hf``: one format everywhere weights are taken.
        """
        d, k, kv, f = self.d_model, self.qkv_dim, self.kv_dim, self.d_ffn
        shapes = {"wte": (self.vocab_size, d), "wpe": (self.max_position, d)}
        for i in range(self.n_layers):
            shapes |= {f"layers.{i}.{name}": shape(d, k, kv, f) for name, shape in _BLOCK.items()}
        return shapes | {"ln_f.weight": (d,), "ln_f.bias": (d,)}


def as_config(cfg) -> ModelConfig:
    """``None`` → the article's ``ModelConfig()``; anything else must be a ModelConfig."""
    if cfg is None:
        return ModelConfig()
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    return cfg
