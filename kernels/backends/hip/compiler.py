"""Runtime compilation of the kernel sources with hiprtc, for the device's own target.

Where the shipped code object for the device's arch serves (shipped_objects.py, prebuilt/), nothing is
compiled. Otherwise, on first use, the sources are compiled for the device's gcnArchName (e.g. gfx1201) and
the code object is kept in the disk cache (kernels/disk_cache.py). The sources include
only headers of their own; those travel to the compiler by name with the program, so no include path or
toolchain is needed. hiprtc is looked for beside the HIP runtime PyTorch loaded first (ROCm wheels ship it
next to amdhip64), then in the ROCm install.

Compilers are registered by name (`register_compiler`): 'hiprtc' here; the CUDA twin used to verify the
kernels on NVIDIA (kernels/verify/cuda_twin.py) registers its own when it is imported.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...disk_cache import cache_key
from .platform import (
    loaded_library_paths,
    parse_gcn_arch,
    prefer_torch_libraries,
    rocm_wheel_dirs,
    torch_lib_dir,
    windows_loaded_module,
)

SOURCE_SUFFIXES = (".hip", ".h", ".hpp", ".cuh", ".inc")
LOG_LIMIT = 6000  # characters of compiler log kept in an error


class CompilerUnavailable(RuntimeError):
    """No usable runtime compiler; the message says what was looked for."""


class CompileError(RuntimeError):
    """The compiler rejected the sources; the message carries its log."""


@dataclass(frozen=True)
class SourceBundle:
    """One translation unit plus every header it may include, by the name it includes them with."""

    name: str
    text: str
    headers: Tuple[Tuple[str, str], ...] = ()

    @functools.cached_property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name, text in ((self.name, self.text),) + tuple(sorted(self.headers)):
            h.update(name.encode() + b"\0" + text.encode() + b"\0")
        return h.hexdigest()

    @classmethod
    def from_dir(cls, folder: str, main: str) -> "SourceBundle":
        """`main` from `folder`, with every other source file of the folder available as a header."""
        files = {}
        for path in sorted(glob.glob(os.path.join(folder, "*"))):
            if path.endswith(SOURCE_SUFFIXES) and os.path.isfile(path):
                with open(path, "r", encoding="utf-8") as fh:
                    files[os.path.basename(path)] = fh.read()
        if main not in files:
            raise FileNotFoundError(f"kernel source {main} not found in {folder}")
        text = files.pop(main)
        return cls(main, text, tuple(sorted(files.items())))


@dataclass
class BuildResult:
    image: bytes
    key: str
    path: Optional[str]   # the cache file, when there is one
    from_cache: bool


# -- finding the libraries ------------------------------------------------------------------------

def without_builtins(paths):
    """The paths that are not an rtc library's builtins companion (which is loaded beside it, not on its own)."""
    return [p for p in paths if "builtins" not in os.path.basename(p)]


def hiprtc_candidates() -> List[str]:
    # hiprtc beside the HIP runtime torch uses first (`prefer_torch_libraries`), when two are mapped
    loaded = prefer_torch_libraries(loaded_library_paths("amdhip64")
                                    + windows_loaded_module(["amdhip64_7.dll", "amdhip64_6.dll"]))
    hip_dirs = [os.path.dirname(p) for p in loaded] + rocm_wheel_dirs()
    roots = [os.environ.get("ROCM_PATH", ""), os.environ.get("HIP_PATH", ""), "/opt/rocm"]
    if sys.platform == "win32":
        folders = hip_dirs + [torch_lib_dir()] + [os.path.join(r, "bin") for r in roots if r]
        found = [p for f in folders for p in sorted(glob.glob(os.path.join(f, "hiprtc*.dll")), reverse=True)]
        return without_builtins(found) + ["hiprtc0700.dll", "hiprtc0605.dll", "hiprtc0604.dll", "hiprtc0603.dll"]
    found = without_builtins(prefer_torch_libraries(loaded_library_paths("libhiprtc.so")))
    folders = hip_dirs + [torch_lib_dir()] + [os.path.join(r, "lib") for r in roots if r]
    found += [p for f in folders for p in sorted(glob.glob(os.path.join(f, "libhiprtc.so*")), reverse=True)]
    return without_builtins(found) + ["libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6"]


