"""A prefill-only serving engine: FCFS batches under a token budget, one flat forward per batch.

``Engine`` takes requests (``scheduler.Request``), forms batches with ``scheduler.Scheduler``,
packs each one, runs the forward by one of three methods and returns one ``RequestOutput`` per
request in submission order, plus one ``BatchStats`` per batch.

Methods (the same model and weights; only how a batch is laid out changes):

========  =========================================================  ============================
method    forward                                                    attention score cells
========  =========================================================  ============================
varlen    flat ``[T, d]``, per-request attention (``attn_backend``)  Σ L_i² (no waste)
masked    flat ``[T, d]``, full ``[T, T]`` scores + block mask       T²
padded    ``[R, Lmax, d]`` right-padded (``forward_padded``)         R · Lmax² (and R · Lmax rows)
========  =========================================================  ============================

Cell counts in ``BatchStats`` are per head per layer and count whole diagonal blocks (the
article's convention, ``flops.attention_cells(causal=False)``); FLOP counts are causal (what a
causal model really needs: the lower triangle of each block).

Taught in notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.batch import cumulative, pack, pad
from ..core.config import ModelConfig, as_config
from ..core.kernels import placement, resolve_backend, synchronize
from ..core.model import Transformer, init_weights
from ..measure.flops import METHODS, attention_cells, forward_flops
from ..validate import check_attention_fn, check_choice, check_int, check_prompt, check_seconds, check_tp_divides, is_int
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Request, Scheduler

Tensor = torch.Tensor

# progress=None shows a bar only for runs at least this long (a notebook's A+B stays quiet).
_AUTO_PROGRESS_TOKENS = 50_000


@dataclass(slots=True)
class RequestOutput:
    """What one request gets back.

    last_hidden: ``[d_model]`` final hidden state (after ``ln_f``) of its last prompt token.
    logits: ``[vocab_size]`` next-token logits of that row (``Transformer.compute_logits``), or
    None when the engine runs with ``compute_logits=False``.
    hidden: ``[L, d_model]`` final hidden rows of every prompt token if the request asked for
    them, else None.
    batch_index: which batch of the run served it.
    """

    request_id: str | int
    num_tokens: int
    last_hidden: Tensor
    logits: Tensor | None
    hidden: Tensor | None
    batch_index: int


@dataclass(slots=True)
class BatchStats:
    """One batch of one run. Cells are per head per layer (whole blocks, see the module doc).

    executed_rows: rows the linear layers processed (padded: R·Lmax; flat methods: T).
    padding_rows / padding_cells: rows and score cells spent on pad tokens (padded only).
    masked_cells: cross-request score cells computed then masked out (masked only).
    flops_executed / flops_useful: whole-forward FLOPs (``flops.forward_flops``, causal).
    wall_s: wall-clock seconds of the forward (and logits), measured.
    """

    index: int
    method: str
    num_seqs: int
    num_tokens: int
    max_seqlen: int
    executed_rows: int
    padding_rows: int
    attn_cells_computed: int
    attn_cells_useful: int
    padding_cells: int
    masked_cells: int
    flops_executed: int
    flops_useful: int
    wall_s: float
    request_ids: list = field(default_factory=list)
    all_reduces: int | None = None  # per forward, rank 0's trace (TP=2 only; C12: 2 * n_layers)

    @property
    def attn_cells_wasted(self) -> int:
        return self.attn_cells_computed - self.attn_cells_useful


def batch_stats(cfg: ModelConfig, seq_lens: Sequence[int], method: str, index: int = 0, wall_s: float = 0.0,
                request_ids: list | None = None) -> BatchStats:
    """The analytic part of ``BatchStats`` for one batch of ``seq_lens`` run by ``method``.

    Taught in notebooks/06_prefill_engine.ipynb.
    """
    cells = attention_cells(seq_lens, method)
    t, r, lmax = sum(seq_lens), len(seq_lens), max(seq_lens)
    rows = r * lmax if method == "padded" else t
    return BatchStats(
        index=index, method=method, num_seqs=r, num_tokens=t, max_seqlen=lmax, executed_rows=rows,
        padding_rows=rows - t, attn_cells_computed=cells.computed, attn_cells_useful=cells.useful,
        padding_cells=cells.wasted if method == "padded" else 0,
        masked_cells=cells.wasted if method == "masked" else 0,
        flops_executed=forward_flops(cfg, seq_lens, method, causal=True).total,
        flops_useful=forward_flops(cfg, seq_lens, method, causal=True, useful_only=True).total,
        wall_s=wall_s, request_ids=list(request_ids or []))


def _progress_enabled(progress, total_tokens: int) -> bool:
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        return False
    if progress is None:
        return total_tokens >= _AUTO_PROGRESS_TOKENS
    return bool(progress)


class Engine:
    """Serve prefill requests with one model: ``submit`` them, then ``run`` (or ``prefill(list)``).

    cfg: model sizes (default: the article's ``ModelConfig()``).
    tp_size: 1 runs the model in this process; 2 runs it on two worker processes through
    ``tp.TPRuntime`` (started at the first batch; ``close()`` or ``with Engine(...)`` stops it).
    ``cfg.tp_size`` describes a deployment; this argument decides what actually runs.
    method: "varlen" (default), "masked" or "padded" — see the module doc.
    attn_backend: attention backend for ``method="varlen"`` ("auto" = fastest here, see
    ``kernels.resolve_backend``), or your own function with ``flash_attn_varlen_func``'s contract,
    ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=..., softmax_scale=...)``
    (TP=1; refused here if it cannot take all of them).
    The other methods fix their own attention.
    weights: full weights (``init_weights``, ``hf.full_weights_from_hf`` or a TP=1 model's
    ``state_dict()``); default ``init_weights(cfg, seed)``.
    device, dtype: where the model runs and in what precision; default CUDA + bfloat16 when a
    GPU is present, else the CPU + float32 (``kernels.placement``). Outputs live on ``device``.
    max_num_batched_tokens, max_num_seqs: the scheduler's budgets (vLLM's meaning).
    compute_logits: also return last-token logits (``[vocab_size]`` per request).
    progress: a tqdm bar over prompt tokens; None = only for runs of >= 50,000 tokens.
    Never shown when the environment has ``CI=true``.

    Taught in notebooks/00_setup_one_request.ipynb and notebooks/06_prefill_engine.ipynb.
    """

    def __init__(self, cfg: ModelConfig | None = None, tp_size: int = 1, attn_backend: str = "auto",
                 weights: dict[str, Tensor] | None = None, seed: int = 0, *,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, method: str = "varlen", compute_logits: bool = True,
                 progress: bool | None = None, tp_backend: str = "auto", tp_timeout: float = 120.0,
                 device=None, dtype: torch.dtype | None = None):
        self.cfg = cfg = as_config(cfg)
        if not is_int(tp_size) or tp_size not in (1, 2):
            raise ValueError(f"tp_size must be 1 or 2, got {tp_size!r}")  # 2.0 == 2, but not a TP degree
        tp_size = int(tp_size)
        check_tp_divides(cfg, "tp_size", tp_size)
        check_choice("method", method, METHODS)
        if method != "varlen" and attn_backend not in ("auto", method):
            raise ValueError(f"attn_backend={attn_backend!r} applies to method='varlen' only; "
                             f"method={method!r} fixes its own attention")
        if method == "varlen" and attn_backend in ("masked", "padded"):
            raise ValueError(f"attn_backend={attn_backend!r} is not a varlen backend: use method={attn_backend!r}")
        if callable(attn_backend) and tp_size != 1:
            raise ValueError("a custom attention function runs in this process only: use tp_size=1")
        if method == "padded" and tp_size != 1:
            raise ValueError("method='padded' runs Transformer.forward_padded in this process: use tp_size=1")
        check_int("seed", seed)
        self.device, self.dtype = placement(device, dtype)
        # The TP runtime starts at the first batch: check its arguments now, not minutes later.
        check_seconds("tp_timeout", tp_timeout)
        check_choice("tp_backend", tp_backend, ("auto", "gloo", "nccl"))
        if tp_size == 2:
            from ..tp.workers import resolve_dist_backend
            try:
                resolve_dist_backend(tp_backend, tp_size, self.device)
            except ValueError as exc:
                raise ValueError(f"tp_backend={tp_backend!r}: {exc}") from None
        self.method, self.tp_size = method, tp_size
        requested = "masked" if method == "masked" else attn_backend
        # TP workers resolve the REQUESTED backend on their own device (gloo may put them on the CPU).
        self._tp_attn_backend = requested
        self.attn_backend = check_attention_fn(resolve_backend(requested, self.device, self.dtype, cfg.d_head))
        self.scheduler = Scheduler(max_num_batched_tokens, max_num_seqs)
        self.compute_logits, self.progress = bool(compute_logits), progress
        self.weights = weights if weights is not None else init_weights(cfg, seed)
        # TP=1 runs here; under TP=2 this copy still serves the replicated LM head (and references).
        self.model = Transformer(cfg, self.weights, attn_backend=self.attn_backend, device=self.device, dtype=self.dtype)
        self._tp_kw = dict(backend=tp_backend, timeout=tp_timeout)
        self._runtime = None
        self._last_all_reduces = None
        self._next_id = 0
        self._pending_ids: set = set()
        self.stats: list[BatchStats] = []

    # ---- requests in -------------------------------------------------------------------
    def _make_request(self, item, return_hidden: bool) -> Request:
        if isinstance(item, Request):
            req = item
        else:
            while self._next_id in self._pending_ids:  # skip an explicit int id still waiting
                self._next_id += 1
            req = Request(self._next_id, item, return_hidden)
        self._next_id += 1
        check_prompt(self.cfg, req.prompt_token_ids, f"request {req.request_id!r}")
        self.scheduler.check_fits(req)
        return req

    def submit(self, prompt, return_hidden: bool = False) -> Request:
        """Queue one request: a ``Request`` or a list of token ids (its id is then a running int).

        Raises ValueError (and queues nothing) for a bad, oversize or duplicate request.
        """
        return self.submit_many([prompt], return_hidden)[0]

    def submit_many(self, prompts: Iterable, return_hidden: bool = False) -> list[Request]:
        """Queue several requests in order; all are validated before any is queued."""
        if isinstance(prompts, (torch.Tensor, np.ndarray, str)) or not isinstance(prompts, Iterable):
            raise ValueError(f"requests must be a list of requests, got {type(prompts).__name__}")
        reqs = [self._make_request(p, return_hidden) for p in prompts]
        seen = set(self._pending_ids)
        for r in reqs:
            if r.request_id in seen:
                raise ValueError(f"request_id {r.request_id!r} is already waiting in this engine")
            seen.add(r.request_id)
        for r in reqs:
            self.scheduler.add(r)
        self._pending_ids = seen
        return reqs

    # ---- running -----------------------------------------------------------------------
    def run(self) -> list[RequestOutput]:
        """Prefill every waiting request; outputs in submission order. ``self.stats`` gets one
        ``BatchStats`` per batch of this run. Nothing waiting → ``[]``.

        All or nothing: if a batch fails (a worker dies, a timeout), the exception propagates
        and every request this run took is waiting again, in order, so ``run()`` can be called
        again (a dead TP runtime is dropped and restarted on the next batch).
        """
        total = sum(len(r) for r in self.scheduler.waiting)
        self.stats = []
        outputs: list[RequestOutput] = []
        taken: list[Request] = []
        bar = None
        if _progress_enabled(self.progress, total):
            from tqdm.auto import tqdm
            bar = tqdm(total=total, unit="tok", desc=f"prefill ({self.method})")
        try:
            while self.scheduler.has_unfinished():
                reqs = self.scheduler.schedule()
                taken.extend(reqs)
                t0 = time.perf_counter()
                outputs.extend(self._execute(reqs, len(self.stats)))
                synchronize(self.device)
                wall = time.perf_counter() - t0
                lens = [len(r) for r in reqs]
                stats = batch_stats(self.cfg, lens, self.method, len(self.stats), wall, [r.request_id for r in reqs])
                stats.all_reduces, self._last_all_reduces = self._last_all_reduces, None
                self.stats.append(stats)
                if bar is not None:
                    bar.update(sum(lens))
        except BaseException:
            self.scheduler.waiting.extendleft(reversed(taken))
            if self._runtime is not None and self._runtime.closed:
                self._runtime = None
            raise
        finally:
            if bar is not None:
                bar.close()
        self._pending_ids.difference_update(r.request_id for r in taken)
        return outputs

    def prefill(self, requests: Sequence) -> list[RequestOutput]:
        """``submit_many(requests)`` then ``run()``. An empty list gives ``[]``. Requests
        submitted earlier and still waiting are served too (they come first)."""
        if isinstance(requests, (torch.Tensor, np.ndarray, str)) or not isinstance(requests, (list, tuple)):
            raise ValueError(f"requests must be a list of requests, got {type(requests).__name__}")
        self.submit_many(requests)
        return self.run()

    def _execute(self, reqs: list[Request], index: int) -> list[RequestOutput]:
        seqs = [torch.tensor(r.prompt_token_ids, dtype=torch.int64) for r in reqs]
        lens = [len(r) for r in reqs]
        if self.method == "padded":
            ids, mask = (t.to(self.device) for t in pad(seqs))      # [R, Lmax] each
            out = self.model.forward_padded(ids, mask)               # [R, Lmax, d]
            last = out[torch.arange(len(reqs)), torch.tensor(lens) - 1]  # [R, d]
            full = lambda i: out[i, :lens[i]].clone()
        else:
            batch = pack(seqs, device=self.device)
            hidden = self._flat_forward(batch)                       # [T, d]
            last = hidden[batch.last_token_indices]                  # [R, d]
            starts = cumulative(lens)
            full = lambda i: hidden[starts[i]:starts[i + 1]].clone()
        logits = self.model.compute_logits(last) if self.compute_logits else None  # [R, vocab]
        return [RequestOutput(r.request_id, lens[i], last[i], None if logits is None else logits[i],
                              full(i) if r.return_hidden else None, index) for i, r in enumerate(reqs)]

    def _flat_forward(self, batch) -> Tensor:
        if self.tp_size == 1:
            return self.model(batch, attn_backend=self.attn_backend)
        if self._runtime is None:
            from ..tp.runtime import TPRuntime  # imported on first use: TP=1 engines never load the runtime
            self._runtime = TPRuntime(self.cfg, self.weights, world_size=self.tp_size, attn_backend=self._tp_attn_backend,
                                      verbose=False, device=self.device.type, dtype=self.dtype, **self._tp_kw)
        result = self._runtime.forward(batch)
        self._last_all_reduces = result.all_reduce_counts[0]
        return result.output.to(self.device)

    def close(self) -> None:
        """Stop the TP workers (if any were started). Safe to call twice."""
        if self._runtime is not None:
            runtime, self._runtime = self._runtime, None
            runtime.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
