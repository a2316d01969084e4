"""Variable-length ("varlen") attention over a flat token stream, with interchangeable backends.

Layout is FlashAttention's: ``q, k, v`` are ``[total_tokens, n_heads, d_head]``; request i
owns rows ``[cu_seqlens[i], cu_seqlens[i+1])`` (int32, ``[R+1]``). The output has q's shape
and dtype. ``cu_seqlens`` is the only request-aware input (claim C10).

Backends (``available_backends(device)`` says which run here and why not):

=============  ==============================================================  ==========
name           what it computes                                                 score cells
=============  ==============================================================  ==========
loop           the article's loop: per request ``Q_i K_i^T`` → softmax → ``@V_i``  Σ L_i²
masked         full ``[T, T]`` scores + block-diagonal mask (the naive fix)      T²
padded         pad to ``[R, Lmax]``, key-padding mask, unpad                     R·Lmax²
sdpa           per-request ``F.scaled_dot_product_attention`` on 4-D views       Σ L_i²
flex           FlexAttention with a document mask (eager; a teaching backend)    block-sparse
flash          ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16)           Σ L_i²
torch_varlen   ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16)       Σ L_i²
=============  ==============================================================  ==========

Causal masking with ``L_k > L_q`` is aligned bottom-right (query i sees keys up to
``i + L_k - L_q``), as in FlashAttention >= 2.1. ``L_k < L_q`` with ``causal=True`` is rejected.

Taught in notebooks/03_masked_vs_varlen_attention.ipynb.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .batch import validate_cu_seqlens

Tensor = torch.Tensor

BACKENDS = ("loop", "masked", "padded", "sdpa", "flex", "flash", "torch_varlen")
# Fastest first; "auto" takes the first that runs for the device and dtype.
# On the CPU the per-request SDPA loop was 39x faster than masked and 57x faster than
# padded on a long-tailed batch (shared/course/PLATFORM-NOTES.md); flex is never auto.
_AUTO_ORDER = {"cuda": ("flash", "torch_varlen", "sdpa"), "cpu": ("sdpa",)}
_PURE = ("loop", "masked", "padded", "sdpa")


class BackendStatus(NamedTuple):
    available: bool
    reason: str


@functools.cache
def _flash_attn_func():
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore
    except Exception as exc:  # ImportError, or a CUDA library missing at import
        return None, f"flash-attn not importable ({type(exc).__name__}: {exc}); pip install -r requirements-gpu.txt on a CUDA machine"
    return flash_attn_varlen_func, "flash-attn installed"


@functools.cache
def _torch_varlen_func():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:
        return None, f"torch.nn.attention.varlen not in torch {torch.__version__} ({type(exc).__name__})"
    return varlen_attn, "torch.nn.attention.varlen.varlen_attn present"


@functools.cache
def _flex_func():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as exc:
        return None, f"FlexAttention not in torch {torch.__version__} ({type(exc).__name__})"
    return (flex_attention, create_block_mask), "FlexAttention present (eager: correct but slow)"


def available_backends(device="cpu", dtype: torch.dtype = torch.float32) -> dict[str, BackendStatus]:
    """Which backends run on ``device`` for ``dtype``, and why the others do not."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    half = dtype in (torch.float16, torch.bfloat16)
    out = {name: BackendStatus(True, "pure PyTorch, any device") for name in ("loop", "masked", "padded")}
    out["sdpa"] = BackendStatus(True, "F.scaled_dot_product_attention per request (4-D views)")
    fn, why = _flex_func()
    out["flex"] = BackendStatus(fn is not None, why)
    for name, probe in (("flash", _flash_attn_func), ("torch_varlen", _torch_varlen_func)):
        fn, why = probe()
        if fn is None:
            out[name] = BackendStatus(False, why)
        elif not cuda:
            out[name] = BackendStatus(False, f"CUDA only (device is {device.type})")
        elif not torch.cuda.is_available():
            out[name] = BackendStatus(False, "CUDA not available")
        elif not half:
            out[name] = BackendStatus(False, f"needs float16/bfloat16, got {str(dtype).replace('torch.', '')}")
        else:
            out[name] = BackendStatus(True, why)
    return out


