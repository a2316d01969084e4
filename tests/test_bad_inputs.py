"""Bad input table for the core entry points: every row is a clear error naming the argument
and the value, or a defined, documented result. docs/bad_inputs.md is this table, rendered:

    python3 -m tests.test_bad_inputs > docs/bad_inputs.md
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pytest
import torch

from lessons_lib.attention import varlen_attention
from lessons_lib.batch import pack, pad, seq_lens_to_cu_seqlens, unpack, validate_cu_seqlens
from lessons_lib.config import ModelConfig
from lessons_lib.flops import attention_cells, forward_flops
from lessons_lib.hf import from_hf_gpt2, make_hf_gpt2
from lessons_lib.model import Transformer, init_weights
from lessons_lib.parallel import LocalGroup

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


@lru_cache(maxsize=None)
def model():
    return Transformer(CFG, seed=0)


@lru_cache(maxsize=None)
def tiny_hf():
    return make_hf_gpt2(ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=300,
                                    max_position=64, tp_size=1))


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
    # ---- unpack / validate_cu_seqlens ----------------------------------------------------
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
    Row("cu-repeated-entry", "validate_cu_seqlens", "a repeated entry `[0, 3, 3, 5]` (zero-length request)",
        lambda: validate_cu_seqlens(cu(0, 3, 3, 5), 5), None, "accepted, as FlashAttention does: [0, 3, 3, 5]",
        lambda r: r == [0, 3, 3, 5]),
    # ---- pad -----------------------------------------------------------------------------
    Row("pad-empty", "pad", "empty request list", lambda: pad([]), ValueError,
        "requests must be a non-empty list of requests"),
    Row("pad-zero-length", "pad", "a zero-length request", lambda: pad([[1], []]), ValueError,
        "requests[1] has length 0"),
    Row("pad-mixed", "pad", "token ids and hidden rows mixed", lambda: pad([[1, 2], torch.randn(2, 3)]), ValueError,
        "requests must all be token ids or all hidden rows of one width"),
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
        ValueError, "unknown method 'blocky'"),
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
        "q, k, v must have the same n_heads, got 2, 3, 3"),
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
        lambda: model()([[1, 2]]), ValueError, "forward takes a PackedBatch (see batch.pack), got list"),
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
        lambda: model()(hidden_batch(width=32)), ValueError, "hidden rows must be [T, d_model=64], got (40, 32)"),
    Row("fwd-hidden-dtype", "Transformer.forward", "fp64 hidden rows for an fp32 model",
        lambda: model()(hidden_batch(dtype=torch.float64)), ValueError,
        "hidden rows must be torch.float32, got torch.float64"),
    Row("fwd-device", "Transformer.forward", "batch on the meta device, model on cpu",
        lambda: model()(ab_batch().to("meta")), ValueError, "batch is on meta but the model is on cpu"),
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
    Row("cfg-heads-tp", "ModelConfig", "`n_heads=6, tp_size=4`", lambda: ModelConfig(n_heads=6, tp_size=4),
        ValueError, "ModelConfig.n_heads=6 is not divisible by tp_size=4"),
    Row("cfg-ffn-tp", "ModelConfig", "`d_ffn=2049` with `tp_size=2`", lambda: ModelConfig(d_ffn=2049), ValueError,
        "ModelConfig.d_ffn=2049 is not divisible by tp_size=2"),
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
]


def tiny_hf_cfg():
    return ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=300, max_position=64,
                       tp_size=1)


def relu_hf():
    hf = make_hf_gpt2(tiny_hf_cfg())
    hf.config.activation_function = "relu"
    return hf


@pytest.mark.parametrize("row", [r for r in ROWS if r.error], ids=lambda r: r.id)
def test_bad_input_is_a_clear_error_naming_argument_and_value(row):
    with pytest.raises(row.error, match=re.escape(row.expect)):
        row.call()


@pytest.mark.parametrize("row", [r for r in ROWS if not r.error], ids=lambda r: r.id)
def test_edge_input_has_its_documented_result(row):
    assert row.check(row.call()), row.expect


def render() -> str:
    """docs/bad_inputs.md, generated from ROWS."""
    lines = ["# Bad inputs to the core entry points", "",
             "Every row is a test in `tests/test_bad_inputs.py` (regenerate this file with",
             "`python3 -m tests.test_bad_inputs > docs/bad_inputs.md`). An error row raises the named",
             "exception with a message containing the text shown: the argument and the value.",
             "A \"defined\" row is legal input with the documented result. Zero-length requests: `pack`",
             "and `pad` reject them; `validate_cu_seqlens` and attention accept a repeated `cu_seqlens`",
             "entry and write no row for it (see `lessons_lib/batch.py`).", "",
             "| id | entry point | input | result |", "|---|---|---|---|"]
    for r in ROWS:
        result = f"`{r.error.__name__}`: `{r.expect.strip()}`" if r.error else f"defined: {r.expect}"
        lines.append(f"| `{r.id}` | `{r.entry}` | {r.given} | {result.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def test_docs_table_lists_the_same_rows():
    assert len({r.id for r in ROWS}) == len(ROWS), "duplicate row ids"
    assert DOC.read_text(encoding="utf-8") == render(), \
        "docs/bad_inputs.md is stale: python3 -m tests.test_bad_inputs > docs/bad_inputs.md"


if __name__ == "__main__":
    print(render(), end="")
