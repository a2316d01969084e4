"""Serving: requests in, FCFS batches under a token budget, one flat forward per batch.

  scheduler  Request, Scheduler (vLLM's max_num_batched_tokens / max_num_seqs), plan_batches
  engine     Engine (varlen / masked / padded, TP=1 or 2), RequestOutput, BatchStats
  workloads  reproducible request-length streams: constant, uniform, long-tail, bimodal

Taught in notebooks/06_prefill_engine.ipynb.
"""
from .engine import BatchStats, Engine, RequestOutput, batch_stats
from .scheduler import Request, Scheduler, plan_batches

__all__ = ["BatchStats", "Engine", "RequestOutput", "batch_stats", "Request", "Scheduler", "plan_batches"]