def resolve_backend(backend: str, device="cpu", dtype: torch.dtype = torch.float32) -> str:
    """Map ``"auto"`` to the fastest available backend; reject unknown or unavailable names."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {('auto',) + BACKENDS}")
    if backend in _PURE:
        return backend  # pure PyTorch: runs anywhere, no need to probe optional kernels
    if backend == "auto":
        kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
        if kind == "cpu":
            return _AUTO_ORDER["cpu"][0]
        status = available_backends(device, dtype)
        return next(b for b in _AUTO_ORDER[kind] if b in _PURE or status[b].available)
    status = available_backends(device, dtype)
    if not status[backend].available:
        raise RuntimeError(f"attention backend {backend!r} is not available here: {status[backend].reason}")
    return backend


def block_diag_mask(cu_seqlens: Tensor, causal: bool = False, cu_seqlens_k: Tensor | None = None) -> Tensor:
    """Bool ``[T_q, T_k]``: True where query row may attend key column (same request, causal if asked)."""
    cu_q = validate_cu_seqlens(cu_seqlens)
    cu_k = cu_q if cu_seqlens_k is None else validate_cu_seqlens(cu_seqlens_k, name="cu_seqlens_k")
    if len(cu_k) != len(cu_q):
        raise ValueError(f"cu_seqlens_k has {len(cu_k) - 1} requests, cu_seqlens_q has {len(cu_q) - 1}")
    mask = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool, device=cu_seqlens.device)
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        mask[cu_q[i]:cu_q[i + 1], cu_k[i]:cu_k[i + 1]] = _local_mask(lq, lk, causal, cu_seqlens.device)
    return mask


def _local_mask(lq: int, lk: int, causal: bool, device) -> Tensor:
    """``[lq, lk]`` bool; causal aligned bottom-right."""
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)


def _all_finite(t: Tensor) -> bool:
    # NaN and ±Inf propagate through a sum, so a finite sum proves every element finite in one
    # vectorised pass (isfinite().all() was ~70x slower on the CPU: 3-5 % of a whole forward).
    # A non-finite sum can also be an overflow of finite values: then look element by element.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [total_tokens, n_heads, d_head], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if not (q.device == k.device == v.device == cu_seqlens_q.device == cu_seqlens_k.device):
        raise ValueError(f"q, k, v, cu_seqlens must be on one device, got q:{q.device} k:{k.device} "
                         f"v:{v.device} cu_seqlens_q:{cu_seqlens_q.device} cu_seqlens_k:{cu_seqlens_k.device}")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"q, k, v must have the same n_heads, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"q, k, v must have the same d_head, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same total_tokens, got {k.shape[0]} and {v.shape[0]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # A dense backend multiplies masked probabilities (0) by every value row, and
        # 0 * NaN = NaN: one request's NaN would leak into the others. Refuse it up front.
        if t.device.type != "meta" and t.numel() and not _all_finite(t):
            row = int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0, 0])
            raise ValueError(f"{name} contains NaN or Inf (first at row {row})")
    cu_q = validate_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = validate_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} requests but cu_seqlens_k has {len(cu_k) - 1}")
    lens_q = [cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)]
    lens_k = [cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)]
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, lens_q), ("max_seqlen_k", max_seqlen_k, lens_k)):
        if given is None:
            continue
        if isinstance(given, bool) or not isinstance(given, int):
            raise ValueError(f"{name} must be an int, got {given!r}")
        if given < max(lens):
            # A kernel sized by a too-small max_seqlen would silently drop rows: refuse.
            raise ValueError(f"{name}={given} is smaller than the longest request ({max(lens)})")
    if causal:
        for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
            if lk < lq:
                raise ValueError(f"causal attention needs L_k >= L_q, request {i} has L_q={lq}, L_k={lk}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite float, got {softmax_scale!r}")
    return cu_q, cu_k, lens_q, lens_k


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, *, causal: bool = True,
                     softmax_scale: float | None = None, backend: str = "auto") -> Tensor:
    """Attention of each request over its own tokens only.

    q: ``[T_q, H, D]``, k, v: ``[T_k, H, D]`` (same dtype and device).
    cu_seqlens_q / cu_seqlens_k: int32 ``[R+1]``; ``cu_seqlens_k`` defaults to ``cu_seqlens_q``.
    max_seqlen_q / max_seqlen_k: optional upper bounds (as in FlashAttention); smaller than
    the real maximum is an error, never a truncation.
    softmax_scale: defaults to ``1 / sqrt(D)``.
    Returns ``[T_q, H, D]`` in q's dtype.
    """
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    cu_q, cu_k, lens_q, lens_k = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, causal, softmax_scale)
    name = resolve_backend(backend, q.device, q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    return _IMPLS[name](q, k, v, cu_q, cu_k, lens_q, lens_k, causal, scale)


def _loop(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, scale):
    out = torch.empty_like(q)
    for i in range(len(lens_q)):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qe == qs:
            continue
        q_i, k_i, v_i = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)  # [H, L, D]
        scores = (q_i @ k_i.transpose(1, 2)) * scale  # [H, L_q, L_k]: only this request's block
        if causal:
            scores.masked_fill_(~_local_mask(qe - qs, ke - ks, True, q.device), float("-inf"))
        out[qs:qe] = (scores.softmax(dim=-1) @ v_i).transpose(0, 1)  # written into its own slice
    return out


def _masked(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, scale):
    mask = block_diag_mask(torch.tensor(cu_q, dtype=torch.int32, device=q.device), causal,
                           torch.tensor(cu_k, dtype=torch.int32, device=q.device))  # [T_q, T_k]
    scores = (q.transpose(0, 1) @ k.permute(1, 2, 0)) * scale  # [H, T_q, T_k]: every cell, cross-request too
    scores.masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # a query with no key (empty k segment) → zero row
    return (probs @ v.transpose(0, 1)).transpose(0, 1).contiguous()


def _pad_heads(x, cu, lens, lmax):
    out = x.new_zeros(len(lens), lmax, *x.shape[1:])  # [R, Lmax, H, D]
    for i, n in enumerate(lens):
        out[i, :n] = x[cu[i]:cu[i + 1]]
    return out


def _padded(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, scale):
    lq, lk = max(lens_q), max(lens_k)
    qp = _pad_heads(q, cu_q, lens_q, lq).transpose(1, 2)  # [R, H, Lq, D]
    kp = _pad_heads(k, cu_k, lens_k, lk).transpose(1, 2)
    vp = _pad_heads(v, cu_k, lens_k, lk).transpose(1, 2)
    scores = (qp @ kp.transpose(-1, -2)) * scale  # [R, H, Lq, Lk]: pad rows and columns computed too
    allowed = torch.zeros(len(lens_q), lq, lk, dtype=torch.bool, device=q.device)
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        allowed[i, :nq, :nk] = _local_mask(nq, nk, causal, q.device)
    scores.masked_fill_(~allowed[:, None], float("-inf"))
    outp = (scores.softmax(dim=-1).nan_to_num(0.0) @ vp).transpose(1, 2)  # [R, Lq, H, D]
    return torch.cat([outp[i, :n] for i, n in enumerate(lens_q)]) if lens_q else q.new_empty(q.shape)


def _sdpa(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, scale):
    out = torch.empty_like(q)
    for i in range(len(lens_q)):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qe == qs:
            continue
        # 4-D [1, H, L, D] views: on the CPU a 3-D call silently takes the slow math kernel.
        q_i, k_i, v_i = (t.transpose(0, 1).unsqueeze(0) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        if causal and (qe - qs) != (ke - ks):
            o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=_local_mask(qe - qs, ke - ks, True, q.device),
                                               scale=scale)
        else:
            o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=causal, scale=scale)
        out[qs:qe] = o[0].transpose(0, 1)
    return out


def _flex(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, scale):
    (flex_attention, create_block_mask), _ = _flex_func()
    dev = q.device
    doc_q = torch.repeat_interleave(torch.arange(len(lens_q), device=dev), torch.tensor(lens_q, device=dev))
    doc_k = torch.repeat_interleave(torch.arange(len(lens_k), device=dev), torch.tensor(lens_k, device=dev))
    start_q = torch.tensor(cu_q[:-1], device=dev)[doc_q]
    start_k = torch.tensor(cu_k[:-1], device=dev)[doc_k]
    shift = (torch.tensor(lens_k, device=dev) - torch.tensor(lens_q, device=dev))[doc_q]  # bottom-right causal

    def document_mask(b, h, qi, ki):
        same = doc_q[qi] == doc_k[ki]
        if not causal:
            return same
        return same & (ki - start_k[ki] <= qi - start_q[qi] + shift[qi])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager-mode FlexAttention warns that it is unfused
        block_mask = create_block_mask(document_mask, None, None, q.shape[0], k.shape[0], device=dev)
        out = flex_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                             v.transpose(0, 1).unsqueeze(0), block_mask=block_mask, scale=scale)
    return out[0].transpose(0, 1).contiguous()


def _cu(cu, device):
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _flash(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, scale):
    fn, _ = _flash_attn_func()
    return fn(q, k, v, _cu(cu_q, q.device), _cu(cu_k, q.device), max(lens_q), max(lens_k),
              softmax_scale=scale, causal=causal)


def _torch_varlen(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, scale):
    fn, _ = _torch_varlen_func()
    return fn(q, k, v, _cu(cu_q, q.device), _cu(cu_k, q.device), max(lens_q), max(lens_k), scale=scale,
              window_size=(-1, 0) if causal else (-1, -1))


_IMPLS = {"loop": _loop, "masked": _masked, "padded": _padded, "sdpa": _sdpa, "flex": _flex,
          "flash": _flash, "torch_varlen": _torch_varlen}


def attention_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None, *,
                  causal: bool = True, softmax_scale: float | None = None,
                  upcast_dtype: torch.dtype = torch.float32) -> Tensor:
    """Padded reference in ``upcast_dtype`` (fp32 by default, fp64 for tolerance studies).

    Same math as FlashAttention's test reference: pad to ``[R, Lmax]``, mask pad keys (and the
    causal upper triangle), softmax, unpad. Returns ``[T_q, H, D]`` in ``upcast_dtype``.
    """
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    cu_q, cu_k, lens_q, lens_k = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, causal, softmax_scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if q.shape[0] == 0:
        return q.new_empty(q.shape, dtype=upcast_dtype)
    return _padded(q.to(upcast_dtype), k.to(upcast_dtype), v.to(upcast_dtype), cu_q, cu_k, lens_q, lens_k, causal, scale)


def plain_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, softmax_scale: float | None = None) -> Tensor:
    """Attention over ALL rows as if they were one sequence: the wrong answer of claim C7.

    On a flat batch this lets request A's queries read request B's keys.
    """
    t = q.shape[0]
    return varlen_attention(q, k, v, torch.tensor([0, t], dtype=torch.int32, device=q.device), causal=causal,
                            softmax_scale=softmax_scale, backend="sdpa")


def padded_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, *, causal: bool = True,
                     softmax_scale: float | None = None) -> Tensor:
    """Dense attention on a padded batch: ``[R, S, H, D]`` ×3 + ``[R, S]`` bool key mask → ``[R, S, H, D]``.

    Every pad row and column is computed (``R·S²`` cells per head); pad keys are masked out.
    Used by ``Transformer.forward_padded``.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must all be [R, S, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if key_mask.shape != q.shape[:2]:
        raise ValueError(f"key_mask must be [R, S] = {tuple(q.shape[:2])}, got {tuple(key_mask.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = q.shape[1]
    allowed = key_mask[:, None, None, :].expand(-1, 1, s, s)  # [R, 1, S, S]
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) * scale  # [R, H, S, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1).nan_to_num(0.0) @ v.transpose(1, 2)).transpose(1, 2)
