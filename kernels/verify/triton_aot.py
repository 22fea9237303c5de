"""Ahead-of-time compilation of the Triton kernels for RDNA4 (gfx1200/gfx1201) on any machine.

`triton.compile(ASTSource(...), target=GPUTarget("hip", arch, 32))` needs no GPU, so every shipped
RDNA4 configuration can be checked on a CPU: register use, spills, LDS, occupancy, and whether the
ISA really uses the gfx12 WMMA instructions (int8 for Q.K^T, fp8 for P.V). The signature mirrors how
the backend launches the kernels (16-byte aligned pointers and row strides, unit strides constant).

It also reads how P.V is accumulated from the Triton IR: Triton's combiner folds `x + dot(a, b, 0)` back
into `dot(a, b, x)` (accumulation inside the MMA) unless the dot carries max_num_imprecise_acc, so the
"split" mode is only real if its P.V dots still start from a zero accumulator after compilation.
`nvidia_pv_dots` checks the same for NVIDIA targets (Triton ships ptxas; no GPU needed).
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
    pv_dots: int = 0        # FP8/FP16 dots (P.V) in the Triton IR
    pv_dots_fresh: int = 0  # of which start from a zero accumulator (the "split" form survived)
    loop_ops: Dict[str, int] = field(default_factory=dict)  # opcode counts of the key loop (most v_wmma)
    # Opcode counts of each unmasked-tile key loop, in ISA order (`key_loops_ops`): a key-mask kernel has two.
    loops: List[Dict[str, int]] = field(default_factory=list)

    @property
    def loop_non_wmma_per_wmma(self) -> Optional[float]:
        """Instructions of the key loop that are not v_wmma, per v_wmma (waits included, as the HIP check)."""
        return non_wmma_per_wmma(self.loop_ops)

    @property
    def loops_non_wmma_per_wmma(self) -> List[Optional[float]]:
        """`loop_non_wmma_per_wmma` of each of `loops`."""
        return [non_wmma_per_wmma(ops) for ops in self.loops]

    def line(self) -> str:
        ops = ", ".join(f"{k}={v}" for k, v in self.isa_ops.items())
        fresh = f"; P.V dots from zero {self.pv_dots_fresh}/{self.pv_dots}" if self.pv_dots else ""
        ratio = self.loop_non_wmma_per_wmma
        loop = f"; key loop {ratio:.2f} non-WMMA per v_wmma" if ratio is not None else ""
        if len(self.loops) > 1:
            loop = "; key loops " + " / ".join(f"{r:.2f}" for r in self.loops_non_wmma_per_wmma if r is not None) \
                + " non-WMMA per v_wmma"
        return (f"{self.arch} {self.label}: VGPRs {self.vgprs}, SGPRs {self.sgprs}, spills v{self.vgpr_spills}/"
                f"s{self.sgpr_spills}, scratch {self.scratch_bytes} B, LDS {self.lds_bytes} B, "
                f"occupancy {self.occupancy} waves/SIMD; {ops}{fresh}{loop}")


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


def pv_dots(ir: str):
    """(P.V dots, of which with a constant accumulator) in Triton IR: dots on f8/f16 operands."""
    total = fresh = 0
    for line in ir.splitlines():
        m = re.search(r"= (?:tt\.dot|ttng\.warp_group_dot) %[\w#]+, %[\w#]+, (%[\w#]+)", line)
        if m and re.search(r": (?:tensor|!ttg\.memdesc)<\d+x\d+x(?:f8E4M3FN|f16)", line):
            total += 1
            fresh += m.group(1).startswith("%cst")
    return total, fresh


def non_wmma_per_wmma(ops: Dict[str, int]) -> Optional[float]:
    """Instructions that are not v_wmma per v_wmma in one block's opcode counts, or None without a v_wmma."""
    wmma = sum(n for op, n in ops.items() if op.startswith("v_wmma"))
    return (sum(ops.values()) - wmma) / wmma if wmma else None


def _blocks(asm: str) -> List[str]:
    return re.split(r"\n(?=\.LBB\d+_\d+:)", asm)


def _opcodes(block: str) -> Dict[str, int]:
    ops: Dict[str, int] = {}
    for line in block.splitlines():
        text = line.strip()
        if text and not text.startswith((";", ".")) and not text.endswith(":"):
            op = text.split()[0]
            ops[op] = ops.get(op, 0) + 1
    return ops


def key_loop_ops(asm: str) -> Dict[str, int]:
    """Opcode counts of the basic block with the most v_wmma: the unmasked key loop of an attention kernel (the
    first in the ISA where there are several)."""
    loop = max(_blocks(asm), key=lambda b: b.count("v_wmma"))
    return _opcodes(loop) if "v_wmma" in loop else {}


