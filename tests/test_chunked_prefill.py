"""Chunked prefill with a prefill KV cache (vLLM's enable_chunked_prefill): the scheduler's chunks, the
cache, and every output equal to the unchunked forward of the same prompt by the tolerance rule."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.course.l01_flat_batch import float64_twin
from lessons_lib.measure.tolerance import assert_close
from lessons_lib.serve.engine import Engine, batch_stats
from lessons_lib.serve.kv_cache import PrefillKVCache
from lessons_lib.serve.scheduler import Request, Scheduler, plan_batches
from lessons_lib.serve.workloads import make_requests
from lessons_lib.tp.dryrun import expected_trace, trace_signature
from lessons_lib.tp.runtime import TPRuntime

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_ffn=64, vocab_size=97, max_position=2048)
CFG8 = ModelConfig(n_layers=8, d_model=32, n_heads=4, d_head=8, d_ffn=64, vocab_size=97, max_position=256)
WEIGHTS = init_weights(CFG, seed=3)
MODEL = Transformer(CFG, WEIGHTS)
MODEL64 = float64_twin(MODEL)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def prompts(lens, seed=0, vocab=CFG.vocab_size):
    return make_requests(list(lens), vocab, seed)


def references(ps, model=MODEL, model64=MODEL64):
    """Each prompt's unchunked forward alone: float32 and the float64 truth, ``[L, d]`` each."""
    return ([model(pack([torch.tensor(p)])) for p in ps], [model64(pack([torch.tensor(p)])) for p in ps])


def assert_served_like_unchunked(outs, ps, model=MODEL, model64=MODEL64):
    ref, ref64 = references(ps, model, model64)
    assert [o.request_id for o in outs] == list(range(len(ps)))  # every request, in submission order
    for o, r, r64 in zip(outs, ref, ref64):
        assert o.num_tokens == r.shape[0]
        assert_close(o.last_hidden, r[-1], r64[-1], f"request {o.request_id} last hidden")
        assert_close(o.logits, model.compute_logits(r[-1:])[0], model64.compute_logits(r64[-1:])[0],
                     f"request {o.request_id} logits")
        if o.hidden is not None:
            assert_close(o.hidden, r, r64, f"request {o.request_id} hidden rows")


def serve(ps, budget, max_seqs=256, return_hidden=True, **kw):
    eng = Engine(CFG, weights=WEIGHTS, device="cpu", dtype=torch.float32, max_num_batched_tokens=budget,
                 max_num_seqs=max_seqs, enable_chunked_prefill=True, **kw)
    return eng, eng.prefill([Request(i, p, return_hidden) for i, p in enumerate(ps)])


def check_plan(lens, budget, max_seqs, forwards):
    """Both budgets in every forward, FCFS, each prompt cut into consecutive chunks covering it once, and
    every forward but the last full (the budget, or max_num_seqs): a chunk is cut only when it must be."""
    served = [(i, s, n) for f in forwards for (i, s, n) in f]
    assert [i for i, _, _ in served] == sorted(i for i, _, _ in served), "FCFS: no request overtakes another"
    for i, n_total in enumerate(lens):
        mine = [(s, n) for j, s, n in served if j == i]
        assert [s for s, _ in mine] == [sum(n for _, n in mine[:k]) for k in range(len(mine))]
        assert sum(n for _, n in mine) == n_total and all(n >= 1 for _, n in mine)
    for k, f in enumerate(forwards):
        tokens = sum(n for _, _, n in f)
        assert tokens <= budget and len(f) <= max_seqs, (k, f)
        assert len({i for i, _, _ in f}) == len(f), "one chunk per request per forward"
        if k < len(forwards) - 1:
            assert tokens == budget or len(f) == max_seqs, (k, f)


# ---- the scheduler ----------------------------------------------------------------------------------

@FAST
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=12), budget=st.integers(1, 160),
       max_seqs=st.integers(1, 5))
def test_plan_batches_chunks_within_both_budgets_in_fcfs_order(lens, budget, max_seqs):
    forwards = plan_batches(lens, budget, max_seqs, enable_chunked_prefill=True)
    check_plan(lens, budget, max_seqs, forwards)
    if max(lens) <= budget:  # filling the budget never needs more forwards than whole prompts do
        assert len(forwards) <= len(plan_batches(lens, budget, max_seqs))


