"""Node "Patch Sage Attention (RDNA4)": MODEL in, a patched clone out."""
from __future__ import annotations

from comfy_api.latest import io

from ..sage_patch.config import KERNEL_CHOICES, ON_UNSUPPORTED, PROLOGUE_CHOICES, PatchConfig
from ..sage_patch.install import patch_model
from .inputs import choice, flag, number, queue_time_error, text

DISPLAY_NAME = "Patch Sage Attention (RDNA4)"

KERNEL_TOOLTIP = (
    "Attention kernel for this model. 'auto' measures, on your GPU inside the first sampling step, on the "
    "model's own calls of each kind, every quantized kernel that accepts them (on RX 9070/9060: hip_int8_fp8, "
    "hip_int8_fp16, triton_int8_fp8, triton_int8_fp16, comfy_kitchen, sageattention) against SDPA, and takes "
    "the fastest; where no quantized kernel is measured faster than SDPA, 'auto' keeps exact attention (SDPA) "
    "for those calls, so it may bring no speed-up there. A kernel that cannot take a call (not installed, wrong "
    "GPU, unsupported head size...) sends it to ComfyUI's own attention and the reason is counted and logged once.")


CROSS_ATTENTION = ("quantized", "exact")


def config_from_inputs(kernel, smooth_k, prologue, on_unsupported, step_start=0.0, step_end=1.0,
                       exact_blocks="", min_seq_len=0, cross_attention="quantized",
                       time_attention=False, smooth_v=False) -> PatchConfig:
    """The node's inputs as a PatchConfig; ValueError (InputError for a wrong type) naming the input."""
    return PatchConfig(kernel=choice("kernel", kernel, KERNEL_CHOICES), smooth_k=flag("smooth_k", smooth_k),
                       prologue=choice("prologue", prologue, PROLOGUE_CHOICES),
                       on_unsupported=choice("on_unsupported", on_unsupported, ON_UNSUPPORTED),
                       step_start=number("step_start", step_start), step_end=number("step_end", step_end),
                       exact_blocks=text("exact_blocks", exact_blocks).strip(),
                       min_seq_len=number("min_seq_len", min_seq_len, integer=True),
                       cross_attention=choice("cross_attention", cross_attention, CROSS_ATTENTION),
                       time_attention=flag("time_attention", time_attention), smooth_v=flag("smooth_v", smooth_v))


def check_inputs(kernel=None, prologue=None, on_unsupported=None, step_start=None, step_end=None,
                 exact_blocks=None, cross_attention=None) -> None:
    """What can be checked before the run; an input a link feeds (None here) takes its least strict value."""
    def pick(value, default):
        return default if value is None else value
    config_from_inputs(pick(kernel, "auto"), True, pick(prologue, "auto"), pick(on_unsupported, "fallback"),
                       pick(step_start, 0.0), pick(step_end, 1.0), pick(exact_blocks, ""), 0,
                       pick(cross_attention, "quantized"))


class PatchSageAttentionRDNA4(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PatchSageAttentionRDNA4",
            display_name=DISPLAY_NAME,
            category="model_patches/attention",
            description="Runs the model's attention on SageAttention-style quantized kernels (INT8 Q.K, FP8/FP16 "
                        "P.V) written for AMD RDNA4. Text encoders and the VAE are not affected.",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to patch. The original stays unpatched."),
                io.Combo.Input("kernel", options=list(KERNEL_CHOICES), default="auto", tooltip=KERNEL_TOOLTIP),
                io.Boolean.Input("smooth_k", default=True,
                                 tooltip="Subtract the per-channel key mean before INT8 quantization. Exact for "
                                         "softmax and more accurate on diffusion models; keep it on."),
                io.Combo.Input("prologue", options=list(PROLOGUE_CHOICES), default="auto",
                               tooltip="Which kernel quantizes Q, K and V before attention: 'auto' uses the "
                                       "attention kernel's own; 'hip' the hand-written HIP one (RDNA4 only); "
                                       "'triton' the portable Triton one."),
                io.Combo.Input("on_unsupported", options=["fallback", "raise"], default="fallback",
                               tooltip="A call the kernel cannot take: 'fallback' runs ComfyUI's own attention "
                                       "and counts the reason; 'raise' stops the run with the reason."),
                io.Float.Input("step_start", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Fraction of the sampling schedule where quantized attention starts; "
                                       "steps before it use exact attention (e.g. 0.1 keeps the first 10% exact)."),
                io.Float.Input("step_end", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Fraction of the schedule where quantized attention stops; later steps "
                                       "use exact attention (e.g. 0.9 keeps the last 10% exact)."),
                io.String.Input("exact_blocks", default="",
                                tooltip="Transformer blocks kept on exact attention: indices '0,5', ranges "
                                        "'2-4', 'first N', 'last N'. Needs a model that reports block_index "
                                        "(and total_blocks for 'last N'); otherwise a note says it cannot apply."),
                io.Int.Input("min_seq_len", default=0, min=0, max=1 << 20,
                             tooltip="Calls with fewer query tokens than this use exact attention (quantization "
                                     "does not pay on short calls). 0 quantizes every call."),
                io.Combo.Input("cross_attention", options=["quantized", "exact"], default="quantized",
                               tooltip="Calls whose query and key lengths differ (text cross-attention): "
                                       "quantize them too, or keep them exact."),
                io.Boolean.Input("time_attention", default=False,
                                 tooltip="Also time the attention calls of each step with device events and "
                                         "print the attention share per sampling run. Off: no extra work."),
                # Last, so workflows saved before it existed keep their widget values in place.
                io.Boolean.Input("smooth_v", default=False,
                                 tooltip="Subtract V's per-channel mean before quantizing and add it back to the "
                                         "output (exact). Helps where V carries a large per-channel offset on "
                                         "hardware whose FP8 accumulator truncates; costs accuracy on zero-mean V "
                                         "at long sequences. Off by default (docs/MEASUREMENTS.md says why)."),
            ],
            outputs=[io.Model.Output(tooltip="A patched clone of the model.")],
        )

    @classmethod
    def validate_inputs(cls, kernel=None, prologue=None, on_unsupported=None, step_start=None, step_end=None,
                        exact_blocks=None, cross_attention=None):
        # Named arguments, not **kwargs: ComfyUI then still checks the other inputs' ranges itself. It skips
        # the min/max of the ones named here, so step_start/step_end are range-checked by PatchConfig.
        return queue_time_error(DISPLAY_NAME, lambda: check_inputs(
            kernel, prologue, on_unsupported, step_start, step_end, exact_blocks, cross_attention))

    @classmethod
    def execute(cls, model, kernel, smooth_k, prologue, on_unsupported, step_start=0.0, step_end=1.0,
                exact_blocks="", min_seq_len=0, cross_attention="quantized", time_attention=False,
                smooth_v=False) -> io.NodeOutput:
        try:
            config = config_from_inputs(kernel, smooth_k, prologue, on_unsupported, step_start, step_end,
                                        exact_blocks, min_seq_len, cross_attention, time_attention, smooth_v)
        except ValueError as exc:  # a value validate_inputs could not see (from a link), or a direct call
            raise ValueError(f"{DISPLAY_NAME}: {exc}") from exc
        patched, _ = patch_model(model, config)
        return io.NodeOutput(patched)
