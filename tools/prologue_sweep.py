"""Triton prologue launch configurations on the GPU: device time per call and bit-identity with the shipped one.

For each shape of the main job (bf16, FP8 V as the FP8 backend stores it on this GPU) and each candidate
PrologueConfig (tokens per quantize program, tokens per stats program, warps) it prints the device time of the
prologue's kernels per call (calls issued back to back, CUDA events, median of 5 batches) and whether every
output (INT8 Q/K and their scales, FP8 V and its scales, K's mean) is bit-identical to the shipped config's.

    python tools/prologue_sweep.py [--shapes flux_1mp,sdxl_1mp_d64,wan_480p] [--pv fp8]

Figures: docs/MEASUREMENTS.md#triton-prologue
"""
import argparse
import statistics

from pack_loader import load_pack

CANDIDATES = [(64, 256, 4), (32, 256, 4), (128, 256, 4), (128, 256, 8), (64, 128, 4), (64, 512, 4), (64, 256, 8),
              (128, 128, 8), (32, 128, 4)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="flux_1mp,sdxl_1mp_d64,wan_480p")
    parser.add_argument("--pv", default="fp8")
    args = parser.parse_args()
    load_pack()
    import torch

    from comfyui_sage_rdna4.kernels import benchmark as bench
    from comfyui_sage_rdna4.kernels.backends.triton import prologue
    from comfyui_sage_rdna4.kernels.backends.triton.configs import PrologueConfig, attention_config
    from comfyui_sage_rdna4.kernels.call_spec import device_arch
    from comfyui_sage_rdna4.kernels.quant import default_sm_scale

    shipped = prologue.prologue_config
    arch = device_arch("cuda", torch.cuda.current_device())
    shapes = {s.name: s for s in bench.GPU_SHAPES}
    print(f"{'shape':<14} {'block_n':>7} {'stats_n':>7} {'warps':>5} {'us':>8} {'/shipped':>8}  identical")
    for name in args.shapes.split(","):
        shape = shapes[name]
        q, k, v = bench.make_inputs(shape, torch.device("cuda"))
        cfg = attention_config(arch, shape.head_dim, args.pv)
        kw = dict(sm_scale=default_sm_scale(shape.head_dim), pv=args.pv, v_transposed=cfg.v_transposed,
                  reuse_buffers=True, pad_k_scale_rows=True)
        base, base_us = None, None
        for block_n, stats_n, warps in CANDIDATES:
            candidate = PrologueConfig(block_n=block_n, stats_block_n=stats_n, num_warps=warps)
            prologue.prologue_config = lambda a, c=candidate: c
            prologue.prologue_launch.cache_clear()
            try:
                out = prologue.triton_quantize_qkv(q, k, v, **kw)
                fields = [out.q8, out.q_scale, out.k8, out.k_scale, out.v.float(), out.v_scale, out.k_mean]
                fields = [t.clone() for t in fields]
                batches = []
                for _ in range(5):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(20):
                        prologue.triton_quantize_qkv(q, k, v, **kw)
                    end.record()
                    end.synchronize()
                    batches.append(start.elapsed_time(end) * 1e3 / 20)
                us = statistics.median(batches)
            finally:
                prologue.prologue_config = shipped
                prologue.prologue_launch.cache_clear()
            if base is None:
                base, base_us = fields, us
            same = all(torch.equal(a, b) for a, b in zip(fields, base))
            print(f"{name:<14} {block_n:>7} {stats_n:>7} {warps:>5} {us:>8.1f} {us / base_us:>8.3f}  {same}",
                  flush=True)


if __name__ == "__main__":
    main()
