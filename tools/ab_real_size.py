"""The A/B benchmark's logic on a real-size Flux-shaped (and optionally Wan-shaped) ComfyUI model with random
weights, driven from a script instead of the node.

    COMFYUI_PATH=/path/to/ComfyUI python3 tools/ab_real_size.py --out DIR [--kernels reference,auto] [--steps 6]

Needs a GPU (--tiny: a CPU smoke test of this script with the tiny models). Writes DIR/<model>.json (every
kernel's report), DIR/<model>.txt and the first kernel's plot as PNG. The models come from tests/comfy_harness.py
(loaded by path: tests/ is not put on sys.path).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from pack_loader import load_harness, load_pack

harness = load_harness()


def save_png(image: torch.Tensor, path: Path) -> None:
    from PIL import Image

    arr = (image[0].clamp(0, 1) * 255).to(torch.uint8).cpu().numpy()
    Image.fromarray(arr).save(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default="reference,auto")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="flux", choices=["flux", "wan13b", "wan14b"])
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test of this script with the tiny models")
    ap.add_argument("--remeasure", action="store_true",
                    help="forget auto's in-step decisions before each kernel's run, so a second 'auto' measures "
                         "again with compilation and self-checks already done: its first step shows what "
                         "measuring alone costs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # The pack first, while ComfyUI is not importable: its __init__ then skips the node modules, whose
    # comfy_api import needs PyAV (absent on the GPU machine). sage_patch imports comfy only when used.
    load_pack()
    harness.comfy_import(cpu=args.tiny)
    from comfyui_sage_rdna4.kernels import tuner
    from comfyui_sage_rdna4.sage_patch.ab_benchmark import run_ab
    from comfyui_sage_rdna4.sage_patch.report import report_json

    t0 = time.time()
    if args.tiny:
        tiny = harness.FLUX_TINY if args.model == "flux" else harness.WAN_TINY
        model = harness.build_model("Flux" if args.model == "flux" else "WAN21_T2V", tiny, torch.float32)
        if args.model == "flux":
            positive, negative = harness.flux_conditioning(seed=1), harness.flux_conditioning(seed=2)
            latent, cfg_scale = harness.image_latent(16, 64, 64), 1.0
        else:
            positive, negative = harness.text_conditioning(32, 64, 1), harness.text_conditioning(32, 64, 2)
            latent, cfg_scale = harness.video_latent(5, 32, 32), 5.0
    elif args.model == "flux":
        model = harness.build_model("Flux", harness.FLUX_1MP, torch.bfloat16, seed=0, device="cuda")
        cfg = harness.FLUX_1MP
        positive = harness.flux_conditioning(512, cfg["context_in_dim"], cfg["vec_in_dim"], seed=1)
        negative = harness.flux_conditioning(512, cfg["context_in_dim"], cfg["vec_in_dim"], seed=2)
        latent = harness.image_latent(16, 1024, 1024)  # 64x64 patches = 4096 image tokens (+512 text)
        cfg_scale = 1.0  # Flux dev: guidance-distilled, one model evaluation per step
    else:
        size = harness.WAN_14B if args.model == "wan14b" else harness.WAN_13B
        model = harness.build_model("WAN21_T2V", size, torch.bfloat16, seed=0, device="cuda")
        positive = harness.text_conditioning(512, 4096, seed=1)
        negative = harness.text_conditioning(512, 4096, seed=2)
        latent = harness.video_latent(args.frames, 480, 832)
        cfg_scale = 5.0
    print(f"built {args.model} in {time.time() - t0:.1f} s; latent {list(latent['samples'].shape)}", flush=True)

    reports, texts = [], []
    for kernel in [k for k in args.kernels.split(",") if k]:
        t1 = time.time()
        if args.remeasure:
            tuner.default_tuner().clear()
        try:
            _, report, text, plot, path = run_ab(model, positive, negative, latent, seed=0, steps=args.steps,
                                                 cfg=cfg_scale, sampler_name="euler", scheduler="simple",
                                                 kernel=kernel, save_dir=tempfile.mkdtemp())
        except Exception as exc:  # report and go on with the next kernel
            text = f"kernel {kernel}: the A/B run failed: {type(exc).__name__}: {exc}"
            report, plot = {"kernel": kernel, "error": text}, None
        report["text"] = text
        reports.append(report)
        texts.append(text + f"\n[{kernel}: {time.time() - t1:.1f} s]\n")
        if plot is not None and not (out / f"{args.model}.png").exists():
            save_png(plot, out / f"{args.model}.png")
        print(texts[-1], flush=True)
        # One file per model, rewritten after each kernel so a run cut short still leaves its results.
        (out / f"{args.model}.json").write_text(report_json({"model": args.model, "reports": reports}))
        (out / f"{args.model}.txt").write_text("\n".join(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
