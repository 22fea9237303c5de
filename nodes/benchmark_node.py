"""Node "Sage Attention Benchmark (RDNA4)": same seed, exact SDPA vs patched attention, timed and compared."""
from __future__ import annotations

import logging

import comfy.samplers
import comfy.utils
from comfy_api.latest import io

from ..sage_patch.ab_benchmark import FROM_PATCH, run_ab
from ..sage_patch.config import KERNEL_CHOICES as PATCH_KERNELS
from ..sage_patch.report import report_json

log = logging.getLogger("sage_rdna4")
KERNEL_CHOICES = [FROM_PATCH, *[n for n in PATCH_KERNELS if n != "sdpa"]]


class SageAttentionBenchmarkRDNA4(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SageAttentionBenchmarkRDNA4",
            display_name="Sage Attention Benchmark (RDNA4)",
            category="model_patches/attention",
            description="Samples twice with the same seed, once with the model's own attention (as without "
                        "the patch; SDPA in a default ComfyUI) and once with the patched attention, and reports "
                        "per-step times, their ratio, the attention share of each step, and how close the "
                        "patched result is to the unpatched one. The first step is warm-up and is "
                        "excluded from the totals. The JSON report goes to the output folder (sage_rdna4/).",
            inputs=[
                io.Model.Input("model", tooltip="A model from the Patch Sage Attention (RDNA4) node (its settings "
                                                "are used), or an unpatched model (then kernel 'auto')."),
                io.Conditioning.Input("positive"),
                io.Conditioning.Input("negative"),
                io.Latent.Input("latent", tooltip="The latent to sample, e.g. from Empty Latent Image."),
                io.Int.Input("seed", default=0, min=0, max=0xffffffffffffffff, control_after_generate=True,
                             tooltip="Both runs use this seed, so they start from the same noise."),
                io.Int.Input("steps", default=10, min=2, max=10000,
                             tooltip="Steps per run; the first is warm-up and is not counted."),
                io.Float.Input("cfg", default=3.5, min=0.0, max=100.0, step=0.1, round=0.01),
                io.Combo.Input("sampler_name", options=comfy.samplers.SAMPLER_NAMES, default="euler",
                               tooltip="One-evaluation samplers (euler) give one timing entry per step."),
                io.Combo.Input("scheduler", options=comfy.samplers.SCHEDULER_NAMES, default="simple"),
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
    def execute(cls, model, positive, negative, latent, seed, steps, cfg, sampler_name, scheduler, vae=None,
                kernel=FROM_PATCH) -> io.NodeOutput:
        pbar = comfy.utils.ProgressBar(2 * steps)
        out, report, text, plot, _ = run_ab(model, positive, negative, latent, seed, steps, cfg, sampler_name,
                                            scheduler, vae=vae, kernel=kernel,
                                            progress=lambda done, total: pbar.update_absolute(done, total))
        log.info("%s", text)
        return io.NodeOutput(out, plot, text, ui={"text": [text], "sage_rdna4_report": [report_json(report)]})
