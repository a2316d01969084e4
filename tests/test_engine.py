"""Prefill engine: FCFS scheduling under budgets, outputs equal to per-request forwards, bad input.

Small config (2 layers, d_model 64, 4 heads of 16, FFN 256, vocab 1000) so the file runs in seconds.
"""
import random

import pytest
import torch

from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer
from lessons_lib.measure.flops import attention_cells
from lessons_lib.measure.tolerance import assert_close
from lessons_lib.serve.engine import METHODS, Engine, batch_stats
from lessons_lib.serve.scheduler import Request, Scheduler
from lessons_lib.serve.workloads import generate

CFG = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=1000, max_position=512)


def _lengths(seed, n=60, high=90):
    rng = random.Random(seed)
    return [rng.randint(1, high) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_scheduler_budgets_fcfs_and_maximal_batches(seed):
    lens = _lengths(seed)
    budget, max_seqs = 120 + seed * 7, 3 + seed
    s = Scheduler(budget, max_seqs)
    for i, n in enumerate(lens):
        s.add(Request(i, [1] * n))
    batches = []
    while s.has_unfinished():
        batches.append(s.schedule())
    order = [r.request_id for b in batches for r in b]
    assert order == list(range(len(lens))), "FCFS: batches must serve requests in arrival order, each once"
    for k, b in enumerate(batches):
        tokens = sum(len(r) for r in b)
        assert 1 <= len(b) <= max_seqs and tokens <= budget, (k, len(b), tokens)
        if k + 1 < len(batches):  # the batch stopped only because the next request broke a budget
            nxt = len(batches[k + 1][0])
            assert len(b) == max_seqs or tokens + nxt > budget, (k, len(b), tokens, nxt)
    assert s.schedule() == [] and len(s) == 0


def test_s3_every_request_runs_whole_in_one_batch_and_an_oversize_one_is_refused():
    lens = [5, 12, 3, 12, 1]
    eng = Engine(CFG, max_num_batched_tokens=12, max_num_seqs=8, compute_logits=False)
    outs = eng.prefill([[7] * n for n in lens])
    assert [o.num_tokens for o in outs] == lens  # each prompt served whole...
    served = [i for s in eng.stats for i in s.request_ids]
    assert sorted(served) == list(range(len(lens))) and len(served) == len(set(served))  # ...exactly once, in one batch
    with pytest.raises(ValueError, match="no chunked prefill"):
        eng.submit([7] * 13)  # longer than the budget: it could never run whole, so it is refused at submit


def test_scheduler_never_skips_ahead():
    s = Scheduler(max_num_batched_tokens=10, max_num_seqs=8)
    for i, n in enumerate([6, 6, 1]):  # the 1-token request would fit beside the first, but waits its turn
        s.add(Request(i, [0] * n))
    assert [r.request_id for r in s.schedule()] == [0]
    assert [r.request_id for r in s.schedule()] == [1, 2]


@pytest.mark.parametrize("method", METHODS)
def test_outputs_equal_per_request_reference(method):
    reqs = generate("long-tail", 23, seed=3, vocab_size=CFG.vocab_size, median=12, max_len=80)
    eng = Engine(CFG, method=method, max_num_batched_tokens=160, max_num_seqs=6, seed=1)
    outs = eng.prefill([Request(f"r{i}", r, return_hidden=(i % 3 == 0)) for i, r in enumerate(reqs)])
    ref = eng.model.forward_each(reqs, attn_backend="loop")  # [L_i, d] each, one request at a time
    model64 = Transformer(CFG, eng.weights, dtype=torch.float64)
    ref64 = model64.forward_each(reqs, attn_backend="loop")
    assert [o.request_id for o in outs] == [f"r{i}" for i in range(len(reqs))]
    assert len(eng.stats) > 1, "the budget should force several batches"
    for i, (o, r, r64) in enumerate(zip(outs, ref, ref64)):
        assert o.num_tokens == len(reqs[i])
        assert_close(o.last_hidden, r[-1], r64[-1], f"{method} request {i}")
        assert_close(o.logits, eng.model.compute_logits(r[-1:])[0], model64.compute_logits(r64[-1:])[0], "logits")
        if i % 3 == 0:
            assert_close(o.hidden, r, r64, f"{method} request {i}, every row")
        else:
            assert o.hidden is None


@pytest.mark.parametrize("method", METHODS)
def test_stats_match_budgets_and_analytic_counts(method):
    lens = [5, 40, 3, 17, 60, 2, 2, 9]
    eng = Engine(CFG, method=method, max_num_batched_tokens=64, max_num_seqs=3, compute_logits=False)
    outs = eng.prefill([[7] * n for n in lens])
    assert all(o.logits is None for o in outs)
    assert sum(s.num_seqs for s in eng.stats) == len(lens)
    served = []
    for k, s in enumerate(eng.stats):
        b = lens[len(served):len(served) + s.num_seqs]
        served += b
        assert s.num_tokens == sum(b) <= 64 and s.num_seqs <= 3 and s.max_seqlen == max(b)
        assert [outs[len(served) - len(b) + j].batch_index for j in range(len(b))] == [k] * len(b)
        brute = {"varlen": sum(n * n for n in b), "masked": sum(b) ** 2, "padded": len(b) * max(b) ** 2}[method]
        assert s.cells_whole_computed == brute and s.cells_whole_useful == sum(n * n for n in b)
        assert s.executed_rows == (len(b) * max(b) if method == "padded" else sum(b))
        assert s.padding_rows == s.executed_rows - sum(b)
        assert s.padding_cells == (brute - s.cells_whole_useful if method == "padded" else 0)
        assert s.masked_cells == (brute - s.cells_whole_useful if method == "masked" else 0)
        assert s.flops_causal_executed >= s.flops_causal_useful > 0 and s.wall_s > 0
    assert served == lens


def test_batch_stats_cells_agree_with_flops_module():
    s = batch_stats(CFG, [10, 30], "masked")
    c = attention_cells([10, 30], "masked")
    assert (s.cells_whole_computed, s.cells_whole_useful, s.cells_whole_wasted) == (c.computed, c.useful, c.wasted)
    assert (s.cells_whole_computed, s.cells_whole_useful, s.masked_cells) == (1600, 1000, 600)  # C8, by hand


def test_empty_request_list_is_a_defined_result():
    eng = Engine(CFG)
    assert eng.prefill([]) == [] and eng.stats == []
    assert eng.run() == []


def test_submit_then_run_and_auto_ids():
    eng = Engine(CFG, max_num_batched_tokens=16)
    a = eng.submit([1, 2, 3])
    b = eng.submit(Request("mine", [4, 5]))
    c = eng.submit([6] * 16)
    outs = eng.run()
    assert [o.request_id for o in outs] == [a.request_id, "mine", c.request_id] and b.request_id == "mine"
    assert len({a.request_id, c.request_id}) == 2
    assert eng.run() == []


@pytest.mark.parametrize("prompt, match", [
    ([], "is empty"),
    ([1, -2, 3], r"prompt_token_ids\[1\] is negative \(-2\)"),
    ([1, 2.0], r"prompt_token_ids\[1\] must be an int token id, got 2.0"),
    ([1, "a"], r"prompt_token_ids\[1\] must be an int"),
    ([True, 1], r"prompt_token_ids\[0\] must be an int"),
    (torch.tensor([1.0, 2.0]), "must hold integers"),
    (torch.ones(2, 2, dtype=torch.long), "must be 1-D"),
    ("hello", "must be a list of int token ids"),
    (None, "must be a list of int token ids"),
    ([1, 1000], r"prompt_token_ids\[1\]=1000 is out of range \[0, vocab_size=1000\)"),
])
def test_bad_prompts_rejected_with_clear_error(prompt, match):
    eng = Engine(CFG)
    with pytest.raises(ValueError, match=match):
        eng.submit(prompt)
    assert len(eng.scheduler) == 0


def test_oversize_request_rejected_and_nothing_queued():
    eng = Engine(CFG, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"request 1 has 33 prompt tokens, more than max_num_batched_tokens=32"):
        eng.prefill([[1] * 4, [1] * 33, [1] * 4])
    assert len(eng.scheduler) == 0, "a rejected list must queue nothing"
    big = Engine(CFG, max_num_batched_tokens=4096)
    with pytest.raises(ValueError, match="more than max_position=512"):
        big.submit([1] * 513)


@pytest.mark.parametrize("kw, match", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be a positive int, got 0"),
    (dict(max_num_batched_tokens=1.5), "max_num_batched_tokens must be a positive int"),
    (dict(max_num_seqs=True), "max_num_seqs must be a positive int, got True"),
    (dict(max_num_seqs=-3), "max_num_seqs must be a positive int, got -3"),
    (dict(method="chunked"), "method must be one of"),
    (dict(tp_size=3), "tp_size must be 1 or 2, got 3"),
    (dict(method="masked", attn_backend="sdpa"), "applies to method='varlen' only"),
    (dict(attn_backend="masked"), "use method='masked'"),
    (dict(attn_backend="nope"), "unknown attention backend"),
    (dict(method="padded", tp_size=2), "use tp_size=1"),
])
def test_bad_engine_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        Engine(CFG, **kw)


