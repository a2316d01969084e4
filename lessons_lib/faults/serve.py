"""Faults of the serving engine (``serve.scheduler``, ``serve.kv_cache``): scheduling and chunked prefill."""
from __future__ import annotations

import torch

from .registry import fault, swap_attr, swap_function

AREA = "serve"


@fault("scheduler_splits_requests", "the unchunked scheduler fills each batch to the budget by splitting the request "
       "that does not fit, and so accepts prompts longer than the budget (chunked prefill without a KV cache)", AREA)
def _scheduler_splits_requests():
    from ..serve import scheduler

    def check_fits(self, req):  # a prompt of any length "fits": it will be cut into pieces
        return None

    def schedule(self):
        batch, tokens = [], 0
        while self.waiting and len(batch) < self.max_num_seqs and tokens < self.max_num_batched_tokens:
            req, room = self.waiting[0], self.max_num_batched_tokens - tokens
            if len(req) > room:  # the part that fits now, the rest at the head of the queue
                ids = req.prompt_token_ids
                self.waiting[0] = scheduler.Request(req.request_id, ids[room:], req.return_hidden)
                req = scheduler.Request(req.request_id, ids[:room], req.return_hidden)
            else:
                self.waiting.popleft()
            batch.append(req)
            tokens += len(req)
        return batch
    return [swap_attr(scheduler.Scheduler, "check_fits", check_fits), swap_attr(scheduler.Scheduler, "schedule", schedule)]


@fault("chunk_positions_restart_at_zero", "positions restart at 0 in every chunk where the model looks up its "
       "position embeddings (a chunk's own offset, num_computed_tokens, forgotten)", AREA)
def _chunk_positions_restart():
    from ..core import model

    def embed(self, batch):
        if batch.input_ids is None:
            return batch.hidden
        cu = batch.cu_seqlens.tolist()
        restart = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1], cu[1:])]).to(batch.positions.device)
        return self.wte[batch.input_ids] + self.wpe[restart]
    return [swap_attr(model.Transformer, "embed", embed)]


@fault("chunk_takes_whole_budget", "the chunked scheduler cuts a request to a whole budget (or the chunk cap), not "
       "to the room left in the forward: a forward holds more tokens than max_num_batched_tokens", AREA)
def _chunk_takes_whole_budget():
    from ..serve import scheduler
    real = scheduler.Scheduler.schedule_chunks

    def schedule_chunks(self):
        if not self.enable_chunked_prefill:
            return real(self)
        cap = getattr(self, "long_prefill_token_threshold", None) or self.max_num_batched_tokens
        chunks, room = [], self.max_num_batched_tokens
        for req in self.waiting:
            if room <= 0 or len(chunks) == self.max_num_seqs:
                break
            n = min(len(req) - req.num_computed_tokens, cap)  # the bug: no "room" in the min
            chunks.append(scheduler.ScheduledChunk(req, req.num_computed_tokens, n))
            room -= n
        for c in chunks:
            self.waiting.popleft()
            c.request.num_computed_tokens += c.length
        self.waiting.extendleft(reversed([c.request for c in chunks if not c.is_last]))
        return chunks
    return [swap_attr(scheduler.Scheduler, "schedule_chunks", schedule_chunks)]


@fault("chunk_rounded_down_to_16_tokens", "the chunked scheduler rounds a chunk that does not end its prompt down to a "
       "multiple of 16 tokens (block-aligned chunks; one shorter than 16 waits for the next forward): a forward can "
       "close with room left, and a long prompt takes more forwards", AREA)
def _chunk_rounded_down_to_16_tokens():
    from ..serve import scheduler
    real = scheduler.Scheduler.schedule_chunks

    def schedule_chunks(self):
        kept = []
        for c in real(self):
            cut = 0 if c.is_last else c.length % 16
            c.request.num_computed_tokens -= cut  # still waiting at the head (real() put it back): it resumes there
            if c.length > cut:
                kept.append(scheduler.ScheduledChunk(c.request, c.start, c.length - cut))
        return kept
    return [swap_attr(scheduler.Scheduler, "schedule_chunks", schedule_chunks)]


@fault("chunk_ignores_cached_keys", "the KV cache is never put in front of a chunk: the chunk's keys are cached, but "
       "each chunk attends to its own keys only (cu_seqlens_k is cu_seqlens_q)", AREA)
def _chunk_ignores_cached_keys():
    from ..core import attention, model
    from ..serve import kv_cache
    real_kv, real_build = kv_cache.KVCacheStep.keys_values, attention.VarlenMetadata.build

    def keys_values(self, layer, k, v):
        real_kv(self, layer, k, v)  # the chunk's keys still go into the cache
        return k, v                 # ... but attention never reads the cached ones

    class Meta(attention.VarlenMetadata):
        @classmethod
        def build(cls, cu_q, cu_k=None, device="cpu", max_seqlen_q=None, max_seqlen_k=None):
            return real_build(cu_q, None, device, max_seqlen_q, max_seqlen_q)
    return [swap_attr(kv_cache.KVCacheStep, "keys_values", keys_values), swap_attr(model, "VarlenMetadata", Meta)]


