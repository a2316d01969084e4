"""Test doubles and the engine's named faults, installed from the test side in every process a test starts.

A test that needs a changed engine in ANOTHER process (a notebook's kernel, spawned TP workers)
puts this folder first on ``PYTHONPATH`` and names a module of ``tests/`` in
``LESSONS_TEST_HOOK`` (``helpers.install_in_children``): every Python started with that
environment runs this file at start-up (``site`` imports ``sitecustomize``; spawned children
inherit the environment) and imports the module, e.g. ``kernel_doubles``, before any code of the
process runs. Then the faults named in ``LESSONS_FAULTS`` are turned on for the whole process
(``lessons_lib.faults.apply_from_env``), as TP workers do at their own start-up.
"""
import importlib
import os
import sys
import traceback
from pathlib import Path

_NAME = os.environ.get("LESSONS_TEST_HOOK")
if _NAME:
    _TESTS = str(Path(__file__).resolve().parents[1])
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    try:
        importlib.import_module(_NAME)
        if os.environ.get("LESSONS_FAULTS"):
            importlib.import_module("lessons_lib.faults").apply_from_env()
    except Exception:  # site would print one line and go on with the engine unchanged: stop instead
        traceback.print_exc()
        raise SystemExit(f"tests/hooks/sitecustomize.py: LESSONS_TEST_HOOK={_NAME!r} or LESSONS_FAULTS="
                         f"{os.environ.get('LESSONS_FAULTS')!r} failed") from None
