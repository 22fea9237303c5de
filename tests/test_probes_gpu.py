"""The hardware probes (kernels/backends/hip/probes.py) on an NVIDIA GPU through the gfx12 emulation: once through
the product path (runtime.run_launches, SAGE_RDNA4_HIP_EMULATE=1) before the self-check, and with each planted
emulation fault (the CUDA build through CuPy), caught with the probe's name. Correctness of the emulation only:
nothing here says what an RDNA4 card does. The e4m3_overflow reading follows the run's SAGE_RDNA4_EMU_FP8_NONSAT
(saturating, or NaN above 448); neither disables a kernel."""
import time

import pytest
import torch

from comfyui_sage_rdna4.kernels import settings
from comfyui_sage_rdna4.kernels.backends.hip import probes
from comfyui_sage_rdna4.kernels.verify import cuda_twin  # noqa: F401 - registers the loader's CUDA platform
from comfyui_sage_rdna4.kernels.verify.emulation_env import env_options

pytestmark = pytest.mark.gpu
LAYOUT = {"wmma_iu8_layout", "wmma_fp8_layout", "wmma_f16_layout", "iu8_bias_constant"}


@pytest.fixture(autouse=True)
def fresh_reports():
    probes.forget()
    yield
    probes.forget()


def _emulated_index(monkeypatch):
    monkeypatch.setenv(settings.HIP_EMULATE.name, "1")
    if getattr(torch.version, "hip", None):
        pytest.skip("the gfx12 emulation runs on NVIDIA GPUs")
    from comfyui_sage_rdna4.kernels.backends.hip.runtime import environment_refusal
    index = torch.cuda.current_device()
    reason = environment_refusal("cuda", index)
    if reason:
        pytest.skip(reason)
    return index


def test_probes_pass_through_the_product_path(monkeypatch):
    index = _emulated_index(monkeypatch)
    probes.probe_device("cuda", index)  # the first run compiles (or loads) the module
    probes.forget()
    t0 = time.perf_counter()
    report = probes.probe_device("cuda", index)
    seconds = time.perf_counter() - t0
    print(f"\n[probes] {report.summary()} ({seconds * 1e3:.1f} ms with the module loaded)")
    assert report.error is None and report.failures() == [] and report.launches == 10
    res = {r.name: r for r in report.results}
    assert res["wmma_fp8_subnormal"].found == "kept" and res["wmma_f16_subnormal"].found == "kept"
    # The emulated conversion past 448 follows the run's mode: SAGE_RDNA4_EMU_FP8_NONSAT=1 builds the module with
    # fp8_nonsat (kernels/verify/emulation_env.py), whose conversion gives NaN there instead of saturating.
    nonsat = bool(env_options().get("fp8_nonsat"))
    assert res["e4m3_overflow"].found.startswith("NaN above 448 (449 -> 0x7F" if nonsat else "saturates to 448")
    # Either reading is safe by construction (FP8 P <= 447.9953, V <= 448): it disables no kernel.
    assert res["e4m3_overflow"].verdict == probes.READING
    assert report.disabled_reason(probes.FP8) is None and report.disabled_reason(probes.FP16) is None
    from comfyui_sage_rdna4.kernels.backends.hip.backend import make_backend
    fp8 = make_backend("fp8")
    assert fp8.probe_refusal("cuda", index) is None and "probe" not in (fp8.unavailable("cuda", index) or "")


def test_first_use_runs_the_probes_before_the_self_check(monkeypatch):
    from comfyui_sage_rdna4.kernels.backends.hip.backend import make_backend
    from comfyui_sage_rdna4.kernels.call_spec import describe_call
    index = _emulated_index(monkeypatch)
    backend = make_backend("fp16")
    order = []
    real = probes.probe_device

    def probe(device_type, idx):
        order.append("probes")
        return real(device_type, idx)
    monkeypatch.setattr(probes, "probe_device", probe)
    monkeypatch.setattr(backend.verdicts, "guard", lambda *a, **k: order.append("self-check"))
    x = torch.empty(1, 1, 1, 64, device=torch.device("cuda", index), dtype=torch.float16)
    assert backend.ready(describe_call(x, x, x)) is None
    assert order == ["probes", "self-check"] and probes.recorded("cuda", index).failures() == []


@pytest.mark.parametrize("option, differ", [("wmma_k_fault", LAYOUT), ("fp8_nonsat", set()),
                                            ("emu_flush_subnormal", set())])
def test_planted_emulation_faults_on_the_gpu(option, differ):
    from comfyui_sage_rdna4.kernels.verify import cupy_runner
    if getattr(torch.version, "hip", None):
        pytest.skip("the CUDA emulation harness runs on NVIDIA GPUs")
    reason = cupy_runner.harness_missing()
    if reason:
        pytest.skip(reason)
    launch = cupy_runner.runner(torch.cuda.current_device(), **{option: 1})

    def run(launches):
        launch(launches)
        torch.cuda.synchronize()
    report = probes.run_probes(run, torch.device("cuda"))
    assert report.error is None and {r.name for r in report.failures()} == differ
    res = {r.name: r for r in report.results}
    if option == "wmma_k_fault":
        assert "wmma_f16_layout" in report.disabled_reason(probes.FP16)
    elif option == "fp8_nonsat":
        assert res["e4m3_overflow"].found.startswith("NaN above 448")
    else:
        assert res["wmma_fp8_subnormal"].found == "flushed" and res["wmma_f16_subnormal"].found == "flushed"
