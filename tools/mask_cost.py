"""What a key-only mask costs the Triton kernels on this GPU: masked against unmasked calls of the same shape.

    python tools/mask_cost.py [--shapes hunyuan_544p,hunyuan_720p] [--reps 20] [--json OUT.json]

Shapes are HunyuanVideo-like self-attention (B1, H24, D128, bf16): image tokens plus 256 text tokens, the last
`--pad` of them padding. Per backend, in turn within each repeat (so clock drift hits all alike): no mask; an
additive bf16 mask (1, 1, N) with -finfo.max on the padding (HunyuanVideo's, after ComfyUI's unsqueeze); a bool
mask (1, 1, 1, N); both masks again with attention.PLAIN_MASK_ROWS on (their plain padding rows take the unmasked key
loop: the setting this tool decides); the padding cut (the kept keys alone, unmasked: what the Patch node runs for
such a mask from its second call in a model evaluation, kernels/padding_masks.py); and SDPA with the additive mask
(what the call ran on before). Device time by CUDA events over BACK_TO_BACK calls in a row, median of the
repeats; the ratio masked / unmasked is the figure (target: within 1.05). Also the time of the mask's preparation
alone (its one launch), and each output's rel L1 against SDPA with the same mask.
Writes JSON to --json, or to $OUT/mask_cost.json where $OUT is set."""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from pack_loader import load_pack

# Calls timed per event pair, back to back: a lone call's events also time the host's work before its first launch,
# which a model's queue hides (docs/MEASUREMENTS.md, "The padding cut at 544p, explained").
BACK_TO_BACK = 5

# name: (image tokens, text tokens)
SHAPES = {"hunyuan_544p": (4096, 256), "hunyuan_720p": (16 * 1024, 256), "hunyuan_small": (1024, 256)}


def cuda_time(fn, reps_inner: int = 1) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps_inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps_inner * 1e3  # microseconds


def rel_l1(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().sum() / b.abs().sum().clamp_min(1e-30))


def print_profile(title: str, calls: dict, reps: int = 5) -> None:
    """Device kernels and host time of each call, apart: which launches differ between two calls."""
    from torch.profiler import ProfilerActivity, profile
    for label, fn in calls.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        print(f"--- profile {title} {label} ({reps} calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


def main(argv=None) -> int:
    pack = load_pack()
    from importlib import import_module
    api = import_module(f"{pack.__name__}.kernels.api")
    masks = import_module(f"{pack.__name__}.kernels.backends.triton.masks")
    attention = import_module(f"{pack.__name__}.kernels.backends.triton.attention")

    def with_plain_rows(fn):
        """fn with attention.PLAIN_MASK_ROWS on (plain padding rows take the unmasked loop), as shipped after it."""
        def run():
            attention.PLAIN_MASK_ROWS = True
            attention.attention_launch.cache_clear()
            try:
                return fn()
            finally:
                attention.PLAIN_MASK_ROWS = False
                attention.attention_launch.cache_clear()
        return run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="hunyuan_544p,hunyuan_720p")
    parser.add_argument("--backends", default="triton_int8_fp8,triton_int8_fp16")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--pad", type=int, default=200, help="padding keys among the text tokens")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also print the torch profiler's kernel table for the unmasked and the cut call")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mask_cost: needs a CUDA or ROCm GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "reps": args.reps,
              "shapes": {}}
    g = torch.Generator(device=dev).manual_seed(0)
    for name in args.shapes.split(","):
        img, txt = SHAPES[name]
        n = img + txt
        q, k, v = (torch.randn(1, args.heads, n, 128, device=dev, dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        additive = torch.zeros(1, 1, n, device=dev, dtype=torch.bfloat16)
        additive[..., n - args.pad:] = -torch.finfo(torch.bfloat16).max
        additive = additive.unsqueeze(1)  # ComfyUI's 3-D -> (1, 1, 1, N)
        keep = additive == 0
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive)  # noqa: E731
        want = sdpa()
        entry = {"n": n, "padding": args.pad, "backends": {}}
        # The mask's preparation alone (one launch: bias, key end, live keys), per call, as the backend does it.
        prep = lambda: masks.key_mask_operands(additive, 1, args.heads, args.heads, n)  # noqa: E731
        for _ in range(3):
            prep()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            prep()
        torch.cuda.synchronize()
        entry["mask_prep_us"] = (time.perf_counter() - t0) / 100 * 1e6
        for backend in args.backends.split(","):
            calls = {
                "unmasked": lambda: api.sage_attention(q, k, v, kernel=backend),
                "additive": lambda: api.sage_attention(q, k, v, kernel=backend, attn_mask=additive),
                "bool": lambda: api.sage_attention(q, k, v, kernel=backend, attn_mask=keep),
                "sdpa_additive": sdpa,
                # What the Patch node runs for this mask from its second call in a model evaluation on
                # (kernels/padding_masks.py): the kept keys alone, unmasked.
                "padding_cut": lambda: api.sage_attention(q, k[:, :, :n - args.pad], v[:, :, :n - args.pad],
                                                          kernel=backend),
            }
            calls["additive_plain_rows"] = with_plain_rows(calls["additive"])
            calls["bool_plain_rows"] = with_plain_rows(calls["bool"])
            accuracy = {label: rel_l1(fn(), want) for label, fn in calls.items() if label != "unmasked"}
            times = {label: [] for label in calls}
            for _ in range(2):  # warm-up: compiles, self-checks, workspaces
                for fn in calls.values():
                    fn()
            torch.cuda.synchronize()
            for _ in range(args.reps):
                for label, fn in calls.items():
                    times[label].append(cuda_time(fn, BACK_TO_BACK))
            med = {label: statistics.median(ts) for label, ts in times.items()}
            if args.profile:
                print_profile(f"{name} {backend}", {k: calls[k] for k in ("unmasked", "padding_cut")})
            entry["backends"][backend] = {
                "median_us": med,
                "additive_vs_unmasked": med["additive"] / med["unmasked"],
                "bool_vs_unmasked": med["bool"] / med["unmasked"],
                "additive_vs_sdpa": med["additive"] / med["sdpa_additive"],
                "additive_plain_rows_vs_unmasked": med["additive_plain_rows"] / med["unmasked"],
                "bool_plain_rows_vs_unmasked": med["bool_plain_rows"] / med["unmasked"],
                "padding_cut_vs_unmasked": med["padding_cut"] / med["unmasked"],
                "rel_l1_vs_sdpa": accuracy,
            }
            print(f"{name} N{n} {backend}: unmasked {med['unmasked']:.1f} us, additive {med['additive']:.1f} "
                  f"(x{med['additive'] / med['unmasked']:.3f}), bool {med['bool']:.1f} "
                  f"(x{med['bool'] / med['unmasked']:.3f}), with plain rows: additive "
                  f"x{med['additive_plain_rows'] / med['unmasked']:.3f}, "
                  f"bool x{med['bool_plain_rows'] / med['unmasked']:.3f}; padding cut "
                  f"x{med['padding_cut'] / med['unmasked']:.3f} (rel L1 {accuracy['padding_cut']:.4f}); "
                  f"SDPA masked {med['sdpa_additive']:.1f}; rel L1 vs SDPA {accuracy['additive']:.4f} "
                  f"(plain rows {accuracy['additive_plain_rows']:.4f})")
        print(f"{name}: mask preparation {entry['mask_prep_us']:.1f} us per call (100 in a row, synchronized)")
        result["shapes"][name] = entry
    path = args.json or (os.path.join(os.environ["OUT"], "mask_cost.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
