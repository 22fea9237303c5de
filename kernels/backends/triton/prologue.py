"""The Triton prologue: smooth_k, smooth_v, INT8 Q/K, FP8 or FP16 V, matching `quant.quantize_qkv_torch`.

Three passes, all reading q/k/v through their strides (fused-qkv views and NHD-as-HND views are read
in place, never copied):
  1. `_kv_stats`: per chunk of keys, partial column sums of K (and of V with smooth_v) and V's column
     amax (with smooth_v: V's column max and min instead).
  2. `_kv_finalize`: per (batch, kv head), the means (partials summed in FP64) and the V scale; for
     short sequences (<= 32 chunks) this step runs inside 3 instead, saving a launch.
  3. `_quantize_qkv`: INT8 Q, INT8 K minus its mean, FP8/FP16 V (minus its mean), in one launch.

Means: each chunk sums its column in FP32 with the rounding error of every add kept (TwoSum) and
hands hi + lo over in FP64, so the mean equals the spec's FP64-summed one (to ~2**-48 relative before
its final rounding to FP32: identical in all but astronomically rare ties).
smooth_v's V scale needs amax|V - mean| before the mean is known: rounding is monotonic, so
max_t |fl(v_t - m)| = max(fl(vmax - m), fl(m - vmin)) exactly, from the column max and min.
Offsets of (batch, head) bases are 64-bit, so 100k+ tokens x 40 heads never overflow int32.

Rounding follows quant.py exactly: q8 = rint(x * (1/amax * 127)) with ties to even, scale = amax / 127,
IEEE divisions (tl.math.div_rn);
V to e4m3 is rounded to nearest even explicitly in FP32 bits before the cast (the Triton interpreter's
own FP32->FP8 cast drops carries, and doing it ourselves keeps one code path on every device).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.jit import JITFunction

from ... import quant
from ...call_spec import device_arch
from .configs import MAX_HEAD_DIM, ceil_div, padded_head_dim, prologue_config
from .launcher import launch, tensor_key
from .masks import LiveKeys, live_keys_operands
from .workspace import WorkspaceCache

# 1.5 * 2**23: adding and subtracting it rounds an FP32 of magnitude < 2**22 to an integer, ties to even.
_RINT_MAGIC = tl.constexpr(12582912.0)
# Stats partials reduced per step; with at most this many chunks the reduction folds into the quantize launch.
STATS_CH = 32
# Sizes and program counts are not specialized on (1, multiple of 16): Triton would compile a kernel per class of
# them, so a new shape (each self-check case, each model's call) cost a compile of its own; the kernels take no
# alignment from them (the AOT checks, kernels/verify/triton_aot.py, compile them without it too).
QUANTIZE_SIZE_ARGS = ["Hq", "Hkv", "Nq", "Nk", "n_chunks", "q_blocks", "k_blocks", "v_blocks", "q_programs",
                      "k_programs"]


@triton.jit
def _rint_magic(x):
    return (x + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def _rint(x, INTERPRETER: tl.constexpr):
    # Compiled: nearbyint (round to nearest even). The magic-number form is exact only if x is rounded to FP32
    # before the add, and NVPTX fuses a preceding multiply into an FMA; the interpreter has no libdevice.
    if INTERPRETER:
        return _rint_magic(x)
    else:
        return libdevice.nearbyint(x)  # ties to even; present in both CUDA and HIP libdevice


@triton.jit
def _nan_max(x, axis: tl.constexpr):
    """Max along `axis` that is NaN when any element is (hardware max instructions drop NaNs,
    and a NaN input must come out as NaN, never as a plausible value)."""
    m = tl.max(x, axis)
    return tl.where(tl.max((x != x).to(tl.int32), axis) > 0, float("nan"), m)


@triton.jit
def _floor_tiny(x):
    """max(x, FP32 tiny) that keeps NaN (tl.maximum may not)."""
    return tl.where(x < 1.1754943508222875e-38, 1.1754943508222875e-38, x)


@triton.jit
def _dead(x):
    """A dead key's value times 0 (quant.smooth_keys_live): 0, or NaN where x is NaN/Inf (x - x is not 0 there)."""
    return tl.where(x - x == 0, 0.0, float("nan"))


@triton.jit
def round_to_e4m3(x):
    """Round FP32 |x| <= 448 to the nearest e4m3fn value (ties to even), still as FP32."""
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # e4m3 subnormals share the 2**-9 step of the lowest binade
    # 2**(3 - exp) and 2**(exp - 3), built from their exponent bits: exact powers of two.
    up = ((130 - exp) << 23).to(tl.float32, bitcast=True)
    down = ((124 + exp) << 23).to(tl.float32, bitcast=True)
    return _rint_magic(x * up) * down  # x * up is exact (a power of two), so an FMA changes nothing


