"""What an entry cached on the user's machine is keyed by: the GPU and its driver, the pack version and
the kernel sources. Shared by the self-check's pass cache (self_check.PassCache) and auto's measured
choices (autotune.DecisionStore); imports nothing of the registry, so both can use it."""
from __future__ import annotations

import functools
import hashlib
import os
from typing import Optional

import torch

_PACK_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """SHA-256 over every source under kernels/ that a user's run executes (kernels, prologues, the self-check)."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("verify", "__pycache__"))
        for name in sorted(files):
            if name.endswith((".py", ".hip", ".h", ".cu", ".cuh")):
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


def gpu_identity(device: torch.device) -> Optional[dict]:
    """GPU name/arch and the driver/runtime versions, or None when any of them cannot be told."""
    try:
        props = torch.cuda.get_device_properties(device)
        rocm = bool(getattr(torch.version, "hip", None))
        arch = str(getattr(props, "gcnArchName", "")) if rocm else f"sm_{props.major}{props.minor}"
        from .backends.hip.runtime import get_runtime
        driver = get_runtime().version()
    except Exception:
        return None
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {"gpu": props.name, "arch": arch, "driver": driver, "torch": torch.__version__,
            "hip": getattr(torch.version, "hip", None), "cuda": getattr(torch.version, "cuda", None),
            "triton": triton_version}
