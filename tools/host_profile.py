"""Where a public call's time goes, per shape and backend (GPU only).

Per (shape, backend) it prints, all from one run:
  cold_ms   per call from an idle device (the main job's figure: host issue time + device tail)
  b2b_ms    per call when 50 calls are issued back to back (what sampling sees while the host runs ahead)
  host_us   median host time of issuing one call; then the same for each step of the call alone
            (describe, choose, why_not, prologue, attention) and for one torch.empty
  kernels   device time per call of every kernel (torch.profiler)
and writes a cProfile of 200 calls per (shape, backend) (functions by own time) under --out.

    python tools/host_profile.py [--shapes flux_1mp,sdxl_1mp_d64] [--backends triton_int8_fp8,sdpa] [--out DIR]

Figures: docs/MEASUREMENTS.md#host-time
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

from pack_loader import load_pack


def host_us(fn, sync, calls=60):
    """Median microseconds of issuing fn() with the device idle before each call."""
    fn()
    sync()
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="flux_1mp,sdxl_1mp_d64,flux_2mp")
    parser.add_argument("--backends", default="triton_int8_fp8,triton_int8_fp16,sdpa")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_pack()
    import torch

    from comfyui_sage_rdna4.kernels import benchmark as bench
    from comfyui_sage_rdna4.kernels.api import sage_attention
    from comfyui_sage_rdna4.kernels.call_spec import describe_call
    from comfyui_sage_rdna4.kernels.dispatch import settled_route
    from comfyui_sage_rdna4.kernels.quant import default_sm_scale
    from comfyui_sage_rdna4.kernels.registry import get_backend

    device = torch.device("cuda")
    sync = torch.cuda.synchronize
    shapes = {s.name: s for s in bench.GPU_SHAPES}
    results = []
    out_dir = args.out
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    empty_us = host_us(lambda: torch.empty((1, 24, 4608, 128), dtype=torch.int8, device=device), sync)
    print(f"torch.empty on cuda: {empty_us:.1f} us host")
    for shape_name in args.shapes.split(","):
        shape = shapes[shape_name]
        q, k, v = bench.make_inputs(shape, device)
        for name in args.backends.split(","):
            def call(name=name):
                return sage_attention(q, k, v, kernel=name)

            try:
                call()
            except Exception as exc:  # a refusal is a result here
                print(f"{shape_name} {name}: did not run: {type(exc).__name__}: {exc}")
                continue
            row = {"shape": shape_name, "backend": name}
            row["cold_ms"] = bench.time_ms(call, device, 30).median
            sync()
            t0 = time.perf_counter()
            for _ in range(50):
                call()
            sync()
            row["b2b_ms"] = (time.perf_counter() - t0) * 1e3 / 50
            row["host_us"] = host_us(call, sync)
            c = describe_call(q, k, v)
            scale = default_sm_scale(c.head_dim)
            row["describe_us"] = host_us(lambda: describe_call(q, k, v), sync)
            row["route_us"] = host_us(lambda: settled_route(c, name, tensors=(q, k, v), sm_scale=scale), sync)
            be = get_backend(name)
            row["why_not_us"] = host_us(lambda: be.why_not(c), sync)
            if name.startswith("triton_"):
                from comfyui_sage_rdna4.kernels.backends.triton import attention, prologue
                from comfyui_sage_rdna4.kernels.backends.triton.configs import attention_config
                pv = name.rsplit("_", 1)[1]
                cfg = attention_config(c.arch, c.head_dim, pv)

                def pro():  # as the backend calls it: into the kept buffers
                    return prologue.triton_quantize_qkv(q, k, v, sm_scale=scale, pv=pv, v_transposed=cfg.v_transposed,
                                                        reuse_buffers=True, pad_k_scale_rows=True)

                qq = pro()
                row["prologue_us"] = host_us(pro, sync)
                row["attention_us"] = host_us(
                    lambda: attention.attention_from_quantized_triton(qq, pv=pv, config=cfg, out_dtype=q.dtype), sync)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call()
                sync()
            kernels = {}
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t:
                    kernels[ev.key[:60]] = round(t / 10, 1)
            row["kernels_us"] = kernels
            prof_c = cProfile.Profile()
            prof_c.enable()
            for _ in range(200):
                call()
                sync()
            prof_c.disable()
            text = io.StringIO()
            pstats.Stats(prof_c, stream=text).sort_stats("tottime").print_stats(40)
            if out_dir:
                with open(os.path.join(out_dir, f"cprofile_{shape_name}_{name}.txt"), "w") as f:
                    f.write(text.getvalue())
            results.append(row)
            print(json.dumps(row), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "host_profile.json"), "w") as f:
            json.dump({"torch_empty_us": empty_us, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
