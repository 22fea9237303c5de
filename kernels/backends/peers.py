"""Installed peers as backends: comfy-kitchen's INT8 attention and the `sageattention` package.

Their acceptance rules restate the limits each package checks (or crashes on), so that a call they
cannot take is refused here with a reason instead of raising inside them.
"""
import importlib
import importlib.util

import torch

from ..registry import Backend

PEER_DTYPES = (torch.float16, torch.bfloat16)


def _common_gpu_refusal(call, dtypes, max_head_dim):
    if call.dtype not in dtypes:
        return f"dtype {call.dtype} is not one of {', '.join(str(d).replace('torch.', '') for d in dtypes)}"
    if call.head_dim > max_head_dim:
        return f"head_dim {call.head_dim} > {max_head_dim}"
    if call.v_head_dim != call.head_dim:
        return f"v head_dim {call.v_head_dim} differs from q/k head_dim {call.head_dim}"
    if not call.last_dim_contiguous:
        return "the last dimension of q, k or v is strided"
    if call.has_zero_size:
        return "a zero-size q, k or v"
    return None


class ComfyKitchenBackend(Backend):
    name = "comfy_kitchen"
    description = "comfy-kitchen's int8_attention (INT8 Q/K/V, HIP on RDNA3/4, CUDA on SM75+)"

    def _unavailable(self, device_type, index):
        if importlib.util.find_spec("comfy_kitchen") is None:
            return "comfy-kitchen is not installed (pip install comfy-kitchen)"
        ck = importlib.import_module("comfy_kitchen")
        if not hasattr(ck, "int8_attention"):
            return "this comfy-kitchen has no int8_attention (upgrade it)"
        if device_type != "cuda":
            return f"comfy-kitchen int8 attention runs on GPUs, not {device_type}"
        check = getattr(ck, "int8_attention_is_available", None)
        if check is not None and not check(torch.device("cuda", index)):
            return "comfy-kitchen reports its int8 attention kernel is not available on this GPU"
        return None

    def refuse(self, call):
        reason = _common_gpu_refusal(call, (torch.float16, torch.bfloat16, torch.float32), 256)
        if reason:
            return reason
        if call.is_causal:
            return "comfy-kitchen's int8_attention has no causal mode"
        if call.return_lse:
            return "comfy-kitchen's int8_attention does not return the log-sum-exp"
        return None

    def launch(self, q, k, v, call, sm_scale, attn_mask):
        ck = importlib.import_module("comfy_kitchen")
        return ck.int8_attention(q, k, v, scale=sm_scale, attn_mask=attn_mask), None


class SageAttentionBackend(Backend):
    name = "sageattention"
    description = "the installed `sageattention` package's sageattn (SageAttention 1/2)"

    def _unavailable(self, device_type, index):
        if importlib.util.find_spec("sageattention") is None:
            return "the sageattention package is not installed"
        if device_type != "cuda":
            return f"sageattention runs on GPUs, not {device_type}"
        if not hasattr(importlib.import_module("sageattention"), "sageattn"):
            return "this sageattention has no sageattn"
        return None

    def refuse(self, call):
        reason = _common_gpu_refusal(call, PEER_DTYPES, 128)
        if reason:
            return reason
        if call.mask != "none":
            return "sageattn takes no attention mask"
        if call.return_lse:
            return "sageattn's log-sum-exp convention differs between versions and is not verified here"
        return None

    def launch(self, q, k, v, call, sm_scale, attn_mask):
        sage = importlib.import_module("sageattention")
        return sage.sageattn(q, k, v, tensor_layout="HND", is_causal=call.is_causal, sm_scale=sm_scale), None
