"""What only a GPU can tell: the bf16 GEMM peak, each attention kernel's speed and the engine's efficiency.

    python3 -m lessons_lib.measure.gpu_bench --device cuda --out DIR   # the benchmark's workloads, bf16
    python3 -m lessons_lib.measure.gpu_bench --device cpu --out DIR    # tiny sizes: every code path (CI)
    python3 -m lessons_lib.measure.gpu_bench --env --out DIR           # only the environment (env.json)

Correctness is the tests' business (``pytest -m device --device cuda``, tests/test_device.py);
this measures, on the workloads of ``measure.bench`` (``full_plan`` on CUDA, ``quick_plan`` on the
CPU: long-tail and bimodal, the same seeds), in bfloat16:

1. ``gemm``: ``F.linear`` TFLOP/s on a few shapes (``matmul_throughput``); the fastest is the peak.
2. ``attention``: one causal ``varlen_attention`` call over every request of a workload per
   backend that runs here (flash, torch_varlen, triton, sdpa, padded), fastest of N after a
   warm-up call (Triton compiles there). Useful FLOPs: ``4 · d_head · heads · Σ L(L+1)/2`` (the
   causal cells each request needs); reported as TFLOP/s and as a fraction of the GEMM peak,
   with ``max |out - sdpa|`` beside it.
3. ``engine``: ``Engine`` (method varlen, attention auto) prefilling the workload under the
   plan's token budget; useful forward FLOPs / time, as TFLOP/s and fraction of the peak.

Writes ``gpu_bench.json`` (schema ``lessons_lib.gpu_bench/1``) into ``--out`` and prints a table.
Timings vary run to run; nothing here asserts one.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import pathlib
import platform
import sys
import time

import torch

from ..core.attention import varlen_attention
from ..core.kernels import available_backends, placement, resolve_backend
from ..core.model import init_weights
from ..serve.workloads import make_requests, workload_lengths
from ..validate import dtype_name
from .bench import _engine_runner, full_plan, padded_score_bytes, quick_plan
from .flops import attention_cells, forward_flops
from .profile import matmul_throughput, random_qkv, time_call
from .tolerance import max_abs_diff

SCHEMA = "lessons_lib.gpu_bench/1"
ATTENTION_BACKENDS = ("flash", "torch_varlen", "triton", "sdpa", "padded")
WORKLOADS = ("long-tail", "bimodal")
# (tokens, d_in, d_out) of the GEMM peak; the model's own [budget x d_model] @ [d_model x d_ffn] is added.
GEMM_SHAPES = {"cuda": [(4096, 4096, 4096), (8192, 8192, 8192)], "cpu": [(256, 256, 256), (512, 512, 512)]}
REPEATS = {"cuda": 20, "cpu": 2}
PADDED_LIMIT = {"cuda": 16 << 30, "cpu": 1 << 28}  # bytes of padded [R, H, Lmax, Lmax] scores, else skipped
NOT_TIMED_ON_CPU = {"triton": "Triton runs in its interpreter on the CPU: a timing of it means nothing"}


def environment(device: str) -> dict:
    """Versions, the GPUs, which attention backends run here (and why not), distributed backends."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    packages = {}
    for pkg in ("torch", "triton", "flash-attn", "flash_attn", "transformers", "numpy", "pytest"):
        with contextlib.suppress(md.PackageNotFoundError):
            packages[pkg] = md.version(pkg)
    gpus = [{"name": torch.cuda.get_device_name(i), "capability": "{}.{}".format(*torch.cuda.get_device_capability(i)),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())] if cuda else []
    backends = {dtype_name(dt): {b: {"available": s.available, "reason": s.reason}
                                 for b, s in available_backends(device, dt, 64).items()}
                for dt in (torch.float16, torch.bfloat16, torch.float32)}
    nccl = dist.is_available() and dist.is_nccl_available()
    nccl_version = None
    if cuda and nccl:
        with contextlib.suppress(Exception):
            nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "packages": packages, "torch_cuda": torch.version.cuda, "cuda_available": cuda, "gpus": gpus,
            "device": device, "attention_backends_head_dim_64": backends,
            "auto_backend_bf16": resolve_backend("auto", device, torch.bfloat16, 64),
            "distributed": {"gloo": dist.is_available() and dist.is_gloo_available(), "nccl": nccl,
                            "nccl_version": nccl_version}}


def gemm_peak(device: str, dtype: torch.dtype, model_shape: tuple, repeats: int) -> dict:
    """TFLOP/s of ``F.linear`` per shape; ``peak_tflops`` is the fastest."""
    shapes = GEMM_SHAPES[device] + [model_shape]
    tflops = {f"[{t} x {i}] @ [{i} x {o}]": matmul_throughput(t, i, o, repeats=repeats, device=device, dtype=dtype) / 1e3
              for t, i, o in shapes}
    return {"dtype": dtype_name(dtype), "tflops": tflops, "peak_tflops": max(tflops.values()),
            "model_shape_tflops": tflops[f"[{model_shape[0]} x {model_shape[1]}] @ [{model_shape[1]} x {model_shape[2]}]"]}


