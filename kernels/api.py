"""The public entry point, shaped like SageAttention's `sageattn`."""
from __future__ import annotations

from typing import Optional

import torch

from . import (
    backends,  # noqa: F401  (registers every backend lazily)
    traced_api,  # noqa: F401  (registers the op a torch.compile trace records)
)
from .call_spec import describe_call
from .dispatch import settled_route
from .quant import default_sm_scale
from .registry import KernelRefused
from .routing import REFUSE

LAYOUTS = ("HND", "NHD")


def to_hnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "HND" else t.transpose(1, 2)


def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_layout: str = "HND",
                   is_causal: bool = False, sm_scale: Optional[float] = None, kernel: str = "auto",
                   smooth_k: bool = True, prologue: str = "auto", return_lse: bool = False,
                   attn_mask: Optional[torch.Tensor] = None, qk_group: str = "token", smooth_v: bool = False):
    """Quantized attention. `tensor_layout` "HND" is (B, H, N, D); "NHD" is (B, N, H, D).

    k/v may have fewer heads than q (GQA). `attn_mask` (2-4 dims) broadcasts to (B, Hq, Nq, Nk): bool
    selects, floating is added to the scores (natural-log units); other dtypes raise ValueError. A call that
    needs a gradient (grad mode on, an input requiring grad) is refused by every quantized kernel: `auto`
    takes SDPA, an explicit quantized kernel raises KernelRefused. `kernel="auto"` picks the best backend that
    accepts the call (on a GPU: the fastest measured at first use, kernels/tuner.py); an explicit
    name runs exactly that backend or raises KernelRefused with the reason. `smooth_v` takes V's
    per-channel mean out before quantizing and adds it back to the output (exact; docs/MEASUREMENTS.md,
    "Why smooth_v is off", says when it helps). Returns the output in q's layout and dtype, and with
    `return_lse` also the natural-log LSE (B, Hq, Nq) in FP32.
    """
    if tensor_layout not in LAYOUTS:
        raise ValueError(f"tensor_layout must be 'HND' or 'NHD', got {tensor_layout!r}")
    if torch.compiler.is_compiling():  # inside a torch.compile trace: one opaque op, this function at run time
        out, lse = torch.ops.sage_rdna4.sage_attention(q, k, v, attn_mask, tensor_layout, bool(is_causal),
                                                       None if sm_scale is None else float(sm_scale), kernel,
                                                       bool(smooth_k), prologue, bool(return_lse), qk_group,
                                                       bool(smooth_v))
        return (out, lse) if return_lse else out
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
