"""The serving hooks lessons use: vLLM's chunk cap (long_prefill_token_threshold), an Engine that runs the
Scheduler it is given, per-forward records (record_forwards), and the public steps prepare_inputs / execute_model."""
from __future__ import annotations

import dataclasses
from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lessons_lib.core.batch import PackedBatch
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import init_weights
from lessons_lib.measure.tolerance import assert_close
from lessons_lib.serve.engine import Engine
from lessons_lib.serve.scheduler import Request, Scheduler, plan_batches
from lessons_lib.serve.workloads import make_requests

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_ffn=64, vocab_size=97, max_position=512)
WEIGHTS = init_weights(CFG, seed=5)
LENS = [30, 5, 40, 7]
PROMPTS = make_requests(LENS, CFG.vocab_size, 1)


def vllm_steps(lens, budget, max_seqs, cap):
    """vLLM v1's prefill steps with its two queues, written from its scheduler's rules: the running requests
    first (each min(rest, cap, budget left)), then waiting ones while fewer than max_seqs run; a request
    whose prompt is done leaves (prefill only). Returns forwards of (request, start, length)."""
    waiting, running, done, steps = deque(range(len(lens))), [], [0] * len(lens), []
    while waiting or running:
        left, step = budget, []
        for i in running:
            if left == 0:
                break
            n = min(lens[i] - done[i], cap or lens[i], left)
            step.append((i, done[i], n))
            left -= n
        while waiting and left > 0 and len(running) < max_seqs:
            i = waiting.popleft()
            n = min(lens[i], cap or lens[i], left)
            running.append(i)
            step.append((i, 0, n))
            left -= n
        for i, _, n in step:
            done[i] += n
        running = [i for i in running if done[i] < lens[i]]
        steps.append(step)
    return steps


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 300), min_size=1, max_size=9), st.integers(1, 256), st.integers(1, 5),
       st.one_of(st.none(), st.integers(1, 300)))
def test_the_chunk_cap_schedules_as_vllm(lens, budget, max_seqs, cap):
    plan = plan_batches(lens, budget, max_seqs, enable_chunked_prefill=True, long_prefill_token_threshold=cap)
    assert [[tuple(c) for c in fwd] for fwd in plan] == vllm_steps(lens, budget, max_seqs, cap)
    assert all(n <= (cap or budget) for fwd in plan for _, _, n in fwd)


def test_a_capped_chunk_leaves_its_room_to_the_requests_behind():
    # budget 256, cap 100: 100 of request 0, all 50 of request 1, 100 of request 2, then the 6 tokens left to 3
    plan = plan_batches([300, 50, 500, 20], 256, enable_chunked_prefill=True, long_prefill_token_threshold=100)
    assert plan[0] == [(0, 0, 100), (1, 0, 50), (2, 0, 100), (3, 0, 6)]
    assert plan[1] == [(0, 100, 100), (2, 100, 100), (3, 6, 14)]


@pytest.mark.parametrize("cap", [0, -3, 2.5, True, "64"])
def test_a_chunk_cap_is_a_positive_int_or_none(cap):
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be a positive int or None"):
        Scheduler(64, enable_chunked_prefill=True, long_prefill_token_threshold=cap)


def test_a_chunk_cap_needs_chunked_prefill():
    with pytest.raises(ValueError, match="enable_chunked_prefill=True"):
        Scheduler(64, long_prefill_token_threshold=16)


def engine(**kw) -> Engine:
    return Engine(CFG, weights=WEIGHTS, device="cpu", dtype=kw.pop("dtype", torch.float32), **kw)


def unchunked(dtype=torch.float32) -> dict:
    return {o.request_id: o for o in engine(max_num_batched_tokens=64, dtype=dtype).prefill(PROMPTS)}


