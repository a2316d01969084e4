"""tools/gpu_check.py in its CPU mode: every step runs, every check has a verdict, and a step that
fails or hangs is recorded (error, traceback, timeout) while the next steps still run.

One run (about 60 s on 2 quiet cores) with two injected faults: ``env`` hangs after its work and
is killed at its 8 s timeout (on a busy machine, possibly before it has finished that work);
``attention`` raises after its work. The other four steps must pass.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"
STEPS = ["env", "attention", "model", "tp", "torchrun", "bench"]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run("--device", "cpu", "--quick", "--out", str(out), "--inject", "env:hang", "--step-budget", "env=8",
                "--inject", "attention:fail")
    path = out / "gpu_check.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(path.read_text()), out


def test_every_step_is_reported_and_every_check_has_a_verdict(report):
    proc, rep, out = report
    assert rep["schema"] == "lessons_lib.gpu_check/1" and rep["device"] == "cpu" and rep["quick"] is True
    assert list(rep["steps"]) == STEPS
    for name, step in rep["steps"].items():
        assert step["status"] in ("ok", "fail", "error", "timeout", "skipped"), name
        assert step["wall_s"] <= step["timeout_s"] + 10, name
        assert step["checks"] or name == "env", f"{name} recorded no check"  # env may be killed before its first
        for c in step["checks"]:
            assert c["verdict"] in ("pass", "fail", "skip") and c["kind"] in ("correctness", "performance"), c
            assert c["verdict"] != "skip" or c["reason"], c
    for name in ("model", "tp", "torchrun", "bench"):
        step = rep["steps"][name]
        assert step["status"] == "ok", (name, step.get("error"), step["checks"])
        assert any(c["verdict"] == "pass" and c["kind"] == "correctness" for c in step["checks"]), name
    assert (out / "gpu_check.log").read_text().count("\n== ") >= len(STEPS)
    assert (out / "torchrun.log").exists() and (out / "bench" / "bench.json").exists()


def test_the_cpu_mode_checks_what_it_says(report):
    _, rep, _ = report
    steps = rep["steps"]
    attn = {c["name"]: c for c in steps["attention"]["checks"]}
    ran = [c for c in attn.values() if c["verdict"] == "pass"]
    assert {n.split(" | ")[1] for n in attn if " | " in n} == {"float16", "bfloat16"}
    assert all(c["err"] <= c["bound"] for c in ran) and any("bottom-right" in n for n in attn)
    assert attn["bfloat16 flash"]["verdict"] == "skip" and attn["bfloat16 flash"]["reason"]  # refused, and why
    assert steps["tp"]["data"]["backend"] == "gloo" and steps["tp"]["data"]["devices"] == ["cpu", "cpu"]
    assert steps["torchrun"]["data"]["exit_code"] == 0
    assert any("fp32 CUDA" in c["name"] and c["verdict"] == "skip" for c in steps["model"]["checks"])
    if "backends" in steps["env"]["data"]:  # measured before its injected hang (unless the machine is very busy)
        assert steps["env"]["data"]["backends"]["table"]["float32"]["flash"]["available"] is False


def test_a_failed_or_hung_step_is_recorded_and_the_others_still_run(report):
    proc, rep, _ = report
    assert proc.returncode == 1, proc.stdout[-2000:]
    env, attn = rep["steps"]["env"], rep["steps"]["attention"]
    assert env["status"] == "timeout" and "killed after its timeout" in env["error"] and env["wall_s"] < 30
    assert attn["status"] == "error" and "injected failure" in attn["error"] and "Traceback" in attn["traceback"]
    assert len(attn["checks"]) > 20  # every check it made before the failure is kept
    s = rep["summary"]
    assert s["verdict"] == "fail" and s["steps_not_ok"] == ["env: timeout", "attention: error"]
    assert s["failed_correctness_checks"] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_a_gpu_says_why(tmp_path):
    proc = _run("--steps", "attention", "--quick", "--out", str(tmp_path), timeout=120)
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    step = rep["steps"]["attention"]
    assert proc.returncode == 1 and step["status"] == "skipped" and "torch.cuda.is_available() is False" in step["reason"]
    assert rep["steps"]["model"] == {"status": "skipped", "reason": "not selected (--steps)"}


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    for args in (["--inject", "env:explode"], ["--steps", "env,nope"], ["--step-budget", "tp"]):
        proc = _run(*args, "--out", str(tmp_path), timeout=60)
        assert proc.returncode == 2 and "usage" in proc.stderr, args
    assert not (tmp_path / "gpu_check.json").exists()
