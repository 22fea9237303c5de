"""The HIP kernel sources executed on the CPU (kernels/verify/host_sim.py): the same text as on gfx12, with
the gfx12 WMMA emulation, one OS thread per GPU thread. Small shapes only: CI has two cores.

Checks: every emulated WMMA builtin against a plain matrix product (bit-exact), the prologue against
quant.quantize_qkv_torch (bit-exact) for strided views and every quantization group, the INT8 Q.K^T
products of the attention path (bit-exact), and attention outputs/LSE against the reference; the spec's
NaN rule (NaN/Inf in q, k or v reaches the output as NaN where the spec puts it, never finite garbage) and its
overflow-safe output (V at the fp16/bf16 maximum stays finite)."""
import math

import pytest
import torch

from comfyui_sage_rdna4.kernels.verify import hip_checks, host_sim

pytestmark = pytest.mark.skipif(host_sim.host_compiler() is None, reason="no host C++ compiler for the simulator")
CPU = torch.device("cpu")
run = host_sim.run


@pytest.mark.parametrize("kind", ["iu8", "fp8", "f16"])
def test_emulated_wmma_matches_matrix_product(kind):
    for seed in range(2):
        got, want = hip_checks.run_wmma(run, kind, CPU, seed)
        assert torch.equal(got, want.to(got.dtype)), (kind, (got - want).abs().max())


@pytest.mark.parametrize("dtype,d,pv,group,layout", [
    (torch.float16, 128, "fp8", "token", "hnd"),
    (torch.bfloat16, 64, "fp16", "block32", "nhd"),
    (torch.bfloat16, 128, "fp8", "block64", "fused"),
    (torch.float16, 64, "fp8", "block128", "fused"),
])
def test_prologue_bit_exact(dtype, d, pv, group, layout):
    q, k, v = hip_checks.make_qkv(1, 2, 2 if layout == "fused" else 1, 150, 150 if layout == "fused" else 97, d,
                              dtype, CPU, layout=layout)
    sm = 1 / math.sqrt(d)
    for smooth in (True, False):
        qq = hip_checks.prologue(run, q, k, v, sm_scale=sm, smooth_k=smooth, pv=pv, qk_group=group)
        assert hip_checks.prologue_mismatches(qq, q, k, v, sm_scale=sm, smooth_k=smooth, pv=pv, qk_group=group) == {}


def test_prologue_v_scale_guards_fp8_and_fp16_ranges():
    """V far beyond e4m3 range (and beyond fp16 range for bf16) must not saturate."""
    q, k, v = hip_checks.make_qkv(1, 1, 1, 40, 40, 64, torch.bfloat16, CPU)
    v = (v.float() * 1e6).to(torch.bfloat16)
    for pv in ("fp8", "fp16"):
        qq = hip_checks.prologue(run, q, k, v, sm_scale=0.125, pv=pv)
        assert hip_checks.prologue_mismatches(qq, q, k, v, sm_scale=0.125, pv=pv) == {}
        assert torch.isfinite(qq.v.float()).all()
        assert float(qq.v.float().abs().max()) <= (448.0 if pv == "fp8" else 32768.0)


@pytest.mark.parametrize("d,nq,nk,hq,hkv", [(128, 70, 100, 2, 1), (64, 130, 33, 1, 1)])
def test_qk_scores_bit_exact(d, nq, nk, hq, hkv):
    from comfyui_sage_rdna4.kernels import quant
    q, k, v = hip_checks.make_qkv(1, hq, hkv, nq, nk, d, torch.float16, CPU)
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=1 / math.sqrt(d))
    assert torch.equal(hip_checks.qk_scores(run, qq), hip_checks.qk_scores_expected(qq))


@pytest.mark.parametrize("pv,d,dtype,causal,nq,nk,hq,hkv,layout", [
    ("fp8", 128, torch.float16, False, 70, 100, 2, 1, "hnd"),
    ("fp8", 128, torch.bfloat16, True, 150, 150, 1, 1, "fused"),
    ("fp16", 64, torch.bfloat16, True, 130, 70, 2, 1, "hnd"),
    ("fp16", 128, torch.float16, False, 40, 130, 1, 1, "nhd"),
    ("fp8", 64, torch.float16, True, 20, 200, 1, 1, "hnd"),
])
def test_attention_matches_reference(pv, d, dtype, causal, nq, nk, hq, hkv, layout):
    q, k, v = hip_checks.make_qkv(1, hq, hkv, nq, nk, d, dtype, CPU, layout=layout)
    sm = 1 / math.sqrt(d)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=sm, pv=pv)
    out, lse = hip_checks.attention(run, qq, pv=pv, is_causal=causal, out_dtype=dtype, return_lse=True, q=q,
                                    sm_scale=sm)
    rep = hip_checks.attention_report(out, lse, qq, q, k, v, pv=pv, is_causal=causal, sm_scale=sm)
    hip_checks.assert_attention_ok(rep, pv)


def test_attention_writes_into_an_nhd_output_view():
    q, k, v = hip_checks.make_qkv(1, 2, 2, 50, 50, 64, torch.float16, CPU)
    from comfyui_sage_rdna4.kernels import quant
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv="fp16")
    buf = torch.full((1, 50, 2, 64), float("nan"), dtype=torch.float16)
    out, _ = hip_checks.attention(run, qq, pv="fp16", is_causal=False, out_dtype=torch.float16, out=buf.transpose(1, 2))
    ref, _ = hip_checks.attention(run, qq, pv="fp16", is_causal=False, out_dtype=torch.float16)
    assert torch.equal(buf.transpose(1, 2), ref)


