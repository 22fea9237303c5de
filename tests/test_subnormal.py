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


# The long tail: every row's max in key 0, the other keys 2^-15 .. 2^-16 below it (subnormal as FP8 P topped at the
# row max's 448, and as FP16 P in [0, 1]); 2048 keys, batch 2. The bound sits 5x above the fixed kernels' torch model
# under a flushing WMMA (FP8 7.8e-4, FP16 5e-7) and 5x below the former kernels' (FP8 2.5e-2, FP16 5.1e-2).
LONG_TAIL = dict(nk=2048, tail_log2=(15.0, 16.0))
LONG_TAIL_BOUND = 0.005


def long_tail_rel_l1(pv: str, flush: int, d: int = 64) -> float:
    from comfyui_sage_rdna4.kernels.verify import subnormal_model
    qq, exact = subnormal_model.long_tail_qq(pv, d=d, **LONG_TAIL)
    out, _ = hip_checks.attention(host_sim.runner(emu_flush_subnormal=flush), qq, pv=pv, is_causal=False,
                                  out_dtype=torch.float16)
    return subnormal_model.rel_l1(out.float(), exact)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_long_tail_survives_a_flushing_wmma(pv):
    """The kernel's P.V and row sum agree on the long tail whether or not the WMMA flushes subnormal P: rel L1
    against exact attention within LONG_TAIL_BOUND with the emulated flush (emu_flush_subnormal) and without. Fails
    on the kernels whose FP8 P took the row max as its top and whose FP16 P lay in [0, 1] (flushed: 2.5e-2, 5.0e-2)."""
    for flush in (1, 0):
        err = long_tail_rel_l1(pv, flush)
        assert err <= LONG_TAIL_BOUND, (pv, flush, err)
