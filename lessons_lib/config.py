"""Model configuration: the article's TP=2 GPT-2-style setup (claim S1).

Taught in notebooks/00_setup_one_request.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class ModelConfig:
    """Sizes of the GPT-2-style model the course runs.

    Defaults are the article's (S1): 8 layers, d_model=512, 8 heads of d_head=64
    (so k = n_heads * d_head = 512), FFN hidden 4 * 512 = 2048, tensor parallel size 2.
    ``vocab_size`` matches GPT-2's tokenizer; ``max_position`` is large enough for the
    10,000-token request of claim C1.
    """

    n_layers: int = 8
    d_model: int = 512
    n_heads: int = 8
    d_head: int = 64
    d_ffn: int = 2048
    vocab_size: int = 50257
    max_position: int = 16384
    tp_size: int = 2
    dtype: torch.dtype = field(default=torch.float32)
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "d_head", "d_ffn", "vocab_size", "max_position", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.tp_size:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} is not divisible by tp_size={self.tp_size}: "
                "each rank must own whole heads")
        if self.d_ffn % self.tp_size:
            raise ValueError(f"ModelConfig.d_ffn={self.d_ffn} is not divisible by tp_size={self.tp_size}")
        if isinstance(self.layer_norm_eps, bool) or not isinstance(self.layer_norm_eps, (int, float)) \
                or not 0 < self.layer_norm_eps < 1:
            raise ValueError(f"ModelConfig.layer_norm_eps must be a float in (0, 1), got {self.layer_norm_eps!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"ModelConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")

    @property
    def qkv_dim(self) -> int:
        """k = n_heads * d_head, the width of Q (and of K, and of V)."""
        return self.n_heads * self.d_head

    @property
    def heads_per_rank(self) -> int:
        return self.n_heads // self.tp_size

    @property
    def all_reduces_per_forward(self) -> int:
        """Two row-parallel layers per block (attention out proj, FFN-down): 2 * n_layers."""
        return 2 * self.n_layers
