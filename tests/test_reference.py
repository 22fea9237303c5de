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


# ------------------------------------------------------------------------------------------------------------------
# The P grid: FP8 P against the row max (p_tile None) or each key tile's own max (the kernels' one-pass rule)
# ------------------------------------------------------------------------------------------------------------------
def scored_qq(u: torch.Tensor, pv: str = "fp8", seed: int = 0) -> quant.QuantizedQKV:
    """A QuantizedQKV (B1 H1, D64) whose base-2 scores are exactly -u (u: (Nq, Nk)); V = 1 + 0.25 noise, -1 at key 0."""
    nq, nk = u.shape
    g = torch.Generator().manual_seed(seed)
    q8 = torch.zeros(1, 1, nq, 64, dtype=torch.int8)
    q8[..., 0] = 1
    k8 = torch.zeros(1, 1, nk, 64, dtype=torch.int8)
    k8[..., 0] = -1
    # Per-key scores need a per-(row, key) term: one query row per call, stacked below.
    assert nq == 1
    v = 1.0 + 0.25 * (2 * torch.rand(1, 1, nk, 64, generator=g) - 1)
    v[:, :, 0] = -1.0
    vq, vs = ((v * 224).to(torch.float8_e4m3fn), 1 / 224) if pv == "fp8" else ((v * 16384).half(), 1 / 16384)
    return quant.QuantizedQKV(q8, torch.ones(1, 1, 1), k8, u.float().reshape(1, 1, nk), vq,
                              torch.full((1, 1, 64), vs), None)


def one_pass_fp8(qq: quant.QuantizedQKV, tile: int) -> torch.Tensor:
    """An independent FP64 model of the kernels' online softmax: per key tile the shift is the tile's max, at least
    the running max less 64; P = e4m3(448 * 2^(s - shift)); the accumulator and the row sum of unrounded P move to
    each tile's shift."""
    s = reference.qk_scores_base2(qq.q8, qq.q_scale, qq.k8, qq.k_scale).double()
    v = qq.v.double()
    acc = torch.zeros(*s.shape[:-1], v.shape[-1], dtype=torch.float64)
    row = torch.zeros(*s.shape[:-1], 1, dtype=torch.float64)
    shift = running = torch.full_like(row, -math.inf)
    for t0 in range(0, s.shape[-1], tile):
        st = s[..., t0:t0 + tile]
        tile_max = st.amax(dim=-1, keepdim=True)
        running = torch.maximum(running, tile_max)
        new = torch.maximum(tile_max, running - 64)
        p = torch.exp2(st - new) * 448
        alpha = torch.exp2(shift - new)
        acc = acc * alpha + p.float().to(torch.float8_e4m3fn).double() @ v[..., t0:t0 + tile, :]
        row = row * alpha + p.sum(dim=-1, keepdim=True)
        shift = new
    return acc / row * qq.v_scale.double().unsqueeze(2)


