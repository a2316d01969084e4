"""What padding costs, and what a flat batch's boundaries carry.

Padding's waste: ``padding_waste`` (one request of ``n`` tokens padded to ``pad_to``, in FLOPs, counting whole
blocks, causal triangles, or the whole tiles a tiled causal kernel executes, ``ops.tiling.predict_work``),
``waste_crossover`` (the shortest such request whose attention waste passes its pad rows'; ``waste_wins``, every
one), ``pad_rows`` and
``fewest_pad_rows`` (a padding server's best grouping, by brute force), ``record_flat_and_padded`` (what the
``OpRecorder`` sees a model execute for the same requests flat and padded).

Boundaries: ``broken_pack`` (a packer that moves one boundary of ``cu_seqlens`` one row and numbers positions
from it), ``wrong_requests`` (which requests it changes, cut at the true boundaries) and ``sampled_rows`` (what a
server trusting it samples).

Taught in notebooks/01_flat_batch.ipynb.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.batch import PackedBatch, cumulative, pack, pad, unpack
from ..core.config import ModelConfig
from ..ops.tiling import predict_work
from ..validate import check_int, check_lengths
from .flops import flops_of, forward_flops
from .profile import cpu_threads
from .recorder import OpRecorder
from .search import first_where
from .tolerance import each_alone, float64_twin, max_abs_diff


def _tile_cells(n: int, block: int) -> int:
    """Score cells per head per layer of the ``block x block`` tiles a causal tiled kernel executes for one request
    of ``n`` tokens (``predict_work``)."""
    return predict_work([n], block_m=block, block_n=block, causal=True).executed_cells


def padding_waste(cfg: ModelConfig, pad_to: int, n: int, causal: bool = False,
                  block: int | None = None) -> dict[str, int]:
    """What padding one request of ``n`` tokens to ``pad_to`` wastes in one forward of ``cfg``, in FLOPs (all
    layers, all heads): {"linear": the pad rows through the linear layers, "attention": the padded request's
    score cells minus its own}. Attention counts whole ``S x S`` blocks (as the padded forward computes them),
    with ``causal`` the lower triangles, with ``block`` the whole ``block x block`` tiles of a causal tiled
    kernel (``predict_work``)."""
    s, n = check_int("pad_to", pad_to, 1), check_int("n", n, 1)
    if n > s:
        raise ValueError(f"n must be <= pad_to, got n={n}, pad_to={s}")
    if block is None:
        big, small = forward_flops(cfg, [s], causal=causal), forward_flops(cfg, [n], causal=causal)
        return {"linear": big.linear - small.linear, "attention": big.attention - small.attention}
    cells = _tile_cells(s, block) - _tile_cells(n, block)
    return {"linear": flops_of(cfg, s - n, 0).linear, "attention": flops_of(cfg, 0, cells).attention}


def waste_crossover(cfg: ModelConfig, pad_to: int, causal: bool = False, block: int | None = None) -> int | None:
    """The shortest request (1 <= n < pad_to) whose padding to ``pad_to`` wastes more FLOPs in attention than in
    its pad rows (``padding_waste`` with the same ``causal`` / ``block``), or None if none does.

    Whole blocks and triangles: once one n wins, every longer one does (bisection). Whole tiles (``block``): not
    so, a request in ``pad_to``'s last row of tiles executes the same tiles padded or not (no attention waste),
    so every n is tried (``waste_wins`` lists them all)."""
    if block is not None:
        return next(iter(waste_wins(cfg, pad_to, block=block)), None)
    return first_where(lambda n: _attention_wins(cfg, pad_to, n, causal, None), 1, pad_to - 1) if pad_to >= 2 else None


def _attention_wins(cfg: ModelConfig, pad_to: int, n: int, causal: bool, block: int | None) -> bool:
    w = padding_waste(cfg, pad_to, n, causal, block)
    return w["attention"] > w["linear"]


def waste_wins(cfg: ModelConfig, pad_to: int, causal: bool = False, block: int | None = None) -> list[int]:
    """Every request length n (1 <= n < pad_to) whose padding to ``pad_to`` wastes more FLOPs in attention than
    in its pad rows (``padding_waste``), in increasing order; tries each n (O(pad_to) calls)."""
    s = check_int("pad_to", pad_to, 1)
    if block is None:
        return [n for n in range(1, s) if _attention_wins(cfg, s, n, causal, None)]
    big = _tile_cells(s, block)  # the padded request's tiles, counted once
    return [n for n in range(1, s)
            if flops_of(cfg, 0, big - _tile_cells(n, block)).attention > flops_of(cfg, s - n, 0).linear]


def pad_rows(lens: Sequence[int]) -> int:
    """Pad rows of one padded batch of these request lengths: ``R · Lmax − Σ L``."""
    lens = check_lengths(lens)
    return len(lens) * max(lens, default=0) - sum(lens)


def fewest_pad_rows(seq_lens: Sequence[int], max_num_seqs: int) -> tuple[int, tuple]:
    """Brute force over every labelling of the requests with ``ceil(R / max_num_seqs)`` groups (each of 1 ..
    ``max_num_seqs`` requests), each group padded to its own longest: the fewest pad rows, and one best split
    (tuples of request indices). Exponential in R: for a handful of requests."""
    lens = check_lengths(seq_lens)
    cap = check_int("max_num_seqs", max_num_seqs, 1)
    n = math.ceil(len(lens) / cap)
    splits = (tuple(tuple(i for i, g in enumerate(labels) if g == group) for group in range(n))
              for labels in itertools.product(range(n), repeat=len(lens)))
    return min((sum(pad_rows([lens[i] for i in g]) for g in split), split)
               for split in splits if all(1 <= len(g) <= cap for g in split))


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def record_flat_and_padded(model, requests: Sequence[Tensor], pad_to: int | None = None,
                           side: str = "right") -> dict:
    """Run ``requests`` (token ids ``[L_i]``, int64, on ``model``'s device) through ``model`` flat (``pack``,
    ``forward``) and padded (``pad``, ``forward_padded``) under the ``OpRecorder``, on one CPU thread.

    Keys, each {"padded", "flat"} unless said: ``out`` (each request's real output rows), ``rows`` (rows of
    every linear layer), ``cells`` (score cells per head per layer), ``largest`` (the largest score matrix's
    shape), ``flops`` ({"linear", "attention"}, as recorded), ``input_bytes``, ``hidden_bytes``; ``waste``
    (padded − flat FLOPs, {"linear", "attention"}); ``batch`` (the PackedBatch); ``padded_shape`` ``[R, S]``.
    """
    cfg = model.cfg
    ids, mask = pad(requests, pad_to=pad_to, side=side)
    batch = pack(requests)
    with cpu_threads(1):
        with OpRecorder() as flat:
            out_flat = model.forward(batch)
        with OpRecorder() as padded:
            out_pad = model.forward_padded(ids, mask)
    recs, per_head_layer = {"padded": padded, "flat": flat}, cfg.n_heads * cfg.n_layers
    flops = {k: r.flops_by_kind for k, r in recs.items()}
    return {"batch": batch, "padded_shape": list(ids.shape),
            "out": {"flat": unpack(out_flat, batch.cu_seqlens), "padded": [out_pad[b][mask[b]] for b in range(len(mask))]},
            "rows": {k: r.linear_rows for k, r in recs.items()},
            "cells": {k: r.cells // per_head_layer for k, r in recs.items()},
            "largest": {k: max(r.scores, key=math.prod) for k, r in recs.items()},
            "flops": flops, "waste": {k: flops["padded"][k] - flops["flat"][k] for k in ("linear", "attention")},
            "input_bytes": {"padded": _nbytes(ids, mask), "flat": _nbytes(batch.input_ids, batch.positions, batch.cu_seqlens)},
            "hidden_bytes": {"padded": _nbytes(out_pad), "flat": _nbytes(out_flat)}}


# ---- a boundary one row off ------------------------------------------------------------------------------------

BOUNDARY_BUGS = ("late", "early")


def broken_pack(requests: Sequence, bug: str, k: int) -> PackedBatch:
    """What a packer that miscounts one boundary builds: the same flat tokens, boundary ``k`` one row
    ``bug`` ("late": request k's first token goes to request k-1; "early": k-1's last token goes to k),
    positions numbered from the wrong boundaries (the batch check passes); an emptied request stays, empty."""
    if bug not in BOUNDARY_BUGS:
        raise ValueError(f"bug must be one of {BOUNDARY_BUGS}, got {bug!r}")
    tensors = [torch.as_tensor(r) for r in requests]
    lens = check_lengths([len(t) for t in tensors])
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(lens) - 1:
        raise ValueError(f"k must be an inner boundary 1..{len(lens) - 1} of {len(lens)} requests, got {k!r}")
    moved = list(lens)
    step = 1 if bug == "late" else -1
    moved[k - 1] += step
    moved[k] -= step
    flat, cu = torch.cat(tensors), cumulative(moved)
    # pack the non-empty pieces; a request the bug emptied keeps its (repeated) boundary, as in FlashAttention
    pieces = pack([flat[cu[i]:cu[i + 1]] for i in range(len(moved)) if moved[i]])
    return dataclasses.replace(pieces, cu_seqlens=torch.tensor(cu, dtype=torch.int32), seq_lens=moved)


def _alone(model, twin, requests) -> list[tuple[Tensor, Tensor, float]]:
    with cpu_threads(1):
        return each_alone(model, requests, twin)


def wrong_requests(model, requests: Sequence[Tensor], bug: str, k: int,
                   twin=None) -> tuple[frozenset[int], tuple[float, ...]]:
    """Run ``broken_pack(requests, bug, k)`` through ``model`` (one CPU thread) and cut the output at the TRUE
    boundaries: the requests beyond the tolerance rule's bound of the request alone (``each_alone``, against
    ``twin``, default ``float64_twin(model)``), and each one's max |diff| from it."""
    twin = float64_twin(model) if twin is None else twin
    with cpu_threads(1):
        out = model.forward(broken_pack(requests, bug, k))
    alone = _alone(model, twin, requests)
    cu = torch.tensor(cumulative([len(r) for r in requests]), dtype=torch.int32)
    diffs = tuple(max_abs_diff(p, r64) for p, (_, r64, _) in zip(unpack(out, cu), alone))
    return frozenset(i for i, (d, (_, _, bound)) in enumerate(zip(diffs, alone)) if d > bound), diffs


