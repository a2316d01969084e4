"""Moved: the palette and shared drawing pieces live in ``lessons_lib.style`` (used by the course and the benchmark)."""
from ..style import *  # noqa: F403  (kept until every import names lessons_lib.style)