def test_the_checker_of_plans_can_fail():
    with pytest.raises(AssertionError):  # a forward over budget
        check_plan([5], 4, 2, [[(0, 0, 5)]])
    with pytest.raises(AssertionError):  # a later request overtakes
        check_plan([2, 2], 4, 2, [[(1, 0, 2), (0, 0, 2)]])
    with pytest.raises(AssertionError):  # a chunk cut although the budget had room
        check_plan([6], 4, 2, [[(0, 0, 3)], [(0, 3, 3)]])


def test_a_prompt_of_exactly_the_budget_runs_whole_and_budget_one_runs_token_by_token():
    assert plan_batches([8, 8], 8, enable_chunked_prefill=True) == [[(0, 0, 8)], [(1, 0, 8)]]
    assert plan_batches([3, 1], 1, enable_chunked_prefill=True) == [[(0, 0, 1)], [(0, 1, 1)], [(0, 2, 1)], [(1, 0, 1)]]
    assert plan_batches([5, 2, 9], 6, enable_chunked_prefill=True) == [[(0, 0, 5), (1, 0, 1)], [(1, 1, 1), (2, 0, 5)],
                                                                      [(2, 5, 4)]]


def test_chunking_off_keeps_today_s_behaviour_and_its_error():
    assert plan_batches([5, 2, 9], 10) == [[0, 1], [2]]
    with pytest.raises(ValueError, match=r"^request 0 has 9 prompt tokens, more than max_num_batched_tokens=8: every "
                                         r"request must fit whole in one batch \(no chunked prefill\); raise "
                                         r"max_num_batched_tokens or shorten the prompt$"):
        Engine(CFG, weights=WEIGHTS, device="cpu", max_num_batched_tokens=8).submit([1] * 9)


# ---- the engine: chunked = unchunked --------------------------------------------------------------------

@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 90), min_size=1, max_size=5), budget=st.integers(1, 64),
       max_seqs=st.integers(1, 4), seed=st.integers(0, 10))
def test_chunked_outputs_equal_the_unchunked_forward(lens, budget, max_seqs, seed):
    ps = prompts(lens, seed)
    eng, outs = serve(ps, budget, max_seqs)
    assert_served_like_unchunked(outs, ps)
    check_plan(lens, budget, max_seqs, [s.chunks for s in eng.stats])
    assert all(s.num_tokens <= budget and s.num_seqs <= max_seqs for s in eng.stats)
    assert len(eng.kv_cache) == 0 and eng.kv_cache.nbytes == 0  # every request's cache freed after its last chunk


def test_budget_one_token_and_many_long_prompts_at_once():
    ps = prompts([7, 1, 3], seed=4)
    eng, outs = serve(ps, 1)
    assert_served_like_unchunked(outs, ps)
    assert [s.num_tokens for s in eng.stats] == [1] * 11
    ps = prompts([300, 257, 411, 129, 300, 64], seed=5)
    eng, outs = serve(ps, 100, max_seqs=3)
    assert_served_like_unchunked(outs, ps)
    assert max(s.num_cached_tokens for s in eng.stats) > 0 and eng.kv_cache_peak_bytes > 0


def test_a_wrong_cache_fails_the_comparison():
    """The comparison can fail: a forward whose cached keys come from another prompt is not the unchunked one."""
    ps = prompts([40, 30], seed=6)
    eng, outs = serve(ps, 16)
    other = prompts([40, 30], seed=7)
    with pytest.raises(AssertionError, match="last hidden"):
        assert_served_like_unchunked(outs, other)


