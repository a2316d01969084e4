"""tp.dryrun.trace_shapes: a trace compared without its rank and dtype."""
import dataclasses

import torch

from lessons_lib.core.config import ModelConfig
from lessons_lib.tp.dryrun import expected_trace, trace_shapes, trace_signature

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_ffn=64, vocab_size=50, max_position=16)


def test_trace_shapes_drop_rank_and_dtype_but_keep_op_shape_and_layer():
    fp32, bf16 = expected_trace(CFG, 6, 0, 2), expected_trace(dataclasses.replace(CFG, dtype=torch.bfloat16), 6, 1, 2)
    assert trace_signature(fp32) != trace_signature(bf16)
    assert trace_shapes(fp32) == trace_shapes(bf16) == [
        ("all_reduce", (6, 32), f"layers.{i}.{part}") for i in (0, 1) for part in ("attn.out_proj", "mlp.fc_down")]
    assert trace_shapes(expected_trace(CFG, 7, 0, 2)) != trace_shapes(fp32)  # another T: another shape
