"""The collectives of one TP rank without starting processes: predicted, or dry-run in this process.

``expected_trace(cfg, num_tokens)`` is the formula of claims C1 and C12: one forward on a rank
makes ``2 · n_layers`` all-reduces (attention out proj, FFN-down of every layer), each of a
``[T, d_model]`` payload, in layer order. Only T, the number of flat tokens, appears in it:
not the number of requests, not their lengths.

``record_trace(cfg, seq_lens)`` checks the formula against the model's own code: it runs one
forward of ``model.Transformer`` on a ``RecordingGroup``, a stand-in for rank ``rank`` of a
TP group that appends the same ``CollectiveRecord`` as ``parallel.DistGroup`` but does not sum
(there is no other rank here). So a dry run's VALUES are not the TP result; its TRACE (which
collectives, in which order, with which payloads) is exactly what the model asks a real rank
for. Lesson 04 compares both with a real two-process trace (``tp.TPRuntime``).

``trace_signature`` drops the rank from each record, so traces compare with ``==``.

Taught in notebooks/04_tp2_invariance.ipynb; behind the explorers of lessons 00 and 04 (``widgets``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from .batch import _check_lengths, pack
from .config import ModelConfig
from .parallel import CollectiveRecord


def _layer_names(cfg: ModelConfig) -> list[str]:
    # The names RowParallelLinear gets in model.Block, in the order a forward calls them.
    return [f"layers.{i}.{part}" for i in range(cfg.n_layers) for part in ("attn.out_proj", "mlp.fc_down")]


def _rank_args(rank, world_size) -> tuple[int, int]:
    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(f"rank={rank} must be < world_size={world_size}")
    return rank, world_size


def _cfg(cfg) -> ModelConfig:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    return cfg


def expected_trace(cfg: ModelConfig, num_tokens: int, rank: int = 0, world_size: int = 2) -> list[CollectiveRecord]:
    """The all-reduces rank ``rank`` records in one forward of ``num_tokens`` flat tokens.

    ``2 · cfg.n_layers`` records of shape ``(num_tokens, d_model)`` and ``num_tokens · d_model ·
    itemsize`` bytes, named like the model's row-parallel layers. ``world_size=1`` gives ``[]``
    (TP=1 has nothing to reduce: ``parallel.LocalGroup`` records nothing).
    """
    cfg = _cfg(cfg)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
    rank, world_size = _rank_args(rank, world_size)
    if world_size == 1:
        return []
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    dtype = str(cfg.dtype).replace("torch.", "")
    shape = (num_tokens, cfg.d_model)
    return [CollectiveRecord("all_reduce", shape, dtype, num_tokens * cfg.d_model * itemsize, name, rank, world_size)
            for name in _layer_names(cfg)]


class RecordingGroup:
    """Rank ``rank`` of a ``world_size`` TP group, simulated in this process.

    ``all_reduce(tensor, layer=...)`` appends a ``CollectiveRecord`` (as ``DistGroup`` does)
    and returns ``tensor`` unchanged: nothing is summed, so the values that flow on are this
    rank's partial sums only. Use it for traces and shapes, never for outputs.
    """

    def __init__(self, rank: int = 0, world_size: int = 2):
        self.rank, self.world_size = _rank_args(rank, world_size)
        self.trace: list[CollectiveRecord] = []

    def all_reduce(self, tensor: torch.Tensor, *, layer: str = "") -> torch.Tensor:
        self.trace.append(CollectiveRecord("all_reduce", tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                           tensor.numel() * tensor.element_size(), layer, self.rank, self.world_size))
        return tensor

    def __repr__(self) -> str:
        return f"RecordingGroup(rank={self.rank}, world_size={self.world_size}, {len(self.trace)} records)"


# Rows enter already embedded, so the token and position tables are never read: one row each
# keeps a dry-run model cheap, and configs that differ only there share one cached model.
_UNUSED = {"vocab_size": 1, "max_position": 1, "tp_size": 1}


@functools.lru_cache(maxsize=4)
def _dry_model(key: tuple, rank: int, world_size: int, seed: int):
    """One rank's model, built once per (config, rank): the weights do not change a trace,
    and building the article's 8 layers costs more than a forward of a few hundred tokens."""
    from .model import Transformer, init_weights  # model imports parallel; keep this module light

    small = ModelConfig(**dict(key))
    # Attention runs masked: one call per layer whatever the number of requests (a dry run of
    # 40 one-token requests stays fast); no attention backend issues a collective (C11).
    return Transformer(small, init_weights(small, seed), group=RecordingGroup(rank, world_size), attn_backend="masked")


def record_trace(cfg: ModelConfig, seq_lens: Sequence[int], rank: int = 0, world_size: int = 2,
                 seed: int = 0) -> list[CollectiveRecord]:
    """Dry-run one forward of ``model.Transformer`` on rank ``rank`` for requests of ``seq_lens``
    tokens (flat, ``cu_seqlens`` from the lengths) and return the collectives it asked for.

    The rows enter already embedded (``[T, d_model]``, seeded): embeddings are replicated and
    issue no collective. Attention uses the masked backend (same trace as any other backend,
    and fast for many tiny requests). The model is cached per (config without its vocabulary
    and position table, rank, world_size, seed).
    """
    cfg = _cfg(cfg)
    lens = _check_lengths(seq_lens)
    if not lens:
        raise ValueError("seq_lens is empty: give at least one request length")
    if max(lens) > cfg.max_position:
        raise ValueError(f"a request of {max(lens)} tokens exceeds max_position={cfg.max_position}")
    rank, world_size = _rank_args(rank, world_size)
    if cfg.n_heads % world_size or cfg.d_ffn % world_size:
        raise ValueError(f"world_size={world_size} must divide n_heads={cfg.n_heads} and d_ffn={cfg.d_ffn}")
    key = tuple((f.name, _UNUSED.get(f.name, getattr(cfg, f.name))) for f in dataclasses.fields(cfg))
    model = _dry_model(key, rank, world_size, seed)
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, cfg.d_model, generator=g).to(cfg.dtype) for n in lens]  # [L_i, d] each
    start = len(model.group.trace)
    model(pack(rows))
    records = model.group.trace[start:]
    del model.group.trace[start:]  # the cached model keeps no history
    return records


def trace_signature(records: Sequence[CollectiveRecord]) -> list[tuple]:
    """``[(op, shape, dtype, bytes, layer), ...]``: a trace without its rank, comparable with ``==``."""
    return [(r.op, tuple(r.shape), r.dtype, r.bytes, r.layer) for r in records]
