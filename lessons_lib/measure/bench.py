"""One benchmark command: varlen against padding, masking and Hugging Face, on the same requests.

    python3 -m lessons_lib.measure.bench            # full run (a few minutes on 2 cores) -> bench/results/
    python3 -m lessons_lib.measure.bench --quick    # tiny config smoke run (seconds)
    python3 -m lessons_lib.measure.bench --profile --workloads long-tail   # top operators of varlen's forward

In ONE process, with ONE set of weights (a Hugging Face ``GPT2Model`` converted with
``hf.full_weights_from_hf``) and the SAME requests per workload, it times:

1. ``varlen``            our engine, flat batch, attention "auto" (flash / torch_varlen / sdpa)
2. ``masked``            our engine, flat batch, full ``[T, T]`` scores + block-diagonal mask
3. ``padded``            our engine, each batch right-padded to its longest request
4. ``hf_padded``         HF ``GPT2Model`` (sdpa), the same batches padded + ``attention_mask``
5. ``hf_one_at_a_time``  HF, one request per forward (no padding, no batching)
6. ``hf_packed``         HF, each batch packed into one row with ``position_ids`` restarting
                         per request (transformers derives a block-diagonal mask from them)

Every method's last-token hidden states are checked against varlen's. Reported per method:
tokens/s, speedup of varlen (``time(method) / time(varlen)``), the speedup the FLOP counts
predict (``executed FLOPs(method) / executed FLOPs(varlen)``), and efficiency = useful FLOPs
/ (time × GEMM peak).

The GEMM peak is measured on the model's OWN linear layers: one block's four matmuls (QKV, out
proj, FFN-up, FFN-down, with bias, the run's dtype, through the model's ``ColumnParallelLinear``:
its kernel, whatever it is) on each of the workload's batch sizes, alone, fastest of 2 passes
(``profile.linear_layers_sampler``). One sample is taken before a workload's
first run and one after every run, so every timed run sits between two samples; its peak is the
faster of the two (a busy neighbour must slow both to inflate it) and its efficiency is
``useful / (time × that peak)``. Reported: the median over a method's runs, the min and max, and
every run with its two samples. 1.0 would be a forward as fast as its matmuls alone; a run above
1.0 is flagged (``above_peak``, and in the log), never clipped. (The earlier reference, one
``[4096 × 512] @ [512 × 2048]`` matmul sampled once before each run, ran slower than the model's
own shapes at T ≈ 2,000, and one sample could catch a busy moment the run missed: a run read 1.43.)

Also: 1,000 requests of 4 tokens in one batch, varlen against padded (equal lengths: padding
adds no work, so the difference is what varlen's per-request handling costs), and two
attention-only sweeps of masked vs varlen, time and peak bytes: R requests of fixed L (C9)
and fixed total tokens split into R requests (C14). ``--device`` / ``--dtype`` choose where
(default: CUDA + bfloat16 with a GPU, else the CPU + float32).

``--profile``: no benchmark; where varlen's time goes on each workload, the operators with the
most self CPU time (``torch.profiler``), one pass after a warm-up.

Writes ``bench.json`` (schema ``lessons_lib.bench/2``) and PNG plots. Timings are measured
and vary run to run; tests check the JSON's structure and arithmetic, never a timing.

Taught in notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ..core.config import ModelConfig
from ..core.kernels import placement, synchronize
from ..serve.engine import Engine
from ..serve.scheduler import plan_batches
from ..serve.workloads import fixed_total_mixes, make_requests, workload_lengths
from ..validate import dtype_name
from .bench_report import METHODS, TARGET_EFFICIENCY, summary_markdown, write_plots
from .flops import attention_cells, forward_flops, linear_shapes
from .profile import linear_layers_sampler, measure_attention, top_ops

SCHEMA = "lessons_lib.bench/2"
ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "bench" / "results"
# Which engine method's FLOP accounting each HF run matches (what it executes).
FLOP_METHOD = {"varlen": "varlen", "masked": "masked", "padded": "padded", "hf_padded": "padded",
               "hf_one_at_a_time": "varlen", "hf_packed": "masked"}


@dataclass
class Plan:
    """Sizes of one benchmark run."""

    cfg: ModelConfig
    max_num_batched_tokens: int
    max_num_seqs: int
    workloads: dict            # name -> (n, generator kwargs)
    repeats: int               # timed runs per method (fastest kept), fewer for slow methods:
    slow_s: float              # first run > slow_s: 2 runs in all; > 3 * slow_s: 1 run
    tiny: tuple                # (num_requests, tokens each) for the loop-overhead run
    sweep_len: int             # C9: fixed L
    sweep_rs: list             # C9: numbers of requests
    sweep_total: int           # C14: fixed total tokens
    sweep_mix_rs: list         # C14: numbers of requests sharing the total
    max_padded_bytes: int      # skip a padded run whose [R, H, Lmax, Lmax] scores would exceed this
    gemm_repeats: int = 2      # passes per GEMM-peak sample (fastest kept)
    seed: int = 0
    quick: bool = False
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32


def full_plan() -> Plan:
    """The article's model (8 layers, d_model 512, 8 heads, FFN 2048), TP=1, sized for 2 CPU cores."""
    return Plan(cfg=ModelConfig(), max_num_batched_tokens=4096, max_num_seqs=16,
                workloads={"constant": (16, dict(length=256)),
                           "uniform": (12, dict(low=16, high=768)),
                           "long-tail": (40, dict(median=128, sigma=1.0, max_len=2048)),
                           # the article's "50-token question beside a draft"; draft 2,000 not 5,000
                           # so that the padded runs fit this machine's memory and minutes
                           "bimodal": (24, dict(short=50, long=2000, p_long=0.1))},
                repeats=3, slow_s=5.0, tiny=(1000, 4), sweep_len=256, sweep_rs=[1, 2, 4, 8, 16],
                sweep_total=4096, sweep_mix_rs=[1, 4, 16, 64, 256], max_padded_bytes=3 << 30)


