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


def mapped_paths(maps_file: str = "/proc/self/maps") -> List[str]:
    """Files mapped into this process, in /proc/self/maps order, each once (Linux; [] elsewhere)."""
    try:
        with open(maps_file, "r", encoding="utf-8", errors="replace") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].endswith(" (deleted)"):
            found.append(parts[5].strip())
    return list(dict.fromkeys(found))


def loaded_library_paths(fragment: str) -> List[str]:
    """Paths of shared objects already mapped into this process whose file name contains `fragment` (Linux),
    in mapping order (rank them with `prefer_torch_libraries` before choosing one)."""
    return [p for p in mapped_paths() if fragment in os.path.basename(p) and os.path.isfile(p)]


def _real(path: str) -> str:
    try:
        return os.path.normcase(os.path.realpath(path))
    except (OSError, ValueError):
        return os.path.normcase(os.path.abspath(path))


def _in_folder(path: str, folder: str) -> bool:
    """`path` is a file of `folder` (or below it), or a file there is a link to it (a torch/lib entry that
    points into /opt/rocm maps under the /opt/rocm name)."""
    if not folder or not os.path.isdir(folder):
        return False
    real, real_folder = _real(path), _real(folder)
    if real.startswith(real_folder.rstrip(os.sep) + os.sep):
        return True
    stem = os.path.basename(path).split(".so")[0].split(".dll")[0]
    return any(_real(p) == real for p in glob.glob(os.path.join(folder, stem + "*")))


def prefer_torch_libraries(paths: Sequence[str]) -> List[str]:
    """The same library found several times (two libamdhip64 mapped: torch's and one another extension or
    /opt/rocm brought), ordered as torch resolves its own dependency: a copy in torch's lib folder first
    (wheels that bundle ROCm), then one from the ROCm SDK wheels (`_rocm_sdk_core`, what ROCm 7 wheels
    link against through their RPATH), then the rest in the order given. Repeats are dropped."""
    torch_dir, wheel_dirs = torch_lib_dir(), rocm_wheel_dirs()

    def rank(path: str) -> int:
        if _in_folder(path, torch_dir):
            return 0
        if any(_in_folder(path, d) for d in wheel_dirs):
            return 1
        return 2

    return sorted(dict.fromkeys(paths), key=rank)  # sorted() is stable: ties keep their order


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
