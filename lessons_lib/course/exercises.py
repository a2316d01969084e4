"""Checkers for the lessons' exercises: grade the reader's function against the library's answer.

Every ``check_*`` takes the reader's function and returns:

- ``True`` after printing one ``✓`` line when every case matches;
- ``False`` after printing a "not attempted yet" line when the function still raises
  ``NotImplementedError`` (the stub a lesson hands out), so a notebook runs top to bottom;
- raises ``AssertionError`` saying which input failed, what came back, what was expected and,
  where a typical mistake is recognised, what probably went wrong.

The expected answers come from ``lessons_lib`` itself (``batch``, ``attention``, ``flops``,
``linear``), never from numbers typed into this file, and the cases include inputs other
than the lesson's A=10, B=30 so that a hard-coded answer fails.

Taught in notebooks/00_setup_one_request.ipynb to notebooks/06_prefill_engine.ipynb (every lesson).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core.attention import attention_ref, block_diag_mask, plain_attention
from ..core.batch import seq_lens_to_cu_seqlens, unpack
from ..core.config import ModelConfig
from ..core.groups import LocalGroup
from ..core.linear import QKVParallelLinear
from ..core.model import Transformer
from ..measure.flops import attention_cells, executed_tokens, forward_flops, linear_intensity
from ..serve.engine import batch_stats
from ..serve.scheduler import plan_batches
from ..tp.dryrun import record_trace
from .probe import row_dependency

Tensor = torch.Tensor
_NOT_YET = object()


class _Wrong(AssertionError):
    pass


def _call(name: str, fn: Callable, *args) -> Any:
    """Run the reader's function; a stub's NotImplementedError becomes the _NOT_YET marker."""
    if not callable(fn):
        raise _Wrong(f"{name}: expected a function, got {type(fn).__name__}")
    try:
        return fn(*args)
    except NotImplementedError:
        return _NOT_YET
    except Exception as exc:
        raise _Wrong(f"{name}: your function raised {type(exc).__name__}: {exc}\n  input: {_show(args)}") from exc


def _show(args) -> str:
    def one(a):
        if isinstance(a, Tensor):
            return f"tensor{list(a.shape)}" if a.numel() > 8 else f"tensor({a.tolist()})"
        if isinstance(a, ModelConfig):
            return (f"ModelConfig(n_layers={a.n_layers}, d_model={a.d_model}, n_heads={a.n_heads}, "
                    f"d_head={a.d_head}, d_ffn={a.d_ffn})")
        return repr(a)
    return ", ".join(one(a) for a in args)


def _grade(name: str, fn: Callable, cases: list[tuple], judge: Callable[..., str | None], done: str) -> bool:
    """Call ``fn(*case)`` for each case; ``judge(got, *case)`` returns None or what is wrong."""
    for case in cases:
        got = _call(name, fn, *case)
        if got is _NOT_YET:
            print(f"… {name}: not attempted yet - replace `raise NotImplementedError` with your code, then run the cell again")
            return False
        problem = judge(got, *case)
        if problem:
            raise _Wrong(f"{name}: wrong answer for input {_show(case)}\n  {problem}")
    print(f"✓ {name}: {done}")
    return True


def _close(got, want: Tensor, atol: float, rtol: float = 0.0) -> str | None:
    if not isinstance(got, Tensor):
        return f"expected a tensor of shape {list(want.shape)}, got {type(got).__name__}"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if not got.is_floating_point():
        return f"dtype {got.dtype}, expected a floating tensor"
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if not torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol):
        return f"values differ from the reference by up to {diff:.3g} (tolerance {atol:g})"
    return None


def _int_tuple(got, names: str):
    """The reader's tuple as ints, or a message when it is not a tuple of len(names.split(", ")) numbers."""
    n = len(names.split(", "))
    if not isinstance(got, (tuple, list)) or len(got) != n or not all(isinstance(v, (int, float)) for v in got):
        return None, f"expected a tuple ({names}), got {got!r}"
    return tuple(int(v) for v in got), None


def _matches(got, want: Tensor, atol: float) -> bool:
    return isinstance(got, Tensor) and tuple(got.shape) == tuple(want.shape) and bool(
        torch.allclose(got.double(), want.double(), atol=atol))


