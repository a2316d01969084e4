"""Faults of the attention layer (``core.attention``, ``core.kernels``): backends, masks, metadata."""
from __future__ import annotations

import torch

from .registry import fault, swap_function, swap_item

AREA = "attention"


def _one_request(lq: int, lk: int, device):
    from ..core.attention import VarlenMetadata
    return VarlenMetadata.build([0, lq], [0, lk], device)


@fault("attention_ignores_cu_seqlens", "every attention backend ignores cu_seqlens: the flat batch is one sequence "
       "of T rows, so a request's queries read the other requests' keys", AREA)
def _ignores_cu_seqlens():
    from ..core import attention
    real = attention.attention_forward

    def attention_forward(q, k, v, meta, backend, *, causal=True, softmax_scale=None):
        whole = attention.VarlenMetadata.build([0, q.shape[0]], [0, k.shape[0]], q.device)
        return real(q, k, v, whole, backend, causal=causal, softmax_scale=softmax_scale)
    return [swap_function(attention, "attention_forward", attention_forward)]


@fault("block_diag_mask_all_true", "block_diag_mask forgets the requests: its mask is all True, so masked "
       "attention mixes the requests (and is not causal)", AREA)
def _block_diag_mask_all_true():
    from ..core import attention

    def block_diag_mask(cu_seqlens, causal=False, cu_seqlens_k=None, device=None):
        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        return torch.ones(int(cu_seqlens[-1]), int(cu_k[-1]), dtype=torch.bool, device=device)
    return [swap_function(attention, "block_diag_mask", block_diag_mask)]


@fault("auto_backend_prefers_masked", "backend 'auto' falls back to the masked backend on the CPU (a fallback order "
       "with masked first)", AREA)
def _auto_prefers_masked():
    from ..core import kernels
    return [swap_item(kernels.AUTO_ORDER, "cpu", ("masked",))]


@fault("loop_reads_keys_from_row_zero", "the varlen loop slices each request's keys and values from row 0 "
       "(k[:end]) instead of from the request's own start", AREA)
def _loop_reads_from_row_zero():
    from ..core import attention
    real = attention.IMPLS["loop"]

    def loop(q, k, v, meta, causal, scale):
        out = torch.empty_like(q)
        for i in range(len(meta.cu_q) - 1):
            qs, qe, ke = meta.cu_q[i], meta.cu_q[i + 1], meta.cu_k[i + 1]
            one = _one_request(qe - qs, ke, q.device)   # the bug: keys 0..ke, not ks..ke
            out[qs:qe] = real(q[qs:qe], k[:ke], v[:ke], one, causal, scale)
        return out
    return [swap_item(attention.IMPLS, "loop", loop)]


@fault("loop_causal_off_by_one", "the varlen loop's causal mask is off by one: query i also reads key i + 1 "
       "of its request", AREA)
def _loop_causal_off_by_one():
    from ..core import attention

    def loop(q, k, v, meta, causal, scale):
        out = torch.empty_like(q)
        for i in range(len(meta.cu_q) - 1):
            qs, qe, ks, ke = meta.cu_q[i], meta.cu_q[i + 1], meta.cu_k[i], meta.cu_k[i + 1]
            allowed = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device)
            if causal:
                allowed = allowed.tril(ke - ks - (qe - qs) + 1)  # the bug: + 1
            one = attention.dense_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1),
                                            v[ks:ke].transpose(0, 1), allowed, scale)
            out[qs:qe] = one.transpose(0, 1)
        return out
    return [swap_item(attention.IMPLS, "loop", loop)]


@fault("loop_backend_runs_masked", "the loop backend computes every query against every key of the flat batch and "
       "masks the rest (the masked method under the varlen name)", AREA)
def _loop_is_masked():
    from ..core import attention
    return [swap_item(attention.IMPLS, "loop", attention.IMPLS["masked"])]


@fault("masked_backend_computes_diagonal_blocks_only", "the masked backend computes only each request's diagonal "
       "block (varlen's work) instead of the whole T x T score matrix", AREA)
def _masked_is_loop():
    from ..core import attention
    return [swap_item(attention.IMPLS, "masked", attention.IMPLS["loop"])]


@fault("loop_repeats_kv_per_query_head", "the loop backend repeats K and V for every query head of its group (the "
       "group not packed): each shared K/V head is read once per query head, in m = 1 matmuls", AREA)
def _gqa_group_not_packed():
    from ..core import attention
    real = attention.IMPLS["loop"]

    def loop(q, k, v, meta, causal, scale):
        g = q.shape[1] // k.shape[1]
        return real(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), meta, causal, scale)
    return [swap_item(attention.IMPLS, "loop", loop)]