def _preload_builtins(path: str, stem: str) -> None:
    """The rtc libraries open their builtins library by name at compile time; load it from the same folder first."""
    folder = os.path.dirname(path)
    if not folder:
        return
    for lib in sorted(glob.glob(os.path.join(folder, f"{stem}-builtins*")), reverse=True):
        try:
            ctypes.CDLL(lib, mode=getattr(os, "RTLD_GLOBAL", 0))
            return
        except OSError:
            continue


def _open(candidates: Sequence[str], stem: str, what: str) -> Tuple[ctypes.CDLL, str]:
    tried = []
    for name in dict.fromkeys(candidates):
        try:
            _preload_builtins(name, stem)
            return ctypes.CDLL(name, mode=getattr(os, "RTLD_GLOBAL", 0)), name
        except OSError as exc:
            tried.append(f"{name} ({exc})" if os.path.sep in name else name)
    raise CompilerUnavailable(f"{what} not found; tried: {', '.join(tried) or 'nothing'}")


def device_gcn_arch(device_index: int) -> str:
    """The device's processor name from its gcnArchName ('gfx1201:sramecc-:xnack-' -> 'gfx1201')."""
    props = torch.cuda.get_device_properties(device_index)
    return parse_gcn_arch(getattr(props, "gcnArchName", ""))


# -- the compilers --------------------------------------------------------------------------------

class RtcCompiler:
    """The runtime compilers share one C API shape, each under its own name prefix (`hiprtc...`); subclasses
    say what differs."""

    kind = ""
    prefix = ""
    stem = ""

    def __init__(self, candidates: Sequence[str], what: str):
        self.lib, self.library = _open(candidates, self.stem, what)
        vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        cpp = ctypes.POINTER(ctypes.c_char_p)
        self._fn = {}
        for name, restype, args in (
            ("GetErrorString", ctypes.c_char_p, [i32]),
            ("Version", i32, [ctypes.POINTER(i32), ctypes.POINTER(i32)]),
            ("CreateProgram", i32, [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, i32, cpp, cpp]),
            ("CompileProgram", i32, [vp, i32, cpp]),
            ("GetProgramLogSize", i32, [vp, ctypes.POINTER(sz)]),
            ("GetProgramLog", i32, [vp, ctypes.c_char_p]),
            ("DestroyProgram", i32, [ctypes.POINTER(vp)]),
        ):
            self._fn[name] = self._bind(name, restype, args)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._fn["Version"](ctypes.byref(major), ctypes.byref(minor)), "Version")
        self._version = f"{self.kind}-{major.value}.{minor.value}"
        self._lock = threading.Lock()

    def _bind(self, name, restype, args):
        full = self.prefix + name
        try:
            fn = getattr(self.lib, full)
        except AttributeError:
            raise CompilerUnavailable(f"{self.library} has no {full}") from None
        fn.restype, fn.argtypes = restype, args
        return fn

    def _check(self, status: int, call: str, log: str = "") -> None:
        if status != 0:
            text = self._fn["GetErrorString"](status)
            msg = f"{self.prefix}{call} failed: {text.decode(errors='replace') if text else status}"
            raise CompileError(msg + (f"\n{log[-LOG_LIMIT:]}" if log else ""))

    def version(self) -> str:
        return self._version

    def target_for_device(self, device_index: int) -> str:
        raise NotImplementedError

    def options(self, target: str, extra_flags: Sequence[str]) -> List[str]:
        raise NotImplementedError

    def _code(self, prog, target: str) -> bytes:
        raise NotImplementedError

    def compile(self, source: SourceBundle, target: str, extra_flags: Sequence[str] = ()) -> bytes:
        opts = self.options(target, extra_flags)
        names = [n.encode() for n, _ in source.headers]
        texts = [t.encode() for _, t in source.headers]
        n = len(names)
        c_names = (ctypes.c_char_p * max(1, n))(*names)
        c_texts = (ctypes.c_char_p * max(1, n))(*texts)
        c_opts = (ctypes.c_char_p * max(1, len(opts)))(*[o.encode() for o in opts])
        prog = ctypes.c_void_p()
        with self._lock:  # the rtc libraries are thread-safe per program; one compile at a time is plenty
            self._check(self._fn["CreateProgram"](ctypes.byref(prog), source.text.encode(), source.name.encode(),
                                                   n, c_texts, c_names), "CreateProgram")
            try:
                status = self._fn["CompileProgram"](prog, len(opts), c_opts)
                self._check(status, f"CompileProgram({source.name}, {' '.join(opts)})", self._log(prog))
                return self._code(prog, target)
            finally:
                self._fn["DestroyProgram"](ctypes.byref(prog))

    def _log(self, prog) -> str:
        size = ctypes.c_size_t(0)
        if self._fn["GetProgramLogSize"](prog, ctypes.byref(size)) != 0 or size.value <= 1:
            return ""
        buf = ctypes.create_string_buffer(size.value)
        self._fn["GetProgramLog"](prog, buf)
        return buf.value.decode(errors="replace")

    def _read(self, prog, size_fn: str, data_fn: str) -> bytes:
        get_size = self._bind(size_fn, ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)])
        get_data = self._bind(data_fn, ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p])
        size = ctypes.c_size_t(0)
        self._check(get_size(prog, ctypes.byref(size)), size_fn)
        buf = ctypes.create_string_buffer(size.value)
        self._check(get_data(prog, buf), data_fn)
        return buf.raw[:size.value]

    def build_cached(self, cache, source: SourceBundle, target: str, extra_flags: Sequence[str],
                     runtime_version: str, force: bool = False) -> BuildResult:
        """Compile unless the cache has this exact build; a corrupt entry is rebuilt by the cache's rules."""
        opts = self.options(target, extra_flags)
        key = cache_key(source=source.digest, target=target, compiler=self.version(),
                              runtime=runtime_version, flags=opts)
        label = f"{os.path.splitext(source.name)[0]}-{target}"
        if not force:
            image, path = cache.load(key, label)
            if image is not None:
                return BuildResult(image, key, path, True)
        image = self.compile(source, target, extra_flags)
        path = cache.store(key, label, image, {"source": source.name, "target": target, "compiler": self.version(),
                                               "runtime": runtime_version, "flags": opts})
        return BuildResult(image, key, path, False)


