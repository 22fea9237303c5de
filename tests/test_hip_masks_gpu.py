"""Key-only masks in the HIP kernels on an NVIDIA GPU, through the gfx12 WMMA emulation (the same sources compiled as
CUDA; kernels/verify/): nothing here has run on RDNA4.

Kernel level (CuPy, the `hip_emulated_run` fixture of tests/conftest.py): the prologue with a mask's live keys
bit-exact against quant.quantize_qkv_torch(live=...), and the masked attention against the spec's attention half
(same QuantizedQKV, same key bias), the whole spec and exact attention with the mask, at B2 with GQA, both head dims,
both dtypes, both P.V modes, causal or not, padding keys 1000x larger than the rest; rows with every key masked.
Backend level (SAGE_RDNA4_HIP_EMULATE=1, the pack's own loader): HipBackend with bool and float masks (-inf,
-finfo.max, another dtype than q, broadcast shapes) against SDPA and exact attention, both prologues, and the
first-use self-check with its padded-keys case."""
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from comfyui_sage_rdna4.kernels import metrics, reference, settings
from comfyui_sage_rdna4.kernels.call_spec import describe_call
from comfyui_sage_rdna4.kernels.verify import hip_checks

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
PAD = (180, 357)  # the self-check's padded-keys case: masked keys at the end of batch 0, 1


@pytest.fixture(scope="module")
def run(hip_emulated_run):
    return hip_emulated_run  # tests/conftest.py


MASKED_CASES = [
    # name, pv, d, dtype, causal, hq, hkv, nq, nk
    ("-finfo.max bf16", "fp8", 128, torch.bfloat16, False, 4, 2, 333, 1100),
    ("-finfo.max bf16", "fp16", 64, torch.bfloat16, True, 2, 2, 700, 700),
    ("bool", "fp8", 64, torch.float16, False, 4, 2, 300, 1100),
    ("bool", "fp16", 128, torch.float16, True, 2, 1, 640, 640),
    ("neg-inf fp16", "fp8", 128, torch.bfloat16, False, 2, 2, 200, 1100),   # an fp16 mask on bf16 q
    ("neg-inf fp16", "fp16", 64, torch.float16, False, 2, 1, 129, 999),
    ("-finfo.max bf16 3d", "fp8", 64, torch.float16, False, 2, 2, 257, 1100),  # a bf16 mask on fp16 q
    ("-finfo.max expanded", "fp16", 128, torch.bfloat16, False, 2, 2, 70, 1100),
    ("per-head bool", "fp8", 128, torch.float16, True, 4, 2, 500, 500),
    ("soft bias", "fp16", 128, torch.bfloat16, False, 4, 2, 300, 1100),
    ("soft bias", "fp8", 64, torch.float16, False, 4, 4, 300, 777),
]


@pytest.mark.parametrize("name,pv,d,dtype,causal,hq,hkv,nq,nk", MASKED_CASES)
def test_masked_attention_matches_the_spec(run, name, pv, d, dtype, causal, hq, hkv, nq, nk):
    scale = 1.0 if name in ("per-head bool", "soft bias") else 1000.0  # live padding belongs in the statistics
    # The 3-D mask is one row for both batches (batch 0's): batch 1 gets padding of the same length, else its larger
    # keys stay live and coarsen FP8 V for the spec itself (host simulator: kernel = spec, spec vs exact cos 0.975).
    pad = (PAD[0], PAD[0]) if name.endswith("3d") else PAD
    q, k, v = hip_checks.padded_qkv(2, hq, hkv, nq, nk, d, dtype, DEV, pad, scale=scale)
    mask = hip_checks.key_mask_variants(2, hq, nk, pad, DEV, nq=nq)[name]
    sm = 1 / math.sqrt(d)
    kw = dict(sm_scale=sm, pv=pv, smooth_k=True)
    qq, km = hip_checks.masked_prologue(run, q, k, v, mask, **kw)
    assert hip_checks.masked_prologue_mismatches(qq, q, k, v, km, **kw) == {}
    out, lse = hip_checks.masked_attention(run, qq, km, pv=pv, is_causal=causal, out_dtype=dtype, return_lse=True,
                                           q=q, sm_scale=sm)
    rep = hip_checks.masked_report(out, lse, qq, km, q, k, v, mask, pv=pv, is_causal=causal, sm_scale=sm)
    print(name, pv, d, dtype, causal, {k_: f"{v_:.3g}" for k_, v_ in rep.items()})
    hip_checks.assert_masked_attention_ok(rep, pv)


