"""What the compiler makes of the Triton kernel for a GPU, found on a machine without one.

``compile_builds(builds)`` compiles ``triton_varlen._varlen_fwd_kernel`` natively (Triton IR → PTX
→ cubin) for NVIDIA targets such as sm_80 (A100) and sm_90 (H100, H200), with the arguments its
launcher would pass, and returns per build the registers per thread, the bytes of register spill
stores and loads, and the shared memory per program: the numbers that decide whether a tile size
fits the GPU. No GPU and no driver are needed; Triton, its bundled ``ptxas`` and a CPU are.

How: a process that imported Triton under ``TRITON_INTERPRET=1`` (as every CPU-only process of
this engine does) can no longer compile natively, so the builds run in a FRESH Python subprocess
started with ``TRITON_INTERPRET=0`` (``python -m lessons_lib.ops.compile_report``, builds as JSON on
stdin, reports on stdout). There each build's signature is specialised exactly as Triton's launcher
specialises a real call (``native_specialize_impl``: an int equal to 1 becomes a constant, pointers
and ints divisible by 16 get the divisibility hint) on the tensors a fused QKV projection hands the
kernel, then ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` builds it.
Registers and spills: Triton reads them from the loaded cubin on a GPU only, but it assembles the
PTX with ``ptxas -v`` itself, Triton's own bundled one from ``triton/backends/nvidia/bin``
(``ptxas-blackwell`` for sm_90a: the plain ``ptxas`` rejects the PTX version Triton 3.9 writes for
Hopper); ``TRITON_DUMP_PTXAS_LOG=1`` makes it print that log, which is parsed here, and
``TRITON_ALWAYS_COMPILE=1`` makes every build run ptxas (no cache hit without a log).

Taught in notebooks/07_inside_the_kernel.ipynb ("what the compiler made of the loop").
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

# Shared memory a block may use (opt-in maximum), bytes: A100 163 KiB, H100/H200 227 KiB.
MAX_SHARED = {80: 166_912, 90: 232_448}
MAX_REGISTERS = 255   # per thread: the hardware cap
HEAD_DIMS = (16, 32, 64, 128, 256)   # one per head-dim class (BLOCK_D) the launcher accepts
DTYPES = ("float16", "bfloat16")     # what the launcher takes on CUDA
GQA_HEADS = (8, 2)                   # (H_q, H_kv) of the pack_gqa builds: G = 4


@dataclass(frozen=True)
class Build:
    """One native build: the launch the launcher makes for these inputs on GPU generation ``arch``.

    ``pack_gqa`` False is the per-head layout with H_q = H_kv = 8 (MHA: G = 1); True packs G = 4 query
    heads per K/V head (``GQA_HEADS``). q, k, v are views of one fused ``[T, H_q + 2 H_kv, D]`` tensor.
    ``return_lse``, ``count``: the launch that also stores the log-sum-exp / runs under ``count_work``."""

    arch: int
    dtype: str
    head_dim: int
    causal: bool
    pack_gqa: bool
    return_lse: bool = False
    count: bool = False


@dataclass(frozen=True)
class BuildReport:
    """What the compiler made of one ``Build``: the launch configuration and the resources it needs."""

    build: Build
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    registers: int        # per thread
    spill_stores: int     # bytes
    spill_loads: int      # bytes
    shared: int           # bytes per program (block)

    @property
    def max_shared(self) -> int:
        return MAX_SHARED[self.build.arch]

    @property
    def fits(self) -> bool:
        """No spill, and the shared memory within the target's per-block limit."""
        return self.spill_stores == 0 and self.spill_loads == 0 and self.shared <= self.max_shared

    def row(self) -> dict:
        b = self.build
        return {"arch": f"sm_{b.arch}", "dtype": b.dtype, "BLOCK_D": b.head_dim, "causal": b.causal,
                "layout": ("pack_gqa" if b.pack_gqa else "per-head") + "+lse" * b.return_lse + "+count" * b.count,
                "BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "warps": self.num_warps, "stages": self.num_stages, "registers": self.registers,
                "spills": f"{self.spill_stores}/{self.spill_loads}", "shared": self.shared}


def launch_builds(archs: Sequence[int] = (80, 90), dtypes: Sequence[str] = DTYPES,
                  head_dims: Sequence[int] = HEAD_DIMS) -> list[Build]:
    """Every build the launcher can make on these GPUs: each dtype, head-dim class, causal or not, both layouts."""
    return [Build(a, dt, d, c, p) for a in archs for dt in dtypes for d in head_dims for c in (False, True)
            for p in (False, True)]


