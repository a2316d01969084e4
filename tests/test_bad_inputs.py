"""Bad input table for the public entry points: every row is a clear error naming the argument
and the value, or a defined, documented result. docs/bad_inputs.md is this table, rendered:

    python3 -m tests.test_bad_inputs > docs/bad_inputs.md

Rows marked ``no_spawn`` (tp_forward, TPRuntime(...), Engine with tp_size=2) are also checked
to be refused before any worker process starts. The TPRuntime.forward rows share one live
TP=2 runtime of a tiny model (≈ 1-3 s to start), which must survive every refused call.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from lessons_lib.core.attention import varlen_attention
from lessons_lib.core.batch import PackedBatch, pack, pad, seq_lens_to_cu_seqlens, unpack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.measure.flops import attention_cells, forward_flops
from lessons_lib.measure.hf import from_hf_gpt2, make_hf_gpt2
from lessons_lib.measure.tolerance import assert_close
from lessons_lib.serve.engine import Engine
from lessons_lib.serve.kv_cache import PrefillKVCache
from lessons_lib.serve.scheduler import Request, Scheduler
from lessons_lib.tp.runtime import TPRuntime, tp_forward
from lessons_lib.tp.workers import WorkerPool
from lessons_lib.validate import check_cu_seqlens

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"
I32, I64 = torch.int32, torch.int64


@dataclass(frozen=True)
class Row:
    id: str
    entry: str                       # the public entry point called
    given: str                       # the bad (or edge) input, in words
    call: Callable[[], object]
    error: type | None               # ValueError / RuntimeError, or None: a defined result
    expect: str                      # literal fragment of the message, or the defined result in words
    check: Callable[[object], bool] | None = None  # for defined results
    no_spawn: bool = False           # refused before any worker process starts (checked)


def cu(*values, dtype=I32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


def qkv(lens=(10, 30), heads=2, d_head=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(lens), heads, d_head, generator=g) for _ in range(3)]


def with_nan(t, row, value=float("nan")):
    t = t.clone()
    t[row] = value
    return t


CFG = ModelConfig(n_layers=1, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=300, max_position=256)
CFG3 = ModelConfig(n_layers=1, d_model=48, n_heads=3, d_head=16, d_ffn=96, vocab_size=300, max_position=256)


@cache
def model():
    return Transformer(CFG, seed=0)


@cache
def tiny_hf():
    return make_hf_gpt2(ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=300,
                                    max_position=64))


def ab_batch(**changes):
    """A=10, B=30 token ids, optionally with fields of the PackedBatch replaced."""
    return replace(pack([list(range(10)), list(range(100, 130))]), **changes)


def hidden_batch(width=64, dtype=torch.float32, bad_row=None, value=float("nan")):
    g = torch.Generator().manual_seed(0)
    b = pack([torch.randn(10, width, generator=g, dtype=dtype), torch.randn(30, width, generator=g, dtype=dtype)])
    if bad_row is not None:
        b.hidden[bad_row, 3] = value
    return b


def sd_without(key):
    return {k: v for k, v in tiny_hf().state_dict().items() if k != key}


def varlen(q=None, k=None, v=None, cu_q=None, cu_k=None, **kw):
    dq, dk, dv = qkv()
    return varlen_attention(dq if q is None else q, dk if k is None else k, dv if v is None else v,
                            cu(0, 10, 40) if cu_q is None else cu_q, cu_k, **kw)


def tpf(batch, **kw):
    """tp_forward on the tiny model; any call that got past validation would start 2 workers."""
    return tp_forward(batch, cfg=CFG, **({"backend": "gloo", "timeout": 60, "verbose": False} | kw))


def tpr(cfg=CFG, **kw):
    return TPRuntime(cfg, **({"backend": "gloo", "timeout": 60, "verbose": False} | kw))


@cache
def runtime():
    """One live TP=2 runtime for the TPRuntime.forward rows (closed by the module fixture)."""
    return TPRuntime(CFG, world_size=2, backend="gloo", timeout=60, verbose=False)


def empty_batch():
    """No request at all, hand-built (pack refuses it): cu_seqlens = [0]."""
    e = torch.zeros(0, dtype=I64)
    return PackedBatch(e, None, e.clone(), cu(0), 0, [])


def meta_weights():
    return {k: v.to("meta") for k, v in init_weights(CFG).items()}


def engine_after(calls, **kw):
    """An Engine(CFG) after ``calls(engine)``; returns what the last call returned."""
    return calls(Engine(CFG, **kw))


def same_tp_output(result):
    return torch.equal(result.output, runtime().forward(ab_batch()).output)


def same_as_alone_rows(out):
    q, k, v = qkv((3, 4))
    alone = [varlen_attention(q[s:e], k[s:e], v[s:e], cu(0, e - s), backend="loop") for s, e in ((0, 3), (3, 7))]
    return out.shape == (7, 2, 8) and torch.equal(out, torch.cat(alone))


ROWS = [
    # ---- pack ----------------------------------------------------------------------------
    Row("pack-empty", "pack", "empty request list `[]`", lambda: pack([]), ValueError,
        "requests is empty: pack needs at least one request"),
    Row("pack-zero-length", "pack", "a zero-length request `[[1, 2], []]`", lambda: pack([[1, 2], []]), ValueError,
        "requests[1] has length 0"),
    Row("pack-negative-id", "pack", "negative token id `[[1, -2]]`", lambda: pack([[1, -2]]), ValueError,
        "requests[0] has a negative token id -2"),
    Row("pack-float-id", "pack", "non-integer token id `[[1, 2.5]]`", lambda: pack([[1, 2.5]]), ValueError,
        "requests[0] must hold int token ids, found 2.5"),
    Row("pack-float-tensor", "pack", "float tensor as token ids", lambda: pack([torch.tensor([1.0, 2.0])]),
        ValueError, "requests[0] token ids must be integers, got torch.float32"),
    Row("pack-bool-tensor", "pack", "bool tensor as token ids", lambda: pack([torch.tensor([True])]), ValueError,
        "requests[0] token ids must be integers, got torch.bool"),
    Row("pack-not-a-list", "pack", "a bare tensor instead of a list", lambda: pack(torch.tensor([1, 2])), ValueError,
        "requests must be a list of requests, got Tensor"),
    Row("pack-3d", "pack", "a `[2, 3, 4]` tensor as one request", lambda: pack([torch.zeros(2, 3, 4)]), ValueError,
        "requests[0] must be 1-D token ids [L] or 2-D hidden rows [L, d], got shape (2, 3, 4)"),
    Row("pack-mixed-kinds", "pack", "token ids and hidden rows mixed", lambda: pack([[1, 2], torch.randn(2, 4)]),
        ValueError, "requests mix token ids (1-D) and hidden rows (2-D)"),
    Row("pack-widths", "pack", "hidden rows of widths 4 and 5", lambda: pack([torch.randn(2, 4), torch.randn(3, 5)]),
        ValueError, "hidden rows must share one width, got [4, 5]"),
    Row("pack-devices", "pack", "requests on cpu and meta",
        lambda: pack([torch.tensor([1]), torch.tensor([2], device="meta")]), ValueError,
        "requests live on different devices: ['cpu', 'meta']"),
    # ---- unpack / check_cu_seqlens ----------------------------------------------------
    Row("unpack-int64", "unpack", "int64 `cu_seqlens` (PyTorch's default integer)",
        lambda: unpack(torch.zeros(5), cu(0, 2, 5, dtype=I64)), ValueError, "cu_seqlens must be int32, got int64"),
    Row("unpack-list", "unpack", "a Python list as `cu_seqlens`", lambda: unpack(torch.zeros(5), [0, 5]), ValueError,
        "cu_seqlens must be a torch.Tensor of int32, got list"),
    Row("unpack-2d", "unpack", "2-D `cu_seqlens` `[[0, 5]]`",
        lambda: unpack(torch.zeros(5), torch.tensor([[0, 5]], dtype=I32)), ValueError,
        "cu_seqlens must be 1-D [num_seqs + 1], got shape (1, 2)"),
    Row("unpack-one-entry", "unpack", "`cu_seqlens = [0]`", lambda: unpack(torch.zeros(0), cu(0)), ValueError,
        "cu_seqlens must have at least 2 entries [0, T], got [0]"),
    Row("unpack-start", "unpack", "`cu_seqlens` not starting at 0: `[1, 3, 5]`",
        lambda: unpack(torch.zeros(5), cu(1, 3, 5)), ValueError, "cu_seqlens must start at 0, got cu_seqlens[0]=1"),
    Row("unpack-decreasing", "unpack", "decreasing `cu_seqlens` `[0, 3, 2, 5]`",
        lambda: unpack(torch.zeros(5), cu(0, 3, 2, 5)), ValueError,
        "cu_seqlens must be non-decreasing, got cu_seqlens[1]=3 > cu_seqlens[2]=2"),
    Row("unpack-overshoot", "unpack", "`cu_seqlens` ends past T=5: `[0, 2, 6]`",
        lambda: unpack(torch.zeros(5), cu(0, 2, 6)), ValueError,
        "cu_seqlens must end at the token count 5, got cu_seqlens[-1]=6"),
    Row("unpack-undershoot", "unpack", "`cu_seqlens` ends before T=5: `[0, 2, 4]`",
        lambda: unpack(torch.zeros(5), cu(0, 2, 4)), ValueError,
        "cu_seqlens must end at the token count 5, got cu_seqlens[-1]=4"),
    Row("cu-repeated-entry", "check_cu_seqlens", "a repeated entry `[0, 3, 3, 5]` (zero-length request)",
        lambda: check_cu_seqlens(cu(0, 3, 3, 5), 5), None, "accepted, as FlashAttention does: [0, 3, 3, 5]",
        lambda r: r == [0, 3, 3, 5]),
    # ---- pad -----------------------------------------------------------------------------
    Row("pad-empty", "pad", "empty request list", lambda: pad([]), ValueError,
        "requests must be a non-empty list of requests"),
    Row("pad-zero-length", "pad", "a zero-length request", lambda: pad([[1], []]), ValueError,
        "requests[1] has length 0"),
    Row("pad-mixed", "pad", "token ids and hidden rows mixed", lambda: pad([[1, 2], torch.randn(2, 3)]), ValueError,
        "requests must all be token ids or all hidden rows of one width"),
    Row("pad-side", "pad", "`side='middle'`", lambda: pad([[1, 2, 3]], side="middle"), ValueError,
        "side must be 'right' or 'left', got 'middle'"),
    Row("pad-to-short", "pad", "`pad_to` below the longest request", lambda: pad([[1, 2, 3]], pad_to=2), ValueError,
        "pad_to must be an int >= the longest request (3), got 2"),
    # ---- lengths (seq_lens_to_cu_seqlens, attention_cells) ---------------------------------
    Row("lens-negative", "seq_lens_to_cu_seqlens", "negative length `[3, -1]`",
        lambda: seq_lens_to_cu_seqlens([3, -1]), ValueError, "seq_lens[1] must be >= 0, got -1"),
    Row("lens-non-integer", "seq_lens_to_cu_seqlens", "non-integer length `[3, 1.5]`",
        lambda: seq_lens_to_cu_seqlens([3, 1.5]), ValueError, "seq_lens[1] must be an int, got 1.5"),
    Row("lens-zero", "seq_lens_to_cu_seqlens", "a zero length `[0, 2]`", lambda: seq_lens_to_cu_seqlens([0, 2]),
        None, "accepted at this low level: [0, 0, 2]", lambda r: r.tolist() == [0, 0, 2] and r.dtype == I32),
    Row("cells-negative", "attention_cells", "negative length `[10, -30]`",
        lambda: attention_cells([10, -30], "masked"), ValueError, "seq_lens[1] must be >= 1, got -30"),
    Row("cells-zero", "attention_cells", "a zero length `[10, 0]`", lambda: attention_cells([10, 0], "varlen"),
        ValueError, "seq_lens[1] must be >= 1, got 0"),
    Row("cells-non-integer", "attention_cells", "non-integer length `[10, 2.5]`",
        lambda: attention_cells([10, 2.5], "varlen"), ValueError, "seq_lens[1] must be an int, got 2.5"),
    Row("cells-method", "attention_cells", "unknown method `'blocky'`", lambda: attention_cells([10], "blocky"),
        ValueError, "method must be one of ('padded', 'masked', 'varlen'), got 'blocky'"),
    Row("cells-empty", "attention_cells", "empty request list `[]`", lambda: attention_cells([], "padded"), None,
        "zero cells: computed 0, useful 0, wasted 0", lambda r: (r.computed, r.useful, r.wasted) == (0, 0, 0)),
    Row("flops-empty", "forward_flops", "empty request list `[]`", lambda: forward_flops(CFG, [], "varlen"), None,
        "zero FLOPs", lambda r: (r.linear, r.attention) == (0, 0)),
    # ---- varlen_attention ----------------------------------------------------------------
    Row("attn-cu-int64", "varlen_attention", "int64 `cu_seqlens_q`", lambda: varlen(cu_q=cu(0, 10, 40, dtype=I64)),
        ValueError, "cu_seqlens_q must be int32, got int64"),
    Row("attn-cu-k-int64", "varlen_attention", "int64 `cu_seqlens_k`",
        lambda: varlen(cu_k=cu(0, 10, 40, dtype=I64)), ValueError, "cu_seqlens_k must be int32, got int64"),
    Row("attn-cu-list", "varlen_attention", "a list as `cu_seqlens_q`", lambda: varlen(cu_q=[0, 10, 40]), ValueError,
        "cu_seqlens_q must be a torch.Tensor of int32, got list"),
    Row("attn-cu-2d", "varlen_attention", "2-D `cu_seqlens_q`",
        lambda: varlen(cu_q=torch.tensor([[0, 10, 40]], dtype=I32)), ValueError,
        "cu_seqlens_q must be 1-D [num_seqs + 1], got shape (1, 3)"),
    Row("attn-cu-start", "varlen_attention", "`cu_seqlens_q` starting at 1", lambda: varlen(cu_q=cu(1, 10, 40)),
        ValueError, "cu_seqlens_q must start at 0, got cu_seqlens_q[0]=1"),
    Row("attn-cu-decreasing", "varlen_attention", "decreasing `cu_seqlens_q` `[0, 30, 10, 40]`",
        lambda: varlen(cu_q=cu(0, 30, 10, 40)), ValueError,
        "cu_seqlens_q must be non-decreasing, got cu_seqlens_q[1]=30 > cu_seqlens_q[2]=10"),
    Row("attn-cu-overshoot", "varlen_attention", "`cu_seqlens_q` `[0, 10, 41]` for 40 rows",
        lambda: varlen(cu_q=cu(0, 10, 41)), ValueError,
        "cu_seqlens_q must end at the token count 40, got cu_seqlens_q[-1]=41"),
    Row("attn-cu-undershoot", "varlen_attention", "`cu_seqlens_q` `[0, 10, 39]` for 40 rows",
        lambda: varlen(cu_q=cu(0, 10, 39)), ValueError,
        "cu_seqlens_q must end at the token count 40, got cu_seqlens_q[-1]=39"),
    Row("attn-cu-count", "varlen_attention", "2 query requests, 1 key request",
        lambda: varlen(cu_k=cu(0, 40), causal=False), ValueError, "cu_seqlens_q has 2 requests but cu_seqlens_k has 1"),
    Row("attn-heads", "varlen_attention", "q with 2 heads, k and v with 3",
        lambda: varlen(k=torch.zeros(40, 3, 8), v=torch.zeros(40, 3, 8)), ValueError,
        "q's n_heads must be a multiple of k and v's n_kv_heads (grouped-query attention), got n_heads=2, n_kv_heads=3"),
    Row("attn-kv-heads-not-dividing", "varlen_attention", "q with 4 heads, k and v with 3",
        lambda: varlen(q=torch.zeros(40, 4, 8), k=torch.zeros(40, 3, 8), v=torch.zeros(40, 3, 8)), ValueError,
        "q's n_heads must be a multiple of k and v's n_kv_heads (grouped-query attention), got n_heads=4, n_kv_heads=3"),
    Row("attn-kv-heads-differ", "varlen_attention", "k with 1 head, v with 2",
        lambda: varlen(k=torch.zeros(40, 1, 8)), ValueError, "k and v must have the same n_kv_heads, got 1 and 2"),
    Row("attn-d-head", "varlen_attention", "q with d_head 8, k and v with 4",
        lambda: varlen(k=torch.zeros(40, 2, 4), v=torch.zeros(40, 2, 4)), ValueError,
        "q, k, v must have the same d_head, got 8, 4, 4"),
    Row("attn-dtype", "varlen_attention", "fp32 q with fp64 k, v",
        lambda: varlen(k=torch.zeros(40, 2, 8, dtype=torch.float64), v=torch.zeros(40, 2, 8, dtype=torch.float64)),
        ValueError, "q, k, v must share a dtype, got torch.float32, torch.float64, torch.float64"),
    Row("attn-int-q", "varlen_attention", "integer q, k, v",
        lambda: varlen(*(torch.zeros(40, 2, 8, dtype=I64) for _ in range(3))), ValueError,
        "q must be a floating tensor, got torch.int64"),
    Row("attn-2d-q", "varlen_attention", "q of shape `[40, 16]`", lambda: varlen(q=torch.zeros(40, 16)), ValueError,
        "q must be [total_tokens, n_heads, d_head], got shape (40, 16)"),
    Row("attn-kv-rows", "varlen_attention", "k with 40 rows, v with 39", lambda: varlen(v=torch.zeros(39, 2, 8)),
        ValueError, "k and v must have the same total_tokens, got 40 and 39"),
    Row("attn-device", "varlen_attention", "k, v on the meta device, q on cpu",
        lambda: varlen(k=torch.zeros(40, 2, 8, device="meta"), v=torch.zeros(40, 2, 8, device="meta")), ValueError,
        "q, k, v, cu_seqlens must be on one device, got q:cpu k:meta v:meta"),
    Row("attn-meta-cu", "varlen_attention", "everything on the meta device (no values to read)",
        lambda: varlen(*(torch.zeros(40, 2, 8, device="meta") for _ in range(3)), cu_q=cu(0, 10, 40, device="meta")),
        ValueError, "cu_seqlens_q is on the meta device"),
    Row("attn-unknown-backend", "varlen_attention", "`backend='fast'`", lambda: varlen(backend="fast"), ValueError,
        "unknown attention backend 'fast'"),
    Row("attn-flash-cpu", "varlen_attention", "`backend='flash'` on the CPU", lambda: varlen(backend="flash"),
        RuntimeError, "attention backend 'flash' is not available here: "),
    Row("attn-torch-varlen-cpu", "varlen_attention", "`backend='torch_varlen'` on the CPU",
        lambda: varlen(backend="torch_varlen"), RuntimeError,
        "attention backend 'torch_varlen' is not available here: "),
    Row("attn-nan-q", "varlen_attention", "NaN in q row 3", lambda: varlen(q=with_nan(qkv()[0], 3)), ValueError,
        "q contains NaN or Inf (first at row 3)"),
    Row("attn-inf-v", "varlen_attention", "+Inf in v row 12 (request B)",
        lambda: varlen(v=with_nan(qkv()[2], 12, float("inf"))), ValueError, "v contains NaN or Inf (first at row 12)"),
    Row("attn-max-seqlen-q", "varlen_attention", "`max_seqlen_q=29`, longest request 30",
        lambda: varlen(max_seqlen_q=29), ValueError, "max_seqlen_q=29 is smaller than the longest request (30)"),
    Row("attn-max-seqlen-k", "varlen_attention", "`max_seqlen_k=1`, longest request 30",
        lambda: varlen(max_seqlen_k=1), ValueError, "max_seqlen_k=1 is smaller than the longest request (30)"),
    Row("attn-max-seqlen-float", "varlen_attention", "`max_seqlen_q=30.0`", lambda: varlen(max_seqlen_q=30.0),
        ValueError, "max_seqlen_q must be an int, got 30.0"),
    Row("attn-max-seqlen-larger", "varlen_attention", "`max_seqlen_q=4096`, longest request 30",
        lambda: varlen(max_seqlen_q=4096, backend="loop"), None,
        "accepted as an upper bound; output bit-identical to no max_seqlen",
        lambda r: torch.equal(r, varlen(backend="loop"))),
    Row("attn-causal-short-k", "varlen_attention", "causal with L_k=20 < L_q=30 for request 1",
        lambda: varlen(k=torch.zeros(30, 2, 8), v=torch.zeros(30, 2, 8), cu_k=cu(0, 10, 30)), ValueError,
        "causal attention needs L_k >= L_q, request 1 has L_q=30, L_k=20"),
    Row("attn-scale-nan", "varlen_attention", "`softmax_scale=nan`", lambda: varlen(softmax_scale=float("nan")),
        ValueError, "softmax_scale must be a finite float, got nan"),
    Row("attn-zero-length", "varlen_attention", "zero-length request: `cu_seqlens_q = [0, 3, 3, 7]`",
        lambda: varlen(*qkv((3, 4)), cu_q=cu(0, 3, 3, 7), backend="loop"), None,
        "no row for the empty request; the others equal their standalone outputs", same_as_alone_rows),
    Row("attn-empty", "varlen_attention", "no tokens at all: T=0, `cu_seqlens_q = [0, 0]`",
        lambda: varlen(*(torch.zeros(0, 2, 8) for _ in range(3)), cu_q=cu(0, 0)), None, "empty `[0, 2, 8]` output",
        lambda r: r.shape == (0, 2, 8)),
    Row("attn-no-keys", "varlen_attention", "non-causal request with L_q=2, L_k=0",
        lambda: varlen(*qkv((2, 2)), cu_q=cu(0, 2, 4), cu_k=cu(0, 0, 4), causal=False, backend="loop"), None,
        "its 2 output rows are zeros (nothing to attend to)", lambda r: bool(r[:2].eq(0).all())),
    # ---- Transformer.forward -------------------------------------------------------------
    Row("fwd-not-batch", "Transformer.forward", "a list of requests instead of a PackedBatch",
        lambda: model()([[1, 2]]), ValueError, "batch must be a PackedBatch (see pack), got list"),
    Row("fwd-cu-int64", "Transformer.forward", "batch with int64 `cu_seqlens`",
        lambda: model()(ab_batch(cu_seqlens=cu(0, 10, 40, dtype=I64))), ValueError,
        "batch.cu_seqlens must be int32, got int64"),
    Row("fwd-cu-overshoot", "Transformer.forward", "batch `cu_seqlens` `[0, 10, 41]` for 40 tokens",
        lambda: model()(ab_batch(cu_seqlens=cu(0, 10, 41))), ValueError,
        "batch.cu_seqlens must end at the token count 40, got batch.cu_seqlens[-1]=41"),
    Row("fwd-max-seqlen", "Transformer.forward", "batch `max_seqlen=29`, longest request 30",
        lambda: model()(ab_batch(max_seqlen=29)), ValueError,
        "batch.max_seqlen=29 must be an int >= the longest request (30)"),
    Row("fwd-positions", "Transformer.forward", "positions `0..39` not restarting for B",
        lambda: model()(ab_batch(positions=torch.arange(40))), ValueError,
        "batch.positions must restart at 0 for every request: row 10 has position 10, expected 0"),
    Row("fwd-seq-lens", "Transformer.forward", "`seq_lens=[30, 10]` against `cu_seqlens=[0, 10, 40]`",
        lambda: model()(ab_batch(seq_lens=[30, 10])), ValueError,
        "batch.seq_lens=[30, 10] disagrees with batch.cu_seqlens=[0, 10, 40]"),
    Row("fwd-float-ids", "Transformer.forward", "float `input_ids`",
        lambda: model()(ab_batch(input_ids=torch.zeros(40))), ValueError,
        "batch.input_ids must be 1-D integer [T], got torch.float32"),
    Row("fwd-no-rows", "Transformer.forward", "neither `input_ids` nor `hidden`",
        lambda: model()(ab_batch(input_ids=None)), ValueError, "batch needs exactly one of input_ids / hidden"),
    Row("fwd-vocab", "Transformer.forward", "token id 300 with `vocab_size=300`",
        lambda: model()(pack([[1, 300]])), ValueError, "input_ids must be in [0, vocab_size=300), got min 1, max 300"),
    Row("fwd-max-position", "Transformer.forward", "a 257-token request with `max_position=256`",
        lambda: model()(pack([[1] * 257])), ValueError, "a request of 257 tokens exceeds max_position=256"),
    Row("fwd-nan-hidden", "Transformer.forward", "NaN in hidden row 5", lambda: model()(hidden_batch(bad_row=5)),
        ValueError, "batch.hidden contains NaN or Inf (first at row 5)"),
    Row("fwd-inf-hidden", "Transformer.forward", "-Inf in hidden row 33",
        lambda: model()(hidden_batch(bad_row=33, value=float("-inf"))), ValueError,
        "batch.hidden contains NaN or Inf (first at row 33)"),
    Row("fwd-hidden-width", "Transformer.forward", "hidden rows of width 32 for `d_model=64`",
        lambda: model()(hidden_batch(width=32)), ValueError, "batch.hidden must be [T, d_model=64] torch.float32, got (40, 32) torch.float32"),
    Row("fwd-hidden-dtype", "Transformer.forward", "fp64 hidden rows for an fp32 model",
        lambda: model()(hidden_batch(dtype=torch.float64)), ValueError,
        "batch.hidden must be [T, d_model=64] torch.float32, got (40, 64) torch.float64"),
    Row("fwd-device", "Transformer.forward", "batch on the meta device, model on cpu",
        lambda: model()(ab_batch().to("meta")), ValueError, "batch.input_ids is on the meta device: a forward needs its values"),
    Row("fwd-unknown-backend", "Transformer.forward", "`attn_backend='fast'`",
        lambda: model()(ab_batch(), attn_backend="fast"), ValueError, "unknown attention backend 'fast'"),
    Row("fwd-flash-cpu", "Transformer.forward", "`attn_backend='flash'` on the CPU",
        lambda: model()(ab_batch(), attn_backend="flash"), RuntimeError,
        "attention backend 'flash' is not available here: "),
    Row("model-missing-weights", "Transformer", "weights dict without `wte`",
        lambda: Transformer(CFG, {k: v for k, v in init_weights(CFG).items() if k != "wte"}), ValueError,
        "weights are missing 1 tensors, e.g. ['wte']"),
    Row("model-group", "Transformer", "a group of world_size 3 for 4 heads",
        lambda: Transformer(CFG, group=LocalGroup(world_size=3)), ValueError,
        "group world_size=3 must divide n_heads=4 and d_ffn=128"),
    # ---- ModelConfig ---------------------------------------------------------------------
    Row("cfg-heads-tp", "ModelConfig.heads_per_rank", "`n_heads=6`, `tp_size=4`",
        lambda: ModelConfig(n_heads=6).heads_per_rank(4), ValueError, "tp_size=4 must divide n_heads=6 and d_ffn=2048"),
    Row("cfg-zero", "ModelConfig", "`d_model=0`", lambda: ModelConfig(d_model=0), ValueError,
        "ModelConfig.d_model must be a positive int, got 0"),
    Row("cfg-negative", "ModelConfig", "`vocab_size=-1`", lambda: ModelConfig(vocab_size=-1), ValueError,
        "ModelConfig.vocab_size must be a positive int, got -1"),
    Row("cfg-float", "ModelConfig", "`n_layers=2.0`", lambda: ModelConfig(n_layers=2.0), ValueError,
        "ModelConfig.n_layers must be a positive int, got 2.0"),
    Row("cfg-bool", "ModelConfig", "`n_layers=True`", lambda: ModelConfig(n_layers=True), ValueError,
        "ModelConfig.n_layers must be a positive int, got True"),
    Row("cfg-dtype", "ModelConfig", "`dtype=torch.int32`", lambda: ModelConfig(dtype=torch.int32), ValueError,
        "ModelConfig.dtype must be a floating torch.dtype, got torch.int32"),
    Row("cfg-eps", "ModelConfig", "`layer_norm_eps=0`", lambda: ModelConfig(layer_norm_eps=0), ValueError,
        "ModelConfig.layer_norm_eps must be a float in (0, 1), got 0"),
    # ---- from_hf_gpt2 --------------------------------------------------------------------
    Row("hf-not-a-model", "from_hf_gpt2", "an int", lambda: from_hf_gpt2(42), ValueError,
        "from_hf_gpt2 takes a HF GPT2Model / GPT2LMHeadModel or a state dict, got int"),
    Row("hf-sd-no-cfg", "from_hf_gpt2", "a bare state dict without `cfg`",
        lambda: from_hf_gpt2(tiny_hf().state_dict()), ValueError,
        "from_hf_gpt2(state_dict) needs cfg=ModelConfig(...)"),
    Row("hf-not-gpt2", "from_hf_gpt2", "a state dict with no `wte.weight`",
        lambda: from_hf_gpt2({"a": torch.zeros(1)}, cfg=CFG), ValueError, "not a GPT-2 state dict: no 'wte.weight'"),
    Row("hf-missing-tensor", "from_hf_gpt2", "state dict without `h.0.mlp.c_fc.weight`",
        lambda: from_hf_gpt2(sd_without("h.0.mlp.c_fc.weight"), cfg=tiny_hf_cfg()), ValueError,
        "GPT-2 state dict for n_layers=1 is missing 1 tensors, e.g. ['h.0.mlp.c_fc.weight']"),
    Row("hf-more-layers", "from_hf_gpt2", "a 1-layer state dict with a 2-layer `cfg`",
        lambda: from_hf_gpt2(tiny_hf().state_dict(), cfg=replace(tiny_hf_cfg(), n_layers=2)), ValueError,
        "GPT-2 state dict for n_layers=2 is missing 12 tensors"),
    Row("hf-wrong-width", "from_hf_gpt2", "a 32-wide state dict with a 64-wide `cfg`",
        lambda: from_hf_gpt2(tiny_hf().state_dict(), cfg=replace(CFG, n_layers=1)), ValueError,
        "weights['wte'] must have shape (300, 64) for this config, got (300, 32)"),
    Row("hf-activation", "from_hf_gpt2", "a model with `activation_function='relu'`", lambda: from_hf_gpt2(relu_hf()),
        ValueError, "the HF config has activation_function='relu'"),
    # ---- tp_forward: the batch (refused in the caller, before any worker starts) ----------
    Row("tpf-not-batch", "tp_forward", "a list of requests instead of a PackedBatch", lambda: tpf([[1, 2]]),
        ValueError, "batch must be a PackedBatch (see pack), got list", no_spawn=True),
    Row("tpf-empty", "tp_forward", "no request at all (hand-built, `cu_seqlens = [0]`)", lambda: tpf(empty_batch()),
        ValueError, "batch.cu_seqlens must have at least 2 entries [0, T], got [0]", no_spawn=True),
    Row("tpf-cu-int64", "tp_forward", "batch with int64 `cu_seqlens`",
        lambda: tpf(ab_batch(cu_seqlens=cu(0, 10, 40, dtype=I64))), ValueError,
        "batch.cu_seqlens must be int32, got int64", no_spawn=True),
    Row("tpf-cu-start", "tp_forward", "batch `cu_seqlens` `[1, 10, 40]` (not starting at 0)",
        lambda: tpf(ab_batch(cu_seqlens=cu(1, 10, 40))), ValueError,
        "batch.cu_seqlens must start at 0, got batch.cu_seqlens[0]=1", no_spawn=True),
    Row("tpf-cu-decreasing", "tp_forward", "batch `cu_seqlens` `[0, 30, 10, 40]` (decreasing)",
        lambda: tpf(ab_batch(cu_seqlens=cu(0, 30, 10, 40))), ValueError,
        "batch.cu_seqlens must be non-decreasing, got batch.cu_seqlens[1]=30 > batch.cu_seqlens[2]=10",
        no_spawn=True),
    Row("tpf-cu-overshoot", "tp_forward", "batch `cu_seqlens` `[0, 10, 41]` for 40 tokens",
        lambda: tpf(ab_batch(cu_seqlens=cu(0, 10, 41))), ValueError,
        "batch.cu_seqlens must end at the token count 40, got batch.cu_seqlens[-1]=41", no_spawn=True),
    Row("tpf-max-seqlen", "tp_forward", "batch `max_seqlen=29`, longest request 30",
        lambda: tpf(ab_batch(max_seqlen=29)), ValueError,
        "batch.max_seqlen=29 must be an int >= the longest request (30)", no_spawn=True),
    Row("tpf-max-seqlen-float", "tp_forward", "batch `max_seqlen=30.0`", lambda: tpf(ab_batch(max_seqlen=30.0)),
        ValueError, "batch.max_seqlen=30.0 must be an int >= the longest request (30)", no_spawn=True),
    Row("tpf-seq-lens-negative", "tp_forward", "batch `seq_lens=[50, -10]` against `cu_seqlens=[0, 10, 40]`",
        lambda: tpf(ab_batch(seq_lens=[50, -10])), ValueError,
        "batch.seq_lens=[50, -10] disagrees with batch.cu_seqlens=[0, 10, 40]", no_spawn=True),
    Row("tpf-positions", "tp_forward", "positions `0..39` not restarting for B",
        lambda: tpf(ab_batch(positions=torch.arange(40))), ValueError,
        "batch.positions must restart at 0 for every request: row 10 has position 10, expected 0", no_spawn=True),
    Row("tpf-float-ids", "tp_forward", "float `input_ids`", lambda: tpf(ab_batch(input_ids=torch.zeros(40))),
        ValueError, "batch.input_ids must be 1-D integer [T], got torch.float32", no_spawn=True),
    Row("tpf-2d-ids", "tp_forward", "`input_ids` of shape `[40, 1]`",
        lambda: tpf(ab_batch(input_ids=torch.zeros(40, 1, dtype=I64))), ValueError,
        "batch.input_ids must be 1-D integer [T], got torch.int64 shape (40, 1)", no_spawn=True),
    Row("tpf-negative-id", "tp_forward", "token id -1 in a hand-built batch",
        lambda: tpf(ab_batch(input_ids=torch.arange(-1, 39))), ValueError,
        "batch.input_ids must be in [0, vocab_size=300), got min -1, max 38", no_spawn=True),
    Row("tpf-vocab", "tp_forward", "token id 300 with `vocab_size=300`", lambda: tpf(pack([[1, 300]])), ValueError,
        "batch.input_ids must be in [0, vocab_size=300), got min 1, max 300", no_spawn=True),
    Row("tpf-max-position", "tp_forward", "a 257-token request with `max_position=256`",
        lambda: tpf(pack([[1] * 257])), ValueError, "a request of 257 tokens exceeds max_position=256", no_spawn=True),
    Row("tpf-nan-hidden", "tp_forward", "NaN in hidden row 5", lambda: tpf(hidden_batch(bad_row=5)), ValueError,
        "batch.hidden contains NaN or Inf (first at row 5)", no_spawn=True),
    Row("tpf-inf-hidden", "tp_forward", "-Inf in hidden row 33",
        lambda: tpf(hidden_batch(bad_row=33, value=float("-inf"))), ValueError,
        "batch.hidden contains NaN or Inf (first at row 33)", no_spawn=True),
    Row("tpf-hidden-width", "tp_forward", "hidden rows of width 32 for `d_model=64`",
        lambda: tpf(hidden_batch(width=32)), ValueError,
        "batch.hidden must be [T, d_model=64] torch.float32, got (40, 32) torch.float32", no_spawn=True),
    Row("tpf-hidden-dtype", "tp_forward", "fp64 hidden rows for an fp32 model",
        lambda: tpf(hidden_batch(dtype=torch.float64)), ValueError,
        "batch.hidden must be [T, d_model=64] torch.float32, got (40, 64) torch.float64", no_spawn=True),
    Row("tpf-meta", "tp_forward", "batch on the meta device", lambda: tpf(ab_batch().to("meta")), ValueError,
        "batch.input_ids is on the meta device: a forward needs its values", no_spawn=True),
    Row("tpf-devices", "tp_forward", "`input_ids` on cpu, `positions` on meta",
        lambda: tpf(ab_batch(positions=torch.zeros(40, dtype=I64, device="meta"))), ValueError,
        "batch.positions is on the meta device: a forward needs its values", no_spawn=True),
    Row("tpf-cfg", "tp_forward", "`cfg='article'`", lambda: tp_forward(ab_batch(), cfg="article"), ValueError,
        "cfg must be a ModelConfig, got str", no_spawn=True),
    # ---- tp_forward / TPRuntime: the arguments (refused before any worker starts) ---------
    Row("tpf-world-size-0", "tp_forward", "`world_size=0`", lambda: tpf(ab_batch(), world_size=0), ValueError,
        "world_size=0 must be a positive int dividing n_heads=4 and d_ffn=128", no_spawn=True),
    Row("tpf-timeout-0", "tp_forward", "`timeout=0`", lambda: tpf(ab_batch(), timeout=0), ValueError,
        "timeout must be a positive number of seconds, got 0", no_spawn=True),
    Row("tpf-attn-backend", "tp_forward", "`attn_backend='fast'`", lambda: tpf(ab_batch(), attn_backend="fast"),
        ValueError, "unknown attention backend 'fast'", no_spawn=True),
    Row("tpr-world-size-negative", "TPRuntime", "`world_size=-1`", lambda: tpr(world_size=-1), ValueError,
        "world_size=-1 must be a positive int dividing n_heads=4 and d_ffn=128", no_spawn=True),
    Row("tpr-world-size-float", "TPRuntime", "`world_size=2.0`", lambda: tpr(world_size=2.0), ValueError,
        "world_size=2.0 must be a positive int dividing n_heads=4 and d_ffn=128", no_spawn=True),
    Row("tpr-world-size-bool", "TPRuntime", "`world_size=True`", lambda: tpr(world_size=True), ValueError,
        "world_size=True must be a positive int dividing n_heads=4 and d_ffn=128", no_spawn=True),
    Row("tpr-world-size-3", "TPRuntime", "`world_size=3` for 4 heads", lambda: tpr(world_size=3), ValueError,
        "world_size=3 must be a positive int dividing n_heads=4 and d_ffn=128", no_spawn=True),
    Row("tpr-timeout-negative", "TPRuntime", "`timeout=-1`", lambda: tpr(timeout=-1), ValueError,
        "timeout must be a positive number of seconds, got -1", no_spawn=True),
    Row("tpr-timeout-str", "TPRuntime", "`timeout='60'`", lambda: tpr(timeout="60"), ValueError,
        "timeout must be a positive number of seconds, got '60'", no_spawn=True),
    Row("tpr-timeout-nan", "TPRuntime", "`timeout=nan`", lambda: tpr(timeout=math.nan), ValueError,
        "timeout must be a positive number of seconds, got nan", no_spawn=True),
    Row("tpr-dist-backend", "TPRuntime", "`backend='mpi'`", lambda: tpr(backend="mpi"), ValueError,
        "backend must be 'auto', 'gloo' or 'nccl', got 'mpi'", no_spawn=True),
    Row("tpr-attn-backend", "TPRuntime", "`attn_backend='fast'`", lambda: tpr(attn_backend="fast"), ValueError,
        "unknown attention backend 'fast'", no_spawn=True),
    Row("tpr-flash-cpu", "TPRuntime", "`attn_backend='flash'` with gloo (CPU ranks)",
        lambda: tpr(attn_backend="flash"), RuntimeError, "attention backend 'flash' is not available here: ",
        no_spawn=True),
    Row("tpr-seed", "TPRuntime", "`seed=1.5`", lambda: tpr(seed=1.5), ValueError, "seed must be an int, got 1.5",
        no_spawn=True),
    Row("tpr-cfg", "TPRuntime", "`cfg='article'`", lambda: tpr("article"), ValueError,
        "cfg must be a ModelConfig, got str", no_spawn=True),
    Row("tpr-weights-type", "TPRuntime", "weights as a list", lambda: tpr(weights=[1]), ValueError,
        "weights must be a dict of tensors (init_weights or a model's state_dict), got list", no_spawn=True),
    Row("tpr-weights-missing", "TPRuntime", "weights dict without `wte`",
        lambda: tpr(weights={k: v for k, v in init_weights(CFG).items() if k != "wte"}), ValueError,
        "weights are missing 1 tensors, e.g. ['wte']", no_spawn=True),
    Row("tpr-weights-meta", "TPRuntime", "weights on the meta device", lambda: tpr(weights=meta_weights()),
        ValueError, "weights['wte'] must be a tensor with values, got a tensor on the meta device", no_spawn=True),
    # ---- TPRuntime.forward on a live runtime (it must survive every refusal) -------------
    Row("tpr-fwd-not-batch", "TPRuntime.forward", "a list of requests", lambda: runtime().forward([[1, 2]]),
        ValueError, "batch must be a PackedBatch (see pack), got list"),
    Row("tpr-fwd-cu-decreasing", "TPRuntime.forward", "batch `cu_seqlens` `[0, 30, 10, 40]`",
        lambda: runtime().forward(ab_batch(cu_seqlens=cu(0, 30, 10, 40))), ValueError,
        "batch.cu_seqlens must be non-decreasing, got batch.cu_seqlens[1]=30 > batch.cu_seqlens[2]=10"),
    Row("tpr-fwd-max-seqlen", "TPRuntime.forward", "batch `max_seqlen=29`, longest request 30",
        lambda: runtime().forward(ab_batch(max_seqlen=29)), ValueError,
        "batch.max_seqlen=29 must be an int >= the longest request (30)"),
    Row("tpr-fwd-nan-hidden", "TPRuntime.forward", "NaN in hidden row 5",
        lambda: runtime().forward(hidden_batch(bad_row=5)), ValueError,
        "batch.hidden contains NaN or Inf (first at row 5)"),
    Row("tpr-fwd-meta", "TPRuntime.forward", "batch on the meta device",
        lambda: runtime().forward(ab_batch().to("meta")), ValueError,
        "batch.input_ids is on the meta device: a forward needs its values"),
    Row("tpr-fwd-fault", "TPRuntime.forward", "`fault='sigkill'` (a str, not a tp.Fault)",
        lambda: runtime().forward(ab_batch(), fault="sigkill"), ValueError,
        "fault must be a tp.Fault or None, got 'sigkill'"),
    Row("tpr-fwd-timeout-0", "TPRuntime.forward", "`timeout=0`", lambda: runtime().forward(ab_batch(), timeout=0),
        ValueError, "timeout must be a positive number of seconds, got 0"),
    Row("tpr-fwd-timeout-str", "TPRuntime.forward", "`timeout='5'`",
        lambda: runtime().forward(ab_batch(), timeout="5"), ValueError,
        "timeout must be a positive number of seconds, got '5'"),
    Row("tpr-fwd-max-seqlen-larger", "TPRuntime.forward", "`max_seqlen=4096` (> `max_position=256`), longest 30",
        lambda: runtime().forward(ab_batch(max_seqlen=4096)), None,
        "accepted as an upper bound; output bit-identical to the exact `max_seqlen=30`", same_tp_output),
    # ---- Request ---------------------------------------------------------------------------
    Row("req-id-float", "Request", "`request_id=1.5`", lambda: Request(1.5, [1]), ValueError,
        "request_id must be a str or int, got 1.5"),
    Row("req-id-bool", "Request", "`request_id=True`", lambda: Request(True, [1]), ValueError,
        "request_id must be a str or int, got True"),
    Row("req-id-negative", "Request", "`request_id=-1`", lambda: Request(-1, [1]), None,
        "accepted: ids are labels (str or int), only uniqueness matters", lambda r: r.request_id == -1),
    Row("req-empty", "Request", "empty prompt `[]`", lambda: Request(0, []), ValueError,
        "request 0: prompt_token_ids is empty: a prefill needs at least one token"),
    Row("req-negative-token", "Request", "prompt `[1, -2]`", lambda: Request(0, [1, -2]), ValueError,
        "request 0: prompt_token_ids[1] is negative (-2): token ids are >= 0"),
    Row("req-float-token", "Request", "prompt `[1, 2.5]`", lambda: Request(0, [1, 2.5]), ValueError,
        "request 0: prompt_token_ids[1] must be an int token id, got 2.5"),
    Row("req-nan-token", "Request", "prompt `[1, nan]`", lambda: Request(0, [1, math.nan]), ValueError,
        "request 0: prompt_token_ids[1] must be an int token id, got nan"),
    Row("req-float-tensor", "Request", "float tensor prompt", lambda: Request(0, torch.tensor([1.0, 2.0])),
        ValueError, "request 0: prompt_token_ids must hold integers, got dtype torch.float32"),
    Row("req-2d", "Request", "a `[2, 2]` tensor prompt", lambda: Request(0, torch.ones(2, 2, dtype=I64)), ValueError,
        "request 0: prompt_token_ids must be 1-D, got shape (2, 2)"),
    Row("req-meta", "Request", "prompt tensor on the meta device",
        lambda: Request(0, torch.tensor([1, 2], device="meta")), ValueError,
        "request 0: prompt_token_ids is on the meta device: the engine needs the token values"),
    Row("req-str", "Request", "prompt `'hello'` (text, not token ids)", lambda: Request(0, "hello"), ValueError,
        "request 0: prompt_token_ids must be a list of int token ids, got str"),
    Row("req-return-hidden", "Request", "`return_hidden='yes'`", lambda: Request(0, [1], return_hidden="yes"),
        ValueError, "request 0: return_hidden must be a bool, got 'yes'"),
    Row("req-numpy", "Request", "an int32 numpy array prompt", lambda: Request(0, np.array([3, 4], dtype=np.int32)),
        None, "converted to a list of Python ints `[3, 4]`",
        lambda r: r.prompt_token_ids == [3, 4] and all(type(t) is int for t in r.prompt_token_ids)),
    # ---- Scheduler -------------------------------------------------------------------------
    Row("sched-tokens-0", "Scheduler", "`max_num_batched_tokens=0`", lambda: Scheduler(0), ValueError,
        "max_num_batched_tokens must be a positive int, got 0"),
    Row("sched-tokens-negative", "Scheduler", "`max_num_batched_tokens=-8`", lambda: Scheduler(-8), ValueError,
        "max_num_batched_tokens must be a positive int, got -8"),
    Row("sched-tokens-float", "Scheduler", "`max_num_batched_tokens=8.5`", lambda: Scheduler(8.5), ValueError,
        "max_num_batched_tokens must be a positive int, got 8.5"),
    Row("sched-seqs-0", "Scheduler", "`max_num_seqs=0`", lambda: Scheduler(max_num_seqs=0), ValueError,
        "max_num_seqs must be a positive int, got 0"),
    Row("sched-add-list", "Scheduler.add", "a token list instead of a Request", lambda: Scheduler().add([1, 2]),
        ValueError, "Scheduler.add takes a Request, got list"),
    Row("sched-add-too-long", "Scheduler.add", "a 5-token request with `max_num_batched_tokens=4`",
        lambda: Scheduler(4).add(Request(0, [1] * 5)), ValueError,
        "request 0 has 5 prompt tokens, more than max_num_batched_tokens=4"),
    Row("sched-empty", "Scheduler.schedule", "nothing waiting", lambda: Scheduler().schedule(), None,
        "an empty batch `[]`", lambda r: r == []),
    Row("sched-chunked-not-bool", "Scheduler", "`enable_chunked_prefill='yes'`",
        lambda: Scheduler(enable_chunked_prefill="yes"), ValueError, "enable_chunked_prefill must be a bool, got 'yes'"),
    Row("sched-chunked-long", "Scheduler.schedule_chunks", "a 5-token request, `max_num_batched_tokens=4`, chunked",
        lambda: chunks_of(Scheduler(4, enable_chunked_prefill=True), 5), None,
        "chunks `(start, length)`: (0, 4), then (4, 1) in the next forward", lambda r: r == [[(0, 4)], [(4, 1)]]),
    # ---- chunked prefill: the KV cache and a chunk's batch ----------------------------------
    Row("kv-count-mismatch", "PrefillKVCache.step", "a chunk at token 5 of a request with nothing cached",
        lambda: PrefillKVCache(1, 4, 16).step(["a"], [5], [3], [True]), ValueError,
        "request 'a': the KV cache holds 0 tokens, the chunk says num_computed_tokens=5"),
    Row("kv-duplicate", "PrefillKVCache.step", "one request twice in one forward",
        lambda: PrefillKVCache(1, 4, 16).step(["a", "a"], [0, 0], [1, 1], [True, True]), ValueError,
        "request_ids must be distinct within one forward"),
    Row("fwd-chunk-no-cache", "Transformer.forward", "a batch with `num_computed_tokens=[3]` and no `kv_cache`",
        lambda: model()(pack([[1, 2]], num_computed_tokens=[3])), ValueError,
        "batch continues requests (num_computed_tokens=[3]) but no kv_cache holds their earlier tokens"),
    Row("pack-computed-length", "pack", "`num_computed_tokens=[0]` for two requests",
        lambda: pack([[1], [2]], num_computed_tokens=[0]), ValueError, "num_computed_tokens has 1 entries for 2 requests"),
    # ---- Engine(...) -----------------------------------------------------------------------
    Row("eng-chunked-not-bool", "Engine", "`enable_chunked_prefill='yes'`",
        lambda: Engine(CFG, enable_chunked_prefill="yes"), ValueError, "enable_chunked_prefill must be a bool, got 'yes'"),
    Row("eng-chunked-padded", "Engine", "`method='padded', enable_chunked_prefill=True`",
        lambda: Engine(CFG, method="padded", enable_chunked_prefill=True), ValueError,
        "enable_chunked_prefill=True needs a flat forward with a KV cache"),
    Row("eng-chunked-max-position", "Engine.submit", "a 257-token prompt, chunked prefill on (budget 16)",
        lambda: Engine(CFG, max_num_batched_tokens=16, enable_chunked_prefill=True).submit([1] * 257), ValueError,
        "request 0 has 257 prompt tokens, more than max_position=256"),
    Row("eng-attn-fn-short", "Engine", "`attn_backend=fn(q, k, v, cu_seqlens, max_seqlen)`",
        lambda: Engine(CFG, attn_backend=lambda q, k, v, cu_seqlens, max_seqlen: q), ValueError,
        "takes no keyword causal or softmax_scale"),
    Row("eng-tp-0", "Engine", "`tp_size=0`", lambda: Engine(CFG, tp_size=0), ValueError,
        "tp_size must be 1 or 2, got 0"),
    Row("eng-tp-negative", "Engine", "`tp_size=-1`", lambda: Engine(CFG, tp_size=-1), ValueError,
        "tp_size must be 1 or 2, got -1"),
    Row("eng-tp-4", "Engine", "`tp_size=4` (divides 4 heads, but the engine runs 1 or 2)",
        lambda: Engine(CFG, tp_size=4), ValueError, "tp_size must be 1 or 2, got 4"),
    Row("eng-tp-float", "Engine", "`tp_size=2.0`", lambda: Engine(CFG, tp_size=2.0), ValueError,
        "tp_size must be 1 or 2, got 2.0"),
    Row("eng-tp-bool", "Engine", "`tp_size=True`", lambda: Engine(CFG, tp_size=True), ValueError,
        "tp_size must be 1 or 2, got True"),
    Row("eng-tp-heads", "Engine", "`tp_size=2` for a 3-head model", lambda: Engine(CFG3, tp_size=2), ValueError,
        "tp_size=2 must divide n_heads=3 and d_ffn=96"),
    Row("eng-tokens-0", "Engine", "`max_num_batched_tokens=0`", lambda: Engine(CFG, max_num_batched_tokens=0),
        ValueError, "max_num_batched_tokens must be a positive int, got 0"),
    Row("eng-seqs-negative", "Engine", "`max_num_seqs=-1`", lambda: Engine(CFG, max_num_seqs=-1), ValueError,
        "max_num_seqs must be a positive int, got -1"),
    Row("eng-method", "Engine", "`method='chunked'`", lambda: Engine(CFG, method="chunked"), ValueError,
        "method must be one of ('padded', 'masked', 'varlen'), got 'chunked'"),
    Row("eng-attn-backend", "Engine", "`attn_backend='fast'`", lambda: Engine(CFG, attn_backend="fast"), ValueError,
        "unknown attention backend 'fast'"),
    Row("eng-flash-cpu", "Engine", "`attn_backend='flash'` on the CPU", lambda: Engine(CFG, attn_backend="flash"),
        RuntimeError, "attention backend 'flash' is not available here: "),
    Row("eng-tp-timeout-0", "Engine", "`tp_size=2, tp_timeout=0`", lambda: Engine(CFG, tp_size=2, tp_timeout=0),
        ValueError, "tp_timeout must be a positive number of seconds, got 0", no_spawn=True),
    Row("eng-tp-timeout-str", "Engine", "`tp_size=2, tp_timeout='60'`",
        lambda: Engine(CFG, tp_size=2, tp_timeout="60"), ValueError,
        "tp_timeout must be a positive number of seconds, got '60'", no_spawn=True),
    Row("eng-tp-backend", "Engine", "`tp_size=2, tp_backend='mpi'`", lambda: Engine(CFG, tp_size=2, tp_backend="mpi"),
        ValueError, "tp_backend must be one of ('auto', 'gloo', 'nccl'), got 'mpi'", no_spawn=True),
    Row("eng-seed", "Engine", "`seed=1.5`", lambda: Engine(CFG, seed=1.5), ValueError, "seed must be an int, got 1.5"),
    Row("eng-cfg", "Engine", "`cfg='article'`", lambda: Engine("article"), ValueError,
        "cfg must be a ModelConfig, got str"),
    Row("eng-weights-missing", "Engine", "weights dict without `wte`",
        lambda: Engine(CFG, weights={k: v for k, v in init_weights(CFG).items() if k != "wte"}), ValueError,
        "weights are missing 1 tensors, e.g. ['wte']"),
    Row("eng-weights-meta", "Engine", "weights on the meta device", lambda: Engine(CFG, weights=meta_weights()),
        ValueError, "weights['wte'] must be a tensor with values, got a tensor on the meta device"),
    # ---- Engine.submit / submit_many / prefill ------------------------------------------------
    Row("eng-submit-budget", "Engine.submit", "a 33-token prompt with `max_num_batched_tokens=32`",
        lambda: Engine(CFG, max_num_batched_tokens=32).submit([1] * 33), ValueError,
        "request 0 has 33 prompt tokens, more than max_num_batched_tokens=32"),
    Row("eng-submit-max-position", "Engine.submit", "a 257-token prompt with `max_position=256`",
        lambda: Engine(CFG).submit([1] * 257), ValueError,
        "request 0 has 257 prompt tokens, more than max_position=256"),
    Row("eng-submit-vocab", "Engine.submit", "token id 300 with `vocab_size=300`",
        lambda: Engine(CFG).submit([1, 300]), ValueError,
        "request 0: prompt_token_ids[1]=300 is out of range [0, vocab_size=300)"),
    Row("eng-submit-negative", "Engine.submit", "prompt `[-1]`", lambda: Engine(CFG).submit([-1]), ValueError,
        "request 0: prompt_token_ids[0] is negative (-1): token ids are >= 0"),
    Row("eng-submit-float-tensor", "Engine.submit", "float tensor prompt",
        lambda: Engine(CFG).submit(torch.tensor([1.0])), ValueError,
        "request 0: prompt_token_ids must hold integers, got dtype torch.float32"),
    Row("eng-submit-meta", "Engine.submit", "prompt tensor on the meta device",
        lambda: Engine(CFG).submit(torch.tensor([1], device="meta")), ValueError,
        "request 0: prompt_token_ids is on the meta device: the engine needs the token values"),
    Row("eng-submit-duplicate", "Engine.submit", "request id `'a'` twice while the first waits",
        lambda: engine_after(lambda e: (e.submit(Request("a", [1])), e.submit(Request("a", [2])))), ValueError,
        "request_id 'a' is already waiting in this engine"),
    Row("eng-submit-auto-id", "Engine.submit", "a token list after an explicit `Request(1, ...)`",
        lambda: engine_after(lambda e: (e.submit(Request(1, [1])), e.submit([2]))[1].request_id), None,
        "the automatic id skips ids still waiting: 2, not a clash with 1", lambda r: r == 2),
    Row("eng-submit-many-duplicate", "Engine.submit_many", "request id `'a'` twice in one list",
        lambda: Engine(CFG).submit_many([Request("a", [1]), Request("a", [2])]), ValueError,
        "request_id 'a' is already waiting in this engine"),
    Row("eng-submit-many-queues-nothing", "Engine.submit_many", "a list whose 2nd prompt is too long",
        lambda: engine_after(lambda e: (refused(lambda: e.submit_many([[1], [1] * 257])), len(e.scheduler))), None,
        "ValueError, and nothing of the list is queued (0 waiting)", lambda r: r == (True, 0)),
    Row("eng-prefill-empty", "Engine.prefill", "empty request list `[]`", lambda: Engine(CFG).prefill([]), None,
        "`[]`, no batch run", lambda r: r == []),
    Row("eng-prefill-empty-tp2", "Engine.prefill", "`[]` with `tp_size=2`",
        lambda: engine_after(lambda e: (e.prefill([]), e._runtime), tp_size=2), None,
        "`[]`, and no TP worker is started", lambda r: r == ([], None)),
    Row("eng-prefill-tensor", "Engine.prefill", "a tensor instead of a list",
        lambda: Engine(CFG).prefill(torch.ones(2)), ValueError, "requests must be a list of requests, got Tensor"),
    Row("eng-prefill-str", "Engine.prefill", "a str instead of a list", lambda: Engine(CFG).prefill("hello"),
        ValueError, "requests must be a list of requests, got str"),
    Row("eng-prefill-zero-length", "Engine.prefill", "a zero-length request `[[1], []]`",
        lambda: Engine(CFG).prefill([[1], []]), ValueError,
        "request 1: prompt_token_ids is empty: a prefill needs at least one token"),
    Row("eng-prefill-nan", "Engine.prefill", "prompt `[1, nan]`", lambda: Engine(CFG).prefill([[1, math.nan]]),
        ValueError, "request 0: prompt_token_ids[1] must be an int token id, got nan"),
    Row("eng-prefill-max-position-tp2", "Engine.prefill", "a 257-token prompt with `tp_size=2`",
        lambda: Engine(CFG, tp_size=2).prefill([[1] * 4, [1] * 257]), ValueError,
        "request 1 has 257 prompt tokens, more than max_position=256", no_spawn=True),
]


def chunks_of(sched, n: int) -> list:
    """Every forward's ``(start, length)`` chunks for one request of ``n`` tokens."""
    sched.add(Request(0, [1] * n))
    out = []
    while sched.has_unfinished():
        out.append([(c.start, c.length) for c in sched.schedule_chunks()])
    return out


