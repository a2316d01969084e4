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


@breaks("C2", "06_prefill_engine",
        "the padded forward runs only the real rows (pad rows skipped: cheaper), yet the engine still reports "
        "R x Lmax rows", variant="pad-rows-skipped")
def _padded_forward_skips_pad_rows():
    import torch

    from lessons_lib.core import model
    from lessons_lib.core.batch import pack

    def forward_padded(self, input_ids, attention_mask):  # only the real tokens go through the layers
        mask = attention_mask.bool()
        seqs = [row[m] for row, m in zip(input_ids, mask)]
        flat = self.forward(pack(seqs, device=input_ids.device))               # [T, d]
        out = flat.new_zeros(*input_ids.shape, flat.shape[-1])                 # [R, S, d], pad rows never computed
        out[mask] = flat
        return out

    model.Transformer.forward_padded = torch.no_grad()(forward_padded)


@breaks("C8", "06_prefill_engine",
        "the masked backend computes only each request's diagonal block (varlen's work) instead of the whole "
        "T x T score matrix, yet the engine still reports (sum L)^2 cells", variant="diagonal-blocks-only")
def _masked_skips_the_cross_blocks():
    from lessons_lib.core import attention

    attention.IMPLS["masked"] = attention.IMPLS["loop"]
