"""The engine's named faults (``lessons_lib.faults``): each one really changes what the engine computes,
and only inside its block.

For every fault, a small engine call (its probe) is run before, with the fault on, and after: the
result with the fault on must differ, the one after must equal the one before. The probes run the
engine's public entry points, looked up at call time (a forward, ``varlen_attention``, the scheduler's plan, ``Engine``, the
kernel's counters); the all-reduce faults break ``DistGroup``, which lives only in TP worker
processes, so their probe is a TP=2 run (gloo, tiny model) whose workers see the fault through
``LESSONS_FAULTS``. Also: undo restores every patched name, nesting, unknown names, record mode.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lessons_lib
from lessons_lib import faults
from lessons_lib.core import ModelConfig, init_weights, varlen_attention
from lessons_lib.core import batch as flat
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.kernels import resolve_backend
from lessons_lib.core.linear import QKVParallelLinear, RowParallelLinear
from lessons_lib.core.model import Transformer
from lessons_lib.course.check import at_most, claim
from lessons_lib.measure import profile
from lessons_lib.measure.recorder import record_matmuls, record_ops
from lessons_lib.ops import tiling
from lessons_lib.serve import scheduler
from lessons_lib.serve.engine import Engine
from lessons_lib.serve.scheduler import Request
from lessons_lib.tp.dryrun import record_trace
from lessons_lib.tp.threads import tp_ranks_in_threads

REPO = Path(__file__).resolve().parents[1]
CFG = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=64, max_position=256)
GQA_CFG = ModelConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ffn=64, vocab_size=64,
                      max_position=256)


def outcome(fn):
    """``fn()``, or the error it raised as text (a fault may make a call raise, or stop raising)."""
    try:
        return fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def ids(lens) -> list[torch.Tensor]:
    return [(torch.arange(n) * 7 + i) % CFG.vocab_size for i, n in enumerate(lens)]


def forward(cfg=CFG, lens=(5, 9), backend="loop") -> torch.Tensor:
    """A model built and run inside the probe (a fault on how models are built applies): ``[T, d_model]``."""
    model = Transformer(cfg, init_weights(cfg, seed=0))
    return model(flat.pack(ids(lens)), attn_backend=backend)


def score_shapes(cfg=CFG, backend="loop") -> list:
    return record_ops(lambda: forward(cfg, backend=backend)).scores


def matmul_shapes(lens=(20, 9)) -> list:
    return [(m.batch, m.m, m.k, m.n) for m in record_matmuls(lambda: forward(lens=lens))]


def padded_forward() -> torch.Tensor:
    model = Transformer(CFG, init_weights(CFG, seed=0))
    input_ids, mask = flat.pad(ids((5, 9)))
    return model.forward_padded(input_ids, mask)


def chunk_attention(backend="loop") -> torch.Tensor:
    """Two requests' chunks after cached keys: 3 queries over 6 keys, 2 over 3 (causal aligned bottom-right)."""
    g = torch.Generator().manual_seed(0)
    q, (k, v) = torch.randn(5, 2, 8, generator=g), torch.randn(2, 9, 2, 8, generator=g)
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    return varlen_attention(q, k, v, cu_q, cu_k, backend=backend)


def attend(backend: str, causal: bool = True) -> torch.Tensor:
    """Self-attention of two requests (3 and 5 tokens, 2 heads of 8) through one backend: ``[8, 2, 8]``."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 2, 8, generator=g) for _ in range(3))
    return varlen_attention(q, k, v, torch.tensor([0, 3, 8], dtype=torch.int32), causal=causal, backend=backend)


def ampere_launches() -> list[tuple]:
    """The launcher's configurations for bfloat16 at head dim 64 and 128 on an A100 (sm_80)."""
    from lessons_lib.ops.triton_varlen import launch_config
    return [tuple(launch_config(d, torch.bfloat16, 80)) for d in (64, 128)]


