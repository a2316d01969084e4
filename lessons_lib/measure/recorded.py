"""What the engine really runs, recorded (``measure.recorder``), for the counts of ``measure.flops`` to be checked
against: the matmuls of a forward, of one decode step's attention and of a real decode step through the serving KV
cache, the FLOPs of a forward summed from them, the bytes the KV cache holds, the intensity of a fused causal
attention call, and a real forward recorded and timed (``timed_forward``).

Models built here for counting (``zero_model``) have the config's shapes with one zero seen as every weight (an
expanded scalar: no memory), TP = 1, on the CPU. Every function runs the engine's own ``Transformer.forward``;
nothing here re-derives a count from the config.

Taught in notebooks/05_flop_regimes.ipynb.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import torch

from ..core.attention import varlen_attention
from ..core.batch import pack, seq_lens_to_cu_seqlens
from ..core.config import ModelConfig
from ..core.model import Transformer
from ..serve.kv_cache import PrefillKVCache
from ..validate import check_int, check_lengths
from .flops import ForwardFlops, attention_cells, forward_flops
from .profile import time_call
from .recorder import BF16, FUSED_ATTENTION_OPS, Matmul, OpRecorder, record_matmuls, record_ops


def forward_matmuls(model, batch, attn_backend: str = "loop") -> list[Matmul]:
    """The matmuls of one forward of ``model`` on the ``PackedBatch`` ``batch`` ("loop": the article's per-request
    loop, one ``bmm`` pair per request)."""
    return record_matmuls(lambda: model(batch, attn_backend=attn_backend))


def of_kind(matmuls: Sequence[Matmul], kind: str) -> list[Matmul]:
    """The matmuls of one kind: ``"linear"`` or ``"attention"``."""
    if kind not in ("linear", "attention"):
        raise ValueError(f"kind must be 'linear' or 'attention', got {kind!r}")
    return [mm for mm in matmuls if mm.kind == kind]


def intensity(matmuls: Sequence[Matmul], nbytes: int = BF16) -> float:
    """FLOP per byte of a group of matmuls: all their FLOPs over all their bytes (the per-matmul byte model,
    ``Matmul.bytes``: each operand read once, the output written once)."""
    if not matmuls:
        raise ValueError("no matmuls: the intensity of nothing is undefined")
    return sum(mm.flops for mm in matmuls) / sum(mm.bytes(nbytes) for mm in matmuls)


def decode_attention_matmuls(num_requests: int, kv_len: int, n_heads: int = 8, d_head: int = 64,
                             backend: str = "loop") -> list[Matmul]:
    """One decode step's attention, run by ``varlen_attention`` (CPU, random fp32 values): each of R
    requests has ONE query (``cu_seqlens_q = [0, 1, ..., R]``) against its own ``kv_len`` keys."""
    r = check_int("num_requests", num_requests, 1, 4096)
    n = check_int("kv_len", kv_len, 1, 1 << 20)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(r, n_heads, d_head, generator=g)                              # [R, H, D]
    k, v = (torch.randn(r * n, n_heads, d_head, generator=g) for _ in range(2))  # [R·L_kv, H, D]
    cu_q, cu_k = seq_lens_to_cu_seqlens([1] * r), seq_lens_to_cu_seqlens([n] * r)
    return record_matmuls(lambda: varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend=backend))


def zero_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every full weight of ``cfg`` (``ModelConfig.weight_shapes``) as one zero of ``cfg.dtype`` expanded to its
    shape: a model's shapes at no memory cost, for counting and sizing."""
    zero = torch.zeros((), dtype=cfg.dtype)
    return {name: zero.expand(shape) for name, shape in cfg.weight_shapes().items()}


def zero_model(cfg: ModelConfig, n_kv_heads: int | None = None, max_position: int | None = None) -> Transformer:
    """``cfg``'s model (``n_kv_heads`` K/V heads, default ``cfg``'s; ``max_position`` positions) with one zero
    seen as every weight (``zero_weights``), vocabulary 8, TP = 1, CPU: the engine's shapes, for counting."""
    small = dataclasses.replace(cfg, n_kv_heads=cfg.n_kv_heads if n_kv_heads is None else n_kv_heads, vocab_size=8,
                                max_position=cfg.max_position if max_position is None else max_position)
    return Transformer(small, zero_weights(small))


def _prefill(model, cache: PrefillKVCache, lens: list[int]) -> None:
    """Prefill requests ``0..R-1`` of ``lens`` tokens (token 0) into ``cache``, every request kept for decode."""
    ids = list(range(len(lens)))
    with torch.no_grad():
        step = cache.step(ids, [0] * len(ids), lens, [True] * len(ids))
        model(pack([torch.zeros(n, dtype=torch.long) for n in lens]), kv_cache=step)
        step.finish()


def engine_decode_matmuls(model, num_requests: int, kv_len: int, attn_backend: str = "loop") -> list[Matmul]:
    """The matmuls of one real decode step of the engine: R requests of ``kv_len - 1`` tokens prefilled into a
    ``PrefillKVCache``, then ``Transformer.forward(kv_cache=...)`` on one new token each, recorded."""
    r, n = check_int("num_requests", num_requests, 1, 4096), check_int("kv_len", kv_len, 2, 1 << 20)
    cache = PrefillKVCache.for_model(model)
    _prefill(model, cache, [n - 1] * r)
    with torch.no_grad():
        step = cache.step(list(range(r)), [n - 1] * r, [1] * r, [False] * r)
        new = pack([[7]] * r, num_computed_tokens=[n - 1] * r)
        return record_matmuls(lambda: model(new, kv_cache=step, attn_backend=attn_backend))


