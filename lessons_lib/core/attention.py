"""Variable-length ("varlen") attention over a flat token stream, with interchangeable backends.

Layout is FlashAttention's: ``q [total_tokens, n_heads, d_head]``, ``k, v [total_tokens_k, n_kv_heads, d_head]``
(grouped-query attention: query head h reads K/V head ``h // (n_heads / n_kv_heads)``); request i owns
rows ``[cu_seqlens[i], cu_seqlens[i+1])`` (int32, ``[R+1]``). The output has q's shape and dtype.
Besides the rows, the only request-aware inputs are ``cu_seqlens`` and ``max_seqlen`` (claim C10).

=============  ==============================================================  ===========
backend        what it computes                                                 score cells
=============  ==============================================================  ===========
loop           the article's loop: per request ``Q_i K_iᵀ`` → softmax → ``@ V_i``     Σ L_i²
masked         full ``[T, T]`` scores + block-diagonal mask (the naive fix)      T²
padded         pad to ``[R, Lmax]``, key-padding mask, unpad                     R · Lmax²
sdpa           ``F.scaled_dot_product_attention``, equal lengths in one call     Σ L_i²
flex           FlexAttention with a document mask (eager; a teaching backend)    block-sparse
flash          ``flash_attn.flash_attn_varlen_func`` (CUDA sm80+, fp16/bf16)      Σ L_i²
torch_varlen   ``torch.nn.attention.varlen.varlen_attn`` (CUDA sm80+, fp16/bf16)  Σ L_i²
triton         ``ops.triton_varlen``: one launch, tiles (CUDA; CPU interpreter)   whole tiles
=============  ==============================================================  ===========

Causal masking with ``L_k > L_q`` is aligned bottom-right (query i sees keys up to
``i + L_k - L_q``), as in FlashAttention >= 2.1.

``varlen_attention`` is the public entry: it checks everything once (``validate``). A model
builds one ``VarlenMetadata`` per forward and calls ``attention_forward`` in every layer: no
checks and no device sync there. A backend may also be your own function with the whole of
``flash_attn_varlen_func``'s contract: ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, causal=..., softmax_scale=...) -> [T_q, H, D]`` (refused up front if it lacks any of them).

Taught in notebooks/03_masked_vs_varlen_attention.ipynb.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..validate import check_attention_fn, check_padded_qkv, check_varlen_args, lengths, row_starts
from .kernels import kernel, resolve_backend, torch_varlen_kwargs

Tensor = torch.Tensor


@dataclass(slots=True)
class VarlenMetadata:
    """What attention needs to know about a flat batch, built once per forward.

    cu_seqlens_q, cu_seqlens_k: ``[R+1]`` int32 on the device (what a kernel reads).
    max_seqlen_q, max_seqlen_k: Python ints; a kernel sizes its launch grid by them
    (R × ⌈max_seqlen / tile⌉ blocks), never its tiles.
    cu_q, cu_k: the same boundaries as Python lists, for the Python-side loops (no device read).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    cu_q: list
    cu_k: list
    _cache: dict = field(default_factory=dict)

    @classmethod
    def build(cls, cu_q: list[int], cu_k: list[int] | None = None, device="cpu",
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None) -> VarlenMetadata:
        """From host boundaries ``[0, L_0, L_0+L_1, ...]``; the int32 tensors go to ``device``."""
        cu_k = cu_q if cu_k is None else cu_k
        cu_tensor_q = torch.tensor(cu_q, dtype=torch.int32, device=device)
        cu_tensor_k = cu_tensor_q if cu_k is cu_q else torch.tensor(cu_k, dtype=torch.int32, device=device)
        return cls(cu_tensor_q, cu_tensor_k, max_seqlen_q or max(lengths(cu_q), default=0),
                   max_seqlen_k or max(lengths(cu_k), default=0), list(cu_q), list(cu_k))

    def cached(self, key, make):
        """``make()`` once per forward, then reused by every layer (masks, index tensors)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


def causal_mask(lq: int, lk: int, device=None) -> Tensor:
    """``[lq, lk]`` bool, True where query i may see key j: ``j <= i + lk - lq`` (bottom-right)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)


