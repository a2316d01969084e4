"""Process groups for tensor parallelism, with a trace of every collective.

A group is anything with ``rank``, ``world_size``, ``trace`` and
``all_reduce(tensor, *, layer) -> tensor``. ``LocalGroup`` is the one-process group (TP=1):
its all-reduce is the identity and records nothing, because nothing crosses a process.

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class CollectiveRecord:
    """One collective call as a rank saw it."""

    op: str          # "all_reduce"
    shape: tuple     # e.g. (40, 512)
    dtype: str       # "float32"
    bytes: int       # payload bytes on this rank
    layer: str       # e.g. "layers.3.attn.out_proj"
    rank: int
    world_size: int


@dataclass
class LocalGroup:
    """TP=1: the whole model in one process; all_reduce is a no-op and is not traced."""

    rank: int = 0
    world_size: int = 1
    trace: list = field(default_factory=list)

    def all_reduce(self, tensor: torch.Tensor, *, layer: str = "") -> torch.Tensor:
        return tensor
