"""The vocabulary split over TP ranks: ``VocabParallelEmbedding`` and ``ParallelLMHead`` (vLLM's names).

Rank r keeps the rows ``[lo, hi)`` of the ``[V, d]`` table (``vocab_range``: contiguous, equal
shares; a real deployment pads V to a multiple of the TP size first).

- ``VocabParallelEmbedding``: a token whose id lies in ``[lo, hi)`` gets its row on this rank,
  every other token zeros; one all-reduce of ``[T, d]`` adds the ranks' rows, so every token
  has its embedding on every rank.
- ``ParallelLMHead``: ``hidden [T, d] @ table[lo:hi].T`` are the logits of this rank's ids,
  ``[T, V/tp]``; one all-gather puts the pieces side by side: ``[T, V]`` on every rank. GPT-2
  ties it to the embedding (the same rows): ``ParallelLMHead.tied_to(embedding)``.

The model of this course keeps both whole (they are small next to its blocks); lesson 04's
exercise 04.1 runs the model with these two around its blocks.

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..core.groups import LocalGroup

Tensor = torch.Tensor


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The token ids ``[lo, hi)`` whose rows rank ``rank`` keeps (contiguous, equal shares)."""
    if vocab_size % world_size:
        raise ValueError(f"vocab_size={vocab_size} is not divisible by world_size={world_size}: a real deployment "
                         f"pads the vocabulary to a multiple (GPT-2's 50257 becomes 50304)")
    n = vocab_size // world_size
    return rank * n, (rank + 1) * n


class VocabParallelEmbedding(nn.Module):
    """``ids [T]`` → ``[T, embedding_dim]`` on every rank; this rank holds ``weight [V/tp, d]`` (see the module)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None, dtype: torch.dtype = torch.float32,
                 name: str = "wte"):
        super().__init__()
        self.group = group if group is not None else LocalGroup()
        self.num_embeddings, self.embedding_dim, self.name = num_embeddings, embedding_dim, name
        self.lo, self.hi = vocab_range(num_embeddings, self.group.rank, self.group.world_size)
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, embedding_dim, dtype=dtype), requires_grad=False)

    @torch.no_grad()
    def load_full_(self, weight: Tensor):
        """Copy this rank's rows ``[lo, hi)`` of the full ``weight [V, d]`` (any device, cast)."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"full weight must have shape {(self.num_embeddings, self.embedding_dim)}, "
                             f"got {tuple(weight.shape)}")
        self.weight.copy_(weight[self.lo:self.hi])
        return self

    def forward(self, ids: Tensor) -> Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        rows = torch.zeros(ids.shape[0], self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)
        rows[mine] = self.weight[ids[mine] - self.lo]       # zeros where another rank keeps the id
        return self.group.all_reduce(rows, layer=self.name)  # [T, d]: every token, every rank


class ParallelLMHead(VocabParallelEmbedding):
    """``hidden [T, d]`` → logits ``[T, V]`` on every rank, from this rank's ``weight [V/tp, d]`` (see the module)."""

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
        return self.group.all_gather(hidden @ self.weight.T, layer=self.name)  # [T, V/tp] per rank -> [T, V]
