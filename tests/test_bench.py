"""The benchmark's smoke run: JSON structure, and every ratio recomputed from the measured times.

No timing is asserted: only that the numbers in bench.json follow from each other and from the
exact FLOP counts, and that all six methods give the same answers on the same weights.
"""
import json
import math
import statistics

import pytest

from lessons_lib.measure import bench
from lessons_lib.measure.flops import forward_flops
from lessons_lib.serve.scheduler import plan_batches


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    plan = bench.quick_plan()
    res = bench.run(plan, out, "python3 -m lessons_lib.measure.bench --quick", log=lambda *a: None)
    return plan, out, res


def test_json_written_and_schema(result):
    plan, out, res = result
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk["schema"] == bench.SCHEMA and on_disk["quick"] is True
    for key in ("command", "machine", "config", "scheduler", "hf_packed", "workloads", "tiny_requests", "sweeps",
                "gemm_peak", "checks", "plots", "wall_s"):
        assert key in on_disk, key
    assert set(on_disk["workloads"]) == set(plan.workloads)
    assert on_disk["machine"]["torch_threads"] >= 1 and on_disk["config"]["d_model"] == plan.cfg.d_model
    for name in on_disk["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_ratios_follow_from_measured_times(result):
    plan, _, res = result
    peak = res["gemm_peak"]["flops_per_s"]
    assert peak == max(res["gemm_peak"]["samples"]) > 0
    assert res["gemm_peak"]["linear_shapes"] == [list(s) for s in bench.linear_shapes(plan.cfg)]
    for w in [*res["workloads"].values(), res["tiny_requests"]]:
        useful = w["flops_useful"]
        samples = w["gemm_samples"]
        ran = [r for r in w["methods"].values() if "skipped" not in r]
        # one sample before the first run, then one after every run: each run sits between two neighbours
        assert len(samples) == 1 + sum(len(r["times_s"]) for r in ran) and all(0 < p <= peak for p in samples)
        neighbours = set(zip(samples, samples[1:]))
        for r in ran:
            assert r["time_s"] == min(r["times_s"]) > 0
            assert len(r["gemm_pairs"]) == len(r["times_s"]) and all(tuple(p) in neighbours for p in r["gemm_pairs"])
            runs = [useful / (t * max(p)) for t, p in zip(r["times_s"], r["gemm_pairs"])]  # the faster sample of the two
            assert r["efficiency_runs"] == runs and r["efficiency"] == statistics.median(runs)
            assert (r["efficiency_min"], r["efficiency_max"]) == (min(runs), max(runs))
            assert r["above_peak"] == (max(runs) > 1.0)
    for w in res["workloads"].values():
        t_var = w["methods"]["varlen"]["time_s"]
        for r in w["methods"].values():
            if "skipped" in r:
                continue
            assert math.isclose(r["speedup_of_varlen"], r["time_s"] / t_var, rel_tol=1e-12)
            assert math.isclose(r["tokens_per_s"], w["num_tokens"] / r["time_s"], rel_tol=1e-12)
            assert math.isclose(r["predicted_speedup"],
                                r["flops_executed"] / w["methods"]["varlen"]["flops_executed"], rel_tol=1e-12)


def test_paired_efficiency_uses_the_faster_neighbour_and_flags_a_run_above_the_peak():
    # run 1: its samples were 50 and 200 FLOP/s -> divides by 200; run 2: both samples slow -> reads above 1.0
    out = bench.paired_efficiency(100, [1.0, 1.0, 2.0], [(50.0, 200.0), (60.0, 90.0), (100.0, 100.0)])
    assert out["efficiency_runs"] == [0.5, 100 / 90, 0.5]
    assert out["efficiency"] == 0.5 and out["efficiency_min"] == 0.5 and out["efficiency_max"] == 100 / 90
    assert out["above_peak"] is True
    assert bench.paired_efficiency(100, [1.0], [(120.0, 150.0)])["above_peak"] is False
    with pytest.raises(ValueError, match="one .before, after. GEMM pair per timed run"):
        bench.paired_efficiency(100, [1.0, 2.0], [(1.0, 2.0)])


def test_flop_counts_recomputed_from_the_batches(result):
    plan, _, res = result
    for name, w in res["workloads"].items():
        n, kw = plan.workloads[name]
        lengths = bench.workload_lengths(name, n, seed=plan.seed, **kw)
        assert sum(lengths) == w["num_tokens"] and w["batch_tokens"] and sum(w["batch_tokens"]) == sum(lengths)
        batches = plan_batches(lengths, plan.max_num_batched_tokens, plan.max_num_seqs)
        assert [len(b) for b in batches] == w["batch_seqs"]
        # padded: R * Lmax rows per batch; masked: T^2 cells per batch; both >= varlen's.
        blens = [[lengths[i] for i in b] for b in batches]
        padded = sum(forward_flops(plan.cfg, b, "padded", causal=True).total for b in blens)
        assert w["methods"]["hf_padded"]["flops_executed"] == padded
        assert w["methods"]["varlen"]["flops_executed"] == w["flops_useful"]  # varlen executes only useful work
        assert all(r["flops_executed"] >= w["flops_useful"] for r in w["methods"].values() if "skipped" not in r)


def test_all_methods_agree_on_the_same_weights(result):
    _, _, res = result
    assert res["hf_packed"]["supported"] in (True, False) and res["hf_packed"]["why"]
    for name, w in res["workloads"].items():
        for m, r in w["methods"].items():
            if "skipped" not in r:
                assert r["max_abs_diff_vs_varlen"] < 1e-4, (name, m, r["max_abs_diff_vs_varlen"])


def test_checks_and_tiny_and_sweeps_are_consistent(result):
    plan, _, res = result
    tiny = res["tiny_requests"]
    assert tiny["flops_useful"] == forward_flops(plan.cfg, [tiny["tokens_each"]] * tiny["num_requests"], "varlen",
                                                 causal=True, useful_only=True).total
    t_var, t_pad = tiny["methods"]["varlen"]["time_s"], tiny["methods"]["padded"]["time_s"]
    assert math.isclose(tiny["per_request_overhead_s"], (t_var - t_pad) / tiny["num_requests"], rel_tol=1e-12)
    assert tiny["padded_over_varlen"] == t_pad / t_var
    assert res["checks"]["tiny_varlen_vs_padded"]["holds"] == (t_pad / t_var >= 1.0)
    for name in ("long-tail", "bimodal"):
        for key, c in res["checks"][name].items():
            assert c["holds"] == (c["measured"] >= c["required"]), (name, key)
            if key != "varlen_vs_hf_one_at_a_time":
                assert math.isclose(c["required"], c["predicted_by_flops"] * (1 - c["varlen_loop_overhead_fraction"]))
    for name, w in res["workloads"].items():
        eff, var = res["checks"][f"efficiency_{name}"], w["methods"]["varlen"]
        assert (eff["value"], eff["min"], eff["max"]) == (var["efficiency"], var["efficiency_min"], var["efficiency_max"])
        assert eff["holds"] == (eff["value"] >= eff["target"])
    above = [f"{n}/{m}" for n, w in res["workloads"].items() for m, r in w["methods"].items() if r.get("above_peak")]
    above += [f"tiny/{m}" for m, r in tiny["methods"].items() if r["above_peak"]]
    assert res["checks"]["no_run_above_gemm_peak"] == {"runs_above": above, "holds": not above}
    for key in ("c9", "c14"):
        pts = res["sweeps"][key]["points"]
        assert len(pts) >= 3 and all(p["masked_cells"] >= p["varlen_cells"] for p in pts)
        assert all(p["masked_s"] > 0 and p["varlen_s"] > 0 for p in pts)
    c14 = res["sweeps"]["c14"]["points"]
    assert len({p["tokens"] for p in c14}) == 1 and len({p["masked_cells"] for p in c14}) == 1  # T^2 whatever the mix


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--repeats", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--workloads", "zipf"])
    assert "unknown workload" in capsys.readouterr().err


def test_profile_lists_the_top_operators(capsys):
    plan = bench.quick_plan()
    ops = bench.profile_workloads(plan, ["constant"], top=5)["constant"]
    shares = [share for _, _, share in ops]
    assert len(ops) == 5 and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert any(name in ("aten::addmm", "aten::mm") for name, _, _ in ops)  # the linear layers take time
    assert "constant: varlen" in capsys.readouterr().out
