"""Debian's headless Chromium driven by Playwright, shared by the browser and site tests.

Never downloads a browser: Playwright only drives ``/usr/bin/chromium``. Where Playwright or
Chromium is missing the test is skipped with the reason, except under ``CI=true``, where a
skip would turn CI green with no browser test run: there it is a failure.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# The background-networking flags matter: this machine's closed network refuses Chromium's
# own connections (updates, sync, QUIC probes), which otherwise cost seconds at every start.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-quic", "--no-first-run", "--disable-sync"]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_or_fail(reason: str, what: str = "the browser test cannot run") -> None:
    """Skip the test with ``reason``; under CI, fail it instead ("CI=true but <what>: <reason>")."""
    if under_ci():
        pytest.fail(f"CI=true but {what}: {reason}", pytrace=False)
    pytest.skip(reason)


def require_browser():
    """Return Playwright's ``sync_playwright``; skip (fail under CI) when it or Chromium is missing."""
    problems = []
    sync_playwright = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        problems.append(f"Playwright is not importable ({exc}); pip install playwright")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        problems.append(f"no Chromium at {CHROMIUM}; apt-get install chromium")
    if problems:
        skip_or_fail("; ".join(problems))
    return sync_playwright


# One Playwright driver per process, shared by every context: Playwright's sync API refuses
# to start a second driver while one is running (the site test and the widget test each
# hold a context for the whole session).
_driver = {"playwright": None, "users": 0}


@contextmanager
def chromium_context(profile_dir: Path) -> Iterator:
    """A persistent Chromium context on a fresh, empty profile (``launch()`` refuses a profile arg)."""
    sync_playwright = require_browser()
    profile_dir.mkdir(parents=True, exist_ok=True)
    if _driver["users"] == 0:
        _driver["playwright"] = sync_playwright().start()
    _driver["users"] += 1
    try:
        context = _driver["playwright"].chromium.launch_persistent_context(
            str(profile_dir), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000})
        try:
            yield context
        finally:
            context.close()
    finally:
        _driver["users"] -= 1
        if _driver["users"] == 0:
            _driver["playwright"].stop()
            _driver["playwright"] = None
