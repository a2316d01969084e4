"""Tensor parallelism on a real process group: TP=2 forwards of the course's model.

Every rank builds ``core.model.Transformer(cfg, weights, group=DistGroup)`` from the SAME full
weights and keeps only its shard (``linear.py``), so TP=1 and TP=2 compute the same function.
Embeddings, LayerNorms and the LM head are replicated; the only collectives are the two
row-parallel all-reduces per layer (attention out proj, FFN-down): exactly
``2 · n_layers = 16`` all-reduces of ``[T, d_model] = [T, 512]`` per forward, whatever the
requests are (claims C1, C12). Each forward is instrumented by ``tp_trace.traced_forward``.

``TPRuntime`` keeps the workers alive between forwards (startup paid once); ``tp_forward`` is
the one-shot form. Both return a ``TPResult``.

Taught in notebooks/04_tp2_invariance.ipynb.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from ..core.batch import PackedBatch
from ..core.config import ModelConfig, as_config
from ..core.kernels import placement, resolve_backend
from ..core.model import Transformer, init_weights
from ..serve.kv_cache import PrefillKVCache
from ..validate import check_batch, check_int, check_kv_heads_split, check_seconds, check_weights
from .trace import Fault, comm_debug_mode, traced_forward
from .workers import WorkerPool, commands, resolve_dist_backend

Tensor = torch.Tensor

@dataclass
class TPResult:
    """One tensor-parallel forward as the caller sees it.

    output: ``[T, d_model]`` final hidden states (rank 0's; every rank's was checked equal).
    traces: ``traces[r]``: rank r's ``CollectiveRecord`` list for this forward (16 under the
    article's 8 layers: 8 × attn out proj + 8 × FFN-down, each ``[T, d_model]``).
    backend: "gloo" or "nccl". world_size: TP degree.
    startup_s: seconds to start the workers and build the shards (paid once per TPRuntime).
    forward_s: the slowest rank's forward, in-worker seconds. call_s: caller-side round trip.
    qkv_shapes: ``qkv_shapes[r][layer]``, e.g. ``(T, 768)`` (C6).
    attn_collectives: ``attn_collectives[r][layer]``: collectives inside attention (C11: all 0).
    comm_debug_counts: per rank, CommDebugMode's count of c10d collectives in the forward
    (None per rank unless the runtime was started with ``comm_debug=True``).
    attn_backend: the attention backend the workers resolved.
    kv_cache_bytes / kv_cache_peak_bytes: rank 0's prefill KV cache (its own heads) after this
    forward, and the most it has held (0 unless the forward ran chunks, ``request_ids=``).
    """

    output: Tensor
    traces: list
    backend: str
    world_size: int
    startup_s: float
    forward_s: float
    call_s: float
    qkv_shapes: list
    attn_collectives: list
    comm_debug_counts: list
    attn_backend: str = ""
    seq_lens: list = field(default_factory=list)
    kv_cache_bytes: int = 0
    kv_cache_peak_bytes: int = 0

    @property
    def all_reduce_counts(self) -> list[int]:
        return [sum(r.op == "all_reduce" for r in t) for t in self.traces]


class TPRuntime:
    """Workers that hold the model's TP shards and run forwards on request.

    cfg: model sizes (default: the article's ModelConfig). weights: full weights
    (``init_weights``, ``hf.full_weights_from_hf`` or a TP=1 model's ``state_dict()``), shared
    with the workers through a file in a fresh temp dir; None = each worker builds
    ``init_weights(cfg, seed)`` itself. world_size: TP degree (must split n_heads, n_kv_heads and d_ffn).
    backend: "auto", "gloo" or "nccl" (``workers.resolve_dist_backend``). device, dtype: where
    the ranks run and in what precision (default ``kernels.placement``: CUDA + bfloat16 with a
    GPU, else the CPU + float32); outputs come back to the caller on the CPU.
    timeout: seconds allowed for startup and for each forward. comm_debug: cross-check every
    forward's trace with PyTorch's CommDebugMode (costs ≈ 1-2 s of startup per worker).
    Bad arguments (and, in ``forward``, a bad batch) raise ValueError before any worker starts
    or any command is sent.

    Use as a context manager; ``forward(batch)`` → ``TPResult``. After a worker failure the
    runtime is closed (every worker terminated) and ``forward`` raises ``WorkerFailed`` /
    ``WorkerTimeout``; start a new one. Embedding/LN/LM head are replicated, so each forward
    makes exactly 2·n_layers all-reduces.

    Taught in notebooks/04_tp2_invariance.ipynb.
    """

    def __init__(self, cfg: ModelConfig | None = None, weights: dict[str, Tensor] | None = None, world_size: int = 2,
                 backend: str = "auto", attn_backend: str = "auto", timeout: float = 120.0, *, seed: int = 0,
                 comm_debug: bool = False, verbose: bool = True, device=None, dtype: torch.dtype | None = None):
        self.cfg = cfg = as_config(cfg)
        _check_world_size(cfg, world_size)
        check_int("seed", seed)
        if weights is not None:
            check_weights(weights, cfg.weight_shapes())  # torch.save in the caller needs every value
        # Everything that can be refused without the workers is refused before any of them starts
        # (WorkerPool checks timeout and backend before spawning too).
        device, self.dtype = placement(device, dtype)
        resolve_dist_backend(backend, world_size, device)
        resolve_backend(attn_backend, device, self.dtype, cfg.d_head)
        t0 = time.perf_counter()
        self._pool = WorkerPool(world_size, backend, timeout, verbose=verbose, name="TPRuntime", device=device)
        self.world_size, self.backend, self.attn_backend = world_size, self._pool.backend, attn_backend
        try:
            weights_path = None
            if weights is not None:
                weights_path = os.path.join(self._pool.workdir, "weights.pt")
                torch.save({k: v.detach().cpu() for k, v in weights.items()}, weights_path)
            self._pool.start(_serve, (cfg, weights_path, seed, attn_backend, bool(comm_debug), self.dtype))
            info = self._pool.collect("result", what="building the model shards")
        except BaseException:
            self._pool.close(graceful=False)
            raise
        self.attn_backend = info[0]["attn_backend"]  # resolved ("auto" → e.g. "sdpa")
        self.startup_s = time.perf_counter() - t0

    @property
    def pids(self) -> list[int]:
        """Worker process ids, rank order."""
        return self._pool.pids

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def forward(self, batch: PackedBatch, *, timeout: float | None = None, fault: Fault | None = None,
                request_ids: list | None = None, keep_kv: list[bool] | None = None) -> TPResult:
        """One TP forward of a flat batch (any device; sent to the workers, which move it to theirs).

        Chunked prefill: ``request_ids`` (one per sequence) runs the batch through each worker's
        ``PrefillKVCache`` (its own heads' keys and values): sequence i continues after its
        ``batch.num_computed_tokens[i]`` cached tokens, and its keys are kept when ``keep_kv[i]``
        (more chunks follow), else freed. Returns a ``TPResult`` whose ``output`` is ``[T, d_model]``
        in the runtime's dtype, on the CPU.
        """
        # in the caller: a bad batch must not kill a healthy runtime
        check_batch(self.cfg, batch, dtype=self.dtype, cached=request_ids is not None)
        plan = None
        if request_ids is not None or keep_kv is not None:
            keep = [False] * batch.num_seqs if keep_kv is None else list(keep_kv)
            done = batch.num_computed_tokens or [0] * batch.num_seqs
            # the same checks the workers' caches make (counts aside), here: a refusal must not kill them
            PrefillKVCache(1, 1, 1).step(list(request_ids or []), [0] * len(done), batch.seq_lens, keep)
            plan = (list(request_ids), done, keep)
        if fault is not None and not isinstance(fault, Fault):
            raise ValueError(f"fault must be a tp.Fault or None, got {fault!r}")
        if timeout is not None:  # after the broadcast a bad value would leave a result unread in the pipe
            check_seconds("timeout", timeout)
        t0 = time.perf_counter()
        self._pool.broadcast(("forward", batch.to("cpu"), fault, plan))
        outs = self._pool.collect("result", timeout=timeout, what=f"running a forward of {batch.num_tokens} tokens")
        call_s = time.perf_counter() - t0
        outputs, reports = [o[0] for o in outs], [o[1] for o in outs]
        for r, out in enumerate(outputs[1:], start=1):
            if not torch.equal(out, outputs[0]):  # after each all-reduce every rank holds the same rows
                diff = (out - outputs[0]).abs().max().item()
                raise RuntimeError(f"rank {r}'s output differs from rank 0's (max abs diff {diff:.3e})")
        return TPResult(outputs[0], [rep.records for rep in reports], self.backend, self.world_size, self.startup_s,
                        max(rep.forward_s for rep in reports), call_s, [rep.qkv_shapes for rep in reports],
                        [rep.attn_collectives for rep in reports], [rep.comm_debug_count for rep in reports],
                        self.attn_backend, list(batch.seq_lens), outs[0][2], outs[0][3])

    def free_kv(self, request_ids: list) -> None:
        """Every worker drops these requests' cached keys and values (after a failed run)."""
        self._pool.broadcast(("free", list(request_ids)))
        self._pool.collect("result", what="freeing KV cache entries")

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._pool.close()

    def __enter__(self) -> TPRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.close(graceful=exc[0] is None)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"TPRuntime(world_size={self.world_size}, backend={self.backend!r}, {state})"


def tp_forward(batch: PackedBatch, world_size: int = 2, cfg: ModelConfig | None = None,
               weights: dict[str, Tensor] | None = None, backend: str = "auto", attn_backend: str = "auto",
               timeout: float = 120.0, *, seed: int = 0, comm_debug: bool = False, verbose: bool = True, device=None,
               dtype: torch.dtype | None = None) -> TPResult:
    """One-shot TP forward: start ``TPRuntime``, run ``batch``, stop. ``startup_s`` says what
    the start cost; for repeated forwards keep a ``TPRuntime`` open instead.

    A bad ``batch`` or argument raises ValueError before any worker process starts.

    Taught in notebooks/04_tp2_invariance.ipynb.
    """
    check_batch(as_config(cfg), batch, dtype=placement(device, dtype)[1])  # refused before any worker starts
    with TPRuntime(cfg, weights, world_size, backend, attn_backend, timeout, seed=seed, comm_debug=comm_debug,
                   verbose=verbose, device=device, dtype=dtype) as rt:
        return rt.forward(batch)


def _check_world_size(cfg: ModelConfig, world_size) -> int:
    if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1
            and cfg.n_heads % world_size == 0 and cfg.d_ffn % world_size == 0):
        raise ValueError(f"world_size={world_size!r} must be a positive int dividing n_heads={cfg.n_heads} "
                         f"and d_ffn={cfg.d_ffn}")
    check_kv_heads_split(cfg.n_kv_heads, world_size, "world_size")
    return world_size


def _serve(group, channel, cfg: ModelConfig, weights_path: str | None, seed: int, attn_backend: str,
           comm_debug: bool, dtype: torch.dtype) -> None:
    """Worker loop of TPRuntime: build the rank's shard once, then one forward per command."""
    weights = torch.load(weights_path, mmap=True, weights_only=True) if weights_path else init_weights(cfg, seed)
    resolved = resolve_backend(attn_backend, group.device, dtype, cfg.d_head)  # "auto" → e.g. "sdpa", once
    model = Transformer(cfg, weights, group=group, attn_backend=resolved, device=group.device, dtype=dtype)
    del weights
    cache = PrefillKVCache.for_model(model)  # this rank's heads only; chunked prefill's earlier tokens
    if comm_debug:
        comm_debug_mode()  # pay the import during startup, not in the first forward
    channel.send({"attn_backend": resolved})
    for cmd in commands(channel):  # until "close" or EOF
        if cmd[0] == "free":
            for rid in cmd[1]:
                cache.free(rid)
            channel.send(None)
            continue
        _, batch, fault, plan = cmd
        step = None if plan is None else cache.step(plan[0], plan[1], batch.seq_lens, plan[2])
        out, report = traced_forward(model, batch.to(group.device), fault=fault, comm_debug=comm_debug, kv_cache=step)
        if step is not None:
            step.finish()
        channel.send((out.cpu(), report, cache.nbytes, cache.peak_bytes))

