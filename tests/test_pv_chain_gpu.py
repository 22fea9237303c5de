"""The accumulator probe and the single-chain P.V on an NVIDIA GPU through the gfx12 emulation (CUDA via CuPy):
the probe reads the emulated accumulator set to 13, 16 and 24 fraction bits (and exact); the FP16 single chain
matches the spec with an exact accumulator; and the planted fault: with the emulation's truncating 13-bit
accumulator the single chain is rejected by the probe and by the self-check (its precision-probe case), while the
two-level kernel passes the same cases, so the first-use choice keeps the two-level kernel. Correctness of the
emulation only: nothing here says what an RDNA4 card does."""
import math

import pytest
import torch

from comfyui_sage_rdna4.kernels.backends.hip import backend as hip_backend
from comfyui_sage_rdna4.kernels.backends.hip import probes, pv_chain
from comfyui_sage_rdna4.kernels.self_check import DEFAULT_CASES, run_self_check
from comfyui_sage_rdna4.kernels.verify import hip_checks

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
ACCUMULATION_CASES = [c for c in DEFAULT_CASES if c.kind in hip_backend.ACCUMULATION_CASE_KINDS]



@pytest.fixture(autouse=True)
def fresh():
    probes.forget()
    yield
    probes.forget()


@pytest.mark.parametrize("bits,read_bits,full", [(0, 23, True), (13, 13, False), (16, 16, False), (24, 23, True)])
def test_accumulator_probe_reads_the_emulated_width(emulated_runner, bits, read_bits, full):
    run_ = emulated_runner(acc_trunc_bits=bits, f16_acc_trunc_bits=bits)
    for kind, backend in (("fp8", probes.FP8), ("f16", probes.FP16)):
        res = probes.probe_accumulator(run_, DEV, kind)
        print(f"\n[accumulator] emulated {bits or 'exact'} bits, {kind}: {res.found}")
        assert res.full_fp32 is full and res.found.startswith(f"{read_bits} fraction bits kept"), res.found
        report = probes.ProbeReport("cuda", results=[res])
        assert (report.single_chain_refusal(backend) is None) is full


def _attention(run_, chain):
    """attention(q, k, v, is_causal=False) through the emulated HIP prologue and FP16 P.V kernel of `chain`."""
    def attention(q, k, v, is_causal=False):
        sm = 1 / math.sqrt(q.shape[-1])
        qq = hip_checks.prologue(run_, q, k, v, sm_scale=sm, pv="fp16")
        out, _ = hip_checks.attention(run_, qq, pv="fp16", is_causal=is_causal, out_dtype=q.dtype, chain=chain)
        return out
    return attention


@pytest.mark.parametrize("d,dtype,causal", [(128, torch.bfloat16, False), (128, torch.float16, True),
                                            (64, torch.bfloat16, True), (64, torch.float16, False)])
def test_fp16_single_chain_matches_the_spec(emulated_runner, d, dtype, causal):
    run_ = emulated_runner()
    q, k, v = hip_checks.make_qkv(2, 4, 2, 333, 1517, d, dtype, DEV)
    sm = 1 / math.sqrt(d)
    qq = hip_checks.prologue(run_, q, k, v, sm_scale=sm, pv="fp16")
    out, lse = hip_checks.attention(run_, qq, pv="fp16", is_causal=causal, out_dtype=dtype, return_lse=True, q=q,
                                    sm_scale=sm, chain="single")
    rep = hip_checks.attention_report(out, lse, qq, q, k, v, pv="fp16", is_causal=causal, sm_scale=sm)
    print(f"\n[single chain] D{d} {dtype} causal={causal}: {rep}")
    hip_checks.assert_attention_ok(rep, "fp16")


def test_a_truncating_13_bit_accumulator_rejects_the_single_chain(emulated_runner):
    """The planted fault: the emulated WMMAs truncate C to 13 fraction bits. The probe reads it (no single chain),
    the self-check's accumulation cases fail with the single chain and pass with the two-level kernel, and the
    first-use choice, asked with both answers, keeps the two-level kernel. With the exact emulated accumulator the
    same choice takes the single chain."""
    narrow = emulated_runner(acc_trunc_bits=13, f16_acc_trunc_bits=13)
    report = probes.run_probes(narrow, DEV)
    refusal = report.single_chain_refusal(probes.FP16)
    assert refusal and refusal.startswith("wmma_f16_accumulator: 13 fraction bits"), refusal
    single = run_self_check(_attention(narrow, "single"), DEV, ACCUMULATION_CASES, lambda c: True)
    two = run_self_check(_attention(narrow, "two-level"), DEV, ACCUMULATION_CASES, lambda c: True)
    print(f"\n[planted 13-bit accumulator] single chain: {single.reason}; two-level: {two.reason}; worst rel L1 "
          f"single {[r.worst_rel_l1 for r in single.results]}, two-level {[r.worst_rel_l1 for r in two.results]}")
    assert single.reason is not None and two.reason is None
    choice = pv_chain.choose("fp16", "cuda", 0, refusal, lambda: single.reason)
    assert choice.chain == "two-level" and choice.why == refusal
    pv_chain.forget()
    # Even a probe fooled into reading full FP32 leaves the two-level kernel: the self-check cases catch it.
    assert pv_chain.choose("fp16", "cuda", 0, None, lambda: single.reason).chain == "two-level"
    pv_chain.forget()
    exact = emulated_runner()
    ok = probes.run_probes(exact, DEV).single_chain_refusal(probes.FP16)
    passed = run_self_check(_attention(exact, "single"), DEV, ACCUMULATION_CASES, lambda c: True).reason
    assert ok is None and passed is None, (ok, passed)
    assert pv_chain.choose("fp16", "cuda", 0, ok, lambda: passed).chain == "single"
