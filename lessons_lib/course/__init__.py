"""The course's apparatus: what each lesson draws, explores and checks, over a few shared pieces.

  l00_setup … l08_chunked  one module per lesson: its claims helpers, figures, explorer, exercise checkers;
                           a lesson imports no other lesson and no underscored engine name, and patches
                           nothing (tests/lesson_rules.py): bugs come from lessons_lib.faults
  check      claim tables and close(): the ✓ of a claim cell, or an error with the numbers
  style      the palette (one meaning per colour), PNG rendering, drawing pieces lessons share
  figures    the figure registry; python -m lessons_lib.course.figures writes figures/
  explore    widget plumbing: an explorer is a pure state function plus a thin ipywidgets wrapper
  grading    how exercises are checked (a learner's check) and scored (a classroom grade cell)
  source     show_source: the engine's own code, shown where a lesson teaches it
  probe      which output rows change when one input row changes
  trace_figures  the TP rank timeline drawn by lessons 04 and 06

``claim`` and ``close`` (from ``check``) are importable from here: ``from lessons_lib.course import claim``.
"""
from .check import claim, close

__all__ = ["claim", "close"]
