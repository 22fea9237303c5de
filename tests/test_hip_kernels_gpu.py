"""The HIP kernels executed on an NVIDIA GPU through the gfx12 WMMA emulation (CUDA via nvrtc/CuPy),
launched with kernel_abi's geometry and compared with the spec:
  * prologue outputs bit-exact against quant.quantize_qkv_torch (CPU), strided/fused/NHD views;
  * INT8 Q.K^T products bit-exact (same LDS staging and fragments as the attention kernels);
  * attention outputs and LSE within tight tolerance of reference.attention_from_quantized;
  * shapes with tails, causal, GQA, both head dims, both dtypes, both P.V modes;
  * a call whose offsets exceed 2^31 elements;
  * NaN/Inf in q, k or v reaching the output as NaN where the spec puts it; V at the dtype max staying finite;
  * smooth_v (prologue bit-exact, attention against the spec);
  * the two-level P.V accumulation under an emulated 13-bit truncating accumulator (NVIDIA's FP8 MMA): diffuse
    attention over 16k keys with a V channel offset stays within rel L1 0.02 per (batch, head), while the former
    single chain (SG_PV_SINGLE_CHAIN=1, verification only) loses mass;
  * FP8 P never above 448 at the e4m3 conversion: peaked scores and a dominant key at logits up to 1e7, built with
    the non-saturating conversion (fp8_nonsat). SAGE_RDNA4_EMU_FP8_NONSAT=1 runs every test of the file under it."""
import math

import pytest
import torch

from comfyui_sage_rdna4.kernels import quant
from comfyui_sage_rdna4.kernels.verify import hip_checks

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def run(hip_emulated_run):
    return hip_emulated_run  # tests/conftest.py


PROLOGUE_CASES = [
    (torch.float16, 128, "fp8", "token", "hnd", 1, 4, 2, 333, 517),
    (torch.bfloat16, 128, "fp8", "token", "fused", 2, 3, 3, 700, 700),
    (torch.bfloat16, 64, "fp16", "block32", "nhd", 1, 2, 1, 1000, 999),
    (torch.float16, 64, "fp8", "block64", "fused", 1, 2, 2, 257, 257),
    (torch.bfloat16, 128, "fp16", "block128", "hnd", 1, 2, 2, 300, 4097),
]


@pytest.mark.parametrize("dtype,d,pv,group,layout,b,hq,hkv,nq,nk", PROLOGUE_CASES)
def test_prologue_bit_exact(run, dtype, d, pv, group, layout, b, hq, hkv, nq, nk):
    q, k, v = hip_checks.make_qkv(b, hq, hkv, nq, nk, d, dtype, DEV, layout=layout)
    sm = 1 / math.sqrt(d)
    for smooth in (True, False):
        qq = hip_checks.prologue(run, q, k, v, sm_scale=sm, smooth_k=smooth, pv=pv, qk_group=group)
        assert hip_checks.prologue_mismatches(qq, q, k, v, sm_scale=sm, smooth_k=smooth, pv=pv, qk_group=group) == {}


@pytest.mark.parametrize("d,nq,nk,hq,hkv", [(128, 333, 517, 4, 2), (64, 130, 33, 2, 1), (128, 1, 1, 1, 1)])
def test_qk_scores_bit_exact(run, d, nq, nk, hq, hkv):
    q, k, v = hip_checks.make_qkv(2, hq, hkv, nq, nk, d, torch.float16, DEV)
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=1 / math.sqrt(d))
    assert torch.equal(hip_checks.qk_scores(run, qq).cpu(), hip_checks.qk_scores_expected(qq))


ATTN_CASES = []
for _pv in ("fp8", "fp16"):
    for _d in (128, 64):
        for _dt in (torch.float16, torch.bfloat16):
            for _causal in (False, True):
                ATTN_CASES.append((_pv, _d, _dt, _causal, 2, 4, 2, 333, 517, "hnd"))
