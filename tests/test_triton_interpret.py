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
# The interpreter runs every program instance in Python (a case takes 0.3-3 s): the default run keeps at least one
# case of every test, the rest of each matrix is marked slow (CI runs them: test_interpreter_suite_in_child_process).
SLOW = pytest.mark.slow


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

    def test_a_prologue_that_drops_smooth_v_fails_the_call(monkeypatch):
        """A prologue that ignores smooth_v (no v_mean back) fails the call instead of returning V without its
        mean."""
        from comfyui_sage_rdna4.kernels.backends.triton import backend as tb

        q = torch.randn(1, 2, 16, 64)
        call = describe_call(q, q, q, prologue="hip", smooth_v=True)
        b = get_backend("triton_int8_fp8")

        def dropping_prologue(q, k, v, *, sm_scale, smooth_k=True, pv="fp8", qk_group="token", smooth_v=False,
                              live=None):
            return quant.quantize_qkv_torch(q, k, v, sm_scale=sm_scale, smooth_k=smooth_k, pv=pv, qk_group=qk_group)

        monkeypatch.setattr(tb, "_hip_prologue", lambda: (lambda c: None, dropping_prologue))
        assert b.refuse(call) is None
        with pytest.raises(RuntimeError, match="v_mean"):
            b.launch(q, q, q, call, 0.125, None)  # the prologue dropped smooth_v: v_mean is None

    def test_accumulation_modes_per_arch():
        from comfyui_sage_rdna4.kernels.backends.triton import configs
        assert configs.accumulation_of("sm_90", 128, "fp8") == "imprecise_k"
        assert configs.accumulation_of("sm_89", 128, "fp8") == "split"
        for arch in configs.RDNA4_ARCHS:
            assert configs.accumulation_of(arch, 128, "fp8") == "split"
        for arch in ("sm_90", "sm_89", "sm_80", "gfx1201", "cpu"):
            for d in (64, 128, 256):
                assert configs.accumulation_of(arch, d, "fp16") == "mma"
        assert "pv_accumulate='imprecise_k'" in repr(configs.attention_config("sm_90", 128, "fp8"))
        with pytest.raises(ValueError, match="pv_accumulate"):
            configs.AttentionConfig(128, 64, 4, 1, pv_accumulate="fast")

    def test_scale_row_stride_rule():
        """How the attention kernel addresses (B, H, N) scales: row b * H + h at one stride, or a refusal."""
        from comfyui_sage_rdna4.kernels.backends.triton.attention import _scale_row_stride
        assert _scale_row_stride(torch.empty(2, 3, 10)) == 10
        assert _scale_row_stride(torch.empty(2, 3, 16)[:, :, :10]) == 16
        assert _scale_row_stride(torch.empty(2, 1, 10)) == 10
        assert _scale_row_stride(torch.empty(1, 1, 10)) == 16  # one row: any stride serves; 16 shares a compile
        assert _scale_row_stride(torch.empty(2, 10).unsqueeze(1)) == 10  # a size-1 head dim of stride 1
        assert _scale_row_stride(torch.empty(3, 2, 10).transpose(0, 1)) is None  # rows not evenly spaced
        assert _scale_row_stride(torch.empty(2, 10, 3).transpose(1, 2)) is None  # scales not unit-stride

    @pytest.mark.timeout(900)  # the child's own limit below; its tests have theirs (pyproject.toml)
    @pytest.mark.parametrize("child_marks", [pytest.param("not slow", id="quick"),
                                             pytest.param("slow", id="full", marks=SLOW)])
    def test_interpreter_suite_in_child_process(child_marks):
        """The default run's child runs the interpreter tests not marked slow, the slow run's child the others."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
               str(Path(__file__)), "-x", "-m", child_marks]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        print(r.stdout[-6000:])
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
        assert " passed" in r.stdout and " failed" not in r.stdout

else:
    import dataclasses

    import triton
    import triton.language as tl

    @triton.jit
    def _unrounded_shift(row_max, TOP: tl.constexpr, EXACT_S: tl.constexpr, MAY_BE_EMPTY: tl.constexpr = True):
        """The FP8 shift as it was: fl(row_max - log2(447.8)), which can land below the exact value (FP8 calls only)."""
        return row_max - tl.constexpr(8.8067)

    @triton.jit
    def _unraised_shift(row_max, TOP: tl.constexpr, EXACT_S: tl.constexpr, MAY_BE_EMPTY: tl.constexpr = True):
        """The FP16 shift as it was: fl(row_max - 15), with no room for its rounding or an FMA's unrounded product."""
        return row_max - TOP

    from comfyui_sage_rdna4.kernels.backends.triton.attention import attention_from_quantized_triton
    from comfyui_sage_rdna4.kernels.backends.triton.configs import PV_ACCUMULATE, attention_config
    from comfyui_sage_rdna4.kernels.backends.triton.prologue import triton_quantize_qkv

    def make_qkv(b, hq, hkv, nq, nk, d, dtype=torch.float32, dv=None, seed=0, k_offset=3.0, v_offset=False):
        g = torch.Generator().manual_seed(seed)
        dv = dv or d
        q = torch.randn(b, hq, nq, d, generator=g)
        k = torch.randn(b, hkv, nk, d, generator=g) + k_offset * torch.randn(b, hkv, 1, d, generator=g)
        v = torch.randn(b, hkv, nk, dv, generator=g)
        if v_offset:  # a per-channel V offset, as video models have: what smooth_v takes out
            v = v + 2.0 + 2.0 * torch.randn(b, hkv, 1, dv, generator=g).abs()
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def assert_same_quantization(got: quant.QuantizedQKV, want: quant.QuantizedQKV):
        """Bit for bit. The means too: the prologue sums each chunk with TwoSum and the chunks in FP64, so its
        mean is the spec's FP64 one before the final rounding (they could part only on an exact tie)."""
        assert torch.equal(got.q8, want.q8), "q8 differs from the torch spec"
        torch.testing.assert_close(got.q_scale, want.q_scale, rtol=0, atol=0)
        assert torch.equal(got.k8, want.k8), "k8 differs from the torch spec"
        torch.testing.assert_close(got.k_scale, want.k_scale, rtol=0, atol=0)
        assert got.v.dtype == want.v.dtype and got.v.shape == want.v.shape
        assert torch.equal(got.v.float(), want.v.float()), "V quantization differs from the torch spec"
        torch.testing.assert_close(got.v_scale, want.v_scale, rtol=0, atol=0)
        for name in ("k_mean", "v_mean"):
            if getattr(want, name) is None:
                assert getattr(got, name) is None, f"{name} should be None"
            else:
                torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)

    @pytest.mark.parametrize("pv", ["fp8", pytest.param("fp16", marks=SLOW)])
    @pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.float32, marks=SLOW)])
    @pytest.mark.parametrize("smooth_k,qk_group,d", [(True, "token", 64), (False, "token", 40),
                                                     (True, "block32", 80), (True, "block64", 128)])
    def test_prologue_matches_torch_spec(pv, dtype, smooth_k, qk_group, d):
        q, k, v = make_qkv(1, 4, 2, 77, 101, d, dtype)
        sm = 1.0 / math.sqrt(d)
        got = triton_quantize_qkv(q, k, v, sm_scale=sm, smooth_k=smooth_k, pv=pv, qk_group=qk_group)
        want = quant.quantize_qkv_torch(q, k, v, sm_scale=sm, smooth_k=smooth_k, pv=pv, qk_group=qk_group)
        assert_same_quantization(got, want)

    @pytest.mark.parametrize("pv", ["fp8", pytest.param("fp16", marks=SLOW)])
    @pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.float32, marks=SLOW)])
    @pytest.mark.parametrize("smooth_k,qk_group,d,dv", [(True, "token", 64, 64), (False, "block32", 80, 40)])
    def test_prologue_smooth_v_matches_torch_spec(pv, dtype, smooth_k, qk_group, d, dv):
        # V with a per-channel offset (what smooth_v is for), GQA, tails, and V narrower than Q/K.
        q, k, v = make_qkv(2, 4, 2, 45, 101, d, dtype, dv=dv, seed=11, v_offset=True)
        sm = 1.0 / math.sqrt(d)
        got = triton_quantize_qkv(q, k, v, sm_scale=sm, smooth_k=smooth_k, pv=pv, qk_group=qk_group, smooth_v=True)
        want = quant.quantize_qkv_torch(q, k, v, sm_scale=sm, smooth_k=smooth_k, pv=pv, qk_group=qk_group,
                                        smooth_v=True)
        assert got.v_mean is not None and got.v_mean.shape == (2, 2, dv) and got.v_mean.dtype == torch.float32
        assert_same_quantization(got, want)
        # The point of it: V's FP8 scale shrinks by the offset.
        plain = quant.quantize_qkv_torch(q, k, v, sm_scale=sm, pv=pv)
        if pv == "fp8":
            assert float((got.v_scale / plain.v_scale).mean()) < 0.7

    def test_prologue_smooth_v_edge_values():
        # A constant V channel (zero after its mean: amax 0, scale clamped to tiny, codes 0), a channel
        # whose extremes sit on one side of the mean, and near-max values (the mean of 65504s is 65504).
        q, k, v = make_qkv(1, 2, 2, 40, 70, 64, torch.float16, seed=4)
        v[:, :, :, 0] = 3.0
        v[:, :, :, 1] = 65504.0
        v[:, :, 5, 2] = 60000.0
        v[:, :, :, 3] = v[:, :, :, 3].abs() + 100.0
        for pv in ("fp8", "fp16"):
            got = triton_quantize_qkv(q, k, v, sm_scale=0.125, pv=pv, smooth_v=True)
            want = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv=pv, smooth_v=True)
            assert_same_quantization(got, want)
            assert torch.isfinite(got.v.float()).all()
            assert float(got.v_mean[0, 0, 1]) == 65504.0 and not got.v.float()[..., :2].any()

    @pytest.mark.parametrize("pv", ["fp8", pytest.param("fp16", marks=SLOW)])
    def test_prologue_long_sequence_path_with_separate_finalize(pv, monkeypatch):
        # Long sequences reduce the stats partials in their own launch, CH chunks per step; shrink CH
        # so 200 keys (4 chunks on the CPU) take that path and its loop runs twice.
        from comfyui_sage_rdna4.kernels.backends.triton import prologue
        monkeypatch.setattr(prologue, "STATS_CH", 2)
        q, k, v = make_qkv(1, 2, 2, 50, 200, 64, v_offset=True)
        for smooth_v in (False, True):
            got = triton_quantize_qkv(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv, smooth_v=smooth_v)
            want = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv, smooth_v=smooth_v)
            assert_same_quantization(got, want)
            # A key-only mask's live keys (a different set per batch) through the same path: the counts reach
            # the finalize launch.
            live = torch.ones(1, 1, 200, dtype=torch.bool)
            live[..., 130:] = False
            got = triton_quantize_qkv(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv, smooth_v=smooth_v, live=live)
            want = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv, smooth_v=smooth_v,
                                            live=live)
            assert_same_quantization(got, want)

    def test_prologue_reads_fused_qkv_views_in_place():
        # (B, N, 3, H, D) projection output: q, k, v are strided NHD views, seen as HND.
        g = torch.Generator().manual_seed(3)
        qkv = torch.randn(2, 70, 3, 3, 64, generator=g, dtype=torch.float32)
        qkv[:, :, 1] += 2.0 * torch.randn(64, generator=g)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        assert not q.is_contiguous()
        for pv, smooth_v in (("fp8", True), ("fp16", False)):
            got = triton_quantize_qkv(q, k, v, sm_scale=0.125, smooth_k=True, pv=pv, smooth_v=smooth_v)
            want = quant.quantize_qkv_torch(q.contiguous(), k.contiguous(), v.contiguous(), sm_scale=0.125,
                                            smooth_k=True, pv=pv, smooth_v=smooth_v)
            assert_same_quantization(got, want)
        # V^T storage (Hopper) carries the same values and the same mean.
        got = triton_quantize_qkv(q, k, v, sm_scale=0.125, pv="fp8", smooth_v=True, v_transposed=True)
        want = quant.quantize_qkv_torch(q.contiguous(), k.contiguous(), v.contiguous(), sm_scale=0.125,
                                        smooth_v=True)
        assert got.v.stride(-2) == 1
        assert_same_quantization(got, want)

    @pytest.mark.parametrize("pv", ["fp8", pytest.param("fp16", marks=SLOW)])
    def test_padded_k_scale_rows_change_nothing(pv):
        """The Triton attention's own prologue call pads k_scale rows to 16 entries and stores V^T rows up to Nk
        rounded up to 64: same values (101 keys: neither is a multiple), and the attention gives the same bits
        from the padded scales as from contiguous ones (GQA, batch 2)."""
        q, k, v = make_qkv(2, 4, 2, 45, 101, 64, seed=5)
        want = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv=pv)
        got = triton_quantize_qkv(q, k, v, sm_scale=0.125, pv=pv, v_transposed=True, pad_k_scale_rows=True)
        assert got.k_scale.stride() == (2 * 112, 112, 1)
        assert_same_quantization(got, want)
        cfg = attention_config("cpu", 64, pv)
        padded = attention_from_quantized_triton(got, pv=pv, config=cfg, out_dtype=torch.float32)[0]
        got.k_scale = got.k_scale.contiguous()
        plain = attention_from_quantized_triton(got, pv=pv, config=cfg, out_dtype=torch.float32)[0]
        assert torch.equal(padded, plain)

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
    @pytest.mark.parametrize("smooth_v", [False, True])
    def test_nan_inputs_give_nan_where_exact_attention_does(kernel, smooth_v):
        # Hardware max drops NaNs; the prologue's amax (and smooth_v's max/min) must not, or a NaN would
        # come out as a number.
        for where in (("q", "k", "v") if not smooth_v else ("k", "v")):
            q, k, v = make_qkv(1, 2, 2, 40, 40, 64, torch.float16)
            {"q": q, "k": k, "v": v}[where][0, 1, 7, 3] = float("nan")
            out = sage_attention(q, k, v, kernel=kernel, smooth_v=smooth_v)
            exact, _ = reference.exact_attention(q, k, v)
            bad = ~torch.isfinite(exact)
            assert bad.any()
            assert not torch.isfinite(out[bad]).any(), f"NaN in {where} came out finite"
            assert torch.isfinite(out[~bad]).all()

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
    @pytest.mark.parametrize("smooth_v", [False, True])
    def test_fp16_max_value_channel_stays_finite(kernel, smooth_v):
        # A V channel holding 65504 everywhere averages to 65504; rounded P (or the mean added back to a
        # rounded zero) must not push it to Inf.
        q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.float16)
        v[..., 5] = 65504.0
        v[..., 6] = 65504.0
        v[:, :, 3, 6] = 60000.0
        out = sage_attention(q, k, v, kernel=kernel, smooth_v=smooth_v)
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

    # The kernel against the spec on its P grid (p_tile = the config's block_n), same quantization: FP16 P.V differs
    # by summation order and FP16 P's running max, FP8 by exp2's last bit (measured over ATTN_CASES and the modes:
    # FP8 <= 2.0e-4, FP16 <= 1.2e-4; against the row grid FP8 differed by 0.5-2.5 %, held to 3 % then).
    SPEC_REL_L1 = {"fp8": 1e-3, "fp16": 5e-4}
    SPEC_COS = 0.99999

    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    @pytest.mark.parametrize("case", ATTN_CASES)
    def test_attention_matches_reference_from_same_quantization(pv, case):
        b, hq, hkv, nq, nk, d, causal = case
        q, k, v = make_qkv(b, hq, hkv, nq, nk, d)
        sm = 1.0 / math.sqrt(d)
        qq = quant.quantize_qkv_torch(q, k, v, sm_scale=sm, smooth_k=True, pv=pv)
        cfg = attention_config("cpu", d, pv)
        out, lse = attention_from_quantized_triton(qq, pv=pv, config=cfg, is_causal=causal, return_lse=True,
                                                   out_dtype=torch.float32)
        ref, ref_lse = reference.attention_from_quantized(qq, pv=pv, is_causal=causal, return_lse=True,
                                                          p_tile=cfg.block_n)
        assert metrics.cosine(out, ref) >= SPEC_COS
        assert metrics.rel_l1(out, ref) <= SPEC_REL_L1[pv]
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)  # LSE of the smoothed scores

    # The kernel against the spec on the kernel's own P grid (reference.attention_from_quantized with p_tile = the
    # config's block_n), FP32 output. Long tail: every row's max in key 0, the other keys 2^-8..2^-16 (FP8) or
    # 2^-25..2^-27 (FP16: fp16 zeros in [0, 1], normals under the 2^15 top) below it; diffuse: near-uniform scores,
    # 4 key tiles. Measured (interpreter): FP8 2.3e-5 / 1.3e-5, FP16 4.0e-6 / 1.3e-5 (FP16 P rounds against the
    # running max, the spec against the final one: the same grid only where the max comes first, as on the tail).
    GRID_CASES = {"fp8": (1024, (8.0, 16.0)), "fp16": (8192, (25.0, 27.0))}
    GRID_TOL = {("fp8", "long_tail"): 2e-4, ("fp8", "diffuse"): 2e-4, ("fp16", "long_tail"): 1.5e-5,
                ("fp16", "diffuse"): 5e-5}

    def grid_case(pv, name):
        from comfyui_sage_rdna4.kernels.verify import hip_checks, subnormal_model
        if name == "long_tail":
            nk, tail = GRID_CASES[pv]
            return subnormal_model.long_tail_qq(pv, nk, tail, batch=1, nq=32, d=64)[0]
        q, k, v = hip_checks.diffuse_qkv(1, 2, 64, 128, 64, torch.float32, torch.device("cpu"), seed=4)
        return quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv=pv)

    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    @pytest.mark.parametrize("name", ["long_tail", "diffuse"])
    def test_attention_matches_spec_on_its_own_p_grid(pv, name):
        """FP8: P against each key tile's own max (floored 64 below the running max), as the HIP kernels; FP16: P
        topped at 2^15. Fails on the kernel that rounded FP8 P against the running max with a 447.797 top (long
        tail 2.5e-3, diffuse 1.9e-3 from the tile grid) and held FP16 P in [0, 1] (long tail 4.3e-5: the tail's P
        were fp16 zeros the row sum still counted); FP16 diffuse (no subnormal P) holds it to the tightness alone."""
        qq = grid_case(pv, name)
        cfg = attention_config("cpu", 64, pv)
        out, lse = attention_from_quantized_triton(qq, pv=pv, config=cfg, return_lse=True, out_dtype=torch.float32)
        ref, ref_lse = reference.attention_from_quantized(qq, pv=pv, return_lse=True, p_tile=cfg.block_n)
        assert metrics.rel_l1(out, ref) <= GRID_TOL[(pv, name)], metrics.rel_l1(out, ref)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=5e-5)

    def check_against_reference(qq, pv, cfg, causal, tol_scale=1.0):
        out, lse = attention_from_quantized_triton(qq, pv=pv, config=cfg, is_causal=causal, return_lse=True,
                                                   out_dtype=torch.float32)
        ref, ref_lse = reference.attention_from_quantized(qq, pv=pv, is_causal=causal, return_lse=True,
                                                          p_tile=cfg.block_n)
        # The same bounds as for the default configs above.
        assert metrics.cosine(out, ref) >= SPEC_COS
        assert metrics.rel_l1(out, ref) <= SPEC_REL_L1[pv] * tol_scale
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)
        return out, ref

    MODE_CASES = [
        # b, hq, hkv, nq, nk, d, causal, smooth_v
        (2, 4, 2, 45, 130, 128, False, True),   # GQA, tails, V offset taken out
        (1, 2, 1, 130, 45, 64, True, False),    # causal top-left, Nq > Nk
    ]

    @pytest.mark.parametrize("mode", PV_ACCUMULATE)
    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    @pytest.mark.parametrize("case", [pytest.param(MODE_CASES[0], marks=SLOW), MODE_CASES[1]])
    def test_every_accumulation_mode_matches_reference(mode, pv, case):
        b, hq, hkv, nq, nk, d, causal, smooth_v = case
        q, k, v = make_qkv(b, hq, hkv, nq, nk, d, seed=5, v_offset=True)
        qq = quant.quantize_qkv_torch(q, k, v, sm_scale=d ** -0.5, pv=pv, smooth_v=smooth_v)
        cfg = dataclasses.replace(attention_config("cpu", d, pv), pv_accumulate=mode)
        check_against_reference(qq, pv, cfg, causal)

    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    @pytest.mark.parametrize("case", [pytest.param((2, 4, 2, 45, 130, 128, False), marks=SLOW),
                                      (1, 2, 1, 100, 100, 64, True), (1, 1, 1, 33, 70, 160, True)])
    def test_epilogue_adds_v_mean(pv, case):
        """smooth_v's mean comes back per channel of each row's KV head (GQA), causal or not; LSE unchanged."""
        b, hq, hkv, nq, nk, d, causal = case
        q, k, v = make_qkv(b, hq, hkv, nq, nk, d, seed=9, v_offset=True)
        qq = quant.quantize_qkv_torch(q, k, v, sm_scale=d ** -0.5, pv=pv, smooth_v=True)
        cfg = attention_config("cpu", d, pv)
        out, ref = check_against_reference(qq, pv, cfg, causal)
        # Against the true output as well: the offset is about 2-8, the varying part about 1 (rows of P sum to 1).
        exact, _ = reference.exact_attention(q, k, v, is_causal=causal)
        assert metrics.rel_l1(out, exact) <= (0.002 if pv == "fp16" else 0.01)
        # Without the mean the output would be off by it: the kernel really adds qq.v_mean.
        no_mean = quant.QuantizedQKV(qq.q8, qq.q_scale, qq.k8, qq.k_scale, qq.v, qq.v_scale, qq.k_mean)
        bare, _ = attention_from_quantized_triton(no_mean, pv=pv, config=cfg, is_causal=causal,
                                                  out_dtype=torch.float32)
        vm = reference.expand_kv_heads(qq.v_mean, hq).unsqueeze(2)
        torch.testing.assert_close(out - bare, vm.expand_as(out), rtol=1e-5, atol=1e-5)

    def test_epilogue_keeps_rows_without_keys_zero_and_nan_rows_nan():
        """With smooth_v, a row that sees no key (a key-only mask hides every key of head 1) gives zeros, not V's
        mean; a NaN row (a NaN q scale) gives NaN, not zeros. (Only a mask can hide every key of a row.)"""
        q, k, v = make_qkv(1, 2, 1, 40, 70, 64, seed=3, v_offset=True)
        for pv in ("fp8", "fp16"):
            qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv=pv, smooth_v=True)
            qq.q_scale[0, 0, 17] = float("nan")
            bias = torch.zeros(1, 2, 70)
            bias[0, 1] = -math.inf
            out, lse = attention_from_quantized_triton(qq, pv=pv, config=attention_config("cpu", 64, pv),
                                                       return_lse=True, out_dtype=torch.float32, key_bias=bias)
            ref, ref_lse = reference.attention_from_quantized(qq, pv=pv, return_lse=True, key_bias=bias,
                                                              p_tile=attention_config("cpu", 64, pv).block_n)
            assert not ref[0, 1].any() and bool((ref_lse[0, 1] == -math.inf).all())
            assert not out[0, 1].any(), "a row without keys got V's mean (or NaN)"
            assert bool((lse[0, 1] == -math.inf).all())
            assert bool(ref[0, 0, 17].isnan().all()) and bool(out[0, 0, 17].isnan().all()), "a NaN row came out finite"
            live = torch.ones_like(out, dtype=torch.bool)
            live[0, 1] = False
            live[0, 0, 17] = False
            assert metrics.rel_l1(out[live], ref[live]) <= SPEC_REL_L1[pv]
            lse_live = live[..., 0]
            torch.testing.assert_close(lse[lse_live], ref_lse[lse_live], rtol=0, atol=1e-4)

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
    @pytest.mark.parametrize("causal", [False, pytest.param(True, marks=SLOW)])
    def test_backend_smooth_v_end_to_end(kernel, causal):
        """sage_attention(..., smooth_v=True) through the Triton prologue and kernel: the spec's result, the
        exact one, and LSE as without smooth_v."""
        q, k, v = make_qkv(1, 4, 2, 70, 90, 64, torch.float16, seed=8, v_offset=True)
        qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out, lse = sage_attention(qn, kn, vn, tensor_layout="NHD", is_causal=causal, kernel=kernel,
                                  return_lse=True, smooth_v=True)
        out = out.transpose(1, 2).float()
        pv = kernel.rsplit("_", 1)[1]
        spec, spec_lse = reference.reference_attention(q, k, v, is_causal=causal, pv=pv, return_lse=True,
                                                       smooth_v=True, p_tile=attention_config("cpu", 64, pv).block_n)
        exact, _ = reference.exact_attention(q, k, v, is_causal=causal)
        assert metrics.rel_l1(out, spec.float()) <= 1e-4  # measured <= 5.8e-6: the offset dominates the output
        assert metrics.rel_l1(out, exact) <= (3e-3 if pv == "fp16" else 0.01)
        _, plain_lse = sage_attention(q, k, v, is_causal=causal, kernel=kernel, return_lse=True)
        torch.testing.assert_close(lse, spec_lse, rtol=0, atol=2e-3)
        torch.testing.assert_close(lse, plain_lse, rtol=0, atol=1e-5)

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
    @pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.float32, marks=SLOW),
                                       pytest.param(torch.bfloat16, marks=SLOW)])
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
        spec, spec_lse = reference.reference_attention(q, k, v, is_causal=causal, pv=pv, return_lse=True,
                                                       p_tile=attention_config("cpu", 64, pv).block_n)
        assert metrics.cosine(out_hnd, spec.float()) >= SPEC_COS
        assert metrics.rel_l1(out_hnd, spec.float()) <= SPEC_REL_L1[pv]  # measured <= 1.1e-4
        # LSE with the smooth_k term added back is the true one, up to INT8 score error.
        torch.testing.assert_close(lse, spec_lse, rtol=0, atol=2e-3)
        assert float((lse - exact_lse).abs().max()) < 0.05

    def test_refusals_are_stated():
        q = torch.randn(1, 2, 16, 64)
        b = get_backend("triton_int8_fp8")
        assert b.unavailable("cpu") is None  # the interpreter makes CPU tensors acceptable
        mask = torch.ones(16, 16, dtype=torch.bool)
        assert "differs between query rows" in b.why_not(describe_call(q, q, q, attn_mask=mask))
        assert b.why_not(describe_call(q, q, q, attn_mask=mask[:1])) is None  # key-only: served
        assert b.why_not(describe_call(q, q, q, attn_mask=mask[:1].expand(16, 16))) is None  # expanded rows
        # A key-only mask takes the HIP prologue too (its live keys): only the prologue's own availability decides.
        hip = b.why_not(describe_call(q, q, q, attn_mask=mask[:1], prologue="hip"))
        assert hip == b.why_not(describe_call(q, q, q, prologue="hip"))
        big = torch.randn(1, 1, 4, 288)
        assert "256" in b.why_not(describe_call(big, big, big))
        assert "dtype" in b.why_not(describe_call(q.double(), q.double(), q.double()))
        assert b.why_not(describe_call(q, q, q, smooth_v=True)) is None  # smooth_v is served (Triton prologue)
        reason = b.why_not(describe_call(q, q, q, prologue="hip"))
        # Without a HIP prologue (or a GPU for it) the call is refused, never silently re-routed.
        assert reason is None or "HIP" in reason
        with pytest.raises(KernelRefused):
            sage_attention(q, q, q, kernel="triton_int8_fp8", attn_mask=mask)

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
    def test_an_output_the_caller_reshapes_is_written_token_major(kernel):
        """out_nhd (ComfyUI reshapes the output to (b, n, h*d)): the same values, written (b, n, h, d) so that the
        reshape is a view of the kernel's buffer instead of a copy of the whole output."""
        q, k, v = make_qkv(1, 2, 2, 40, 70, 64, seed=5)
        backend = get_backend(kernel)
        hnd, _ = backend.launch(q, k, v, describe_call(q, k, v), 0.125, None)
        nhd, _ = backend.launch(q, k, v, describe_call(q, k, v, out_nhd=True), 0.125, None)
        assert hnd.is_contiguous() and not nhd.is_contiguous() and nhd.transpose(1, 2).is_contiguous()
        assert torch.equal(hnd, nhd)
        assert nhd.transpose(1, 2).flatten(2).data_ptr() == nhd.data_ptr()

    # ---- key-only masks: padding keys holding huge values, against SDPA and the spec
    def padded(b, hq, hkv, n, d, pad, seed=3, scale=1000.0):
        q, k, v = make_qkv(b, hq, hkv, n, n, d, seed=seed)
        k[:, :, n - pad:] *= scale
        v[:, :, n - pad:] *= scale
        return q, k, v

    def mask_variants(b, hq, n, pad):
        keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
        keep[..., n - pad:] = False
        neg_max = torch.zeros(b, 1, 1, n).masked_fill(~keep, -torch.finfo(torch.float32).max)
        per_head = torch.ones(1, hq, 1, n, dtype=torch.bool)
        per_head[:, 0, :, n - pad:] = False
        per_head[:, -1, :, : n // 3] = False
        return {
            "bool": keep,
            "neg-inf fp16": torch.zeros(b, 1, 1, n, dtype=torch.float16).masked_fill(~keep, -math.inf),
            "-finfo.max bf16 3d": torch.zeros(1, 1, n, dtype=torch.bfloat16).masked_fill(
                ~keep[:1, 0], -torch.finfo(torch.bfloat16).max),
            "-finfo.max expanded": neg_max.expand(b, 1, 70, n),
            "per-head bool": per_head,
            "soft bias": torch.randn(b, hq, 1, n, generator=torch.Generator().manual_seed(5)) * 2.0,
        }

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
    @pytest.mark.parametrize("name", ["bool", "neg-inf fp16", "-finfo.max bf16 3d", "-finfo.max expanded",
                                      "per-head bool", "soft bias"])
    def test_key_masks_against_sdpa_and_spec(kernel, name):
        from comfyui_sage_rdna4.kernels.call_spec import key_mask
        """Padding keys 1000x larger than the rest: the output and LSE follow SDPA and the spec (which keeps dead keys
        out of the statistics); letting them in costs cos ~0.1 on the self-check's padded-keys case."""
        pv = kernel.rsplit("_", 1)[1]
        # Masks that leave the padding live somewhere (per head, soft) get ordinary padding: live keys belong in the
        # statistics, and 1000x keys there would be the inputs' coarseness, not the mask's.
        q, k, v = padded(2, 4, 2, 70, 64, 17, scale=1.0 if name in ("per-head bool", "soft bias") else 1000.0)
        mask = mask_variants(2, 4, 70, 17)[name]
        out, lse = sage_attention(q, k, v, kernel=kernel, attn_mask=mask, return_lse=True)
        # The kernel on the spec's own quantization, with the bias and the key end the backend computes: the spec
        # to its tight bound (the end skips the padding's tiles, which must change nothing).
        from comfyui_sage_rdna4.kernels.backends.triton.masks import key_mask_operands
        bias, key_end, plain, live = key_mask_operands(mask, 2, 4, 2, 70)
        assert key_end.max() <= (70 if name in ("per-head bool", "soft bias") else 53)
        assert bool(plain.all()) == (name not in ("per-head bool", "soft bias"))  # padding rows: the unmasked loop
        qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv=pv, live=quant.live_keys(
            quant.mask_bias_base2(key_mask(mask, 70)), 2))
        cfg = attention_config("cpu", 64, pv)
        got, got_lse = attention_from_quantized_triton(qq, pv=pv, config=cfg, return_lse=True, key_bias=bias,
                                                       key_end=key_end, key_plain=plain, out_dtype=torch.float32)
        ref, ref_lse = reference.attention_from_quantized(qq, pv=pv, return_lse=True, p_tile=cfg.block_n,
                                                          key_bias=quant.key_mask_bias(
                                                              quant.mask_bias_base2(key_mask(mask, 70))))
        assert metrics.rel_l1(got, ref) <= SPEC_REL_L1[pv], metrics.rel_l1(got, ref)
        torch.testing.assert_close(got_lse, ref_lse, rtol=0, atol=1e-4)
        sdpa_mask = mask if mask.dtype == torch.bool else mask.float()  # SDPA takes FP32 masks with FP32 q (exact)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                                attn_mask=sdpa_mask)
        exact, exact_lse = reference.exact_attention(q, k, v, attn_mask=mask, return_lse=True)
        torch.testing.assert_close(exact, sdpa, rtol=1e-5, atol=1e-5)
        spec, spec_lse = reference.reference_attention(q, k, v, pv=pv, attn_mask=mask, return_lse=True,
                                                       p_tile=attention_config("cpu", 64, pv).block_n)
        assert metrics.rel_l1(out, spec) <= SPEC_REL_L1[pv], metrics.rel_l1(out, spec)
        assert metrics.rel_l1(out, sdpa) <= {"fp8": 0.05, "fp16": 0.012}[pv], metrics.rel_l1(out, sdpa)
        torch.testing.assert_close(lse, spec_lse, rtol=0, atol=2e-3)
        assert float((lse - exact_lse).abs().max()) < 0.05

    def test_fully_masked_rows_follow_sdpa():
        """Every key -inf/False: zeros and LSE -inf (torch 2.13's SDPA gives zeros too); every key -finfo.max: the
        uniform average over the keys, as SDPA's FP32 sum swamps the scores."""
        q, k, v = make_qkv(1, 2, 2, 40, 70, 64, seed=9)
        none_kept = torch.zeros(1, 1, 1, 70, dtype=torch.bool)
        out, lse = sage_attention(q, k, v, kernel="triton_int8_fp16", attn_mask=none_kept, return_lse=True)
        assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
        for dtype in (torch.float32, torch.bfloat16):
            swamped = torch.full((1, 1, 1, 70), -torch.finfo(dtype).max, dtype=dtype)
            for kernel in ("triton_int8_fp8", "triton_int8_fp16"):
                out = sage_attention(q, k, v, kernel=kernel, attn_mask=swamped)
                sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=swamped.float())
                torch.testing.assert_close(sdpa, v.mean(dim=2, keepdim=True).expand_as(sdpa), rtol=0, atol=1e-5)
                assert metrics.rel_l1(out, sdpa) <= 0.03, (kernel, dtype, metrics.rel_l1(out, sdpa))

    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    @pytest.mark.parametrize("smooth_k,smooth_v,qk_group", [(True, False, "token"), (True, True, "block32"),
                                                            (False, False, "block64")])
    def test_prologue_keeps_dead_keys_out_like_the_spec(pv, smooth_k, smooth_v, qk_group):
        q, k, v = padded(2, 4, 2, 101, 64, 30)
        v = v + 3.0  # an offset: with smooth_v a dead key's 0 must not widen V's range
        bias = quant.mask_bias_base2(mask_variants(2, 4, 101, 30)["bool"][:, :, 0])
        live = quant.live_keys(bias, 2)
        assert live.shape == (2, 1, 101) and not bool(live.all())
        kw = dict(sm_scale=0.125, smooth_k=smooth_k, pv=pv, qk_group=qk_group, smooth_v=smooth_v)
        got = triton_quantize_qkv(q, k, v, live=live, **kw)
        want = quant.quantize_qkv_torch(q, k, v, live=live, **kw)
        assert_same_quantization(got, want)
        assert not bool(got.k8[:, :, 71:].any()) and not bool(got.v.float()[:, :, 71:].any())  # dead: code 0
        plain = quant.quantize_qkv_torch(q, k, v, **kw)
        assert float(got.v_scale.max()) < float(plain.v_scale.max()) / 100  # padding's V is not in the scale

    @pytest.mark.parametrize("kind", ["bool", "neg-inf fp16", "-finfo.max bf16 3d", "-finfo.max expanded",
                                      "per-head bool", "soft bias", "nan and all -inf heads"])
    def test_mask_operands_in_one_launch_match_the_spec(kind):
        """masks.key_mask_operands (one launch) gives quant.mask_bias_base2 and quant.live_keys bit for bit, and the
        live count per (batch, kv head)."""
        from comfyui_sage_rdna4.kernels.backends.triton.masks import key_mask_operands
        from comfyui_sage_rdna4.kernels.call_spec import key_mask
        b, hq, hkv, n = 2, 4, 2, 1500  # two blocks of the prep kernel
        if kind == "nan and all -inf heads":
            mask = torch.randn(b, hq, 1, n) * 3.0
            mask[0, 1] = -math.inf
            mask[1, 2, :, 7] = float("nan")
            mask[1, 3, :, : n // 2] = -8000.0
        else:
            mask = mask_variants(b, hq, n, 333)[kind]
        bias, key_end, plain, live = key_mask_operands(mask, b, hq, hkv, n)
        raw = quant.mask_bias_base2(key_mask(mask, n))
        want = quant.key_mask_bias(raw)
        assert torch.equal(bias.isnan(), want.isnan())
        assert torch.equal(torch.nan_to_num(bias), torch.nan_to_num(want))
        alive = ~quant.dead_keys(raw)
        idx = torch.arange(1, n + 1, dtype=torch.int32)
        assert torch.equal(key_end, torch.where(alive, idx, 0).amax(-1).to(torch.int32))
        want_live = quant.live_keys(raw, hkv).expand(b, hkv, n)
        assert torch.equal(live.flags.bool(), want_live)
        assert torch.equal(live.count, want_live.sum(-1).double().clamp_min(1).reshape(-1))
        assert torch.equal(plain.bool(), plain_padding_rows(raw))

    def plain_padding_rows(raw):
        """What masks.key_mask_operands' `plain` means, from the spec's base-2 bias (Bm, Hm, Nk): every live key has
        bias exactly 0 (NaN is not 0) and the live keys are exactly [0, key end)."""
        alive = ~quant.dead_keys(raw)
        idx = torch.arange(1, raw.shape[-1] + 1, dtype=torch.int32)
        key_end = torch.where(alive, idx, 0).amax(-1)
        return ((raw == 0) | ~alive).all(-1) & (alive.sum(-1) == key_end)

    def flag_cases(b, hq, n, pad):
        """Masks (B, Hq, Nk) with the plain flag each mask row should get (Bm, Hm)."""
        cases = {name: (mask, True) for name, mask in mask_variants(b, hq, n, pad).items()
                 if name not in ("per-head bool", "soft bias")}
        cases["soft bias"] = (mask_variants(b, hq, n, pad)["soft bias"], False)
        hole = torch.ones(1, hq, 1, n, dtype=torch.bool)
        hole[:, 1, :, 5:9] = False  # dead keys before the end: the biased path
        hole[:, 2, :, n - pad:] = False
        cases["per-head hole"] = (hole, torch.tensor([[True, False, True, True]]))
        nan = torch.zeros(b, 1, 1, n).masked_fill(torch.arange(n) >= n - pad, -math.inf)
        nan[1, 0, 0, 3] = float("nan")
        cases["nan"] = (nan, torch.tensor([[True], [False]]))
        shifted = torch.full((b, 1, 1, n), 0.5).masked_fill(torch.arange(n) >= n - pad, -math.inf)
        shifted[0] = 0.0  # a padding row; the other's live keys all carry 0.5 (softmax would not mind, the flag does)
        cases["nonzero live bias"] = (shifted, torch.tensor([[True], [False]]))
        dead = torch.ones(b, 1, 1, n, dtype=torch.bool)
        dead[1] = False  # every key of batch 1 masked: its rows come out 0
        cases["every key dead"] = (dead, torch.tensor([[True], [False]]))
        swamped = torch.zeros(b, 1, 1, n)
        swamped[0] = -torch.finfo(torch.float32).max  # every key at -finfo.max: all live, none 0
        cases["every key -finfo.max"] = (swamped, torch.tensor([[False], [True]]))
        return cases

    @pytest.mark.parametrize("name", ["bool", "neg-inf fp16", "-finfo.max bf16 3d", "-finfo.max expanded",
                                      "soft bias", "per-head hole", "nan", "nonzero live bias", "every key dead",
                                      "every key -finfo.max"])
    def test_plain_padding_flag_of_key_masks(name):
        """key_mask_operands flags a mask row plain exactly where its live keys are a prefix with bias 0: padding
        masks in any dtype or layout, not soft biases, holes, NaN, shifted live keys or rows without a live key."""
        from comfyui_sage_rdna4.kernels.backends.triton.masks import key_mask_operands
        from comfyui_sage_rdna4.kernels.call_spec import key_mask
        b, hq, hkv, n = 2, 4, 2, 1100  # two blocks of the prep kernel
        mask, want = flag_cases(b, hq, n, 150)[name]
        plain = key_mask_operands(mask, b, hq, hkv, n).plain
        assert plain.dtype == torch.int8
        assert torch.equal(plain.bool(), torch.as_tensor(want).expand_as(plain)), plain
        assert torch.equal(plain.bool(), plain_padding_rows(quant.mask_bias_base2(key_mask(mask, n))))

    @pytest.fixture
    def plain_mask_rows(monkeypatch):
        """attention.PLAIN_MASK_ROWS on for one test (off as shipped until a GPU shows it pays)."""
        from comfyui_sage_rdna4.kernels.backends.triton import attention as ta
        monkeypatch.setattr(ta, "PLAIN_MASK_ROWS", True)
        ta.attention_launch.cache_clear()
        yield
        ta.attention_launch.cache_clear()

    @pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")  # the row without a live key
    @pytest.mark.parametrize("pv", ["fp8", "fp16"])
    @pytest.mark.parametrize("causal", [False, True])
    def test_plain_mask_rows_match_the_biased_path(pv, causal, plain_mask_rows):
        """A padding mask's plain rows (the unmasked loop up to the key end) give what the biased loop gives for the
        same rows, within the spec's bound, and the spec itself; a row with no live key stays 0 with LSE -inf. The
        plain loop reads no bias: a NaN bias changes nothing there."""
        from comfyui_sage_rdna4.kernels.backends.triton.masks import key_mask_operands
        from comfyui_sage_rdna4.kernels.call_spec import key_mask
        b, hq, hkv, n = 2, 4, 2, 150
        q, k, v = padded(b, hq, hkv, n, 64, 37)
        keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
        keep[0, ..., n - 37:] = False
        keep[1, ..., 40:] = False
        mask = torch.zeros(b, 1, 1, n).masked_fill(~keep, -torch.finfo(torch.float32).max)
        mask[1, ..., 3:] = -math.inf  # batch 1 keeps keys 0-2 only (plain too)
        ops = key_mask_operands(mask, b, hq, hkv, n)
        assert ops.plain.tolist() == [[1], [1]] and ops.key_end.tolist() == [[113], [3]]
        raw = quant.mask_bias_base2(key_mask(mask, n))
        qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv=pv, live=quant.live_keys(raw, hkv))
        cfg = attention_config("cpu", 64, pv)
        kw = dict(pv=pv, config=cfg, is_causal=causal, return_lse=True, out_dtype=torch.float32,
                  key_end=ops.key_end)
        plain, plain_lse = attention_from_quantized_triton(qq, key_bias=ops.bias, key_plain=ops.plain, **kw)
        biased, biased_lse = attention_from_quantized_triton(qq, key_bias=ops.bias, **kw)
        assert metrics.rel_l1(plain, biased) <= SPEC_REL_L1[pv], metrics.rel_l1(plain, biased)
        torch.testing.assert_close(plain_lse, biased_lse, rtol=0, atol=1e-4)
        ref, ref_lse = reference.attention_from_quantized(qq, pv=pv, return_lse=True, p_tile=cfg.block_n,
                                                          is_causal=causal, key_bias=quant.key_mask_bias(raw))
        assert metrics.rel_l1(plain, ref) <= SPEC_REL_L1[pv], metrics.rel_l1(plain, ref)
        torch.testing.assert_close(plain_lse, ref_lse, rtol=0, atol=1e-4)
        unread = attention_from_quantized_triton(qq, key_bias=torch.full_like(ops.bias, math.nan),
                                                 key_plain=ops.plain, **kw)
        assert torch.equal(unread[0], plain) and torch.equal(unread[1], plain_lse)
        from comfyui_sage_rdna4.kernels.backends.triton import attention as ta
        ta.PLAIN_MASK_ROWS = False  # as shipped: the flag is not read, every row adds its (here NaN) bias
        ta.attention_launch.cache_clear()
        read = attention_from_quantized_triton(qq, key_bias=torch.full_like(ops.bias, math.nan), key_plain=ops.plain,
                                               **kw)
        assert bool(read[0].isnan().any())  # the NaN bias was read
        ta.PLAIN_MASK_ROWS = True
        ta.attention_launch.cache_clear()
        # No live key in batch 1 (every key -inf): not plain; its rows are 0 with LSE -inf on either path.
        none = torch.zeros(b, 1, 1, n).masked_fill(~keep, -math.inf)
        none[1] = -math.inf
        ops = key_mask_operands(none, b, hq, hkv, n)
        assert ops.plain.tolist() == [[1], [0]]
        out, lse = attention_from_quantized_triton(qq, key_bias=ops.bias, key_plain=ops.plain,
                                                   **dict(kw, key_end=ops.key_end))
        assert not bool(out[1].any()) and bool((lse[1] == -math.inf).all())
        assert torch.equal(out[0], plain[0]) and torch.equal(lse[0], plain_lse[0])

    # ---- small V through FP16 P.V: the V scale goes up as well as down (quant.fp16_v_scale)
    @pytest.mark.parametrize("dtype,magnitude", [
        (torch.float32, 1e-7), (torch.float32, 1e-9),
        pytest.param(torch.float32, 1e-4, marks=SLOW), pytest.param(torch.float32, 1e-5, marks=SLOW),
        pytest.param(torch.float32, 1e-6, marks=SLOW), pytest.param(torch.float32, 1e-8, marks=SLOW),
        pytest.param(torch.float16, 1e-4, marks=SLOW)])
    def test_small_v_keeps_fp16_pv_accurate(dtype, magnitude):
        """The prologue's V scale equals the spec's bit for bit (with and without smooth_v), and triton_int8_fp16
        stays within the FP16 path's bound at every V magnitude (before: rel L1 0.17 at 1e-7, 1.0 at 1e-9)."""
        q, k, v = make_qkv(1, 2, 2, 48, 80, 64, seed=4)
        errors = []
        for m in (1.0, magnitude):
            qq, kk, vv = q.to(dtype), k.to(dtype), (v * m).to(dtype)
            for smooth_v in (False, True):
                got = triton_quantize_qkv(qq, kk, vv, sm_scale=0.125, pv="fp16", smooth_v=smooth_v)
                want = quant.quantize_qkv_torch(qq, kk, vv, sm_scale=0.125, pv="fp16", smooth_v=smooth_v)
                assert_same_quantization(got, want)
            out = sage_attention(qq, kk, vv, kernel="triton_int8_fp16")
            exact, _ = reference.exact_attention(qq.double(), kk.double(), vv.double())
            errors.append(metrics.rel_l1(out.double(), exact))
        assert errors[1] <= min(0.02, 1.25 * errors[0]), errors

    # ---- huge logits: P <= 448 before the FP8 conversion (under the interpreter a larger P turns into NaN)
    def dominant_key(logit, nk=80):
        """One key scores `logit` (natural-log units), the others 0; V = 1 everywhere, so the output is 1."""
        q = torch.zeros(1, 1, 8, 64)
        k = torch.zeros(1, 1, nk, 64)
        q[..., 0] = logit
        k[0, 0, 37, 0] = 1.0
        return q, k, torch.ones(1, 1, nk, 64)

    @pytest.mark.parametrize("logit", [1e2, 1e5, 1e6, 1e7])
    def test_huge_logits_keep_p_at_most_448(logit):
        """Before: 0.9964 at 1e5, 0.966 at 1e6, 0.50 at 1e7 (P = 512 saturated). Under the interpreter the kernel
        turns any P above 448 at the conversion into NaN (CHECK_P_RANGE), so a finite output shows there was none. The
        dominant key's P is e4m3-rounded on the kernel's grid (not the spec's p * 448), so its output is 1 to half
        an e4m3 step (2**-4 relative); FP16 P is exact to 2**-11."""
        from comfyui_sage_rdna4.kernels.backends.triton import attention as ta
        assert ta.CHECK_P_RANGE
        q, k, v = dominant_key(logit)
        for kernel in ("triton_int8_fp8", "triton_int8_fp16"):
            out, lse = sage_attention(q, k, v, kernel=kernel, sm_scale=1.0, smooth_k=False, return_lse=True)
            print(f"{kernel} logit {logit:g}: out {float(out.min()):.6f}..{float(out.max()):.6f} "
                  f"lse - logit {float((lse - logit).abs().max()):.3g}")
            assert float((out - 1).abs().max()) <= (2.0 ** -4 if kernel.endswith("fp8") else 2.0 ** -11)
            # The LSE carries the same shift as the row sum: logit + log(1 + 79 e^-logit), to FP32's grid.
            assert float((lse.double() - logit).abs().max()) <= max(1e-3, 4 * logit * 2.0 ** -24)

    @pytest.mark.parametrize("logit", [1e8, 1e10, 1e20])
    def test_scores_past_fp32_resolution_stay_finite_and_in_range(logit):
        """Base-2 scores past ~1e7 have an FP32 ulp of 1 and more: the raised shifts keep P finite (FP8 <= 448, FP16
        <= 65504) and the top P may vanish, which leaves the row 0 (in V's range), never Inf or NaN. The GPU fuzz
        found FP16 P overflowing there (fp16 q 2e4, k 5.5e4, D48: all 960 outputs non-finite)."""
        q, k, v = dominant_key(logit)
        for kernel in ("triton_int8_fp8", "triton_int8_fp16"):
            out = sage_attention(q, k, v, kernel=kernel, sm_scale=1.0, smooth_k=False)
            assert bool(torch.isfinite(out).all()), (kernel, logit)
            assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0, (kernel, logit)

    def test_fp16_p_overflows_without_the_raised_shift(monkeypatch):
        """The check above can fail: with the FP16 shift as it was (fl(row_max - 15), no raise) P passes 65504 and
        the row comes out Inf or NaN: at logit 1e8 (base 2: 1.44e8, an ulp of 16) the shift rounds to row_max - 16,
        so the top P is 2^16 (on a GPU an FMA's unrounded s * q_scale adds up to half an ulp more)."""
        from comfyui_sage_rdna4.kernels.backends.triton import attention as ta

        monkeypatch.setattr(ta, "_shifted_max", _unraised_shift)
        out = sage_attention(*dominant_key(1e8), kernel="triton_int8_fp16", sm_scale=1.0, smooth_k=False)
        assert not bool(torch.isfinite(out).all())

    def test_p_range_assertion_fires_on_the_old_shift(monkeypatch):
        """The check can fail: with the unrounded shift (the code before) P = 449.6 at logit 1e5 and 512 at 1e7
        make the output NaN (at 1e6 that rounding happens to go up: P = 430.5)."""
        from comfyui_sage_rdna4.kernels.backends.triton import attention as ta

        monkeypatch.setattr(ta, "_shifted_max", _unrounded_shift)
        for logit in (1e5, 1e7):
            q, k, v = dominant_key(logit)
            out = sage_attention(q, k, v, kernel="triton_int8_fp8", sm_scale=1.0, smooth_k=False)
            assert torch.isnan(out).all(), logit

    # ---- the inline-asm FP8 conversion: a failing compile falls back to the software conversion, once
    def test_asm_conversion_failure_falls_back_once(monkeypatch, caplog):
        """The interpreter has no inline asm: it refuses `_to_e4m3_gfx12` as a Triton that rejects the asm would.
        The launch falls back to the software conversion, says why once, and never tries the asm again."""
        import logging

        from comfyui_sage_rdna4.kernels.backends.triton import attention as ta
        monkeypatch.setattr(ta, "ASM_CONVERSION", True)
        monkeypatch.setattr(ta, "asm_conversion_failure", None)
        ta.attention_launch.cache_clear()
        tried = []
        real_launch = ta.launch

        def counting(fn, grid, args, meta, key):
            tried.append(meta["FP8_CVT_ASM"])
            return real_launch(fn, grid, args, meta, key)

        monkeypatch.setattr(ta, "launch", counting)
        q, k, v = make_qkv(1, 2, 2, 40, 70, 64, seed=6)
        qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv="fp8")
        soft_cfg = attention_config("cpu", 64, "fp8")
        asm_cfg = dataclasses.replace(soft_cfg, fp8_cvt_asm=True)
        try:
            with caplog.at_level(logging.WARNING, logger=ta.log.name):
                first, _ = attention_from_quantized_triton(qq, pv="fp8", config=asm_cfg, out_dtype=torch.float32)
                second, _ = attention_from_quantized_triton(qq, pv="fp8", config=asm_cfg, out_dtype=torch.float32)
            soft, _ = attention_from_quantized_triton(qq, pv="fp8", config=soft_cfg, out_dtype=torch.float32)
        finally:
            ta.attention_launch.cache_clear()
        assert tried == [True, False, False, False]  # the asm once; then the software conversion every time
        assert "inline_asm" in ta.asm_conversion_failure, ta.asm_conversion_failure
        warnings = [r for r in caplog.records if "inline-asm" in r.getMessage()]
        assert len(warnings) == 1 and ta.asm_conversion_failure in warnings[0].getMessage()
        assert torch.equal(first, soft) and torch.equal(second, soft)

    # ---- the first-use self-check on the Triton kernel, and faults planted into its launch

    import importlib

    from planted_faults import LAUNCH_FAULTS

    sc = importlib.import_module("comfyui_sage_rdna4.kernels.self_check")
    # The self-check's kinds on shapes the interpreter runs in seconds (fp16: its bf16 is not exact): the probe (the
    # gain's case), the LSE case, the causal diagonal and a softmax scale of its own.
    SMALL_CASES = (
        sc.Case("small-lse", "peaked", torch.float16, 64, 1, 2, 1, 40, 70, is_causal=True, return_lse=True),
        sc.Case("small-diagonal", "diagonal", torch.float16, 64, 1, 2, 1, 64, 64, is_causal=True),
        sc.Case("small-scale", "peaked", torch.float16, 64, 1, 2, 2, 32, 96, scale=0.06),
        sc.Case("small-probe", "probe", torch.float16, 64, 1, 2, 2, 32, 256),
    )
    # The default run plants the faults the interpreter fuzz missed before (LSE, causal); the slow run the others.
    QUICK_FAULTS = ("LSE + 0.05", "causal one key late")

    def triton_self_check(kernel, variant):
        backend = get_backend(kernel)
        return sc.run_self_check(sc.backend_attention(backend, variant), "cpu", SMALL_CASES,
                                 accepts=lambda c: True, variant=variant)

    @pytest.mark.parametrize("kernel", ["triton_int8_fp8", pytest.param("triton_int8_fp16", marks=SLOW)])
    def test_triton_kernel_passes_the_self_check_oracles(kernel):
        """Unplanted, the Triton kernel passes the self-check's oracles (rel L1, gain, per row, LSE and its mean)."""
        result = triton_self_check(kernel, sc.Variant("auto", "token", True, False))
        assert result.reason is None, result.reason
        assert len(result.results) == len(SMALL_CASES)

    @pytest.mark.parametrize("fault", [f if f in QUICK_FAULTS else pytest.param(f, marks=SLOW)
                                       for f in LAUNCH_FAULTS])
    def test_a_fault_planted_in_the_triton_launch_fails_the_self_check(monkeypatch, fault):
        """Each fault of tests/planted_faults.py, planted into the Triton FP8 backend's launch, fails the self-check
        (in the small cases here, run by the kernel under the interpreter)."""
        backend = get_backend("triton_int8_fp8")
        monkeypatch.setattr(backend, "launch", LAUNCH_FAULTS[fault](type(backend).launch.__get__(backend)))
        result = triton_self_check("triton_int8_fp8", sc.Variant("auto", "token", True, False))
        assert result.reason, f"{fault} passed the self-check"
