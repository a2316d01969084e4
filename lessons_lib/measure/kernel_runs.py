"""The engine's varlen Triton kernel (``ops.triton_varlen``, loaded by ``faults.kernel.kernel_module`` so that its
one-line faults apply) run where it runs: on CUDA in bfloat16, else under Triton's CPU interpreter in float32; its
inputs, its float64 reference pair for the tolerance rule, one launch under its work counters."""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..core.attention import attention_ref
from ..faults import kernel as kernel_faults
from ..ops.tiling import WorkCounts, predict_work
from .profile import random_qkv
from .tolerance import max_abs_diff, tolerance

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kernel_dtype(device) -> torch.dtype:
    """bfloat16 on CUDA (the compiled kernel takes fp16 / bf16 only), float32 elsewhere (Triton's CPU interpreter)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


KERNEL_DTYPE = kernel_dtype(KERNEL_DEVICE)


@functools.cache
def kernel_missing() -> str | None:
    """None where the kernel runs; else one sentence saying why not."""
    try:
        kernel_faults.kernel_module()
    except RuntimeError as exc:
        return (f"{exc}: Triton publishes Linux wheels only (and needs an NVIDIA GPU or its CPU interpreter). The "
                "pictures and predictions (ops.tiling) still run.")
    return None


def kernel_module():
    """``lessons_lib.ops.triton_varlen``, or None where it does not import (see ``kernel_missing``)."""
    return None if kernel_missing() else kernel_faults.kernel_module()


def kernel_qkv(seq_lens: Sequence[int], n_heads: int, d_head: int, *, seq_lens_k: Sequence[int] | None = None,
               seed: int = 0, device=None) -> tuple:
    """``random_qkv`` on ``device`` (default ``KERNEL_DEVICE``) in ``kernel_dtype(device)``: q, k, v ``[T, H, D]`` and
    int32 cu_seqlens (five values with ``seq_lens_k``)."""
    device = KERNEL_DEVICE if device is None else device
    return random_qkv(list(seq_lens), n_heads, d_head, seq_lens_k=None if seq_lens_k is None else list(seq_lens_k),
                      seed=seed, device=device, dtype=kernel_dtype(device))


def kernel_refs(q, k, v, cu_q, cu_k=None, *, causal=True) -> tuple:
    """``attention_ref`` in q's dtype and in float64: the pair the course's tolerance rule takes."""
    return tuple(attention_ref(q, k, v, cu_q, cu_k, causal=causal, upcast_dtype=t) for t in (q.dtype, torch.float64))


def run_kernel(q, k, v, cu_q, cu_k=None, *, causal=True, block_m=64, block_n=64):
    """``triton_varlen_attention`` under ``count_work`` on ``KERNEL_DEVICE``: ``(out [T_q, H, D] in q's dtype on q's
    device, WorkCounts)``. RuntimeError (``kernel_missing``'s sentence) where the kernel does not run."""
    tv = kernel_module()
    if tv is None:
        raise RuntimeError(kernel_missing())
    moved = [None if x is None else x.to(KERNEL_DEVICE) for x in (q, k, v, cu_q, cu_k)]
    with tv.count_work() as counts:
        out = tv.triton_varlen_attention(*moved, causal=causal, block_m=block_m, block_n=block_n)
    return out.to(q.device), counts


def counters_text(w: WorkCounts) -> str:
    """A launch's counters on one line (``masked_tiles`` included, which ``==`` on ``WorkCounts`` leaves out)."""
    return (f"{w.programs} programs, {w.early_exits} exits, {w.tiles} tiles, {w.tiles_skipped} skipped, "
            f"{w.cells:,} cells, {w.masked_tiles} masked")


def causal_counts(lens_q: Sequence[int], lens_k: Sequence[int], block_m: int, block_n: int,
                  max_programs: int) -> WorkCounts:
    """The counters of a causal launch over one head of 16 (queries of ``lens_q``, keys of ``lens_k``): the kernel's
    own where it runs and the launch has at most ``max_programs`` programs, else ``tiling.predict_work``'s."""
    predicted = predict_work(lens_q, lens_k, block_m=block_m, block_n=block_n, causal=True)
    if kernel_module() is None or predicted.programs > max_programs:
        return predicted
    q, _, _, cu_q = kernel_qkv(lens_q, 1, 16, seed=0)
    _, k, v, cu_k = kernel_qkv(lens_k, 1, 16, seed=1)
    return run_kernel(q, k, v, cu_q, cu_k, causal=True, block_m=block_m, block_n=block_n)[1]


def run_layout(lens_q: Sequence[int], lens_k: Sequence[int], n_heads: int, n_kv_heads: int, d_head: int,
               pack_gqa: bool | None, *, block_m: int = 16, block_n: int = 16, causal: bool = True) -> dict:
    """The kernel on ``n_heads`` query heads over ``n_kv_heads`` K/V heads (``kernel_qkv``, k and v cut to their first
    ``n_kv_heads`` heads) in one layout (``pack_gqa``; None: the launcher's pick), under ``count_launches`` and
    ``count_work``: ``{"grid", "packed", "counts", "predicted", "error", "bound"}``: the launch's grid, whether its
    head axis is the K/V heads (packed), the counters, ``tiling.predict_work``'s for that layout, max |out - float64
    reference| and the tolerance rule's bound. RuntimeError where the kernel does not run."""
    tv = kernel_module()
    if tv is None:
        raise RuntimeError(kernel_missing())
    q, k, v, cu_q, cu_k = kernel_qkv(lens_q, n_heads, d_head, seq_lens_k=lens_k)
    k, v = k[:, :n_kv_heads].contiguous(), v[:, :n_kv_heads].contiguous()
    with tv.count_launches() as grids, tv.count_work() as counts:
        out = tv.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, block_m=block_m, block_n=block_n,
                                         pack_gqa=pack_gqa)
    ref, ref64 = kernel_refs(q, k, v, cu_q, cu_k, causal=causal)
    packed = grids[0][1] == n_kv_heads     # the grid's head axis: K/V heads when packed, query heads if not
    predicted = predict_work(lens_q, lens_k, n_heads, n_kv_heads=n_kv_heads, pack_gqa=packed, block_m=block_m,
                             block_n=block_n, causal=causal)
    return {"grid": grids[0], "packed": packed, "counts": counts, "predicted": predicted,
            "error": max_abs_diff(out.cpu(), ref64), "bound": tolerance(ref, ref64)}
