#!/usr/bin/env bash
# One command for the tests on any machine, even one whose Python has no torch:
#   bash scripts/setup_and_test.sh [pytest arguments]
# Picks or makes the Python environment as setup_and_benchmark.sh does (scripts/_python_env.sh: PYTHON,
# VENV, TORCH_SPEC, TORCH_INDEX_URL, SAGE_GPU), adds Triton if torch did not bring it (TRITON_SPEC,
# default triton==3.6.0: its interpreter runs the Triton kernels on the CPU and its AMD backend compiles
# them for gfx12), requirements.txt and requirements-test.txt, then runs `python -m pytest tests`.
# Which tests: pyproject.toml's addopts hold -m "not slow", so the default run leaves out the tests marked slow
# (the 10,000-call fuzz, the long Triton-interpreter and simulator matrices; about 3.5 minutes on 2 cores without
# them). A -m among the arguments replaces that one: `-m ""` runs every test (what .ci/run does), `-m slow` only
# the slow ones, `-m "gpu and not slow"` the quick GPU tests (a slow test named by its id needs `-m ""` too).
# Other arguments go to pytest as they are.
# WITH_APT=1 (or CI=true), as root with apt-get: also installs clang-19 lld-19 llvm-19 (HIP compile
# checks for gfx1200/gfx1201) and chromium (the frontend extension in a headless browser).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_python_env.sh
. scripts/_python_env.sh

APT_PACKAGES="clang-19 lld-19 llvm-19 chromium"
if [ "${WITH_APT:-0}" = 1 ] || [ "${CI:-}" = true ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    sage_say "apt-get install $APT_PACKAGES"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $APT_PACKAGES >/dev/null
  else
    sage_say "WITH_APT: not root or no apt-get, so not installing $APT_PACKAGES"
  fi
fi
command -v clang-19 >/dev/null 2>&1 || sage_say "no clang-19: the HIP compile checks will skip (WITH_APT=1 as root installs $APT_PACKAGES)"
command -v chromium >/dev/null 2>&1 || sage_say "no chromium: the browser test of the frontend extension will skip"

sage_setup_python
if ! "$PY" -c "import triton" >/dev/null 2>&1; then
  if [ "$(uname -s)" = Linux ]; then
    sage_say "installing ${TRITON_SPEC:-triton==3.6.0} (about 650 MB installed)"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q ${TRITON_SPEC:-triton==3.6.0}
  else
    sage_say "no Triton wheels for $(uname -s) on PyPI: the Triton tests will skip"
  fi
fi
"$PY" -m pip install -q -r requirements.txt -r requirements-test.txt
"$PY" - <<'PYEOF' >&2
import importlib.util
import sys

import torch

triton = "triton " + __import__("triton").__version__ if importlib.util.find_spec("triton") else "no triton"
print(f"setup: torch {torch.__version__}, {triton}; running {sys.executable} -m pytest")
PYEOF
# No path given: pytest runs `tests` (testpaths in pyproject.toml).
exec "$PY" -m pytest "$@"
