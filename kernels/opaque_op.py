"""Registering a function as a torch operator that torch.compile records without tracing into it.

`define_opaque_op` defines `torch.ops.sage_rdna4.<name>` from a Python function (its schema inferred from the type
hints), runs it as the op's body, and gives a meta implementation for fake tensors. It goes through
`torch.library.Library` rather than `custom_op`, whose fake registration reads its caller's source through
`inspect` and fails inside a process where a module has no file name (seen in a ComfyUI process). Each copy of the
pack a process loads (ComfyUI's, and a test's) names its ops apart, so neither finds the other's registered.
"""
from __future__ import annotations

import hashlib
from typing import Callable, List

import torch

NAMESPACE = "sage_rdna4"
_LIBRARIES: List[object] = []  # a Library unregisters its ops when collected: kept for the process


def own_output(out, inputs):
    """`out` as an op may return it: contiguous (the strides its meta implementation gives) and sharing no input's
    storage (an op's output must not alias its inputs)."""
    out = out.contiguous()
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in inputs):
        out = out.clone()
    return out


def op_name(base: str, package: str) -> str:
    """`base` with a suffix naming the pack copy `package` (a module's __name__ prefix)."""
    return f"{base}_{hashlib.sha1(package.encode()).hexdigest()[:8]}"


def _existing(name: str):
    try:
        return getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return None


def define_opaque_op(name: str, fn: Callable, fake: Callable) -> object:
    """The op `torch.ops.sage_rdna4.<name>`: `fn` its body, `fake` its meta implementation. Raises when torch cannot
    register it (the caller then keeps the eager path)."""
    found = _existing(name)
    if found is not None:  # this module imported again (a reload): its body is the same module's function
        return found
    schema = torch.library.infer_schema(fn, mutates_args=())
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)  # the body runs host work a CUDA graph cannot replay
    try:
        library.define(name + schema, tags=(tag,) if tag is not None else ())
    except TypeError:  # a torch whose define takes no tags
        library.define(name + schema)
    library.impl(name, fn, "CompositeExplicitAutograd")
    library.impl(name, fake, "Meta")
    _LIBRARIES.append(library)
    return getattr(getattr(torch.ops, NAMESPACE), name)


def try_define(name: str, fn: Callable, fake: Callable):
    """(op, None), or (None, why it could not be registered)."""
    try:
        return define_opaque_op(name, fn, fake), None
    except Exception as exc:  # never a reason to fail importing the pack
        return None, f"{type(exc).__name__}: {exc}"

