"""Breakages of the claims lesson 08 proves (see breakages.py). Each installs one of the bugs of
``course.l08_chunked.BUGS``, the same ones the lesson's break-it cells run."""
from breakages import breaks_each

NOTEBOOK = "08_chunked_prefill"


def _install(bug: str):
    from lessons_lib.course import l08_chunked

    l08_chunked.install(bug)


# One bug per claim (l08_chunked's break-it table names them).
breaks_each(NOTEBOOK, _install, (
        ("P1", "bug report", "positions restart at 0 in every chunk where the model looks up its position embeddings"),
        ("P2", "chunk takes a whole budget",
         "the chunked scheduler gives the head request a whole budget, not the room left in the forward"),
        ("P3", "causal top-left",
         "the causal mask of a chunk is aligned top-left (query i sees keys 0..i of its rectangle), on every TP rank"),
        ("P4", "cache not appended", "the cache is never appended in front of a chunk: each chunk attends to its own keys only"),
        ("P5", "chunked request to the back",
         "a chunked request goes to the back of the queue (round robin) instead of staying at its head")))
