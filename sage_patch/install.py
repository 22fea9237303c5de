"""Put the override on a clone of a ComfyUI model. The only module here that touches ComfyUI objects."""
from __future__ import annotations

import logging
from typing import Optional, Tuple

from .config import PatchConfig
from .override import SageAttentionOverride
from .stats import PatchStats
from .timing import attach_step_timer

OVERRIDE_KEY = "optimized_attention_override"
log = logging.getLogger("sage_rdna4")


def override_hook_missing() -> Optional[str]:
    """None when this ComfyUI calls per-model attention overrides, else the reason it cannot be patched."""
    try:
        import comfy.ldm.modules.attention as attention
    except ImportError as exc:
        return f"ComfyUI's attention module cannot be imported: {exc}"
    if not hasattr(attention, "wrap_attn"):
        return ("this ComfyUI is too old: it has no per-model attention override (wrap_attn, added in "
                "2025-09). Update ComfyUI to use Patch Sage Attention (RDNA4).")
    return None


def patch_model(model, config: PatchConfig, stats: Optional[PatchStats] = None,
                baseline: bool = False) -> Tuple[object, SageAttentionOverride]:
    """Return (patched clone, its override). The input model is left untouched. `baseline`: the override runs
    every call as the model did before (the A/B benchmark's timed run A)."""
    reason = override_hook_missing()
    if reason:
        raise RuntimeError(reason)
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    previous = options.get(OVERRIDE_KEY)
    if isinstance(previous, SageAttentionOverride):
        previous = previous.previous  # re-patching replaces our own patch, keeps what was under it
    elif previous is not None:
        # e.g. the core "Model Attention Backend" node (ModelPatcher.set_model_optimized_attention) or
        # another pack: the calls this patch does not quantize keep going where they went before.
        log.info("[sage_rdna4] another attention override is on this model (%r): calls this patch does not "
                 "run go to it", getattr(previous, "__qualname__", previous))
    override = SageAttentionOverride(config, stats or PatchStats(f"sage_rdna4[{config.kernel}]"), previous=previous,
                                     baseline=baseline)
    options[OVERRIDE_KEY] = override
    attach_step_timer(patched, override)
    return patched, override


def find_override(model) -> Optional[SageAttentionOverride]:
    """The override a model was patched with by this pack, if any."""
    options = getattr(model, "model_options", {}).get("transformer_options", {})
    found = options.get(OVERRIDE_KEY)
    return found if isinstance(found, SageAttentionOverride) else None
