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
# gives each wave 16 query rows (one WMMA tile high), like the seed's HIP kernel. The largest tiles that spill
# no VGPR on gfx1201 (AOT, Triton 3.6 and 3.8). FP8 P.V accumulates "split": whether gfx12's FP8 WMMA keeps a
# full FP32 accumulator is undocumented. FP16 P.V stays "mma". Figures: docs/MEASUREMENTS.md#triton-key-loop-on-gfx12
_RDNA4_GEOMETRY = {32: (128, 32, 8), 64: (128, 32, 8), 128: (128, 32, 8), 256: (64, 16, 8)}
# FP8 stores V (Dv, Nk) and converts P with v_cvt_pk_fp8_f32: Triton's own conversion and byte-wise FP8 V reads
# cost several times the instructions per v_wmma. FP16 stores V (Dv, Nk) only where that costs no wave per SIMD
# (D64 also serves SD1.5's D40), and does not fold q's scale (it made D128 worse).
# Figures: docs/MEASUREMENTS.md#triton-key-loop-on-gfx12
_RDNA4_FP16_V_T = (32, 128)
# SAGE_RDNA4_TRITON_FP8_CVT=software (kernels/settings.py): convert P to FP8 with Triton's own code instead of
# v_cvt_pk_fp8_f32 (a way out should the inline asm misbehave on some ROCm stack: the self-check would then have
# disabled triton_int8_fp8 with its reason).
_RDNA4: Dict[Tuple[int, str], AttentionConfig] = {}
for _d, (_bm, _bn, _w) in _RDNA4_GEOMETRY.items():
    _RDNA4[(_d, "fp8")] = AttentionConfig(_bm, _bn, _w, 1, True, "split", fold_q_scale=True, fp8_cvt_asm=True)
    _RDNA4[(_d, "fp16")] = AttentionConfig(_bm, _bn, _w, 1, _d in _RDNA4_FP16_V_T, "mma")

# Hopper (sm_90): Triton emits wgmma for the INT8 and FP8 dots; FP8 wgmma wants a K-major B, so V is stored
# (Dv, Nk). FP8 P.V accumulates "imprecise_k": wgmma's FP8 accumulator keeps ~13 bits, so "mma" loses diffuse
# attention's mass over long sequences, and "split" is slower. Folding q's scale frees the registers FP8 needs at
# BM128 BN64 w4. FP16 wgmma accumulates in FP32: "mma". No entry overlaps the MMA with the softmax (ptxas
# serialises the wgmma). Figures: docs/MEASUREMENTS.md#triton-launch-configurations and #the-sm_90-kernel
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

# The GPU prologue config: no candidate of a sweep (tools/prologue_sweep.py) won clearly enough to replace it.
# Figures: docs/MEASUREMENTS.md#triton-prologue
_PROLOGUE_GPU = PrologueConfig(block_n=64, stats_block_n=256, num_warps=4)
_PROLOGUE_INTERPRETER = PrologueConfig(block_n=32, stats_block_n=64, num_warps=4)

def attention_config(arch: str, head_dim: int, pv: str) -> AttentionConfig:
    return _table_config(arch, padded_head_dim(head_dim), pv)


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