@fault("causal_mask_top_left", "the causal mask is aligned top-left (query i sees keys 0..i of its rectangle, not "
       "0..i + L_k - L_q): a chunk after cached keys loses their offset", AREA)
def _causal_top_left():
    from ..core import attention

    def causal_mask(lq, lk, device=None):
        return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()  # the bug: no diagonal offset lk - lq
    return [swap_function(attention, "causal_mask", causal_mask)]


@fault("triton_backend_launches_per_request", "the triton backend launches the kernel once per request (the "
       "article's loop over requests, in Python)", AREA)
def _one_launch_per_request():
    from ..core import attention
    real = attention.IMPLS["triton"]

    def triton(q, k, v, meta, causal, scale):
        out = q.new_empty(q.shape)
        for i in range(len(meta.cu_q) - 1):
            qs, qe, ks, ke = meta.cu_q[i], meta.cu_q[i + 1], meta.cu_k[i], meta.cu_k[i + 1]
            out[qs:qe] = real(q[qs:qe], k[ks:ke], v[ks:ke], _one_request(qe - qs, ke - ks, q.device), causal, scale)
        return out
    return [swap_item(attention.IMPLS, "triton", triton)]


def _sdpa_with(is_causal, unpermute):
    """The sdpa backend rebuilt with its ``is_causal`` flag from ``is_causal(causal, lq, lk)`` and its output
    ``[n, H, L, D]`` turned back into rows by ``unpermute`` before the reshape to ``[n·L, H, D]``."""
    import torch.nn.functional as F

    from ..core import attention

    def sdpa(q, k, v, meta, causal, scale):
        out, (h, d), h_kv = torch.empty_like(q), q.shape[1:], k.shape[1]
        gqa = {"enable_gqa": True} if h_kv != h else {}
        for lq, lk, n, rows_q, rows_k in attention._length_groups(meta):
            qg = q[rows_q].view(n, lq, h, d).transpose(1, 2)
            kg, vg = (x[rows_k].view(n, lk, h_kv, d).transpose(1, 2) for x in (k, v))
            mask = attention.causal_mask(lq, lk, q.device) if causal and lq != lk else None
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=is_causal(causal, lq, lk),
                                               scale=scale, **gqa)
            out[rows_q] = unpermute(o).reshape(n * lq, h, d)
        return out
    return [swap_item(attention.IMPLS, "sdpa", sdpa)]


@fault("sdpa_causal_whenever_square", "the sdpa backend passes is_causal whenever a request has as many keys as "
       "queries (is_causal=lq == lk, the call's causal flag dropped): a non-causal call comes out causal", AREA)
def _sdpa_causal_whenever_square():
    return _sdpa_with(lambda causal, lq, lk: lq == lk, lambda o: o.transpose(1, 2))


@fault("sdpa_output_heads_not_transposed", "the sdpa backend reshapes its output [n, H, L, D] straight to rows "
       "[n·L, H, D] without moving the head axis back: rows and heads are scrambled", AREA)
def _sdpa_output_heads_not_transposed():
    return _sdpa_with(lambda causal, lq, lk: causal and lq == lk, lambda o: o)


@fault("padded_unpad_keeps_pad_rows", "the padded backend unpads by flattening its [R, L_max] rows and keeping the "
       "first T (the pad rows not dropped): every request after a shorter one gets shifted rows", AREA)
def _padded_unpad_keeps_pad_rows():
    from ..core import attention
    from ..validate import lengths

    def padded(q, k, v, meta, causal, scale):
        lens_q, lens_k = lengths(meta.cu_q), lengths(meta.cu_k)
        allowed = torch.zeros(len(lens_q), max(lens_q), max(lens_k), dtype=torch.bool, device=q.device)
        for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            allowed[i, :nq, :nk] = attention.causal_mask(nq, nk, q.device) if causal else True

        def pad(x, cu, lens):                                     # [T, H, D] -> [R, H, Lmax, D]
            out = x.new_zeros(len(lens), max(lens), *x.shape[1:])
            for i, n in enumerate(lens):
                out[i, :n] = x[cu[i]:cu[i + 1]]
            return out.transpose(1, 2)

        qp, kp, vp = pad(q, meta.cu_q, lens_q), pad(k, meta.cu_k, lens_k), pad(v, meta.cu_k, lens_k)
        outp = attention.dense_attention(qp, kp, vp, allowed[:, None], scale).transpose(1, 2)  # [R, Lq, H, D]
        return outp.flatten(0, 1)[:q.shape[0]].contiguous()   # the bug: pad rows kept, the batch cut at T
    return [swap_item(attention.IMPLS, "padded", padded)]
