"""Varlen attention forward in Triton: every request of a flat batch in ONE kernel launch.

The article's loop over requests (``for i in range(R): s, e = cu_seqlens[i], cu_seqlens[i+1]; ...``)
moves inside the GPU: the launch grid is ``(⌈max_seqlen_q / BLOCK_M⌉, H, R)``, one program per
(query tile, head, request). Program ``(m, h, r)`` reads its request's boundaries from
``cu_seqlens_q[r], cu_seqlens_q[r+1]`` (and ``cu_seqlens_k``), returns at once if its tile starts
past the request's end, else loads its ``[BLOCK_M, D]`` query tile and walks the request's keys
``BLOCK_N`` at a time with FlashAttention's online softmax: a running row max ``m`` and row sum
``l`` (fp32) rescale the partial output whenever the max grows, so the ``[L_q × L_k]`` score matrix
never exists. With ``causal`` the walk stops at the diagonal (bottom-right aligned when L_k > L_q).

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

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated: before the @triton.jit below

import triton  # after TRITON_INTERPRET
import triton.language as tl

from ..validate import check_int, check_varlen_args, lengths
from .tiling import FIELDS, WorkCounts

Tensor = torch.Tensor
BLOCK_M, BLOCK_N = 64, 64
MAX_HEAD_DIM = 256
# Triton decides at its own import whether its language runs interpreted; a CPU-only process that
# imported it before TRITON_INTERPRET was set cannot run kernels at all.
INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"
if not INTERPRETED and not torch.cuda.is_available():
    raise ImportError("triton was imported before TRITON_INTERPRET=1 was set and there is no GPU: import lessons_lib "
                      "before triton (or torch.nn.attention.varlen), or set TRITON_INTERPRET=1 in the environment")


@triton.jit
def _varlen_fwd_kernel(Q, K, V, Out, CU_Q, CU_K, COUNTS, scale,
                       stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                       stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       CAUSAL: tl.constexpr, COUNT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    m_block, head, req = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(CU_Q + req)
    len_q = tl.load(CU_Q + req + 1) - q_start
    k_start = tl.load(CU_K + req)
    len_k = tl.load(CU_K + req + 1) - k_start
    if COUNT:
        tl.atomic_add(COUNTS + 0, 1)                       # programs launched
    if m_block * BLOCK_M >= len_q:                         # the grid is sized by the longest request
        if COUNT:
            tl.atomic_add(COUNTS + 1, 1)                   # returned at once
            tl.store(COUNTS + 5 + m_block + tl.num_programs(0) * (head + tl.num_programs(1) * req), -1)
        return

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)     # query rows of this tile, within the request
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < len_q
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)          # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running row max of the scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running row sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)        # running Σ exp(score - m_i) · v

    hi = len_k                                             # keys this tile reads: [0, hi)
    if CAUSAL:                                             # last real row r sees keys <= r + len_k - len_q
        hi = tl.minimum(len_k, tl.minimum((m_block + 1) * BLOCK_M, len_q) + len_k - len_q)
    hi = tl.maximum(hi, 0)
    tiles = 0
    cells = 0
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < len_k
        k = tl.load(K + (k_start + cols)[None, :] * stride_kt + head * stride_kh + offs_d[:, None] * stride_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)      # [BLOCK_D, BLOCK_N]: K tile, transposed
        v = tl.load(V + (k_start + cols)[:, None] * stride_vt + head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)      # [BLOCK_N, BLOCK_D]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale              # [BLOCK_M, BLOCK_N] fp32 scores
        else:
            s = tl.dot(q, k) * scale
        allowed = col_ok[None, :]
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= offs_m[:, None] + (len_k - len_q))
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)            # a row with no key yet: exp(-inf) = 0
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)                                      # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        if COUNT:
            tiles += 1
            cells += tl.sum((row_ok[:, None] & col_ok[None, :]).to(tl.int32))  # in-bounds cells of this tile

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]                  # a row that sees no key: zeros
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if COUNT:
        tl.atomic_add(COUNTS + 2, tiles)
        tl.atomic_add(COUNTS + 3, tl.cdiv(len_k, BLOCK_N) - tiles)       # key tiles skipped above the diagonal
        tl.atomic_add(COUNTS + 4, cells)
        tl.store(COUNTS + 5 + m_block + tl.num_programs(0) * (head + tl.num_programs(1) * req), tiles)  # its own


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


def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float | None = None, causal: bool = True, *,
               block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> Tensor:
    """One launch, no checks (the per-layer call: inputs already validated, nothing waits for the device).

    Arguments as ``triton_varlen_attention``. ``max_seqlen_k`` is not needed by the grid (keys are
    walked, not launched over) and is accepted for ``flash_attn_varlen_func``'s signature.
    """
    t_q, h, d = q.shape
    out = torch.empty_like(q)
    if t_q == 0:
        return out
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    r = cu_seqlens_q.shape[0] - 1
    grid = (triton.cdiv(max_seqlen_q, block_m), h, r)
    counting = bool(_ACTIVE)
    # counting: the 5 totals, then one slot per program (its key tiles, -1 if it returned at once)
    counts = torch.zeros(len(FIELDS) + grid[0] * grid[1] * grid[2], dtype=torch.int64, device=q.device) \
        if counting else cu_seqlens_q
    _varlen_fwd_kernel[grid](q, k, v, out, cu_seqlens_q, cu_seqlens_k, counts, scale,
                             *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                             HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
                             CAUSAL=bool(causal), COUNT=counting, UPCAST=INTERPRETED and q.dtype != torch.float32,
                             IEEE=q.dtype == torch.float32)
    if counting:
        for counter in _ACTIVE:
            counter.buffers.append(counts)
            counter.blocks.add((block_m, block_n))
    return out


def triton_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None,
                            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                            softmax_scale: float | None = None, causal: bool = True, *,
                            block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> Tensor:
    """``flash_attn_varlen_func``'s contract, in one Triton launch.

    q: ``[T_q, H, D]``; k, v: ``[T_k, H, D]``; fp32, fp16 or bf16, one dtype, one device (CUDA, or
    the CPU under Triton's interpreter). Read through their strides: views of a fused QKV output
    (last-dim stride 1, row stride 3·H·D) need no copy. D any size up to 256 (padded to a power of
    two inside the kernel, masked).
    cu_seqlens_q, cu_seqlens_k: ``[R+1]`` int32 on q's device; request r owns query rows
    ``[cu_seqlens_q[r], cu_seqlens_q[r+1])`` and key rows ``[cu_seqlens_k[r], cu_seqlens_k[r+1])``.
    max_seqlen_q: sizes the grid ``(⌈max_seqlen_q / block_m⌉, H, R)`` (default: the longest request);
    max_seqlen_k: checked like FlashAttention's (an upper bound), not needed by the grid.
    causal: query i of a request sees keys ``j <= i + L_k - L_q`` (bottom-right, FlashAttention >= 2.1);
    a query that sees no key gets zeros. softmax_scale: default ``1 / sqrt(D)``.
    block_m, block_n: query and key tile sizes, powers of two in [16, 256].
    Returns ``[T_q, H, D]`` in q's dtype on q's device. Bad input raises ValueError naming it, as
    ``varlen_attention`` does (the checks are the same).
    """
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    cu_q, cu_k = check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the triton kernel takes float32, float16 or bfloat16, got {str(q.dtype).removeprefix('torch.')}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the triton kernel takes head dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if q.device.type == "cpu" and not INTERPRETED:
        raise ValueError("the triton kernel got CPU tensors but Triton is not in interpreter mode "
                         "(TRITON_INTERPRET=1 must be set before triton is imported)")
    block_m, block_n = _check_block("block_m", block_m), _check_block("block_n", block_n)
    return varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q or max(lengths(cu_q), default=0),
                      max_seqlen_k or max(lengths(cu_k), default=0), softmax_scale, causal, block_m=block_m, block_n=block_n)
