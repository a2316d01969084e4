"""The engine a learner reads: a flat batch, varlen attention, tensor-parallel linear layers, the model.

Read in this order:
  config     ModelConfig (claim S1) and the table of weight names and shapes
  batch      PackedBatch, pack / unpack / pad, cu_seqlens (C2, C3)
  attention  varlen_attention, its backends, attention_ref, block_diag_mask (C7-C11)
  kernels    which optional kernels (FlashAttention, PyTorch varlen, flex) run here, and why not
  linear     Column/Row/QKV parallel linear layers (C5, C6)
  groups     LocalGroup / DistGroup and CollectiveRecord: how a rank talks to the others (C1, C12)
  model      the GPT-2-style Transformer on flat batches (S1)

Every argument check lives beside it in ``lessons_lib.validate`` and runs once, at the public
entry points (``varlen_attention``, ``Transformer.forward``): the per-layer path is plain tensor
code. Nothing here imports the TP runtime, the serving engine, the measurements or the course.
"""
from ..validate import check_cu_seqlens
from .attention import VarlenMetadata, attention_forward, attention_ref, block_diag_mask, plain_attention, varlen_attention
from .batch import PackedBatch, cumulative, pack, pad, pad_input, seq_lens_to_cu_seqlens, unpack, unpad_input
from .config import ModelConfig
from .groups import CollectiveRecord, DistGroup, LocalGroup
from .kernels import BACKENDS, available_backends, placement, resolve_backend
from .linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .model import Transformer, init_weights

__all__ = ["VarlenMetadata", "attention_forward", "attention_ref", "block_diag_mask", "plain_attention", "varlen_attention",
           "PackedBatch", "cumulative", "pack", "pad", "pad_input", "seq_lens_to_cu_seqlens", "unpack", "unpad_input",
           "ModelConfig", "CollectiveRecord", "DistGroup", "LocalGroup", "BACKENDS", "available_backends",
           "resolve_backend", "placement", "ColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear", "Transformer",
           "init_weights", "check_cu_seqlens"]
