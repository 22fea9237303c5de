"""A/B benchmark: sample twice with the same seed, the model as without this patch vs patched, and compare.

Run A is the baseline a user has without the patch: every attention call goes to the model's own attention (in
ComfyUI the one it chose at start-up, e.g. PyTorch SDPA or sub-quadratic, or another override that was on the
model), through an override that only times it; the report names it (`baseline`, `baseline_name`).
Run B is the patch's own config. That is also what `auto` runs when it keeps exact
attention, so a run where `auto` kept it differs from the baseline only by noise and the patch's host time.
Both have attention timing on. The first step of each run is the warm-up: it is timed and
shown but left out of the totals; the per-call accuracy samples are taken in that step too, so the
copies they need never touch a measured step. The JSON report is saved under ComfyUI's output folder.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
from typing import Callable, List, Optional

import torch

from ..kernels import metrics
from ..kernels.accuracy_flags import flag_level
from ..kernels.reference import exact_attention
from ..kernels.self_check import BOUNDS
from .config import PatchConfig
from .install import OVERRIDE_KEY, find_override, patch_model
from .layouts import bind_attention_args, expand_mask, to_hnd
from .report import baseline_label, format_report_text, plot_step_times, report_json, summarize_steps, timing_caveat
from .stats import PatchStats
from .timing import step_timer_of

WARMUP_STEPS = 1
ACCURACY_SAMPLES = 4
FROM_PATCH = "from patch node"

log = logging.getLogger("sage_rdna4")

# ComfyUI's attention functions (comfy/ldm/modules/attention.py) by the name of the one it chose at start-up.
ATTENTION_NAMES = {"attention_pytorch": "PyTorch SDPA", "attention_sub_quad": "sub-quadratic",
                   "attention_split": "split", "attention_xformers": "xformers", "attention_sage": "SageAttention",
                   "attention_flash": "FlashAttention", "attention_basic": "basic"}


def comfy_attention_name() -> Optional[str]:
    """The attention ComfyUI chose at start-up (what the model's attention calls run without a patch), or None
    where ComfyUI is not importable or names it in a way this does not know."""
    try:
        from comfy.ldm.modules import attention
    except ImportError:
        return None
    name = getattr(getattr(attention, "optimized_attention", None), "__name__", None)
    return ATTENTION_NAMES.get(name) if isinstance(name, str) else None


class AccuracyProbe:
    """Stands in front of an override for one run; keeps copies of a few calls of one step.

    Calls are sampled at positions 0, 1, 3, 7, 15, ... within the step, which spreads them over the
    model's blocks without knowing their number in advance."""

    def __init__(self, override, step_index: int, max_samples: int):
        self.override = override
        self.step_index = step_index
        self.max_samples = max_samples
        self.samples: List[dict] = []
        self._step_seen = -1
        self._call_in_step = 0

    def __deepcopy__(self, memo):
        return self

    def _current_step(self) -> int:
        timer = step_timer_of(self.override)
        return timer.current_step if timer is not None else -1

    def __call__(self, func, *args, **kwargs):
        step = self._current_step()
        if step != self._step_seen:
            self._step_seen, self._call_in_step = step, 0
        n = self._call_in_step
        self._call_in_step += 1
        wanted = (step == self.step_index and len(self.samples) < self.max_samples and ((n + 1) & n) == 0)
        if not wanted:
            return self.override(func, *args, **kwargs)
        before = self.override.stats.snapshot()
        out = self.override(func, *args, **kwargs)
        after = self.override.stats.snapshot()
        self.samples.append(_capture(args, kwargs, out, step, n, _who_ran(before, after)))
        return out


def _who_ran(before: dict, after: dict) -> str:
    for name, count in after["calls"].items():
        if count > before["calls"].get(name, 0):
            return name
    for kind, label in (("fallbacks", "fallback"), ("routed", "exact by policy")):
        for reason, count in after[kind].items():
            if count > before[kind].get(reason, 0):
                return f"{label}: {reason}"
    return "unknown"


def _capture(args, kwargs, out, step: int, call: int, backend: str) -> dict:
    a = bind_attention_args(args, kwargs)
    q, k, v = to_hnd(a.q, a.k, a.v, a.heads, a.skip_reshape)
    if a.skip_output_reshape:
        o = out
    else:
        b, n = out.shape[0], out.shape[1]
        o = out.view(b, n, q.shape[1], -1).transpose(1, 2)
    scale = kwargs.get("scale")
    return {"step": step, "call": call, "backend": backend, "q": q.detach().clone(), "k": k.detach().clone(),
            "v": v.detach().clone(), "out": o.detach().clone(), "mask": expand_mask(a.mask),
            "sm_scale": float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])}


