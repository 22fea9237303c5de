#!/usr/bin/env bash
# Fresh machine -> benchmark + self-check of every attention backend against SDPA.
# Uses $PYTHON, or .venv, or python3 when it has torch; otherwise makes .venv and installs the PyTorch
# build for this machine (ROCm on an AMD GPU, CUDA on an NVIDIA GPU, CPU without a GPU). Settings:
# PYTHON, VENV, TORCH_SPEC, TORCH_INDEX_URL, SAGE_GPU (see scripts/_python_env.sh). Extra arguments go
# to benchmark.py.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_python_env.sh
. scripts/_python_env.sh
sage_setup_python
# pip's log to stderr: stdout is the benchmark's alone (with --json - it must be just the JSON document).
"$PY" -m pip install -q -r requirements.txt >&2
exec "$PY" benchmark.py "$@"
