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


# ---------------------------------------------------------------------------------------------------------------
# Model table families (tools/model_table.py, tests/test_model_table.py). Each family: ComfyUI's model class, its
# config at real width/heads/head dim (values as comfy/model_detection.py reads them from the released weights),
# the overrides that cut its depth for the table, the overrides of a tiny CPU version, and the inputs ComfyUI
# passes (conditioning with its attention mask, latent, cfg). Real token counts are set by the latent sizes below.
# ---------------------------------------------------------------------------------------------------------------
from typing import Callable, Dict, Optional, Tuple  # noqa: E402


class Family:
    """One model family of the table. A plain class: tools load this file by path, without a sys.modules entry
    (which a dataclass needs)."""

    def __init__(self, name: str, label: str, config_class: str, real: dict, cut: dict, full_depth: str, tiny: dict,
                 inputs: Callable[[bool], Tuple[list, list, dict, float]], masks: str, size: str,
                 dtype: torch.dtype = torch.bfloat16):
        self.name, self.label, self.config_class = name, label, config_class
        self.real = real              # unet_config at real size and full depth
        self.cut = cut                # overrides of `real` for the table (fewer blocks, same width)
        self.full_depth = full_depth  # the released model's depth, to say what was cut
        self.tiny = tiny              # overrides of `real` for the CPU version
        self.inputs = inputs          # tiny -> (positive, negative, latent, cfg)
        self.masks = masks            # which attention masks ComfyUI's code passes for this family, and when
        self.size = size              # the real-size sample (resolution, frames) the table uses
        self.dtype = dtype

    def config(self, tiny: bool, cut: bool = True) -> dict:
        cfg = dict(self.real)
        if tiny:
            cfg.update(self.tiny)
        elif cut:
            cfg.update(self.cut)
        return cfg


def randomize_weight_buffers(patcher, seed: int = 0, std: float = 0.02) -> list:
    """Give the diffusion model's persistent buffers random values as build_model does its parameters: a released
    checkpoint carries them (SD3's pos_embed), and ComfyUI allocates them empty, so without it they hold whatever
    memory held (NaN latents, from one run to the next). Returns their names."""
    module = patcher.model.diffusion_model
    persistent = set(module.state_dict().keys())
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    names = []
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name in persistent and buf.is_floating_point():
                buf.copy_((torch.randn(buf.shape, generator=gen) * std).to(buf.dtype))
                names.append(name)
    return names


def padded_text(tokens: int, dim: int, seed: int, valid: Optional[int] = None, **extra) -> list:
    """Text conditioning as ComfyUI's encoders hand it over; `valid` < `tokens`: a padded prompt whose
    attention_mask (1 = token, 0 = padding, integer as the tokenizer makes it) rides along in the conditioning."""
    gen = torch.Generator().manual_seed(seed)
    cond = torch.randn(1, tokens, dim, generator=gen)
    opts = dict(extra)
    if valid is not None:
        mask = torch.zeros(1, tokens, dtype=torch.long)
        mask[:, :valid] = 1
        opts["attention_mask"] = mask
    return [[cond, opts]]


def _pooled(dim: int, seed: int) -> torch.Tensor:
    return torch.randn(1, dim, generator=torch.Generator().manual_seed(seed + 100))


def _latent(*shape) -> dict:
    return {"samples": torch.zeros(1, *shape)}


SDXL_BASE = dict(use_checkpoint=False, image_size=32, out_channels=4, use_spatial_transformer=True, legacy=False,
                 num_classes="sequential", adm_in_channels=2816, in_channels=4, model_channels=320,
                 num_res_blocks=[2, 2, 2], transformer_depth=[0, 0, 2, 2, 10, 10], channel_mult=[1, 2, 4],
                 transformer_depth_middle=10, use_linear_in_transformer=True, context_dim=2048, num_head_channels=64,
                 transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], use_temporal_attention=False,
                 use_temporal_resblock=False)


