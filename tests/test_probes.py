"""The hardware probes (kernels/backends/hip/probes.py) on the CPU: the probe kernels run on the host simulator
(the HIP sources as C++ with the gfx12 emulation) and pass there; each planted emulation fault (wmma_k_fault,
fp8_nonsat, emu_flush_subnormal) and each planted output fault is caught by the probe named for it; a failure
disables exactly the backends relying on it, through Backend.disable (auto, an explicit request and the stats
see the reason); the probes run once per device across threads; a launch error disables both HIP backends.
The product runner (runtime.run_launches) is replaced by the simulator: no GPU here, nothing ran on RDNA4."""
import ctypes
import logging
import re
import shutil
import subprocess
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from comfyui_sage_rdna4.kernels import field_report as fr
from comfyui_sage_rdna4.kernels import gating, registry, routing
from comfyui_sage_rdna4.kernels.backends.hip import backend as hip_backend
from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi, probes
from comfyui_sage_rdna4.kernels.backends.hip import prologue as hip_prologue
from comfyui_sage_rdna4.kernels.call_spec import describe_call
from comfyui_sage_rdna4.kernels.verify import host_sim
from comfyui_sage_rdna4.sage_patch.stats import PatchStats
from fakes import FakeBackend

pytestmark = pytest.mark.skipif(host_sim.host_compiler() is None, reason="no host C++ compiler for the simulator")
CPU = torch.device("cpu")
NAMES = ("wmma_iu8_layout", "wmma_fp8_layout", "wmma_f16_layout", "iu8_bias_constant", "wmma_fp8_subnormal",
         "wmma_f16_subnormal", "wmma_fp8_accumulator", "wmma_f16_accumulator", "e4m3_convert", "e4m3_overflow",
         "lane_shuffles", "f16_pack_dot")
FP8, FP16 = probes.FP8, probes.FP16


@pytest.fixture(autouse=True)
def fresh_reports():
    probes.forget()
    yield
    probes.forget()


def failed(report):
    return {r.name for r in report.failures()}


def by_name(report):
    return {r.name: r for r in report.results}


# -- the probes on the emulation ------------------------------------------------------------------------

def test_every_probe_passes_on_the_emulation():
    report = probes.run_probes(host_sim.runner(), CPU)
    assert report.error is None and report.launches == 10
    assert [r.name for r in report.results] == list(NAMES)
    assert failed(report) == set() and report.disabled_reason(FP8) is None and report.disabled_reason(FP16) is None
    res = by_name(report)
    assert res["wmma_fp8_subnormal"].found == "kept" and res["wmma_f16_subnormal"].found == "kept"
    assert res["e4m3_overflow"].verdict == "reading"
    assert res["e4m3_overflow"].found.startswith("saturates to 448 (Inf included)")
    assert "subnormal 2^-8 kept" in res["e4m3_overflow"].found
    assert "7 passed, 0 differ" in report.summary() and "10 launches" in report.summary()
    assert res["wmma_fp8_accumulator"].full_fp32 and res["wmma_f16_accumulator"].full_fp32
    assert report.single_chain_refusal(FP8) is None and report.single_chain_refusal(FP16) is None


def test_k_order_fault_is_caught_by_the_layout_probes():
    """wmma_k_fault=1: B alone in the other family's K order. Every WMMA probe differs, and the reasons name them:
    hip_int8_fp8 loses iu8 and fp8 (and the bias start, an iu8 WMMA), hip_int8_fp16 iu8 and f16."""
    report = probes.run_probes(host_sim.runner(wmma_k_fault=1), CPU)
    assert failed(report) == {"wmma_iu8_layout", "wmma_fp8_layout", "wmma_f16_layout", "iu8_bias_constant"}
    fp8, fp16 = report.disabled_reason(FP8), report.disabled_reason(FP16)
    assert "wmma_iu8_layout" in fp8 and "wmma_fp8_layout" in fp8 and "wmma_f16_layout" not in fp8
    assert "wmma_iu8_layout" in fp16 and "wmma_f16_layout" in fp16 and "wmma_fp8_layout" not in fp16


def test_a_k_permutation_shared_by_a_and_b_is_invisible():
    """wmma_k_fault=2: A and B both in the other order. The sum over K is unchanged, so no probe (and no kernel
    result) can see it: harmless, and the probes say pass."""
    report = probes.run_probes(host_sim.runner(wmma_k_fault=2), CPU)
    assert failed(report) == set() and report.error is None


