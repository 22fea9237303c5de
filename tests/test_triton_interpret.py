"""The Triton kernels' numerics on the CPU, under TRITON_INTERPRET=1.

Triton decides interpreted-or-compiled when a kernel is defined (at import), so these tests run in a
child pytest with TRITON_INTERPRET=1 set from the start; the parent process (no interpreter) only
starts that child and checks the CPU refusal. bf16 inputs are tested by upcasting to fp32 here (the
interpreter's bf16 conversions are not exact) and natively on the GPU (test_triton_gpu.py).
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from comfyui_sage_rdna4.kernels import metrics, quant, reference  # noqa: E402
from comfyui_sage_rdna4.kernels.api import sage_attention  # noqa: E402
from comfyui_sage_rdna4.kernels.call_spec import describe_call  # noqa: E402
from comfyui_sage_rdna4.kernels.registry import KernelRefused, get_backend  # noqa: E402

# Padded rows divide by the tiny amax clamp (1/tiny overflows to inf, masked out on store) and the NaN
# test feeds NaNs on purpose: numpy warns about both.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:All-NaN slice:RuntimeWarning")

CHILD = os.environ.get("TRITON_INTERPRET", "0") == "1"
ROOT = Path(__file__).resolve().parents[1]


if not CHILD:
    def test_cpu_without_interpreter_is_refused_with_reason():
        from comfyui_sage_rdna4.kernels.backends.triton.backend import CPU_REASON
        q = torch.randn(1, 1, 8, 64)
        call = describe_call(q, q, q)
        for name in ("triton_int8_fp8", "triton_int8_fp16"):
            backend = get_backend(name)
            assert backend.why_not(call) == CPU_REASON
            with pytest.raises(KernelRefused, match="TRITON_INTERPRET=1"):
                sage_attention(q, q, q, kernel=name)

    def test_interpreter_suite_in_child_process():
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
               str(Path(__file__)), "-x"]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        print(r.stdout[-6000:])
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
        assert " passed" in r.stdout and " failed" not in r.stdout

else:
    from comfyui_sage_rdna4.kernels.backends.triton.attention import attention_from_quantized_triton
    from comfyui_sage_rdna4.kernels.backends.triton.configs import attention_config
    from comfyui_sage_rdna4.kernels.backends.triton.prologue import triton_quantize_qkv

    def make_qkv(b, hq, hkv, nq, nk, d, dtype=torch.float32, dv=None, seed=0, k_offset=3.0):
        g = torch.Generator().manual_seed(seed)
        dv = dv or d
        q = torch.randn(b, hq, nq, d, generator=g)
        k = torch.randn(b, hkv, nk, d, generator=g) + k_offset * torch.randn(b, hkv, 1, d, generator=g)
        v = torch.randn(b, hkv, nk, dv, generator=g)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def assert_same_quantization(got: quant.QuantizedQKV, want: quant.QuantizedQKV):
        assert torch.equal(got.q8, want.q8), "q8 differs from the torch spec"
        torch.testing.assert_close(got.q_scale, want.q_scale, rtol=0, atol=0)
        # K is smoothed with a mean that may differ from the FP64 one in the last bit: allow a rare +-1.
        diff = (got.k8.int() - want.k8.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
        torch.testing.assert_close(got.k_scale, want.k_scale, rtol=1e-5, atol=0)
        assert got.v.dtype == want.v.dtype and got.v.shape == want.v.shape
        assert torch.equal(got.v.float(), want.v.float()), "V quantization differs from the torch spec"
        torch.testing.assert_close(got.v_scale, want.v_scale, rtol=0, atol=0)
        if want.k_mean is None:
            assert got.k_mean is None
        else:
            torch.testing.assert_close(got.k_mean, want.k_mean, rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("smooth_k,qk_group,d", [(True, "token", 64), (False, "token", 40),
                                                     (True, "block32", 80), (True, "block64", 128)])
    def test_prologue_matches_torch_spec(pv, dtype, smooth_k, qk_group, d):
        q, k, v = make_qkv(1, 4, 2, 77, 101, d, dtype)
        sm = 1.0 / math.sqrt(d)
        got = triton_quantize_qkv(q, k, v, sm_scale=sm, smooth_k=smooth_k, pv=pv, qk_group=qk_group)
        want = quant.quantize_qkv_torch(q, k, v, sm_scale=sm, smooth_k=smooth_k, pv=pv, qk_group=qk_group)
        assert_same_quantization(got, want)

    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    def test_prologue_long_sequence_path_with_separate_finalize(pv, monkeypatch):
        # Long sequences reduce the stats partials in their own launch, CH chunks per step; shrink CH
        # so 200 keys (4 chunks on the CPU) take that path and its loop runs twice.
        from comfyui_sage_rdna4.kernels.backends.triton import prologue
        monkeypatch.setattr(prologue, "STATS_CH", 2)
        q, k, v = make_qkv(1, 2, 2, 50, 200, 64)
        got = triton_quantize_qkv(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv)
        want = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv)
        assert_same_quantization(got, want)

    def test_prologue_reads_fused_qkv_views_in_place():
        # (B, N, 3, H, D) projection output: q, k, v are strided NHD views, seen as HND.
        g = torch.Generator().manual_seed(3)
        qkv = torch.randn(2, 70, 3, 3, 64, generator=g, dtype=torch.float32)
        qkv[:, :, 1] += 2.0 * torch.randn(64, generator=g)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        assert not q.is_contiguous()
        for pv in ("fp8", "fp16"):
            got = triton_quantize_qkv(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv)
            want = quant.quantize_qkv_torch(q.contiguous(), k.contiguous(), v.contiguous(), sm_scale=0.125,
                                            smooth_k=True, pv=pv)
            assert_same_quantization(got, want)

    def test_prologue_edge_values():
        # An all-zero token (0 * inf scale) quantizes to zeros; huge V never overflows FP8 or FP16.
        q, k, v = make_qkv(1, 1, 1, 40, 40, 64)
        q[0, 0, 5] = 0.0
        v[0, 0, 3, :8] = 1e6
        for pv in ("fp8", "fp16"):
            got = triton_quantize_qkv(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv)
            assert torch.equal(got.q8[0, 0, 5], torch.zeros(64, dtype=torch.int8))
            assert torch.isfinite(got.v.float()).all()
            assert float(got.v.float().abs().max()) <= (448.0 if pv == "fp8" else 32768.0)
            want = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv)
            torch.testing.assert_close(got.v_scale, want.v_scale, rtol=0, atol=0)

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
    def test_nan_inputs_give_nan_where_exact_attention_does(kernel):
        # Hardware max drops NaNs; the prologue's amax must not, or a NaN would come out as a number.
        for where in ("q", "k", "v"):
            q, k, v = make_qkv(1, 2, 2, 40, 40, 64, torch.float16)
            {"q": q, "k": k, "v": v}[where][0, 1, 7, 3] = float("nan")
            out = sage_attention(q, k, v, kernel=kernel)
            exact, _ = reference.exact_attention(q, k, v)
            bad = ~torch.isfinite(exact)
            assert bad.any()
            assert not torch.isfinite(out[bad]).any(), f"NaN in {where} came out finite"
            assert torch.isfinite(out[~bad]).all()

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
    def test_fp16_max_value_channel_stays_finite(kernel):
        # A V channel holding 65504 everywhere averages to 65504; rounded P must not push it to Inf.
        q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.float16)
        v[..., 5] = 65504.0
        out = sage_attention(q, k, v, kernel=kernel)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[..., 5].float(), torch.full_like(out[..., 5].float(), 65504.0), rtol=0.07,
                                   atol=0)

    ATTN_CASES = [
        # b, hq, hkv, nq, nk, d, causal
        (1, 2, 2, 100, 100, 64, False),
        (1, 2, 2, 100, 100, 64, True),
        (2, 4, 2, 45, 130, 128, False),   # GQA, Nq < Nk, tails
        (1, 2, 1, 130, 45, 64, True),     # Nq > Nk, causal top-left
        (1, 1, 1, 64, 96, 40, False),     # padded head dim (SD1.5)
        (1, 1, 1, 33, 70, 160, True),     # padded to 256
    ]

    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    @pytest.mark.parametrize("case", ATTN_CASES)
    def test_attention_matches_reference_from_same_quantization(pv, case):
        b, hq, hkv, nq, nk, d, causal = case
        q, k, v = make_qkv(b, hq, hkv, nq, nk, d)
        sm = 1.0 / math.sqrt(d)
        qq = quant.quantize_qkv_torch(q, k, v, sm_scale=sm, smooth_k=True, pv=pv)
        out, lse = attention_from_quantized_triton(qq, pv=pv, config=attention_config("cpu", d, pv),
                                                   is_causal=causal, return_lse=True, out_dtype=torch.float32)
        ref, ref_lse = reference.attention_from_quantized(qq, pv=pv, is_causal=causal, return_lse=True)
        # FP16 P.V differs only by summation order; FP8 also rounds P against the running row max.
        assert metrics.cosine(out, ref) >= (0.99999 if pv == "fp16" else 0.9995)
        assert metrics.rel_l1(out, ref) <= (1e-3 if pv == "fp16" else 0.03)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)  # LSE of the smoothed scores

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("causal", [False, True])
    def test_backend_end_to_end_against_exact(kernel, dtype, causal):
        q, k, v = make_qkv(1, 3, 3, 90, 90, 64, seed=7)
        run_dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # interpreter: bf16 by upcast
        q, k, v = (t.to(dtype).to(run_dtype) for t in (q, k, v))
        # NHD views, as ComfyUI hands them over.
        qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out, lse = sage_attention(qn, kn, vn, tensor_layout="NHD", is_causal=causal, kernel=kernel,
                                  return_lse=True)
        assert out.dtype == run_dtype and out.shape == qn.shape
        exact, exact_lse = reference.exact_attention(q, k, v, is_causal=causal, return_lse=True)
        out_hnd = out.transpose(1, 2).float()
        assert metrics.cosine(out_hnd, exact) >= 0.998
        pv = kernel.rsplit("_", 1)[1]
        spec, spec_lse = reference.reference_attention(q, k, v, is_causal=causal, pv=pv, return_lse=True)
        assert metrics.cosine(out_hnd, spec.float()) >= 0.9995
        # LSE with the smooth_k term added back is the true one, up to INT8 score error.
        torch.testing.assert_close(lse, spec_lse, rtol=0, atol=2e-3)
        assert float((lse - exact_lse).abs().max()) < 0.05

    def test_refusals_are_stated():
        q = torch.randn(1, 2, 16, 64)
        b = get_backend("triton_int8_fp8")
        assert b.unavailable("cpu") is None  # the interpreter makes CPU tensors acceptable
        mask = torch.ones(16, 16, dtype=torch.bool)
        assert "mask" in b.why_not(describe_call(q, q, q, attn_mask=mask))
        big = torch.randn(1, 1, 4, 288)
        assert "256" in b.why_not(describe_call(big, big, big))
        assert "dtype" in b.why_not(describe_call(q.double(), q.double(), q.double()))
        reason = b.why_not(describe_call(q, q, q, prologue="hip"))
        # Without a HIP prologue (or a GPU for it) the call is refused, never silently re-routed.
        assert reason is None or "HIP" in reason
        with pytest.raises(KernelRefused):
            sage_attention(q, q, q, kernel="triton_int8_fp8", attn_mask=mask)
