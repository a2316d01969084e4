"""The Triton varlen kernel (lessons_lib/ops/triton_varlen.py), here under Triton's interpreter.

Against the float64 reference by FlashAttention's rule (at most twice the error of PyTorch in the
same dtype) on the edge cases (FlashAttention's random length sets run it in tests/test_attention.py,
beside every other CPU backend) (R = 1, length 1, lengths
spanning several tiles, L_k > L_q), in every dtype; through strided views of a fused QKV; one
launch per call; the kernel's own work counters against ``tiling.predict_work``; bad input refused
as ``varlen_attention`` refuses it; the model, the engine and the TP workers running on it.
Sizes are chosen by programs launched (~10 ms each under the interpreter).
"""
from __future__ import annotations

import pytest
import torch
from helpers import make_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons_lib.core.attention import attention_ref, varlen_attention
from lessons_lib.core.batch import pack, seq_lens_to_cu_seqlens
from lessons_lib.core.kernels import available_backends, resolve_backend
from lessons_lib.core.model import Transformer
from lessons_lib.measure.tolerance import assert_close, reference_lse
from lessons_lib.ops import tiling

triton_varlen = pytest.importorskip("lessons_lib.ops.triton_varlen", reason="triton not installed (Linux wheels only)")
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(lens_q, lens_k=None, causal=True, dtype=torch.float32, heads=2, d_head=32, seed=0, **kw):
    q, k, v, cu_q, cu_k = make_qkv(lens_q, lens_k, heads=heads, d_head=d_head, seed=seed, dtype=dtype)
    out = triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, **kw)
    scale = kw.get("softmax_scale")
    ref64 = attention_ref(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale, upcast_dtype=torch.float64)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale, upcast_dtype=dtype)  # PyTorch, same dtype
    assert out.shape == q.shape and out.dtype == q.dtype
    return assert_close(out, ref, ref64, f"triton {dtype} {lens_q}")


def test_triton_is_available_on_the_cpu_but_never_auto():
    status = available_backends("cpu")["triton"]
    assert status.available, status.reason
    assert triton_varlen.INTERPRETED  # no GPU here: Triton's interpreter
    assert resolve_backend("auto", "cpu", torch.float32) != "triton"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", [
    ([1], None), ([37], None), ([200], None),            # R = 1: length 1, one tile, four tiles
    ([1, 130, 64, 65], None),                            # tile edges: 64 and 65 rows, 130 spans three tiles
    ([5, 20, 1], [9, 40, 3]),                            # L_k > L_q: bottom-right causal
], ids=["one-token", "one-tile", "four-tiles", "tile-edges", "more-keys"])
def test_every_dtype_against_fp64(case, dtype):
    for causal in (True, False):
        _check(*case, causal=causal, dtype=dtype, seed=7)


@pytest.mark.parametrize("d_head", [16, 40, 64, 128])
def test_head_dims_including_one_that_is_not_a_power_of_two(d_head):
    _check([10, 30], d_head=d_head, heads=1)


def test_small_tiles_and_odd_scale():
    _check([10, 30, 3], block_m=16, block_n=32, softmax_scale=0.3)


def test_views_of_a_fused_qkv_are_read_through_their_strides():
    """The model hands the kernel q, k, v as views of one [T, 3, H, D] tensor (row stride 3·H·D)."""
    lens = [10, 30]
    qkv = torch.randn(sum(lens), 3, 2, 32, generator=torch.Generator().manual_seed(3))
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    cu = seq_lens_to_cu_seqlens(lens)
    out = varlen_attention(q, k, v, cu, backend="triton")
    assert_close(out, attention_ref(q, k, v, cu), attention_ref(q, k, v, cu, upcast_dtype=torch.float64), "strided")


def test_edge_cases_have_their_defined_results():
    empty = torch.zeros(0, 2, 16)
    assert triton_varlen.triton_varlen_attention(empty, empty, empty, seq_lens_to_cu_seqlens([0])).shape == (0, 2, 16)
    q, k, v, cu_q, cu_k = make_qkv([3, 0, 4], heads=2, d_head=16)  # a zero-length request in the middle
    out = triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k)
    assert_close(out, attention_ref(q, k, v, cu_q), attention_ref(q, k, v, cu_q, upcast_dtype=torch.float64), "empty req")
    q, k, v, cu_q, cu_k = make_qkv([2], [0], heads=2, d_head=16)    # no key at all (non-causal): zeros
    assert torch.equal(triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=False), torch.zeros_like(q))