def tile_sizes_launched(tile: int) -> tuple[int, int]:
    """The tile sizes the Triton kernel's counters record for one launch asked for ``tile x tile`` tiles."""
    from lessons_lib.ops.triton_varlen import count_work, triton_varlen_attention
    q, k, v = (torch.randn(5, 1, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with count_work() as counts:
        triton_varlen_attention(q, k, v, torch.tensor([0, 5], dtype=torch.int32), block_m=tile, block_n=tile)
    return counts.block_m, counts.block_n


def triton_launches() -> int:
    from lessons_lib.ops.triton_varlen import count_launches
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(14, 2, 16, generator=g) for _ in range(3))
    with count_launches() as grids:
        varlen_attention(q, k, v, torch.tensor([0, 5, 14], dtype=torch.int32), backend="triton")
    return len(grids)


def kernel_runs() -> list:
    """The Triton kernel (interpreted here) on requests longer than one tile: prefill causal, a chunk after
    cached keys, prefill not causal; per run its output and its work counters."""
    from lessons_lib.ops.triton_varlen import count_work, triton_varlen_attention
    g = torch.Generator().manual_seed(0)
    out = []
    for lens_q, lens_k, causal in (((70, 130), (70, 130), True), ((70, 30), (100, 130), True),
                                   ((70, 130), (70, 130), False)):
        q = torch.randn(sum(lens_q), 1, 16, generator=g)
        k, v = (torch.randn(sum(lens_k), 1, 16, generator=g) for _ in range(2))
        cu_q, cu_k = (torch.tensor([0, a[0], a[0] + a[1]], dtype=torch.int32) for a in (lens_q, lens_k))
        with count_work() as counts:
            o = triton_varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
        out.append((o, repr(counts)))
    return out


def qkv_shard(rank: int, world: int, cfg) -> torch.Tensor:
    """Rank ``rank``'s QKV weight of ``world`` ranks, cut from one full weight ``[Q | K | V]``."""
    full = torch.arange((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head * cfg.d_model, dtype=torch.float32)
    full = full.reshape(-1, cfg.d_model)
    layer = QKVParallelLinear(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.n_kv_heads, group=LocalGroup(rank, world))
    return layer.load_full_(full, torch.zeros(full.shape[0])).weight.detach().clone()


def row_parallel_outputs() -> list:
    """A row-parallel layer ``[6, 8] -> [6, 4]`` on 2 thread ranks that really all-reduce: each rank's output."""
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(4, 8, generator=g), torch.randn(4, generator=g) + 1, torch.randn(6, 8, generator=g)

    def rank(group):
        layer = RowParallelLinear(8, 4, group=group).load_full_(w, b)
        return layer(x[:, group.rank * 4:(group.rank + 1) * 4]).detach()
    return [y for y, _ in tp_ranks_in_threads(2, rank)]


def chunked_engine() -> torch.Tensor:
    """One 20-token prompt prefilled by ``Engine`` in chunks of at most 8 tokens: its hidden rows ``[20, d_model]``."""
    with Engine(CFG, weights=init_weights(CFG, seed=0), device="cpu", max_num_batched_tokens=8,
                enable_chunked_prefill=True, compute_logits=False) as engine:
        (out,) = engine.prefill([Request(0, [(7 * t) % CFG.vocab_size for t in range(20)], return_hidden=True)])
    return out.hidden


def measured(path: str, *args):
    """``lessons_lib.measure.<module>.<name>`` looked up at call time (a measure fault swaps the module's name),
    called on ``args`` when given (a machine is read as it is)."""
    module, name = path.rsplit(".", 1)
    value = getattr(importlib.import_module(f"lessons_lib.measure.{module}"), name)
    return value(*args) if args else value


def tp2_forward() -> tuple[int, torch.Tensor]:
    """One TP=2 forward (gloo, worker processes) of 300 tokens: the all-reduces rank 0 recorded, rank 0's hidden."""
    from lessons_lib.tp.trace import forward_worker
    from lessons_lib.tp.workers import launch
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=2, d_head=32, d_ffn=128, vocab_size=64, max_position=512)
    result = launch(forward_worker, 2, backend="gloo", args=(cfg, flat.pack([torch.arange(300) % 64])), verbose=False)
    return len(result.traces[0]), result.results[0][0]


def plan(chunked: bool = True):
    return outcome(lambda: scheduler.plan_batches([10, 30, 7], 16, enable_chunked_prefill=chunked))


def unrestarted_forward() -> torch.Tensor:
    """A forward of a flat batch whose positions run 0..13 across both requests (the batch check refuses it)."""
    batch = flat.pack(ids((5, 9)))
    batch.positions = torch.arange(batch.num_tokens)
    return Transformer(CFG, init_weights(CFG, seed=0))(batch)


PROBES = {
    "attention_ignores_cu_seqlens": forward,
    "block_diag_mask_all_true": lambda: forward(backend="masked"),
    "auto_backend_prefers_masked": lambda: resolve_backend("auto", "cpu"),
    "loop_reads_keys_from_row_zero": forward,
    "loop_causal_off_by_one": forward,
    "loop_backend_runs_masked": score_shapes,
    "masked_backend_computes_diagonal_blocks_only": lambda: score_shapes(backend="masked"),
    "loop_repeats_kv_per_query_head": lambda: score_shapes(GQA_CFG),
    "causal_mask_top_left": chunk_attention,
    "triton_backend_launches_per_request": triton_launches,
    "sdpa_causal_whenever_square": lambda: attend("sdpa", causal=False),
    "sdpa_output_heads_not_transposed": lambda: attend("sdpa"),
    "padded_unpad_keeps_pad_rows": lambda: attend("padded"),
    "random_qkv_rows_all_equal": lambda: profile.random_qkv([3, 5], 2, 8)[:3],
    "triton_launch_ignores_tile_sizes": lambda: tile_sizes_launched(32),
    "cuda_tiles_hopper_on_ampere": ampere_launches,
    "pad_mask_all_true": lambda: flat.pad(ids((5, 9)))[1],
    "positions_do_not_restart": lambda: flat.pack(ids((5, 9))).positions,
    "pack_refused": lambda: outcome(lambda: flat.pack(ids((5, 9))).cu_seqlens),
    "last_token_indices_off_by_one": lambda: flat.pack(ids((5, 9))).last_token_indices,
    "max_seqlen_is_num_tokens": lambda: flat.pack(ids((5, 9))).max_seqlen,
    "pack_sorts_requests_by_length": lambda: flat.pack(ids((5, 9))).input_ids,
    "cu_seqlens_int64": lambda: str(flat.pack(ids((5, 9))).cu_seqlens.dtype),
    "batch_check_skips_positions": lambda: outcome(unrestarted_forward),
    "embedding_without_positions": forward,
    "layer_norm_over_the_batch": forward,
    "mlp_exact_gelu": forward,
    "residual_add_off_by_one_row": forward,
    "gelu_output_int8_per_tensor": forward,
    "block_layers_without_tp_group": lambda: [tuple(p.shape) for p in Transformer(CFG, group=LocalGroup(0, 2)).parameters()],
    "padded_forward_skips_pad_rows": padded_forward,
    "model_runs_requests_one_at_a_time": matmul_shapes,
    "kv_repeated_before_cache": lambda: score_shapes(GQA_CFG),
    "qkv_sharded_as_one_block": lambda: qkv_shard(0, 2, CFG),
    "kv_replicas_dealt_round_robin": lambda: qkv_shard(1, 4, GQA_CFG),
    "kv_block_rank_mod_replicas": lambda: qkv_shard(2, 4, GQA_CFG),
    "qkv_computed_whole_on_every_rank": lambda: qkv_shard(0, 2, CFG),
    "attention_gathers_every_head": lambda: [(r.op, r.shape) for r in record_trace(CFG, [3, 4], 0, 2)],
    "activations_int8_per_tensor": forward,
    "row_parallel_bias_on_every_rank": row_parallel_outputs,
    "row_parallel_all_reduce_before_matmul": row_parallel_outputs,
    "row_parallel_no_all_reduce": row_parallel_outputs,
    "row_parallel_bias_sharded": row_parallel_outputs,
    "all_reduce_twice": row_parallel_outputs,
    "column_parallel_bias_whole": lambda: Transformer(CFG, seed=0, group=LocalGroup(0, 2)).layers[0].mlp.fc_up.bias.shape,
    "linear_rows_in_chunks_of_16": matmul_shapes,
    "scheduler_splits_requests": lambda: plan(chunked=False),
    "chunk_positions_restart_at_zero": chunked_engine,
    "chunk_takes_whole_budget": plan,
    "chunk_rounded_down_to_16_tokens": plan,
    "chunk_ignores_cached_keys": chunked_engine,
    "chunked_request_to_the_back": plan,
    "chunked_scheduler_ignores_max_num_seqs": lambda: outcome(lambda: scheduler.plan_batches(
        [10, 3, 2, 1], 16, 2, enable_chunked_prefill=True)),
    "scheduler_refused": plan,
    "scheduler_first_fit": lambda: outcome(lambda: scheduler.plan_batches([10, 8, 5, 3], 16)),
    "scheduler_overshoots_budget": lambda: outcome(lambda: scheduler.plan_batches([10, 8, 5, 3], 16)),
    "scheduler_budgets_padded_rows": lambda: outcome(lambda: scheduler.plan_batches([10, 8, 5, 3], 16)),
    "flat_batch_padded_to_multiple_of_64": lambda: [m.m for m in record_matmuls(lambda: Engine(
        CFG, weights=init_weights(CFG, seed=0), device="cpu", compute_logits=False).prefill([[1] * 5, [2] * 9]))],
    "matmul_flops_count_multiply_adds": lambda: [m.flops for m in record_matmuls(forward)],
    "bmm_recorded_as_one_head": matmul_shapes,
    "linear_flops_per_token_one_layer": lambda: measured("flops.linear_flops_per_token", ModelConfig()),
    "causal_cells_exclude_diagonal": lambda: measured("flops.attention_cells", [5, 9], "varlen", True),
    "kv_cache_bytes_counts_k_only": lambda: measured("flops.kv_cache_bytes", ModelConfig(), [10, 30]),
    "decode_kv_read_shared_by_batch": lambda: measured("flops.decode_step_parts", ModelConfig(), 4, 128,
                                                       measured("machines.H200")).attention.bytes,
    "h200_peak_with_sparsity": lambda: measured("machines.H200").ridge,
    "tolerance_without_eps": lambda: measured("tolerance.tolerance", torch.zeros(3), torch.ones(3)),
    "tiling_tiles_rounded_down": lambda: (tiling.predict_work([70, 5, 20], n_heads=2, block_m=16, block_n=16).as_dict(),
                                          tiling.launch_grid(20, 2, 3, 16)),
} | {name: kernel_runs for name in faults.FAULTS if name.startswith("kernel_")}


# their probe is a TP=2 run (slow): test_the_tp2_workers_see_the_fault...
WORKER_FAULTS = ("all_reduce_in_64k_buckets", "all_reduce_sums_in_bfloat16")


def test_every_fault_has_a_probe_and_a_name_and_what():
    assert sorted([*PROBES, *WORKER_FAULTS]) == sorted(faults.FAULTS)
    for name, f in faults.FAULTS.items():
        assert f.name == name and name == name.lower() and " " not in name and len(f.what) > 20, name


@pytest.mark.parametrize("name", sorted(PROBES))
def test_fault_changes_what_the_engine_computes_inside_its_block_only(name):
    probe = PROBES[name]
    before = probe()
    with faults.injected(name) as on:
        assert on == (name,) and os.environ[faults.ENV] == name
        broken = probe()
    after = probe()
    assert not same(broken, before), f"{name}: the probe gives the same result with the fault on"
    assert same(after, before), f"{name}: the probe differs after the block"
    assert faults.active() == () and faults.ENV not in os.environ


def test_the_tp2_workers_see_the_fault_through_the_environment_and_not_after_the_block():
    # 1 layer: attention out proj and FFN-down, one all-reduce each of 300 x 64 floats (76,800 B)
    count, hidden = tp2_forward()
    assert count == 2
    with faults.injected("all_reduce_in_64k_buckets"):
        assert tp2_forward()[0] == 4  # each sent in two buckets of at most 64 KiB
    with faults.injected("all_reduce_sums_in_bfloat16"):
        count_bf16, hidden_bf16 = tp2_forward()
    assert count_bf16 == 2  # the same calls recorded: only the sums are rounded
    # bfloat16 keeps 8 bits of mantissa: the sums move by ~2^-9 of their size, float32 rounding by ~2^-24
    assert (hidden_bf16 - hidden).abs().max() > 1e-3 * hidden.abs().max()
    count, again = tp2_forward()
    assert count == 2 and torch.equal(again, hidden)


def _bindings() -> dict:
    """Every name bound in a loaded lessons_lib module and in its classes, with the identity of its value."""
    out = {}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("lessons_lib"):
            continue
        for key, value in list(vars(mod).items()):
            out[(mod_name, key)] = id(value)
            if isinstance(value, type) and value.__module__ == mod_name:
                out |= {(mod_name, key, k): id(v) for k, v in vars(value).items()}
            if isinstance(value, dict) and key.isupper():  # a table: the backends, the fallback order
                out |= {(mod_name, key, k): id(v) for k, v in list(value.items())}
    return out


def test_undo_puts_back_every_name_all_faults_patched():
    kernel_runs()  # load the kernel module and every engine module first: a module a fault imports is not a patch
    for m in pkgutil.walk_packages(lessons_lib.__path__, "lessons_lib."):
        if not m.name.startswith("lessons_lib.course.l"):
            importlib.import_module(m.name)
    before = _bindings()
    with faults.injected(*faults.FAULTS):
        during = _bindings()
    after = _bindings()
    assert {k for k in before if during.get(k) != before[k]}, "turning every fault on patched nothing"
    assert {k: before.get(k) for k in after if after[k] != before.get(k)} == {}


def test_nested_blocks_add_faults_and_a_fault_already_on_stays_on():
    with faults.injected("mlp_exact_gelu"):
        with faults.injected("residual_add_off_by_one_row", "mlp_exact_gelu") as on:
            assert on == ("mlp_exact_gelu", "residual_add_off_by_one_row")
            assert os.environ[faults.ENV] == "mlp_exact_gelu,residual_add_off_by_one_row"
        assert faults.active() == ("mlp_exact_gelu",) and os.environ[faults.ENV] == "mlp_exact_gelu"
        broken = forward()
    assert faults.active() == () and faults.ENV not in os.environ
    with faults.injected("mlp_exact_gelu"):
        assert same(forward(), broken)


def test_unknown_name_is_refused_with_the_known_ones_and_nothing_is_turned_on():
    with pytest.raises(ValueError, match="unknown fault 'no_such_bug'; known faults: .*causal_mask_top_left"):
        with faults.injected("mlp_exact_gelu", "no_such_bug"):
            pass
    assert faults.active() == ()
    with pytest.raises(ValueError, match="a fault name must be a str, got 3"):
        with faults.injected(3):
            pass


def test_an_error_in_the_block_still_undoes_the_faults_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv(faults.ENV, "")
    with pytest.raises(KeyError):
        with faults.injected("pad_mask_all_true"):
            raise KeyError("boom")
    assert faults.active() == () and os.environ[faults.ENV] == ""


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=os.environ | env)