def key_loops_ops(asm: str) -> List[Dict[str, int]]:
    """Opcode counts of each block with the most v_wmma that branches back to its own label, in ISA order: the loops
    over full key tiles (the masked tail's loop spans several blocks). A key-mask kernel has two: the plain padding
    rows' (its then-branch, placed first) and the biased rows'."""
    blocks = _blocks(asm)
    most = max(b.count("v_wmma") for b in blocks)
    loops = []
    for block in blocks:
        label = re.match(r"(\.LBB\d+_\d+):", block)
        if most and block.count("v_wmma") == most and label and \
                re.search(rf"\bs_c?branch\w*\s+{re.escape(label.group(1))}\b", block):
            loops.append(_opcodes(block))
    return loops


def _report(kernel, label: str, arch: str) -> KernelReport:
    asm = kernel.asm["amdgcn"]
    dots, fresh = pv_dots(kernel.asm["ttir"])
    occ = re.search(r";\s*Occupancy:\s*(\d+)", asm)
    ops = {name: len(re.findall(rf"\b{name}\b", asm)) for name in (WMMA_INT8, WMMA_FP8, WMMA_F16)}
    return KernelReport(
        label=label, arch=arch,
        vgprs=_meta_int(asm, "vgpr_count"), sgprs=_meta_int(asm, "sgpr_count"),
        vgpr_spills=_meta_int(asm, "vgpr_spill_count"), sgpr_spills=_meta_int(asm, "sgpr_spill_count"),
        scratch_bytes=_meta_int(asm, "private_segment_fixed_size"),
        lds_bytes=int(kernel.metadata.shared), occupancy=int(occ.group(1)) if occ else None,
        isa_ops=ops, pv_dots=dots, pv_dots_fresh=fresh, loop_ops=key_loop_ops(asm), loops=key_loops_ops(asm))


def _compile(fn, signature: Dict[str, str], constexprs: Dict[str, object], arch: str, num_warps: int,
             num_stages: int):
    """Compile for gfx12 (`arch` "gfx1201"), or for NVIDIA with `arch` "sm_89"/"sm_90"."""
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
    target = GPUTarget("cuda", int(arch[3:]), 32) if arch.startswith("sm_") else GPUTarget("hip", arch, 32)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def compile_attention(arch: str, head_dim: int, pv: str, config: AttentionConfig, *, is_causal: bool = False,
                      return_lse: bool = False, out_dtype: str = "bf16", kv_group: int = 1,
                      v_head_dim: Optional[int] = None, smooth_v: bool = False,
                      key_mask: bool = False, plain_rows: bool = False) -> KernelReport:
    """One attention kernel as the backend launches it with `config` (its `pv_accumulate` included); `key_mask`:
    the variant that adds a key-only mask's bias; `plain_rows`: with the plain padding rows' loop beside it
    (attention.PLAIN_MASK_ROWS)."""
    kernel, label = _compile_attention(arch, head_dim, pv, config, is_causal=is_causal, return_lse=return_lse,
                                       out_dtype=out_dtype, kv_group=kv_group, v_head_dim=v_head_dim,
                                       smooth_v=smooth_v, key_mask=key_mask, plain_rows=plain_rows)
    return _report(kernel, label, arch)


def nvidia_missing() -> Optional[str]:
    """Why AOT compilation for NVIDIA cannot run here, or None."""
    try:
        from triton.backends import backends
    except Exception as exc:
        return f"triton is not importable: {exc}"
    return None if "nvidia" in backends else "this triton has no NVIDIA backend"


def nvidia_pv_dots(arch: str, head_dim: int, pv: str, config: AttentionConfig) -> Dict[str, object]:
    """How the P.V dots come out for an NVIDIA target ("sm_89", "sm_90"): counts in the TTIR and TTGIR and
    each TTGIR dot's maxNumImpreciseAcc (sm_90's wgmma flushes its FP8 accumulator every that many K)."""
    kernel, _ = _compile_attention(arch, head_dim, pv, config)
    ttgir = kernel.asm["ttgir"]
    imprecise = [int(m) for line in ttgir.splitlines() if re.search(r"x(?:f8E4M3FN|f16)", line)
                 for m in re.findall(r"maxNumImpreciseAcc = (\d+)", line)]
    return {"ttir": pv_dots(kernel.asm["ttir"]), "ttgir": pv_dots(ttgir), "max_num_imprecise_acc": imprecise}


