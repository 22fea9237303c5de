"""Load the repository as a package the way ComfyUI does (by folder path, under its own name).

The repo root is never put on sys.path: `kernels` is also a PyPI package name. tests/ is (pyproject.toml's
pythonpath): the stand-ins the tests share live in tests/fakes.py, the ComfyUI helpers in tests/comfy_harness.py
and tests/comfy_browser.py.
"""
import contextlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import triton_prewarm

try:
    import torch
except ImportError:  # stop in pytest_configure with one line, not an INTERNALERROR at collection
    torch = None

ROOT = Path(__file__).resolve().parents[1]
PACK = "comfyui_sage_rdna4"
# Tests never read or write the user's cache of self-check passes (a planted fault must be checked, not
# answered by an earlier pass); the cache's own tests hand it a temporary folder.
os.environ.setdefault("SAGE_RDNA4_SELF_CHECK_CACHE", "0")
# Nor the user's file of auto's measured choices (kernels/autotune.py): a GPU test measures afresh, in memory.
os.environ.setdefault("SAGE_RDNA4_AUTOTUNE_CACHE", "0")


def load_pack():
    if PACK in sys.modules:
        return sys.modules[PACK]
    spec = importlib.util.spec_from_file_location(PACK, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK] = module
    spec.loader.exec_module(module)
    return module


load_pack()

# Per-test limits (pytest-timeout, requirements-test.txt): pyproject.toml's `timeout` for every test; a test marked
# slow gets SLOW_TEST_TIMEOUT_S unless it sets its own with @pytest.mark.timeout(...). A test past its limit fails
# and the run goes on (the signal method), so no hung or runaway test holds a GPU run or CI.
SLOW_TEST_TIMEOUT_S = 1800


def pytest_addoption(parser, pluginmanager):
    if not pluginmanager.hasplugin("timeout"):  # pyproject's key would be an unknown option: say it once instead
        parser.addini("timeout", "per-test limit in seconds (ignored: pytest-timeout is not installed)")


def pytest_report_header(config):
    if not config.pluginmanager.hasplugin("timeout"):
        return ("pytest-timeout is not installed: tests run without a time limit "
                "(python -m pip install -r requirements-test.txt)")
    return None


def pytest_configure(config):
    if torch is None:
        pytest.exit(f"torch is not installed for {sys.executable}. Run `bash scripts/setup_and_test.sh` (sets up "
                    "torch and what the tests need in .venv, then runs them), or use a Python that has torch "
                    "(.venv/bin/python -m pytest tests).", returncode=pytest.ExitCode.USAGE_ERROR)
    config.addinivalue_line("markers", "gpu: needs a CUDA/ROCm GPU; skipped without one")
    config.addinivalue_line("markers", "comfyui: needs a ComfyUI checkout in COMFYUI_PATH; skipped without one")
    config.addinivalue_line("markers", "browser: needs Chromium (chromium, chromium-browser or google-chrome on PATH); "
                                       "skipped without it")
    config.addinivalue_line("markers", "hipcc: needs clang-19 with the AMDGPU target; skipped without it")
    config.addinivalue_line("markers", "slow: long-running; left out of the default run (pyproject.toml's addopts: "
                                       "-m \"not slow\"), run by .ci/run (-m \"\") and by -m slow; limit "
                                       f"{SLOW_TEST_TIMEOUT_S} s unless the test sets its own")
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): per-test limit (pytest-timeout is not installed)")


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="no GPU: torch.cuda.is_available() is False")
    no_comfy = pytest.mark.skip(reason="COMFYUI_PATH is not set to a ComfyUI checkout")
    has_comfy = bool(os.environ.get("COMFYUI_PATH")) and (Path(os.environ.get("COMFYUI_PATH", "")) / "comfy").is_dir()
    no_browser = pytest.mark.skip(reason="no Chromium/Chrome on PATH")
    has_browser = any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome"))
    slow_limit = pytest.mark.timeout(SLOW_TEST_TIMEOUT_S)
    for item in items:
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(slow_limit)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "comfyui" in item.keywords and not has_comfy:
            item.add_marker(no_comfy)
        if "browser" in item.keywords and not has_browser:
            item.add_marker(no_browser)


