"""`sdpa`: PyTorch scaled_dot_product_attention, exact; the baseline everything is timed against."""
import contextlib
import inspect
import math

import torch
import torch.nn.functional as F

from ..reference import exact_attention
from ..registry import Backend

SDPA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _backend_priority():
    """SDPA's implementations in the order ComfyUI's own attention asks for on a GPU (cuDNN's first, where torch
    has one), or None where this torch cannot set an order. In torch's default order this backend's Flux steps
    on the H200 took 1.127x ComfyUI's; in this order 1.005x (docs/MEASUREMENTS.md, "auto in the step")."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
            return None
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return lambda: sdpa_kernel(order, set_priority=True)


_PRIORITY = _backend_priority()


def _on_gpu_order(q):
    """The context SDPA runs in: ComfyUI's implementation order on a GPU, nothing on the CPU."""
    return _PRIORITY() if _PRIORITY is not None and q.is_cuda else contextlib.nullcontext()


def sdpa_hnd(q, k, v, sm_scale, attn_mask=None, is_causal=False):
    """SDPA on HND tensors, in ComfyUI's implementation order on a GPU."""
    with _on_gpu_order(q):
        return _sdpa_hnd(q, k, v, sm_scale, attn_mask, is_causal)


def _sdpa_hnd(q, k, v, sm_scale, attn_mask, is_causal):
    """SDPA on HND tensors with GQA expanded by view when this torch has no enable_gqa."""
    if attn_mask is None and k.shape[1] == q.shape[1]:  # the common call: nothing to adapt
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=sm_scale)
    kwargs = {}
    if k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    if is_causal and attn_mask is not None:
        # SDPA refuses both at once; fold the causal triangle into the mask (top-left aligned).
        nq, nk = q.shape[2], k.shape[2]
        tri = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
        attn_mask = (attn_mask & tri) if attn_mask.dtype == torch.bool else \
            attn_mask.masked_fill(~tri, float("-inf"))
        is_causal = False
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=sm_scale,
                                          **kwargs)


class SdpaBackend(Backend):
    name = "sdpa"
    description = "PyTorch SDPA (exact)"
    quantized = False

    def _unavailable(self, device_type, index):
        return None if hasattr(F, "scaled_dot_product_attention") else "this torch has no scaled_dot_product_attention"

    def refuse(self, call):
        if call.dtype not in SDPA_DTYPES:
            return f"dtype {call.dtype} is not fp16, bf16 or fp32"
        if call.return_lse:
            return "SDPA does not return the log-sum-exp"
        if call.has_zero_size:
            return "a zero-size q, k or v"
        return None

    def launch(self, q, k, v, call, sm_scale, attn_mask):
        if call.device_type == "cpu" and not _all_finite(q, k, v, attn_mask):
            # torch's CPU SDPA kernel turns NaN/Inf inputs into finite outputs on short sequences (a NaN
            # query row comes out as zeros); exact attention keeps them visible. CPU is no speed path.
            out, _ = exact_attention(q, k, v, is_causal=call.is_causal, sm_scale=sm_scale, attn_mask=attn_mask)
            return out.to(q.dtype), None
        return sdpa_hnd(q, k, v, sm_scale, attn_mask, call.is_causal), None


def _all_finite(q, k, v, attn_mask) -> bool:
    """No NaN/Inf in q, k, v, and no NaN or +Inf in a float mask (-Inf there means 'masked')."""
    # A sum is non-finite when any element is (NaN and Inf propagate); a finite-input sum that overflows
    # only sends the call to the exact path, which is right anyway. One pass, no bool tensor: ~15x cheaper.
    # The three FP32 sums meet as Python floats (FP64: no new overflow; Inf - Inf is NaN), read with one
    # `float` each: torch.isfinite on a 0-d tensor costs more host time than the sum itself.
    f32 = torch.float32
    total = float(q.sum(dtype=f32)) + float(k.sum(dtype=f32)) + float(v.sum(dtype=f32))
    if not math.isfinite(total):
        return False
    if attn_mask is not None and attn_mask.is_floating_point():
        return not bool((torch.isnan(attn_mask) | torch.isposinf(attn_mask)).any())
    return True