@triton.jit
def _two_sum_add(hi, lo, x):
    """hi + x with the add's exact rounding error collected in lo (Knuth's TwoSum; no FMA can form)."""
    s = hi + x
    bp = s - hi
    err = (hi - (s - bp)) + (x - bp)
    return s, lo + err


@triton.jit
def _column_total(hi, lo):
    """FP64 column sums of hi + lo ([SUB, D] -> [D]); a hi that overflowed keeps its Inf (its lo is NaN)."""
    hi64 = hi.to(tl.float64)
    return tl.sum(tl.where(hi - hi == 0, hi64 + lo.to(tl.float64), hi64), 0)


@triton.jit(do_not_specialize=["Hkv", "Nk", "n_chunks"])
def _kv_stats(K, V, KSUM, VMAX, VSUM, VMIN, LIVE,
              skb, skh, skn, skd, svb, svh, svn, svd, slb, slh,
              Hkv, Nk, n_chunks,
              D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
              CHUNK: tl.constexpr, SUB: tl.constexpr, DO_KSUM: tl.constexpr, SMOOTH_V: tl.constexpr,
              HAS_LIVE: tl.constexpr):
    """Per chunk: K column sums (FP64), and V's column amax, or with SMOOTH_V V's column sums (FP64),
    max and min (signed). NaN anywhere in a V column makes its amax NaN; with SMOOTH_V its sum is NaN,
    which makes the mean, hence the scale, NaN (max/min need no NaN flag then)."""
    pid_bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    rows = tl.arange(0, SUB)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    k_hi = tl.zeros([SUB, D_PAD], dtype=tl.float32)  # NaN propagates through the sums by itself
    k_lo = tl.zeros([SUB, D_PAD], dtype=tl.float32)
    v_hi = tl.zeros([SUB, DV_PAD], dtype=tl.float32)
    v_lo = tl.zeros([SUB, DV_PAD], dtype=tl.float32)
    vmax = tl.zeros([SUB, DV_PAD], dtype=tl.float32) - float("inf")  # |v| max, or v max with SMOOTH_V
    vmin = tl.zeros([SUB, DV_PAD], dtype=tl.float32) + float("inf")
    vnan = tl.zeros([SUB, DV_PAD], dtype=tl.int32)  # without SMOOTH_V only
    start = chunk * CHUNK
    for s in range(0, CHUNK, SUB):
        n = (start + s + rows).to(tl.int64)
        live = n < Nk
        if HAS_LIVE:  # a key-only mask's dead keys add 0 (NaN where theirs is not finite) to every statistic
            kept = (tl.load(LIVE + b * slb + h * slh + n, mask=live, other=0) != 0)[:, None]
        if DO_KSUM:
            k = tl.load(k_base + n[:, None] * skn + offs_d[None, :] * skd,
                        mask=live[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
            if HAS_LIVE:
                k = tl.where(kept, k, _dead(k))
            k_hi, k_lo = _two_sum_add(k_hi, k_lo, k)
        v_live = live[:, None] & (offs_dv[None, :] < DV)
        v = tl.load(v_base + n[:, None] * svn + offs_dv[None, :] * svd, mask=v_live, other=0.0)
        v = v.to(tl.float32)
        if HAS_LIVE:
            v = tl.where(kept, v, _dead(v))
        if SMOOTH_V:
            v_hi, v_lo = _two_sum_add(v_hi, v_lo, v)
            if HAS_LIVE:  # a dead key's 0 is no value of V's: it must not widen max/min (its NaN is in the sum)
                v_live = v_live & kept
            vmax = tl.maximum(vmax, tl.where(v_live, v, float("-inf")))
            vmin = tl.minimum(vmin, tl.where(v_live, v, float("inf")))
        else:
            vmax = tl.maximum(vmax, tl.abs(v))
            vnan += (v != v).to(tl.int32)
    out = pid_bh.to(tl.int64) * n_chunks + chunk
    if DO_KSUM:
        tl.store(KSUM + out * D_PAD + offs_d, _column_total(k_hi, k_lo))
    if SMOOTH_V:
        tl.store(VMAX + out * DV_PAD + offs_dv, tl.max(vmax, 0))
        tl.store(VMIN + out * DV_PAD + offs_dv, tl.min(vmin, 0))
        tl.store(VSUM + out * DV_PAD + offs_dv, _column_total(v_hi, v_lo))
    else:
        tl.store(VMAX + out * DV_PAD + offs_dv, tl.where(tl.sum(vnan, 0) > 0, float("nan"), tl.max(vmax, 0)))


@triton.jit
def _nan_or(a, b, x):
    return tl.where((a != a) | (b != b), float("nan"), x)


@triton.jit
def _head_stats(KSUM, VMAX, VSUM, VMIN, COUNT, pid_bh, n_chunks, Nk,
                D_PAD: tl.constexpr, DV_PAD: tl.constexpr, CH: tl.constexpr,
                DO_K: tl.constexpr, DO_V: tl.constexpr, PV_FP8: tl.constexpr, SMOOTH_V: tl.constexpr,
                HAS_LIVE: tl.constexpr):
    """K mean ([D_PAD] FP32, partials summed in FP64), V scale and V mean ([DV_PAD]; the mean is zero
    without SMOOTH_V) of one (batch, kv head)."""
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    offs_c = tl.arange(0, CH)
    row0 = pid_bh.to(tl.int64) * n_chunks
    ksum = tl.zeros([D_PAD], dtype=tl.float64)
    vsum = tl.zeros([DV_PAD], dtype=tl.float64)
    vmax = tl.zeros([DV_PAD], dtype=tl.float32) - float("inf")
    vmin = tl.zeros([DV_PAD], dtype=tl.float32) + float("inf")
    c = 0
    while c < n_chunks:  # a while loop: Triton 3.6's interpreter cannot take a runtime range() bound
        rows = c + offs_c
        live = rows < n_chunks
        if DO_K:
            part = tl.load(KSUM + (row0 + rows)[:, None] * D_PAD + offs_d[None, :], mask=live[:, None], other=0.0)
            ksum += tl.sum(part, 0)
        if DO_V:
            ptrs = (row0 + rows)[:, None] * DV_PAD + offs_dv[None, :]
            part = tl.load(VMAX + ptrs, mask=live[:, None], other=float("-inf"))
            step = _nan_max(part, 0)
            vmax = _nan_or(vmax, step, tl.maximum(vmax, step))
            if SMOOTH_V:
                vsum += tl.sum(tl.load(VSUM + ptrs, mask=live[:, None], other=0.0), 0)
                part = tl.load(VMIN + ptrs, mask=live[:, None], other=float("inf"))
                step = -_nan_max(-part, 0)
                vmin = _nan_or(vmin, step, tl.minimum(vmin, step))
        c += CH
    if HAS_LIVE:
        count = tl.load(COUNT + pid_bh)  # FP64 number of live keys of this (batch, kv head), at least 1
    else:
        count = Nk
    mean = (ksum / count).to(tl.float32)
    if SMOOTH_V:
        v_mean = (vsum / count).to(tl.float32)
        # amax|fl(v - m)| over tokens, exactly: rounding is monotonic, so the extremes come from vmax/vmin.
        hi = vmax - v_mean
        lo = v_mean - vmin
        vamax = _nan_or(hi, lo, tl.maximum(hi, lo))
    else:
        v_mean = tl.zeros([DV_PAD], dtype=tl.float32)
        vamax = vmax
    if PV_FP8:
        scale = _floor_tiny(tl.math.div_rn(vamax, 448.0))
    else:
        # quant.fp16_v_scale: the power of two >= amax / 32768, at least 2**-126, rounded up to 2**k in bits.
        over = vamax * (1.0 / 32768.0)  # exact above the floor: a power of two
        over = tl.where(over < 1.1754943508222875e-38, 1.1754943508222875e-38, over)  # keeps NaN
        bits = over.to(tl.int32, bitcast=True)
        bits = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
        scale = tl.where(vamax != vamax, float("nan"), bits.to(tl.float32, bitcast=True))
    return mean, scale, v_mean


@triton.jit(do_not_specialize=["n_chunks", "Nk"])
def _kv_finalize(KSUM, VMAX, VSUM, VMIN, COUNT, KMEAN, VSCALE, VMEAN, n_chunks, Nk,
                 D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                 CH: tl.constexpr, DO_KSUM: tl.constexpr, PV_FP8: tl.constexpr, SMOOTH_V: tl.constexpr,
                 HAS_LIVE: tl.constexpr):
    pid_bh = tl.program_id(0)
    mean, scale, v_mean = _head_stats(KSUM, VMAX, VSUM, VMIN, COUNT, pid_bh, n_chunks, Nk, D_PAD, DV_PAD, CH,
                                      DO_KSUM, True, PV_FP8, SMOOTH_V, HAS_LIVE)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    if DO_KSUM:
        tl.store(KMEAN + pid_bh.to(tl.int64) * D + offs_d, mean, mask=offs_d < D)
    tl.store(VSCALE + pid_bh.to(tl.int64) * DV + offs_dv, scale, mask=offs_dv < DV)
    if SMOOTH_V:
        tl.store(VMEAN + pid_bh.to(tl.int64) * DV + offs_dv, v_mean, mask=offs_dv < DV)


@triton.jit
def _int8_tile(X, mean, Q8, SCALE, mult, sxb, sxh, sxn, sxd, H, N, s_row, pid_bh, blk, LIVE, slb, slh,
               D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
               PER_BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_MULT: tl.constexpr,
               HAS_LIVE: tl.constexpr, INTERPRETER: tl.constexpr):
    """INT8 codes and scales of BLOCK tokens of one (batch, head); a head's scales start s_row apart.
    HAS_LIVE (K under a key-only mask): dead keys are 0, so they reach neither a block's amax nor any code."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    n = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = (n[:, None] < N) & (offs_d[None, :] < D)
    x = tl.load(X + b * sxb + h * sxh + n[:, None] * sxn + offs_d[None, :] * sxd, mask=live, other=0.0)
    x = x.to(tl.float32)
    if HAS_MEAN:
        x = tl.where(live, x - mean[None, :], 0.0)  # padded rows must not reach the amax
    if HAS_LIVE:  # dead keys: 0 (NaN where not finite), so they reach no block's amax
        kept = (tl.load(LIVE + b * slb + h * slh + n, mask=n < N, other=0) != 0)[:, None]
        x = tl.where(kept, x, _dead(x))
    if HAS_MULT:
        x = x * mult
    if PER_BLOCK:
        amax = tl.zeros([BLOCK], dtype=tl.float32) + _nan_max(_nan_max(tl.abs(x), 1), 0)
    else:
        amax = _nan_max(tl.abs(x), 1)
    amax = _floor_tiny(amax)  # a NaN token keeps a NaN scale, so its scores (and output) are NaN
    # torch evaluates `127 / amax` as reciprocal(amax) * 127; IEEE division (Triton's `/` may not be).
    inv = tl.math.div_rn(1.0, amax) * 127.0
    y = x * inv[:, None]
    y = tl.where(y == y, y, 0.0)  # an all-zero row gives 0 * inf = NaN (max/min would turn it into -127)
    q = tl.minimum(tl.maximum(_rint(y, INTERPRETER), -127.0), 127.0)
    row = pid_bh.to(tl.int64) * N + n
    tl.store(Q8 + row[:, None] * D + offs_d[None, :], q.to(tl.int8), mask=live)
    tl.store(SCALE + pid_bh.to(tl.int64) * s_row + n, tl.math.div_rn(amax, 127.0), mask=n < N)


@triton.jit
def _v_tile(V, scale, v_mean, VOUT, svb, svh, svn, svd, sob, soh, son, sod, H, N, pid_bh, blk, LIVE, slb, slh,
            DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK: tl.constexpr, PV_FP8: tl.constexpr,
            OUT_T: tl.constexpr, SMOOTH_V: tl.constexpr, HAS_LIVE: tl.constexpr):
    """FP8 or FP16 V (minus its mean with SMOOTH_V) of BLOCK tokens of one (batch, head), stored (N, Dv)
    or transposed (Dv, N). HAS_LIVE: dead keys' V is 0."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_d = tl.arange(0, DV_PAD)
    n = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = (n[:, None] < N) & (offs_d[None, :] < DV)
    v = tl.load(V + b * svb + h * svh + n[:, None] * svn + offs_d[None, :] * svd, mask=live, other=0.0)
    x = v.to(tl.float32)
    if SMOOTH_V:
        x = x - v_mean[None, :]
    if HAS_LIVE:  # dead keys: 0 (NaN where not finite)
        kept = (tl.load(LIVE + b * slb + h * slh + n, mask=n < N, other=0) != 0)[:, None]
        x = tl.where(kept, x, _dead(v.to(tl.float32)))
    x = tl.math.div_rn(x, scale[None, :])
    if PV_FP8:
        x = round_to_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0))
        x = x.to(tl.float8e4nv)
    else:
        x = x.to(tl.float16)
    if OUT_T:
        # (Dv, N) storage: transpose the tile so each thread writes along N (coalesced). Masked at N rounded up
        # to 64, which the buffer's rows hold (allocate_buffers): a bound Triton can prove to be a multiple of
        # 16 lets it store 16 bytes at once. Masked at N itself, an N that is not a multiple of 16 (Wan 480p's
        # 32760) made every byte a store of its own: 5x slower on the H200. Past N it writes V's padding rows.
        n_store = (N + 63) // 64 * 64
        out_ptr = VOUT + b * sob + h * soh + offs_d[:, None] * sod + n[None, :] * son
        tl.store(out_ptr, tl.trans(x), mask=(offs_d[:, None] < DV) & (n[None, :] < n_store))
    else:
        tl.store(VOUT + b * sob + h * soh + n[:, None] * son + offs_d[None, :] * sod, x, mask=live)