@pytest.mark.parametrize("num_requests", [1, 7, 50])
def test_one_launch_per_call_whatever_the_number_of_requests(num_requests):
    lens = [1 + (7 * i) % 13 for i in range(num_requests)]
    q, k, v, cu, _ = make_qkv(lens, heads=2, d_head=16)
    real = triton_varlen._varlen_fwd_kernel
    with triton_varlen.count_launches() as grids:
        varlen_attention(q, k, v, cu, backend="triton")
    assert grids == [(1, 2, num_requests)]  # (query tiles, heads, requests)
    assert triton_varlen._varlen_fwd_kernel is real  # the counter is gone after the block


def test_counters_equal_the_prediction_on_the_article_example():
    lens = [10, 30]
    q, k, v, cu, _ = make_qkv(lens, heads=8, d_head=64)
    with triton_varlen.count_work() as w:
        triton_varlen.triton_varlen_attention(q, k, v, cu, block_m=16, block_n=16)
    assert w == tiling.predict_work(lens, n_heads=8, block_m=16, block_n=16)
    # 2 query tiles per request (grid sized by B's 30), A's second tile returns at once (one per head);
    # B's first tile skips its second key tile (above the diagonal).
    assert (w.programs, w.early_exits, w.tiles, w.tiles_skipped) == (32, 8, 32, 8)
    assert w.cells == 8 * (10 * 10 + 16 * 16 + 14 * 30)


@settings(max_examples=12, deadline=None)
@given(lens=st.lists(st.integers(0, 90), min_size=1, max_size=5), extra=st.lists(st.integers(0, 40), min_size=5, max_size=5),
       blocks=st.sampled_from([(16, 16), (16, 64), (32, 16), (64, 64)]), causal=st.booleans())
def test_counters_equal_the_prediction_on_drawn_lengths_and_tiles(lens, extra, blocks, causal):
    lens_k = [n + e for n, e in zip(lens, extra)]
    q, k, v, cu_q, cu_k = make_qkv(lens, lens_k, heads=1, d_head=16)
    with triton_varlen.count_work() as w:
        triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, block_m=blocks[0], block_n=blocks[1])
    assert w == tiling.predict_work(lens, lens_k, 1, block_m=blocks[0], block_n=blocks[1], causal=causal)


def test_count_work_adds_up_launches_and_is_off_outside_the_block():
    q, k, v, cu, _ = make_qkv([10, 30], heads=2, d_head=16)
    with triton_varlen.count_work() as w:
        for _ in range(3):
            varlen_attention(q, k, v, cu, backend="triton")
    assert w.programs == 3 * tiling.predict_work([10, 30], n_heads=2).programs == 12
    assert not triton_varlen._ACTIVE
    with triton_varlen.count_work() as w2:
        pass
    assert w2.programs == 0


BAD = [
    ("cu-int64", dict(cu_q=torch.tensor([0, 10, 40]))),
    ("max-seqlen-short", dict(max_seqlen_q=29)),
    ("causal-short-k", dict(k=torch.zeros(30, 2, 16), v=torch.zeros(30, 2, 16), cu_k=torch.tensor([0, 10, 30], dtype=torch.int32))),
    ("nan-q", dict(q=torch.full((40, 2, 16), float("nan")))),
    ("dtype-mix", dict(k=torch.zeros(40, 2, 16, dtype=torch.float64))),
    ("heads", dict(k=torch.zeros(40, 3, 16), v=torch.zeros(40, 3, 16))),
]


