# shellcheck shell=bash
# Sourced by scripts/setup_and_benchmark.sh and scripts/setup_and_test.sh, not run by itself.
# `sage_setup_python` sets PY to a Python that has torch: $PYTHON if it has torch, else the virtual
# environment $VENV (made here if missing), else python3 if it has torch, else a new $VENV with the
# PyTorch build that fits this machine. Messages go to stderr, and so does what pip and venv print (stdout stays
# the benchmark's: `setup_and_benchmark.sh --json -` must write nothing there but the JSON).
#
# Settings, all optional:
#   PYTHON           a Python to use as it is when it has torch (e.g. ComfyUI's); without torch, $VENV
#                    is made from it
#   VENV             the virtual environment (default: .venv in the repository)
#   TORCH_SPEC       what pip is asked for (default: torch), e.g. "torch==2.13.0"
#   TORCH_INDEX_URL  take torch from this wheel index, whatever GPU is here
#   SAGE_GPU         amd, nvidia or none: skip the GPU detection
# Which build: AMD GPU -> PyTorch's ROCm wheel index; NVIDIA GPU -> PyPI (CUDA build); no GPU -> a CPU
# build: the one pip offers as configured if it is one (macOS, Windows, a local CPU wheel), else PyTorch's
# CPU wheel index. Never the several-GB CUDA build of PyPI on a machine without an NVIDIA GPU.

SAGE_PYTORCH_WHL="https://download.pytorch.org/whl"
# PyTorch's ROCm indexes, newest first; the first that answers is used.
SAGE_ROCM_INDEXES="rocm7.2 rocm7.1 rocm7.0 rocm6.4"
# The torch CI tests with (.ci/run): the CPU fallback when no index offers a CPU build of the newest one.
SAGE_CI_TORCH="torch==2.13.0"
SAGE_AMD_RDNA4_INDEX="https://rocm.nightlies.amd.com/v2/gfx120X-all/"

sage_say() { printf 'setup: %s\n' "$*" >&2; }
sage_die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

sage_has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }

sage_torch_version() { "$1" -c "import torch; print(torch.__version__)" 2>/dev/null; }

sage_venv_python() {
  if [ -x "$VENV/bin/python" ]; then
    printf '%s\n' "$VENV/bin/python"
  elif [ -x "$VENV/Scripts/python.exe" ]; then
    printf '%s\n' "$VENV/Scripts/python.exe"
  fi
}

# URL answers with a success status (DNS, proxy and TLS failures count as no). Uses the Python found first.
sage_url_ok() {
  "${SAGE_BASE_PY:-python3}" - "$1" >/dev/null 2>&1 <<'EOF'
import sys
import urllib.request

try:
    with urllib.request.urlopen(sys.argv[1], timeout=15) as r:
        sys.exit(0 if r.status < 400 else 1)
except Exception:
    sys.exit(1)
EOF
}

# Sets SAGE_GPU (amd, nvidia, none) and SAGE_GPU_SEEN (what showed it). SAGE_DEV_DIR: tests only.
sage_detect_gpu() {
  local dev="${SAGE_DEV_DIR:-/dev}" out display
  if [ -n "${SAGE_GPU:-}" ]; then
    case "$SAGE_GPU" in
      amd | nvidia | none) SAGE_GPU_SEEN="SAGE_GPU=$SAGE_GPU" ;;
      *) sage_die "SAGE_GPU must be amd, nvidia or none, not '$SAGE_GPU'" ;;
    esac
    return 0
  fi
  SAGE_GPU=none SAGE_GPU_SEEN="no /dev/kfd, rocminfo, nvidia-smi, /dev/nvidia0 or GPU in lspci"
  out=""
  if command -v rocminfo >/dev/null 2>&1; then out=$(rocminfo 2>/dev/null || true); fi
  display=""
  if command -v lspci >/dev/null 2>&1; then
    display=$(lspci 2>/dev/null | grep -Ei 'vga compatible|display controller|3d controller' || true)
  fi
  if [ -e "$dev/kfd" ]; then
    SAGE_GPU=amd SAGE_GPU_SEEN="$dev/kfd"
  elif grep -Eq 'gfx[0-9]' <<<"$out"; then
    SAGE_GPU=amd SAGE_GPU_SEEN="rocminfo: $(grep -Eo 'gfx[0-9a-f]+' <<<"$out" | head -n1)"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    SAGE_GPU=nvidia SAGE_GPU_SEEN="nvidia-smi"
  elif [ -e "$dev/nvidia0" ]; then
    SAGE_GPU=nvidia SAGE_GPU_SEEN="$dev/nvidia0"
  elif grep -Eiq '\[AMD/ATI\]|Advanced Micro Devices|\bATI\b' <<<"$display"; then
    SAGE_GPU=amd SAGE_GPU_SEEN="lspci: $(grep -Ei '\[AMD/ATI\]|Advanced Micro Devices|\bATI\b' <<<"$display" | head -n1)"
  elif grep -iq 'nvidia' <<<"$display"; then
    SAGE_GPU=nvidia SAGE_GPU_SEEN="lspci: $(grep -i 'nvidia' <<<"$display" | head -n1)"
  fi
}

