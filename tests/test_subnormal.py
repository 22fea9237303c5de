"""Subnormal WMMA inputs (nothing here has run on RDNA4: whether its WMMA flushes them is unknown). The emulation's
emu_flush_subnormal option (kernel_abi.VERIFY_OPTIONS) models a matrix unit that reads them as zero; these tests
check the model itself on the CPU (kernels/verify/host_sim.py) and the kernels' attention under it."""
import pytest
import torch

from comfyui_sage_rdna4.kernels.verify import hip_checks, host_sim

pytestmark = pytest.mark.skipif(host_sim.host_compiler() is None, reason="no host C++ compiler for the simulator")
CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["fp8", "f16"])
def test_flush_option_zeroes_exactly_the_subnormal_products(kind):
    """Default build: subnormal e4m3/f16 operands read exactly (D = A B + C bit for bit). emu_flush_subnormal=1: D is
    the product with every subnormal A and B element read as zero, bit for bit, and differs from the exact D (the
    case has subnormals in every row and column, so a flush that missed A, B or one format would show)."""
    got, exact, flush = hip_checks.run_subnormal_wmma(host_sim.run, kind, CPU)
    assert torch.equal(got, exact)
    got, exact, flush = hip_checks.run_subnormal_wmma(host_sim.runner(emu_flush_subnormal=1), kind, CPU)
    assert int((exact != flush).sum()) > 128
    assert torch.equal(got, flush), (got - flush).abs().max()
