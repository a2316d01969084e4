"""Breakages of the claims lesson 06 proves (see breakages.py)."""
from breakages import breaks


@breaks("S3", "06_prefill_engine",
        "the scheduler fills each batch to the budget by splitting the request that does not fit, and so accepts "
        "prompts longer than the budget (chunked prefill without a KV cache)")
def _scheduler_splits_requests():
    from lessons_lib.serve import scheduler

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

    scheduler.Scheduler.check_fits = check_fits
    scheduler.Scheduler.schedule = schedule
