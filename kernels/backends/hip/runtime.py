"""ctypes over the HIP runtime PyTorch already loaded: load a code object, find a kernel, launch it.

The module API is one small interface (`GpuRuntime`); `HipRuntime` implements it on the HIP module API in
libamdhip64 / amdhip64_N.dll. Nothing here compiles: the code object is the one shipped for the device's
arch (shipped_objects.py) when it is the build of these sources, else `compiler.py` builds one (hiprtc) and
kernels/disk_cache.py keeps it on disk. `KernelLoader` joins them: (device, kernel) -> a launchable
function, and says which path served (`code_paths`). Where the libraries are and what the GPU is called come
from `platform.py`, shared with the compiler.

Which runtime and compiler serve a PyTorch build is a registered `Platform`: 'hip' here. On NVIDIA the kernels
run only as the gfx12 emulation, whose CUDA runtime and compiler live with the verification tooling
(kernels/verify/cuda_twin.py, which registers the 'cuda' platform when imported): `get_platform` imports it
only when SAGE_RDNA4_HIP_EMULATE=1, so a user's run never loads it.

Launches go on `torch.cuda.current_stream(device).cuda_stream`, so they order with PyTorch's work.

Every call that depends on the device (module load, function lookup, launch, function attributes) runs
with the kernel's device current and puts the caller's device back after (`GpuRuntime.device_scope`):
clr ties a module to the device current when it was loaded and aborts the process (`guarantee`) when
`hipModuleGetFunction` or a launch runs with another device current, and the NULL stream (PyTorch's
default stream) means "the current device's". So a worker thread sitting on device 0 or a machine with
an iGPU beside the dGPU never reaches clr with the wrong device. Modules are loaded and kept per device,
each with the buffer its code object was loaded from (clr registers that image without copying it).
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ... import settings
from ...disk_cache import HIP_CODE_OBJECTS, EntryStore
from . import shipped_objects
from .compiler import (
    CompilerUnavailable,
    SourceBundle,
    compiler_unavailable_reason,
    device_gcn_arch,
    get_compiler,
)
from .platform import (
    loaded_library_paths,
    parse_gcn_arch,
    prefer_torch_libraries,
    rocm_wheel_dirs,
    torch_lib_dir,
    windows_loaded_module,
)

# Argument kinds a kernel signature may use, and their C types. 'ptr' takes a tensor, an int or None.
ARG_CTYPES = {
    "ptr": ctypes.c_void_p,
    "i32": ctypes.c_int32,
    "u32": ctypes.c_uint32,
    "i64": ctypes.c_int64,
    "u64": ctypes.c_uint64,
    "f32": ctypes.c_float,
}

log = logging.getLogger(__name__)


class RuntimeUnavailable(RuntimeError):
    """The GPU runtime library cannot be found or lacks an entry point; the message says which."""


class LaunchError(RuntimeError):
    """A runtime call failed; the message names the call and the runtime's own error text."""


def pack_args(signature: Sequence[str], values: Sequence) -> Tuple[list, ctypes.Array]:
    """Kernel arguments as ctypes values plus the `void**` array the launch APIs take.

    The values list is returned too: it must stay alive until the launch call returns."""
    if len(signature) != len(values):
        raise ValueError(f"kernel takes {len(signature)} arguments, got {len(values)}")
    held = []
    for kind, value in zip(signature, values):
        ctype = ARG_CTYPES.get(kind)
        if ctype is None:
            raise ValueError(f"unknown argument kind {kind!r}; use one of {sorted(ARG_CTYPES)}")
        if kind == "ptr":
            value = value.data_ptr() if isinstance(value, torch.Tensor) else (value or 0)
        elif kind in ("i32", "u32", "i64", "u64"):
            value = int(value)
            bits = 32 if kind in ("i32", "u32") else 64
            lo, hi = (0, 1 << bits) if kind.startswith("u") else (-(1 << (bits - 1)), 1 << (bits - 1))
            if not lo <= value < hi:
                raise ValueError(f"argument {value} does not fit {kind}")
        else:
            value = float(value)
        held.append(ctype(value))
    array = (ctypes.c_void_p * max(1, len(held)))(*[ctypes.addressof(h) for h in held])
    return held, array


