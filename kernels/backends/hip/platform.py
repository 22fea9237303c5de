"""What compiler.py and runtime.py both need to know about this machine: where the GPU libraries that
PyTorch loaded (or ships beside itself) are, and the ISA name of an AMD GPU."""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import List, Sequence

import torch


def parse_gcn_arch(name: str) -> str:
    """'gfx1201:sramecc+:xnack-' -> 'gfx1201' (target features are not part of the ISA name)."""
    base = str(name).strip().split(":")[0].strip()
    return base or "gfx_unknown"


def loaded_library_paths(fragment: str) -> List[str]:
    """Paths of shared objects already mapped into this process whose file name contains `fragment` (Linux)."""
    try:
        with open("/proc/self/maps", "r", encoding="utf-8", errors="replace") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if fragment in os.path.basename(p) and os.path.isfile(p))


def windows_loaded_module(names: Sequence[str]) -> List[str]:
    """Full paths of the DLLs among `names` that this process has loaded (Windows)."""
    if sys.platform != "win32":
        return []
    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    k32.GetModuleHandleW.restype, k32.GetModuleHandleW.argtypes = ctypes.c_void_p, [ctypes.c_wchar_p]
    k32.GetModuleFileNameW.restype = ctypes.c_uint32
    k32.GetModuleFileNameW.argtypes = [ctypes.c_void_p, ctypes.c_wchar_p, ctypes.c_uint32]
    found = []
    for name in names:
        handle = k32.GetModuleHandleW(name)
        if handle:
            buf = ctypes.create_unicode_buffer(32768)
            if k32.GetModuleFileNameW(handle, buf, 32768):
                found.append(buf.value)
    return found


def torch_lib_dir() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib")


def rocm_wheel_dirs() -> List[str]:
    """Library folders of the ROCm SDK wheels (`rocm-sdk-core`) that ROCm 7 PyTorch wheels depend on."""
    sub = "bin" if sys.platform == "win32" else "lib"
    return [d for p in dict.fromkeys(sys.path) if p and os.path.isdir(p)
            for d in glob.glob(os.path.join(p, "_rocm_sdk_core", sub))]