def test_non_saturating_conversion_is_a_reading_not_a_failure():
    report = probes.run_probes(host_sim.runner(fp8_nonsat=1), CPU)
    assert failed(report) == set() and report.disabled_reason(FP8) is None
    reading = by_name(report)["e4m3_overflow"]
    assert reading.verdict == "reading" and reading.found.startswith("NaN above 448")
    assert "449 -> 0x7F" in reading.found and "-inf -> 0xFF" in reading.found


def test_flushed_subnormals_are_read_as_flushed():
    """emu_flush_subnormal=1: the fp8 and f16 WMMAs read subnormal operands as zero. The readings say so (the
    subnormal-accuracy work decides what that means for P.V); nothing is disabled, iu8 is unaffected."""
    report = probes.run_probes(host_sim.runner(emu_flush_subnormal=1), CPU)
    res = by_name(report)
    assert res["wmma_fp8_subnormal"].found == "flushed" and res["wmma_f16_subnormal"].found == "flushed"
    assert failed(report) == set()


# -- planted output faults: each caught by its probe, disabling exactly its dependents ----------------------

def _poke(kernel, arg, *, kind=None, index=0, fn):
    """A maker of a `run` for host_sim that, after the first launch of `kernel` (and WMMA kind), rewrites the
    32-bit word `index` of output argument `arg` with fn(word as int32, as float) -> int32 word."""
    def make():
        done = []

        def run(launches):
            for ln in launches:
                host_sim.run([ln])
                if ln.kernel != kernel or done or (kind is not None and ln.args[0][1] != kernel_abi.WMMA_KINDS[kind]):
                    continue
                done.append(1)
                word = ctypes.c_int32.from_address(ln.args[arg][1] + 4 * index)
                word.value = fn(word.value, ctypes.c_float.from_buffer_copy(word).value)
        return run
    return make


def _scaled(_, f):  # the float times 1.01: a 1 % scale error
    return ctypes.c_int32.from_buffer_copy(ctypes.c_float(f * 1.01)).value


PLANTED = {
    "iu8 D + 1": (_poke("sage_wmma_probe", 4, kind="iu8", fn=lambda i, f: i + 1), {"wmma_iu8_layout"}, (FP8, FP16)),
    "fp8 D x 1.01": (_poke("sage_wmma_probe", 4, kind="fp8", fn=_scaled), {"wmma_fp8_layout"}, (FP8,)),
    "f16 D x 1.01": (_poke("sage_wmma_probe", 4, kind="f16", index=77, fn=_scaled), {"wmma_f16_layout"}, (FP16,)),
    "bias D - 1": (_poke("sage_bias_probe", 2, fn=lambda i, f: i - 1), {"iu8_bias_constant"}, (FP8, FP16)),
    "e4m3 of 1.0 one code up": (_poke("sage_e4m3_probe", 1, fn=lambda i, f: i + 0x0100), {"e4m3_convert"}, (FP8,)),
    "lane_xor<8> lane 5": (_poke("sage_lane_probe", 2, index=3 * 32 + 5, fn=lambda i, f: i ^ 1), {"lane_shuffles"},
                           (FP8, FP16)),
    "add_f16x2 x 1.01": (_poke("sage_lane_probe", 2, index=7 * 32 + 9, fn=_scaled), {"f16_pack_dot"}, (FP16,)),
}


@pytest.mark.parametrize("plant", list(PLANTED))
def test_a_planted_output_fault_disables_exactly_its_dependents(plant):
    make, names, disabled = PLANTED[plant]
    report = probes.run_probes(make(), CPU)
    assert failed(report) == names
    for backend in (FP8, FP16):
        reason = report.disabled_reason(backend)
        if backend in disabled:
            assert reason and all(f"hardware probe {n} differs" in reason for n in names), (backend, reason)
        else:
            assert reason is None, (backend, reason)


def test_a_launch_error_means_the_probes_could_not_run():
    def broken(launches):
        raise RuntimeError("hipModuleLaunchKernel failed: invalid device function")
    report = probes.run_probes(broken, CPU)
    assert report.error == "RuntimeError: hipModuleLaunchKernel failed: invalid device function"
    for backend in (FP8, FP16):
        assert report.disabled_reason(backend) == f"hardware probes could not run: {report.error}"


# -- first use: once per device, before the self-check, through the recorded-verdict path -------------------

