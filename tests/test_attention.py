"""Varlen attention (attention.py): every backend against the reference, FlashAttention-style
random length sets, the contamination of plain attention (C7), the cells each backend really
computes (C8, C10), and the "loop never builds a [T x T] tensor" promise."""
import math
import random

import pytest
import torch

from lessons_lib.core.attention import attention_ref, block_diag_mask, padded_attention, plain_attention, varlen_attention
from lessons_lib.core.batch import pad, seq_lens_to_cu_seqlens
from lessons_lib.core.kernels import BACKENDS, available_backends, resolve_backend
from lessons_lib.measure.flops import attention_cells
from lessons_lib.measure.recorder import OpRecorder
from lessons_lib.measure.tolerance import assert_close

CPU_OK = [b for b, s in available_backends("cpu").items() if s.available]
DENSE_OK = [b for b in CPU_OK if b != "flex"]  # flex is eager on the CPU: 17-140x slower, small cases only


def _length_sets():
    """FlashAttention's test recipe: random lengths, including 1, odd ones and one long + many short."""
    rng = random.Random(1234)
    return {
        "ones": [1] * 13,
        "odd": [2 * rng.randrange(0, 90) + 1 for _ in range(11)],
        "one_long_many_short": [400] + [rng.randint(1, 40) for _ in range(30)],
        "few_thousand_random": [rng.randint(1, 150) for _ in range(40)],
        "duplicates": [7, 7, 7, 64, 64, 1, 1],
    }


LENGTH_SETS = _length_sets()


