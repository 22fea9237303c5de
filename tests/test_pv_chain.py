"""The HIP P.V chain (kernels/backends/hip/pv_chain.py): chosen once per device and P.V mode at first use, the single
chain only where its kernel ships, the accumulator probe read full FP32 and the self-check's precision-probe and
long-tail cases pass with it; SAGE_RDNA4_HIP_PV_CHAIN forces either. The kernels themselves on the host simulator
(the HIP sources as C++ with the gfx12 emulation): the FP16 single chain matches the spec with an exact accumulator
and loses mass on a long diffuse row with the emulation's truncating 13-bit one, where the two-level kernel does
not (the planted fault the probe and the self-check must catch). Nothing here has run on RDNA4 hardware."""
import logging
import threading

import pytest
import torch

from comfyui_sage_rdna4.kernels import settings
from comfyui_sage_rdna4.kernels.backends.hip import backend as hip_backend
from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi, probes, pv_chain
from comfyui_sage_rdna4.kernels.self_check import checks_fingerprint
from comfyui_sage_rdna4.kernels.verify import hip_checks, host_sim

CPU = torch.device("cpu")
FULL = None  # the probes' answer for a unit read as full FP32
NARROW = "wmma_f16_accumulator: 13 fraction bits kept across 16 chained WMMAs, truncates, not full FP32"


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(settings, "_parsed", {})
    monkeypatch.delenv(settings.HIP_PV_CHAIN.name, raising=False)
    pv_chain.forget()
    yield
    pv_chain.forget()


def passes():
    return None


def test_single_chain_needs_full_fp32_and_the_long_tail_case():
    calls = []

    def long_tail():
        calls.append(1)
        return None
    got = pv_chain.choose("fp16", "cuda", 0, FULL, long_tail)
    assert got.chain == "single" and "full FP32" in got.why and calls == [1]
    assert pv_chain.choose("fp16", "cuda", 0, NARROW, long_tail) is got and calls == [1]  # decided once
    assert pv_chain.chosen("fp16", "cuda", 0) is got
    narrow = pv_chain.choose("fp16", "cuda", 1, NARROW, lambda: pytest.fail("checked a narrow unit"))
    assert narrow.chain == "two-level" and narrow.why == NARROW


def test_a_failed_or_crashed_long_tail_case_keeps_the_two_level_kernel():
    failed = pv_chain.choose("fp16", "cuda", 0, FULL, lambda: "rel L1 0.21 > 0.035 at (0, 1)")
    assert failed.chain == "two-level" and "accumulation cases: rel L1 0.21" in failed.why

    def crash():
        raise RuntimeError("hipModuleLaunchKernel failed")
    crashed = pv_chain.choose("fp16", "cuda", 1, FULL, crash)
    assert crashed.chain == "two-level" and "could not run: RuntimeError: hipModuleLaunchKernel" in crashed.why


def test_fp8_has_no_single_chain_even_when_forced(monkeypatch):
    monkeypatch.setenv(settings.HIP_PV_CHAIN.name, "single")
    got = pv_chain.choose("fp8", "cuda", 0, FULL, lambda: pytest.fail("checked a kernel that does not ship"))
    assert got.chain == "two-level" and got.why == "no single-chain FP8 kernel ships"
    with pytest.raises(ValueError, match="no 'single' P.V kernel for pv='fp8'"):
        kernel_abi.attention_kernel("fp8", 128, torch.float16, "single")


def test_the_setting_forces_either(monkeypatch, caplog):
    monkeypatch.setenv(settings.HIP_PV_CHAIN.name, "two-level")
    got = pv_chain.choose("fp16", "cuda", 0, FULL, lambda: pytest.fail("forced: nothing to check"))
    assert got.chain == "two-level" and got.why == "forced by SAGE_RDNA4_HIP_PV_CHAIN"
    monkeypatch.setenv(settings.HIP_PV_CHAIN.name, "single")
    monkeypatch.setattr(settings, "_parsed", {})
    with caplog.at_level(logging.WARNING):
        forced = pv_chain.choose("fp16", "cuda", 1, NARROW, lambda: pytest.fail("forced: nothing to check"))
    assert forced.chain == "single" and NARROW in forced.why
    assert any("serves although" in r.getMessage() for r in caplog.records)


