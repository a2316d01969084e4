"""bfloat16 on the CPU, so the dtype-aware tolerance rule runs on every CI run (the GPUs' dtype).

For each batch: the bf16 result may be at most twice as far from the float64 truth as bf16
computed one request at a time (TP=1), plus rounding (lessons_lib.measure.tolerance).
"""
import pytest
import torch

from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.measure.tolerance import assert_close, max_abs_diff
from lessons_lib.serve.engine import Engine
from lessons_lib.serve.workloads import long_tail_lengths, make_requests
from lessons_lib.tp.runtime import TPRuntime

BF16 = torch.bfloat16
CFG = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=1000, max_position=512)
BATCHES = {"A=10 + B=30": [10, 30], "long-tail": long_tail_lengths(16, median=24, max_len=200, seed=5)}


@pytest.mark.parametrize("name", BATCHES)
def test_bf16_engine_matches_fp32_and_fp64_within_the_rule(name):
    reqs = make_requests(BATCHES[name], CFG.vocab_size, seed=1)
    kw = dict(device="cpu", compute_logits=False, max_num_batched_tokens=4096)
    w = init_weights(CFG)
    bf16, fp32, fp64 = (Engine(CFG, weights=w, dtype=dt, **kw).prefill(reqs) for dt in (BF16, torch.float32,
                                                                                          torch.float64))
    # the references: each request alone, through the loop backend (another summation order than the engine's batch)
    alone, alone32 = (Transformer(CFG, w, dtype=dt).forward_each([torch.tensor(r) for r in reqs], attn_backend="loop")
                      for dt in (BF16, torch.float32))
    assert all(o.last_hidden.dtype == BF16 for o in bf16)
    for o, o32, o64, a, a32 in zip(bf16, fp32, fp64, alone, alone32):
        err, bound = assert_close(o.last_hidden, a[-1], o64.last_hidden, f"bf16 engine, request {o.request_id}")
        # the fp32 engine obeys the same rule against the fp32 request alone, with its own, far smaller rounding
        assert_close(o32.last_hidden, a32[-1], o64.last_hidden, f"fp32 engine, request {o32.request_id}")
        assert max_abs_diff(o.last_hidden, o32.last_hidden) <= bound + max_abs_diff(o32.last_hidden, o64.last_hidden)


def test_tp2_bf16_equals_tp1_bf16_within_the_rule():
    w = init_weights(CFG)
    batch = pack([torch.tensor(r) for r in make_requests(BATCHES["long-tail"], CFG.vocab_size, seed=2)])
    with TPRuntime(CFG, w, backend="gloo", device="cpu", dtype=BF16, verbose=False) as rt:
        res = rt.forward(batch)
    assert res.output.dtype == BF16 and all(r.dtype == "bfloat16" for r in res.traces[0])
    assert res.traces[0][0].bytes == batch.num_tokens * CFG.d_model * 2  # bf16: 2 bytes per element
    tp1 = Transformer(CFG, w, dtype=BF16)(batch)
    assert_close(res.output, tp1, Transformer(CFG, w, dtype=torch.float64)(batch), "TP=2 bf16")
