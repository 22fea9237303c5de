"""Subnormal WMMA inputs (nothing here has run on RDNA4: whether its WMMA flushes them is unknown). The emulation's
emu_flush_subnormal option (kernel_abi.VERIFY_OPTIONS) models a matrix unit that reads them as zero; these tests
check the model itself on the CPU (kernels/verify/host_sim.py) and the kernels' attention under it."""

import pytest
import torch

from comfyui_sage_rdna4.kernels.verify import hip_checks, host_sim, subnormal_model

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


# Crafted quantized inputs (subnormal_model.long_tail_qq): every row's max in key 0, the other keys 2^-15 .. 2^-16
# below it (subnormal as FP8 P topped at the row max's 448, and as FP16 P in [0, 1]); 2048 keys, batch 2. The bound
# sits 6x above the fixed kernels under a flushing WMMA (FP8 7.9e-4, FP16 1.4e-4: the fp16 output's rounding) and 5x
# below the former kernels' (FP8 2.5e-2, FP16 5.1e-2), in the host simulator and the spec's flush model alike. The
# self-check's own long-tail case, from float inputs: tests/test_long_tail_case.py.
CASE = {"kv_len": 2048, "tail_log2": (15.0, 16.0), "batch": 2, "max_rel_l1": 0.005}


def long_tail(pv: str, flush: int, d: int = 64):
    """(host-simulator output, exact output, the spec on the kernel's P grid under the same flush model)."""
    qq, exact = subnormal_model.long_tail_qq(pv, CASE["kv_len"], CASE["tail_log2"], batch=CASE["batch"], d=d)
    out, _ = hip_checks.attention(host_sim.runner(emu_flush_subnormal=flush), qq, pv=pv, is_causal=False,
                                  out_dtype=torch.float16)
    model = subnormal_model.spec_model(qq, pv, flush=bool(flush), p_tile=hip_checks.HIP_P_TILE)
    return out.float(), exact, model


def long_tail_rel_l1(pv: str, flush: int) -> float:
    out, exact, _ = long_tail(pv, flush)
    return subnormal_model.rel_l1(out, exact)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_long_tail_survives_a_flushing_wmma(pv):
    """Under the emulated flush (emu_flush_subnormal) the kernel's P.V and row sum agree on the long tail: rel L1
    against exact attention within the case's bound. Fails on the kernels whose FP8 P took the row max as its top and
    whose FP16 P lay in [0, 1] (2.5e-2, 5.05e-2). The spec on the kernel's P grid with its flush model
    (reference.attention_from_quantized p_tile, model_flushing_wmma) agrees with the simulator to the fp16 output's
    rounding."""
    out, exact, model = long_tail(pv, 1)
    err = subnormal_model.rel_l1(out, exact)
    assert err <= CASE["max_rel_l1"], (pv, err)
    assert float((out.double() - model.double()).abs().sum() / model.double().abs().sum()) < 3e-4


@pytest.mark.slow
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_long_tail_without_a_flush(pv):
    """The same case on the default (non-flushing) emulation: within the bound too (FP8 1.4e-4, FP16 1.4e-4)."""
    assert long_tail_rel_l1(pv, 0) <= CASE["max_rel_l1"]
