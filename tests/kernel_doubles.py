"""Contract doubles of the two CUDA varlen kernels, so their call sites run on the CPU in CI.

Each double has the real function's signature, refuses every call the real kernel refuses
(half precision only, last dim contiguous, int32 ``cu_seqlens`` on q's device, ``max_seqlen``
Python ints, head dim <= 256 and a multiple of 8, K/V row counts that agree, K/V heads dividing the
query heads: grouped-query attention, as the real kernels take it) and computes the
answer with ``attention_ref`` (bottom-right causal when ``seqlen_q != seqlen_k``, as
FlashAttention >= 2.1 and PyTorch's ``window_size=(-1, 0)``).

``install()`` puts them in ``lessons_lib.core.kernels.KERNELS`` for the CPU and CUDA: the
model's, the engine's and the TP worker's ``flash`` / ``torch_varlen`` paths then run here.
A spawned TP worker installs them when ``LESSONS_TEST_HOOK=kernel_doubles``
(``helpers.install_in_children``: tests/hooks/sitecustomize.py imports this module at start-up).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from lessons_lib.core import kernels
from lessons_lib.core.attention import attention_ref


class ContractError(RuntimeError):
    """A call the real kernel would refuse (the real ones raise RuntimeError from C++)."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ContractError(what)


def _check(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(t.dtype in (torch.float16, torch.bfloat16), f"{name} must be fp16 or bf16, got {t.dtype}")
        _require(t.dim() == 3, f"{name} must be [total, heads, head_dim], got {tuple(t.shape)}")
        _require(t.stride(-1) == 1, f"{name} must have a contiguous last dimension")
    _require(q.dtype == k.dtype == v.dtype, "q, k, v must share a dtype")
    _require(q.shape[-1] <= 256 and q.shape[-1] % 8 == 0, f"head_dim {q.shape[-1]} unsupported (<= 256, multiple of 8)")
    _require(k.shape == v.shape and q.shape[-1] == k.shape[-1], "k, v shapes disagree with q")
    _require(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
             "Number of heads in key/value must divide number of heads in query")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _require(isinstance(cu, torch.Tensor) and cu.dtype == torch.int32, f"{name} must be an int32 tensor")
        _require(cu.device == q.device, f"{name} must be on q's device {q.device}, got {cu.device}")
        _require(cu.is_contiguous(), f"{name} must be contiguous")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        _require(type(m) is int, f"{name} must be a Python int, got {type(m).__name__}")
    _require(cu_q.numel() == cu_k.numel(), "cu_seqlens_q and cu_seqlens_k must have the same length")
    lens_q, lens_k = cu_q.diff(), cu_k.diff()
    _require(int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0], "cu_seqlens must end at the row counts")
    _require(int(lens_q.max()) <= max_q and int(lens_k.max()) <= max_k, "max_seqlen below the longest request")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2.x's ``flash_attn_varlen_func``."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _require(dropout_p == 0.0 and window_size == (-1, -1) and alibi_slopes is None, "inference call expected")
    out = attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale)
    return out.to(q.dtype)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """PyTorch >= 2.10's ``torch.nn.attention.varlen.varlen_attn`` (causal as ``window_size=(-1, 0)``)."""
    _check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    _require(enable_gqa or key.shape[1] == query.shape[1], "fewer K/V heads than query heads needs enable_gqa=True")
    _require(tuple(window_size) in ((-1, -1), (-1, 0)), f"window_size {window_size}: full or causal expected")
    causal = tuple(window_size) == (-1, 0)
    return attention_ref(query, key, value, cu_seq_q, cu_seq_k, causal=causal, softmax_scale=scale).to(query.dtype)


def varlen_attn_is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """An earlier ``varlen_attn`` signature: ``is_causal`` and no ``scale``."""
    _check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    return attention_ref(query, key, value, cu_seq_q, cu_seq_k, causal=is_causal).to(query.dtype)


def install(torch_varlen=varlen_attn) -> None:
    """Put the doubles in ``KERNELS`` for the CPU and CUDA (the real requirements otherwise)."""
    for name, fn in (("flash", flash_attn_varlen_func), ("torch_varlen", torch_varlen)):
        kernels.KERNELS[name] = dataclasses.replace(kernels.KERNELS[name], module=__name__, names=(fn.__name__,),
                                                    devices=("cpu", "cuda"))


if os.environ.get("LESSONS_TEST_HOOK") == __name__:
    install()
