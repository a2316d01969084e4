"""Which claim rows each of the engine's named faults flips: run the lessons whole, with no fault and under faults.

Every lesson notebook runs in a fresh kernel (nbclient, the Agg backend) with ``LESSONS_CLAIMS_RECORD`` set, so
``course.check.claim`` records every row (value, expected, ok) instead of stopping at a failed one. A first run
with no fault must hold every row; each further run turns faults on from the kernel's start
(``LESSONS_FAULTS``; TP workers spawned by the lesson turn them on too). A row is flipped by a fault when it holds
with no fault and fails under it; a row the run never reached (a cell raised first) is counted apart.

    python tools/claims_coverage.py                  each fault against the lessons that declare it
    python tools/claims_coverage.py --lessons 03,05  only those lessons
    python tools/claims_coverage.py --all --jobs 2   every fault against every lesson, two kernels at a time

A lesson declares a fault when one of its claims' breakages uses it (tests/breakages.py) or its notebook names it
(quoted in code, or in backticks in the prose).
Writes docs/claims_coverage.md and docs/claims_coverage.json (lessons not run this time are kept from the JSON).
One lesson run costs as long as the lesson's notebook (``make notebooks`` runs them all); not part of ``make test``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # lessons_lib, and tests/breakages.py (the claims' faults)
NOTEBOOKS = ROOT / "notebooks"
OUT = ROOT / "docs" / "claims_coverage.md"
START = "from lessons_lib import faults\nfaults.apply_from_env()"  # the kernel's first cell: faults on from the start


def run_lesson(notebook: str, fault_names: tuple[str, ...], timeout: int) -> dict:
    """Run ``notebook`` whole with ``fault_names`` on; the rows it recorded, the cells that raised, seconds."""
    import nbformat
    from helpers import run_cells  # tests/helpers.py: the cell-by-cell runner test_claims_can_fail uses too
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / f"{notebook}.ipynb", as_version=4)
    with tempfile.TemporaryDirectory(prefix="claims_coverage_") as tmp:
        record = Path(tmp) / "rows.jsonl"
        env = {"LESSONS_CLAIMS_RECORD": str(record), "LESSONS_FAULTS": ",".join(fault_names), "MPLBACKEND": "Agg"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the kernel inherits this process's environment
        t0 = time.perf_counter()
        errors: list[str] = []
        try:
            client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                                    resources={"metadata": {"path": str(NOTEBOOKS)}})
            with client.setup_kernel():
                client.execute_cell(nbformat.v4.new_code_cell(START), 0)
                errors = [f"cell {i}: {o.get('ename')}: {str(o.get('evalue'))[:160]}"
                          for i, outs in run_cells(client, nb).items() for o in outs]
        finally:
            for k, v in old.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return {"faults": list(fault_names), "seconds": round(time.perf_counter() - t0, 1), "errors": errors,
            "rows": {f"{r['claim']}: {r['row']}": r["ok"] for r in rows}}


def declared() -> dict[str, set[str]]:
    """Fault name -> the notebooks that declare it (its breakages' claims, or the notebook names it)."""
    from breakages import BREAKS

    from lessons_lib.faults import FAULTS
    out: dict[str, set[str]] = {name: set() for name in FAULTS}
    for b in BREAKS.values():
        for name in b.faults:
            out[name].add(b.notebook)
    for path in NOTEBOOKS.glob("*.ipynb"):
        text = path.read_text()
        for name in FAULTS:
            if any(f"{q}{name}" in text for q in ('"', "'", "`")):  # named in code or in the prose
                out[name].add(path.stem)
    return out


def coverage(lesson: dict) -> list[dict]:
    """Per row of the clean run: whether it held, the faults that flip it, those whose run never reached it."""
    clean = lesson["runs"][""]["rows"]
    out = []
    for key, ok in clean.items():
        runs = [r for name, r in lesson["runs"].items() if name]
        out.append({"row": key, "holds": ok,
                    "flipped_by": sorted(n for r in runs for n in r["faults"] if ok and r["rows"].get(key) is False),
                    "not_reached_by": sorted(n for r in runs for n in r["faults"] if key not in r["rows"])})
    return sorted(out, key=lambda r: (bool(r["flipped_by"]), r["row"]))


def cell(text: str) -> str:
    """``text`` inside a Markdown table cell (a row named ``max |diff|`` keeps its bars)."""
    return text.replace("|", "\\|")


def report(data: dict) -> str:
    lines = ["# Claims coverage", "",
             "Generated by `make claims-coverage` (tools/claims_coverage.py): every lesson run whole with no fault "
             "(every row must hold) and under the engine's named faults (`lessons_lib.faults`). A row is flipped "
             "by a fault when it holds without it and fails with it; rows no fault flips come first.", "",
             f"Last run: {data['last_run']}.", ""]
    for notebook, lesson in sorted(data["lessons"].items()):
        rows = coverage(lesson)
        flipped = sum(1 for r in rows if r["flipped_by"])
        clean = lesson["runs"][""]
        lines += [f"## {notebook}", "",
                  f"{flipped} / {len(rows)} rows flipped by at least one fault; {len(lesson['runs']) - 1} fault runs; "
                  f"run without faults: {clean['seconds']} s, {len(clean['errors'])} cell errors, "
                  f"{sum(1 for r in rows if not r['holds'])} rows failing.", "",
                  "| row | holds without faults | flipped by | run stopped before it |", "|---|---|---|---|"]
        lines += [f"| {cell(r['row'])} | {'yes' if r['holds'] else '**NO**'} | {', '.join(r['flipped_by']) or '**none**'} "
                  f"| {', '.join(r['not_reached_by'])} |" for r in rows]
        lines += ["", "| fault | seconds | rows recorded | cell errors |", "|---|---|---|---|"]
        lines += [f"| {name} | {r['seconds']} | {len(r['rows'])} | {len(r['errors'])} |"
                  for name, r in sorted(lesson["runs"].items()) if name]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lessons", default="", help="comma-separated lesson numbers, e.g. 03,05 (default: all)")
    parser.add_argument("--all", action="store_true", help="every fault against every lesson (the full product)")
    parser.add_argument("--jobs", type=int, default=1, help="lessons run at a time (one kernel each)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument("--faults", default="", help="comma-separated fault names: only these runs (and the run without "
                        "faults); the lesson's other fault runs are kept from the JSON")
    parser.add_argument("--out", type=Path, default=OUT, help="the Markdown report; the JSON goes beside it")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    notebooks = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    wanted = [x.strip() for x in args.lessons.split(",") if x.strip()]
    unknown = [w for w in wanted if not any(n.startswith(f"{w}_") for n in notebooks)]
    if unknown:
        parser.error(f"no lesson {unknown}; lessons: {', '.join(n[:2] for n in notebooks)}")
    notebooks = [n for n in notebooks if not wanted or n[:2] in wanted]
    by_fault = declared()
    only = [x.strip() for x in args.faults.split(",") if x.strip()]
    if [f for f in only if f not in by_fault]:
        parser.error(f"unknown faults {[f for f in only if f not in by_fault]}; known: {', '.join(sorted(by_fault))}")
    plan = [(n, ()) for n in notebooks] + [(n, (f,)) for f, where in sorted(by_fault.items()) for n in notebooks
                                          if (args.all or n in where or f in only) and (not only or f in only)]
    print(f"{len(plan)} lesson runs ({len(notebooks)} lessons without faults, {len(plan) - len(notebooks)} under one)")
    json_path = args.out.with_suffix(".json")
    runs: dict[str, dict] = {n: {} for n in notebooks}
    t0 = time.perf_counter()
    if args.jobs > 1 and "OMP_NUM_THREADS" not in os.environ:  # each kernel (and its TP ranks) its share of the cores
        from lessons_lib.tp.workers import threads_per_worker
        os.environ["OMP_NUM_THREADS"] = str(threads_per_worker(args.jobs))
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [(n, f, pool.submit(run_lesson, n, f, args.timeout)) for n, f in plan]
        for n, f, fut in futures:
            run = fut.result()
            runs[n][",".join(f)] = run
            print(f"{n} {','.join(f) or 'no fault'}: {run['seconds']} s, {len(run['rows'])} rows, "
                  f"{sum(not ok for ok in run['rows'].values())} failing, {len(run['errors'])} cell errors", flush=True)
    # read the JSON only now: another run may have written other lessons meanwhile
    data = json.loads(json_path.read_text()) if json_path.exists() else {"lessons": {}}
    for n in notebooks:
        kept = data["lessons"].get(n, {}).get("runs", {}) if only else {}
        data["lessons"][n] = {"runs": {**{k: v for k, v in kept.items() if k}, **runs[n]}}
    data["last_run"] = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `{' '.join(argv or sys.argv[1:]) or 'no flags'}`"
                        f": {len(plan)} lesson runs in {time.perf_counter() - t0:,.0f} s, {args.jobs} at a time")
    json_path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    args.out.write_text(report(data))
    failing = [(n, r["row"]) for n in notebooks for r in coverage(data["lessons"][n]) if not r["holds"]]
    print(f"wrote {args.out} and {json_path}")
    if failing:
        print(f"rows failing WITHOUT faults: {failing}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