@pytest.mark.parametrize("name,kw", BAD, ids=[b[0] for b in BAD])
def test_bad_input_refused_with_the_same_message_as_varlen_attention(name, kw):
    q, k, v, cu, _ = make_qkv([10, 30], heads=2, d_head=16)
    args = dict(q=q, k=k, v=v, cu_q=cu, cu_k=None) | kw
    call = lambda fn, **extra: fn(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"],
                                  max_seqlen_q=kw.get("max_seqlen_q"), **extra)
    with pytest.raises(ValueError) as ours:
        call(triton_varlen.triton_varlen_attention)
    with pytest.raises(ValueError) as theirs:
        call(varlen_attention, backend="sdpa")
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kw,message", [
    (dict(block_m=48), r"block_m must be a power of two in \[16, 256\]"),
    (dict(block_n=8), r"block_n must be an int in \[16, 256\], got 8"),
    (dict(dtype=torch.float64), "the triton kernel takes float32, float16 or bfloat16, got float64"),
    (dict(d_head=320), "the triton kernel takes head dim <= 256, got 320"),
])
def test_what_only_the_kernel_refuses(kw, message):
    q, k, v, cu, _ = make_qkv([10, 30], heads=1, d_head=kw.pop("d_head", 16), dtype=kw.pop("dtype", torch.float32))
    with pytest.raises(ValueError, match=message):
        triton_varlen.triton_varlen_attention(q, k, v, cu, **kw)


def test_backend_refuses_head_dims_past_256_by_name():
    assert not available_backends("cpu", torch.float32, 320)["triton"].available


def test_model_and_engine_run_on_the_kernel(tiny_cfg, model_pair, make_requests):
    from lessons_lib.serve.engine import Engine

    model, model64 = model_pair(tiny_cfg, 1)
    reqs = make_requests([1, 10, 30, 70], tiny_cfg.vocab_size, seed=4)
    batch = pack(reqs)
    out = model(batch, attn_backend="triton")
    assert_close(out, model(batch, attn_backend="sdpa"), model64(pack(reqs), attn_backend="loop"), "model on triton")
    with Engine(tiny_cfg, attn_backend="triton", weights=model.state_dict(), max_num_batched_tokens=128) as engine:
        got = engine.prefill([r.tolist() for r in reqs])
    ref = [h[-1] for h in model64.forward_each(reqs, attn_backend="loop")]
    for o, r, want in zip(got, reqs, ref):
        assert_close(o.last_hidden, model.forward_each([r], attn_backend="sdpa")[0][-1], want, f"engine {len(r)}")


def test_tp2_workers_run_the_kernel(tiny_cfg, model_pair, make_requests):
    """Spawned TP workers import the kernel (and switch Triton to its interpreter) themselves."""
    from lessons_lib.tp.runtime import tp_forward

    model, model64 = model_pair(tiny_cfg, 2)
    reqs = make_requests([10, 30], tiny_cfg.vocab_size, seed=5)
    result = tp_forward(pack(reqs), cfg=tiny_cfg, weights=model.state_dict(), attn_backend="triton",
                        backend="gloo", timeout=120, verbose=False)
    assert_close(result.output, model(pack(reqs), attn_backend="sdpa"), model64(pack(reqs), attn_backend="loop"), "TP=2 triton")
    assert result.all_reduce_counts[0] == 2 * tiny_cfg.n_layers


def test_a_model_on_the_kernel_is_one_launch_per_layer(tiny_cfg, make_requests):
    reqs = make_requests([3, 9, 17, 2, 5], tiny_cfg.vocab_size)
    with triton_varlen.count_launches() as grids:
        Transformer(tiny_cfg)(pack(reqs), attn_backend="triton")
    assert len(grids) == tiny_cfg.n_layers and set(grids) == {(1, tiny_cfg.n_heads, 5)}


# ---- grouped-query attention: both layouts -----------------------------------------------------------------

def _gqa_inputs(lens_q, lens_k, heads, kv_heads, d_head=16, dtype=torch.float32, seed=0, fused=False):
    """q ``[T_q, H, D]``, k, v ``[T_k, H_kv, D]`` (views of one fused ``[T, H + 2 H_kv, D]`` when ``fused``)."""
    g = torch.Generator().manual_seed(seed)
    if fused:
        qkv = torch.randn(sum(lens_q), heads + 2 * kv_heads, d_head, generator=g).to(dtype)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    else:
        q = torch.randn(sum(lens_q), heads, d_head, generator=g).to(dtype)
        k, v = (torch.randn(sum(lens_k), kv_heads, d_head, generator=g).to(dtype) for _ in range(2))
    return q, k, v, seq_lens_to_cu_seqlens(lens_q), seq_lens_to_cu_seqlens(lens_k)


