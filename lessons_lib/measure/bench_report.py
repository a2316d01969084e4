"""Reporting for ``python3 -m lessons_lib.bench``: the PNG plots and the Markdown tables of one
run, both drawn only from the result dict that ``bench.run`` also writes as ``bench.json``.
"""
from __future__ import annotations

import json
import pathlib

# The six ways the benchmark runs a workload, in table order (see bench.py's docstring).
METHODS = ("varlen", "masked", "padded", "hf_padded", "hf_one_at_a_time", "hf_packed")
TARGET_EFFICIENCY = 0.85  # the benchmark's goal for varlen on every workload: useful FLOPs / (time x GEMM peak)


def write_plots(result: dict, out_dir: pathlib.Path) -> list[str]:
    """Write the methods, efficiency and sweep plots into ``out_dir``; return the file names."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from ..style import measured_series, to_png

    files = {}
    names = [n for n in result["workloads"]]
    fig = Figure(figsize=(9, 3.8))
    ax = fig.add_subplot()
    width = 0.8 / (len(METHODS) - 1)
    for k, m in enumerate(METHODS[1:]):
        xs, ys, preds = [], [], []
        for i, n in enumerate(names):
            r = result["workloads"][n]["methods"][m]
            if "skipped" in r:
                continue
            xs.append(i + (k - (len(METHODS) - 2) / 2) * width)
            ys.append(r["speedup_of_varlen"])
            preds.append(r["predicted_speedup"])
        ax.bar(xs, ys, width=width * 0.95, label=m)
        ax.plot(xs, preds, "k_", markersize=10)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("time / varlen time (log)")
    ax.set_title("How much slower than varlen (bars: measured; black ticks: FLOP-count prediction)", fontsize=9)
    ax.legend(fontsize=7, frameon=False, ncol=3)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.1, top=0.9)
    files["methods_speedup.png"] = to_png(fig)

    fig = Figure(figsize=(9, 3.4))
    ax = fig.add_subplot()
    for k, m in enumerate(METHODS):
        xs, ys, spread = [], [], ([], [])
        for i, n in enumerate(names):
            r = result["workloads"][n]["methods"][m]
            if "skipped" not in r:
                xs.append(i + (k - (len(METHODS) - 1) / 2) * (0.8 / len(METHODS)))
                ys.append(r["efficiency"])
                spread[0].append(r["efficiency"] - r["efficiency_min"])
                spread[1].append(r["efficiency_max"] - r["efficiency"])
        ax.bar(xs, ys, width=0.8 / len(METHODS) * 0.95, label=m, yerr=spread, capsize=2, error_kw={"lw": 0.7})
    ax.axhline(TARGET_EFFICIENCY, color="gray", ls="--", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("useful FLOPs / (time x GEMM peak)")
    ax.set_title(f"Useful FLOPs / (time x the model's own {result['gemm_peak']['dtype']} GEMMs sampled beside each run), "
                 "median of runs", fontsize=9)
    ax.legend(fontsize=7, frameon=False, ncol=3)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.1, top=0.9)
    files["efficiency.png"] = to_png(fig)

    for key, sweep in result["sweeps"].items():
        pts = sweep["points"]
        rs = [p["R"] for p in pts]
        for what, unit, scale in (("s", "ms", 1e3), ("peak_bytes", "MiB", 1 / 2**20)):
            series = {m: [max(p[f"{m}_{what}"] * scale, 1e-3) for p in pts] for m in ("masked", "varlen")}
            label = "time" if what == "s" else "peak memory"
            fig = measured_series(rs, series, f"R ({sweep['what']})", f"{label} ({unit})",
                                  f"{key.upper()}: attention {label}, masked vs varlen (measured)")
            files[f"{key}_{'time' if what == 's' else 'memory'}.png"] = to_png(fig)
    for fname, data in files.items():
        (out_dir / fname).write_bytes(data)
    return sorted(files)


def summary_markdown(res: dict) -> str:
    """The tables of one run, as Markdown (written next to bench.json)."""
    m = res["machine"]
    out = [f"# Benchmark results ({'quick smoke run' if res['quick'] else 'full run'})", "",
           f"Command: `{res['command']}`  ", f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch "
           f"{m['torch']} ({m['torch_threads']} threads), transformers {m['transformers']}, Python {m['python']}; "
           f"1-min load average {m['load_average_1min_at_start']} at start, {m.get('load_average_1min_at_end')} at end.  ",
           f"Model: {res['config']['n_layers']} layers, d_model {res['config']['d_model']}, {res['config']['n_heads']} heads, "
           f"FFN {res['config']['d_ffn']}, {m['dtype']} on {m['device']}, TP=1. "
           f"Scheduler: {res['scheduler']['max_num_batched_tokens']} tokens / "
           f"{res['scheduler']['max_num_seqs']} requests per batch, FCFS.  ",
           f"GEMM peak: the model's own linear layers ({', '.join(f'{a}->{b}' for a, b in res['gemm_peak']['linear_shapes'])}, "
           f"{res['gemm_peak']['dtype']}) on each workload's batches, sampled before and after every run; "
           f"fastest of {len(res['gemm_peak']['samples'])} samples {res['gemm_peak']['flops_per_s'] / 1e9:.1f} GFLOP/s, "
           f"median {res['gemm_peak']['median_flops_per_s'] / 1e9:.1f}. Efficiency: median over runs (min-max), each run "
           f"against the faster sample beside it. Wall time of the whole run: {res['wall_s']:.0f} s.", ""]
    for name, w in res["workloads"].items():
        out += [f"## {name}: {w['num_requests']} requests, {w['num_tokens']} tokens (median {w['median_len']}, "
                f"max {w['max_len']}), {w['num_batches']} batches", "",
                "| method | time (s) | tokens/s | time / varlen | FLOP prediction | efficiency (min-max) "
                "| max abs diff vs varlen |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for meth, r in w["methods"].items():
            if "skipped" in r:
                out.append(f"| {meth} | {r['skipped']} | | | | | |")
            else:
                out.append(f"| {meth} | {r['time_s']:.3f} | {r['tokens_per_s']:.0f} | {r['speedup_of_varlen']:.2f} | "
                           f"{r['predicted_speedup']:.2f} | {_eff(r)} | {r['max_abs_diff_vs_varlen']:.1e} |")
        out.append("")
    t = res["tiny_requests"]
    out += [f"## {t['num_requests']} requests of {t['tokens_each']} tokens, one batch", "",
            "| method | time (s) | tokens/s | efficiency (min-max) |", "|---|---:|---:|---:|"]
    out += [f"| {k} | {r['time_s']:.3f} | {r['tokens_per_s']:.0f} | {_eff(r)} |" for k, r in t["methods"].items()]
    out += ["", f"padded / varlen time: {t['padded_over_varlen']:.2f}; varlen's per-request cost beyond padded: "
            f"{t['per_request_overhead_s'] * 1e6:+.1f} us per request per forward.", ""]
    for key, sw in res["sweeps"].items():
        out += [f"## {key.upper()} sweep: {sw['what']} (attention only, one layer, causal)", "",
                "| R | L | masked ms | masked MiB | varlen ms | varlen MiB | masked cells | varlen cells |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {p['R']} | {p['L']} | {p['masked_s'] * 1e3:.1f} | {p['masked_peak_bytes'] / 2**20:.1f} | "
                f"{p['varlen_s'] * 1e3:.1f} | {p['varlen_peak_bytes'] / 2**20:.1f} | {p['masked_cells']} | {p['varlen_cells']} |"
                for p in sw["points"]]
        out.append("")
    out += ["## Checks", "", "```json", json.dumps(res["checks"], indent=1), "```", ""]
    return "\n".join(out)


def _eff(r: dict) -> str:
    """``0.84 (0.82-0.86)``; a run above 1.0 (faster than its own matmuls: a slowed GEMM sample) is marked."""
    return (f"{r['efficiency']:.2f} ({r['efficiency_min']:.2f}-{r['efficiency_max']:.2f})"
            + (" above 1.0!" if r["above_peak"] else ""))
