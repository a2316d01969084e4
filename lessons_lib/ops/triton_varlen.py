"""Varlen attention forward in Triton: every request of a flat batch in ONE kernel launch.

The article's loop over requests (``for i in range(R): s, e = cu_seqlens[i], cu_seqlens[i+1]; ...``)
moves inside the GPU: the launch grid is ``(⌈max_seqlen_q / BLOCK_M⌉, H, R)``, one program per
(query tile, head, request). Program ``(m, h, r)`` reads its request's boundaries from
``cu_seqlens_q[r], cu_seqlens_q[r+1]`` (and ``cu_seqlens_k``), returns at once if its tile starts
past the request's end, else loads its ``[BLOCK_M, D]`` query tile and walks the request's keys
``BLOCK_N`` at a time with FlashAttention's online softmax: a running row max ``m`` and row sum
``l`` (fp32) rescale the partial output whenever the max grows, so the ``[L_q × L_k]`` score matrix
never exists. With ``causal`` the walk stops at the diagonal (bottom-right aligned when L_k > L_q).

The fast paths of Triton's fused-attention tutorial, each visible in the counters or the compiled code:
scores are scaled by ``softmax_scale · log2(e)`` once, so the loop exponentiates with ``exp2`` (the
GPU's ``ex2`` instruction, no multiply before it); the key walk has two stages, the key tiles every
row of the query tile sees whole first, WITHOUT a mask, then only the diagonal tiles and a last
partial tile with it (``masked_tiles`` counts them); ``return_lse`` also stores each row's
log-sum-exp. Token index × row stride is computed in 64 bits (a fused QKV's rows pass 2³¹ elements
long before the tokens do); offsets within one tile stay 32-bit.

Grouped-query attention (k, v with ``H_kv`` heads, ``G = H / H_kv``) in two layouts: per head, program
``(m, h, r)`` reads K/V head ``h // G``; packed (FlashAttention 3's ``pack_gqa``, vLLM's grid per K/V
head), program ``(m, h_kv, r)`` takes ``BLOCK_M`` (token, query head) rows of one K/V head's group, so
each K/V tile is loaded once for the whole group (``tiling.predict_work`` counts both).

Tile sizes: on CUDA from ``CUDA_TILES``, one row per GPU generation and head-dim class, each entry
compiled for sm_80 / sm_90 without a GPU by ``ops.compile_report`` (no register spill, shared memory
within the block limit); fp16/bf16 only on CUDA, as FlashAttention. Under the interpreter 64 × 64.

Where it runs: natively on an NVIDIA GPU; on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, set here before Triton is imported when no GPU is present). The
interpreter executes the same source program by program with NumPy — about 10–30 ms per program — so on
the CPU it is for small sizes (a lesson, the tests), never chosen by ``auto``.

Half precision: on a GPU ``tl.dot`` multiplies fp16/bf16 tiles and accumulates in fp32. The
interpreter's ``tl.dot`` on bf16 operands is wrong, so under the interpreter the tiles are upcast
to fp32 first (``UPCAST``); the output is stored in q's dtype either way.

Taught in notebooks/07_inside_the_kernel.ipynb.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated: before the @triton.jit below

import triton  # after TRITON_INTERPRET
import triton.language as tl

from ..validate import check_int, check_varlen_args, lengths
from . import tiling
from .tiling import FIELDS, WorkCounts

Tensor = torch.Tensor
BLOCK_M, BLOCK_N = 64, 64    # the interpreter's tiles (the lessons' counts); CUDA_TILES below on a GPU
LOG2E = 1.4426950408889634   # scores are scaled by softmax_scale · log2(e) so the kernel exponentiates with exp2
MAX_HEAD_DIM = 256
# Triton decides at its own import whether its language runs interpreted; a CPU-only process that
# imported it before TRITON_INTERPRET was set cannot run kernels at all.
INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"
COMPILE_ONLY = os.environ.get("TRITON_INTERPRET") == "0"  # set by ops.compile_report: builds for a GPU, launches nothing
if not INTERPRETED and not torch.cuda.is_available() and not COMPILE_ONLY:
    raise ImportError("triton was imported before TRITON_INTERPRET=1 was set and there is no GPU: import lessons_lib "
                      "before triton (or torch.nn.attention.varlen), or set TRITON_INTERPRET=1 in the environment")


@triton.jit
def _varlen_fwd_kernel(Q, K, V, Out, LSE, CU_Q, CU_K, COUNTS, qk_scale,
                       stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                       stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
                       HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PACK_GQA: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                       RETURN_LSE: tl.constexpr, COUNT: tl.constexpr, UPCAST: tl.constexpr):
    m_block, head, req = tl.program_id(0), tl.program_id(1), tl.program_id(2)   # head: a K/V head with PACK_GQA
    q_start = tl.load(CU_Q + req)
    len_q = tl.load(CU_Q + req + 1) - q_start
    k_start = tl.load(CU_K + req)
    len_k = tl.load(CU_K + req + 1) - k_start
    rows_q = len_q * GROUP if PACK_GQA else len_q          # PACK_GQA: a row is a (token, query head of the group) pair
    if COUNT:                                              # count_work: programs launched
        tl.atomic_add(COUNTS + 0, 1)
    if m_block * BLOCK_M >= rows_q:                        # the grid is sized by the longest request
        if COUNT:                                          # count_work: returned at once (its own slot stays -1)
            tl.atomic_add(COUNTS + 1, 1)
        return

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)     # rows of this tile, within the request
    if PACK_GQA:                                           # K/V head `head` serves query heads head·G .. head·G + G-1
        tok = offs_m // GROUP
        q_head = head * GROUP + offs_m % GROUP
        kv_head = head
    else:                                                  # query head `head` reads K/V head head // G
        tok = offs_m
        q_head = head
        kv_head = head // GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < rows_q
    d_ok = offs_d < HEAD_DIM
    # 64-bit offsets: a token index times a row stride can pass 2**31 elements (offsets within a tile stay 32-bit)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + q_head * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running row max of the scores (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running row sum of 2^(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)        # running sum of 2^(score - m_i) · v

    # Keys this tile reads: [0, hi). Key tiles below `lo` are seen whole by every row: no mask.
    if CAUSAL:                                             # token t sees keys j <= t + len_k - len_q
        if PACK_GQA:
            hi = tl.minimum(len_k, tl.cdiv(tl.minimum((m_block + 1) * BLOCK_M, rows_q), GROUP) + len_k - len_q)
        else:
            hi = tl.minimum(len_k, tl.minimum((m_block + 1) * BLOCK_M, len_q) + len_k - len_q)
        lo = tl.minimum(len_k, (m_block * BLOCK_M) // (GROUP if PACK_GQA else 1) + 1 + len_k - len_q)
    else:
        hi = len_k
        lo = len_k
    hi = tl.maximum(hi, 0)
    lo = lo // BLOCK_N * BLOCK_N
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    k_offs = offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd   # [BLOCK_D, BLOCK_N]: K tile, transposed
    v_offs = offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd   # [BLOCK_N, BLOCK_D]
    tiles, cells, masked = 0, 0, 0                         # count_work: key tiles, in-bounds cells, masked tiles
    for stage in tl.static_range(2):  # 0: tiles below the diagonal, no mask; 1: the diagonal and a last partial tile
        for start_n in range(0 if stage == 0 else lo, lo if stage == 0 else hi, BLOCK_N):
            cols = start_n + offs_n
            col_ok = cols < len_k
            first = (k_start + start_n).to(tl.int64)                      # the tile's first key row
            k = tl.load(K + first * stride_kt + k_offs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(V + first * stride_vt + v_offs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, k) * qk_scale                                   # [BLOCK_M, BLOCK_N] fp32 scores · log2(e)
            if stage == 1:
                allowed = col_ok[None, :]
                if CAUSAL:
                    allowed = allowed & (cols[None, :] <= tok[:, None] + (len_k - len_q))
                s = tl.where(allowed, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)        # a row with no key yet: 2^-inf = 0
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)                                 # rescales what was summed under the old max
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
            if COUNT:                                                     # count_work: this key tile
                tiles += 1
                cells += tl.sum((row_ok[:, None] & col_ok[None, :]).to(tl.int32))
                masked += stage

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]                  # a row that sees no key: zeros
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + q_head * stride_oh
    tl.store(Out + o_rows[:, None] + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:                                                        # natural log; -inf for a row with no key
        tl.store(LSE + q_head.to(tl.int64) * stride_lh + q_start + tok, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    if COUNT:                                                             # count_work: the launch's totals (FIELDS)
        tl.atomic_add(COUNTS + 2, tiles)
        tl.atomic_add(COUNTS + 3, tl.cdiv(len_k, BLOCK_N) - tiles)       # key tiles skipped above the diagonal
        tl.atomic_add(COUNTS + 4, cells)
        tl.atomic_add(COUNTS + 5, masked)
        tl.store(COUNTS + 6 + m_block + tl.num_programs(0) * (head + tl.num_programs(1) * req), tiles)  # its own slot


class _Counter:
    """The buffer a launch adds its work into while ``count_work`` is active."""

    def __init__(self):
        self.buffers: list[Tensor] = []
        self.blocks: set[tuple[int, int]] = set()


_ACTIVE: list[_Counter] = []


@contextmanager
def count_work() -> Iterator[WorkCounts]:
    """Count the work of every launch inside the block (opt-in: atomics into a 5-slot int64 buffer,
    and each program's own key tiles, or -1 if it returned at once, into ``program_tiles``).

    Yields a ``WorkCounts`` filled in when the block ends (one device read then). All launches
    inside must use the same tile sizes.
    """
    counter, result = _Counter(), WorkCounts()
    _ACTIVE.append(counter)
    try:
        yield result
    finally:
        _ACTIVE.remove(counter)
    if len(counter.blocks) > 1:
        raise ValueError(f"count_work saw launches with different tile sizes {sorted(counter.blocks)}")
    host = [b.cpu() for b in counter.buffers]
    totals = torch.stack([b[:len(FIELDS)] for b in host]).sum(0).tolist() if host else [0] * len(FIELDS)
    for name, value in zip(FIELDS, totals):
        setattr(result, name, int(value))
    result.program_tiles = tuple(tuple(int(x) for x in b[len(FIELDS):]) for b in host)
    result.block_m, result.block_n = next(iter(counter.blocks), (0, 0))


class _LaunchCounter:
    """Stands in for the JIT function: records the grid of every ``kernel[grid](...)`` and forwards it."""

    def __init__(self, fn, grids: list):
        self.fn, self.grids = fn, grids

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.fn[grid]


@contextmanager
def count_launches() -> Iterator[list[tuple[int, int, int]]]:
    """Record every launch of the kernel inside the block: yields the list of their grids.

    The launcher looks ``_varlen_fwd_kernel`` up at call time, so the block wraps whatever kernel
    is installed when it starts (the real one, or one a lesson rebuilt with a line changed).
    """
    global _varlen_fwd_kernel
    real, grids = _varlen_fwd_kernel, []
    _varlen_fwd_kernel = _LaunchCounter(real, grids)
    try:
        yield grids
    finally:
        _varlen_fwd_kernel = real


def _check_block(name: str, value) -> int:
    n = check_int(name, value, 16, 256)
    if n & (n - 1):
        raise ValueError(f"{name} must be a power of two in [16, 256] (tl.dot's tile), got {n}")
    return n


class LaunchConfig(NamedTuple):
    """One launch's tile sizes and Triton options."""

    block_m: int      # rows of a query tile (tokens, or (token, query head) pairs with pack_gqa)
    block_n: int      # keys of a key tile
    num_warps: int
    num_stages: int   # software-pipelining depth of the key loop (shared-memory buffers for K and V)


# fp16/bf16 on CUDA: (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU generation (sm_80: A100; sm_90: H100,
# H200, and newer) and head-dim class (BLOCK_D: the head dim rounded up to a power of two). Each entry compiles
# without a register spill and within the generation's shared memory per block (tests/test_triton_compile.py
# compiles every one for both layouts, causal and not; ops.compile_report prints the table).
CUDA_TILES: dict[int, dict[int, tuple[int, int, int, int]]] = {
    80: {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 8, 3), 128: (128, 32, 8, 3), 256: (64, 32, 8, 2)},
    90: {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)},
}
CUDA_DTYPES = (torch.float16, torch.bfloat16)


