"""A key-only mask's operands for the Triton kernels, in one launch: the FP32 base-2 bias the attention adds per key
(`quant.key_mask_bias`: -inf on dead keys), the end of each mask row's last live key (the attention stops there),
whether the row is plain padding (the attention then runs the unmasked key loop up to that end), and the live keys
with their count per (batch, kv head) that the prologue's statistics take (`quant.live_keys`).
The same values as the torch spec, bit for bit; done in torch they were about a dozen small launches per call.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import quant
from ...call_spec import key_mask
from .launcher import launch, tensor_key

PREP_BLOCK = 1024
_FP32_MAX = tl.constexpr(quant.FP32_MAX)
_LOG2E = tl.constexpr(quant.LOG2E)
_DEAD_KEY_RANGE = tl.constexpr(quant.DEAD_KEY_RANGE)


class KeyMaskOperands(NamedTuple):
    """`key_mask_operands`' result: bias (Bm, Hm, Nk) FP32 contiguous, key_end (Bm, Hm) int32, plain (Bm, Hm) int8
    (1 where every key before key_end is live with bias exactly 0: the dead keys are a suffix, a padding mask's
    row) and the prologue's LiveKeys."""
    bias: torch.Tensor
    key_end: torch.Tensor
    plain: torch.Tensor
    live: "LiveKeys"


LiveKeys = quant.LiveKeys  # what the prologue reads (also the HIP prologue's operands)


def live_keys_operands(live: torch.Tensor, b: int, hkv: int) -> LiveKeys:
    """`quant.live_keys`'s bool (1 or B, 1 or Hkv, Nk) as the prologue's operands (torch: the public path)."""
    count = live.expand(b, hkv, live.shape[-1]).sum(dim=-1, dtype=torch.float64).clamp_min(1).reshape(-1)
    return LiveKeys(live.to(torch.int8).contiguous(), count)


@triton.jit
def _bias(m, IS_BOOL: tl.constexpr):
    """quant.mask_bias_base2 of loaded mask values (bool as uint8)."""
    if IS_BOOL:
        return tl.where(m != 0, 0.0, float("-inf"))
    x = m.to(tl.float32)
    y = x * _LOG2E
    y = tl.where(y < -_FP32_MAX, -_FP32_MAX, y)  # keeps NaN
    return tl.where(x == float("-inf"), x, y)


