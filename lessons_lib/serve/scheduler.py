"""First come, first served: which waiting requests go into the next prefill batch.

``Request`` is one prompt (``request_id``, ``prompt_token_ids``), checked when created.
``Scheduler`` takes waiting requests in arrival order while ``Σ L_i <= max_num_batched_tokens``
and ``R <= max_num_seqs`` (vLLM's two knobs). It never skips a request to fill a hole. By default
it never splits one either: every request is prefilled whole in one batch (claim S3), and a
prompt longer than ``max_num_batched_tokens`` could never run, so it is refused when added.

With ``enable_chunked_prefill=True`` (vLLM's chunked prefill): when the next waiting request does
not fit the budget left in this forward, it gets the rest of the budget as a chunk and stays at
the head of the queue, its ``num_computed_tokens`` advanced; the next forward continues it first.
Whole prompts and one chunk share a forward; both budgets hold for every forward; FCFS order is
kept. ``long_prefill_token_threshold`` (vLLM's chunk cap, chunked prefill only) also cuts every
chunk to at most that many tokens: a capped request does not close the forward, the room left goes
to the requests behind it, so several requests may be part-way through their prompts at once.
``schedule_chunks`` returns ``ScheduledChunk``s (request, start, length) either way.
``plan_batches`` runs the scheduler on bare lengths.

Taught in notebooks/06_prefill_engine.ipynb (whole prompts) and notebooks/08_chunked_prefill.ipynb.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    num_computed_tokens: prompt tokens already prefilled (vLLM's name), advanced by the scheduler's
    chunks; 0 until a chunked prefill starts it, reset when an engine takes the request.

    Taught in notebooks/00_setup_one_request.ipynb and notebooks/06_prefill_engine.ipynb.
    """

    request_id: str | int
    prompt_token_ids: list[int]
    return_hidden: bool = False
    num_computed_tokens: int = field(default=0, init=False, compare=False)  # prompt tokens already prefilled

    def __post_init__(self) -> None:
        rid = self.request_id
        if not (isinstance(rid, str) or is_int(rid)):
            raise ValueError(f"request_id must be a str or int, got {rid!r}")
        self.prompt_token_ids = check_token_ids(self.prompt_token_ids, f"request {rid!r}: prompt_token_ids")
        if not isinstance(self.return_hidden, bool):
            raise ValueError(f"request {rid!r}: return_hidden must be a bool, got {self.return_hidden!r}")

    def __len__(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of one forward: prompt tokens ``[start, start + length)`` of ``request``.

    ``start`` is the request's ``num_computed_tokens`` when scheduled (keys already cached);
    ``is_last``: the chunk ends the prompt (the request is done after this forward).
    """

    request: Request
    start: int
    length: int

    @property
    def is_last(self) -> bool:
        return self.start + self.length == len(self.request)

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids[self.start:self.start + self.length]


class Scheduler:
    """FCFS prefill scheduler with vLLM's budget knobs.

    max_num_batched_tokens: most prompt tokens in one batch (Σ L_i over the batch).
    max_num_seqs: most requests in one batch (a chunk counts as one).
    enable_chunked_prefill: split the request that does not fit (see the module doc); default
    False: requests are never split (S3), never reordered: a request that does not fit the current
    batch waits for the next one, and so does everyone behind it.
    long_prefill_token_threshold: vLLM's chunk cap, a positive int or None (no cap; vLLM spells that
    0): no chunk of any request longer than this many tokens; needs ``enable_chunked_prefill=True``.

    Taught in notebooks/06_prefill_engine.ipynb and notebooks/08_chunked_prefill.ipynb.
    """

    def __init__(self, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, *, enable_chunked_prefill: bool = False,
                 long_prefill_token_threshold: int | None = None):
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        if not isinstance(enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {enable_chunked_prefill!r}")
        self.enable_chunked_prefill = enable_chunked_prefill
        cap = long_prefill_token_threshold
        if cap is not None and not (is_int(cap) and cap >= 1):
            raise ValueError(f"long_prefill_token_threshold must be a positive int or None (no cap), got {cap!r}")
        if cap is not None and not enable_chunked_prefill:
            raise ValueError(f"long_prefill_token_threshold={cap} caps chunks, and there are none: requests run whole "
                             "unless enable_chunked_prefill=True")
        self.long_prefill_token_threshold = None if cap is None else int(cap)
        self.waiting: deque[Request] = deque()

    def check_fits(self, req: Request) -> None:
        """Raise ValueError if ``req`` could never be scheduled whole (never, with chunked prefill)."""
        if not self.enable_chunked_prefill and len(req) > self.max_num_batched_tokens:
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

    def schedule_chunks(self) -> list[ScheduledChunk]:
        """Pop the next forward as chunks. Chunked prefill off: ``schedule()``'s requests, whole. On, as
        vLLM schedules: the waiting requests in arrival order (those part-way through first, they arrived
        first), each ``min(tokens it has left, long_prefill_token_threshold, tokens left in the forward)``,
        until the forward holds ``max_num_batched_tokens`` tokens or ``max_num_seqs`` requests. Each
        request's ``num_computed_tokens`` advances to its chunk's end; an unfinished one keeps its place."""
        if not self.enable_chunked_prefill:
            return [ScheduledChunk(r, 0, len(r)) for r in self.schedule()]
        cap = self.long_prefill_token_threshold or self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        room = self.max_num_batched_tokens
        for req in self.waiting:
            if not room or len(chunks) == self.max_num_seqs:
                break
            n = min(len(req) - req.num_computed_tokens, cap, room)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            room -= n
        for c in chunks:  # the chunks are the head of the queue: take them off, put back the unfinished
            self.waiting.popleft()
            c.request.num_computed_tokens += c.length
        self.waiting.extendleft(reversed([c.request for c in chunks if not c.is_last]))
        return chunks

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def __len__(self) -> int:
        return len(self.waiting)


def plan_batches(seq_lens: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 *, skip_oversize: bool = False, enable_chunked_prefill: bool = False,
                 long_prefill_token_threshold: int | None = None) -> list[list]:
    """Request indices per batch, exactly as ``Scheduler`` forms them for requests of ``seq_lens``.

    A request longer than the budget raises ValueError, or with ``skip_oversize=True`` is left
    out of every batch (the engine would refuse it at submit). With ``enable_chunked_prefill=True``
    every batch is a list of chunks ``(request index, start, length)`` and no request is oversize;
    ``long_prefill_token_threshold`` caps every chunk (``Scheduler``).
    """
    sched = Scheduler(max_num_batched_tokens, max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
                      long_prefill_token_threshold=long_prefill_token_threshold)
    for i, n in enumerate(check_lengths(seq_lens)):
        if enable_chunked_prefill or not (skip_oversize and n > sched.max_num_batched_tokens):
            sched.add(Request(i, [0] * n))
    batches = []
    while sched.has_unfinished():
        if enable_chunked_prefill:
            batches.append([(c.request.request_id, c.start, c.length) for c in sched.schedule_chunks()])
        else:
            batches.append([r.request_id for r in sched.schedule()])
    return batches


def prefill_waits(forwards: Sequence[Sequence[tuple]]) -> dict:
    """``{request: (forwards, tokens)}`` of a run's forwards, each a list of ``(request, num_tokens)`` pairs or
    ``(request, start, num_tokens)`` chunks (a chunked ``plan_batches`` plan, ``BatchStats.chunks``): the forwards
    run until the one that holds the request's last chunk (that one included, counted from 1), and the prompt
    tokens those forwards ran. A wait ends with the request's last chunk, whichever forward it is in."""
    out, tokens = {}, 0
    for f, fwd in enumerate(forwards):
        tokens += sum(c[-1] for c in fwd)
        for c in fwd:
            out[c[0]] = (f + 1, tokens)
    return out


