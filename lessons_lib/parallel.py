"""Process groups for tensor parallelism, with a trace of every collective.

A group is anything with ``rank``, ``world_size``, ``trace`` and
``all_reduce(tensor, *, layer) -> tensor``. ``LocalGroup`` is the one-process group (TP=1):
its all-reduce is the identity and records nothing, because nothing crosses a process.
``DistGroup`` wraps a real ``torch.distributed`` process group: its all-reduce is a real
``dist.all_reduce`` and appends one ``CollectiveRecord`` per call.

``launch(fn, world_size=2)`` runs ``fn(group)`` on real worker processes, one per rank, and
returns every rank's result and trace; failures surface as ``WorkerFailed`` /
``WorkerTimeout`` with no process left behind (``workers.py`` says how).

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .workers import WorkerFailed, WorkerPool, WorkerTimeout, resolve_dist_backend

__all__ = ["CollectiveRecord", "LocalGroup", "DistGroup", "LaunchResult", "launch", "all_reduce_probe",
           "WorkerFailed", "WorkerTimeout", "WorkerPool", "resolve_dist_backend"]


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


class DistGroup:
    """A real process group (default: the WORLD group of ``torch.distributed``) that traces.

    ``all_reduce(tensor, layer=...)`` sums ``tensor`` over all ranks IN PLACE with
    ``dist.all_reduce`` and returns it; then appends a ``CollectiveRecord`` to ``trace``.
    ``device`` is where this rank's tensors live (cpu for gloo, ``cuda:<rank>`` for nccl).

    Cross-check: on torch 2.13 with gloo, PyTorch's own
    ``torch.distributed.tensor.debug.CommDebugMode`` DOES count a plain ``dist.all_reduce``
    (as ``c10d.allreduce_``), so ``tp.traced_forward`` compares both counts on every forward
    (tests/test_tp.py::test_commdebugmode_counts_plain_all_reduce).
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
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        self.trace.append(CollectiveRecord("all_reduce", tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                           tensor.numel() * tensor.element_size(), layer, self.rank, self.world_size))
        return tensor

    def __repr__(self) -> str:
        return f"DistGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"


@dataclass
class LaunchResult:
    """What ``launch`` returns: ``results[r]`` is ``fn``'s return value on rank r, ``traces[r]``
    that rank's ``CollectiveRecord`` list; ``startup_s``: spawn → every rank in the group."""

    results: list
    traces: list[list[CollectiveRecord]]
    backend: str
    world_size: int
    startup_s: float
    wall_s: float


def _run_fn(group, channel, fn, args, kwargs):
    result = fn(group, *args, **kwargs)
    channel.send((result, list(group.trace)))


def _check_importable(fn) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise ValueError(f"fn={name} is defined in an interactive session (a notebook cell); spawned workers "
                         "cannot import it. Define worker functions in lessons_lib.")
    if "<lambda>" in name or "<locals>" in name:
        raise ValueError(f"fn={name} is a lambda or a nested function; spawned workers can only import "
                         "module-level functions")


def launch(fn, world_size: int = 2, backend: str = "auto", timeout: float = 120.0, args: tuple = (),
           kwargs: dict | None = None, *, verbose: bool = True) -> LaunchResult:
    """Run ``fn(group, *args, **kwargs)`` on ``world_size`` fresh worker processes, one per rank.

    fn: an importable function (lives in ``lessons_lib``); ``group`` is the rank's ``DistGroup``.
    backend: "auto" (nccl with one GPU per rank, else gloo on the CPU), "gloo" or "nccl"; the
    one that ran is printed and returned. timeout: seconds for startup and again for ``fn``.
    Arguments and results are pickled (copies). Raises ``WorkerFailed`` / ``WorkerTimeout``
    (workers already cleaned up) instead of hanging.

    Taught in notebooks/04_tp2_invariance.ipynb.
    """
    _check_importable(fn)
    t0 = time.perf_counter()
    pool = WorkerPool(world_size, backend, timeout, verbose=verbose, name="launch")
    try:
        startup = pool.start(_run_fn, (fn, tuple(args), dict(kwargs or {})))
        out = pool.collect("result", what=f"running {getattr(fn, '__qualname__', fn)}")
    finally:
        pool.close()
    return LaunchResult([o[0] for o in out], [o[1] for o in out], pool.backend, world_size, startup,
                        time.perf_counter() - t0)


def all_reduce_probe(group, rows: int = 4) -> list[float]:
    """A minimal worker for ``launch``: all-reduce ``[rows, 512]`` filled with ``rank + 1``;
    returns the first column (each entry ``1 + 2 + ... + world_size``)."""
    x = torch.full((rows, 512), float(group.rank + 1), device=group.device)
    return group.all_reduce(x, layer="probe")[:, 0].tolist()