def _compile_attention(arch, head_dim, pv, config, *, is_causal=False, return_lse=False, out_dtype="bf16",
                       kv_group=1, v_head_dim=None, smooth_v=False, key_mask=False, plain_rows=False):
    from ..backends.triton.attention import ACC_MODES, _sage_attn_fwd

    dv = v_head_dim or head_dim
    d_pad, dv_pad = padded_head_dim(head_dim), padded_head_dim(dv)
    v_ty = "*fp8e4nv" if pv == "fp8" else "*fp16"
    sig = {"Q8": "*i8", "QS": "*fp32", "K8": "*i8", "KS": "*fp32", "V": v_ty, "VS": "*fp32", "VM": "*fp32",
           "O": f"*{out_dtype}", "LSE": "*fp32", "BIAS": "*fp32", "KEND": "*i32", "PLAIN": "*i8"}
    # sks: k_scale's row stride, a multiple of 16 from the Triton prologue (pad_k_scale_rows)
    strides = ["sqb", "sqh", "sqn", "skb", "skh", "skn", "svb", "svh", "svn", "svd", "sob", "soh", "son", "sks",
               "sbb", "sbh", "seb", "seh", "spb", "sph"]
    unit = "svn" if config.v_transposed else "svd"
    for s in strides:
        sig[s] = "constexpr" if s == unit else "i32"
    for s in ("Hq", "Hkv", "Nq", "Nk"):
        sig[s] = "i32"
    consts = {unit: 1, "KV_GROUP": kv_group, "HEAD_DIM": head_dim, "D_PAD": d_pad, "DV": dv, "DV_PAD": dv_pad,
              "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "IS_CAUSAL": is_causal,
              "PV_FP8": pv == "fp8", "STORE_LSE": return_lse, "V_T": config.v_transposed, "EXACT_P_ROUND": False,
              "PV_ACC": ACC_MODES[config.pv_accumulate], "HAS_VMEAN": smooth_v,
              "FOLD_Q_SCALE": config.fold_q_scale,
              "FP8_CVT_ASM": config.fp8_cvt_asm and pv == "fp8", "CHECK_P": False, "HAS_BIAS": key_mask,
              "PLAIN_ROWS": key_mask and plain_rows, "INTERPRETER": False}
    for k in consts:
        sig[k] = "constexpr"
    kernel = _compile(_sage_attn_fwd, sig, consts, arch, config.num_warps, config.num_stages)
    label = (f"attention D{head_dim}{'' if dv == head_dim else f'/{dv}'} {pv} BM{config.block_m} "
             f"BN{config.block_n} w{config.num_warps} s{config.num_stages} acc={config.pv_accumulate}"
             f"{' causal' if is_causal else ''}{' lse' if return_lse else ''}{' smooth_v' if smooth_v else ''}"
             f"{' key_mask' if key_mask else ''}{' plain_rows' if key_mask and plain_rows else ''}")
    return kernel, label


def _quantize_kernels(arch: str, head_dim: int, pv: str, v_head_dim: Optional[int] = None,
                      smooth_v: bool = False):
    """[(kernel, label)] of `_quantize_qkv` at the shipped prologue configuration (bf16 input), without and with
    the stats folded in. Sequence lengths carry no divisibility (as at Nk = 32760, Wan 480p); V's output strides
    are those of its storage: (Dv, Nk) rows when the attention wants V transposed, else (Nk, Dv)."""
    from ..backends.triton import prologue as p
    from ..backends.triton.configs import attention_config, prologue_config

    cfg = prologue_config(arch)
    dv = v_head_dim or head_dim
    out_t = attention_config(arch, max(head_dim, dv), pv).v_transposed  # V stored (Dv, Nk) for the attention
    d_pad, dv_pad = padded_head_dim(head_dim), padded_head_dim(dv)
    sv = " smooth_v" if smooth_v else ""
    v_out = "*fp8e4nv" if pv == "fp8" else "*fp16"
    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KSUM": "*fp64", "VMAX": "*fp32", "VSUM": "*fp64",
           "VMIN": "*fp32", "COUNT": "*fp64", "LIVE": "*i8", "KMEAN": "*fp32", "VSCALE": "*fp32", "VMEAN": "*fp32",
           "Q8": "*i8",
           "QS": "*fp32", "K8": "*i8", "KS": "*fp32", "VOUT": v_out, "mult": "fp32"}
    for t in ("q", "k", "v", "o"):
        for dim in "bhn":
            sig[f"s{t}{dim}"] = "i32"
        sig[f"s{t}d"] = "constexpr"
    v_unit = "son" if out_t else "sod"  # the unit stride of V's storage
    sig["son"], sig["sod"], sig["sks"], sig["slb"], sig["slh"] = "i32", "i32", "i32", "i32", "i32"
    sig[v_unit] = "constexpr"
    for name in ("Hq", "Hkv", "Nq", "Nk", "n_chunks", "q_blocks", "k_blocks", "v_blocks", "q_programs",
                 "k_programs"):
        sig[name] = "i32"
    consts = {"sqd": 1, "skd": 1, "svd": 1, v_unit: 1, "D": head_dim, "D_PAD": d_pad, "DV": dv,
              "DV_PAD": dv_pad, "QK_BLOCK": cfg.block_n, "V_BLOCK": cfg.block_n, "PER_BLOCK": False,
              "HAS_MEAN": True, "PV_FP8": pv == "fp8", "OUT_T": out_t, "FOLD_STATS": False,
              "STATS_CH": p.STATS_CH, "SMOOTH_V": smooth_v, "HAS_LIVE": False, "INTERPRETER": False}
    sig.update({k: "constexpr" for k in consts})
    kernels = []
    for fold in (False, True):
        consts["FOLD_STATS"] = fold
        k = _compile(p._quantize_qkv, sig, consts, arch, cfg.num_warps, 1)
        vt = " V^T" if out_t else ""
        kernels.append((k, f"quantize_qkv D{head_dim}/{dv} {pv}{vt}{' fold' if fold else ''}{sv}"))
    return kernels