def block_diag_mask(cu_seqlens: Tensor | list, causal: bool = False, cu_seqlens_k: Tensor | list | None = None,
                    device=None) -> Tensor:
    """Bool ``[T_q, T_k]``: True where a query row may attend a key column (same request, causal if asked)."""
    cu_q = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    cu_k = cu_q if cu_seqlens_k is None else (cu_seqlens_k.tolist() if isinstance(cu_seqlens_k, Tensor)
                                              else list(cu_seqlens_k))
    device = cu_seqlens.device if isinstance(cu_seqlens, Tensor) else device
    mask = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool, device=device)
    for i in range(len(cu_q) - 1):
        block = (cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i])
        mask[cu_q[i]:cu_q[i + 1], cu_k[i]:cu_k[i + 1]] = causal_mask(*block, device) if causal else True
    return mask


# ---- backends: (q, k, v, meta, causal, scale) -> out [T_q, H, D]; k, v [T_k, H_kv, D] -----------

def _loop(q, k, v, meta, causal, scale):
    out = torch.empty_like(q)
    for i in range(len(meta.cu_q) - 1):
        qs, qe, ks, ke = meta.cu_q[i], meta.cu_q[i + 1], meta.cu_k[i], meta.cu_k[i + 1]
        q_i, k_i, v_i = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)  # [H, L, D]
        if (g := q.shape[1] // k.shape[1]) > 1:  # GQA packed (FlashAttention-3's pack_gqa): query heads j·G .. j·G + G-1
            q_i = q_i.unflatten(0, (k.shape[1], g)).flatten(1, 2)  # are the rows of ONE matmul on K/V head j: [H_kv, G·L_q, D]
        scores = (q_i @ k_i.transpose(-1, -2)) * scale        # [H, L_q, L_k] (GQA: [H_kv, G·L_q, L_k]): this request only
        if causal:  # GQA: through a view [H_kv, G, L_q, L_k], the mask for each query head of a group
            grouped = scores.unflatten(1, (g, qe - qs)) if g > 1 else scores
            grouped.masked_fill_(~causal_mask(qe - qs, ke - ks, q.device), -math.inf)
        out[qs:qe] = (scores.softmax(dim=-1) @ v_i).reshape(q.shape[1], qe - qs, q.shape[2]).transpose(0, 1)  # its own rows
    return out


def dense_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """The masked and padded backends' attention: ``q [..., H, L_q, D]`` against ``k, v [..., H_kv, L_k, D]``
    (same dtype and device; ``H_kv`` divides ``H``), EVERY score cell computed, the cells ``allowed`` (bool,
    broadcastable to ``[..., H, L_q, L_k]``) does not allow thrown away; a row with no key allowed → zeros.
    Returns ``[..., H, L_q, D]`` in q's dtype. Unchecked (the backends' inner call)."""
    g = q.shape[-3] // k.shape[-3]  # GQA packed: query heads j·G .. j·G + G-1 are the rows of one matmul on K/V head j
    scores = (q.unflatten(-3, (k.shape[-3], g)).flatten(-3, -2) @ k.transpose(-1, -2)) * scale  # [..., H_kv, G·L_q, L_k]
    if g > 1:  # seen as [..., H_kv, G, L_q, L_k]: the mask (its H dimension 1) for each query head of a group
        scores, allowed = scores.unflatten(-2, (g, q.shape[-2])), allowed.unsqueeze(-3) if allowed.dim() > 2 else allowed
    p = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return (p.flatten(-3, -2) @ v).unflatten(-2, (g, q.shape[-2])).flatten(-4, -3) if g > 1 else p @ v


def _masked(q, k, v, meta, causal, scale):
    mask = meta.cached(("mask", causal), lambda: block_diag_mask(meta.cu_q, causal, meta.cu_k, q.device))  # [T_q, T_k]
    out = dense_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale)  # [H, T_q, D]: cross-request too
    return out.transpose(0, 1).contiguous()


def _padded(q, k, v, meta, causal, scale):
    def build():                                                  # lengths + [R, 1, Lq_max, Lk_max] mask
        lens_q, lens_k = lengths(meta.cu_q), lengths(meta.cu_k)
        allowed = torch.zeros(len(lens_q), max(lens_q), max(lens_k), dtype=torch.bool, device=q.device)
        for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            allowed[i, :nq, :nk] = causal_mask(nq, nk, q.device) if causal else True
        return lens_q, lens_k, allowed[:, None]

    def pad(x, cu, lens):                                         # [T, H, D] -> [R, H, Lmax, D]
        out = x.new_zeros(len(lens), max(lens), *x.shape[1:])
        for i, n in enumerate(lens):
            out[i, :n] = x[cu[i]:cu[i + 1]]
        return out.transpose(1, 2)

    lens_q, lens_k, allowed = meta.cached(("padded", causal), build)
    qp, kp, vp = pad(q, meta.cu_q, lens_q), pad(k, meta.cu_k, lens_k), pad(v, meta.cu_k, lens_k)
    outp = dense_attention(qp, kp, vp, allowed, scale).transpose(1, 2)  # [R, Lq, H, D]: pad rows and columns too
    return torch.cat([outp[i, :n] for i, n in enumerate(lens_q)])