# A GPU test stuck in C (a kernel that never returns, a compile) is past pytest-timeout's reach: its signal is only
# handled once Python runs again, and on 2026-12-05 one such test held an H100 run for 250 s past its limit. So a GPU
# test still running this long after its limit ends the run, with every thread's traceback on stderr (where it
# hung); the results printed so far stay (run with -v and tee).
GPU_HANG_GRACE_S = 60


def per_test_limit_s(node, config) -> float:
    """The per-test limit pytest-timeout applies to `node` (its timeout marker, else the ini value); 0: none."""
    marker = node.get_closest_marker("timeout")
    try:
        limit = marker.args[0] if marker is not None and marker.args else config.getini("timeout")
        return max(float(limit), 0.0)
    except (TypeError, ValueError):  # no pytest-timeout (an unknown ini key), or no number
        return 0.0


@contextlib.contextmanager
def hang_guard(seconds: float):
    """Past `seconds`, dump every thread's traceback to stderr and end the process (faulthandler's watchdog
    thread: it fires while the main thread is stuck in C)."""
    import faulthandler
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _gpu_hang_guard(request):
    limit = per_test_limit_s(request.node, request.config) if "gpu" in request.node.keywords else 0.0
    if limit <= 0 or torch is None or not torch.cuda.is_available():
        yield
        return
    with hang_guard(limit + GPU_HANG_GRACE_S):
        yield


@pytest.fixture(scope="module", autouse=True)
def _torch_sdpa_precision_per_module():
    """Keeps a process-wide torch flag that importing ComfyUI flips inside the module that imported it.

    comfy.model_management calls torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True) when imported,
    which makes exact SDPA in fp16/bf16 reduce in that precision (on the CPU too). Test modules that import
    ComfyUI in-process run under ComfyUI's setting; the modules after them get torch's default back, so an
    exact-attention accuracy check later in the run (tests/test_fuzz.py) does not depend on the order."""
    import torch

    cuda = torch.backends.cuda
    if not hasattr(cuda, "fp16_bf16_reduction_math_sdp_allowed"):
        yield
        return
    before = cuda.fp16_bf16_reduction_math_sdp_allowed()
    yield
    cuda.allow_fp16_bf16_reduction_math_sdp(before)


_SUMMARY = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def summary_lines(request):
    """Lines a test wants shown in the run's final summary even when its output is captured (fuzz counts)."""
    return request.config.stash.setdefault(_SUMMARY, [])


def pytest_sessionfinish(session, exitstatus):
    triton_prewarm.stop_all()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_SUMMARY, []) + triton_prewarm.summary_lines() + emulated_build_lines()
    if lines:
        terminalreporter.section("sage_rdna4 counts")
        for line in lines:
            terminalreporter.write_line(line)


# The emulated builds (kernels/verify/cupy_runner.py: part, verification options) the GPU tests ask for, seconds of
# nvrtc each. A GPU run compiles them in background threads from its start rather than one after another as tests
# ask (nvrtc runs through ctypes, so threads overlap), heaviest first. A build missing here is still compiled when
# asked for; the run's summary lists those (docs/MEASUREMENTS.md, "Test time limits").
_ALL_PARTS = ("attention", "prologue", "probes")
EMULATED_BUILDS = tuple(
    [(part, options) for options in ({}, {"acc_trunc_bits": 13, "f16_acc_trunc_bits": 13}, {"fp8_nonsat": 1},
                                     {"emu_flush_subnormal": 1}) for part in _ALL_PARTS]
    + [(part, {"acc_trunc_bits": 13, "pv_single_chain": 1}) for part in ("attention", "prologue")]
    + [("probes", {"wmma_k_fault": 1}), ("probes", {"wmma_k_fault": 2}),
       ("probes", {"acc_trunc_bits": 16, "f16_acc_trunc_bits": 16}),
       ("probes", {"acc_trunc_bits": 24, "f16_acc_trunc_bits": 24})])
EMULATED_BUILDS = tuple(sorted(EMULATED_BUILDS, key=lambda b: _ALL_PARTS.index(b[0])))  # attention: the heaviest


def _gpu_modules_mentioning(items, words) -> bool:
    """Whether a selected GPU test's module mentions one of `words` (how a run tells it will need the emulation)."""
    files = {str(item.fspath) for item in items if "gpu" in item.keywords}
    return any(any(word in Path(f).read_text(errors="replace") for word in words) for f in sorted(files))


