"""exercises for lessons 00, 04, 06: each checker accepts a right answer written independently here,
rejects the typical wrong ones with the hint a learner needs, and lets a stub through."""
from __future__ import annotations

import pytest
import torch
from test_exercises import attempt, stub, varlen_loop  # shared stub, "run a wrong answer", the loop

from lessons_lib.core.config import ModelConfig
from lessons_lib.course import exercises

CHECKS = (exercises.check_param_count, exercises.check_rank_params, exercises.check_all_reduce_bytes,
          exercises.check_rank_attention, exercises.check_trace_prediction, exercises.check_fcfs_schedule,
          exercises.check_stream_waste)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_stub_is_not_attempted(check, capsys):
    assert check(stub) is False
    assert "not attempted yet" in capsys.readouterr().out


# --- lesson 00 (S1, C1) ------------------------------------------------------------------------

def params(cfg: ModelConfig, tp: int = 1, *, tied=True, wpe=True, biases=True, ln=True, row_bias_split=False) -> int:
    """The model's parameters on one rank, counted from the architecture of S1 (not from the model)."""
    d, k, f, n = cfg.d_model, cfg.qkv_dim, cfg.d_ffn, cfg.n_layers
    weights = n * (3 * k * d + k * d + f * d + d * f) // tp
    col_bias = n * (3 * k + f) // tp
    row_bias = n * 2 * d // (tp if row_bias_split else 1)
    total = cfg.vocab_size * d * (1 if tied else 2) + (cfg.max_position * d if wpe else 0) + weights
    total += (col_bias + row_bias) if biases else 0
    total += (4 * n + 2) * d if ln else 0
    return total


def test_s1_param_count_checker():
    assert exercises.check_param_count(params)
    assert "tied" in attempt(exercises.check_param_count, lambda c: params(c, tied=False))
    assert "position embedding" in attempt(exercises.check_param_count, lambda c: params(c, wpe=False))
    assert "biases" in attempt(exercises.check_param_count, lambda c: params(c, biases=False))
    assert "LayerNorm" in attempt(exercises.check_param_count, lambda c: params(c, ln=False))
    assert "expected" in attempt(exercises.check_param_count, lambda c: 59_340_288)  # the article's count, hard-coded