@triton.jit(do_not_specialize=["Bm", "Hm", "Hkv", "Nk"])
def _key_mask_prep(M, BIAS, KEND, PLAIN, LIVE, COUNT, smb, smh, smn, sbb, sbh, Bm, Hm, Hkv, Nk,
                   GROUP: tl.constexpr, PER_HEAD: tl.constexpr, IS_BOOL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (batch, kv head): for each mask head its kv head sees (GROUP of them with a mask per q head,
    else the one), the largest bias, then the bias (stored once per mask row) and the live flags (OR over the
    heads), then the live count. KEND (Bm, Hm) int32: 1 + the last key of the mask row that is not dead; PLAIN
    (Bm, Hm) int8: 1 where the row's live keys are exactly [0, KEND) and all have bias 0 (NaN is not 0)."""
    pid = tl.program_id(0)
    b = pid // Hkv
    hk = pid % Hkv
    bm = tl.where(Bm > 1, b, 0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live_row = LIVE + pid.to(tl.int64) * Nk
    if PER_HEAD:  # the program that stores this mask row's bias
        writer = b < Bm
    else:
        writer = (b < Bm) & (hk == 0)
    for j in tl.static_range(GROUP):
        if PER_HEAD:
            hm = (hk * GROUP + j).to(tl.int64)
        else:
            hm = tl.zeros([], dtype=tl.int64)
        m_row = M + bm * smb + hm * smh
        top = tl.full([], float("-inf"), tl.float32)
        n0 = 0
        while n0 < Nk:  # while: Triton 3.6's interpreter takes no runtime range() bound
            n = n0 + offs
            x = tl.where(n < Nk, _bias(tl.load(m_row + n * smn, mask=n < Nk, other=0), IS_BOOL), float("-inf"))
            step = tl.max(x, 0)
            nan = (tl.max((x != x).to(tl.int32), 0) > 0) | (top != top)
            top = tl.where(nan, float("nan"), tl.maximum(top, step))
            n0 += BLOCK
        n0 = 0
        end = tl.zeros([BLOCK], dtype=tl.int32)
        n_live = tl.zeros([BLOCK], dtype=tl.int32)
        biased = tl.zeros([BLOCK], dtype=tl.int32)  # live keys whose bias is not exactly 0
        while n0 < Nk:
            n = n0 + offs
            x = _bias(tl.load(m_row + n * smn, mask=n < Nk, other=0), IS_BOOL)
            dead = x < top - _DEAD_KEY_RANGE  # NaN compares false: live
            tl.store(BIAS + bm * sbb + hm * sbh + n, tl.where(dead, float("-inf"), x), mask=(n < Nk) & writer)
            end = tl.maximum(end, tl.where(dead | (n >= Nk), 0, n + 1))
            live = dead == 0
            row_live = live & (n < Nk)
            n_live += row_live.to(tl.int32)
            biased = tl.maximum(biased, (row_live & (x != 0)).to(tl.int32))  # NaN != 0: biased
            if j > 0:
                live = live | (tl.load(live_row + n, mask=n < Nk, other=0) != 0)
            tl.store(live_row + n, live.to(tl.int8), mask=n < Nk)
            n0 += BLOCK
        key_end = tl.max(end, 0)
        # Plain padding: no live key carries a bias and none is dead before the end (live count == end).
        plain = (tl.max(biased, 0) == 0) & (tl.sum(n_live, 0) == key_end)
        tl.store(KEND + bm * Hm + hm, key_end, mask=writer)
        tl.store(PLAIN + bm * Hm + hm, plain.to(tl.int8), mask=writer)
    total = tl.zeros([BLOCK], dtype=tl.int32)
    n0 = 0
    while n0 < Nk:
        n = n0 + offs
        total += tl.load(live_row + n, mask=n < Nk, other=0).to(tl.int32)
        n0 += BLOCK
    tl.store(COUNT + pid, tl.maximum(tl.sum(total, 0), 1).to(tl.float64))


_META = {}


def key_mask_operands(attn_mask: torch.Tensor, b: int, hq: int, hkv: int, nk: int) -> KeyMaskOperands:
    """A key-only mask's KeyMaskOperands (LiveKeys' flags (B, Hkv, Nk)), in one launch."""
    m = key_mask(attn_mask, nk)
    bm, hm = m.shape[0], m.shape[1]
    is_bool = m.dtype == torch.bool
    if is_bool:
        m = m.view(torch.uint8)
    dev = m.device
    bias = torch.empty((bm, hm, nk), dtype=torch.float32, device=dev)
    key_end = torch.empty((bm, hm), dtype=torch.int32, device=dev)
    plain = torch.empty((bm, hm), dtype=torch.int8, device=dev)
    flags = torch.empty((b, hkv, nk), dtype=torch.int8, device=dev)
    count = torch.empty((b * hkv,), dtype=torch.float64, device=dev)
    per_head = hm > 1
    group = hq // hkv if per_head else 1
    key = (group, per_head, is_bool)
    meta = _META.get(key)
    if meta is None:
        meta = _META.setdefault(key, dict(GROUP=group, PER_HEAD=per_head, IS_BOOL=is_bool, BLOCK=PREP_BLOCK,
                                          num_warps=4))
    strides = (m.stride(0) if bm > 1 else 0, m.stride(1) if hm > 1 else 0, m.stride(2) if nk > 1 else 0)
    args = (*strides, bias.stride(0), bias.stride(1), bm, hm, hkv, nk)
    # Triton specializes the integers by value class: the values themselves are the key.
    launch(_key_mask_prep, (b * hkv,), (m, bias, key_end, plain, flags, count, *args), meta, (tensor_key(m), args))
    return KeyMaskOperands(bias, key_end, plain, LiveKeys(flags, count))