# ---------------------------------------------------------------------------------------------
# Lesson 01: flat batches.

_LENS_CASES = [[10, 30], [5], [1, 1, 1], [7, 1, 12, 3], [30, 10]]


def check_cu_seqlens(fn: Callable[[list], list]) -> bool:
    """Exercise 01.1: ``fn(seq_lens) -> cu_seqlens`` as a list of ints (``[10, 30] -> [0, 10, 40]``)."""
    def judge(got, lens):
        want = seq_lens_to_cu_seqlens(lens).tolist()
        if isinstance(got, Tensor):
            got = got.tolist()
        if not isinstance(got, (list, tuple)):
            return f"expected a list of ints, got {type(got).__name__}"
        got = list(got)
        if got == want:
            return None
        hint = ""
        if len(got) == len(lens):
            hint = " - cu_seqlens has R + 1 entries: it starts with 0"
        elif got == [0] + list(lens):
            hint = " - it is cumulative: each entry adds the next length to the previous entry"
        elif got and got[-1] != sum(lens):
            hint = f" - the last entry must be the total token count {sum(lens)}"
        return f"got {got}, expected {want}{hint}"
    return _grade("cu_seqlens", fn, [(list(c),) for c in _LENS_CASES], judge,
                  "cu_seqlens = [0, L0, L0+L1, ...] on 5 batches")


def check_padding_rows(fn: Callable[[list], tuple]) -> bool:
    """Exercise 01.2: ``fn(seq_lens) -> (padded_rows, useful_rows)`` of the padded layout (C2)."""
    def judge(got, lens):
        want = (executed_tokens(lens, "padded"), executed_tokens(lens, "varlen"))
        got, problem = _int_tuple(got, "padded_rows, useful_rows")
        if problem or got == want:
            return problem
            return None
        hint = ""
        if got[0] == max(lens) * max(lens):
            hint = " - padded rows are R x Lmax (every request is padded to the longest)"
        elif got[0] == sum(lens):
            hint = " - that is the flat row count; padding adds Lmax - L_i rows to each request"
        elif got[0] == want[0] - want[1]:
            hint = " - that is the pad-row count; the first number is all rows the padded batch computes"
        return f"got {got}, expected {want}{hint}"
    return _grade("padding_rows", fn, [(list(c),) for c in _LENS_CASES], judge,
                  "padded rows R x Lmax and useful rows sum(L) on 5 batches")


def check_split_flat(fn: Callable[[Tensor, Tensor], list]) -> bool:
    """Exercise 01.3: ``fn(x [T, d], cu_seqlens) -> list of [L_i, d]`` (unpack by hand)."""
    def judge(got, x, cu):
        want = unpack(x, cu)
        if not isinstance(got, (list, tuple)):
            return f"expected a list of tensors, got {type(got).__name__}"
        if len(got) != len(want):
            return f"got {len(got)} pieces, expected {len(want)} (one per request, len(cu_seqlens) - 1)"
        for i, (g, w) in enumerate(zip(got, want)):
            if not isinstance(g, Tensor) or tuple(g.shape) != tuple(w.shape):
                shape = list(g.shape) if isinstance(g, Tensor) else type(g).__name__
                return (f"request {i} has shape {shape}, expected {list(w.shape)} - request i owns rows "
                        f"cu_seqlens[i] .. cu_seqlens[i+1] - 1 (the end is exclusive)")
            if not torch.equal(g, w):
                return f"request {i} holds the wrong rows - slice x[cu_seqlens[i]:cu_seqlens[i+1]]"
        return None
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randn(sum(c), 4, generator=g), seq_lens_to_cu_seqlens(c)) for c in _LENS_CASES]
    return _grade("split_flat", fn, cases, judge, "flat rows split back into requests on 5 batches")


# ---------------------------------------------------------------------------------------------
# Lesson 02: linear layers are per token.

