"""ComfyUI's attention calling convention <-> the kernels' HND layout, both ways: the call's arguments bound once
(`AttentionArgs`), their HND views, and the output in the call site's layout."""
from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

_POSITIONAL = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")
_DEFAULTS = {"mask": None, "attn_precision": None, "skip_reshape": False, "skip_output_reshape": False}
_REQUIRED = ("q", "k", "v", "heads")


class AttentionArgs(NamedTuple):
    """ComfyUI's attention arguments, named once whether they came by position or keyword
    (`f(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)`)."""
    q: Any
    k: Any
    v: Any
    heads: Any
    mask: Any = None
    attn_precision: Any = None
    skip_reshape: bool = False
    skip_output_reshape: bool = False

    def signature(self) -> Optional[tuple]:
        """The key of the call's plan (sage_patch/call_plans.py), or None when its parts are not tensors (such a
        call takes the uncached path, which reports it). Everything a plan's decisions read: shapes, strides, dtypes
        and devices (a mask's strides tell a key-only expand from a per-row mask), `heads`, both reshape flags, and
        whether the call needs a gradient. The tensors' classes are part of it: a plan's strided views
        (`strided_layout`) are made for plain tensors only."""
        q, k, v, mask = self.q, self.k, self.v, self.mask
        try:
            # The kernels refuse autograd calls (call_spec.AUTOGRAD_REFUSAL): a plan made for one must not serve an
            # inference call of the same shapes, nor the other way round.
            grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                or (mask is not None and mask.requires_grad))
            return (self.heads, bool(self.skip_reshape), bool(self.skip_output_reshape), grad,
                    q.__class__, q.shape, q.stride(), q.dtype, q.device,
                    k.__class__, k.shape, k.stride(), k.dtype, k.device,
                    v.__class__, v.shape, v.stride(), v.dtype, v.device,
                    None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.device))
        except (AttributeError, TypeError, RuntimeError):
            return None


_new_tuple = tuple.__new__


def bind_attention_args(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> AttentionArgs:
    """Name ComfyUI's attention arguments whether they came by position or keyword; TypeError for a call that
    does not follow the convention."""
    if len(args) == 4:  # ComfyUI's own calls: q, k, v, heads by position, the rest by keyword (the hit path)
        get = kwargs.get
        # tuple.__new__ skips the NamedTuple's Python-level __new__: every attention call comes through here
        return _new_tuple(AttentionArgs, (*args, get("mask"), get("attn_precision"), get("skip_reshape", False),
                                          get("skip_output_reshape", False)))
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"attention called with {len(args)} positional arguments")
    bound = dict(_DEFAULTS)
    bound.update(zip(_POSITIONAL, args))
    for name in _POSITIONAL[len(args):]:
        if name in kwargs:
            bound[name] = kwargs[name]
    missing = [n for n in _REQUIRED if n not in bound]
    if missing:
        raise TypeError(f"attention called without {', '.join(missing)}")
    return AttentionArgs(**bound)


def to_hnd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, skip_reshape: bool):
    """Return HND views (no copy) of ComfyUI's q, k, v.

    ComfyUI passes (b, n, heads*d) unless `skip_reshape`, in which case (b, h, n, d) already. K and V may
    carry fewer heads than Q (grouped-query attention, `enable_gqa=True` in ComfyUI 2026): their head
    count is read from their own width, as ComfyUI's `_reshape_qkv_to_heads` does, never assumed to be
    `heads`. A width that is not a whole number of heads raises ValueError."""
    if skip_reshape:
        return q, k, v
    return hnd_views(q, k, v, head_split_shapes(q, k, v, heads))


def head_split_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int):
    """The (b, n, h, d) shapes that `to_hnd` views q, k, v as: a function of their shapes and `heads` only,
    so a caller may keep them for later calls of the same shapes. Raises ValueError as `to_hnd` does."""
    b = q.shape[0]
    if heads <= 0 or q.shape[-1] % heads:
        raise ValueError(f"q width {q.shape[-1]} is not a multiple of heads={heads}")
    d = q.shape[-1] // heads
    k_width, v_width = _token_width(k), _token_width(v)
    if k_width % d:
        raise ValueError(f"k width {k_width} is not a multiple of the head size {d}")
    kv_heads = k_width // d
    if kv_heads <= 0 or v_width % kv_heads:
        raise ValueError(f"v width {v_width} is not a multiple of the {kv_heads} k/v heads")
    dv = v_width // kv_heads
    return (b, -1, heads, d), (b, -1, kv_heads, d), (b, -1, kv_heads, dv)