@triton.jit(do_not_specialize=QUANTIZE_SIZE_ARGS)
def _quantize_qkv(Q, K, V, KSUM, VMAX, VSUM, VMIN, COUNT, LIVE, KMEAN, VSCALE, VMEAN, Q8, QS, K8, KS, VOUT, mult,
                  sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod, sks, slb, slh,
                  Hq, Hkv, Nq, Nk, n_chunks, q_blocks, k_blocks, v_blocks, q_programs, k_programs,
                  D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                  QK_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, PER_BLOCK: tl.constexpr,
                  HAS_MEAN: tl.constexpr, PV_FP8: tl.constexpr, OUT_T: tl.constexpr,
                  FOLD_STATS: tl.constexpr, STATS_CH: tl.constexpr, SMOOTH_V: tl.constexpr,
                  HAS_LIVE: tl.constexpr, INTERPRETER: tl.constexpr):
    """Q, K and V in one launch: programs [0, q_programs) quantize Q, the next k_programs K, the rest V.

    FOLD_STATS (few key chunks, i.e. short sequences where launches dominate): each K/V program
    reduces its head's stats partials itself (block 0 stores them), so no finalize launch is needed."""
    pid = tl.program_id(0)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    if pid < q_programs:
        _int8_tile(Q, tl.zeros([D_PAD], dtype=tl.float32), Q8, QS, mult, sqb, sqh, sqn, sqd, Hq, Nq, Nq,
                   pid // q_blocks, pid % q_blocks, LIVE, slb, slh, D, D_PAD, QK_BLOCK, PER_BLOCK, False, True, False,
                   INTERPRETER)
    elif pid < q_programs + k_programs:
        p = pid - q_programs
        pid_bh = p // k_blocks
        blk = p % k_blocks
        if HAS_MEAN:
            if FOLD_STATS:
                # Distinct names per branch: Triton unifies same-named variables across if/else, and the
                # unused halves have different widths when D != DV.
                mean, _vs_unused, _vm_unused = _head_stats(KSUM, VMAX, VSUM, VMIN, COUNT, pid_bh, n_chunks, Nk,
                                                           D_PAD, DV_PAD, STATS_CH, True, False, PV_FP8, False,
                                                           HAS_LIVE)
                if blk == 0:
                    tl.store(KMEAN + pid_bh.to(tl.int64) * D + offs_d, mean, mask=offs_d < D)
            else:
                mean = tl.load(KMEAN + pid_bh.to(tl.int64) * D + offs_d, mask=offs_d < D, other=0.0)
        else:
            mean = tl.zeros([D_PAD], dtype=tl.float32)
        _int8_tile(K, mean, K8, KS, 1.0, skb, skh, skn, skd, Hkv, Nk, sks, pid_bh, blk, LIVE, slb, slh,
                   D, D_PAD, QK_BLOCK, PER_BLOCK, HAS_MEAN, False, HAS_LIVE, INTERPRETER)
    else:
        p = pid - q_programs - k_programs
        pid_bh = p // v_blocks
        blk = p % v_blocks
        if FOLD_STATS:
            _k_unused, scale, v_mean = _head_stats(KSUM, VMAX, VSUM, VMIN, COUNT, pid_bh, n_chunks, Nk, D_PAD,
                                                   DV_PAD, STATS_CH, False, True, PV_FP8, SMOOTH_V, HAS_LIVE)
            if blk == 0:
                tl.store(VSCALE + pid_bh.to(tl.int64) * DV + offs_dv, scale, mask=offs_dv < DV)
                if SMOOTH_V:
                    tl.store(VMEAN + pid_bh.to(tl.int64) * DV + offs_dv, v_mean, mask=offs_dv < DV)
        else:
            scale = tl.load(VSCALE + pid_bh.to(tl.int64) * DV + offs_dv, mask=offs_dv < DV, other=1.0)
            if SMOOTH_V:
                v_mean = tl.load(VMEAN + pid_bh.to(tl.int64) * DV + offs_dv, mask=offs_dv < DV, other=0.0)
            else:
                v_mean = tl.zeros([DV_PAD], dtype=tl.float32)
        _v_tile(V, scale, v_mean, VOUT, svb, svh, svn, svd, sob, soh, son, sod, Hkv, Nk, pid_bh, blk, LIVE, slb, slh,
                DV, DV_PAD, V_BLOCK, PV_FP8, OUT_T, SMOOTH_V, HAS_LIVE)