def quick_plan() -> Plan:
    """A smoke run on a tiny model: every code path, a few seconds."""
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=1000,
                      max_position=512)
    return Plan(cfg=cfg, max_num_batched_tokens=256, max_num_seqs=8,
                workloads={"constant": (6, dict(length=16)), "uniform": (6, dict(low=2, high=40)),
                           "long-tail": (12, dict(median=12, sigma=1.0, max_len=120)),
                           "bimodal": (10, dict(short=5, long=100, p_long=0.2))},
                repeats=1, slow_s=1.0, tiny=(50, 4), sweep_len=16, sweep_rs=[1, 2, 4], sweep_total=64,
                sweep_mix_rs=[1, 4, 16], max_padded_bytes=1 << 28, quick=True)


# ---- measurement helpers ---------------------------------------------------------------------
def gemm_sampler(plan: Plan, batch_tokens: list[int]):
    """``sample() -> FLOP/s``: one layer's linear matmuls of ``plan.cfg`` on these batch sizes, alone (see the doc)."""
    return linear_layers_sampler(batch_tokens, linear_shapes(plan.cfg), repeats=plan.gemm_repeats, device=plan.device,
                                 dtype=plan.dtype, seed=plan.seed)


def timed_between_samples(runners: dict, repeats: int, sample, skip=lambda m, rep, times: False, device="cpu"):
    """Run every runner ``repeats`` times, interleaved, with a GEMM-peak sample before the first run and after
    every run. Returns ``(times, pairs, outputs, samples)``: per method its run times (s), per run the
    ``(sample before, sample after)`` FLOP/s, its last output, and all samples in time order.
    ``skip(method, rep, times)``: leave this run out (a slow baseline)."""
    times, pairs, outs, samples = {m: [] for m in runners}, {m: [] for m in runners}, {}, [sample()]
    for rep in range(repeats):
        for m, run in runners.items():
            if skip(m, rep, times):
                continue
            t0 = time.perf_counter()
            outs[m] = run()
            synchronize(device)
            times[m].append(time.perf_counter() - t0)
            samples.append(sample())
            pairs[m].append((samples[-2], samples[-1]))
    return times, pairs, outs, samples


