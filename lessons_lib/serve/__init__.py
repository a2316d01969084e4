"""Serving: requests in, FCFS batches under a token budget, one flat forward per batch.

  scheduler  Request, Scheduler (vLLM's max_num_batched_tokens / max_num_seqs / enable_chunked_prefill /
             long_prefill_token_threshold), ScheduledChunk, plan_batches
  kv_cache   PrefillKVCache, KVCacheStep: chunked prefill's keys and values of the tokens already run
  engine     Engine (varlen / masked / padded, TP=1 or 2, chunked prefill, a given scheduler, recorded
             forwards), RequestOutput, BatchStats
  workloads  reproducible request-length streams: constant, uniform, long-tail, bimodal

Taught in notebooks/06_prefill_engine.ipynb.
"""
from .engine import BatchStats, Engine, RequestOutput, batch_stats
from .kv_cache import KVCacheStep, PrefillKVCache
from .scheduler import Request, ScheduledChunk, Scheduler, plan_batches

__all__ = ["BatchStats", "Engine", "RequestOutput", "batch_stats", "KVCacheStep", "PrefillKVCache", "Request",
           "ScheduledChunk", "Scheduler", "plan_batches"]