def stats_rows(d_pad: int, dv_pad: int, smooth_k: bool, smooth_v: bool) -> int:
    """Rows per step of `_kv_stats`: it holds one [rows, D] FP32 tile per running statistic (K: sum and
    its error; V: amax and a NaN count, or sum, error, max and min); keep them within 3 x 32 x 128
    elements (what the kernel held before the error terms), so VGPRs stay unspilled on RDNA4."""
    elements = (2 * d_pad if smooth_k else 0) + (4 if smooth_v else 2) * dv_pad
    rows = 32
    while rows > 4 and rows * elements > 3 * 32 * 128:
        rows //= 2
    return rows


def triton_prologue_refusal(call) -> Optional[str]:
    """Why the Triton prologue cannot quantize this call, or None."""
    if call.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {call.dtype} is not fp16, bf16 or fp32"
    if call.head_dim > MAX_HEAD_DIM or call.v_head_dim > MAX_HEAD_DIM:
        return f"head_dim {call.head_dim}/{call.v_head_dim} > {MAX_HEAD_DIM}"
    if call.has_zero_size:
        return "a zero-size q, k or v"
    if call.qk_group not in ("token", "block32", "block64", "block128"):
        return f"qk_group {call.qk_group!r} is not supported"
    return None


# Whether these kernels run in Triton's interpreter: triton.jit decided it when this module was imported (from
# TRITON_INTERPRET then), so it is read from the kernel once, not from the environment on every launch.
INTERPRETED = not isinstance(_quantize_qkv, JITFunction)


