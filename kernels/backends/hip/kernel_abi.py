"""The single description of the HIP kernels: sources, entry points, arguments, launch geometry.

The runtime loader (kernels/backends/hip/runtime.py, compiler.py, prologue.py, backend.py) compiles
`module_source(target)` once per device and launches what `prologue_plan` / `attention_plan` return;
the static checks and the GPU harness (kernels/verify/) use the same functions, so nothing about a
launch is stated twice.

A plan is a list of `Launch`: kernel name, grid, block, dynamic shared bytes (always 0: the kernels
use static LDS) and the argument list as (ctype, value) pairs with ctype one of
'ptr' (a device address, int; 0 = NULL), 'i32', 'i64', 'f32'. All launches of a plan go on one
stream, in order.

Layout contract (see quant.QuantizedQKV): q8/k8 int8 (B,H,N,D) contiguous, per-token fp32 scales
(B,H,N), v e4m3 or fp16 (B,Hkv,Nk,Dv) contiguous, v_scale (B,Hkv,Dv), k_mean (B,Hkv,D) or None,
v_mean (B,Hkv,Dv) or None (smooth_v).
Raw inputs q, k, v are fp16/bf16 HND views with any element strides (the last one included).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ... import launch_split, quant

SRC_DIR = Path(__file__).resolve().parent / "src"
# Concatenated in this order into one translation unit (the .hip files include nothing).
SOURCE_FILES = ("gfx12_prelude.h", "sage_prologue.hip", "sage_attention.hip", "sage_probes.hip")

HEAD_DIMS = (64, 128)
DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
QK_GROUP_SIZES = {"token": 1, "block32": 32, "block64": 64, "block128": 128}
# P.V accumulation: "two-level" (each tile's chain folded into FP32, any accumulator) or "single" (one chain over
# all tiles, for a unit whose C keeps full FP32); the single chain ships for these P.V modes only.
CHAINS = ("two-level", "single")
SINGLE_CHAIN_PV = ("fp16",)

# Geometry constants, mirrored from the sources (checked by tests/test_hip_static_check.py).
PRO_THREADS = 256
STAT_CHUNK = 512
ATT_THREADS = 256
ATT_BLOCK_M = 128
ATT_BLOCK_N = 64
PROBE_THREADS = 32


# Verification-only build options (never set on the product path), as `module_source` keywords:
#   acc_trunc_bits      SG_EMU_ACC_TRUNC_BITS: the emulated fp8 WMMA (CUDA, host simulator) models an
#                       accumulator keeping that many fraction bits (NVIDIA's FP8 MMA: ~13; 24: one bit more
#                       than its fp32 register); 0 = exact
#   f16_acc_trunc_bits  SG_EMU_F16_ACC_TRUNC_BITS: the same for the emulated f16 WMMA
#   pv_single_chain     SG_PV_SINGLE_CHAIN: every attention kernel accumulates P.V in one WMMA chain over all key
#                       tiles (FP8 too, which ships only the two-level kernel), as the `single` chain does
#   fp8_nonsat          SG_EMU_FP8_NONSAT: the emulated e4m3 conversion (CUDA, host simulator) gives NaN for
#                       |x| > 448, the non-saturating reading of gfx12's v_cvt_pk_fp8_f32 (no clamp bit)
#   wmma_k_fault        SG_EMU_WMMA_K_FAULT: a planted fault of the emulated WMMA's K order, for the layout probe:
#                       1 = B alone uses the other family's K order (A and B disagree), 2 = both do (shared)
#   emu_flush_subnormal SG_EMU_FLUSH_SUBNORMAL: the emulated fp8 and f16 WMMAs (CUDA, host simulator) read
#                       subnormal A/B inputs (exponent field 0) as zero, a model of a flushing matrix unit
VERIFY_OPTIONS = {"acc_trunc_bits": "SG_EMU_ACC_TRUNC_BITS", "f16_acc_trunc_bits": "SG_EMU_F16_ACC_TRUNC_BITS",
                  "pv_single_chain": "SG_PV_SINGLE_CHAIN", "fp8_nonsat": "SG_EMU_FP8_NONSAT",
                  "wmma_k_fault": "SG_EMU_WMMA_K_FAULT", "emu_flush_subnormal": "SG_EMU_FLUSH_SUBNORMAL"}


def option_defines(**options) -> str:
    """`#define` lines for verification options (see VERIFY_OPTIONS); '' when all are off."""
    lines = []
    for key, value in sorted(options.items()):
        if key not in VERIFY_OPTIONS:
            raise ValueError(f"unknown kernel build option {key!r} (known: {sorted(VERIFY_OPTIONS)})")
        value = int(value)
        if key.endswith("trunc_bits") and not 0 <= value <= 24:
            raise ValueError(f"{key} must be in 0..24, got {value}")
        if value:
            lines.append(f"#define {VERIFY_OPTIONS[key]} {value}\n")
    return "".join(lines)


def module_source(target: str = "hip", **options) -> str:
    """The translation unit for 'hip' (hiprtc/clang AMDGPU) or 'cuda' (a CUDA compiler): the same text, the prelude
    picks its branch from the compiler's macros. The CPU simulator (kernels/verify/host_sim.py) puts its own
    runtime header in front of this text. `options` (VERIFY_OPTIONS; verification only) prepend #defines."""
    if target not in ("hip", "cuda"):
        raise ValueError(f"unknown target {target!r}")
    return option_defines(**options) + "\n".join((SRC_DIR / name).read_text() for name in SOURCE_FILES)


