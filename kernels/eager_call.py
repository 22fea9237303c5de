"""The public API's call as it runs eagerly: describe the call, settle its route, launch the backend."""
from __future__ import annotations

from typing import Optional

import torch

from . import backends  # noqa: F401  (registers every backend lazily)
from .call_spec import describe_call
from .dispatch import settled_route
from .quant import default_sm_scale
from .registry import KernelRefused
from .routing import REFUSE

LAYOUTS = ("HND", "NHD")


def to_hnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "HND" else t.transpose(1, 2)


def eager_attention(q, k, v, tensor_layout: str, is_causal: bool, sm_scale: Optional[float], kernel: str,
                    smooth_k: bool, prologue: str, return_lse: bool, attn_mask, qk_group: str, smooth_v: bool):
    """`kernels.sage_attention` (api.py) with its arguments checked: what it does outside a torch.compile trace,
    and what its op (traced_api.py) does at run time inside one."""
    qh, kh, vh = (to_hnd(t, tensor_layout) for t in (q, k, v))
    call = describe_call(qh, kh, vh, attn_mask=attn_mask, is_causal=is_causal, return_lse=return_lse,
                         smooth_k=smooth_k, prologue=prologue, qk_group=qk_group, smooth_v=smooth_v)
    if sm_scale is None:
        sm_scale = default_sm_scale(call.head_dim)
    # An autograd call is not measured: no quantized kernel takes it (registry.Backend.why_not), and an empty
    # decision made on it would keep auto from measuring that kind of call for the rest of the process.
    tensors = None if call.requires_grad else (qh, kh, vh)
    route = settled_route(call, kernel, tensors=tensors, sm_scale=float(sm_scale), attn_mask=attn_mask)
    if route.kind == REFUSE:
        raise KernelRefused(route.kernel, route.reason)
    out, lse = route.backend.launch(qh, kh, vh, call, float(sm_scale), attn_mask)
    out = to_hnd(out, tensor_layout)
    return (out, lse) if return_lse else out
