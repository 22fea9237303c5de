"""The Triton prologue: smooth_k, INT8 Q/K, FP8 or FP16 V, matching `quant.quantize_qkv_torch`.

Three passes, all reading q/k/v through their strides (fused-qkv views and NHD-as-HND views are read
in place, never copied):
  1. `_kv_stats`: per chunk of keys, partial FP32 column sums of K and column amax of V.
  2. `_kv_finalize`: per (batch, kv head), K mean (partials summed in FP64) and the V scale; for
     short sequences (<= 32 chunks) this step runs inside 3 instead, saving a launch.
  3. `_quantize_qkv`: INT8 Q, INT8 K minus its mean, FP8/FP16 V, in one launch.
Offsets of (batch, head) bases are 64-bit, so 100k+ tokens x 40 heads never overflow int32.

Rounding follows quant.py exactly: q8 = rint(x * (1/amax * 127)) with ties to even, scale = amax / 127,
IEEE divisions (tl.math.div_rn);
V to e4m3 is rounded to nearest even explicitly in FP32 bits before the cast (the Triton interpreter's
own FP32->FP8 cast drops carries, and doing it ourselves keeps one code path on every device).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ... import quant
from .configs import MAX_HEAD_DIM, padded_head_dim, prologue_config

# 1.5 * 2**23: adding and subtracting it rounds an FP32 of magnitude < 2**22 to an integer, ties to even.
_RINT_MAGIC = tl.constexpr(12582912.0)
# Stats partials reduced per step; with at most this many chunks the reduction folds into the quantize launch.
STATS_CH = 32


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
def _kv_stats(K, V, KSUM, VMAX,
              skb, skh, skn, skd, svb, svh, svn, svd,
              Hkv, Nk, n_chunks,
              D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
              CHUNK: tl.constexpr, SUB: tl.constexpr, DO_KSUM: tl.constexpr):
    pid_bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    rows = tl.arange(0, SUB)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    ksum = tl.zeros([SUB, D_PAD], dtype=tl.float32)  # NaN propagates through the sum by itself
    vmax = tl.zeros([SUB, DV_PAD], dtype=tl.float32)
    vnan = tl.zeros([SUB, DV_PAD], dtype=tl.int32)
    start = chunk * CHUNK
    for s in range(0, CHUNK, SUB):
        n = (start + s + rows).to(tl.int64)
        live = n < Nk
        if DO_KSUM:
            k = tl.load(k_base + n[:, None] * skn + offs_d[None, :] * skd,
                        mask=live[:, None] & (offs_d[None, :] < D), other=0.0)
            ksum += k.to(tl.float32)
        v = tl.load(v_base + n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=live[:, None] & (offs_dv[None, :] < DV), other=0.0)
        vmax = tl.maximum(vmax, tl.abs(v.to(tl.float32)))
        vnan += (v != v).to(tl.int32)
    out = pid_bh.to(tl.int64) * n_chunks + chunk
    if DO_KSUM:
        tl.store(KSUM + out * D_PAD + offs_d, tl.sum(ksum, 0))
    tl.store(VMAX + out * DV_PAD + offs_dv, tl.where(tl.sum(vnan, 0) > 0, float("nan"), tl.max(vmax, 0)))


@triton.jit
def _head_stats(KSUM, VMAX, pid_bh, n_chunks, Nk,
                D_PAD: tl.constexpr, DV_PAD: tl.constexpr, CH: tl.constexpr,
                DO_K: tl.constexpr, DO_V: tl.constexpr, PV_FP8: tl.constexpr):
    """K mean ([D_PAD] FP32, partials summed in FP64) and V scale ([DV_PAD]) of one (batch, kv head)."""
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    offs_c = tl.arange(0, CH)
    row0 = pid_bh.to(tl.int64) * n_chunks
    ksum = tl.zeros([D_PAD], dtype=tl.float64)
    vmax = tl.zeros([DV_PAD], dtype=tl.float32)
    c = 0
    while c < n_chunks:  # a while loop: Triton 3.6's interpreter cannot take a runtime range() bound
        rows = c + offs_c
        live = rows < n_chunks
        if DO_K:
            part = tl.load(KSUM + (row0 + rows)[:, None] * D_PAD + offs_d[None, :], mask=live[:, None], other=0.0)
            ksum += tl.sum(part.to(tl.float64), 0)
        if DO_V:
            part = tl.load(VMAX + (row0 + rows)[:, None] * DV_PAD + offs_dv[None, :], mask=live[:, None], other=0.0)
            step = _nan_max(part, 0)
            vmax = tl.where((vmax != vmax) | (step != step), float("nan"), tl.maximum(vmax, step))
        c += CH
    mean = (ksum / Nk).to(tl.float32)
    if PV_FP8:
        scale = _floor_tiny(tl.math.div_rn(vmax, 448.0))
    else:
        # Power of two >= amax / 32768 (1 for anything FP16 holds): round the ratio up to 2**k in bits.
        over = tl.maximum(vmax * (1.0 / 32768.0), 1.0)  # exact: a power of two
        bits = over.to(tl.int32, bitcast=True)
        bits = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
        scale = tl.where(vmax != vmax, float("nan"), bits.to(tl.float32, bitcast=True))
    return mean, scale


@triton.jit
def _kv_finalize(KSUM, VMAX, KMEAN, VSCALE, n_chunks, Nk,
                 D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                 CH: tl.constexpr, DO_KSUM: tl.constexpr, PV_FP8: tl.constexpr):
    pid_bh = tl.program_id(0)
    mean, scale = _head_stats(KSUM, VMAX, pid_bh, n_chunks, Nk, D_PAD, DV_PAD, CH, DO_KSUM, True, PV_FP8)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    if DO_KSUM:
        tl.store(KMEAN + pid_bh.to(tl.int64) * D + offs_d, mean, mask=offs_d < D)
    tl.store(VSCALE + pid_bh.to(tl.int64) * DV + offs_dv, scale, mask=offs_dv < DV)


@triton.jit
def _int8_tile(X, mean, Q8, SCALE, mult, sxb, sxh, sxn, sxd, H, N, pid_bh, blk,
               D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
               PER_BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_MULT: tl.constexpr,
               INTERPRETER: tl.constexpr):
    """INT8 codes and scales of BLOCK tokens of one (batch, head)."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    n = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = (n[:, None] < N) & (offs_d[None, :] < D)
    x = tl.load(X + b * sxb + h * sxh + n[:, None] * sxn + offs_d[None, :] * sxd, mask=live, other=0.0)
    x = x.to(tl.float32)
    if HAS_MEAN:
        x = tl.where(live, x - mean[None, :], 0.0)  # padded rows must not reach the amax
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
    tl.store(SCALE + row, tl.math.div_rn(amax, 127.0), mask=n < N)


