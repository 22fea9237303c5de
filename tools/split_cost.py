"""What splitting an attention call into bounded launches (kernels/launch_split.py) costs on this GPU.

    python tools/split_cost.py [--shape wan_720p] [--backends triton_int8_fp8,triton_int8_fp16] [--reps 10]
    python tools/split_cost.py --estimate     # the tail-cost estimate only (no GPU needed)

For each backend, the same call (kernels/benchmark.py's shape and standard inputs) under several work bounds, in
turn within each repeat so clock drift hits all alike: one launch, this device's own bound (its arch's rate,
clock, CUs and OS), the bound at RDNA4's per-CU rate on this device's SMs (the rule before 2026-12-02), and the
bounds an RX 9060 XT gets on Windows and on Linux. Prints medians, their ratio to one launch, the launch count and
whether the output is bit-identical to one launch; then an ESTIMATE (a model, not a measurement) of the tail cost
on RDNA4 cards from workgroups per CU; then the host time the plan adds to a call that stays one launch."""
import argparse
import json
import math
import statistics
import sys
import time

import torch

from pack_loader import load_pack

# Cards as their drivers would describe them (arch, CUs, clock in kHz, OS, ROCm): public specifications, the
# clock being the boost clock HIP's clockRate is expected to report (not seen on a card here).
CARDS = {
    "RX 9060 XT, Windows": ("gfx1200", 32, 3_130_000, "windows", True),
    "RX 9060 XT, Linux": ("gfx1200", 32, 3_130_000, "linux", True),
    "RX 9070 XT, Windows": ("gfx1201", 64, 2_970_000, "windows", True),
    "RX 9070 XT, Linux": ("gfx1201", 64, 2_970_000, "linux", True),
}
# Workgroups of the HIP D128 attention kernels resident per RDNA4 CU: 8 waves of 32 per workgroup, 9 (FP8) and
# 8 (FP16) waves per SIMD and 19.7 / 27.9 KB of LDS (docs/MEASUREMENTS.md#hip-key-loop, compiled, never run).
HIP_BLOCK_M, HIP_WORKGROUPS_PER_CU = 128, 2


def waves(pieces, block_m: int, slots: int) -> int:
    """Rounds of `slots` workgroups the launches of `pieces` take, each launch's last round counted whole."""
    return sum(math.ceil((p.b1 - p.b0) * (p.h1 - p.h0) * math.ceil((p.n1 - p.n0) / block_m) / slots)
               for p in pieces)


def tail_estimate(ls, shape, pv: str, bound: float, block_m: int, slots: int):
    """(launches, modelled time vs one launch): workgroups of equal duration, each launch ending on its last
    round. A model: it ignores uneven workgroup times and the launch gaps."""
    b, h, n, d = shape.batch, shape.heads, shape.seq, shape.head_dim
    split = ls.split_attention(b, h, h, n, n, d, d, pv=pv, causal=False, row_block=block_m, bound=bound)
    one = ls.split_attention(b, h, h, n, n, d, d, pv=pv, causal=False, row_block=block_m, bound=float("inf"))
    return len(split), waves(split, block_m, slots) / waves(one, block_m, slots)


def print_estimates(ls, shape, result):
    print(f"ESTIMATE, not measured: tail cost of the split on RDNA4 at {shape.name} (HIP D128 kernels, "
          f"{HIP_WORKGROUPS_PER_CU} workgroups per CU, equal workgroup times)")
    result["estimates"] = {}
    for label, card in CARDS.items():
        bound = ls.launch_bound(*card)
        for pv in ("fp8", "fp16"):
            launches, ratio = tail_estimate(ls, shape, pv, bound.work, HIP_BLOCK_M, card[1] * HIP_WORKGROUPS_PER_CU)
            result["estimates"][f"{label} {pv}"] = {"bound": bound.work, "launches": launches, "vs_one_launch": ratio}
            print(f"  {label:20} {pv:4} bound {bound.work:.3g}  {launches:3d} launches  x{ratio:.4f} (estimate)")


def main(argv=None) -> int:
    pack = load_pack()
    from importlib import import_module
    bench = import_module(f"{pack.__name__}.kernels.benchmark")
    ls = import_module(f"{pack.__name__}.kernels.launch_split")

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="wan_720p")
    parser.add_argument("--backends", default="triton_int8_fp8,triton_int8_fp16")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--estimate", action="store_true", help="print the RDNA4 tail-cost estimate only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    shape = {s.name: s for s in bench.GPU_SHAPES + bench.CPU_SHAPES}[args.shape]
    result = {"shape": shape.name, "reps": args.reps, "backends": {}}
    if args.estimate:
        print_estimates(ls, shape, result)
        return _dump(result, args.json)

    api = import_module(f"{pack.__name__}.kernels.api")
    dev = torch.device("cuda", torch.cuda.current_device())
    own = ls.device_bound(dev)
    result.update(device=torch.cuda.get_device_name(), bound=own._asdict(), bound_work=own.work)
    print(f"{result['device']}: {own.arch}, {own.ops_per_clock} ops/clk x {own.cus} CUs x "
          f"{own.clock_hz / 1e9:.3f} GHz x {ls.EFFICIENCY:.0%} x {own.seconds} s ({own.os}) = {own.work:.4g}")
    names = [x for x in args.backends.split(",") if x]  # none (--backends ''): the host cost only
    q, k, v = bench.make_inputs(shape, dev) if names else (None,) * 3
    b, h, n, d = shape.batch, shape.heads, shape.seq, shape.head_dim
    bounds = {"one launch": float("inf"), "this device": own.work,
              f"RDNA4 rate x {own.cus} (old)": ls.WORK_PER_CU * own.cus}
    bounds.update({label: ls.launch_bound(*CARDS[label]).work for label in ("RX 9060 XT, Windows",
                                                                             "RX 9060 XT, Linux")})
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
            launches = len(ls.split_attention(b, h, h, n, n, d, d, pv=pv, causal=False, row_block=128, bound=bound))
            med = statistics.median(times[label])
            rows[label] = {"bound": bound, "launches": launches, "median_ms": med, "min_ms": min(times[label]),
                           "max_ms": max(times[label]),
                           "vs_one_launch": med / statistics.median(times["one launch"]),
                           "bit_identical": bool(torch.equal(outs[label], outs["one launch"]))}
        result["backends"][name] = rows
        for label, r in rows.items():
            print(f"{shape.name} {name:18} {label:22} {r['bound']:9.3g} {r['launches']:3d} launches "
                  f"{r['median_ms']:9.3f} ms [{r['min_ms']:.3f}-{r['max_ms']:.3f}]  x{r['vs_one_launch']:.4f}  "
                  f"bit-identical={r['bit_identical']}", flush=True)
    print_estimates(ls, shape, result)
    # The plan's host cost on a call that stays one launch (what every small call pays).
    flux = {s.name: s for s in bench.GPU_SHAPES}["flux_1mp"]
    reps = 20000
    t0 = time.perf_counter()
    for _ in range(reps):
        ls.split_attention(1, flux.heads, flux.heads, flux.seq, flux.seq, 128, 128, pv="fp8", causal=False,
                           bound=ls.work_bound(dev), row_block=128)
    result["plan_host_us_flux_1mp"] = (time.perf_counter() - t0) / reps * 1e6
    print(f"plan host cost, flux_1mp (one launch): {result['plan_host_us_flux_1mp']:.2f} us per call")
    return _dump(result, args.json)


def _dump(result, path) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
