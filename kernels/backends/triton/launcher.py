"""Launching our jitted kernels without Triton's per-launch bookkeeping.

`kernel[grid](...)` (JITFunction.run) re-binds and re-specializes every argument, rebuilds the compile key
as strings and reads its knobs on every launch: with our ~45 arguments that cost 60-100 µs of host time per
launch on the H200's host (tools/host_profile.py), more than the prologue's kernels take on the device at
Flux size. Here the first launch of each specialization goes through Triton's own path, which compiles or
finds the kernel and launches it; later ones call that compiled kernel's launcher directly.

What Triton specializes a compiled kernel on: the constexprs and launch options (fixed per launch plan and
passed as `meta`), the argument dtypes, integers by value class (1, divisible by 16, 64-bit) and pointers by
16-byte alignment. The caller passes `key`, a hashable that must determine all of those that vary between
its calls (`tensor_key` per tensor, the strides as values); the cache is per (device, kernel, meta, key).

Used only with Triton 3.6 (whose compiled-kernel launcher takes the arguments this module passes;
tests/test_triton_launch_gpu.py checks on a GPU that the direct path runs the kernel Triton's own path would
pick), never under the interpreter or while a launch hook is installed (profilers such as proton install one),
and not with SAGE_RDNA4_TRITON_LAUNCH=triton.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import triton
from triton.runtime.jit import JITFunction

from ... import settings

SUPPORTED_TRITON = ((3, 6),)
MAX_ENTRIES = 512


def _triton_version() -> Tuple[int, int]:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return (0, 0)


def fast_launch_refusal() -> str:
    """Why launches go through Triton's own path in this process ('' when the direct path is used)."""
    if settings.triton_launch_through_triton():
        return f"{settings.TRITON_LAUNCH.name}=triton"
    if _triton_version() not in SUPPORTED_TRITON:
        return f"Triton {triton.__version__}: the direct launch is written for Triton 3.6"
    return ""


def tensor_key(t: torch.Tensor) -> Tuple[object, bool]:
    """What Triton specializes a tensor argument on: its dtype and whether its data is 16-byte aligned."""
    return t.dtype, t.data_ptr() % 16 == 0


def _active(hook) -> bool:
    """Whether a launch hook would do anything: Triton 3.6 keeps each as a chain (`.calls`), empty by default."""
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectLauncher:
    """Launches of one compiled (not interpreted) jitted kernel; see `launch`."""

    def __init__(self, fn):
        from triton import knobs
        from triton.runtime import driver
        self.fn = fn
        self._knobs = knobs
        self._driver = driver
        self._compiled: Dict[Hashable, Tuple[object, Tuple[object, ...], dict]] = {}
        self._constexpr_names = [p.name for p in fn.params if p.is_constexpr]
        runtime = len(fn.params) - len(self._constexpr_names)
        self.refusal = fast_launch_refusal()
        if any(p.is_constexpr for p in fn.params[:runtime]):
            self.refusal = f"{fn.__name__}: constexpr parameters must come after the runtime ones"

    def __call__(self, grid: Sequence[int], args: Sequence[object], meta: dict, key: Hashable):
        hooks = self._knobs.runtime
        if self.refusal or _active(hooks.launch_enter_hook) or _active(hooks.launch_exit_hook):
            return self.fn[grid](*args, **meta)
        active = self._driver.active
        device = active.get_current_device()
        full_key = (device, id(meta), key)
        entry = self._compiled.get(full_key)
        if entry is None or entry[2] is not meta:
            kernel = self.fn[grid](*args, **meta)  # Triton's own path: compiles if needed, launches
            if hasattr(kernel, "result"):  # asynchronous compile mode hands out a future
                kernel = kernel.result()
            if len(self._compiled) >= MAX_ENTRIES:  # many distinct strides or plans: start over
                self._compiled.clear()
            self._compiled[full_key] = (kernel, tuple(meta[name] for name in self._constexpr_names), meta)
            return kernel
        kernel, tail, _ = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, active.get_current_stream(device), kernel.function, kernel.packed_metadata,
                   None, None, None, *args, *tail)
        return kernel


_LAUNCHERS: Dict[object, DirectLauncher] = {}
# While set (in this thread or task only: precompile.py), launches are appended here instead of run.
COLLECTING: ContextVar[Optional[List[tuple]]] = ContextVar("sage_rdna4_triton_collecting", default=None)


def launch(fn, grid: Sequence[int], args: Sequence[object], meta: dict, key: Hashable):
    """`fn[grid](*args, **meta)`, directly through the compiled kernel's launcher once this specialization
    was launched before. `args` are the runtime arguments in order (a kernel's constexprs come after them and
    are in `meta` with the launch options); `meta` is reused per launch plan (its identity is part of the key);
    `key` determines everything else Triton specializes on that varies between the caller's calls. Anything
    that is not a compiled JITFunction (the interpreter's kernels, a test's stand-in) is called as usual.
    While COLLECTING holds a list, the launch is appended to it as (fn, grid, args, meta) and nothing runs."""
    sink = COLLECTING.get()
    if sink is not None:
        sink.append((fn, tuple(grid), tuple(args), meta))
        return None
    runner = _LAUNCHERS.get(fn)
    if runner is None:
        if not isinstance(fn, JITFunction):
            return fn[grid](*args, **meta)
        runner = _LAUNCHERS[fn] = DirectLauncher(fn)
    return runner(grid, args, meta, key)