@pytest.fixture
def hip_pair(monkeypatch):
    """Both HIP backends, fresh, registered, taking 'cuda' calls on this CPU machine (environment and prologue
    refusals off); probes.device_runner is what the test sets."""
    monkeypatch.setattr(hip_prologue, "hip_prologue_refusal", lambda call: None)
    pair = {}
    for pv in ("fp8", "fp16"):
        b = hip_backend.make_backend(pv)
        monkeypatch.setattr(b, "_unavailable", lambda device_type, index: None)
        monkeypatch.setitem(registry._REGISTRY, b.name, b)
        pair[b.name] = b
    return pair


def _cuda_call():
    t = torch.empty(1, 2, 40, 64, dtype=torch.float16)
    return replace(describe_call(t, t, t), device_type="cuda", device_index=0)


def test_a_probe_failure_disables_the_dependents_for_auto_explicit_and_stats(hip_pair, monkeypatch, caplog):
    run = PLANTED["f16 D x 1.01"][0]()
    monkeypatch.setattr(probes, "device_runner", lambda device_type, index: (run, CPU))
    ran_selfcheck = []
    monkeypatch.setattr(gating.Verdicts, "guard", lambda self, backend, call, variant=None: ran_selfcheck.append(
        backend.name))
    call = _cuda_call()
    with caplog.at_level(logging.INFO, logger=probes.log.name):
        reason = hip_pair[FP16].ready(call)
    assert reason.startswith("hip_int8_fp16 disabled on cuda:0: hardware probe wmma_f16_layout differs")
    assert ran_selfcheck == []  # the probes come first: no self-check for a backend they disabled
    assert hip_pair[FP16].unavailable("cuda", 0) == reason and hip_pair[FP16].why_not(call) == reason
    assert hip_pair[FP8].unavailable("cuda", 0) is None
    assert hip_pair[FP8].ready(call) is None and ran_selfcheck == [FP8]  # fp8 passes on to its self-check
    # an explicit request and auto both see it; the stats keep the reason auto passed over
    assert routing.route(call, FP16).reason == reason
    monkeypatch.setattr(registry, "auto_order", lambda c: [FP16, "fake_exact"])
    monkeypatch.setitem(registry._REGISTRY, "fake_exact", FakeBackend("fake_exact", quantized=False))
    monkeypatch.setattr(registry, "BACKEND_NAMES", (*registry.BACKEND_NAMES, "fake_exact"))
    found = routing.route(call)
    assert found.backend.name == "fake_exact" and found.passed_over[FP16] == reason
    stats = PatchStats()
    stats.record_passed_over(found.passed_over, "fake_exact")
    assert "wmma_f16_layout" in repr(stats.snapshot())
    # the log: one INFO summary for the device, a WARNING naming the probe
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum(m.startswith("hardware probes on cuda:0: 6 passed, 1 differ (wmma_f16_layout)") for m in infos) == 1
    assert any("hardware probe wmma_f16_layout on cuda:0 differs" in m and "disables hip_int8_fp16" in m
               for m in warnings)


def test_probes_that_cannot_run_disable_both(hip_pair, monkeypatch):
    def no_loader(device_type, index):
        raise OSError("libamdhip64.so: cannot open shared object file")
    monkeypatch.setattr(probes, "device_runner", no_loader)
    reason = hip_pair[FP8].probe_refusal("cuda", 0)
    assert reason == ("hip_int8_fp8 disabled on cuda:0: hardware probes could not run: OSError: libamdhip64.so: "
                      "cannot open shared object file")
    assert hip_pair[FP16].unavailable("cuda", 0).startswith("hip_int8_fp16 disabled on cuda:0: hardware probes "
                                                            "could not run: OSError")


