"""Node "Sage Attention Benchmark (RDNA4)": same seed, the model's own attention vs the patched one, compared."""
from __future__ import annotations

import logging

import comfy.samplers
import comfy.utils
from comfy_api.latest import io

from ..sage_patch.ab_benchmark import FROM_PATCH, patched_config, run_ab
from ..sage_patch.config import KERNEL_CHOICES as PATCH_KERNELS
from ..sage_patch.report import report_json
from .inputs import choice, number, queue_time_error

log = logging.getLogger("sage_rdna4")
DISPLAY_NAME = "Sage Attention Benchmark (RDNA4)"
KERNEL_CHOICES = [FROM_PATCH, *[n for n in PATCH_KERNELS if n != "sdpa"]]


def check_inputs(kernel=None, sampler_name=None, scheduler=None, steps=None, seed=None, cfg=None,
                 linked=True) -> None:
    """ValueError naming the input. With `linked`, at queue time, None (an input a link feeds) is not checked."""
    def known(value):
        return not (linked and value is None)
    for name, value, options in (("kernel", kernel, KERNEL_CHOICES),
                                 ("sampler_name", sampler_name, comfy.samplers.SAMPLER_NAMES),
                                 ("scheduler", scheduler, comfy.samplers.SCHEDULER_NAMES)):
        if known(value):
            choice(name, value, options)
    if known(steps) and number("steps", steps, integer=True) < 2:
        raise ValueError(f"steps must be at least 2 (the first is warm-up), got {steps}")
    if known(seed) and number("seed", seed, integer=True) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if known(cfg):
        number("cfg", cfg)


class SageAttentionBenchmarkRDNA4(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SageAttentionBenchmarkRDNA4",
            display_name=DISPLAY_NAME,
            category="model_patches/attention",
            # An output node: it runs (and shows its report) without anything connected to its outputs, and a
            # cached re-run sends its stored report to the page again.
            is_output_node=True,
            description="Samples twice with the same seed, once with the model's own attention (what it runs "
                        "without the patch: the attention ComfyUI chose at start-up, named in the report) and "
                        "once with the patched attention, and reports "
                        "per-step times, their ratio, the attention share of each step, and how close the "
                        "patched result is to the unpatched one. The first step is warm-up and is "
                        "excluded from the totals. The JSON report goes to the output folder (sage_rdna4/).",
            inputs=[
                io.Model.Input("model", tooltip="A model from the Patch Sage Attention (RDNA4) node (its settings "
                                                "are used), or an unpatched model (then kernel 'auto')."),
                io.Conditioning.Input("positive", tooltip="The prompt's conditioning, as for KSampler."),
                io.Conditioning.Input("negative", tooltip="The negative conditioning, as for KSampler (e.g. "
                                                          "ConditioningZeroOut for Flux)."),
                io.Latent.Input("latent", tooltip="The latent to sample, e.g. from Empty Latent Image."),
                io.Int.Input("seed", default=0, min=0, max=0xffffffffffffffff, control_after_generate=True,
                             tooltip="Both runs use this seed, so they start from the same noise."),
                io.Int.Input("steps", default=10, min=2, max=10000,
                             tooltip="Steps per run; the first is warm-up and is not counted."),
                io.Float.Input("cfg", default=3.5, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale, as for KSampler (1.0 for Flux, which takes "
                                       "its guidance from FluxGuidance)."),
                io.Combo.Input("sampler_name", options=comfy.samplers.SAMPLER_NAMES, default="euler",
                               tooltip="One-evaluation samplers (euler) give one timing entry per step."),
                io.Combo.Input("scheduler", options=comfy.samplers.SCHEDULER_NAMES, default="simple",
                               tooltip="Noise schedule, as for KSampler; both runs use the same one."),
                io.Vae.Input("vae", optional=True,
                             tooltip="Connect to also compare the decoded images (image PSNR)."),
                io.Combo.Input("kernel", options=KERNEL_CHOICES, default=FROM_PATCH, optional=True,
                               tooltip="Kernel of the patched run: the Patch node's choice, or one named here."),
            ],
            outputs=[
                io.Latent.Output(display_name="LATENT", tooltip="The patched run's result."),
                io.Image.Output(display_name="plot", tooltip="Time per step of both runs."),
                io.String.Output(display_name="report", tooltip="The report as text."),
            ],
        )

    @classmethod
    def validate_inputs(cls, kernel=None, sampler_name=None, scheduler=None):
        # ComfyUI does not check a V3 node's combo values at queue time; steps, seed and cfg keep its range check.
        return queue_time_error(DISPLAY_NAME, lambda: check_inputs(kernel, sampler_name, scheduler))

    @classmethod
    def execute(cls, model, positive, negative, latent, seed, steps, cfg, sampler_name, scheduler, vae=None,
                kernel=FROM_PATCH) -> io.NodeOutput:
        try:
            check_inputs(kernel, sampler_name, scheduler, steps, seed, cfg, linked=False)
            if not isinstance(latent, dict) or "samples" not in latent:
                raise ValueError(f"latent must be a LATENT (a dict with 'samples'), got {type(latent).__name__}")
            patched_config(model, kernel)  # a bad kernel for this model stops here, named, before sampling
        except ValueError as exc:
            raise ValueError(f"{DISPLAY_NAME}: {exc}") from exc
        steps = int(steps)
        pbar = comfy.utils.ProgressBar(2 * steps)
        out, report, text, plot, _ = run_ab(model, positive, negative, latent, int(seed), steps, float(cfg),
                                            sampler_name, scheduler, vae=vae, kernel=kernel,
                                            progress=lambda done, total: pbar.update_absolute(done, total))
        log.info("%s", text)
        return io.NodeOutput(out, plot, text, ui={"text": [text], "sage_rdna4_report": [report_json(report)]})
