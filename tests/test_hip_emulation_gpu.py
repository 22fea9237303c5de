"""The gfx12 WMMA emulation on an NVIDIA GPU: each builtin the kernels use, compiled as CUDA with nvrtc
(CuPy) and run with its operands in the gfx12 per-lane layout, must equal a plain matrix product."""
import pytest
import torch

from comfyui_sage_rdna4.kernels.verify import hip_checks

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def run(hip_emulated_run):
    return hip_emulated_run  # tests/conftest.py


@pytest.mark.parametrize("kind", ["iu8", "fp8", "f16"])
def test_emulated_wmma_matches_matrix_product(run, kind):
    for seed in range(4):
        got, want = hip_checks.run_wmma(run, kind, torch.device("cuda"), seed)
        assert torch.equal(got, want.to(got.dtype)), (kind, seed, (got.double() - want.double()).abs().max())