def check_layer_norm_rows(fn: Callable[[Tensor, Tensor, Tensor, float], Tensor]) -> bool:
    """Exercise 02.1: LayerNorm by hand, ``fn(x [T, d], weight [d], bias [d], eps) -> [T, d]``."""
    g = torch.Generator().manual_seed(2)
    cases = []
    for t, d in ((40, 16), (7, 32), (1, 8)):
        cases.append((torch.randn(t, d, generator=g) * 3 + 1, torch.randn(d, generator=g) + 1,
                      torch.randn(d, generator=g), 1e-5))

    def judge(got, x, w, b, eps):
        want = F.layer_norm(x, (x.shape[1],), w, b, eps)
        problem = _close(got, want, atol=1e-4)
        if problem is None:
            return None
        if x.shape[0] > 1 and _matches(got, w * (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + eps) + b, 1e-4):
            return problem + " - you normalised each FEATURE over the tokens (dim 0): that mixes requests; use dim=-1"
        if _matches(got, w * (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True, unbiased=True) + eps) + b, 1e-4):
            return problem + " - LayerNorm uses the biased variance (divide by d, not d - 1)"
        if _matches(got, (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + eps), 1e-4):
            return problem + " - apply the weight (scale) and bias after normalising"
        return problem

    ok = _grade("layer_norm_rows", fn, cases, judge, "matches F.layer_norm on 3 inputs")
    if ok:
        dep = row_dependency(lambda x: fn(x, cases[0][1], cases[0][2], 1e-5), cases[0][0])
        if not torch.equal(dep, torch.eye(dep.shape[0], dtype=torch.bool)):
            raise _Wrong("layer_norm_rows: values match, but an output row changes when ANOTHER row changes "
                         "- compute the statistics of each row from that row only")
    return ok


def check_qkv_width(fn: Callable[[int, int, int], int]) -> bool:
    """Exercise 02.2: ``fn(n_heads, d_head, tp_size) -> int``, the QKV output width on one rank (C6)."""
    cases = [(8, 64, 2), (8, 64, 1), (8, 64, 4), (12, 64, 3), (16, 128, 8)]

    def judge(got, h, d, tp):
        layer = QKVParallelLinear(64, h, d, bias=False, group=LocalGroup(0, tp))
        want = layer.weight.shape[0]  # the shard the library really allocates
        if got == want:
            return None
        hint = ""
        if got == h * d // tp:
            hint = " - that is Q alone; the fused projection holds Q, K and V"
        elif got == 3 * h * d:
            hint = " - that is the full width; each rank keeps only its H / tp heads"
        return f"got {got!r}, expected {want}{hint}"
    return _grade("qkv_width", fn, cases, judge, "per-rank QKV width 3 x (H / tp) x d_head on 5 layouts")


def check_row_parallel_combine(fn: Callable[[list, Tensor], Tensor]) -> bool:
    """Exercise 02.3: ``fn(partials, bias) -> [T, d_out]``: finish a row-parallel linear layer
    from the ranks' partial outputs (what the all-reduce and the bias add do)."""
    g = torch.Generator().manual_seed(3)
    cases, wants = [], {}
    for t, d_in, d_out, tp in ((40, 16, 8, 2), (5, 12, 6, 3), (3, 8, 4, 1)):
        x, w, b = torch.randn(t, d_in, generator=g), torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g)
        n = d_in // tp
        partials = [x[:, r * n:(r + 1) * n] @ w[:, r * n:(r + 1) * n].T for r in range(tp)]  # [T, d_out] each
        cases.append((partials, b))
        wants[id(partials)] = F.linear(x, w, b)  # the unsharded layer: the truth to match

    def judge(got, partials, b):
        want = wants[id(partials)]
        problem = _close(got, want, atol=1e-4)
        if problem is None:
            return None
        tp = len(partials)
        if tp > 1 and _matches(got, want + (tp - 1) * b, 1e-4):
            return problem + f" - the bias was added {tp} times: add it once, after the sum"
        if _matches(got, want - b, 1e-4):
            return problem + " - add the bias once after summing the partials"
        return problem + " - the full output is the SUM of the partials (an all-reduce), plus the bias once"
    return _grade("row_parallel_combine", fn, cases, judge, "sum of partials + bias once, for tp = 2, 3, 1")


# ---------------------------------------------------------------------------------------------
# Lesson 03: masked vs varlen attention.

