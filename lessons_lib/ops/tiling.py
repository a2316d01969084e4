"""How a tiled varlen attention kernel cuts its work, predicted from the lengths alone (no Triton needed).

The kernel of ``ops.triton_varlen`` launches one program per (query tile, head, request): a grid of
``(⌈max_seqlen_q / BLOCK_M⌉, H, R)``. The grid is sized by the LONGEST request, so a program whose
query tile starts at or past its own request's end has nothing to do and returns at once. A
program that works walks its request's keys ``BLOCK_N`` at a time; with ``causal`` it stops at
the diagonal (bottom-right aligned: query row i sees keys ``j <= i + L_k - L_q``), so the key
tiles wholly above it are never computed.

``predict_work`` gives, for lengths and tile sizes, the numbers the kernel counts itself
(``triton_varlen.count_work``): the lesson asserts measured == predicted, so removing the early
return or moving the causal bound shows up as a difference.

Taught in notebooks/07_inside_the_kernel.ipynb.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from ..validate import check_int, check_lengths

FIELDS = ("programs", "early_exits", "tiles", "tiles_skipped", "cells")


@dataclass(slots=True)
class WorkCounts:
    """The work of one or more kernel launches, summed over programs.

    programs: programs launched (the grid's size, summed over launches).
    early_exits: programs whose query tile starts past their request's end (returned at once).
    tiles: ``[BLOCK_M × BLOCK_N]`` score tiles computed (one ``Q_tile @ K_tileᵀ`` each).
    tiles_skipped: key tiles of a working program's request that causal masking let it skip.
    cells: score cells of the computed tiles that lie inside the request's ``[L_q × L_k]`` block,
    the causally masked ones included (the tile's rows and columns past the request's end are not).
    block_m, block_n: the tile sizes (``tiles · block_m · block_n`` cells were executed); not compared.
    """

    programs: int = 0
    early_exits: int = 0
    tiles: int = 0
    tiles_skipped: int = 0
    cells: int = 0
    block_m: int = field(default=0, compare=False)  # a launch-free call (no tokens) records no tile size
    block_n: int = field(default=0, compare=False)
    # per launch, per program (index m + grid_m · (h + H · r)): its key tiles, -1 if it returned at once;
    # filled only by the kernel's count_work, never predicted
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


def key_tiles(len_q: int, len_k: int, tile_start: int, block_m: int, block_n: int, causal: bool) -> tuple[int, int]:
    """``(computed, skipped)`` key tiles for the query tile starting at row ``tile_start`` of a request.

    Causal: the tile's last real row ``r = min(tile_start + block_m, len_q) - 1`` sees keys up to
    ``r + len_k - len_q``, so keys ``[0, min(len_k, r + 1 + len_k - len_q))`` are read, whole tiles.
    """
    total = cdiv(len_k, block_n)
    if not causal:
        return total, 0
    hi = min(len_k, min(tile_start + block_m, len_q) + len_k - len_q)
    computed = cdiv(max(hi, 0), block_n)
    return computed, total - computed


def predict_work(seqlens_q: Sequence[int], seqlens_k: Sequence[int] | None = None, n_heads: int = 1, *,
                 block_m: int = 64, block_n: int = 64, causal: bool = True,
                 max_seqlen_q: int | None = None) -> WorkCounts:
    """What one launch over requests of ``seqlens_q`` queries (and ``seqlens_k`` keys) computes.

    A pure function of the lengths, ``n_heads``, the tile sizes and ``causal``: the same numbers
    the kernel counts with atomics when run under ``count_work()``. ``max_seqlen_q`` sizes the grid
    (default: the longest request; a larger bound launches more programs that return at once).
    """
    lq = check_lengths(seqlens_q, minimum=0, name="seqlens_q")
    lk = lq if seqlens_k is None else check_lengths(seqlens_k, minimum=0, name="seqlens_k")
    if len(lk) != len(lq):
        raise ValueError(f"seqlens_q and seqlens_k must have one length per request, got {len(lq)} and {len(lk)}")
    h = check_int("n_heads", n_heads, 1)
    bm, bn = check_int("block_m", block_m, 1), check_int("block_n", block_n, 1)
    grid_m = cdiv(max(lq, default=0) if max_seqlen_q is None else check_int("max_seqlen_q", max_seqlen_q, 0), bm)
    w = WorkCounts(programs=grid_m * h * len(lq), block_m=bm, block_n=bn)
    for nq, nk in zip(lq, lk):
        for m in range(grid_m):
            start = m * bm
            if start >= nq:
                w.early_exits += h
                continue
            computed, skipped = key_tiles(nq, nk, start, bm, bn, causal)
            rows = min(bm, nq - start)
            w.tiles += h * computed
            w.tiles_skipped += h * skipped
            w.cells += h * rows * min(computed * bn, nk)
    return w


def launch_grid(max_seqlen_q: int, n_heads: int, num_seqs: int, block_m: int = 64) -> tuple[int, int, int]:
    """``(⌈max_seqlen_q / block_m⌉, H, R)``: the kernel's grid, one program per (query tile, head, request)."""
    return cdiv(check_int("max_seqlen_q", max_seqlen_q, 0), check_int("block_m", block_m, 1)), \
        check_int("n_heads", n_heads, 1), check_int("num_seqs", num_seqs, 0)
