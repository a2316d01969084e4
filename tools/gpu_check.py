#!/usr/bin/env python3
"""The GPU check: every CUDA path of lessons_lib in one run, a JSON report and a readable log.

    python3 tools/gpu_check.py --out DIR                 # on a CUDA machine (default --device cuda)
    python3 tools/gpu_check.py --device cpu --quick      # the same steps on the CPU, tiny sizes (CI)

Steps, in order: env (versions, GPU, which attention backends run and why not, NCCL), attention
(every available backend against the float64 ``attention_ref``, fp16 and bf16), model (the
article's model in bf16 per backend against float64; CUDA fp32 against CPU fp32), tp (TPRuntime
world_size=2: gloo on CUDA tensors with one GPU, NCCL with two or more), torchrun (the
``lessons_lib.tp.demo`` entry point), bench (bf16 GEMM peak and ``lessons_lib.measure.bench``).
Every comparison uses the one tolerance rule (``lessons_lib.measure.tolerance``).

Never hangs: this process only orchestrates (it never imports torch). Each step runs in a child
process in its own session with a timeout (its own budget, capped by what is left of ``--budget``);
on timeout the child's whole process group gets SIGTERM, then SIGKILL, and so does every process
group the child started (torchrun, the benchmark), whose ids it records as it starts them. The
child rewrites its record after every check, so a step that is killed keeps what it measured;
the report is rewritten after every step. A step that raises is recorded with its error and
traceback, and the next step runs.

Writes to ``--out`` (default ``$OUT``, else ``./gpu_check_out``): gpu_check.json (schema
``lessons_lib.gpu_check/1``), gpu_check.log, torchrun.log, bench/bench.json, bench/summary.md, bench/bench.log (6 files).
Exit code 0 when every selected step ran and no correctness check failed (performance checks,
e.g. "varlen beats padded", are reported but do not decide it), else 1.
``--inject STEP:fail|hang`` (or ``GPU_CHECK_INJECT=STEP:MODE,...``) makes a step raise, or hang
until its timeout, after its own work: tests/test_gpu_check.py uses it to check that a failed or
hung step is recorded and the next steps still run.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the GPU machine may have no editable install of lessons_lib

SCHEMA = "lessons_lib.gpu_check/1"
STEPS = ("env", "attention", "model", "tp", "torchrun", "bench")
# Seconds per step: (full run on a GPU, --quick). The benchmark goes last and gets what is left.
# --quick budgets are loose: they only matter when a step hangs, and CI machines can be busy.
BUDGETS = {"env": (45, 40), "attention": (75, 75), "model": (75, 75), "tp": (75, 90), "torchrun": (90, 120),
           "bench": (150, 90)}
# FlexAttention (a teaching backend) compiles each new shape, seconds apiece on the CPU.
FLEX_CPU = "FlexAttention compiles every new shape (seconds each on the CPU): run on CUDA; tests/test_attention.py checks it here"
RESERVE_S = 5.0    # kept back from the global budget for the final report
MIN_STEP_S = 10.0  # a step with less than this left is skipped, not started


# ---- the JSON record of one step (written by the child after every check) -------------------
def _clean(x):
    """JSON-safe: NaN/inf as strings, tuples as lists, anything else unknown as str."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x if isinstance(x, (str, int, float, bool)) or x is None else str(x)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(obj), f, indent=1)
    os.replace(tmp, path)


class Step:
    """What a step measured: ``data`` (facts) and ``checks`` (each with a verdict pass/fail/skip)."""

    def __init__(self, name: str, path: str, inject: str | None):
        self.name, self.path, self.inject = name, path, inject
        self.rec: dict = {"data": {}, "checks": [], "pgids": []}

    def save(self) -> None:
        _write_json(self.path, self.rec)

    def data(self, **kw) -> None:
        self.rec["data"].update(kw)
        self.save()

    def check(self, name: str, ok: bool | None, kind: str = "correctness", **detail) -> bool:
        """Record a check: ok True/False → pass/fail, None → skip (give ``reason``)."""
        verdict = "skip" if ok is None else "pass" if ok else "fail"
        detail = {k: v for k, v in detail.items() if v is not None}
        self.rec["checks"].append({"name": name, "verdict": verdict, "kind": kind, **detail})
        self.save()
        extra = ", ".join(f"{k}={_fmt(v)}" for k, v in detail.items())
        print(f"  [{verdict.upper():4}] {name}" + (f"  ({extra})" if extra else ""), flush=True)
        return bool(ok)

    def fire_injected(self) -> None:
        """``--inject STEP:fail|hang``, after the step's own work: raise, or hang until killed."""
        if self.inject == "fail":
            raise RuntimeError(f"injected failure in step {self.name!r} (--inject {self.name}:fail)")
        if self.inject == "hang":
            print(f"  injected hang in step {self.name!r}: sleeping until killed", flush=True)
            while True:
                time.sleep(60)


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)[:200]


