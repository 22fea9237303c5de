"""Build TINY real ComfyUI models with random weights, plus their conditioning and latents.

Everything goes through ComfyUI's own classes (supported_models config -> model_base -> ModelPatcher), so
the attention calls are exactly the ones a real Flux / Wan / SD model makes, only smaller.
`comfy_import()` must run first: it puts COMFYUI_PATH on sys.path and forces the CPU unless asked not to.
The same builders take real sizes (see FLUX_1MP) for the H200 measurement script, tools/ab_real_size.py.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def comfy_path() -> Path:
    return Path(os.environ["COMFYUI_PATH"]).resolve()


def comfy_import(cpu: bool = True):
    """Make ComfyUI importable; with `cpu` set, comfy.model_management never looks for a GPU."""
    path = str(comfy_path())
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.cli_args

    if cpu:
        comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401  (probes the device now, with the flag above)
    return comfy


# Tiny configs: head dims and ratios as in the real models, everything else small.
FLUX_TINY = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
                 hidden_size=128, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 28, 28],
                 theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)
# Flux.1-dev as released: 24 heads of 128, 19 double + 38 single blocks.
FLUX_1MP = dict(FLUX_TINY, vec_in_dim=768, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24,
                depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56])
WAN_TINY = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=32, in_dim=16, dim=128,
                ffn_dim=256, freq_dim=64, text_dim=64, out_dim=16, num_heads=2, num_layers=2, eps=1e-6)
# Wan 2.1 T2V 1.3B as released: 12 heads of 128, 30 layers.
WAN_13B = dict(WAN_TINY, text_len=512, dim=1536, ffn_dim=8960, freq_dim=256, text_dim=4096, num_heads=12,
               num_layers=30)
# Wan 2.1 T2V 14B as released: 40 heads of 128, 40 blocks.
WAN_14B = dict(WAN_13B, dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
SD15_TINY = dict(use_checkpoint=False, image_size=32, out_channels=4, use_spatial_transformer=True,
                 legacy=False, adm_in_channels=None, in_channels=4, model_channels=32, num_res_blocks=1,
                 transformer_depth=[1], channel_mult=[1], transformer_depth_middle=1,
                 use_linear_in_transformer=False, context_dim=64, num_head_channels=16,
                 transformer_depth_output=[1, 1], use_temporal_attention=False, use_temporal_resblock=False)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Comfy's ops leave weights uninitialised: give every parameter small random values."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * std).to(p.dtype))


def _randomize_on_device(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)


def build_model(config_cls_name: str, unet_config: dict, dtype=torch.float32, seed: int = 0, device=None):
    """A ModelPatcher around comfy's model class for `config_cls_name` (a comfy.supported_models class)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models as sm

    model_config = getattr(sm, config_cls_name)(dict(unet_config))
    manual_cast = mm.unet_manual_cast(dtype, mm.get_torch_device(), model_config.supported_inference_dtypes)
    model_config.set_inference_dtype(dtype, manual_cast)
    model = model_config.get_model({}, "", device=device)
    if device is not None and torch.device(device).type != "cpu":
        _randomize_on_device(model, seed)
    else:
        _randomize(model, seed)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def tiny_flux(seed: int = 0):
    return build_model("Flux", FLUX_TINY, torch.float32, seed)


def tiny_wan(seed: int = 0):
    return build_model("WAN21_T2V", WAN_TINY, torch.float32, seed)


def tiny_sd15(seed: int = 0):
    return build_model("SD15", SD15_TINY, torch.float32, seed)


def flux_conditioning(tokens: int = 8, context_dim: int = 64, vec_dim: int = 32, seed: int = 1, guidance=3.5):
    gen = torch.Generator().manual_seed(seed)
    cond = torch.randn(1, tokens, context_dim, generator=gen)
    pooled = torch.randn(1, vec_dim, generator=gen)
    return [[cond, {"pooled_output": pooled, "guidance": guidance}]]


def text_conditioning(tokens: int, context_dim: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, context_dim, generator=gen), {}]]


def image_latent(channels: int, height: int, width: int) -> dict:
    """An empty latent as EmptyLatentImage / EmptySD3LatentImage give (zeros; the sampler adds noise)."""
    return {"samples": torch.zeros(1, channels, height // 8, width // 8)}


def video_latent(frames: int, height: int, width: int, channels: int = 16) -> dict:
    """An empty Wan latent (B, C, 1 + (frames-1)/4, H/8, W/8)."""
    return {"samples": torch.zeros(1, channels, 1 + (frames - 1) // 4, height // 8, width // 8)}