def _repeat_kv(q, k, v):
    """The GQA reference's inputs: each K/V head repeated for the G query heads it serves (MHA afterwards)."""
    g = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


def _check_gqa(lens_q, lens_k, heads, kv_heads, *, causal, dtype=torch.float32, pack_gqa=None, fused=False, **kw):
    q, k, v, cu_q, cu_k = _gqa_inputs(lens_q, lens_k, heads, kv_heads, dtype=dtype, fused=fused)
    out = triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, pack_gqa=pack_gqa, **kw)
    qr, kr, vr = _repeat_kv(q, k, v)
    ref64 = attention_ref(qr, kr, vr, cu_q, cu_k, causal=causal, upcast_dtype=torch.float64)
    ref = attention_ref(qr, kr, vr, cu_q, cu_k, causal=causal, upcast_dtype=dtype)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, ref64, f"triton {dtype} H={heads} H_kv={kv_heads} pack={pack_gqa} causal={causal}")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("pack_gqa", [False, True], ids=["per-head", "pack"])
def test_gqa_both_layouts_against_fp64(kv_heads, pack_gqa, dtype):
    for causal in (True, False):  # L_k > L_q, a request of one token, tiles of 16: diagonal and partial tiles
        _check_gqa([5, 20, 1], [9, 40, 3], 4, kv_heads, causal=causal, dtype=dtype, pack_gqa=pack_gqa,
                   block_m=16, block_n=16)


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["per-head", "pack"])
def test_gqa_group_of_three_spans_tile_edges(pack_gqa):
    """G = 3 does not divide BLOCK_M: a packed tile's rows start and end inside a token's group."""
    _check_gqa([7, 30], [7, 30], 6, 2, causal=True, pack_gqa=pack_gqa, block_m=16, block_n=16)


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["per-head", "pack"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gqa_views_of_a_fused_qkv_with_fewer_kv_heads(pack_gqa, dtype):
    """The K/V part of the fused projection has H_kv < H heads: row stride (H + 2 H_kv)·D for all three."""
    q, k, _, _, _ = _gqa_inputs([3], [3], 4, 2, fused=True)
    assert q.stride(0) == k.stride(0) == (4 + 2 * 2) * 16 and not q.is_contiguous()
    _check_gqa([10, 30], [10, 30], 4, 2, causal=True, dtype=dtype, pack_gqa=pack_gqa, fused=True, block_m=16)


HEADS = [(1, 1), (2, 1), (3, 1), (4, 2), (6, 2)]


@settings(max_examples=12, deadline=None)
@given(lens=st.lists(st.integers(0, 60), min_size=1, max_size=4), extra=st.lists(st.integers(0, 30), min_size=4, max_size=4),
       blocks=st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 64)]), causal=st.booleans(),
       heads=st.sampled_from(HEADS), pack_gqa=st.booleans())
def test_gqa_counters_equal_the_prediction_in_both_layouts(lens, extra, blocks, causal, heads, pack_gqa):
    lens_k = [n + e for n, e in zip(lens, extra)]
    q, k, v, cu_q, cu_k = _gqa_inputs(lens, lens_k, *heads)
    with triton_varlen.count_work() as w:
        triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, pack_gqa=pack_gqa,
                                              block_m=blocks[0], block_n=blocks[1])
    want = tiling.predict_work(lens, lens_k, heads[0], n_kv_heads=heads[1], pack_gqa=pack_gqa, block_m=blocks[0],
                               block_n=blocks[1], causal=causal)
    assert w == want and w.masked_tiles == want.masked_tiles


@settings(max_examples=10, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=3), extra=st.lists(st.integers(0, 20), min_size=3, max_size=3),
       heads=st.sampled_from(HEADS + [(4, 4), (8, 1)]), d_head=st.sampled_from([8, 16, 24, 64]), causal=st.booleans(),
       pack_gqa=st.booleans(), dtype=st.sampled_from(ALL_DTYPES))
