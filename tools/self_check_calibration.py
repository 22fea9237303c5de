"""What the spec (the torch reference backend) reaches on each self-check case in every variant, and what planted
faults reach: the figures the self-check's bounds (kernels/self_check.py) are calibrated from.

For every qk_group x smooth_k x smooth_v (the prologue changes nothing in the spec) it runs every case of
DEFAULT_CASES through `backend_attention(reference backend, variant)` and prints, per case, the worst of each
figure the self-check judges: rel L1 (per query block or per (batch, head)), cosine, rel L1 of one query row,
|gain - 1| per (batch, head) and, on the LSE case, the LSE's max error and |mean error|. Then the worst per case
over the variants (accurate: per-token INT8 with smooth_k; weak: every other).

    python tools/self_check_calibration.py [--variants token-on-off,...] [--p-tile 64] [--pv fp16]
    python tools/self_check_calibration.py --backend triton_int8_fp8 --device cuda   # a kernel on a GPU

`--p-tile N` / `--pv fp16` run the spec on the kernels' own P grid (each tile of N keys' max) or with FP16 P.V.

Figures: docs/VERIFICATION.md#the-first-use-self-check
"""
import argparse
import itertools
import time

from pack_loader import load_pack

FIGURES = ("worst_rel_l1", "worst_cosine", "worst_row_rel_l1", "gain_error", "lse_error", "lse_bias")


def variants(sc):
    from comfyui_sage_rdna4.kernels.call_spec import QK_GROUPS
    for group, smooth_k, smooth_v in itertools.product(QK_GROUPS, (True, False), (False, True)):
        yield sc.Variant("auto", group, smooth_k, smooth_v)


def short(variant) -> str:
    return f"{variant.qk_group}-{'on' if variant.smooth_k else 'off'}-{'on' if variant.smooth_v else 'off'}"


def fmt(x) -> str:
    return "-" if x is None or x != x else f"{x:.5f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="", help="comma-separated qkgroup-smoothk-smoothv (default: all 16)")
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--p-tile", type=int, default=None, help="the spec's FP8 P tops per tile of this many keys")
    parser.add_argument("--pv", default="fp8", help="the spec's P.V precision (fp8 or fp16)")
    args = parser.parse_args()
    load_pack()
    import importlib

    import torch

    from comfyui_sage_rdna4.kernels.registry import get_backend
    sc = importlib.import_module("comfyui_sage_rdna4.kernels.self_check")
    torch.manual_seed(0)
    backend = get_backend(args.backend)
    if args.backend == "reference" and (args.p_tile or args.pv != "fp8"):
        from comfyui_sage_rdna4.kernels.backends import reference as reference_module
        from comfyui_sage_rdna4.kernels.reference import reference_attention

        def on_grid(*a, **kw):
            return reference_attention(*a, **dict(kw, pv=args.pv, p_tile=args.p_tile))
        reference_module.reference_attention = on_grid
    wanted = set(filter(None, args.variants.split(",")))
    from comfyui_sage_rdna4.kernels.call_spec import describe_call
    t = torch.empty(1, 1, 1, 64, device=args.device)
    like = describe_call(t, t, t)  # the device facts of the cases' calls
    if backend.unavailable(like.device_type, like.device_index):
        raise SystemExit(f"{args.backend}: {backend.unavailable(like.device_type, like.device_index)}")
    worst = {}
    print("variant            case               " + " ".join(f"{f:>16}" for f in FIGURES) + "  seconds")
    for variant in variants(sc):
        if wanted and short(variant) not in wanted:
            continue
        attention = sc.backend_attention(backend, variant)
        bounds = sc.bounds_for(variant)
        t0 = time.perf_counter()
        device = torch.device(args.device)
        accepts = (lambda c: True) if args.backend == "reference" else (
            lambda c, v=variant: backend.refuse(sc.case_call(c, like, v)) is None)
        result = sc.run_self_check(attention, device, sc.DEFAULT_CASES, accepts=accepts, stop_at_first=False,
                                   variant=variant)
        for r in result.results:
            figs = [getattr(r, f) for f in FIGURES]
            print(f"{short(variant):18} {r.case.name:18} " + " ".join(f"{fmt(x):>16}" for x in figs)
                  + f"  {r.seconds:.2f}" + ("" if r.reason is None else f"  FAILS: {r.reason}"))
            w = worst.setdefault((r.case.name, variant.accurate), {})
            for f, x in zip(FIGURES, figs):
                if x is None or x != x:
                    continue
                better_low = f != "worst_cosine"
                w[f] = max(w.get(f, x), x) if better_low else min(w.get(f, x), x)
        print(f"{short(variant)}: {len(result.results)} cases in {time.perf_counter() - t0:.2f} s, "
              f"{'passed' if result.passed else 'FAILED'}; bounds {bounds}")
    print("\nworst per case (accurate = token with smooth_k on; weak = every other variant):")
    for (name, accurate), w in sorted(worst.items()):
        print(f"{name:18} {'accurate' if accurate else 'weak':8} " + " ".join(f"{f} {fmt(w.get(f))}" for f in FIGURES))


if __name__ == "__main__":
    main()