def compile_builds(builds: Sequence[Build], processes: int = 1, timeout: float = 600,
                   tiles: dict | None = None) -> list[BuildReport]:
    """Compile each build natively in fresh subprocesses (``processes`` of them, builds split between them).

    ``tiles``: a ``triton_varlen.CUDA_TILES``-shaped table to try instead of the launcher's own.
    Raises RuntimeError with the subprocess's error output when a build fails to compile."""
    builds = list(builds)
    chunks = [builds[i::processes] for i in range(processes)]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DUMP_PTXAS_LOG="1", TRITON_ALWAYS_COMPILE="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run(chunk):
        if not chunk:
            return []
        payload = json.dumps({"builds": [asdict(b) for b in chunk], "tiles": tiles})
        done = subprocess.run([sys.executable, "-c", _PTX_PROGRAM], input=payload, text=True,  # LESSONS_FAULTS on there
                              capture_output=True, env=env, cwd=root, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"native compile failed:\n{done.stderr[-3000:]}")
        return [BuildReport(Build(**r.pop("build")), **r) for r in json.loads(done.stdout.splitlines()[-1])]

    with ThreadPoolExecutor(processes) as pool:
        parts = list(pool.map(run, chunks))
    by_build = {r.build: r for part in parts for r in part}
    return [by_build[b] for b in builds]


def format_table(reports: Sequence[BuildReport]) -> str:
    """The reports as a fixed-width text table, one line per build (spills: store/load bytes)."""
    rows = [r.row() for r in reports]
    if not rows:
        return "(no builds)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.rjust(width[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).rjust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def limits_table(reports: Sequence[BuildReport]) -> str:
    """``format_table`` with each target's register and shared-memory limits and whether the build fits."""
    lines = format_table(reports).splitlines()
    head = f"{lines[0]}  {'max regs':>8}  {'max shared':>10}  fits"
    return "\n".join([head] + [f"{line}  {MAX_REGISTERS:>8}  {r.max_shared:>10}  {'yes' if r.fits else 'NO'}"
                               for line, r in zip(lines[1:], reports)])


# Launches the launcher does NOT make on an A100, (BLOCK_M, BLOCK_N, warps, stages) per head dim: 64 keys a tile at
# head dim 128, 4 warps at head dim 64.
AVOIDED_TILES = {80: {128: (128, 64, 8, 3), 64: (128, 64, 4, 3)}}


@functools.cache
def launcher_and_avoided(archs: tuple[int, ...] = (80, 90), head_dims: tuple[int, ...] = (64, 128)) -> tuple[list, list]:
    """``(launcher's, avoided)``: ``compile_builds`` of the launcher's bfloat16 causal per-head builds for ``archs`` x
    ``head_dims``, and of the same builds at ``AVOIDED_TILES`` (fresh subprocesses, no GPU; cached)."""
    mine = [Build(a, "bfloat16", d, True, False) for a in archs for d in head_dims]
    avoided = [Build(a, "bfloat16", d, True, False) for a, by_d in AVOIDED_TILES.items() for d in by_d]
    with ThreadPoolExecutor(2) as pool:
        ours = pool.submit(compile_builds, mine, 2)
        other = pool.submit(compile_builds, avoided, 1, 600, AVOIDED_TILES)
        return ours.result(), other.result()

# The kernel's exponential, and the line an unfolded kernel would have (compiled only, never run).
EXP_LINE = ("p = tl.exp2(s - m_safe[:, None])", "p = tl.exp(s - m_safe[:, None])")
LOG2E_PTX = "0f3FB8AA3B"   # log2(e) as a float32 immediate in PTX
# The subprocess: the faults named in LESSONS_FAULTS on, or (argv) one line of the kernel changed, then the build.
_PTX_PROGRAM = ("import runpy, sys\nfrom lessons_lib import faults\nfrom lessons_lib.faults.kernel import line_changed\n"
                "line_changed(sys.argv[1], sys.argv[2]) if len(sys.argv) > 1 else faults.apply_from_env()\n"
                "runpy.run_module('lessons_lib.ops.compile_report', run_name='__main__')\n")


@dataclass(frozen=True)
class ExpCount:
    """Instructions of one native build's PTX (per thread, the whole kernel)."""

    ex2: int          # ex2.approx: the GPU's only exponential instruction (base 2)
    mul_log2e: int    # multiplies by log2(e): what tl.exp adds before each ex2
    mul_f32: int      # all fp32 multiplies


