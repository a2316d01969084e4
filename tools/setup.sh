#!/usr/bin/env bash
# Create .venv and install the course's requirements. Safe to re-run: it skips what is done.
# On a machine without an NVIDIA GPU, torch's CPU build goes in first, so that the range in
# requirements.txt is already satisfied and pip does not pull a multi-GB CUDA build. Where
# python3 already has a CUDA torch that sees a GPU, .venv is made with --system-site-packages
# and uses that torch. Offline (pip's index unreachable), pip takes local wheels only, setup
# lists what it could not install and goes on; online, a failing install stops setup.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=".venv/bin/python -m pip"
MISSING=""
maybe_timeout() { if command -v timeout >/dev/null 2>&1; then timeout "$@"; else shift; "$@"; fi; }
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if [ ! -x .venv/bin/python ]; then
  if maybe_timeout 120 "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "setup: $PY has a CUDA torch that sees a GPU: .venv uses it (--system-site-packages)"
    "$PY" -m venv --system-site-packages .venv 2>/dev/null || "$PY" -m venv --system-site-packages --without-pip .venv
  else
    "$PY" -m venv .venv
  fi
fi

# Asked once, when something must be installed: does pip's index answer? (An HTTP error is an answer.)
online() {
  if [ -z "${ONLINE:-}" ]; then
    ONLINE=no
    .venv/bin/python - <<'EOF' && ONLINE=yes
import os, subprocess, sys, urllib.error, urllib.request
cfg = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout  # files + PIP_*
url = next((v.strip("'\"") for k, _, v in (x.partition("=") for x in cfg.splitlines()) if k.endswith(".index-url")),
           "https://pypi.org/simple")
try:
    if url.startswith("file:"):
        assert os.path.isdir(url.removeprefix("file://"))
    else:
        urllib.request.urlopen(url.rstrip("/") + "/pip/", timeout=10)
except urllib.error.HTTPError:
    pass
except Exception as exc:
    sys.exit(f"setup: pip's index {url} is unreachable ({type(exc).__name__}): installing offline, from local wheels only")
EOF
  fi
  [ "$ONLINE" = yes ]
}
# pip_install WHAT ARGS...: online, a failure stops setup (a real error); offline, WHAT is noted and setup goes on.
pip_install() {
  local what=$1; shift
  if online; then
    $PIP install "$@" || { echo "setup: pip failed although its index answers: fix the error above" >&2; exit 1; }
  elif ! $PIP install --no-index "$@"; then
    MISSING="$MISSING$what"$'\n'
    return 1
  fi
}
# The lines of requirements.txt that .venv does not satisfy.
unmet_requirements() {
  .venv/bin/python - <<'EOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for line in open("requirements.txt"):
    line = line.split("#", 1)[0].strip()
    if line:
        req = Requirement(line)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            print(line)
            continue
        if not req.specifier.contains(have, prereleases=True):
            print(f"{line} (have {have})")
EOF
}

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if has_gpu; then
    pip_install "torch>=2.5,<2.15" -q "torch>=2.5,<2.15" || true
  else
    # The CPU wheel index is tried briefly; where it is unreachable pip uses PyPI / local wheels.
    pip_install "torch==2.13.0 (CPU build)" -q --retries 0 --timeout 10 \
      --extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" "torch==2.13.0" || true
  fi
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if pip_install "" -q -r requirements.txt; then
    echo "$want" > "$stamp"
  else
    MISSING="$MISSING$(unmet_requirements)"$'\n'
  fi
fi
# lessons_lib importable from any folder (JupyterLab opens notebooks/), edits picked up live.
venv_py="$(pwd)/.venv/bin/python"
if ! (cd / && "$venv_py" -c "import lessons_lib") 2>/dev/null; then
  if ! $PIP install -q --no-deps --no-build-isolation -e . 2>/dev/null; then  # needs setuptools in .venv
    echo "setup: pip cannot build an editable install here (setuptools/wheel missing?): lessons_lib goes on .venv's path by a .pth file"
    pwd > "$("$venv_py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/lessons_lib_repo.pth"
  fi
  (cd / && "$venv_py" -c "import lessons_lib")
fi
# The browser test drives Debian's Chromium (never a downloaded browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { maybe_timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive maybe_timeout 600 apt-get install -y -qq chromium >/dev/null; } \
    || echo "setup: could not install Debian's chromium (no network?): only the browser tests need it"
fi
# FlashAttention is an optional CUDA extra: say how to add it, never fail for it.
if has_gpu && ! .venv/bin/python -c "import flash_attn" 2>/dev/null; then
  echo "setup: flash-attn not installed (optional, sm80+); to add it: .venv/bin/python -m pip install -r requirements-gpu.txt --no-build-isolation"
fi
if [ -n "${MISSING//$'\n'/}" ]; then
  echo "setup: OFFLINE, so these were not installed (re-run tools/setup.sh with network):"
  printf '%s' "$MISSING" | sed '/^$/d; s/^/  /'
  echo "setup: the GPU check needs only torch: python3 tools/gpu_check.py --out DIR"
fi
