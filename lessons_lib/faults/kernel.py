"""Faults of the Triton varlen kernel (``ops.triton_varlen``): the kernel rebuilt from its real source with ONE
line changed (a ``@triton.jit`` function cannot be patched line by line). The launcher looks the kernel up at
call time, so swapping the module's ``_varlen_fwd_kernel`` changes every launch, counters included.

``LINE_CHANGES[fault name] = (the kernel's line, as code without its comment, what it becomes)``;
``with kernel_with_line(old, new):`` does the same for a pair of your own (in this process; ``line_changed``
returns the undo instead); ``changed_source`` shows the changed kernel. Line changes compose: with one in force,
the next is made on top of it (a later change of the same line wins), so a kernel fault turned on for a whole run
stays on inside ``faults.injected`` of another.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .registry import fault, swap_attr, swap_function, swap_item

AREA = "kernel"
KERNEL_FILE = Path(__file__).resolve().parents[1] / "ops" / "triton_varlen.py"
KERNEL_NAME = "_varlen_fwd_kernel"

LINE_CHANGES: dict[str, tuple[str, str]] = {
    "kernel_no_early_return": ("return", "pass"),
    "kernel_causal_bound_one_tile_late": (
        "hi = tl.minimum(len_k, tl.minimum((m_block + 1) * BLOCK_M, len_q) + len_k - len_q)",
        "hi = tl.minimum(len_k, tl.minimum((m_block + 1) * BLOCK_M, len_q) + len_k - len_q + BLOCK_N)"),
    "kernel_columns_past_end_kept": ("allowed = col_ok[None, :]", "allowed = cols[None, :] >= 0"),
    "kernel_sum_not_rescaled": ("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)"),
    "kernel_every_key_tile_masked": ("lo = lo // BLOCK_N * BLOCK_N", "lo = 0"),
    "kernel_diagonal_tile_unmasked": ("lo = lo // BLOCK_N * BLOCK_N", "lo = hi"),
    "kernel_causal_diagonal_top_left": ("allowed = allowed & (cols[None, :] <= tok[:, None] + (len_k - len_q))",
                                        "allowed = allowed & (cols[None, :] <= tok[:, None])"),
    "kernel_cells_counted_whole_tile": ("cells += tl.sum((row_ok[:, None] & col_ok[None, :]).to(tl.int32))",
                                        "cells += BLOCK_M * BLOCK_N"),
    "kernel_exp_in_base_e": ("p = tl.exp2(s - m_safe[:, None])", "p = tl.exp(s - m_safe[:, None])"),
}
_WHAT = {
    "kernel_no_early_return": "the kernel's early return removed: programs past their request's end walk its keys anyway",
    "kernel_causal_bound_one_tile_late": "the causal loop bound one key tile too far: tiles wholly above the diagonal "
                                         "are computed",
    "kernel_columns_past_end_kept": "the tile's key columns past the request's end are no longer masked (they score 0, "
                                    "not -inf)",
    "kernel_sum_not_rescaled": "the running sum l is not rescaled when the running max grows",
    "kernel_every_key_tile_masked": "the two-stage loop's unmasked stage emptied: every key tile takes the masked path "
                                    "(right output, slower)",
    "kernel_diagonal_tile_unmasked": "the two-stage loop's unmasked stage runs to the end: the diagonal tile is not "
                                     "masked (keys above it seen)",
    "kernel_causal_diagonal_top_left": "the kernel's causal mask aligned top-left (j <= i): a chunk after cached keys "
                                       "loses their offset",
    "kernel_cells_counted_whole_tile": "count_work's cells counter adds every cell of a computed tile, the rows and "
                                       "key columns past the request's end included (the in-bounds test dropped)",
    "kernel_exp_in_base_e": "the kernel's exponential is tl.exp while its scores and running max are in base 2 "
                            "(log2(e) folded into the scale): the probabilities are wrong, and the PTX multiplies by "
                            "log2(e) again",
}


def kernel_module():
    """``lessons_lib.ops.triton_varlen`` (Triton interpreted on a machine without a GPU); raises RuntimeError
    saying why where it does not import."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import, as core.kernels does
    try:
        from ..ops import triton_varlen
    except Exception as exc:  # ImportError without Triton, or Triton imported too early
        raise RuntimeError(f"the Triton kernel does not run here ({type(exc).__name__}: {exc})") from None
    return triton_varlen


def kernel_source() -> str:
    """The kernel's function as it is in its file, decorator included."""
    lines = KERNEL_FILE.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"def {KERNEL_NAME}("))
    while first > 0 and lines[first - 1].startswith("@"):
        first -= 1
    end = next((i for i in range(first + 2, len(lines)) if lines[i] and not lines[i][0].isspace()
                and not lines[i].startswith(")")), len(lines))
    return "\n".join(lines[first:end]).rstrip() + "\n"


