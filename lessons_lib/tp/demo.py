"""torchrun entry point: the TP invariance checks on a real multi-process (or multi-node) group.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m lessons_lib.tp.demo

(``torchrun`` is the same program; ``--standalone`` picks a free port so runs never collide; on
one machine, ``GLOO_SOCKET_IFNAME=lo`` keeps gloo on the loopback interface.)
Every rank builds the article's model from the same seed and keeps its shard; for a few flat
batches each rank runs ``trace.traced_forward``; rank 0 gathers every rank's trace and prints it,
then checks the invariants: exactly 16 all-reduces of ``[T, 512]`` per forward (C1, C12), QKV
``[T, 768]`` per rank (C6), no collective inside attention (C11), and the TP output against a
float64 TP=1 forward by the one tolerance rule (``measure.tolerance``: at most twice the error
of TP=1 in the same dtype, plus rounding). Device and dtype default to CUDA + bfloat16 with a
GPU (NCCL when this node has one GPU per rank, gloo on CUDA tensors when they share one), else
the CPU + float32 over gloo; ``--device`` / ``--dtype`` override. Exit code 1 if a check fails.

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from ..core.batch import pack
from ..core.config import ModelConfig
from ..core.groups import DistGroup
from ..core.kernels import placement
from ..core.model import Transformer, init_weights
from ..measure.tolerance import max_abs_diff, tolerance
from ..serve.workloads import long_tail_lengths
from ..validate import dtype_name
from .dryrun import expected_layers
from .trace import format_trace, summarize_trace, traced_forward
from .workers import _rank_device, resolve_dist_backend, threads_per_worker


def demo_batches(cfg: ModelConfig, seed: int = 0) -> dict[str, list[int]]:
    """Request lengths of the demo batches: 1 request, the article's A+B, 40 tokens as 40
    requests, and a long-tailed mix."""
    tail = long_tail_lengths(12, median=20, max_len=400, seed=seed)
    return {"one request of 10": [10], "A=10 + B=30": [10, 30], "40 tokens as 40 requests": [1] * 40,
            f"long-tailed mix ({len(tail)} requests)": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--full-trace", action="store_true", help="print every record of every batch")
    opts = parser.parse_args(argv)
    device, dtype = placement(opts.device, getattr(torch, opts.dtype) if opts.dtype else None)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    backend = resolve_dist_backend("auto", local_world, device)  # NCCL needs one GPU per rank ON THIS NODE
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":  # the rank's own GPU on this node (NCCL), or the one the ranks share (gloo)
        device, _ = _rank_device(local_rank, backend, device.type)
    else:
        torch.set_num_threads(threads_per_worker(max(1, local_world)))
    dist.init_process_group(backend)  # env:// from torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    group = DistGroup(device=device)
    cfg = ModelConfig()
    weights = init_weights(cfg, opts.seed)
    model = Transformer(cfg, weights, group=group, device=device, dtype=dtype)
    if group.rank == 0:  # TP=1 in the same dtype (the trusted result) and in float64 (the truth)
        reference = Transformer(cfg, weights, device=device, dtype=dtype)
        reference64 = Transformer(cfg, weights, dtype=torch.float64)
    del weights
    qkv_width = model.layers[0].attn.qkv.output_size_per_partition  # 3·512/2 = 768 for the article's model
    failures = 0
    for i, (name, lens) in enumerate(demo_batches(cfg, opts.seed).items()):
        g = torch.Generator().manual_seed(opts.seed + i)
        batch = pack([torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens])
        out, report = traced_forward(model, batch.to(device), comm_debug=True)
        reports = [None] * group.world_size
        dist.gather_object(report, reports if group.rank == 0 else None, dst=0)  # not traced: outside the model
        if group.rank != 0:
            continue
        t, itemsize = batch.num_tokens, dtype.itemsize
        print(f"\n=== {name}: T={t} tokens, R={batch.num_seqs} requests, backend={backend}, device={device}, "
              f"dtype={dtype_name(dtype)}, world_size={group.world_size} ===")
        for rep in reports:
            ranks = {r.rank for r in rep.records} or {"?"}
            print(f"rank {ranks.pop()}: {summarize_trace(rep.records)}; QKV out {list(rep.qkv_shapes[0])}; "
                  f"collectives inside attention {sum(rep.attn_collectives)}; CommDebugMode {rep.comm_debug_count}")
            if opts.full_trace or i == 0:
                print(format_trace(rep.records))
        truth = reference64(batch)
        err, bound = max_abs_diff(out, truth), tolerance(reference(batch.to(device)), truth, dtype)
        checks = {
            f"C1/C12 {2 * cfg.n_layers} all-reduces per rank":
                all(len(rep.records) == 2 * cfg.n_layers for rep in reports),
            f"C1 every all-reduce is [{t}, {cfg.d_model}] {dtype_name(dtype)}":
                all(r.shape == (t, cfg.d_model) and r.bytes == t * cfg.d_model * itemsize
                    for rep in reports for r in rep.records),
            "C1 layers are out_proj/fc_down of each layer, in order":
                all([r.layer for r in rep.records] == expected_layers(cfg) for rep in reports),
            f"C6 QKV per rank is [{t}, {qkv_width}]":
                all(s == (t, qkv_width) for rep in reports for s in rep.qkv_shapes),
            "C11 attention issued 0 collectives; CommDebugMode agrees with the trace":
                all(sum(rep.attn_collectives) == 0 and rep.comm_debug_count == len(rep.records) for rep in reports),
            f"C12 TP={group.world_size} vs float64: {err:.2e} <= {bound:.2e} (2x TP=1's error + 2 eps)": err <= bound,
        }
        for text, ok in checks.items():
            print(("✓ " if ok else "✗ FAILED ") + text)
            failures += not ok
    if group.rank == 0:
        print(f"\n{'all checks passed' if not failures else f'{failures} check(s) FAILED'}")
    ok = torch.tensor([failures], device=device)
    dist.broadcast(ok, src=0)
    dist.destroy_process_group()
    return int(ok.item() != 0)


if __name__ == "__main__":
    sys.exit(main())
