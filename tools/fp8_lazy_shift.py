"""Why the HIP FP8 P.V has no single chain: the spec's FP8 P grid against a lazy shift, on the CPU.

    python tools/fp8_lazy_shift.py [--headrooms 0,1,2,3,4]

FP8 P is e4m3(448 * 2**(s - top)) with top each 64-key tile's own max (`reference.fp8_p_tops`). A single P.V chain
(o accumulated in the matrix unit's C across tiles, no fold) must rescale o whenever top moves, so under that grid
it rescales on every tile. A lazy shift moves top only when a tile's max exceeds it, and then to that max plus a
headroom H (base 2): the single chain then rescales only on those tiles, at the price of H bits less range below
the top for the small weights. For each headroom this prints the spec's rel L1 against exact FP32 attention with the
lazy grid (the spec itself with None) on the self-check's input kinds and Gaussian inputs, how often a row's top
moves per tile, and how often some row of a 16-row wave does (the single chain's rescaling path runs on those tiles).
"""
import argparse
import importlib
import math
import sys

import torch

from pack_loader import load_pack

WAVE_ROWS = 16  # query rows of one wave in the HIP kernels (the lanes of a 16-row WMMA block)


def lazy_tops(headroom: float, moves: dict):
    """fp8_p_tops' stand-in with the lazy rule; records the moves in `moves`."""
    def tops(s: torch.Tensor, p_tile: int) -> torch.Tensor:
        nk = s.shape[-1]
        tiles = torch.nn.functional.pad(s, (0, -nk % p_tile), value=-math.inf).unflatten(-1, (-1, p_tile))
        tile_max = tiles.amax(dim=-1)  # (..., rows, tiles)
        top = torch.full(tile_max.shape[:-1], -math.inf, dtype=tile_max.dtype)
        out = torch.empty_like(tile_max)
        row_moves = wave_moves = 0.0
        for t in range(tile_max.shape[-1]):
            moved = tile_max[..., t] > top
            row_moves += moved.float().mean().item()
            rows = moved.reshape(-1, moved.shape[-1])
            waves = torch.nn.functional.pad(rows, (0, -rows.shape[-1] % WAVE_ROWS)).unflatten(-1, (-1, WAVE_ROWS))
            wave_moves += waves.any(dim=-1).float().mean().item()
            top = torch.where(moved, tile_max[..., t] + headroom, top)
            out[..., t] = top
        moves["row"] = row_moves / tile_max.shape[-1]
        moves["wave"] = wave_moves / tile_max.shape[-1]
        out = torch.where(out == -math.inf, torch.zeros_like(out), out)
        return out.repeat_interleave(p_tile, dim=-1)[..., :nk]
    return tops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headrooms", default="0,1,2,3,4")
    args = ap.parse_args(argv)
    pack = load_pack()
    quant = importlib.import_module(f"{pack.__name__}.kernels.quant")
    reference = importlib.import_module(f"{pack.__name__}.kernels.reference")
    sc = importlib.import_module(f"{pack.__name__}.kernels.self_check")
    spec_tops = reference.fp8_p_tops
    inputs = []
    for kind in ("long-tail", "diffuse", "peaked", "long-keys"):
        case = next(c for c in sc.DEFAULT_CASES if c.kind == kind or c.name == kind)
        inputs.append((f"self-check {case.name}", sc.make_inputs(case, "cpu"), case.bound.max_rel_l1))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 128, generator=g).bfloat16() for n in (256, 4096, 4096))
    inputs += [("Gaussian, 4096 keys", (q, k, v), None), ("Gaussian x3 (sharper), 4096 keys", (q * 3, k * 3, v), None)]
    for label, (q, k, v), bound in inputs:
        sm = quant.default_sm_scale(q.shape[-1])
        exact = reference.exact_attention(q.float(), k.float(), v.float(), sm_scale=sm)[0]
        qq = quant.quantize_qkv_torch(q, k, v, sm_scale=sm, smooth_k=True, pv="fp8")
        print(f"{label} {tuple(q.shape)} Nk {k.shape[2]}" + (f" (self-check bound {bound})" if bound else ""))
        for h in [None] + [float(x) for x in args.headrooms.split(",")]:
            moves = {}
            reference.fp8_p_tops = spec_tops if h is None else lazy_tops(h, moves)
            try:
                out = reference.attention_from_quantized(qq, pv="fp8", q=q, sm_scale=sm, p_tile=64)[0]
            finally:
                reference.fp8_p_tops = spec_tops
            rel = float((out - exact).abs().sum() / exact.abs().sum())
            what = "spec (per-tile top)" if h is None else f"lazy H={h:g}"
            extra = "" if h is None else f"; top moves per tile: row {moves['row']:.3f}, wave {moves['wave']:.3f}"
            print(f"  {what:20s} rel L1 {rel:.5f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