@pytest.mark.parametrize("pv,smooth_v,group", [("fp8", True, "block64"), ("fp16", True, "block128"),
                                               ("fp8", False, "block32")])
def test_masked_prologue_bit_exact_with_smooth_v_and_blocks(run, pv, smooth_v, group):
    q, k, v = hip_checks.padded_qkv(2, 4, 2, 300, 1100, 128, torch.bfloat16, DEV, PAD, layout="nhd")
    v = v + 3.0  # an offset: a dead key's 0 must not widen V's range with smooth_v
    mask = hip_checks.key_mask_variants(2, 4, 1100, PAD, DEV)["bool"]
    for smooth_k in (True, False):
        kw = dict(sm_scale=0.088, smooth_k=smooth_k, pv=pv, qk_group=group, smooth_v=smooth_v)
        qq, km = hip_checks.masked_prologue(run, q, k, v, mask, **kw)
        assert hip_checks.masked_prologue_mismatches(qq, q, k, v, km, **kw) == {}


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_fully_masked_rows(run, pv):
    """Every key -inf: zeros and LSE -inf; every key at -finfo.max: SDPA's uniform average, finite LSE."""
    q, k, v = hip_checks.padded_qkv(2, 2, 2, 200, 700, 128, torch.bfloat16, DEV, PAD, scale=1.0)
    masks = hip_checks.key_mask_variants(2, 2, 700, PAD, DEV)
    sm = 1 / math.sqrt(128)
    qq, km = hip_checks.masked_prologue(run, q, k, v, masks["all -inf"], sm_scale=sm, pv=pv)
    out, lse = hip_checks.masked_attention(run, qq, km, pv=pv, is_causal=False, out_dtype=torch.bfloat16,
                                           return_lse=True, q=q, sm_scale=sm)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    qq, km = hip_checks.masked_prologue(run, q, k, v, masks["all -finfo.max"], sm_scale=sm, pv=pv)
    out, lse = hip_checks.masked_attention(run, qq, km, pv=pv, is_causal=False, out_dtype=torch.bfloat16,
                                           return_lse=True, q=q, sm_scale=sm)
    # SDPA's math (and CPU) path gives the uniform average; CUDA's fused kernels may not (seen on the H200: zeros
    # where every key is at -finfo.max), so the oracle is the average itself.
    uniform = v.float().mean(dim=2, keepdim=True).expand(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
    with sdpa_kernel(SDPBackend.MATH):
        sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                attn_mask=masks["all -finfo.max"])
    torch.testing.assert_close(sdpa, uniform, rtol=1e-4, atol=1e-3)
    err = metrics.rel_l1(out.float(), sdpa)
    ref, _ = hip_checks.hip_spec(qq, pv=pv, out_dtype=torch.bfloat16, key_bias=km.attention.bias)
    vs_spec = metrics.rel_l1(out.float(), ref.float())
    print(f"{pv} every key -finfo.max: rel L1 vs SDPA {err:.4f}, vs the spec {vs_spec:.2e}")
    assert vs_spec <= hip_checks.TOL_REL_L1_VS_REF[pv]
    assert err <= {"fp8": 0.04, "fp16": 0.01}[pv] and torch.isfinite(lse).all()


# -- the backend, through the pack's loader -----------------------------------------------------------------