def ptx_counts(arch: int, head_dim: int, line: Sequence[str] = ()) -> ExpCount:
    """The launcher's bf16 causal per-head build for ``arch`` and ``head_dim`` compiled natively in a fresh
    subprocess (the faults of ``LESSONS_FAULTS`` on there; ``line``: ``(old, new)``, that one kernel line changed
    instead, ``faults.kernel.line_changed``), its PTX's ``ExpCount``. No GPU needed."""
    import tempfile
    payload = json.dumps({"builds": [asdict(Build(arch, "bfloat16", head_dim, True, False))], "tiles": None})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="ptx_") as cache:
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DUMP_PTXAS_LOG="1", TRITON_ALWAYS_COMPILE="1",
                   TRITON_CACHE_DIR=cache)
        done = subprocess.run([sys.executable, "-c", _PTX_PROGRAM, *line], input=payload, text=True,
                              capture_output=True, env=env, cwd=root, timeout=600)
        if done.returncode:
            raise RuntimeError(f"native compile failed:\n{done.stderr[-3000:]}")
        ptx = "\n".join(open(os.path.join(d, f)).read() for d, _, files in os.walk(cache) for f in files
                        if f == "_varlen_fwd_kernel.ptx")
    code = [op.split() for op in ptx.splitlines() if op.strip() and not op.lstrip().startswith(".")]
    return ExpCount(sum(op[0].startswith("ex2.") for op in code),
                    sum(op[0].startswith("mul") and LOG2E_PTX in " ".join(op) for op in code),
                    sum(op[0].startswith("mul.") and op[0].endswith("f32") for op in code))


def exp_instructions(arch: int = 80, head_dim: int = 64) -> dict[str, ExpCount]:
    """``ptx_counts`` of the kernel as it is and with ``EXP_LINE`` swapped in (two builds side by side):
    ``{"tl.exp2 (the kernel)": ExpCount, "tl.exp": ExpCount}``."""
    with ThreadPoolExecutor(2) as pool:
        real, unfolded = pool.map(lambda line: ptx_counts(arch, head_dim, line), ((), EXP_LINE))
    return {"tl.exp2 (the kernel)": real, "tl.exp": unfolded}


# ---- inside the subprocess (TRITON_INTERPRET=0) ------------------------------------------------------------

def _resources(log: str) -> tuple[int, int, int]:
    """``(registers, spill store bytes, spill load bytes)`` from ``ptxas -v``'s log."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not (regs and spill):
        raise RuntimeError(f"no register report in the ptxas log: {log[-2000:]!r}")
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def _compile(build: Build, tiles: dict | None) -> BuildReport:
    import torch
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    from . import triton_varlen as tv

    dtype = getattr(torch, build.dtype)
    h_q, h_kv = GQA_HEADS if build.pack_gqa else (GQA_HEADS[0], GQA_HEADS[0])
    fused = torch.empty(64, h_q + 2 * h_kv, build.head_dim, dtype=dtype)   # a fused QKV projection's output
    q, k, v = fused.split([h_q, h_kv, h_kv], dim=1)
    out, cu = torch.empty_like(q), torch.zeros(3, dtype=torch.int32)
    lse = torch.empty(h_q, 64) if build.return_lse else cu          # as the launcher passes them
    counts = torch.zeros(8, dtype=torch.int64) if build.count else cu
    if tiles is None:
        config = tv.launch_config(build.head_dim, dtype, build.arch)
    else:
        config = tv.LaunchConfig(*tiles[build.arch][tv.block_d(build.head_dim)])
    args = dict(zip(tv._varlen_fwd_kernel.arg_names, (q, k, v, out, lse, cu, cu, counts, 0.125 * tv.LOG2E, *q.stride(),
                                                      *k.stride(), *v.stride(), *out.stride(),
                                                      lse.stride(0) if build.return_lse else 0)))
    constexprs = tv.kernel_constexprs(build.head_dim, dtype, config, group=h_q // h_kv, pack_gqa=build.pack_gqa,
                                      causal=build.causal, return_lse=build.return_lse, count=build.count)
    signature, attrs = {}, {}
    for i, name in enumerate(tv._varlen_fwd_kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        kind, key = native_specialize_impl(BaseBackend, args[name], False, True, True)
        signature[name] = kind
        if kind == "constexpr":   # an int equal to 1 (a unit stride)
            constexprs[name] = key
        elif key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):   # TRITON_DUMP_PTXAS_LOG: Triton prints its own ptxas -v run
        kernel = triton.compile(ASTSource(tv._varlen_fwd_kernel, signature, constexprs, attrs),
                                target=GPUTarget("cuda", build.arch, 32),
                                options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    registers, stores, loads = _resources(log.getvalue())
    return BuildReport(build, *config, registers, stores, loads, kernel.metadata.shared)


def _main() -> None:
    request = json.loads(sys.stdin.read())
    tiles = request["tiles"] and {int(a): {int(d): tuple(t) for d, t in by_d.items()} for a, by_d in request["tiles"].items()}
    reports = [_compile(Build(**b), tiles) for b in request["builds"]]
    print(json.dumps([asdict(r) for r in reports]))


if __name__ == "__main__":
    _main()
