"""Long-tail attention inputs and a torch model of the HIP kernels' P grid, with and without a flushing WMMA.

Verification only. Nothing here has run on RDNA4: whether its WMMA flushes subnormal inputs is unknown; the
emulation's emu_flush_subnormal option (kernel_abi.VERIFY_OPTIONS) models a unit that does.

The inputs (long_tail_qq) put each row's largest score in key 0, so the kernels' running max is the final max
from the first key tile on: the online softmax then rounds exactly the P that this one-pass model rounds (up to
v_exp_f32's last bit and the summation order), which the tests check against the host simulator.

    python -m comfyui_sage_rdna4.kernels.verify.subnormal_model     (prints the table of docs/MEASUREMENTS.md)
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

from .. import quant, reference

E4M3_MIN_NORMAL = 2.0 ** -6
F16_MIN_NORMAL = 2.0 ** -14
FP8_P_LOG2_MAX = 8.80733967  # sage_attention.hip: the row max's FP8 P is exp2 of this (447.9953)


def long_tail_qq(pv: str, nk: int, tail_log2: Tuple[float, float], *, batch: int = 2, nq: int = 128, d: int = 64,
                 seed: int = 0) -> Tuple[quant.QuantizedQKV, torch.Tensor]:
    """A crafted QuantizedQKV (CPU) and its exact attention output (FP64, dequantized V): in every row key 0 has
    the largest score, the other nk - 1 keys lie log-uniformly tail_log2 = (lo, hi) below it (base 2: weights
    2^-lo .. 2^-hi of the max), each row's tail stretched by its own factor in [0.9, 1.1]. V: channel offset 1 with
    +-0.25 noise for the tail, -1 for key 0, so weight lost from the tail moves the output."""
    g = torch.Generator().manual_seed(seed)
    q8 = torch.zeros(batch, 1, nq, d, dtype=torch.int8)
    q8[..., 0] = 127
    k8 = torch.zeros(batch, 1, nk, d, dtype=torch.int8)
    k8[..., 0] = -127
    lo, hi = tail_log2
    u = lo + (hi - lo) * torch.rand(batch, 1, nk, generator=g, dtype=torch.float64)
    u[:, :, 0] = 0.0
    stretch = 0.9 + 0.2 * torch.rand(batch, 1, nq, generator=g, dtype=torch.float64)
    q_scale = (stretch / (127 * 127)).float()
    k_scale = u.float()
    v = 1.0 + 0.25 * (2 * torch.rand(batch, 1, nk, d, generator=g) - 1)
    v[:, :, 0] = -1.0
    if pv == "fp8":
        vq, v_scale = (v * 224).to(torch.float8_e4m3fn), torch.full((batch, 1, d), 1 / 224)
    else:
        vq, v_scale = (v * 16384).half(), torch.full((batch, 1, d), 1 / 16384)
    qq = quant.QuantizedQKV(q8, q_scale, k8, k_scale, vq, v_scale, None)
    s = reference.qk_scores_base2(q8, q_scale, k8, k_scale).double()
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True))
    exact = (p @ (vq.double() * v_scale.double().unsqueeze(2))) / p.sum(dim=-1, keepdim=True)
    return qq, exact


def kernel_p_model(qq: quant.QuantizedQKV, pv: str, *, flush: bool, fp16_p_log2_top: float = 0.0,
                   fp8_tile_top: bool = False, tile: int = 64) -> torch.Tensor:
    """The HIP kernels' output (FP32) on inputs whose max is in the first key tile. FP8: P = e4m3(exp2(s - m +
    FP8_P_LOG2_MAX)), the row sum adds the unrounded P; `fp8_tile_top`: m is each key tile's own max instead (the
    fixed kernel; tiles more than 64 below the row max are not modelled). FP16: P = fp16(exp2(s - m +
    fp16_p_log2_top)), the row sum adds the fp16 P. `flush`: the WMMA reads subnormal P as zero (the row sum still
    counts them)."""
    s = reference.qk_scores_base2(qq.q8, qq.q_scale, qq.k8, qq.k_scale)
    m = s.amax(dim=-1, keepdim=True)
    v = qq.v.float()
    if pv == "fp8":
        top = m
        if fp8_tile_top:
            nk = s.shape[-1]
            tiles = torch.nn.functional.pad(s, (0, -nk % tile), value=-math.inf).unflatten(-1, (-1, tile))
            top = tiles.amax(dim=-1, keepdim=True).expand_as(tiles).flatten(-2)[..., :nk]
        p = torch.exp2(s - top + FP8_P_LOG2_MAX)
        used = p.to(torch.float8_e4m3fn).float()
        tiny = E4M3_MIN_NORMAL
        weight = torch.exp2(top - m)  # each tile's P in units of the row max's
        if flush:
            used = torch.where(used < tiny, torch.zeros_like(used), used)
        return ((used * weight) @ v) / (p * weight).sum(dim=-1, keepdim=True) * qq.v_scale.unsqueeze(2)
    used = torch.exp2(s - m + fp16_p_log2_top).half().float()
    row_sum = used.sum(dim=-1, keepdim=True)
    if flush:
        used = torch.where(used < F16_MIN_NORMAL, torch.zeros_like(used), used)
    return (used @ v) / row_sum * qq.v_scale.unsqueeze(2)


def rel_l1(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).abs().sum() / exact.abs().sum())


def spec_output(qq: quant.QuantizedQKV, pv: str) -> torch.Tensor:
    return reference.attention_from_quantized(qq, pv=pv)[0]


TAILS = {"2^-8..2^-16": (8.0, 16.0), "2^-13..2^-17": (13.0, 17.0), "2^-15..2^-16": (15.0, 16.0)}


def table(nks=(2048, 4096, 16384), tails=TAILS) -> Dict[tuple, Dict[str, float]]:
    """rel L1 against exact attention per (pv, nk, tail): the spec, the kernel model kept/flushed, the FP8 kernel
    with each tile's P topped at 448 and the FP16 kernel with P's top at 2^15 (kept/flushed)."""
    rows = {}
    for pv in ("fp8", "fp16"):
        for nk in nks:
            for name, tail in tails.items():
                qq, exact = long_tail_qq(pv, nk, tail)
                row = {"spec": rel_l1(spec_output(qq, pv), exact),
                       "kept": rel_l1(kernel_p_model(qq, pv, flush=False), exact),
                       "flushed": rel_l1(kernel_p_model(qq, pv, flush=True), exact)}
                if pv == "fp8":
                    row["tiletop kept"] = rel_l1(kernel_p_model(qq, pv, flush=False, fp8_tile_top=True), exact)
                    row["tiletop flushed"] = rel_l1(kernel_p_model(qq, pv, flush=True, fp8_tile_top=True), exact)
                if pv == "fp16":
                    row["top2^15 kept"] = rel_l1(kernel_p_model(qq, pv, flush=False, fp16_p_log2_top=15.0), exact)
                    row["top2^15 flushed"] = rel_l1(kernel_p_model(qq, pv, flush=True, fp16_p_log2_top=15.0), exact)
                rows[(pv, nk, name)] = row
    return rows


def main() -> None:
    for (pv, nk, name), row in table().items():
        print(f"{pv:5s} nk={nk:6d} tail {name:13s} " + "  ".join(f"{k} {v:.2e}" for k, v in row.items()))
    print("(rel L1 against exact attention; FP8 P subnormal below 2^-6 = 2^%.1f of the row max)"
          % (-6 - math.log2(447.9953)))


if __name__ == "__main__":
    main()