def _backend_or_skip(pv, monkeypatch):
    monkeypatch.setenv(settings.HIP_EMULATE.name, "1")
    from comfyui_sage_rdna4.kernels.backends.hip.backend import make_backend
    backend = make_backend(pv)
    reason = backend.unavailable("cuda", torch.cuda.current_device())
    if reason:
        pytest.skip(reason)
    return backend


@pytest.fixture(scope="module")
def backends():
    """One emulated HipBackend per P.V mode for the module: each runs its first-use self-check once per prologue."""
    patch = pytest.MonkeyPatch()
    try:
        yield {pv: _backend_or_skip(pv, patch) for pv in ("fp8", "fp16")}
    finally:
        patch.undo()


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_self_check_runs_and_passes_padded_keys(pv, monkeypatch):
    """The first-use self-check of the HIP backend now includes the padded-keys case (a key-only -finfo.max mask over
    padding keys 1000x larger), and passes it on the emulated kernels."""
    backend = _backend_or_skip(pv, monkeypatch)
    first = torch.empty(1, 1, 1, 64, device=DEV, dtype=torch.float16)
    assert backend.ready(describe_call(first, first, first)) is None
    result = backend.verdicts.last_result
    names = [r.case.name for r in result.results]
    print({r.case.name: r.reason for r in result.results})
    assert "padded-keys" in names and not result.skipped


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("prologue", ["hip", "triton"])
@pytest.mark.parametrize("style", ["-finfo.max bf16", "bool", "neg-inf fp32", "per-head soft", "all -finfo.max",
                                   "all -inf"])
def test_backend_with_key_masks_against_sdpa(backends, pv, prologue, style):
    """HunyuanVideo's key-only padding mask at B2 H8 N2100 D128 bf16 (padding K and V 100x larger), through
    HipBackend: within the unmasked bounds of SDPA and exact attention, LSE included; every key -finfo.max gives the
    uniform average, every key -inf zeros with LSE -inf."""
    backend = backends[pv]
    b, h, n, d, pad = 2, 8, 2100, 128, (200, 613)
    q, k, v = hip_checks.padded_qkv(b, h, h, n, n, d, torch.bfloat16, DEV, pad, scale=100.0)
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device=DEV)
    for i in range(b):
        keep[i, ..., n - pad[i]:] = False
    masks = {
        "-finfo.max bf16": torch.zeros(b, 1, 1, n, dtype=torch.bfloat16, device=DEV).masked_fill(
            ~keep, -torch.finfo(torch.bfloat16).max),
        "bool": keep,
        "neg-inf fp32": torch.zeros(b, 1, 1, n, device=DEV).masked_fill(~keep, -math.inf),  # FP32 on bf16 q
        "per-head soft": torch.randn(b, h, 1, n, device=DEV) * 2.0,
        "all -finfo.max": torch.full((1, 1, 1, n), -torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16,
                                     device=DEV),
        "all -inf": torch.full((b, 1, 1, n), -math.inf, device=DEV),
    }
    mask = masks[style]
    if style == "per-head soft":
        q, k, v = hip_checks.padded_qkv(b, h, h, n, n, d, torch.bfloat16, DEV, pad, scale=1.0)
    call = describe_call(q, k, v, attn_mask=mask, return_lse=True, prologue=prologue)
    reason = backend.ready(call)
    if reason and prologue == "triton" and "Triton prologue" in reason:
        pytest.skip(reason)
    assert reason is None, reason
    out, lse = backend(q, k, v, call, 1 / math.sqrt(d), mask)
    sdpa_mask = mask if mask.dtype == torch.bool else mask.float()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=sdpa_mask)
    exact, exact_lse = reference.exact_attention(q, k, v, attn_mask=mask, return_lse=True)
    if style == "all -inf":
        assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
        return
    err, sdpa_err = metrics.rel_l1(out.float(), exact), metrics.rel_l1(sdpa.float(), exact)
    print(f"{backend.name} {prologue} {style}: rel L1 vs exact {err:.4f} (SDPA FP32 {sdpa_err:.2e}), "
          f"LSE max err {float((lse - exact_lse).abs().max()):.2e}")
    spec, spec_lse = reference.reference_attention(q, k, v, pv=pv, attn_mask=mask, return_lse=True,
                                                   p_tile=hip_checks.HIP_P_TILE)
    assert metrics.rel_l1(out.float(), spec.float()) <= hip_checks.TOL_REL_L1_VS_REF[pv]
    if style == "all -finfo.max":  # the uniform average (V's e4m3 / fp16 rounding: the spec's own error)
        uniform = v.float().mean(dim=2, keepdim=True).expand_as(exact)
        assert metrics.rel_l1(out.float(), uniform) <= {"fp8": 0.04, "fp16": 0.01}[pv]
        return
    assert metrics.cosine(out.float(), exact) >= 0.999
    assert err <= {"fp8": 0.05, "fp16": 0.015}[pv]
    assert float((lse - spec_lse).abs().max()) < hip_checks.TOL_LSE * 5
    assert float((lse - exact_lse).abs().max()) < 0.05


