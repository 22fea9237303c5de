"""The CUDA twin of the HIP runtime and compiler: runs the gfx12 kernels on an NVIDIA GPU, compiled as CUDA
with the prelude's WMMA emulation (kernels/backends/hip/src/gfx12_prelude.h), to verify them. Never a speed
path and never part of a user's run.

Importing this module registers the 'cuda' platform with kernels/backends/hip/runtime.py (`CudaRuntime`, the
CUDA driver API in libcuda / nvcuda.dll) and the 'nvrtc' compiler with compiler.py (`NvrtcCompiler`). The HIP
runtime imports it itself only under CUDA PyTorch with SAGE_RDNA4_HIP_EMULATE=1 (the HIP backends then run
emulated); tests and the verification tooling import it directly to use the loader on NVIDIA.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
import threading
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from ..backends.hip import kernel_abi
from ..backends.hip.compiler import CompilerUnavailable, RtcCompiler, register_compiler, without_builtins
from ..backends.hip.platform import loaded_library_paths, torch_lib_dir
from ..backends.hip.runtime import (
    GpuRuntime,
    LaunchError,
    Module,
    Platform,
    bind,
    launch_dims,
    open_first,
    register_platform,
)
from .emulation_env import env_options

# CUDA refuses more than 48 KiB of dynamic shared memory unless the function opts in.
CUDA_DEFAULT_SMEM = 48 * 1024
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# The CUDA build exists to verify the gfx12 kernels through the WMMA emulation, not for speed. The fully
# unrolled emulation makes ptxas -O3 take ~500 s for the whole module (measured on a 2-core CPU) against
# ~5 s at -O1; ptxas levels do not change float semantics (contraction is fixed in the PTX).
EMULATION_PTXAS_FLAGS = ("-Xptxas=-O1",)


# -- the driver -----------------------------------------------------------------------------------

def cuda_driver_candidates() -> List[str]:
    if sys.platform == "win32":
        return ["nvcuda.dll"]
    return loaded_library_paths("libcuda.so") + ["libcuda.so.1", "libcuda.so"]


class CudaRuntime(GpuRuntime):
    """CUDA driver API. Modules live in the device's primary context, the one PyTorch's runtime uses."""

    kind = "cuda"
    dynamic_shared_limit = CUDA_DEFAULT_SMEM

    def __init__(self, candidates: Optional[Sequence[str]] = None):
        lib, self.library = open_first(candidates or cuda_driver_candidates(), "the CUDA driver (libcuda / nvcuda.dll)")
        what = self.library
        vp, u32, i32 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        self._error_string = bind(lib, "cuGetErrorString", i32, [i32, ctypes.POINTER(ctypes.c_char_p)], what)
        self._driver_version = bind(lib, "cuDriverGetVersion", i32, [ctypes.POINTER(i32)], what)
        self._init = bind(lib, "cuInit", i32, [u32], what)
        self._device_get = bind(lib, "cuDeviceGet", i32, [ctypes.POINTER(i32), i32], what)
        self._retain = bind(lib, "cuDevicePrimaryCtxRetain", i32, [ctypes.POINTER(vp), i32], what)
        self._ctx_get = bind(lib, "cuCtxGetCurrent", i32, [ctypes.POINTER(vp)], what)
        self._ctx_push = bind(lib, "cuCtxPushCurrent_v2", i32, [vp], what)
        self._ctx_pop = bind(lib, "cuCtxPopCurrent_v2", i32, [ctypes.POINTER(vp)], what)
        self._load = bind(lib, "cuModuleLoadData", i32, [ctypes.POINTER(vp), vp], what)
        self._get_function = bind(lib, "cuModuleGetFunction", i32, [ctypes.POINTER(vp), vp, ctypes.c_char_p], what)
        self._set_attribute = bind(lib, "cuFuncSetAttribute", i32, [vp, i32, i32], what)
        self._launch = bind(lib, "cuLaunchKernel", i32,
                            [vp, u32, u32, u32, u32, u32, u32, u32, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)], what)
        self._contexts: Dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self.check(self._init(0), "cuInit")

    def check(self, status: int, call: str) -> None:
        if status != 0:
            text = ctypes.c_char_p()
            self._error_string(status, ctypes.byref(text))
            message = text.value.decode(errors="replace") if text.value else "error"
            raise LaunchError(f"{call} failed: {message} ({status})")

    def version(self) -> str:
        v = ctypes.c_int(0)
        self.check(self._driver_version(ctypes.byref(v)), "cuDriverGetVersion")
        return f"cuda-driver-{v.value}"

    def primary_context(self, device_index: int) -> ctypes.c_void_p:
        with self._lock:
            if device_index not in self._contexts:
                dev, ctx = ctypes.c_int(), ctypes.c_void_p()
                self.check(self._device_get(ctypes.byref(dev), device_index), "cuDeviceGet")
                self.check(self._retain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
                self._contexts[device_index] = ctx
            return self._contexts[device_index]

    @contextlib.contextmanager
    def device_scope(self, device_index: int) -> Iterator[None]:
        """The device's primary context current for the body; the caller's context again after."""
        ctx = self.primary_context(int(device_index))
        current = ctypes.c_void_p()
        self.check(self._ctx_get(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value == ctx.value:
            yield
            return
        self.check(self._ctx_push(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._ctx_pop(ctypes.byref(ctypes.c_void_p()))

    def load_module(self, image: bytes, device_index: int) -> Module:
        handle = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(bytes(image), len(image))  # PTX must end in NUL; the buffer adds one
        with self.device_scope(device_index):
            self.check(self._load(ctypes.byref(handle), ctypes.cast(buf, ctypes.c_void_p)), "cuModuleLoadData")
        return Module(handle, device_index, buf)

    def get_function(self, module: Module, name: str):
        fn = ctypes.c_void_p()
        with self.device_scope(module.device_index):
            self.check(self._get_function(ctypes.byref(fn), module.handle, name.encode()),
                       f"cuModuleGetFunction({name})")
        return fn

    def set_max_dynamic_shared(self, function, nbytes, device_index):
        if nbytes > CUDA_DEFAULT_SMEM:
            with self.device_scope(device_index):
                self.check(self._set_attribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes)),
                           "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")

    def launch(self, function, grid, block, shared_bytes, stream, arg_array, device_index):
        g, b = launch_dims(grid), launch_dims(block)
        with self.device_scope(device_index):
            self.check(self._launch(function, *g, *b, int(shared_bytes), ctypes.c_void_p(stream or None),
                                    ctypes.cast(arg_array, ctypes.POINTER(ctypes.c_void_p)), None), "cuLaunchKernel")


# -- the compiler ---------------------------------------------------------------------------------

def _site_dirs() -> List[str]:
    return [p for p in dict.fromkeys(sys.path) if p and os.path.isdir(p)]


def nvrtc_candidates() -> List[str]:
    """nvrtc paths, those of torch's CUDA major version first (CUDA wheels ship nvrtc in nvidia-cuda-nvrtc)."""
    major = (getattr(torch.version, "cuda", None) or "").split(".")[0]
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    if sys.platform == "win32":
        pattern, folders = "nvrtc64_*.dll", [torch_lib_dir()] + [os.path.join(r, "bin") for r in roots if r]
        folders += [d for s in _site_dirs() for d in glob.glob(os.path.join(s, "nvidia", "*", "bin"))]
        folders += [d for s in _site_dirs() for d in glob.glob(os.path.join(s, "nvidia", "*", "bin", "x86_64"))]
        names = [f"nvrtc64_{major}0_0.dll"] if major else []
    else:
        pattern, folders = "libnvrtc.so*", [torch_lib_dir()]
        folders += [d for s in _site_dirs() for d in glob.glob(os.path.join(s, "nvidia", "*", "lib"))]
        folders += [os.path.join(r, sub) for r in roots if r for sub in ("lib64", "lib")]
        names = ([f"libnvrtc.so.{major}"] if major else []) + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    found = without_builtins(loaded_library_paths("libnvrtc"))
    found += without_builtins([p for f in folders for p in sorted(glob.glob(os.path.join(f, pattern)), reverse=True)])

    def torch_major_first(p):
        base = os.path.basename(p)
        return 0 if major and (f".so.{major}" in base or f"nvrtc64_{major}" in base) else 1

    return sorted(dict.fromkeys(found), key=torch_major_first) + names