# -- finding the libraries ------------------------------------------------------------------------

def hip_library_candidates() -> List[str]:
    """Where the HIP runtime may be, best first: the copy torch loaded, torch's own lib folder, ROCm.

    With two HIP runtimes in the process (torch's and, say, /opt/rocm's pulled in by another extension)
    the one under torch's lib folder comes first, then one from the ROCm SDK wheels torch depends on
    (`platform.prefer_torch_libraries`): modules and streams belong to one runtime instance, and torch's
    streams and device are the ones we launch on."""
    if sys.platform == "win32":
        dll_names = ["amdhip64_7.dll", "amdhip64_6.dll", "amdhip64.dll"]
        names = prefer_torch_libraries(windows_loaded_module(dll_names))
        for folder in [torch_lib_dir()] + rocm_wheel_dirs() + [os.path.join(os.environ.get("HIP_PATH", ""), "bin")]:
            names += sorted(glob.glob(os.path.join(folder, "amdhip64*.dll")), reverse=True)
        return names + dll_names
    names = prefer_torch_libraries(loaded_library_paths("libamdhip64.so"))
    for folder in [torch_lib_dir()] + rocm_wheel_dirs():
        names += sorted(glob.glob(os.path.join(folder, "libamdhip64.so*")), reverse=True)
    for root in (os.environ.get("ROCM_PATH", ""), os.environ.get("HIP_PATH", ""), "/opt/rocm"):
        if root:
            names += sorted(glob.glob(os.path.join(root, "lib", "libamdhip64.so*")), reverse=True)
    return names + ["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"]


def open_first(candidates: Sequence[str], what: str) -> Tuple[ctypes.CDLL, str]:
    tried = []
    for name in dict.fromkeys(candidates):  # keeps order, drops repeats
        try:
            return ctypes.CDLL(name, mode=getattr(os, "RTLD_GLOBAL", 0)), name
        except OSError as exc:
            tried.append(f"{name} ({exc})" if os.path.sep in name else name)
    raise RuntimeUnavailable(f"{what} not found; tried: {', '.join(tried) or 'nothing'}")


def bind(lib: ctypes.CDLL, name: str, restype, argtypes, what: str):
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise RuntimeUnavailable(f"{what} has no {name}") from None
    fn.restype, fn.argtypes = restype, argtypes
    return fn


# -- the runtime ----------------------------------------------------------------------------------

class Module:
    """A code object loaded on one device: the runtime's handle, the device, and the buffer it came from.

    clr's hipModuleLoadData registers the image pointer without copying it (DynCO keeps it in its
    FatBinaryInfo), so the buffer must live exactly as long as the handle: it lives here."""

    __slots__ = ("handle", "device_index", "image")

    def __init__(self, handle: ctypes.c_void_p, device_index: int, image):
        self.handle, self.device_index, self.image = handle, device_index, image

    def __repr__(self) -> str:
        return f"Module(0x{self.handle.value or 0:x}, device {self.device_index}, {len(self.image)} bytes)"