# ------------------------------------------------------------------------------------------ names
def attention_kernel(pv: str, head_dim: int, dtype: torch.dtype, chain: str = "two-level",
                     key_mask: bool = False) -> str:
    """The attention entry point: `chain` its P.V accumulation (CHAINS); `key_mask`: the variant taking a key-only
    mask (KeyMask in sage_attention.hip), which ships two-level only."""
    if chain not in CHAINS or (chain == "single" and (pv not in SINGLE_CHAIN_PV or key_mask)):
        raise ValueError(f"no {chain!r} P.V kernel for pv={pv!r}{' with a key mask' if key_mask else ''} "
                         f"(chains {CHAINS}; single for {SINGLE_CHAIN_PV}, unmasked)")
    suffix = "_sc" if chain == "single" else "_kmask" if key_mask else ""
    return f"sage_attn_i8{'f8' if pv == 'fp8' else 'f16'}_d{head_dim}_{DTYPES[dtype]}{suffix}"


def quant_qk_kernel(head_dim: int, group: int, dtype: torch.dtype) -> str:
    return f"sage_quant_qk_d{head_dim}_g{group}_{DTYPES[dtype]}"


def quant_v_kernel(pv: str, dtype: torch.dtype) -> str:
    return f"sage_quant_v_{pv}_{DTYPES[dtype]}"


def colstats_kernel(dtype: torch.dtype) -> str:
    return f"sage_colstats_{DTYPES[dtype]}"


def all_kernel_names() -> List[str]:
    names = []
    for dt in DTYPES:
        names.append(colstats_kernel(dt))
        for pv in ("fp8", "fp16"):
            names.append(quant_v_kernel(pv, dt))
            for d in HEAD_DIMS:
                names += [attention_kernel(pv, d, dt, c) for c in CHAINS if c == "two-level" or pv in SINGLE_CHAIN_PV]
                names.append(attention_kernel(pv, d, dt, key_mask=True))
        for d in HEAD_DIMS:
            for g in QK_GROUP_SIZES.values():
                names.append(quant_qk_kernel(d, g, dt))
    names += ["sage_colstats_finalize", "sage_qk_scores_d64", "sage_qk_scores_d128", "sage_wmma_probe",
              "sage_bias_probe", "sage_acc_probe", "sage_e4m3_probe", "sage_lane_probe"]
    return names


# ------------------------------------------------------------------------------------------ launches
@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    args: Tuple[Tuple[str, object], ...]
    shared_bytes: int = 0


def _ptr(t: Optional[torch.Tensor]) -> Tuple[str, int]:
    return ("ptr", 0 if t is None else int(t.data_ptr()))


def _i64(x) -> Tuple[str, int]:
    return ("i64", int(x))


def _i32(x) -> Tuple[str, int]:
    x = int(x)
    if not -(1 << 31) <= x < (1 << 31):
        raise ValueError(f"{x} does not fit a 32-bit kernel argument")
    return ("i32", x)


def _f32(x) -> Tuple[str, float]:
    return ("f32", float(torch.tensor(float(x), dtype=torch.float32)))


def _strides(t: torch.Tensor):
    return tuple(_i64(s) for s in t.stride())