def _read_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure_peak_rss(fn):
    """Run ``fn()``; return ``(its result, peak RSS above the RSS at the start, in bytes)``.

    Linux: resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) and reads
    ``VmHWM`` afterwards, so earlier peaks of this process do not count. Elsewhere: samples
    RSS every 2 ms in a thread (psutil), which can miss a short spike.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _read_status_kib("VmRSS")
        result = fn()
        return result, max(0, _read_status_kib("VmHWM") - base) * 1024
    except OSError:
        import threading

        import psutil
        proc, stop, peak = psutil.Process(), threading.Event(), [0]
        base = proc.memory_info().rss

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.002)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            result = fn()
        finally:
            stop.set()
            th.join()
        return result, max(0, max(peak[0], proc.memory_info().rss) - base)


def machine_info(plan: Plan) -> dict:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    import transformers
    return {"cpu": model, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "dtype": dtype_name(plan.dtype), "device": str(plan.device),
            "gpu": torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else None,
            "load_average_1min_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


# ---- the six ways to run one workload -------------------------------------------------------
def _engine_runner(plan: Plan, weights, method: str, reqs):
    eng = Engine(plan.cfg, weights=weights, method=method, compute_logits=False, progress=False,
                 max_num_batched_tokens=plan.max_num_batched_tokens, max_num_seqs=plan.max_num_seqs,
                 device=plan.device, dtype=plan.dtype)

    def run():
        return torch.stack([o.last_hidden for o in eng.prefill(reqs)])  # [R, d]
    return run


def _hf_runner(hf, method: str, reqs, batches):
    dev = next(hf.parameters()).device
    ids = [torch.tensor(r, dtype=torch.int64, device=dev) for r in reqs]

    @torch.no_grad()  # here, not on the factory: the closures run later (autograd would keep every activation)
    def padded():
        out = []
        for b in batches:
            lens = [len(ids[i]) for i in b]
            x = torch.zeros(len(b), max(lens), dtype=torch.int64, device=dev)
            mask = torch.zeros_like(x)
            for j, i in enumerate(b):
                x[j, :lens[j]], mask[j, :lens[j]] = ids[i], 1  # right padding: default positions are right
            h = hf(input_ids=x, attention_mask=mask, use_cache=False).last_hidden_state
            out += [h[j, lens[j] - 1] for j in range(len(b))]
        return torch.stack(out)

    @torch.no_grad()
    def one_at_a_time():
        return torch.stack([hf(input_ids=t[None], use_cache=False).last_hidden_state[0, -1] for t in ids])

    @torch.no_grad()
    def packed():
        out = []
        for b in batches:
            x = torch.cat([ids[i] for i in b])[None]                                  # [1, T]
            pos = torch.cat([torch.arange(len(ids[i]), device=dev) for i in b])[None]  # restarts per request
            h = hf(input_ids=x, position_ids=pos, use_cache=False).last_hidden_state[0]  # [T, d]
            ends = torch.cumsum(torch.tensor([len(ids[i]) for i in b], device=dev), 0) - 1
            out += list(h[ends])
        return torch.stack(out)

    return {"hf_padded": padded, "hf_one_at_a_time": one_at_a_time, "hf_packed": packed}[method]


def hf_packed_support(hf, cfg: ModelConfig) -> dict:
    """Does this transformers version run packed sequences (restarting position_ids) correctly here?"""
    import transformers
    reqs = make_requests([5, 9, 3], cfg.vocab_size, seed=7)
    dev = next(hf.parameters()).device
    try:
        with torch.no_grad():
            flat = torch.tensor(sum(reqs, []), device=dev)[None]
            pos = torch.cat([torch.arange(len(r), device=dev) for r in reqs])[None]
            packed = hf(input_ids=flat, position_ids=pos, use_cache=False).last_hidden_state[0]
            alone = torch.cat([hf(input_ids=torch.tensor(r, device=dev)[None], use_cache=False).last_hidden_state[0]
                               for r in reqs])
        diff = (packed.float() - alone.float()).abs().max().item()
    except Exception as exc:  # an older transformers, or an attention implementation without packing
        return {"supported": False, "why": f"{type(exc).__name__}: {exc}"[:300]}
    ok = diff < 1e-4 if next(hf.parameters()).dtype == torch.float32 else diff < 5e-2
    return {"supported": ok, "max_abs_diff_vs_separate": diff,
            "why": (f"transformers {transformers.__version__} with attn_implementation='sdpa' finds the request "
                    "starts where position_ids restart (masking_utils.find_packed_sequence_indices) and builds a "
                    "block-diagonal causal mask over the whole [T, T]: masked-style work. The varlen path "
                    "(cu_seq_lens to flash_attn_varlen_func) needs attn_implementation='flash_attention_2', "
                    "CUDA only.") if ok else f"packed output differs from separate forwards by {diff:.3e}"}


def padded_score_bytes(cfg: ModelConfig, batches_lens: list[list[int]], dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the largest ``[R, H, Lmax, Lmax]`` score tensor our padded attention makes."""
    return max(len(b) * cfg.n_heads * max(b) ** 2 * dtype.itemsize for b in batches_lens)


