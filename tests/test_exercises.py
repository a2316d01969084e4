"""exercises: every checker accepts a correct answer, rejects typical wrong ones with a useful
message, and lets an unattempted stub through without failing the lesson."""
from __future__ import annotations

import math

import pytest
import torch

from lessons_lib.course import exercises
from lessons_lib.measure.flops import linear_flops_per_token


def stub(*args):
    raise NotImplementedError


def attempt(check, fn):
    """Run a checker on a wrong answer; return its message."""
    with pytest.raises(AssertionError) as info:
        check(fn)
    return str(info.value)


def test_stub_is_not_attempted_and_does_not_fail(capsys):
    for check in (exercises.check_cu_seqlens, exercises.check_padding_rows, exercises.check_split_flat,
                  exercises.check_layer_norm_rows, exercises.check_qkv_width, exercises.check_row_parallel_combine,
                  exercises.check_causal_varlen, exercises.check_masked_cells, exercises.check_doc_mask,
                  exercises.check_attention_flops, exercises.check_crossover, exercises.check_linear_intensity):
        assert check(stub) is False
        assert "not attempted yet" in capsys.readouterr().out


def test_a_crashing_answer_is_reported_with_its_input():
    msg = attempt(exercises.check_cu_seqlens, lambda lens: lens[5])
    assert "IndexError" in msg and "input" in msg


# --- lesson 01 ---------------------------------------------------------------------------------

def test_c3_cu_seqlens_checker(capsys):
    def good(lens):
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return out
    assert exercises.check_cu_seqlens(good) is True
    assert "✓" in capsys.readouterr().out
    assert "starts with 0" in attempt(exercises.check_cu_seqlens, lambda lens: good(lens)[1:])
    assert "cumulative" in attempt(exercises.check_cu_seqlens, lambda lens: [0] + list(lens))
    assert "input [5]" in attempt(exercises.check_cu_seqlens, lambda lens: [0, 10, 40])  # hard-coded A, B fails


def test_c2_padding_rows_checker():
    assert exercises.check_padding_rows(lambda lens: (len(lens) * max(lens), sum(lens)))
    assert "R x Lmax" in attempt(exercises.check_padding_rows, lambda lens: (max(lens) ** 2, sum(lens)))
    assert "flat row count" in attempt(exercises.check_padding_rows, lambda lens: (sum(lens), sum(lens)))
    assert "expected a tuple (padded_rows, useful_rows)" in attempt(exercises.check_padding_rows, lambda lens: 60)