def test_probes_run_once_per_device_across_threads(hip_pair, monkeypatch):
    made = []

    def runner(device_type, index):
        made.append((device_type, index))
        return host_sim.runner(), CPU
    monkeypatch.setattr(probes, "device_runner", runner)
    results = []
    threads = [threading.Thread(target=lambda b=b: results.append(b.probe_refusal("cuda", 0)))
               for b in list(hip_pair.values()) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [None] * 6 and made == [("cuda", 0)]
    hip_pair[FP8].probe_refusal("cuda", 1)
    assert made == [("cuda", 0), ("cuda", 1)]  # another device: its own probes
    assert probes.recorded("cuda", 0) is not probes.recorded("cuda", 1)


def test_no_probes_for_a_device_no_hip_kernel_runs_on(hip_pair, monkeypatch):
    monkeypatch.setattr(probes, "device_runner", lambda *a: pytest.fail("probed a CPU"))
    assert hip_pair[FP8].probe_refusal("cpu", None) is None and probes.recorded("cpu", None) is None


# -- the field report's section ------------------------------------------------------------------------------

def test_field_report_shows_a_planted_probe_failure(hip_pair, monkeypatch):
    monkeypatch.setattr(fr, "_hip_refusal", lambda device: None)
    monkeypatch.setattr(probes, "device_runner", lambda device_type, index: (PLANTED["e4m3 of 1.0 one code up"][0](),
                                                                            CPU))
    data = fr.probes_section(torch.device("cuda", 0))
    assert data["status"] == "failed" and data["launches"] == 10
    rows = {r["name"]: r for r in data["results"]}
    assert rows["e4m3_convert"]["verdict"] == "differs" and "1 -> 0x39 (want 0x38)" in rows["e4m3_convert"]["found"]
    assert hip_pair[FP8].unavailable("cuda", 0).startswith("hip_int8_fp8 disabled on cuda:0: hardware probe "
                                                           "e4m3_convert differs")
    assert hip_pair[FP16].unavailable("cuda", 0) is None
    report = {"title": fr.TITLE, "created_utc": "now", "device": "cuda:0", "seconds": 1.0, "rdna4_note": "",
              "errors": [], "sections": {"hardware_probes": {"status": "ok", "data": data},
                                         "environment": {"status": "ok", "data": {}},
                                         "self_check": {"status": "ok", "data": []},
                                         "benchmark": {"status": "error", "error": "not in this test"}}}
    md = "\n".join(fr.summary(report))
    assert "1 differ (e4m3_convert)" in md
    table = fr.to_markdown(report)
    assert "| e4m3_convert | differs | 1 -> 0x39 (want 0x38) |" in table


def test_field_report_says_why_the_probes_did_not_run():
    data = fr.probes_section(CPU)
    assert data["status"] == "not run" and data["results"] == []
    assert data["note"].startswith("hardware probes: not run: no GPU (cpu)")


# -- the probes exercise the instruction forms the kernels use (the shipped objects, disassembled) --------------

_HELPERS = re.compile(r"^\s*(v_wmma_\w+|v_cvt_pk_fp8_f32|v_dot2_f32_f16|v_fma_mix(?:lo|hi)_f16|v_permlanex16_b32"
                      r"|ds_swizzle_b32)\s+([^/\n]*)", re.M)

_REGISTER = re.compile(r"[vs]\[\d+:\d+\]|\b[vs]\d+\b")


def _forms_by_kernel(text):
    """{kernel: {instruction with its operands' kinds (registers as R, constants and modifiers kept)}}."""
    found = {}
    for chunk in re.split(r"\n(?=[0-9a-f]+ <\w+>:)", text):
        head = re.match(r"[0-9a-f]+ <(\w+)>:", chunk)
        if head:
            found[head.group(1)] = {m + " " + _REGISTER.sub("R", ops).strip() for m, ops in _HELPERS.findall(chunk)}
    return found


@pytest.mark.skipif(shutil.which("llvm-objdump-19") is None, reason="llvm-objdump-19 not installed")
def test_probe_kernels_use_the_instruction_forms_of_the_kernels():
    """Every form of the probed instructions in the product kernels (the iu8 WMMA with C the inline constant
    0.15915494 and signed operands, the fp8/f16 WMMAs with C 0 or registers, v_cvt_pk_fp8_f32 both halves, v_dot2
    from 0 or a register, v_fma_mix, v_permlanex16, ds_swizzle SWAP 1-8) occurs in a probe kernel too, in the
    shipped gfx1201 object: the probes run what the kernels run, not a lookalike."""
    obj = Path(kernel_abi.__file__).parent / "prebuilt" / "sage_kernels-gfx1201.co"
    text = subprocess.run(["llvm-objdump-19", "-d", "--mcpu=gfx1201", str(obj)], capture_output=True, text=True,
                          check=True).stdout
    forms = _forms_by_kernel(text)
    product = set().union(*(f for k, f in forms.items() if "probe" not in k and not k.startswith("sage_qk_scores")))
    probed = set().union(*(f for k, f in forms.items() if k.endswith("_probe")))
    assert "v_wmma_i32_16x16x16_iu8 R, R, R, 0.15915494 neg_lo:[1,1,0]" in product
    assert len(product) >= 15 and product <= probed, sorted(product - probed)