def attention_accuracy(samples: List[dict]) -> List[dict]:
    """Cosine and relative L1 of each sampled call's output against exact FP32 attention, and whether the
    call is flagged: rel L1 above the level of the kernel that ran it (`kernels.self_check.flag_level`)."""
    rows = []
    for s in samples:
        exact, _ = exact_attention(s["q"], s["k"], s["v"], sm_scale=s["sm_scale"], attn_mask=s["mask"])
        b, h, nq, d = s["q"].shape
        rel_l1 = metrics.rel_l1(s["out"], exact)
        level = flag_level(s["backend"])
        rows.append({"step": s["step"], "call": s["call"], "backend": s["backend"],
                     "shape": f"B{b} H{h} Nq{nq} Nk{s['k'].shape[2]} D{d}",
                     "cosine": metrics.cosine(s["out"], exact), "rel_l1": rel_l1,
                     "flag_rel_l1": level, "flagged": not rel_l1 <= level})  # NaN is flagged too
    return rows


def accuracy_flags(rows: List[dict]) -> List[str]:
    """One warning per flagged sampled call, each also logged (the console)."""
    probe = BOUNDS["probe"].max_rel_l1
    messages = []
    for a in rows:
        if not a.get("flagged"):
            continue
        msg = (f"attention call {a['call']} of step {a['step']} ({a['shape']}) ran {a['backend']}: rel L1 "
               f"{a['rel_l1']:.4f} against exact FP32 exceeds {a['flag_rel_l1']}, the most a kernel that passes "
               f"its self-check should show on a real call (its precision probe must stay within {probe}); the "
               f"result may be visibly damaged: compare with an FP16 P.V kernel or sdpa")
        log.warning("[sage_rdna4 A/B] %s", msg)
        messages.append(msg)
    return messages


def fidelity(sdpa_latent: torch.Tensor, patched_latent: torch.Tensor, sdpa_image=None, patched_image=None) -> dict:
    """Patched result against the baseline's (`sdpa_*`: the own-attention run): latent PSNR (peak = the baseline
    latent's range) and cosine;
    image PSNR with peak 1 when both decoded images are given."""
    out = {"latent_psnr_db": metrics.psnr(patched_latent, sdpa_latent),
           "latent_cosine": metrics.cosine(patched_latent, sdpa_latent), "image_psnr_db": None}
    if sdpa_image is not None and patched_image is not None:
        out["image_psnr_db"] = metrics.psnr(patched_image.clamp(0, 1), sdpa_image.clamp(0, 1), peak=1.0)
    return out


def _sample(model, latent: dict, seed, steps, cfg, sampler_name, scheduler, positive, negative, on_step):
    import comfy.sample

    latent_image = comfy.sample.fix_empty_latent_channels(model, latent["samples"])
    noise = comfy.sample.prepare_noise(latent_image, seed, latent.get("batch_index"))
    return comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                               noise_mask=latent.get("noise_mask"), callback=on_step, disable_pbar=True, seed=seed)


def patched_config(model, kernel: Optional[str]) -> PatchConfig:
    """The config of run B: the Patch node's (if the model went through it), the kernel optionally replaced."""
    found = find_override(model)
    config = found.config if found is not None else PatchConfig()
    if kernel and kernel != FROM_PATCH:
        config = dataclasses.replace(config, kernel=kernel)
    return dataclasses.replace(config, time_attention=True)