def _token_width(t: torch.Tensor) -> int:
    """Elements per token: ComfyUI's attention views k and v as (b, -1, heads, d), so a (b, n, heads, d) tensor
    passes as well as a (b, n, heads * d) one (SD3's MMDiT hands v over unflattened)."""
    return t.shape[-1] if t.dim() <= 3 else math.prod(t.shape[2:])


def hnd_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shapes):
    """q, k, v viewed as (b, h, n, d) through `head_split_shapes`' shapes (None: they are HND already)."""
    if shapes is None:
        return q, k, v
    q_shape, k_shape, v_shape = shapes
    # view(*shape): torch parses separate ints faster than one tuple (measurable at ~57 calls a step)
    return q.view(*q_shape).transpose(1, 2), k.view(*k_shape).transpose(1, 2), v.view(*v_shape).transpose(1, 2)


def strided_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[tuple]:
    """(shape, stride) of HND views made by `hnd_views`, for `strided_hnd` to remake them on tensors of the same
    shapes and strides; None unless all three are plain tensors (a subclass may not take `as_strided`)."""
    if not (type(q) is type(k) is type(v) is torch.Tensor):
        return None
    return tuple((tuple(t.shape), t.stride()) for t in (q, k, v))


def strided_hnd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: tuple):
    """The views `hnd_views` makes, as one `as_strided` each instead of a view and a transpose (half the host
    time). Only for tensors of the shapes and strides `layout` was taken from (same storage offset: kept)."""
    (qs, qt), (ks, kt), (vs, vt) = layout
    return q.as_strided(qs, qt), k.as_strided(ks, kt), v.as_strided(vs, vt)


def from_hnd(out: torch.Tensor, skip_output_reshape: bool) -> torch.Tensor:
    """(b, h, n, d) -> what the call site expects: (b, n, h*d) unless `skip_output_reshape`."""
    if skip_output_reshape:
        return out
    # flatten(2) is reshape(b, n, h * d) (the same view, or the same copy) for less host time than reading the shape
    return out.transpose(1, 2).flatten(2)


def expand_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """ComfyUI's rule (attention_pytorch): a 2-D mask gains a batch dim, a 3-D mask a heads dim."""
    if mask is None:
        return None
    if mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    return mask


# What reading a call ComfyUI sent can raise when the call is not one we can read (heads not dividing the width, a
# batch of 0, parts that are not tensors): the override hands such a call on unchanged.
MALFORMED = (RuntimeError, ValueError, TypeError, AttributeError, IndexError, ZeroDivisionError)


def hnd_inputs(bound: AttentionArgs, plan=None):
    """(q, k, v, mask, view shapes, strided layout) of a bound ComfyUI call: q, k, v as HND views, its mask as
    ComfyUI's attention broadcasts it. `plan` (call_plans.CallPlan) is the one kept for the call's signature: its
    views are remade from its strides. The view shapes are None when the call came HND; the strided layout
    (`strided_layout`) is what a new plan keeps for its later calls."""
    q, k, v = bound.q, bound.k, bound.v
    if plan is not None:
        view_shapes, strided = plan.view_shapes, plan.strided
        if strided is not None:
            q, k, v = strided_hnd(q, k, v, strided)  # the miss's views: cannot fail
        else:
            q, k, v = hnd_views(q, k, v, view_shapes)
    else:
        view_shapes = None if bound.skip_reshape else head_split_shapes(q, k, v, bound.heads)
        q, k, v = hnd_views(q, k, v, view_shapes)
        strided = strided_layout(q, k, v) if view_shapes is not None else None
    return q, k, v, expand_mask(bound.mask), view_shapes, strided
