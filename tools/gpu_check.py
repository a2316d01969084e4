#!/usr/bin/env python3
"""The GPU check: the device tests (pytest) and the GPU benchmark, within a time budget, one JSON report.

    python3 tools/gpu_check.py --device cuda --out DIR    # on a GPU machine, from the repository root
    python3 tools/gpu_check.py --device cpu --out DIR     # the same selection on the CPU (CI)

Three steps, each a subprocess with its own timeout:

1. ``env``: ``python -m lessons_lib.measure.gpu_bench --env`` (versions, GPUs, which attention
   backends run and why not, NCCL) -> ``env.json``;
2. ``tests``: ``python -m pytest tests/test_device.py -m device --device DEV`` (attention backends
   against the fp64 reference in fp16/bf16, the model on the device against the CPU, TP=2 over
   NCCL or gloo, torchrun) -> ``pytest.xml`` (JUnit), ``pytest.log``;
3. ``bench``: ``python -m lessons_lib.measure.gpu_bench --device DEV`` (bf16 GEMM peak, every
   attention backend and the engine on the benchmark's workloads) -> ``bench/gpu_bench.json``.

Writes ``DIR/gpu_check.json`` (schema ``lessons_lib.gpu_check/2``) after every step: what ran,
each step's status, exit code and time, the tests' passed / failed / error / skipped counts
with every failure and skip reason, the benchmark's numbers and the environment. ``--out``
defaults to ``$OUT``, else ``./gpu_check_out``. Exit code 0 when every step ran, no test
failed and at least one passed; else 1.

Never hangs: the whole run stays within ``--budget`` seconds. A step that runs out of time is
stopped with everything it started: SIGTERM to its process group and to every descendant
(torchrun's workers run in sessions of their own), then SIGKILL 5 s later. This script only
launches; it never imports torch. The steps run under this interpreter if it has torch, else
under the repository's ``.venv/bin/python`` (``--python`` chooses).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "lessons_lib.gpu_check/2"
TESTS = ["tests/test_device.py"]
# Seconds each step may take at most (the benchmark gets what is left of the budget).
STEP_S = {"env": 60.0, "tests": 330.0}
RESERVE_S = 10.0  # kept back for stopping a step and writing the report
GRACE_S = 5.0     # between SIGTERM and SIGKILL


# ---- running one step ---------------------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    """pid -> child pids, from /proc (empty where there is no /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc``'s process group and every descendant, then SIGKILL what is left after GRACE_S."""
    pids = set(descendants(proc.pid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids |= set(descendants(proc.pid))  # a child started since the last look
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, sig)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=GRACE_S)
    proc.wait()


def run_step(cmd: list[str], timeout: float, log_path: Path) -> dict:
    """Run ``cmd`` in its own session with output to ``log_path``; stop it after ``timeout`` s."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    t0 = time.monotonic()
    rec = {"command": " ".join(cmd), "timeout_s": round(timeout, 1), "log": log_path.name}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rec["returncode"] = proc.wait(timeout=timeout)
            rec["status"] = "ok" if proc.returncode == 0 else "fail"
        except subprocess.TimeoutExpired:
            stop(proc)
            rec.update(status="timeout", returncode=proc.returncode,
                       error=f"stopped after its timeout of {timeout:.0f} s, with every process it started")
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM of this script: stop the step, keep the report
            stop(proc)
            rec.update(status="interrupted", returncode=proc.returncode, error="gpu_check was interrupted")
            raise
        finally:
            rec["wall_s"] = round(time.monotonic() - t0, 1)
    return rec


# ---- reading what the steps wrote -----------------------------------------------------------------------
def junit_summary(path: Path) -> dict:
    """Counts and the failures and skips of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    passed, failures, skips = [], [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
            passed.append(name)
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            skips.append({"test": name, "reason": outcome.get("message", "")})
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append({"test": name, "kind": outcome.tag,
                             "message": (outcome.get("message") or "")[:800], "detail": (outcome.text or "")[-2000:]})
    return {"counts": counts, "failures": failures, "skipped": skips, "passed": passed}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# ---- the run ---------------------------------------------------------------------------------------------
class Report:
    def __init__(self, args, argv: list[str]):
        self.out, self.t0, self.budget = args.out, time.monotonic(), args.budget
        self.path = self.out / "gpu_check.json"
        self.data = {"schema": SCHEMA, "command": "python3 tools/gpu_check.py " + " ".join(argv), "device": args.device,
                     "budget_s": args.budget, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "launcher": {"python": sys.executable, "python_version": platform.python_version(),
                                  "platform": platform.platform(), "commit": _commit()},
                     "steps": {}}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.data["summary"] = summarize(self.data["steps"])
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


def default_python() -> str:
    """This interpreter if it has torch (checked without importing it), else the repository's .venv."""
    import importlib.util
    venv = ROOT / ".venv" / "bin" / "python"
    return sys.executable if importlib.util.find_spec("torch") or not venv.exists() else str(venv)


def _commit() -> str | None:
    with contextlib.suppress(Exception):
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return proc.stdout.strip() or None
    return None


def summarize(steps: dict) -> dict:
    tests = steps.get("tests", {}).get("counts", {})
    not_ok = [f"{name}: {rec['status']}" for name, rec in steps.items() if rec.get("status") != "ok"]
    failed = tests.get("failed", 0) + tests.get("errors", 0)
    ok = not not_ok and not failed and tests.get("passed", 0) > 0 and "bench" in steps
    return {"verdict": "pass" if ok else "fail", "steps_not_ok": not_ok, "tests": tests}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default cuda")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"),
                   help="folder for the report (default $OUT, else ./gpu_check_out)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default 540)")
    p.add_argument("--python", default=None, help="interpreter of the steps (default: this one if it has torch, "
                   "else .venv/bin/python)")
    p.add_argument("--tests", nargs="+", default=TESTS, help=f"pytest paths for -m device (default {' '.join(TESTS)})")
    args = p.parse_args(argv)
    if args.budget < 3 * RESERVE_S:
        p.error(f"--budget must be at least {3 * RESERVE_S:.0f} s, got {args.budget:g}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    rep = Report(args, argv)
    py, dev = args.python or default_python(), args.device
    rep.data["launcher"]["steps_python"] = py
    steps = {
        "env": [py, "-m", "lessons_lib.measure.gpu_bench", "--env", "--device", dev, "--out", str(args.out)],
        "tests": [py, "-m", "pytest", *args.tests, "-m", "device", "--device", dev, "-o", "addopts=",
                  "-p", "no:cacheprovider", "-q", "-rfEs", "--junitxml", str(args.out / "pytest.xml")],
        "bench": [py, "-m", "lessons_lib.measure.gpu_bench", "--device", dev, "--out", str(args.out / "bench")],
    }
    print(f"gpu_check: device {dev}, budget {args.budget:.0f} s, report {rep.path}", flush=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    try:
        for name, cmd in steps.items():
            timeout = min(STEP_S.get(name, float("inf")), rep.left() - RESERVE_S)
            if timeout < RESERVE_S:
                rep.data["steps"][name] = {"status": "skipped", "reason": f"budget: {rep.left():.0f} s left"}
                continue
            print(f"\n== {name} (timeout {timeout:.0f} s): {' '.join(cmd[1:])}", flush=True)
            rep.data["steps"][name] = rec = {"status": "running"}
            rep.save()
            rec.update(run_step(cmd, timeout, args.out / f"{name}.log"))
            if name == "env":
                rec["environment"] = _read_json(args.out / "env.json")
            elif name == "tests" and (args.out / "pytest.xml").is_file():
                with contextlib.suppress(ET.ParseError):
                    rec.update(junit_summary(args.out / "pytest.xml"))
            elif name == "bench":
                rec["result"] = _read_json(args.out / "bench" / "gpu_bench.json")
            print(_tail(args.out / f"{name}.log"), flush=True)
            print(f"== {name}: {rec['status']} in {rec['wall_s']} s" + (f" ({rec['error']})" if "error" in rec else ""),
                  flush=True)
            rep.save()
    except KeyboardInterrupt as exc:
        for rec in rep.data["steps"].values():
            if rec.get("status") == "running":
                rec.update(status="interrupted", error=f"gpu_check was interrupted ({exc or 'Ctrl-C'})")
    rep.save()
    s = rep.data["summary"]
    print(f"\nverdict: {s['verdict'].upper()} in {rep.data['elapsed_s']} s; tests {json.dumps(s['tests'])}; "
          f"steps not ok: {s['steps_not_ok'] or 'none'}\nreport: {rep.path}", flush=True)
    return 0 if s["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