# ---- child side: the steps ------------------------------------------------------------------
class Ctx:
    def __init__(self, args):
        self.device, self.quick, self.out, self.deadline = args.device, args.quick, args.out, args.deadline

    def left(self) -> float:
        return self.deadline - time.time()


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:1500]


def _need_cuda(st: Step, ctx: Ctx) -> bool:
    """False (and the step recorded as skipped) when --device cuda but torch sees no GPU."""
    import torch
    if ctx.device == "cuda" and not torch.cuda.is_available():
        st.rec["skipped"] = (f"--device cuda but torch.cuda.is_available() is False (torch {torch.__version__}, "
                             f"built for CUDA {torch.version.cuda})")
        st.save()
        return False
    return True


def _run_logged(st: Step, cmd: list[str], timeout: float, log_path: str) -> tuple[int | None, str]:
    """Run ``cmd`` in its own session, output to ``log_path``; kill its group after ``timeout`` s.
    Returns (exit code or None on timeout, output)."""
    from lessons_lib.tp.workers import _loopback_ifname

    timeout = max(timeout, 1.0)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               PYTHONUNBUFFERED="1")
    if lo := _loopback_ifname():
        env.setdefault("GLOO_SOCKET_IFNAME", lo)  # every rank is on this machine
    print(f"  $ {' '.join(cmd)}   (timeout {timeout:.0f} s, output in {os.path.basename(log_path)})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        st.rec["pgids"].append(proc.pid)  # the parent kills this group too if this child is killed
        st.save()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
    with open(log_path, errors="replace") as f:
        return rc, f.read()


def step_env(st: Step, ctx: Ctx) -> None:
    import importlib.metadata as md
    import inspect
    import platform
    import shutil

    import torch
    import torch.distributed as dist

    from lessons_lib.core.kernels import AUTO_ORDER, available_backends, placement, resolve_backend, torch_varlen_kwargs
    from lessons_lib.tp.workers import resolve_dist_backend

    cuda = torch.cuda.is_available()
    versions = {}
    for pkg in ("torch", "triton", "transformers", "numpy", "flash-attn", "flash_attn"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    gpus = [{"name": torch.cuda.get_device_name(i), "capability": "{}.{}".format(*torch.cuda.get_device_capability(i)),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())] if cuda else []
    st.data(python=sys.version.split()[0], executable=sys.executable, platform=platform.platform(),
            cpu_count=os.cpu_count(), packages=versions, torch_cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version() if cuda else None, cuda_available=cuda, gpus=gpus,
            default_placement=[str(x) for x in placement()])
    st.check("CUDA available (torch sees a GPU)", cuda if ctx.device == "cuda" else None,
             reason=None if ctx.device == "cuda" else "--device cpu", gpus=len(gpus))
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(Exception):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            st.data(nvidia_smi=(smi.stdout or smi.stderr).strip())

    # Which attention backends run, for the model's head dim, and why the others do not.
    head_dim = 64
    table, refusals_explained = {}, True
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        status = available_backends(ctx.device, dt, head_dim)
        table[str(dt).removeprefix("torch.")] = {b: {"available": s.available, "reason": s.reason} for b, s in status.items()}
        refusals_explained &= all(s.reason.strip() for s in status.values() if not s.available)
        auto = resolve_backend("auto", ctx.device, dt, head_dim)
        first = next(b for b in AUTO_ORDER[ctx.device] if status[b].available)
        st.check(f"auto picks the first available of {'/'.join(AUTO_ORDER[ctx.device])} for {dt}", auto == first,
                 auto=auto)
    st.data(backends={"device": ctx.device, "head_dim": head_dim, "table": table})
    st.check("every refused backend says why", refusals_explained)
    fp32 = table["float32"]
    st.check("flash and torch_varlen refuse float32, with a reason",
             not fp32["flash"]["available"] and not fp32["torch_varlen"]["available"],
             flash=fp32["flash"]["reason"], torch_varlen=fp32["torch_varlen"]["reason"])
    if ctx.device == "cuda" and cuda and torch.cuda.get_device_capability() < (8, 0):
        bf = table["bfloat16"]
        st.check("below sm80: flash and torch_varlen refused, auto is sdpa",
                 not bf["flash"]["available"] and not bf["torch_varlen"]["available"]
                 and resolve_backend("auto", "cuda", torch.bfloat16, head_dim) == "sdpa",
                 flash=bf["flash"]["reason"], torch_varlen=bf["torch_varlen"]["reason"])

    # PyTorch's varlen kernel: detected by its signature, never by a version string.
    try:
        from torch.nn.attention.varlen import varlen_attn
        sig = inspect.signature(varlen_attn)
        info = {"importable": True, "signature": f"varlen_attn{sig}", "has_scale": "scale" in sig.parameters}
        try:
            info["causal_kwargs"] = torch_varlen_kwargs(varlen_attn, True, 0.125)
            st.check("varlen_attn's causal switch found in its signature", True, kwargs=info["causal_kwargs"])
        except RuntimeError as exc:
            st.check("varlen_attn's causal switch found in its signature", False, error=_err(exc))
    except Exception as exc:
        info = {"importable": False, "reason": _err(exc)}
    st.data(varlen_attn=info)
    try:
        import flash_attn  # type: ignore[import-not-found]
        st.data(flash_attn={"importable": True, "version": getattr(flash_attn, "__version__", "?")})
    except Exception as exc:
        st.data(flash_attn={"importable": False, "reason": _err(exc),
                            "install": "pip install -r requirements-gpu.txt --no-build-isolation (CUDA machine)"})

    dist_info = {"available": dist.is_available(), "gloo": dist.is_available() and dist.is_gloo_available(),
                 "nccl": dist.is_available() and dist.is_nccl_available()}
    if cuda and dist_info["nccl"]:
        with contextlib.suppress(Exception):
            dist_info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        dist_info["auto_backend_world_size_2"] = resolve_dist_backend("auto", 2, ctx.device)
    except Exception as exc:
        dist_info["auto_backend_world_size_2"] = _err(exc)
    st.data(distributed=dist_info)
    st.check("NCCL available", dist_info["nccl"] if ctx.device == "cuda" else None,
             reason=None if ctx.device == "cuda" else "NCCL moves CUDA tensors only (--device cpu)")


def _attention_cases(quick: bool) -> dict:
    """name → (lens_q, lens_k, causal, softmax_scale)."""
    from lessons_lib.serve.workloads import long_tail_lengths
    tail = long_tail_lengths(8, median=12, max_len=60, seed=3) if quick else long_tail_lengths(32, median=64, max_len=512,
                                                                                                seed=3)
    tiny = [4] * (100 if quick else 1000)
    lens_q, lens_k = [1, 4, 9, 1, 30, 64], [5, 4, 20, 1, 31, 200]
    return {"A=10+B=30": ([10, 30], None, True, None),
            "A=10+B=30 non-causal": ([10, 30], None, False, None),
            "A=10+B=30 softmax_scale=0.3": ([10, 30], None, True, 0.3),
            f"long-tail ({len(tail)} requests, {sum(tail)} tokens)": (tail, None, True, None),
            f"many tiny ({len(tiny)} x 4)": (tiny, None, True, None),
            "seqlen_q != seqlen_k (bottom-right causal)": (lens_q, lens_k, True, None)}


def _compare(st: Step, label: str, backend: str, call, ref64, bound: float, ctx: Ctx, problem=lambda out: None,
             **extra) -> None:
    """One backend against the float64 truth, as check ``label``: it passes when ``call()`` runs,
    ``problem(out)`` is None and ``max_abs_diff(out, ref64) <= bound``; a non-empty ``problem`` is
    recorded as ``error``. Records err, bound, ``extra`` and ms (the first call; on a GPU, the fastest
    of 3 more). Flex on the CPU is skipped (``FLEX_CPU``); a call that raises is a failure."""
    from lessons_lib.core.kernels import synchronize
    from lessons_lib.measure.profile import time_call
    from lessons_lib.measure.tolerance import max_abs_diff

    if backend == "flex" and ctx.device == "cpu":
        st.check(label, None, reason=FLEX_CPU)
        return
    try:
        t0 = time.perf_counter()  # time_call(repeats=1, warmup=0) by hand: the output is needed too
        out = call()
        synchronize(ctx.device)
        ms = (time.perf_counter() - t0) * 1e3
        err = max_abs_diff(out, ref64)
        if not ctx.quick:
            ms = time_call(call, repeats=3, warmup=0, device=ctx.device) * 1e3
        why = problem(out)
        st.check(label, why is None and err <= bound, err=err, bound=bound, **extra, ms=ms, error=why or None)
    except Exception as exc:
        st.check(label, False, error=_err(exc))


def _unlike(like, out) -> str | None:
    """Why ``out`` has not the shape, dtype and device of ``like`` (None when it has)."""
    if out.shape == like.shape and out.dtype == like.dtype and out.device == like.device:
        return None
    return f"got {tuple(out.shape)} {out.dtype} on {out.device}"


def step_attention(st: Step, ctx: Ctx) -> None:
    import torch

    from lessons_lib.core.attention import attention_ref, varlen_attention
    from lessons_lib.core.batch import seq_lens_to_cu_seqlens
    from lessons_lib.core.kernels import available_backends
    from lessons_lib.measure.tolerance import max_abs_diff, tolerance

    if not _need_cuda(st, ctx):
        return
    heads, d_head = (4, 16) if ctx.quick else (8, 64)
    st.data(heads=heads, d_head=d_head, device=ctx.device,
            trusted_ref="attention_ref in the same dtype (padded, FlashAttention's test recipe); truth: attention_ref "
                        "in float64 on the same device; rule: |out - ref64| <= 2 |ref - ref64| + 2 eps(dtype) max(1, |ref64|)")
    cases = _attention_cases(ctx.quick)
    for dt in (torch.float16, torch.bfloat16):
        name = str(dt).removeprefix("torch.")
        status = available_backends(ctx.device, dt, d_head)
        for b, s in status.items():
            if not s.available:
                st.check(f"{name} {b}", None, reason=s.reason)
        backends = [b for b, s in status.items() if s.available]
        for i, (case, (lq, lk, causal, scale)) in enumerate(cases.items()):
            g = torch.Generator().manual_seed(i)
            q = torch.randn(sum(lq), heads, d_head, generator=g).to(ctx.device, dt)
            k, v = (torch.randn(sum(lk or lq), heads, d_head, generator=g).to(ctx.device, dt) for _ in range(2))
            cu_q = seq_lens_to_cu_seqlens(lq, ctx.device)
            cu_k = cu_q if lk is None else seq_lens_to_cu_seqlens(lk, ctx.device)
            kw = dict(causal=causal, softmax_scale=scale)
            ref64 = attention_ref(q, k, v, cu_q, cu_k, upcast_dtype=torch.float64, **kw)
            ref = attention_ref(q, k, v, cu_q, cu_k, upcast_dtype=dt, **kw)
            bound, ref_err = tolerance(ref, ref64, dt), max_abs_diff(ref, ref64)
            for b in backends:
                _compare(st, f"{case} | {name} | {b}", b,
                         functools.partial(varlen_attention, q, k, v, cu_q, cu_k, backend=b, **kw), ref64, bound, ctx,
                         problem=functools.partial(_unlike, q), ref_err=ref_err)


def _tiny_cfg():
    from lessons_lib.core.config import ModelConfig
    return ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=1000, max_position=512)


def _model_batches(quick: bool) -> dict:
    from lessons_lib.serve.workloads import long_tail_lengths
    tail = long_tail_lengths(6, median=8, max_len=40, seed=5) if quick else long_tail_lengths(16, median=48, max_len=512,
                                                                                               seed=5)
    return {"A=10+B=30": [10, 30], f"long-tail ({len(tail)} requests, {sum(tail)} tokens)": tail}


def step_model(st: Step, ctx: Ctx) -> None:
    import torch

    from lessons_lib.core.batch import pack
    from lessons_lib.core.config import ModelConfig
    from lessons_lib.core.kernels import available_backends, resolve_backend
    from lessons_lib.core.model import Transformer, init_weights
    from lessons_lib.measure.tolerance import max_abs_diff, tolerance
    from lessons_lib.serve.workloads import make_requests

    if not _need_cuda(st, ctx):
        return
    cfg = _tiny_cfg() if ctx.quick else ModelConfig()
    dev, half = torch.device(ctx.device), torch.bfloat16
    weights = init_weights(cfg, seed=0)
    m64 = Transformer(cfg, weights, dtype=torch.float64)            # the truth, on the CPU
    m = Transformer(cfg, weights, device=dev, dtype=half)
    backends = [b for b, s in available_backends(dev, half, cfg.d_head).items() if s.available]
    st.data(config={"n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads, "d_head": cfg.d_head},
            device=ctx.device, auto_backend_bf16=resolve_backend("auto", dev, half, cfg.d_head), backends=backends,
            trusted_ref="the same model in bf16 on the device, one request at a time, attention 'loop'; truth: float64 "
                        "on the CPU")
    cpu32 = gpu32 = None
    if ctx.device == "cuda":
        cpu32, gpu32 = Transformer(cfg, weights, dtype=torch.float32), Transformer(cfg, weights, device=dev,
                                                                                   dtype=torch.float32)
    for i, (name, lens) in enumerate(_model_batches(ctx.quick).items()):
        reqs = [torch.tensor(r) for r in make_requests(lens, cfg.vocab_size, seed=i)]
        batch = pack(reqs)
        ref64 = m64(batch)
        ref = torch.cat(m.forward_each(reqs, attn_backend="loop"))
        bound, on_dev = tolerance(ref, ref64, half), batch.to(dev)
        for b in backends:
            _compare(st, f"{name} | bf16 on {ctx.device} | {b}", b, functools.partial(m, on_dev, attn_backend=b), ref64,
                     bound, ctx, problem=lambda out: None if out.dtype == half else f"got {out.dtype}, not {half}")
        if gpu32 is None:
            st.check(f"{name} | fp32 CUDA vs fp32 CPU", None, reason="needs --device cuda")
            continue
        try:
            out, ref32 = gpu32(on_dev), cpu32(batch)
            err, bound32 = max_abs_diff(out, ref64), tolerance(ref32, ref64, torch.float32)
            st.check(f"{name} | fp32 CUDA vs fp32 CPU", err <= bound32, err=err, bound=bound32,
                     backend=resolve_backend("auto", dev, torch.float32, cfg.d_head),
                     cuda_vs_cpu=max_abs_diff(out, ref32))
        except Exception as exc:
            st.check(f"{name} | fp32 CUDA vs fp32 CPU", False, error=_err(exc))


def step_tp(st: Step, ctx: Ctx) -> None:
    import torch

    from lessons_lib.core.batch import pack
    from lessons_lib.core.config import ModelConfig
    from lessons_lib.core.model import Transformer, init_weights
    from lessons_lib.measure.tolerance import max_abs_diff, tolerance
    from lessons_lib.serve.workloads import long_tail_lengths, make_requests
    from lessons_lib.tp.runtime import TPRuntime
    from lessons_lib.tp.workers import resolve_dist_backend

    if not _need_cuda(st, ctx):
        return
    cuda = ctx.device == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    auto = resolve_dist_backend("auto", 2, ctx.device)
    st.data(gpus=gpus, auto_backend=auto)
    try:
        resolve_dist_backend("nccl", 2, ctx.device)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    if gpus >= 2:
        st.check("2+ GPUs: auto picks NCCL, and NCCL is accepted", auto == "nccl" and refused is None, refused=refused)
    else:
        st.check(f"{'1 GPU' if cuda else 'CPU'}: auto picks gloo; NCCL is refused with a reason",
                 auto == "gloo" and bool(refused), message=refused)
    cfg = _tiny_cfg() if ctx.quick else ModelConfig()
    half = torch.bfloat16
    weights = init_weights(cfg, seed=0)
    lens = [10, 30] + long_tail_lengths(6 if ctx.quick else 12, median=12 if ctx.quick else 40,
                                         max_len=60 if ctx.quick else 400, seed=7)
    batch = pack([torch.tensor(r) for r in make_requests(lens, cfg.vocab_size, seed=7)])
    timeout = max(10.0, min(90.0, ctx.left() - 15))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rt = TPRuntime(cfg, weights, world_size=2, backend="auto", device=ctx.device, dtype=half, timeout=timeout)
    line = printed.getvalue().strip()
    print("  " + line, flush=True)
    with rt:
        res = rt.forward(batch)
        devices = getattr(rt._pool, "devices", None)  # what each rank reported (also in the printed line)
    st.data(backend=res.backend, devices=devices, runtime_says=line, attn_backend=res.attn_backend,
            startup_s=res.startup_s, forward_s=res.forward_s, tokens=batch.num_tokens, requests=batch.num_seqs)
    want = "cuda" if cuda else "cpu"
    fell_back = cuda and devices and not all(str(d).startswith("cuda") for d in devices)
    st.check(f"ranks ran on {want} (or said why not)", bool(devices) and (not fell_back or "cannot" in line),
             devices=devices, fallback=line if fell_back else None)
    n = cfg.all_reduces_per_forward
    st.check(f"{n} all-reduces per forward on every rank", res.all_reduce_counts == [n, n], counts=res.all_reduce_counts)
    st.check(f"every all-reduce is [{batch.num_tokens}, {cfg.d_model}] bfloat16",
             all(r.shape == (batch.num_tokens, cfg.d_model) and r.dtype == "bfloat16" for t in res.traces for r in t))
    st.check("no collective inside attention", all(sum(a) == 0 for a in res.attn_collectives))
    tp1 = Transformer(cfg, weights, device=ctx.device, dtype=half)(batch.to(ctx.device))
    ref64 = Transformer(cfg, weights, dtype=torch.float64)(batch)
    err, bound = max_abs_diff(res.output, ref64), tolerance(tp1, ref64, half)
    st.check("TP=2 vs TP=1 in bf16 by the rule (float64 truth)", res.output.dtype == half and err <= bound, err=err,
             bound=bound, tp2_vs_tp1=max_abs_diff(res.output, tp1))


def step_torchrun(st: Step, ctx: Ctx) -> None:
    import torch
    if not _need_cuda(st, ctx):
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lessons_lib.tp.demo", "--device", ctx.device]
    rc, out = _run_logged(st, cmd, ctx.left() - 3, os.path.join(ctx.out, "torchrun.log"))
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(("✓", "✗", "===")) or "check" in ln]
    st.data(command=" ".join(cmd[1:]), exit_code=rc, check_lines=lines[:80], tail=out[-3000:],
            gpus=torch.cuda.device_count() if ctx.device == "cuda" else 0)
    for ln in lines:
        print("  | " + ln, flush=True)
    st.check("torchrun exits 0", rc == 0, exit_code="timeout" if rc is None else rc)
    passed, failed = sum(ln.startswith("✓") for ln in lines), sum(ln.startswith("✗") for ln in lines)
    st.check("every demo check passed", passed > 0 and failed == 0, passed=passed, failed=failed)


def step_bench(st: Step, ctx: Ctx) -> None:
    import torch

    from lessons_lib.measure.profile import matmul_throughput

    if not _need_cuda(st, ctx):
        return
    half = torch.bfloat16
    shapes = [(256, 64, 256), (512, 512, 512)] if ctx.quick else [(4096, 512, 2048), (8192, 8192, 8192)]
    gemm = {}
    for t, d_in, d_out in shapes:
        gemm[f"[{t} x {d_in}] @ [{d_in} x {d_out}]"] = matmul_throughput(t, d_in, d_out, repeats=3 if ctx.quick else 10,
                                                                           device=ctx.device, dtype=half)
    st.data(gemm_bf16_gflops=gemm)
    st.check("bf16 GEMM peak measured", all(v > 0 for v in gemm.values()), kind="performance",
             peak_gflops=max(gemm.values()))
    bench_dir = os.path.join(ctx.out, "bench")
    cmd = [sys.executable, "-m", "lessons_lib.measure.bench", "--device", ctx.device, "--dtype", "bfloat16",
           "--no-sweeps", "--out", bench_dir] + (["--quick", "--workloads", "long-tail", "--repeats", "1"] if ctx.quick
                                                  else ["--workloads", "long-tail,bimodal", "--repeats", "2"])
    os.makedirs(bench_dir, exist_ok=True)
    rc, out = _run_logged(st, cmd, ctx.left() - 3, os.path.join(bench_dir, "bench.log"))
    print("\n".join("  | " + ln for ln in out.splitlines()[-40:]), flush=True)
    path = os.path.join(bench_dir, "bench.json")
    st.data(command=" ".join(cmd[1:]), exit_code=rc, tail=out[-2000:])
    ok = rc == 0 and os.path.exists(path)
    st.check("benchmark ran and wrote bench/bench.json", ok, exit_code="timeout" if rc is None else rc)
    if not ok:
        return
    with open(path) as f:
        res = json.load(f)
    keep = ("time_s", "tokens_per_s", "efficiency", "speedup_of_varlen", "predicted_speedup", "max_abs_diff_vs_varlen",
            "skipped")
    st.data(bench={"machine": res["machine"], "gemm_peak": {k: v for k, v in res["gemm_peak"].items() if k != "samples"},
                   "workloads": {w: {m: {k: r[k] for k in keep if k in r} for m, r in rec["methods"].items()}
                                 for w, rec in res["workloads"].items()},
                   "tiny_requests": {k: v for k, v in res["tiny_requests"].items() if k != "methods"},
                   "wall_s": res["wall_s"]})
    for w, rows in res["checks"].items():
        for claim, r in (rows.items() if "holds" not in rows else [("", rows)]):
            st.check(f"bench {w} {claim}".strip(), bool(r["holds"]), kind="performance",
                     **{k: r[k] for k in ("measured", "required", "value", "target") if k in r})


STEP_FUNCS = {"env": step_env, "attention": step_attention, "model": step_model, "tp": step_tp,
              "torchrun": step_torchrun, "bench": step_bench}


def child_main(args) -> int:
    inject = dict(x.split(":", 1) for x in args.inject).get(args.child)
    st = Step(args.child, args.result, inject)
    st.save()

    def on_term(signum, frame):  # the parent's timeout: take our own subprocess groups down with us
        _kill_groups(st.rec["pgids"])
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    try:
        STEP_FUNCS[args.child](st, Ctx(args))
        st.fire_injected()
    except Exception as exc:
        st.rec.update(error=_err(exc), traceback=traceback.format_exc()[-6000:])
        st.save()
        print(f"  ERROR: {_err(exc)}", flush=True)
        return 1
    return 0


# ---- parent side: run the steps, each in a killable child ------------------------------------
def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group that ``proc`` leads, give it 5 s, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            return


def _kill_groups(pgids: list[int]) -> None:
    """SIGKILL every recorded process group (those already gone are skipped)."""
    for pgid in pgids:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


class Report:
    def __init__(self, args, argv):
        self.args, self.t0 = args, time.monotonic()
        os.makedirs(args.out, exist_ok=True)
        self.json_path = os.path.join(args.out, "gpu_check.json")
        self.log = open(os.path.join(args.out, "gpu_check.log"), "w")  # open for the whole run
        self.data = {"schema": SCHEMA, "command": "python3 tools/gpu_check.py " + " ".join(argv),
                     "device": args.device, "quick": args.quick, "budget_s": args.budget,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}}
        for name in STEPS:
            self.data["steps"][name] = ({"status": "pending"} if name in args.steps else
                                        {"status": "skipped", "reason": "not selected (--steps)"})
        self.save()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.data["summary"] = summarize(self.data["steps"])
        _write_json(self.json_path, self.data)


