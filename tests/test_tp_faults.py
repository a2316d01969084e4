"""Worker faults on a real TP=2 gloo group: a clear error, in bounded time, nothing left behind.

Each test injects one fault (``tp.Fault``) on rank 1 in the middle of a forward (after
``2·layer`` all-reduces), then checks: the exception names rank 1 (or the ranks that went
silent), it arrived well within the deadline, no worker process is left (psutil), and a
following launch in this same Python process works. A small model keeps each launch ≈ 1-3 s
(idle machine); the four launches are chained in one test so each proves the last one's cleanup.
"""
from __future__ import annotations

import time

import psutil
import pytest
from helpers import children

from lessons_lib import ModelConfig, pack
from lessons_lib.tp.runtime import TPRuntime
from lessons_lib.tp.trace import Fault, forward_worker
from lessons_lib.tp.workers import WorkerFailed, WorkerTimeout, all_reduce_probe, launch

SMALL = ModelConfig(n_layers=8, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=256, max_position=256)
BATCH = pack([list(range(10)), list(range(30))])  # A=10 + B=30


@pytest.fixture
def no_leftovers():
    before = children()
    yield
    left = children() - before
    assert not left, f"worker processes left behind: {left}"


def _no_workers_left(pids):
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"workers still alive: {alive}"
    assert not children(), f"child processes left: {children()}"


def test_faults_raise_sigkill_hang_each_then_a_working_launch(no_leftovers):
    """Four launches in a row; launches 2-4 each prove that the one before left nothing behind."""
    # 1. launch(): rank 1 raises in layer 2 -> WorkerFailed naming rank 1, with its traceback
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        launch(forward_worker, world_size=2, backend="gloo", timeout=60, args=(SMALL, BATCH),
               kwargs={"fault": Fault("raise", rank=1, layer=2)}, verbose=False)
    elapsed, err = time.monotonic() - t0, info.value
    print(f"\nraise on rank 1   -> {type(err).__name__} after {elapsed:.1f} s (incl. startup): {str(err)[:140]}")
    assert err.rank == 1 and "rank 1 of 2 raised RuntimeError: injected fault on rank 1" in str(err)
    assert "injected fault" in err.child_traceback and "traced_forward" in err.child_traceback
    assert elapsed < 60
    assert not children(), f"child processes left after the raise: {children()}"

    # 2. TPRuntime: a good forward (the launch after a raise works), then rank 1 is SIGKILLed
    rt = TPRuntime(SMALL, world_size=2, backend="gloo", timeout=60, verbose=False)
    assert rt.forward(BATCH).all_reduce_counts == [16, 16]
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        rt.forward(BATCH, fault=Fault("sigkill", rank=1, layer=3))
    elapsed, err = time.monotonic() - t0, info.value
    print(f"SIGKILL on rank 1 -> {type(err).__name__} after {elapsed:.1f} s: {str(err)[:140]}")
    assert err.rank == 1 and err.exitcode == -9 and "killed by signal SIGKILL" in str(err)
    assert elapsed < 15  # seen on the process sentinel, not at the 60 s deadline
    assert rt.closed
    _no_workers_left(rt.pids)
    with pytest.raises(RuntimeError, match="closed"):
        rt.forward(BATCH)

    # 3. TPRuntime: a good forward (the launch after a SIGKILL works), then rank 1 hangs
    with TPRuntime(SMALL, world_size=2, backend="gloo", timeout=60, verbose=False) as rt:
        assert rt.forward(BATCH).all_reduce_counts == [16, 16]
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout) as info:
            rt.forward(BATCH, fault=Fault("hang", rank=1, layer=5), timeout=3)
        elapsed = time.monotonic() - t0
        print(f"hang on rank 1    -> {type(info.value).__name__} after {elapsed:.1f} s: {info.value}")
        # rank 1 sleeps; rank 0 waits for it in layer 5's all-reduce: neither answers
        assert info.value.ranks == [0, 1] and "within 3 s" in str(info.value)
        assert 3 <= elapsed < 3 + 10
        assert rt.closed
    _no_workers_left(rt.pids)

    # 4. the launch after a hang works
    res = launch(all_reduce_probe, world_size=2, backend="gloo", timeout=60, args=(2,), verbose=False)
    assert res.results == [[3.0, 3.0], [3.0, 3.0]]  # 1 + 2 on every row, on both ranks


def test_fault_arguments_are_checked():
    with pytest.raises(ValueError, match="Fault.kind must be 'raise', 'sigkill' or 'hang', got 'segfault'"):
        Fault("segfault")
    with pytest.raises(ValueError, match="Fault.layer must be an int >= 0, got -1"):
        Fault("hang", layer=-1)
