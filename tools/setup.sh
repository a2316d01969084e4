#!/usr/bin/env bash
# Create .venv and install the course's requirements. Safe to re-run: it skips what is done.
# On a machine without an NVIDIA GPU, torch's CPU build goes in first, so that the range in
# requirements.txt is already satisfied and pip does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q "torch>=2.5,<2.15"
  else
    # The CPU wheel index is tried briefly; where it is unreachable pip uses PyPI / local wheels.
    $PIP install -q --retries 0 --timeout 10 --extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" "torch==2.13.0"
  fi
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  $PIP install -q -r requirements.txt
  echo "$want" > "$stamp"
fi
# lessons_lib importable from any folder (JupyterLab opens notebooks/), edits picked up live.
venv_py="$(pwd)/.venv/bin/python"
if ! (cd / && "$venv_py" -c "import lessons_lib") 2>/dev/null; then
  $PIP install -q --no-deps --no-build-isolation -e .
fi
# The browser test drives Debian's Chromium (never a downloaded browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