def nvrtc_target(capability: int, supported: Sequence[int]) -> str:
    """A cubin for the device when nvrtc knows its arch; else PTX for the newest arch it knows below it
    (the driver JIT-compiles PTX forward)."""
    if not supported or capability in supported:
        return f"sm_{capability}"
    older = [a for a in supported if a <= capability]
    return f"compute_{max(older)}" if older else f"sm_{capability}"


class NvrtcCompiler(RtcCompiler):
    kind, prefix, stem = "nvrtc", "nvrtc", "libnvrtc" if sys.platform != "win32" else "nvrtc"

    def __init__(self, candidates: Optional[Sequence[str]] = None):
        super().__init__(candidates or nvrtc_candidates(), "nvrtc (the CUDA runtime compiler)")

    def supported_archs(self) -> List[int]:
        try:
            count_fn = self._bind("GetNumSupportedArchs", ctypes.c_int, [ctypes.POINTER(ctypes.c_int)])
            list_fn = self._bind("GetSupportedArchs", ctypes.c_int, [ctypes.POINTER(ctypes.c_int)])
        except CompilerUnavailable:
            return []
        n = ctypes.c_int(0)
        if count_fn(ctypes.byref(n)) != 0 or n.value <= 0:
            return []
        arr = (ctypes.c_int * n.value)()
        return list(arr) if list_fn(arr) == 0 else []

    def target_for_device(self, device_index: int) -> str:
        props = torch.cuda.get_device_properties(device_index)
        return nvrtc_target(props.major * 10 + props.minor, self.supported_archs())

    def options(self, target, extra_flags):
        # Verification options of the whole run (SAGE_RDNA4_EMU_FP8_NONSAT, kernels/verify/emulation_env.py) as
        # defines; they are part of the flags, so of the disk cache's key.
        defines = [f"-D{kernel_abi.VERIFY_OPTIONS[k]}={int(v)}" for k, v in sorted(env_options().items()) if int(v)]
        return [f"--gpu-architecture={target}", "-std=c++17", *EMULATION_PTXAS_FLAGS, *defines, *extra_flags]

    def _code(self, prog, target):
        if target.startswith("sm_"):
            return self._read(prog, "GetCUBINSize", "GetCUBIN")
        return self._read(prog, "GetPTXSize", "GetPTX")


register_compiler("nvrtc", NvrtcCompiler)
register_platform(Platform("cuda", "nvrtc", CudaRuntime, "cuda"))


def prewarm_loader_build(device_index: int = 0) -> threading.Thread:
    """Compile the emulated HIP backends' module into the loader's disk cache in a background (daemon) thread, as
    the loader would build it at the backends' first call (the same source, target, flags and runtime version, so
    the same cache key): a GPU test run then loads it instead of compiling it in whichever test comes first.
    Nothing is loaded on the device here. A failure is left for that first call to meet and report."""
    from ..backends.hip.runtime import get_loader, kernel_bundle

    def build():
        with contextlib.suppress(Exception):
            loader = get_loader()
            comp = loader.compiler
            comp.build_cached(loader.cache, kernel_bundle(), comp.target_for_device(device_index), (),
                              loader.runtime.version())

    thread = threading.Thread(target=build, name="sage-emulated-prewarm-loader", daemon=True)
    thread.start()
    return thread