def bench_workload(plan: Plan, weights, hf, name: str, lengths: list[int], peaks: list[float],
                   methods=METHODS, log=print) -> dict:
    """Time every method on one workload; return its JSON record."""
    cfg = plan.cfg
    reqs = make_requests(lengths, cfg.vocab_size, seed=plan.seed + 1)
    batches = plan_batches(lengths, plan.max_num_batched_tokens, plan.max_num_seqs)
    blens = [[lengths[i] for i in b] for b in batches]
    runners, skipped = {}, {}
    for m in methods:
        if m == "padded" and (need := padded_score_bytes(cfg, blens, plan.dtype)) > plan.max_padded_bytes:
            skipped[m] = (f"skipped: the [R, H, Lmax, Lmax] scores would need {need / 2**30:.1f} GiB "
                          f"(limit {plan.max_padded_bytes / 2**30:.1f})")
            continue
        runners[m] = _engine_runner(plan, weights, m, reqs) if m in ("varlen", "masked", "padded") \
            else _hf_runner(hf, m, reqs, batches)
    # a slow baseline is long enough to average out noise, and its gap is large: fewer runs
    times, pairs, outs, samples = timed_between_samples(
        runners, plan.repeats, gemm_sampler(plan, [sum(b) for b in blens]),
        skip=lambda m, rep, t: rep and t[m][0] > plan.slow_s * (1 if rep >= 2 else 3), device=plan.device)
    peaks += samples
    useful = forward_flops(cfg, lengths, "varlen", causal=True, useful_only=True).total
    executed = {m: (sum(forward_flops(cfg, b, FLOP_METHOD[m], causal=True).total for b in blens)
                    if m != "hf_one_at_a_time" else forward_flops(cfg, lengths, "varlen", causal=True).total)
                for m in METHODS}
    rec = {"num_requests": len(lengths), "num_tokens": sum(lengths), "min_len": min(lengths),
           "median_len": statistics.median(lengths), "max_len": max(lengths), "num_batches": len(batches),
           "batch_tokens": [sum(b) for b in blens], "batch_seqs": [len(b) for b in blens],
           "flops_useful": useful, "gemm_samples": samples, "methods": {}}
    t_var = min(times["varlen"])
    for m in METHODS:
        if m not in runners:
            rec["methods"][m] = {"skipped": skipped.get(m, "not run")}
            continue
        t = min(times[m])
        rec["methods"][m] = {
            "time_s": t, "times_s": times[m], "tokens_per_s": sum(lengths) / t,
            "flops_executed": executed[m], **paired_efficiency(useful, times[m], pairs[m]),
            "speedup_of_varlen": t / t_var, "predicted_speedup": executed[m] / executed["varlen"],
            "max_abs_diff_vs_varlen": (outs[m].float() - outs["varlen"].float()).abs().max().item()}
    log(_table(name, rec))
    return rec


def paired_efficiency(useful_flops: int, times: list[float], gemm_pairs: list[tuple[float, float]]) -> dict:
    """Efficiency of each timed run against the faster of the two GEMM samples around it; median, min, max.

    ``useful_flops / (time_i × max(before_i, after_i))``: a neighbour that slows the run usually slows a
    sample beside it too, so the ratio holds where the whole benchmark's fastest sample would not; taking
    the faster of the two means one slowed sample cannot inflate it. ``above_peak``: some run read above
    1.0, i.e. faster than its own matmuls alone (both samples were slowed and the run was not).
    """
    if len(times) != len(gemm_pairs) or not times:
        raise ValueError(f"need one (before, after) GEMM pair per timed run, got {len(gemm_pairs)} for {len(times)}")
    peaks = [max(pair) for pair in gemm_pairs]
    runs = [useful_flops / (t * p) for t, p in zip(times, peaks)]
    return {"efficiency": statistics.median(runs), "efficiency_min": min(runs), "efficiency_max": max(runs),
            "efficiency_runs": runs, "gemm_pairs": [list(pair) for pair in gemm_pairs], "above_peak": max(runs) > 1.0}


