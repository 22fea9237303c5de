"""The quantization steps of the numerical spec, in torch. Kernels must reproduce these.

All math is FP32 unless stated. Tensors are HND: (B, H, N, D).

* smooth_k: mean over tokens per (batch, head, channel), summed in FP64, subtracted in FP32.
* smooth_v (optional): the same mean taken out of V before its quantization and added back to the
  output after normalising (exact: every softmax row sums to 1). It shrinks V's FP8 scale and keeps
  the P.V accumulator small where V carries a per-channel offset.
* INT8 Q and K: x = t.float() * mult (for Q, mult = sm_scale * log2(e), so scores are base 2);
  per group amax = max|x| (clamped to FP32 tiny); q8 = rint(x * (127 / amax)) clamped to [-127, 127];
  scale = amax / 127. Groups are single tokens ("token") or blocks of 32/64/128 tokens.
* V for FP8 P.V: per (batch, head, channel) scale = amax_over_tokens / 448 (clamped to tiny);
  v8 = e4m3(clamp(v / scale, +-448)); nothing can overflow e4m3.
* V for FP16 P.V: per channel the power of two 2**e that brings amax/2**e into (2**14, 2**15]
  (`fp16_v_scale`), up or down, so small V keeps FP16's full precision instead of sinking into its
  subnormals; a power of two is exact for FP16 inputs. The top leaves 2x below FP16's max for the
  rounding of V and of the output. The scale never goes below FP32's smallest normal (2**-126, also an
  all-zero channel's scale); NaN/Inf amax give a NaN/Inf scale.
* P for FP8: e4m3(448 * 2**(s - top)), top the row max (p_tile None) or, with p_tile, each tile of p_tile keys'
  own max, floored FP8_TILE_SHIFT_RANGE below the running max (reference.fp8_p_tops); the row sum adds the
  unrounded P, so the 448 and each tile's top cancel in acc / row sum.
* P for FP16: fp16(p * 2**FP16_P_LOG2_TOP) with p = 2**(s - row max) in [0, 1]: every weight above 2**-29 of the
  max is an fp16 normal, which a WMMA that flushes subnormal inputs reads whole.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Tuple

import torch

LOG2E = 1.4426950408889634
FP8_MAX = 448.0
INT8_MAX = 127.0
FP16_SAFE = 32768.0         # top of FP16 V's range after scaling: amax / scale lies in (2**14, 2**15]
FP16_V_SCALE_MIN = 2.0 ** -126  # FP32's smallest normal: the scale, and 1 / scale, stay normal
_TINY = torch.finfo(torch.float32).tiny
# The P grid (the spec, the HIP and the Triton kernels): FP16 P tops at 2**15; FP8 P tiles' tops stay within 64
# (base 2) of the running max, so an accumulator in units of a tile's top stays far from FP32's overflow.
FP16_P_LOG2_TOP = 15.0
FP8_TILE_SHIFT_RANGE = 64.0
# The smallest normals of e4m3 and fp16: what a WMMA that flushes subnormal inputs still reads.
E4M3_MIN_NORMAL = 2.0 ** -6
FP16_MIN_NORMAL = 2.0 ** -14


def group_size(qk_group: str) -> int:
    """Tokens per quantization group; 1 means per token."""
    return 1 if qk_group == "token" else int(qk_group.replace("block", ""))


def token_mean(x: torch.Tensor) -> torch.Tensor:
    """FP32 mean over tokens (summed in FP64), shape (B, H, 1, D); zeros when there is no token."""
    if not x.shape[2]:
        return x.new_zeros((*x.shape[:2], 1, x.shape[3]), dtype=torch.float32)
    return x.double().mean(dim=2, keepdim=True).float()


def smooth_keys(k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return (k - mean) in FP32 and the FP32 mean, shape (B, H, 1, D)."""
    mean = token_mean(k)
    return k.float() - mean, mean