class GpuRuntime:
    """The module API of one GPU runtime. Subclasses set `kind` (a Platform's kind) and the entry points.

    `load_module` returns a `Module` (or anything a subclass's `get_function` understands); every
    device-sensitive call runs inside `device_scope(device_index)`."""

    kind = ""
    library = ""
    # Bytes of dynamic shared memory a launch may use before `set_max_dynamic_shared` must raise the
    # function's limit; None where the runtime has no such opt-in (HIP).
    dynamic_shared_limit: Optional[int] = None

    def version(self) -> str:
        raise NotImplementedError

    @contextlib.contextmanager
    def device_scope(self, device_index: int) -> Iterator[None]:
        """Make `device_index` current for the calls inside; the caller's device is current again after."""
        yield

    def load_module(self, image: bytes, device_index: int):
        raise NotImplementedError

    def get_function(self, module, name: str):
        raise NotImplementedError

    def set_max_dynamic_shared(self, function, nbytes: int, device_index: int) -> None:
        """Let `function` use `nbytes` of dynamic shared memory (above `dynamic_shared_limit`)."""

    def launch(self, function, grid, block, shared_bytes: int, stream: int, arg_array, device_index: int) -> None:
        raise NotImplementedError


def launch_dims(dims) -> Tuple[int, int, int]:
    """A grid or block as three positive ints (missing trailing ones are 1)."""
    dims = tuple(int(d) for d in dims) + (1, 1, 1)
    if any(d <= 0 for d in dims[:3]):
        raise ValueError(f"grid/block dimensions must be positive, got {dims[:3]}")
    return dims[:3]


class HipRuntime(GpuRuntime):
    kind = "hip"

    def __init__(self, candidates: Optional[Sequence[str]] = None, lib=None):
        """`lib`: an already opened library (tests pass a stand-in built from ctypes callbacks)."""
        if lib is None:
            lib, self.library = open_first(candidates or hip_library_candidates(),
                                           "the HIP runtime (libamdhip64 / amdhip64_N.dll)")
        else:
            self.library = getattr(lib, "_name", type(lib).__name__)
        what = self.library
        vp, u32, i32 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        self._error_string = bind(lib, "hipGetErrorString", ctypes.c_char_p, [i32], what)
        self._runtime_version = bind(lib, "hipRuntimeGetVersion", i32, [ctypes.POINTER(i32)], what)
        self._get_device = bind(lib, "hipGetDevice", i32, [ctypes.POINTER(i32)], what)
        self._set_device = bind(lib, "hipSetDevice", i32, [i32], what)
        self._load = bind(lib, "hipModuleLoadData", i32, [ctypes.POINTER(vp), vp], what)
        self._get_function = bind(lib, "hipModuleGetFunction", i32, [ctypes.POINTER(vp), vp, ctypes.c_char_p], what)
        self._launch = bind(lib, "hipModuleLaunchKernel", i32,
                            [vp, u32, u32, u32, u32, u32, u32, u32, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)], what)
        self._get_last_error = bind(lib, "hipGetLastError", i32, [], what)

    def check(self, status: int, call: str) -> None:
        if status != 0:
            text = self._error_string(status)
            self._get_last_error()  # clear the sticky copy so torch does not report ours later
            raise LaunchError(f"{call} failed: {text.decode(errors='replace') if text else 'error'} ({status})")

    def version(self) -> str:
        v = ctypes.c_int(0)
        self.check(self._runtime_version(ctypes.byref(v)), "hipRuntimeGetVersion")
        return f"hip-{v.value}"

    def current_device(self) -> int:
        dev = ctypes.c_int(-1)
        self.check(self._get_device(ctypes.byref(dev)), "hipGetDevice")
        return dev.value

    @contextlib.contextmanager
    def device_scope(self, device_index: int) -> Iterator[None]:
        """hipSetDevice(device_index) for the body, then the caller's device again (current device is per thread).

        Goes through this library's own hipGetDevice/hipSetDevice, so it holds for the runtime the
        calls are made on even where torch.cuda.device would switch another copy."""
        device_index = int(device_index)
        previous = self.current_device()
        if previous == device_index:
            yield
            return
        self.check(self._set_device(device_index), f"hipSetDevice({device_index})")
        try:
            yield
        except BaseException:
            self._set_device(previous)  # the body's error is the one to report
            raise
        self.check(self._set_device(previous), f"hipSetDevice({previous}) (restoring the caller's device)")

    def load_module(self, image: bytes, device_index: int) -> Module:
        handle = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(bytes(image), len(image))  # kept by the Module: clr does not copy it
        with self.device_scope(device_index):  # a module belongs to the device current when it is loaded
            self.check(self._load(ctypes.byref(handle), ctypes.cast(buf, ctypes.c_void_p)), "hipModuleLoadData")
        return Module(handle, device_index, buf)

    def get_function(self, module: Module, name: str):
        fn = ctypes.c_void_p()
        with self.device_scope(module.device_index):  # clr aborts when another device is current
            self.check(self._get_function(ctypes.byref(fn), module.handle, name.encode()),
                       f"hipModuleGetFunction({name})")
        return fn

    def launch(self, function, grid, block, shared_bytes, stream, arg_array, device_index):
        g, b = launch_dims(grid), launch_dims(block)
        with self.device_scope(device_index):  # the NULL stream is the current device's
            self.check(self._launch(function, *g, *b, int(shared_bytes), ctypes.c_void_p(stream or None),
                                    ctypes.cast(arg_array, ctypes.POINTER(ctypes.c_void_p)), None),
                       "hipModuleLaunchKernel")


