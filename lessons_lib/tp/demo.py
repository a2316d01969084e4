"""torchrun entry point: the TP invariance checks on a real multi-process (or multi-node) group.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m lessons_lib.tp.demo

(``torchrun`` is the same program; ``--standalone`` picks a free port so runs never collide; on
one machine, ``GLOO_SOCKET_IFNAME=lo`` keeps gloo on the loopback interface.)
Every rank builds the article's model from the same seed and keeps its shard; for a few flat
batches each rank runs ``tp.traced_forward``; rank 0 gathers every rank's trace and prints it,
then checks the invariants: exactly 16 all-reduces of ``[T, 512]`` per forward (C1, C12), QKV
``[T, 768]`` per rank (C6), no collective inside attention (C11), and TP output == TP=1 output
computed on rank 0 (fp32; tolerance 2e-5 absolute, about 3x the bounds tests/test_tp.py
derives from an fp64 reference, 5.6e-6 to 7.5e-6).
Exit code 1 if any check fails.

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
from ..core.model import Transformer, init_weights
from ..serve.workloads import long_tail_lengths
from .dryrun import expected_layers
from .trace import format_trace, summarize_trace, traced_forward
from .workers import resolve_dist_backend

TOLERANCE = 2e-5


def demo_batches(cfg: ModelConfig, seed: int = 0) -> dict[str, list[int]]:
    """Request lengths of the demo batches: 1 request, the article's A+B, 40 tokens as 40
    requests, and a long-tailed mix."""
    tail = long_tail_lengths(12, median=20, max_len=400, seed=seed)
    return {"one request of 10": [10], "A=10 + B=30": [10, 30], "40 tokens as 40 requests": [1] * 40,
            f"long-tailed mix ({len(tail)} requests)": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-trace", action="store_true", help="print every record of every batch")
    opts = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    backend = resolve_dist_backend("auto", world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world_size)))
    dist.init_process_group(backend)  # env:// from torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    group = DistGroup(device=device)
    torch.manual_seed(opts.seed)
    cfg = ModelConfig()
    weights = init_weights(cfg, opts.seed)
    model = Transformer(cfg, weights, group=group).to(device)
    reference = Transformer(cfg, weights) if group.rank == 0 else None  # TP=1, on rank 0 only
    del weights
    failures = 0
    for i, (name, lens) in enumerate(demo_batches(cfg, opts.seed).items()):
        g = torch.Generator().manual_seed(opts.seed + i)
        batch = pack([torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens])
        out, report = traced_forward(model, batch.to(device), comm_debug=True)
        reports = [None] * group.world_size
        dist.gather_object(report, reports if group.rank == 0 else None, dst=0)  # not traced: outside the model
        if group.rank != 0:
            continue
        t = batch.num_tokens
        print(f"\n=== {name}: T={t} tokens, R={batch.num_seqs} requests, backend={backend}, "
              f"world_size={group.world_size} ===")
        for rep in reports:
            ranks = {r.rank for r in rep.records} or {"?"}
            print(f"rank {ranks.pop()}: {summarize_trace(rep.records)}; QKV out {list(rep.qkv_shapes[0])}; "
                  f"collectives inside attention {sum(rep.attn_collectives)}; CommDebugMode {rep.comm_debug_count}")
            if opts.full_trace or i == 0:
                print(format_trace(rep.records))
        diff = (out.cpu() - reference(batch)).abs().max().item()
        checks = {
            f"C1/C12 {2 * cfg.n_layers} all-reduces per rank":
                all(len(rep.records) == 2 * cfg.n_layers for rep in reports),
            f"C1 every all-reduce is [{t}, {cfg.d_model}]":
                all(r.shape == (t, cfg.d_model) and r.bytes == t * cfg.d_model * 4 for rep in reports for r in rep.records),
            "C1 layers are out_proj/fc_down of each layer, in order":
                all([r.layer for r in rep.records] == expected_layers(cfg) for rep in reports),
            f"C6 QKV per rank is [{t}, {3 * cfg.qkv_dim // group.world_size}]":
                all(s == (t, 3 * cfg.qkv_dim // group.world_size) for rep in reports for s in rep.qkv_shapes),
            "C11 attention issued 0 collectives; CommDebugMode agrees with the trace":
                all(sum(rep.attn_collectives) == 0 and rep.comm_debug_count == len(rep.records) for rep in reports),
            f"C12 TP={group.world_size} == TP=1 (max abs diff {diff:.2e} <= {TOLERANCE:g})": diff <= TOLERANCE,
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
