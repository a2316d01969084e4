"""The course's apparatus: what the lessons draw, explore, check and probe.

  check      claim() and close(): the one-line ✓ of a claim cell, or an error with the numbers
  viz        matplotlib figures as pure functions (numbers in, Figure out)
  figures    python -m lessons_lib.course.figures: every lesson figure into figures/
  widgets    ipywidgets explorers over pure state functions
  exercises  checkers that grade the reader's functions and explain a wrong answer
  probe      which output rows change when one input row changes
"""