def narrow_stores(arch: str, head_dim: int, pv: str) -> Dict[str, int]:
    """8- and 16-bit global stores per `_quantize_qkv` variant for `arch` (gfx12 or "sm_90"): the quantized
    outputs are rows of 16-byte multiples, so no store should be narrower than 32 bits; one that is means
    Triton could not vectorize it."""
    pattern = (r"\b(?:global|buffer)_store_(?:b8|b16|byte|short|d16\w*)\b" if arch.startswith("gfx")
               else r"\bst\.global(?:\.\w+)*\.[bsuf](?:8|16)\b")
    out = {}
    for kernel, label in _quantize_kernels(arch, head_dim, pv):
        asm = kernel.asm["amdgcn"] if arch.startswith("gfx") else kernel.asm["ptx"]
        out[label] = len(re.findall(pattern, asm))
    return out


def compile_prologue(arch: str, head_dim: int, pv: str, v_head_dim: Optional[int] = None,
                     smooth_v: bool = False) -> List[KernelReport]:
    """The prologue's kernels at the shipped configuration (bf16 input), as reports (gfx12 only)."""
    from ..backends.triton import prologue as p
    from ..backends.triton.configs import prologue_config

    cfg = prologue_config(arch)
    dv = v_head_dim or head_dim
    d_pad, dv_pad = padded_head_dim(head_dim), padded_head_dim(dv)
    sv = " smooth_v" if smooth_v else ""
    reports = [_report(k, label, arch) for k, label in _quantize_kernels(arch, head_dim, pv, v_head_dim, smooth_v)]
    sig = {"K": "*bf16", "V": "*bf16", "KSUM": "*fp64", "VMAX": "*fp32", "VSUM": "*fp64", "VMIN": "*fp32",
           "LIVE": "*i8", "skb": "i32", "skh": "i32", "skn": "i32", "skd": "constexpr",
           "svb": "i32", "svh": "i32", "svn": "i32", "svd": "constexpr", "slb": "i32", "slh": "i32", "Hkv": "i32",
           "Nk": "i32", "n_chunks": "i32"}
    consts = {"skd": 1, "svd": 1, "D": head_dim, "D_PAD": d_pad, "DV": dv, "DV_PAD": dv_pad,
              "CHUNK": cfg.stats_block_n, "SUB": p.stats_rows(d_pad, dv_pad, True, smooth_v), "DO_KSUM": True,
              "SMOOTH_V": smooth_v, "HAS_LIVE": False}
    sig.update({k: "constexpr" for k in consts})
    k = _compile(p._kv_stats, sig, consts, arch, cfg.num_warps, 1)
    reports.append(_report(k, f"kv_stats D{head_dim}{sv}", arch))
    sig = {"KSUM": "*fp64", "VMAX": "*fp32", "VSUM": "*fp64", "VMIN": "*fp32", "COUNT": "*fp64", "KMEAN": "*fp32",
           "VSCALE": "*fp32", "VMEAN": "*fp32", "n_chunks": "i32", "Nk": "i32"}
    consts = {"D": head_dim, "D_PAD": d_pad, "DV": dv, "DV_PAD": dv_pad, "CH": p.STATS_CH, "DO_KSUM": True,
              "PV_FP8": pv == "fp8", "SMOOTH_V": smooth_v, "HAS_LIVE": False}
    sig.update({k: "constexpr" for k in consts})
    k = _compile(p._kv_finalize, sig, consts, arch, 4, 1)
    reports.append(_report(k, f"kv_finalize D{head_dim} {pv}{sv}", arch))
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