def kernel_source_part(start: str | None = None, stop: str | None = None) -> tuple[str, str]:
    """``(heading, code)``: ``kernel_source()`` cut from its first line containing ``start`` up to (not including) the
    first later line containing ``stop``; the heading names the file (from the repository root), the lines and the
    kernel. ValueError if ``start`` is not in the kernel."""
    body = kernel_source().rstrip().splitlines()
    first = KERNEL_FILE.read_text().splitlines().index(body[0])
    lo = next((i for i, line in enumerate(body) if start in line), None) if start else 0
    if lo is None:
        raise ValueError(f"{start!r} is not in the kernel's source")
    hi = next((i for i in range(lo + 1, len(body)) if stop in body[i]), len(body)) if stop else len(body)
    where = KERNEL_FILE.relative_to(KERNEL_FILE.parents[2])
    return f"{where}, lines {first + lo + 1}-{first + hi}: {KERNEL_NAME}", "\n".join(body[lo:hi])


def changed_source(old: str, new: str, *earlier: tuple[str, str]) -> str:
    """The kernel's source with the one line whose code (comment stripped) is ``old`` replaced by ``new``,
    indentation kept and marked ``# CHANGED``; ValueError unless exactly one line matches. ``earlier``: ``(old,
    new)`` changes made first (a line they changed matches by its ``was:`` code too)."""
    lines = kernel_source().splitlines()
    for was, now in (*earlier, (old, new)):
        hits = [i for i, line in enumerate(lines) if was.strip() in
                (line.split("#", 1)[0].strip(), line.partition("# CHANGED, was: ")[2].strip())]
        if len(hits) != 1:
            raise ValueError(f"the kernel has {len(hits)} lines whose code is {was!r}; name exactly one")
        i = hits[0]
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        lines[i] = f"{indent}{now.strip()}  # CHANGED, was: {was.strip()}"
    return "\n".join(lines) + "\n"


_IN_FORCE: list[tuple[str, str]] = []   # the line changes on in this process, oldest first


@functools.cache
def broken_kernel(old: str, new: str, *earlier: tuple[str, str]):
    """The kernel rebuilt from ``changed_source(old, new, *earlier)``: a new ``@triton.jit`` function, imported
    from a file of its own (Triton reads a kernel's source from its file)."""
    kernel_module()
    text = "import triton\nimport triton.language as tl\n\n\n" + changed_source(old, new, *earlier)
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    path = Path(tempfile.mkdtemp(prefix="lessons_kernel_")) / f"kernel_{digest}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"lessons_kernel_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, KERNEL_NAME)


def line_changed(old: str, new: str) -> Callable[[], None]:
    """Make the engine launch the kernel with the line ``old`` replaced by ``new``, on top of the line changes
    already in force; returns the undo (undo in the reverse order of the changes)."""
    undo = swap_attr(kernel_module(), KERNEL_NAME, broken_kernel(old, new, *_IN_FORCE))
    _IN_FORCE.append((old, new))

    def undo_change() -> None:
        _IN_FORCE.remove((old, new))
        undo()
    return undo_change


@contextlib.contextmanager
def kernel_with_line(old: str, new: str) -> Iterator[None]:
    """Inside the block the engine launches the kernel with the line ``old`` replaced by ``new``."""
    undo = line_changed(old, new)
    try:
        yield
    finally:
        undo()


def _register(name: str) -> None:
    fault(name, _WHAT[name], AREA)(lambda: [line_changed(*LINE_CHANGES[name])])


for _name in LINE_CHANGES:
    _register(_name)


def _cdiv_rounded_down(a: int, b: int) -> int:
    return a // b


@fault("tiling_tiles_rounded_down", "ops.tiling's cdiv rounds down (a // b where it needs the ceiling): the predictor "
       "and launch_grid lose every partial tile (a request shorter than a tile gets no program)", "tiling")
def _tiles_rounded_down():
    from ..ops import tiling
    tiling.choose_pack_gqa.cache_clear()
    undo = swap_attr(tiling, "cdiv", _cdiv_rounded_down)
    return [undo, tiling.choose_pack_gqa.cache_clear]


@fault("triton_launch_ignores_tile_sizes", "the Triton launcher's launch_config drops an explicit block_m / block_n "
       "and launches its own default tiles (64 x 64 under the interpreter)", AREA)
def _launch_ignores_tile_sizes():
    module = kernel_module()
    real = module.launch_config

    def launch_config(head_dim, dtype, arch, block_m=None, block_n=None):
        return real(head_dim, dtype, arch)
    return [swap_function(module, "launch_config", launch_config)]


@fault("cuda_tiles_hopper_on_ampere", "the launcher's tile table gives an A100 (sm_80) the H100's tiles, warps and stages: "
       "at head dim 64 and 128 those builds spill registers there", AREA)
def _hopper_tiles_on_ampere():
    tiles = kernel_module().CUDA_TILES
    return [swap_item(tiles, 80, dict(tiles[90]))]