# -- which runtime and compiler serve this PyTorch ---------------------------------------------------

@dataclass(frozen=True)
class Platform:
    """The machinery the kernels run on under one kind of PyTorch build."""
    kind: str                                # runtime_kind() of that build
    compiler_kind: str                       # compiler.get_compiler's name for its compiler
    make_runtime: Callable[[], GpuRuntime]
    source_target: str                       # kernel_abi.module_source's target for its compiler
    prebuilt: bool = False                   # whether shipped_objects' code objects serve it


_PLATFORMS: Dict[str, Platform] = {}


def register_platform(platform: Platform) -> None:
    _PLATFORMS[platform.kind] = platform


register_platform(Platform("hip", "hiprtc", HipRuntime, "hip", prebuilt=True))

EMULATION_KIND = "cuda"
# The CUDA twin, relative to this package: verification code, imported only when the emulation is asked for.
EMULATION_MODULE = "...verify.cuda_twin"


def emulation_refusal() -> str:
    return (f"HIP kernels target AMD RDNA4; on NVIDIA they run only as a gfx12 emulation for verification, "
            f"when {settings.HIP_EMULATE.name}=1")


def runtime_kind() -> str:
    """'hip' under ROCm PyTorch, 'cuda' under CUDA PyTorch."""
    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def get_platform(kind: str) -> Platform:
    """The registered platform `kind`; the emulation's is imported on demand when it is asked for.

    Raises RuntimeUnavailable with the reason when there is none (not cached: the switch may change)."""
    found = _PLATFORMS.get(kind)
    if found is None and kind == EMULATION_KIND:
        if not settings.hip_emulation_requested():
            raise RuntimeUnavailable(emulation_refusal())
        try:
            importlib.import_module(EMULATION_MODULE, __package__)  # registers the 'cuda' platform
        except ImportError as exc:
            raise RuntimeUnavailable(f"the gfx12 emulation (kernels/verify/cuda_twin.py) cannot be imported: "
                                     f"{type(exc).__name__}: {exc}") from None
        found = _PLATFORMS.get(kind)
    if found is None:
        raise RuntimeUnavailable(f"no GPU runtime is registered for {kind!r} (known: {sorted(_PLATFORMS)})")
    return found


_RUNTIMES: Dict[str, GpuRuntime] = {}
_RUNTIME_ERRORS: Dict[str, str] = {}
_RUNTIME_LOCK = threading.Lock()


