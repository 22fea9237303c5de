"""A key-only mask's operands for the HIP kernels, in torch on the mask's device: the FP32 base-2 bias the masked
attention kernels add per key (`quant.key_mask_bias`: -inf on dead keys), the end of each mask row's last live key
(the key loop stops there), and the live keys the prologue's statistics take (`quant.live_keys`). The same values
as the torch spec, bit for bit (the spec's functions; the live keys by quant.live_keys's rule from the dead keys
found once). 15-17 small device operations per masked call (the Triton backend does the same in one launch).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ... import quant
from ...call_spec import key_mask, mask_scope
from .kernel_abi import KeyMaskOperands


class HipKeyMask(NamedTuple):
    """`attention`: what the masked attention kernels take; `live`: bool (1 or B, 1 or Hkv, Nk), for either
    prologue (`hip_quantize_qkv(live=...)`, `triton_quantize_qkv(live=...)`, `quant.quantize_qkv_torch(live=...)`)."""
    attention: KeyMaskOperands
    live: torch.Tensor


def key_mask_operands(attn_mask: torch.Tensor, kv_heads: int, kv_len: int) -> HipKeyMask:
    """The operands of a "keys" mask (call_spec.mask_scope); any other mask is a ValueError (the backend refuses
    those calls first: this keeps a wrong plan from reading row 0 of a per-row mask)."""
    if mask_scope(attn_mask) != "keys":
        raise ValueError(f"a mask {tuple(attn_mask.shape)} that differs between query rows reached the HIP "
                         "kernels, which take key-only masks")
    raw = quant.mask_bias_base2(key_mask(attn_mask, kv_len))  # (Bm, Hm, Nk)
    dead = quant.dead_keys(raw)
    bias = raw.masked_fill(dead, -float("inf")).contiguous()
    position = torch.arange(1, kv_len + 1, dtype=torch.int32, device=raw.device)
    # 1 + the last key that is not dead; at least 1 (a row's largest bias is never dead, nor is any key of a row
    # whose largest bias is -inf or NaN).
    key_end = torch.where(dead, 0, position).amax(dim=-1).to(torch.int32).contiguous()
    # quant.live_keys from the dead keys already found (one pass over the mask fewer): live for a kv head where any
    # q head of its group keeps the key.
    live = ~dead
    if live.shape[1] > 1:
        live = live.unflatten(1, (kv_heads, -1)).any(dim=2)
    return HipKeyMask(KeyMaskOperands(bias, key_end, attn_mask.dtype == torch.bool), live)
