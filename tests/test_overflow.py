"""Overflow safety (issue 6): V up to 6e4 and K channel offsets up to 1e3.

Every backend that accepts such a call must return finite values with cosine >= 0.99 against exact FP32
attention; a backend may instead refuse (KernelRefused with a reason). The FP8 trap this guards against:
V entries above 448 after scaling saturate in e4m3 and renders turn black (seed F150); and FP8 rounding of P
can lift a convex combination of V a few percent above max|V|, which is Inf in fp16 at 65504.

CPU: the reference (both P.V modes) and SDPA here; the Triton kernels under TRITON_INTERPRET=1 in a fresh
process. GPU (marked): every backend the GPU offers, the HIP ones through the gfx12 emulation on NVIDIA.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if __name__ == "__main__":  # the Triton-interpreter subprocess, tests/ first on sys.path: conftest loads the pack
    import conftest  # noqa: F401

from comfyui_sage_rdna4.kernels import BACKEND_NAMES, KernelRefused, sage_attention
from comfyui_sage_rdna4.kernels.metrics import cosine
from comfyui_sage_rdna4.kernels.reference import exact_attention, reference_attention
from comfyui_sage_rdna4.kernels.registry import get_backend

MIN_COS = 0.99


def overflow_case(dtype, v_max, k_offset, kind, n=256, d=64, heads=2, seed=0, device="cpu"):
    """q ~ N(0,1); K with a per-channel offset of magnitude k_offset; V scaled so max|V| = v_max.

    kind: "spread" (V ~ N(0,1) scaled), "outlier" (one huge entry per head, the rest ~1), "constant" (one V
    channel holds v_max everywhere: the output there must be v_max, not Inf)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, d, generator=g)
    k = torch.randn(1, heads, n, d, generator=g)
    k = k + (torch.rand(d, generator=g) * 2 - 1) * k_offset
    v = torch.randn(1, heads, n, d, generator=g)
    if kind == "spread":
        v = v / v.abs().amax() * v_max
    elif kind == "outlier":
        v[:, :, n // 3, d // 2] = v_max
    elif kind == "constant":
        v[..., 5] = v_max
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


CASES = [(v_max, k_offset, kind) for v_max in (448.0, 6e4) for k_offset in (0.0, 1e3)
         for kind in ("spread", "outlier", "constant")] + [(65504.0, 1e3, "constant"), (1e3, 100.0, "spread")]


def check(out, q, k, v, label):
    assert out.shape == q.shape[:3] + (v.shape[-1],), label
    assert torch.isfinite(out).all(), f"{label}: {int((~torch.isfinite(out)).sum())} non-finite outputs"
    exact, _ = exact_attention(q, k, v)
    c = cosine(out.float(), exact)
    assert c >= MIN_COS, f"{label}: cosine {c:.5f} < {MIN_COS}"
    return c


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("v_max,k_offset,kind", CASES)
def test_reference_spec_is_overflow_safe(dtype, pv, v_max, k_offset, kind):
    """The spec itself, both P.V modes: what every kernel is compared with."""
    q, k, v = overflow_case(dtype, v_max, k_offset, kind)
    out, _ = reference_attention(q, k, v, pv=pv, smooth_k=True)
    check(out, q, k, v, f"reference pv={pv} {dtype} V{v_max:g} K+{k_offset:g} {kind}")
    if kind == "constant":  # the convex combination of a constant channel is that constant
        got = out[..., 5].float()
        assert torch.allclose(got, torch.full_like(got, float(v.float()[0, 0, 0, 5])), rtol=0.07)


def run_every_backend(device, cases=CASES, dtypes=(torch.float16, torch.bfloat16), n=256, only=None):
    """Returns {backend: (accepted, refused, worst cosine)}; fails on any non-finite or inaccurate result."""
    summary, all_failures = {}, []
    for name in only or BACKEND_NAMES:
        idx = torch.device(device).index if torch.device(device).type == "cuda" else None
        if torch.device(device).type == "cuda" and idx is None:
            idx = torch.cuda.current_device()
        if get_backend(name).unavailable(torch.device(device).type, idx):
            continue
        accepted = refused = 0
        worst = 1.0
        failures = []
        for dtype in dtypes:
            for v_max, k_offset, kind in cases:
                if v_max > torch.finfo(dtype).max:
                    continue
                q, k, v = overflow_case(dtype, v_max, k_offset, kind, n=n, device=device)
                try:
                    out = sage_attention(q, k, v, kernel=name, smooth_k=True)
                except KernelRefused as exc:
                    assert exc.reason, f"{name} refused without a reason"
                    refused += 1
                    continue
                try:
                    worst = min(worst, check(out, q, k, v, f"{name} {dtype} V{v_max:g} K+{k_offset:g} {kind}"))
                except AssertionError as exc:
                    failures.append(str(exc).splitlines()[0])
                accepted += 1
        summary[name] = (accepted, refused, round(worst, 5))
        all_failures.extend(failures)
    print(f"overflow safety on {device}: backend -> (accepted, refused, worst cosine): {summary}")
    assert not all_failures, "\n".join(all_failures)
    return summary


def test_every_cpu_backend_is_overflow_safe():
    summary = run_every_backend("cpu")
    assert summary["reference"][0] > 0 and summary["sdpa"][0] > 0


def test_auto_and_the_override_path_are_overflow_safe():
    """auto on this device and the ComfyUI override (kernel=reference) with V 6e4 and K offsets 1e3."""
    from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride

    q, k, v = overflow_case(torch.float16, 6e4, 1e3, "spread")
    check(sage_attention(q, k, v), q, k, v, "auto")
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    flat = lambda t: t.transpose(1, 2).reshape(1, t.shape[2], -1)  # noqa: E731
    out = ov(lambda *a, **kw: pytest.fail("fell back"), flat(q), flat(k), flat(v), 2,
             transformer_options={}, _inside_attn_wrapper=True)
    check(out.view(1, -1, 2, 64).transpose(1, 2), q, k, v, "override")
    assert ov.stats.snapshot()["calls"] == {"reference": 1}


def test_triton_interpreter_is_overflow_safe():
    """The Triton backends under TRITON_INTERPRET=1, in a fresh process (the interpreter is chosen when the
    kernels are first defined); small shapes, the interpreter is slow."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--triton-interpreter"], env=env, capture_output=True,
                          text=True, timeout=300)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "triton_int8_fp8" in proc.stdout


@pytest.mark.gpu
def test_every_gpu_backend_is_overflow_safe(monkeypatch):
    monkeypatch.setenv("SAGE_RDNA4_HIP_EMULATE", "1")
    summary = run_every_backend("cuda", n=1024)
    quantized = [n for n in summary if get_backend(n).quantized and summary[n][0]]
    print("quantized backends that took the calls:", quantized)
    assert summary["sdpa"][0] > 0


if __name__ == "__main__" and "--triton-interpreter" in sys.argv:
    small = [(6e4, 1e3, "spread"), (6e4, 0.0, "constant"), (65504.0, 1e3, "constant"), (448.0, 1e3, "spread"),
             (6e4, 1e3, "outlier")]
    run_every_backend("cpu", cases=small, dtypes=(torch.float16,), n=64,
                      only=["triton_int8_fp8", "triton_int8_fp16"])