def _qkv_cases(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for lens, h, d in (([10, 30], 2, 8), ([3, 1, 5], 1, 4), ([6], 2, 4)):
        t = sum(lens)
        q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
        out.append((q, k, v, seq_lens_to_cu_seqlens(lens)))
    return out


def check_causal_varlen(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> bool:
    """Exercise 03.1: ``fn(q, k, v, cu_seqlens) -> [T, H, D]``, the article's loop with a causal
    mask inside each request's block (query i sees keys 0..i of its own request)."""
    def judge(got, q, k, v, cu):
        want = attention_ref(q, k, v, cu, causal=True)
        problem = _close(got, want, atol=1e-5)
        if problem is None:
            return None
        if _matches(got, attention_ref(q, k, v, cu, causal=False), 1e-5):
            return problem + " - no causal mask: set scores above the diagonal of each block to -inf"
        if _matches(got, plain_attention(q, k, v, causal=True), 1e-5):
            return problem + " - queries read other requests' keys: slice q, k, v with cu_seqlens"
        if _matches(got, attention_ref(q, k, v, cu, causal=True, softmax_scale=1.0), 1e-5):
            return problem + " - scale the scores by 1 / sqrt(d_head) before the softmax"
        return problem
    return _grade("causal_varlen", fn, _qkv_cases(4), judge, "equals the padded fp32 reference on 3 batches")


def check_masked_cells(fn: Callable[[list], tuple]) -> bool:
    """Exercise 03.2: ``fn(seq_lens) -> (computed, useful, wasted)`` of MASKED attention (C8)."""
    def judge(got, lens):
        c = attention_cells(lens, "masked")
        want = (c.computed, c.useful, c.wasted)
        got, problem = _int_tuple(got, "computed, useful, wasted")
        if problem or got == want:
            return problem
            return None
        hint = ""
        if got[1] == sum(n * (n + 1) // 2 for n in lens):
            hint = " - count whole diagonal blocks (the article's convention): useful = sum of L_i^2"
        elif got[0] == sum(n * n for n in lens):
            hint = " - masked attention computes the whole T x T matrix before masking"
        return f"got {got}, expected {want}{hint}"
    return _grade("masked_cells", fn, [(list(c),) for c in _LENS_CASES], judge,
                  "computed T^2, useful sum L_i^2, wasted the rest, on 5 batches")


def check_doc_mask(fn: Callable[[Tensor], Tensor]) -> bool:
    """Exercise 03.3: ``fn(cu_seqlens) -> bool [T, T]``, True where query row and key row belong to
    the same request (the non-causal block-diagonal mask)."""
    def judge(got, cu):
        want = block_diag_mask(cu, causal=False)
        if not isinstance(got, Tensor):
            return f"expected a bool tensor, got {type(got).__name__}"
        if tuple(got.shape) != tuple(want.shape):
            return f"shape {list(got.shape)}, expected {list(want.shape)} (T x T, T = cu_seqlens[-1])"
        if got.dtype != torch.bool:
            return f"dtype {got.dtype}, expected torch.bool"
        if torch.equal(got, want):
            return None
        if torch.equal(got, ~want):
            return "the mask is inverted: True means 'may attend' (same request)"
        wrong = (got != want).nonzero()[0].tolist()
        return f"{int((got != want).sum())} cells differ, e.g. [query {wrong[0]}, key {wrong[1]}]"
    cases = [(seq_lens_to_cu_seqlens(c),) for c in _LENS_CASES]
    return _grade("doc_mask", fn, cases, judge, "block-diagonal mask equals block_diag_mask on 5 batches")


# ---------------------------------------------------------------------------------------------
# Lesson 05: FLOP regimes.

_CFGS = [ModelConfig(), ModelConfig(n_layers=2, d_model=256, n_heads=4, d_head=32, d_ffn=1024, tp_size=1)]


def check_attention_flops(fn: Callable[[ModelConfig, list], int]) -> bool:
    """Exercise 05.1: ``fn(cfg, seq_lens) -> int``, attention FLOPs of one whole varlen forward
    (non-causal whole blocks, ``QK^T`` and ``PV``)."""
    cases = [(cfg, lens) for cfg in _CFGS for lens in ([1000], [100] * 10, [10, 30], [7, 1, 12])]

    def judge(got, cfg, lens):
        want = forward_flops(cfg, lens, "varlen").attention
        if got == want:
            return None
        if not isinstance(got, (int, float)) or got == 0:
            return f"got {got!r}, expected {want}"
        ratio = want / got
        if len(lens) > 1 and got == sum(lens) ** 2 * cfg.n_layers * cfg.n_heads * 4 * cfg.d_head:
            return f"got {got}, expected {want} - that counts the whole T x T matrix (masked); varlen computes sum L_i^2"
        factors = [(cfg.n_layers, "n_layers"), (cfg.n_heads, "n_heads"), (cfg.n_layers * cfg.n_heads, "n_layers x n_heads"),
                   (2, "2: there are two matmuls, QK^T and PV"),
                   (4, "4: each cell costs 4 x d_head FLOPs, 2 in QK^T and 2 in PV")]
        hint = " or ".join(text for value, text in factors if math.isclose(ratio, value))
        return f"got {got}, expected {want}" + (f" - off by a factor {ratio:g}: missing {hint}?" if hint else "")
    return _grade("attention_flops", fn, cases, judge, "n_layers x n_heads x sum(L_i^2) x 4 x d_head on 8 cases")


def check_crossover(fn: Callable[[ModelConfig], int]) -> bool:
    """Exercise 05.2: ``fn(cfg) -> int``, the smallest single-request length L whose attention
    FLOPs (non-causal) reach the linear FLOPs."""
    def judge(got, cfg):
        want = _crossover(cfg)
        if got == want:
            return None
        if isinstance(got, (int, float)) and abs(got - want) <= 1:
            return f"got {got}, expected {want} - off by one: find the SMALLEST L with attention >= linear"
        return f"got {got!r}, expected {want}"
    return _grade("crossover", fn, [(c,) for c in _CFGS], judge, "attention overtakes the linears at the right length")


def _crossover(cfg: ModelConfig) -> int:
    def attention_below(n: int) -> bool:
        f = forward_flops(cfg, [n])
        return f.attention < f.linear

    lo, hi = 1, 1
    while attention_below(hi):
        hi *= 2
    while lo < hi:  # smallest L with attention >= linear (both grow monotonically in L)
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if attention_below(mid) else (lo, mid)
    return lo


def check_linear_intensity(fn: Callable[[int, int, int, int], float]) -> bool:
    """Exercise 05.3: ``fn(tokens, d_in, d_out, bytes_per_element) -> float``: FLOP per byte of
    ``[T, d_in] @ [d_in, d_out]`` reading the weight once (C13)."""
    cases = [(1, 512, 2048, 2), (40, 512, 1536, 4), (1000, 512, 512, 4), (4096, 2048, 512, 2)]

    def judge(got, t, d_in, d_out, nbytes):
        want = linear_intensity(t, d_in, d_out, nbytes)
        if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-6):
            return None
        hint = ""
        if isinstance(got, (int, float)) and math.isclose(got, 2 * t * d_in * d_out / (nbytes * d_in * d_out), rel_tol=1e-6):
            hint = " - count the bytes of the activations too: the input [T, d_in] and the output [T, d_out]"
        return f"got {got!r}, expected {want:.4f}{hint}"
    return _grade("linear_intensity", fn, cases, judge, "FLOP / byte = 2 T d_in d_out / (bytes (weight + input + output))")


# ---------------------------------------------------------------------------------------------
# Lesson 00: the model of S1 and one request's all-reduces (C1).

_SMALL_CFGS = [ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=128),
               ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=77, max_position=40,
                           tp_size=3),
               ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=32, d_ffn=128, vocab_size=50, max_position=16)]


