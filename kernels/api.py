"""The public entry point, shaped like SageAttention's `sageattn`."""
from __future__ import annotations

from typing import Optional

import torch

from . import traced_api  # noqa: F401  (registers the op a torch.compile trace records)
from .eager_call import LAYOUTS, eager_attention


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
    if torch.compiler.is_compiling() and traced_api.sage_attention_op is not None:  # one opaque op in a trace
        out, lse = traced_api.sage_attention_op(q, k, v, attn_mask, tensor_layout, bool(is_causal),
                                                  None if sm_scale is None else float(sm_scale), kernel,
                                                  bool(smooth_k), prologue, bool(return_lse), qk_group, bool(smooth_v))
        return (out, lse) if return_lse else out
    return eager_attention(q, k, v, tensor_layout, is_causal, sm_scale, kernel, smooth_k, prologue, return_lse,
                           attn_mask, qk_group, smooth_v)
