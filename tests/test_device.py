"""The existing checks, on the device of ``--device`` (marker ``device``; fixture ``device``).

    pytest tests/test_device.py -m device --device cuda    # on a GPU (tools/gpu_check.py runs this)
    pytest tests/test_device.py -m device                  # the same tests on the CPU (CI)

The cases are the other test files' own: test_attention's random length sets (FlashAttention's
recipe) in fp16 and bf16 for every attention backend, test_bf16's model and batches, test_tp's
article model and TP batches, and the torchrun demo. Every comparison is the one tolerance rule
(``measure.tolerance.assert_close``): at most twice as far from the float64 truth as a trusted
computation in the same dtype (the padded ``attention_ref`` in that dtype; the same model one
request at a time with the ``loop`` backend; TP=1), plus rounding. A backend that does not run
here is skipped with its reason; flex and triton are skipped on the CPU (FlexAttention compiles
every shape, Triton runs in its interpreter there: seconds per case), where their own tests
check them. Without ``-m device`` on the CPU (the plain suite) they are skipped: tests/test_gpu_check.py
runs them there, through tools/gpu_check.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_attention import LENGTH_SETS
from test_bf16 import BATCHES as BF16_BATCHES
from test_bf16 import CFG as TINY
from test_tp import ART
from test_tp import BATCHES as TP_BATCHES

from lessons_lib.core.attention import attention_ref, varlen_attention
from lessons_lib.core.batch import pack
from lessons_lib.core.kernels import AUTO_ORDER, BACKENDS, available_backends, resolve_backend
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.measure.tolerance import assert_close, max_abs_diff, tolerance
from lessons_lib.serve.workloads import make_requests
from lessons_lib.tp.runtime import TPRuntime
from lessons_lib.tp.workers import _loopback_ifname, resolve_dist_backend

pytestmark = pytest.mark.device

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
HALF = {"float16": torch.float16, "bfloat16": BF16}
SLOW_ON_CPU = {"flex": "FlexAttention compiles every new shape (seconds each on the CPU); test_attention checks it",
               "triton": "Triton's interpreter on the CPU (seconds per case); run with --device cuda"}
# q/k/v [T, heads, head dim]: on CUDA the article's head dim (what flash, torch_varlen and triton see in the
# model); on the CPU, where fp16/bf16 matmuls are slow, smaller (the masks and lengths are the same).
SHAPE = {"cuda": (4, 64), "cpu": (2, 16)}
D_HEAD = SHAPE["cuda"][1]
ATTENTION_CASES = {**{name: (lens, None, None) for name, lens in LENGTH_SETS.items()},
                   "A=10+B=30 softmax_scale=0.3": ([10, 30], None, 0.3),
                   "bottom-right causal, keys outnumber queries": ([1, 4, 9, 1, 30, 64], [5, 4, 20, 1, 31, 200], None)}


@pytest.fixture(autouse=True)
def _asked_for(request):
    """In the plain suite (no ``-m device``, CPU) these tests would repeat the other files' CPU runs:
    tests/test_gpu_check.py runs them on the CPU through tools/gpu_check.py instead."""
    config = request.config
    if "device" not in (config.option.markexpr or "") and config.getoption("--device") == "cpu":
        pytest.skip("device tests run with -m device (tools/gpu_check.py; tests/test_gpu_check.py on the CPU)")


def _runs_here(backend: str, device: str, dtype: torch.dtype, head_dim: int) -> None:
    """Skip (with the reason) unless ``backend`` runs on ``device`` in ``dtype``."""
    if device == "cpu" and backend in SLOW_ON_CPU:
        pytest.skip(SLOW_ON_CPU[backend])
    status = available_backends(device, dtype, head_dim)[backend]
    if not status.available:
        pytest.skip(f"{backend} does not run here ({device}, {dtype}): {status.reason}")


# ---- attention: every backend against the float64 reference, in fp16 and bf16 ----------------------
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_backend_matches_the_fp64_reference(backend, dtype, case, device, make_qkv):
    dt = HALF[dtype]
    heads, d_head = SHAPE[device]
    _runs_here(backend, device, dt, d_head)
    lens_q, lens_k, scale = ATTENTION_CASES[case]
    q, k, v, cu_q, cu_k = make_qkv(lens_q, lens_k, heads=heads, d_head=d_head, seed=len(lens_q), dtype=dt,
                                   device=device)
    for causal in (True, False):
        kw = dict(causal=causal, softmax_scale=scale)
        out = varlen_attention(q, k, v, cu_q, cu_k, backend=backend, **kw)
        assert (out.shape, out.dtype, out.device) == (q.shape, q.dtype, q.device)
        ref64 = attention_ref(q, k, v, cu_q, cu_k, upcast_dtype=torch.float64, **kw)
        ref = attention_ref(q, k, v, cu_q, cu_k, upcast_dtype=dt, **kw)
        assert_close(out, ref, ref64, f"{backend}, {dtype}, {case}, causal={causal}")


def test_backends_here_say_why_not_and_auto_takes_the_first_that_runs(device):
    for dt in (torch.float16, BF16, torch.float32):
        status = available_backends(device, dt, D_HEAD)
        assert all(s.reason.strip() for s in status.values() if not s.available), status
        first = next(b for b in AUTO_ORDER[device] if status[b].available)
        assert resolve_backend("auto", device, dt, D_HEAD) == first
    fp32 = available_backends(device, torch.float32, D_HEAD)
    assert not fp32["flash"].available and not fp32["torch_varlen"].available
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 0):  # a T4: both varlen kernels refused
        bf = available_backends(device, BF16, D_HEAD)
        assert not bf["flash"].available and not bf["torch_varlen"].available
        assert resolve_backend("auto", device, BF16, D_HEAD) == "sdpa"


# ---- the model: bf16 on the device against float64 on the CPU ---------------------------------------
MODEL_CASES = {"tiny, A=10+B=30": (TINY, BF16_BATCHES["A=10 + B=30"]),
               "tiny, long-tail": (TINY, BF16_BATCHES["long-tail"]),
               "article layers, A=10+B=30": (ART, [10, 30])}


_MODELS: dict = {}


def _model(cfg, device: str, dtype: torch.dtype) -> Transformer:
    """One model per (config, device, dtype), from the same weights, kept for the session."""
    key = (id(cfg), device, dtype)
    if key not in _MODELS:
        _MODELS[key] = Transformer(cfg, init_weights(cfg, seed=0), device=device, dtype=dtype)
    return _MODELS[key]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MODEL_CASES)
def test_model_in_bf16_on_the_device_matches_float64_on_the_cpu(case, backend, device):
    cfg, lens = MODEL_CASES[case]
    _runs_here(backend, device, BF16, cfg.d_head)
    if backend == "flex" and cfg is ART:
        pytest.skip("flex: one layer shape is enough (the tiny model)")
    model, model64 = _model(cfg, device, BF16), _model(cfg, "cpu", torch.float64)
    reqs = [torch.tensor(r) for r in make_requests(lens, cfg.vocab_size, seed=1)]
    batch = pack(reqs)
    out = model(batch.to(device), attn_backend=backend)
    assert out.dtype == BF16 and out.device.type == device
    alone = torch.cat(model.forward_each(reqs, attn_backend="loop"))  # trusted: bf16, one request at a time
    assert_close(out, alone, model64(batch), f"{case}, bf16 on {device}, attention {backend}")


def test_model_in_fp32_on_the_device_matches_fp32_on_the_cpu(device):
    if device == "cpu":
        pytest.skip("compares the GPU with the CPU: needs --device cuda")
    cfg, lens = MODEL_CASES["article layers, A=10+B=30"]
    batch = pack([torch.tensor(r) for r in make_requests(lens, cfg.vocab_size, seed=1)])
    out, ref32 = _model(cfg, device, torch.float32)(batch.to(device)), _model(cfg, "cpu", torch.float32)(batch)
    assert out.device.type == device
    assert_close(out, ref32, _model(cfg, "cpu", torch.float64)(batch), f"fp32 on {device} vs fp32 on the CPU")


# ---- tensor parallelism: TP=2 on the device (NCCL with a GPU per rank, else gloo) -----------------------
def test_tp2_on_the_device_equals_tp1_in_bf16(device):
    cfg = ART if device == "cuda" else TINY
    weights = init_weights(cfg, seed=0)
    lens = TP_BATCHES["A=10 + B=30"] + TP_BATCHES["long-tailed mix"]
    batch = pack([torch.tensor(r) for r in make_requests(lens, cfg.vocab_size, seed=7)])
    want = resolve_dist_backend("auto", 2, device)
    if device == "cuda":
        assert want == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    with TPRuntime(cfg, weights, world_size=2, backend="auto", device=device, dtype=BF16, timeout=180,
                   verbose=False) as rt:
        res = rt.forward(batch)
    n = cfg.all_reduces_per_forward
    assert res.backend == want and res.all_reduce_counts == [n, n]
    assert all((r.shape, r.dtype) == ((batch.num_tokens, cfg.d_model), "bfloat16") for t in res.traces for r in t)
    assert all(sum(per_layer) == 0 for per_layer in res.attn_collectives), "a collective inside attention"
    tp1 = Transformer(cfg, weights, device=device, dtype=BF16)(batch.to(device))
    ref64 = Transformer(cfg, weights, dtype=torch.float64)(batch)
    assert res.output.dtype == BF16
    err, bound = assert_close(res.output, tp1, ref64, f"TP=2 on {device} ({res.backend}) vs TP=1, bf16")
    print(f"TP=2 {res.backend} on {device}: |TP2 - fp64| {err:.2e} <= {bound:.2e}; |TP2 - TP1| "
          f"{max_abs_diff(res.output, tp1):.2e}; TP=1 alone {tolerance(tp1, ref64, BF16):.2e}")


def test_torchrun_demo_on_the_device(device):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lessons_lib.tp.demo", "--device", device]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if _loopback_ifname():
        env.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())  # one machine: gloo on the loopback
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all checks passed" in proc.stdout and "✗" not in proc.stdout, proc.stdout[-3000:]
