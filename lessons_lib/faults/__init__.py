"""The engine's named breakages: one registry of the bugs the course shows and the claims guard against.

Each ``Fault`` is one plausible bug a contributor could introduce, named in snake_case for what it
does (``loop_reads_keys_from_row_zero``, ``row_parallel_bias_on_every_rank``, ``causal_mask_top_left``):
``install()`` patches the engine in this process and returns the undo. Turn faults on for a block::

    from lessons_lib import faults
    with faults.injected("causal_mask_top_left"):
        engine.prefill(requests)          # runs with the bug, on every TP rank too

``injected`` installs the faults here and puts their names in the environment variable
``LESSONS_FAULTS`` (comma separated), so TP worker processes spawned inside the block apply them at
start-up (``apply_from_env``, called by ``tp.workers``); on exit it undoes them in reverse order and
restores the variable. Nested blocks add faults; a fault already on stays on (and is not undone by
the inner block). Unknown names raise ValueError listing the known ones.

The faults live by engine area: ``attention``, ``model``, ``batch``, ``linear`` (and TP),
``serve``, ``kernel`` (the Triton kernel rebuilt with one line changed), ``measure`` (the measuring tools).
A worker fault that kills or hangs a rank mid-forward is ``tp.trace.Fault`` (``TPRuntime.forward(..., fault=...)``).
"""
from . import attention, batch, kernel, linear, measure, model, serve  # noqa: F401  (each registers its area's faults)
from .registry import ENV, FAULTS, Fault, active, apply_from_env, fault, injected, swap_attr, swap_function, swap_item

__all__ = ["ENV", "FAULTS", "Fault", "active", "apply_from_env", "fault", "injected", "swap_attr", "swap_function",
           "swap_item"]
