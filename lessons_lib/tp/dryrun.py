"""The collectives of one TP rank without starting processes: predicted, or dry-run in this process.

``expected_trace(cfg, num_tokens)`` is the formula of claims C1 and C12: one forward on a rank
makes ``2 · n_layers`` all-reduces (attention out proj, then FFN-down, of every layer), each
of a ``[T, d_model]`` payload. Only T, the number of flat tokens, appears in it: not the number
of requests, not their lengths.

``record_trace(cfg, seq_lens)`` checks the formula against the model's own code: it runs one
forward of ``core.model.Transformer`` on ``LocalGroup(rank, world_size)``, the in-process
stand-in for a rank, which records each all-reduce exactly as a real rank does but does not
sum. So a dry run's VALUES are not the TP result; its TRACE is exactly what the model asks a
real rank for. Lesson 04 compares both with a real two-process trace (``runtime.TPRuntime``).

``record_requests`` dry-runs a number of tokens as equal requests, packed and one forward each.

Taught in notebooks/04_tp2_invariance.ipynb; behind the explorers of lessons 00 and 04.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from ..core.batch import pack
from ..core.config import ModelConfig, as_config
from ..core.groups import CollectiveRecord, LocalGroup
from ..core.model import Transformer, init_weights
from ..validate import check_int, check_lengths, check_tp_divides


def expected_layers(cfg: ModelConfig) -> list[str]:
    """The ``layer`` names of the 2·n_layers all-reduces of one forward, in call order."""
    return [f"layers.{i}.{part}" for i in range(cfg.n_layers) for part in ("attn.out_proj", "mlp.fc_down")]


def expected_trace(cfg: ModelConfig, num_tokens: int, rank: int = 0, world_size: int = 2) -> list[CollectiveRecord]:
    """The all-reduces rank ``rank`` records in one forward of ``num_tokens`` flat tokens.

    ``2 · cfg.n_layers`` records of shape ``(num_tokens, d_model)``, ``num_tokens · d_model ·
    itemsize`` bytes each, named like the model's row-parallel layers. ``world_size=1`` gives
    ``[]``: TP=1 has nothing to reduce.
    """
    cfg, n = as_config(cfg), check_int("num_tokens", num_tokens, 1)
    group = LocalGroup(rank, world_size)  # checks rank and world_size
    check_tp_divides(cfg, "world_size", world_size)
    for layer in expected_layers(cfg):  # at world_size=1 the group records nothing
        group.all_reduce(torch.empty(n, cfg.d_model, dtype=cfg.dtype, device="meta"), layer=layer)
    return group.trace


# Rows enter already embedded, so the token and position tables are never read: one row each
# keeps a dry-run model cheap, and configs that differ only there share one cached model.
_UNUSED = {"vocab_size": 1, "max_position": 1}


@functools.lru_cache(maxsize=4)
def _dry_model(key: tuple, rank: int, world_size: int, seed: int) -> Transformer:
    """One rank's model, built once per (config, rank): the weights do not change a trace, and
    building the article's 8 layers costs more than a forward of a few hundred tokens. Attention
    runs masked: one call per layer whatever the number of requests (40 one-token requests stay
    fast); no attention backend issues a collective (C11)."""
    small = ModelConfig(**dict(key))
    return Transformer(small, init_weights(small, seed), group=LocalGroup(rank, world_size), attn_backend="masked")


def record_trace(cfg: ModelConfig, seq_lens: Sequence[int], rank: int = 0, world_size: int = 2,
                 seed: int = 0) -> list[CollectiveRecord]:
    """Dry-run one forward of the model on rank ``rank`` for requests of ``seq_lens`` tokens
    (flat, ``cu_seqlens`` from the lengths) and return the collectives it asked for.

    The rows enter already embedded (``[T, d_model]``, seeded): embeddings are replicated and
    issue no collective.
    """
    cfg, lens = as_config(cfg), check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    if max(lens) > cfg.max_position:
        raise ValueError(f"a request of {max(lens)} tokens exceeds max_position={cfg.max_position}")
    LocalGroup(rank, world_size)  # checks rank and world_size before they key the cache
    check_tp_divides(cfg, "world_size", world_size)
    key = tuple((f.name, _UNUSED.get(f.name, getattr(cfg, f.name))) for f in dataclasses.fields(cfg))
    model = _dry_model(key, rank, world_size, seed)
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, cfg.d_model, generator=g).to(cfg.dtype) for n in lens]  # [L_i, d] each
    model.group.trace.clear()  # the cached model keeps no history
    model(pack(rows))
    return list(model.group.trace)


def trace_signature(records: Sequence[CollectiveRecord]) -> list[tuple]:
    """``[(op, shape, dtype, bytes, layer), ...]``: a trace without its rank, comparable with ``==``."""
    return [r.signature for r in records]


RECORD_D_MODEL = 64  # record_requests' model: 8 heads of 8, so that a dry run stays around a second on a loaded CPU
RECORD_MAX_TOKENS = 256


def record_requests(num_tokens: int, requests: int = 1, n_layers: int = 8, dtype: str = "float32",
                    world_size: int = 2) -> dict:
    """The all-reduces rank 0 of TP=``world_size`` makes in the model's forward (``record_trace``, at width
    ``RECORD_D_MODEL``, 8 heads) for ``num_tokens`` tokens as ``requests`` requests as equal as possible (longer
    first), packed into one forward and one forward each (each distinct length dry-run once; one request: one forward).

    Keys: ``lens``, ``n_layers``, ``dtype``, ``world_size``, ``d_model``, ``packed`` (a trace), ``separate`` (one
    trace per request), ``agrees`` (every trace equals ``expected_trace``'s, record by record). ValueError above
    ``RECORD_MAX_TOKENS`` tokens, for more requests than tokens, or a dtype not float32/bfloat16/float16."""
    n = check_int("num_tokens", num_tokens, 1, RECORD_MAX_TOKENS)
    r = check_int("requests", requests, 1, n)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be one of ('float32', 'bfloat16', 'float16'), got {dtype!r}")
    p = check_int("world_size", world_size, 2, 1024)
    cfg = ModelConfig(n_layers=check_int("n_layers", n_layers, 1, 256), d_model=RECORD_D_MODEL, n_heads=8,
                      d_ffn=4 * RECORD_D_MODEL, vocab_size=1, max_position=n, dtype=getattr(torch, dtype))
    lens = [n // r + (i < n % r) for i in range(r)]
    packed = record_trace(cfg, lens, 0, p)
    alone = {m: packed if r == 1 else record_trace(cfg, [m], 0, p) for m in set(lens)}  # one request: the same forward
    separate = [list(alone[m]) for m in lens]
    agrees = (trace_signature(packed) == trace_signature(expected_trace(cfg, n, 0, p))
              and all(trace_signature(t) == trace_signature(expected_trace(cfg, m, 0, p)) for m, t in alone.items()))
    return {"lens": lens, "n_layers": cfg.n_layers, "dtype": dtype, "world_size": p, "d_model": cfg.d_model,
            "packed": packed, "separate": separate, "agrees": agrees}
