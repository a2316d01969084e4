"""How a tiled varlen attention kernel cuts its work, predicted from the lengths alone (no Triton needed).

The kernel of ``ops.triton_varlen`` launches one program per (query tile, head, request): a grid of
``(⌈max_seqlen_q / BLOCK_M⌉, H, R)``. The grid is sized by the LONGEST request, so a program whose
query tile starts at or past its own request's end has nothing to do and returns at once. A
program that works walks its request's keys ``BLOCK_N`` at a time; with ``causal`` it stops at
the diagonal (bottom-right aligned: query row i sees keys ``j <= i + L_k - L_q``), so the key
tiles wholly above it are never computed.

With grouped-query attention (``n_kv_heads`` < ``n_heads``, G query heads per K/V head) the kernel
has two layouts: per head, as above; or packed (``pack_gqa``), a grid of
``(⌈max_seqlen_q · G / BLOCK_M⌉, H_kv, R)`` whose tiles hold (token, query head) rows, so each K/V tile
is loaded once for the group. Of the key tiles a program computes, those every row sees whole skip
the mask; the rest (the diagonal's, a last partial tile) are ``masked_tiles``.

``predict_work`` gives, for lengths and tile sizes, the numbers the kernel counts itself
(``triton_varlen.count_work``): the lesson asserts measured == predicted, so removing the early
return or moving the causal bound shows up as a difference.

Taught in notebooks/07_inside_the_kernel.ipynb.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from ..validate import check_int, check_lengths

FIELDS = ("programs", "early_exits", "tiles", "tiles_skipped", "cells", "masked_tiles")


@dataclass(slots=True)
class WorkCounts:
    """The work of one or more kernel launches, summed over programs.

    programs: programs launched (the grid's size, summed over launches).
    early_exits: programs whose query tile starts past their request's end (returned at once).
    tiles: ``[BLOCK_M × BLOCK_N]`` score tiles computed (one ``Q_tile @ K_tileᵀ`` each).
    tiles_skipped: key tiles of a working program's request that causal masking let it skip.
    cells: score cells of the computed tiles that lie inside the request's ``[L_q × L_k]`` block,
    the causally masked ones included (the tile's rows and columns past the request's end are not).
    With ``pack_gqa`` a row is a (token, query head) pair, so the block is ``[L_q · G × L_k]``.
    masked_tiles: computed tiles that took the masked path (the causal diagonal's, and a request's last
    partial key tile); the others are seen whole by every row and skip the mask. Not compared by ``==``
    (lesson 07's picture has no such column): compare ``as_dict()``.
    block_m, block_n: the tile sizes (``tiles · block_m · block_n`` cells were executed); not compared.

    Every computed score tile loads one K tile and one V tile, so ``tiles`` is also the count of K/V
    tile loads, and ``kv_bytes_read`` their bytes, in either GQA layout.
    """

    programs: int = 0
    early_exits: int = 0
    tiles: int = 0
    tiles_skipped: int = 0
    cells: int = 0
    masked_tiles: int = field(default=0, compare=False)
    block_m: int = field(default=0, compare=False)  # a launch-free call (no tokens) records no tile size
    block_n: int = field(default=0, compare=False)
    # per launch, per program (index m + grid_m · (h + H · r)): its key tiles, -1 if it returned at once;
    # filled by the kernel's count_work (program_key_tiles predicts one request's)
    program_tiles: tuple = field(default=(), compare=False, repr=False)

    @property
    def executed_cells(self) -> int:
        """Score cells the hardware computed: every cell of every computed tile."""
        return self.tiles * self.block_m * self.block_n

    def kv_bytes_read(self, d_head: int, nbytes: int = 2) -> int:
        """Bytes of K and V the computed tiles load: each key tile reads ``BLOCK_N`` keys and as many
        values of ``d_head`` elements, ``nbytes`` each (``tiles`` already sums over heads). A query tile
        re-reads its request's K/V, so for a long causal request this grows as ``L² · d / BLOCK_M``."""
        d, b = check_int("d_head", d_head, 1), check_int("nbytes", nbytes, 1)
        return self.tiles * self.block_n * d * 2 * b

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "program_tiles"}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_tiles(len_q: int, len_k: int, tile_start: int, block_m: int, block_n: int, causal: bool,
              group: int = 1) -> tuple[int, int]:
    """``(computed, skipped)`` key tiles for the query tile starting at row ``tile_start`` of a request.

    Causal: the tile's last real row ``r = min(tile_start + block_m, len_q) - 1`` sees keys up to
    ``r + len_k - len_q``, so keys ``[0, min(len_k, r + 1 + len_k - len_q))`` are read, whole tiles.
    ``group``: rows per token (``pack_gqa``'s G query heads per K/V head; row ``i`` is token ``i // G``):
    the tile then has ``len_q · G`` rows and its last row's token is ``r // G``.
    """
    total = cdiv(len_k, block_n)
    if not causal:
        return total, 0
    hi = min(len_k, cdiv(min(tile_start + block_m, len_q * group), group) + len_k - len_q)
    computed = cdiv(max(hi, 0), block_n)
    return computed, total - computed


def masked_key_tiles(len_q: int, len_k: int, tile_start: int, block_m: int, block_n: int, causal: bool,
                     group: int = 1) -> int:
    """How many of the tile's computed key tiles take the masked path.

    The kernel walks keys in two stages (Triton's fused-attention tutorial): the key tiles below
    ``lo`` are seen whole by EVERY row of the query tile, so they skip the mask; the rest (the causal
    diagonal, and a last key tile past which the request ends) are masked. ``lo`` is what the tile's
    first row sees, ``min(len_k, first_token + 1 + len_k - len_q)`` causally (``len_k`` if not),
    rounded down to whole key tiles.
    """
    computed, _ = key_tiles(len_q, len_k, tile_start, block_m, block_n, causal, group)
    lo = min(len_k, tile_start // group + 1 + len_k - len_q) if causal else len_k
    return max(0, computed - lo // block_n)


def predict_work(seqlens_q: Sequence[int], seqlens_k: Sequence[int] | None = None, n_heads: int = 1, *,
                 n_kv_heads: int | None = None, pack_gqa: bool | None = None, block_m: int = 64, block_n: int = 64,
                 causal: bool = True, max_seqlen_q: int | None = None) -> WorkCounts:
    """What one launch over requests of ``seqlens_q`` queries (and ``seqlens_k`` keys) computes.

    A pure function of the lengths, the heads, the layout, the tile sizes and ``causal``: the same
    numbers the kernel counts with atomics when run under ``count_work()``. ``max_seqlen_q`` sizes the
    grid (default: the longest request; a larger bound launches more programs that return at once).
    ``n_kv_heads`` (default ``n_heads``) K/V heads, each serving ``G = n_heads / n_kv_heads`` query heads;
    ``pack_gqa``: False, one program per (query tile, query head); True, one per (tile of ``block_m``
    (token, query head) rows, K/V head); None, ``choose_pack_gqa``'s pick (as the kernel's launcher).
    """
    lq = check_lengths(seqlens_q, minimum=0, name="seqlens_q")
    lk = lq if seqlens_k is None else check_lengths(seqlens_k, minimum=0, name="seqlens_k")
    if len(lk) != len(lq):
        raise ValueError(f"seqlens_q and seqlens_k must have one length per request, got {len(lq)} and {len(lk)}")
    h = check_int("n_heads", n_heads, 1)
    h_kv = h if n_kv_heads is None else check_int("n_kv_heads", n_kv_heads, 1)
    if h % h_kv:
        raise ValueError(f"n_heads must be a multiple of n_kv_heads, got n_heads={h}, n_kv_heads={h_kv}")
    bm, bn = check_int("block_m", block_m, 1), check_int("block_n", block_n, 1)
    longest = max(lq, default=0) if max_seqlen_q is None else check_int("max_seqlen_q", max_seqlen_q, 0)
    g = h // h_kv
    if pack_gqa is None:
        pack_gqa = choose_pack_gqa(longest, max(lk, default=0), g, bm, bn, causal)
    rows, heads = (g, h_kv) if pack_gqa else (1, h)   # rows per token; programs along the head axis
    grid_m = cdiv(longest * rows, bm)
    w = WorkCounts(programs=grid_m * heads * len(lq), block_m=bm, block_n=bn)
    for nq, nk in zip(lq, lk):
        for m, computed in enumerate(program_key_tiles(nq, nk, grid_m, bm, bn, causal, rows)):
            if computed < 0:
                w.early_exits += heads
                continue
            w.tiles += heads * computed
            w.tiles_skipped += heads * (cdiv(nk, bn) - computed)
            w.cells += heads * min(bm, nq * rows - m * bm) * min(computed * bn, nk)
            w.masked_tiles += heads * masked_key_tiles(nq, nk, m * bm, bm, bn, causal, rows)
    return w


def program_key_tiles(len_q: int, len_k: int, grid_m: int, block_m: int, block_n: int, causal: bool,
                      group: int = 1) -> list[int]:
    """One request's ``grid_m`` programs of one head, query tile by query tile: the key tiles each computes, -1 for
    one that returns at once (its tile starts at or past the request's ``len_q · group`` rows). What
    ``count_work``'s ``program_tiles`` holds for that request and head, predicted."""
    return [-1 if m * block_m >= len_q * group else key_tiles(len_q, len_k, m * block_m, block_m, block_n, causal, group)[0]
            for m in range(grid_m)]


@functools.lru_cache(maxsize=256)
def choose_pack_gqa(max_seqlen_q: int, max_seqlen_k: int, group: int, block_m: int, block_n: int, causal: bool) -> bool:
    """``pack_gqa=None``'s choice: pack the ``group`` query heads of each K/V head into one program's rows
    when that loads fewer K/V tiles (``predict_work``'s ``tiles``) for a request of ``max_seqlen_q``
    queries and ``max_seqlen_k`` keys. Packing never loads more; it loads fewer where a query tile
    would be mostly padding (short queries: decode, chunk tails) and, causally with ``block_m > block_n``,
    where its tiles of fewer tokens follow the diagonal closer. Equal (MHA, or tiles already full and non-causal): not packed, the
    grid keeps one program per query head. Cached: the launcher asks once per shape."""
    if group == 1 or max_seqlen_q == 0:
        return False
    lq, lk = [max_seqlen_q], [max(max_seqlen_k, max_seqlen_q) if causal else max_seqlen_k]
    tiles = [predict_work(lq, lk, group, n_kv_heads=1, pack_gqa=p, block_m=block_m, block_n=block_n,
                          causal=causal).tiles for p in (False, True)]
    return tiles[1] < tiles[0]


def launch_grid(max_seqlen_q: int, n_heads: int, num_seqs: int, block_m: int = 64) -> tuple[int, int, int]:
    """``(⌈max_seqlen_q / block_m⌉, H, R)``: the kernel's grid, one program per (query tile, head, request)
    (with ``pack_gqa``: ``launch_grid(max_seqlen_q · G, H_kv, R)``)."""
    return cdiv(check_int("max_seqlen_q", max_seqlen_q, 0), check_int("block_m", block_m, 1)), \
        check_int("n_heads", n_heads, 1), check_int("num_seqs", num_seqs, 0)


def window_key_tiles(len_q: int, len_k: int, tile_start: int, block_m: int, block_n: int,
                     window: int | None) -> tuple[int, int]:
    """``(first, end)``: the key tiles ``[first, end)`` the query tile starting at row ``tile_start`` must compute
    when row ``i`` sees keys ``j`` with ``i + L_k − L_q − W < j ≤ i + L_k − L_q`` (``window=None``: plain causal, no
    lower edge); ``(0, 0)`` when no real row of the tile sees a key. Found by brute force over the mask, cell by cell
    (independent of ``key_tiles``' formula)."""
    nq, nk = check_int("len_q", len_q, 0), check_int("len_k", len_k, 0)
    bm, bn = check_int("block_m", block_m, 1), check_int("block_n", block_n, 1)
    w = None if window is None else check_int("window", window, 1)
    seen = set()
    for row in range(check_int("tile_start", tile_start, 0), min(tile_start + bm, nq)):
        top = row + nk - nq
        low = -1 if w is None else top - w
        seen.update(j // bn for j in range(max(0, low + 1), min(nk, top + 1)))
    return (min(seen), max(seen) + 1) if seen else (0, 0)


def flat_grid_size(seqlens_q: Sequence[int], block_q: int) -> int:
    """``⌊T / BLOCK_Q⌋ + R``: the programs of a flat grid per K/V head (vLLM's ``kernel_unified_attention_2d``), from
    the token count T and the request count R alone; at most one of them per request has no token tile. Not this
    engine's grid (``launch_grid``: ``⌈max_seqlen_q / BLOCK_M⌉ · R`` per head)."""
    lq = check_lengths(seqlens_q, minimum=0, name="seqlens_q")
    return sum(lq) // check_int("block_q", block_q, 1) + len(lq)


def longest_program(seqlens: Sequence[int], block_m: int, block_n: int, causal: bool = True) -> int:
    """Key tiles the busiest program of a launch over prompts of ``seqlens`` walks, one after the other
    (``program_key_tiles``, one head): no launch ends before that program does."""
    lens = check_lengths(seqlens, minimum=0, name="seqlens")
    return max([t for n in lens for t in program_key_tiles(n, n, cdiv(n, block_m), block_m, block_n, causal)],
               default=0)


def busy_sms(work: WorkCounts, longest: int) -> float:
    """The SMs a launch keeps busy on average, in the simplest model (work over span, every key tile costing the
    same): its key tiles over the key tiles of its longest program (``longest_program``). An upper bound: a real SM
    runs several programs at once to hide memory latency, so filling a GPU takes more work than this asks."""
    return work.tiles / longest if longest > 0 else 0.0


def tile_costs(seqlens: Sequence[int], n_heads: int, block_m: int, block_n: int, d_head: int, nbytes: int = 2, *,
               busy: bool = True) -> tuple[float, int, int]:
    """``(SMs kept busy, K/V bytes read, executed cells)`` of a causal launch over prompts of ``seqlens`` at
    ``block_m`` x ``block_n`` (``predict_work``): the SMs are ``busy_sms`` (key tiles over the longest program's);
    ``busy=False`` counts every program of the grid as a busy SM, those that return at once too (the naive count)."""
    w = predict_work(seqlens, n_heads=n_heads, block_m=block_m, block_n=block_n, causal=True)
    sms = busy_sms(w, longest_program(seqlens, block_m, block_n)) if busy else w.programs
    return sms, w.kv_bytes_read(d_head, nbytes), w.executed_cells


def best_block_m(seqlens: Sequence[int], n_heads: int, n_sms: int, block_ms: Sequence[int], block_n: int, d_head: int,
                 nbytes: int = 2, *, busy: bool = True) -> int:
    """The ``block_ms`` choice reading the fewest K/V bytes among those keeping at least ``n_sms`` SMs busy
    (``tile_costs``); if none does, the one keeping the most busy; ties: fewest executed cells."""
    if not block_ms:
        raise ValueError("block_ms is empty: name at least one BLOCK_M to choose from")
    costs = {bm: tile_costs(seqlens, n_heads, bm, block_n, d_head, nbytes, busy=busy) for bm in block_ms}
    full = [bm for bm in block_ms if costs[bm][0] >= n_sms]
    if full:
        return min(full, key=lambda bm: (costs[bm][1], costs[bm][2]))
    return min(block_ms, key=lambda bm: (-costs[bm][0], costs[bm][2]))
