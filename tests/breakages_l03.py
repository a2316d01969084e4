"""Breakages of the claims lesson 03 proves (see breakages.py)."""
from breakages import breaks


@breaks("C7", "03_masked_vs_varlen_attention", "every attention backend ignores cu_seqlens (one sequence of T rows)")
def _attention_ignores_cu_seqlens():
    from lessons_lib.core import attention, model

    real = attention.attention_forward

    def broken(q, k, v, meta, backend, *, causal=True, softmax_scale=None):
        whole = attention.VarlenMetadata.build([0, q.shape[0]], [0, k.shape[0]], q.device)
        return real(q, k, v, whole, backend, causal=causal, softmax_scale=softmax_scale)

    attention.attention_forward = model.attention_forward = broken  # both modules' global names


@breaks("C8", "03_masked_vs_varlen_attention",
        "block_diag_mask forgets the requests: its mask is all True, so masked attention mixes A and B")
def _mask_all_true():
    import torch

    from lessons_lib import core
    from lessons_lib.core import attention

    def broken(cu_seqlens, causal=False, cu_seqlens_k=None, device=None):
        cu_q = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        cu_k = cu_q if cu_seqlens_k is None else (cu_seqlens_k.tolist() if isinstance(cu_seqlens_k, torch.Tensor)
                                                  else list(cu_seqlens_k))
        return torch.ones(cu_q[-1], cu_k[-1], dtype=torch.bool, device=device)

    attention.block_diag_mask = core.block_diag_mask = broken  # both modules' global names


@breaks("C9", "03_masked_vs_varlen_attention",
        "backend 'auto' falls back to the masked backend on the CPU (a fallback order with masked first)")
def _auto_is_masked():
    from lessons_lib.core import kernels

    kernels.AUTO_ORDER["cpu"] = ("masked",)


@breaks("C10", "03_masked_vs_varlen_attention",
        "the varlen loop slices each request's keys and values from row 0 (k[:ke]) instead of from its own start")
def _loop_reads_from_row_zero():
    import torch

    from lessons_lib.core import attention

    def broken(q, k, v, meta, causal, scale):
        out = torch.empty_like(q)
        for i in range(len(meta.cu_q) - 1):
            qs, qe, ke = meta.cu_q[i], meta.cu_q[i + 1], meta.cu_k[i + 1]
            q_i, k_i, v_i = q[qs:qe].transpose(0, 1), k[:ke].transpose(0, 1), v[:ke].transpose(0, 1)  # the bug: [:ke]
            scores = (q_i @ k_i.transpose(1, 2)) * scale
            if causal:
                scores.masked_fill_(~attention.causal_mask(qe - qs, ke, q.device), float("-inf"))
            out[qs:qe] = (scores.softmax(dim=-1) @ v_i).transpose(0, 1)
        return out

    attention._loop = attention.IMPLS["loop"] = broken


@breaks("C10", "03_masked_vs_varlen_attention",
        "the loop's causal mask is off by one: query i also reads key i + 1 of its request", variant="causal-off-by-one")
def _loop_causal_off_by_one():
    import torch

    from lessons_lib.core import attention

    def broken(q, k, v, meta, causal, scale):
        out = torch.empty_like(q)
        for i in range(len(meta.cu_q) - 1):
            qs, qe, ks, ke = meta.cu_q[i], meta.cu_q[i + 1], meta.cu_k[i], meta.cu_k[i + 1]
            q_i, k_i, v_i = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
            scores = (q_i @ k_i.transpose(1, 2)) * scale
            if causal:
                seen = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(1)  # the bug: tril(1)
                scores.masked_fill_(~seen, float("-inf"))
            out[qs:qe] = (scores.softmax(dim=-1) @ v_i).transpose(0, 1)
        return out

    attention._loop = attention.IMPLS["loop"] = broken