@pytest.mark.parametrize("backend", ["loop", "sdpa", "padded", "masked", "flex"])
def test_every_backend_reads_the_cache_in_one_varlen_call(backend):
    """A chunk's queries over cached + own keys (cu_seqlens_k != cu_seqlens_q, bottom-right causal), on the
    model directly: every backend that takes cu_seqlens_k, ``padded`` (the varlen backend) included."""
    a, b = prompts([37, 12], seed=8)
    cache = PrefillKVCache.for_model(MODEL)
    got = {0: [], 1: []}
    for plan in ([(0, 0, 20, True)], [(0, 20, 10, True), (1, 0, 5, True)], [(0, 30, 7, False), (1, 5, 7, False)]):
        ids, starts, lens, keep = (list(x) for x in zip(*plan))
        seqs = [(a, b)[i][s:s + n] for i, s, n in zip(ids, starts, lens)]
        step = cache.step(ids, starts, lens, keep)
        out = MODEL(pack(seqs, num_computed_tokens=starts), attn_backend=backend, kv_cache=step)
        step.finish()
        for i, rows in zip(ids, out.split(lens)):
            got[i].append(rows)
    ref, ref64 = references([a, b])
    for i in (0, 1):
        assert_close(torch.cat(got[i]), ref[i], ref64[i], f"{backend}: request {i}")
    assert len(cache) == 0 and cache.nbytes == 0


def test_your_function_gets_cu_seqlens_k_and_a_backend_without_it_is_refused():
    seen = []

    def mine(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None):
        seen.append((cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), causal, softmax_scale))
        from lessons_lib.core.attention import varlen_attention
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, backend="loop")
    ps = prompts([10, 4], seed=9)
    eng, outs = serve(ps, 8, attn_backend=mine)
    assert_served_like_unchunked(outs, ps)
    assert ([0, 8], [0, 8], True, 1 / math.sqrt(8)) in seen and ([0, 2, 6], [0, 10, 14], True, 1 / math.sqrt(8)) in seen
    with pytest.raises(ValueError, match="takes no keyword causal or softmax_scale"):
        Engine(CFG, weights=WEIGHTS, device="cpu", attn_backend=lambda q, k, v, cu, m: q, enable_chunked_prefill=True)


def test_stats_count_both_conventions_the_chunks_and_the_cached_keys():
    eng, _ = serve(prompts([10, 4], seed=1), 8)
    s0, s1 = eng.stats
    assert s0.chunks == [(0, 0, 8)] and s1.chunks == [(0, 8, 2), (1, 0, 4)]
    assert (s0.num_chunk_tokens, s1.num_chunk_tokens, s0.num_cached_tokens, s1.num_cached_tokens) == (8, 2, 0, 8)
    assert (s1.cells_whole_useful, s1.cells_causal_useful) == (2 * 10 + 4 * 4, 2 * 8 + 3 + 10)
    assert s1.cells_whole_computed == s1.cells_whole_useful and s1.cells_causal_computed == s1.cells_causal_useful
    masked = batch_stats(CFG, [2, 4], "masked", num_computed_tokens=[8, 0])
    assert masked.cells_whole_computed == 6 * 14 and masked.masked_cells == 6 * 14 - 36
    whole = batch_stats(CFG, [10, 30], "varlen")  # no chunk: the article's counts, and lesson 06's names
    assert (whole.cells_whole_computed, whole.cells_causal_useful) == (1000, 55 + 465)
    assert whole.flops_whole_executed > whole.flops_causal_executed == whole.flops_causal_useful


# ---- all or nothing, bad inputs, memory ------------------------------------------------------------------