def _table(name: str, rec: dict) -> str:
    lines = [f"\n{name}: {rec['num_requests']} requests, {rec['num_tokens']} tokens (median {rec['median_len']}, "
             f"max {rec['max_len']}), {rec['num_batches']} batches",
             f"  {'method':<17}{'time s':>9}{'tok/s':>10}{'varlen x':>10}{'FLOPs pred':>11}{'eff':>7}{'|diff|':>10}"]
    for m, r in rec["methods"].items():
        if "skipped" in r:
            lines.append(f"  {m:<17}{r['skipped']}")
            continue
        lines.append(f"  {m:<17}{r['time_s']:>9.3f}{r['tokens_per_s']:>10.0f}{r['speedup_of_varlen']:>10.2f}"
                     f"{r['predicted_speedup']:>11.2f}{r['efficiency']:>7.2f}{r['max_abs_diff_vs_varlen']:>10.1e}"
                     f"  eff {r['efficiency_min']:.2f}-{r['efficiency_max']:.2f}"
                     + ("  ABOVE 1.0: its GEMM samples were slowed" if r["above_peak"] else ""))
    return "\n".join(lines)


def bench_tiny(plan: Plan, weights, peaks: list[float], log=print) -> dict:
    """``n`` requests of ``L`` tokens in ONE batch: varlen against padded, interleaved run by run.

    Equal lengths: padding adds no FLOP and its attention is one batched call, so padded is the
    yardstick for what varlen's per-request handling costs; ``(t_varlen - t_padded) / n`` is that
    cost per request per forward (negative: varlen is the faster).
    """
    n, length = plan.tiny
    cfg = plan.cfg
    reqs = make_requests([length] * n, cfg.vocab_size, seed=plan.seed + 2)
    engines = {m: Engine(cfg, weights=weights, method=m, compute_logits=False, progress=False,
                         max_num_batched_tokens=max(n * length, 1), max_num_seqs=n, device=plan.device,
                         dtype=plan.dtype) for m in ("varlen", "padded")}
    for eng in engines.values():
        eng.prefill(reqs[:2])  # warm-up
    times, pairs, _, samples = timed_between_samples({m: (lambda e=e: e.prefill(reqs)) for m, e in engines.items()},
                                                     max(plan.repeats, 3), gemm_sampler(plan, [n * length]),
                                                     device=plan.device)
    peaks += samples
    useful = forward_flops(cfg, [length] * n, "varlen", causal=True, useful_only=True).total
    rec = {"num_requests": n, "tokens_each": length, "flops_useful": useful, "gemm_samples": samples,
           "methods": {m: {"time_s": min(t), "times_s": t, "tokens_per_s": n * length / min(t),
                           **paired_efficiency(useful, t, pairs[m])} for m, t in times.items()}}
    t_var, t_pad = rec["methods"]["varlen"]["time_s"], rec["methods"]["padded"]["time_s"]
    rec["padded_over_varlen"] = t_pad / t_var
    rec["per_request_overhead_s"] = (t_var - t_pad) / n
    log(f"\n{n} requests x {length} tokens, one batch: varlen {t_var:.3f} s, padded {t_pad:.3f} s "
        f"(padded / varlen = {t_pad / t_var:.2f}); varlen's per-request cost beyond padded: "
        f"{rec['per_request_overhead_s'] * 1e6:+.1f} us per request per forward")
    return rec


def sweeps(plan: Plan, log=print) -> dict:
    """Attention only (random q, k, v; causal; fastest of N; peak bytes from the allocator)."""
    cfg, out = plan.cfg, {}
    cases = {"c9": (f"R requests of {plan.sweep_len} tokens", {r: [plan.sweep_len] * r for r in plan.sweep_rs}),
             "c14": (f"{plan.sweep_total} tokens split into R requests", fixed_total_mixes(plan.sweep_total,
                                                                                        plan.sweep_mix_rs))}
    for key, (what, mixes) in cases.items():
        points = []
        for r, lens in mixes.items():
            p = {"R": r, "L": lens[0], "tokens": sum(lens)}
            for label, backend in (("masked", "masked"), ("varlen", "auto")):
                run = measure_attention(lens, backend, cfg.n_heads, cfg.d_head, causal=True, repeats=2,
                                        device=plan.device, dtype=plan.dtype)
                p[f"{label}_s"], p[f"{label}_peak_bytes"] = run.seconds, run.peak_bytes
                p[f"{label}_cells"] = attention_cells(lens, label, causal=True).computed
            points.append(p)
        out[key] = {"what": what, "points": points}
        log(f"\n{key.upper()} sweep ({what}), attention only, one layer, {cfg.n_heads} heads:")
        for p in points:
            log(f"  R={p['R']:>4} L={p['L']:>5}: masked {p['masked_s'] * 1e3:8.1f} ms "
                f"{p['masked_peak_bytes'] / 2**20:8.1f} MiB"
                f" | varlen {p['varlen_s'] * 1e3:8.1f} ms {p['varlen_peak_bytes'] / 2**20:8.1f} MiB")
    return out