@dataclass(frozen=True, eq=False)
class PrologueLaunch:
    """What the three launches of one prologue call take besides the tensors: a function of the shapes and
    options only, so it is computed once per signature (`prologue_launch`)."""
    k_stats_shape: Tuple[int, ...]  # (B*Hkv, chunks, D_PAD) FP64 K partial sums
    v_stats_shape: Tuple[int, ...]  # (B*Hkv, chunks, DV_PAD) V statistics
    stats_grid: Tuple[int, ...]
    stats_meta: Dict[str, object]  # constexprs and num_warps of _kv_stats
    n_chunks: int
    fold: bool  # stats reduced inside the quantize launch (no _kv_finalize launch)
    finalize_grid: Tuple[int, ...]
    finalize_meta: Dict[str, object]
    v_dtype: torch.dtype
    v_store_shape: Optional[Tuple[int, ...]]  # (B, Hkv, Dv, Nk_pad) when V is stored transposed
    k_scale_row: int  # entries per (batch, kv head) row of the k_scale storage: nk, or nk rounded up to 16
    quantize_grid: Tuple[int, ...]
    quantize_sizes: Tuple[int, ...]  # the runtime size arguments of _quantize_qkv, in order
    quantize_meta: Dict[str, object]


@functools.lru_cache(maxsize=256)
def prologue_launch(b: int, hq: int, nq: int, d: int, hkv: int, nk: int, dv: int, arch: str, smooth_k: bool,
                    smooth_v: bool, pv: str, qk_group: str, v_transposed: bool,
                    pad_k_scale_rows: bool = False, has_live: bool = False) -> PrologueLaunch:
    """The launch geometry of `triton_quantize_qkv` for these shapes and options (the tensors' strides and
    data are passed per call)."""
    cfg = prologue_config(arch)
    d_pad, dv_pad = padded_head_dim(d), padded_head_dim(dv)
    group = quant.group_size(qk_group)
    n_chunks = ceil_div(nk, cfg.stats_block_n)
    fold = n_chunks <= STATS_CH
    stats_meta = dict(D=d, D_PAD=d_pad, DV=dv, DV_PAD=dv_pad, CHUNK=cfg.stats_block_n,
                      SUB=stats_rows(d_pad, dv_pad, smooth_k, smooth_v), DO_KSUM=smooth_k, SMOOTH_V=smooth_v,
                      HAS_LIVE=has_live, num_warps=cfg.num_warps)
    finalize_meta = dict(D=d, D_PAD=d_pad, DV=dv, DV_PAD=dv_pad, CH=STATS_CH, DO_KSUM=smooth_k, PV_FP8=pv == "fp8",
                         SMOOTH_V=smooth_v, HAS_LIVE=has_live, num_warps=4)
    v_store_shape = None
    if v_transposed:
        # 64-byte aligned rows; a row stride that is a multiple of 1 KiB is skewed by 64 bytes (at
        # Wan 480p the 32 KiB power-of-two stride made the transposed stores twice as slow). The quantize
        # kernel writes each row up to nk rounded up to 64 (_v_tile).
        nk_pad = ceil_div(nk, 64) * 64
        nk_pad += 64 if nk_pad % 1024 == 0 else 0
        v_store_shape = (b, hkv, dv, nk_pad)  # the tail is never read
    # k_scale rows padded to 16 entries (64 bytes): the attention kernel then knows each key tile's scales to be
    # 16-byte aligned and reads them 4 at a time (gfx1201 key loop at Nk = 32760: 13.1 -> 10.3 non-WMMA
    # instructions per v_wmma, FP8 D128). Only for the Triton attention's own call; others get contiguous scales.
    k_scale_row = ceil_div(nk, 16) * 16 if pad_k_scale_rows else nk
    block = cfg.block_n if group == 1 else group
    vb = cfg.block_n
    q_blocks, k_blocks, v_blocks = ceil_div(nq, block), ceil_div(nk, block), ceil_div(nk, vb)
    q_programs, k_programs = b * hq * q_blocks, b * hkv * k_blocks
    warps = cfg.num_warps if max(block * d_pad, vb * dv_pad) <= 64 * 128 else 8
    quantize_meta = dict(D=d, D_PAD=d_pad, DV=dv, DV_PAD=dv_pad, QK_BLOCK=block, V_BLOCK=vb, PER_BLOCK=group > 1,
                         HAS_MEAN=smooth_k, PV_FP8=pv == "fp8", OUT_T=v_transposed, FOLD_STATS=fold,
                         STATS_CH=STATS_CH, SMOOTH_V=smooth_v, HAS_LIVE=has_live, INTERPRETER=INTERPRETED,
                         num_warps=warps)
    return PrologueLaunch(
        k_stats_shape=(b * hkv, n_chunks, d_pad), v_stats_shape=(b * hkv, n_chunks, dv_pad),
        stats_grid=(b * hkv, n_chunks), stats_meta=stats_meta, n_chunks=n_chunks, fold=fold,
        finalize_grid=(b * hkv,), finalize_meta=finalize_meta,
        v_dtype=torch.float8_e4m3fn if pv == "fp8" else torch.float16,
        v_store_shape=v_store_shape, k_scale_row=k_scale_row,
        quantize_grid=(q_programs + k_programs + b * hkv * v_blocks,),
        quantize_sizes=(hq, hkv, nq, nk, n_chunks, q_blocks, k_blocks, v_blocks, q_programs, k_programs),
        quantize_meta=quantize_meta)


