"""tools/gpu_check.py on the CPU: it runs the device tests (pytest -m device) and the GPU benchmark
in their CPU mode and writes one report; a step that hangs is stopped with every process it started;
failures, errors and skips are counted from pytest's JUnit file.

One full run, about 60-70 s on 2 busy cores (the device tests are most of it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402  # tools/ is no package: importable only after the sys.path line above

DEVICE_TESTS = ("test_attention_backend_matches_the_fp64_reference", "test_model_in_bf16_on_the_device_matches_float64_on_the_cpu",
                "test_tp2_on_the_device_equals_tp1_in_bf16", "test_torchrun_demo_on_the_device")


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run("--device", "cpu", "--out", str(out))
    path = out / "gpu_check.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(path.read_text()), out


def test_the_cpu_run_passes_and_reports_every_step(report):
    proc, rep, out = report
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert rep["schema"] == "lessons_lib.gpu_check/2" and rep["device"] == "cpu"
    assert list(rep["steps"]) == ["env", "tests", "bench"]
    for name, step in rep["steps"].items():
        assert step["status"] == "ok" and step["returncode"] == 0, (name, step)
        assert step["wall_s"] <= step["timeout_s"] + 1 and (out / step["log"]).is_file(), name
    assert rep["summary"] == {"verdict": "pass", "steps_not_ok": [], "tests": rep["steps"]["tests"]["counts"]}
    env = rep["steps"]["env"]["environment"]
    assert env["device"] == "cpu" and env["cuda_available"] is torch.cuda.is_available()
    flash = env["attention_backends_head_dim_64"]["float32"]["flash"]
    assert flash["available"] is False and flash["reason"]


def test_the_tests_step_is_the_device_selection_and_counts_it(report):
    _, rep, _ = report
    tests = rep["steps"]["tests"]
    assert "-m device --device cpu" in tests["command"]
    counts = tests["counts"]
    assert counts["failed"] == counts["errors"] == 0 and counts["passed"] > 20 and not tests["failures"]
    assert len(tests["skipped"]) == counts["skipped"] and all(s["reason"] for s in tests["skipped"])
    assert len(tests["passed"]) == counts["passed"]
    for name in DEVICE_TESTS:  # every kind of check ran here, not only skipped
        assert any(f"::{name}" in t for t in tests["passed"]), name
    flash = [sk for sk in tests["skipped"] if "[flash-" in sk["test"]]
    assert flash and all("flash does not run here" in sk["reason"] for sk in flash)


def test_the_bench_step_reports_peak_and_fractions(report):
    _, rep, _ = report
    res = rep["steps"]["bench"]["result"]
    assert res["schema"] == "lessons_lib.gpu_bench/1" and res["device"] == "cpu" and res["dtype"] == "bfloat16"
    peak = res["gemm"]["peak_tflops"]
    assert peak == max(res["gemm"]["tflops"].values()) > 0
    assert set(res["workloads"]) == {"long-tail", "bimodal"}
    for name, w in res["workloads"].items():
        attn = w["attention"]
        assert set(attn) == {"useful_flops", "flash", "torch_varlen", "triton", "sdpa", "padded"}
        for b in ("flash", "torch_varlen", "triton"):  # none is timed on the CPU, each says why
            assert attn[b]["skipped"], (name, b)
        for b in ("sdpa", "padded"):
            r = attn[b]
            assert r["useful_tflops"] == pytest.approx(attn["useful_flops"] / r["time_s"] / 1e12)
            assert r["fraction_of_gemm_peak"] == pytest.approx(r["useful_tflops"] / peak)
            assert r["max_abs_diff_vs_sdpa"] <= 0.05  # bf16 rounding, not a wrong answer
        e = w["engine"]
        assert e["attention_backend"] == "sdpa"
        assert e["fraction_of_gemm_peak"] == pytest.approx(e["useful_flops"] / e["time_s"] / 1e12 / peak)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_a_gpu_says_why(tmp_path):
    proc = _run("--device", "cuda", "--out", str(tmp_path), timeout=180)
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 1 and rep["summary"]["verdict"] == "fail"
    for name in ("env", "tests", "bench"):
        step = rep["steps"][name]
        assert step["status"] == "fail", (name, step)
        assert "torch.cuda.is_available() is False" in (tmp_path / step["log"]).read_text(), name


_HANGS = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)        # deaf to SIGTERM: only SIGKILL stops it
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)                          # in a session of its own, like torchrun's workers
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_step_that_hangs_is_stopped_with_everything_it_started(tmp_path):
    log = tmp_path / "hang.log"
    t0 = time.monotonic()
    rec = gpu_check.run_step([sys.executable, "-c", textwrap.dedent(_HANGS)], 3.0, log)
    assert time.monotonic() - t0 < 3.0 + 3 * gpu_check.GRACE_S
    assert rec["status"] == "timeout" and "stopped after its timeout of 3 s" in rec["error"]
    grandchild = int(log.read_text().split()[0])
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(grandchild):
        os.kill(grandchild, 9)
        pytest.fail(f"the step's own child {grandchild} (its own session) survived the stop")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_device" name="test_a[ok]" time="0.1"/>
<testcase classname="tests.test_device" name="test_a[bad]" time="0.1"><failure message="AssertionError: flash, bfloat16: max |out - ref64| = 1e-1 exceeds the bound">trace</failure></testcase>
<testcase classname="tests.test_device" name="test_b" time="0.1"><error message="failed on setup">boom</error></testcase>
<testcase classname="tests.test_device" name="test_c" time="0.0"><skipped type="pytest.skip" message="flash does not run here">why</skipped></testcase>
</testsuite></testsuites>"""


def test_failures_errors_and_skips_are_counted_and_fail_the_verdict(tmp_path):
    (tmp_path / "pytest.xml").write_text(JUNIT)
    s = gpu_check.junit_summary(tmp_path / "pytest.xml")
    assert s["counts"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert s["passed"] == ["tests.test_device::test_a[ok]"]
    assert [f["test"] for f in s["failures"]] == ["tests.test_device::test_a[bad]", "tests.test_device::test_b"]
    assert "exceeds the bound" in s["failures"][0]["message"] and s["failures"][1]["kind"] == "error"
    assert s["skipped"] == [{"test": "tests.test_device::test_c", "reason": "flash does not run here"}]
    ok = {"status": "ok"}
    assert gpu_check.summarize({"env": ok, "tests": {**ok, **s}, "bench": ok})["verdict"] == "fail"
    passed = {"passed": 3, "failed": 0, "errors": 0, "skipped": 0}
    assert gpu_check.summarize({"env": ok, "tests": {**ok, "counts": passed}, "bench": ok})["verdict"] == "pass"
    none = dict(passed, passed=0)  # nothing ran: not a pass
    assert gpu_check.summarize({"env": ok, "tests": {**ok, "counts": none}, "bench": ok})["verdict"] == "fail"
    assert gpu_check.summarize({"env": ok, "tests": {**ok, "counts": passed},
                                "bench": {"status": "timeout"}})["steps_not_ok"] == ["bench: timeout"]


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    for args in (["--device", "gpu"], ["--budget", "5"]):
        proc = _run(*args, "--out", str(tmp_path), timeout=60)
        assert proc.returncode == 2 and "usage" in proc.stderr, args
    assert not (tmp_path / "gpu_check.json").exists()
