"""How many Triton compiles a set of calls costs, counted on the CPU without compiling or running anything.

Triton compiles a jitted kernel once per distinct key: its constexprs and launch options, and per runtime argument
what `native_specialize_impl` makes of it (a tensor's dtype and 16-byte alignment, an integer's width and whether
it is 1 or a multiple of 16). Every Triton launch of the pack goes through `launcher.launch`, which the
`CompileKeys` context replaces with a recorder: each launch's key is kept, nothing runs (outputs stay as
allocated). With `arch` the launch plans are those of that GPU (e.g. "sm_90", "gfx1201"), not the interpreter's.

    with CompileKeys(arch="sm_90") as keys:
        run_self_check(backend_attention(get_backend("triton_int8_fp8"), variant), "cpu", ...)
    keys.count()          # distinct compiles, all kernels
    keys.count("_sage_attn_fwd")
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Tuple

from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from ..backends.triton import attention, backend, configs, masks, prologue

LAUNCHING_MODULES = (attention, prologue, masks)


def fn_name(fn) -> str:
    inner = getattr(fn, "fn", fn)  # JITFunction and InterpretedFunction keep the Python function as .fn
    return getattr(inner, "__name__", repr(fn))


def compile_key(fn, args, meta) -> Tuple:
    """What Triton keys a compiled kernel on for this launch."""
    if hasattr(fn, "params"):  # a JITFunction
        plain = [not p.do_not_specialize for p in fn.params if not p.is_constexpr]
    else:  # the interpreter's InterpretedFunction keeps the decorator's arguments and the names
        skip = set((getattr(fn, "kwargs", None) or {}).get("do_not_specialize") or ())
        plain = [name not in skip for name in getattr(fn, "arg_names", [])[:len(args)]] or [True] * len(args)
    spec = tuple(native_specialize_impl(BaseBackend, a, False, s, True) for a, s in zip(args, plain))
    return fn_name(fn), tuple(sorted((k, repr(v)) for k, v in meta.items())), spec


def shard(launches: List[Tuple], index: int, count: int) -> List[Tuple]:
    """One launch per distinct compile key of `launches` ((fn, grid, args, meta), as precompile.collect_launches
    gives them), those of shard `index` of `count`: the keys in the order of their text, dealt out in turn. Processes
    that collect the same launches each compile a part, none twice, whatever order they collected them in."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}: give 0 <= index < count")
    by_key = {}
    for fn, grid, args, meta in launches:
        by_key.setdefault(repr(compile_key(fn, args, meta)), (fn, grid, args, meta))
    return [by_key[k] for k in sorted(by_key)[index::count]]


class CompileKeys:
    """Records every Triton launch's compile key while active; launches nothing."""

    def __init__(self, arch: Optional[str] = None):
        self.arch = arch
        self.launches: List[Tuple] = []
        self._saved: Dict = {}

    def _record(self, fn, grid, args, meta, key):
        self.launches.append(compile_key(fn, args, meta))
        return None

    def __enter__(self) -> "CompileKeys":
        for module in LAUNCHING_MODULES:
            self._saved[(module, "launch")] = module.launch
            module.launch = self._record
        if self.arch is not None:
            arch = self.arch
            self._saved[(backend, "attention_config")] = backend.attention_config
            backend.attention_config = lambda _arch, d, pv: configs.attention_config(arch, d, pv)
            self._saved[(prologue, "device_arch")] = prologue.device_arch
            prologue.device_arch = lambda _type, _index: arch
            attention.attention_launch.cache_clear()
            prologue.prologue_launch.cache_clear()
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), value in self._saved.items():
            setattr(module, name, value)
        self._saved.clear()
        attention.attention_launch.cache_clear()
        prologue.prologue_launch.cache_clear()
        prologue.WORKSPACES.clear()

    def distinct(self, kernel: Optional[str] = None) -> List[Tuple]:
        return list(dict.fromkeys(k for k in self.launches if kernel is None or k[0] == kernel))

    def count(self, kernel: Optional[str] = None) -> int:
        return len(self.distinct(kernel))

    def per_kernel(self) -> Dict[str, int]:
        return dict(Counter(k[0] for k in self.distinct()))
