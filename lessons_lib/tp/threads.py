"""A TP group whose ranks are threads of this process: real sums and gathers, no processes.

``tp_ranks_in_threads(world_size, fn)`` runs ``fn(group)`` on ``world_size`` threads; each
``ThreadRank`` really sums (``all_reduce``) and gathers (``all_gather``) over the threads, every
rank waiting for the others as over NCCL or gloo, and records each collective as
``core.groups.DistGroup`` does. Exercises and tests use it where spawning processes would cost
seconds; ``tp.runtime`` is the same model on real processes.

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..core.groups import record
from ..validate import check_int

Tensor = torch.Tensor


@dataclass
class ThreadRank:
    """Rank ``rank`` of a TP group whose ranks are threads of this process (see the module)."""

    rank: int
    world_size: int
    _shared: dict = field(repr=False)
    trace: list = field(default_factory=list)

    def _exchange(self, tensor: Tensor, combine) -> Tensor:
        s = self._shared
        s["slots"][self.rank] = tensor
        s["barrier"].wait()
        out = combine(list(s["slots"]))
        s["barrier"].wait()                      # nobody overwrites a slot before every rank has read them all
        return out

    def all_reduce(self, tensor: Tensor, *, layer: str = "") -> Tensor:
        """Sum ``tensor`` over the ranks, in place (as ``DistGroup``); record it; return it."""
        total = self._exchange(tensor, lambda parts: torch.stack(parts).sum(0))
        self.trace.append(record(total, layer, self.rank, self.world_size))
        tensor.copy_(total)
        return tensor

    def all_gather(self, tensor: Tensor, *, layer: str = "") -> Tensor:
        """Every rank's ``[..., n]`` side by side along the last dim, in rank order: ``[..., n · world_size]``.
        The record holds what this rank contributed (``[..., n]``)."""
        out = self._exchange(tensor, lambda parts: torch.cat(parts, dim=-1))
        self.trace.append(record(tensor, layer, self.rank, self.world_size, "all_gather"))
        return out


def tp_ranks_in_threads(world_size: int, fn: Callable[[ThreadRank], object], timeout: float = 20.0) -> list:
    """Run ``fn(rank_group)`` on ``world_size`` threads that form one TP group; ``[(result, trace)]``
    in rank order.

    If a rank raises, the others are released (the barrier is broken) and the first error is
    re-raised here, so a wrong answer never hangs the caller.
    """
    ws = check_int("world_size", world_size, 1, 16)
    shared = {"slots": [None] * ws, "barrier": threading.Barrier(ws, timeout=timeout)}
    groups = [ThreadRank(r, ws, shared) for r in range(ws)]
    results, errors = [None] * ws, [None] * ws

    def run(r):
        try:
            results[r] = fn(groups[r])
        except BaseException as exc:  # handed back to the caller below
            errors[r] = exc
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ws)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 5)
    failed = [e for e in errors if e is not None]
    if failed:  # the root cause first: the other ranks only saw the broken barrier
        raise next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)), failed[0])
    return [(res, g.trace) for res, g in zip(results, groups)]


@torch.no_grad()
def row_parallel_in_threads(weight: Tensor, bias: Tensor | None, x: Tensor, tp: int = 2) -> tuple[list[Tensor], list[list]]:
    """The engine's ``RowParallelLinear`` holding the full ``weight [out, in]`` and ``bias [out]``, cut over
    ``tp`` ranks that are threads of this process and really all-reduce; rank r gets its slice of the input
    features of ``x [T, in]`` (``in`` divisible by ``tp``). Returns each rank's output ``[T, out]`` and each
    rank's list of collectives (``CollectiveRecord``). Faults on in this process (``faults.injected``) apply."""
    from ..core.linear import RowParallelLinear

    n = check_int("in_features", weight.shape[1], 1) // check_int("tp", tp, 1, 16)

    def rank(group):
        layer = RowParallelLinear(weight.shape[1], weight.shape[0], bias is not None, group=group, dtype=weight.dtype,
                                  name="row_parallel").load_full_(weight, bias)
        return layer(x[:, group.rank * n:(group.rank + 1) * n].contiguous())

    results = tp_ranks_in_threads(tp, rank)
    return [y for y, _ in results], [list(trace) for _, trace in results]


