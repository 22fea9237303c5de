"""What splitting an attention call into bounded launches (kernels/launch_split.py) costs on this GPU.

    python tools/split_cost.py [--shape wan_720p] [--backends triton_int8_fp8,triton_int8_fp16] [--reps 10]

For each backend, the same call (kernels/benchmark.py's shape and standard inputs) with three work bounds, in
turn within each repeat so clock drift hits all alike: no split (one launch), this device's bound, and an
RX 9060 XT's (32 CUs: the most launches a call gets on an RDNA4 card). Prints medians, their ratio to one
launch, the launch count and whether the output is bit-identical to one launch; also the host time the plan
adds to a call that stays one launch (Flux 1 MP)."""
import argparse
import json
import statistics
import sys
import time

import torch

from pack_loader import load_pack


def main(argv=None) -> int:
    pack = load_pack()
    from importlib import import_module
    bench = import_module(f"{pack.__name__}.kernels.benchmark")
    ls = import_module(f"{pack.__name__}.kernels.launch_split")
    api = import_module(f"{pack.__name__}.kernels.api")

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="wan_720p")
    parser.add_argument("--backends", default="triton_int8_fp8,triton_int8_fp16")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    shape = {s.name: s for s in bench.GPU_SHAPES + bench.CPU_SHAPES}[args.shape]
    dev = torch.device("cuda")
    names = [x for x in args.backends.split(",") if x]  # none (--backends ''): the host cost only
    q, k, v = bench.make_inputs(shape, dev) if names else (None,) * 3
    b, h, n, d = shape.batch, shape.heads, shape.seq, shape.head_dim
    bounds = {"one launch": float("inf"), "this device": None, "RX 9060 XT (32 CU)": ls.WORK_PER_CU * 32}
    result = {"device": torch.cuda.get_device_name(), "shape": shape.name, "reps": args.reps, "backends": {}}
    for name in names:
        pv = name.rsplit("_", 1)[1]
        outs, times = {}, {label: [] for label in bounds}
        for rep in range(args.reps + 2):  # two untimed warm-up rounds (compiles, autotune-free: explicit kernel)
            for label, bound in bounds.items():
                with ls.work_bound_override(bound):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    out = api.sage_attention(q, k, v, kernel=name)
                    end.record()
                    end.synchronize()
                if rep >= 2:
                    times[label].append(start.elapsed_time(end))
                else:
                    outs[label] = out
        rows = {}
        for label, bound in bounds.items():
            launches = len(ls.split_attention(b, h, h, n, n, d, d, pv=pv, causal=False, row_block=128,
                                              bound=ls.work_bound(dev) if bound is None else bound))
            med = statistics.median(times[label])
            rows[label] = {"launches": launches, "median_ms": med, "min_ms": min(times[label]),
                           "max_ms": max(times[label]),
                           "vs_one_launch": med / statistics.median(times["one launch"]),
                           "bit_identical": bool(torch.equal(outs[label], outs["one launch"]))}
        result["backends"][name] = rows
        for label, r in rows.items():
            print(f"{shape.name} {name:18} {label:20} {r['launches']:3d} launches  {r['median_ms']:9.3f} ms "
                  f"[{r['min_ms']:.3f}-{r['max_ms']:.3f}]  x{r['vs_one_launch']:.4f}  "
                  f"bit-identical={r['bit_identical']}", flush=True)
    # The plan's host cost on a call that stays one launch (what every small call pays).
    flux = {s.name: s for s in bench.GPU_SHAPES}["flux_1mp"]
    reps = 20000
    t0 = time.perf_counter()
    for _ in range(reps):
        ls.split_attention(1, flux.heads, flux.heads, flux.seq, flux.seq, 128, 128, pv="fp8", causal=False,
                           bound=ls.work_bound(dev), row_block=128)
    result["plan_host_us_flux_1mp"] = (time.perf_counter() - t0) / reps * 1e6
    print(f"plan host cost, flux_1mp (one launch): {result['plan_host_us_flux_1mp']:.2f} us per call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