def refused(call) -> bool:
    """True if ``call()`` raises ValueError."""
    try:
        call()
    except ValueError:
        return True
    return False


def tiny_hf_cfg():
    return ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=300, max_position=64)


def relu_hf():
    hf = make_hf_gpt2(tiny_hf_cfg())
    hf.config.activation_function = "relu"
    return hf


@pytest.fixture(scope="module", autouse=True)
def _close_runtime():
    yield
    if runtime.cache_info().currsize:
        runtime().close()


@pytest.mark.parametrize("row", [r for r in ROWS if r.error], ids=lambda r: r.id)
def test_bad_input_is_a_clear_error_naming_argument_and_value(row):
    with pytest.raises(row.error, match=re.escape(row.expect)):
        row.call()


@pytest.mark.parametrize("row", [r for r in ROWS if not r.error], ids=lambda r: r.id)
def test_edge_input_has_its_documented_result(row):
    assert row.check(row.call()), row.expect


@pytest.mark.parametrize("row", [r for r in ROWS if r.no_spawn], ids=lambda r: r.id)
def test_refused_before_any_worker_starts(row, monkeypatch):
    """tp_forward / TPRuntime / a TP=2 engine refuse bad input in the caller: no worker is
    spawned: WorkerPool.start is never reached and psutil sees no new child."""
    # live children minus the session's resource tracker; imported here: pytest puts tests/ on sys.path
    from helpers import children as _children
    starts = []
    real_start = WorkerPool.start
    monkeypatch.setattr(WorkerPool, "start", lambda self, *a, **k: starts.append(a) or real_start(self, *a, **k))
    before = _children()
    with pytest.raises(row.error, match=re.escape(row.expect)):
        row.call()
    assert not starts, "a worker pool was started before the input was refused"
    assert _children() == before, f"child processes appeared: {_children() - before}"


