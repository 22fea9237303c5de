"""What the first call of each Triton backend costs on this GPU, part by part, against SDPA's first call.

For each kernel, one call of a model's size through the public API (`kernel=NAME`, which runs the first-use
self-check of the call's variant, then the call): its wall time, the parts kernels/first_use_costs.py recorded (the
self-check, compiles included), the self-check's warm-up (its kernels compiled side by side:
kernels/backends/triton/precompile.py), how many Triton kernels were compiled or loaded from Triton's disk cache,
then a second call. Triton's disk cache is a fresh folder unless --triton-cache names one: run twice with the same
folder to see a later session (compiles cached; self-check passes are not kept unless --keep-passes).

    python tools/first_use_cost.py [--shape flux|wan|sdxl] [--kernels triton_int8_fp8,triton_int8_fp16]
                                   [--triton-cache DIR] [--keep-passes]
    SAGE_RDNA4_TRITON_PRECOMPILE=0 python tools/first_use_cost.py       # the same, compiling one at a time

Prints one block per kernel; with $OUT set (or --out) it also writes first_use_cost.json there.
"""
import argparse
import json
import os
import sys
import tempfile
import time

from pack_loader import load_pack

SHAPES = {  # (batch, heads, tokens, head dim, dtype): the attention calls of these models
    "flux": (1, 24, 4608, 128, "bfloat16"),
    "wan": (1, 40, 32760, 128, "bfloat16"),
    "sdxl": (2, 10, 4096, 64, "float16"),
}


class CompileCounter:
    """Triton's JIT hook after each in-memory cache miss: a compile, or a load from Triton's disk cache."""

    def __init__(self, knobs):
        self.knobs, self.count = knobs, {}

    def after(self, **kw):
        name = kw["fn"].name
        self.count[name] = self.count.get(name, 0) + 1

    def __enter__(self):
        self.knobs.runtime.jit_post_compile_hook = self.after
        return self

    def __exit__(self, *exc):
        self.knobs.runtime.jit_post_compile_hook = None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="flux", choices=sorted(SHAPES))
    parser.add_argument("--kernels", default="triton_int8_fp8,triton_int8_fp16")
    parser.add_argument("--triton-cache", default=None, help="Triton's disk cache folder (default: a fresh one)")
    parser.add_argument("--keep-passes", action="store_true", help="use the disk cache of self-check passes")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for first_use_cost.json")
    args = parser.parse_args()
    # Both before Triton and the pack are imported: they read them once.
    os.environ["TRITON_CACHE_DIR"] = args.triton_cache or tempfile.mkdtemp(prefix="triton-cache-")
    if not args.keep_passes:
        os.environ["SAGE_RDNA4_SELF_CHECK_CACHE"] = "0"
    load_pack()
    import torch
    from triton import knobs

    from comfyui_sage_rdna4.kernels import first_use_costs, sage_attention
    from comfyui_sage_rdna4.kernels.registry import get_backend

    if not torch.cuda.is_available():
        sys.exit("first_use_cost.py: needs a GPU")
    b, h, n, d, dtype = SHAPES[args.shape]
    g = torch.Generator(device="cuda").manual_seed(0)

    def inputs():
        return [torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, dtype), generator=g) for _ in range(3)]

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    q, k, v = inputs()
    sdpa = [timed(lambda: torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))))
            for _ in range(2)]
    result = {"shape": args.shape, "call": f"B{b} H{h} N{n} D{d} {dtype}",
              "triton_cache": os.environ["TRITON_CACHE_DIR"], "sdpa_first_s": round(sdpa[0], 4),
              "sdpa_second_s": round(sdpa[1], 4), "kernels": {}}
    print(f"{result['call']}: SDPA first call {sdpa[0]:.3f} s, second {sdpa[1]:.4f} s")
    for name in [s for s in args.kernels.split(",") if s]:
        mark = first_use_costs.mark()
        with CompileCounter(knobs) as compiles:
            first = timed(lambda: sage_attention(q, k, v, tensor_layout="NHD", kernel=name))
            parts = first_use_costs.since(mark)
            in_checks = dict(compiles.count)
            second = timed(lambda: sage_attention(q, k, v, tensor_layout="NHD", kernel=name))
        checked = get_backend(name).verdicts.last_result
        warm = getattr(checked, "warm_up", None)
        entry = {"first_call_s": round(first, 3), "second_call_s": round(second, 4),
                 "parts": [{"part": p, "seconds": round(s, 3)} for p, s in parts],
                 "compiles": compiles.count, "compiles_in_first_call": sum(in_checks.values()),
                 "warm_up": None if warm is None else dict(vars(warm), seconds=round(warm.seconds, 3))}
        result["kernels"][name] = entry
        said = "no warm-up" if warm is None else (
            f"warm-up {warm.seconds:.2f} s for {warm.submitted} launches" + (f", stopped: {warm.error}"
                                                                              if warm.error else ""))
        print(f"{name}: first call {first:.2f} s ({first_use_costs.describe(parts)}; {said}); "
              f"{sum(compiles.count.values())} Triton compiles or cache loads "
              f"({', '.join(f'{k} {c}' for k, c in sorted(compiles.count.items()))}); second call {second:.4f} s")
    if args.out:
        path = os.path.join(args.out, "first_use_cost.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