def test_the_engine_serves_a_capped_schedule_like_whole_prompts():
    sched = Scheduler(16, enable_chunked_prefill=True, long_prefill_token_threshold=6)
    eng = engine(scheduler=sched)
    served = eng.prefill(PROMPTS)
    outs = {o.request_id: o for o in served}
    assert eng.scheduler is sched and [o.request_id for o in served] == [0, 1, 2, 3]   # submission order
    assert [o.batch_index for o in served] != sorted(o.batch_index for o in served)  # though they ended out of order
    assert [s.chunks for s in eng.stats] == plan_batches(LENS, 16, enable_chunked_prefill=True,
                                                         long_prefill_token_threshold=6)
    # several requests part-way through their prompts in one forward, each with its own cached keys
    assert max(sum(c + n < LENS[i] for i, c, n in s.chunks) for s in eng.stats) >= 2
    ref, ref64 = unchunked(), unchunked(torch.float64)
    for i in range(len(LENS)):
        assert_close(outs[i].last_hidden, ref[i].last_hidden, ref64[i].last_hidden, f"request {i}")
        assert_close(outs[i].logits, ref[i].logits, ref64[i].logits, f"request {i} logits")


def test_the_engine_runs_the_scheduler_it_is_given():
    class LastComeFirst(Scheduler):
        def schedule(self):
            return [self.waiting.pop()]
    eng = engine(scheduler=LastComeFirst(64))
    outs = eng.prefill(PROMPTS)
    assert [s.request_ids for s in eng.stats] == [[3], [2], [1], [0]]
    assert [o.request_id for o in outs] == [0, 1, 2, 3]   # submission order, whatever the schedule


@pytest.mark.parametrize("kw, match", [
    (dict(scheduler=Scheduler(64), max_num_batched_tokens=32), "max_num_batched_tokens=32 contradicts"),
    (dict(scheduler=Scheduler(64, 4), max_num_seqs=8), "max_num_seqs=8 contradicts"),
    (dict(scheduler=Scheduler(64), enable_chunked_prefill=True), "enable_chunked_prefill=True contradicts"),
    (dict(scheduler=Scheduler(64, enable_chunked_prefill=True), method="padded"), "method='padded'"),
    (dict(scheduler="fcfs"), "scheduler must be a serve.scheduler.Scheduler"),
])
def test_the_engine_refuses_a_scheduler_that_contradicts_it(kw, match):
    with pytest.raises(ValueError, match=match):
        engine(**kw)


def test_the_engine_refuses_a_scheduler_already_holding_requests():
    sched = Scheduler(64)
    sched.add(Request("early", [1, 2, 3]))
    with pytest.raises(ValueError, match="already holds 1 waiting"):
        engine(scheduler=sched)


def test_settings_equal_to_the_schedulers_are_accepted():
    eng = engine(scheduler=Scheduler(32, 3, enable_chunked_prefill=True), max_num_batched_tokens=32, max_num_seqs=3,
                 enable_chunked_prefill=True)
    assert (eng.scheduler.max_num_batched_tokens, eng.scheduler.max_num_seqs, eng.enable_chunked_prefill) == (32, 3, True)


def test_recorded_forwards_carry_the_packed_batch_each_ran():
    eng = engine(max_num_batched_tokens=16, enable_chunked_prefill=True, record_forwards=True)
    eng.prefill(PROMPTS)
    for s in eng.stats:
        assert isinstance(s.batch, PackedBatch) and s.tp_result is None and s.all_reduces is None
        ids = [t for i, c, n in s.chunks for t in PROMPTS[i][c:c + n]]
        positions = [p for _, c, n in s.chunks for p in range(c, c + n)]
        assert s.batch.input_ids.tolist() == ids and s.batch.positions.tolist() == positions
        assert s.batch.cu_seqlens.diff().tolist() == [n for *_, n in s.chunks]
    plain = engine(max_num_batched_tokens=64)
    plain.prefill(PROMPTS)
    assert all(s.batch is None and s.tp_result is None for s in plain.stats)