ATTN_CASES += [
    ("fp8", 128, torch.bfloat16, True, 1, 3, 3, 700, 700, "fused"),
    ("fp16", 128, torch.float16, False, 1, 3, 3, 700, 700, "fused"),
    ("fp8", 64, torch.float16, True, 1, 2, 2, 1000, 1000, "nhd"),
    ("fp8", 128, torch.float16, True, 1, 2, 1, 300, 100, "hnd"),   # causal with Nq > Nk
    ("fp16", 64, torch.bfloat16, True, 1, 2, 1, 50, 600, "hnd"),    # causal with Nq < Nk
]


@pytest.mark.parametrize("pv,d,dtype,causal,b,hq,hkv,nq,nk,layout", ATTN_CASES)
def test_attention_matches_reference(run, pv, d, dtype, causal, b, hq, hkv, nq, nk, layout):
    q, k, v = hip_checks.make_qkv(b, hq, hkv, nq, nk, d, dtype, DEV, layout=layout)
    sm = 1 / math.sqrt(d)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=sm, pv=pv)
    out, lse = hip_checks.attention(run, qq, pv=pv, is_causal=causal, out_dtype=dtype, return_lse=True, q=q,
                                    sm_scale=sm)
    rep = hip_checks.attention_report(out, lse, qq, q, k, v, pv=pv, is_causal=causal, sm_scale=sm)
    print(pv, d, dtype, causal, layout, {k_: round(v_, 6) for k_, v_ in rep.items()})
    hip_checks.assert_attention_ok(rep, pv)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_flux_sized_call_accuracy(run, pv):
    """B1 H24 N4608 D128 bf16 (a Flux 1 MP call): accuracy against exact attention and the spec."""
    q, k, v = hip_checks.make_qkv(1, 24, 24, 4608, 4608, 128, torch.bfloat16, DEV)
    sm = 1 / math.sqrt(128)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=sm, pv=pv)
    out, _ = hip_checks.attention(run, qq, pv=pv, is_causal=False, out_dtype=torch.bfloat16)
    rep = hip_checks.attention_report(out, None, qq, q, k, v, pv=pv, is_causal=False, sm_scale=sm)
    print("flux", pv, rep)
    hip_checks.assert_attention_ok(rep, pv)


def test_offsets_beyond_2_pow_31(run):
    """q, q8 and out hold more than 2^31 elements; the last query rows sit past that offset."""
    nq, nk, d = (1 << 24) + 200, 100, 128
    q = torch.randn(1, 1, nq, d, device=DEV, dtype=torch.float16)
    assert q.numel() > (1 << 31)
    _, k, v = hip_checks.make_qkv(1, 1, 1, 1, nk, d, torch.float16, DEV)
    sm = 1 / math.sqrt(d)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=sm, pv="fp8")
    out, lse = hip_checks.attention(run, qq, pv="fp8", is_causal=False, out_dtype=torch.float16, return_lse=True,
                                q=q, sm_scale=sm)
    tail = slice(nq - 300, nq)
    q_t = q[:, :, tail]
    ref = quant.quantize_qkv_torch(q_t.cpu(), k.cpu(), v.cpu(), sm_scale=sm)
    assert torch.equal(qq.q8[:, :, tail].cpu(), ref.q8)
    assert torch.equal(qq.q_scale[:, :, tail].cpu(), ref.q_scale)
    sub = quant.QuantizedQKV(qq.q8[:, :, tail].contiguous(), qq.q_scale[:, :, tail].contiguous(), qq.k8, qq.k_scale,
                             qq.v, qq.v_scale, qq.k_mean)
    rep = hip_checks.attention_report(out[:, :, tail], lse[:, :, tail], sub, q_t, k, v, pv="fp8", is_causal=False,
                                  sm_scale=sm)
    print("2^31", rep)
    hip_checks.assert_attention_ok(rep, "fp8")


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("where,value,pv,causal,smooth,dtype", [
    ("q", NAN, "fp8", False, True, torch.float16),
    ("q", INF, "fp16", True, True, torch.bfloat16),
    ("k", NAN, "fp8", True, False, torch.bfloat16),
    ("k", -INF, "fp16", True, False, torch.float16),
    ("k", INF, "fp8", False, True, torch.float16),
    ("v", NAN, "fp16", True, True, torch.bfloat16),
    ("v", INF, "fp8", True, True, torch.float16),
    ("v", -INF, "fp8", False, True, torch.bfloat16),
])
def test_nan_and_inf_propagate(run, where, value, pv, causal, smooth, dtype):
    """Prologue: NaN/Inf scales exactly where the torch prologue has them (else bit-exact). Attention: NaN
    exactly where the spec is not finite, never finite where exact attention is not, NaN LSE where the spec's is
    NaN (several query blocks and key tiles)."""
    q, k, v = hip_checks.poisoned_qkv(where, value, dtype, DEV, nq=300, nk=517)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=0.125, smooth_k=smooth, pv=pv)
    assert hip_checks.prologue_mismatches(qq, q, k, v, sm_scale=0.125, smooth_k=smooth, pv=pv) == {}
    out, lse = hip_checks.attention(run, qq, pv=pv, is_causal=causal, out_dtype=dtype, return_lse=True, q=q,
                                sm_scale=0.125)
    hip_checks.assert_nonfinite_like_spec(out, lse, qq, q, k, v, where=where, pv=pv, is_causal=causal, sm_scale=0.125,
                                      smooth_k=smooth)