def attention_timings(lens: list[int], cfg, device: str, dtype: torch.dtype, peak_tflops: float, repeats: int) -> dict:
    """Each backend on one causal call over all of ``lens``: seconds, useful TFLOP/s, fraction of the peak."""
    useful = 4 * cfg.d_head * cfg.n_heads * attention_cells(lens, "varlen", causal=True).useful
    q, k, v, cu = random_qkv(lens, cfg.n_heads, cfg.d_head, seed=0, device=device, dtype=dtype)
    status = available_backends(device, dtype, cfg.d_head)
    ref = varlen_attention(q, k, v, cu, causal=True, backend="sdpa")
    out: dict = {"useful_flops": useful}
    for b in ATTENTION_BACKENDS:
        if not status[b].available or (device == "cpu" and b in NOT_TIMED_ON_CPU):
            out[b] = {"skipped": status[b].reason if not status[b].available else NOT_TIMED_ON_CPU[b]}
            continue
        need = padded_score_bytes(cfg, [lens], dtype)
        if b == "padded" and need > PADDED_LIMIT[device]:
            out[b] = {"skipped": f"padded scores would need {need / 2**30:.1f} GiB (limit {PADDED_LIMIT[device] / 2**30:.1f})"}
            continue
        try:
            got = varlen_attention(q, k, v, cu, causal=True, backend=b)  # also the warm-up (Triton compiles here)
            seconds = time_call(lambda b=b: varlen_attention(q, k, v, cu, causal=True, backend=b), repeats=repeats,
                                warmup=0, device=device)
        except Exception as exc:  # one kernel failing must not hide the others' numbers
            out[b] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            continue
        tflops = useful / seconds / 1e12
        out[b] = {"time_s": seconds, "useful_tflops": tflops, "fraction_of_gemm_peak": tflops / peak_tflops,
                  "max_abs_diff_vs_sdpa": max_abs_diff(got, ref)}
    return out


def engine_efficiency(plan, lens: list[int], weights, peak_tflops: float, repeats: int) -> dict:
    """The engine prefilling ``lens`` (varlen, attention auto): useful forward FLOPs / time."""
    reqs = make_requests(lens, plan.cfg.vocab_size, seed=plan.seed + 1)
    run = _engine_runner(plan, weights, "varlen", reqs)
    seconds = time_call(run, repeats=max(2, repeats // 5), warmup=1, device=plan.device)
    useful = forward_flops(plan.cfg, lens, "varlen", causal=True, useful_only=True).total
    tflops = useful / seconds / 1e12
    return {"time_s": seconds, "useful_flops": useful, "useful_tflops": tflops, "fraction_of_gemm_peak": tflops / peak_tflops,
            "attention_backend": resolve_backend("auto", plan.device, plan.dtype, plan.cfg.d_head),
            "max_num_batched_tokens": plan.max_num_batched_tokens}


def run(device: str, out_dir: pathlib.Path, log=print) -> dict:
    t0 = time.perf_counter()
    plan = full_plan() if device == "cuda" else quick_plan()
    plan.device, plan.dtype = placement(device, torch.bfloat16)
    cfg, reps = plan.cfg, REPEATS[device]
    res: dict = {"schema": SCHEMA, "device": device, "dtype": "bfloat16", "environment": environment(device),
                 "config": {"n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads, "d_head": cfg.d_head,
                            "d_ffn": cfg.d_ffn},
                 "gemm": gemm_peak(device, plan.dtype, (plan.max_num_batched_tokens, cfg.d_model, cfg.d_ffn), reps),
                 "workloads": {}}
    peak = res["gemm"]["peak_tflops"]
    log(f"bf16 GEMM on {device}: " + ", ".join(f"{k} {v:.4g}" for k, v in res["gemm"]["tflops"].items())
        + f" TFLOP/s; peak {peak:.4g}")
    weights = init_weights(cfg, seed=plan.seed)
    for name in WORKLOADS:
        n, kw = plan.workloads[name]
        lens = workload_lengths(name, n, seed=plan.seed, **kw)
        rec = {"num_requests": len(lens), "num_tokens": sum(lens), "max_len": max(lens),
               "attention": attention_timings(lens, cfg, device, plan.dtype, peak, reps),
               "engine": engine_efficiency(plan, lens, weights, peak, reps)}
        res["workloads"][name] = rec
        log(f"\n{name}: {len(lens)} requests, {sum(lens)} tokens (max {max(lens)}); attention, one causal call, "
            f"{cfg.n_heads} heads x {cfg.d_head}:")
        for b in ATTENTION_BACKENDS:
            r = rec["attention"][b]
            log(f"  {b:<13}" + (f"{r['time_s'] * 1e3:9.3f} ms {r['useful_tflops']:9.4g} TFLOP/s "
                                f"{r['fraction_of_gemm_peak']:6.1%} of peak  |out - sdpa| {r['max_abs_diff_vs_sdpa']:.1e}"
                                if "time_s" in r else r.get("skipped") or r.get("error")))
        e = rec["engine"]
        log(f"  engine       {e['time_s'] * 1e3:9.3f} ms {e['useful_tflops']:9.4g} TFLOP/s "
            f"{e['fraction_of_gemm_peak']:6.1%} of peak (attention {e['attention_backend']})")
    res["wall_s"] = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_bench.json").write_text(json.dumps(res, indent=1) + "\n")
    log(f"\nwrote {out_dir / 'gpu_bench.json'} in {res['wall_s']:.1f} s")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m lessons_lib.measure.gpu_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpu_bench_out"), help="folder for the JSON")
    p.add_argument("--env", action="store_true", help="write only the environment (env.json) and stop")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda but torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda})")
    if args.env:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "env.json").write_text(json.dumps(environment(args.device), indent=1) + "\n")
        print(f"wrote {args.out / 'env.json'}")
        return 0
    run(args.device, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