def test_fp8_tile_tops_follow_the_kernels_rule():
    """Each key's top is its tile's max, floored 64 below the running max (a tile 75 below it takes max - 64; a
    fully masked tile the floor too); a row before any live key has top 0; NaN stays in its row."""
    inf = math.inf
    s = torch.tensor([[-3.0, -5.0, 5.0, 1.0, -75.0, -80.0, -inf, -inf, -inf],
                      [-inf, -inf, -2.0, -inf, -inf, -inf, -inf, -inf, -inf],
                      [0.0, math.nan, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    top = reference.fp8_p_tops(s, 2)
    assert top[0].tolist() == [-3.0, -3.0, 5.0, 5.0, -59.0, -59.0, -59.0, -59.0, -59.0]
    assert top[1].tolist() == [0.0, 0.0, -2.0, -2.0, -66.0, -66.0, -66.0, -66.0, -66.0]
    assert torch.isnan(top[2]).all()


@pytest.mark.parametrize("tile", [32, 64])
def test_fp8_tile_grid_is_the_one_pass_kernel(tile):
    """The spec with p_tile equals the independent one-pass model (the max arrives late, tiles 70 below it, a tail
    tile) to FP32 rounding, while the row max's grid differs from it by far more; p_tile >= Nk is the row grid."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for r in range(6):
        u = 14 * torch.rand(1, 300, generator=g, dtype=torch.float64)
        u[0, 200 + r] = -1.0          # the row max comes in a late tile
        u[0, 70:130] += 70.0          # whole tiles far below it: their tops are floored
        rows.append(u)
    for u in rows:
        qq = scored_qq(u)
        model = one_pass_fp8(qq, tile)
        tiled, _ = reference.attention_from_quantized(qq, pv="fp8", p_tile=tile)
        row_grid, _ = reference.attention_from_quantized(qq, pv="fp8")
        assert rel_l1(tiled.double(), model) < 1e-6, rel_l1(tiled.double(), model)
        assert rel_l1(row_grid.double(), model) > 2e-4
        assert torch.equal(reference.attention_from_quantized(qq, pv="fp8", p_tile=300)[0], row_grid)


def test_p_tile_is_checked_and_fp16_ignores_it():
    q, k, v = diffusion_like(nq=40, d=64, dtype=torch.float32)
    for bad in (0, -64, 64.0, True):
        with pytest.raises(ValueError, match="p_tile"):
            reference_attention(q, k, v, p_tile=bad)
    plain, _ = reference_attention(q, k, v, pv="fp16")
    assert torch.equal(reference_attention(q, k, v, pv="fp16", p_tile=16)[0], plain)


def test_fp16_p_tops_at_2_pow_15():
    """FP16 P is fp16(p * 2^15) / 2^15: a weight of 2^-20 of the max keeps fp16's 11 bits (p.half() would leave it
    a subnormal on a 2^-24 grid, 2^-26 and below would be zeros)."""
    u = torch.zeros(1, 3, dtype=torch.float64)
    u[0, 1], u[0, 2] = 20.0 + 1 / 3, 27.0
    qq = scored_qq(u, pv="fp16")
    qq.v = torch.zeros_like(qq.v)
    qq.v[0, 0, :, 0] = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float16)
    qq.v_scale = torch.ones_like(qq.v_scale)
    out = reference.attention_from_quantized(qq, pv="fp16")[0][0, 0, 0, 0].double()
    w = 2.0 ** -u[0].double()
    exact = (w[1] + w[2]) / w.sum()
    assert abs(float(out - exact)) < 2.0 ** -11 * float(exact)


# ------------------------------------------------------------------------------------------------------------------
# The verification-only model of a flushing WMMA (model_flushing_wmma)
# ------------------------------------------------------------------------------------------------------------------
def test_flush_model_zeroes_subnormal_p_only():
    """Under the model P.V reads subnormal P (e4m3 below 2^-6, fp16 below 2^-14) as zero and the row sum keeps them:
    three keys at 2^0, 2^-12 and 2^-18 of the max; the 2^-18 key's FP8 P (448 * 2^-18 = 2^-9.2) is a subnormal on
    the row grid, so only its V drops out; FP16 P (2^15 top: 2^-3) stays."""
    u = torch.tensor([[0.0, 12.0, 18.0]], dtype=torch.float64)
    for pv in ("fp8", "fp16"):
        qq = scored_qq(u, pv=pv)
        qq.v = torch.zeros_like(qq.v)
        qq.v[0, 0, :, 0] = torch.tensor([0.0, 0.0, 1.0]).to(qq.v.dtype)
        qq.v_scale = torch.ones_like(qq.v_scale)
        kept = reference.attention_from_quantized(qq, pv=pv)[0][0, 0, 0, 0]
        flushed = reference.attention_from_quantized(qq, pv=pv, model_flushing_wmma=True)[0][0, 0, 0, 0]
        assert float(kept) > 0.5 * 2.0 ** -18
        assert float(flushed) == (0.0 if pv == "fp8" else float(kept)), (pv, float(flushed))


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_tile_grid_survives_a_flushing_wmma_on_a_long_tail(pv):
    """Long tail (every row's max in key 0, 2047 keys 2^-15..2^-16 below it): under the flush model the row max's grid
    (FP8; FP16 P in [0, 1], the kernels before) loses 2.5e-2 / 5.1e-2 rel L1 against exact attention, the kernels'
    grid now (FP8 p_tile = HIP's BN; FP16 topped at 2^15) 7.7e-4 / 3.9e-7."""
    from comfyui_sage_rdna4.kernels.verify import subnormal_model as sm
    qq, exact = sm.long_tail_qq(pv, 2048, (15.0, 16.0))
    before = sm.rel_l1(sm.grid_model(qq, pv, "before", flush=True), exact)
    after = sm.rel_l1(sm.grid_model(qq, pv, "after", flush=True), exact)
    assert before > 1e-2 and after < 1e-3, (before, after)


def test_flush_model_is_never_passed_by_the_product():
    """model_flushing_wmma is verification only: no module outside kernels/verify/ and tests/ names it, except the
    spec that defines it."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    users = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
             if "model_flushing_wmma" in p.read_text(encoding="utf-8")]
    product = [p for p in users if not p.startswith(("tests/", "kernels/verify/")) and p != "kernels/reference.py"]
    assert not product, product
    assert "kernels/verify/subnormal_model.py" in users
