"""A launch of the varlen kernel drawn cell by cell: each program's key tiles (the kernel's own per-program counts or
``tiling.program_key_tiles``'), every (query, key) cell coded by what the kernel does with it, and the kernel's
counters read back off that picture. Pure NumPy; no GPU, no Triton."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..validate import check_int
from .tiling import WorkCounts, cdiv, program_key_tiles

# Cell codes: a real (query, key) pair the mask keeps; computed then thrown away (masked, or past the request's
# end); a key tile never computed (above the diagonal); the band of a program that returned at once.
SKIPPED, USEFUL, WASTED, RETURNED = 0, 1, 2, 3


def program_tiles(lens_q: Sequence[int], lens_k: Sequence[int], *, block_m: int, block_n: int, causal: bool,
                  measured: Sequence[int] | None = None, n_heads: int = 1) -> list[list[int]]:
    """Key tiles of each program of head 0, per request, per query tile (-1: returned at once): from ``measured`` (a
    launch's ``WorkCounts.program_tiles[0]`` over ``n_heads`` heads) or predicted (``tiling.program_key_tiles``)."""
    grid_m = cdiv(max(lens_q, default=0), block_m)
    if measured is not None:
        return [[int(t) for t in measured[grid_m * n_heads * r:grid_m * (n_heads * r + 1)]] for r in range(len(lens_q))]
    return [program_key_tiles(nq, nk, grid_m, block_m, block_n, causal) for nq, nk in zip(lens_q, lens_k)]


def program_cells(len_q: int, len_k: int, tiles: Sequence[int], block_m: int, block_n: int, causal: bool) -> np.ndarray:
    """One request's programs (``tiles``: each one's key tiles, -1 returned) as a uint8 ``[len(tiles) · block_m,
    key_tiles · block_n]`` picture of codes: each computed key tile USEFUL where the cell is a real (query, key) pair
    the mask keeps, WASTED elsewhere; key tiles not computed SKIPPED; a returned program's band RETURNED."""
    nq, nk = check_int("len_q", len_q, 0), check_int("len_k", len_k, 0)
    width = max(1, cdiv(nk, block_n)) * block_n
    pic = np.full((len(tiles) * block_m, width), SKIPPED, dtype=np.uint8)
    cols = np.arange(width)[None, :]
    for m, computed in enumerate(tiles):
        band = pic[m * block_m:(m + 1) * block_m]
        if computed < 0:
            band[:] = RETURNED
            continue
        rows = m * block_m + np.arange(block_m)[:, None]
        keep = (rows < nq) & (cols < nk) & ((cols <= rows + nk - nq) if causal else True)
        band[:] = np.where(cols < computed * block_n, np.where(keep, USEFUL, WASTED), SKIPPED)
    return pic


def picture_totals(lens_q: Sequence[int], lens_k: Sequence[int], tiles: Sequence[Sequence[int]], *, block_m: int,
                   block_n: int, causal: bool, n_heads: int = 1) -> WorkCounts:
    """The kernel's counters read off the picture of ``tiles`` (``program_tiles``; every head does the same): a band
    past its request's end counts as an early exit even if it computed (the kernel's test still counts it), cells
    are the picture's computed cells inside each request's ``[L_q x L_k]`` block."""
    exits = sum(m * block_m >= nq for nq, mine in zip(lens_q, tiles) for m in range(len(mine)))
    skipped = sum(cdiv(nk, block_n) - t for nk, mine in zip(lens_k, tiles) for t in mine if t >= 0)
    pics = [program_cells(nq, nk, mine, block_m, block_n, causal)[:nq, :nk] for nq, nk, mine in zip(lens_q, lens_k, tiles)]
    cells = sum(int(((pic == USEFUL) | (pic == WASTED)).sum()) for pic in pics)
    return WorkCounts(programs=n_heads * sum(map(len, tiles)), early_exits=n_heads * exits,
                      tiles=n_heads * sum(max(t, 0) for mine in tiles for t in mine), tiles_skipped=n_heads * skipped,
                      cells=n_heads * cells, block_m=block_m, block_n=block_n)