def test_apply_from_env_turns_the_named_faults_on_once_and_refuses_unknown_names():
    code = ("from lessons_lib import faults; print(faults.apply_from_env(), faults.apply_from_env(), faults.active())")
    run = _python(code, LESSONS_FAULTS="mlp_exact_gelu, pad_mask_all_true")
    assert run.returncode == 0, run.stderr
    on = ("mlp_exact_gelu", "pad_mask_all_true")
    assert run.stdout.strip() == f"{on} () {on}"
    bad = _python(code, LESSONS_FAULTS="mlp_exact_gelu,typo")
    assert bad.returncode != 0 and "unknown fault 'typo'" in bad.stderr


def test_record_mode_writes_one_line_per_row_with_the_active_faults_and_does_not_raise(tmp_path, monkeypatch, capsys):
    path = tmp_path / "rows.jsonl"
    monkeypatch.setenv("LESSONS_CLAIMS_RECORD", str(path))
    rows = [("cells", 1600, 1600), ("wasted", 600, at_most(500))]
    claim("C8", "masked", rows)  # a failed row: recorded, not raised
    with faults.injected("mlp_exact_gelu"):
        claim("C4", "gelu", [("max diff", 0.5, 0.0)])
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(g["claim"], g["row"], g["ok"], g["faults"]) for g in got] == [
        ("C8", "cells", True, []), ("C8", "wasted", False, []), ("C4", "max diff", False, ["mlp_exact_gelu"])]
    assert got[1]["value"] == 600 and got[1]["expected"] == "≤ 500" and got[0]["expected"] == 1600
    assert "✗ C8 FAILED" in capsys.readouterr().out  # the table still says so


