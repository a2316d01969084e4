"""Test doubles and breakages, installed from the test side in every process a test starts.

A test that needs a changed engine in ANOTHER process (a notebook's kernel, spawned TP workers)
puts this folder first on ``PYTHONPATH`` and names a module of ``tests/`` in
``LESSONS_TEST_HOOK`` (``helpers.install_in_children``): every Python started with that
environment runs this file at start-up (``site`` imports ``sitecustomize``; spawned children
inherit the environment) and imports the module, e.g. ``breakages`` (with ``LESSONS_BREAK=<claim
id>``) or ``kernel_doubles``, before any code of the process runs. The engine knows nothing of it.
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
    except Exception:  # site would print one line and go on with the engine unchanged: stop instead
        traceback.print_exc()
        raise SystemExit(f"tests/hooks/sitecustomize.py: LESSONS_TEST_HOOK={_NAME!r} failed to import") from None
