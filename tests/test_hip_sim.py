"""The HIP kernel sources executed on the CPU (kernels/hip/host_sim.py): the same text as on gfx12, with
the gfx12 WMMA emulation, one OS thread per GPU thread. Small shapes only: CI has two cores.

Checks: every emulated WMMA builtin against a plain matrix product (bit-exact), the prologue against
quant.quantize_qkv_torch (bit-exact) for strided views and every quantization group, the INT8 Q.K^T
products of the attention path (bit-exact), and attention outputs/LSE against the reference."""
import math

import pytest
import torch

from comfyui_sage_rdna4.kernels.hip import host_sim, verify

pytestmark = pytest.mark.skipif(host_sim.host_compiler() is None, reason="no host C++ compiler for the simulator")
CPU = torch.device("cpu")
run = host_sim.run


@pytest.mark.parametrize("kind", ["iu8", "fp8", "f16"])
def test_emulated_wmma_matches_matrix_product(kind):
    for seed in range(2):
        got, want = verify.run_wmma(run, kind, CPU, seed)
        assert torch.equal(got, want.to(got.dtype)), (kind, (got - want).abs().max())


@pytest.mark.parametrize("dtype,d,pv,group,layout", [
    (torch.float16, 128, "fp8", "token", "hnd"),
    (torch.bfloat16, 64, "fp16", "block32", "nhd"),
    (torch.bfloat16, 128, "fp8", "block64", "fused"),
    (torch.float16, 64, "fp8", "block128", "fused"),
])
def test_prologue_bit_exact(dtype, d, pv, group, layout):
    q, k, v = verify.make_qkv(1, 2, 2 if layout == "fused" else 1, 150, 150 if layout == "fused" else 97, d,
                              dtype, CPU, layout=layout)
    sm = 1 / math.sqrt(d)
    for smooth in (True, False):
        qq = verify.prologue(run, q, k, v, sm_scale=sm, smooth_k=smooth, pv=pv, qk_group=group)
        assert verify.prologue_mismatches(qq, q, k, v, sm_scale=sm, smooth_k=smooth, pv=pv, qk_group=group) == {}


def test_prologue_v_scale_guards_fp8_and_fp16_ranges():
    """V far beyond e4m3 range (and beyond fp16 range for bf16) must not saturate."""
    q, k, v = verify.make_qkv(1, 1, 1, 40, 40, 64, torch.bfloat16, CPU)
    v = (v.float() * 1e6).to(torch.bfloat16)
    for pv in ("fp8", "fp16"):
        qq = verify.prologue(run, q, k, v, sm_scale=0.125, pv=pv)
        assert verify.prologue_mismatches(qq, q, k, v, sm_scale=0.125, pv=pv) == {}
        assert torch.isfinite(qq.v.float()).all()
        assert float(qq.v.float().abs().max()) <= (448.0 if pv == "fp8" else 32768.0)


@pytest.mark.parametrize("d,nq,nk,hq,hkv", [(128, 70, 100, 2, 1), (64, 130, 33, 1, 1)])
def test_qk_scores_bit_exact(d, nq, nk, hq, hkv):
    from comfyui_sage_rdna4.kernels import quant
    q, k, v = verify.make_qkv(1, hq, hkv, nq, nk, d, torch.float16, CPU)
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=1 / math.sqrt(d))
    assert torch.equal(verify.qk_scores(run, qq), verify.qk_scores_expected(qq))


@pytest.mark.parametrize("pv,d,dtype,causal,nq,nk,hq,hkv,layout", [
    ("fp8", 128, torch.float16, False, 70, 100, 2, 1, "hnd"),
    ("fp8", 128, torch.bfloat16, True, 150, 150, 1, 1, "fused"),
    ("fp16", 64, torch.bfloat16, True, 130, 70, 2, 1, "hnd"),
    ("fp16", 128, torch.float16, False, 40, 130, 1, 1, "nhd"),
    ("fp8", 64, torch.float16, True, 20, 200, 1, 1, "hnd"),
])
def test_attention_matches_reference(pv, d, dtype, causal, nq, nk, hq, hkv, layout):
    q, k, v = verify.make_qkv(1, hq, hkv, nq, nk, d, dtype, CPU, layout=layout)
    sm = 1 / math.sqrt(d)
    qq = verify.prologue(run, q, k, v, sm_scale=sm, pv=pv)
    out, lse = verify.attention(run, qq, pv=pv, is_causal=causal, out_dtype=dtype, return_lse=True, q=q, sm_scale=sm)
    rep = verify.attention_report(out, lse, qq, q, k, v, pv=pv, is_causal=causal, sm_scale=sm)
    verify.assert_attention_ok(rep, pv)


def test_attention_writes_into_an_nhd_output_view():
    q, k, v = verify.make_qkv(1, 2, 2, 50, 50, 64, torch.float16, CPU)
    from comfyui_sage_rdna4.kernels import quant
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv="fp16")
    buf = torch.full((1, 50, 2, 64), float("nan"), dtype=torch.float16)
    out, _ = verify.attention(run, qq, pv="fp16", is_causal=False, out_dtype=torch.float16, out=buf.transpose(1, 2))
    ref, _ = verify.attention(run, qq, pv="fp16", is_causal=False, out_dtype=torch.float16)
    assert torch.equal(buf.transpose(1, 2), ref)


def test_lse_without_smooth_k_and_gqa():
    q, k, v = verify.make_qkv(1, 4, 2, 90, 75, 64, torch.bfloat16, CPU, k_offset=0.5)
    qq = verify.prologue(run, q, k, v, sm_scale=0.125, smooth_k=False, pv="fp8")
    assert qq.k_mean is None
    out, lse = verify.attention(run, qq, pv="fp8", is_causal=False, out_dtype=torch.bfloat16, return_lse=True,
                                q=q, sm_scale=0.125)
    rep = verify.attention_report(out, lse, qq, q, k, v, pv="fp8", is_causal=False, sm_scale=0.125)
    verify.assert_attention_ok(rep, "fp8")
    assert rep["lse_max_abs_vs_exact"] < 0.05, rep
