"""Process groups for tensor parallelism, and the record of every collective they make.

A group is anything with ``rank``, ``world_size``, ``trace``, ``all_reduce(tensor, *, layer) ->
tensor`` (the sum over the ranks) and ``all_gather(tensor, *, layer) -> tensor`` (every rank's
``[..., n]`` side by side along the last dim, in rank order: ``[..., n · world_size]``). Both
record what this rank sent. Two kinds here, both explicit objects (no global state), and ranks
as threads in ``tp.threads``:

- ``LocalGroup(rank=0, world_size=1)``: no other process. At ``world_size=1`` (TP=1) its
  collectives are the identity and record nothing: nothing would cross a process. With
  ``world_size > 1`` it stands in for rank ``rank`` of a TP group inside this process: the
  model cuts that rank's shards, and each collective is recorded exactly as a real rank's
  would be but NOT exchanged (there is no one to exchange with): the all-reduce returns this
  rank's partial, the all-gather ``world_size`` copies of this rank's piece: right traces and
  shapes, partial values.
- ``DistGroup``: a real ``torch.distributed`` group; its collectives run over the ranks.

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..validate import check_int, dtype_name


@dataclass(slots=True)
class CollectiveRecord:
    """One collective call as a rank saw it, e.g. ``all_reduce (40, 512) float32 81920 B``."""

    op: str          # "all_reduce" or "all_gather"
    shape: tuple     # e.g. (40, 512)
    dtype: str       # "float32"
    bytes: int       # payload bytes on this rank
    layer: str       # e.g. "layers.3.attn.out_proj"
    rank: int
    world_size: int

    @property
    def signature(self) -> tuple:
        """The record without its rank: equal on every rank of a correct TP forward."""
        return self.op, tuple(self.shape), self.dtype, self.bytes, self.layer


def record(tensor: torch.Tensor, layer: str, rank: int, world_size: int, op: str = "all_reduce") -> CollectiveRecord:
    """What this rank sent: ``tensor`` (for an all-gather, its own piece)."""
    return CollectiveRecord(op, tuple(tensor.shape), dtype_name(tensor.dtype),
                            tensor.numel() * tensor.element_size(), layer, rank, world_size)


@dataclass
class LocalGroup:
    """This process only: TP=1, or a stand-in for rank ``rank`` of ``world_size`` (see module doc)."""

    rank: int = 0
    world_size: int = 1
    trace: list = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        check_int("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank} must be < world_size={self.world_size}")

    def all_reduce(self, tensor: torch.Tensor, *, layer: str = "") -> torch.Tensor:
        """``tensor`` unchanged (nothing to sum with); recorded when standing in for a rank of a TP group."""
        if self.world_size > 1:
            self.trace.append(record(tensor, layer, self.rank, self.world_size))
        return tensor

    def all_gather(self, tensor: torch.Tensor, *, layer: str = "") -> torch.Tensor:
        """``world_size`` copies of ``tensor [..., n]`` side by side (``[..., n · world_size]``: the right
        shape, not the other ranks' values); recorded when standing in for a rank of a TP group."""
        if self.world_size == 1:
            return tensor
        self.trace.append(record(tensor, layer, self.rank, self.world_size, "all_gather"))
        return torch.cat([tensor] * self.world_size, dim=-1)


class DistGroup:
    """A real process group (default: WORLD of ``torch.distributed``) that records its collectives.

    ``all_reduce(tensor, layer=...)`` sums ``tensor`` over all ranks IN PLACE with
    ``dist.all_reduce`` and returns it; ``all_gather`` concatenates the ranks' pieces along the
    last dim with ``dist.all_gather``. ``device``: where this rank's tensors live (``cpu`` for
    gloo, ``cuda:<local rank>`` for NCCL); every collective's tensor must be there.
    """

    def __init__(self, process_group=None, device: torch.device | str = "cpu"):
        if not dist.is_initialized():
            raise RuntimeError("DistGroup needs torch.distributed.init_process_group() first")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.backend = str(dist.get_backend(process_group))
        self.device = torch.device(device)
        self.trace: list[CollectiveRecord] = []

    def all_reduce(self, tensor: torch.Tensor, *, layer: str = "") -> torch.Tensor:
        """Sum ``tensor`` (any shape, on ``self.device``) over the ranks, in place; record it; return it."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        self.trace.append(record(tensor, layer, self.rank, self.world_size))
        return tensor

    def all_gather(self, tensor: torch.Tensor, *, layer: str = "") -> torch.Tensor:
        """Every rank's ``tensor [..., n]`` (same shape on every rank) side by side: ``[..., n · world_size]``."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.process_group)
        self.trace.append(record(tensor, layer, self.rank, self.world_size, "all_gather"))
        return torch.cat(parts, dim=-1)

    def __repr__(self) -> str:
        return f"DistGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"
