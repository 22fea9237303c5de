"""Ahead-of-time compilation of the Triton kernels for RDNA4 (gfx1200/gfx1201) on any machine.

`triton.compile(ASTSource(...), target=GPUTarget("hip", arch, 32))` needs no GPU, so every shipped
RDNA4 configuration can be checked on a CPU: register use, spills, LDS, occupancy, and whether the
ISA really uses the gfx12 WMMA instructions (int8 for Q.K^T, fp8 for P.V). The signature mirrors how
the backend launches the kernels (16-byte aligned pointers and row strides, unit strides constant).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..backends.triton.configs import AttentionConfig, padded_head_dim, shipped_rdna4_configs

WMMA_INT8 = "v_wmma_i32_16x16x16_iu8"
WMMA_FP8 = "v_wmma_f32_16x16x16_fp8_fp8"
WMMA_F16 = "v_wmma_f32_16x16x16_f16"
LDS_LIMIT = 64 * 1024


@dataclass
class KernelReport:
    label: str
    arch: str
    vgprs: int
    sgprs: int
    vgpr_spills: int
    sgpr_spills: int
    scratch_bytes: int
    lds_bytes: int
    occupancy: Optional[int]  # waves per SIMD as LLVM reports it
    isa_ops: Dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        ops = ", ".join(f"{k}={v}" for k, v in self.isa_ops.items())
        return (f"{self.arch} {self.label}: VGPRs {self.vgprs}, SGPRs {self.sgprs}, spills v{self.vgpr_spills}/"
                f"s{self.sgpr_spills}, scratch {self.scratch_bytes} B, LDS {self.lds_bytes} B, "
                f"occupancy {self.occupancy} waves/SIMD; {ops}")


def amd_backend_missing() -> Optional[str]:
    """Why AOT compilation for AMD cannot run here, or None."""
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except Exception as exc:
        return f"triton is not importable: {exc}"
    if "amd" not in backends:
        return "this triton has no AMD backend"
    return None


def _meta_int(asm: str, key: str) -> int:
    m = re.search(rf"^\s*\.{re.escape(key)}:\s+(\d+)", asm, re.M)
    return int(m.group(1)) if m else -1


def _report(kernel, label: str, arch: str) -> KernelReport:
    asm = kernel.asm["amdgcn"]
    occ = re.search(r";\s*Occupancy:\s*(\d+)", asm)
    ops = {name: len(re.findall(rf"\b{name}\b", asm)) for name in (WMMA_INT8, WMMA_FP8, WMMA_F16)}
    return KernelReport(
        label=label, arch=arch,
        vgprs=_meta_int(asm, "vgpr_count"), sgprs=_meta_int(asm, "sgpr_count"),
        vgpr_spills=_meta_int(asm, "vgpr_spill_count"), sgpr_spills=_meta_int(asm, "sgpr_spill_count"),
        scratch_bytes=_meta_int(asm, "private_segment_fixed_size"),
        lds_bytes=int(kernel.metadata.shared), occupancy=int(occ.group(1)) if occ else None,
        isa_ops=ops)


def _compile(fn, signature: Dict[str, str], constexprs: Dict[str, object], arch: str, num_warps: int,
             num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    attrs = {}
    for i, name in enumerate(names):
        ty = signature[name]
        if ty.startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16], ["tt.pointer_range", 32]]
        elif name.startswith("s") and ty == "i32":  # row strides: multiples of 16 in the shipped layouts
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("hip", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_attention(arch: str, head_dim: int, pv: str, config: AttentionConfig, *, is_causal: bool = False,
                      return_lse: bool = False, out_dtype: str = "bf16", kv_group: int = 1,
                      v_head_dim: Optional[int] = None) -> KernelReport:
    from ..backends.triton.attention import _sage_attn_fwd

    dv = v_head_dim or head_dim
    d_pad, dv_pad = padded_head_dim(head_dim), padded_head_dim(dv)
    v_ty = "*fp8e4nv" if pv == "fp8" else "*fp16"
    sig = {"Q8": "*i8", "QS": "*fp32", "K8": "*i8", "KS": "*fp32", "V": v_ty, "VS": "*fp32",
           "O": f"*{out_dtype}", "LSE": "*fp32"}
    strides = ["sqb", "sqh", "sqn", "skb", "skh", "skn", "svb", "svh", "svn", "svd", "sob", "soh", "son"]
    unit = "svn" if config.v_transposed else "svd"
    for s in strides:
        sig[s] = "constexpr" if s == unit else "i32"
    for s in ("Hq", "Hkv", "Nq", "Nk"):
        sig[s] = "i32"
    consts = {unit: 1, "KV_GROUP": kv_group, "HEAD_DIM": head_dim, "D_PAD": d_pad, "DV": dv, "DV_PAD": dv_pad,
              "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "IS_CAUSAL": is_causal,
              "PV_FP8": pv == "fp8", "STORE_LSE": return_lse, "V_T": config.v_transposed, "EXACT_P_ROUND": False,
              "INTERPRETER": False}
    for k in consts:
        sig[k] = "constexpr"
    kernel = _compile(_sage_attn_fwd, sig, consts, arch, config.num_warps, config.num_stages)
    label = (f"attention D{head_dim}{'' if dv == head_dim else f'/{dv}'} {pv} BM{config.block_m} BN{config.block_n} w{config.num_warps} "
             f"s{config.num_stages}{' causal' if is_causal else ''}{' lse' if return_lse else ''}")
    return _report(kernel, label, arch)


def compile_prologue(arch: str, head_dim: int, pv: str, v_head_dim: Optional[int] = None) -> List[KernelReport]:
    """The quantize kernels at the shipped prologue configuration (bf16 input)."""
    from ..backends.triton import prologue as p
    from ..backends.triton.configs import prologue_config

    cfg = prologue_config(arch)
    dv = v_head_dim or head_dim
    d_pad, dv_pad = padded_head_dim(head_dim), padded_head_dim(dv)
    reports = []
    v_out = "*fp8e4nv" if pv == "fp8" else "*fp16"
    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KSUM": "*fp32", "VMAX": "*fp32", "KMEAN": "*fp32",
           "VSCALE": "*fp32", "Q8": "*i8",
           "QS": "*fp32", "K8": "*i8", "KS": "*fp32", "VOUT": v_out, "mult": "fp32"}
    for t in ("q", "k", "v", "o"):
        for dim in "bhn":
            sig[f"s{t}{dim}"] = "i32"
        sig[f"s{t}d"] = "constexpr"
    for name in ("Hq", "Hkv", "Nq", "Nk", "n_chunks", "q_blocks", "k_blocks", "v_blocks", "q_programs",
                 "k_programs"):
        sig[name] = "i32"
    consts = {"sqd": 1, "skd": 1, "svd": 1, "sod": 1, "D": head_dim, "D_PAD": d_pad, "DV": dv,
              "DV_PAD": dv_pad, "QK_BLOCK": cfg.block_n, "V_BLOCK": cfg.block_n, "PER_BLOCK": False,
              "HAS_MEAN": True, "PV_FP8": pv == "fp8", "OUT_T": False, "FOLD_STATS": False,
              "STATS_CH": p.STATS_CH, "INTERPRETER": False}
    sig.update({k: "constexpr" for k in consts})
    for fold in (False, True):
        consts["FOLD_STATS"] = fold
        k = _compile(p._quantize_qkv, sig, consts, arch, cfg.num_warps, 1)
        reports.append(_report(k, f"quantize_qkv D{head_dim}/{dv} {pv}{' fold' if fold else ''}", arch))
    sig = {"K": "*bf16", "V": "*bf16", "KSUM": "*fp32", "VMAX": "*fp32",
           "skb": "i32", "skh": "i32", "skn": "i32", "skd": "constexpr",
           "svb": "i32", "svh": "i32", "svn": "i32", "svd": "constexpr", "Hkv": "i32", "Nk": "i32", "n_chunks": "i32"}
    consts = {"skd": 1, "svd": 1, "D": head_dim, "D_PAD": d_pad, "DV": dv, "DV_PAD": dv_pad,
              "CHUNK": cfg.stats_block_n, "SUB": 32, "DO_KSUM": True}
    sig.update({k: "constexpr" for k in consts})
    k = _compile(p._kv_stats, sig, consts, arch, cfg.num_warps, 1)
    reports.append(_report(k, f"kv_stats D{head_dim}", arch))
    sig = {"KSUM": "*fp32", "VMAX": "*fp32", "KMEAN": "*fp32", "VSCALE": "*fp32", "n_chunks": "i32", "Nk": "i32"}
    consts = {"D": head_dim, "D_PAD": d_pad, "DV": dv, "DV_PAD": dv_pad, "CH": p.STATS_CH, "DO_KSUM": True,
              "PV_FP8": pv == "fp8"}
    sig.update({k: "constexpr" for k in consts})
    k = _compile(p._kv_finalize, sig, consts, arch, 4, 1)
    reports.append(_report(k, f"kv_finalize D{head_dim} {pv}", arch))
    return reports


def compile_shipped(arch: str, *, with_variants: bool = True) -> List[KernelReport]:
    """Every shipped RDNA4 attention configuration (plus causal+LSE variants) for `arch`."""
    out = []
    for d, pv, cfg in shipped_rdna4_configs():
        out.append(compile_attention(arch, d, pv, cfg))
        if with_variants:
            out.append(compile_attention(arch, d, pv, cfg, is_causal=True, return_lse=True, out_dtype="fp16"))
    return out


if __name__ == "__main__":  # python -m <pack>.kernels.verify.triton_aot gfx1201
    import sys
    for a in sys.argv[1:] or ["gfx1201"]:
        for r in compile_shipped(a):
            print(r.line())
