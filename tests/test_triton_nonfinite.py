"""NaN and Inf in, NaN or Inf out, from the Triton kernels: the six calls the H100's GPU fuzz caught (2026-12-05)
giving finite outputs where exact attention is not finite, replayed under Triton's interpreter on the CPU.

Two interpreters: Triton's own, and one whose elementwise max/min drop a NaN operand as the GPUs' do
(tests/gpu_max.py).
Before the kernel's epilogue kept a NaN row's NaN (a row whose running max stayed -inf, its NaN scores dropped by the
max, was taken for a row that saw no key and zeroed), all 12 calls (six, both kernels) leaked with the GPU's max and
10 of 12 with the interpreter's own."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (path, Case fields) of each call, as the GPU fuzz reported it (tests/test_fuzz.py's Case, seed included).
CALLS = [
    ("api", dict(batch=2, q_heads=2, kv_heads=2, q_len=128, kv_len=128, head_dim=64, v_head_dim=64, layout="hnd",
                 mask=None, mask_shape="head", values="inf", smooth_v=True, scale_factor=0.62, seed=813581037)),
    ("api", dict(batch=2, q_heads=4, kv_heads=4, q_len=8, kv_len=8, head_dim=64, v_head_dim=64, layout="hnd",
                 mask=None, mask_shape="key", mask_style="other_dtype", values="nan", smooth_v=True, seed=805600941)),
    ("api", dict(batch=3, q_heads=1, kv_heads=1, q_len=65, kv_len=5, head_dim=48, v_head_dim=48, layout="hnd",
                 mask="float", mask_shape="full", mask_style="all_masked", values="nan", is_causal=True,
                 scale_factor=0.405, seed=746725775)),
    ("override", dict(batch=1, q_heads=3, kv_heads=3, q_len=5, kv_len=1, head_dim=64, v_head_dim=64, layout="comfy",
                      mask="bool", mask_shape="key", mask_style="padding", values="nan", scale_factor=0.407,
                      seed=203425470)),
    ("override", dict(batch=3, q_heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=48, v_head_dim=48, layout="fused",
                      mask="float", mask_shape="head", mask_style="padding", values="nan", scale_factor=0.931,
                      seed=72476363)),
    ("override", dict(batch=2, q_heads=1, kv_heads=1, q_len=8, kv_len=3, head_dim=128, v_head_dim=128, layout="skip",
                      mask="float", mask_shape="3d", mask_style="padding", values="inf", seed=1044823267)),
]

CHILD = """
import sys
sys.path.insert(0, {tests!r})
import conftest  # noqa: F401  (loads the pack)
if {gpu_max!r}:
    from gpu_max import drop_nan_in_max
    drop_nan_in_max()
import torch
import test_fuzz as F
from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride
from test_triton_nonfinite import CALLS
func, _ = F.comfy_func()
bad = 0
for kernel in ("triton_int8_fp8", "triton_int8_fp16"):
    for path, fields in CALLS:
        case = F.Case(dtype=torch.bfloat16, **fields)
        tally = F.Tally(kernel)
        if path == "api":
            F.api_call(tally, case, kernel, "cpu")
        else:
            F.override_call(tally, case, SageAttentionOverride(PatchConfig(kernel=kernel)), func, "cpu", kernel)
        ran = tally.results.get(kernel, 0)
        print(kernel, path, case.short(), "ran", ran, "violations", tally.violations)
        bad += len(tally.violations) + (ran != 1)
sys.exit(1 if bad else 0)
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("gpu_max", [False, True], ids=["interpreter max", "GPU max (NaN dropped)"])
def test_non_finite_inputs_give_non_finite_outputs(gpu_max):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    code = CHILD.format(tests=str(ROOT / "tests"), gpu_max=gpu_max)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=580,
                          cwd=str(ROOT / "tests"))
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ran 1 violations []") == 2 * len(CALLS), proc.stdout[-4000:]