def run_ab(model, positive, negative, latent: dict, seed: int, steps: int, cfg: float, sampler_name: str,
           scheduler: str, vae=None, kernel: Optional[str] = None, accuracy_samples: int = ACCURACY_SAMPLES,
           progress: Optional[Callable[[int, int], None]] = None, save_dir: Optional[str] = None):
    """Run the A/B comparison. Returns (patched LATENT dict, report dict, report text, plot IMAGE, json path);
    the path is None when the report could not be saved (the reason is in the report's "save_error")."""
    config = patched_config(model, kernel)
    baseline = PatchConfig(kernel="sdpa", time_attention=True)
    sdpa_model, sdpa_override = patch_model(model, baseline, PatchStats("sage_rdna4[A/B baseline]"), baseline=True)
    ab_model, ab_override = patch_model(model, config, PatchStats(f"sage_rdna4[{config.kernel}] (A/B)"))
    probe = AccuracyProbe(ab_override, step_index=0, max_samples=accuracy_samples)
    ab_model.model_options["transformer_options"][OVERRIDE_KEY] = probe

    own = comfy_attention_name()
    total = 2 * steps

    def step_callback(offset):
        def on_step(step, x0, x, total_steps):
            if progress is not None:
                progress(offset + step + 1, total)
        return on_step

    sdpa_samples = _sample(sdpa_model, latent, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                           step_callback(0))
    patched_samples = _sample(ab_model, latent, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                              step_callback(steps))
    run_a, run_b = step_timer_of(sdpa_override).last_run, step_timer_of(ab_override).last_run

    images = (None, None)
    if vae is not None:
        images = (vae.decode(sdpa_samples), vae.decode(patched_samples))
    summary = summarize_steps([s.as_dict() for s in run_a.steps], [s.as_dict() for s in run_b.steps], WARMUP_STEPS)
    device = getattr(model, "load_device", None)
    accuracy = attention_accuracy(probe.samples)
    caveat = timing_caveat(device)
    report = {
        "kind": "sage_rdna4 A/B benchmark",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kernel": config.kernel,
        "baseline": "the model's own attention, as without this patch" + (f" ({own}, ComfyUI's choice)" if own
                                                                           else ""),
        "baseline_name": own,
        "config": dataclasses.asdict(config),
        "model": type(getattr(model, "model", model)).__name__,
        "device": _device_name(device), "clock": run_b.clock,
        "cpu_run": caveat is not None, "timing_caveat": caveat,
        "latent_shape": list(latent["samples"].shape), "steps": steps, "cfg": cfg, "seed": seed,
        "sampler": sampler_name, "scheduler": scheduler,
        "ratio_definition": "patched time / own attention's time per step (below 1 is faster); speed-up = own / "
                            "patched; the keys named sdpa_* hold the own-attention run",
        "warmup_note": f"the first {WARMUP_STEPS} step(s) of each run are warm-up: shown, excluded from totals; "
                       "attention accuracy samples are taken there",
        **summary,
        "run_total_ms": {"sdpa": run_a.total_ms, "patched": run_b.total_ms},
        "fidelity": fidelity(sdpa_samples, patched_samples, *images),
        "attention_accuracy": accuracy,
        "accuracy_flags": accuracy_flags(accuracy),
        "calls": {"patched": run_b.calls, "sdpa": run_a.calls},
        "fallbacks": run_b.fallbacks, "routed": run_b.routed, "passed_over": run_b.passed_over,
        "sdpa_fallbacks": run_a.fallbacks,
        "first_use": [{"part": part, "seconds": seconds} for part, seconds in run_b.first_use],
        "notes": ab_override.stats.snapshot()["notes"],
        "auto_choices": ab_override.stats.snapshot()["auto_choices"],
        "auto_decisions": ab_override.stats.snapshot()["auto_decisions"],
    }
    path = None
    try:
        path = save_report(report, save_dir)
    except OSError as exc:  # an unwritable output folder must not cost the two sampling runs just made
        report["save_error"] = f"report not saved: {type(exc).__name__}: {exc}"
        log.warning("[sage_rdna4 A/B] %s", report["save_error"])
    report["json_path"] = path
    text = format_report_text(report)
    plot = plot_step_times(summary["per_step"], title=f"time per step: {baseline_label(report)} vs {config.kernel}"
                                                      + (" (CPU: not speed claims)" if caveat else ""),
                           baseline=baseline_label(report))
    out = dict(latent)
    out["samples"] = patched_samples
    return out, report, text, plot, path


def _device_name(device) -> str:
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        arch = props.gcnArchName if torch.version.hip else f"sm_{props.major}{props.minor}"
        return f"{props.name} ({arch})"
    return str(device) if device is not None else "unknown"


def save_report(report: dict, save_dir: Optional[str] = None) -> str:
    """Write the JSON under ComfyUI's output directory (sage_rdna4/ab_<time>.json); returns the path."""
    if save_dir is None:
        import folder_paths
        save_dir = os.path.join(folder_paths.get_output_directory(), "sage_rdna4")
    os.makedirs(save_dir, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    path = os.path.join(save_dir, f"ab_{stamp}.json")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(report_json(report))
    return path


def load_report(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)
