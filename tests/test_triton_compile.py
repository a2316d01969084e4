"""The Triton kernel compiled natively for sm_80 (A100) and sm_90 (H100, H200), on this machine without a GPU.

``lessons_lib.ops.compile_report`` builds ``_varlen_fwd_kernel`` in ONE fresh subprocess per worker (two
workers) started with ``TRITON_INTERPRET=0`` (a process that imported Triton interpreted cannot compile
natively), for every launch the launcher makes on CUDA: float16 and bfloat16, head-dim classes
BLOCK_D = 16, 32, 64, 128, 256, causal and not, the per-head layout (MHA, H = H_kv = 8) and the pack_gqa
layout (H = 8, H_kv = 2), each at the tile sizes, warps and stages ``triton_varlen.launch_config`` picks,
with the argument specialisation Triton's launcher would apply. ptxas: Triton's own, found beside its
NVIDIA backend (``triton/backends/nvidia/bin/ptxas`` for sm_80, ``ptxas-blackwell`` for sm_90a, whose
PTX version the plain one rejects); ``ptxas -v`` on each build's PTX reports registers and spill bytes,
Triton's metadata the shared memory per program.

Each build must compile, spill no register (0 bytes stored and loaded) and fit the target's shared
memory per block (A100 166,912 B, H100/H200 232,448 B). The table of every build is printed (shown
even when pytest captures output). Skipped only where Triton is not installed.
"""
from __future__ import annotations

import pytest
import torch

from lessons_lib.ops import compile_report as C

tv = pytest.importorskip("lessons_lib.ops.triton_varlen", reason="triton not installed (Linux wheels only)")


@pytest.fixture(scope="module")
def reports():
    return C.compile_builds(C.launch_builds(), processes=2)


def test_every_cuda_launch_compiles_spill_free_within_shared_memory(reports, capsys):
    with capsys.disabled():
        print(f"\nnative builds of {tv._varlen_fwd_kernel.fn.__name__} (spills: bytes stored/loaded; shared: bytes "
              f"per program, limit sm_80 {C.MAX_SHARED[80]:,}, sm_90 {C.MAX_SHARED[90]:,})")
        print(C.format_table(reports))
    builds = C.launch_builds()
    assert [r.build for r in reports] == builds and len(builds) == 2 * 2 * 5 * 2 * 2
    for r in reports:  # the launch compiled is the launcher's own
        want = tv.launch_config(r.build.head_dim, getattr(torch, r.build.dtype), r.build.arch)
        assert (r.block_m, r.block_n, r.num_warps, r.num_stages) == want
    bad = [r.row() for r in reports if not (0 < r.registers <= C.MAX_REGISTERS and r.fits)]
    assert not bad, f"builds that spill or overflow shared memory: {bad}"


def test_the_lse_and_counting_launches_compile_too(capsys):
    """``return_lse`` (one more store) and ``count_work`` (atomics; lesson 07 on a GPU) at the largest head dims."""
    builds = [C.Build(80, "bfloat16", 128, True, True, return_lse=True), C.Build(90, "float16", 256, True, False, count=True),
              C.Build(80, "float16", 64, False, False, return_lse=True, count=True)]
    reports = C.compile_builds(builds, processes=2)
    with capsys.disabled():
        print("\n" + C.format_table(reports))
    bad = [r.row() for r in reports if not (0 < r.registers <= C.MAX_REGISTERS and r.fits)]
    assert not bad, f"builds that spill or overflow shared memory: {bad}"


def test_the_report_sees_a_spilling_tile_size():
    """The check can fail: 128 x 64 query/key tiles in 4 warps at head dim 128 do not fit an A100's registers."""
    tiles = {80: {d: (128, 64, 4, 3) for d in C.HEAD_DIMS}}
    (report,) = C.compile_builds([C.Build(80, "bfloat16", 128, True, False)], tiles=tiles)
    assert report.registers == C.MAX_REGISTERS and report.spill_stores > 0 and not report.fits


def test_the_tile_table_has_an_entry_per_generation_and_head_dim_class():
    assert set(tv.CUDA_TILES) == {80, 90}
    for table in tv.CUDA_TILES.values():
        assert set(table) == set(C.HEAD_DIMS)
    assert tv.launch_config(100, torch.bfloat16, 86) == tv.LaunchConfig(*tv.CUDA_TILES[80][128])  # sm_86: A100 table
    assert tv.launch_config(64, torch.float16, 100) == tv.LaunchConfig(*tv.CUDA_TILES[90][64])    # newer: Hopper's
    assert tv.launch_config(64, torch.float16, 90, block_m=32).block_m == 32                       # explicit tiles win
