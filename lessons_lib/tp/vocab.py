"""The vocabulary split over TP ranks: ``VocabParallelEmbedding`` and ``ParallelLMHead`` (vLLM's names).

One rule for every vocabulary: it is padded to a multiple of the TP size (``pad_vocab_size(V, tp)``,
vLLM's function), so every rank holds ``num_embeddings_per_partition = ceil(V / tp)`` rows of the
``[V, d]`` table, rank r the ids ``vocab_range(V, r, tp)``; the last rank's rows past V are zeros.
(vLLM pads to a multiple of 64 first, for its kernels; the split is the same.)

- ``VocabParallelEmbedding``: a token whose id lies in this rank's range gets its row here, every
  other token zeros; one all-reduce of ``[T, d]`` adds the ranks' rows, so every token has its
  embedding on every rank.
- ``ParallelLMHead``: ``hidden [T, d] @ weight.T`` are the logits of this rank's ids, ``[T, V_pad/tp]``;
  one all-gather puts the pieces side by side and the padded columns are dropped: ``[T, V]`` on every
  rank. GPT-2 ties it to the embedding (the same rows): ``ParallelLMHead.tied_to(embedding)``.
- ``vocab_parallel_logits(model, batch)``: a model's forward with both around its blocks.

The engine's model keeps both whole (they are small next to its blocks).

Taught in notebooks/00_setup_one_request.ipynb and notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ..core.batch import PackedBatch, pack
from ..core.groups import LocalGroup
from ..validate import check_batch, check_int, check_lengths

Tensor = torch.Tensor


def pad_vocab_size(vocab_size: int, pad_to: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``): 50257 → 50258 for
    ``pad_to=2``, 50304 for 64."""
    v, p = check_int("vocab_size", vocab_size, 1), check_int("pad_to", pad_to, 1)
    return (v + p - 1) // p * p


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The token ids ``[lo, hi)`` whose rows rank ``rank`` of ``world_size`` holds: the rank's
    ``pad_vocab_size(vocab_size, world_size) / world_size`` rows, cut at ``vocab_size`` (the last rank's
    range may be shorter, even empty; its padded rows are nobody's id)."""
    ws = check_int("world_size", world_size, 1)
    r = check_int("rank", rank, 0, ws - 1)
    n = pad_vocab_size(vocab_size, ws) // ws
    return min(r * n, vocab_size), min((r + 1) * n, vocab_size)


class VocabParallelEmbedding(nn.Module):
    """``ids [T]`` → ``[T, embedding_dim]`` on every rank; this rank holds ``weight [ceil(V/tp), d]`` (see the module)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None, dtype: torch.dtype = torch.float32,
                 name: str = "wte"):
        super().__init__()
        self.group = group if group is not None else LocalGroup()
        self.num_embeddings, self.embedding_dim, self.name = num_embeddings, embedding_dim, name
        self.num_embeddings_per_partition = pad_vocab_size(num_embeddings, self.group.world_size) // self.group.world_size
        self.lo, self.hi = vocab_range(num_embeddings, self.group.rank, self.group.world_size)
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)

    @torch.no_grad()
    def load_full_(self, weight: Tensor):
        """Copy this rank's rows ``[lo, hi)`` of the full ``weight [V, d]`` (any device, cast); padded rows stay 0."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"full weight must have shape {(self.num_embeddings, self.embedding_dim)}, "
                             f"got {tuple(weight.shape)}")
        self.weight[:self.hi - self.lo].copy_(weight[self.lo:self.hi])
        return self

    def forward(self, ids: Tensor) -> Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        rows = torch.zeros(ids.shape[0], self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)
        rows[mine] = self.weight[ids[mine] - self.lo]       # zeros where another rank holds the id
        return self.group.all_reduce(rows, layer=self.name)  # [T, d]: every token, every rank


class ParallelLMHead(VocabParallelEmbedding):
    """``hidden [T, d]`` → logits ``[T, V]`` on every rank, from this rank's ``weight [ceil(V/tp), d]`` (see the module)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None, dtype: torch.dtype = torch.float32,
                 name: str = "lm_head"):
        super().__init__(num_embeddings, embedding_dim, group=group, dtype=dtype, name=name)

    @classmethod
    def tied_to(cls, embedding: VocabParallelEmbedding, name: str = "lm_head") -> ParallelLMHead:
        """A head that shares ``embedding``'s rows (GPT-2's tied weights): no copy."""
        head = cls(embedding.num_embeddings, embedding.embedding_dim, group=embedding.group,
                   dtype=embedding.weight.dtype, name=name)
        head.weight = embedding.weight
        return head

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.group.all_gather(hidden @ self.weight.T, layer=self.name)  # [T, V_pad/tp] per rank -> [T, V_pad]
        return logits[:, :self.num_embeddings]                                   # [T, V]: the padded ids dropped


def vocab_parallel_logits(model, batch: PackedBatch) -> Tensor:
    """Logits ``[T, V]`` on every rank of ``model.group`` for a batch of token ids, with the model's token
    embedding and tied LM head split by vocabulary (cut from its ``wte``) around its blocks: equal to
    ``model.compute_logits(model(batch))`` at TP=1. Collectives: the embedding's all-reduce ("wte"), the
    blocks' two per layer, the head's all-gather ("lm_head"). The position table stays whole (it is small)."""
    cfg = model.cfg
    check_batch(cfg, batch, model.device)
    if batch.input_ids is None:
        raise ValueError("batch must hold token ids (input_ids): the vocab-parallel embedding looks them up")
    if any(batch.num_computed_tokens or ()):
        raise ValueError(f"batch continues requests (num_computed_tokens={batch.num_computed_tokens}): "
                         "vocab_parallel_logits runs whole prompts only (no KV cache)")
    embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, group=model.group, dtype=model.dtype)
    embedding = embedding.to(model.device).load_full_(model.wte)
    x = embedding(batch.input_ids) + model.wpe[batch.positions]              # [T, d], every token, every rank
    hidden = model(pack(list(x.split(batch.seq_lens)), device=model.device))  # the blocks and the final LayerNorm
    return ParallelLMHead.tied_to(embedding)(hidden)                          # [T, V] on every rank


@functools.lru_cache(maxsize=8)  # the weights do not change a trace; building the article's model is the slow part
def _stand_in_model(cfg, rank: int, world_size: int):
    from ..core.model import Transformer

    zeros = {name: torch.zeros(shape, dtype=cfg.dtype) for name, shape in cfg.weight_shapes().items()}
    return Transformer(cfg, zeros, group=LocalGroup(rank, world_size), attn_backend="masked")


def vocab_parallel_trace(cfg, seq_lens, world_size: int, rank: int = 0) -> list:
    """The collectives rank ``rank`` of ``world_size`` makes in one ``vocab_parallel_logits`` of requests of
    ``seq_lens`` tokens (``cfg`` a ``ModelConfig``), dry-run on a stand-in rank (``LocalGroup``, zero weights):
    ``[CollectiveRecord, ...]`` in call order."""
    lens = check_lengths(seq_lens)
    model = _stand_in_model(cfg, rank, world_size)
    ids = torch.arange(sum(lens)) * 7 % cfg.vocab_size                 # ids spread over every rank's share
    model.group.trace.clear()
    vocab_parallel_logits(model, pack(list(ids.split(lens))))
    return list(model.group.trace)