@fault("chunked_request_to_the_back", "a request part-way through its prompt goes to the back of the queue (round "
       "robin) instead of keeping its place at the head", AREA)
def _chunked_to_the_back():
    from ..serve import scheduler
    real = scheduler.Scheduler.schedule_chunks

    def schedule_chunks(self):
        chunks = real(self)
        unfinished = [c.request for c in chunks if not c.is_last]
        if unfinished:
            rest = [r for r in self.waiting if all(r is not u for u in unfinished)]
            self.waiting.clear()
            self.waiting.extend(rest + unfinished)
        return chunks
    return [swap_attr(scheduler.Scheduler, "schedule_chunks", schedule_chunks)]


@fault("scheduler_refused", "the scheduler and plan_batches raise: whoever needs a plan must work it out (an "
       "exercise's guard)", AREA)
def _scheduler_refused():
    from ..serve import scheduler

    def refuse(*args, **kwargs):
        raise RuntimeError("the scheduler is switched off here (fault 'scheduler_refused'): work the plan out yourself")
    return [swap_function(scheduler, "plan_batches", refuse), swap_attr(scheduler.Scheduler, "schedule_chunks", refuse),
            swap_attr(scheduler.Scheduler, "schedule", refuse)]


@fault("scheduler_first_fit", "when the head of the queue does not fit the room left, the unchunked scheduler looks "
       "further down the queue and takes every later request that still fits (first fit): later arrivals overtake it",
       AREA)
def _scheduler_first_fit():
    from ..serve import scheduler

    def schedule(self):
        batch, tokens, passed = [], 0, []
        while self.waiting:
            req = self.waiting.popleft()
            if len(batch) < self.max_num_seqs and tokens + len(req) <= self.max_num_batched_tokens:
                batch.append(req)
                tokens += len(req)
            else:
                passed.append(req)
        self.waiting.extend(passed)
        return batch
    return [swap_attr(scheduler.Scheduler, "schedule", schedule)]


@fault("scheduler_overshoots_budget", "the unchunked scheduler checks the budget against the tokens already taken, "
       "not with the next request's: it takes requests while under max_num_batched_tokens, so a batch overshoots it by "
       "its last request", AREA)
def _scheduler_overshoots_budget():
    from ..serve import scheduler

    def schedule(self):
        batch, tokens = [], 0
        while self.waiting and len(batch) < self.max_num_seqs and tokens < self.max_num_batched_tokens:
            batch.append(self.waiting.popleft())
            tokens += len(batch[-1])
        return batch
    return [swap_attr(scheduler.Scheduler, "schedule", schedule)]


@fault("scheduler_budgets_padded_rows", "the unchunked scheduler counts max_num_batched_tokens in padded rows "
       "(requests x the longest one, as a padded engine allocates) even for flat forwards: it closes batches that "
       "still had room for the next request's tokens", AREA)
def _scheduler_budgets_padded_rows():
    from ..serve import scheduler

    def schedule(self):
        batch, longest = [], 0
        while self.waiting and len(batch) < self.max_num_seqs:
            n = len(self.waiting[0])
            if (len(batch) + 1) * max(longest, n) > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            longest = max(longest, n)
        return batch
    return [swap_attr(scheduler.Scheduler, "schedule", schedule)]


@fault("flat_batch_padded_to_multiple_of_64", "the engine pads every flat forward (varlen and masked) with a dummy "
       "request of pad tokens up to a multiple of 64 rows, as a CUDA-graph runner pads to a captured size, on the "
       "CPU too: the linear layers run rows nobody asked for", AREA)
def _flat_batch_padded():
    from ..core.batch import pack
    from ..serve import engine
    real = engine.Engine.prepare_inputs

    def prepare_inputs(self, chunks):
        batch = real(self, chunks)
        extra = -batch.num_tokens % 64
        if not extra or batch.num_computed_tokens is not None:
            return batch
        cu = batch.cu_seqlens.tolist()
        seqs = [batch.input_ids[s:e].cpu() for s, e in zip(cu[:-1], cu[1:])] + [torch.zeros(extra, dtype=torch.int64)]
        return pack(seqs, device=self.device)
    return [swap_attr(engine.Engine, "prepare_inputs", prepare_inputs)]


@fault("chunked_scheduler_ignores_max_num_seqs", "the chunked scheduler forgets max_num_seqs: it fills every forward "
       "to max_num_batched_tokens with as many requests as fit (only the unchunked path counts requests)", AREA)
def _chunked_ignores_max_num_seqs():
    from ..serve import scheduler
    real = scheduler.Scheduler.schedule_chunks

    def schedule_chunks(self):
        if not self.enable_chunked_prefill:
            return real(self)
        limit = self.max_num_seqs
        self.max_num_seqs = max(limit, len(self.waiting))   # the bug: the request count never closes a forward
        try:
            return real(self)
        finally:
            self.max_num_seqs = limit
    return [swap_attr(scheduler.Scheduler, "schedule_chunks", schedule_chunks)]
