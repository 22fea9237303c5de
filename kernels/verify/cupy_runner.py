"""Stand-alone GPU harness: compile the kernel sources as CUDA (gfx12 WMMA emulation) with CuPy's
nvrtc and launch kernel_abi plans on torch CUDA tensors. Verification only; the product path is the
ctypes loader (kernels/backends/hip/runtime.py, compiler.py)."""
from __future__ import annotations

import threading
import warnings
from typing import Iterable

from ..backends.hip import kernel_abi

_MODULES = {}
_LOCK = threading.Lock()


def cupy_missing():
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA mismatch raised at import
        return f"cupy unavailable: {type(exc).__name__}: {exc}"
    return None


def module(device_index: int = 0):
    import cupy as cp
    with _LOCK:
        if device_index not in _MODULES:
            with cp.cuda.Device(device_index):
                mod = cp.RawModule(code=kernel_abi.module_source("cuda"), backend="nvrtc",
                                   options=("-std=c++17",))
                mod.compile()
            _MODULES[device_index] = mod
        return _MODULES[device_index]


def run(launches: Iterable[kernel_abi.Launch], device_index: int = 0) -> None:
    """Launch in order on torch's current stream of `device_index`."""
    import cupy as cp
    import numpy as np
    import torch

    conv = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "f32": np.float32}
    mod = module(device_index)
    with warnings.catch_warnings():  # ExternalStream is deprecated in CuPy 14 but still the simple way
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device_index).cuda_stream, device_index)
    with cp.cuda.Device(device_index), stream:
        for ln in launches:
            fn = mod.get_function(ln.kernel)
            fn(ln.grid, ln.block, tuple(conv[t](v) for t, v in ln.args), shared_mem=ln.shared_bytes)
