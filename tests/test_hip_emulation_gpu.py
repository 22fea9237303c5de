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


@pytest.mark.parametrize("nonsat", [0, 1])
def test_emulated_e4m3_conversion(hip_emulated_run, nonsat):
    """The CUDA emulation's e4m3 conversion (pack_e4m3x4, the probe kernel): round to nearest even, saturating above
    448 by default, NaN (0x7f / 0xff) above 448 with fp8_nonsat; the same bytes as the CPU simulator's."""
    from comfyui_sage_rdna4.kernels.verify import cupy_runner
    launch = cupy_runner.runner(torch.cuda.current_device(), fp8_nonsat=nonsat)

    def run(launches):
        launch(launches)
        torch.cuda.synchronize()
    x = hip_checks.e4m3_probe_values()
    assert torch.equal(hip_checks.run_e4m3(run, x, torch.device("cuda")), hip_checks.e4m3_expected(x, bool(nonsat)))


@pytest.mark.parametrize("kind", ["iu8", "fp8", "f16"])
def test_layout_probe_reports_a_k_order_that_a_and_b_do_not_share(hip_emulated_run, kind):
    """The probe on the CUDA emulation with planted K-order faults (wmma_k_fault): B alone in another K order (1)
    gives wrong products in most elements; A and B sharing it (2) stays exact (a shared K permutation is invisible)."""
    from comfyui_sage_rdna4.kernels.verify import cupy_runner

    def runner(**options):
        launch = cupy_runner.runner(torch.cuda.current_device(), **options)

        def run(launches):
            launch(launches)
            torch.cuda.synchronize()
        return run
    got, want = hip_checks.run_wmma(runner(wmma_k_fault=1), kind, torch.device("cuda"), 0)
    assert int((got != want.to(got.dtype)).sum()) > 128, "the probe missed a K order that A and B do not share"
    got, want = hip_checks.run_wmma(runner(wmma_k_fault=2), kind, torch.device("cuda"), 0)
    assert torch.equal(got, want.to(got.dtype))


def test_emulated_f16_wmma_takes_amds_k_order(run):
    """As on the CPU simulator: the CUDA emulation takes f16 element e of lane half h as K 8 (e // 4) + 4h + e % 4."""
    assert float(hip_checks.run_f16_k_order(run, torch.device("cuda"))) == 2.0 ** 24 + 4
