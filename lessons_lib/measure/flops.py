"""Exact work accounting: attention score cells, forward FLOPs, arithmetic intensity.

Conventions (stated once, used everywhere):
- A "cell" is one entry of one head's ``Q K^T`` score matrix in one layer. Counts are per
  head per layer unless a function says otherwise.
- ``causal=False`` counts whole diagonal blocks (the article's convention, C8: A=10, B=30 →
  useful 10² + 30² = 1000). ``causal=True`` counts only the lower triangle ``L(L+1)/2`` as
  useful; padded and masked still compute their full squares, varlen computes the triangles.
- A matmul ``[m, k] @ [k, n]`` is ``2·m·k·n`` FLOPs. Attention per cell per head: ``2·d_head``
  for ``QK^T`` and ``2·d_head`` for ``P @ V``. Softmax, LayerNorm and GeLU are not counted
  (O(T·d), small next to the matmuls). Nor is the LM head, which is not small: O(R·d·V), one row
  ``[1, 512] @ [512, 50257]`` is 51.5 MFLOP, more than the 8 blocks' linear layers per token
  (50.3 MFLOP); the engine computes it for the R last tokens only, outside "the forward" counted here.

Taught in notebooks/03_masked_vs_varlen_attention.ipynb and notebooks/05_flop_regimes.ipynb.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.config import ModelConfig
from ..validate import check_choice, check_lengths

METHODS = ("padded", "masked", "varlen")


@dataclass(frozen=True, slots=True)
class AttentionCells:
    computed: int
    useful: int
    wasted: int


def _method(method: str) -> str:
    check_choice("method", method, METHODS)
    return method


def attention_cells(seq_lens: Sequence[int], method: str, causal: bool = False) -> AttentionCells:
    """Score cells per head per layer for one batch of requests."""
    lens = check_lengths(seq_lens)
    _method(method)
    useful = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
    if method == "varlen":
        computed = useful
    elif method == "masked":
        computed = sum(lens) ** 2
    else:
        computed = len(lens) * max(lens) ** 2 if lens else 0
    return AttentionCells(computed, useful, computed - useful)


def executed_tokens(seq_lens: Sequence[int], method: str) -> int:
    """Rows the linear layers process: padded runs ``R · Lmax``, flat methods ``Σ L_i``."""
    lens = check_lengths(seq_lens)
    return len(lens) * max(lens, default=0) if _method(method) == "padded" else sum(lens)


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of the four matmuls of all layers for ONE token (whole model, all ranks)."""
    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    return cfg.n_layers * 2 * (d * 3 * k + k * d + d * f + f * d)


@dataclass(frozen=True, slots=True)
class ForwardFlops:
    linear: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.attention

    @property
    def attention_fraction(self) -> float:
        return self.attention / self.total if self.total else 0.0

    @property
    def dominant(self) -> str:
        return "attention" if self.attention > self.linear else "linear"


def forward_flops(cfg: ModelConfig, seq_lens: Sequence[int], method: str = "varlen", causal: bool = False,
                  useful_only: bool = False) -> ForwardFlops:
    """FLOPs of one whole forward (all layers, all heads, all ranks).

    ``method`` says what is executed (padded rows and masked cells included); with
    ``useful_only=True`` only the work a request really needs is counted.
    """
    cells = attention_cells(seq_lens, method, causal)
    rows = sum(check_lengths(seq_lens)) if useful_only else executed_tokens(seq_lens, method)
    return flops_of(cfg, rows, cells.useful if useful_only else cells.computed)


def flops_of(cfg: ModelConfig, rows: int, cells: int) -> ForwardFlops:
    """FLOPs of one whole forward that runs ``rows`` rows through the linear layers and computes
    ``cells`` score cells (per head per layer) in attention: ``forward_flops``'s arithmetic."""
    linear = rows * linear_flops_per_token(cfg)
    attention = cfg.n_layers * cfg.n_heads * cells * 4 * cfg.d_head
    return ForwardFlops(linear, attention)


def linear_intensity(num_tokens: int, d_in: int, d_out: int, bytes_per_element: int = 4) -> float:
    """FLOP per byte of ``[T, d_in] @ [d_in, d_out]``: the weight is read once for all T tokens (C13).

    ``2·T·d_in·d_out / (bytes · (d_in·d_out + T·d_in + T·d_out))``; grows with T, then
    saturates near ``2·d_in·d_out / (bytes·(d_in + d_out))``.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    flops = 2 * num_tokens * d_in * d_out
    return flops / (bytes_per_element * (d_in * d_out + num_tokens * d_in + num_tokens * d_out))


def decode_attention_intensity(kv_len: int, d_head: int, bytes_per_element: int = 2) -> float:
    """FLOP per byte of one decode step's ``q K^T`` for one head: ``[1, D] @ [D, L_kv]`` (C15).

    ``2·L·D`` FLOPs over ``bytes·(L·D + D + L)`` bytes: about 1 FLOP/byte in bf16, whatever L is.
    """
    if kv_len < 1:
        raise ValueError(f"kv_len must be >= 1, got {kv_len}")
    return 2 * kv_len * d_head / (bytes_per_element * (kv_len * d_head + d_head + kv_len))