def get_runtime(kind: Optional[str] = None) -> GpuRuntime:
    """The process-wide runtime of that kind; raises RuntimeUnavailable (same reason every time) when absent."""
    kind = kind or runtime_kind()
    platform = get_platform(kind)
    with _RUNTIME_LOCK:
        if kind in _RUNTIMES:
            return _RUNTIMES[kind]
        if kind in _RUNTIME_ERRORS:
            raise RuntimeUnavailable(_RUNTIME_ERRORS[kind])
        try:
            rt = platform.make_runtime()
        except (RuntimeUnavailable, LaunchError) as exc:
            _RUNTIME_ERRORS[kind] = str(exc)
            raise RuntimeUnavailable(str(exc)) from None
        _RUNTIMES[kind] = rt
        return rt


def runtime_unavailable_reason(kind: Optional[str] = None) -> Optional[str]:
    try:
        get_runtime(kind)
        return None
    except RuntimeUnavailable as exc:
        return str(exc)


# -- kernels ready to launch ----------------------------------------------------------------------

def current_stream(device_index: int) -> int:
    """The handle of PyTorch's current stream on that device (0 for its default stream, which the runtime
    reads as the NULL stream of the device current at launch: launches switch to `device_index`)."""
    return torch.cuda.current_stream(device_index).cuda_stream


def resolve_device(device_index: Optional[int]) -> int:
    """A tensor's `device.index`, or PyTorch's current device for a bare 'cuda' device."""
    return torch.cuda.current_device() if device_index is None else int(device_index)


class LoadedKernel:
    """One kernel function in a module loaded on one device; launches on that device, whichever is current.

    Holds its module (and with it the code object buffer the runtime may still read)."""

    def __init__(self, runtime: GpuRuntime, module, function, name: str, device_index: int, signature: Sequence[str]):
        self.runtime, self.module, self.function = runtime, module, function
        self.name, self.device_index, self.signature = name, device_index, tuple(signature)
        self._smem_allowed = runtime.dynamic_shared_limit  # None: no opt-in to make
        self._lock = threading.Lock()

    def __call__(self, grid, block, args: Sequence, shared_bytes: int = 0, stream: Optional[int] = None,
                 signature: Optional[Sequence[str]] = None) -> None:
        """Launch on `stream` (default: PyTorch's current stream on this device).

        `signature` overrides the argument kinds given at load time (plans carry their own)."""
        if self._smem_allowed is not None and shared_bytes > self._smem_allowed:
            with self._lock:
                self.runtime.set_max_dynamic_shared(self.function, shared_bytes, self.device_index)
                self._smem_allowed = max(self._smem_allowed, shared_bytes)
        if stream is None:
            stream = current_stream(self.device_index)
        held, array = pack_args(self.signature if signature is None else signature, args)
        self.runtime.launch(self.function, grid, block, shared_bytes, stream, array, self.device_index)
        del held  # the values had to live through the launch call