class HiprtcCompiler(RtcCompiler):
    kind, prefix, stem = "hiprtc", "hiprtc", "libhiprtc" if sys.platform != "win32" else "hiprtc"

    def __init__(self, candidates: Optional[Sequence[str]] = None):
        super().__init__(candidates or hiprtc_candidates(), "hiprtc (the HIP runtime compiler)")

    def target_for_device(self, device_index: int) -> str:
        return device_gcn_arch(device_index)

    def options(self, target, extra_flags):
        return [f"--offload-arch={target}", "-O3", "-std=c++17", *extra_flags]

    def _code(self, prog, target):
        return self._read(prog, "GetCodeSize", "GetCode")


_COMPILERS: Dict[str, RtcCompiler] = {}
_COMPILER_ERRORS: Dict[str, str] = {}
_LOCK = threading.Lock()
_FACTORIES: Dict[str, Callable[[], RtcCompiler]] = {"hiprtc": HiprtcCompiler}


def register_compiler(kind: str, factory: Callable[[], RtcCompiler]) -> None:
    """Make `get_compiler(kind)` build its compiler with `factory` (the CUDA twin registers itself)."""
    with _LOCK:
        _FACTORIES[kind] = factory


def get_compiler(kind: str) -> RtcCompiler:
    """The registered compiler `kind` ('hiprtc'), process-wide; raises CompilerUnavailable with the same reason
    every time."""
    with _LOCK:
        if kind in _COMPILERS:
            return _COMPILERS[kind]
        if kind in _COMPILER_ERRORS:
            raise CompilerUnavailable(_COMPILER_ERRORS[kind])
        factory = _FACTORIES.get(kind)
        if factory is None:  # not cached: registering it later makes it available
            raise CompilerUnavailable(f"no runtime compiler named {kind!r} is registered (known: {sorted(_FACTORIES)})")
        try:
            comp = factory()
        except (CompilerUnavailable, CompileError) as exc:
            _COMPILER_ERRORS[kind] = str(exc)
            raise CompilerUnavailable(str(exc)) from None
        _COMPILERS[kind] = comp
        return comp


def compiler_unavailable_reason(kind: str) -> Optional[str]:
    try:
        get_compiler(kind)
        return None
    except CompilerUnavailable as exc:
        return str(exc)
