"""Breakages of the claims lesson 07 proves (see breakages.py).

K2-K5 change ONE line of the Triton kernel: the kernel is rebuilt from its real source with that
line replaced (``course.l07_kernel.install``, the helper the lesson's break-it cells use), since a
``@triton.jit`` function cannot be monkeypatched line by line. K1 puts the loop over requests back
in Python, in the engine's triton backend.
"""
from breakages import breaks

NOTEBOOK = "07_inside_the_kernel"


def _install(bug: str) -> None:
    from lessons_lib.course import l07_kernel

    if l07_kernel.kernel_module() is not None:  # without Triton the kernel cells skip: nothing to break
        l07_kernel.install(bug)


@breaks("K1", NOTEBOOK, "the triton backend launches the kernel once per request (the article's loop, in Python)")
def _one_launch_per_request():
    from lessons_lib.core import attention
    from lessons_lib.core.attention import VarlenMetadata

    real = attention.IMPLS["triton"]

    def per_request(q, k, v, meta, causal, scale):
        out = q.new_empty(q.shape)
        for i in range(len(meta.cu_q) - 1):
            qs, qe, ks, ke = meta.cu_q[i], meta.cu_q[i + 1], meta.cu_k[i], meta.cu_k[i + 1]
            one = VarlenMetadata.build([0, qe - qs], [0, ke - ks], q.device)
            out[qs:qe] = real(q[qs:qe], k[ks:ke], v[ks:ke], one, causal, scale)
        return out

    attention._triton = attention.IMPLS["triton"] = per_request


@breaks("K2", NOTEBOOK, "the kernel's early return removed: programs past their request's end walk its keys anyway")
def _no_early_return():
    _install("no early return")


@breaks("K3", NOTEBOOK, "the causal loop bound one key tile too far: tiles wholly above the diagonal are computed")
def _causal_bound_one_tile_late():
    _install("causal bound one tile late")


@breaks("K4", NOTEBOOK, "the tile's key columns past the request's end are no longer masked (they score 0, not -inf)")
def _columns_past_the_end_kept():
    _install("columns past the end kept")


@breaks("K5", NOTEBOOK, "the running sum l is not rescaled when the running max grows")
def _sum_not_rescaled():
    _install("sum not rescaled")
