"""First come, first served: which waiting requests go into the next prefill batch.

``Request`` is one prompt (``request_id``, ``prompt_token_ids``), checked when created.
``Scheduler`` takes waiting requests in arrival order while ``Σ L_i <= max_num_batched_tokens``
and ``R <= max_num_seqs`` (vLLM's two knobs). It never skips a request to fill a hole, and never
splits one: every request is prefilled whole in one batch (claim S3; chunked prefill is the
series' article 06). A prompt longer than ``max_num_batched_tokens`` could never run, so it is
refused when added. ``plan_batches`` runs the scheduler on bare lengths.

Taught in notebooks/06_prefill_engine.ipynb.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..validate import check_int, check_lengths, check_token_ids, is_int

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(slots=True)
class Request:
    """One prefill request.

    request_id: a str or int, unique among the requests waiting in one engine.
    prompt_token_ids: the prompt, a non-empty list of non-negative ints (a 1-D integer tensor or
    numpy array is converted to a list). ``len(request)`` is its token count L.
    return_hidden: also return the final hidden rows of every prompt token (``[L, d_model]``).

    Taught in notebooks/00_setup_one_request.ipynb and notebooks/06_prefill_engine.ipynb.
    """

    request_id: str | int
    prompt_token_ids: list[int]
    return_hidden: bool = False

    def __post_init__(self) -> None:
        rid = self.request_id
        if not (isinstance(rid, str) or is_int(rid)):
            raise ValueError(f"request_id must be a str or int, got {rid!r}")
        self.prompt_token_ids = check_token_ids(self.prompt_token_ids, f"request {rid!r}: prompt_token_ids")
        if not isinstance(self.return_hidden, bool):
            raise ValueError(f"request {rid!r}: return_hidden must be a bool, got {self.return_hidden!r}")

    def __len__(self) -> int:
        return len(self.prompt_token_ids)


class Scheduler:
    """FCFS prefill scheduler with vLLM's budget knobs.

    max_num_batched_tokens: most prompt tokens in one batch (Σ L_i over the batch).
    max_num_seqs: most requests in one batch.
    Requests are never split (S3), never reordered: a request that does not fit the current
    batch waits for the next one, and so does everyone behind it.

    Taught in notebooks/06_prefill_engine.ipynb.
    """

    def __init__(self, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS):
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        self.waiting: deque[Request] = deque()

    def check_fits(self, req: Request) -> None:
        """Raise ValueError if ``req`` could never be scheduled whole."""
        if len(req) > self.max_num_batched_tokens:
            raise ValueError(
                f"request {req.request_id!r} has {len(req)} prompt tokens, more than "
                f"max_num_batched_tokens={self.max_num_batched_tokens}: every request must fit whole in one "
                "batch (no chunked prefill); raise max_num_batched_tokens or shorten the prompt")

    def add(self, req: Request) -> None:
        if not isinstance(req, Request):
            raise ValueError(f"Scheduler.add takes a Request, got {type(req).__name__}")
        self.check_fits(req)
        self.waiting.append(req)

    def schedule(self) -> list[Request]:
        """Pop the next batch: the longest FCFS prefix of the queue within both budgets."""
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            n = len(self.waiting[0])
            if tokens + n > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        return batch

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def __len__(self) -> int:
        return len(self.waiting)


def plan_batches(seq_lens: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 *, skip_oversize: bool = False) -> list[list[int]]:
    """Request indices per batch, exactly as ``Scheduler`` forms them for requests of ``seq_lens``.

    A request longer than the budget raises ValueError, or with ``skip_oversize=True`` is left
    out of every batch (the engine would refuse it at submit).
    """
    sched = Scheduler(max_num_batched_tokens, max_num_seqs)
    for i, n in enumerate(check_lengths(seq_lens)):
        if not (skip_oversize and n > sched.max_num_batched_tokens):
            sched.add(Request(i, [0] * n))
    batches = []
    while sched.has_unfinished():
        batches.append([r.request_id for r in sched.schedule()])
    return batches
