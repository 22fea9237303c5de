"""Run the kernel sources on the CPU: compiled as plain C++ (SAGE_HOST_SIM), one OS thread per GPU thread.

For tests only (slow: a 256-thread block is 256 threads meeting at barriers). It executes the same
source text, with the gfx12 WMMA emulation of gfx12_prelude.h, so layouts, LDS staging, masking and
rounding are checked without a GPU. Launches come from kernel_abi plans; tensors live on the CPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Optional

from ..backends.hip import kernel_abi
from .emulation_env import with_env

SIM_RUNTIME = Path(__file__).resolve().parent / "sim_runtime.h"
_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}
_LIBS = {}
_LOCK = threading.Lock()


def host_compiler() -> Optional[str]:
    for name in ("clang++-19", "clang++", "g++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def module_source(**options) -> str:
    """The kernels as host C++ (SAGE_HOST_SIM): the simulator's runtime header, then the kernel sources.
    `options`: kernel_abi.VERIFY_OPTIONS (e.g. acc_trunc_bits=13), as #defines in front."""
    return "\n".join(["#define SAGE_HOST_SIM 1\n", kernel_abi.option_defines(**options), SIM_RUNTIME.read_text(),
                      kernel_abi.module_source("hip")])


def _build(options) -> ctypes.CDLL:
    cxx = host_compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler (clang++-19, clang++ or g++) for the kernel simulator")
    src = module_source(**options)
    key = hashlib.sha256((cxx + src).encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / f"sage_rdna4_sim_{os.getuid()}"
    cache.mkdir(exist_ok=True)
    lib = cache / f"kernels_{key}.so"
    if not lib.exists():
        cpp = cache / f"kernels_{key}.cpp"
        cpp.write_text(src)
        tmp = cache / f"kernels_{key}.{os.getpid()}.so"
        cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", str(tmp), str(cpp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"simulator build failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


def _key(options) -> tuple:
    return tuple(sorted((k, int(v)) for k, v in options.items() if int(v)))


def library(**options) -> ctypes.CDLL:
    """The simulator build of the kernels with these verification options (one shared library each), over the
    environment's (kernels/verify/emulation_env.py)."""
    key = _key(with_env(options))
    with _LOCK:
        if key not in _LIBS:
            _LIBS[key] = _build(dict(key))
        return _LIBS[key]


def runner(**options):
    """A `run` function (as `run` below) executing the build with these options, e.g. runner(acc_trunc_bits=13)."""
    options = {k: int(v) for k, v in options.items()}  # an explicit 0 stays: it wins over the environment's option
    kernel_abi.option_defines(**options)  # unknown or out-of-range options fail here, not at the first launch

    def run_with(launches: Iterable[kernel_abi.Launch]) -> None:
        run(launches, **options)
    return run_with


def run(launches: Iterable[kernel_abi.Launch], **options) -> None:
    """Execute launches in order, one block at a time (`options`: kernel_abi.VERIFY_OPTIONS)."""
    lib = library(**options)
    for ln in launches:
        fn = getattr(lib, ln.kernel)
        fn.restype = None
        fn.argtypes = [_CTYPES[t] for t, _ in ln.args]
        args = [_CTYPES[t](v) for t, v in ln.args]
        threads = ln.block[0] * ln.block[1] * ln.block[2]

        def body(tid, fn=fn, args=args):
            lib.sim_set_thread(tid)
            fn(*args)

        for bz in range(ln.grid[2]):
            for by in range(ln.grid[1]):
                for bx in range(ln.grid[0]):
                    lib.sim_begin_block(bx, by, bz, threads)
                    ts = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
