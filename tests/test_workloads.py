"""Workload generators: reproducible from a seed, the advertised shape, clear errors."""
import math
import statistics

import pytest

from lessons_lib.serve import workloads as W


@pytest.mark.parametrize("name", W.WORKLOADS)
def test_same_seed_same_requests_and_lengths_in_range(name):
    a = W.generate(name, 200, seed=4, vocab_size=500)
    assert a == W.generate(name, 200, seed=4, vocab_size=500)
    assert len(a) == 200 and all(len(r) >= 1 for r in a)
    assert all(0 <= t < 500 and isinstance(t, int) for r in a for t in r)
    assert W.generate(name, 200, seed=5, vocab_size=500) != a, "another seed must give other token ids"


def test_constant_and_uniform():
    assert W.constant_lengths(3, 7) == [7, 7, 7]
    u = W.uniform_lengths(5000, low=10, high=20, seed=1)
    assert min(u) == 10 and max(u) == 20  # both ends reachable: the range is inclusive
    assert abs(statistics.mean(u) - 15) < 0.2


def test_long_tail_is_lognormal_and_clipped():
    lens = W.long_tail_lengths(20000, median=100, sigma=1.0, max_len=100000, seed=0)
    assert abs(statistics.median(lens) / 100 - 1) < 0.05
    # P(L > e * median) = P(Z > 1) = 0.1587 for a lognormal with sigma 1.
    tail = sum(n > math.e * 100 for n in lens) / len(lens)
    assert abs(tail - 0.1587) < 0.01
    clipped = W.long_tail_lengths(2000, median=100, sigma=2.0, min_len=5, max_len=300, seed=0)
    assert min(clipped) == 5 and max(clipped) == 300


def test_bimodal_two_values_with_probability():
    lens = W.bimodal_lengths(10000, seed=2)
    assert set(lens) == {50, 5000}  # the article's question and draft
    assert abs(lens.count(5000) / len(lens) - 0.1) < 0.01
    assert set(W.bimodal_lengths(10, short=3, long=9, p_long=0.0)) == {3}


def test_fixed_total_mixes_and_make_requests():
    mixes = W.fixed_total_mixes(1000, [1, 10, 100])
    assert mixes[1] == [1000] and mixes[10] == [100] * 10 and all(sum(m) == 1000 for m in mixes.values())
    reqs = W.make_requests([3, 1, 4], vocab_size=10, seed=0)
    assert [len(r) for r in reqs] == [3, 1, 4]
    assert W.generate("constant", 0) == []


@pytest.mark.parametrize("call, match", [
    (lambda: W.uniform_lengths(5, low=10, high=3), "high=3 must be >= low=10"),
    (lambda: W.long_tail_lengths(5, sigma=-1.0), "sigma must be a finite float >= 0"),
    (lambda: W.long_tail_lengths(5, median=0), "median must be a positive int, got 0"),
    (lambda: W.bimodal_lengths(5, p_long=1.5), "p_long must be a probability"),
    (lambda: W.constant_lengths(-1), "n must be an int >= 0, got -1"),
    (lambda: W.uniform_lengths(5, seed=-1), "seed must be an int >= 0"),
    (lambda: W.fixed_total_mixes(1000, [3]), "num_requests=3 does not divide total_tokens=1000"),
    (lambda: W.make_requests([2, 0]), r"lengths\[1\] must be a positive int, got 0"),
    (lambda: W.generate("zipf", 3), "unknown workload 'zipf'"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_prefill_stream_is_the_preset_long_tail_with_one_draft_over_the_budget():
    lens, prompts = W.prefill_stream(vocab_size=97)
    assert len(lens) == W.PREFILL_STREAM["num_requests"] == len(prompts)
    assert lens == W.long_tail_lengths(24, median=64, sigma=1.0, max_len=2048, seed=3)
    assert [len(p) for p in prompts] == lens and all(0 <= t < 97 for p in prompts for t in p)
    over = [n for n in lens if n > W.PREFILL_STREAM_BUDGET]
    assert len(over) == 1 and over[0] > 3 * W.PREFILL_STREAM_BUDGET  # one draft the budget refuses whole
    assert (lens, prompts) == W.prefill_stream(vocab_size=97)
    assert W.preset_stream("long-tail", 24, 3, 97, prompt_seed=2)[1] != prompts  # the prompt seed draws the ids


def test_preset_stream_refuses_a_workload_without_preset():
    with pytest.raises(ValueError, match="workload must be one of"):
        W.preset_stream("constant", 4, 0)


def test_preset_lengths_are_the_preset_streams_lengths():
    assert W.preset_lengths("long-tail", 24, 3) == W.prefill_stream()[0]
    assert W.preset_lengths("bimodal", 40, 0) == W.workload_lengths("bimodal", 40, 0, **W.WORKLOAD_PRESETS["bimodal"])
    with pytest.raises(ValueError, match="workload must be one of"):
        W.preset_lengths("zipf", 4, 0)


def test_trickle_arrivals_lead_with_one_long_request_then_short_waves():
    waves = W.trickle_arrivals()
    assert len(waves) == 12 and waves[0][0] == 400 and len(waves[0]) == 7
    assert all(len(w) == 6 for w in waves[1:]) and all(8 <= n < 40 for n in waves[0][1:] + sum(waves[1:], []))
    assert waves == W.trickle_arrivals() != W.trickle_arrivals(seed=6)
    assert W.trickle_arrivals(first=50, per_step=1, steps=2, low=3, high=4) == [[50, 3], [3]]
