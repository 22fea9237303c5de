"""Per-call cost of the ComfyUI override itself (binding, layout views, call description, rule checks).

Times ComfyUI-style SDPA called directly against the same call routed through the override with
kernel="sdpa" (same math underneath), in alternating short batches, on small shapes where overhead shows.
On the CPU the figure includes the SDPA backend's finiteness check (CPU only: torch's CPU SDPA hides
NaN inputs), which a GPU never runs.

    python tools/override_overhead.py [--device cuda] [--calls 2000] [--masks]

--masks: 2 x 64 queries against 128 keys instead, with no mask, a key mask padding the keys' end (LTX-Video's kind:
the padding cut narrows K and V) and one whose kept keys are not a prefix (Lumina 2's: a gather), a model evaluation
ending every 8 calls (each mask is read once per evaluation).

Figures: docs/MEASUREMENTS.md#override-overhead
"""
import argparse
import statistics
import time

from pack_loader import load_pack


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--masks", action="store_true", help="masked calls (see the module's text)")
    args = parser.parse_args()
    load_pack()
    import torch

    from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride

    def site_sdpa(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                  **kwargs):
        b, n, hd = q.shape
        qh, kh, vh = (t.view(b, -1, heads, hd // heads).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, hd)

    torch.set_num_threads(1)  # steadier CPU timings; the overhead is host-side Python anyway
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cases = masked_cases(torch, device) if args.masks else [
        (f"N={n:5d}", torch.randn(1, n, 4 * 64, device=device), None, None) for n in (16, 256)]
    for label, q, k, mask in cases:
        k = q if k is None else k
        override = SageAttentionOverride(PatchConfig(kernel="sdpa"))
        opts = {"optimized_attention_override": override}
        kw = dict(mask=mask, transformer_options=opts, _inside_attn_wrapper=True)

        def direct():
            return site_sdpa(q, k, k, 4, **kw)

        def routed():
            return override(site_sdpa, q, k, k, 4, **kw)

        def per_call_us(fn, calls):
            for _ in range(10):
                fn()
            sync()
            t0 = time.perf_counter()
            for i in range(calls):
                fn()
                if args.masks and i % EVALUATION_CALLS == EVALUATION_CALLS - 1:
                    override.step_boundary()  # a model evaluation ends: its masks are read again in the next
            sync()
            return (time.perf_counter() - t0) / calls * 1e6

        # Short batches, direct and routed in turn: each round's difference sees the same load, so a busy
        # shared host (other jobs on its cores) moves both sides of it; the median round is reported, and the
        # quietest batches (min: interference only ever adds time) beside it.
        rounds, batch = 60, max(1, args.calls // 20)  # 3 x --calls calls of each, as before
        direct_us, routed_us = [], []
        for _ in range(rounds):
            direct_us.append(per_call_us(direct, batch))
            routed_us.append(per_call_us(routed, batch))
        overhead = statistics.median(r - d for d, r in zip(direct_us, routed_us))
        assert sum(override.stats.snapshot()["calls"].values()) > 0
        print(f"{label} {device.type}: direct SDPA {statistics.median(direct_us):8.1f} us/call, through the override "
              f"{statistics.median(routed_us):8.1f} us/call, overhead {overhead:7.1f} us/call "
              f"(quietest batches: {min(routed_us) - min(direct_us):6.1f})")


EVALUATION_CALLS = 8  # calls per model evaluation in --masks (the padding cut reads each mask once per evaluation)


def masked_cases(torch, device):
    """(label, q, k, mask) with no mask, a padded end of the keys, and kept keys that are not a prefix."""
    q, k = torch.randn(2, 64, 4 * 64, device=device), torch.randn(2, 128, 4 * 64, device=device)
    prefix, scattered = torch.zeros(128, dtype=torch.bool), torch.zeros(128, dtype=torch.bool)
    prefix[:100] = True
    scattered[:50] = True
    scattered[80:] = True
    cases = [("no mask", q, k, None)]
    for label, keep in (("padded end", prefix), ("kept keys not a prefix", scattered)):
        mask = torch.zeros(2, 1, 1, 128, device=device)
        mask[..., ~keep.to(device)] = -torch.finfo(torch.float32).max
        cases.append((label, q, k, mask))
    return cases


if __name__ == "__main__":
    main()
