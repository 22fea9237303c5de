#!/usr/bin/env bash
# Fresh machine -> benchmark + self-check of every attention backend against SDPA.
# Uses $PYTHON (default python3) if it already has torch (e.g. ComfyUI's own Python); otherwise makes
# .venv here and installs PyTorch from PyPI (CUDA build on Linux; for ROCm set TORCH_INDEX_URL to the
# ROCm wheel index of your PyTorch version). Extra arguments go to benchmark.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m venv .venv
  PY=.venv/bin/python
  "$PY" -m pip install -q --upgrade pip
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$PY" -m pip install -q torch --index-url "$TORCH_INDEX_URL"
  else
    "$PY" -m pip install -q torch
  fi
fi
"$PY" -m pip install -q -r requirements.txt
exec "$PY" benchmark.py "$@"
