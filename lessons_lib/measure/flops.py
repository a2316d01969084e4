"""Exact work accounting: attention score cells (counted, ``attention_cells``, and cell by cell,
``attention_cell_grid``), forward FLOPs and bytes, arithmetic intensity, the block's linear layers' shapes
on one rank (``linear_shapes``: one function for every lesson), and a decode step part by part on a
machine's roofline (``decode_step_parts``, ``min_decode_batch``).

Conventions (stated once, used everywhere):
- A "cell" is one entry of one head's ``Q K^T`` score matrix in one layer. Counts are per
  head per layer unless a function says otherwise.
- ``causal=False`` counts whole diagonal blocks (the article's convention, C8: A=10, B=30 →
  useful 10² + 30² = 1000). ``causal=True`` counts only the lower triangle ``L(L+1)/2`` as
  useful; padded and masked still compute their full squares, varlen computes the triangles.
- A matmul ``[m, k] @ [k, n]`` is ``2·m·k·n`` FLOPs. Attention per cell per head: ``2·d_head``
  for ``QK^T`` and ``2·d_head`` for ``P @ V``. Softmax, LayerNorm and GeLU are not counted
  (O(T·d), small next to the matmuls). Nor is the LM head, which is not small: O(T·d·V) if run on
  all T rows, O(R·d·V) as the engine runs it (the R last tokens only, outside "the forward" counted
  here); one row ``[1, 512] @ [512, 50257]`` is 51.5 MFLOP, more than the 8 blocks' linear layers
  per token (50.3 MFLOP).
- Grouped-query attention (``n_kv_heads`` < ``n_heads``; every ``n_kv_heads=None`` means the config's own
  ``cfg.n_kv_heads``, which is ``n_heads`` for the course's model): the
  queries keep ``n_heads`` heads, K and V have ``n_kv_heads``, each shared by ``n_heads / n_kv_heads``
  query heads. The score work is unchanged (every query head computes its own cells); the K and V
  projections and the KV bytes shrink by the group factor.
- Bytes (``forward_bytes``): each operand moved once, no cache reuse. A linear layer moves its weight
  once per forward plus its input and output rows; a fused varlen attention kernel (FlashAttention's
  kind, no score matrix in memory) reads Q, K, V and writes O once per layer.

Taught in notebooks/03_masked_vs_varlen_attention.ipynb and notebooks/05_flop_regimes.ipynb.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..core.config import ModelConfig
from ..validate import check_choice, check_int, check_lengths, check_n_kv_heads, check_tp_divides
from .search import first_where

if TYPE_CHECKING:
    from .machines import Machine

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


@dataclass(frozen=True, slots=True)
class AttentionWaste:
    """Score cells per head per layer by why they were computed: ``useful`` (the mask keeps them), ``causal``
    (inside a request's own block, above its causal diagonal: computed, then masked), ``outside`` (outside every
    request's block: padding's pad cells, masking's cross-request cells); ``computed`` is their sum."""
    computed: int
    useful: int
    causal: int
    outside: int


def attention_waste(seq_lens: Sequence[int], method: str, causal: bool = False,
                    whole_blocks: bool = False) -> AttentionWaste:
    """``attention_cells``' computed cells split into useful, causally masked and outside the blocks.
    ``whole_blocks`` (causal varlen only): each request's whole block computed and its upper triangle masked
    (a per-request loop), not the lower triangles only (an ideal causal kernel), as in ``attention_cell_grid``."""
    lens = check_lengths(seq_lens)
    useful = attention_cells(lens, method, causal).useful
    inside = useful if method == "varlen" and causal and not whole_blocks else sum(n * n for n in lens)
    computed = inside if method == "varlen" else attention_cells(lens, method).computed
    return AttentionWaste(computed, useful, inside - useful, computed - inside)


def attention_cell_grid(seq_lens: Sequence[int], method: str, causal: bool = False,
                        whole_blocks: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Cell by cell, what ``attention_cells`` counts: bool ``(useful, computed)``, each ``[n, n]``, one head's score
    matrix in one layer (query rows down, key rows across). ``masked`` and ``varlen``: ``n = T = Σ L_i``, the flat
    rows; ``padded``: ``n = R·Lmax``, the R ``[Lmax, Lmax]`` matrices along the diagonal. ``whole_blocks`` (causal
    varlen only): each request's whole block computed, its upper triangle masked (a per-request loop) instead of
    the lower triangles only (an ideal causal kernel)."""
    lens = np.asarray(check_lengths(seq_lens), dtype=np.int64)
    _method(method)
    if method == "padded":
        lmax = int(lens.max())
        idx = np.arange(len(lens) * lmax)
        rid, pos = idx // lmax, idx % lmax
        real = pos < lens[rid]
    else:
        rid = np.repeat(np.arange(len(lens)), lens)
        pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        real = np.ones_like(rid, dtype=bool)
    same = rid[:, None] == rid[None, :]
    useful = same & real[:, None] & real[None, :]
    if causal:
        useful &= pos[:, None] >= pos[None, :]
    computed = {"padded": same, "masked": np.ones_like(same), "varlen": same if whole_blocks else useful}[method]
    return useful, computed


def executed_tokens(seq_lens: Sequence[int], method: str) -> int:
    """Rows the linear layers process: padded runs ``R · Lmax``, flat methods ``Σ L_i``."""
    lens = check_lengths(seq_lens)
    return len(lens) * max(lens, default=0) if _method(method) == "padded" else sum(lens)


def _with_kv_heads(cfg: ModelConfig, n_kv_heads: int | None) -> ModelConfig:
    """``cfg`` with ``n_kv_heads`` K/V heads (a positive int dividing ``cfg.n_heads``), or ``cfg`` itself when None."""
    if n_kv_heads is None:
        return cfg
    return dataclasses.replace(cfg, n_kv_heads=check_n_kv_heads("n_kv_heads", n_kv_heads, cfg.n_heads))


LINEAR_LAYERS = ("QKV", "out proj", "FFN-up", "FFN-down")  # linear_shapes' order (the block's qkv, out_proj, fc_up, fc_down)


def linear_shapes(cfg: ModelConfig, tp_size: int = 1) -> tuple[tuple[int, int], ...]:
    """``(d_in, d_out)`` of one block's four linear layers on ONE rank under TP=``tp_size``, in ``LINEAR_LAYERS``'
    order: QKV ``(d_model, (H + 2·H_kv)·d_head / tp)``, out proj ``(H·d_head / tp, d_model)``, FFN-up
    ``(d_model, d_ffn / tp)``, FFN-down ``(d_ffn / tp, d_model)``: the engine's cut (QKV and FFN-up split their
    outputs, out proj and FFN-down their inputs). With more ranks than K/V heads each rank holds one K/V head
    (vLLM's replication), so QKV is wider than ``1 / tp`` of the whole. ``tp_size`` must split ``cfg``'s heads,
    K/V heads and FFN (``validate.check_tp_divides``)."""
    tp = check_int("tp_size", tp_size, 1)
    check_tp_divides(cfg, "tp_size", tp)
    d, f, q = cfg.d_model, cfg.d_ffn, cfg.qkv_dim // tp
    kv = max(cfg.n_kv_heads // tp, 1) * cfg.d_head
    return ((d, q + 2 * kv), (q, d), (d, f // tp), (f // tp, d))


def linear_terms(cfg: ModelConfig, tp_size: int = 1) -> tuple[int, int]:
    """``(W, A)`` of one block's four linear layers on one rank (``linear_shapes``): ``W = Σ d_in·d_out`` weight
    numbers, ``A = Σ (d_in + d_out)`` input and output numbers per row."""
    shapes = linear_shapes(cfg, tp_size)
    return sum(a * b for a, b in shapes), sum(a + b for a, b in shapes)


def linear_flops_per_token(cfg: ModelConfig, n_kv_heads: int | None = None) -> int:
    """FLOPs of the four matmuls of all layers for ONE token (whole model, all ranks): 2 per weight,
    ``2 · (d·3k + k·d + d·f + f·d)`` per layer without grouped-query attention."""
    return cfg.n_layers * 2 * sum(a * b for a, b in linear_shapes(_with_kv_heads(cfg, n_kv_heads)))


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
                  useful_only: bool = False, n_kv_heads: int | None = None) -> ForwardFlops:
    """FLOPs of one whole forward (all layers, all heads, all ranks).

    ``method`` says what is executed (padded rows and masked cells included); with
    ``useful_only=True`` only the work a request really needs is counted. ``n_kv_heads``: grouped-query
    attention (K/V projections shrink; attention's FLOPs do not change).
    """
    cells = attention_cells(seq_lens, method, causal)
    rows = sum(check_lengths(seq_lens)) if useful_only else executed_tokens(seq_lens, method)
    return flops_of(cfg, rows, cells.useful if useful_only else cells.computed, n_kv_heads=n_kv_heads)


def flops_of(cfg: ModelConfig, rows: int, cells: int, n_kv_heads: int | None = None) -> ForwardFlops:
    """FLOPs of one whole forward that runs ``rows`` rows through the linear layers and computes
    ``cells`` score cells (per head per layer) in attention: ``forward_flops``'s arithmetic."""
    linear = rows * linear_flops_per_token(cfg, n_kv_heads)
    attention = cfg.n_layers * cfg.n_heads * cells * 4 * cfg.d_head
    return ForwardFlops(linear, attention)


def attention_crossover_length(cfg: ModelConfig, causal: bool = False) -> int:
    """The smallest request length L at which attention's FLOPs reach the linear layers' in one forward
    (``forward_flops``, varlen; the share does not depend on how many requests of that length): 6·d_model whole
    blocks, 12·d_model - 1 causal, for a block of 4·d_model² + 2·d_model·d_ffn weights with d_ffn = 4·d_model."""
    def reached(n: int) -> bool:
        f = forward_flops(cfg, [n], "varlen", causal)
        return f.attention >= f.linear
    return first_where(reached, 1, 1 << 40)


def linear_intensity(num_tokens: int, d_in: int, d_out: int, bytes_per_element: int = 4) -> float:
    """FLOP per byte of ``[T, d_in] @ [d_in, d_out]``: the weight is read once for all T tokens (C13).

    ``2·T·d_in·d_out / (bytes · (d_in·d_out + T·d_in + T·d_out))``; grows with T, then
    saturates near ``2·d_in·d_out / (bytes·(d_in + d_out))``.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    flops = 2 * num_tokens * d_in * d_out
    return flops / (bytes_per_element * (d_in * d_out + num_tokens * d_in + num_tokens * d_out))


def decode_attention_intensity(kv_len: int, d_head: int, bytes_per_element: int = 2, group: int = 1) -> float:
    """FLOP per byte of one request's decode attention on one K/V head, ``group`` query heads as the rows of
    each matmul (``Q K^T`` ``[G, D] @ [D, L_kv]``, ``P V`` ``[G, L_kv] @ [L_kv, D]``) (C15).

    ``2·G·L·D`` FLOPs over ``bytes·(G·D + L·D + G·L)`` bytes per matmul: about 1 FLOP/byte in bf16 without
    grouped-query attention (G = 1), whatever L is; a little under G with one K/V head per G query heads.
    """
    n, d, g = (check_int(name, x, 1) for name, x in (("kv_len", kv_len), ("d_head", d_head), ("group", group)))
    return 2 * g * n * d / (_bytes_per_element(bytes_per_element) * (g * d + n * d + g * n))


@dataclass(frozen=True, slots=True)
class ForwardBytes:
    linear: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.attention


def _bytes_per_element(nbytes: int) -> int:
    if isinstance(nbytes, bool) or nbytes not in (1, 2, 4, 8):
        raise ValueError(f"bytes_per_element must be 1, 2, 4 or 8, got {nbytes!r}")
    return nbytes


def forward_bytes(cfg: ModelConfig, seq_lens: Sequence[int], n_kv_heads: int | None = None,
                  bytes_per_element: int = 2) -> ForwardBytes:
    """Bytes one whole varlen forward moves (all layers), each operand once, no cache reuse.

    Linear, per layer: the four weights once + every flat row's input and output of each layer.
    Attention, per layer (a fused kernel: scores never in memory): Q and O, ``T·k`` numbers each,
    K and V, ``T·n_kv_heads·d_head`` each, with T = Σ L_i.
    """
    t = sum(check_lengths(seq_lens))
    nb = _bytes_per_element(bytes_per_element)
    cfg = _with_kv_heads(cfg, n_kv_heads)
    shapes = linear_shapes(cfg)
    linear = sum(a * b for a, b in shapes) + t * sum(a + b for a, b in shapes)
    attention = t * (2 * cfg.qkv_dim + 2 * cfg.kv_dim)
    return ForwardBytes(cfg.n_layers * nb * linear, cfg.n_layers * nb * attention)


def kv_cache_bytes(cfg: ModelConfig, seq_lens: Sequence[int], n_kv_heads: int | None = None,
                   bytes_per_element: int = 2) -> int:
    """Bytes of the K and V a forward leaves for decode: every token, every layer, K and V,
    ``n_kv_heads · d_head`` numbers each."""
    t = sum(check_lengths(seq_lens))
    return cfg.n_layers * 2 * t * _with_kv_heads(cfg, n_kv_heads).kv_dim * _bytes_per_element(bytes_per_element)


def roofline_seconds(flops: float, nbytes: float, peak_flops: float, bytes_per_s: float) -> float:
    """The roofline's time for one kernel: the longer of its arithmetic at peak and its bytes at full
    bandwidth, ``max(flops / peak, bytes / bandwidth)``."""
    if not (peak_flops > 0 and bytes_per_s > 0):
        raise ValueError(f"peak_flops and bytes_per_s must be > 0, got {peak_flops!r}, {bytes_per_s!r}")
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and nbytes must be >= 0, got {flops!r}, {nbytes!r}")
    return max(flops / peak_flops, nbytes / bytes_per_s)


@dataclass(frozen=True, slots=True)
class RooflinePart:
    """One part of a step (a kernel, or a group of them) on a machine's roofline: ``flops``, ``bytes`` moved,
    ``intensity`` (FLOP/byte), ``seconds`` (``roofline_seconds``) and ``bound``: ``"compute-bound"`` when the
    intensity reaches the machine's ridge, else ``"memory-bound"``."""

    flops: float
    bytes: float
    intensity: float
    seconds: float
    bound: str


def roofline_part(flops: float, nbytes: float, peak_flops: float, bytes_per_s: float) -> RooflinePart:
    """``flops`` over ``nbytes`` (> 0) on the roofline of ``peak_flops`` FLOP/s and ``bytes_per_s``."""
    if not nbytes > 0:
        raise ValueError(f"nbytes must be > 0 (intensity is FLOPs per byte), got {nbytes!r}")
    seconds = roofline_seconds(flops, nbytes, peak_flops, bytes_per_s)
    intensity = flops / nbytes
    bound = "compute-bound" if intensity >= peak_flops / bytes_per_s else "memory-bound"
    return RooflinePart(flops, nbytes, intensity, seconds, bound)


def block_linear_intensity(cfg: ModelConfig, rows: int, bytes_per_element: int = 2) -> float:
    """FLOP per byte of one block's four linear layers on ``rows`` rows, weights, input rows and output rows each
    moved once (C13, C15): ``2·rows·W / (bytes·(W + rows·A))`` (``linear_terms``). Prefill: rows = T flat tokens;
    a decode step: rows = R requests."""
    r = check_int("rows", rows, 1)
    w, a = linear_terms(cfg)
    return 2 * r * w / (_bytes_per_element(bytes_per_element) * (w + r * a))


def min_decode_batch(cfg: ModelConfig, ridge: float, bytes_per_element: int = 2) -> int | None:
    """The smallest number of requests R whose decode step's linear layers (``block_linear_intensity``, rows = R)
    reach ``ridge`` FLOP/byte, or None: the intensity only approaches ``2W / (bytes·A)``."""
    if not 0 < ridge < math.inf:
        raise ValueError(f"ridge must be a positive finite FLOP/byte, got {ridge!r}")
    return first_where(lambda r: block_linear_intensity(cfg, r, bytes_per_element) >= ridge, 1, 1 << 40)


def linear_ridge_tokens(cfg: ModelConfig, ridge: float, tp_size: int = 1, bytes_per_element: int = 2,
                        limit: int = 1 << 16) -> dict[str, int | None]:
    """For each of one rank's linear layers (``LINEAR_LAYERS``, ``linear_shapes`` under TP=``tp_size``): the fewest
    tokens a forward needs for its ``linear_intensity`` to reach ``ridge`` FLOP/byte, or None if it does not up to
    ``limit`` tokens (a layer with a small side saturates below the ridge, whatever the tokens)."""
    if not 0 < ridge < math.inf:
        raise ValueError(f"ridge must be a positive finite FLOP/byte, got {ridge!r}")
    nb, top = _bytes_per_element(bytes_per_element), check_int("limit", limit, 1)
    return {name: first_where(lambda n, a=a, b=b: linear_intensity(n, a, b, nb) >= ridge, 1, top)
            for name, (a, b) in zip(LINEAR_LAYERS, linear_shapes(cfg, tp_size))}


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One layer of a decode step, each part on its own roofline (``decode_step_parts``)."""

    linear: RooflinePart
    attention: RooflinePart

    @property
    def seconds(self) -> float:
        """The two parts one after the other."""
        return self.linear.seconds + self.attention.seconds

    @property
    def longer(self) -> str:
        """``"attention"`` when the KV read takes longer than the linear layers, else ``"linear"``."""
        return "attention" if self.attention.seconds > self.linear.seconds else "linear"


def decode_step_parts(cfg: ModelConfig, requests: int, kv_len: int, machine: Machine,
                      bytes_per_element: int = 2) -> DecodeStep:
    """Per layer, a decode step of R = ``requests`` requests with ``kv_len`` cached tokens each (no grouped-query
    attention), each part on ``machine``'s roofline (``Machine.roofline_part``): the linear layers, ``2·R·W``
    FLOPs over ``bytes·(W + R·A)`` (``linear_terms``); attention, per request ``4·k·kv_len`` FLOPs (k =
    ``cfg.qkv_dim``) over ``bytes·2k·(1 + kv_len)``: the query and output, the cached K and V."""
    r, n = check_int("requests", requests, 1), check_int("kv_len", kv_len, 1)
    nb = _bytes_per_element(bytes_per_element)
    w, a = linear_terms(cfg)
    k = cfg.qkv_dim
    return DecodeStep(machine.roofline_part(2 * r * w, nb * (w + r * a)),
                      machine.roofline_part(r * 4 * k * n, nb * r * 2 * k * (1 + n)))


def prefill_attention_intensity(cfg: ModelConfig, seq_lens: Sequence[int], n_kv_heads: int | None = None,
                                bytes_per_element: int = 2) -> float:
    """FLOP per byte of one forward's causal prefill attention as a fused kernel runs it: ``forward_flops``' causal
    attention FLOPs over ``forward_bytes``' attention bytes (Q, K, V, O once): a token-weighted mean over the
    requests, ``(L + 1) / 4`` for one request without grouped-query attention in bf16."""
    f = forward_flops(cfg, seq_lens, "varlen", causal=True, n_kv_heads=n_kv_heads)
    return f.attention / forward_bytes(cfg, seq_lens, n_kv_heads, bytes_per_element).attention


def gqa_intensity_ceiling(cfg: ModelConfig) -> float:
    """The most one K/V head can raise prefill attention's intensity over ``n_heads`` K/V heads: ``2k / (k + d_head)``
    (k = ``cfg.qkv_dim``; Q and O keep every head), under 2 whatever the group."""
    return 2 * cfg.qkv_dim / (cfg.qkv_dim + cfg.d_head)


def gqa_heads_for_ridge(cfg: ModelConfig, seq_lens: Sequence[int], ridge: float) -> int | None:
    """The largest ``n_kv_heads`` (a divisor of ``cfg.n_heads``) whose causal prefill attention
    (``prefill_attention_intensity``, bf16) reaches ``ridge`` FLOP/byte, or None."""
    fits = [kv for kv in range(1, cfg.n_heads + 1)
            if cfg.n_heads % kv == 0 and prefill_attention_intensity(cfg, seq_lens, kv) >= ridge]
    return max(fits, default=None)


def most_compute_bound_requests(cfg: ModelConfig, total: int, n_kv_heads: int, ridge: float,
                                min_len: int = 16) -> int | None:
    """The most requests (each at least ``min_len`` tokens, ``total`` in all) whose causal prefill attention
    (``prefill_attention_intensity``, bf16) reaches ``ridge``, or None: one long request and the rest at
    ``min_len`` (the largest sum of L² for a count), grown while it holds."""
    t = check_int("total", total, check_int("min_len", min_len, 1))
    best = None
    for n in range(1, t // min_len + 1):
        if prefill_attention_intensity(cfg, [t - (n - 1) * min_len] + [min_len] * (n - 1), n_kv_heads) < ridge:
            break
        best = n
    return best


def decode_kv_overtakes_from(cfg: ModelConfig, ridge: float, bytes_per_element: int, kv_len: int) -> int | None:
    """The smallest R from which a decode step's attention takes longer than its linear layers (``decode_step_parts``,
    each part on a roofline of ridge ``ridge``, time in bytes / bandwidth: ``max(FLOPs / ridge, bytes)``), or None.
    Per request attention takes ``a = max(4kn / ridge, nbytes·2k(n + 1))``; it is longer iff ``a > 2W / ridge`` (the
    compute-bound linear layers' time per request) and ``R (a - nbytes·A) > nbytes·W`` (``linear_terms``)."""
    from fractions import Fraction
    w, a_rows = linear_terms(cfg)
    k, n, nb = cfg.qkv_dim, check_int("kv_len", kv_len, 1), _bytes_per_element(bytes_per_element)
    if not 0 < ridge < math.inf:
        raise ValueError(f"ridge must be a positive finite FLOP/byte, got {ridge!r}")
    rho = Fraction(ridge).limit_denominator(10**6)
    a = max(Fraction(4 * k * n) / rho, Fraction(nb * 2 * k * (n + 1)))
    if a <= 2 * w / rho or a <= nb * a_rows:
        return None
    return math.floor(nb * w / (a - nb * a_rows)) + 1


GPU_TILE = 128  # rows and columns of one thread block's output tile: a GEMM's, and FlashAttention's query tile


def gemm_thread_blocks(rows: int, d_out: int, tile: int = GPU_TILE) -> int:
    """Thread blocks of a ``[rows, d_in] @ [d_in, d_out]`` GEMM with ``tile x tile`` output tiles (no split-K)."""
    return -(-check_int("rows", rows, 1) // tile) * -(-check_int("d_out", d_out, 1) // tile)


def attention_thread_blocks(seq_lens: Sequence[int], n_heads: int, tile: int = GPU_TILE) -> int:
    """Thread blocks of a varlen FlashAttention forward: one per ``tile`` queries of one request and one head."""
    return check_int("n_heads", n_heads, 1) * sum(-(-n // tile) for n in check_lengths(seq_lens))


@dataclass(frozen=True, slots=True)
class GpuVerdict:
    """A roofline ``part`` on a GPU, with what binds before it: ``blocks`` thread blocks on ``machine.n_sms`` SMs
    (fewer blocks than SMs: at most that share of the peak and bandwidth) and ``kernels`` launches of
    ``machine.launch_s`` each. ``seconds``: the longest of the roofline time stretched by occupancy and the
    launches; ``binds``: ``"launch latency"``, ``"occupancy"`` or the part's own bound."""

    part: RooflinePart
    blocks: int
    kernels: int
    n_sms: int
    launch_s: float

    @property
    def occupancy(self) -> float:
        return min(1.0, self.blocks / self.n_sms)

    @property
    def seconds(self) -> float:
        return max(self.part.seconds / self.occupancy, self.kernels * self.launch_s)

    @property
    def binds(self) -> str:
        if self.kernels * self.launch_s >= self.part.seconds / self.occupancy:
            return "launch latency"
        return "occupancy" if self.occupancy < 1 else self.part.bound

    def __str__(self) -> str:
        return (f"{self.part.bound} by the roofline ({self.part.intensity:.1f} FLOP/B): {self.part.seconds * 1e6:.3g} us; "
                f"{self.blocks} thread blocks for {self.n_sms} SMs, {self.kernels} launch{'es' * (self.kernels > 1)} "
                f"of {self.launch_s * 1e6:.3g} us: {self._first} binds first, at least {self.seconds * 1e6:.3g} us")

    @property
    def _first(self) -> str:  # a bound reads "the roofline (compute-bound)"
        return self.binds if self.binds in ("launch latency", "occupancy") else f"the roofline ({self.binds})"


def gpu_verdict(flops: float, nbytes: float, machine: Machine, blocks: int, kernels: int = 1) -> GpuVerdict:
    """``flops`` over ``nbytes`` on ``machine``'s roofline, run as ``kernels`` launches of ``blocks`` thread blocks
    in all (``gemm_thread_blocks``, ``attention_thread_blocks``); ``machine`` must give ``n_sms`` and ``launch_s``."""
    if machine.n_sms is None or machine.launch_s is None:
        raise ValueError(f"{machine.name}: a GPU verdict needs the machine's n_sms and launch_s")
    return GpuVerdict(machine.roofline_part(flops, nbytes), check_int("blocks", blocks, 1),
                      check_int("kernels", kernels, 1), machine.n_sms, machine.launch_s)


def decode_step_verdicts(cfg: ModelConfig, requests: int, kv_len: int, machine: Machine,
                         bytes_per_element: int = 2) -> tuple[GpuVerdict, GpuVerdict]:
    """``decode_step_parts``' (linear, attention), per layer, as ``gpu_verdict``s on ``machine``: the linear layers as
    one GEMM launch per layer of ``linear_shapes`` (``gemm_thread_blocks`` of R rows each), attention as one launch
    of one thread block per request and query head."""
    p = decode_step_parts(cfg, requests, kv_len, machine, bytes_per_element)
    shapes = linear_shapes(cfg)
    blocks = sum(gemm_thread_blocks(requests, d_out) for _, d_out in shapes)
    return (gpu_verdict(p.linear.flops, p.linear.bytes, machine, blocks, kernels=len(shapes)),
            gpu_verdict(p.attention.flops, p.attention.bytes, machine, requests * cfg.n_heads))