def _sdxl_inputs(tiny: bool):
    dim, side = (64, 64) if tiny else (2048, 1024)
    extra = lambda s: dict(pooled_output=_pooled(1280, s), width=side, height=side)  # noqa: E731
    return (padded_text(77, dim, 1, **extra(1)), padded_text(77, dim, 2, **extra(2)),
            _latent(4, side // 8, side // 8), 5.0)


SD35_LARGE = dict(in_channels=16, patch_size=2, out_channels=16, depth=38, input_size=None, adm_in_channels=2048,
                  context_embedder_config={"target": "torch.nn.Linear",
                                           "params": {"in_features": 4096, "out_features": 2432}},
                  num_patches=36864, pos_embed_max_size=192, qk_norm="rms", pos_embed_scaling_factor=None,
                  x_block_self_attn_layers=[])


def _sd35_inputs(tiny: bool):
    dim, side = (64, 128) if tiny else (4096, 1024)
    # CLIP-L/G (77) and T5 (77) tokens side by side, as ComfyUI's SD3 text encoder returns them.
    return (padded_text(154, dim, 1, pooled_output=_pooled(2048, 1)),
            padded_text(154, dim, 2, pooled_output=_pooled(2048, 2)), _latent(16, side // 8, side // 8), 4.5)


FLUX_DEV = dict(FLUX_1MP)


def _flux_inputs(tiny: bool):
    dim, vec, side, tokens = (64, 32, 64, 16) if tiny else (4096, 768, 1024, 512)
    pos = padded_text(tokens, dim, 1, pooled_output=_pooled(vec, 1), guidance=3.5)
    neg = padded_text(tokens, dim, 2, pooled_output=_pooled(vec, 2), guidance=3.5)
    return pos, neg, _latent(16, side // 8, side // 8), 1.0


CHROMA = dict(image_model="chroma", in_channels=64, out_channels=64, context_in_dim=4096, hidden_size=3072,
              mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56], theta=10000,
              patch_size=2, qkv_bias=True, in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5)


def _chroma_inputs(tiny: bool):
    # Chroma's T5 tokenizer does not pad and its encoder returns no attention mask (comfy/text_encoders/pixart_t5.py).
    dim, side, tokens, neg_tokens = (64, 64, 12, 8) if tiny else (4096, 1024, 120, 40)
    pos = padded_text(tokens, dim, 1, pooled_output=None)
    return pos, padded_text(neg_tokens, dim, 2, pooled_output=None), _latent(16, side // 8, side // 8), 4.0


QWEN_IMAGE = dict(image_model="qwen_image", in_channels=64, num_layers=60)


def _qwen_inputs(tiny: bool):
    # Qwen-Image's text mask never reaches attention in this ComfyUI (model_base.QwenImage drops it).
    dim, side, tokens, neg_tokens = (64, 64, 12, 6) if tiny else (3584, 1328, 120, 12)
    return (padded_text(tokens, dim, 1), padded_text(neg_tokens, dim, 2), _latent(16, side // 8, side // 8), 2.5)


HIDREAM_FULL = dict(image_model="hidream", attention_head_dim=128, axes_dims_rope=[64, 32, 32],
                    caption_channels=[4096, 4096], max_resolution=[128, 128], in_channels=16,
                    llama_layers=list(range(32)) + [31] * 16, num_attention_heads=20, num_routed_experts=4,
                    num_activated_experts=2, num_layers=16, num_single_layers=32, out_channels=16, patch_size=2,
                    text_emb_dim=2048)


def _hidream_inputs(tiny: bool):
    # T5 and Llama prompts padded to 128 tokens each; HiDream's model takes no text mask (model_base.HiDream).
    dim, side, tokens, layers = (64, 64, 8, 4) if tiny else (4096, 1024, 128, 32)

    def cond(seed):
        gen = torch.Generator().manual_seed(seed + 200)
        llama = torch.randn(1, layers, tokens, dim, generator=gen)
        return padded_text(tokens, dim, seed, pooled_output=_pooled(2048, seed), conditioning_llama3=llama)
    return cond(1), cond(2), _latent(16, side // 8, side // 8), 5.0


LUMINA2 = dict(image_model="lumina2", patch_size=2, in_channels=16, dim=2304, cap_feat_dim=2304, n_layers=26,
               n_heads=24, n_kv_heads=8, qk_norm=True, axes_dims=[32, 32, 32], axes_lens=[300, 512, 512])


def _lumina2_inputs(tiny: bool):
    # A padded prompt: model_base.Lumina2 passes its attention_mask on when any token is padding.
    dim, side, tokens, valid, neg_tokens = (64, 64, 16, 10, 6) if tiny else (2304, 1024, 256, 150, 20)
    # Gemma's encoder always returns a mask; an unpadded prompt's (all ones) is not passed on but sets num_tokens.
    return (padded_text(tokens, dim, 1, valid=valid), padded_text(neg_tokens, dim, 2, valid=neg_tokens),
            _latent(16, side // 8, side // 8), 4.0)


WAN22_5B = dict(WAN_13B, dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48)


def _wan_inputs(frames: int, height: int, width: int, channels: int = 16, spatial: int = 8):
    def inputs(tiny: bool):
        if tiny:
            return (padded_text(32, 64, 1), padded_text(32, 64, 2), _latent(channels, 2, 4, 4), 5.0)
        return (padded_text(512, 4096, 1), padded_text(512, 4096, 2),
                _latent(channels, 1 + (frames - 1) // 4, height // spatial, width // spatial), 5.0)
    return inputs


HUNYUAN_VIDEO = dict(image_model="hunyuan_video", in_channels=16, patch_size=[1, 2, 2], out_channels=16,
                     vec_in_dim=768, axes_dim=[16, 56, 56], meanflow=False, context_in_dim=4096, hidden_size=3072,
                     mlp_ratio=4.0, num_heads=24, depth=20, depth_single_blocks=40, theta=256, qkv_bias=True,
                     byt5=False, guidance_embed=True)


def _hunyuan_video_inputs(tiny: bool):
    # A padded Llama prompt: the mask reaches the token refiner (per row) and the double/single blocks (per key).
    dim, tokens, valid = (64, 16, 10) if tiny else (4096, 256, 120)
    latent = _latent(16, 2, 4, 4) if tiny else _latent(16, 1 + (73 - 1) // 4, 480 // 8, 848 // 8)
    extra = dict(pooled_output=_pooled(768, 1), guidance=6.0)
    return padded_text(tokens, dim, 1, valid=valid, **extra), padded_text(tokens, dim, 2, **extra), latent, 1.0


LTXV_2B = dict(image_model="ltxv", num_layers=28, attention_head_dim=64, cross_attention_dim=2048)


def _ltxv_inputs(tiny: bool):
    # T5 prompts padded to 128 tokens (comfy/text_encoders/lt.py) with their mask, for the cross-attention.
    dim, tokens, valid, neg_valid = (64, 16, 10, 4) if tiny else (4096, 128, 60, 12)
    latent = _latent(128, 2, 2, 2) if tiny else _latent(128, 1 + (97 - 1) // 8, 512 // 32, 768 // 32)
    return (padded_text(tokens, dim, 1, valid=valid, frame_rate=25), padded_text(tokens, dim, 2, valid=neg_valid,
                                                                                   frame_rate=25), latent, 3.0)


MOCHI = dict(image_model="mochi_preview", depth=48, patch_size=2, num_heads=24, hidden_size_x=3072,
             hidden_size_y=1536, mlp_ratio_x=4.0, mlp_ratio_y=4.0, learn_sigma=False, in_channels=12, qk_norm=True,
             qkv_bias=False, out_bias=True, attn_drop=0.0, patch_embed_bias=True, posenc_preserve_area=True,
             timestep_mlp_bias=True, attend_to_padding=False, timestep_scale=1000.0, use_t5=True, t5_feat_dim=4096,
             t5_token_length=256, rope_theta=10000.0)


def _mochi_inputs(tiny: bool):
    # T5 padded to 256 tokens with its mask: Mochi crops the text to the valid tokens instead of masking.
    dim, tokens, valid, neg_valid = (64, 16, 10, 4) if tiny else (4096, 256, 60, 8)
    latent = _latent(12, 2, 4, 4) if tiny else _latent(12, 1 + (85 - 1) // 6, 480 // 8, 848 // 8)
    return (padded_text(tokens, dim, 1, valid=valid), padded_text(tokens, dim, 2, valid=neg_valid), latent, 4.5)


COSMOS_PREDICT2_2B = dict(image_model="cosmos_predict2", max_img_h=240, max_img_w=240, max_frames=128,
                          in_channels=16, out_channels=16, patch_spatial=2, patch_temporal=1, model_channels=2048,
                          concat_padding_mask=True, crossattn_emb_channels=1024, pos_emb_cls="rope3d",
                          pos_emb_learnable=True, pos_emb_interpolation="crop", min_fps=1, max_fps=30,
                          use_adaln_lora=True, adaln_lora_dim=256, num_blocks=28, num_heads=16,
                          extra_per_block_abs_pos_emb=False, rope_h_extrapolation_ratio=4.0,
                          rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0,
                          extra_h_extrapolation_ratio=1.0, extra_w_extrapolation_ratio=1.0,
                          extra_t_extrapolation_ratio=1.0, rope_enable_fps_modulation=False)


def _cosmos_inputs(tiny: bool):
    # T5 padded to 512 tokens (comfy/text_encoders/cosmos.py); predict2 takes no text mask (model_base).
    dim, tokens, side = (1024, 16, 64) if tiny else (1024, 512, 1024)
    return (padded_text(tokens, dim, 1), padded_text(tokens, dim, 2), _latent(16, 1, side // 8, side // 8), 4.0)


_TINY_DIT = dict(num_heads=2)  # two heads of the real head dim where the config takes heads directly

_FAMILY_LIST = [
    Family("sdxl", "SDXL", "SDXL", SDXL_BASE,
           cut=dict(transformer_depth=[0, 0, 1, 1, 1, 1], transformer_depth_middle=1,
                    transformer_depth_output=[0, 0, 0, 1, 1, 1, 1, 1, 1]),
           full_depth="70 transformer blocks (2/2 + 10/10 down, 10 middle, 2x3 + 10x3 up)",
           tiny=dict(model_channels=64, num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth=[1, 1],
                     transformer_depth_middle=1, transformer_depth_output=[1, 1, 1, 1], context_dim=64),
           inputs=_sdxl_inputs, masks="none", size="1024x1024, cfg 5 (cond and uncond in one batch)"),
    Family("sd35", "SD3.5 Large", "SD3", SD35_LARGE, cut=dict(num_blocks=3), full_depth="38 joint blocks",
           tiny=dict(depth=2, num_blocks=2, adm_in_channels=2048, num_patches=1024, pos_embed_max_size=32,
                     context_embedder_config={"target": "torch.nn.Linear",
                                              "params": {"in_features": 64, "out_features": 128}}),
           inputs=_sd35_inputs, masks="none", size="1024x1024, cfg 4.5"),
    Family("flux", "Flux.1 dev", "Flux", FLUX_DEV, cut=dict(depth=2, depth_single_blocks=2),
           full_depth="19 double + 38 single blocks",
           tiny=dict(FLUX_TINY, hidden_size=256, num_heads=2, axes_dim=[16, 56, 56]),
           inputs=_flux_inputs,
           masks="none unless the conditioning carries one (Redux with attn_bias: a per-row (N, N) bias)",
           size="1024x1024, 512 T5 tokens, cfg 1"),
    Family("chroma", "Chroma", "Chroma", CHROMA, cut=dict(depth=2, depth_single_blocks=2),
           full_depth="19 double + 38 single blocks",
           tiny=dict(context_in_dim=64, hidden_size=256, num_heads=2, depth=1, depth_single_blocks=1, out_dim=256,
                     hidden_dim=64, n_layers=1),
           inputs=_chroma_inputs, masks="none: ComfyUI's Chroma T5 neither pads nor returns a mask",
           size="1024x1024, 120-token prompt, cfg 4"),
    Family("qwen_image", "Qwen-Image", "QwenImage", QWEN_IMAGE, cut=dict(num_layers=2),
           full_depth="60 blocks", tiny=dict(num_layers=1, num_attention_heads=2, joint_attention_dim=64),
           inputs=_qwen_inputs, masks="none: the text mask is dropped before the model (model_base.QwenImage)",
           size="1328x1328, cfg 2.5"),
    Family("hidream", "HiDream-I1 Full", "HiDream", HIDREAM_FULL,
           cut=dict(num_layers=2, num_single_layers=2, llama_layers=[0, 1, 2, 3]),
           full_depth="16 double + 32 single blocks",
           tiny=dict(caption_channels=[64, 64], num_attention_heads=2, num_layers=1, num_single_layers=1,
                     llama_layers=[0, 3], text_emb_dim=2048, max_resolution=[8, 8]),
           inputs=_hidream_inputs, masks="none: prompts are padded to 128 tokens but no mask reaches the model",
           size="1024x1024, 128 T5 + 2x128 Llama tokens, cfg 5"),
    Family("lumina2", "Lumina Image 2.0", "Lumina2", LUMINA2, cut=dict(n_layers=2), full_depth="26 layers",
           tiny=dict(dim=192, cap_feat_dim=64, n_layers=1, n_heads=3, n_kv_heads=1, axes_dims=[16, 24, 24],
                     axes_lens=[300, 64, 64]),
           inputs=_lumina2_inputs,
           masks="keys: a padded prompt's mask in the context refiner and the main layers; the noise refiner always "
                 "passes a (B, 1, N) zero bias",
           size="1024x1024, a 256-token prompt with 150 tokens, cfg 4", dtype=torch.bfloat16),
    Family("wan21_14b", "Wan 2.1 T2V 14B", "WAN21_T2V", WAN_14B, cut=dict(num_layers=2), full_depth="40 blocks",
           tiny=dict(WAN_TINY), inputs=_wan_inputs(33, 480, 832), masks="none",
           size="832x480, 33 frames, cfg 5"),
    Family("wan22_14b", "Wan 2.2 T2V 14B", "WAN21_T2V", WAN_14B, cut=dict(num_layers=2),
           full_depth="40 blocks (each of the two experts)", tiny=dict(WAN_TINY), inputs=_wan_inputs(81, 480, 832),
           masks="none", size="832x480, 81 frames, cfg 5"),
    Family("wan22_5b", "Wan 2.2 TI2V 5B", "WAN22_T2V", WAN22_5B, cut=dict(num_layers=2), full_depth="30 blocks",
           tiny=dict(WAN_TINY, in_dim=48, out_dim=48),
           inputs=_wan_inputs(121, 704, 1280, channels=48, spatial=16), masks="none",
           size="1280x704, 121 frames, cfg 5"),
    Family("hunyuan_video", "HunyuanVideo", "HunyuanVideo", HUNYUAN_VIDEO, cut=dict(depth=2, depth_single_blocks=2),
           full_depth="20 double + 40 single blocks (and the 2-block token refiner, kept)",
           tiny=dict(context_in_dim=64, hidden_size=256, num_heads=2, depth=1, depth_single_blocks=1),
           inputs=_hunyuan_video_inputs,
           masks="keys in the double/single blocks ((1, 1, N) bias) and rows in the token refiner ((B, 1, L, L)), "
                 "with a padded prompt", size="848x480, 73 frames, a 256-token prompt with 120 tokens, cfg 1"),
    Family("ltxv", "LTX-Video 2B", "LTXV", LTXV_2B, cut=dict(num_layers=2), full_depth="28 blocks",
           tiny=dict(num_layers=1, num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
                     caption_channels=64),
           inputs=_ltxv_inputs, masks="keys: the T5 padding mask in every cross-attention ((B, 1, 1, 128) bias)",
           size="768x512, 97 frames, 128 T5 tokens, cfg 3"),
    Family("mochi", "Mochi 1", "GenmoMochi", MOCHI, cut=dict(depth=2), full_depth="48 blocks",
           tiny=dict(depth=1, hidden_size_x=256, mlp_ratio_x=48.0, hidden_size_y=128, num_heads=2, t5_feat_dim=64,
                     t5_token_length=16),
           inputs=_mochi_inputs, masks="none: the text is cropped to its valid tokens instead",
           size="848x480, 85 frames, cfg 4.5"),
    Family("cosmos_predict2", "Cosmos Predict2 2B (T2I)", "CosmosT2IPredict2", COSMOS_PREDICT2_2B,
           cut=dict(num_blocks=2), full_depth="28 blocks",
           tiny=dict(model_channels=256, num_blocks=1, num_heads=2, adaln_lora_dim=32, max_img_h=16, max_img_w=16,
                     max_frames=4),
           inputs=_cosmos_inputs, masks="none", size="1024x1024, 512 T5 tokens, cfg 4"),
]
# The masked families first, so a run cut short has measured them.
TABLE_ORDER = ("hunyuan_video", "ltxv", "lumina2", "flux", "sdxl", "sd35", "wan21_14b", "wan22_14b", "wan22_5b",
               "qwen_image", "chroma", "hidream", "mochi", "cosmos_predict2")
FAMILIES: Dict[str, Family] = {name: next(f for f in _FAMILY_LIST if f.name == name) for name in TABLE_ORDER}
