"""lessons_lib: the small, real engine behind the course on varlen prefill batching.

The package is laid out by role; read ``core`` first, it is the engine:

  core     config, flat batches, varlen attention, TP linear layers, the model (what a learner reads)
  validate every argument check of the public entry points, run once at the boundary
  tp       tensor parallelism on real processes: workers, TPRuntime / tp_forward, traces, dry runs
  serve    the prefill scheduler and engine, request workloads
  measure  FLOP accounting, timing and memory, machines, the all-reduce model, the benchmark
  faults   the engine's named breakages, turned on in a ``with faults.injected(name):`` block
  course   figures, widgets, exercise checkers, claim cells

The engine's names a learner uses most are importable from here (loaded on first use, so that
``import lessons_lib.core`` stays free of processes, plots and the serving engine). The course's
own ``claim`` and ``close`` come from ``lessons_lib.course``.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelConfig": "core.config", "PackedBatch": "core.batch", "pack": "core.batch", "unpack": "core.batch",
    "pad": "core.batch", "varlen_attention": "core.attention", "attention_ref": "core.attention",
    "available_backends": "core.kernels", "Transformer": "core.model", "init_weights": "core.model",
    "Engine": "serve.engine", "Request": "serve.scheduler", "TPRuntime": "tp.runtime", "tp_forward": "tp.runtime",
    "forward_flops": "measure.flops", "attention_cells": "measure.flops",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lessons_lib' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
