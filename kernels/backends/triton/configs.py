"""Launch configurations of the Triton kernels, per GPU architecture.

Pure data (no triton import), so the backend's acceptance rule and the AOT checks can read it cheaply.
RDNA4 (gfx12) must use num_stages=1: the AMD software pipeliner crashes on gfx12 with more stages
(SageAttention #365, WanVideoWrapper #2007). Every shipped RDNA4 entry is compiled for gfx1200 and
gfx1201 by `aot.py` and checked for spills and LDS there.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, Tuple

from ... import settings

RDNA4_ARCHS = ("gfx1200", "gfx1201")
MAX_HEAD_DIM = 256

# How each key tile's P.V product reaches the FP32 accumulator (attention.py explains the kernel side):
#   "mma"          acc = dot(p, v, acc): accumulated inside the MMA. Exact enough where the MMA accumulates
#                  in full FP32 (FP16 MMA on NVIDIA); NVIDIA's FP8 MMA keeps ~13 mantissa bits and loses
#                  the small increments of diffuse attention over long sequences (rel L1 0.47 at N=32760).
#   "imprecise_k"  dot(p, v, acc, max_num_imprecise_acc=block_n): Triton's own partial accumulator on
#                  sm_90 (wgmma into a zeroed register tile, added into acc in FP32 after each tile).
#   "split"        acc = acc * alpha + dot(p, v): a zero-initialised dot per tile, added in FP32.
PV_ACCUMULATE = ("mma", "imprecise_k", "split")


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int      # query rows per program
    block_n: int      # keys per tile (one softmax rescale per tile)
    num_warps: int
    num_stages: int
    v_transposed: bool = False  # V stored (Dv, Nk): K-major for the P.V dot (Hopper fp8 wgmma needs it)
    pv_accumulate: str = "mma"  # one of PV_ACCUMULATE: how each tile's P.V reaches the FP32 accumulator
    fold_q_scale: bool = False  # multiply the scores by q's row scale inside exp2's FMA, not per score
    fp8_cvt_asm: bool = False   # gfx12: P to FP8 with v_cvt_pk_fp8_f32 (inline asm), not Triton's software conversion

    def __post_init__(self):
        if self.pv_accumulate not in PV_ACCUMULATE:
            raise ValueError(f"pv_accumulate must be one of {PV_ACCUMULATE}, got {self.pv_accumulate!r}")


@dataclass(frozen=True)
class PrologueConfig:
    block_n: int      # tokens per program in the quantize kernels (token groups)
    stats_block_n: int  # tokens per program in the K-mean / V-amax pass
    num_warps: int


def padded_head_dim(d: int) -> int:
    """Head dims are padded inside the kernels to a power of two >= 32 (the INT8 dot's K on NVIDIA)."""
    return 1 << (d - 1).bit_length() if d > 32 else 32


def ceil_div(a: int, b: int) -> int:
    """Host-side ceiling division: `triton.cdiv` is a constexpr function in Triton 3.6 and costs
    microseconds per host call (it unwraps constexpr arguments)."""
    return -(-a // b)


# Keyed by (padded head dim, pv). RDNA4: wave32, 64 KiB LDS, VGPRs decide occupancy; BM=128 with 8 waves
# gives each wave 16 query rows (one WMMA tile high), like the seed's HIP kernel.
# Chosen from the AOT reports (aot.py) with Triton 3.6 and 3.8: the largest tiles that spill no VGPR
# on gfx1201 under both (BN=64 at D128 spilled 29 VGPRs with 3.6; D256 needs BN=16 and 8 waves).
# FP8 P.V accumulates "split": nobody could tell whether gfx12's FP8 WMMA keeps a full FP32 accumulator,
# and the split form compiles without VGPR spills for every entry (Triton 3.6, gfx1201; VGPRs mma -> split:
# D32 110 -> 114, D64 138 -> 156, D128 225 -> 212, D256 215 -> 217; LDS unchanged). FP16 P.V stays "mma".
_RDNA4_GEOMETRY = {32: (128, 32, 8), 64: (128, 32, 8), 128: (128, 32, 8), 256: (64, 16, 8)}
# What the compiled gfx1201 key loop spends per WMMA (Triton 3.6, AOT, non-WMMA instructions per v_wmma in the
# unmasked loop, waits included; measured 2026-12-01 with tests/test_triton_aot.py's compiler, no hardware):
#   FP8 P.V: Triton converts P to e4m3 in software on gfx12 (~10 VALU a value) and, with V stored (Nk, Dv),
#   reads FP8 V from LDS a byte at a time (ds_load_u8). V stored (Dv, Nk) ("v_transposed"), P converted with
#   v_cvt_pk_fp8_f32 ("fp8_cvt_asm") and q's scale folded: D32 155 -> 45, D64 86 -> 21, D128 44 -> 13,
#   D256 38 -> 12.6, VGPRs no higher (D128 212 -> 201, SGPR spills 4 -> 0), occupancy no lower (D64 9 -> 10).
#   Then k_scale rows padded to 16 entries (prologue.py, pad_k_scale_rows), so each tile's scales are read 4 at a
#   time whatever the key count: FP8 45 -> 33.9, 21 -> 17.2 (10 -> 12 waves), 13 -> 10.3, 12.6 -> 11.0; FP16 D32 /
#   64 / 128 / 256 39.9 -> 31.3, 26.2 -> 20.3, 11.9 -> 9.3, 16.0 -> 14.4; no VGPRs more, occupancy no lower.
#   (Before, only key counts that are multiples of 16, which Triton specializes on, got the wide reads.)
#   FP16 P.V: V (Dv, Nk) at D32 44.6 -> 39.9 and D128 16.2 -> 11.9 at the same occupancy; at D64 (26.2 -> 20.1)
#   and D256 (16.0 -> 12.5) it costs a wave per SIMD (12 -> 10, 8 -> 7), so those stay (Nk, Dv) until measured.
#   With the padded k_scale rows (2026-12-01): D64 itself would keep 12 waves (20.3 -> 15.3, VGPRs 111 -> 120), but
#   SD1.5's D40, which shares the D64 entry, drops 12 -> 10 (20.9 -> 19.8), and waves_per_eu=12 costs 2-3
#   instructions per v_wmma and spills the causal variant: still (Nk, Dv).
#   Folding q's scale made FP16 D128 worse (16.2 -> 18.1): off for FP16.
_RDNA4_FP16_V_T = (32, 128)
# SAGE_RDNA4_TRITON_FP8_CVT=software (kernels/settings.py): convert P to FP8 with Triton's own code instead of
# v_cvt_pk_fp8_f32 (a way out should the inline asm misbehave on some ROCm stack: the self-check would then have
# disabled triton_int8_fp8 with its reason).
_RDNA4: Dict[Tuple[int, str], AttentionConfig] = {}
for _d, (_bm, _bn, _w) in _RDNA4_GEOMETRY.items():
    _RDNA4[(_d, "fp8")] = AttentionConfig(_bm, _bn, _w, 1, True, "split", fold_q_scale=True, fp8_cvt_asm=True)
    _RDNA4[(_d, "fp16")] = AttentionConfig(_bm, _bn, _w, 1, _d in _RDNA4_FP16_V_T, "mma")

# Hopper (sm_90): Triton emits wgmma for the INT8 and FP8 dots; FP8 wgmma wants a K-major B, so V is stored
# (Dv, Nk) (without it: 2.3x slower). FP8 P.V accumulates "imprecise_k": wgmma's FP8 accumulator keeps ~13 bits,
# and "mma" (1.00x cuDNN at Wan 480p) lost half the output's mass on diffuse attention over 32k keys; "split"
# costs 1.60x. The partial accumulator doubles P.V's registers: before the fold below, BM128 BN64 w4 spilled
# (1.59x) and BM128 BN128 w8 s3 (1.06x) was shipped. FP16 wgmma accumulates in FP32: "mma", BM128 BN64 w4 s4
# (before the fold at Wan 480p: s4 1.09, BN128 w8 1.21, BM64 BN64 1.35; at Flux 1 MP s4 beat s3).
# All attention alone, time / cuDNN SDPA, H200 (tools/triton_h200.py --sweep, tools/triton_config_sweep.py).
# fold_q_scale (attention alone / cuDNN, H200, 2026-12-01, a one-off sweep of score-path variants): D128
# Wan 480p fp8 1.06 -> 1.00, fp16 1.10 -> 1.06; Flux 1 MP fp8 1.29 -> 1.22, fp16 1.67 -> 1.34; D64 (SDXL)
# slower at the D64 tiles of then (BM128 BN128 w8 for FP8), fp8 1.64 -> 1.80, fp16 1.59 -> 1.74 (D64 FP8 now folds
# at other tiles, below). Tried and dropped in the
# same sweep: int32 -> FP32 by the 1.5 * 2**23 bit trick instead of I2F (1.00 -> 1.08 at Wan 480p) and exp2 in
# packed FP16 (1.14). Folding frees the BM x BN scale tile, so FP8 "imprecise_k" fits BM128 BN64 w4 again
# (attention alone / cuDNN, Wan 480p / Flux 1 MP, the list in tools/triton_h200.py SWEEP): BM128 BN64 w4 s4
# 0.94 / 1.19, s3 0.94 / 1.18, BM128 BN128 w8 s3 1.00 / 1.28, BN128 w8 s2 1.10 / 1.54, BM64 BN64 w4 1.09 / 1.33,
# BN64 w8 1.16 / 1.51; diffuse + V offset rel L1 0.0020 for all. FP16 with the fold: BM128 BN64 w4 s4
# 1.05 / 1.32 stays (s3 1.05 / 1.38, BN128 w8 1.15).
# D64 FP8 (2026-12-01 second sweep, attention alone / cuDNN, SDXL B2 H10 N4096 / B1 H10 N4096 / SD1.5's D40 B2 H8
# N4096, `.exp`-style one-off runs of tools/triton_config_sweep.py's method): BM128 BN128 w8 s3 1.64 / 1.45 / 2.46
# -> BM128 BN64 w4 s4 with the folded q scale 1.31 / 1.42 / 1.69 (one warpgroup per CTA, two CTAs per SM instead of
# one; diffuse + V offset rel L1 0.0016, was 0.0018). BM64 BN64 w4 s4 folded: 1.25 / 1.15 / 1.96 (not taken: SD1.5).
# D64 FP16 with the fold: 1.56 / 1.55 / 2.02 against 1.50 / 1.64 / 2.22 unfolded: mixed, left as it was.
# Why none of these overlaps MMA with the softmax, and what un-serialised variants measured (FP8 "mma" with the
# key loop assumed non-empty 0.87x at Wan 480p but rel L1 0.47, and with smooth_v still 0.10 on regional V offsets,
# benchmark.py's regional_voffset; periodic FP32 flushes, two 64-row halves, BM64 "split", FP16 un-serialised: all
# slower than the entries below): README, "Measured" (2026-12-01, ncu_profile.py).
_HOPPER: Dict[Tuple[int, str], AttentionConfig] = {
    (32, "fp8"): AttentionConfig(128, 128, 8, 3, True, "imprecise_k"),
    (64, "fp8"): AttentionConfig(128, 64, 4, 4, True, "imprecise_k", fold_q_scale=True),
    (128, "fp8"): AttentionConfig(128, 64, 4, 4, True, "imprecise_k", fold_q_scale=True),
    (256, "fp8"): AttentionConfig(64, 64, 4, 2, True, "imprecise_k", fold_q_scale=True),
    (32, "fp16"): AttentionConfig(128, 64, 4, 4),
    (64, "fp16"): AttentionConfig(128, 64, 4, 4),
    (128, "fp16"): AttentionConfig(128, 64, 4, 4, fold_q_scale=True),
    (256, "fp16"): AttentionConfig(64, 64, 4, 2, fold_q_scale=True),
}

# Other NVIDIA / other AMD GPUs: conservative, fits 100 KB of shared memory. FP8 P.V accumulates "split":
# Ada's (sm_89) FP8 mma truncates like Hopper's, and for the rest (Blackwell, gfx950) it is unmeasured.
# fold_q_scale stays off here: measured on the H200 only (RDNA4 FP8 takes it for its compiled loop, above).
_GENERIC_GEOMETRY = {32: (128, 64, 4, 2), 64: (128, 64, 4, 2), 128: (128, 64, 8, 2), 256: (64, 32, 4, 1)}
_GENERIC: Dict[Tuple[int, str], AttentionConfig] = {
    (d, pv): AttentionConfig(bm, bn, w, st, pv_accumulate="split" if pv == "fp8" else "mma")
    for d, (bm, bn, w, st) in _GENERIC_GEOMETRY.items() for pv in ("fp8", "fp16")
}

# The interpreter (CPU): small tiles so tests with ~100 tokens still cross several tiles and tails.
# FP8 accumulates "split" with V stored (Dv, Nk) there (as on RDNA4); tests run every mode explicitly. FP16 folds
# q's scale into exp2 (as on Hopper at D128) with V (Nk, Dv), so the CPU tests run both score paths and both V
# layouts. fp8_cvt_asm never applies under the interpreter (it cannot run inline asm; it rounds exactly instead).
_INTERPRETER = {"fp8": AttentionConfig(32, 32, 4, 1, True, "split"),
                "fp16": AttentionConfig(32, 32, 4, 1, fold_q_scale=True)}

# The GPU prologue config held up in a sweep on the H200 (`python tools/prologue_sweep.py`, 2026-12-01, bf16, FP8 V,
# every candidate's outputs bit-identical): µs per call, shipped 64/256/4 -> best other. Flux 1 MP 92 -> 90
# (32/128/4, within noise). Wan 480p 1433 -> 1408 (64/512/4). SDXL 48 -> 37 (128/256/4), but SDXL's figure is
# host-bound (calls issued back to back take longer to issue than to run). 32-token quantize programs cost
# 1.2-1.6x everywhere. Nothing won clearly enough to change it.
_PROLOGUE_GPU = PrologueConfig(block_n=64, stats_block_n=256, num_warps=4)
_PROLOGUE_INTERPRETER = PrologueConfig(block_n=32, stats_block_n=64, num_warps=4)

# Test/benchmark hook: (arch, padded_d, pv) -> config replacing the table entry.
OVERRIDES: Dict[Tuple[str, int, str], AttentionConfig] = {}


def attention_config(arch: str, head_dim: int, pv: str) -> AttentionConfig:
    d = padded_head_dim(head_dim)
    if OVERRIDES and (arch, d, pv) in OVERRIDES:
        return OVERRIDES[(arch, d, pv)]
    return _table_config(arch, d, pv)


@functools.lru_cache(maxsize=None)
def _table_config(arch: str, d: int, pv: str) -> AttentionConfig:
    """The shipped entry for a padded head dim (pure: the tables never change at run time)."""
    if arch == "cpu":
        return _INTERPRETER[pv]
    if arch in RDNA4_ARCHS or arch.startswith("gfx12"):  # unknown future gfx12: same pipeliner hazard
        if settings.triton_fp8_cvt_software():  # read once per process (this table is cached)
            return dataclasses.replace(_RDNA4[(d, pv)], fp8_cvt_asm=False)
        return _RDNA4[(d, pv)]
    if arch == "sm_90":
        return _HOPPER[(d, pv)]
    return _GENERIC[(d, pv)]


def accumulation_of(arch: str, head_dim: int, pv: str) -> str:
    """How P.V is accumulated for this call ("mma", "imprecise_k" or "split"): for benchmarks and reports."""
    return attention_config(arch, head_dim, pv).pv_accumulate


def prologue_config(arch: str) -> PrologueConfig:
    return _PROLOGUE_INTERPRETER if arch == "cpu" else _PROLOGUE_GPU


def shipped_rdna4_configs():
    """Every (padded head dim, pv, config) the RDNA4 path can launch: what the AOT check must compile."""
    return [(d, pv, _RDNA4[(d, pv)]) for d in sorted(_RDNA4_GEOMETRY) for pv in ("fp8", "fp16")]