def _model_params(cfg: ModelConfig, tp_size: int = 1) -> int:
    """Parameters rank 0 really holds: built from the model's own classes (one-process stand-in group)."""
    model = Transformer(cfg, seed=0, group=LocalGroup(0, tp_size))
    return sum(p.numel() for p in model.parameters())


def check_param_count(fn: Callable[[ModelConfig], int]) -> bool:
    """Exercise 00.1: ``fn(cfg) -> int``, the parameters of the whole model (TP=1), LM head tied."""
    def judge(got, cfg):
        want = _model_params(cfg)
        if got == want:
            return None
        d, n = cfg.d_model, cfg.n_layers
        hints = {want + cfg.vocab_size * d: "the LM head is tied to the token embedding (logits = h @ wte^T): count it once",
                 want - cfg.max_position * d: "the learned position embedding wpe [max_position, d_model] is a parameter too",
                 want - cfg.vocab_size * d: "the token embedding wte [vocab_size, d_model] is a parameter too",
                 want - n * (3 * cfg.qkv_dim + d + cfg.d_ffn + d): "count the biases of the four linear layers",
                 want - (4 * n + 2) * d: "LayerNorms have a weight and a bias of d_model each: ln_1, ln_2 per layer, ln_f"}
        hint = hints.get(got, "")
        return f"got {got!r}, expected {want}" + (f" - {hint}" if hint else "")
    return _grade("param_count", fn, [(c,) for c in _SMALL_CFGS], judge, "matches the real model on 3 configs")