def _check_against_ref(backend, q, k, v, cu_q, cu_k, causal):
    out = varlen_attention(q, k, v, cu_q, cu_k, causal=causal, backend=backend)
    ref64 = attention_ref(q, k, v, cu_q, cu_k, causal=causal, upcast_dtype=torch.float64)
    ref32 = attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref32, ref64, backend)  # at most 2x the fp32 reference's error + floor


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(LENGTH_SETS))
def test_c10_dense_backends_match_attention_ref_on_random_lengths(name, causal, make_qkv):
    """Tolerance, FlashAttention's method: |backend - ref64| <= 2 |ref32 - ref64| + 2 ulp. fp32
    softmax-weighted sums of L terms carry ~sqrt(L) ulp of rounding whichever order they are
    summed in; a backend that is as good as the fp32 reference passes, a wrong mask is off by O(1)."""
    lens = LENGTH_SETS[name]
    q, k, v, cu, _ = make_qkv(lens, heads=2, d_head=32, seed=len(lens))
    for backend in DENSE_OK:
        _check_against_ref(backend, q, k, v, cu, cu, causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_c10_flex_backend_matches_attention_ref_on_small_batches(causal, make_qkv):
    assert "flex" in CPU_OK, available_backends("cpu")["flex"].reason
    for lens in ([1, 5, 2], [17, 1, 33, 4], [64]):
        q, k, v, cu, _ = make_qkv(lens, heads=2, d_head=16, seed=sum(lens))
        _check_against_ref("flex", q, k, v, cu, cu, causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_bottom_right_causal_when_keys_outnumber_queries(causal, make_qkv):
    """cu_seqlens_k != cu_seqlens_q: query i of a request sees keys up to i + L_k - L_q (FlashAttention >= 2.1)."""
    lens_q, lens_k = [1, 4, 9, 1, 30], [5, 4, 20, 1, 31]
    q, k, v, cu_q, cu_k = make_qkv(lens_q, lens_k, heads=2, d_head=16, seed=5)
    for backend in CPU_OK:
        _check_against_ref(backend, q, k, v, cu_q, cu_k, causal)


def _naive_attention(q, k, v, lens_q, lens_k, causal):
    """Independent fp64 reference, one query row at a time, mask written from the definition."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    sq = sk = 0
    for lq, lk in zip(lens_q, lens_k):
        for i in range(lq):
            keys = [j for j in range(lk) if not causal or j <= i + lk - lq]
            for h in range(q.shape[1]):
                if not keys:
                    continue
                s = torch.stack([q[sq + i, h].double() @ k[sk + j, h].double() for j in keys]) / math.sqrt(q.shape[2])
                out[sq + i, h] = torch.softmax(s, 0) @ v[[sk + j for j in keys], h].double()
        sq, sk = sq + lq, sk + lk
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_ref_matches_a_naive_per_query_loop(causal, make_qkv):
    """attention_ref is the yardstick for every other test, so it is checked against the definition."""
    lens_q, lens_k = [1, 3, 6, 2], [2, 3, 9, 2]
    q, k, v, cu_q, cu_k = make_qkv(lens_q, lens_k, heads=2, d_head=8, seed=9)
    ref = attention_ref(q, k, v, cu_q, cu_k, causal=causal, upcast_dtype=torch.float64)
    assert (ref - _naive_attention(q, k, v, lens_q, lens_k, causal)).abs().max().item() < 1e-12


def test_gpu_backends_are_reported_and_refused_or_agree(make_qkv):
    """flash / torch_varlen run only on CUDA in fp16/bf16. Here: each is either unavailable with a
    reason and refused by name, or (on a CUDA machine) checked in bf16 against the fp64 reference."""
    lens = [1, 37, 5, 200, 3]
    for backend in ("flash", "torch_varlen"):
        status = available_backends("cpu")[backend]
        assert not status.available and status.reason
        q, k, v, cu, _ = make_qkv(lens)
        with pytest.raises(RuntimeError, match=rf"attention backend '{backend}' is not available here: \S"):
            varlen_attention(q, k, v, cu, backend=backend)
        if torch.cuda.is_available() and available_backends("cuda", torch.bfloat16)[backend].available:
            q, k, v, cu, _ = make_qkv(lens, dtype=torch.bfloat16, device="cuda")
            for causal in (True, False):
                out = varlen_attention(q, k, v, cu, causal=causal, backend=backend).double()
                ref64 = attention_ref(q, k, v, cu, causal=causal, upcast_dtype=torch.float64)
                ref_low = attention_ref(q, k, v, cu, causal=causal, upcast_dtype=torch.bfloat16)
                bf16_eps = torch.finfo(torch.bfloat16).eps
                tol = 2 * (ref_low.double() - ref64).abs().max().item() + 2 * bf16_eps
                assert (out - ref64).abs().max().item() <= tol


def test_auto_picks_the_per_request_sdpa_loop_on_cpu():
    """On the CPU, SDPA on 4-D per-request views (equal lengths batched) is the fastest exact path."""
    assert resolve_backend("auto", "cpu", torch.float32) == "sdpa"
    assert set(BACKENDS) == {"loop", "masked", "padded", "sdpa", "flex", "flash", "torch_varlen", "triton"}
    assert {"loop", "masked", "padded", "sdpa"} <= set(CPU_OK)


def test_block_diag_mask_matches_request_ids():
    lens = [2, 3, 1]
    cu = seq_lens_to_cu_seqlens(lens)
    rid = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))  # request of each row
    pos = torch.cat([torch.arange(n) for n in lens])                     # position inside it
    same = rid[:, None] == rid[None, :]
    assert torch.equal(block_diag_mask(cu), same)
    assert torch.equal(block_diag_mask(cu, causal=True), same & (pos[None, :] <= pos[:, None]))


def test_c7_plain_attention_lets_a_read_b(make_qkv):
    """Plain (non-causal) attention over the flat 40 rows gives A a different answer than A alone:
    it is exactly attention of A's queries over all 40 keys. With a causal mask, A (first in the
    batch) happens to be safe, but B's queries read A's keys: the bug only hides, it does not go away."""
    q, k, v, cu, _ = make_qkv([10, 30], heads=8, d_head=64, seed=7)
    i32 = torch.int32

    def ref(rows_q, rows_k, causal):  # fp32 and fp64 references for one request of those rows
        cq, ck = torch.tensor([0, len(rows_q)], dtype=i32), torch.tensor([0, len(rows_k)], dtype=i32)
        args = (q[rows_q], k[rows_k], v[rows_k], cq, ck)
        return attention_ref(*args, causal=causal), attention_ref(*args, causal=causal, upcast_dtype=torch.float64)

    a, b, everything = list(range(10)), list(range(10, 40)), list(range(40))
    plain = plain_attention(q, k, v, causal=False)
    a32, a64 = ref(a, a, causal=False)
    diff_a = (plain[:10].double() - a64).abs().max().item()
    print(f"C7: plain attention over 40 rows moves A's output by up to {diff_a:.3f} "
          f"(|A alone| up to {a64.abs().max().item():.3f})")
    assert diff_a > 0.1  # not rounding: a different answer
    all32, all64 = ref(a, everything, causal=False)  # A's queries over A's AND B's keys
    assert_close(plain[:10], all32, all64, "plain attention = A's queries over all 40 keys")
    varlen = varlen_attention(q, k, v, cu, causal=False, backend="sdpa")
    assert_close(varlen[:10], a32, a64, "varlen: A as if alone")

    plain_causal = plain_attention(q, k, v, causal=True)
    ca32, ca64 = ref(a, a, causal=True)
    assert_close(plain_causal[:10], ca32, ca64, "causal plain attention: A (first) is safe")
    _, b64 = ref(b, b, causal=True)
    assert (plain_causal[10:].double() - b64).abs().max().item() > 0.1


def test_c10_each_backend_computes_the_cells_it_promises(make_qkv):
    """The softmax input of each backend IS its score tensor: loop computes only the diagonal blocks
    (100 + 900 cells per head for A=10, B=30), masked all 1600, padded 2 x 30^2 = 1800."""
    q, k, v, cu, _ = make_qkv([10, 30], heads=8, d_head=8)
    cells = {}
    for backend, method in (("loop", "varlen"), ("masked", "masked"), ("padded", "padded")):
        with OpRecorder() as rec:
            varlen_attention(q, k, v, cu, causal=False, backend=backend)
        cells[backend] = rec.cells // 8  # per head
        assert cells[backend] == attention_cells([10, 30], method).computed
    assert cells == {"loop": 1000, "masked": 1600, "padded": 1800}


def test_c10_each_output_lands_in_its_own_slice(make_qkv):
    """cu_seqlens is the only request-aware input: rewriting B's rows leaves A's output bit-identical."""
    q, k, v, cu, _ = make_qkv([10, 30], heads=2, d_head=16)
    out = varlen_attention(q, k, v, cu, backend="loop")
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[10:] = torch.randn_like(t[10:])
    out2 = varlen_attention(q2, k2, v2, cu, backend="loop")
    assert torch.equal(out[:10], out2[:10]) and not torch.equal(out[10:], out2[10:])


def test_loop_never_allocates_a_t_by_t_tensor(make_qkv):
    """16 requests x 256 tokens (T = 4096): every tensor created by "loop" is recorded; none has
    T*T elements or a [T, T] shape (its biggest score block is [H, 256, 256]); "masked" builds
    [H, T, T] scores and a [T, T] mask."""
    lens = [256] * 16
    t = sum(lens)
    q, k, v, cu, _ = make_qkv(lens, heads=2, d_head=16)
    seen = {}
    for backend in ("loop", "masked"):
        with OpRecorder() as rec:
            varlen_attention(q, k, v, cu, causal=True, backend=backend)
        seen[backend] = rec.outputs
    loop_max = max(math.prod(s) for _, s in seen["loop"])
    assert loop_max < t * t and not any(s[-2:] == (t, t) for _, s in seen["loop"])
    assert {s for _, s in seen["loop"] if len(s) == 3 and s[1] == s[2]} == {(2, 256, 256)}  # [H, L_i, L_i] scores
    assert any(s == (2, t, t) for _, s in seen["masked"]) and any(s == (t, t) for _, s in seen["masked"])
    print(f"largest tensor: loop {loop_max} elements, masked {max(math.prod(s) for _, s in seen['masked'])}")


def test_padded_attention_valid_rows_equal_varlen(make_qkv):
    lens = [3, 8, 1]
    q, k, v, cu, _ = make_qkv(lens, heads=2, d_head=16)
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    (qp, mask), (kp, _), (vp, _) = (pad([t[s:e].flatten(1) for s, e in spans]) for t in (q, k, v))  # [R, S, H*D]
    qp, kp, vp = (t.unflatten(-1, (2, 16)) for t in (qp, kp, vp))  # [R, S, H, D]
    out = padded_attention(qp, kp, vp, mask)
    ref64 = attention_ref(q, k, v, cu, upcast_dtype=torch.float64)
    ref32 = attention_ref(q, k, v, cu)
    assert_close(out[mask], ref32, ref64, "padded attention, valid rows")