def raw_input_refusal(q, k, v) -> Optional[str]:
    """Why the HIP prologue cannot read these inputs, or None."""
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"HIP prologue takes fp16/bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[3] not in HEAD_DIMS or k.shape[3] != q.shape[3]:
        return f"head_dim must be 64 or 128, got {q.shape[3]}"
    if v.shape[3] not in HEAD_DIMS:
        return f"v head_dim must be 64 or 128, got {v.shape[3]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[2] >= (1 << 31) or t.shape[1] > 65535 or t.shape[0] > 65535:
            return f"{name} shape {tuple(t.shape)} exceeds the launch grid"
    return None


LiveKeys = quant.LiveKeys  # the prologue's live-key operands (flags full (B, Hkv, Nk) here)


def live_keys(live: torch.Tensor, b: int, hkv: int, nk: int) -> LiveKeys:
    """`quant.live_keys`'s bool (1 or B, 1 or Hkv, Nk) as the prologue's operands."""
    flags = live.expand(b, hkv, nk).to(torch.int8).contiguous()
    return LiveKeys(flags, flags.sum(dim=-1, dtype=torch.float64).clamp_min(1).reshape(-1))


def prologue_plan(q, k, v, *, sm_scale: float, smooth_k: bool, pv: str, qk_group: str = "token",
                  smooth_v: bool = False, live: Optional[LiveKeys] = None):
    """Allocate a QuantizedQKV (plus workspace) and return (qq, workspace, launches) for the HIP prologue.

    Keep `workspace` alive until the launches have run. smooth_v: V's channel mean (`v_mean`) is taken out
    before V's scale and quantization (quant.quantize_qkv_torch's rule). `live` (a key-only mask's LiveKeys): only
    live keys enter the means and scales and dead keys' K and V codes are 0 (quant.quantize_qkv_torch(live=...))."""
    reason = raw_input_refusal(q, k, v)
    if reason:
        raise ValueError(reason)
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
    group = QK_GROUP_SIZES[qk_group]
    dev, dt = q.device, q.dtype
    b, hq, nq, d = q.shape
    _, hkv, nk, _ = k.shape
    dv = v.shape[3]
    q8 = torch.empty((b, hq, nq, d), dtype=torch.int8, device=dev)
    k8 = torch.empty((b, hkv, nk, d), dtype=torch.int8, device=dev)
    q_scale = torch.empty((b, hq, nq), dtype=torch.float32, device=dev)
    k_scale = torch.empty((b, hkv, nk), dtype=torch.float32, device=dev)
    v_q = torch.empty((b, hkv, nk, dv), dtype=torch.float8_e4m3fn if pv == "fp8" else torch.float16, device=dev)
    v_scale = torch.empty((b, hkv, dv), dtype=torch.float32, device=dev)
    k_mean = torch.empty((b, hkv, d), dtype=torch.float32, device=dev) if smooth_k else None
    v_mean = torch.empty((b, hkv, dv), dtype=torch.float32, device=dev) if smooth_v else None
    if live is not None and (tuple(live.flags.shape) != (b, hkv, nk) or live.flags.dtype != torch.int8
                             or not live.flags.is_contiguous() or tuple(live.count.shape) != (b * hkv,)
                             or live.count.dtype != torch.float64 or not live.count.is_contiguous()):
        raise ValueError(f"live must be int8 flags {(b, hkv, nk)} and an FP64 count {(b * hkv,)}, contiguous")
    flags, count = (None, None) if live is None else (live.flags, live.count)
    chunks = max(1, math.ceil(nk / STAT_CHUNK))
    ws = torch.empty((2, b * hkv * chunks * max(d, dv)), dtype=torch.float64, device=dev)
    ws_k, ws_v = ws[0], ws[1]
    block = (PRO_THREADS, 1, 1)
    launches: List[Launch] = []

    def stats(x, width, mode, wsp, out, mean=None):
        launches.append(Launch(colstats_kernel(dt), (chunks, x.shape[1], b), block,
                               (_ptr(x), *_strides(x), _i32(x.shape[1]), _i32(nk), _i32(width), _i32(chunks),
                                _i32(0 if mode == 0 else 1), _ptr(mean), _ptr(flags), _ptr(wsp))))
        rows = b * x.shape[1]
        launches.append(Launch("sage_colstats_finalize", (math.ceil(rows * width / PRO_THREADS), 1, 1), block,
                               (_ptr(wsp), _i32(chunks), _i64(rows), _i32(width), _i32(nk), _i32(mode),
                                _ptr(count if mode == 0 else None), _ptr(out))))

    if smooth_k:
        stats(k, d, 0, ws_k, k_mean)
    if smooth_v:  # the mean first; the amax pass then reuses the workspace (same stream, in order)
        stats(v, dv, 0, ws_v, v_mean)
    stats(v, dv, 1 if pv == "fp8" else 2, ws_v, v_scale, v_mean)
    tb = 32 if group == 1 else group

    def quant_qk(x, n, mult, mean, key_flags, out, scale):
        launches.append(Launch(quant_qk_kernel(d, group, dt), (math.ceil(n / tb), x.shape[1], b), block,
                               (_ptr(x), *_strides(x), _i32(x.shape[1]), _i32(n), _f32(mult), _ptr(mean),
                                _ptr(key_flags), _ptr(out), _ptr(scale))))

    quant_qk(q, nq, quant.qk_multiplier(sm_scale), None, None, q8, q_scale)
    quant_qk(k, nk, 1.0, k_mean, flags, k8, k_scale)
    launches.append(Launch(quant_v_kernel(pv, dt), (math.ceil(nk * (dv // 4) / PRO_THREADS), hkv, b), block,
                           (_ptr(v), *_strides(v), _i32(hkv), _i32(nk), _i32(dv), _ptr(v_scale), _ptr(v_mean),
                            _ptr(flags), _ptr(v_q))))
    qq = quant.QuantizedQKV(q8, q_scale, k8, k_scale, v_q, v_scale, k_mean, v_mean)
    return qq, ws, launches


def attention_shape_refusal(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dv: int, pv: str) -> Optional[str]:
    """The attention kernels' own shape rule (the backend's refusal should include it), or None."""
    if d not in HEAD_DIMS or dv != d:
        return f"attention kernels take head_dim == v_head_dim in {HEAD_DIMS}, got {d} and {dv}"
    if nk == 0 or nq == 0:
        return "empty sequence"
    if hkv == 0 or hq % hkv:
        return f"q heads {hq} not a multiple of kv heads {hkv}"
    if hq > 65535 or b > 65535 or nq >= (1 << 31):
        return "shape exceeds the launch grid"
    # Offsets inside one (batch, kv head) are 32-bit in the key loop (the 64-bit head base stays scalar).
    if nk * dv * (1 if pv == "fp8" else 2) >= (1 << 31):
        return f"kv_len {nk} x head_dim {dv} exceeds 2 GiB of {pv} V per head"
    return None


def quantized_refusal(qq: quant.QuantizedQKV, pv: str) -> Optional[str]:
    """Why the attention kernels cannot consume this QuantizedQKV, or None."""
    b, hq, nq, d = qq.q8.shape
    _, hkv, nk, dv = qq.v.shape
    reason = attention_shape_refusal(b, hq, hkv, nq, nk, d, dv, pv)
    if reason:
        return reason
    want_v = torch.float8_e4m3fn if pv == "fp8" else torch.float16
    if qq.v.dtype != want_v:
        return f"pv={pv} needs v as {want_v}, got {qq.v.dtype}"
    for name in ("q8", "q_scale", "k8", "k_scale", "v", "v_scale"):
        if not getattr(qq, name).is_contiguous():
            return f"{name} must be contiguous"
    for name, width in (("k_mean", d), ("v_mean", dv)):
        t = getattr(qq, name, None)
        if t is None:
            continue
        if t.dtype != torch.float32 or tuple(t.shape) != (b, hkv, width) or not t.is_contiguous():
            return f"{name} must be contiguous fp32 {(b, hkv, width)}, got {t.dtype} {tuple(t.shape)}"
    return None


@dataclass(frozen=True)
class KeyMaskOperands:
    """A key-only mask as the masked attention kernels take it (sage_attention.hip, KeyMask): `bias` FP32 base 2
    (1 or B, 1 or Hq, Nk) with unit-stride keys, -inf on dead keys (quant.key_mask_bias); `key_end` int32 (1 or B,
    1 or Hq): 1 + the last live key of each mask row, the key loop stops there; `fill` (a bool mask): keys at -inf
    score -inf whatever q.k is."""
    bias: torch.Tensor
    key_end: torch.Tensor
    fill: bool


def key_mask_refusal(km: KeyMaskOperands, b: int, hq: int, nk: int) -> Optional[str]:
    """Why the masked kernels cannot take these operands for a (B, Hq, Nk) call, or None."""
    bias, end = km.bias, km.key_end
    if (bias.dim() != 3 or bias.dtype != torch.float32 or bias.shape[2] != nk or bias.shape[0] not in (1, b)
            or bias.shape[1] not in (1, hq) or (nk > 1 and bias.stride(2) != 1)):
        return (f"key bias must be FP32 (1 or {b}, 1 or {hq}, {nk}) with unit-stride keys, got "
                f"{tuple(bias.shape)} {bias.dtype}")
    if end.dim() != 2 or end.dtype != torch.int32 or tuple(end.shape) != tuple(bias.shape[:2]):
        return f"key end must be int32 {tuple(bias.shape[:2])}, got {tuple(end.shape)} {end.dtype}"
    return None


def attention_plan(qq: quant.QuantizedQKV, *, pv: str, is_causal: bool, out_dtype: torch.dtype,
                   return_lse: bool = False, q: Optional[torch.Tensor] = None, sm_scale: float = 1.0,
                   out: Optional[torch.Tensor] = None, chain: str = "two-level",
                   key_mask: Optional[KeyMaskOperands] = None):
    """Return (out (B,Hq,Nq,Dv) in out_dtype, lse (B,Hq,Nq) fp32 or None, launches).

    `out` may be passed as any view whose last dim is contiguous with rows 16-byte aligned (e.g. an
    HND view of an NHD buffer). `q` (the raw fp16/bf16 query) is needed for the LSE's smooth_k term. `chain`: the
    P.V accumulation (CHAINS) of an unmasked call. `key_mask`: a key-only mask, through the masked entry points (the
    same kernels with the bias per key; two-level, whatever `chain` says).
    A call above the device's work bound becomes several launches (kernels/launch_split.py)."""
    reason = quantized_refusal(qq, pv)
    if reason:
        raise ValueError(reason)
    if out_dtype not in DTYPES:
        raise ValueError(f"output dtype must be fp16 or bf16, got {out_dtype}")
    b, hq, nq, d = qq.q8.shape
    hkv, nk = qq.k8.shape[1], qq.k8.shape[2]
    dev = qq.q8.device
    if out is None:
        out = torch.empty((b, hq, nq, d), dtype=out_dtype, device=dev)
    if out.stride(3) != 1 or out.dtype != out_dtype or any(s % 8 for s in out.stride()[:3]) or out.data_ptr() % 16:
        raise ValueError("out needs a contiguous last dim and 16-byte aligned rows")
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=dev) if return_lse else None
    use_q = return_lse and qq.k_mean is not None
    if use_q and (q is None or q.dtype != out_dtype):
        raise ValueError("the LSE with smooth_k needs the raw q (same dtype as the output)")
    pieces = launch_split.split_attention(b, hq, hkv, nq, nk, d, d, pv=pv, causal=is_causal, row_block=ATT_BLOCK_M,
                                          bound=launch_split.work_bound(dev))
    masked = key_mask is not None
    kernel, group = attention_kernel(pv, d, out_dtype, "two-level" if masked else chain, masked), hq // hkv
    if key_mask is not None:
        reason = key_mask_refusal(key_mask, b, hq, nk)
        if reason:
            raise ValueError(reason)
        # (B, Hq, Nk) and (B, Hq) views, stride 0 where the mask broadcasts: a piece's (batch, head) address below.
        bias_bh, end_bh = key_mask.bias.expand(b, hq, nk), key_mask.key_end.expand(b, hq)
    qs = _strides(q) if use_q else (_i64(0),) * 4
    tail = (_i64(out.stride(0)), _i64(out.stride(1)), _i64(out.stride(2)))
    v_mean = getattr(qq, "v_mean", None)
    k_mean = qq.k_mean if use_q else None
    q = q if use_q else None
    launches = []
    for pc in pieces:
        # A piece of whole kv-head groups keeps the call's Hq/Hkv/Nq (the kernel's strides); any other piece is
        # one q head, launched as a call of one head over its query rows.
        whole = pc.n0 == 0 and pc.n1 == nq and pc.h0 % group == 0 and pc.h1 % group == 0
        if whole:
            heads, kv_heads, rows, grid_y, grid_z = hq, hkv, nq, pc.h1 - pc.h0, pc.b1 - pc.b0
        else:
            heads, kv_heads, rows, grid_y, grid_z = 1, 1, pc.n1 - pc.n0, 1, 1
        bh, hk, n0 = (pc.b0, pc.h0), (pc.b0, pc.h0 // group), pc.n0
        launches.append(Launch(
            kernel, (math.ceil(rows / ATT_BLOCK_M), grid_y, grid_z), (ATT_THREADS, 1, 1),
            (_at(qq.q8, *bh, n0), _at(qq.q_scale, *bh, n0), _at(qq.k8, *hk), _at(qq.k_scale, *hk), _at(qq.v, *hk),
             _at(qq.v_scale, *hk), _at(v_mean, *hk), _i32(heads), _i32(kv_heads), _i32(rows), _i32(nk),
             _i32(1 if is_causal else 0), _at(out, *bh, n0), *tail, _at(lse, *bh, n0), _at(q, *bh, n0), *qs,
             _at(k_mean, *hk), _f32(sm_scale),
            *(() if key_mask is None else (
                _at(bias_bh, *bh), *(_i64(s) for s in bias_bh.stride()[:2]), _at(end_bh, *bh),
                *(_i64(s) for s in end_bh.stride()), _i32(1 if key_mask.fill else 0))))))
    return out, lse, launches


def _at(t: Optional[torch.Tensor], *index: int) -> Tuple[str, int]:
    """The device address of t[index] (leading dims; NULL stays NULL)."""
    if t is None:
        return ("ptr", 0)
    return ("ptr", int(t.data_ptr()) + t.element_size() * sum(i * s for i, s in zip(index, t.stride())))


def qk_scores_plan(q8: torch.Tensor, k8: torch.Tensor):
    """Verification only: int32 Q.K^T (B,Hq,Nq,Nk) through the attention kernel's staging and WMMA path."""
    b, hq, nq, d = q8.shape
    hkv, nk = k8.shape[1], k8.shape[2]
    scores = torch.zeros((b, hq, nq, nk), dtype=torch.int32, device=q8.device)
    launch = Launch(f"sage_qk_scores_d{d}", (math.ceil(nq / ATT_BLOCK_M), hq, b), (ATT_THREADS, 1, 1),
                    (_ptr(q8), _ptr(k8), _i32(hq), _i32(hkv), _i32(nq), _i32(nk), _ptr(scores)))
    return scores, [launch]


WMMA_KINDS = {"iu8": 0, "fp8": 1, "f16": 2}


def wmma_probe_plan(kind: str, a_lanes: torch.Tensor, b_lanes: torch.Tensor, c_lanes: Optional[torch.Tensor]):
    """One WMMA on per-lane fragments (int32 words, lane-major); c_lanes None: C is the constant 0 (the P.V chains'
    inline operand). Returns (d_lanes, launches)."""
    d = torch.zeros((32, 8), dtype=torch.int32, device=a_lanes.device)
    launch = Launch("sage_wmma_probe", (1, 1, 1), (PROBE_THREADS, 1, 1),
                    (_i32(WMMA_KINDS[kind]), _ptr(a_lanes), _ptr(b_lanes), _ptr(c_lanes), _ptr(d)))
    return d, [launch]


def acc_probe_plan(kind: str, a_lanes: torch.Tensor, b_lanes: torch.Tensor, c_lanes: torch.Tensor, steps: int):
    """`steps` chained WMMAs of `kind` ('fp8' or 'f16') on per-lane fragments (int32 words, lane-major), C from
    c_lanes before the first, each D the next C. Returns (the last D's lanes as int32 (32, 8), launches)."""
    if kind not in ("fp8", "f16"):
        raise ValueError(f"the accumulator probe takes 'fp8' or 'f16', got {kind!r}")
    d = torch.zeros((32, 8), dtype=torch.int32, device=a_lanes.device)
    launch = Launch("sage_acc_probe", (1, 1, 1), (PROBE_THREADS, 1, 1),
                    (_i32(WMMA_KINDS[kind]), _ptr(a_lanes), _ptr(b_lanes), _ptr(c_lanes), _i32(steps), _ptr(d)))
    return d, [launch]


def bias_probe_plan(a_lanes: torch.Tensor, b_lanes: torch.Tensor):
    """The iu8 WMMA started from C = QK_BIAS as the attention kernels start it. Returns (raw D lanes int32 (32, 8),
    unbias_dot(D) lanes fp32 (32, 8), launches)."""
    d = torch.zeros((32, 8), dtype=torch.int32, device=a_lanes.device)
    dot = torch.zeros((32, 8), dtype=torch.float32, device=a_lanes.device)
    launch = Launch("sage_bias_probe", (1, 1, 1), (PROBE_THREADS, 1, 1),
                    (_ptr(a_lanes), _ptr(b_lanes), _ptr(d), _ptr(dot)))
    return d, dot, [launch]


LANE_PROBE_ROWS = ("lane_xor<1>", "lane_xor<2>", "lane_xor<4>", "lane_xor<8>", "lane_xor<16>",
                   "lane_xor16_full_wave", "wave_abs_max", "add_f16x2", "pack_f16x2", "add_f16x2 from 0")


def lane_probe_plan(x: torch.Tensor, w: torch.Tensor):
    """The cross-lane and packed-half helpers on one wave (sage_probes.hip lane_probe): x fp32 (64,), w int32 (32,)
    (two fp16 each). Returns (int32 words (len(LANE_PROBE_ROWS), 32), launches)."""
    if (x.numel() != 64 or w.numel() != 32 or x.dtype != torch.float32 or w.dtype != torch.int32
            or not x.is_contiguous() or not w.is_contiguous()):
        raise ValueError("lane probe takes 64 contiguous fp32 values and 32 contiguous int32 words")
    out = torch.zeros((len(LANE_PROBE_ROWS), 32), dtype=torch.int32, device=x.device)
    launch = Launch("sage_lane_probe", (1, 1, 1), (PROBE_THREADS, 1, 1),
                    (_ptr(x), _ptr(w), _ptr(out)))
    return out, [launch]


def e4m3_probe_plan(x: torch.Tensor):
    """fp32 x (n, a multiple of 4) to e4m3 bytes through the kernels' conversion. Returns
    (bytes as uint8 (n,), launches)."""
    n = x.numel()
    if n % 4 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("e4m3 probe takes a contiguous fp32 tensor of a multiple of 4 elements")
    out = torch.zeros(n // 4, dtype=torch.int32, device=x.device)
    launch = Launch("sage_e4m3_probe", (math.ceil(n // 4 / PROBE_THREADS), 1, 1), (PROBE_THREADS, 1, 1),
                    (_ptr(x), _ptr(out), _i32(n)))
    return out.view(torch.uint8), [launch]


# ------------------------------------------------------------------------------------------ layouts
def operand_k(h: torch.Tensor, e: torch.Tensor, element_bytes: int) -> torch.Tensor:
    """K of element e of a lane in half h (lane // 16) of a gfx12 wave32 16x16x16 A or B operand: 8-bit (iu8, fp8)
    8h + e; f16 8 (e // 4) + 4h + e % 4, i.e. lanes 0-15 hold K 0-3 and 8-11, lanes 16-31 K 4-7 and 12-15 (AMD's
    Matrix Instruction Calculator for RDNA4; the prelude's layout comment says where each fact comes from)."""
    if element_bytes == 1:
        return 8 * h + e
    if element_bytes == 2:
        return 8 * (e // 4) + 4 * h + e % 4
    raise ValueError(f"WMMA operands hold 1- or 2-byte elements, got {element_bytes}")


def lanes_from_a(a: torch.Tensor) -> torch.Tensor:
    """A (16 x 16, int8/e4m3 or fp16) -> per-lane gfx12 fragments (32, 8): lane t, element e holds
    A[t % 16][operand_k(t // 16, e)]."""
    t = torch.arange(32)
    k = operand_k((t // 16)[:, None], torch.arange(8)[None, :], a.element_size())
    return a[(t % 16)[:, None], k]


def lanes_from_b(b: torch.Tensor) -> torch.Tensor:
    """B (16 x 16) -> (32, 8): lane t, element e holds B[operand_k(t // 16, e)][t % 16]."""
    return lanes_from_a(b.t())


def d_from_lanes(d_lanes: torch.Tensor) -> torch.Tensor:
    """(32, 8) accumulator fragments -> D (16 x 16): lane t, element e is D[8 (t // 16) + e][t % 16]."""
    t = torch.arange(32)
    d = torch.empty((16, 16), dtype=d_lanes.dtype)
    d[(8 * (t // 16))[:, None] + torch.arange(8)[None, :], (t % 16)[:, None].expand(32, 8)] = d_lanes
    return d


def lanes_from_d(d: torch.Tensor) -> torch.Tensor:
    t = torch.arange(32)
    return d[(8 * (t // 16))[:, None] + torch.arange(8)[None, :], (t % 16)[:, None].expand(32, 8)]
