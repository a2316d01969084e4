"""Grouped-query attention (GQA; MQA when n_kv_heads = 1) end to end: every attention backend, the model,
TP=2 on a real gloo group, the prefill KV cache, chunked prefill and the refusals.

The convention is FlashAttention's: K/V have ``H_kv`` heads, ``H_kv`` divides ``H_q``, and query head h
reads K/V head ``h // (H_q / H_kv)``. The attention reference here is built independently of
``core.attention``: K and V repeated per query head with ``repeat_interleave``, then per-request
softmax math, in float64 (the truth) and in the backend's dtype; results are judged by FlashAttention's
rule (``measure.tolerance.assert_close``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import kernel_doubles as kd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lessons_lib.core import kernels
from lessons_lib.core.attention import varlen_attention
from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.linear import QKVParallelLinear
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.measure.flops import kv_cache_bytes
from lessons_lib.measure.hf import hf_config
from lessons_lib.measure.tolerance import assert_close, max_abs_diff, tolerance
from lessons_lib.serve.engine import Engine
from lessons_lib.serve.kv_cache import PrefillKVCache
from lessons_lib.serve.scheduler import Request
from lessons_lib.serve.workloads import make_requests
from lessons_lib.tp.dryrun import expected_layers
from lessons_lib.tp.runtime import TPRuntime
from lessons_lib.tp.trace import forward_checks
from lessons_lib.tp.workers import launch

CPU_BACKENDS = ("loop", "masked", "padded", "sdpa", "flex")
FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GQA = ModelConfig(n_layers=2, d_model=64, n_heads=8, n_kv_heads=2, d_head=8, d_ffn=128, vocab_size=97,
                  max_position=256)


# ---- the independent reference ----------------------------------------------------------------------

def reference(q, k, v, lens_q, lens_k, causal, dtype, kv_head=None):
    """Per request, per query head: softmax(q K^T / sqrt(D)) V in ``dtype``, bottom-right causal. Query head h
    reads K/V head ``kv_head(h)``: ``h // G`` (FlashAttention's rule) unless a wrong rule is given."""
    h_q, h_kv, d = q.shape[1], k.shape[1], q.shape[2]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if kv_head is None:  # K/V head j repeated for its G query heads j·G .. j·G + G-1
        k, v = (x.repeat_interleave(h_q // h_kv, dim=1) for x in (k, v))
    else:
        k, v = (x[:, [kv_head(h) for h in range(h_q)]] for x in (k, v))
    out, sq, sk = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        qi, ki, vi = (x.transpose(0, 1) for x in (q[sq:sq + lq], k[sk:sk + lk], v[sk:sk + lk]))  # [H, L, D]
        scores = qi @ ki.transpose(1, 2) / math.sqrt(d)
        if causal:
            allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ vi).transpose(0, 1))
        sq, sk = sq + lq, sk + lk
    return torch.cat(out)