def check_rank_params(fn: Callable[[ModelConfig, int], int]) -> bool:
    """Exercise 00.2: ``fn(cfg, tp_size) -> int``, the parameters ONE rank holds under TP=tp_size."""
    cases = [(c, tp) for c in _SMALL_CFGS for tp in (1, 2, 3) if c.n_heads % tp == 0 and c.d_ffn % tp == 0]

    def judge(got, cfg, tp):
        want = _model_params(cfg, tp)
        if got == want:
            return None
        total = _model_params(cfg)
        replicated = total - (total - want) * tp // (tp - 1) if tp > 1 else 0
        hint = ""
        if tp > 1 and isinstance(got, (int, float)) and got * tp == total:
            hint = " - not everything is split: embeddings, LayerNorms and the row-parallel biases are whole on every rank"
        elif tp > 1 and got == want - replicated:
            hint = " - add the replicated parameters (embeddings, LayerNorms, row-parallel biases) that every rank keeps"
        elif tp > 1 and got == want - 2 * cfg.n_layers * cfg.d_model * (tp - 1) // tp:
            hint = (" - the biases of out proj and FFN-down are not split: each rank keeps the whole [d_model] bias "
                    "and adds it once, after the all-reduce")
        return f"got {got!r}, expected {want} for tp_size={tp}{hint}"
    return _grade("rank_params", fn, cases, judge, f"matches each rank's real shard on {len(cases)} layouts")


def check_all_reduce_bytes(fn: Callable[[ModelConfig, int], tuple]) -> bool:
    """Exercise 00.3: ``fn(cfg, num_tokens) -> (count, bytes_each)``: the all-reduces one rank makes
    in one TP=2 forward of a single request, and the bytes of each (in ``cfg.dtype``) (C1)."""
    cases = [(_SMALL_CFGS[0], 10), (_SMALL_CFGS[0], 111), (ModelConfig(n_layers=3, d_model=64, n_heads=4,
             d_head=16, d_ffn=128, vocab_size=50, max_position=64, dtype=torch.bfloat16), 7)]

    def judge(got, cfg, n):
        trace = record_trace(cfg, [n], 0, 2)  # the model's own code on a recording stand-in for rank 0
        want = (len(trace), trace[0].bytes)
        got, problem = _int_tuple(got, "count, bytes_each")
        if problem or got == want:
            return problem
        size = torch.empty((), dtype=cfg.dtype).element_size()
        hint = ""
        if got[0] == cfg.n_layers:
            hint = " - two per layer: after the attention out proj and after FFN-down"
        elif got[1] == n * cfg.d_ffn * size or got[1] == n * cfg.d_ffn * size // 2:
            hint = " - the all-reduce carries the row-parallel layer's OUTPUT, [N, d_model], not its input"
        elif got[1] * 2 == want[1]:
            hint = " - each rank all-reduces a full [N, d_model] partial sum, not half of it"
        elif got[1] == n * cfg.d_model:
            hint = f" - bytes, not elements: {cfg.dtype} has {size} bytes per element"
        return f"got {got}, expected {want}{hint}"
    return _grade("all_reduce_bytes", fn, cases, judge, "2 x n_layers all-reduces of N x d_model x itemsize bytes, on 3 cases")


# ---------------------------------------------------------------------------------------------
# Lesson 04: TP=2 invariance (C11, C12).