def checks(result: dict) -> dict:
    """The issue's must-show comparisons, from the measured numbers in ``result``."""
    out = {}
    c_req = max(result["tiny_requests"]["per_request_overhead_s"], 0.0)
    for name in ("long-tail", "bimodal"):
        w = result["workloads"].get(name)
        if not w:
            continue
        var = w["methods"]["varlen"]
        overhead = min(c_req * w["num_requests"] / var["time_s"], 1.0)
        rows = {}
        for m in ("padded", "masked"):
            r = w["methods"][m]
            if "skipped" in r:
                continue
            need = r["predicted_speedup"] * (1 - overhead)
            rows[f"varlen_vs_{m}"] = {"predicted_by_flops": r["predicted_speedup"],
                                      "varlen_loop_overhead_fraction": overhead,
                                      "required": need, "measured": r["speedup_of_varlen"],
                                      "holds": r["speedup_of_varlen"] >= need}
        hf1 = w["methods"]["hf_one_at_a_time"]
        if "skipped" not in hf1:
            rows["varlen_vs_hf_one_at_a_time"] = {"required": 1.0, "measured": hf1["speedup_of_varlen"],
                                                  "holds": hf1["speedup_of_varlen"] >= 1.0}
        out[name] = rows
    tiny = result["tiny_requests"]
    out["tiny_varlen_vs_padded"] = {"padded_over_varlen": tiny["padded_over_varlen"], "required": 1.0,
                                    "per_request_overhead_us": tiny["per_request_overhead_s"] * 1e6,
                                    "holds": tiny["padded_over_varlen"] >= 1.0}
    for name, w in result["workloads"].items():
        var = w["methods"]["varlen"]
        out[f"efficiency_{name}"] = {"value": var["efficiency"], "min": var["efficiency_min"], "max": var["efficiency_max"],
                                     "target": TARGET_EFFICIENCY, "holds": var["efficiency"] >= TARGET_EFFICIENCY}
    above = [f"{name}/{m}" for name, w in result["workloads"].items() for m, r in w["methods"].items()
             if r.get("above_peak")] + [f"tiny/{m}" for m, r in tiny["methods"].items() if r["above_peak"]]
    out["no_run_above_gemm_peak"] = {"runs_above": above, "holds": not above}
    return out


def profile_workloads(plan: Plan, names: list[str], top: int = 8, log=print) -> dict:
    """Varlen's top operators by self CPU time on each workload: ``{name: [(op, seconds, share), ...]}``.

    One engine pass over the workload's requests under ``torch.profiler``, after a warm-up pass; the
    engine's own random weights (the shapes, not the values, set the time)."""
    out = {}
    for name in names:
        n, kw = plan.workloads[name]
        run = _engine_runner(plan, None, "varlen", make_requests(workload_lengths(name, n, seed=plan.seed, **kw),
                                                                 plan.cfg.vocab_size, seed=plan.seed + 1))
        run()
        out[name] = top_ops(run, top, plan.device)
        log(f"\n{name}: varlen, self CPU time of one pass, top {top} operators")
        log("\n".join(f"  {op:<52}{sec * 1e3:9.1f} ms {share:6.1%}" for op, sec, share in out[name]))
    return out