@st.composite
def gqa_cases(draw, d_heads=(4, 8, 16)):
    h_kv = draw(st.sampled_from([1, 1, 2, 3]))  # MQA drawn often
    g = draw(st.sampled_from([1, 2, 4]))
    lens_q = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    lens_k = [n + draw(st.integers(0, 6)) for n in lens_q]  # L_k >= L_q (chunked prefill's shape)
    return dict(h_q=h_kv * g, h_kv=h_kv, d=draw(st.sampled_from(d_heads)), lens_q=lens_q, lens_k=lens_k,
                causal=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def make(case, dtype=torch.float32):
    g = torch.Generator().manual_seed(case["seed"])
    tq, tk = sum(case["lens_q"]), sum(case["lens_k"])
    q = torch.randn(tq, case["h_q"], case["d"], generator=g).to(dtype)
    k, v = (torch.randn(tk, case["h_kv"], case["d"], generator=g).to(dtype) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (case["lens_q"], case["lens_k"]))
    return q, k, v, cu_q, cu_k


def check_against_reference(out, q, k, v, case, what):
    args = (q, k, v, case["lens_q"], case["lens_k"], case["causal"])
    ref64, ref = reference(*args, torch.float64), reference(*args, q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype, what
    assert_close(out, ref, ref64, what)
    return ref, ref64


# ---- every backend ----------------------------------------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # 5 backends per example
@given(case=gqa_cases())
def test_every_cpu_backend_matches_the_repeated_kv_reference(case):
    q, k, v, cu_q, cu_k = make(case)
    for backend in CPU_BACKENDS:
        out = varlen_attention(q, k, v, cu_q, cu_k, causal=case["causal"], backend=backend)
        ref, ref64 = check_against_reference(out, q, k, v, case, f"{backend} {case}")
    if case["h_kv"] > 1 and case["h_q"] > case["h_kv"]:  # h % H_kv pairs heads differently: the test above sees it
        wrong = reference(q, k, v, case["lens_q"], case["lens_k"], case["causal"], torch.float64,
                          kv_head=lambda h: h % case["h_kv"])
        assert max_abs_diff(wrong, ref64) > tolerance(ref, ref64, q.dtype), "h % H_kv would have passed"


def test_a_backend_pairing_heads_by_h_mod_hkv_fails_the_reference():
    """A backend that reads K/V head ``h % H_kv`` (``k.repeat`` instead of ``repeat_interleave``) is caught."""
    case = dict(h_q=4, h_kv=2, d=8, lens_q=[5, 3], lens_k=[7, 3], causal=True, seed=1)
    q, k, v, cu_q, cu_k = make(case)
    wrong = varlen_attention(q, k.repeat(1, 2, 1), v.repeat(1, 2, 1), cu_q, cu_k, backend="loop")
    with pytest.raises(AssertionError, match="exceeds the bound"):
        check_against_reference(wrong, q, k, v, case, "h % H_kv")
    right = varlen_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu_q, cu_k, backend="loop")
    check_against_reference(right, q, k, v, case, "h // G, K/V repeated by hand")


@contextlib.contextmanager
def doubles_installed(torch_varlen=kd.varlen_attn):
    saved = {name: kernels.KERNELS[name] for name in ("flash", "torch_varlen")}
    kd.install(torch_varlen=torch_varlen)
    try:
        yield
    finally:
        kernels.KERNELS.update(saved)


@FAST
@given(case=gqa_cases(d_heads=(8, 16)), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_contract_doubles_take_gqa_like_flash_attn(case, dtype):
    q, k, v, cu_q, cu_k = make(case, dtype)
    with doubles_installed():
        for backend in ("flash", "torch_varlen"):  # attention.py's call sites, the doubles behind them
            out = varlen_attention(q, k, v, cu_q, cu_k, causal=case["causal"], backend=backend)
            check_against_reference(out, q, k, v, case, f"{backend} double {dtype} {case}")


def test_old_varlen_signature_without_enable_gqa_gets_repeated_kv():
    case = dict(h_q=6, h_kv=2, d=8, lens_q=[4, 9], lens_k=[6, 9], causal=True, seed=3)
    q, k, v, cu_q, cu_k = make(case, torch.bfloat16)
    with doubles_installed(torch_varlen=kd.varlen_attn_is_causal):
        out = varlen_attention(q, k, v, cu_q, cu_k, backend="torch_varlen")
    check_against_reference(out, q, k, v, case, "varlen_attn(is_causal=) with K/V repeated")


def test_doubles_refuse_what_the_real_kernels_refuse():
    q, k, v, cu_q, cu_k = make(dict(h_q=4, h_kv=3, d=8, lens_q=[5], lens_k=[5], causal=True, seed=0), torch.bfloat16)
    with pytest.raises(kd.ContractError, match="Number of heads in key/value must divide number of heads in query"):
        kd.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    with pytest.raises(kd.ContractError, match="k, v shapes disagree"):
        kd.flash_attn_varlen_func(q, k[:, :1], v[:, :2], cu_q, cu_k, 5, 5, causal=True)
    q, k, v, cu_q, cu_k = make(dict(h_q=4, h_kv=2, d=8, lens_q=[5], lens_k=[5], causal=True, seed=0), torch.bfloat16)
    with pytest.raises(kd.ContractError, match="enable_gqa=True"):
        kd.varlen_attn(q, k, v, cu_q, cu_k, 5, 5, window_size=(-1, 0))
    ok = kd.varlen_attn(q, k, v, cu_q, cu_k, 5, 5, window_size=(-1, 0), enable_gqa=True)
    assert ok.shape == q.shape


# ---- the model --------------------------------------------------------------------------------------

def repeated_kv_weights(cfg: ModelConfig, w: dict) -> dict:
    """The MHA weights whose K/V heads are ``cfg``'s GQA ones, each repeated for its G query heads."""
    out, d, g = dict(w), cfg.d_head, cfg.n_heads // cfg.n_kv_heads
    for i in range(cfg.n_layers):
        for p in ("weight", "bias"):
            name = f"layers.{i}.attn.qkv.{p}"
            q, k, v = w[name].split([cfg.n_heads * d, cfg.n_kv_heads * d, cfg.n_kv_heads * d])
            k, v = (x.unflatten(0, (cfg.n_kv_heads, d)).repeat_interleave(g, 0).flatten(0, 1) for x in (k, v))
            out[name] = torch.cat([q, k, v])
    return out


def test_gqa_config_and_weight_shapes():
    assert ModelConfig().n_kv_heads == 8 and ModelConfig() == ModelConfig(n_kv_heads=8)  # the article's, MHA
    assert ModelConfig().weight_shapes()["layers.0.attn.qkv.weight"] == (3 * 512, 512)
    shapes = GQA.weight_shapes()
    assert GQA.kv_dim == 2 * 8
    assert shapes["layers.1.attn.qkv.weight"] == ((8 + 2 * 2) * 8, 64) and shapes["layers.1.attn.qkv.bias"] == (96,)
    assert shapes["layers.1.attn.out_proj.weight"] == (64, 64)  # the output keeps n_heads · d_head
    model = Transformer(GQA, init_weights(GQA, 1))
    qkv = model.layers[0].attn.qkv
    assert (qkv.n_local_heads, qkv.n_local_kv_heads, qkv.num_kv_head_replicas) == (8, 2, 1)
    sd = model.state_dict()
    assert {n: tuple(t.shape) for n, t in sd.items()} == shapes
    batch = pack(make_requests([5, 12, 1], GQA.vocab_size, 0))
    assert torch.equal(Transformer(GQA, sd)(batch), model(batch))  # state_dict round trip


def test_gqa_forward_flat_equals_each_and_every_backend():
    model = Transformer(GQA, init_weights(GQA, 2))
    model64 = Transformer(GQA, init_weights(GQA, 2), dtype=torch.float64)
    reqs = [torch.tensor(r) for r in make_requests([7, 20, 1, 13], GQA.vocab_size, 4)]
    each, each64 = torch.cat(model.forward_each(reqs)), torch.cat(model64.forward_each(reqs))
    for backend in CPU_BACKENDS:
        assert_close(model(pack(reqs), attn_backend=backend), each, each64, f"flat GQA forward, {backend}")
    ids = torch.zeros(len(reqs), 20, dtype=torch.long)
    mask = torch.zeros(len(reqs), 20, dtype=torch.bool)
    for i, r in enumerate(reqs):
        ids[i, :len(r)], mask[i, :len(r)] = r, True
    assert_close(model.forward_padded(ids, mask)[mask], each, each64, "forward_padded, GQA")


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_model_equals_mha_model_with_kv_heads_repeated_per_group(n_kv_heads):
    cfg = dataclasses.replace(GQA, n_kv_heads=n_kv_heads)
    w = init_weights(cfg, 5)
    mha_cfg = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
    mha_w = repeated_kv_weights(cfg, w)
    mha, mha64 = Transformer(mha_cfg, mha_w), Transformer(mha_cfg, mha_w, dtype=torch.float64)
    batch = pack(make_requests([9, 3, 17], cfg.vocab_size, 1))
    assert_close(Transformer(cfg, w)(batch), mha(batch), mha64(batch), f"GQA n_kv_heads={n_kv_heads} vs MHA")


def test_qkv_parallel_linear_shards_and_replicates_kv_heads():
    """vLLM's rule: tp <= n_kv_heads splits the K/V heads; tp > n_kv_heads gives each rank ONE K/V head,
    head ``r // num_kv_head_replicas``; rank r's query heads read only K/V heads it holds."""
    d_model, h, dh = 16, 8, 4
    for h_kv in (1, 2, 4, 8):
        w = torch.randn((h + 2 * h_kv) * dh, d_model)
        b = torch.randn((h + 2 * h_kv) * dh)
        x = torch.randn(5, d_model)
        full = QKVParallelLinear(d_model, h, dh, h_kv).load_full_(w, b)
        q, k, v = full.split(full(x))
        torch.testing.assert_close(torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1), x @ w.T + b)
        for tp in (1, 2, 4, 8):
            for r in range(tp):
                layer = QKVParallelLinear(d_model, h, dh, h_kv, group=LocalGroup(r, tp)).load_full_(w, b)
                q_r, k_r, v_r = layer.split(layer(x))
                replicas = max(tp // h_kv, 1)
                assert layer.num_kv_head_replicas == replicas and layer.n_local_kv_heads == max(h_kv // tp, 1)
                kv_heads = [r // replicas] if tp > h_kv else list(range(r * h_kv // tp, (r + 1) * h_kv // tp))
                q_heads = list(range(r * h // tp, (r + 1) * h // tp))
                torch.testing.assert_close(q_r, q[:, q_heads], rtol=0, atol=1e-5)
                torch.testing.assert_close(k_r, k[:, kv_heads], rtol=0, atol=1e-5)
                torch.testing.assert_close(v_r, v[:, kv_heads], rtol=0, atol=1e-5)
                assert {qh // (h // h_kv) for qh in q_heads} == set(kv_heads)  # its queries' K/V heads, all here


# ---- TP=2 on a real gloo group ----------------------------------------------------------------------

TP_CFGS = [ModelConfig(n_layers=8, d_model=64, n_heads=8, n_kv_heads=n, d_head=8, d_ffn=128, vocab_size=97,
                       max_position=64) for n in (1, 2, 8)]


def test_tp2_gqa_equals_tp1_with_sixteen_all_reduces():
    """One launch, three K/V head counts (MQA: each K/V head replicated on both ranks)."""
    lens = (10, 30)
    res = launch(forward_checks, world_size=2, backend="gloo", timeout=120, args=(TP_CFGS, 0, lens))
    batch, t = pack([torch.arange(n) % 97 for n in lens]), sum(lens)
    for i, cfg in enumerate(TP_CFGS):
        w = init_weights(cfg, 0)
        ref, ref64 = Transformer(cfg, w)(batch), Transformer(cfg, w, dtype=torch.float64)(batch)
        full_k = w["layers.0.attn.qkv.weight"].split([64, cfg.kv_dim, cfg.kv_dim])[1].unflatten(0, (cfg.n_kv_heads, 8))
        for rank in range(2):
            hidden, report, qkv_w = res.results[rank][i]
            assert_close(hidden, ref, ref64, f"TP=2 rank {rank}, n_kv_heads={cfg.n_kv_heads}")
            assert [r.layer for r in report.records] == expected_layers(cfg) and len(report.records) == 16
            assert all((r.op, r.shape) == ("all_reduce", (t, cfg.d_model)) for r in report.records)
            h_kv_local = max(cfg.n_kv_heads // 2, 1)
            assert report.qkv_shapes == [(t, (4 + 2 * h_kv_local) * 8)] * cfg.n_layers
            kv_heads = [0] if cfg.n_kv_heads == 1 else list(range(rank * h_kv_local, (rank + 1) * h_kv_local))
            torch.testing.assert_close(qkv_w[32:32 + h_kv_local * 8], full_k[kv_heads].flatten(0, 1), rtol=0, atol=0)


# ---- KV cache, flops, chunked prefill ---------------------------------------------------------------

def test_kv_cache_bytes_of_a_gqa_model():
    lens = [7, 19]
    bytes_of = {}
    for n_kv in (1, 2, 8):
        cfg = dataclasses.replace(GQA, n_kv_heads=n_kv)
        model = Transformer(cfg, init_weights(cfg, 0))
        cache = PrefillKVCache.for_model(model)
        assert cache.n_kv_heads == n_kv
        step = cache.step(["a", "b"], [0, 0], lens, [True, True])
        model(pack(make_requests(lens, cfg.vocab_size, 0)), kv_cache=step)
        step.finish()
        assert cache.nbytes == kv_cache_bytes(cfg, lens, bytes_per_element=4)  # n_kv_heads=None: the config's
        bytes_of[n_kv] = cache.nbytes
    assert bytes_of[8] == sum(lens) * GQA.n_layers * 2 * 8 * GQA.d_head * 4
    assert bytes_of[1] * 8 == bytes_of[2] * 4 == bytes_of[8]  # MHA bytes × n_kv_heads / n_heads


def test_chunked_prefill_with_gqa_equals_unchunked():
    cfg = dataclasses.replace(GQA, n_kv_heads=1)
    w = init_weights(cfg, 3)
    model, model64 = Transformer(cfg, w), Transformer(cfg, w, dtype=torch.float64)
    prompts = make_requests([40, 9, 25], cfg.vocab_size, 2)
    eng = Engine(cfg, weights=w, device="cpu", dtype=torch.float32, max_num_batched_tokens=16,
                 enable_chunked_prefill=True)
    outs = eng.prefill([Request(i, p, True) for i, p in enumerate(prompts)])
    assert eng.kv_cache_peak_bytes > 0  # the long prompts did run in chunks through the cache
    for o, p in zip(outs, prompts):
        batch = pack([torch.tensor(p)])
        assert_close(o.hidden, model(batch), model64(batch), f"chunked GQA request {o.request_id}")


# ---- refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    (0, "ModelConfig.n_kv_heads must be a positive int, got 0"),
    (-2, "ModelConfig.n_kv_heads must be a positive int, got -2"),
    (2.0, "ModelConfig.n_kv_heads must be a positive int, got 2.0"),
    (True, "ModelConfig.n_kv_heads must be a positive int, got True"),
    (3, r"ModelConfig.n_kv_heads=3 must divide n_heads=8 \(each K/V head serves a whole group"),
    (16, "ModelConfig.n_kv_heads=16 must divide n_heads=8"),
])
def test_config_refuses_bad_kv_head_counts(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(n_kv_heads=bad)


def test_bad_head_counts_refused_with_their_messages():
    with pytest.raises(ValueError, match=r"n_kv_heads=3 must divide n_heads=8 \(each K/V head serves a whole group"):
        QKVParallelLinear(64, 8, 8, 3)
    with pytest.raises(ValueError, match="n_kv_heads must be a positive int, got 0"):
        QKVParallelLinear(64, 8, 8, 0)
    with pytest.raises(ValueError, match="n_heads=8 is not divisible by tp_size=3"):
        QKVParallelLinear(64, 8, 8, 1, group=LocalGroup(0, 3))
    split = r"cannot split n_kv_heads=4 over the ranks: it must divide them, or be a multiple of them"
    with pytest.raises(ValueError, match="tp_size=6 " + split):
        QKVParallelLinear(96, 12, 8, 4, group=LocalGroup(0, 6))
    cfg = ModelConfig(n_heads=12, n_kv_heads=4, d_ffn=120)
    with pytest.raises(ValueError, match="tp_size=6 " + split):
        cfg.heads_per_rank(6)
    with pytest.raises(ValueError, match="group world_size=6 " + split):
        Transformer(dataclasses.replace(cfg, n_layers=1, vocab_size=10, max_position=8), group=LocalGroup(0, 6))
    with pytest.raises(ValueError, match="world_size=6 " + split):
        TPRuntime(cfg, world_size=6)  # refused before any worker starts
    assert cfg.heads_per_rank(4) == 3 and cfg.heads_per_rank(12) == 1  # 4 | 4 and 4 | 12: both fine
    with pytest.raises(ValueError, match="GPT-2 has no grouped-query attention: it needs n_kv_heads == n_heads, got "
                                         "n_kv_heads=2, n_heads=8"):
        hf_config(GQA)
    q, kv = torch.zeros(10, 4, 8), torch.zeros(10, 3, 8)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q's n_heads must be a multiple of k and v's n_kv_heads \(grouped-query "
                                         r"attention\), got n_heads=4, n_kv_heads=3"):
        varlen_attention(q, kv, kv, cu)
    with pytest.raises(ValueError, match="k and v must have the same n_kv_heads, got 2 and 1"):
        varlen_attention(q, torch.zeros(10, 2, 8), torch.zeros(10, 1, 8), cu)
