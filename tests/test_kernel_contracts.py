"""The CUDA varlen kernels' call sites, run on the CPU through contract doubles (kernel_doubles.py),
and backend availability decided from facts (device, compute capability, dtype, head dim)."""
from __future__ import annotations

import kernel_doubles as kd
import pytest
import torch
from helpers import install_in_children, make_qkv

from lessons_lib.core import attention, kernels
from lessons_lib.core.attention import attention_ref, varlen_attention
from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.measure.tolerance import assert_close
from lessons_lib.serve.engine import Engine
from lessons_lib.tp.runtime import TPRuntime

BF16 = torch.bfloat16
CFG = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=300, max_position=256)


@pytest.fixture
def doubles(monkeypatch):
    """The doubles installed in KERNELS for this test only."""
    for name in ("flash", "torch_varlen"):
        monkeypatch.setitem(kernels.KERNELS, name, kernels.KERNELS[name])  # restored afterwards
    kd.install()


def _call(lens_q=(10, 30), lens_k=None, heads=2, d=16, dtype=BF16):
    lens_k = lens_q if lens_k is None else lens_k
    q, k, v, cu_q, cu_k = make_qkv(lens_q, lens_k, heads=heads, d_head=d, dtype=dtype)
    return dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), max_k=max(lens_k))


def _run(fn, a, causal=True):
    if fn is kd.flash_attn_varlen_func:
        return fn(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], a["max_q"], a["max_k"], causal=causal)
    return fn(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], a["max_q"], a["max_k"],
              window_size=(-1, 0) if causal else (-1, -1))