@pytest.mark.parametrize("dtype,v_max", [(torch.float16, 65504.0), (torch.bfloat16, 3e38)])
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_output_is_overflow_safe(run, dtype, v_max, pv, d):
    """V at the top of its dtype's range (fp16 65504; bf16 3e38): finite output, constant channels at +-max|V|."""
    q, k, v = hip_checks.overflow_qkv(dtype, v_max, DEV, nq=300, nk=517, d=d)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=1 / math.sqrt(d), pv=pv)
    out, _ = hip_checks.attention(run, qq, pv=pv, is_causal=True, out_dtype=dtype)
    hip_checks.assert_overflow_safe(out, qq, v, pv=pv, is_causal=True)


# ------------------------------------------------------------------------------------------------------
# smooth_v
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,d,pv,group,layout,b,hq,hkv,nq,nk", PROLOGUE_CASES)
def test_prologue_smooth_v_bit_exact(run, dtype, d, pv, group, layout, b, hq, hkv, nq, nk):
    q, k, v = hip_checks.make_qkv(b, hq, hkv, nq, nk, d, dtype, DEV, layout=layout)
    v.add_(torch.linspace(-3, 5, d, device=DEV).to(dtype))  # a channel offset (in place: views keep strides)
    sm = 1 / math.sqrt(d)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=sm, pv=pv, qk_group=group, smooth_v=True)
    assert hip_checks.prologue_mismatches(qq, q, k, v, sm_scale=sm, pv=pv, qk_group=group, smooth_v=True) == {}


@pytest.mark.parametrize("pv,d,dtype,causal,b,hq,hkv,nq,nk,layout", ATTN_CASES[::3])
def test_attention_smooth_v_matches_reference(run, pv, d, dtype, causal, b, hq, hkv, nq, nk, layout):
    q, k, v = hip_checks.make_qkv(b, hq, hkv, nq, nk, d, dtype, DEV, layout=layout)
    v.add_(torch.linspace(-3, 5, d, device=DEV).to(dtype))
    sm = 1 / math.sqrt(d)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=sm, pv=pv, smooth_v=True)
    out, lse = hip_checks.attention(run, qq, pv=pv, is_causal=causal, out_dtype=dtype, return_lse=True, q=q,
                                    sm_scale=sm)
    rep = hip_checks.attention_report(out, lse, qq, q, k, v, pv=pv, is_causal=causal, sm_scale=sm)
    print("smooth_v", pv, d, dtype, causal, layout, {k_: round(v_, 6) for k_, v_ in rep.items()})
    hip_checks.assert_attention_ok(rep, pv)