class KernelLoader:
    """(device, source, entry) -> LoadedKernel: the shipped code object when it may serve, else a build.

    One loader per runtime kind; modules are loaded once per device and source, and kept (a module
    loaded on device 0 is not valid on device 1, so the device is part of every key).

    With `prebuilt` (shipped_objects.ShippedObjects; the 'hip' platform) and no extra flags, the object shipped
    for the device's arch (`arch_of`) is loaded when its manifest names these sources' digest and its bytes
    their sha256: no compiler is made or called. Otherwise, or when the runtime refuses it, the compiler
    (`compiler`, or made by `compiler_factory` on first need) builds through the disk cache; `served` and
    `prebuilt_refusals` say, per device, which path served and why the shipped object did not (a refusal by
    the runtime is logged with its error). A shipped object that cannot serve, whatever its files hold, is a
    reason and never an exception from `kernel()`: the compiler is tried next.
    A cached code object the driver rejects is dropped and rebuilt once.
    """

    def __init__(self, runtime: GpuRuntime, compiler=None, cache=None, *,
                 compiler_factory: Optional[Callable[[], object]] = None,
                 prebuilt: Optional[shipped_objects.ShippedObjects] = None,
                 arch_of: Optional[Callable[[int], str]] = None):
        if compiler is None and compiler_factory is None:
            raise ValueError("KernelLoader needs a compiler or a compiler_factory")
        self.runtime, self.cache = runtime, cache
        self._compiler, self._compiler_factory = compiler, compiler_factory
        self.prebuilt, self._arch_of = prebuilt, arch_of
        self.served: Dict[int, str] = {}             # device -> "prebuilt gfx1201 1a2b3c4d" / "hiprtc 7.0"
        self.prebuilt_refusals: Dict[int, str] = {}  # device -> why the shipped object did not serve
        self._modules: Dict[Tuple[int, str, Tuple[str, ...]], object] = {}
        self._kernels: Dict[Tuple[int, str, Tuple[str, ...], str], LoadedKernel] = {}
        self._prebuilt_refused: Dict[Tuple[int, str, Tuple[str, ...]], str] = {}
        self._lock = threading.Lock()

    @property
    def compiler(self):
        """The compiler, made on first need; raises CompilerUnavailable (from the factory) when there is none."""
        if self._compiler is None:
            self._compiler = self._compiler_factory()
        return self._compiler

    def arch(self, device_index: int) -> str:
        return self._arch_of(device_index) if self._arch_of else self.compiler.target_for_device(device_index)

    def kernel(self, device_index: int, source: "object", entry: str, signature: Sequence[str],
               extra_flags: Sequence[str] = ()) -> LoadedKernel:
        """`source` is a compiler.SourceBundle; `entry` an extern "C" kernel name in it."""
        device_index = int(device_index)
        flags = tuple(extra_flags)
        key = (device_index, source.digest, flags, entry)
        with self._lock:
            found = self._kernels.get(key)
            if found is not None:
                return found
            module = self._module(device_index, source, flags)
            function = self.runtime.get_function(module, entry)
            found = LoadedKernel(self.runtime, module, function, entry, device_index, signature)
            self._kernels[key] = found
            return found

    def preload(self, device_index: int, source) -> Optional[str]:
        """Load `source`'s shipped object on the device now (nothing is compiled here). None when the shipped
        object serves it, else the reason it does not."""
        device_index = int(device_index)
        mkey = (device_index, source.digest, ())
        if self.prebuilt is None:
            return "no prebuilt code objects on this platform"
        with self._lock:
            if mkey not in self._modules:
                module = self._load_prebuilt(device_index, source)
                if module is not None:
                    self._modules[mkey] = module
            return self._prebuilt_refused.get(mkey)

    def _load_prebuilt(self, device_index: int, source):
        """The module of the shipped object, or None with the reason kept (asked once per device and source)."""
        mkey = (device_index, source.digest, ())
        if self.prebuilt is None or mkey in self._prebuilt_refused:
            return None
        try:
            found, reason = self.prebuilt.find(self.arch(device_index), source.digest)
        except Exception as exc:  # the device's arch unreadable, or a checker's bug: the compiler is tried next
            found, reason = None, f"the prebuilt code object could not be checked: {type(exc).__name__}: {exc}"
        if found is not None:
            try:
                module = self.runtime.load_module(found.image, device_index)
            except LaunchError as exc:
                reason = f"the runtime refused the {found.label} code object: {exc}"
                log.warning("HIP kernels on device %d: %s", device_index, reason)
            else:
                self.served[device_index] = found.label
                log.info("HIP kernels on device %d: %s (loaded as shipped, nothing compiled)", device_index,
                         found.label)
                return module
        self._prebuilt_refused[mkey] = self.prebuilt_refusals[device_index] = reason
        return None

    def _module(self, device_index, source, flags):
        mkey = (device_index, source.digest, flags)
        if mkey in self._modules:
            return self._modules[mkey]
        refusal = None
        if not flags:  # shipped objects are builds without extra flags
            module = self._load_prebuilt(device_index, source)
            if module is not None:
                self._modules[mkey] = module
                return module
            refusal = self._prebuilt_refused.get(mkey)
        try:
            comp = self.compiler
        except CompilerUnavailable as exc:
            if refusal:
                raise CompilerUnavailable(f"{refusal}; and no compiler to build the kernels instead: {exc}") from None
            raise
        target = comp.target_for_device(device_index)
        version = self.runtime.version()
        built = comp.build_cached(self.cache, source, target, flags, version)
        try:
            module = self.runtime.load_module(built.image, device_index)
        except LaunchError:
            if not built.from_cache:
                raise  # freshly compiled and still rejected: a real error
            self.cache.discard(built.path, built.key)  # stale entry the driver rejects: rebuild once
            built = comp.build_cached(self.cache, source, target, flags, version, force=True)
            module = self.runtime.load_module(built.image, device_index)
        if not flags:
            self.served[device_index] = compiled_label(comp)
            log.info("HIP kernels on device %d: %s (%s)", device_index, self.served[device_index],
                     f"{'from the disk cache' if built.from_cache else 'compiled at first use'}"
                     f"{'; ' + refusal if refusal else ''}")
        self._modules[mkey] = module
        return module


