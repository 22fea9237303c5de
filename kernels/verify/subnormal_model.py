"""Long-tail attention inputs and the kernels' P grid (the spec's, reference.py) with and without a flushing WMMA.

Verification only. Nothing here has run on RDNA4: whether its WMMA flushes subnormal inputs is unknown; the
emulation's emu_flush_subnormal option (kernel_abi.VERIFY_OPTIONS) models a unit that does.

The inputs (long_tail_qq) put each row's largest score in key 0, so the kernels' running max is the final max
from the first key tile on; the spec's one-pass P grid (p_tile = the kernel's key tile) is then the kernels' up to
v_exp_f32's last bit and the summation order, which the tests check against the host simulator.

    python -m comfyui_sage_rdna4.kernels.verify.subnormal_model     (prints the table of docs/MEASUREMENTS.md)
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from .. import quant, reference
from ..backends.hip import kernel_abi


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


def spec_model(qq: quant.QuantizedQKV, pv: str, *, flush: bool, p_tile: Optional[int] = None) -> torch.Tensor:
    """The spec's output (FP32) on its P grid: FP8 P against the row max (p_tile None: the kernels before the fix)
    or each key tile's max (p_tile = the kernel's tile); `flush`: P.V reads subnormal P as zero, the row sum still
    counts them (the spec's verification-only model_flushing_wmma)."""
    return reference.attention_from_quantized(qq, pv=pv, p_tile=p_tile, model_flushing_wmma=flush)[0]


def former_fp16_model(qq: quant.QuantizedQKV, *, flush: bool) -> torch.Tensor:
    """The kernels' FP16 P before it topped at 2^15 (the spec no longer states it): P = fp16(2^(s - m)) in [0, 1],
    the row sum adds the fp16 P; `flush` as in spec_model."""
    s = reference.qk_scores_base2(qq.q8, qq.q_scale, qq.k8, qq.k_scale)
    used = torch.exp2(s - s.amax(dim=-1, keepdim=True)).half().float()
    row_sum = used.sum(dim=-1, keepdim=True)
    if flush:
        used = torch.where(used < quant.FP16_MIN_NORMAL, torch.zeros_like(used), used)
    return (used @ qq.v.float()) / row_sum * qq.v_scale.unsqueeze(2)


def grid_model(qq: quant.QuantizedQKV, pv: str, when: str, *, flush: bool) -> torch.Tensor:
    """The kernels' P grid "before" the fix (FP8 against the row max, FP16 in [0, 1]) or "after" it (FP8 against
    each HIP key tile's max, FP16 topped at 2^15): the output under `flush` or not."""
    if pv == "fp16" and when == "before":
        return former_fp16_model(qq, flush=flush)
    p_tile = kernel_abi.ATT_BLOCK_N if pv == "fp8" and when == "after" else None
    return spec_model(qq, pv, flush=flush, p_tile=p_tile)


def rel_l1(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).abs().sum() / exact.abs().sum())


TAILS = {"2^-8..2^-16": (8.0, 16.0), "2^-13..2^-17": (13.0, 17.0), "2^-15..2^-16": (15.0, 16.0)}


def table(nks=(2048, 4096, 16384), tails=TAILS) -> Dict[tuple, Dict[str, float]]:
    """rel L1 against exact attention per (pv, nk, tail), kept / flushed: FP8 P on the row max's grid (the kernels
    before the fix) and on each tile's (HIP's BN); FP16 P in [0, 1] (before) and topped at 2^15 (the spec now)."""
    rows = {}
    for pv in ("fp8", "fp16"):
        for nk in nks:
            for name, tail in tails.items():
                qq, exact = long_tail_qq(pv, nk, tail)
                rows[(pv, nk, name)] = {f"{when} {'flushed' if flush else 'kept'}": rel_l1(
                    grid_model(qq, pv, when, flush=flush), exact) for when in ("before", "after") for flush in (0, 1)}
    return rows


def main() -> None:
    for (pv, nk, name), row in table().items():
        print(f"{pv:5s} nk={nk:6d} tail {name:13s} " + "  ".join(f"{k} {v:.2e}" for k, v in row.items()))
    print("(rel L1 against exact attention; FP8 P subnormal below 2^-6 = 2^%.1f of its top)"
          % (-6 - math.log2(quant.FP8_MAX)))


if __name__ == "__main__":
    main()