# ------------------------------------------------------------------------------------------------------
# Two-level P.V accumulation under a truncating accumulator (the emulation's model of NVIDIA's FP8 MMA)
# ------------------------------------------------------------------------------------------------------
PRECISION_SHAPE = dict(b=2, h=2, nq=256, nk=16384, d=128)  # 2 query blocks x 256 key tiles per (batch, head)
TARGET_REL_L1 = 0.02      # issue 10's target for diffuse attention with a V channel offset
SINGLE_CHAIN_MIN_LOSS = 0.05



def _precision_inputs(kind):
    """diffuse_voffset: hip_checks.diffuse_qkv; regional_voffset: benchmark.py's kind at nk keys, every
    (nk / nq)-th query of it (so the queries spread over every run of keys)."""
    s = PRECISION_SHAPE
    if kind == "diffuse_voffset":
        return hip_checks.diffuse_qkv(s["b"], s["h"], s["nq"], s["nk"], s["d"], torch.bfloat16, DEV)
    from comfyui_sage_rdna4.kernels import benchmark
    shape = benchmark.Shape("regional", s["b"], s["h"], s["nk"], s["d"], "bfloat16")
    q, k, v = benchmark.make_inputs(shape, DEV, kind=kind)
    return q[:, :, ::s["nk"] // s["nq"]].contiguous(), k, v


def _precision_case(run_, pv, smooth_v, kind="diffuse_voffset"):
    from comfyui_sage_rdna4.kernels import reference
    s = PRECISION_SHAPE
    q, k, v = _precision_inputs(kind)
    exact, _ = reference.exact_attention(q, k, v)
    qq = hip_checks.prologue(run_, q, k, v, sm_scale=1 / math.sqrt(s["d"]), pv=pv, smooth_v=smooth_v)
    out, _ = hip_checks.attention(run_, qq, pv=pv, is_causal=False, out_dtype=torch.bfloat16)
    return hip_checks.per_head_rel_l1(out, exact)


@pytest.mark.parametrize("pv,smooth_v", [("fp8", False), ("fp8", True), ("fp16", False)])
def test_two_level_pv_survives_a_13_bit_accumulator(emulated_runner, pv, smooth_v):
    """Diffuse attention over 16384 keys with a V channel offset, B2 H2, 256 query rows, D128, bf16: with the
    emulated WMMA accumulator truncating to 13 fraction bits (fp8; for fp16 P.V the f16 builtin likewise), the
    two-level kernel stays within rel L1 0.02 of exact FP32 attention per (batch, head), as with an exact one."""
    exact_acc = _precision_case(emulated_runner(), pv, smooth_v)
    trunc = _precision_case(emulated_runner(acc_trunc_bits=13, f16_acc_trunc_bits=13), pv, smooth_v)
    print(f"two-level {pv} smooth_v={smooth_v}: rel L1 per (b, h) exact acc {exact_acc.tolist()}, "
          f"13-bit acc {trunc.tolist()}")
    assert (exact_acc <= TARGET_REL_L1).all(), exact_acc
    assert (trunc <= TARGET_REL_L1).all(), trunc


def test_single_chain_pv_loses_mass_under_a_13_bit_accumulator(emulated_runner):
    """The same case through the former single-chain FP8 P.V (SG_PV_SINGLE_CHAIN=1, verification only): the
    truncation model bites (rel L1 > 0.05 in every (batch, head)), so the test above proves something."""
    err = _precision_case(emulated_runner(acc_trunc_bits=13, pv_single_chain=1), "fp8", False)
    print(f"single chain fp8, 13-bit acc: rel L1 per (b, h) {err.tolist()}")
    assert (err > SINGLE_CHAIN_MIN_LOSS).all(), err


@pytest.mark.parametrize("pv,smooth_v", [("fp8", False), ("fp8", True), ("fp16", False)])
def test_two_level_pv_survives_regional_v_offsets_under_a_13_bit_accumulator(emulated_runner, pv, smooth_v):
    """benchmark.py's regional_voffset inputs (queries mostly within their own run of keys, V offset per run),
    16384 keys, B2 H2, 256 queries: the two-level kernel stays within rel L1 0.02 under the 13-bit accumulator."""
    trunc = _precision_case(emulated_runner(acc_trunc_bits=13, f16_acc_trunc_bits=13), pv, smooth_v,
                            "regional_voffset")
    print(f"two-level {pv} smooth_v={smooth_v} regional: rel L1 per (b, h), 13-bit acc {trunc.tolist()}")
    assert (trunc <= TARGET_REL_L1).all(), trunc


def test_smooth_v_does_not_rescue_single_chain_pv_from_regional_v_offsets(emulated_runner):
    """The negative control: the single-chain FP8 P.V under the 13-bit accumulator fails the regional inputs
    even with smooth_v, which takes out V's global channel mean but not the per-run offsets (on the H200, FP8
    "mma" accumulation with smooth_v measured rel L1 0.105 on these inputs at 32760 keys)."""
    run_ = emulated_runner(acc_trunc_bits=13, pv_single_chain=1)
    err = _precision_case(run_, "fp8", True, "regional_voffset")
    print(f"single chain fp8 smooth_v regional, 13-bit acc: rel L1 per (b, h) {err.tolist()}")
    assert (err > TARGET_REL_L1).all(), err


# ------------------------------------------------------------------------------------------------------
# FP8 P within e4m3's range: the non-saturating reading of gfx12's v_cvt_pk_fp8_f32
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d,dtype,causal", [(128, torch.bfloat16, False), (64, torch.float16, True)])
def test_fp8_p_stays_within_e4m3_range_without_saturation(emulated_runner, d, dtype, causal):
    """Built with the non-saturating e4m3 conversion (fp8_nonsat: NaN above 448, as gfx12's conversion without a
    clamp bit may give): peaked attention (hip_checks.peaked_qkv, base-2 row maxima in the hundreds) stays finite
    and within the spec's tolerances, and a dominant key at logits 1e2 .. 1e7 (V = 1) comes out as the spec's 1
    within half an e4m3 step of its P (1/16). Fails on a kernel that feeds P above 448 to the conversion."""
    from comfyui_sage_rdna4.kernels import reference
    run_ = emulated_runner(fp8_nonsat=1)
    q, k, v = hip_checks.peaked_qkv(2, 4, 333, 517, d, dtype, DEV)
    sm = 1 / math.sqrt(d)
    qq = hip_checks.prologue(run_, q, k, v, sm_scale=sm, pv="fp8")
    out, lse = hip_checks.attention(run_, qq, pv="fp8", is_causal=causal, out_dtype=dtype, return_lse=True, q=q,
                                    sm_scale=sm)
    rep = hip_checks.attention_report(out, lse, qq, q, k, v, pv="fp8", is_causal=causal, sm_scale=sm)
    print("peaked nonsat", d, dtype, causal, {k_: round(v_, 6) for k_, v_ in rep.items()})
    hip_checks.assert_attention_ok(rep, "fp8")
    logits = hip_checks.dominant_key_logits(512)
    qq = hip_checks.dominant_key_qq(logits, d=d)
    qq_dev = quant.QuantizedQKV(*(None if getattr(qq, f) is None else getattr(qq, f).to(DEV)
                                  for f in hip_checks.QQ_FIELDS))
    out, lse = hip_checks.attention(run_, qq_dev, pv="fp8", is_causal=False, out_dtype=dtype, return_lse=True)
    ref, ref_lse = reference.attention_from_quantized(qq, pv="fp8", return_lse=True, out_dtype=dtype)
    o, r = out.float().cpu()[0, 0], ref.float()[0, 0]
    print("dominant key nonsat, out at logits 1e2 1e5 1e6 1e7:", o[:4, 0].tolist(), "spec", r[:4, 0].tolist())
    bad = (~torch.isfinite(o)).any(dim=-1)
    assert not bad.any(), f"non-finite rows at logits {[logits[i] for i in bad.nonzero().flatten().tolist()][:8]}"
    assert float((o - r).abs().max()) <= 1 / 16, float((o - r).abs().max())
    lg = torch.tensor(logits, dtype=torch.float32)
    assert ((lse.cpu() - ref_lse).abs()[0, 0] <= 2e-3 + 4e-7 * lg).all()