def test_gqa_drawn_cases_against_fp64(lens, extra, heads, d_head, causal, pack_gqa, dtype):
    """Drawn (H_q, H_kv, D, lengths, L_k >= L_q) in both layouts, MHA and MQA included, by FlashAttention's rule."""
    lens_k = [n + e for n, e in zip(lens, extra)]
    if sum(lens) == 0 or sum(lens_k) == 0:
        lens, lens_k = [max(1, n) for n in lens], [max(1, n) for n in lens_k]
    q, k, v, cu_q, cu_k = _gqa_inputs(lens, lens_k, *heads, d_head=d_head, dtype=dtype)
    out = triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, pack_gqa=pack_gqa, block_m=16, block_n=16)
    qr, kr, vr = _repeat_kv(q, k, v)
    ref64 = attention_ref(qr, kr, vr, cu_q, cu_k, causal=causal, upcast_dtype=torch.float64)
    ref = attention_ref(qr, kr, vr, cu_q, cu_k, causal=causal, upcast_dtype=dtype)
    assert_close(out, ref, ref64, f"triton {dtype} H={heads} D={d_head} pack={pack_gqa} causal={causal} {lens}/{lens_k}")


def test_pack_gqa_loads_each_kv_tile_once_for_the_group():
    """Decode-like queries (one token per request, 8 query heads on 2 K/V heads): per head, every query
    tile is one real row and loads all its request's K/V tiles; packed, one tile holds the group's 4 rows."""
    lens, lens_k = [1, 1, 1], [100, 40, 64]
    q, k, v, cu_q, cu_k = _gqa_inputs(lens, lens_k, 8, 2)
    got = {}
    for packed in (False, True):
        with triton_varlen.count_work() as w, triton_varlen.count_launches() as grids:
            triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=True, pack_gqa=packed)
        got[packed] = (w, grids)
    per_head, packed = got[False][0], got[True][0]
    assert got[False][1] == [(1, 8, 3)] and got[True][1] == [(1, 2, 3)]
    assert per_head.tiles == 8 * (2 + 1 + 1) and packed.tiles == 2 * (2 + 1 + 1)   # K/V tile loads: 4x fewer
    assert per_head.kv_bytes_read(16, 4) == 4 * packed.kv_bytes_read(16, 4)
    assert per_head.cells == packed.cells == 8 * (100 + 40 + 64)                     # the same useful work
    with triton_varlen.count_launches() as grids:  # pack_gqa=None takes the predictor's pick: packed here
        triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert grids == [(1, 2, 3)] and tiling.choose_pack_gqa(1, 100, 4, 64, 64, True)


def test_choose_pack_gqa_follows_the_predicted_kv_loads():
    assert not tiling.choose_pack_gqa(100, 100, 1, 64, 64, True)    # MHA: nothing to pack
    assert not tiling.choose_pack_gqa(128, 128, 4, 64, 64, False)   # full tiles, no mask: the same loads
    assert tiling.choose_pack_gqa(10, 10, 4, 64, 64, False)         # 10 rows of 64 per head: packed fills 40
    assert not tiling.choose_pack_gqa(256, 256, 4, 64, 64, True)    # causal, BLOCK_M = BLOCK_N: 4 x 10 tiles either way
    assert tiling.choose_pack_gqa(256, 256, 4, 128, 64, True)       # BLOCK_M = 2 BLOCK_N: packed 4 x (1+1+2+2+3+3+4+4)
    assert tiling.predict_work([256], n_heads=4, n_kv_heads=1, pack_gqa=False, block_m=128).tiles == 4 * (2 + 4)


# ---- the fast paths: masked tiles, log-sum-exp ----------------------------------------------------------------

