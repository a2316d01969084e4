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