def _length_groups(meta) -> list[tuple]:
    """Requests grouped by (L_q, L_k): ``(L_q, L_k, n, q rows, k rows)``; rows are a slice when
    the group's requests sit next to each other in the stream, else an index tensor."""
    groups: dict[tuple, list[int]] = {}
    for i, (lq, lk) in enumerate(zip(lengths(meta.cu_q), lengths(meta.cu_k))):
        if lq:
            groups.setdefault((lq, lk), []).append(i)
    out = []
    for (lq, lk), reqs in groups.items():
        sq, sk, n = [meta.cu_q[i] for i in reqs], [meta.cu_k[i] for i in reqs], len(reqs)
        if sq == list(range(sq[0], sq[0] + n * lq, lq)) and sk == list(range(sk[0], sk[0] + n * lk, lk)):
            out.append((lq, lk, n, slice(sq[0], sq[0] + n * lq), slice(sk[0], sk[0] + n * lk)))
        else:
            dev = meta.cu_seqlens_q.device
            rows_q = (torch.tensor(sq)[:, None] + torch.arange(lq)).flatten().to(dev)  # [n · L_q]
            rows_k = (torch.tensor(sk)[:, None] + torch.arange(lk)).flatten().to(dev)
            out.append((lq, lk, n, rows_q, rows_k))
    return out


def _sdpa(q, k, v, meta, causal, scale):
    out, (h, d), h_kv = torch.empty_like(q), q.shape[1:], k.shape[1]
    gqa = {"enable_gqa": True} if h_kv != h else {}  # only for GQA: MHA keeps its usual CPU kernel
    for lq, lk, n, rows_q, rows_k in meta.cached("groups", lambda: _length_groups(meta)):
        # 4-D [n, H, L, D]: on the CPU a 3-D call silently takes the slow math kernel.
        qg = q[rows_q].view(n, lq, h, d).transpose(1, 2)
        kg, vg = (x[rows_k].view(n, lk, h_kv, d).transpose(1, 2) for x in (k, v))
        mask = causal_mask(lq, lk, q.device) if causal and lq != lk else None
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=causal and lq == lk, scale=scale, **gqa)
        out[rows_q] = o.transpose(1, 2).reshape(n * lq, h, d)
    return out


def _flex(q, k, v, meta, causal, scale):
    flex_attention, create_block_mask = kernel("flex")

    def build():                                                  # the block mask: boundaries only
        dev, lens_q, lens_k = q.device, lengths(meta.cu_q), lengths(meta.cu_k)
        doc_q, doc_k = (torch.arange(len(n), device=dev).repeat_interleave(torch.tensor(n, device=dev)) for n in (lens_q, lens_k))
        start_q, start_k = row_starts(meta.cu_q, dev), row_starts(meta.cu_k, dev)
        shift = (torch.tensor(lens_k, device=dev) - torch.tensor(lens_q, device=dev))[doc_q]  # bottom-right causal

        def document_mask(b, h, qi, ki):
            same = doc_q[qi] == doc_k[ki]
            return same & (ki - start_k[ki] <= qi - start_q[qi] + shift[qi]) if causal else same
        return create_block_mask(document_mask, None, None, q.shape[0], k.shape[0], device=dev)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        block_mask = meta.cached(("flex", causal), build)
        out = flex_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), block_mask=block_mask, scale=scale,
                             enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1).contiguous()


def _varlen_kernel(name: str):
    """A backend for a kernel with ``flash_attn_varlen_func``'s signature (flash, triton)."""
    def run(q, k, v, meta, causal, scale):
        return kernel(name)(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
                            softmax_scale=scale, causal=causal)
    return run


_flash, _triton = _varlen_kernel("flash"), _varlen_kernel("triton")


def _torch_varlen(q, k, v, meta, causal, scale):
    fn = kernel("torch_varlen")
    gqa = k.shape[1] != q.shape[1]
    kw = torch_varlen_kwargs(fn, causal, scale, gqa)
    if gqa and "enable_gqa" not in kw:  # an early signature without GQA: K/V repeated per group
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    if "scale" not in kw:  # an early signature always scales by 1/sqrt(D): fold our scale into q
        q = q * (scale * math.sqrt(q.shape[-1]))
    return fn(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, **kw)