def test_concurrent_first_callers_share_one_check():
    calls, results = [], []

    def long_tail():
        calls.append(1)
        return None
    threads = [threading.Thread(target=lambda: results.append(pv_chain.choose("fp16", "cuda", 0, FULL, long_tail)))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and len({id(r) for r in results}) == 1


def test_forgetting_the_probes_forgets_the_choices():
    pv_chain.choose("fp16", "cuda", 0, FULL, passes)
    probes.forget()
    assert pv_chain.recorded("fp16", "cuda", 0) is None


def test_a_self_check_pass_is_kept_per_chain(tmp_path):
    """The pass cache's key names the chain chosen on the device: a pass of the two-level kernel does not serve the
    single chain (one code object holds both)."""
    backend = hip_backend.make_backend("fp16")
    cache = backend.verdicts.cache
    cache.inner.enabled = True
    identity = {"gpu": "test", "arch": "gfx1201", "driver": "1"}
    variant = backend.variant(hip_backend_call())
    dev = torch.device("cuda", 0)
    before = cache.key(backend.name, variant, dev, checks_fingerprint(), identity=identity)
    pv_chain.choose("fp16", "cuda", 0, FULL, passes)
    after = cache.key(backend.name, variant, dev, checks_fingerprint(), identity=identity)
    assert before and after and before != after


def hip_backend_call():
    from comfyui_sage_rdna4.kernels.call_spec import describe_call
    t = torch.empty(1, 1, 8, 64, dtype=torch.float16)
    return describe_call(t, t, t)


# -- the kernels on the host simulator ---------------------------------------------------------------------------
needs_sim = pytest.mark.skipif(host_sim.host_compiler() is None, reason="no host C++ compiler for the simulator")


@needs_sim
def test_fp16_single_chain_matches_the_spec_with_an_exact_accumulator():
    q, k, v = hip_checks.make_qkv(1, 2, 1, 70, 200, 64, torch.float16, CPU)
    sm = 0.125
    qq = hip_checks.prologue(host_sim.run, q, k, v, sm_scale=sm, pv="fp16")
    out, lse = hip_checks.attention(host_sim.run, qq, pv="fp16", is_causal=True, out_dtype=torch.float16,
                                    return_lse=True, q=q, sm_scale=sm, chain="single")
    rep = hip_checks.attention_report(out, lse, qq, q, k, v, pv="fp16", is_causal=True, sm_scale=sm)
    hip_checks.assert_attention_ok(rep, "fp16")
    two, _ = hip_checks.attention(host_sim.run, qq, pv="fp16", is_causal=True, out_dtype=torch.float16, q=q,
                                  sm_scale=sm)
    # The same P and the same products, summed in another order: equal to a few fp16 units.
    assert float((out.float() - two.float()).abs().max()) <= 4e-3 * float(two.float().abs().max())


@needs_sim
def test_a_truncating_accumulator_breaks_the_fp16_single_chain_only():
    """Diffuse attention over 2048 keys with a V offset, FP16 P.V, the emulated f16 WMMA truncating to 13 bits: the
    two-level kernel stays near exact attention, the single chain loses mass (and the probe reads 13 bits there,
    so the single chain would not have been chosen)."""
    from comfyui_sage_rdna4.kernels import metrics, quant, reference
    q, k, v = hip_checks.diffuse_qkv(1, 1, 16, 2048, 64, torch.bfloat16, CPU)
    exact, _ = reference.exact_attention(q, k, v)
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=0.125, pv="fp16")
    run = host_sim.runner(f16_acc_trunc_bits=13)
    two, _ = hip_checks.attention(run, qq, pv="fp16", is_causal=False, out_dtype=torch.bfloat16)
    one, _ = hip_checks.attention(run, qq, pv="fp16", is_causal=False, out_dtype=torch.bfloat16, chain="single")
    err_two, err_one = (metrics.rel_l1(t.float(), exact) for t in (two, one))
    assert err_two < 0.01, err_two
    assert err_one > 3 * err_two and err_one > 0.01, (err_one, err_two)
    assert probes.probe_accumulator(run, CPU, "f16").full_fp32 is False