def test_runtime_survives_every_refused_forward():
    rt = runtime()
    first = rt.forward(ab_batch()).output
    for row in ROWS:
        if row.entry == "TPRuntime.forward" and row.error:
            with pytest.raises(row.error, match=re.escape(row.expect)):
                row.call()
    assert not rt.closed and all(psutil.pid_exists(p) for p in rt.pids)
    again = rt.forward(ab_batch()).output
    assert torch.equal(again, first)  # no stale result was left in the pipes by a refused call
    ref = model()(ab_batch())  # TP=1 in this process, same weights (seed 0)
    assert_close(again, ref, Transformer(CFG, seed=0, dtype=torch.float64)(ab_batch()), "TP=2 after the refusals")


def render() -> str:
    """docs/bad_inputs.md, generated from ROWS."""
    lines = ["# Bad inputs to the public entry points", "",
             "Every row is a test in `tests/test_bad_inputs.py` (regenerate this file with",
             "`python3 -m tests.test_bad_inputs > docs/bad_inputs.md`). An error row raises the named",
             "exception with a message containing the text shown: the argument and the value.",
             "A \"defined\" row is legal input with the documented result. Zero-length requests: `pack`",
             "and `pad` reject them; `check_cu_seqlens` and attention accept a repeated `cu_seqlens`",
             "entry and write no row for it (see `lessons_lib/batch.py`).",
             "Rows marked † are also checked to be refused before any worker process starts (no spawn,",
             "no child process, well under a second); the `TPRuntime.forward` rows run on one live",
             "TP=2 runtime, which must still work afterwards.", "",
             "| id | entry point | input | result |", "|---|---|---|---|"]
    for r in ROWS:
        result = f"`{r.error.__name__}`: `{r.expect.strip()}`" if r.error else f"defined: {r.expect}"
        entry = f"`{r.entry}`" + (" †" if r.no_spawn else "")
        lines.append(f"| `{r.id}` | {entry} | {r.given} | {result.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def test_docs_table_lists_the_same_rows():
    assert len({r.id for r in ROWS}) == len(ROWS), "duplicate row ids"
    assert DOC.read_text(encoding="utf-8") == render(), \
        "docs/bad_inputs.md is stale: python3 -m tests.test_bad_inputs > docs/bad_inputs.md"


if __name__ == "__main__":
    print(render(), end="")