def check_rank_attention(fn: Callable[..., Tensor]) -> bool:
    """Exercise 04.1: ``fn(q, k, v, cu_seqlens, rank, world_size) -> [T, H / world_size, D]``: causal
    varlen attention for the heads rank ``rank`` owns, from the full ``[T, H, D]`` q, k, v (C11)."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for lens, h, d, rank, tp in (([10, 30], 8, 8, 1, 2), ([3, 1, 5], 4, 4, 0, 2), ([6, 2], 6, 4, 2, 3), ([5], 2, 4, 0, 1)):
        q, k, v = (torch.randn(sum(lens), h, d, generator=g) for _ in range(3))
        cases.append((q, k, v, seq_lens_to_cu_seqlens(lens), rank, tp))

    def judge(got, q, k, v, cu, rank, tp):
        hl = q.shape[1] // tp
        full = attention_ref(q, k, v, cu, causal=True)                  # [T, H, D]
        want = full[:, rank * hl:(rank + 1) * hl]
        problem = _close(got, want, atol=1e-5)
        if problem is None:
            return None
        if _matches(got, full, 1e-5) and tp > 1:
            return problem + " - that is every head; keep only this rank's H / world_size heads"
        if tp > 1 and _matches(got, full[:, rank::tp], 1e-5):
            return problem + f" - rank r owns a contiguous block of heads, [r*H/tp, (r+1)*H/tp), not every {tp}-th head"
        sl = slice(rank * hl, (rank + 1) * hl)
        if _matches(got, plain_attention(q[:, sl], k[:, sl], v[:, sl], causal=True), 1e-5):
            return problem + " - the requests read each other: slice each request with cu_seqlens"
        if _matches(got, attention_ref(q[:, sl], k[:, sl], v[:, sl], cu, causal=False), 1e-5):
            return problem + " - the model is causal: a query reads only the keys at or before it in its request"
        return problem
    return _grade("rank_attention", fn, cases, judge, "each rank's heads, varlen and causal, on 4 layouts")


def _trace_pairs(got) -> list | None:
    try:
        return [(str(name), tuple(int(s) for s in shape)) for name, shape in got]
    except (TypeError, ValueError):
        return None


def check_trace_prediction(fn: Callable[[ModelConfig, list], list]) -> bool:
    """Exercise 04.2: ``fn(cfg, seq_lens) -> [(layer, shape), ...]``, the all-reduces rank 0 makes in
    one TP=2 forward of a flat batch of ``seq_lens`` (C12), in order, e.g.
    ``("layers.0.attn.out_proj", (40, 512))``."""
    cfg_a = _SMALL_CFGS[0]
    cfg_b = ModelConfig(n_layers=3, d_model=48, n_heads=6, d_head=8, d_ffn=96, vocab_size=77, max_position=40)
    cases = [(cfg_a, [10, 30]), (cfg_a, [40]), (cfg_a, [1] * 40), (cfg_b, [3, 1, 5]), (cfg_b, [9])]

    def judge(got, cfg, lens):
        want = [(r.layer, tuple(r.shape)) for r in record_trace(cfg, lens, 0, 2)]
        pairs = _trace_pairs(got)
        if pairs is None:
            return f"expected a list of (layer name, shape) pairs, got {got!r}"[:300]
        if pairs == want:
            return None
        t, d = sum(lens), cfg.d_model
        if len(pairs) == cfg.n_layers:
            return f"got {len(pairs)} all-reduces, expected {len(want)} - two per layer: attn.out_proj, then mlp.fc_down"
        if len(pairs) == len(want) * len(lens) and len(lens) > 1:
            return (f"got {len(pairs)} all-reduces, expected {len(want)} - TP does not loop over requests: one "
                    f"all-reduce carries the whole flat batch")
        if len(pairs) != len(want):
            return f"got {len(pairs)} all-reduces, expected {len(want)}"
        shapes = {s for _, s in pairs}
        if shapes == {(max(lens), d)} and len(lens) > 1:
            return f"shape {(max(lens), d)}, expected {(t, d)} - the payload is every flat token, T = sum(seq_lens) = {t}"
        if shapes != {(t, d)}:
            return f"shapes {sorted(shapes)}, expected {(t, d)} - the row-parallel layers' output, [T, d_model]"
        first = next(i for i, (a, b) in enumerate(zip(pairs, want)) if a != b)
        return (f"record {first} is {pairs[first]}, expected {want[first]} - forward order: layers.0.attn.out_proj, "
                f"layers.0.mlp.fc_down, layers.1.attn.out_proj, ...")
    return _grade("trace_prediction", fn, cases, judge, "the real model's trace, for 1, 2, 3 and 40 requests")


# ---------------------------------------------------------------------------------------------
# Lesson 06: the prefill engine (S3).

def check_fcfs_schedule(fn: Callable[[list, int], list]) -> bool:
    """Exercise 06.1: ``fn(seq_lens, max_num_batched_tokens) -> [[request index, ...], ...]``: FCFS
    batches of whole requests within the token budget (what ``engine.Scheduler`` does). A request
    longer than the budget must raise ``ValueError`` (S3: no chunked prefill)."""
    cases = [([10, 30], 64), ([300, 300, 500, 100], 700), ([5] * 9, 12), ([64, 1, 64, 1, 64], 65), ([7], 7)]

    def judge(got, lens, budget):
        want = plan_batches(lens, budget, max_num_seqs=1 << 20)   # engine.Scheduler's batches
        try:
            got = [[int(i) for i in b] for b in got]
        except (TypeError, ValueError):
            return f"expected a list of batches (lists of request indices), got {got!r}"
        if got == want:
            return None
        flat = [i for b in got for i in b]
        if sorted(flat) != list(range(len(lens))):
            return f"got {got}, expected {want} - every request must be served exactly once"
        for b in got:
            if sum(lens[i] for i in b) > budget:
                return f"got {got}, expected {want} - batch {b} holds {sum(lens[i] for i in b)} tokens > budget {budget}"
        if flat != sorted(flat):
            return (f"got {got}, expected {want} - first come, first served: a later request never overtakes a "
                    "waiting one, even when it would fill the hole")
        return f"got {got}, expected {want} - close a batch only when the next request does not fit"
    ok = _grade("fcfs_schedule", fn, [(list(lens), b) for lens, b in cases], judge,
                "FCFS batches within the budget on 5 streams")
    if not ok:
        return ok
    lens, budget = [100, 900, 50], 512
    try:
        got = fn(list(lens), budget)
    except ValueError:
        return ok
    except Exception as exc:
        raise _Wrong(f"fcfs_schedule: for {lens} with budget {budget} raise ValueError, not {type(exc).__name__}: {exc}") \
            from exc
    raise _Wrong(f"fcfs_schedule: for {lens} with budget {budget} you returned {got!r} - request 1 has 900 tokens, "
                 "more than the budget: it can never run whole (S3), so raise ValueError")


def check_stream_waste(fn: Callable[[list], tuple]) -> bool:
    """Exercise 06.2: ``fn(batches) -> (pad_rows, masked_wasted_cells)`` summed over a stream;
    ``batches`` is a list of batches, each a list of request lengths. Cells per head per layer,
    whole blocks (the article's count)."""
    cases = [[[10, 30]], [[10, 30], [40], [5, 5, 20]], [[1, 7, 3], [64, 2], [16] * 4], [[100], [3, 300, 30]]]
    cfg = _SMALL_CFGS[0]

    def judge(got, batches):
        pad = sum(batch_stats(cfg, b, "padded").padding_rows for b in batches)
        masked = sum(batch_stats(cfg, b, "masked").masked_cells for b in batches)
        want = (pad, masked)
        got, problem = _int_tuple(got, "pad_rows, masked_wasted_cells")
        if problem or got == want:
            return problem
        lens = [n for b in batches for n in b]
        hint = ""
        if len(batches) > 1 and got[0] == len(lens) * max(lens) - sum(lens):
            hint = " - each batch pads to its OWN longest request, not the stream's"
        elif len(batches) > 1 and got[1] == sum(lens) ** 2 - sum(n * n for n in lens):
            hint = " - masking is per batch: only requests in the same batch share a score matrix"
        elif got[1] == masked // 2:
            hint = " - count both off-diagonal blocks, A's queries on B's keys and B's on A's"
        return f"got {got}, expected {want}{hint}"
    return _grade("stream_waste", fn, [(c,) for c in cases], judge, "pad rows and masked cells summed batch by batch, 4 streams")