@dataclass(frozen=True)
class PrologueBuffers:
    """Everything one prologue call writes. Buffers a pass does not use are stood in for by another one of the
    right kind that the kernel never touches (vmax for the stats, v_scale for the means)."""
    ksum: torch.Tensor
    vmax: torch.Tensor
    vsum: torch.Tensor
    vmin: torch.Tensor
    k_mean: Optional[torch.Tensor]
    v_scale: torch.Tensor
    v_mean: Optional[torch.Tensor]
    q8: torch.Tensor
    q_scale: torch.Tensor
    k8: torch.Tensor
    k_scale: torch.Tensor
    v_q: torch.Tensor

    def tensors(self):
        return tuple(t for t in vars(self).values() if t is not None)


def allocate_buffers(plan: PrologueLaunch, shapes: Tuple[int, ...], dev: torch.device) -> PrologueBuffers:
    b, hq, nq, d, hkv, nk, dv = shapes
    f32 = torch.float32
    smooth_k, smooth_v = plan.stats_meta["DO_KSUM"], plan.stats_meta["SMOOTH_V"]
    vmax = torch.empty(plan.v_stats_shape, dtype=f32, device=dev)
    v_scale = torch.empty((b, hkv, dv), dtype=f32, device=dev)
    if plan.v_store_shape is not None:
        v_q = torch.empty(plan.v_store_shape, dtype=plan.v_dtype, device=dev).transpose(2, 3)[:, :, :nk]
    else:
        v_q = torch.empty((b, hkv, nk, dv), dtype=plan.v_dtype, device=dev)
    return PrologueBuffers(
        ksum=torch.empty(plan.k_stats_shape, dtype=torch.float64, device=dev) if smooth_k else vmax,
        vmax=vmax,
        vsum=torch.empty(plan.v_stats_shape, dtype=torch.float64, device=dev) if smooth_v else vmax,
        vmin=torch.empty(plan.v_stats_shape, dtype=f32, device=dev) if smooth_v else vmax,
        k_mean=torch.empty((b, hkv, d), dtype=f32, device=dev) if smooth_k else None,
        v_scale=v_scale,
        v_mean=torch.empty((b, hkv, dv), dtype=f32, device=dev) if smooth_v else None,
        q8=torch.empty((b, hq, nq, d), dtype=torch.int8, device=dev),
        q_scale=torch.empty((b, hq, nq), dtype=f32, device=dev),
        k8=torch.empty((b, hkv, nk, d), dtype=torch.int8, device=dev),
        k_scale=torch.empty((b, hkv, plan.k_scale_row), dtype=f32, device=dev)[:, :, :nk],
        v_q=v_q)