def sampled_rows(model, requests: Sequence, bug: str, k: int) -> dict:
    """What a server trusting ``broken_pack(requests, bug, k)`` samples (requests: token ids ``[L_i]``, int64, on
    ``model``'s device): row ``last_token_indices[i]`` of ``model``'s output against the last row, run alone,
    of request i and of the request the moved boundary made of it (``moved``); bounds by the tolerance rule.

    Keys: ``cu_seqlens`` (the broken one, a list), ``rows`` (None for a request the bug emptied), ``diff`` /
    ``bound`` against request i, ``moved_diff`` / ``moved_bound`` against the moved request, ``wrong`` (the
    indices beyond their bound of request i, or with no row).
    """
    batch = broken_pack(requests, bug, k)
    tensors = [torch.as_tensor(r) for r in requests]
    cu = batch.cu_seqlens.tolist()
    moved = [torch.cat(tensors)[a:b] for a, b in zip(cu, cu[1:])]
    with cpu_threads(1):
        out = model.forward(batch)
    rows = [int(r) if b > a else None for r, a, b in zip(batch.last_token_indices.tolist(), cu, cu[1:])]
    twin, got = float64_twin(model), {"cu_seqlens": cu, "rows": rows}
    for key, reqs in (("", tensors), ("moved_", moved)):
        runs = iter(_alone(model, twin, [r for r in reqs if len(r)]))
        refs = [next(runs) if len(r) else None for r in reqs]  # a request the bug emptied has no row, no reference
        got[key + "diff"] = [None if r is None else max_abs_diff(out[r], ref[1][-1]) for r, ref in zip(rows, refs)]
        got[key + "bound"] = [None if ref is None else ref[2] for ref in refs]
    got["wrong"] = {i for i, (d, b) in enumerate(zip(got["diff"], got["bound"])) if d is None or d > b}
    return got
