"""Stand-alone GPU harness: compile the kernel sources as CUDA (gfx12 WMMA emulation) with CuPy's
nvrtc and launch kernel_abi plans on torch CUDA tensors. Verification only, like the loader's own CUDA
twin (kernels/verify/cuda_twin.py); the product path is the ctypes loader (kernels/backends/hip/runtime.py,
compiler.py) on ROCm."""
from __future__ import annotations

import threading
import warnings
from typing import Iterable

from ..backends.hip import kernel_abi
from .emulation_env import with_env

_MODULES = {}
_LOCK = threading.Lock()


def cupy_missing():
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA mismatch raised at import
        return f"cupy unavailable: {type(exc).__name__}: {exc}"
    return None


def _key(options) -> tuple:
    return tuple(sorted((k, int(v)) for k, v in options.items() if int(v)))


def module(device_index: int = 0, **options):
    """The nvrtc build of the kernels for `device_index`; `options` are kernel_abi.VERIFY_OPTIONS
    (acc_trunc_bits=13: the emulated fp8 WMMA models a 13-bit truncating accumulator), one module each; the
    environment's options (kernels/verify/emulation_env.py) apply where `options` does not say."""
    import cupy as cp
    key = (device_index, _key(with_env(options)))
    with _LOCK:
        if key not in _MODULES:
            with cp.cuda.Device(device_index):
                mod = cp.RawModule(code=kernel_abi.module_source("cuda", **dict(key[1])), backend="nvrtc",
                                   options=("-std=c++17",))
                mod.compile()
            _MODULES[key] = mod
        return _MODULES[key]


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
    mod = module(device_index, **options)
    with warnings.catch_warnings():  # ExternalStream is deprecated in CuPy 14 but still the simple way
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device_index).cuda_stream, device_index)
    with cp.cuda.Device(device_index), stream:
        for ln in launches:
            fn = mod.get_function(ln.kernel)
            fn(ln.grid, ln.block, tuple(conv[t](v) for t, v in ln.args), shared_mem=ln.shared_bytes)