def smooth_values(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return (v - mean) in FP32 and the FP32 mean, shape (B, H, 1, Dv): smooth_v's prologue half."""
    mean = token_mean(v)
    return v.float() - mean, mean


def quantize_int8(x: torch.Tensor, mult: float = 1.0, group: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """INT8 per token (group=1) or per block of `group` tokens along dim 2.

    Returns (int8 tensor like x, FP32 scales (B, H, N) with each token carrying its group's scale)."""
    xf = x.float() * mult if mult != 1.0 else x.float()
    b, h, n, d = xf.shape
    if group == 1:
        amax = xf.abs().amax(dim=-1)
    else:
        pad = (-n) % group
        a = xf.abs().amax(dim=-1)
        if pad:
            a = torch.nn.functional.pad(a, (0, pad))
        amax = a.view(b, h, (n + pad) // group, group).amax(dim=-1).repeat_interleave(group, dim=-1)[..., :n]
    amax = amax.clamp_min(_TINY)
    inv = (INT8_MAX / amax).unsqueeze(-1)
    q8 = torch.round(xf * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q8, amax / INT8_MAX


def quantize_v_fp8(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel e4m3 V and its FP32 scale (B, H, 1, Dv)."""
    vf = v.float()
    amax = vf.abs().amax(dim=2, keepdim=True) if v.shape[2] else vf.new_zeros((*v.shape[:2], 1, v.shape[3]))
    scale = (amax / FP8_MAX).clamp_min(_TINY)
    v8 = (vf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return v8, scale


def fp16_v_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power of two 2**e with amax / 2**e in (2**14, 2**15], at least 2**-126; NaN/Inf amax stay.

    Built from the bits (x = amax * 2**-15 rounded up to a power of two), not from log2, which rounds
    to the integer just above a power of two: the prologues do the same in bits."""
    x = torch.clamp_min(amax.float() * (1.0 / FP16_SAFE), FP16_V_SCALE_MIN)  # exact above the floor; keeps NaN
    bits = x.view(torch.int32)
    up = ((bits & 0x7FFFFF) != 0) & torch.isfinite(x)
    return torch.where(up, (bits & 0x7F800000) + 0x800000, bits).view(torch.float32)


def quantize_v_fp16(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP16 V with a per-channel power-of-two scale (B, H, 1, Dv) from `fp16_v_scale`: |v16| <= 32768."""
    vf = v.float()
    amax = vf.abs().amax(dim=2, keepdim=True) if v.shape[2] else vf.new_zeros((*v.shape[:2], 1, v.shape[3]))
    scale = fp16_v_scale(amax)
    return (vf / scale).to(torch.float16), scale


def quantize_p_fp8(p: torch.Tensor) -> torch.Tensor:
    """Probabilities in [0, 1] to e4m3 after multiplying by 448 (returned as FP32 values)."""
    return (p * FP8_MAX).to(torch.float8_e4m3fn).float()


def qk_multiplier(sm_scale: float) -> float:
    """The factor folded into Q's scale: scores come out in base 2."""
    return float(sm_scale) * LOG2E


def default_sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


class QuantizedQKV:
    """What a prologue hands to an attention kernel; every prologue (torch, triton, hip) fills this.

    q8 int8 (B, Hq, Nq, D) contiguous     q_scale fp32 (B, Hq, Nq)   per token (a block's scale repeated)
    k8 int8 (B, Hkv, Nk, D) contiguous    k_scale fp32 (B, Hkv, Nk)
    v  e4m3 or fp16 (B, Hkv, Nk, Dv) contiguous   v_scale fp32 (B, Hkv, Dv)
    k_mean fp32 (B, Hkv, D) or None (smooth_k off)
    v_mean fp32 (B, Hkv, Dv) or None (smooth_v off): added to the normalised output
    Scores in base 2 are (q8 . k8) * q_scale * k_scale; sm_scale*log2(e) is inside q_scale.
    """

    __slots__ = ("q8", "q_scale", "k8", "k_scale", "v", "v_scale", "k_mean", "v_mean")

    def __init__(self, q8, q_scale, k8, k_scale, v, v_scale, k_mean, v_mean=None):
        self.q8, self.q_scale, self.k8, self.k_scale = q8, q_scale, k8, k_scale
        self.v, self.v_scale, self.k_mean, self.v_mean = v, v_scale, k_mean, v_mean


def quantize_qkv_torch(q, k, v, *, sm_scale: float, smooth_k: bool = True, pv: str = "fp8",
                       qk_group: str = "token", smooth_v: bool = False, live=None) -> QuantizedQKV:
    """The spec's prologue in torch (also the fallback prologue on any device). `live` (bool, broadcasting to
    (B, Hkv, Nk), from `live_keys`): only live keys enter the means and scales; dead keys' K and V codes are 0."""
    group = group_size(qk_group)
    if live is not None:
        k_used, k_mean = smooth_keys_live(k, live, smooth_k)
        v_used, v_mean = smooth_keys_live(v, live, smooth_v)
    else:
        k_used, k_mean = smooth_keys(k) if smooth_k else (k, None)
        v_used, v_mean = smooth_values(v) if smooth_v else (v, None)
    q8, sq = quantize_int8(q, qk_multiplier(sm_scale), group)
    k8, sk = quantize_int8(k_used, 1.0, group)
    v_q, v_scale = quantize_v_fp8(v_used) if pv == "fp8" else quantize_v_fp16(v_used)
    squeeze = lambda t: None if t is None else t.squeeze(2).contiguous()  # noqa: E731
    return QuantizedQKV(q8.contiguous(), sq.contiguous(), k8.contiguous(), sk.contiguous(), v_q.contiguous(),
                        v_scale.squeeze(2).contiguous(), squeeze(k_mean), squeeze(v_mean))


# -- masks ------------------------------------------------------------------------------------------------------
# An additive mask enters the base-2 scores as mask * log2(e). SDPA adds it in FP32 natural-log units, where
# -finfo.max stays finite (a row masked with it everywhere is a uniform average); times log2(e) it would overflow
# to -inf (a row of zeros), so finite values are floored at -FP32 max: the swamped scores stay equal, as in SDPA.
# (Biases below -FP32 max / log2(e) all floor to the same value: SDPA still orders them; it matters only in a row
# whose every key is masked that deep.)
FP32_MAX = torch.finfo(torch.float32).max
# A key whose base-2 bias lies this far below the largest bias of its (batch, head) has weight below 2**-8000 of
# that key's in every row whose scores spread less than that (|scale * q.k| differences under ~5600), 0 in FP32:
# it is "dead". Its bias becomes -inf (the kernels skip a tail of dead keys), it leaves the K/V statistics
# (smooth_k/smooth_v means, V scale, K block scales), and its K and V codes are 0, so padding keys holding huge
# values cannot coarsen the kept keys' quantization.
DEAD_KEY_RANGE = 8192.0


def mask_bias_base2(mask: torch.Tensor) -> torch.Tensor:
    """A mask (bool: True keeps; floating: added, natural-log units) as an FP32 base-2 additive bias, elementwise
    (-inf where masked). -inf stays -inf and NaN stays NaN; finite values are floored at -FP32 max."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, -math.inf)
    m = mask.float()
    return torch.where(m == -math.inf, m, (m * LOG2E).clamp(min=-FP32_MAX))  # the product may overflow to -inf


def dead_keys(bias: torch.Tensor) -> torch.Tensor:
    """Where a key-only mask's base-2 bias (..., Nk) lies DEAD_KEY_RANGE or more below its row's largest (never
    where that largest is -inf or NaN: such rows keep every key)."""
    top = bias.amax(dim=-1, keepdim=True) if bias.shape[-1] else bias
    return bias < top - DEAD_KEY_RANGE


def key_mask_bias(bias: torch.Tensor) -> torch.Tensor:
    """The bias the kernels add for a key-only mask (Bm, Hm, Nk): -inf on its dead keys."""
    return bias.masked_fill(dead_keys(bias), -math.inf)


def live_keys(bias: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The keys a key-only mask leaves in the K/V statistics: bias (Bm, Hm, Nk) base 2, Hm 1 or a multiple of
    kv_heads. Returns bool (Bm, kv_heads or 1, Nk): a key is live for a kv head where, for some q head of its group,
    its bias is within DEAD_KEY_RANGE of that head's largest bias. A head whose keys are all -inf keeps them all
    (its rows are empty anyway), as does a NaN bias (its rows are NaN)."""
    live = ~dead_keys(bias)  # NaN compares false: kept
    if live.shape[1] > 1:
        live = live.unflatten(1, (kv_heads, -1)).any(dim=2)
    return live


class LiveKeys(NamedTuple):
    """`live_keys` as the prologue kernels read them (the HIP and the Triton one alike): `flags` int8 (1 or B, 1 or
    Hkv, Nk) contiguous, 1 live and 0 dead (the HIP prologue takes them full, (B, Hkv, Nk)); `count` FP64 (B * Hkv,)
    contiguous, the live keys per (batch, kv head), at least 1."""
    flags: torch.Tensor
    count: torch.Tensor


def smooth_keys_live(x: torch.Tensor, live: torch.Tensor, smooth: bool = True):
    """x (K or V) with dead keys x * 0: minus the mean over the live keys (FP64 sum / live count) when `smooth`.
    Returns (FP32 x, the FP32 mean (B, H, 1, D) or None). `live` broadcasts to (B, H, Nk).
    x * 0 is 0, or NaN where a dead key holds NaN/Inf: that reaches the mean or the scale, so the output is NaN as
    exact attention's is (its masked score or P * V is NaN there), never a finite answer from non-finite input."""
    w = live.expand(x.shape[:3]).unsqueeze(-1)
    xf = x.float()
    if not smooth:
        return torch.where(w, xf, xf * 0), None
    count = w.sum(dim=2, keepdim=True).clamp_min(1)
    xd = x.double()
    mean = (torch.where(w, xd, xd * 0).sum(dim=2, keepdim=True) / count).float()
    return torch.where(w, xf - mean, xf * 0), mean
