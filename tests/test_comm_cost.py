"""measure.comm's cost of a forward's all-reduces (comm_cost_state, packing_saving), its fit read-outs (fit_misses,
about), the all-reduce bench's refusals and one timing beside the model (measure_point), and
tp.dryrun.record_requests: the engine's forward recorded for equal requests."""
from __future__ import annotations

import pytest
from helpers import FakeBench

from lessons_lib.course import l00_setup as L
from lessons_lib.measure.comm import (
    AllReduceBench,
    AlphaBeta,
    about,
    all_reduce_seconds,
    comm_cost_state,
    fit_misses,
    measure_point,
    packing_saving,
)
from lessons_lib.tp.dryrun import RECORD_MAX_TOKENS, record_requests


def _ring(alpha, beta, payload, p):
    """The ring model written out on its own: 2(p-1) steps, each alpha + (S/p)/beta."""
    return 2 * (p - 1) * (alpha + payload / p / beta)


def test_c1_comm_cost_state_counts_from_the_trace_and_times_from_the_ring():
    fit = AlphaBeta(80e-6, 2e9)
    s = comm_cost_state(1000, fit)
    assert (s["count"], s["bytes_each"]) == (16, 1000 * 512 * 4)
    assert s["one_s"] == pytest.approx(_ring(80e-6, 2e9, 2_048_000, 2))
    assert s["forward_s"] == pytest.approx(16 * s["one_s"]) and s["dominated"] == "bandwidth"
    # at N* the two terms are equal; the layer count does not move N*
    n_star = s["crossover"]
    assert _ring(80e-6, 2e9, 0, 2) == pytest.approx(_ring(0, 2e9, n_star * 512 * 4, 2) * 1.0)
    assert comm_cost_state(10, fit, n_layers=80)["crossover"] == n_star
    assert comm_cost_state(10, fit, n_layers=80)["count"] == 160
    assert comm_cost_state(10, fit, dtype="bfloat16")["bytes_each"] == 10 * 512 * 2
    assert comm_cost_state(int(n_star) - 1, fit)["dominated"] == "latency"
    # 4 requests of 250 as one forward each: four times the all-reduces, four times the latency
    four = comm_cost_state(1000, fit, requests=4)
    assert four["lens"] == [250] * 4 and four["separate_count"] == 64
    assert four["separate_s"] == pytest.approx(4 * 16 * _ring(80e-6, 2e9, 250 * 512 * 4, 2))
    assert "packed in one forward 16 all-reduces" in L.comm_cost_text(four)
    assert comm_cost_state(10, fit, requests=3)["lens"] == [4, 3, 3]


@pytest.mark.parametrize("bad", [{"num_tokens": 0}, {"num_tokens": 5, "requests": 6}, {"num_tokens": 5, "dtype": "int8"},
                                 {"num_tokens": 5, "n_layers": 0}, {"num_tokens": 5, "world_size": 1}])
def test_comm_cost_state_refuses_bad_input(bad):
    with pytest.raises(ValueError):
        comm_cost_state(fit=AlphaBeta(1e-6, 1e9), **bad)


def test_c1_record_requests_runs_the_engine_on_the_learners_requests():
    rec = record_requests(10, requests=3, n_layers=2, dtype="bfloat16", world_size=2)
    assert rec["lens"] == [4, 3, 3] and rec["agrees"]
    assert [(r.layer, tuple(r.shape), r.bytes) for r in rec["packed"]] == [
        (f"layers.{i}.{part}", (10, 64), 10 * 64 * 2) for i in range(2) for part in ("attn.out_proj", "mlp.fc_down")]
    assert [len(t) for t in rec["separate"]] == [4, 4, 4]
    assert {tuple(r.shape) for t in rec["separate"] for r in t} == {(4, 64), (3, 64)}
    assert "3 request(s) of [4, 3, 3] packed: 4 all-reduces of [10, 64]" in L.record_text(rec)
    assert "the same, record by record" in L.record_text(rec)
    assert record_requests(4, world_size=4)["packed"][0].shape == (4, 64)
    with pytest.raises(ValueError, match="num_tokens"):
        record_requests(RECORD_MAX_TOKENS + 1)
    with pytest.raises(ValueError, match="requests"):
        record_requests(3, requests=4)


def test_c1_fit_misses_and_about_say_how_many_digits_mean_anything():
    fit = AlphaBeta(10e-6, 1e9)
    on_line = all_reduce_seconds(fit, 4096)
    measured = {"bytes": [4096, 4096], "seconds": [on_line, 3 * on_line], "world_size": 2}
    assert fit_misses(fit, measured) == pytest.approx([1.0, 3.0])
    assert [about(x) for x in (259.3, 2197.0, 14.9, 0.04)] == ["300", "2,000", "10", "0.04"]
    assert [about(x, 2) for x in (1836.2, 1.84, 204.0)] == ["1,800", "1.8", "200"]
    assert about(0.0) == "0"
    with pytest.raises(ValueError, match="non-negative"):
        about(-1.0)


def test_all_reduce_bench_refuses_bad_sizes_before_spawning():
    bench = AllReduceBench()
    with pytest.raises(ValueError, match="too large to time"):
        bench.measure([16384], 8192)
    with pytest.raises(ValueError, match="distinct"):
        bench.measure([4, 4])
    assert bench.pool is None  # nothing was spawned


def test_c1_packing_saving_is_the_ring_models_ratio():
    fit = AlphaBeta(80e-6, 2e9)
    one = _ring(80e-6, 2e9, 64 * 512 * 4, 2)
    packed = _ring(80e-6, 2e9, 8 * 64 * 512 * 4, 2)
    assert packing_saving(fit, 64, 8) == pytest.approx(8 * one / packed)
    assert packing_saving(fit, 64, 1) == pytest.approx(1.0)
    ring4 = 8 * _ring(80e-6, 2e9, 64 * 512 * 4, 4) / _ring(80e-6, 2e9, 8 * 64 * 512 * 4, 4)
    assert packing_saving(fit, 64, 8, world_size=4) == pytest.approx(ring4)
    with pytest.raises(ValueError, match="requests"):
        packing_saving(fit, 64, 0)


def test_c1_measure_point_puts_the_model_beside_the_measurement():
    point = measure_point(FakeBench(), 100, 512, AlphaBeta(80e-6, 2e9))
    assert point == {"tokens": 100, "d_model": 512, "bytes": 100 * 512 * 4, "seconds": 1e-3,
                     "model_s": pytest.approx(_ring(80e-6, 2e9, 204_800, 2)), "backend": "fake", "world_size": 2}
