"""Spawned worker processes for tensor parallelism: start them, talk to them, fail cleanly.

``WorkerPool`` starts one process per rank (``torch.multiprocessing``, spawn), joins them into
one ``torch.distributed`` group (each gets a ``core.groups.DistGroup``) and runs
``entry(group, channel, *args)`` in each; ``launch`` (one call) and ``runtime.TPRuntime``
(many forwards) are built on it. Guarantees, each covered by tests/test_tp_faults.py:

- ``backend="auto"`` with ``device="cuda"`` is NCCL with one GPU per rank, else gloo with CUDA
  tensors (ranks sharing a GPU; if gloo cannot, the ranks run on the CPU and say so); with
  ``device="cpu"`` gloo; 2 ranks on 2 cores get one thread each (no over-subscription); gloo
  listens on the loopback interface only;
- rendezvous through a file store in a fresh temporary directory, so two runs never share a
  port or a stale rendezvous file;
- a worker that raises → ``WorkerFailed`` in the caller, naming the rank, with the child's
  traceback; a worker that dies (e.g. SIGKILL) → ``WorkerFailed`` naming the rank and signal;
  no answer within ``timeout`` → ``WorkerTimeout``; in every case all workers are terminated
  and joined before the exception reaches the caller, and the next launch works;
- messages are plain pickles over one pipe per direction per rank (copies: no shared memory
  that would die with a worker).

Entry functions must be importable (defined in ``lessons_lib``, not in a notebook cell):
spawned children import them by name.

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as _wait_ready

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..core.groups import DistGroup
from ..validate import check_int, check_seconds


def resolve_dist_backend(backend: str = "auto", world_size: int = 2, device="cpu") -> str:
    """The collective backend for ``world_size`` ranks on this machine whose tensors live on ``device``.

    ``"auto"``: CPU tensors → gloo; CUDA tensors → NCCL when there is one GPU per rank, else
    gloo with CUDA tensors (several ranks sharing a GPU; gloo's all-reduce takes CUDA tensors).
    ``world_size`` is the number of ranks on THIS node (under torchrun: ``LOCAL_WORLD_SIZE``).
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but CUDA is not available here")
    gpus = torch.cuda.device_count() if cuda else 0
    if backend == "auto":
        return "nccl" if cuda and gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not cuda:
        raise ValueError("backend='nccl' moves CUDA tensors only: use device='cuda' (the CPU runs gloo)")
    if backend == "nccl" and (gpus < world_size or not dist.is_nccl_available()):
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"torch.cuda.device_count()={gpus} (nccl available: {dist.is_nccl_available()})")
    return backend


