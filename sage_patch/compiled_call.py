"""The override inside a torch.compile trace: every attention call becomes one opaque custom op.

Dynamo never traces the override (its plans, locks, stats, auto's trials and watch, self-checks, file caches)
nor our kernels. At trace time the override only names the call: its tensors, `heads`, the layout flags, the
transformer_options the policies read, and the call site's attention by module and name. It emits
`sage_rdna4::attention_<copy>`, whose body at run time is the eager override. So a compiled model gets the same plans,
policies, auto measuring in the step, watch and stats as an eager one, our Triton kernels are never handed to
inductor, and nothing checks, compiles or measures under a fake tensor.

One op whose body dispatches at run time, rather than one op per backend: a route can change between steps
(auto deciding, the watch reverting, a self-check disabling a kernel), and a per-backend op baked into a graph
could not follow it without recompiling.

The op returns (b, h, n, d) and the graph itself reshapes it as the call site asked, as in the unpatched graph,
where SDPA returns (b, h, n, d): inductor then fuses that reshape into what reads the output (Flux's single blocks
concatenate it with their MLP). An op returning the call site's (b, n, h*d) would make that copy itself, eagerly,
on every call `auto` hands back to exact attention.

What does not cross: keyword arguments the op does not carry (another pack's) and a call site whose attention
is not a module-level function (found again by its module and name at run time). Such a call runs the call
site's own attention inside the graph, as without the patch, and is not counted.
"""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Optional

import torch

from ..kernels.opaque_op import op_name, own_output, try_define
from .layouts import AttentionArgs, bind_attention_args, from_hnd, hnd_inputs

# ComfyUI's attention keywords the op carries; a call with any other keyword is not ours under compile.
CARRIED = frozenset({"q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape",
                     "transformer_options", "_inside_attn_wrapper", "scale", "enable_gqa", "low_precision_attention"})
NO_BLOCK = -1  # block_index / total_blocks the model did not pass

_OVERRIDES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT_ID = [0]


def register(override) -> int:
    """The id a trace names `override` by (made once, eagerly, when the override is built)."""
    _NEXT_ID[0] += 1
    _OVERRIDES[_NEXT_ID[0]] = override
    return _NEXT_ID[0]


def _site_name(func) -> Optional[str]:
    """'module:name' of the call site's attention, or None when it cannot be found again by that name."""
    name, module = getattr(func, "__name__", None), getattr(func, "__module__", None)
    if not isinstance(name, str) or not isinstance(module, str) or "<" in name:
        return None
    return f"{module}:{name}"


def _site(site: str):
    module, _, name = site.partition(":")
    found = getattr(sys.modules.get(module), name, None)
    if found is None:
        raise RuntimeError(f"sage_rdna4: the attention {site} of a compiled call cannot be found at run time")
    return found


def traced_call(override_id: int, func, args, kwargs, uses_steps: bool) -> torch.Tensor:
    """At trace time: the call as one `sage_rdna4::attention` op; a call that cannot cross (see the module) runs
    the call site's own attention inside the graph. The sigmas cross only when a step policy reads them: the
    schedule's length is part of the graph's guards, so carrying it always would recompile the model whenever the
    user changes the number of steps."""
    try:
        bound = bind_attention_args(args, kwargs)
    except TypeError:  # not ComfyUI's calling convention: the call site's attention judges it
        return func(*args, **kwargs)
    site = _site_name(func)
    if site is None or not CARRIED.issuperset(kwargs):
        return func(*args, **kwargs)
    to = kwargs.get("transformer_options") or {}
    block, total = to.get("block_index"), to.get("total_blocks")
    sigmas, schedule = (to.get("sigmas"), to.get("sample_sigmas")) if uses_steps else (None, None)
    out = attention_op(
        bound.q, bound.k, bound.v, bound.mask, sigmas, schedule, override_id,
        site, int(bound.heads), bool(bound.skip_reshape),
        bound.attn_precision, kwargs.get("scale"), bool(kwargs.get("enable_gqa", False)),
        kwargs.get("low_precision_attention", True) is not False,
        NO_BLOCK if block is None else int(block), NO_BLOCK if total is None else int(total))
    return from_hnd(out, bool(bound.skip_output_reshape))


def _hnd_output_shape(q, k, v, heads: int, skip_reshape: bool) -> torch.Size:
    """(b, h, nq, dv) of the call (layouts' own rules), without running anything."""
    qh, _, vh, _, _, _ = hnd_inputs(AttentionArgs(q, k, v, heads, skip_reshape=skip_reshape))
    return torch.Size((*qh.shape[:3], vh.shape[-1]))


def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
        sigmas: Optional[torch.Tensor], sample_sigmas: Optional[torch.Tensor], override_id: int, site: str,
        heads: int, skip_reshape: bool, attn_precision: Optional[torch.dtype],
        scale: Optional[float], enable_gqa: bool, low_precision: bool, block_index: int,
        total_blocks: int) -> torch.Tensor:
    """At run time: the eager override, with the keywords the call carried, asked for (b, h, n, d)."""
    override = _OVERRIDES.get(override_id)
    if override is None:
        raise RuntimeError(f"sage_rdna4: a compiled graph names patch {override_id}, which no longer exists")
    to = {}
    for key, value in (("sigmas", sigmas), ("sample_sigmas", sample_sigmas), ("block_index", block_index),
                       ("total_blocks", total_blocks)):
        if value is not None and not (isinstance(value, int) and value == NO_BLOCK):
            to[key] = value
    kwargs = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                  skip_output_reshape=True, transformer_options=to, _inside_attn_wrapper=True)
    if scale is not None:
        kwargs["scale"] = scale
    if enable_gqa:
        kwargs["enable_gqa"] = True
    if not low_precision:
        kwargs["low_precision_attention"] = False
    out = override(_site(site), q, k, v, heads, **kwargs)
    if out.ndim == 3:  # a call site's attention that ignores skip_output_reshape gave (b, n, h*d)
        b, h, n, dv = _hnd_output_shape(q, k, v, heads, skip_reshape)
        out = out.view(b, n, h, dv).transpose(1, 2)
    return own_output(out, (q, k, v))


def _fake(q, k, v, mask, sigmas, sample_sigmas, override_id, site, heads, skip_reshape,
          attn_precision, scale, enable_gqa, low_precision, block_index, total_blocks):
    """The output's shape, dtype and device without running anything."""
    return q.new_empty(_hnd_output_shape(q, k, v, heads, skip_reshape))


# One op per copy of the pack in the process; None (with the reason) where torch could not register it, and then
# the override runs eagerly inside traces (sage_patch/override.py asks `TRACEABLE`).
attention_op, OP_PROBLEM = try_define(op_name("attention", __name__), _op, _fake)
TRACEABLE = attention_op is not None
if OP_PROBLEM:
    logging.getLogger("sage_rdna4").warning("[sage_rdna4] under torch.compile the patch runs eagerly (graph breaks): "
                                            "its op could not be registered: %s", OP_PROBLEM)
