"""Per-call cost of the ComfyUI override itself (binding, layout views, call description, rule checks).

Times ComfyUI-style SDPA called directly against the same call routed through the override with
kernel="sdpa" (same math underneath), median of many calls, on small shapes where overhead shows.

    python tools/override_overhead.py [--device cuda] [--calls 2000]
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)


def load_pack():
    """The repo as package `comfyui_sage_rdna4`, through benchmark.py's loader (loaded by path)."""
    spec = importlib.util.spec_from_file_location("_sage_rdna4_entry", os.path.join(ROOT, "benchmark.py"))
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    return entry.load_pack()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    load_pack()
    import torch
    from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride

    def site_sdpa(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                  **kwargs):
        b, n, hd = q.shape
        qh, kh, vh = (t.view(b, -1, heads, hd // heads).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
        return out.transpose(1, 2).reshape(b, n, hd)

    torch.set_num_threads(1)  # steadier CPU timings; the overhead is host-side Python anyway
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for n in (16, 256):
        q = torch.randn(1, n, 4 * 64, device=device)
        override = SageAttentionOverride(PatchConfig(kernel="sdpa"))
        opts = {"optimized_attention_override": override}

        def direct():
            return site_sdpa(q, q, q, 4, transformer_options=opts, _inside_attn_wrapper=True)

        def routed():
            return override(site_sdpa, q, q, q, 4, transformer_options=opts, _inside_attn_wrapper=True)

        def per_call_us(fn):
            samples = []
            for _ in range(3):
                for _ in range(50):
                    fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(args.calls // 3):
                    fn()
                sync()
                samples.append((time.perf_counter() - t0) / (args.calls // 3) * 1e6)
            return statistics.median(samples)

        pairs = [(per_call_us(direct), per_call_us(routed)) for _ in range(3)]  # interleaved against drift
        d = statistics.median(p[0] for p in pairs)
        r = statistics.median(p[1] for p in pairs)
        assert sum(override.stats.snapshot()["calls"].values()) > 0
        print(f"N={n:5d} {device.type}: direct SDPA {d:8.1f} us/call, through the override {r:8.1f} us/call, "
              f"overhead {r - d:7.1f} us/call")


if __name__ == "__main__":
    main()