def compiled_label(comp) -> str:
    """'hiprtc 7.0' from a compiler whose version() is 'hiprtc-7.0'."""
    version = comp.version()
    prefix = f"{comp.kind}-"
    return f"{comp.kind} {version[len(prefix):] if version.startswith(prefix) else version}"


# -- whether the kernels can run on a device ---------------------------------------------------------

GFX12_ARCHS = ("gfx1200", "gfx1201")
_LOADERS: Dict[str, KernelLoader] = {}


def compiler_kind(rt_kind: str) -> str:
    return get_platform(rt_kind).compiler_kind


def environment_refusal(device_type: str, index: Optional[int]) -> Optional[str]:
    """Why the HIP kernels cannot run on this device at all, or None.

    ROCm: gfx1200/gfx1201 only, with the HIP runtime, and the shipped code object for the arch loaded here
    (`KernelLoader.preload`) or else hiprtc to compile the kernels (a refusal names both reasons).
    NVIDIA: only as the gfx12 emulation, and only when asked for with SAGE_RDNA4_HIP_EMULATE=1 (it exists
    to verify the kernels, it is never a speed path).
    Answers are kept per device (and emulation setting): the prologue asks on every call."""
    key = (device_type, index, settings.hip_emulation_requested(), runtime_kind())
    if key not in _ENV_VERDICTS:
        _ENV_VERDICTS[key] = _environment_refusal(device_type, index)
    return _ENV_VERDICTS[key]


_ENV_VERDICTS: Dict[tuple, Optional[str]] = {}


def _environment_refusal(device_type: str, index: Optional[int]) -> Optional[str]:
    if device_type != "cuda":
        return f"HIP kernels need a ROCm gfx1200/gfx1201 GPU, not {device_type}"
    if not torch.cuda.is_available():
        return "torch.cuda is not available"
    index = torch.cuda.current_device() if index is None else index
    kind = runtime_kind()
    if kind == "hip":
        name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
        arch = parse_gcn_arch(name)
        if arch not in GFX12_ARCHS:
            return f"HIP kernels are written for RDNA4 (gfx1200/gfx1201); this GPU is {arch}"
    elif not settings.hip_emulation_requested():
        return emulation_refusal()
    reason = runtime_unavailable_reason(kind)
    if reason:
        return reason
    if not get_platform(kind).prebuilt:
        return compiler_unavailable_reason(compiler_kind(kind))
    # A shipped object that loads needs no compiler: hiprtc is asked for only when it does not serve.
    try:
        prebuilt_reason = get_loader().preload(index, kernel_bundle())
    except Exception as exc:  # the sources or the device properties unreadable: a reason, not a crash
        prebuilt_reason = f"the prebuilt code object could not be loaded: {type(exc).__name__}: {exc}"
    if prebuilt_reason is None:
        return None
    reason = compiler_unavailable_reason(compiler_kind(kind))
    return f"{prebuilt_reason}; and no compiler to build the kernels instead: {reason}" if reason else None


