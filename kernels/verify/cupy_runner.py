"""Stand-alone GPU harness: compile the kernel sources as CUDA (gfx12 WMMA emulation) with nvrtc and launch
kernel_abi plans on torch CUDA tensors through CuPy. Verification only, like the loader's own CUDA
twin (kernels/verify/cuda_twin.py); the product path is the ctypes loader (kernels/backends/hip/runtime.py,
compiler.py) on ROCm."""
from __future__ import annotations

import re
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Iterable, List, NamedTuple, Sequence

from ..backends.hip import kernel_abi
from .emulation_env import with_env

_MODULES = {}  # build key -> the loaded CuPy module
_CODE = {}     # build key -> Future of its code (compiled once, by whichever thread asked first)
_LOCK = threading.Lock()


class Compiled(NamedTuple):
    """One build this process compiled: for a test run's summary (which builds a prewarm missed, and their cost)."""
    part: str
    options: tuple
    seconds: float
    prewarmed: bool


COMPILED: List[Compiled] = []
ASKED: set = set()  # (part, options) of the builds `module` was asked for: a prewarmed build never asked for is waste


def harness_missing():
    """Why the harness cannot run here (CuPy to launch, nvrtc to compile), or None."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA mismatch raised at import
        return f"cupy unavailable: {type(exc).__name__}: {exc}"
    from ..backends.hip.compiler import CompilerUnavailable
    try:
        harness_compiler()
    except CompilerUnavailable as exc:
        return f"nvrtc unavailable: {exc}"
    return None


def _key(options) -> tuple:
    return tuple(sorted((k, int(v)) for k, v in options.items() if int(v)))


# Each test compiles only the part of the sources its launches need: nvrtc compiles every extern kernel of a
# module, and the 28 attention kernels are most of a whole module's compile, paid again for each option set.
PARTS = ("probes", "prologue", "attention")
_INSTANTIATION = re.compile(r"^SG_(ATTN|ATTN_KMASK|QK_SCORES)\(.*$", re.MULTILINE)


def _probe_kernels() -> frozenset:
    text = (kernel_abi.SRC_DIR / "sage_probes.hip").read_text()
    return frozenset(re.findall(r'extern "C" __global__.*?\bvoid\s+(\w+)\s*\(', text))


PROBE_KERNELS = _probe_kernels()


def part_of(kernel: str) -> str:
    """Which part of the sources defines `kernel`."""
    if kernel in PROBE_KERNELS:
        return "probes"
    return "attention" if kernel.startswith(("sage_attn_", "sage_qk_scores_")) else "prologue"


def part_source(part: str, **options) -> str:
    """The CUDA translation unit of one part: the prelude and its file; the probes also need the attention
    file's device functions, without its kernel instantiations."""
    read = lambda name: (kernel_abi.SRC_DIR / name).read_text()  # noqa: E731
    if part == "all":
        return kernel_abi.module_source("cuda", **options)
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r} (parts {PARTS})")
    files = {"probes": [_INSTANTIATION.sub("", read("sage_attention.hip")),
                        read("sage_probes.hip")],
             "prologue": [read("sage_prologue.hip")], "attention": [read("sage_attention.hip")]}[part]
    return kernel_abi.option_defines(**options) + "\n".join([read("gfx12_prelude.h")] + files)


def module(device_index: int = 0, part: str = "all", **options):
    """The build of the kernels (`part`: one of PARTS, or "all") for `device_index`; `options` are
    kernel_abi.VERIFY_OPTIONS (acc_trunc_bits=13: the emulated fp8 WMMA models a 13-bit truncating accumulator),
    one module each; the environment's options (kernels/verify/emulation_env.py) apply where `options` does not
    say."""
    import cupy as cp
    key = (device_index, part, _key(with_env(options)))
    ASKED.add(key[1:])
    code = _code(key).result()  # compiled here, or waited for where a prewarm thread is compiling it
    with _LOCK:
        if key not in _MODULES:
            path = _build_dir() / f"{part}-{len(_MODULES)}.bin"
            path.write_bytes(code)
            with cp.cuda.Device(device_index):
                _MODULES[key] = cp.RawModule(path=str(path))
        return _MODULES[key]