def test_without_record_mode_a_failed_row_raises(monkeypatch):
    monkeypatch.delenv("LESSONS_CLAIMS_RECORD", raising=False)
    with pytest.raises(AssertionError, match="✗ C8 FAILED"):
        claim("C8", "masked", [("wasted", 600, at_most(500))])


def test_a_kernel_line_of_your_own_changes_the_kernel_inside_the_block_only():
    from lessons_lib.faults.kernel import kernel_with_line
    before = kernel_runs()
    with kernel_with_line("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i * alpha"):
        broken = kernel_runs()
    assert not same(broken, before) and same(kernel_runs(), before)
    with pytest.raises(ValueError, match="the kernel has 0 lines whose code is 'x = 1'; name exactly one"):
        with kernel_with_line("x = 1", "x = 2"):
            pass


def test_kernel_faults_compose_and_a_later_change_of_the_same_line_wins():
    from lessons_lib.faults.kernel import LINE_CHANGES, changed_source
    no_rescale, exp_e = LINE_CHANGES["kernel_sum_not_rescaled"], LINE_CHANGES["kernel_exp_in_base_e"]
    both = changed_source(*exp_e, no_rescale)
    assert f"# CHANGED, was: {no_rescale[0]}" in both and f"# CHANGED, was: {exp_e[0]}" in both
    mask_all, unmasked = LINE_CHANGES["kernel_every_key_tile_masked"], LINE_CHANGES["kernel_diagonal_tile_unmasked"]
    last_wins = changed_source(*unmasked, mask_all)
    assert f"{unmasked[1]}  # CHANGED, was: {unmasked[0]}" in last_wins and mask_all[1] + " " not in last_wins
    alone = {name: None for name in ("kernel_sum_not_rescaled", "kernel_exp_in_base_e")}
    for name in alone:
        with faults.injected(name):
            alone[name] = kernel_runs()
    with faults.injected("kernel_sum_not_rescaled"), faults.injected("kernel_exp_in_base_e"):
        together = kernel_runs()
    with faults.injected("kernel_sum_not_rescaled"):
        assert same(kernel_runs(), alone["kernel_sum_not_rescaled"])  # the inner one undone, the outer still on
    assert not any(same(together, one) for one in alone.values())