def test_c3_split_flat_checker():
    assert exercises.check_split_flat(lambda x, cu: list(x.split((cu[1:] - cu[:-1]).tolist())))
    off_by_one = lambda x, cu: [x[s:e + 1] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    assert "exclusive" in attempt(exercises.check_split_flat, off_by_one)
    assert "pieces" in attempt(exercises.check_split_flat, lambda x, cu: [x])


# --- lesson 02 ---------------------------------------------------------------------------------

def _ln(x, w, b, eps, dim=-1, unbiased=False):
    mean = x.mean(dim, keepdim=True)
    var = x.var(dim, keepdim=True, unbiased=unbiased)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def test_c4_layer_norm_checker():
    assert exercises.check_layer_norm_rows(_ln)
    assert "dim 0" in attempt(exercises.check_layer_norm_rows, lambda x, w, b, eps: _ln(x, w, b, eps, dim=0))
    assert "biased variance" in attempt(exercises.check_layer_norm_rows, lambda x, w, b, eps: _ln(x, w, b, eps, unbiased=True))
    assert "weight" in attempt(exercises.check_layer_norm_rows, lambda x, w, b, eps: _ln(x, 1.0, 0.0, eps))


def test_c4_layer_norm_checker_catches_rows_that_read_other_rows():
    # Right values on the checker's inputs (a tiny leak from the next row), yet not per row.
    def leaky(x, w, b, eps):
        return _ln(x, w, b, eps) + 1e-9 * torch.roll(x, 1, dims=0)
    assert "ANOTHER row" in attempt(exercises.check_layer_norm_rows, leaky)


def test_c6_qkv_width_checker():
    assert exercises.check_qkv_width(lambda h, d, tp: 3 * h * d // tp)
    assert "Q alone" in attempt(exercises.check_qkv_width, lambda h, d, tp: h * d // tp)
    assert "full width" in attempt(exercises.check_qkv_width, lambda h, d, tp: 3 * h * d)
    assert "768" in attempt(exercises.check_qkv_width, lambda h, d, tp: 768)


def test_c6_row_parallel_combine_checker():
    assert exercises.check_row_parallel_combine(lambda parts, b: sum(parts) + b)
    assert "times" in attempt(exercises.check_row_parallel_combine, lambda parts, b: sum(p + b for p in parts))
    assert "once" in attempt(exercises.check_row_parallel_combine, lambda parts, b: sum(parts))
    assert "SUM" in attempt(exercises.check_row_parallel_combine, lambda parts, b: parts[0] + b)


# --- lesson 03 ---------------------------------------------------------------------------------

def varlen_loop(q, k, v, cu, causal=True, scale=None, cross=False):
    """The article's loop, written independently of lessons_lib; ``cross`` ignores cu_seqlens."""
    out, cu = torch.empty_like(q), cu.tolist()
    if cross:
        cu = [0, cu[-1]]
    for s, e in zip(cu[:-1], cu[1:]):
        sc = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        if causal:
            sc = sc.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v[s:e])
    return out


def test_c10_causal_varlen_checker():
    assert exercises.check_causal_varlen(varlen_loop)
    assert "no causal mask" in attempt(exercises.check_causal_varlen, lambda q, k, v, cu: varlen_loop(q, k, v, cu, causal=False))
    assert "other requests" in attempt(exercises.check_causal_varlen, lambda q, k, v, cu: varlen_loop(q, k, v, cu, cross=True))
    assert "sqrt" in attempt(exercises.check_causal_varlen, lambda q, k, v, cu: varlen_loop(q, k, v, cu, scale=1.0))
    assert "shape" in attempt(exercises.check_causal_varlen, lambda q, k, v, cu: q[:1])


def test_c8_masked_cells_checker():
    assert exercises.check_masked_cells(lambda lens: (sum(lens) ** 2, sum(n * n for n in lens), sum(lens) ** 2 - sum(n * n for n in lens)))
    causal = lambda lens: (sum(lens) ** 2, sum(n * (n + 1) // 2 for n in lens), 0)
    assert "whole diagonal blocks" in attempt(exercises.check_masked_cells, causal)
    varlen = lambda lens: (sum(n * n for n in lens),) * 2 + (0,)
    assert "whole T x T" in attempt(exercises.check_masked_cells, varlen)
    assert "(1600, 1000, 600)" in attempt(exercises.check_masked_cells, lambda lens: (1600, 1000, 600))


def test_c8_doc_mask_checker():
    def good(cu):
        lens = (cu[1:] - cu[:-1]).long()
        rid = torch.repeat_interleave(torch.arange(len(lens)), lens)
        return rid[:, None] == rid[None, :]
    assert exercises.check_doc_mask(good)
    assert "inverted" in attempt(exercises.check_doc_mask, lambda cu: ~good(cu))
    assert "torch.bool" in attempt(exercises.check_doc_mask, lambda cu: good(cu).float())
    assert "cells differ" in attempt(exercises.check_doc_mask, lambda cu: good(cu).tril())


# --- lesson 05 ---------------------------------------------------------------------------------

def _attn_flops(cfg, lens):
    return cfg.n_layers * cfg.n_heads * sum(n * n for n in lens) * 4 * cfg.d_head


def test_c14_attention_flops_checker():
    assert exercises.check_attention_flops(_attn_flops)
    msg = attempt(exercises.check_attention_flops, lambda cfg, lens: _attn_flops(cfg, lens) // cfg.n_layers)
    assert "n_layers" in msg
    assert "4 x d_head" in attempt(exercises.check_attention_flops, lambda cfg, lens: _attn_flops(cfg, lens) // 4)
    masked = lambda cfg, lens: cfg.n_layers * cfg.n_heads * sum(lens) ** 2 * 4 * cfg.d_head
    assert "masked" in attempt(exercises.check_attention_flops, masked)


def test_c14_crossover_checker():
    def good(cfg):
        per_l = cfg.n_layers * cfg.n_heads * 4 * cfg.d_head
        return -(-linear_flops_per_token(cfg) // per_l)
    assert exercises.check_crossover(good)
    assert "off by one" in attempt(exercises.check_crossover, lambda cfg: good(cfg) + 1)
    assert "expected" in attempt(exercises.check_crossover, lambda cfg: 3072)  # hard-coded: fails the second config


def test_c13_linear_intensity_checker():
    def good(t, d_in, d_out, nbytes):
        return 2 * t * d_in * d_out / (nbytes * (d_in * d_out + t * d_in + t * d_out))
    assert exercises.check_linear_intensity(good)
    weight_only = lambda t, d_in, d_out, nbytes: 2 * t * d_in * d_out / (nbytes * d_in * d_out)
    assert "activations" in attempt(exercises.check_linear_intensity, weight_only)


def test_checker_rejects_a_non_function():
    with pytest.raises(AssertionError, match="expected a function"):
        exercises.check_cu_seqlens([0, 10, 40])