def get_loader() -> KernelLoader:
    """The process-wide loader for this PyTorch's runtime (check environment_refusal first). Its compiler is
    made on first need: where a shipped code object serves, never."""
    kind = runtime_kind()
    with _RUNTIME_LOCK:
        loader = _LOADERS.get(kind)
    if loader is None:
        platform = get_platform(kind)
        loader = KernelLoader(get_runtime(kind), None, EntryStore(HIP_CODE_OBJECTS),
                              compiler_factory=lambda: get_compiler(platform.compiler_kind),
                              prebuilt=shipped_objects.ShippedObjects() if platform.prebuilt else None,
                              arch_of=device_gcn_arch if platform.prebuilt else None)
        with _RUNTIME_LOCK:
            loader = _LOADERS.setdefault(kind, loader)
    return loader


def code_paths() -> Dict[int, str]:
    """Per device, what serves the HIP kernels in this process: 'prebuilt gfx1201 1a2b3c4d' or 'hiprtc 7.0'
    (the emulation: its compiler's); empty before their first load."""
    with _RUNTIME_LOCK:
        loader = _LOADERS.get(runtime_kind())
    return dict(loader.served) if loader else {}


def code_path_line() -> Optional[str]:
    """`code_paths` in one line ('prebuilt gfx1201 1a2b3c4d' on one GPU, 'cuda:0 ..., cuda:1 ...' on more); a
    device whose shipped object did not serve and that has not compiled yet: 'hiprtc 7.0 at first use (why)'."""
    with _RUNTIME_LOCK:
        loader = _LOADERS.get(runtime_kind())
    if loader is None:
        return None
    paths = dict(loader.served)
    for index, reason in loader.prebuilt_refusals.items():
        if index not in paths:
            try:
                label = compiled_label(loader.compiler)
            except CompilerUnavailable as exc:
                label = f"no compiler ({exc})"
            paths[index] = f"{label} at first use ({reason})"
    if not paths:
        return None
    if len(set(paths.values())) == 1:
        return next(iter(paths.values()))
    return ", ".join(f"cuda:{i} {p}" for i, p in sorted(paths.items()))


def run_launches(device_index: int, source, launches: Sequence, stream: Optional[int] = None,
                 loader: Optional[KernelLoader] = None) -> None:
    """Run a kernel_abi plan: each Launch (kernel, grid, block, args as (kind, value), shared_bytes), in order,
    on one stream (default: PyTorch's current stream on the device). The device is the tensors' device
    (`tensor.device.index`), not the caller's current one: loads and launches switch to it."""
    loader = loader or get_loader()
    device_index = resolve_device(device_index)
    if stream is None:
        stream = current_stream(device_index)
    for item in launches:
        kinds = [kind for kind, _ in item.args]
        kern = loader.kernel(device_index, source, item.kernel, kinds)
        kern(item.grid, item.block, [value for _, value in item.args], item.shared_bytes, stream, signature=kinds)


_BUNDLES: Dict[str, object] = {}


def source_bundle(target: str) -> SourceBundle:
    """The kernels' translation unit for a compiler target ('hip', 'cuda'): what the loader builds or finds
    shipped (its digest is the one in the shipped manifests)."""
    from . import kernel_abi
    return SourceBundle(shipped_objects.SOURCE_NAME, kernel_abi.module_source(target))


def kernel_bundle():
    """The kernels' translation unit for this runtime (kernel_abi.module_source), read once per process."""
    kind = runtime_kind()
    bundle = _BUNDLES.get(kind)
    if bundle is None:
        bundle = _BUNDLES.setdefault(kind, source_bundle(get_platform(kind).source_target))
    return bundle