def mean_prefill_wait(waits: dict, requests: Sequence) -> tuple[float, float]:
    """Mean ``(forwards, tokens)`` of ``prefill_waits`` over ``requests`` (a non-empty sequence of its keys)."""
    rs = list(requests)
    if not rs or any(i not in waits for i in rs):
        raise ValueError(f"requests must be a non-empty list of requests the run served, got {rs[:8]!r}")
    return sum(waits[i][0] for i in rs) / len(rs), sum(waits[i][1] for i in rs) / len(rs)


def chunked_schedule_problem(forwards, seq_lens: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int,
                             long_prefill_token_threshold: int = 0) -> str | None:
    """The first rule of a chunked prefill (vLLM's, ``Scheduler`` with ``enable_chunked_prefill=True``) that
    ``forwards`` (each a list of ``(request index, num_tokens)`` pairs, in the order they run) breaks, in words, or
    None. Any schedule keeping the rules passes, not only ``Scheduler``'s: each forward runs the first unfinished
    requests in arrival order, each once, 1 .. min(its rest, ``long_prefill_token_threshold``) tokens (0: no cap),
    within both budgets; it closes with room left and fewer than ``max_num_seqs`` requests only when every
    unfinished request runs all the cap allows; every prompt's tokens run exactly once."""
    budget, cap = max_num_batched_tokens, long_prefill_token_threshold
    if not isinstance(forwards, (list, tuple)) or not all(isinstance(f, (list, tuple)) for f in forwards):
        return f"expected a list of forwards, each a list of (request, num_tokens) pairs, got {forwards!r}"[:300]
    if not all(isinstance(c, (list, tuple)) and len(c) == 2 and all(map(is_int, c)) for f in forwards for c in f):
        return ("each chunk is a pair (request index, num_tokens) of ints: a chunked forward says how many tokens "
                "each request runs")
    left, limit = list(seq_lens), cap or budget
    for f, fwd in enumerate(forwards):
        waiting = [i for i, n in enumerate(left) if n]
        ids, tokens = [i for i, _ in fwd], sum(t for _, t in fwd)
        if not waiting:
            return f"{len(forwards)} forwards, but every prompt is finished after forward {f - 1}: forward {f} should not exist"
        if not fwd:
            return f"forward {f} is empty: every forward carries at least one chunk"
        if sorted(ids) != waiting[:len(ids)]:
            return (f"forward {f} runs requests {ids} while the first unfinished ones are {waiting[:len(ids)]}: a "
                    "forward takes the unfinished requests in arrival order, each once")
        for i, t in fwd:
            if not 1 <= t <= left[i]:
                return (f"forward {f}: request {i} gets {t} tokens with {left[i]} of its {seq_lens[i]} left: a chunk "
                        "holds at least one token and continues where the cache ends, never past the prompt")
            if cap and t > cap:
                return (f"forward {f}: request {i} runs {t} tokens > long_prefill_token_threshold={cap}: no chunk may "
                        "exceed the cap")
        if tokens > budget:
            return (f"forward {f} holds {tokens} tokens > max_num_batched_tokens={budget}: the chunk of the request "
                    "that does not fit is the room LEFT in this forward, not a whole budget")
        if len(fwd) > max_num_seqs:
            return f"forward {f} holds {len(fwd)} requests > max_num_seqs={max_num_seqs}: the budget counts requests too"
        short = [(i, t) for i, t in fwd if t < min(left[i], limit)]
        if tokens < budget and short:
            why = " - long_prefill_token_threshold=0 means no cap (vLLM's default)" if cap == 0 else ""
            return (f"forward {f} has {budget - tokens} tokens of room, yet request {short[0][0]} gets only "
                    f"{short[0][1]} of the {min(left[short[0][0]], limit)} it may run{why}")
        if tokens < budget and len(fwd) < min(max_num_seqs, len(waiting)):
            return (f"forward {f} closes with {budget - tokens} tokens of room while request {waiting[len(fwd)]} "
                    "waits: a capped chunk does not end the forward, the room left goes to the requests behind it "
                    "(that is the point of the cap)")
        for i, t in fwd:
            left[i] -= t
    missing = [i for i, n in enumerate(left) if n][:8]
    return f"requests {missing} are not finished: {[left[i] for i in missing]} tokens never scheduled" if missing else None