def test_s1_rank_params_checker():
    assert exercises.check_rank_params(params)
    assert "not everything is split" in attempt(exercises.check_rank_params, lambda c, tp: params(c) // tp)
    assert "FFN-down are not split" in attempt(exercises.check_rank_params,
                                            lambda c, tp: params(c, tp, row_bias_split=True))
    assert "replicated" in attempt(exercises.check_rank_params,
                                   lambda c, tp: (params(c) - params(c, tp)) // (tp - 1) if tp > 1 else params(c))


def _itemsize(cfg):
    return torch.empty((), dtype=cfg.dtype).element_size()


def test_c1_all_reduce_bytes_checker():
    assert exercises.check_all_reduce_bytes(lambda c, n: (2 * c.n_layers, n * c.d_model * _itemsize(c)))
    assert "two per layer" in attempt(exercises.check_all_reduce_bytes, lambda c, n: (c.n_layers, n * c.d_model * _itemsize(c)))
    assert "OUTPUT" in attempt(exercises.check_all_reduce_bytes, lambda c, n: (2 * c.n_layers, n * c.d_ffn * _itemsize(c)))
    assert "not half" in attempt(exercises.check_all_reduce_bytes, lambda c, n: (2 * c.n_layers, n * c.d_model * _itemsize(c) // 2))
    assert "bytes, not elements" in attempt(exercises.check_all_reduce_bytes, lambda c, n: (2 * c.n_layers, n * c.d_model))
    assert "expected (4, 2560)" in attempt(exercises.check_all_reduce_bytes, lambda c, n: (16, 20480))  # hard-coded N=10


# --- lesson 04 (C11, C12) ----------------------------------------------------------------------

def rank_attention(q, k, v, cu, rank, tp, *, heads=None, causal=True, use_cu=True):
    h = q.shape[1] // tp
    sl = heads if heads is not None else slice(rank * h, (rank + 1) * h)
    return varlen_loop(q[:, sl], k[:, sl], v[:, sl], cu, causal=causal, cross=not use_cu)


def test_c11_rank_attention_checker():
    assert exercises.check_rank_attention(rank_attention)
    check = exercises.check_rank_attention
    assert "every head" in attempt(check, lambda q, k, v, cu, r, tp: rank_attention(q, k, v, cu, r, tp, heads=slice(None)))
    assert "contiguous" in attempt(check, lambda q, k, v, cu, r, tp: rank_attention(q, k, v, cu, r, tp, heads=slice(r, None, tp)))
    assert "cu_seqlens" in attempt(check, lambda q, k, v, cu, r, tp: rank_attention(q, k, v, cu, r, tp, use_cu=False))
    assert "causal" in attempt(check, lambda q, k, v, cu, r, tp: rank_attention(q, k, v, cu, r, tp, causal=False))


def trace(cfg, lens, *, per_request=False, order=("attn.out_proj", "mlp.fc_down"), rows=None):
    t = sum(lens) if rows is None else rows
    one = [(f"layers.{i}.{part}", (t, cfg.d_model)) for i in range(cfg.n_layers) for part in order]
    return one * len(lens) if per_request else one


def test_c12_trace_prediction_checker():
    assert exercises.check_trace_prediction(trace)
    check = exercises.check_trace_prediction
    assert "two per layer" in attempt(check, lambda c, lens: trace(c, lens)[::2])
    assert "does not loop over requests" in attempt(check, lambda c, lens: trace(c, lens, per_request=True))
    assert "T = sum(seq_lens)" in attempt(check, lambda c, lens: trace(c, lens, rows=max(lens)))
    assert "forward order" in attempt(check, lambda c, lens: trace(c, lens, order=("mlp.fc_down", "attn.out_proj")))
    assert "pairs" in attempt(check, lambda c, lens: 16)


# --- lesson 06 (S3) ----------------------------------------------------------------------------

def fcfs(lens, budget, *, fill_holes=False, check=True):
    if check and max(lens) > budget:
        raise ValueError(f"request of {max(lens)} tokens > budget {budget}")
    batches, left = [], list(range(len(lens)))
    while left:
        batch, used = [], 0
        for i in list(left):
            if used + lens[i] <= budget:
                batch.append(i)
                used += lens[i]
                left.remove(i)
            elif not fill_holes:
                break
        if not batch:  # only reachable with check=False: an oversize request would loop forever
            batch = [left.pop(0)]
        batches.append(batch)
    return batches


def test_s3_fcfs_schedule_checker():
    assert exercises.check_fcfs_schedule(fcfs)
    check = exercises.check_fcfs_schedule
    assert "overtakes" in attempt(check, lambda lens, b: fcfs(lens, b, fill_holes=True))
    assert "raise ValueError" in attempt(check, lambda lens, b: fcfs(lens, b, check=False))
    assert "exactly once" in attempt(check, lambda lens, b: [[i] for i in range(len(lens) - 1)])
    assert "> budget" in attempt(check, lambda lens, b: [list(range(len(lens)))] if max(lens) <= b else fcfs(lens, b))


def waste(batches, *, global_pad=False, global_mask=False, one_side=False):
    lens = [n for b in batches for n in b]
    pad = (len(lens) * max(lens) - sum(lens)) if global_pad else sum(len(b) * max(b) - sum(b) for b in batches)
    if global_mask:
        masked = sum(lens) ** 2 - sum(n * n for n in lens)
    else:
        masked = sum(sum(b) ** 2 - sum(n * n for n in b) for b in batches)
    return pad, masked // 2 if one_side else masked


def test_c2_c8_stream_waste_checker():
    assert exercises.check_stream_waste(waste)
    check = exercises.check_stream_waste
    assert "OWN longest" in attempt(check, lambda b: waste(b, global_pad=True))
    assert "per batch" in attempt(check, lambda b: waste(b, global_mask=True))
    assert "both off-diagonal" in attempt(check, lambda b: waste(b, one_side=True))
