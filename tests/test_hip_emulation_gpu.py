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


@pytest.mark.parametrize("kind", ["fp8", "f16"])
def test_emulated_wmma_truncation_matches_model(hip_emulated_run, kind):
    """The CUDA emulation built with SG_EMU_ACC_TRUNC_BITS=13 / SG_EMU_F16_ACC_TRUNC_BITS=13 equals the torch model
    of a 13-bit truncating accumulator (hip_checks.trunc_acc_model) bit for bit, as the CPU simulator does."""
    from comfyui_sage_rdna4.kernels.verify import cupy_runner
    trunc = cupy_runner.runner(torch.cuda.current_device(), acc_trunc_bits=13, f16_acc_trunc_bits=13)

    def run(launches):
        trunc(launches)
        torch.cuda.synchronize()
    for seed in range(4):
        got, want, exact = hip_checks.run_trunc_wmma(run, kind, torch.device("cuda"), 13, seed)
        assert torch.equal(got, want), (kind, seed, (got.double() - want.double()).abs().max())
        assert (want != exact).sum() > 16