IMPLS = {"loop": _loop, "masked": _masked, "padded": _padded, "sdpa": _sdpa, "flex": _flex, "flash": _flash,
         "torch_varlen": _torch_varlen, "triton": _triton}


def attention_forward(q: Tensor, k: Tensor, v: Tensor, meta: VarlenMetadata, backend, *, causal: bool = True,
              softmax_scale: float | None = None) -> Tensor:
    """The per-layer call: ``q [T_q, H, D]``, ``k, v [T_k, H_kv, D]`` (H_kv divides H) → ``[T_q, H, D]``.

    ``backend`` must already be resolved (``resolve_backend``) and the inputs valid: nothing is
    checked here, so nothing waits for the device. A callable backend (``validate.check_attention_fn``)
    gets the whole contract: ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    causal=causal, softmax_scale=scale)``, the scale as a float (``1 / sqrt(D)`` unless given).
    """
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if callable(backend):
        return backend(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
                       causal=causal, softmax_scale=scale)
    return IMPLS[backend](q, k, v, meta, causal, scale)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, *, causal: bool = True,
                     softmax_scale: float | None = None, backend: str = "auto") -> Tensor:
    """Attention of each request over its own tokens only (``flash_attn_varlen_func``'s contract).

    q: ``[T_q, H, D]``; k, v: ``[T_k, H_kv, D]``, ``H_kv`` dividing ``H`` (see the module doc); one dtype, one device.
    cu_seqlens_q / cu_seqlens_k: ``[R+1]`` int32 on that device; ``cu_seqlens_k`` defaults to ``cu_seqlens_q``.
    max_seqlen_q / max_seqlen_k: optional upper bounds (ints); smaller than the real maximum
    is an error, never a truncation. softmax_scale: defaults to ``1 / sqrt(D)``.
    backend: one of ``kernels.BACKENDS``, ``"auto"``, or your function (see the module doc).
    Returns ``[T_q, H, D]`` in q's dtype, on q's device.
    """
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    cu_q, cu_k = check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale)
    name = check_attention_fn(resolve_backend(backend, q.device, q.dtype, q.shape[-1]))
    meta = VarlenMetadata(cu_seqlens_q, cu_seqlens_k, max_seqlen_q or max(lengths(cu_q)),
                          max_seqlen_k or max(lengths(cu_k)), cu_q, cu_k)
    return attention_forward(q, k, v, meta, name, causal=causal, softmax_scale=softmax_scale)


def attention_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None, *,
                  causal: bool = True, softmax_scale: float | None = None,
                  upcast_dtype: torch.dtype = torch.float32) -> Tensor:
    """FlashAttention's test reference (pad, mask, softmax, unpad) in ``upcast_dtype`` (fp32; fp64 for
    tolerance studies): q ``[T_q, H, D]``, k, v ``[T_k, H_kv, D]`` → ``[T_q, H, D]`` in ``upcast_dtype``."""
    q, k, v = (x.to(upcast_dtype) for x in (q, k, v))
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    cu_q, cu_k = check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, causal, softmax_scale)
    return attention_forward(q, k, v, VarlenMetadata(cu_seqlens_q, cu_seqlens_k, 0, 0, cu_q, cu_k), "padded",
                     causal=causal, softmax_scale=softmax_scale)


def plain_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                    softmax_scale: float | None = None) -> Tensor:
    """Attention over ALL rows as one sequence, the wrong answer of claim C7: A's queries read B's keys."""
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    return varlen_attention(q, k, v, cu, causal=causal, softmax_scale=softmax_scale, backend="sdpa")


def padded_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, *, causal: bool = True,
                     softmax_scale: float | None = None) -> Tensor:
    """Dense attention on a padded batch (``Transformer.forward_padded``): q ``[R, S, H, D]``, k, v ``[R, S, H_kv, D]``,
    ``[R, S]`` bool key mask → ``[R, S, H, D]``. Every pad row and column is computed (``R·S²`` cells per head)."""
    check_padded_qkv(q, k, v, key_mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    allowed = key_mask[:, None, None, :] & (causal_mask(q.shape[1], q.shape[1], q.device) if causal else True)
    out = dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed, scale)  # [R, H, S, D]
    return out.transpose(1, 2)  # [R, S, H, D]
