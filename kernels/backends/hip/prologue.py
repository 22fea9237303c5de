"""`prologue="hip"`: quantize Q, K, V with the HIP prologue kernel into a `quant.QuantizedQKV`.

The rule (`hip_prologue_refusal`) is stated once; `hip_quantize_qkv` applies it again before
launching, so a caller that skipped the check gets the reason instead of a wrong launch. The
kernel's name, arguments and geometry come from `kernel_abi.py` (the kernel author's contract).
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import quant
from ...call_spec import AttentionCall
from ...registry import KernelRefused
from .runtime import environment_refusal, kernel_bundle, run_launches

DTYPES = (torch.float16, torch.bfloat16)


def _abi():
    from . import kernel_abi
    return kernel_abi


def prologue_shape_refusal(call: AttentionCall) -> Optional[str]:
    """What the prologue kernels themselves cannot take (the device is judged separately)."""
    if call.dtype not in DTYPES:
        return f"dtype {call.dtype} is not fp16 or bf16"
    try:
        abi = _abi()
    except Exception as exc:
        return f"kernel descriptions (kernel_abi) failed to load: {type(exc).__name__}: {exc}"
    if call.head_dim not in abi.HEAD_DIMS or call.v_head_dim not in abi.HEAD_DIMS:
        return f"head_dim {call.head_dim}/{call.v_head_dim} is not one of {abi.HEAD_DIMS}"
    if call.qk_group not in abi.QK_GROUP_SIZES:
        return f"qk_group {call.qk_group!r} is not one of {tuple(abi.QK_GROUP_SIZES)}"
    if call.has_zero_size:
        return "a zero-size q, k or v"
    if max(call.batch, call.q_heads, call.kv_heads) > 65535 or max(call.q_len, call.kv_len) >= 1 << 31:
        return f"shape ({call.short()}) exceeds the launch grid"
    return None


def hip_prologue_refusal(call: AttentionCall) -> Optional[str]:
    return environment_refusal(call.device_type, call.device_index) or prologue_shape_refusal(call)


def hip_quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float, smooth_k: bool = True,
                     pv: str = "fp8", qk_group: str = "token", smooth_v: bool = False,
                     live=None) -> quant.QuantizedQKV:
    """Quantize HND views (any strides) on their GPU with the HIP prologue, on PyTorch's current stream.

    smooth_v: V's channel mean is taken out before its quantization and returned as `v_mean` (B, Hkv, Dv)
    fp32, which both the HIP and the Triton attention add back to their output. `live` (bool (1 or B, 1 or Hkv,
    Nk), `quant.live_keys` of a key-only mask, or `quant.LiveKeys` already full (B, Hkv, Nk), as the Triton
    mask preparation makes them): only live keys enter the means and scales, as `quant.quantize_qkv_torch(live=...)`."""
    from ...call_spec import describe_call
    call = describe_call(q, k, v, smooth_k=smooth_k, prologue="hip", qk_group=qk_group, smooth_v=smooth_v)
    reason = hip_prologue_refusal(call)
    if reason:
        raise KernelRefused("prologue=hip", reason)
    abi = _abi()
    if live is not None and not isinstance(live, quant.LiveKeys):
        b, hkv, nk = k.shape[:3]
        if live.dim() != 3 or live.dtype != torch.bool or live.shape[0] not in (1, b) or \
                live.shape[1] not in (1, hkv) or live.shape[2] != nk:
            raise ValueError(f"live must be bool (1 or {b}, 1 or {hkv}, {nk}), got {tuple(live.shape)} {live.dtype}")
        live = abi.live_keys(live, b, hkv, nk)
    qq, workspace, launches = abi.prologue_plan(q, k, v, sm_scale=sm_scale, smooth_k=smooth_k, pv=pv,
                                                qk_group=qk_group, smooth_v=smooth_v, live=live)
    run_launches(q.device.index, kernel_bundle(), launches)
    del workspace, live  # freed in stream order: the allocator reuses them only after these launches
    return qq