class WorkerFailed(RuntimeError):
    """A worker raised or died. ``rank``: the root-cause rank; ``child_traceback``: its traceback
    (None if it died without one); ``exitcode``: its exit code (negative = killed by signal)."""

    def __init__(self, message: str, rank: int, child_traceback: str | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank, self.child_traceback, self.exitcode = rank, child_traceback, exitcode


class WorkerTimeout(TimeoutError):
    """No answer from ``ranks`` within the deadline; the workers were terminated."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


@dataclass(slots=True)
class _Failure:
    rank: int
    died: bool              # True: exited without a message (signal, os._exit)
    time: float             # when it happened (time.time(); the child's clock for raised errors)
    summary: str
    child_traceback: str | None = None
    exitcode: int | None = None


_GRACE_S = 1.0  # after a first failure, wait this long for the others: the root cause may arrive second


def _loopback_ifname() -> str | None:
    """The loopback interface ("lo" on Linux, "lo0" on macOS), if this machine has one."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((n for n in ("lo", "lo0") if n in names), None)


def threads_per_worker(world_size: int) -> int:
    """Torch threads each of ``world_size`` CPU ranks gets: this process's cores shared out, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)


class Channel:
    """A worker's end of its two pipes. ``send(obj)`` returns ``obj`` to the caller; ``recv()``
    waits for the caller's next command (EOFError when the caller is gone)."""

    def __init__(self, rank: int, cmd_conn, res_conn):
        self.rank, self._cmd, self._res = rank, cmd_conn, res_conn

    def _post(self, kind: str, payload) -> None:
        self._res.send_bytes(pickle.dumps((kind, self.rank, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def send(self, obj) -> None:
        self._post("result", obj)

    def recv(self):
        return pickle.loads(self._cmd.recv_bytes())


def commands(channel: Channel):
    """A worker loop's commands: yield each command the caller sends on ``channel``, in order, and stop
    (return) at ``("close",)`` or when the caller is gone (EOF). The loop body answers with ``channel.send``."""
    while True:
        try:
            cmd = channel.recv()
        except EOFError:  # the caller is gone
            return
        if cmd[0] == "close":
            return
        yield cmd


def _rank_device(rank: int, backend: str, device_type: str) -> tuple[torch.device, str]:
    """Where rank ``rank``'s tensors live: its own GPU under NCCL, a shared GPU under gloo, or the CPU."""
    if device_type != "cuda":
        return torch.device("cpu"), "cpu"
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device, "one GPU per rank" if backend == "nccl" else "ranks share a GPU, gloo on CUDA tensors"


def _bootstrap(rank, world_size, backend, device_type, init_method, pg_timeout_s, threads, entry, args, kwargs,
               cmd_conn, res_conn):
    """Child process main: join the process group, then run ``entry(group, channel, *args)``."""
    channel = Channel(rank, cmd_conn, res_conn)
    try:
        from .. import faults  # here, not at the top: faults patches the engine, tp.workers included (see test_architecture)
        faults.apply_from_env()  # the faults the parent had on when it spawned this rank (faults.injected)
        torch.set_num_threads(threads)  # 2 ranks on 2 cores: one thread each, no over-subscription
        lo = _loopback_ifname()
        if backend == "gloo" and lo and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = lo  # all ranks are on this host: listen on 127.0.0.1 only
        device, how = _rank_device(rank, backend, device_type)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        if backend == "gloo" and device.type == "cuda":
            try:  # gloo's CUDA all-reduce depends on the torch build and dtype: probe, else fall back to the CPU
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    dist.all_reduce(torch.ones(1, device=device, dtype=dtype))
            except RuntimeError as exc:
                device, how = torch.device("cpu"), f"gloo cannot all-reduce CUDA tensors here ({exc}); ranks on the CPU"
        group = DistGroup(device=device)
        channel._post("ready", {"pid": os.getpid(), "device": str(device), "how": how, "threads": threads})
        entry(group, channel, *args, **kwargs)
    except BaseException as exc:
        try:
            channel._post("error", {"type": type(exc).__name__, "message": str(exc),
                                    "traceback": traceback.format_exc(), "time": time.time()})
        finally:
            os._exit(1)  # skip process-group teardown: a peer may already be gone
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a normal interpreter exit with torch loaded takes 2-4 s on 2 busy cores; results are sent


def _shutdown(procs, conns, workdir) -> None:
    """Terminate, then kill, then join every worker; close pipes; remove the rendezvous dir."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for c in conns:
        try:
            c.close()
        except OSError:
            pass
    shutil.rmtree(workdir, ignore_errors=True)


class WorkerPool:
    """``world_size`` spawned workers in one process group, driven over pipes.

    ``start(entry, args)`` spawns them; every worker calls ``entry(group, channel, *args)``.
    ``collect(kind)`` waits for one message of ``kind`` from every rank; ``broadcast(obj)``
    sends a command to every rank. Any failure closes the pool and raises (see module doc).
    """

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 120.0, *, verbose: bool = True,
                 name: str = "launch", device="cpu"):
        self.world_size, self.timeout = check_int("world_size", world_size, 1), check_seconds("timeout", timeout)
        self.verbose, self.name, self.device_type = verbose, name, torch.device(device).type
        self.backend = resolve_dist_backend(backend, world_size, device)
        self.workdir = tempfile.mkdtemp(prefix="lessons_tp_")  # fresh: a stale rendezvous file would hang init
        self.procs: list = []
        self._cmd: list = []
        self._res: list = []
        self.closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, [], self.workdir)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self, entry, args: tuple = (), kwargs: dict | None = None) -> float:
        """Spawn the workers and wait until every rank joined the group; returns seconds taken."""
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        init_method = "file://" + os.path.join(self.workdir, "rendezvous")
        threads = threads_per_worker(self.world_size) if self.device_type == "cpu" else 1
        pg_timeout = max(self.timeout, 30.0) + 30.0  # the caller's deadline fires first
        for rank in range(self.world_size):
            cmd_r, cmd_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_bootstrap, name=f"{self.name}-rank{rank}", daemon=True,
                            args=(rank, self.world_size, self.backend, self.device_type, init_method, pg_timeout, threads, entry,
                                  tuple(args), dict(kwargs or {}), cmd_r, res_w))
            p.start()
            cmd_r.close()  # the child's ends: closing ours lets us see EOF when it dies
            res_w.close()
            self.procs.append(p)
            self._cmd.append(cmd_w)
            self._res.append(res_r)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self._cmd + self._res, self.workdir)
        info = self.collect("ready", what="starting up and joining the process group (a spawned child re-runs "
                                           "the caller's __main__ script: guard it with if __name__ == '__main__')")
        self.devices = [i["device"] for i in info]
        if self.verbose:
            print(f"[{self.name}] {self.world_size} workers, backend={self.backend}, devices {self.devices} "
                  f"({info[0]['how']}), {info[0]['threads']} thread(s) each, rendezvous=file store")
        return time.perf_counter() - t0

    def broadcast(self, obj) -> None:
        """Send the same command to every rank."""
        self._check_open()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._cmd:
            try:
                conn.send_bytes(data)
            except OSError:  # BrokenPipeError: that rank is gone; collect() says how
                pass

    def collect(self, kind: str = "result", timeout: float | None = None, what: str = "") -> list:
        """One ``kind`` message from every rank, in rank order, within ``timeout`` seconds."""
        self._check_open()
        timeout = self.timeout if timeout is None else check_seconds("timeout", timeout)
        t0 = time.monotonic()
        deadline = t0 + timeout
        got: dict[int, object] = {}
        failures: list[_Failure] = []
        first_failure_at = None
        try:
            while True:
                pending = [r for r in range(self.world_size) if r not in got and r not in {f.rank for f in failures}]
                if not pending:
                    break
                stop = deadline if first_failure_at is None else min(deadline, first_failure_at + _GRACE_S)
                left = stop - time.monotonic()
                if left <= 0:
                    break
                waitables = {self._res[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
                for obj in _wait_ready(list(waitables), timeout=left):
                    r = waitables[obj]
                    if r in got or any(f.rank == r for f in failures):
                        continue
                    self._read_one(r, kind, got, failures)
                if failures and first_failure_at is None:
                    first_failure_at = time.monotonic()
        except BaseException:  # KeyboardInterrupt in a notebook: never leave workers behind
            self.close(graceful=False)
            raise
        if failures:
            self.close(graceful=False)
            raise self._failure_error(failures, what or f"waiting for {kind!r}") from None
        if len(got) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in got]
            self.close(graceful=False)
            raise WorkerTimeout(f"[{self.name}] no answer from rank(s) {missing} of {self.world_size} within "
                                f"{timeout:g} s while {what or f'waiting for {kind!r}'}; all workers were "
                                "terminated", missing)
        return [got[r] for r in range(self.world_size)]

    def _read_one(self, r: int, kind: str, got: dict, failures: list) -> None:
        conn, proc = self._res[r], self.procs[r]
        try:
            if conn.poll():
                k, rank, payload = pickle.loads(conn.recv_bytes())
                if k == kind:
                    got[r] = payload
                    return
                if k == "error":
                    failures.append(_Failure(r, False, payload["time"], f"raised {payload['type']}: {payload['message']}",
                                             payload["traceback"], None))
                    return
                raise RuntimeError(f"rank {r} sent {k!r} while the caller expected {kind!r}")
        except (EOFError, OSError):
            pass  # pipe closed: the process is gone; its exit code says how
        proc.join(0.5)
        if not proc.is_alive():
            code = proc.exitcode
            how = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exited with code {code}")
            failures.append(_Failure(r, True, time.time(), f"died ({how}) without reporting an error", None, code))

    def _failure_error(self, failures: list[_Failure], what: str) -> WorkerFailed:
        # Root cause first: a rank that died silently cannot be reacting to a peer (a reaction
        # would be a raised, reported error); among the rest, the earliest.
        first = min(failures, key=lambda f: (not f.died, f.time))
        msg = f"[{self.name}] rank {first.rank} of {self.world_size} {first.summary} (while {what})"
        others = [f for f in failures if f is not first]
        if others:
            msg += "; then " + "; ".join(f"rank {f.rank} {f.summary.splitlines()[0][:200]}" for f in others)
        if first.child_traceback:
            msg += f"\n--- traceback of rank {first.rank} ---\n{first.child_traceback.rstrip()}"
        return WorkerFailed(msg, first.rank, first.child_traceback, first.exitcode)

    def close(self, graceful: bool = True, timeout: float = 5.0) -> None:
        """Stop every worker (``graceful``: ask them to return first) and remove the temp dir."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            data = pickle.dumps(("close",))
            for conn in self._cmd:
                try:
                    conn.send_bytes(data)
                except OSError:
                    pass
            end = time.monotonic() + timeout
            for p in self.procs:
                p.join(max(0.0, end - time.monotonic()))
        self._finalizer()  # terminate/kill/join whatever is left

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"[{self.name}] this worker pool is closed (after close() or a failure); start a new one")

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close(graceful=exc[0] is None)



# ---- launch: run one function on fresh workers ---------------------------------------------------

@dataclass
class LaunchResult:
    """What ``launch`` returns: ``results[r]`` is ``fn``'s return value on rank r, ``traces[r]``
    that rank's ``CollectiveRecord`` list; ``startup_s``: spawn → every rank in the group."""

    results: list
    traces: list
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
           kwargs: dict | None = None, *, verbose: bool = True, device="cpu") -> LaunchResult:
    """Run ``fn(group, *args, **kwargs)`` on ``world_size`` fresh worker processes, one per rank.

    fn: an importable function (lives in ``lessons_lib``); ``group`` is the rank's ``DistGroup``.
    backend: "auto", "gloo" or "nccl" (see ``resolve_dist_backend``); the one that ran is printed
    and returned. device: "cpu" or "cuda" (each rank's ``group.device``). timeout: seconds for
    startup and again for ``fn``.
    Arguments and results are pickled (copies). Raises ``WorkerFailed`` / ``WorkerTimeout``
    (workers already cleaned up) instead of hanging.

    Taught in notebooks/04_tp2_invariance.ipynb.
    """
    _check_importable(fn)
    t0 = time.perf_counter()
    pool = WorkerPool(world_size, backend, timeout, verbose=verbose, name="launch", device=device)
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