@torch.no_grad()
def forward_in_threads(cfg, weights: dict, batch, tp: int, device="cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """The whole forward of ``batch`` (a ``PackedBatch``) on ``tp`` thread ranks that really add, each rank's
    ``Transformer(cfg, weights)`` built here on ``device`` in ``dtype`` (faults on in this process apply): rank 0's
    output ``[T, d_model]``, on the CPU."""
    from ..core.model import Transformer

    def run(group):
        return Transformer(cfg, weights, group=group, device=device, dtype=dtype)(batch.to(device)).cpu()
    return tp_ranks_in_threads(check_int("tp", tp, 1, cfg.n_heads), run)[0][0]


class TapGroup:
    """A rank's group for models built once and run on thread ranks many times: while ``serving(inner)`` is
    open each collective goes to ``inner`` (the ``ThreadRank`` of the forward in flight, which really sums over
    the threads and records), and the tensor this rank hands to the all-reduce named ``tapped`` is kept in
    ``sent`` (a copy): its own partial sums, before they are added to the other ranks'. At ``world_size`` 1 an
    all-reduce returns its input (as ``LocalGroup``)."""

    def __init__(self, rank: int, world_size: int, tapped: str):
        self.rank, self.world_size, self.tapped, self.inner, self.sent = rank, world_size, tapped, None, None

    @contextlib.contextmanager
    def serving(self, inner):
        self.inner = inner
        try:
            yield self
        finally:
            self.inner = None

    def all_reduce(self, tensor: Tensor, *, layer: str = "") -> Tensor:
        if layer == self.tapped:
            self.sent = tensor.clone()
        if self.world_size == 1:
            return tensor
        return self.inner.all_reduce(tensor, layer=layer)

    def all_gather(self, tensor: Tensor, *, layer: str = "") -> Tensor:
        return self.inner.all_gather(tensor, layer=layer)


@torch.no_grad()
def module_error_in_threads(cfg, weights: dict, batch, tp: int, module: str) -> tuple[Tensor, Tensor, float]:
    """The output of ``module`` (a path such as ``"layers.0.attn.out_proj"``) in one forward of ``batch`` on ``tp``
    thread ranks that really add, each rank's ``Transformer(cfg, weights)`` built here (faults on in this process
    apply), against the one-process forward: ``(error, bias, allowed)``. ``error`` ``[T, out]`` float64: rank 0's
    output minus the one-process output in float64 (loop attention); ``bias`` the module's bias (a copy);
    ``allowed`` the tolerance rule's bound of the one-process float32 output."""
    from ..core.model import Transformer
    from ..measure.recorder import module_io
    from ..measure.tolerance import tolerance

    def output(model):
        return module_io(model, [module], lambda: model(batch))[module][1]
    got = tp_ranks_in_threads(check_int("tp", tp, 1, cfg.n_heads), lambda g: output(Transformer(cfg, weights, group=g)))
    tp1, fp64 = Transformer(cfg, weights), Transformer(cfg, weights, dtype=torch.float64, attn_backend="loop")
    ref, ref64 = output(tp1), output(fp64)
    return got[0][0].double() - ref64, tp1.get_submodule(module).bias.detach().clone(), tolerance(ref, ref64)


def tapped_forward(models: list, batch) -> list[tuple[Tensor, Tensor | None, list]]:
    """One forward of ``batch`` by each of ``models`` (rank r's model on a ``TapGroup`` of rank r, one per rank)
    on thread ranks that really add: per rank ``(output, sent, trace)``, ``sent`` what it handed to the tapped
    all-reduce (None if none ran), ``trace`` its collectives. Faults on in this process apply."""
    def run(group):
        with models[group.rank].group.serving(group) as tap:
            return models[group.rank](batch), tap.sent
    with torch.no_grad():
        return [(out, sent, trace) for (out, sent), trace in tp_ranks_in_threads(len(models), run)]