def block_d(head_dim: int) -> int:
    """The head dim rounded up to a power of two, at least 16 (``tl.dot``'s smallest K): the kernel's ``BLOCK_D``."""
    return max(16, triton.next_power_of_2(head_dim))


def launch_config(head_dim: int, dtype: torch.dtype, arch: int | None, block_m: int | None = None,
                  block_n: int | None = None) -> LaunchConfig:
    """The launch for ``head_dim``, ``dtype`` on GPU generation ``arch`` (compute capability as 80, 86, 90, ...;
    None: Triton's interpreter, which keeps the lessons' 64 x 64 tiles). Explicit ``block_m``/``block_n`` win.
    On CUDA only float16 and bfloat16 are taken (as FlashAttention): fp32 tiles spill registers and, at
    head dim 128, need more shared memory than an A100 gives a block."""
    if arch is None:
        return LaunchConfig(block_m or BLOCK_M, block_n or BLOCK_N, 4, 1)
    if dtype not in CUDA_DTYPES:
        raise ValueError(f"the triton kernel on CUDA takes float16 or bfloat16 (as FlashAttention), got "
                         f"{str(dtype).removeprefix('torch.')}; float32 runs on the CPU, under Triton's interpreter")
    if arch < 80:
        raise ValueError(f"the triton kernel needs compute capability >= sm80 (A100, H100, H200), got sm{arch}")
    bm, bn, warps, stages = CUDA_TILES[90 if arch >= 90 else 80][block_d(head_dim)]
    return LaunchConfig(block_m or bm, block_n or bn, warps, stages)


