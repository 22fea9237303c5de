"""The Triton attention kernel: INT8 Q.K^T -> INT32, exp2 online softmax, FP8 or FP16 P.V, FP32 accumulate.

Input is a `quant.QuantizedQKV` (any prologue's). Scores are base 2 already (sm_scale*log2e lives in
q_scale). P's grid is the spec's (reference.py, p_tile = BLOCK_N) and the HIP kernels': for FP8 P.V each
key tile's own max, lowered by P_SHIFT = log2(448) - 2**-16, is the shift m of its P = exp2(s - m), which
lands in [0, 447.9953] and goes to e4m3 without a multiply; m is floored FP8_TILE_SHIFT_RANGE below the
running max's shift, and the accumulator and the row sum move to each tile's m (alpha may exceed 1), so the
shifts cancel in acc / l and in the LSE. `row_max - P_SHIFT` rounds in FP32 (at |s| = 1e7 its ulp is 1), so
the shifted max is rounded up by 2**-22 of itself (`_shifted_max`): then s - m <= P_SHIFT for every score of
the tile, also where s * q_scale - m is one FMA (exact product), and P <= 448 holds for every finite input.
FP16 P tops at 2**15 (the running max lowered by 15). Either way a matrix unit that flushes subnormal inputs
drops no weight that counts (docs/MEASUREMENTS.md#one-p-grid-for-the-spec-and-the-kernels).
Head dims are padded to a power of two inside the kernel (masked loads).
Each program owns BLOCK_M query rows of one (batch, head); key tiles run in two stages: full tiles
without masks, then the tail / causal-diagonal tiles with masks. With a key-only mask and PLAIN_MASK_ROWS each program
takes one of two such loops: on a plain padding row (masks.py) the unmasked one up to the row's key end, else the one
adding the bias.

How P.V reaches the FP32 accumulator (PV_ACC, from the config's `pv_accumulate`): NVIDIA's FP8 MMA
(Hopper, Ada) keeps ~13 mantissa bits in its accumulator, so adding each key tile's small product
to a large running sum inside the MMA truncates it; near-uniform attention over tens of thousands of
keys with a V offset lost half its mass that way (rel L1 0.47 at N=32760 on an H200).
  ACC_MMA (0):         acc = dot(p, v, acc)              accumulate in the MMA (FP16 P.V: full FP32)
  ACC_IMPRECISE_K (1): dot(p, v, acc, max_num_imprecise_acc=BLOCK_N): Triton's sm_90 lowering keeps
                       a zeroed partial accumulator per dot and adds it into acc in FP32
  ACC_SPLIT (2):       acc = acc * alpha + dot(p, v)     a zero-initialised dot per tile, added in FP32.
                       Its dot carries max_num_imprecise_acc=BLOCK_N only so that Triton's combiner
                       does not fold the add back into the dot (it folds `x + dot(a, b, 0)` into
                       `dot(a, b, x)` when that attribute is 0, the default off sm_90); no backend but
                       sm_90 reads the attribute otherwise. triton_aot checks the compiled IR for this.
With smooth_v (HAS_VMEAN) V's per-channel mean was taken out in the prologue and comes back here,
after normalising, on every row that saw a key.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import quant
from .configs import AttentionConfig, ceil_div, padded_head_dim
from .launcher import launch, tensor_key
from .prologue import INTERPRETED, round_to_e4m3

# exp2(P_SHIFT) = 447.9953 (the HIP kernels' FP8_P_LOG2_MAX): below 448 by 1.1e-5 relative, far more than exp2's
# error (a few ulp on either target), so P never saturates e4m3; and 45x closer to the spec's 448 than log2(447.797)
# was, whose 4.5e-4 bias on a peaked row's top P was the largest difference from the spec on the tile grid.
P_SHIFT = tl.constexpr(8.80733967)  # log2(448) - 2**-16
FP8_TILE_SHIFT_RANGE = tl.constexpr(quant.FP8_TILE_SHIFT_RANGE)
FP16_P_LOG2_TOP = tl.constexpr(quant.FP16_P_LOG2_TOP)
# Verification: a P above 448 at the FP8 conversion makes its row NaN (as gfx12's non-saturating conversion may),
# so it reaches the output instead of saturating unseen. Always under the interpreter; compiled only where a test
# sets it (and clears attention_launch's cache).
CHECK_P_RANGE = INTERPRETED

# Whether plain padding mask rows (masks.py) take the unmasked key loop. Off until a GPU shows it pays: the second
# loop costs a masked kernel registers for every row (gfx1201 D128: one wave less per SIMD; sm_90 FP8 D128 spills in
# it), and no GPU timing exists yet. tools/mask_cost.py times both settings side by side; a test or tool that sets it
# clears attention_launch's cache.
PLAIN_MASK_ROWS = False

# PV_ACC values (the config's `pv_accumulate` names them).
ACC_MODES = {"mma": 0, "imprecise_k": 1, "split": 2}
# Not specialized on (prologue.QUANTIZE_SIZE_ARGS says why): calls of other lengths and head counts share a compile.
SIZE_ARGS = ["Hq", "Hkv", "Nq", "Nk"]

log = logging.getLogger(__name__)
# Whether a config's inline-asm FP8 conversion is compiled at all: never under the interpreter (it has no inline
# asm and rounds exactly instead). A test sets it to reach the fallback below through the interpreter's refusal.
ASM_CONVERSION = not INTERPRETED
# Why the inline-asm conversion is off in this process (None while it is not known to fail): set by the first
# launch whose asm version raised while the software version of the same launch ran.
asm_conversion_failure: Optional[str] = None


@triton.jit
def _to_e4m3_gfx12(x):
    """FP32 -> e4m3fn with gfx12's v_cvt_pk_fp8_f32 (round to nearest even): Triton 3.6 converts in software
    there (about 10 VALU instructions a value). One value per instruction, in the low byte of a 32-bit
    register (the inline-asm outputs must be full registers); Triton packs the bytes for the WMMA.
    P <= 448 here by construction (`_shifted_max`), so no saturation is needed; on gfx12 this conversion does
    not saturate (the HIP kernels use the same instruction)."""
    bits = tl.inline_asm_elementwise("v_cvt_pk_fp8_f32 $0, $1, $1", "=v,v", [x], dtype=tl.int32, is_pure=True,
                                     pack=1)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _shifted_max(row_max, TOP: tl.constexpr, EXACT_S: tl.constexpr, MAY_BE_EMPTY: tl.constexpr = True):
    """fl(row_max - TOP) raised by 2**-22 of itself: at least the exact row_max - TOP plus the half ulp an FMA's
    unrounded s * q_scale can exceed the rounded row max by (|c| * 2**-22 is >= 2 ulp of c), so P <= 2**TOP
    (FP8: 447.9953; FP16: 2**15, which without the raise passed 65504 at scores past 2**24). The top P then sits up
    to 2**-22 |c| binades below 2**TOP: nothing at ordinary scores, 3.4 binades at |s| = 1.4e7, where the scores'
    own FP32 step is 1; past ~1e8 it underflows and the row comes out 0. A row with no key stays -inf.
    EXACT_S (scores rounded to FP32 before the max, as without FOLD_Q_SCALE): where TOP vanishes in the rounding
    (|row_max| >= 2**28) c is the row max itself, so P <= 1 with no raise; the raise would put every P of a row
    near -FP32 max (a -finfo.max mask) to 0.
    MAY_BE_EMPTY off (a tile with neither a mask nor a bias: every row has a finite max, or an all-NaN row whose max
    a GPU gives as -inf and whose shift then comes out NaN, which the running max drops) saves the -inf select."""
    c = row_max - TOP
    raised = c + tl.abs(c) * 2.384185791015625e-07
    if EXACT_S:
        raised = tl.where(c == row_max, c, raised)
    if MAY_BE_EMPTY:
        raised = tl.where(c == float("-inf"), c, raised)
    return raised


@triton.jit
def _key_tile(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base, start_n,
              offs_m, offs_n, offs_d, offs_dv, key_bound, skn, svn, svd,
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
              PV_FP8: tl.constexpr, V_T: tl.constexpr, EXACT_P_ROUND: tl.constexpr, PV_ACC: tl.constexpr,
              FOLD_Q_SCALE: tl.constexpr, FP8_CVT_ASM: tl.constexpr, CHECK_P: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """One key tile into the running softmax. MASKED tiles drop the keys at or past key_bound (Nk, or a plain
    padding row's key end) and, with IS_CAUSAL, those right of each query row. FOLD_Q_SCALE must be off with
    HAS_BIAS (the bias is added to whole scores)."""
    cols = start_n + offs_n
    k_ptrs = k_base + cols[:, None] * skn + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=(cols[:, None] < key_bound) & (offs_d[None, :] < HEAD_DIM), other=0)
        ks = tl.load(ks_base + cols, mask=cols < key_bound, other=0.0)
    elif HEAD_DIM == D_PAD:
        k = tl.load(k_ptrs)
        ks = tl.load(ks_base + cols)
    else:
        k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0)
        ks = tl.load(ks_base + cols)
    if FOLD_Q_SCALE:
        # q_scale > 0 per row commutes with the row max, so it folds into exp2's argument as one FMA
        # instead of an outer-product multiply per score (H200: Wan 480p fp8 1.06 -> 1.00x cuDNN).
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * ks[None, :]
    elif HAS_BIAS:
        # A key-only mask's base-2 bias, one value per key, added to whole scores (FOLD_Q_SCALE is off): the row
        # scale and the bias in one FMA per score.
        if MASKED:
            bias = tl.load(bias_base + cols, mask=cols < key_bound, other=float("-inf"))
        else:
            bias = tl.load(bias_base + cols)
        s = (tl.dot(q, tl.trans(k)).to(tl.float32) * ks[None, :]) * q_scale[:, None] + bias[None, :]
        if HAS_BIAS == 2:  # a bool mask selects: its masked keys are -inf whatever their score (NaN too)
            s = tl.where(bias[None, :] == float("-inf"), float("-inf"), s)
    else:
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * (q_scale[:, None] * ks[None, :])
    if MASKED:
        keep = cols[None, :] < key_bound
        if IS_CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
    row_max = tl.max(s, 1)
    if FOLD_Q_SCALE:
        row_max = row_max * q_scale
    if PV_FP8:
        # This tile's own max is its P's top, floored FP8_TILE_SHIFT_RANGE below the running max: P <= 448 as
        # before (the shift is at least this tile's _shifted_max), and e4m3's normals reach 2^-14.8 of the tile's
        # max instead of the row's (m_new: this tile's shift, m_run: the running max's).
        tile_shift = _shifted_max(row_max, P_SHIFT, not FOLD_Q_SCALE)
        m_run = tl.maximum(m_run, tile_shift)
        m_new = tl.maximum(tile_shift, m_run - FP8_TILE_SHIFT_RANGE)
    else:
        # FP16 P tops at 2^15: every weight above 2^-29 of the running max is an fp16 normal.
        m_new = tl.maximum(m_i, _shifted_max(row_max, FP16_P_LOG2_TOP, not FOLD_Q_SCALE, MASKED or HAS_BIAS))
    m_exp = m_new
    if HAS_BIAS:
        # A mask can hide every key of a row so far (max -inf): exp2(-inf - -inf) would be NaN, and the epilogue
        # tells such a row (row sum 0) from a NaN row (row sum NaN) by it. Without a mask every row sees a key.
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FOLD_Q_SCALE:
        p = tl.math.exp2(s * q_scale[:, None] - m_exp[:, None])
    else:
        p = tl.math.exp2(s - m_exp[:, None])
    alpha = tl.math.exp2(m_i - m_exp)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_T:
        vt_ptrs = v_base + offs_dv[:, None] * svd + cols[None, :] * svn
        if MASKED or DV != DV_PAD:
            vt = tl.load(vt_ptrs, mask=(cols[None, :] < key_bound) & (offs_dv[:, None] < DV), other=0.0)
        else:
            vt = tl.load(vt_ptrs)
        v = tl.trans(vt)
    else:
        v_ptrs = v_base + cols[:, None] * svn + offs_dv[None, :] * svd
        if MASKED or DV != DV_PAD:
            v = tl.load(v_ptrs, mask=(cols[:, None] < key_bound) & (offs_dv[None, :] < DV), other=0.0)
        else:
            v = tl.load(v_ptrs)
    if PV_FP8:
        if CHECK_P:  # through the row sum: the interpreter's own FP8 cast turns a NaN P into a number
            l_i = tl.where(tl.max((p > 448.0).to(tl.int32), 1) > 0, float("nan"), l_i)
        if EXACT_P_ROUND:
            p = round_to_e4m3(p)
        if FP8_CVT_ASM:
            p = _to_e4m3_gfx12(p)
        else:
            p = p.to(tl.float8e4nv)
    else:
        p = p.to(tl.float16)
    if PV_ACC == 2:
        # The attribute keeps the add from being folded back into the dot (see the module docstring).
        acc = acc * alpha[:, None] + tl.dot(p, v, max_num_imprecise_acc=BLOCK_N)
    elif PV_ACC == 1:
        acc = tl.dot(p, v, acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
    else:
        acc = tl.dot(p, v, acc * alpha[:, None])
    return acc, l_i, m_new, m_run


@triton.jit
def _key_tiles(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base, lo, hi,
               offs_m, offs_n, offs_d, offs_dv, key_bound, skn, svn, svd,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
               PV_FP8: tl.constexpr, V_T: tl.constexpr, EXACT_P_ROUND: tl.constexpr,
               PV_ACC: tl.constexpr, FOLD_Q_SCALE: tl.constexpr, FP8_CVT_ASM: tl.constexpr,
               CHECK_P: tl.constexpr, HAS_BIAS: tl.constexpr, WHILE_LOOP: tl.constexpr):
    if WHILE_LOOP:
        # Interpreter only: Triton 3.6's interpreter cannot take runtime range() bounds with numpy 2.
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i, m_run = _key_tile(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base,
                                             start_n, offs_m, offs_n, offs_d, offs_dv, key_bound, skn, svn, svd,
                                             HEAD_DIM, D_PAD, DV, DV_PAD, BLOCK_N, MASKED, IS_CAUSAL, PV_FP8, V_T,
                                             EXACT_P_ROUND, PV_ACC, FOLD_Q_SCALE, FP8_CVT_ASM, CHECK_P, HAS_BIAS)
            start_n += BLOCK_N
    else:
        # A for loop, so the software pipeliner can overlap loads with compute (num_stages > 1).
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i, m_run = _key_tile(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base,
                                             start_n, offs_m, offs_n, offs_d, offs_dv, key_bound, skn, svn, svd,
                                             HEAD_DIM, D_PAD, DV, DV_PAD, BLOCK_N, MASKED, IS_CAUSAL, PV_FP8, V_T,
                                             EXACT_P_ROUND, PV_ACC, FOLD_Q_SCALE, FP8_CVT_ASM, CHECK_P, HAS_BIAS)
    return acc, l_i, m_i, m_run


@triton.jit
def _key_range(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base, full_end, hi,
               offs_m, offs_n, offs_d, offs_dv, key_bound, skn, svn, svd,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
               PV_FP8: tl.constexpr, V_T: tl.constexpr, EXACT_P_ROUND: tl.constexpr,
               PV_ACC: tl.constexpr, FOLD_Q_SCALE: tl.constexpr, FP8_CVT_ASM: tl.constexpr,
               CHECK_P: tl.constexpr, HAS_BIAS: tl.constexpr, WHILE_LOOP: tl.constexpr):
    """The keys [0, hi) of one program: the full tiles below full_end without masks, then the rest masked at
    key_bound."""
    acc, l_i, m_i, m_run = _key_tiles(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base, 0, full_end,
                                      offs_m, offs_n, offs_d, offs_dv, key_bound, skn, svn, svd,
                                      HEAD_DIM, D_PAD, DV, DV_PAD, BLOCK_N, False, IS_CAUSAL, PV_FP8, V_T,
                                      EXACT_P_ROUND, PV_ACC, FOLD_Q_SCALE, FP8_CVT_ASM, CHECK_P, HAS_BIAS,
                                      WHILE_LOOP)
    acc, l_i, m_i, m_run = _key_tiles(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base,
                                      full_end, hi, offs_m, offs_n, offs_d, offs_dv, key_bound, skn, svn, svd,
                                      HEAD_DIM, D_PAD, DV, DV_PAD, BLOCK_N, True, IS_CAUSAL, PV_FP8, V_T,
                                      EXACT_P_ROUND, PV_ACC, FOLD_Q_SCALE, FP8_CVT_ASM, CHECK_P, HAS_BIAS,
                                      WHILE_LOOP)
    return acc, l_i, m_i, m_run


@triton.jit(do_not_specialize=SIZE_ARGS)
def _sage_attn_fwd(Q8, QS, K8, KS, V, VS, VM, O, LSE, BIAS, KEND, PLAIN,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, svd, sob, soh, son, sks, sbb, sbh, seb, seh, spb, sph,
                   Hq, Hkv, Nq, Nk,
                   KV_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, PV_FP8: tl.constexpr, STORE_LSE: tl.constexpr,
                   V_T: tl.constexpr, EXACT_P_ROUND: tl.constexpr, PV_ACC: tl.constexpr,
                   HAS_VMEAN: tl.constexpr, FOLD_Q_SCALE: tl.constexpr, FP8_CVT_ASM: tl.constexpr,
                   CHECK_P: tl.constexpr, HAS_BIAS: tl.constexpr, PLAIN_ROWS: tl.constexpr,
                   INTERPRETER: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // KV_GROUP
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    q_row0 = (b64 * Hq + h64) * Nq   # (B, Hq, Nq) scales / LSE
    k_row0 = (b64 * Hkv + hk64) * sks  # (B, Hkv, Nk) scales, rows sks apart (the prologue may pad them)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    m_live = offs_m < Nq

    q = tl.load(Q8 + b64 * sqb + h64 * sqh + offs_m[:, None] * sqn + offs_d[None, :],
                mask=m_live[:, None] & (offs_d[None, :] < HEAD_DIM), other=0)
    # Rows past Nq get scale 1: 0 would make 0 * -inf = NaN in the folded exp2 argument of masked tiles.
    q_scale = tl.load(QS + q_row0 + offs_m, mask=m_live, other=1.0)
    k_base = K8 + b64 * skb + hk64 * skh
    ks_base = KS + k_row0
    v_base = V + b64 * svb + hk64 * svh
    bias_base = BIAS + b64 * sbb + h64 * sbh  # (Bm, Hm, Nk) FP32 base-2 bias; stride 0 where it broadcasts

    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    m_run = m_i  # FP8: the running max's shift (FP16: unused)

    full_end = (Nk // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        # Tiles left of this block's first row need no mask (BLOCK_M is a multiple of BLOCK_N).
        hi = tl.minimum(start_m + BLOCK_M, Nk)
        full_end = tl.minimum(full_end, start_m)
    else:
        hi = Nk
    if HAS_BIAS:
        # Keys past the mask row's last live one are dead (bias -inf, weight 0): their tiles are skipped.
        key_end = tl.load(KEND + b64 * seb + h64 * seh)
        hi = tl.minimum(hi, key_end)
        full_end = tl.minimum(full_end, (key_end // BLOCK_N) * BLOCK_N)
        plain_row = False
        if PLAIN_ROWS:
            plain_row = tl.load(PLAIN + b64 * spb + h64 * sph) != 0
        if plain_row:
            # Plain padding (every key before key_end live with bias 0): the unmasked loop, its tail cut at key_end.
            # Key 0 is live, so the first tile gives every query row a finite max, as in an unmasked call.
            acc, l_i, m_i, m_run = _key_range(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base,
                                              full_end, hi, offs_m, offs_n, offs_d, offs_dv, key_end, skn, svn, svd,
                                              HEAD_DIM, D_PAD, DV, DV_PAD, BLOCK_N, IS_CAUSAL, PV_FP8, V_T,
                                              EXACT_P_ROUND, PV_ACC, FOLD_Q_SCALE, FP8_CVT_ASM, CHECK_P, 0,
                                              INTERPRETER)
        else:
            acc, l_i, m_i, m_run = _key_range(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base,
                                              full_end, hi, offs_m, offs_n, offs_d, offs_dv, Nk, skn, svn, svd,
                                              HEAD_DIM, D_PAD, DV, DV_PAD, BLOCK_N, IS_CAUSAL, PV_FP8, V_T,
                                              EXACT_P_ROUND, PV_ACC, False, FP8_CVT_ASM, CHECK_P, HAS_BIAS,
                                              INTERPRETER)
    else:
        acc, l_i, m_i, m_run = _key_range(acc, l_i, m_i, m_run, q, q_scale, k_base, ks_base, v_base, bias_base,
                                          full_end, hi, offs_m, offs_n, offs_d, offs_dv, Nk, skn, svn, svd,
                                          HEAD_DIM, D_PAD, DV, DV_PAD, BLOCK_N, IS_CAUSAL, PV_FP8, V_T,
                                          EXACT_P_ROUND, PV_ACC, FOLD_Q_SCALE, FP8_CVT_ASM, CHECK_P, 0, INTERPRETER)

    v_scale = tl.load(VS + (b64 * Hkv + hk64) * DV + offs_dv, mask=offs_dv < DV, other=0.0)
    inv_l = 1.0 / l_i
    # acc / l first, as the spec: inv_l * v_scale underflows FP32 for tiny V scales (down to 2**-126).
    out = (acc * inv_l[:, None]) * v_scale[None, :]
    if HAS_VMEAN:
        # smooth_v: each row of P sums to 1, so V's mean comes back whole.
        v_mean = tl.load(VM + (b64 * Hkv + hk64) * DV + offs_dv, mask=offs_dv < DV, other=0.0)
        out = out + v_mean[None, :]
    # A row with row sum 0 gives zeros: one the mask leaves no key (0 / 0), or one whose weights all underflowed
    # (base-2 scores past ~1e8, where the raised shifts put the top P below FP32's range). A NaN row keeps its NaN:
    # its row sum is NaN (sums keep NaN everywhere), even where m_i stayed -inf (a GPU's max drops NaN operands).
    out = tl.where((l_i == 0.0)[:, None], 0.0, out)
    if O.dtype.element_ty == tl.float16:
        # Rounding P (FP8: up to 6%) can lift a convex combination of V just past max|V|; at 65504 that
        # is Inf in FP16. Bring that small overshoot back to the largest FP16; real Inf/NaN stay as they are.
        big = tl.abs(out)
        out = tl.where((big > 65504.0) & (big < 73728.0), tl.where(out > 0, 65504.0, -65504.0), out)
    tl.store(O + b64 * sob + h64 * soh + offs_m[:, None] * son + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=m_live[:, None] & (offs_dv[None, :] < DV))
    if STORE_LSE:
        # Natural-log LSE of the base-2 scores; the last tile's shift (and FP8's 448, FP16's 2^15) cancels between
        # m_i and l_i.
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(LSE + q_row0 + offs_m, lse, mask=m_live)


@functools.lru_cache(maxsize=256)
def attention_launch(b: int, hq: int, nq: int, d: int, hkv: int, dv: int, config: AttentionConfig, pv: str,
                     is_causal: bool, return_lse: bool, v_t: bool, has_vmean: bool, has_bias: int = 0):
    """(grid, constexprs and launch options) of `_sage_attn_fwd` for one signature: computed once per signature.
    `has_bias`: 0 no mask, 1 a key-only bias added, 2 added and its -inf keys set to -inf (a bool mask).
    FOLD_Q_SCALE is the form of the tiles without a bias (unmasked calls, plain padding rows); biased tiles never
    fold. PLAIN_ROWS (PLAIN_MASK_ROWS, for a masked call): plain padding rows take the unmasked loop."""
    grid = (ceil_div(nq, config.block_m), b * hq)
    meta = dict(KV_GROUP=hq // hkv, HEAD_DIM=d, D_PAD=padded_head_dim(d), DV=dv, DV_PAD=padded_head_dim(dv),
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, IS_CAUSAL=is_causal, PV_FP8=pv == "fp8",
                STORE_LSE=return_lse, V_T=v_t, EXACT_P_ROUND=INTERPRETED, PV_ACC=ACC_MODES[config.pv_accumulate],
                HAS_VMEAN=has_vmean, FOLD_Q_SCALE=config.fold_q_scale, HAS_BIAS=has_bias,
                PLAIN_ROWS=bool(has_bias) and PLAIN_MASK_ROWS,
                FP8_CVT_ASM=config.fp8_cvt_asm and pv == "fp8" and ASM_CONVERSION, CHECK_P=CHECK_P_RANGE,
                INTERPRETER=INTERPRETED, num_warps=config.num_warps, num_stages=config.num_stages)
    return grid, meta


def _launch_attention(grid, args, meta, key, software_meta):
    """Launch; where the inline-asm FP8 conversion fails (a Triton or LLVM that rejects the asm), launch the
    software conversion instead and keep it for the rest of the process, saying why once."""
    global asm_conversion_failure
    if not meta["FP8_CVT_ASM"]:
        return launch(_sage_attn_fwd, grid, args, meta, key)
    if asm_conversion_failure is not None:
        return launch(_sage_attn_fwd, grid, args, software_meta(), key)
    try:
        return launch(_sage_attn_fwd, grid, args, meta, key)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001  (compile errors come as many types; the retry below decides)
        soft = software_meta()
        result = launch(_sage_attn_fwd, grid, args, soft, key)  # raises if the asm was not the problem
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        asm_conversion_failure = f"{type(exc).__name__}: {first}"
        log.warning("sage_rdna4: Triton FP8 attention: the inline-asm v_cvt_pk_fp8_f32 conversion failed (%s); "
                    "using Triton's software conversion from now on in this process", asm_conversion_failure)
        return result


def _scale_row_stride(scales: torch.Tensor) -> Optional[int]:
    """The distance between consecutive (batch, head) rows of (B, H, N) scales, or None when the rows are not
    unit-stride and evenly spaced (the kernel addresses row b * H + h at that multiple)."""
    b, h, n = scales.shape
    s0, s1, s2 = scales.stride()
    if n > 1 and s2 != 1:
        return None
    if h > 1:
        return s1 if b == 1 or s0 == h * s1 else None
    # One row: only row 0 is addressed, so any stride serves; a multiple of 16, as the padded rows' own, keeps
    # such calls on the kernel the others compiled (Triton specializes on it).
    return s0 if b > 1 else ceil_div(n, 16) * 16


def _broadcast_strides(t: torch.Tensor):
    """(batch, head) strides of a (1 or B, 1 or H, ...) operand: 0 where it broadcasts."""
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in (0, 1))


def _key_mask_args(key_bias, key_end, key_plain, b: int, hq: int, nk: int):
    """Validated key-mask operands with their (batch, head) strides: (bias strides, key_end, its strides, key_plain,
    its strides). A missing key_end is Nk (nothing skipped), a missing key_plain 0 (every row biased)."""
    if key_bias.dim() != 3 or key_bias.dtype != torch.float32 or key_bias.shape[-1] != nk or \
            (nk > 1 and key_bias.stride(-1) != 1) or key_bias.shape[0] not in (1, b) or \
            key_bias.shape[1] not in (1, hq):
        raise ValueError(f"key_bias must be FP32 (1 or B, 1 or Hq, Nk) with unit-stride keys, got "
                         f"{tuple(key_bias.shape)} {key_bias.dtype} strides {key_bias.stride()}")
    device = key_bias.device
    if key_end is None:
        key_end = torch.full((1, 1), nk, dtype=torch.int32, device=device)
    if key_plain is None:
        key_plain = torch.zeros((1, 1), dtype=torch.int8, device=device)
    for name, t, dtype in (("key_end", key_end, torch.int32), ("key_plain", key_plain, torch.int8)):
        if t.dtype != dtype or t.dim() != 2 or any(t.shape[i] not in (1, key_bias.shape[i]) for i in (0, 1)):
            raise ValueError(f"{name} must be {str(dtype).split('.')[1]} (1 or B, 1 or Hq) as key_bias's, got "
                             f"{tuple(t.shape)} {t.dtype}")
    return _broadcast_strides(key_bias), key_end, _broadcast_strides(key_end), key_plain, \
        _broadcast_strides(key_plain)


def attention_from_quantized_triton(qq: quant.QuantizedQKV, *, pv: str, config: AttentionConfig,
                                    is_causal: bool = False, return_lse: bool = False,
                                    out_dtype: torch.dtype = torch.float16,
                                    out: Optional[torch.Tensor] = None,
                                    key_bias: Optional[torch.Tensor] = None,
                                    key_end: Optional[torch.Tensor] = None, key_fill: bool = False,
                                    key_plain: Optional[torch.Tensor] = None):
    """Attention on a prologue's output. Returns (out (B, Hq, Nq, Dv) in out_dtype, LSE of the
    smoothed scores (B, Hq, Nq) fp32 or None). The caller adds the smooth_k term to the LSE.
    A `qq.v_mean` (smooth_v) is added back to the output; the LSE does not depend on it.
    `key_bias`: a key-only mask as FP32 base-2 bias (quant.mask_bias_base2) broadcasting to (B, Hq, Nk), its
    last dim unit-stride; it is added to every query row's scores. `key_end` (int32, key_bias's (1 or B, 1 or Hq)):
    the keys from there on are dead (bias -inf) and skipped; None: none is skipped. `key_fill` (a bool mask's
    bias): its -inf keys get score -inf whatever q.k is, as a bool mask selects. `key_plain` (int8, key_end's
    (1 or B, 1 or Hq)): nonzero on mask rows that are plain padding, i.e. every key before key_end live with bias
    exactly 0 and every key from key_end on dead (masks.key_mask_operands computes it); with PLAIN_MASK_ROWS such rows
    run the unmasked key loop over [0, key_end) and read no bias. None: no row is plain (every row adds its bias)."""
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
    q8, k8, v = qq.q8, qq.k8, qq.v
    b, hq, nq, d = q8.shape
    _, hkv, nk, dv = v.shape
    if config.block_m % config.block_n:
        raise ValueError("block_m must be a multiple of block_n (causal tiling)")
    q_strides, k_strides, v_strides = q8.stride(), k8.stride(), v.stride()
    for name, strides in (("q8", q_strides), ("k8", k_strides)):
        if strides[-1] != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    ks_row = _scale_row_stride(qq.k_scale)
    if ks_row is None or not qq.q_scale.is_contiguous():
        raise ValueError("q_scale must be contiguous and k_scale's (B, Hkv, Nk) rows unit-stride and evenly spaced")
    v_t = v_strides[-2] == 1 and v_strides[-1] != 1  # the (Dv, Nk) storage the Hopper config asks for
    device = q8.device
    if out is None:
        out = torch.empty((b, hq, nq, dv), dtype=out_dtype, device=device)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=device) if return_lse else None
    has_vmean = qq.v_mean is not None
    if has_vmean and (qq.v_mean.shape != qq.v_scale.shape or not qq.v_mean.is_contiguous()
                      or qq.v_mean.dtype != torch.float32):
        raise ValueError("v_mean must be a contiguous FP32 (B, Hkv, Dv) tensor")
    has_bias = 0 if key_bias is None else (2 if key_fill else 1)
    if has_bias:
        bias_strides, key_end, end_strides, key_plain, plain_strides = _key_mask_args(key_bias, key_end, key_plain,
                                                                                      b, hq, nk)
    else:
        bias_strides = end_strides = plain_strides = (0, 0)
    grid, meta = attention_launch(b, hq, nq, d, hkv, dv, config, pv, bool(is_causal), bool(return_lse), v_t,
                                  has_vmean, has_bias)
    o_strides = out.stride()
    tensors = (q8, qq.q_scale, k8, qq.k_scale, v, qq.v_scale, qq.v_mean if has_vmean else qq.v_scale, out,
               lse if return_lse else qq.q_scale, key_bias if has_bias else qq.q_scale,
               key_end if has_bias else qq.q_scale, key_plain if has_bias else qq.q_scale)
    # Triton specializes on each tensor's dtype and alignment and on the strides (the sizes are in the plan).
    key = (tuple(tensor_key(t) for t in tensors), q_strides, k_strides, v_strides, o_strides, ks_row, bias_strides,
           end_strides, plain_strides)
    args = (*tensors, *q_strides[:3], *k_strides[:3], *v_strides, *o_strides[:3], ks_row, *bias_strides,
            *end_strides, *plain_strides, hq, hkv, nq, nk)
    signature = (b, hq, nq, d, hkv, dv)
    flags = (pv, bool(is_causal), bool(return_lse), v_t, has_vmean, has_bias)
    _launch_attention(grid, args, meta, key, lambda: attention_launch(
        *signature, dataclasses.replace(config, fp8_cvt_asm=False), *flags)[1])
    return out, lse
