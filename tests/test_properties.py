"""Property-based equivalence (hypothesis) over random request-length lists and seeds.

Length lists mix the shapes that break varlen code: length 1, many tiny requests, one huge
request among tiny ones, duplicates, in any order. Default: 25 examples per property (model:
15, one forward per request each; flex: 5, eager and slow on the CPU), deadline off.
Set LESSONS_PROPERTY_EXAMPLES=500 for a deeper local run.
"""
import os

import pytest
import torch
from helpers import make_qkv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lessons_lib.core.attention import attention_ref, block_diag_mask, varlen_attention
from lessons_lib.core.batch import pack, pad, pad_input, seq_lens_to_cu_seqlens, unpack, unpad_input
from lessons_lib.core.kernels import available_backends
from lessons_lib.measure.flops import attention_cells
from lessons_lib.measure.tolerance import assert_close, tolerance

N = int(os.environ.get("LESSONS_PROPERTY_EXAMPLES", "25"))
CI = settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                     HealthCheck.data_too_large])
# flex (eager) and triton (Triton's interpreter) are slow on the CPU: each is held to the rule on sized cases elsewhere
FAST = [b for b, s in available_backends("cpu").items() if s.available and b not in ("flex", "triton")]

_tiny = st.integers(1, 8)
LENGTHS = st.one_of(
    st.lists(st.integers(1, 64), min_size=1, max_size=8),                              # mixed
    st.lists(_tiny, min_size=1, max_size=40),                                          # many tiny
    st.builds(lambda big, rest: [big, *rest], st.integers(100, 300), st.lists(_tiny, max_size=10)),  # one huge
    st.lists(st.sampled_from([1, 3, 16]), min_size=2, max_size=12),                    # duplicates
).flatmap(st.permutations)
SEEDS = st.integers(0, 2**31 - 1)


@st.composite
def q_and_k_lengths(draw, lengths=LENGTHS):
    """Query lengths, and key lengths >= them (bottom-right causal) or equal to them."""
    lens_q = draw(lengths)
    if draw(st.booleans()):
        return lens_q, lens_q
    extra = draw(st.lists(st.integers(0, 5), min_size=len(lens_q), max_size=len(lens_q)))
    return lens_q, [q + e for q, e in zip(lens_q, extra)]


def _assert_backends_match_ref(backends, lens, seed, causal):
    q, k, v, cu_q, cu_k = make_qkv(*lens, heads=2, d_head=16, seed=seed)
    ref64 = attention_ref(q, k, v, cu_q, cu_k, causal=causal, upcast_dtype=torch.float64)
    ref32 = attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    for backend in backends:
        assert_close(varlen_attention(q, k, v, cu_q, cu_k, causal=causal, backend=backend), ref32, ref64, backend)


@CI
@given(lens=q_and_k_lengths(), seed=SEEDS, causal=st.booleans())
def test_prop_every_fast_backend_matches_attention_ref(lens, seed, causal):
    _assert_backends_match_ref(FAST, lens, seed, causal)


@settings(CI, max_examples=max(1, N // 5))
@given(lens=q_and_k_lengths(st.lists(st.integers(1, 24), min_size=1, max_size=5)), seed=SEEDS,
       causal=st.booleans())
def test_prop_flex_matches_attention_ref(lens, seed, causal):
    _assert_backends_match_ref(["flex"], lens, seed, causal)


@CI
@given(lens=LENGTHS, seed=SEEDS)
def test_prop_max_seqlen_too_small_is_an_error_never_a_truncation(lens, seed):
    q, k, v, cu, _ = make_qkv(lens, heads=2, d_head=16, seed=seed)
    longest = max(lens)
    with pytest.raises(ValueError, match=rf"max_seqlen_q={longest - 1} is smaller than the longest request"):
        varlen_attention(q, k, v, cu, max_seqlen_q=longest - 1, backend="sdpa")
    exact = varlen_attention(q, k, v, cu, backend="sdpa")
    assert torch.equal(varlen_attention(q, k, v, cu, max_seqlen_q=longest + seed % 7, max_seqlen_k=longest,
                                        backend="sdpa"), exact)  # an upper bound changes nothing


@pytest.fixture(scope="module")
def models(tiny_cfg, model_pair):
    return model_pair(tiny_cfg, 11)


@settings(CI, max_examples=max(1, 3 * N // 5))
@given(lens=LENGTHS.filter(lambda ls: sum(ls) <= 256), seed=SEEDS)
def test_prop_model_flat_forward_equals_per_request_forward(lens, seed, models, make_requests):
    model, model64 = models
    reqs = make_requests(lens, model.cfg.vocab_size, seed)
    flat = model(pack(reqs))
    each = torch.cat(model.forward_each(reqs))
    ref64 = model64(pack(reqs), attn_backend="loop")
    assert (flat - each).abs().max().item() <= tolerance(each, ref64)
    assert_close(flat, each, ref64, "flat forward")


@CI
@given(lens=LENGTHS, seed=SEEDS)
def test_prop_pack_then_unpack_is_the_identity(lens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 50257, (n,), generator=g).tolist() for n in lens]
    batch = pack(ids)
    assert [p.tolist() for p in unpack(batch.input_ids, batch.cu_seqlens)] == ids
    assert [p.tolist() for p in unpack(batch.positions, batch.cu_seqlens)] == [list(range(n)) for n in lens]
    rows = [torch.randn(n, 3, generator=g) for n in lens]
    hidden = pack(rows)
    assert all(torch.equal(a, b) for a, b in zip(unpack(hidden.hidden, hidden.cu_seqlens), rows))
    padded, mask = pad(rows)
    flat, indices, cu, max_len, _ = unpad_input(padded, mask)
    assert torch.equal(flat, hidden.hidden) and torch.equal(cu, hidden.cu_seqlens) and max_len == max(lens)
    assert torch.equal(pad_input(flat, indices, len(lens), max_len), padded)


@CI
@given(lens=LENGTHS, causal=st.booleans())
def test_prop_attention_cells_equal_brute_force_mask_counts(lens, causal):
    mask = block_diag_mask(seq_lens_to_cu_seqlens(lens), causal=causal)  # [T, T]
    _, pad_mask = pad([[0] * n for n in lens])
    useful = int(mask.sum())
    for method, computed in (("masked", mask.numel()), ("padded", pad_mask.numel() * pad_mask.shape[1]),
                             ("varlen", useful)):
        cells = attention_cells(lens, method, causal=causal)
        assert (cells.computed, cells.useful, cells.wasted) == (computed, useful, computed - useful), method
