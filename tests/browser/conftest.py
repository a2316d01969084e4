"""Fixtures for the browser test: a private JupyterLab server and a headless Chromium.

The server is started by the test itself on 127.0.0.1 with a free port and a fixed token, on
a temporary copy of ``notebooks/`` (so Run All and autosave never dirty the repo), with every
Jupyter/IPython directory pointed into a temp dir (nothing of the user's is read or touched).
On teardown it stops only what it started: the server's own process group and the kernels
the server spawned (kernels run in their own sessions, so they are recorded by pid).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # whatever pytest's import mode
from course_browser import ARTIFACTS, REPO, chromium_context, require_browser

TOKEN = "course-browser-test-token"
START_TIMEOUT_S = 90


@dataclass(frozen=True)
class LabServer:
    url: str          # http://127.0.0.1:PORT
    token: str
    root: Path        # the temp copy of notebooks/ the server serves
    log: Path

    def lab_url(self, notebook: str) -> str:
        # ?reset: start from an empty workspace, never restore a previous layout.
        return f"{self.url}/lab/tree/{notebook}?reset&token={self.token}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(settings_dir: Path) -> None:
    """User settings for the private server: no news/update fetches, every cell in the DOM."""
    files = {
        # "none": all cells stay in the DOM, so widgets far down a lesson can be found
        # without scrolling the virtual notebook window.
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
    }
    for rel, value in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _descendants(pid: int) -> list:
    try:
        import psutil
        return psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing or the server already gone: nothing more to record
        return []


def _stop(proc: subprocess.Popen, url: str, known_children: list) -> None:
    """Stop the server we started and the kernels it spawned; nothing else."""
    children = {c.pid: c for c in known_children + _descendants(proc.pid)}
    if proc.poll() is None:
        try:  # a clean shutdown also shuts down the kernels
            req = urllib.request.Request(f"{url}/api/shutdown", method="POST",
                                         headers={"Authorization": f"token {TOKEN}"})
            urllib.request.urlopen(req, timeout=5).close()
        except (OSError, urllib.error.URLError):
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)  # the group that start_new_session gave our server
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
    for child in children.values():  # kernels live in their own sessions; end them by pid
        try:
            if child.is_running():
                child.kill()
        except Exception:
            pass


# Module scope: the server, its kernels and Playwright's driver (which holds an asyncio loop
# on this thread) are gone before the rest of the session (unit tests, nbval) runs.
@pytest.fixture(scope="module")
def lab_server(tmp_path_factory) -> LabServer:
    require_browser()  # skip/fail before paying for a server start
    base = tmp_path_factory.mktemp("lab")
    # Lessons import lessons_lib and may read/write ../figures, as they do from the repo.
    root = base / "course" / "notebooks"
    shutil.copytree(REPO / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    if (REPO / "figures").is_dir():
        shutil.copytree(REPO / "figures", base / "course" / "figures")
    (base / "course" / "lessons_lib").symlink_to(REPO / "lessons_lib")
    jdirs = {name: base / name.lower() for name in
             ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_WORKSPACES_DIR",
              "JUPYTERLAB_SETTINGS_DIR", "IPYTHONDIR", "MPLCONFIGDIR")}
    for d in jdirs.values():
        d.mkdir()
    _write_settings(jdirs["JUPYTERLAB_SETTINGS_DIR"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "JPY_"))}
    env.update({k: str(v) for k, v in jdirs.items()})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / "jupyterlab-server.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode} before answering; "
                            f"log:\n{log.read_text()[-3000:]}", pytrace=False)
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer on {url} within {START_TIMEOUT_S} s; "
                            f"log:\n{log.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.25)
        yield LabServer(url, TOKEN, root, log)
    finally:
        _stop(proc, url, _descendants(proc.pid))


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):
    """A Chromium context on a fresh profile, shared by the browser tests of one module."""
    with chromium_context(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context
