"""What the engine's ``"loop"`` attention backend (lesson 03's loop, one request at a time) dispatches to the device,
op by op, recorded by ``OpRecorder``: the work the varlen kernel's one launch replaces."""
from __future__ import annotations

from collections.abc import Sequence

from ..core.attention import varlen_attention
from .profile import random_qkv
from .recorder import record_ops


def loop_ops(seq_lens: Sequence[int], *, causal: bool = True) -> list[str]:
    """The ops ``varlen_attention(..., backend="loop")`` (one head of 16) dispatches for requests of ``seq_lens``,
    views left out: each op left runs on the device (on a GPU a kernel launch, or, ``_local_scalar_dense``, a read
    back to the host), one after the other."""
    q, k, v, cu = random_qkv(list(seq_lens), n_heads=1, d_head=16, seed=0)
    return record_ops(lambda: varlen_attention(q, k, v, cu, causal=causal, backend="loop")).launched()


def loop_ops_per_request(*, causal: bool = True) -> list[str]:
    """The ops the loop adds for one more request: those of two requests past those of one (in order)."""
    extra = loop_ops([6, 13], causal=causal)
    for name in loop_ops([6], causal=causal):
        extra.remove(name)
    return extra
