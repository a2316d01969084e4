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

``BatchStats`` counts score cells per head per layer, and FLOPs, in both conventions by name:
whole blocks (``cells_whole_*``, ``flops_whole_*``: the article's, ``flops.attention_cells(causal=False)``)
and causal (``cells_causal_*``, ``flops_causal_*``: the lower triangle a causal model needs); every
reader names the convention it means.

Chunked prefill (``enable_chunked_prefill=True``, vLLM's): the scheduler cuts the request that
does not fit the budget left; each forward is a list of ``ScheduledChunk``s, packed with their
``num_computed_tokens`` (positions continue), run through a ``kv_cache.PrefillKVCache`` (one
varlen call per layer, ``cu_seqlens_k`` = cached + chunk lengths, causal bottom-right). A request's
output comes with the forward of its last chunk; its cache is freed then. Still prefill only.

What a caller may change or read, all public: ``Engine(scheduler=...)`` runs the ``Scheduler`` (or
subclass) it is given, e.g. with vLLM's chunk cap ``long_prefill_token_threshold``;
``record_forwards=True`` keeps each forward's packed batch and TP trace in its ``BatchStats``; a
forward is vLLM's two steps, ``prepare_inputs(chunks)`` then ``execute_model(chunks, index)``, and a
subclass may override either.

Taught in notebooks/06_prefill_engine.ipynb and notebooks/08_chunked_prefill.ipynb.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.batch import PackedBatch, cumulative, pack, pad
from ..core.config import ModelConfig, as_config
from ..core.kernels import placement, resolve_backend, synchronize
from ..core.model import Transformer, init_weights
from ..measure.flops import METHODS, flops_of
from ..validate import (
    check_attention_fn,
    check_choice,
    check_int,
    check_lengths,
    check_prompt,
    check_seconds,
    check_tp_divides,
    is_int,
)
from .kv_cache import PrefillKVCache
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Request, ScheduledChunk, Scheduler

if TYPE_CHECKING:
    from ..tp.runtime import TPResult

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
    batch_index: which forward of the run served it (with chunked prefill: the one of its last chunk;
    ``hidden`` then joins the rows of all its chunks, equal to one unchunked forward's).
    All tensors are on the engine's device, in its dtype.
    """

    request_id: str | int
    num_tokens: int
    last_hidden: Tensor
    logits: Tensor | None
    hidden: Tensor | None
    batch_index: int


@dataclass(slots=True)
class BatchStats:
    """One forward of one run. Cells are score cells per head per layer, in two named conventions:

    - whole blocks (the article's, ``flops.attention_cells(causal=False)``): each sequence's
      ``L_q × L_k`` rectangle of queries × keys (``L²`` for a whole prompt);
    - causal: only the cells a causal mask keeps, ``L_q·c + L_q(L_q+1)/2`` for a chunk of
      ``L_q`` tokens after ``c`` cached ones (``L(L+1)/2`` for a whole prompt).

    ``*_computed`` is what the method executes in that convention (masked: every query × every key
    of the forward; padded: ``R · Lmax²``; varlen: the useful cells), ``*_useful`` what the requests
    need. FLOPs (``flops.flops_of``: linear rows + ``4·d_head`` per cell) likewise: ``flops_whole_*``
    and ``flops_causal_*``.

    executed_rows: rows the linear layers processed (padded: R·Lmax; flat methods: T).
    padding_rows / padding_cells: rows and (whole-block) cells spent on pad tokens (padded only).
    masked_cells: cross-request (whole-block) cells computed then masked out (masked only).
    chunks: ``(request_id, start, length)`` per sequence of the forward, in batch order (a whole
    prompt is ``(id, 0, L)``); num_chunk_tokens: tokens of sequences that are not a whole prompt;
    num_cached_tokens: keys read from the KV cache (Σ start, per layer per head).
    wall_s: wall-clock seconds of the forward (and logits), measured.
    With ``Engine(record_forwards=True)``, what ran: ``batch``, the ``PackedBatch`` the model was
    given (``prepare_inputs``: token ids, positions, ``cu_seqlens``, ``num_computed_tokens``; None for
    method "padded"), and under TP=2 ``tp_result``, that forward's ``tp.runtime.TPResult`` (every
    rank's collective trace ``traces``, ``qkv_shapes``, ``attn_collectives``, ``attn_backend``).
    """

    index: int
    method: str
    num_seqs: int
    num_tokens: int
    max_seqlen: int
    executed_rows: int
    padding_rows: int
    cells_whole_computed: int
    cells_whole_useful: int
    cells_causal_computed: int
    cells_causal_useful: int
    padding_cells: int
    masked_cells: int
    flops_whole_executed: int
    flops_whole_useful: int
    flops_causal_executed: int
    flops_causal_useful: int
    wall_s: float
    request_ids: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    num_chunk_tokens: int = 0
    num_cached_tokens: int = 0
    all_reduces: int | None = None  # per forward, rank 0's trace (TP=2 only; C12: 2 * n_layers)
    batch: PackedBatch | None = None   # record_forwards only: the flat batch the model ran (None for padded)
    tp_result: TPResult | None = None  # record_forwards and TP=2 only: the workers' tp.runtime.TPResult

    @property
    def cells_whole_wasted(self) -> int:
        """Whole-block cells computed and thrown away (pad and cross-request cells)."""
        return self.cells_whole_computed - self.cells_whole_useful


def batch_stats(cfg: ModelConfig, seq_lens: Sequence[int], method: str, index: int = 0, wall_s: float = 0.0,
                request_ids: list | None = None, num_computed_tokens: Sequence[int] | None = None) -> BatchStats:
    """The analytic part of ``BatchStats`` for one forward of ``seq_lens`` (query tokens per sequence)
    run by ``method``; ``num_computed_tokens``: each sequence's cached tokens (chunked prefill), default 0.

    Taught in notebooks/06_prefill_engine.ipynb.
    """
    check_choice("method", method, METHODS)
    lens = check_lengths(seq_lens)
    done = [0] * len(lens) if num_computed_tokens is None else check_lengths(num_computed_tokens, 0)
    if len(done) != len(lens):
        raise ValueError(f"num_computed_tokens has {len(done)} entries for {len(lens)} sequences")
    t, r, lmax = sum(lens), len(lens), max(lens)
    whole = sum(n * (c + n) for c, n in zip(done, lens))                 # L_q × L_k rectangles
    causal = sum(n * c + n * (n + 1) // 2 for c, n in zip(done, lens))   # what a causal mask keeps
    rows = r * lmax if method == "padded" else t
    if method == "padded":   # R · Lmax_q · Lmax_k, every pad row and column (never chunked: refused)
        computed_whole = computed_causal = r * lmax * max(c + n for c, n in zip(done, lens))
    elif method == "masked":  # every query × every key of the forward, then masked
        computed_whole = computed_causal = t * (t + sum(done))
    else:
        computed_whole, computed_causal = whole, causal
    ids = list(request_ids) if request_ids is not None else list(range(r))
    return BatchStats(
        index=index, method=method, num_seqs=r, num_tokens=t, max_seqlen=lmax, executed_rows=rows,
        padding_rows=rows - t, cells_whole_computed=computed_whole, cells_whole_useful=whole,
        cells_causal_computed=computed_causal, cells_causal_useful=causal,
        padding_cells=computed_whole - whole if method == "padded" else 0,
        masked_cells=computed_whole - whole if method == "masked" else 0,
        flops_whole_executed=flops_of(cfg, rows, computed_whole).total, flops_whole_useful=flops_of(cfg, t, whole).total,
        flops_causal_executed=flops_of(cfg, rows, computed_causal).total,
        flops_causal_useful=flops_of(cfg, t, causal).total,
        wall_s=wall_s, request_ids=list(request_ids or []),
        chunks=[(i, c, n) for i, c, n in zip(ids, done, lens)],
        num_chunk_tokens=0, num_cached_tokens=sum(done))


def _engine_scheduler(scheduler, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill) -> Scheduler:
    """The scheduler an ``Engine`` runs: ``scheduler`` if given (empty, and agreeing with every setting
    given beside it), else a new one from the settings (None: the defaults)."""
    settings = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
                "enable_chunked_prefill": enable_chunked_prefill}
    if scheduler is None:
        return Scheduler(DEFAULT_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens,
                         DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs,
                         enable_chunked_prefill=False if enable_chunked_prefill is None else enable_chunked_prefill)
    if not isinstance(scheduler, Scheduler):
        raise ValueError(f"scheduler must be a serve.scheduler.Scheduler (or a subclass), got {type(scheduler).__name__}")
    if scheduler.has_unfinished():
        raise ValueError(f"the scheduler already holds {len(scheduler)} waiting requests: give the engine an empty one "
                         "and submit requests to the engine")
    for name, value in settings.items():
        if value is not None and value != getattr(scheduler, name):
            raise ValueError(f"{name}={value!r} contradicts the scheduler's {name}={getattr(scheduler, name)!r}: "
                             "give it once, to the Scheduler")
    return scheduler


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
    max_num_batched_tokens, max_num_seqs: the scheduler's budgets (vLLM's meaning), held by every forward;
    None: the ``scheduler``'s, or 8192 and 256.
    scheduler: the ``Scheduler`` (or subclass) the engine runs, empty; default one built from the budgets
    and ``enable_chunked_prefill``. A budget or ``enable_chunked_prefill`` given beside it must equal its own.
    enable_chunked_prefill: vLLM's chunked prefill: a prompt that does not fit the budget left runs
    in chunks over several forwards, its earlier tokens' keys and values kept in a
    ``kv_cache.PrefillKVCache`` (per TP rank under TP=2); then any prompt up to ``max_position``
    is served. Off (default): every prompt must fit ``max_num_batched_tokens`` whole. Not with
    ``method="padded"``. ``kv_cache_peak_bytes``: the most the cache held in the last run.
    compute_logits: also return last-token logits (``[vocab_size]`` per request).
    record_forwards: each ``BatchStats`` also keeps what its forward ran (``batch``, ``tp_result``).
    progress: a tqdm bar over prompt tokens; None = only for runs of >= 50,000 tokens.
    Never shown when the environment has ``CI=true``.

    Taught in notebooks/00_setup_one_request.ipynb and notebooks/06_prefill_engine.ipynb.
    """

    def __init__(self, cfg: ModelConfig | None = None, tp_size: int = 1, attn_backend: str = "auto",
                 weights: dict[str, Tensor] | None = None, seed: int = 0, *,
                 max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None, method: str = "varlen",
                 compute_logits: bool = True, progress: bool | None = None, tp_backend: str = "auto",
                 tp_timeout: float = 120.0, device=None, dtype: torch.dtype | None = None,
                 enable_chunked_prefill: bool | None = None, scheduler: Scheduler | None = None,
                 record_forwards: bool = False):
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
        self.scheduler = _engine_scheduler(scheduler, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill)
        enable_chunked_prefill = self.scheduler.enable_chunked_prefill
        if enable_chunked_prefill and method == "padded":
            raise ValueError("enable_chunked_prefill=True needs a flat forward with a KV cache; method='padded' runs "
                             "Transformer.forward_padded, which has none: use method='varlen' or 'masked'")
        self.enable_chunked_prefill = enable_chunked_prefill
        if not isinstance(record_forwards, bool):
            raise ValueError(f"record_forwards must be a bool, got {record_forwards!r}")
        self.compute_logits, self.progress, self.record_forwards = bool(compute_logits), progress, record_forwards
        self.weights = weights if weights is not None else init_weights(cfg, seed)
        # TP=1 runs here; under TP=2 this copy still serves the replicated LM head (and references).
        self.model = Transformer(cfg, self.weights, attn_backend=self.attn_backend, device=self.device, dtype=self.dtype)
        self._tp_kw = dict(backend=tp_backend, timeout=tp_timeout)
        self._runtime = None
        self._last_forward: tuple = (None, None)  # (PackedBatch, TPResult) of the latest flat forward
        # TP=1: the cache lives here; TP=2: each worker holds its own K/V heads' (the runtime reports its bytes).
        self.kv_cache = PrefillKVCache.for_model(self.model) if enable_chunked_prefill and tp_size == 1 else None
        self.kv_cache_peak_bytes = 0
        self._partial: dict = {}  # request id -> final hidden rows of its chunks so far (return_hidden)
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
        req.num_computed_tokens = 0  # a Request object served before starts over here
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
        ``BatchStats`` per forward of this run. Nothing waiting → ``[]``.

        All or nothing: if a forward fails (a worker dies, a timeout), the exception propagates
        and every request this run took is waiting again, in order, from its first token (its KV
        cache freed), so ``run()`` can be called again (a dead TP runtime is dropped and restarted
        on the next forward).
        """
        total = sum(len(r) - r.num_computed_tokens for r in self.scheduler.waiting)
        submitted = {r.request_id: k for k, r in enumerate(self.scheduler.waiting)}
        self.stats = []
        self.kv_cache_peak_bytes = 0
        if self.kv_cache is not None:
            self.kv_cache.peak_bytes = self.kv_cache.nbytes
        outputs: list[RequestOutput] = []
        taken: list[Request] = []  # every request a forward of this run touched, first-touch order
        bar = None
        if _progress_enabled(self.progress, total):
            from tqdm.auto import tqdm
            bar = tqdm(total=total, unit="tok", desc=f"prefill ({self.method})")
        try:
            while self.scheduler.has_unfinished():
                chunks = self.scheduler.schedule_chunks()
                taken.extend(c.request for c in chunks if c.start == 0)
                t0 = time.perf_counter()
                outputs.extend(self.execute_model(chunks, len(self.stats)))
                synchronize(self.device)
                wall = time.perf_counter() - t0
                lens = [c.length for c in chunks]
                stats = batch_stats(self.cfg, lens, self.method, len(self.stats), wall,
                                    [c.request.request_id for c in chunks], [c.start for c in chunks])
                stats.num_chunk_tokens = sum(c.length for c in chunks if c.length != len(c.request))
                (batch, tp_result), self._last_forward = self._last_forward, (None, None)
                stats.all_reduces = None if tp_result is None else tp_result.all_reduce_counts[0]
                if self.record_forwards:
                    stats.batch, stats.tp_result = batch, tp_result
                self.stats.append(stats)
                if bar is not None:
                    bar.update(sum(lens))
        except BaseException:
            self._abort(taken)
            raise
        finally:
            if bar is not None:
                bar.close()
        self._pending_ids.difference_update(r.request_id for r in taken)
        return sorted(outputs, key=lambda o: submitted[o.request_id])  # a capped or custom schedule ends them out of order

    def _abort(self, taken: list[Request]) -> None:
        """A forward failed: every taken request waits again, whole, in order; no cache is left behind."""
        waiting = self.scheduler.waiting
        untouched = [r for r in waiting if not any(r is t for t in taken)]  # taken ones part-way stay queued
        waiting.clear()
        waiting.extend(taken + untouched)
        for r in taken:
            r.num_computed_tokens = 0
            self._partial.pop(r.request_id, None)
            if self.kv_cache is not None:
                self.kv_cache.free(r.request_id)
        if self._runtime is not None and self._runtime.closed:
            self._runtime = None
        elif self._runtime is not None and self.enable_chunked_prefill:
            try:  # the workers drop these requests' keys too (a first chunk would also reset them)
                self._runtime.free_kv([r.request_id for r in taken])
            except Exception:
                self._runtime = None

    def prefill(self, requests: Sequence) -> list[RequestOutput]:
        """``submit_many(requests)`` then ``run()``. An empty list gives ``[]``. Requests
        submitted earlier and still waiting are served too (they come first)."""
        if isinstance(requests, (torch.Tensor, np.ndarray, str)) or not isinstance(requests, (list, tuple)):
            raise ValueError(f"requests must be a list of requests, got {type(requests).__name__}")
        self.submit_many(requests)
        return self.run()

    def execute_model(self, chunks: list[ScheduledChunk], index: int) -> list[RequestOutput]:
        """vLLM's ``execute_model``: one forward of the scheduler's ``chunks`` (one ``ScheduledChunk`` per
        sequence), forward number ``index`` of the run (``run`` calls it once per ``schedule_chunks``).
        Returns a ``RequestOutput`` (on the engine's device) for each request whose last chunk ran."""
        reqs = [c.request for c in chunks]
        lens = [c.length for c in chunks]
        if self.method == "padded":
            seqs = [torch.tensor(c.token_ids, dtype=torch.int64) for c in chunks]
            ids, mask = (t.to(self.device) for t in pad(seqs))      # [R, Lmax] each
            out = self.model.forward_padded(ids, mask)               # [R, Lmax, d]
            last = out[torch.arange(len(reqs)), torch.tensor(lens) - 1]  # [R, d]
            rows = [out[i, :n] for i, n in enumerate(lens)]
        else:
            batch = self.prepare_inputs(chunks)
            hidden = self._flat_forward(batch, chunks if self.enable_chunked_prefill else None)  # [T, d]
            last = hidden[batch.last_token_indices]                  # [R, d]
            starts = cumulative(lens)
            rows = [hidden[starts[i]:starts[i + 1]] for i in range(len(chunks))]
        done = [i for i, c in enumerate(chunks) if c.is_last]
        for i, c in enumerate(chunks):
            if c.request.return_hidden and not c.is_last:
                self._partial.setdefault(c.request.request_id, []).append(rows[i].clone())
        logits = self.model.compute_logits(last[done]) if self.compute_logits and done else None  # [R_done, vocab]
        out = []
        for j, i in enumerate(done):
            r = reqs[i]
            full = torch.cat([*self._partial.pop(r.request_id, []), rows[i]]) if r.return_hidden else None
            out.append(RequestOutput(r.request_id, len(r), last[i], None if logits is None else logits[j], full, index))
        return out

    def prepare_inputs(self, chunks: list[ScheduledChunk]) -> PackedBatch:
        """vLLM's ``prepare_inputs``: the flat batch (methods "varlen" and "masked") the model runs for
        ``chunks``: token ids ``[T]`` int64, positions ``[T]`` (with chunked prefill continuing after each
        chunk's ``start``, its ``num_computed_tokens``), ``cu_seqlens`` ``[R+1]`` int32, on the engine's device.
        A subclass may override it to change what the model is given (the result must stay a valid batch)."""
        seqs = [torch.tensor(c.token_ids, dtype=torch.int64) for c in chunks]
        done = [c.start for c in chunks] if self.enable_chunked_prefill else None
        return pack(seqs, device=self.device, num_computed_tokens=done)

    def _flat_forward(self, batch, chunks: list[ScheduledChunk] | None = None) -> Tensor:
        """``[T, d]`` final hidden rows of a flat batch; ``chunks``: run through the KV cache."""
        plan = None if chunks is None else ([c.request.request_id for c in chunks], [not c.is_last for c in chunks])
        if self.tp_size == 1:
            self._last_forward = (batch, None)
            if plan is None:
                return self.model(batch, attn_backend=self.attn_backend)
            step = self.kv_cache.step(plan[0], batch.num_computed_tokens, batch.seq_lens, plan[1])
            hidden = self.model(batch, attn_backend=self.attn_backend, kv_cache=step)
            step.finish()
            self.kv_cache_peak_bytes = max(self.kv_cache_peak_bytes, self.kv_cache.peak_bytes)
            return hidden
        if self._runtime is None:
            from ..tp.runtime import TPRuntime  # imported on first use: TP=1 engines never load the runtime
            self._runtime = TPRuntime(self.cfg, self.weights, world_size=self.tp_size, attn_backend=self._tp_attn_backend,
                                      verbose=False, device=self.device.type, dtype=self.dtype, **self._tp_kw)
        if plan is None:
            result = self._runtime.forward(batch)
        else:
            result = self._runtime.forward(batch, request_ids=plan[0], keep_kv=plan[1])
            self.kv_cache_peak_bytes = max(self.kv_cache_peak_bytes, result.kv_cache_peak_bytes)
        self._last_forward = (batch, result)
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