def pytest_collection_finish(session):
    """A GPU run starts its background compiles at once: the Triton GPU fuzz's kernels in a few processes, those
    tests moved to the run's end (tests/triton_prewarm.py); and on an NVIDIA GPU, if tests use the HIP emulation,
    its builds (see EMULATED_BUILDS); a run of other GPU tests compiles none (the threads would only slow its
    Triton compiles). SAGE_TEST_PREWARM=0: neither."""
    if not triton_prewarm.enabled() or session.config.option.collectonly:
        return
    if torch is None or not torch.cuda.is_available():
        return
    fuzz_kernels = triton_prewarm.fuzz_kernels(item.nodeid for item in session.items)
    if fuzz_kernels and not os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist every worker would start them
        session.items[:] = triton_prewarm.fuzz_last(session.items)
        triton_prewarm.start(fuzz_kernels, triton_prewarm.processes_per_kernel())
    if getattr(torch.version, "hip", None):
        return
    builds = _gpu_modules_mentioning(session.items, ("cupy_runner", "emulated_run"))
    backends = _gpu_modules_mentioning(session.items, ("HIP_EMULATE", "hip_int8"))
    if not (builds or backends):
        return
    load_pack()
    from comfyui_sage_rdna4.kernels.verify import cuda_twin, cupy_runner

    if backends:
        cuda_twin.prewarm_loader_build(torch.cuda.current_device())  # the HIP backends' module, as the loader builds it
    if builds and cupy_runner.harness_missing() is None:
        # A quarter of the cores: more threads slow the Triton compiles of the tests running beside them
        # (docs/MEASUREMENTS.md, "Test time limits").
        cupy_runner.prewarm(EMULATED_BUILDS, torch.cuda.current_device(), workers=max(1, (os.cpu_count() or 4) // 4))


def emulated_build_lines() -> list:
    """What the emulated builds cost this run: compiled in the background ahead of the tests, or when asked."""
    cupy_runner = sys.modules.get(f"{PACK}.kernels.verify.cupy_runner")
    if cupy_runner is None or not cupy_runner.COMPILED:
        return []
    done = list(cupy_runner.COMPILED)
    ahead = [c for c in done if c.prewarmed]
    lines = [f"[emulated builds] {len(done)} compiled, {sum(c.seconds for c in done):.1f} s of nvrtc; "
             f"{len(ahead)} in the background ahead of the tests ({sum(c.seconds for c in ahead):.1f} s)"]
    lines += [f"[emulated builds] compiled when asked (not in EMULATED_BUILDS): {c.part} {dict(c.options)} "
              f"{c.seconds:.1f} s" for c in done if not c.prewarmed]
    if cupy_runner.ASKED:  # a run that asked for none (a -k selection) says nothing of the list's use
        lines += [f"[emulated builds] compiled ahead, never asked for in this run: {c.part} {dict(c.options)} "
                  f"{c.seconds:.1f} s" for c in ahead if (c.part, c.options) not in cupy_runner.ASKED]
    return lines


@pytest.fixture(scope="session")
def hip_emulated_run():
    """Launch kernel_abi plans through the CUDA build of the HIP sources (gfx12 WMMA emulated), synchronously.

    Skips on ROCm (the emulation is for NVIDIA) and without CuPy or nvrtc; compiles each part of the sources
    as its launches need it (kernels/verify/cupy_runner.py)."""
    import torch

    from comfyui_sage_rdna4.kernels.verify import cupy_runner

    if getattr(torch.version, "hip", None):
        pytest.skip("the CUDA emulation harness runs on NVIDIA GPUs")
    reason = cupy_runner.harness_missing()
    if reason:
        pytest.skip(reason)
    cupy_runner.module(torch.cuda.current_device(), part="probes")  # nvrtc works; parts compile as used

    def run(launches):
        cupy_runner.run(launches)
        torch.cuda.synchronize()
    return run


@pytest.fixture(scope="session")
def emulated_runner(hip_emulated_run):
    """make(**options) -> a synchronous run function for the emulated build with kernel_abi.VERIFY_OPTIONS."""
    import torch

    from comfyui_sage_rdna4.kernels.verify import cupy_runner

    def make(**options):
        launch = cupy_runner.runner(torch.cuda.current_device(), **options)

        def run_(launches):
            launch(launches)
            torch.cuda.synchronize()
        return run_
    return make
