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
from ..measure.recorder import module_io
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


def trace_shapes(records: Sequence[CollectiveRecord]) -> list[tuple]:
    """``[(op, shape, layer), ...]``: a trace without rank and dtype, comparable with ``==`` (a dry run is float32,
    a GPU rank bfloat16)."""
    return [(r.op, tuple(r.shape), r.layer) for r in records]


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
    from ..serve.workloads import packing_lens
    n = check_int("num_tokens", num_tokens, 1, RECORD_MAX_TOKENS)
    r = check_int("requests", requests, 1, n)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be one of ('float32', 'bfloat16', 'float16'), got {dtype!r}")
    p = check_int("world_size", world_size, 2, 1024)
    cfg = ModelConfig(n_layers=check_int("n_layers", n_layers, 1, 256), d_model=RECORD_D_MODEL, n_heads=8,
                      d_ffn=4 * RECORD_D_MODEL, vocab_size=1, max_position=n, dtype=getattr(torch, dtype))
    lens = packing_lens(n, r)  # as equal as possible, longer first
    packed = record_trace(cfg, lens, 0, p)
    alone = {m: packed if r == 1 else record_trace(cfg, [m], 0, p) for m in set(lens)}  # one request: the same forward
    separate = [list(alone[m]) for m in lens]
    agrees = (trace_signature(packed) == trace_signature(expected_trace(cfg, n, 0, p))
              and all(trace_signature(t) == trace_signature(expected_trace(cfg, m, 0, p)) for m, t in alone.items()))
    return {"lens": lens, "n_layers": cfg.n_layers, "dtype": dtype, "world_size": p, "d_model": cfg.d_model,
            "packed": packed, "separate": separate, "agrees": agrees}


# ---------------------------------------------------------------------------------------------
# What one rank's layer 0 computes, measured on a stand-in rank (its input, the embedding, is whole on every rank)

RANK_LINEARS = (("QKV", "attn.qkv", "column"), ("out proj", "attn.out_proj", "row"),
                ("FFN-up", "mlp.fc_up", "column"), ("FFN-down", "mlp.fc_down", "row"))


@dataclasses.dataclass(frozen=True)
class RankLayer:
    """One linear layer on one rank: input and output shape, the products summed into each
    output number (the rank's input width), and whether an all-reduce follows it."""

    name: str
    split: str          # "column" (keeps some output features) or "row" (a partial sum of all of them)
    x: tuple
    y: tuple
    products: int
    all_reduce: bool

    def __str__(self) -> str:
        after = ", then all-reduce (partial sum)" if self.all_reduce else ", no collective"
        return (f"{self.name:9s} {self.split:6s} [{self.x[0]}, {self.x[1]}] -> [{self.y[0]}, {self.y[1]}]: "
                f"{self.products} products per output number{after}")


def rank_layers(cfg: ModelConfig, num_tokens: int, rank: int = 0, world_size: int = 2) -> list[RankLayer]:
    """Layer 0's four linear layers (``RANK_LINEARS``) on rank ``rank`` of ``world_size``, MEASURED: forward
    hooks on the model's own modules (cut by ``LocalGroup(rank, world_size)``, the same cut a real rank makes)
    record each input and output shape, and the trace says which layers all-reduce.

    Article's model, TP=2, T tokens: QKV [T,512]->[T,768]; out proj [T,256]->[T,512] partial;
    FFN-up [T,512]->[T,1024]; FFN-down [T,1024]->[T,512] partial.
    """
    t = check_int("num_tokens", num_tokens, 1)
    small = dataclasses.replace(cfg, n_layers=1, vocab_size=1, max_position=1)
    group = LocalGroup(rank, world_size)
    model = Transformer(small, init_weights(small), group=group, attn_backend="masked")
    io = module_io(model.layers[0], [path for _, path, _ in RANK_LINEARS],
                   lambda: model(pack([torch.zeros(t, cfg.d_model, dtype=cfg.dtype)])))
    seen = {name: (tuple(io[path][0][0].shape), tuple(io[path][1].shape)) for name, path, _ in RANK_LINEARS}
    reduced = {r.layer for r in group.trace}
    return [RankLayer(name, split, *seen[name], seen[name][0][1], f"layers.0.{path}" in reduced)
            for name, path, split in RANK_LINEARS]


def layer0_attention(model: Transformer, batch) -> torch.Tensor:
    """Layer 0's attention output on this model's rank, ``[T, H_local, D]``: what its attention core
    returned in one forward of ``batch`` (a ``PackedBatch``; a forward hook on ``layers.0.attn.core``).

    Layer 0's input is the embedding, replicated, so a ``LocalGroup(rank, tp)`` stand-in computes
    exactly what a real rank does there (later layers would need the other ranks' partial sums).
    """
    return module_io(model, ["layers.0.attn.core"], lambda: model(batch))["layers.0.attn.core"][1]


def out_proj_partials(model: Transformer, batch) -> torch.Tensor:
    """What layer 0's out proj of ``model`` (any group) hands to its all-reduce for ``batch``, ``[T, d_model]``:
    its output minus its bias. On a ``LocalGroup`` stand-in the all-reduce returns the tensor it was
    given, so this is the rank's partial sum (layer 0's input, the embedding, is the same on every rank)."""
    out = module_io(model, ["layers.0.attn.out_proj"], lambda: model(batch))["layers.0.attn.out_proj"][1]
    return out - model.layers[0].attn.out_proj.bias


def layer0_model(cfg: ModelConfig, weights: dict) -> tuple[ModelConfig, dict]:
    """Layer 0 of ``cfg`` alone (``n_layers=1``) and its weights out of the full ``weights``."""
    return (dataclasses.replace(cfg, n_layers=1),
            {k: v for k, v in weights.items() if not k.startswith("layers.") or k.startswith("layers.0.")})


def rank_partials(cfg: ModelConfig, weights: dict, batch, tp: int = 2, device="cpu",
                  dtype=torch.float32) -> list[torch.Tensor]:
    """What each of ``tp`` ranks hands to layer 0's out-proj all-reduce for ``batch``: one
    ``[T, d_model]`` tensor per rank, on the CPU (``out_proj_partials`` of a ``LocalGroup(r, tp)``
    stand-in). Layer 0's input, the embedding, is whole on every rank, so a stand-in sends exactly
    what a real rank sends. Only layer 0 of ``weights`` is built; float64 runs the loop attention."""
    tp = check_int("tp", tp, 1, cfg.n_heads)
    one, w1 = layer0_model(cfg, weights)
    backend = "loop" if dtype == torch.float64 else "auto"
    with torch.no_grad():
        return [out_proj_partials(Transformer(one, w1, group=LocalGroup(r, tp), attn_backend=backend, device=device,
                                              dtype=dtype), batch.to(device)).cpu() for r in range(tp)]
