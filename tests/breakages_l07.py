"""Breakages of the claims lesson 07 proves (see breakages.py).

K2-K5 (and K3's variants: the two-stage loop, the bottom-right diagonal) change ONE line of the Triton kernel: the kernel is rebuilt from its real source with that
line replaced (``course.l07_kernel.install``, the helper the lesson's break-it cells use), since a
``@triton.jit`` function cannot be monkeypatched line by line. K1 puts the loop over requests back
in Python, in the engine's triton backend.
"""
from breakages import breaks, breaks_each

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


# K2-K5: one line of the kernel each (l07_kernel.KERNEL_BUGS names them).
breaks_each(NOTEBOOK, _install, (
        ("K2", "no early return", "the kernel's early return removed: programs past their request's end walk its keys anyway"),
        ("K3", "causal bound one tile late",
         "the causal loop bound one key tile too far: tiles wholly above the diagonal are computed"),
        ("K4", "columns past the end kept",
         "the tile's key columns past the request's end are no longer masked (they score 0, not -inf)"),
        ("K5", "sum not rescaled", "the running sum l is not rescaled when the running max grows"),
        ("K3:mask-all", "every key tile masked",
         "the two-stage loop's unmasked stage emptied: every key tile takes the masked path (right output, slower)"),
        ("K3:diagonal-unmasked", "diagonal tile unmasked",
         "the two-stage loop's unmasked stage runs to the end: the diagonal tile is not masked (keys above it seen)"),
        ("K3:top-left", "causal diagonal top-left",
         "the causal mask aligned top-left (j <= i): a chunk after cached keys loses its cached keys' offset")))
