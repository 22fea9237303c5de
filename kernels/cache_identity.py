"""What an entry cached on the user's machine is keyed by: the GPU and its driver, the pack version and
the kernel sources. Shared by the self-check's pass cache (self_check.PassCache) and auto's measured
choices (decisions.DecisionStore); imports nothing of the registry, so both can use it."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
from typing import Optional

import torch

_PACK_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """SHA-256 over every source under kernels/ that a user's run executes (kernels, prologues, the self-check),
    and the shipped code objects (.co): a pass of one build says nothing of another."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("verify", "__pycache__"))
        for name in sorted(files):
            if name.endswith((".py", ".hip", ".h", ".cu", ".cuh", ".co")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def pack_version() -> str:
    try:
        with open(os.path.join(_PACK_ROOT, "pyproject.toml"), encoding="utf-8") as fh:
            for line in fh:
                if line.strip().startswith("version"):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "unknown"


# The CUDA driver as torch's CUDA runtime loaded it (RTLD_NOLOAD: never a second copy, never a load of our own).
CUDA_DRIVER_NAMES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")


def _mapped_cuda_drivers(maps_file: str = "/proc/self/maps"):
    """Paths of CUDA driver files mapped into this process (Linux; [] elsewhere): found under any name."""
    try:
        with open(maps_file, encoding="utf-8", errors="replace") as fh:
            paths = [line.split(None, 5)[5].strip() for line in fh if len(line.split(None, 5)) == 6]
    except OSError:
        return []
    return list(dict.fromkeys(p for p in paths if os.path.basename(p).startswith("libcuda.so")))


def _loaded_cuda_driver():
    """The CUDA driver library already in this process, or None."""
    mode = getattr(os, "RTLD_NOLOAD", 0)
    for name in list(CUDA_DRIVER_NAMES) + (_mapped_cuda_drivers() if mode else []):
        try:
            return ctypes.CDLL(name, mode=mode) if mode else ctypes.CDLL(name)
        except OSError:
            continue
    return None


def cuda_driver_version(lib=None) -> Optional[str]:
    """'cuda-driver-<N>' from cuDriverGetVersion of `lib` (default: the loaded CUDA driver), or None."""
    lib = lib if lib is not None else _loaded_cuda_driver()
    if lib is None:
        return None
    fn = lib.cuDriverGetVersion
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]
    version = ctypes.c_int(0)
    if fn(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return f"cuda-driver-{version.value}"


def hip_runtime_version() -> Optional[str]:
    """The HIP runtime's version through the HIP backend's loader (a module of every ROCm user's run)."""
    from .backends.hip.runtime import get_runtime
    return get_runtime("hip").version()


def driver_version() -> Optional[str]:
    """The GPU driver's version for cache keys, or None when it cannot be told (then nothing is cached).

    ROCm: the HIP runtime's version. NVIDIA: the CUDA driver's, read straight from the library torch loaded,
    so a cache key there needs no HIP code and no verification code."""
    try:
        version = hip_runtime_version() if getattr(torch.version, "hip", None) else cuda_driver_version()
    except Exception:
        return None
    return version or None


def gpu_identity(device: torch.device) -> Optional[dict]:
    """GPU name/arch and the driver/runtime versions, or None when any of them cannot be told."""
    try:
        props = torch.cuda.get_device_properties(device)  # initializes CUDA/HIP (loads the driver) first
        rocm = bool(getattr(torch.version, "hip", None))
        arch = str(getattr(props, "gcnArchName", "")) if rocm else f"sm_{props.major}{props.minor}"
    except Exception:
        return None
    driver = driver_version()
    if not driver:
        return None
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {"gpu": props.name, "arch": arch, "driver": driver, "torch": torch.__version__,
            "hip": getattr(torch.version, "hip", None), "cuda": getattr(torch.version, "cuda", None),
            "triton": triton_version}