def summarize(steps: dict) -> dict:
    counts: dict = {}
    failed = []
    for name, rec in steps.items():
        for c in rec.get("checks", []):
            counts.setdefault(c["kind"], {"pass": 0, "fail": 0, "skip": 0})[c["verdict"]] += 1
            if c["verdict"] == "fail" and c["kind"] == "correctness":
                failed.append(f"{name}: {c['name']}")
    selected = {n: r for n, r in steps.items() if r.get("reason") != "not selected (--steps)"}
    not_ok = [f"{n}: {r['status']}" for n, r in selected.items() if r["status"] != "ok"]
    return {"verdict": "pass" if not not_ok and not failed else "fail", "steps_not_ok": not_ok,
            "failed_correctness_checks": failed, "checks": counts}


def run_step(rep: Report, name: str, inject: list[str]) -> None:
    args = rep.args
    want = args.step_budget.get(name, BUDGETS[name][1 if args.quick else 0])
    timeout = min(want, rep.left() - RESERVE_S)
    rec = rep.data["steps"][name]
    if timeout < min(MIN_STEP_S, want):
        rec.update(status="skipped", reason=f"global budget: {rep.left():.0f} s left of {args.budget:.0f}")
        rep.say(f"\n== {name}: SKIPPED ({rec['reason']})")
        return
    rep.say(f"\n== {name} (timeout {timeout:.0f} s, {rep.left():.0f} s of the budget left)")
    rec["status"] = "running"
    rep.save()
    fd, result = tempfile.mkstemp(prefix=f"gpu_check_{name}_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--result", result, "--device", args.device,
           "--out", args.out, "--deadline", str(time.time() + timeout)] + (["--quick"] if args.quick else [])
    cmd += [x for i in inject for x in ("--inject", i)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def relay():  # the child's output, live, to the console and the log
        for ln in io.TextIOWrapper(proc.stdout, errors="replace"):
            rep.say(ln.rstrip("\n"))
    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    timed_out = interrupted = None
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = f"killed after its timeout of {timeout:.0f} s (the checks above ran before that)"
    except KeyboardInterrupt as exc:  # SIGTERM or Ctrl-C of this script: record the step, then stop
        interrupted = exc
    if timed_out or interrupted:
        _kill_group(proc)
    reader.join(5.0)
    try:
        with open(result) as f:
            got = json.load(f)
    except (OSError, ValueError):
        got = {}
    with contextlib.suppress(OSError):
        os.unlink(result)
    _kill_groups(got.pop("pgids", []))  # the child's own subprocess groups (torchrun, bench), if still there
    checks = got.get("checks", [])
    if timed_out or interrupted:
        status = "timeout" if timed_out else "error"
        got["error"] = timed_out or f"gpu_check interrupted ({interrupted or 'Ctrl-C'}) during this step"
    elif "skipped" in got:
        status = "skipped"
    elif proc.returncode != 0 or "error" in got:
        status = "error"
        got.setdefault("error", f"the step's process exited with code {proc.returncode} without a record of why")
    else:
        status = "fail" if any(c["verdict"] == "fail" and c["kind"] == "correctness" for c in checks) else "ok"
    rec.clear()
    rec.update(status=status, wall_s=round(time.monotonic() - t0, 1), timeout_s=round(timeout, 1),
               returncode=proc.returncode, **got)
    if "skipped" in got:
        rec["reason"] = rec.pop("skipped")
    rep.say(f"== {name}: {status.upper()} in {rec['wall_s']} s" + (f" ({rec.get('error') or rec.get('reason')})"
                                                                    if status not in ("ok", "fail") else ""))
    if interrupted:
        raise interrupted


def _budget_pair(text: str) -> tuple[str, float]:
    name, _, secs = text.partition("=")
    if name not in STEPS or not secs:
        raise argparse.ArgumentTypeError(f"expected STEP=SECONDS with STEP one of {STEPS}, got {text!r}")
    return name, float(secs)


def _inject(text: str) -> str:
    name, _, mode = text.partition(":")
    if name not in STEPS or mode not in ("fail", "hang"):
        raise argparse.ArgumentTypeError(f"expected STEP:fail or STEP:hang with STEP one of {STEPS}, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_check_out"),
                   help="folder for the report (default $OUT, else ./gpu_check_out)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU mode CI runs)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--step-budget", type=_budget_pair, action="append", default=[], metavar="STEP=SECONDS",
                   help="override one step's timeout")
    p.add_argument("--inject", type=_inject, action="append", default=[], metavar="STEP:fail|hang",
                   help="make a step raise or hang after its work (tests this script); also GPU_CHECK_INJECT")
    for hidden in ("--child", "--result", "--deadline"):
        p.add_argument(hidden, help=argparse.SUPPRESS, type=float if hidden == "--deadline" else str)
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.child:
        return child_main(args)
    args.inject += [_inject(x.strip()) for x in os.environ.get("GPU_CHECK_INJECT", "").split(",") if x.strip()]
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if bad := [s for s in args.steps if s not in STEPS]:
        p.error(f"unknown step(s) {bad}; choose from {list(STEPS)}")
    args.step_budget = dict(args.step_budget)
    rep = Report(args, argv)
    rep.say(f"gpu_check: device={args.device} quick={args.quick} budget={args.budget:.0f} s out={args.out}")

    def on_term(signum, frame):  # killed from outside: stop the step, keep the report
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    try:
        for name in args.steps:
            run_step(rep, name, args.inject)
            rep.save()
    except KeyboardInterrupt as exc:  # run_step has recorded the step it stopped
        for rec in rep.data["steps"].values():
            if rec.get("status") == "running":
                rec.update(status="error", error=f"gpu_check interrupted ({exc or 'Ctrl-C'}) during this step")
            elif rec.get("status") == "pending":
                rec.update(status="skipped", reason=f"gpu_check interrupted ({exc or 'Ctrl-C'})")
    rep.save()
    s = rep.data["summary"]
    rep.say(f"\nverdict: {s['verdict'].upper()} in {rep.data['elapsed_s']} s; checks {json.dumps(s['checks'])}")
    for line in s["steps_not_ok"] + s["failed_correctness_checks"]:
        rep.say(f"  not ok: {line}")
    rep.say(f"report: {rep.json_path}")
    rep.log.close()
    return 0 if s["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
