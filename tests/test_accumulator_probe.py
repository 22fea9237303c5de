"""The accumulator probe (kernels/backends/hip/accumulator.py, probes.probe_accumulator): its operands, its exact
expected values, its reading of simulated accumulators of 13, 16 and 24 fraction bits that round or truncate, and
the probe kernel on the host simulator (the HIP sources as C++ with the gfx12 emulation), whose truncating
accumulator is set to 13, 16 and 24 bits. Nothing here has run on RDNA4 hardware."""
from fractions import Fraction

import pytest
import torch

from comfyui_sage_rdna4.kernels.backends.hip import accumulator as acc
from comfyui_sage_rdna4.kernels.backends.hip import probes
from comfyui_sage_rdna4.kernels.verify import host_sim

CPU = torch.device("cpu")
MODES = (acc.NEAREST, acc.TRUNCATE)


def test_operands_are_exact_in_both_formats():
    """Every A and B entry is a normal e4m3 and f16 number (no subnormal a flushing unit could drop), and each
    element's product is its increment exactly."""
    a, b, c = acc.operands()
    for cast, tiny in ((torch.float8_e4m3fn, 2.0 ** -6), (torch.float16, 2.0 ** -14)):
        for x in (a, b):
            assert torch.equal(x.to(cast).float(), x)
            nonzero = x[x != 0].abs()
            assert bool((nonzero >= tiny).all())
    prod = a.double() @ b.double()
    for el in acc.ELEMENTS:
        assert Fraction(float(prod[el.row, el.col])) == el.delta
        assert Fraction(float(c[el.row, el.col])) == el.c0
    assert len({(el.row, el.col) for el in acc.ELEMENTS}) == len(acc.ELEMENTS)


def test_expected_values_come_from_exact_arithmetic():
    """Hand-worked: 2^16 + 16 * 2^10 for j 6; at j 24 an fp32 chain keeps 2^16 (each 2^-8 is a tie, C even);
    at j 24, p 3/2 rounding to nearest climbs one unit 2^-7 per step, truncation stays."""
    el = {(e.sign, e.j, e.p): e for e in acc.ELEMENTS}
    assert el[1, 6, 1].exact == 2 ** 16 + 16 * 2 ** 10
    assert el[-1, 6, 1].exact == -(2 ** 16 + 16 * 2 ** 10)
    assert acc.chain(el[1, 24, 1], 23, acc.NEAREST) == 2 ** 16
    assert acc.chain(el[1, 24, Fraction(3, 2)], 23, acc.NEAREST) == 2 ** 16 + 16 * Fraction(1, 128)
    assert acc.chain(el[1, 24, Fraction(3, 2)], 23, acc.TRUNCATE) == 2 ** 16
    assert acc.chain(el[1, 13, 1], 13, acc.TRUNCATE) == el[1, 13, 1].exact
    assert acc.chain(el[1, 14, 1], 13, acc.TRUNCATE) == 2 ** 16
    assert acc.fp32_exact(el[1, 23, 1]) and not acc.fp32_exact(el[1, 24, 1])
    assert not acc.fp32_exact(el[1, 23, Fraction(3, 2)]) and acc.fp32_exact(el[1, 22, Fraction(3, 2)])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits,read_bits,full", [(13, 13, False), (16, 16, False), (24, 23, True)])
def test_reading_of_simulated_accumulators(bits, read_bits, full, mode):
    """A simulated accumulator of 13 or 16 fraction bits reads as such and not full FP32; one of 24 bits stored as
    fp32 reads 23 and full FP32. The mode: rounding to nearest moves C by 3/4 of a unit, truncation does not (a
    24-bit truncating unit loses that 3/4 unit at its own grid, then the fp32 store rounds the half unit left to
    even: it reads as truncating)."""
    reading = acc.read(acc.model_output(bits, mode))
    assert reading.bits == read_bits and reading.full_fp32 is full
    assert reading.mode == (acc.TRUNCATE if bits == 24 and mode == acc.TRUNCATE else mode)
    assert len(reading.models) == 1 and reading.problems == ()
    assert torch.equal(acc.model_output(*reading.models[0]), acc.model_output(bits, mode))
    assert ("not full FP32" in reading.text()) is not full


def test_a_unit_with_one_bit_less_than_fp32_is_not_full():
    reading = acc.read(acc.model_output(22, acc.NEAREST))
    assert reading.bits == 22 and not reading.full_fp32


def test_an_element_off_every_model_is_named():
    """One element 1 % off (a broken unit or a misread lane): no model predicts it; a non-finite one: unreadable."""
    d = acc.model_output(23, acc.NEAREST)
    el = next(e for e in acc.ELEMENTS if e.j == 10)
    d[el.row, el.col] *= 1.01
    reading = acc.read(d)
    assert not reading.full_fp32 and reading.models == () and f"D[{el.row}][{el.col}]" in reading.text()
    d[0, 0] = float("nan")
    assert acc.read(d).bits is None and "not finite" in acc.read(d).text()
    stray = acc.model_output(23, acc.NEAREST)
    stray[15, 15] = 1.0
    assert not acc.read(stray).full_fp32


@pytest.mark.skipif(host_sim.host_compiler() is None, reason="no host C++ compiler for the simulator")
@pytest.mark.parametrize("bits,read_bits,full", [(0, 23, True), (13, 13, False), (16, 16, False), (24, 23, True)])
def test_probe_kernel_on_the_emulation(bits, read_bits, full):
    """The probe kernel through the host simulator with the emulated accumulator truncating to `bits` (0: exact fp32
    sums): the reading and the single chain's verdict follow, for the fp8 and the f16 WMMA."""
    run = host_sim.runner(acc_trunc_bits=bits, f16_acc_trunc_bits=bits)
    for kind, backend in (("fp8", probes.FP8), ("f16", probes.FP16)):
        res = probes.probe_accumulator(run, CPU, kind)
        assert res.verdict == probes.READING and res.full_fp32 is full, res.found
        assert res.found.startswith(f"{read_bits} fraction bits kept"), res.found
        report = probes.ProbeReport("cpu", results=[res])
        refusal = report.single_chain_refusal(backend)
        assert (refusal is None) is full
        if not full:
            assert refusal.startswith(f"{probes.ACCUMULATOR_PROBES[backend]}: {read_bits} fraction bits")


@pytest.mark.skipif(host_sim.host_compiler() is None, reason="no host C++ compiler for the simulator")
@pytest.mark.parametrize("bits", [16, 24])
@pytest.mark.parametrize("kind", ["fp8", "f16"])
def test_emulated_truncation_matches_its_torch_twin_at_any_width(kind, bits):
    """The emulation's truncating accumulator (normalised in double, then stored as fp32) equals the torch model bit
    for bit at 16 and 24 bits too, where the normalised sum can need more than fp32's 24 significant bits."""
    from comfyui_sage_rdna4.kernels.verify import hip_checks
    run = host_sim.runner(acc_trunc_bits=bits, f16_acc_trunc_bits=bits)
    for seed in range(2):
        got, want, exact = hip_checks.run_trunc_wmma(run, kind, CPU, bits, seed)
        assert torch.equal(got, want), (kind, bits, seed, (got - want).abs().max())
        if bits == 16:
            assert not torch.equal(want, exact)