def _code(key, prewarm: bool = False) -> Future:
    """The Future of a build's code; the first thread to ask compiles it (outside the lock: nvrtc runs through
    ctypes, which lets other threads run), later askers wait on the same Future. A failed compile fails it for every
    asker, as it would have failed each one."""
    with _LOCK:
        found = _CODE.get(key)
        if found is not None:
            return found
        future = _CODE[key] = Future()
    device_index, part, options = key
    start = time.perf_counter()
    try:
        compiler = harness_compiler()
        future.set_result(compile_part(compiler, part, compiler.target_for_device(device_index), **dict(options)))
    except BaseException as exc:  # handed to every asker, the one that compiled included
        future.set_exception(exc)
    COMPILED.append(Compiled(part, options, time.perf_counter() - start, prewarm))
    return future


def prewarm(builds: Sequence[tuple], device_index: int = 0, workers: int = 4) -> List[threading.Thread]:
    """Compile `builds` ((part, options dict) pairs, as `module` takes them) in `workers` background threads, so
    a GPU test run's tests find them compiled: each build is tens of seconds of nvrtc, paid one after another
    otherwise. Daemon threads: a run that ends first does not wait for them. Returns the threads."""
    pending = [(device_index, part, _key(with_env(dict(options)))) for part, options in builds]
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                if not pending:
                    return
                key = pending.pop(0)
            _code(key, prewarm=True)

    threads = [threading.Thread(target=work, name=f"sage-emulated-prewarm-{i}", daemon=True)
               for i in range(max(1, min(workers, len(pending))))]
    for thread in threads:
        thread.start()
    return threads


# nvrtc's own default, stated: FP32 subnormals are kept, as on gfx12 (HIP flushes none unless asked). CuPy's compile
# path appends -ftz=true to every build, which turned a dead key's K scale (FP32 tiny / 127) into 0.
HARNESS_FLAGS = ("-ftz=false",)


def harness_compiler():
    """The loader's nvrtc binding (cuda_twin.py), taking a part's options from its text rather than the environment
    (module() has folded the environment's in already)."""
    from .cuda_twin import NvrtcCompiler

    class HarnessNvrtc(NvrtcCompiler):
        def options(self, target, extra_flags):
            return harness_options(target, extra_flags)
    return HarnessNvrtc()


def harness_options(target: str, extra_flags=HARNESS_FLAGS):
    return [f"--gpu-architecture={target}", "-std=c++17", *extra_flags]


def compile_part(compiler, part: str, target: str, **options) -> bytes:
    """The part's code (cubin for sm_XX, PTX for compute_XX) with HARNESS_FLAGS."""
    from ..backends.hip.compiler import SourceBundle
    return compiler.compile(SourceBundle(f"sage_{part}.cu", part_source(part, **options)), target, HARNESS_FLAGS)


_BUILD_DIR = []


def _build_dir() -> Path:
    """A folder for this process's builds, removed at exit."""
    if not _BUILD_DIR:
        _BUILD_DIR.append(tempfile.TemporaryDirectory(prefix="sage-cupy-harness-"))
    return Path(_BUILD_DIR[0].name)


def runner(device_index: int = 0, **options):
    """A `run` function for the build with these options (see `module`)."""
    kernel_abi.option_defines(**options)  # unknown or out-of-range options fail here

    def run_with(launches: Iterable[kernel_abi.Launch]) -> None:
        run(launches, device_index, **options)
    return run_with


def run(launches: Iterable[kernel_abi.Launch], device_index: int = 0, **options) -> None:
    """Launch in order on torch's current stream of `device_index`."""
    import cupy as cp
    import numpy as np
    import torch

    conv = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "f32": np.float32}
    with warnings.catch_warnings():  # ExternalStream is deprecated in CuPy 14 but still the simple way
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device_index).cuda_stream, device_index)
    with cp.cuda.Device(device_index), stream:
        for ln in launches:
            fn = module(device_index, part_of(ln.kernel), **options).get_function(ln.kernel)
            fn(ln.grid, ln.block, tuple(conv[t](v) for t, v in ln.args), shared_mem=ln.shared_bytes)