def _coverage_tool():
    spec = importlib.util.spec_from_file_location("claims_coverage", REPO / "tools" / "claims_coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_coverage_lists_first_the_rows_no_fault_flips_and_tells_flipped_from_not_reached():
    tool = _coverage_tool()
    lesson = {"runs": {"": {"faults": [], "seconds": 1.0, "errors": [], "rows": {"C1: a": True, "C1: b": True,
                                                                                "C2: c |x|": False}},
                       "f1": {"faults": ["f1"], "seconds": 1.0, "errors": [], "rows": {"C1: a": False, "C1: b": True}},
                       "f2": {"faults": ["f2"], "seconds": 1.0, "errors": ["cell 3: KeyError"], "rows": {"C1: a": False}}}}
    rows = tool.coverage(lesson)
    assert [(r["row"], r["holds"], r["flipped_by"], r["not_reached_by"]) for r in rows] == [
        ("C1: b", True, [], ["f2"]), ("C2: c |x|", False, [], ["f1", "f2"]), ("C1: a", True, ["f1", "f2"], [])]
    text = tool.report({"lessons": {"01_x": lesson}, "last_run": "today"})
    assert "1 / 3 rows flipped by at least one fault; 2 fault runs" in text and "| C2: c \\|x\\| | **NO** |" in text


def test_every_fault_a_breakage_uses_is_declared_by_that_breakages_lesson():
    from breakages import BREAKS
    by_fault = _coverage_tool().declared()
    for b in BREAKS.values():
        assert all(b.notebook in by_fault[name] for name in b.faults)
