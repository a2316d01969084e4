"""Breakages of the claims lesson 08 proves (see breakages.py). Each installs one of the bugs of
``course.l08_chunked.BUGS``, the same ones the lesson's break-it cells run."""
from breakages import breaks

NOTEBOOK = "08_chunked_prefill"


def _install(bug: str):
    from lessons_lib.course import l08_chunked

    l08_chunked.install(bug)


@breaks("P1", NOTEBOOK, "positions restart at 0 in every chunk where the model looks up its position embeddings")
def _positions_restart():
    _install("positions restart")


@breaks("P2", NOTEBOOK, "the chunked scheduler gives the head request a whole budget, not the room left in the forward")
def _chunk_takes_whole_budget():
    _install("chunk takes a whole budget")


@breaks("P3", NOTEBOOK, "the causal mask of a chunk is aligned top-left (query i sees keys 0..i of its rectangle), "
        "on every TP rank")
def _causal_top_left():
    _install("causal top-left")


@breaks("P4", NOTEBOOK, "the cache is never appended in front of a chunk: each chunk attends to its own keys only")
def _cache_not_appended():
    _install("cache not appended")


@breaks("P5", NOTEBOOK, "a chunked request goes to the back of the queue (round robin) instead of staying at its head")
def _chunked_to_the_back():
    _install("chunked request to the back")