def test_lse_without_smooth_k_and_gqa():
    q, k, v = hip_checks.make_qkv(1, 4, 2, 90, 75, 64, torch.bfloat16, CPU, k_offset=0.5)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=0.125, smooth_k=False, pv="fp8")
    assert qq.k_mean is None
    out, lse = hip_checks.attention(run, qq, pv="fp8", is_causal=False, out_dtype=torch.bfloat16, return_lse=True,
                                q=q, sm_scale=0.125)
    rep = hip_checks.attention_report(out, lse, qq, q, k, v, pv="fp8", is_causal=False, sm_scale=0.125)
    hip_checks.assert_attention_ok(rep, "fp8")
    assert rep["lse_max_abs_vs_exact"] < 0.05, rep



# ------------------------------------------------------------------------------------------------------
# NaN/Inf propagation and the overflow-safe output cast (the spec's rules in quant.py / reference.py)
# ------------------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
T, C = hip_checks.POISON_TOKEN, hip_checks.POISON_CHANNEL


@pytest.mark.parametrize("where,value,pv,group,smooth", [
    ("q", NAN, "fp8", "token", True),
    ("q", INF, "fp16", "block32", True),
    ("k", -INF, "fp16", "block64", False),
    ("k", INF, "fp8", "token", True),
    ("v", NAN, "fp16", "token", True),
])
def test_prologue_keeps_nan_and_inf_where_the_spec_does(where, value, pv, group, smooth):
    """A NaN/Inf element gives its token (or block, or V channel) a NaN/Inf scale exactly where
    quant.quantize_qkv_torch does, with the same int8 values, and every finite field stays bit-exact.
    An fmaxf-based amax would give the bad token a finite scale (and finite garbage) instead.
    (test_attention_propagates_nan_and_inf checks the prologue of its cases the same way.)"""
    q, k, v = hip_checks.poisoned_qkv(where, value, torch.float16, CPU)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=0.125, smooth_k=smooth, pv=pv, qk_group=group)
    assert hip_checks.prologue_mismatches(qq, q, k, v, sm_scale=0.125, smooth_k=smooth, pv=pv, qk_group=group) == {}
    if where == "q":
        bad = qq.q_scale[0, 0, 0:32] if group == "block32" else qq.q_scale[0, 0, T:T + 1]
        assert not torch.isfinite(bad).any() and torch.isfinite(qq.q_scale[0, 0, 32:]).all()
        assert not qq.q8[0, 0, T].any()  # int8 0, as torch casts NaN
    elif where == "k":
        bad = qq.k_scale[0, 0] if smooth else (qq.k_scale[0, 0, 0:64] if group == "block64" else qq.k_scale[0, 0, T])
        assert not torch.isfinite(bad).any()
        assert bool(torch.isfinite(qq.k_scale[0, 0, 64:]).all()) == (not smooth)
    else:
        assert not torch.isfinite(qq.v_scale[0, 0, C]) and torch.isfinite(qq.v_scale[0, 0, C + 1:]).all()
        assert torch.isnan(qq.v.float()[0, 0, T, C])


@pytest.mark.parametrize("where,value,pv,causal,smooth", [
    ("q", NAN, "fp8", False, True),
    ("q", INF, "fp16", True, True),
    ("q", -INF, "fp8", True, False),
    ("k", NAN, "fp8", True, False),
    ("k", INF, "fp16", True, False),
    ("k", NAN, "fp16", False, True),
    ("v", NAN, "fp8", True, True),
    ("v", INF, "fp8", False, True),
    ("v", -INF, "fp16", True, True),
])
def test_attention_propagates_nan_and_inf(where, value, pv, causal, smooth):
    """NaN/Inf in q, k or v comes out as NaN exactly where the spec's attention is not finite (the bad query's
    row; the rows that see the bad key; the bad V channel), never as a finite value where exact attention is
    not finite (test_fuzz's rule), with a NaN LSE where the spec's is NaN; all else matches the spec."""
    dtype = torch.bfloat16 if where == "k" else torch.float16
    q, k, v = hip_checks.poisoned_qkv(where, value, dtype, CPU)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=0.125, smooth_k=smooth, pv=pv)
    assert hip_checks.prologue_mismatches(qq, q, k, v, sm_scale=0.125, smooth_k=smooth, pv=pv) == {}
    out, lse = hip_checks.attention(run, qq, pv=pv, is_causal=causal, out_dtype=dtype, return_lse=True, q=q,
                                sm_scale=0.125)
    hip_checks.assert_nonfinite_like_spec(out, lse, qq, q, k, v, where=where, pv=pv, is_causal=causal, sm_scale=0.125,
                                      smooth_k=smooth)


@pytest.mark.parametrize("dtype,v_max,pv", [
    (torch.float16, 65504.0, "fp8"),
    (torch.float16, 65504.0, "fp16"),
    (torch.bfloat16, 3e38, "fp8"),
    (torch.bfloat16, 3e38, "fp16"),
])
def test_attention_output_is_overflow_safe(dtype, v_max, pv):
    """V at the top of its dtype's range: a channel holding +-v_max everywhere comes out as about +-v_max and
    finite. FP8 rounding of P lifts a convex combination up to ~6 % above max|V| (65504 -> Inf in fp16 without
    the saturating cast), and acc * v_scale before the division overflows FP32 for bf16 near its max."""
    q, k, v = hip_checks.overflow_qkv(dtype, v_max, CPU)
    qq = hip_checks.prologue(run, q, k, v, sm_scale=0.125, pv=pv)
    out, _ = hip_checks.attention(run, qq, pv=pv, is_causal=True, out_dtype=dtype)
    hip_checks.assert_overflow_safe(out, qq, v, pv=pv, is_causal=True)