@functools.cache
def _arch(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def kernel_constexprs(head_dim: int, dtype: torch.dtype, config: LaunchConfig, *, group: int, pack_gqa: bool,
                      causal: bool, return_lse: bool, count: bool) -> dict:
    """The kernel's compile-time arguments for one launch (shared by the launcher and ``ops.compile_report``)."""
    return dict(HEAD_DIM=head_dim, GROUP=group, PACK_GQA=pack_gqa, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                BLOCK_D=block_d(head_dim), CAUSAL=causal, RETURN_LSE=return_lse, COUNT=count,
                UPCAST=INTERPRETED and dtype != torch.float32)


def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float | None = None, causal: bool = True, *,
               block_m: int | None = None, block_n: int | None = None, pack_gqa: bool | None = None,
               return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """One launch, no checks (the per-layer call: inputs already validated, nothing waits for the device).

    Arguments as ``triton_varlen_attention``. ``max_seqlen_k`` is not needed by the grid (keys are
    walked, not launched over); it is accepted for ``flash_attn_varlen_func``'s signature and read
    by ``pack_gqa=None``'s choice.
    """
    t_q, h, d = q.shape
    group = h // k.shape[1]
    config = launch_config(d, q.dtype, _arch(q.device), block_m, block_n)
    block_m = config.block_m
    pack = tiling.choose_pack_gqa(max_seqlen_q, max_seqlen_k, group, block_m, config.block_n, bool(causal)) \
        if pack_gqa is None else bool(pack_gqa)
    out = torch.empty_like(q)
    lse = torch.empty((h, t_q), dtype=torch.float32, device=q.device) if return_lse else None
    if t_q == 0:
        return (out, lse) if return_lse else out
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    r = cu_seqlens_q.shape[0] - 1
    if pack:   # one program per (tile of (token, query head) rows, K/V head, request)
        grid = (triton.cdiv(max_seqlen_q * group, block_m), k.shape[1], r)
    else:      # one program per (query tile, query head, request)
        grid = (triton.cdiv(max_seqlen_q, block_m), h, r)
    counting = bool(_ACTIVE)
    # counting: the totals (zeros), then one slot per program (its key tiles; -1 stays if it returned at once)
    counts = torch.cat([torch.zeros(len(FIELDS), dtype=torch.int64, device=q.device),
                        torch.full((grid[0] * grid[1] * grid[2],), -1, dtype=torch.int64, device=q.device)]) \
        if counting else cu_seqlens_q
    _varlen_fwd_kernel[grid](q, k, v, out, cu_seqlens_q if lse is None else lse, cu_seqlens_q, cu_seqlens_k, counts,
                             scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                             0 if lse is None else lse.stride(0),
                             **kernel_constexprs(d, q.dtype, config, group=group, pack_gqa=pack, causal=bool(causal),
                                                 return_lse=return_lse, count=counting),
                             num_warps=config.num_warps, num_stages=config.num_stages)
    if counting:
        for counter in _ACTIVE:
            counter.buffers.append(counts)
            counter.blocks.add((block_m, config.block_n))
    return (out, lse) if return_lse else out


def triton_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None,
                            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                            softmax_scale: float | None = None, causal: bool = True, *,
                            block_m: int | None = None, block_n: int | None = None, pack_gqa: bool | None = None,
                            return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``flash_attn_varlen_func``'s contract, in one Triton launch.

    q: ``[T_q, H, D]``; k, v: ``[T_k, H_kv, D]`` with ``H % H_kv == 0`` (grouped-query attention: query
    head h reads K/V head ``h // (H / H_kv)``; H_kv = H is multi-head, H_kv = 1 multi-query). One dtype,
    one device: float16 or bfloat16 on CUDA (sm80+), also float32 on the CPU under Triton's interpreter.
    Read through their strides: views of a fused QKV output need no copy. D any size up to 256 (padded
    to a power of two inside the kernel, masked).
    cu_seqlens_q, cu_seqlens_k: ``[R+1]`` int32 on q's device; request r owns query rows
    ``[cu_seqlens_q[r], cu_seqlens_q[r+1])`` and key rows ``[cu_seqlens_k[r], cu_seqlens_k[r+1])``.
    max_seqlen_q: sizes the grid (default: the longest request); max_seqlen_k: checked like
    FlashAttention's (an upper bound).
    causal: query i of a request sees keys ``j <= i + L_k - L_q`` (bottom-right, FlashAttention >= 2.1);
    a query that sees no key gets zeros. softmax_scale: default ``1 / sqrt(D)``.
    block_m, block_n: query and key tile sizes, powers of two in [16, 256] (default: ``launch_config``'s,
    64 x 64 under the interpreter).
    pack_gqa: the GQA layout. False: one program per (query tile, query head), grid
    ``(⌈max_seqlen_q / block_m⌉, H, R)``; True: one program per (tile of (token, query head) rows, K/V head)
    (FlashAttention 3's ``pack_gqa``), grid ``(⌈max_seqlen_q · G / block_m⌉, H_kv, R)``, each K/V tile
    loaded once for the group; None: the layout ``tiling.choose_pack_gqa`` predicts loads fewer K/V tiles.
    return_lse: also return the log-sum-exp of each row's scaled scores (natural log), ``[H, T_q]``
    float32 (FlashAttention's varlen ``softmax_lse``; -inf for a row that sees no key).
    Returns ``[T_q, H, D]`` in q's dtype on q's device (and the lse). Bad input raises ValueError naming it,
    as ``varlen_attention`` does (the checks are the same).
    """
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    cu_q, cu_k = check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    if q.dtype not in (torch.float32, *CUDA_DTYPES):
        raise ValueError(f"the triton kernel takes float32, float16 or bfloat16, got {str(q.dtype).removeprefix('torch.')}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the triton kernel takes head dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise ValueError("the triton kernel got CPU tensors but Triton is not in interpreter mode "
                         "(TRITON_INTERPRET=1 must be set before triton is imported)")
    block_m = None if block_m is None else _check_block("block_m", block_m)
    block_n = None if block_n is None else _check_block("block_n", block_n)
    return varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q or max(lengths(cu_q), default=0),
                      max_seqlen_k or max(lengths(cu_k), default=0), softmax_scale, causal, block_m=block_m,
                      block_n=block_n, pack_gqa=pack_gqa, return_lse=return_lse)
