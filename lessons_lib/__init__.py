"""lessons_lib: the small, real engine behind the course on varlen prefill batching.

One concept per module:
  config     ModelConfig (claim S1)
  batch      PackedBatch, pack / unpack / pad, cu_seqlens validation (C2, C3)
  attention  varlen_attention and its backends, attention_ref, block_diag_mask (C7-C11)
  linear     Column/Row/QKV parallel linear layers (C5, C6)
  parallel   process groups with collective tracing (C1, C11, C12)
  model      the GPT-2-style Transformer on flat batches (S1)
  hf         Hugging Face GPT-2 bridge
  flops      attention cells, forward FLOPs, arithmetic intensity (C8, C9, C13-C15)
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