def test_duplicate_and_bad_request_ids():
    eng = Engine(CFG)
    eng.submit(Request("a", [1]))
    with pytest.raises(ValueError, match="request_id 'a' is already waiting"):
        eng.submit(Request("a", [2]))
    with pytest.raises(ValueError, match="request_id must be a str or int"):
        Request(1.5, [1])
    with pytest.raises(ValueError, match="requests must be a list"):
        eng.prefill(torch.tensor([1, 2]))
    assert [o.request_id for o in eng.run()] == ["a"]
    eng.submit(Request("a", [3]))  # served ids may be reused
    assert len(eng.run()) == 1


@pytest.mark.parametrize("method", METHODS)
def test_same_seed_bit_identical_different_seed_differs(method):
    reqs = generate("uniform", 12, seed=5, vocab_size=CFG.vocab_size, low=1, high=50)

    def run(seed):
        outs = Engine(CFG, method=method, seed=seed, max_num_batched_tokens=128).prefill(reqs)
        return torch.stack([o.logits for o in outs])

    a, b = run(0), run(0)
    assert torch.equal(a, b), "same seed, same backend: outputs must be bit-identical"
    assert not torch.allclose(a, run(1)), "a different seed must give different weights"


def test_progress_bar_on_request_and_off_under_ci(capsys, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    Engine(CFG, progress=True).prefill([[1] * 5])
    assert "prefill (varlen)" in capsys.readouterr().err
    monkeypatch.setenv("CI", "true")
    Engine(CFG, progress=True).prefill([[1] * 5])
    assert "prefill" not in capsys.readouterr().err
    monkeypatch.delenv("CI")
    Engine(CFG).prefill([[1] * 5])  # progress=None: short runs stay quiet
    assert "prefill" not in capsys.readouterr().err


def test_tp2_engine_equals_tp1():
    reqs = generate("long-tail", 9, seed=8, vocab_size=CFG.vocab_size, median=10, max_len=60)
    kw = dict(max_num_batched_tokens=96, max_num_seqs=4, seed=2)
    one = Engine(CFG, tp_size=1, **kw).prefill(reqs)
    one64 = Engine(CFG, tp_size=1, dtype=torch.float64, **kw).prefill(reqs)
    with Engine(CFG, tp_size=2, **kw) as eng:
        two = eng.prefill(reqs)
        assert len(eng.stats) > 1 and all(s.all_reduces == 2 * CFG.n_layers for s in eng.stats)
    assert [o.request_id for o in two] == [o.request_id for o in one]
    for a, b, c in zip(one, two, one64):
        # TP=2 sums two partial matmuls where TP=1 does one: equal up to rounding (C12).
        assert_close(b.last_hidden, a.last_hidden, c.last_hidden, f"TP=2 request {a.request_id}")
        assert_close(b.logits, a.logits, c.logits, f"TP=2 logits {a.request_id}")
    assert eng._runtime is None, "closing the engine stops the TP workers"


def test_failed_run_loses_nothing_and_can_be_rerun(monkeypatch):
    reqs = [[3] * n for n in (5, 9, 4, 7, 6)]
    eng = Engine(CFG, max_num_batched_tokens=12, max_num_seqs=2)
    forward = eng.model.forward
    calls = []

    def flaky(batch, **kw):  # the second batch fails, as a dead worker would
        calls.append(batch.num_seqs)
        if len(calls) == 2:
            raise RuntimeError("worker died")
        return forward(batch, **kw)

    monkeypatch.setattr(eng.model, "forward", flaky)
    with pytest.raises(RuntimeError, match="worker died"):
        eng.prefill(reqs)
    assert [r.request_id for r in eng.scheduler.waiting] == [0, 1, 2, 3, 4], "all taken requests wait again, in order"
    outs = eng.run()
    assert [o.request_id for o in outs] == [0, 1, 2, 3, 4]
    ref = Engine(CFG, max_num_batched_tokens=12, max_num_seqs=2).prefill(reqs)
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(outs, ref))