WORKSPACES = WorkspaceCache()


def triton_quantize_qkv(q, k, v, *, sm_scale: float, smooth_k: bool = True, pv: str = "fp8",
                        qk_group: str = "token", v_transposed: bool = False,
                        smooth_v: bool = False, reuse_buffers: bool = False,
                        pad_k_scale_rows: bool = False, live=None) -> quant.QuantizedQKV:
    """The spec's prologue as Triton kernels; returns what `quant.quantize_qkv_torch` returns.

    `v_transposed=True` (internal to the Triton attention where its config asks for it) stores V as
    (B, Hkv, Dv, Nk_pad) and hands out its (B, Hkv, Nk, Dv) transposed view; every other consumer gets
    contiguous V. `pad_k_scale_rows=True` (internal to the Triton attention too) stores k_scale with rows
    padded to 16 entries and hands out its (B, Hkv, Nk) view.
    `live` (bool (1 or B, 1 or Hkv, Nk), `quant.live_keys` of a key-only mask, or its `masks.LiveKeys`): only live
    keys enter the means and scales, and dead keys' K and V codes are 0 (NaN where not finite), as
    `quant.quantize_qkv_torch(live=...)`.
    `reuse_buffers=True` (the backend's own path only) writes into this signature's kept workspace
    (workspace.py): the result is overwritten by the next such call on the same stream.
    """
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
    b, hq, nq, d = q.shape
    _, hkv, nk, dv = v.shape
    dev = q.device
    smooth_k, smooth_v = bool(smooth_k), bool(smooth_v)
    plan = prologue_launch(b, hq, nq, d, hkv, nk, dv, device_arch(dev.type, dev.index), smooth_k, smooth_v, pv,
                           qk_group, bool(v_transposed), bool(pad_k_scale_rows), live is not None)
    shapes = (b, hq, nq, d, hkv, nk, dv)
    if reuse_buffers:
        buf = WORKSPACES.get(plan, dev, lambda: allocate_buffers(plan, shapes, dev))
    else:
        buf = allocate_buffers(plan, shapes, dev)
    k_strides, v_strides = k.stride(), v.stride()
    if live is not None:
        flags = live.flags if isinstance(live, LiveKeys) else live
        if flags.dim() != 3 or flags.shape[-1] != nk or flags.shape[0] not in (1, b) or flags.shape[1] not in (1, hkv):
            raise ValueError(f"live must be (1 or B, 1 or Hkv, Nk) = {(b, hkv, nk)}, got {tuple(flags.shape)}")
        live_i8, count = live if isinstance(live, LiveKeys) else live_keys_operands(live, b, hkv)
        if not live_i8.is_contiguous() or live_i8.dtype != torch.int8 or count.shape != (b * hkv,):
            raise ValueError("LiveKeys must hold contiguous int8 flags and a (B * Hkv,) count")
        live_strides = tuple(0 if live_i8.shape[i] == 1 else live_i8.stride(i) for i in (0, 1))
    else:
        live_i8, live_strides, count = buf.vmax, (0, 0), buf.vmax  # stand-ins the kernels never read
    k_mean_arg = buf.v_scale if buf.k_mean is None else buf.k_mean
    v_mean_arg = buf.v_scale if buf.v_mean is None else buf.v_mean

    # 1. Per chunk of keys: K column sums (FP64 partials); V column amax, or with smooth_v V's column
    #    sums, max and min.
    # What Triton specializes on beyond the plan: the inputs' dtypes, alignment and strides (every buffer made
    # here is aligned, and its strides follow from the plan).
    kv_key = (tensor_key(k), tensor_key(v), k_strides, v_strides, tensor_key(live_i8), live_strides)
    launch(_kv_stats, plan.stats_grid,
           (k, v, buf.ksum, buf.vmax, buf.vsum, buf.vmin, live_i8, *k_strides, *v_strides, *live_strides, hkv, nk,
            plan.n_chunks), plan.stats_meta, kv_key)
    # 2. Means and V scale per head: a launch of its own for long sequences, else folded into 3.
    if not plan.fold:
        launch(_kv_finalize, plan.finalize_grid, (buf.ksum, buf.vmax, buf.vsum, buf.vmin, count, k_mean_arg,
                                                  buf.v_scale, v_mean_arg, plan.n_chunks, nk),
               plan.finalize_meta, tensor_key(count))
    # 3. One launch: INT8 Q (sm_scale*log2e folded in), INT8 K (minus its mean), FP8/FP16 V (minus its mean).
    q_strides = q.stride()
    launch(_quantize_qkv, plan.quantize_grid,
           (q, k, v, buf.ksum, buf.vmax, buf.vsum, buf.vmin, count, live_i8, k_mean_arg, buf.v_scale, v_mean_arg,
            buf.q8, buf.q_scale, buf.k8, buf.k_scale, buf.v_q, quant.qk_multiplier(sm_scale), *q_strides,
            *k_strides, *v_strides, *buf.v_q.stride(), plan.k_scale_row, *live_strides, *plan.quantize_sizes),
           plan.quantize_meta, (tensor_key(q), q_strides, kv_key, tensor_key(count)))
    return quant.QuantizedQKV(buf.q8, buf.q_scale, buf.k8, buf.k_scale, buf.v_q, buf.v_scale, buf.k_mean, buf.v_mean)