@pytest.mark.parametrize("causal,length,tiles,masked", [
    (True, 200, 13 * 14 // 2, 13),   # 13 query tiles of 16; tile m computes m + 1 key tiles, the diagonal one masked
    (False, 200, 13 * 13, 13),       # every tile computes 13 key tiles, only the partial last one (8 keys) masked
    (False, 192, 12 * 12, 0),        # 192 = 12 x 16: no partial tile, no mask at all
    (True, 192, 12 * 13 // 2, 12),
])
def test_only_the_diagonal_and_partial_tiles_take_the_masked_path(causal, length, tiles, masked):
    q, k, v, cu, _ = make_qkv([length], heads=1, d_head=16)
    with triton_varlen.count_work() as w:
        out = triton_varlen.triton_varlen_attention(q, k, v, cu, causal=causal, block_m=16, block_n=16)
    assert (w.tiles, w.masked_tiles) == (tiles, masked)
    assert w.as_dict() == tiling.predict_work([length], block_m=16, block_n=16, causal=causal).as_dict()
    assert_close(out, attention_ref(q, k, v, cu, causal=causal),
                 attention_ref(q, k, v, cu, causal=causal, upcast_dtype=torch.float64), "two-stage loop")


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["per-head", "pack"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_return_lse_is_the_logsumexp_of_the_scaled_scores(dtype, pack_gqa):
    lens_q, lens_k = [5, 20, 1], [9, 40, 3]
    q, k, v, cu_q, cu_k = _gqa_inputs(lens_q, lens_k, 4, 2, dtype=dtype)
    for causal in (True, False):
        out, lse = triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=0.3,
                                                         pack_gqa=pack_gqa, block_m=16, block_n=16, return_lse=True)
        assert lse.shape == (4, sum(lens_q)) and lse.dtype == torch.float32
        assert torch.equal(out, triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=0.3,
                                                                      pack_gqa=pack_gqa, block_m=16, block_n=16))
        want = reference_lse(q, k, cu_q, cu_k, causal=causal, softmax_scale=0.3)   # float64, [H, T_q]
        tol = 1e-5 if dtype == torch.float32 else 1e-4   # from fp32 sums of products of exact half-precision inputs
        assert (lse.double() - want).abs().max() <= tol * want.abs().max().clamp(min=1)
    q, k, v, cu_q, cu_k = make_qkv([2], [0], heads=2, d_head=16)   # no key at all: logsumexp of nothing
    _, lse = triton_varlen.triton_varlen_attention(q, k, v, cu_q, cu_k, causal=False, return_lse=True)
    assert torch.equal(lse, torch.full((2, 2), float("-inf")))


# ---- 64-bit offsets ------------------------------------------------------------------------------------------

def test_offsets_past_two_to_the_31_elements_are_64_bit():
    """Token index x row stride passes 2**31: q, k, v are strided views into a > 2**31-element (4 GiB)
    fp16 allocation, one row every 2**22 elements, starting 2**31 elements in. Triton's interpreter does
    not copy a CPU tensor's storage (it wraps it, and its copy back onto itself is a no-op), and untouched
    pages are never resident, so only the 2 x 600 written rows cost memory. With 32-bit offsets, row 512
    and beyond (512 x 2**22 = 2**31) wraps to a NEGATIVE offset, 4 GiB back: still inside the allocation
    (hence the 2**31-element lead), so the kernel reads zeros instead of crashing, and the output differs."""
    stride, lead, n = 1 << 22, 1 << 31, 600
    big = torch.empty(lead + n * stride, dtype=torch.float16)
    rows = big[lead:].as_strided((n, 2, 16), (stride, 16, 1))  # q in [:, 0], k = v in [:, 1]
    g = torch.Generator().manual_seed(0)
    rows.copy_(torch.randn(n, 2, 16, generator=g).to(torch.float16))
    q, k = rows[:, :1], rows[:, 1:]
    assert q.stride(0) * (n - 1) > 2**31 and big.untyped_storage().nbytes() > 2 * 2**31
    cu = seq_lens_to_cu_seqlens([n])
    out = triton_varlen.triton_varlen_attention(q, k, k, cu, causal=False, block_m=64, block_n=64)
    qc, kc = q.contiguous(), k.contiguous()
    assert_close(out, attention_ref(qc, kc, kc, cu, causal=False),
                 attention_ref(qc, kc, kc, cu, causal=False, upcast_dtype=torch.float64), "int64 offsets")


def test_float32_is_refused_on_cuda_by_name():
    with pytest.raises(ValueError, match="on CUDA takes float16 or bfloat16 .*got float32"):
        triton_varlen.launch_config(64, torch.float32, 80)
    with pytest.raises(ValueError, match="compute capability >= sm80"):
        triton_varlen.launch_config(64, torch.float16, 75)
    assert triton_varlen.launch_config(64, torch.float32, None) == (64, 64, 4, 1)   # the interpreter keeps 64 x 64
