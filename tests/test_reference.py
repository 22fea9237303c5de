"""The torch reference (the numerical spec) against exact FP32 attention and its own invariants."""
import math

import pytest
import torch

from comfyui_sage_rdna4.kernels import quant, reference
from comfyui_sage_rdna4.kernels.metrics import cosine, rel_l1
from comfyui_sage_rdna4.kernels.reference import exact_attention, reference_attention


def diffusion_like(b=1, h=2, nq=256, nk=None, d=128, hkv=None, dtype=torch.float16, seed=0, offset=3.0):
    g = torch.Generator().manual_seed(seed)
    nk = nk or nq
    hkv = hkv or h
    q = torch.randn(b, h, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g) + offset * torch.randn(1, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_accuracy_against_exact(dtype, pv):
    q, k, v = diffusion_like(dtype=dtype)
    out, _ = reference_attention(q, k, v, pv=pv)
    exact, _ = exact_attention(q, k, v)
    assert out.dtype == dtype
    assert cosine(out, exact) >= 0.998
    assert rel_l1(out, exact) < (0.06 if pv == "fp8" else 0.03)


def test_fp16_pv_is_more_accurate_than_fp8():
    q, k, v = diffusion_like(seed=3)
    exact, _ = exact_attention(q, k, v)
    err8 = rel_l1(reference_attention(q, k, v, pv="fp8")[0], exact)
    err16 = rel_l1(reference_attention(q, k, v, pv="fp16")[0], exact)
    assert err16 < err8


def test_smooth_k_helps_with_a_key_channel_offset():
    q, k, v = diffusion_like(offset=20.0, seed=1)
    exact, _ = exact_attention(q, k, v)
    with_smooth = rel_l1(reference_attention(q, k, v, smooth_k=True)[0], exact)
    without = rel_l1(reference_attention(q, k, v, smooth_k=False)[0], exact)
    assert with_smooth < without


@pytest.mark.parametrize("group", ["block32", "block64", "block128"])
def test_per_block_groups(group):
    q, k, v = diffusion_like(nq=200)
    out, _ = reference_attention(q, k, v, qk_group=group)
    assert cosine(out, exact_attention(q, k, v)[0]) >= 0.995


def test_causal_unequal_lengths_and_gqa():
    q, k, v = diffusion_like(h=4, hkv=2, nq=96, nk=160, d=64)
    for causal in (False, True):
        out, _ = reference_attention(q, k, v, is_causal=causal)
        exact, _ = exact_attention(q, k, v, is_causal=causal)
        assert out.shape == (1, 4, 96, 64)
        assert cosine(out, exact) >= 0.998


def test_causal_matches_sdpa_alignment():
    q, k, v = diffusion_like(nq=64, nk=64, d=64, dtype=torch.float32)
    exact, _ = exact_attention(q, k, v, is_causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(exact, sdpa, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_masks(mask_kind):
    q, k, v = diffusion_like(nq=80, nk=120, d=64, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    if mask_kind == "bool":
        mask = torch.rand(1, 1, 80, 120, generator=g) > 0.3
        mask[..., 0] = True
    else:
        mask = torch.randn(80, 120, generator=g) * 2.0
    out, _ = reference_attention(q, k, v, attn_mask=mask)
    exact, _ = exact_attention(q, k, v, attn_mask=mask)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(exact, sdpa, atol=1e-5, rtol=1e-4)
    assert cosine(out, exact) >= 0.998


def test_fully_masked_row_gives_zero_and_minus_inf_lse():
    q, k, v = diffusion_like(nq=8, nk=16, d=32, dtype=torch.float32)
    mask = torch.ones(8, 16, dtype=torch.bool)
    mask[3] = False
    out, lse = reference_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.all(out[:, :, 3] == 0)
    assert torch.all(torch.isneginf(lse[:, :, 3]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("smooth_k", [True, False])
def test_lse_matches_exact(smooth_k):
    # Without smooth_k a large key offset costs INT8 precision (that is what smooth_k is for): no offset then.
    q, k, v = diffusion_like(nq=64, nk=96, d=64, dtype=torch.float32, offset=3.0 if smooth_k else 0.0)
    _, lse = reference_attention(q, k, v, smooth_k=smooth_k, return_lse=True)
    _, exact_lse = exact_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(lse, exact_lse, atol=0.02, rtol=0.0)


def test_chunking_gives_the_same_result(monkeypatch):
    q, k, v = diffusion_like(nq=100, nk=70, d=32, dtype=torch.float32)
    whole, lse_whole = reference_attention(q, k, v, return_lse=True, is_causal=True)
    monkeypatch.setattr(reference, "SCORE_BUDGET", 7 * 70 * 2)
    chunked, lse_chunked = reference_attention(q, k, v, return_lse=True, is_causal=True)
    torch.testing.assert_close(whole, chunked, atol=0, rtol=0)
    torch.testing.assert_close(lse_whole, lse_chunked, atol=0, rtol=0)


def test_head_dims_of_any_size():
    for d in (1, 40, 80, 160, 256):
        q, k, v = diffusion_like(nq=48, d=d, dtype=torch.float32)
        out, _ = reference_attention(q, k, v)
        assert cosine(out, exact_attention(q, k, v)[0]) >= 0.995, d


def test_int8_quantization_rules():
    x = torch.tensor([[[[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]]])
    q8, scale = quant.quantize_int8(x, mult=2.0)
    assert q8.dtype == torch.int8
    assert q8[0, 0, 0].tolist() == [64, -127, 32, 0]  # rint(2x * 127/4)
    assert scale[0, 0, 0].item() == pytest.approx(4.0 / 127)
    assert torch.all(q8[0, 0, 1] == 0)  # an all-zero row quantizes to zeros, not NaN


def test_v_fp8_cannot_overflow():
    v = torch.randn(1, 2, 64, 16) * 6e4
    v8, scale = quant.quantize_v_fp8(v)
    back = v8.float() * scale
    assert torch.isfinite(back).all()
    assert v8.float().abs().max() <= 448
    assert cosine(back, v) > 0.99


def test_v_fp16_scale_brings_each_channel_into_fp16_normal_range():
    """quant.fp16_v_scale: a power of two with amax / scale in (2**14, 2**15], up or down, at least 2**-126."""
    amax = torch.tensor([1e-9, 3.7e-7, 1e-4, 0.75, 1.0, 16384.0, 16385.0, 32768.0, 32769.0, 65504.0, 1e30, 3e38])
    scale = quant.fp16_v_scale(amax)
    m, e = torch.frexp(scale)
    assert torch.all(m == 0.5)  # powers of two
    ratio = amax / scale
    assert torch.all((ratio > 2 ** 14) & (ratio <= 2 ** 15)), ratio
    # The bit construction equals the real ceil(log2(amax / 2**15)) (torch.log2 in float64 is exact enough here).
    want = torch.exp2(torch.ceil(torch.log2(amax.double() / 2 ** 15))).float()
    assert torch.equal(scale, want)
    # A zero channel and FP32 subnormals stop at FP32's smallest normal; NaN and Inf stay.
    edge = quant.fp16_v_scale(torch.tensor([0.0, 1e-40, 2.0 ** -111, float("inf"), float("nan")]))
    tiny = torch.finfo(torch.float32).tiny
    assert edge[:3].tolist() == [tiny, tiny, tiny] and edge[3] == math.inf and math.isnan(edge[4])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_v_fp16_scaling_is_exact_and_cannot_overflow(dtype):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(1, 2, 64, 8, generator=g) * torch.logspace(-6, 4, 8)  # every channel its own magnitude
    v = v.to(dtype)
    v16, scale = quant.quantize_v_fp16(v)
    assert float(v16.float().abs().max()) <= 32768.0 and torch.isfinite(v16.float()).all()
    if dtype == torch.float16:
        assert torch.equal(v16.float() * scale, v.float())  # FP16 inputs: a power of two loses nothing
    big = (torch.randn(1, 1, 32, 8, generator=g) * 1e6).to(dtype if dtype != torch.float16 else torch.float32)
    v16, scale = quant.quantize_v_fp16(big)
    assert torch.isfinite(v16.float()).all() and float(v16.float().abs().max()) <= 32768.0


# FP16 P.V's own error at V ~ 1 on these inputs is 0.0073-0.0077 (rel L1, all three dtypes); the rule allows 0.02
# (the self-check's fp16 flag level, FLAG_REL_L1) and 1.25x the unit-magnitude error. Before V was scaled up, V at
# 1e-6 gave 0.018, 1e-7 0.17 and 1e-8 1.0 (all zeros). FP16 inputs only while the fp16 output is normal (1e-4).
SMALL_V = [(torch.float32, m) for m in (1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9)] + \
          [(torch.bfloat16, m) for m in (1e-4, 1e-6, 1e-7, 1e-8, 1e-9)] + [(torch.float16, 1e-4)]


@pytest.mark.parametrize("dtype,magnitude", SMALL_V)
def test_fp16_pv_keeps_small_v(dtype, magnitude):
    q, k, v = diffusion_like(nq=64, nk=96, d=64, dtype=torch.float32, offset=2.0)
    errors = []
    for m in (1.0, magnitude):
        qq, kk, vv = q.to(dtype), k.to(dtype), (v * m).to(dtype)
        out, _ = reference_attention(qq, kk, vv, pv="fp16")
        exact, _ = exact_attention(qq.double(), kk.double(), vv.double())
        errors.append(rel_l1(out.double(), exact))
    print(f"fp16 P.V {dtype} V x{magnitude:g}: rel L1 {errors[1]:.4f} (V x1: {errors[0]:.4f})")
    assert errors[1] <= min(0.02, 1.25 * errors[0]), errors


def test_large_values_stay_finite():
    q, k, v = diffusion_like(nq=64, d=64, dtype=torch.float32)
    v = v * 6e4
    k = k + 1e3
    out, _ = reference_attention(q, k, v)
    exact, _ = exact_attention(q, k, v)
    assert torch.isfinite(out).all()
    assert cosine(out, exact) >= 0.99


def test_exact_attention_agrees_with_sdpa_with_gqa():
    q, k, v = diffusion_like(h=6, hkv=2, nq=40, nk=50, d=16, dtype=torch.float32)
    exact, _ = exact_attention(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(exact, sdpa, atol=1e-5, rtol=1e-4)


def test_sm_scale_is_honoured():
    q, k, v = diffusion_like(nq=32, d=64, dtype=torch.float32)
    out, _ = reference_attention(q, k, v, sm_scale=0.5 / math.sqrt(64))
    exact, _ = exact_attention(q, k, v, sm_scale=0.5 / math.sqrt(64))
    default, _ = exact_attention(q, k, v)
    assert cosine(out, exact) > cosine(out, default)


# -- smooth_v ---------------------------------------------------------------------------------------------

def test_smooth_v_is_exact_math():
    """Without quantization error on V (FP16 P.V, FP16-exact V) smooth_v changes the result by rounding only."""
    q, k, v = diffusion_like(seed=11, nq=96, nk=160)
    v = v + 4.0
    plain, _ = reference_attention(q, k, v, pv="fp16")
    smooth, _ = reference_attention(q, k, v, pv="fp16", smooth_v=True)
    exact, _ = exact_attention(q, k, v)
    assert rel_l1(smooth, exact) < 0.01 and rel_l1(plain, exact) < 0.01
    assert rel_l1(smooth, plain) < 0.01


def test_smooth_v_mean_comes_back_and_lse_is_unchanged():
    q, k, v = diffusion_like(seed=12, nq=64, nk=200)
    v = v + torch.linspace(-5, 5, v.shape[-1])
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.1, smooth_v=True)
    assert qq.v_mean is not None and qq.v_mean.shape == (1, 2, 128)
    torch.testing.assert_close(qq.v_mean, v.double().mean(dim=2).float())
    # V's FP8 scale is taken after the mean is out: smaller than without
    plain = quant.quantize_qkv_torch(q, k, v, sm_scale=0.1)
    assert plain.v_mean is None
    offset_channels = torch.linspace(-5, 5, v.shape[-1]).abs() > 2
    assert (qq.v_scale[..., offset_channels] < plain.v_scale[..., offset_channels]).all()
    _, lse_plain = reference_attention(q, k, v, return_lse=True)
    _, lse_smooth = reference_attention(q, k, v, return_lse=True, smooth_v=True)
    torch.testing.assert_close(lse_smooth, lse_plain)


def test_smooth_v_shrinks_the_fp8_error_with_a_value_offset():
    """A large per-channel V offset makes FP8 V coarse relative to the varying part; smooth_v removes it."""
    g = torch.Generator().manual_seed(13)
    q = 0.5 * torch.randn(1, 2, 128, 64, generator=g)
    k = 0.5 * torch.randn(1, 2, 512, 64, generator=g)
    v = torch.randn(1, 2, 512, 64, generator=g) + 20.0
    exact, _ = exact_attention(q, k, v)
    centred = exact - v.mean(dim=2, keepdim=True)  # the part of the output that attention decides
    err_plain = rel_l1(reference_attention(q, k, v)[0] - v.mean(dim=2, keepdim=True), centred)
    err_smooth = rel_l1(reference_attention(q, k, v, smooth_v=True)[0] - v.mean(dim=2, keepdim=True), centred)
    assert err_smooth < 0.5 * err_plain


def test_smooth_v_keeps_empty_rows_zero():
    q, k, v = diffusion_like(seed=14, nq=8, nk=16)
    mask = torch.ones(8, 16, dtype=torch.bool)
    mask[3] = False
    out, _ = reference_attention(q, k, v + 3.0, attn_mask=mask, smooth_v=True)
    assert out[:, :, 3].abs().max() == 0
    assert out[:, :, 2].abs().min() > 0
