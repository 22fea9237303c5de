"""The patch inside ComfyUI's TorchCompileModel path on a real-size model with random weights: step times, first
steps, graph breaks and latent PSNR, eager and compiled, side by side in one process.

    COMFYUI_PATH=/path/to/ComfyUI python3 tools/compile_real_size.py --out DIR --model flux \
        --runs eager:sdpa,eager:auto,inductor:sdpa,inductor:auto,inductor:triton_int8_fp8 [--steps 6]

A run is MODE:KERNEL. MODE is `eager` or a torch.compile backend (`inductor`, `aot_eager`, `cudagraphs`), applied as
TorchCompileModel does (comfy_api.torch_helpers.set_torch_compile_wrapper); `inductor-ro` is inductor with
mode="reduce-overhead". KERNEL `sdpa` is the unpatched model (ComfyUI's own attention); any other is the Patch node's
kernel. Each run samples the same latent with the same seed. Per run: every step's wall time (the first holds
compilation, self-checks and auto's measuring), the median of the others, dynamo's graph breaks with their reasons,
the pack's stats, and latent PSNR against the `sdpa` run of the same MODE (and of eager). Writes DIR/<model>.json
after each run, so a run cut short keeps what finished. Needs a GPU (--tiny: a CPU smoke test with tiny models).
A cold first use needs a fresh process: run the eager and the compiled set as two invocations.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from pack_loader import load_harness, load_pack

harness = load_harness()


def build(args):
    """(model, positive, negative, latent, cfg) for --model at real size (or tiny on the CPU)."""
    if args.tiny:
        if args.model == "flux":
            model = harness.build_model("Flux", harness.FLUX_TINY, torch.float32)
            return (model, harness.flux_conditioning(seed=1), harness.flux_conditioning(seed=2),
                    harness.image_latent(16, 64, 64), 1.0)
        model = harness.build_model("WAN21_T2V", harness.WAN_TINY, torch.float32)
        return (model, harness.text_conditioning(32, 64, 1), harness.text_conditioning(32, 64, 2),
                harness.video_latent(5, 32, 32), 5.0)
    if args.model == "flux":
        cfg = dict(harness.FLUX_1MP)
        if args.depth:  # keep the double/single proportion of the released model (19 + 38)
            cfg.update(depth=max(1, args.depth // 3), depth_single_blocks=max(1, args.depth - args.depth // 3))
        model = harness.build_model("Flux", cfg, torch.bfloat16, seed=0, device="cuda")
        cond = [harness.flux_conditioning(512, cfg["context_in_dim"], cfg["vec_in_dim"], seed=s) for s in (1, 2)]
        return model, cond[0], cond[1], harness.image_latent(16, 1024, 1024), 1.0
    size = dict(harness.WAN_14B if args.model == "wan14b" else harness.WAN_13B)
    if args.depth:
        size["num_layers"] = args.depth
    model = harness.build_model("WAN21_T2V", size, torch.bfloat16, seed=0, device="cuda")
    cond = [harness.text_conditioning(512, 4096, seed=s) for s in (1, 2)]
    return model, cond[0], cond[1], harness.video_latent(args.frames, 480, 832), 5.0


def prepared(model, mode: str, kernel: str):
    """A clone of `model`, patched with `kernel` (unless sdpa) and compiled as TorchCompileModel does (unless eager).
    Returns (model, override or None)."""
    from comfyui_sage_rdna4.sage_patch.config import PatchConfig
    from comfyui_sage_rdna4.sage_patch.install import patch_model
    from comfyui_sage_rdna4.sage_patch.stats import PatchStats

    override = None
    m = model.clone()
    if kernel != "sdpa":
        m, override = patch_model(model, PatchConfig(kernel=kernel), PatchStats(f"sage_rdna4[{kernel}]"))
    if mode != "eager":
        from comfy_api.torch_helpers import set_torch_compile_wrapper

        backend, compile_mode = (("inductor", "reduce-overhead") if mode == "inductor-ro" else (mode, None))
        set_torch_compile_wrapper(m, backend=backend, mode=compile_mode)
    return m, override


def sample_timed(model, positive, negative, latent, cfg, steps, seed=0, profiler=None):
    """Sample; returns (latent samples, wall seconds of each step). The first step is timed from the call.
    `profiler` (started and stopped here) records the second step alone."""
    import comfy.sample

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    marks = []

    def on_step(step, x0, x, total):
        sync()
        marks.append(time.perf_counter())
        if profiler is not None and step in (0, 1):
            profiler.start() if step == 0 else profiler.stop()

    latent_image = comfy.sample.fix_empty_latent_channels(model, latent["samples"])
    noise = comfy.sample.prepare_noise(latent_image, seed, None)
    sync()
    start = time.perf_counter()
    out = comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent_image,
                              callback=on_step, disable_pbar=True, seed=seed)
    times = [b - a for a, b in zip([start] + marks[:-1], marks)]
    return out.float().cpu(), times


def psnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    from comfyui_sage_rdna4.kernels import metrics

    return float(metrics.psnr(out, ref))


def profile_step(m, positive, negative, latent, cfg, steps) -> dict:
    """The same sampling again with torch.profiler over its second step: the step's wall time, the GPU kernels'
    summed time (the difference is time the GPU waited), the top 12 kernels, and the host time inside the pack's
    op, to place a compiled step's difference."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    _, times = sample_timed(m, positive, negative, latent, cfg, max(steps, 2), profiler=prof)
    if os.environ.get("OUT"):  # the whole step, to see where the GPU waits (chrome://tracing, Perfetto)
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"trace_{len(os.listdir(os.environ['OUT']))}.json"))
    events = prof.key_averages()
    gpu = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    ours = [e for e in events if e.key.startswith("sage_rdna4::")]
    return {"step_wall_ms": times[1] * 1e3, "gpu_total_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "top_gpu": [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3)) for e in gpu[:30]],
            "op_host_ms": [(e.key, e.count, round(e.cpu_time_total / 1e3, 3)) for e in ours]}