@pytest.mark.parametrize("kernel", ["triton_int8_fp8", "triton_int8_fp16"])
@pytest.mark.parametrize("style", ["-finfo.max bf16", "bool"])
def test_triton_attention_with_the_hip_prologue_takes_key_masks(kernel, style, monkeypatch):
    """The Triton backend with prologue="hip" (emulated) on a key-only mask: the HIP prologue gets the mask's live
    keys, so padding keys 100x larger stay out of the statistics; the output equals the Triton prologue's within the
    spec's own tolerance and is as close to exact attention."""
    monkeypatch.setenv(settings.HIP_EMULATE.name, "1")
    from comfyui_sage_rdna4.kernels.registry import get_backend
    backend = get_backend(kernel)
    b, h, n, d, pad = 2, 4, 1300, 128, (200, 413)
    q, k, v = hip_checks.padded_qkv(b, h, h, n, n, d, torch.bfloat16, DEV, pad, scale=100.0)
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device=DEV)
    for i in range(b):
        keep[i, ..., n - pad[i]:] = False
    mask = keep if style == "bool" else torch.zeros(b, 1, 1, n, dtype=torch.bfloat16, device=DEV).masked_fill(
        ~keep, -torch.finfo(torch.bfloat16).max)
    outs = {}
    for prologue in ("hip", "triton"):
        call = describe_call(q, k, v, attn_mask=mask, return_lse=True, prologue=prologue)
        reason = backend.ready(call)
        if reason and prologue == "hip" and "HIP" in reason:
            pytest.skip(reason)
        assert reason is None, reason
        outs[prologue] = backend(q, k, v, call, 1 / math.sqrt(d), mask)
    exact, exact_lse = reference.exact_attention(q, k, v, attn_mask=mask, return_lse=True)
    pv = kernel.rsplit("_", 1)[1]
    (hip_out, hip_lse), (tri_out, tri_lse) = outs["hip"], outs["triton"]
    err_hip, err_tri = metrics.rel_l1(hip_out.float(), exact), metrics.rel_l1(tri_out.float(), exact)
    print(f"{kernel} {style}: rel L1 vs exact, HIP prologue {err_hip:.4f}, Triton prologue {err_tri:.4f}")
    assert metrics.rel_l1(hip_out.float(), tri_out.float()) <= hip_checks.TOL_REL_L1_VS_REF[pv]
    assert err_hip <= {"fp8": 0.05, "fp16": 0.015}[pv] and err_hip <= 1.05 * err_tri + 1e-4
    assert float((hip_lse - exact_lse).abs().max()) < 0.05
    assert float((hip_lse - tri_lse).abs().max()) < hip_checks.TOL_LSE * 5