@triton.jit
def _v_tile(V, scale, VOUT, svb, svh, svn, svd, sob, soh, son, sod, H, N, pid_bh, blk,
            DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK: tl.constexpr, PV_FP8: tl.constexpr,
            OUT_T: tl.constexpr):
    """FP8 or FP16 V of BLOCK tokens of one (batch, head), stored (N, Dv) or transposed (Dv, N)."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_d = tl.arange(0, DV_PAD)
    n = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = (n[:, None] < N) & (offs_d[None, :] < DV)
    v = tl.load(V + b * svb + h * svh + n[:, None] * svn + offs_d[None, :] * svd, mask=live, other=0.0)
    x = tl.math.div_rn(v.to(tl.float32), scale[None, :])
    if PV_FP8:
        x = round_to_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0))
        x = x.to(tl.float8e4nv)
    else:
        x = x.to(tl.float16)
    if OUT_T:
        # (Dv, N) storage: transpose the tile so each thread writes along N (coalesced).
        out_ptr = VOUT + b * sob + h * soh + offs_d[:, None] * sod + n[None, :] * son
        tl.store(out_ptr, tl.trans(x), mask=(offs_d[:, None] < DV) & (n[None, :] < N))
    else:
        tl.store(VOUT + b * sob + h * soh + n[:, None] * son + offs_d[None, :] * sod, x, mask=live)


@triton.jit
def _quantize_qkv(Q, K, V, KSUM, VMAX, KMEAN, VSCALE, Q8, QS, K8, KS, VOUT, mult,
                  sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
                  Hq, Hkv, Nq, Nk, n_chunks, q_blocks, k_blocks, v_blocks, q_programs, k_programs,
                  D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                  QK_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, PER_BLOCK: tl.constexpr,
                  HAS_MEAN: tl.constexpr, PV_FP8: tl.constexpr, OUT_T: tl.constexpr,
                  FOLD_STATS: tl.constexpr, STATS_CH: tl.constexpr, INTERPRETER: tl.constexpr):
    """Q, K and V in one launch: programs [0, q_programs) quantize Q, the next k_programs K, the rest V.

    FOLD_STATS (few key chunks, i.e. short sequences where launches dominate): each K/V program
    reduces its head's stats partials itself (block 0 stores them), so no finalize launch is needed."""
    pid = tl.program_id(0)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    if pid < q_programs:
        _int8_tile(Q, tl.zeros([D_PAD], dtype=tl.float32), Q8, QS, mult, sqb, sqh, sqn, sqd, Hq, Nq,
                   pid // q_blocks, pid % q_blocks, D, D_PAD, QK_BLOCK, PER_BLOCK, False, True, INTERPRETER)
    elif pid < q_programs + k_programs:
        p = pid - q_programs
        pid_bh = p // k_blocks
        blk = p % k_blocks
        if HAS_MEAN:
            if FOLD_STATS:
                # Distinct names per branch: Triton unifies same-named variables across if/else, and the
                # unused halves have different widths when D != DV.
                mean, _v_unused = _head_stats(KSUM, VMAX, pid_bh, n_chunks, Nk, D_PAD, DV_PAD, STATS_CH,
                                              True, False, PV_FP8)
                if blk == 0:
                    tl.store(KMEAN + pid_bh.to(tl.int64) * D + offs_d, mean, mask=offs_d < D)
            else:
                mean = tl.load(KMEAN + pid_bh.to(tl.int64) * D + offs_d, mask=offs_d < D, other=0.0)
        else:
            mean = tl.zeros([D_PAD], dtype=tl.float32)
        _int8_tile(K, mean, K8, KS, 1.0, skb, skh, skn, skd, Hkv, Nk, pid_bh, blk,
                   D, D_PAD, QK_BLOCK, PER_BLOCK, HAS_MEAN, False, INTERPRETER)
    else:
        p = pid - q_programs - k_programs
        pid_bh = p // v_blocks
        blk = p % v_blocks
        if FOLD_STATS:
            _k_unused, scale = _head_stats(KSUM, VMAX, pid_bh, n_chunks, Nk, D_PAD, DV_PAD, STATS_CH,
                                           False, True, PV_FP8)
            if blk == 0:
                tl.store(VSCALE + pid_bh.to(tl.int64) * DV + offs_dv, scale, mask=offs_dv < DV)
        else:
            scale = tl.load(VSCALE + pid_bh.to(tl.int64) * DV + offs_dv, mask=offs_dv < DV, other=1.0)
        _v_tile(V, scale, VOUT, svb, svh, svn, svd, sob, soh, son, sod, Hkv, Nk, pid_bh, blk,
                DV, DV_PAD, V_BLOCK, PV_FP8, OUT_T)


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


def _arch_of(t: torch.Tensor) -> str:
    from ...call_spec import device_arch
    return device_arch(t.device.type, t.device.index)


def triton_quantize_qkv(q, k, v, *, sm_scale: float, smooth_k: bool = True, pv: str = "fp8",
                        qk_group: str = "token", v_transposed: bool = False) -> quant.QuantizedQKV:
    """The spec's prologue as Triton kernels; returns what `quant.quantize_qkv_torch` returns.

    `v_transposed=True` (internal to the Triton attention on Hopper) stores V as (B, Hkv, Dv, Nk_pad)
    and hands out its (B, Hkv, Nk, Dv) transposed view; every other consumer gets contiguous V.
    """
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
    b, hq, nq, d = q.shape
    _, hkv, nk, dv = v.shape
    dev = q.device
    cfg = prologue_config(_arch_of(q))
    d_pad, dv_pad = padded_head_dim(d), padded_head_dim(dv)
    group = quant.group_size(qk_group)

    # 1. Partial K column sums and V column amax per chunk of keys.
    n_chunks = triton.cdiv(nk, cfg.stats_block_n)
    ksum = torch.empty((b * hkv, n_chunks, d_pad), dtype=torch.float32, device=dev) if smooth_k else None
    vmax = torch.empty((b * hkv, n_chunks, dv_pad), dtype=torch.float32, device=dev)
    sub = 32 if max(d_pad, dv_pad) <= 128 else 16
    _kv_stats[(b * hkv, n_chunks)](
        k, v, ksum if smooth_k else vmax, vmax, *k.stride(), *v.stride(), hkv, nk, n_chunks,
        D=d, D_PAD=d_pad, DV=dv, DV_PAD=dv_pad, CHUNK=cfg.stats_block_n, SUB=sub, DO_KSUM=smooth_k,
        num_warps=cfg.num_warps)
    # 2. K mean and V scale per head: a launch of its own for long sequences, else folded into 3.
    k_mean = torch.empty((b, hkv, d), dtype=torch.float32, device=dev) if smooth_k else None
    v_scale = torch.empty((b, hkv, dv), dtype=torch.float32, device=dev)
    fold = n_chunks <= STATS_CH
    if not fold:
        _kv_finalize[(b * hkv,)](
            ksum if smooth_k else vmax, vmax, k_mean if smooth_k else v_scale, v_scale, n_chunks, nk,
            D=d, D_PAD=d_pad, DV=dv, DV_PAD=dv_pad, CH=STATS_CH, DO_KSUM=smooth_k, PV_FP8=pv == "fp8",
            num_warps=4)

    # 3. One launch: INT8 Q (sm_scale*log2e folded in), INT8 K (minus its mean), FP8/FP16 V.
    block = cfg.block_n if group == 1 else group
    q8 = torch.empty((b, hq, nq, d), dtype=torch.int8, device=dev)
    q_scale = torch.empty((b, hq, nq), dtype=torch.float32, device=dev)
    k8 = torch.empty((b, hkv, nk, d), dtype=torch.int8, device=dev)
    k_scale = torch.empty((b, hkv, nk), dtype=torch.float32, device=dev)
    v_dtype = torch.float8_e4m3fn if pv == "fp8" else torch.float16
    if v_transposed:
        # 64-byte aligned rows; a row stride that is a multiple of 1 KiB is skewed by 64 bytes (at
        # Wan 480p the 32 KiB power-of-two stride made the transposed stores twice as slow).
        nk_pad = triton.cdiv(nk, 64) * 64
        nk_pad += 64 if nk_pad % 1024 == 0 else 0
        store = torch.empty((b, hkv, dv, nk_pad), dtype=v_dtype, device=dev)  # the tail is never read
        v_q = store.transpose(2, 3)[:, :, :nk]
    else:
        v_q = torch.empty((b, hkv, nk, dv), dtype=v_dtype, device=dev)
    vb = cfg.block_n
    q_blocks, k_blocks, v_blocks = triton.cdiv(nq, block), triton.cdiv(nk, block), triton.cdiv(nk, vb)
    q_programs, k_programs = b * hq * q_blocks, b * hkv * k_blocks
    warps = cfg.num_warps if max(block * d_pad, vb * dv_pad) <= 64 * 128 else 8
    _quantize_qkv[(q_programs + k_programs + b * hkv * v_blocks,)](
        q, k, v, ksum if smooth_k else vmax, vmax, k_mean if smooth_k else v_scale, v_scale,
        q8, q_scale, k8, k_scale, v_q,
        quant.qk_multiplier(sm_scale), *q.stride(), *k.stride(), *v.stride(), *v_q.stride(),
        hq, hkv, nq, nk, n_chunks, q_blocks, k_blocks, v_blocks, q_programs, k_programs,
        D=d, D_PAD=d_pad, DV=dv, DV_PAD=dv_pad, QK_BLOCK=block, V_BLOCK=vb, PER_BLOCK=group > 1,
        HAS_MEAN=smooth_k, PV_FP8=pv == "fp8", OUT_T=v_transposed, FOLD_STATS=fold, STATS_CH=STATS_CH,
        INTERPRETER=os.environ.get("TRITON_INTERPRET", "0") == "1", num_warps=warps)
    return quant.QuantizedQKV(q8, q_scale, k8, k_scale, v_q, v_scale, k_mean)