def test_field_report_shows_each_choice_and_both_timings():
    from comfyui_sage_rdna4.kernels import field_report as fr
    pv_chain.choose("fp16", "cpu", None, FULL, passes)
    data = fr.pv_chain_section(CPU, lambda text: None)
    assert data["choices"]["hip_int8_fp16"].startswith("single P.V (the accumulator probe reads full FP32")
    assert data["choices"]["hip_int8_fp8"].startswith("not chosen") and data["timings"] == []
    assert data["note"] == "no GPU (cpu): nothing timed"
    data["timings"] = [{"kernel": "hip_int8_fp16", "shape": "flux_1mp", "two-level ms": 2.0, "single ms": 1.8,
                        "single / two-level": 0.9}]
    report = {"title": fr.TITLE, "created_utc": "now", "device": "cpu", "seconds": 1.0, "rdna4_note": "",
              "errors": [], "sections": {"hip_pv_chain": {"status": "ok", "data": data}}}
    md = fr.to_markdown(report)
    assert "## HIP P·V chain" in md and "| hip_int8_fp16 | flux_1mp | 2.0 | 1.8 | 0.9 |" in md
    assert "- hip_int8_fp16: single P.V (" in md


def test_the_chain_shows_in_the_stats(monkeypatch):
    from comfyui_sage_rdna4.kernels.backends.hip import runtime
    from comfyui_sage_rdna4.sage_patch.stats import PatchStats
    monkeypatch.setattr(runtime, "code_path_line", lambda: "prebuilt gfx1201 1a2b3c4d")
    pv_chain.choose("fp16", "cuda", 0, FULL, passes)
    pv_chain.choose("fp8", "cuda", 0, FULL, passes)
    stats = PatchStats()
    stats.record_call("hip_int8_fp16")
    stats.record_call("hip_int8_fp8")
    summary = stats.summary()
    assert "ran hip_int8_fp16: 1 (prebuilt gfx1201 1a2b3c4d; single P.V)" in summary
    assert "ran hip_int8_fp8: 1 (prebuilt gfx1201 1a2b3c4d; two-level P.V)" in summary
    pv_chain.choose("fp16", "cuda", 1, NARROW, passes)
    assert pv_chain.stats_line("fp16") == "cuda:0 single P.V, cuda:1 two-level P.V"


def test_the_accumulation_check_runs_once_per_gpu_driver_and_code(monkeypatch, tmp_path):
    """A pass of the single chain's accumulation cases is kept with the self-check's passes: a later process (a
    fresh backend) on the same GPU, driver and code does not run them again; a failure is never kept."""
    import importlib

    from comfyui_sage_rdna4.kernels import pass_cache
    self_check = importlib.import_module("comfyui_sage_rdna4.kernels.self_check")
    monkeypatch.setenv(settings.CACHE.name, str(tmp_path))
    monkeypatch.setenv(settings.SELF_CHECK_CACHE.name, "1")  # the tests' default is off (tests/conftest.py)
    monkeypatch.setattr(pass_cache, "gpu_identity", lambda device: {"gpu": "test gpu", "driver": "1"})
    runs, verdict = [], [None]

    def fake_run(attention, device, cases, accepts=None, **kw):
        runs.append(sorted(c.kind for c in cases))
        result = self_check.SelfCheckResult(verdict[0])
        return result
    monkeypatch.setattr(self_check, "run_self_check", fake_run)
    verdict[0] = "rel L1 0.05 > 0.015"
    assert hip_backend.make_backend("fp16").accumulation_refusal("cuda", 0, "single") == "rel L1 0.05 > 0.015"
    verdict[0] = None
    assert hip_backend.make_backend("fp16").accumulation_refusal("cuda", 0, "single") is None
    assert hip_backend.make_backend("fp16").accumulation_refusal("cuda", 0, "single") is None
    assert runs == [["long-tail", "probe"]] * 2
    assert hip_backend.make_backend("fp16").accumulation_refusal("cuda", 0, "two-level") is None and len(runs) == 3