def test_a_failed_forward_leaves_every_taken_request_waiting_whole_and_frees_its_cache(monkeypatch):
    ps = prompts([30, 5, 20], seed=2)
    eng = Engine(CFG, weights=WEIGHTS, device="cpu", max_num_batched_tokens=12, enable_chunked_prefill=True)
    eng.submit_many([Request(i, p, True) for i, p in enumerate(ps)])
    real, calls = eng.model.forward, [0]

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected")
        return real(*a, **kw)
    monkeypatch.setattr(eng.model, "forward", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        eng.run()
    assert [r.request_id for r in eng.scheduler.waiting] == [0, 1, 2]
    assert all(r.num_computed_tokens == 0 for r in eng.scheduler.waiting)
    assert len(eng.kv_cache) == 0 and eng.kv_cache.nbytes == 0 and not eng._partial
    assert_served_like_unchunked(eng.run(), ps)


def test_bad_inputs_are_refused_with_their_names():
    with pytest.raises(ValueError, match="enable_chunked_prefill must be a bool, got 'yes'"):
        Engine(CFG, device="cpu", enable_chunked_prefill="yes")
    with pytest.raises(ValueError, match="enable_chunked_prefill must be a bool, got 1"):
        Scheduler(enable_chunked_prefill=1)
    with pytest.raises(ValueError, match="enable_chunked_prefill must be a bool"):
        plan_batches([3], 2, enable_chunked_prefill=None)
    with pytest.raises(ValueError, match="method='padded' runs Transformer.forward_padded"):
        Engine(CFG, device="cpu", method="padded", enable_chunked_prefill=True)
    eng = Engine(CFG, weights=WEIGHTS, device="cpu", max_num_batched_tokens=4, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match="more than max_position=2048"):
        eng.submit([1] * 2049)
    assert len(eng.scheduler) == 0
    with pytest.raises(ValueError, match=r"no kv_cache holds their earlier tokens"):
        MODEL(pack([[1, 2]], num_computed_tokens=[3]))
    with pytest.raises(ValueError, match="num_computed_tokens has 1 entries for 2 requests"):
        pack([[1], [2]], num_computed_tokens=[0])
    with pytest.raises(ValueError, match=r"num_computed_tokens\[0\] must be >= 0, got -1"):
        pack([[1]], num_computed_tokens=[-1])
    with pytest.raises(ValueError, match="exceeds max_position=2048"):
        MODEL(pack([[1, 2]], num_computed_tokens=[2047]), kv_cache=PrefillKVCache.for_model(MODEL).step([0], [0], [2], [False]))
    cache = PrefillKVCache.for_model(MODEL)
    with pytest.raises(ValueError, match="the KV cache holds 0 tokens, the chunk says num_computed_tokens=5"):
        cache.step(["a"], [5], [3], [True])
    with pytest.raises(ValueError, match="request_ids must be distinct"):
        cache.step(["a", "a"], [0, 0], [1, 1], [True, True])
    with pytest.raises(ValueError, match="keep must hold bools"):
        cache.step(["a"], [0], [1], ["no"])
    with pytest.raises(ValueError, match="one entry per request"):
        cache.step(["a"], [0, 0], [1], [True])


def test_the_cache_does_not_grow_over_1000_small_requests():
    eng = Engine(CFG, weights=WEIGHTS, device="cpu", max_num_batched_tokens=48, max_num_seqs=16,
                 enable_chunked_prefill=True, compute_logits=False)
    lens = [1 + (7 * i) % 23 for i in range(1000)]  # 1..23 tokens: many cut at a budget of 48
    # at most one request is cut per forward: its keys (at most 22 tokens), held and staged at once
    per_token = CFG.n_layers * 2 * CFG.n_heads * CFG.d_head * 4
    peaks = []
    for part in range(4):
        outs = eng.prefill(prompts(lens[part * 250:(part + 1) * 250], seed=part))
        assert len(outs) == 250 and len(eng.kv_cache) == 0 and eng.kv_cache.nbytes == 0
        peaks.append(eng.kv_cache_peak_bytes)
    assert 0 < min(peaks) and max(peaks) <= 2 * 22 * per_token, peaks


# ---- TP=2 -----------------------------------------------------------------------------------------------

def test_tp2_chunks_each_rank_caches_its_heads_and_the_trace_is_16_all_reduces_of_the_forward_s_tokens():
    w8 = init_weights(CFG8, seed=1)
    m8 = Transformer(CFG8, w8)
    ps = prompts([70, 9, 40], seed=3)
    forwards = plan_batches([len(p) for p in ps], 32, enable_chunked_prefill=True)
    got = {i: [] for i in range(len(ps))}
    with TPRuntime(CFG8, w8, world_size=2, backend="gloo", timeout=120, verbose=False, device="cpu",
                   dtype=torch.float32) as rt:
        for f in forwards:
            seqs = [ps[i][s:s + n] for i, s, n in f]
            res = rt.forward(pack(seqs, num_computed_tokens=[s for _, s, _ in f]), request_ids=[i for i, _, _ in f],
                             keep_kv=[s + n < len(ps[i]) for i, s, n in f])
            t = sum(n for _, _, n in f)
            for r in range(2):  # no collective for the cache: only the blocks' two per layer, [T this forward, d]
                assert trace_signature(res.traces[r]) == trace_signature(expected_trace(CFG8, t, r)), f
            assert all(c == 0 for rank in res.attn_collectives for c in rank)
            for (i, _, _), rows in zip(f, res.output.split([n for _, _, n in f])):
                got[i].append(rows)
        assert res.kv_cache_bytes == 0 and res.kv_cache_peak_bytes > 0
        full = CFG8.n_layers * 2 * CFG8.n_heads * CFG8.d_head * 4
        assert res.kv_cache_peak_bytes <= 2 * 70 * full // 2  # each rank: half the heads
    ref, ref64 = references(ps, m8, float64_twin(m8))
    for i in got:
        assert_close(torch.cat(got[i]), ref[i], ref64[i], f"TP=2 request {i}")


def test_tp2_engine_serves_chunks_like_tp1_also_after_a_failed_run(monkeypatch):
    ps = prompts([50, 3, 21], seed=11)
    with Engine(CFG, weights=WEIGHTS, device="cpu", tp_size=2, tp_backend="gloo", max_num_batched_tokens=16,
                enable_chunked_prefill=True) as eng:
        real, calls = eng.model.compute_logits, [0]

        def flaky(hidden):  # fails after the workers ran (and cached) this forward: they must drop those keys
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected")
            return real(hidden)
        monkeypatch.setattr(eng.model, "compute_logits", flaky)
        eng.submit_many([Request(i, p, True) for i, p in enumerate(ps)])
        with pytest.raises(RuntimeError, match="injected"):
            eng.run()
        assert [r.request_id for r in eng.scheduler.waiting] == [0, 1, 2] and not eng._runtime.closed
        outs = eng.run()
        assert all(s.all_reduces == 2 * CFG.n_layers and s.num_tokens <= 16 for s in eng.stats)
        assert eng.kv_cache is None and eng.kv_cache_peak_bytes > 0
    assert_served_like_unchunked(outs, ps)


# ---- the headline: lesson 06's capstone stream under 512 tokens --------------------------------------------

def test_lesson_06_stream_with_its_1776_token_draft_under_512_tokens():
    from lessons_lib.serve.workloads import PREFILL_STREAM_BUDGET, prefill_stream
    lens, ps = prefill_stream(CFG.vocab_size)
    assert max(lens) == 1776 and PREFILL_STREAM_BUDGET == 512
    with pytest.raises(ValueError, match="more than max_num_batched_tokens=512"):
        Engine(CFG, weights=WEIGHTS, device="cpu", max_num_batched_tokens=512).prefill(ps)
    eng, outs = serve(ps, 512, return_hidden=False)
    assert all(s.num_tokens <= 512 for s in eng.stats) and sum(s.num_tokens for s in eng.stats) == sum(lens)
    assert any(s.num_cached_tokens for s in eng.stats)
    assert_served_like_unchunked(outs, ps)


@pytest.mark.parametrize("backend", ["flash", "torch_varlen"])
def test_the_cuda_kernels_call_sites_take_the_chunks(backend, monkeypatch):
    """FlashAttention's and PyTorch's varlen kernels get cached + chunk keys with their own cu_seqlens_k (run
    here through the contract doubles of tests/kernel_doubles.py, which refuse what the real kernels refuse)."""
    import kernel_doubles as kd

    from lessons_lib.core import kernels
    for name in ("flash", "torch_varlen"):
        monkeypatch.setitem(kernels.KERNELS, name, kernels.KERNELS[name])  # restored afterwards
    kd.install()
    ps = prompts([45, 7, 20], seed=12)
    eng = Engine(CFG, weights=WEIGHTS, device="cpu", dtype=torch.bfloat16, attn_backend=backend,
                 max_num_batched_tokens=16, enable_chunked_prefill=True)
    outs = eng.prefill([Request(i, p, True) for i, p in enumerate(ps)])
    assert sum(s.num_cached_tokens for s in eng.stats) > 0
    bf16 = Transformer(CFG, WEIGHTS, dtype=torch.bfloat16, attn_backend=backend)
    for o, p in zip(outs, ps):
        ref, ref64 = bf16(pack([torch.tensor(p)])), MODEL64(pack([torch.tensor(p)]))
        assert_close(o.hidden, ref, ref64, f"{backend}: request {o.request_id}")