# Reads a `pip install --dry-run --report` file: prints "torch VERSION" and succeeds when the torch in it
# is a CPU build (no +cuXXX/+rocmX.Y label, no CUDA or ROCm requirement for this platform).
sage_report_is_cpu_build() {
  "$PY" - "$1" <<'EOF'
import json
import sys

items = [i for i in json.load(open(sys.argv[1]))["install"] if i["metadata"]["name"].lower() == "torch"]
if not items:
    sys.exit(1)
meta = items[0]["metadata"]
version = meta["version"]
if "+cu" in version or "+rocm" in version:
    sys.exit(1)
try:
    from pip._vendor.packaging.requirements import Requirement
except ImportError:
    Requirement = None
for text in meta.get("requires_dist") or []:
    name = text.split(";")[0].strip().lower()
    if not name.startswith(("nvidia-", "cuda-", "pytorch-triton-rocm", "rocm")):
        continue
    if Requirement is not None:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
    sys.exit(1)
print("torch " + version)
EOF
}

# Sets SAGE_TORCH_ARGS (pip arguments) and says what will be installed, from where and how big.
sage_torch_plan() {
  local spec="${TORCH_SPEC:-torch}" report probe name url=""
  SAGE_TORCH_ARGS=()
  SAGE_TORCH_SPEC="$spec"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    SAGE_TORCH_ARGS=(--index-url "$TORCH_INDEX_URL")
    sage_say "installing $spec from TORCH_INDEX_URL=$TORCH_INDEX_URL (a CPU build is about 200 MB to download, a CUDA or ROCm build several GB)"
    return 0
  fi
  sage_detect_gpu
  case "$SAGE_GPU" in
    amd)
      for name in $SAGE_ROCM_INDEXES; do
        if sage_url_ok "$SAGE_PYTORCH_WHL/$name/torch/"; then url="$SAGE_PYTORCH_WHL/$name"; break; fi
      done
      [ -n "$url" ] || sage_die "AMD GPU found ($SAGE_GPU_SEEN) but none of PyTorch's ROCm wheel indexes ($SAGE_ROCM_INDEXES under $SAGE_PYTORCH_WHL) can be reached: set TORCH_INDEX_URL to a ROCm wheel index, or PYTHON to a Python that has a ROCm torch"
      SAGE_TORCH_ARGS=(--index-url "$url")
      sage_say "AMD GPU found ($SAGE_GPU_SEEN): installing $spec, ROCm build, from PyTorch's index $url (several GB: about 3-5 GB to download, over 10 GB installed)"
      sage_say "another ROCm build: TORCH_INDEX_URL=<wheel index> (AMD's own RDNA4 wheels: $SAGE_AMD_RDNA4_INDEX), or PYTHON=<a Python that has torch>"
      ;;
    nvidia)
      sage_say "NVIDIA GPU found ($SAGE_GPU_SEEN): installing $spec from PyPI, CUDA build (several GB: about 3 GB to download, about 5.5 GB installed); TORCH_INDEX_URL chooses another"
      ;;
    none)
      # What pip would take as configured, without installing anything: taken only if it is a CPU build.
      report=$(mktemp)
      # shellcheck disable=SC2086  # TORCH_SPEC may name several requirements
      if "$PY" -m pip install --dry-run --quiet --no-deps --ignore-installed --report "$report" $spec >/dev/null 2>&1 &&
        probe=$(sage_report_is_cpu_build "$report"); then
        sage_say "no GPU found ($SAGE_GPU_SEEN): pip offers a CPU build of $spec ($probe): installing it (about 200 MB to download, about 1 GB installed)"
      elif sage_url_ok "$SAGE_PYTORCH_WHL/cpu/torch/"; then
        SAGE_TORCH_ARGS=(--index-url "$SAGE_PYTORCH_WHL/cpu")
        sage_say "no GPU found ($SAGE_GPU_SEEN): installing $spec, CPU build, from PyTorch's CPU index $SAGE_PYTORCH_WHL/cpu (about 200 MB to download, about 1 GB installed)"
      elif [ -z "${TORCH_SPEC:-}" ] && "$PY" -m pip install --dry-run --quiet --no-deps --ignore-installed \
          --report "$report" "$SAGE_CI_TORCH" >/dev/null 2>&1 && probe=$(sage_report_is_cpu_build "$report"); then
        # No index with a CPU build of the newest torch: the version CI tests with, if pip has it as a CPU build.
        SAGE_TORCH_SPEC="$SAGE_CI_TORCH"
        sage_say "no GPU found ($SAGE_GPU_SEEN) and PyTorch's CPU index $SAGE_PYTORCH_WHL/cpu cannot be reached: pip offers a CPU build of $SAGE_CI_TORCH, the version CI tests with ($probe): installing it (about 200 MB to download, about 1 GB installed)"
      else
        rm -f "$report"
        sage_die "no GPU found and PyTorch's CPU wheel index $SAGE_PYTORCH_WHL/cpu cannot be reached (pip as configured offers only a CUDA build of $spec, several GB): set TORCH_INDEX_URL to a reachable wheel index, TORCH_SPEC to a version pip offers as a CPU build, or PYTHON to a Python that has torch"
      fi
      rm -f "$report"
      ;;
  esac
}