def one_run(model, positive, negative, latent, cfg, steps, mode, kernel, profiled=False):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m, override = prepared(model, mode, kernel)
    samples, times = sample_timed(m, positive, negative, latent, cfg, steps)
    breaks = {str(reason)[:200]: n for reason, n in counters["graph_break"].items()}
    row = {"mode": mode, "kernel": kernel, "step_s": times, "first_step_s": times[0],
           "median_step_s": statistics.median(times[1:]) if len(times) > 1 else None,
           "graph_breaks": sum(breaks.values()), "graph_break_reasons": breaks,
           "unique_graphs": int(counters["stats"].get("unique_graphs", 0))}
    if profiled:
        row["profile"] = profile_step(m, positive, negative, latent, cfg, steps)
    if override is not None:
        snap = override.stats.snapshot()
        row["stats"] = {k: snap.get(k) for k in ("calls", "fallbacks", "routed", "passed_over", "auto_choices",
                                                 "auto_decisions")}
        from comfyui_sage_rdna4.sage_patch.timing import step_timer_of

        last = step_timer_of(override).last_run
        row["first_use"] = list(last.first_use) if last is not None else None
    return row, samples


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="flux", choices=["flux", "wan13b", "wan14b"])
    ap.add_argument("--runs", default="eager:sdpa,eager:triton_int8_fp8,inductor:sdpa,inductor:triton_int8_fp8,"
                                      "inductor:auto")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--depth", type=int, default=0, help="cut the model to this many blocks (0: as released)")
    ap.add_argument("--profile", action="store_true", help="profile one more step of each run")
    ap.add_argument("--tag", default="", help="suffix of the output file name (two invocations, one model)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_pack()
    harness.comfy_import(cpu=args.tiny)

    t0 = time.time()
    model, positive, negative, latent, cfg = build(args)
    depth = args.depth or "as released"
    print(f"built {args.model} (depth {depth}) in {time.time() - t0:.1f} s; latent {list(latent['samples'].shape)}",
          flush=True)
    rows, latents = [], {}
    path = out / f"{args.model}{args.tag}.json"
    for spec in [r for r in args.runs.split(",") if r]:
        mode, kernel = spec.split(":")
        t1 = time.time()
        try:
            row, samples = one_run(model, positive, negative, latent, cfg, args.steps, mode, kernel,
                                   args.profile)
            latents[(mode, kernel)] = samples
            refs = [mode, "eager"] if kernel != "sdpa" else ["eager"] if mode != "eager" else []
            for ref_mode in dict.fromkeys(refs):
                if (ref_mode, "sdpa") in latents:
                    row[f"latent_psnr_vs_{ref_mode}_sdpa_db"] = psnr(latents[(ref_mode, "sdpa")], samples)
        except Exception as exc:  # report the failure and go on with the next run
            row = {"mode": mode, "kernel": kernel, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()[-3000:]}
        row["wall_s"] = round(time.time() - t1, 1)
        rows.append(row)
        brief = {k: row.get(k) for k in ("first_step_s", "median_step_s", "graph_breaks", "error")}
        print(f"{mode}:{kernel} {json.dumps(brief)} [{row['wall_s']} s]", flush=True)
        path.write_text(json.dumps({"model": args.model, "steps": args.steps, "rows": rows}, indent=1, default=str))
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
