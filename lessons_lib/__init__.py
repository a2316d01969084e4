"""lessons_lib: the small, real engine behind the course on varlen prefill batching.

One concept per module:
  config     ModelConfig (claim S1)
  batch      PackedBatch, pack / unpack / pad, cu_seqlens validation (C2, C3)
  attention  varlen_attention and its backends, attention_ref, block_diag_mask (C7-C11)
  linear     Column/Row/QKV parallel linear layers (C5, C6)
  parallel   process groups with collective tracing, launch() of real workers (C1, C11, C12)
  workers    spawned TP worker processes: start, pipes, clean failure (WorkerPool)
  tp_trace   one traced TP forward: collectives, QKV shapes, attention window, Fault
  tp         TPRuntime / tp_forward / TPResult: TP=2 forwards on real processes (C1, C6, C11, C12)
  tp_dryrun  the expected trace from the formula / recorded in one process (no workers)
  tp_demo    torchrun entry point with the invariance checks
  model      the GPT-2-style Transformer on flat batches (S1)
  hf         Hugging Face GPT-2 bridge
  flops      attention cells, forward FLOPs, arithmetic intensity (C8, C9, C13-C15)
  engine     Request, FCFS prefill Scheduler, Engine with per-batch stats (S3)
  workloads  constant / uniform / long-tail / bimodal request streams
  bench      python -m lessons_lib.bench: varlen vs masked vs padded vs Hugging Face
  profile    timing and peak-memory helpers the lessons use
  probe      which output rows change when one input row changes
  viz        matplotlib figures as pure functions
  widgets    ipywidgets explorers over pure state functions
  figures    python -m lessons_lib.figures: every lesson figure into figures/
  exercises  checkers for the lessons' exercises
  check      claim() / close() for lesson claim cells
"""
from .attention import (BACKENDS, attention_ref, available_backends, block_diag_mask, padded_attention,
                        plain_attention, varlen_attention)
from .batch import PackedBatch, pack, pad, pad_input, seq_lens_to_cu_seqlens, unpack, unpad_input, validate_cu_seqlens
from .check import claim, close
from .config import ModelConfig
from .flops import attention_cells, forward_flops, linear_intensity
from .model import Transformer, init_weights

__all__ = ["BACKENDS", "attention_ref", "available_backends", "block_diag_mask", "padded_attention",
           "plain_attention", "varlen_attention", "PackedBatch", "pack", "pad", "pad_input",
           "seq_lens_to_cu_seqlens", "unpack", "unpad_input", "validate_cu_seqlens", "claim", "close",
           "ModelConfig", "attention_cells", "forward_flops", "linear_intensity", "Transformer", "init_weights"]