sage_install_torch() {
  if sage_has_torch "$PY"; then return 0; fi
  "$PY" -m pip install -q --upgrade pip >&2 || sage_die "could not upgrade pip in $VENV"
  sage_torch_plan
  # shellcheck disable=SC2086  # TORCH_SPEC may name several requirements
  "$PY" -m pip install ${SAGE_TORCH_ARGS[@]+"${SAGE_TORCH_ARGS[@]}"} $SAGE_TORCH_SPEC >&2 ||
    sage_die "pip could not install $SAGE_TORCH_SPEC: set TORCH_INDEX_URL or TORCH_SPEC, or PYTHON to a Python that has torch"
  "$PY" -W ignore - <<'EOF' >&2
import torch
hip, cuda = getattr(torch.version, "hip", None), torch.version.cuda
build = f"ROCm {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU"
print(f"setup: installed torch {torch.__version__} ({build} build); GPU usable: {torch.cuda.is_available()}")
EOF
  if command -v du >/dev/null 2>&1; then sage_say "$VENV now takes $(du -sh "$VENV" 2>/dev/null | cut -f1)"; fi
}

sage_setup_python() {
  VENV="${VENV:-.venv}"
  local base venv_py
  SAGE_BASE_PY=$(command -v python3 || command -v python || true)
  if [ -n "${PYTHON:-}" ]; then
    base=$PYTHON
    command -v "$base" >/dev/null 2>&1 || sage_die "PYTHON=$PYTHON: no such program"
    SAGE_BASE_PY=$base
    if sage_has_torch "$base"; then
      PY=$base
      sage_say "using PYTHON=$PYTHON (torch $(sage_torch_version "$PY"))"
      return 0
    fi
    sage_say "PYTHON=$PYTHON has no torch: making the virtual environment $VENV from it"
  else
    venv_py=$(sage_venv_python)
    if [ -n "$venv_py" ]; then
      PY=$venv_py
      if sage_has_torch "$PY"; then
        sage_say "using $VENV (torch $(sage_torch_version "$PY"))"
      else
        sage_say "$VENV has no torch yet"
        sage_install_torch
      fi
      return 0
    fi
    [ -n "$SAGE_BASE_PY" ] || sage_die "no python3 found: install Python 3.10 or newer, or set PYTHON"
    base=$SAGE_BASE_PY
    if sage_has_torch "$base"; then
      PY=$base
      sage_say "using $base (torch $(sage_torch_version "$PY")); PYTHON=... picks another Python"
      return 0
    fi
    sage_say "$base has no torch: making the virtual environment $VENV"
  fi
  "$base" -m venv "$VENV" >&2 ||
    sage_die "$base -m venv $VENV failed (on Debian/Ubuntu: apt-get install python3-venv), or set PYTHON to a Python that has torch"
  PY=$(sage_venv_python)
  [ -n "$PY" ] || sage_die "no Python in $VENV after $base -m venv"
  sage_install_torch
}
