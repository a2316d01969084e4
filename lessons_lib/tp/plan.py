"""What one TP rank holds of the model: its shard read off the built model, and the parameter count of a plan.

- ``shard_table``: each of a block's parameters at TP=1 and on a rank, and how it is cut.
- ``row_spans``: the rows of the full weight a column-parallel layer keeps, as runs.
- ``heads_held``: which heads of Q, K and V a rank's fused QKV weight holds, matched against the full weight.
- ``tp_sizes``, ``rank_params``, ``smallest_tp``: the TP sizes a config splits over, what rank 0 holds there (with
  the token table whole or vocab-parallel), and the smallest TP size under a per-rank budget.

Taught in notebooks/00_setup_one_request.ipynb.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from ..core.config import ModelConfig
from ..core.groups import LocalGroup
from ..core.model import Transformer
from ..validate import check_int, check_tp_divides
from .vocab import VocabParallelEmbedding


def _cut(full: tuple, shard: tuple) -> str:
    if full == shard:
        return "whole (replicated)"
    if full[0] != shard[0]:
        return "split: output features"
    return "split: input features"


def shard_table(full: Transformer, shard: Transformer, layer: int = 0) -> list[tuple[str, list, list, str]]:
    """``(parameter, TP=1 shape, shape on the shard's rank, how it is cut)`` for one block's parameters."""
    mine = dict(shard.layers[layer].named_parameters())
    return [(name, list(p.shape), list(mine[name].shape), _cut(tuple(p.shape), tuple(mine[name].shape)))
            for name, p in full.layers[layer].named_parameters()]


def heads_held(weights: Mapping[str, torch.Tensor], shard: Transformer, layer: int = 0) -> dict[str, list[int]]:
    """Which heads of Q, K and V a rank's fused QKV weight holds, found by matching each
    ``d_head``-row block of the shard against the full weight: ``{"Q": [0, 1, 2, 3], "K": ..., "V": ...}``."""
    cfg = shard.cfg
    full = weights[f"layers.{layer}.attn.qkv.weight"].to(shard.dtype)  # [(H + 2·H_kv)·D, d]: Q heads | K heads | V heads
    mine = shard.layers[layer].attn.qkv.weight.detach().cpu()          # this rank's rows of it
    first = {"Q": 0, "K": cfg.n_heads, "V": cfg.n_heads + cfg.n_kv_heads}  # each part's first head, in d_head rows
    count = {"Q": cfg.n_heads, "K": cfg.n_kv_heads, "V": cfg.n_kv_heads}
    blocks = {(part, h): full[(first[part] + h) * cfg.d_head:(first[part] + h + 1) * cfg.d_head]
              for part in "QKV" for h in range(count[part])}
    found: dict[str, list[int]] = {"Q": [], "K": [], "V": []}
    for j in range(mine.shape[0] // cfg.d_head):
        block = mine[j * cfg.d_head:(j + 1) * cfg.d_head]
        match = next((key for key, b in blocks.items() if torch.equal(b, block)), None)
        if match is not None:
            found[match[0]].append(match[1])
    return found


def row_spans(layer) -> list[tuple[int, int]]:
    """The rows of the full weight a column-parallel ``layer`` keeps on its rank, read off the layer's own
    ``shard_rows``, as ``(start, stop)`` runs of consecutive rows (``[(0, 256), (512, 768), (1024, 1280)]``
    for rank 0's QKV at TP=2)."""
    spans: list[list[int]] = []
    for row in layer.shard_rows(torch.arange(layer.out_features)).tolist():
        if spans and spans[-1][1] == row:
            spans[-1][1] = row + 1
        else:
            spans.append([row, row + 1])
    return [(start, stop) for start, stop in spans]


@functools.cache
def _held(cfg: ModelConfig, tp_size: int) -> dict[str, int]:
    """Parameters of rank 0's real shard under TP=``tp_size``, by name (the model on a one-process stand-in group)."""
    model = Transformer(cfg, seed=0, group=LocalGroup(0, tp_size))
    return {name: p.numel() for name, p in model.named_parameters()}


def held_by_name(cfg: ModelConfig, tp_size: int) -> dict[str, int]:
    """Parameters of rank 0's real shard under TP=``tp_size`` (the token table whole), by parameter name."""
    return dict(_held(cfg, check_int("tp_size", tp_size, 1)))


def rank_params(cfg: ModelConfig, tp_size: int, vocab_parallel: bool = False) -> int:
    """Parameters rank 0 holds under TP=``tp_size``, counted on its real shard. With ``vocab_parallel`` its token
    table ``wte`` (and so the tied LM head) is the engine's ``tp.vocab.VocabParallelEmbedding`` shard instead:
    ``pad_vocab_size(vocab_size, tp_size) / tp_size`` rows; everything else as in the engine."""
    held = held_by_name(cfg, tp_size)
    if vocab_parallel:
        with torch.device("meta"):  # the shard's shape, nothing allocated
            held["wte"] = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, group=LocalGroup(0, tp_size)).weight.numel()
    return sum(held.values())


def _splits(cfg: ModelConfig, p: int) -> bool:
    try:
        check_tp_divides(cfg, "tp_size", p)
    except ValueError:
        return False
    return True


def tp_sizes(cfg: ModelConfig) -> list[int]:
    """The TP sizes the engine can split ``cfg`` over: those ``validate.check_tp_divides`` accepts (they divide
    ``n_heads`` and ``d_ffn``, and divide or are a multiple of ``n_kv_heads``)."""
    return [p for p in range(1, cfg.n_heads + 1) if _splits(cfg, p)]


def smallest_tp(cfg: ModelConfig, budget: int, vocab_parallel: bool = False) -> int | None:
    """The smallest TP size (one of ``tp_sizes(cfg)``) at which rank 0 holds at most ``budget`` parameters
    (``rank_params``), or None when none does."""
    check_int("budget", budget, 1)
    return next((p for p in tp_sizes(cfg) if rank_params(cfg, p, vocab_parallel) <= budget), None)