def test_record_forwards_is_a_bool():
    with pytest.raises(ValueError, match="record_forwards must be a bool"):
        engine(record_forwards="yes")


def test_recorded_tp_forwards_carry_every_ranks_trace():
    with engine(tp_size=2, tp_backend="gloo", max_num_batched_tokens=32, enable_chunked_prefill=True,
                record_forwards=True) as eng:
        eng.prefill(PROMPTS)
    for s in eng.stats:
        traces = s.tp_result.traces
        assert len(traces) == 2 and [r.op for r in traces[0]] == [r.op for r in traces[1]]
        assert sum(r.op == "all_reduce" for r in traces[0]) == 2 * CFG.n_layers == s.all_reduces
        assert s.tp_result.seq_lens == [n for *_, n in s.chunks] == s.batch.seq_lens


class PositionsBy(Engine):
    """Every forward's positions from ``self.positions_of(chunks)`` (a lesson's hook on prepare_inputs)."""

    def prepare_inputs(self, chunks):
        batch = super().prepare_inputs(chunks)
        return dataclasses.replace(batch, positions=torch.tensor(self.positions_of(chunks), dtype=torch.int64))


def test_prepare_inputs_is_what_the_model_runs():
    class Continued(PositionsBy):   # each chunk's positions continue after its cached tokens
        def positions_of(self, chunks):
            return [p for c in chunks for p in range(c.start, c.start + c.length)]

    class FromZero(PositionsBy):    # the offset forgotten: refused by the model's batch check, never a wrong answer
        def positions_of(self, chunks):
            return [p for c in chunks for p in range(c.length)]
    kw = dict(weights=WEIGHTS, device="cpu", dtype=torch.float32, max_num_batched_tokens=16, enable_chunked_prefill=True)
    outs = {o.request_id: o for o in Continued(CFG, **kw).prefill(PROMPTS)}
    ref, ref64 = unchunked(), unchunked(torch.float64)
    for i in range(len(LENS)):
        assert_close(outs[i].last_hidden, ref[i].last_hidden, ref64[i].last_hidden, f"request {i}")
    with pytest.raises(ValueError, match="positions must start at each request's num_computed_tokens"):
        FromZero(CFG, **kw).prefill(PROMPTS)


def test_run_calls_execute_model_once_per_forward():
    calls = []

    class Counting(Engine):
        def execute_model(self, chunks, index):
            calls.append((index, [c.length for c in chunks]))
            return super().execute_model(chunks, index)
    eng = Counting(CFG, weights=WEIGHTS, device="cpu", dtype=torch.float32, max_num_batched_tokens=40)
    outs = eng.prefill(PROMPTS)
    assert calls == [(s.index, [n for *_, n in s.chunks]) for s in eng.stats] and len(outs) == len(LENS)


def test_a_failed_capped_run_leaves_every_request_waiting_whole_once():
    class FailsAtThird(Engine):
        def execute_model(self, chunks, index):
            if index == 2 and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("a forward failed")
            return super().execute_model(chunks, index)
    eng = FailsAtThird(CFG, weights=WEIGHTS, device="cpu", dtype=torch.float32,
                       scheduler=Scheduler(16, enable_chunked_prefill=True, long_prefill_token_threshold=6))
    eng.submit_many([Request(i, p) for i, p in enumerate(PROMPTS)])
    with pytest.raises(RuntimeError, match="a forward failed"):
        eng.run()
    assert [r.request_id for r in eng.scheduler.waiting] == [0, 1, 2, 3]   # each once, in arrival order
    assert all(r.num_computed_tokens == 0 for r in eng.scheduler.waiting) and eng.kv_cache.nbytes == 0
    outs = {o.request_id: o for o in eng.run()}
    ref, ref64 = unchunked(), unchunked(torch.float64)
    for i in range(len(LENS)):
        assert_close(outs[i].last_hidden, ref[i].last_hidden, ref64[i].last_hidden, f"request {i}")