BAD_CALLS = {
    "fp32 inputs": (lambda a: a | {k: a[k].float() for k in "qkv"}, "must be fp16 or bf16"),
    "last dim not contiguous": (lambda a: a | {"q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)},
                                "contiguous last dimension"),
    "int64 cu_seqlens": (lambda a: a | {"cu_q": a["cu_q"].long()}, "cu_seqlens_q must be an int32 tensor"),
    "cu_seqlens on another device": (lambda a: a | {"cu_k": a["cu_k"].to("meta")}, "must be on q's device"),
    "max_seqlen as a tensor": (lambda a: a | {"max_q": torch.tensor(a["max_q"])}, "must be a Python int"),
    "head dim 260": (lambda a: _call(d=260), "head_dim 260 unsupported"),
    "max_seqlen too small": (lambda a: a | {"max_k": 5}, "max_seqlen below the longest request"),
}


@pytest.mark.parametrize("fn", [kd.flash_attn_varlen_func, kd.varlen_attn], ids=["flash", "torch_varlen"])
@pytest.mark.parametrize("bad", BAD_CALLS, ids=list(BAD_CALLS))
def test_each_precondition_refuses_a_bad_call(fn, bad):
    make, message = BAD_CALLS[bad]
    _run(fn, _call())  # the good call passes
    with pytest.raises(kd.ContractError, match=message):
        _run(fn, make(_call()))


@pytest.mark.parametrize("fn", [kd.flash_attn_varlen_func, kd.varlen_attn], ids=["flash", "torch_varlen"])
def test_doubles_compute_bottom_right_causal_when_lq_differs_from_lk(fn):
    a = _call(lens_q=(3, 5), lens_k=(7, 5))
    out = _run(fn, a, causal=True)
    cu_k = a["cu_k"].tolist()
    # query 0 of request 0 (L_q=3, L_k=7) sees keys 0..4 of its request: the diagonal ends bottom-right
    q0, keys = a["q"][0].float(), a["k"][cu_k[0]:cu_k[0] + 5].float()
    p = torch.softmax(torch.einsum("hd,khd->hk", q0, keys) / 4.0, dim=-1)
    want = torch.einsum("hk,khd->hd", p, a["v"][:5].float())
    assert torch.allclose(out[0].float(), want, atol=2e-2)


@pytest.mark.parametrize("backend", ["flash", "torch_varlen"])
def test_model_kernel_path_runs_through_the_double(doubles, backend):
    """The model's own call (cu_seqlens, max_seqlen, scale, causal) satisfies the contract, and
    the result obeys the tolerance rule against float64 with the per-request loop as the trusted one."""
    w = init_weights(CFG)
    model = Transformer(CFG, w, dtype=BF16)
    batch = pack([torch.arange(n) % CFG.vocab_size for n in (10, 30, 1, 7)])
    out, loop = model(batch, attn_backend=backend), model(batch, attn_backend="loop")
    ref64 = Transformer(CFG, w, dtype=torch.float64)(batch)
    assert_close(out, loop, ref64, f"bf16 model through the {backend} double")


def test_older_varlen_signature_is_called_with_is_causal(doubles):
    kd.install(torch_varlen=kd.varlen_attn_is_causal)
    a = _call()
    out = varlen_attention(a["q"], a["k"], a["v"], a["cu_q"], backend="torch_varlen")
    ref = attention_ref(a["q"], a["k"], a["v"], a["cu_q"], causal=True).to(BF16)
    assert torch.equal(out, ref)
    assert kernels.torch_varlen_kwargs(kd.varlen_attn_is_causal, True, 0.25) == {"is_causal": True}
    assert kernels.torch_varlen_kwargs(kd.varlen_attn, True, 0.25) == {"scale": 0.25, "window_size": (-1, 0)}


def test_a_call_site_bug_fails_on_the_cpu(doubles, monkeypatch):
    """An argument bug in our call site (int64 cu_seqlens, as torch.cumsum returns) is caught here."""
    def buggy(q, k, v, meta, causal, scale):
        return kernels.kernel("flash")(q, k, v, meta.cu_seqlens_q.long(), meta.cu_seqlens_k, meta.max_seqlen_q,
                                       meta.max_seqlen_k, softmax_scale=scale, causal=causal)
    monkeypatch.setitem(attention.IMPLS, "flash", buggy)
    model = Transformer(CFG, dtype=BF16)
    with pytest.raises(kd.ContractError, match="cu_seqlens_q must be an int32 tensor"):
        model(pack([[1, 2, 3], [4, 5]]), attn_backend="flash")


def test_engine_kernel_path_runs_through_the_double(doubles):
    reqs = [list(range(n)) for n in (10, 30, 3)]
    eng = Engine(CFG, attn_backend="flash", device="cpu", dtype=BF16, compute_logits=False)
    assert eng.attn_backend == "flash"
    flash = eng.prefill(reqs)
    loop = Engine(CFG, attn_backend="loop", device="cpu", dtype=BF16, compute_logits=False).prefill(reqs)
    ref64 = Engine(CFG, attn_backend="loop", device="cpu", dtype=torch.float64, compute_logits=False).prefill(reqs)
    for f, lp, r in zip(flash, loop, ref64):
        assert_close(f.last_hidden, lp.last_hidden, r.last_hidden, f"engine request {f.request_id}")


def test_tp_worker_kernel_path_runs_through_the_double(doubles, monkeypatch):
    """Spawned TP workers install the doubles at start-up (tests/hooks/sitecustomize.py) and run the flash path."""
    install_in_children(monkeypatch, "kernel_doubles")
    batch = pack([torch.arange(n) % CFG.vocab_size for n in (10, 30)])
    with TPRuntime(CFG, attn_backend="flash", backend="gloo", device="cpu", dtype=BF16, verbose=False) as rt:
        res = rt.forward(batch)
    assert res.attn_backend == "flash" and res.all_reduce_counts == [4, 4]
    w = init_weights(CFG)
    tp1 = Transformer(CFG, w, dtype=BF16)(batch, attn_backend="loop")
    assert_close(res.output, tp1, Transformer(CFG, w, dtype=torch.float64)(batch), "TP=2 through the flash double")


# ---- availability from facts -------------------------------------------------------------------

def test_cpu_refuses_the_cuda_kernels_with_the_reason():
    status = kernels.available_backends("cpu", BF16)
    for name in ("flash", "torch_varlen"):
        assert not status[name].available
    assert kernels.resolve_backend("auto", "cpu", BF16) == "sdpa"


def test_capability_dtype_and_head_dim_decide_on_cuda(doubles, monkeypatch):
    """On a (pretended) GPU: sm75 is refused, sm90 accepted; fp32 and head dim 512 refused; auto order."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cc = {"value": (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc["value"])
    t4 = kernels.available_backends("cuda", BF16, 64)
    assert not t4["flash"].available and "sm80" in t4["flash"].reason and "sm75" in t4["flash"].reason
    assert kernels.resolve_backend("auto", "cuda", BF16, 64) == "sdpa"
    cc["value"] = (9, 0)
    assert kernels.resolve_backend("auto", "cuda", BF16, 64) == "flash"
    fp32 = kernels.available_backends("cuda", torch.float32, 64)
    assert not fp32["flash"].available and "float32" in fp32["flash"].reason
    big = kernels.available_backends("cuda", BF16, 512)
    assert not big["torch_varlen"].available and "head dim 512" in big["torch_varlen"].reason
    monkeypatch.setitem(kernels.KERNELS, "flash", kernels.Kernel("no_such_flash_attn_module", ("f",)))
    assert kernels.resolve_backend("auto", "cuda", BF16, 64) == "torch_varlen"
