"""Tensor parallelism on real processes: the same model split over ranks, every collective traced.

  workers  WorkerPool (spawned ranks, pipes, clean failure) and launch(fn) for one call
  runtime  TPRuntime (workers kept alive) and tp_forward (one shot) -> TPResult
  trace    traced_forward: the collectives, QKV shapes and attention window of one forward; Fault
  dryrun   the expected trace from the formula, or recorded in this process (no workers)
  threads  ThreadRank / tp_ranks_in_threads: a TP group whose ranks are threads (real sums and gathers)
  vocab    VocabParallelEmbedding, ParallelLMHead (the vocabulary split over the ranks, padded by pad_vocab_size)
           and vocab_parallel_logits (the model's forward with both)
  demo     python -m torch.distributed.run ... -m lessons_lib.tp.demo

Taught in notebooks/00_setup_one_request.ipynb and notebooks/04_tp2_invariance.ipynb.
"""
from .runtime import TPResult, TPRuntime, tp_forward
from .workers import WorkerFailed, WorkerTimeout, launch

__all__ = ["TPResult", "TPRuntime", "tp_forward", "WorkerFailed", "WorkerTimeout", "launch"]