def prefill_cache_bytes(model, seq_lens: Sequence[int]) -> int:
    """Bytes (``PrefillKVCache.nbytes``) a new cache of ``model`` (any group: a rank's cache) holds after prefilling
    requests of ``seq_lens`` tokens, every request kept."""
    cache = PrefillKVCache.for_model(model)
    _prefill(model, cache, list(seq_lens))
    return cache.nbytes


def engine_kv_cache_bytes(cfg: ModelConfig, seq_lens: Sequence[int], n_kv_heads: int | None = None) -> int:
    """Bytes (``PrefillKVCache.nbytes``) the engine's cache holds after prefilling ``seq_lens`` on ``cfg``'s model
    (``zero_model``, ``n_kv_heads`` K/V heads), in ``cfg.dtype``: MEASURED on the cache, not counted."""
    lens = check_lengths(seq_lens)
    return prefill_cache_bytes(zero_model(cfg, n_kv_heads, max(lens)), lens)


def gqa_decode_matmuls(cfg: ModelConfig, n_kv_heads: int, num_requests: int, kv_len: int) -> list[Matmul]:
    """``engine_decode_matmuls`` on ``cfg``'s model with ``n_kv_heads`` K/V heads (``zero_model``, loop backend):
    a group's G query heads are the rows of one matmul on their K/V head."""
    return engine_decode_matmuls(zero_model(cfg, n_kv_heads, kv_len), num_requests, kv_len)


def recorded_flops(cfg: ModelConfig, seq_lens: Sequence[int], attn_backend: str = "loop") -> ForwardFlops:
    """The linear and attention FLOPs one forward of ``cfg``'s model (``zero_model``) on ``seq_lens`` executes,
    summed from its recorded matmuls."""
    lens = check_lengths(seq_lens)
    with torch.no_grad():
        mm = forward_matmuls(zero_model(cfg, max_position=max(lens)),
                             pack([torch.zeros(n, dtype=torch.long) for n in lens]), attn_backend)
    return ForwardFlops(sum(m.flops for m in of_kind(mm, "linear")), sum(m.flops for m in of_kind(mm, "attention")))


def fused_attention_intensity(rec: OpRecorder, nbytes: int = BF16) -> float:
    """FLOP per byte of the SDPA kernels ``rec`` recorded (``[B, H, L, D]``, L_q = L_k): ``4·D`` FLOPs per score
    cell the call needs (``flops.attention_cells``, causal when the call was), over Q, K, V read and O written
    once (the fused-kernel byte model). ValueError when no such call was recorded or one is not square."""
    flops = moved = 0
    for op in rec.named(*FUSED_ATTENTION_OPS):
        q, k, v = (op.args[i].shape for i in range(3))
        if FUSED_ATTENTION_OPS[op.name][0] != "bhld" or q[2] != k[2]:
            raise ValueError(f"{op.name}: expected an SDPA call with L_q = L_k, got q {q}, k {k}")
        b, h, n, d = q
        flops += 4 * d * b * h * attention_cells([n], "varlen", causal=op.args[4] is True).computed
        moved += nbytes * (math.prod(q) + math.prod(k) + math.prod(v) + math.prod(op.outputs[0]))
    if not moved:
        raise ValueError("no fused attention call was recorded: run the forward with attn_backend='sdpa'")
    return flops / moved


def count_ops(fn: Callable[[], object]) -> int:
    """How many ATen ops ``fn()`` runs (``measure.recorder``): on a GPU each is at least one kernel launch."""
    with OpRecorder() as rec:
        fn()
    return len(rec.ops)


TIMED_MAX_TOKENS, TIMED_MAX_FLOPS = 1024, 20e9   # timed_forward: at most this many tokens and FLOPs


@functools.lru_cache(maxsize=1)
def _timed_model(cfg: ModelConfig) -> Transformer:
    return Transformer(cfg, seed=0)


def timed_forward(cfg: ModelConfig, seq_lens: Sequence[int], repeats: int = 1) -> dict:
    """One real engine forward of ``cfg``'s model (random fp32 weights, CPU, vocabulary 1000) on ``seq_lens`` (at
    most ``TIMED_MAX_TOKENS`` tokens and ``TIMED_MAX_FLOPS`` FLOPs, else ValueError): recorded once
    (``measure.recorder``: its ATen ops and matmul FLOPs), then timed (fastest of ``repeats``). Returns ``{"cfg",
    "seq_lens", "seconds", "ops", "flops"}`` (``cfg``: the model run; ``flops``: the recorded ``ForwardFlops``)."""
    lens = check_lengths(seq_lens)
    need = forward_flops(cfg, lens).total
    if sum(lens) > TIMED_MAX_TOKENS or need > TIMED_MAX_FLOPS:
        raise ValueError(f"the timed forward takes at most {TIMED_MAX_TOKENS} tokens and {TIMED_MAX_FLOPS / 1e9:g} "
                         f"GFLOP, got {sum(lens)} tokens, {need / 1e9:.1f} GFLOP")
    cfg = dataclasses.replace(cfg, dtype=torch.float32, vocab_size=1000, max_position=max(1024, max(lens)))
    model, g = _timed_model(cfg), torch.Generator().manual_seed(0)
    batch = pack([torch.randint(0, cfg.vocab_size, (m,), generator=g) for m in lens])
    with torch.no_grad():
        rec = record_ops(lambda: model(batch))
        seconds = time_call(lambda: model(batch), repeats=check_int("repeats", repeats, 1, 20), warmup=0)
    return {"cfg": cfg, "seq_lens": list(lens), "seconds": seconds, "ops": len(rec.ops),
            "flops": ForwardFlops(**rec.flops_by_kind)}