# ---- main ----------------------------------------------------------------------------------------
def run(plan: Plan, out_dir: pathlib.Path, command: str, workloads=None, methods=METHODS, do_sweeps=True,
        log=print) -> dict:
    from .hf import full_weights_from_hf, make_hf_gpt2

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cfg = plan.cfg
    hf = make_hf_gpt2(cfg, attn_implementation="sdpa", seed=plan.seed).requires_grad_(False)
    weights = full_weights_from_hf(hf.state_dict(), cfg.n_layers)  # one set of weights for all six runs
    hf = hf.to(plan.device, plan.dtype)
    peaks = []
    result = {"schema": SCHEMA, "command": command, "quick": plan.quick, "machine": machine_info(plan),
              "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(cfg).items()},
              "scheduler": {"max_num_batched_tokens": plan.max_num_batched_tokens, "max_num_seqs": plan.max_num_seqs,
                            "policy": "FCFS, each request whole (S3)"},
              "hf_packed": hf_packed_support(hf, cfg), "workloads": {}}
    log(f"model {cfg.n_layers} layers d_model={cfg.d_model} heads={cfg.n_heads} d_ffn={cfg.d_ffn} "
        f"{dtype_name(plan.dtype)} on {plan.device}, "
        f"torch threads {torch.get_num_threads()}; budget {plan.max_num_batched_tokens} tokens / "
        f"{plan.max_num_seqs} seqs")
    log(f"hf_packed: supported={result['hf_packed']['supported']}: {result['hf_packed']['why']}")
    names = workloads or list(plan.workloads)
    for name in names:
        n, kw = plan.workloads[name]
        lengths = workload_lengths(name, n, seed=plan.seed, **kw)
        rec = bench_workload(plan, weights, hf, name, lengths, peaks, methods, log)
        rec["generator"] = {"name": name, "n": n, "seed": plan.seed, **kw}
        result["workloads"][name] = rec
    result["tiny_requests"] = bench_tiny(plan, weights, peaks, log)
    result["sweeps"] = sweeps(plan, log) if do_sweeps else {}
    result["gemm_peak"] = {"linear_shapes": [list(s) for s in linear_shapes(cfg)], "dtype": dtype_name(plan.dtype),
                           "flops_per_s": max(peaks), "median_flops_per_s": statistics.median(peaks), "samples": peaks,
                           "how": f"one block's linear layers (ColumnParallelLinear, with bias) on each of the workload's "
                                  f"batch sizes, alone, fastest of {plan.gemm_repeats} passes; a sample before a workload's "
                                  "first run and after every run; each run's efficiency divides by the faster of the two "
                                  "samples around it, and the median over runs is reported with its min and max"}
    final = max(peaks)
    result["checks"] = checks(result)
    result["wall_s"] = time.perf_counter() - t_start
    result["machine"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    result["plots"] = write_plots(result, out_dir) if do_sweeps else []
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    (out_dir / "summary.md").write_text(summary_markdown(result))
    log(f"\nGEMM peak {final / 1e9:.1f} GFLOP/s (median sample {statistics.median(peaks) / 1e9:.1f}); checks:")
    for k, v in result["checks"].items():
        log(f"  {k}: {json.dumps(v)}")
    log(f"wrote {out_dir}/bench.json and {len(result['plots'])} plots in {result['wall_s']:.0f} s")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m lessons_lib.measure.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and workloads: a smoke run in seconds")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="directory for bench.json and the plots")
    p.add_argument("--workloads", default=None, help="comma-separated subset of " + ",".join(full_plan().workloads))
    p.add_argument("--repeats", type=int, default=None, help="timed runs per method (fastest kept)")
    p.add_argument("--no-sweeps", action="store_true", help="skip the attention sweeps and plots")
    p.add_argument("--profile", action="store_true", help="no benchmark: varlen's top operators (self CPU) per workload")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    args = p.parse_args(argv)
    plan = quick_plan() if args.quick else full_plan()
    plan.device, plan.dtype = placement(args.device, getattr(torch, args.dtype) if args.dtype else None)
    if args.repeats is not None:
        if args.repeats < 1:
            p.error(f"--repeats must be >= 1, got {args.repeats}")
        plan.repeats = args.repeats
    names = None
    if args.workloads:
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        bad = [w for w in names if w not in plan.workloads]
        if bad:
            p.error(f"unknown workload(s) {bad}; choose from {list(plan.workloads)}")
    if args.profile:
        profile_workloads(plan, names or list(plan.workloads))
        return 0
    command = "python3 -m lessons_lib.measure.bench" + ("" if argv is None and len(sys.argv) < 2 else " " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    run(plan, pathlib.Path(args.out), command.strip(), names, do_sweeps=not args.no_sweeps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
