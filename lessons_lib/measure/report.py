"""This machine in words: what the engine picks here and why, for the appendix of lesson 00.

- ``machine_report``: device and dtype, every attention backend with why (not), the TP backend, the cores.
- ``backend_rows``: the attention backends on one device and dtype; ``format_table``: a plain-text table.

Taught in notebooks/00_setup_one_request.ipynb.
"""
from __future__ import annotations

import torch


def format_table(rows, headers) -> str:
    """A plain-text table of ``rows`` (sequences of cells) under ``headers``, columns padded to their widest cell."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def backend_rows(device, dtype: torch.dtype, head_dim: int | None = None) -> list[tuple[str, str, str]]:
    """``(backend, "yes"/"no", reason)`` for every attention backend on ``device`` in ``dtype``."""
    from ..core.kernels import available_backends
    return [(name, "yes" if s.available else "no", s.reason)
            for name, s in available_backends(device, dtype, head_dim).items()]


def machine_report(head_dim: int = 64) -> str:
    """This machine in words: the device and dtype the engine picks, every attention backend with why (not) for
    the CPU and, with a GPU, CUDA in float16 / bfloat16 / float32, the TP backend for two ranks, and the cores."""
    import os

    from ..core.kernels import placement, resolve_backend
    from ..tp.workers import resolve_dist_backend
    from ..validate import dtype_name
    device, dtype = placement()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines = [f"device: {device.type} | dtype: {dtype_name(dtype)} | torch {torch.__version__} | "
             f"CPU cores: {cores} | torch threads: {torch.get_num_threads()} | GPUs: {gpus}"]
    places = [("cpu", torch.float32)] + ([("cuda", t) for t in (torch.float16, torch.bfloat16, torch.float32)] if gpus else [])
    for dev, dt in places:
        lines += ["", f"attention backends on {dev}, {dtype_name(dt)}, head dim {head_dim}: "
                  f"auto -> {resolve_backend('auto', dev, dt, head_dim)}"]
        lines.append(format_table(backend_rows(dev, dt, head_dim), ("backend", "runs", "why (not)")))
    tp = resolve_dist_backend("auto", 2, device)
    lines += ["", f"TP=2 collectives: {tp}" + ("" if tp == "nccl" else " (NCCL needs one GPU per rank)")]
    return "\n".join(lines)
