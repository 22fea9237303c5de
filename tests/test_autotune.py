"""`auto` that measures alone (kernels/tuner.py, decisions.py, routing.py), with fake backends and an injected
timer: no GPU needed.

The fake call says it is on a ROCm GPU (so the real rules for measuring apply) while its tensors stay on
the CPU; the timer returns each fake backend's set time for the backend that just ran.
"""
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from comfyui_sage_rdna4.kernels import decisions, disk_cache, registry, routing, settings
from comfyui_sage_rdna4.kernels import tuner as tuner_mod
from comfyui_sage_rdna4.kernels.call_spec import describe_call
from comfyui_sage_rdna4.kernels.dispatch import settled_route
from fakes import FakeBackend

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = {"gpu": "AMD Radeon RX 9070 XT", "arch": "gfx1201", "driver": 60342134, "torch": "2.9", "hip": "6.4",
            "cuda": None, "triton": "3.6"}


class Clock:
    """timer(fn, device): runs fn and answers the time set for the backend that ran; counts timed calls."""

    def __init__(self, ran, times):
        self.ran, self.times, self.timed = ran, times, []

    def __call__(self, fn, device):
        fn()
        self.timed.append(self.ran[-1])
        return self.times[self.ran[-1]]


def tensors(nq=4000, nk=4000, hq=2, hkv=2, d=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, hq, nq, d, generator=g).to(dtype), torch.randn(1, hkv, nk, d, generator=g).to(dtype),
            torch.randn(1, hkv, nk, d, generator=g).to(dtype))


def gpu_call(qkv, **kw):
    """The call as a ROCm GPU would describe it (the tensors stay on the CPU: the timer is fake)."""
    return dataclasses.replace(describe_call(*qkv, **kw), device_type="cuda", device_index=0, rocm=True,
                               arch="gfx1201")


def setup(times, refuse=None, raises=None):
    """Fakes named like real quantized backends (SDPA first in `times`), a clock, and a memory-only tuner."""
    ran = []
    backends = {name: FakeBackend(name, ran=ran, quantized=name != "sdpa", refuse=(refuse or {}).get(name),
                                  raises=(raises or {}).get(name)) for name in times}
    clock = Clock(ran, times)
    tuner = tuner_mod.Tuner(timer=clock, store=decisions.DecisionStore(enabled=False), enabled=True)
    return backends, clock, tuner


def choose(tuner, backends, call, qkv):
    """(backend, passed over, decision) of auto's route with `backends` registered in the static order given,
    or None where it measured nothing (the static order decides)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, backend in backends.items():
            mp.setitem(registry._REGISTRY, name, backend)
        mp.setattr(registry, "auto_order", lambda c: [n for n in backends if n != "sdpa"] + ["sdpa"])
        found = settled_route(call, "auto", tensors=qkv, tuner=tuner)
    if found.decision is None:
        return None
    return found.backend, dict(found.passed_over), found.decision


def test_the_fastest_is_chosen_and_ranked_against_sdpa():
    backends, clock, tuner = setup({"sdpa": 10.0, "triton_int8_fp8": 8.0, "triton_int8_fp16": 5.0})
    qkv = tensors()
    backend, skipped, decision = choose(tuner, backends, gpu_call(qkv), qkv)
    assert backend.name == "triton_int8_fp16" and skipped == {}
    assert decision.ranking == ("triton_int8_fp16", "triton_int8_fp8", "sdpa")
    assert decision.ratio("triton_int8_fp16") == pytest.approx(0.5)
    assert decision.summary.startswith("auto chose triton_int8_fp16: 0.50x SDPA at (float16, D64, Nq<=4096")
    assert decision.method == decisions.ALONE and "[measured alone: " in decision.summary
    # one untimed warm-up and TIMED_REPEATS timed calls each, SDPA (the yardstick) first
    names = ("sdpa", "triton_int8_fp8", "triton_int8_fp16")
    assert clock.timed == [name for name in names for _ in range(tuner_mod.TIMED_REPEATS)]
    assert clock.ran == [name for name in names for _ in range(1 + tuner_mod.TIMED_REPEATS)]


def test_a_quantized_backend_slower_than_sdpa_is_never_chosen():
    backends, _, tuner = setup({"sdpa": 5.0, "triton_int8_fp8": 6.0, "triton_int8_fp16": 5.0})
    qkv = tensors()
    backend, _, decision = choose(tuner, backends, gpu_call(qkv), qkv)
    assert backend.name == "sdpa" and decision.ranking == ("sdpa",)
    # a tie is no gain: exact attention keeps it (QUANTIZED_MUST_BEAT)
    assert decision.best_quantized == ("triton_int8_fp16", 1.0)
    assert decision.sdpa_reason() == ("auto: SDPA kept on this shape (best quantized: triton_int8_fp16 1.00x SDPA, "
                                      "not at or under 0.97x)")


def test_a_candidate_that_raises_or_refuses_is_left_out_with_its_reason():
    backends, clock, tuner = setup({"sdpa": 10.0, "hip_int8_fp8": 1.0, "triton_int8_fp8": 2.0, "triton_int8_fp16": 4.0},
                                   refuse={"hip_int8_fp8": "hiprtc not found"},
                                   raises={"triton_int8_fp8": RuntimeError("boom")})
    qkv = tensors()
    backend, skipped, decision = choose(tuner, backends, gpu_call(qkv), qkv)
    assert backend.name == "triton_int8_fp16"
    assert skipped["hip_int8_fp8"] == "hiprtc not found"
    assert skipped["triton_int8_fp8"] == "failed while auto measured it: RuntimeError: boom"
    assert "hip_int8_fp8" not in clock.ran and "triton_int8_fp8" not in decision.timings
    assert "; triton_int8_fp8: failed while auto measured it: RuntimeError: boom" in decision.summary


def test_sdpa_raising_means_no_measurement_and_the_static_order():
    backends, _, tuner = setup({"sdpa": 1.0, "triton_int8_fp8": 2.0}, raises={"sdpa": RuntimeError("no")})
    qkv = tensors()
    assert choose(tuner, backends, gpu_call(qkv), qkv) is None


def test_length_buckets_and_keys():
    assert [decisions.length_bucket(n) for n in (1, 2, 3, 64, 65, 4096, 4097, 75600)] == [1, 2, 4, 64, 128, 4096,
                                                                                          8192, 131072]
    key = decisions.tune_key(gpu_call(tensors(nq=3000, nk=4000)))
    assert key == decisions.tune_key(gpu_call(tensors(nq=4096, nk=2049)))
    assert (key.q_bucket, key.k_bucket, key.gqa, key.causal) == (4096, 4096, False, False)
    for other in (gpu_call(tensors(nq=4097)), gpu_call(tensors(nk=300)), gpu_call(tensors(hkv=1)),
                  gpu_call(tensors(d=128)), gpu_call(tensors(dtype=torch.bfloat16)),
                  gpu_call(tensors(), is_causal=True), gpu_call(tensors(), smooth_k=False)):
        assert decisions.tune_key(other) != key


def test_one_measurement_per_key_in_memory():
    backends, clock, tuner = setup({"sdpa": 10.0, "triton_int8_fp8": 5.0})
    qkv = tensors(nq=3000)
    choose(tuner, backends, gpu_call(qkv), qkv)
    timed = len(clock.timed)
    same_bucket = tensors(nq=4000)
    assert choose(tuner, backends, gpu_call(same_bucket), same_bucket)[0].name == "triton_int8_fp8"
    assert len(clock.timed) == timed
    other = tensors(nq=5000)
    choose(tuner, backends, gpu_call(other), other)
    assert len(clock.timed) == 2 * timed


def test_a_backend_disabled_after_measuring_is_passed_over_per_call():
    backends, _, tuner = setup({"sdpa": 10.0, "triton_int8_fp8": 5.0, "triton_int8_fp16": 7.0})
    qkv = tensors()
    choose(tuner, backends, gpu_call(qkv), qkv)
    backends["triton_int8_fp8"].disable("cuda", 0, "self-check failed")
    backend, skipped, _ = choose(tuner, backends, gpu_call(qkv), qkv)
    assert backend.name == "triton_int8_fp16" and skipped == {"triton_int8_fp8": "self-check failed"}


def test_a_candidate_whose_self_check_ran_out_of_memory_is_measured_on_a_later_call():
    """Its first-use check could not run (out of memory: kernels/self_check.py records no verdict, why_not stays
    None). auto decides nothing for this call (the static order serves it) and measures on a later one, with it."""
    backends, clock, tuner = setup({"sdpa": 10.0, "triton_int8_fp8": 4.0, "triton_int8_fp16": 6.0})
    fp8 = backends["triton_int8_fp8"]
    answers = ["triton_int8_fp8 on cuda:0: self-check could not run for lack of memory (...); it will be tried "
               "again on a later call"]


    class FirstUseCheck:  # a fake keeps no verdict: its check is asked for on every first call of a kind
        @staticmethod
        def pending(device_type, index):
            return True

        @staticmethod
        def refusal(device_type, index):
            return answers.pop(0) if answers else None
    fp8.probe = FirstUseCheck()
    qkv = tensors()
    call = gpu_call(qkv)
    assert choose(tuner, backends, call, qkv) is None and clock.timed == []
    assert tuner.decision_for(call) is None  # nothing kept: the next call decides
    backend, skipped, decision = choose(tuner, backends, call, qkv)
    assert backend is fp8 and skipped == {} and set(decision.timings) == set(backends)


# -- through settled_route (the real registry, fakes under real names) -------------------------------------

@pytest.fixture
def registered(monkeypatch):
    def install(times, **kw):
        backends, clock, tuner = setup(times, **kw)
        for name, backend in backends.items():
            monkeypatch.setitem(registry._REGISTRY, name, backend)
        monkeypatch.setattr(registry, "auto_order", lambda call: list(times)[1:] + ["sdpa"])
        return backends, clock, tuner
    return install


def test_quantized_only_gets_none_and_the_reason_when_sdpa_is_fastest(registered):
    _, _, tuner = registered({"sdpa": 5.0, "triton_int8_fp8": 6.0})
    qkv = tensors()
    found = settled_route(gpu_call(qkv), "auto", quantized_only=True, tensors=qkv, tuner=tuner)
    assert found.kind == routing.EXACT and found.backend is None and found.passed_over == {}
    assert found.reason == ("auto: SDPA measured faster on this shape (best quantized: triton_int8_fp8 "
                            "1.20x SDPA)")
    found = settled_route(gpu_call(qkv), "auto", tensors=qkv, tuner=tuner)
    assert found.kind == routing.RUN and found.backend.name == "sdpa" and found.passed_over == {}
    assert found.decision is not None and found.reason.startswith("auto: SDPA measured faster")


def test_the_route_reports_the_decision(registered):
    _, _, tuner = registered({"sdpa": 5.0, "triton_int8_fp8": 4.0})
    qkv = tensors()
    found = settled_route(gpu_call(qkv), "auto", quantized_only=True, tensors=qkv, tuner=tuner)
    assert found.kind == routing.RUN and found.backend.name == "triton_int8_fp8" and found.reason is None
    assert found.decision.ranking == ("triton_int8_fp8", "sdpa")


def test_env_switch_off_keeps_the_static_order(registered, monkeypatch):
    # the static order prefers the slow one: measuring would not
    backends, clock, _ = registered({"sdpa": 5.0, "triton_int8_fp8": 50.0, "triton_int8_fp16": 1.0})
    tuner = tuner_mod.Tuner(timer=clock, store=decisions.DecisionStore(enabled=False))
    qkv = tensors()
    monkeypatch.setenv(settings.AUTOTUNE.name, "0")
    assert settled_route(gpu_call(qkv), "auto", tensors=qkv, tuner=tuner).backend.name == "triton_int8_fp8"
    assert clock.timed == []
    monkeypatch.setenv(settings.AUTOTUNE.name, "1")
    assert settled_route(gpu_call(qkv), "auto", tensors=qkv, tuner=tuner).backend.name == "triton_int8_fp16"


def test_no_tensors_cpu_or_a_first_call_in_capture_keep_the_static_order(registered, monkeypatch):
    backends, clock, tuner = registered({"sdpa": 5.0, "triton_int8_fp8": 50.0, "triton_int8_fp16": 1.0})
    qkv = tensors()
    cpu_call = describe_call(*qkv)
    assert cpu_call.device_type == "cpu"
    assert settled_route(cpu_call, "auto", tensors=qkv, tuner=tuner).backend.name == "triton_int8_fp8"
    assert settled_route(gpu_call(qkv), "auto", tuner=tuner).backend.name == "triton_int8_fp8"
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert settled_route(gpu_call(qkv), "auto", tensors=qkv, tuner=tuner).backend.name == "triton_int8_fp8"
    assert clock.timed == [] and clock.ran == []
    capturing[0] = False
    assert settled_route(gpu_call(qkv), "auto", tensors=qkv, tuner=tuner).backend.name == "triton_int8_fp16"
    timed = len(clock.timed)
    capturing[0] = True  # a decision made before a capture serves the captured calls, without timing
    assert settled_route(gpu_call(qkv), "auto", tensors=qkv, tuner=tuner).backend.name == "triton_int8_fp16"
    assert len(clock.timed) == timed


def test_a_masked_call_is_measured_only_with_its_mask(registered):
    _, clock, tuner = registered({"sdpa": 5.0, "triton_int8_fp8": 50.0, "triton_int8_fp16": 1.0})
    qkv = tensors()
    mask = torch.ones(4000, 4000, dtype=torch.bool)
    call = gpu_call(qkv, attn_mask=mask)
    assert settled_route(call, "auto", tensors=qkv, tuner=tuner).backend.name == "triton_int8_fp8"
    assert clock.timed == []
    assert settled_route(call, "auto", tensors=qkv, attn_mask=mask, tuner=tuner).backend.name == \
        "triton_int8_fp16"


def test_nvidia_weighs_our_triton_kernels_and_comfy_kitchen_too():
    call = dataclasses.replace(describe_call(*tensors()), device_type="cuda", device_index=0, rocm=False, arch="sm_90")
    assert registry.auto_candidates(call) == ["sageattention", "triton_int8_fp8", "triton_int8_fp16", "comfy_kitchen",
                                              "sdpa"]
    assert registry.auto_order(call) == ["sageattention", "sdpa"]  # the static order is unchanged


def test_when_no_candidate_takes_a_call_the_reason_names_every_candidates_refusal(registered, monkeypatch):
    """On NVIDIA the static order names SageAttention alone, but auto weighs our Triton kernels too: a call none of
    them takes (a per-row mask) says why each refused, not only that SageAttention is not installed."""
    rows = "a float mask that differs between query rows is not supported"
    backends, clock, tuner = registered(
        {"sdpa": 10.0, "sageattention": 1.0, "triton_int8_fp8": 1.0, "triton_int8_fp16": 1.0, "comfy_kitchen": 1.0},
        refuse={"sageattention": "the package is not installed", "triton_int8_fp8": rows, "triton_int8_fp16": rows,
                "comfy_kitchen": "the package is not installed"})
    monkeypatch.setattr(registry, "auto_order", lambda call: ["sageattention", "sdpa"])
    qkv = tensors()
    call = dataclasses.replace(describe_call(*qkv), device_type="cuda", device_index=0, rocm=False, arch="sm_90")
    found = settled_route(call, "auto", tensors=qkv, tuner=tuner)
    assert found.backend.name == "sdpa" and clock.timed == []
    assert found.reason.startswith("auto: no quantized kernel takes this call")
    for name in ("sageattention", "triton_int8_fp8", "triton_int8_fp16", "comfy_kitchen"):
        assert f"{name}: " in found.reason, name
    assert found.reason.count(rows) == 2
    assert dict(found.passed_over) == {"sageattention": "the package is not installed"}


# -- on disk -----------------------------------------------------------------------------------------------

def disk_tuner(tmp_path, times, identity=IDENTITY, **kw):
    backends, clock, _ = setup(times, **kw)
    store = decisions.DecisionStore(str(tmp_path), enabled=True, identity=lambda device: identity)
    return backends, clock, tuner_mod.Tuner(timer=clock, store=store, enabled=True)


TIMES = {"sdpa": 10.0, "triton_int8_fp8": 4.0, "triton_int8_fp16": 6.0}


def entries(folder):
    return sorted(folder.glob("autotune-*.bin"))


def test_a_decision_survives_on_disk_and_is_reused(tmp_path):
    backends, clock, tuner = disk_tuner(tmp_path, TIMES)
    qkv = tensors()
    first = choose(tuner, backends, gpu_call(qkv), qkv)[2]
    files = entries(tmp_path)
    assert len(files) == 1
    meta = disk_cache.read_meta(str(files[0]))  # the entry says what it is for whoever reads the folder
    assert meta["kind"] == disk_cache.AUTO_DECISIONS and meta["header"]["identity"] == IDENTITY
    assert meta["tune_key"] == first.key.ident()
    backends, clock, tuner = disk_tuner(tmp_path, TIMES)  # a new process
    backend, _, again = choose(tuner, backends, gpu_call(qkv), qkv)
    assert clock.timed == [] and again.source == "disk"
    assert backend.name == "triton_int8_fp8" and again.timings == first.timings
    assert again.summary.endswith("from disk]")


def test_the_default_folder_is_the_cache_folders_auto_decisions(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE.name, str(tmp_path))
    store = decisions.DecisionStore(enabled=True, identity=lambda device: IDENTITY)
    assert store.entries().folder == str(tmp_path / disk_cache.AUTO_DECISIONS)


def test_the_disk_cache_is_per_gpu_driver_pack_version_and_candidates(tmp_path, monkeypatch):
    backends, _, tuner = disk_tuner(tmp_path, TIMES)
    qkv = tensors()
    choose(tuner, backends, gpu_call(qkv), qkv)

    def measured_again(identity=IDENTITY, times=TIMES):
        backends, clock, tuner = disk_tuner(tmp_path, times, identity)
        choose(tuner, backends, gpu_call(qkv), qkv)
        return bool(clock.timed)

    assert not measured_again()
    assert measured_again(identity={**IDENTITY, "gpu": "AMD Radeon RX 9060 XT"})
    assert measured_again(identity={**IDENTITY, "driver": 60400000})
    with monkeypatch.context() as m:
        m.setattr(decisions, "pack_version", lambda: "99.0.0")
        assert measured_again()
    assert not measured_again()  # none of the above replaced the first entry
    assert measured_again(times={**TIMES, "comfy_kitchen": 3.0})  # a backend came: measure again


def test_a_corrupt_or_unreadable_cache_entry_is_measured_again(tmp_path):
    backends, _, tuner = disk_tuner(tmp_path, TIMES)
    qkv = tensors()
    decision = choose(tuner, backends, gpu_call(qkv), qkv)[2]
    path = entries(tmp_path)[0]
    key = disk_cache.read_meta(str(path))["key"]
    sound = path.read_bytes()
    for payload in (b"{not json", json.dumps({"timings": "x"}).encode(), b"[]", b"\x00\xff"):
        path.write_bytes(disk_cache.encode_entry(key, payload))  # checksummed, but not a decision
        backends, clock, tuner = disk_tuner(tmp_path, TIMES)
        backend, _, again = choose(tuner, backends, gpu_call(qkv), qkv)
        assert clock.timed and backend.name == "triton_int8_fp8" and again.source == "measured"
        entry = disk_cache.EntryStore(disk_cache.AUTO_DECISIONS, str(tmp_path)).load_json(key, "autotune")
        assert entry["timings"] == again.timings == decision.timings  # rewritten whole
    for damaged in (sound[:-3], b"garbage"):  # truncated or not an entry at all
        path.write_bytes(damaged)
        backends, clock, tuner = disk_tuner(tmp_path, TIMES)
        assert choose(tuner, backends, gpu_call(qkv), qkv)[2].source == "measured" and clock.timed
        assert path.read_bytes() != damaged
    path.unlink()
    path.mkdir()  # a folder where the entry should be: unreadable, and unwritable
    backends, clock, tuner = disk_tuner(tmp_path, TIMES)
    assert choose(tuner, backends, gpu_call(qkv), qkv)[0].name == "triton_int8_fp8"


@pytest.mark.parametrize("timings", [
    {"triton_int8_fp8": -0.1}, {"triton_int8_fp8": 0.0}, {"triton_int8_fp8": math.nan},
    {"triton_int8_fp8": math.inf}, {"triton_int8_fp8": 0.001, "sdpa": 5.0}, {"triton_int8_fp16": 2e4},
    {"sdpa": 0.0}, {"sdpa": -5.0}, {"sdpa": math.nan}, {"sdpa": math.inf},
], ids=["negative", "zero", "nan", "inf", "0.001ms-vs-5ms", "2000x-sdpa", "sdpa-zero", "sdpa-negative",
        "sdpa-nan", "sdpa-inf"])
def test_an_implausible_timing_on_disk_is_a_miss_and_measured_again(tmp_path, caplog, timings):
    """A checksummed entry whose timings cannot be (not finite, not above 0, or over 1000x off SDPA either
    way) is not believed: it would read "auto chose ... -0.10x SDPA". Measured again and rewritten."""
    backends, _, tuner = disk_tuner(tmp_path, TIMES)
    qkv = tensors()
    measured = choose(tuner, backends, gpu_call(qkv), qkv)[2]
    path = entries(tmp_path)[0]
    key = disk_cache.read_meta(str(path))["key"]
    entry = json.loads(disk_cache.decode_entry(path.read_bytes(), key)[0])
    entry["timings"].update(timings)
    path.write_bytes(disk_cache.encode_entry(key, json.dumps(entry).encode()))  # sound entry, planted numbers
    backends, clock, tuner = disk_tuner(tmp_path, TIMES)
    with caplog.at_level("INFO", logger=tuner_mod.__name__):
        backend, _, again = choose(tuner, backends, gpu_call(qkv), qkv)
    assert clock.timed and again.source == "measured", again.summary
    assert backend.name == "triton_int8_fp8" and again.timings == measured.timings
    assert "implausible" in caplog.text
    rewritten = json.loads(disk_cache.decode_entry(path.read_bytes(), key)[0])
    assert rewritten["timings"] == measured.timings


def test_plausible_edited_timings_on_disk_are_believed(tmp_path):
    """The rule's edges: 1.1e-3x and 900x SDPA are odd but possible, and are read as stored."""
    backends, _, tuner = disk_tuner(tmp_path, TIMES)
    qkv = tensors()
    choose(tuner, backends, gpu_call(qkv), qkv)
    path = entries(tmp_path)[0]
    key = disk_cache.read_meta(str(path))["key"]
    entry = json.loads(disk_cache.decode_entry(path.read_bytes(), key)[0])
    entry["timings"] = {"sdpa": 10.0, "triton_int8_fp8": 0.011, "triton_int8_fp16": 9000.0}
    path.write_bytes(disk_cache.encode_entry(key, json.dumps(entry).encode()))
    backends, clock, tuner = disk_tuner(tmp_path, TIMES)
    backend, _, again = choose(tuner, backends, gpu_call(qkv), qkv)
    assert clock.timed == [] and again.source == "disk" and again.timings == entry["timings"]


# One process saving one decision, loading the pack by its folder as tests/conftest.py does. It waits for `go`
# after loading (torch's import takes seconds) so that every process writes at the same moment.
SAVE_ONE_DECISION = """
import importlib.util, os, sys, time
root, folder, sync, index = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
spec = importlib.util.spec_from_file_location("comfyui_sage_rdna4", os.path.join(root, "__init__.py"),
                                              submodule_search_locations=[root])
pack = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = pack
spec.loader.exec_module(pack)
import torch
from comfyui_sage_rdna4.kernels import decisions
key = decisions.TuneKey("float16", 64, 64, False, False, 2 ** (index + 6), 4096, "none", "opts")
decision = decisions.Decision(key, {"sdpa": 10.0, "triton_int8_fp8": 1.0 + index / 4})
store = decisions.DecisionStore(folder, enabled=True, identity=lambda device: {"gpu": "concurrent writers"})
open(os.path.join(sync, f"ready-{index}"), "w").close()
while not os.path.exists(os.path.join(sync, "go")):
    time.sleep(0.001)
print(store.save(torch.device("cpu"), decision, ["triton_int8_fp8"]))
"""


@pytest.mark.slow  # 12 Pythons importing torch: about 40 s on 2 shared cores
def test_twelve_processes_saving_at_once_lose_no_decision(tmp_path):
    """One entry per decision, each written atomically on its own (kernels/disk_cache.py): writers never read,
    merge and rewrite one another's entries, so all 12 decisions saved at the same moment load afterwards. (The
    earlier store, one JSON file per GPU merged on every save, kept 2 of 12 in this very test.)"""
    folder, sync = tmp_path / "decisions", tmp_path / "sync"
    sync.mkdir()
    writers = [subprocess.Popen([sys.executable, "-c", SAVE_ONE_DECISION, str(ROOT), str(folder), str(sync), str(i)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(12)]
    try:
        deadline = time.monotonic() + 240
        while len(list(sync.glob("ready-*"))) < 12 and time.monotonic() < deadline:
            if any(w.poll() not in (None, 0) for w in writers):
                break
            time.sleep(0.05)
        (sync / "go").touch()
        outputs = [w.communicate(timeout=120) for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    assert [w.returncode for w in writers] == [0] * 12, [err[-2000:] for _, err in outputs]
    assert len(list(sync.glob("ready-*"))) == 12
    store = decisions.DecisionStore(str(folder), enabled=True, identity=lambda device: {"gpu": "concurrent writers"})
    found = {}
    for i in range(12):
        key = decisions.TuneKey("float16", 64, 64, False, False, 2 ** (i + 6), 4096, "none", "opts")
        decision = store.load(torch.device("cpu"), key, ["triton_int8_fp8"])
        if decision is not None:
            found[i] = decision.timings["triton_int8_fp8"]
    assert found == {i: 1.0 + i / 4 for i in range(12)}, f"{len(found)} of 12 decisions kept"
    assert not list(folder.glob(".tmp-*"))  # no temporary file left behind


def test_no_identity_means_memory_only(tmp_path):
    backends, _, tuner = disk_tuner(tmp_path, TIMES, identity=None)
    qkv = tensors()
    assert choose(tuner, backends, gpu_call(qkv), qkv)[0].name == "triton_int8_fp8"
    assert entries(tmp_path) == []


def test_the_cache_env_switch_keeps_decisions_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.AUTOTUNE_CACHE.name, "0")
    backends, clock, _ = setup(TIMES)
    store = decisions.DecisionStore(str(tmp_path), identity=lambda device: IDENTITY)
    qkv = tensors()
    choose(tuner_mod.Tuner(timer=clock, store=store, enabled=True), backends, gpu_call(qkv), qkv)
    assert clock.timed and entries(tmp_path) == []


# -- the benchmark (the ComfyUI override's in-step measurement: tests/test_step_trials.py) -----------------

def test_the_benchmark_has_a_row_for_what_auto_takes(registered, monkeypatch):
    from comfyui_sage_rdna4.kernels import benchmark

    tiny, cpu = benchmark.SMOKE_SHAPES[0], torch.device("cpu")
    rows = benchmark.bench_shape(tiny, cpu, ["sdpa"], reps=1, warmup=0, with_auto=True)
    assert [(r["backend"], r["note"]) for r in rows if "note" in r] == [("auto=sdpa", "auto measured nothing here: "
                                                                         "static order")]
    _, _, tuner = registered({"sdpa": 5.0, "triton_int8_fp8": 2.0})
    tuner.require_cuda = False
    monkeypatch.setattr(tuner_mod, "_DEFAULT", tuner)
    rows = benchmark.bench_shape(tiny, cpu, ["sdpa"], reps=1, warmup=0, with_auto=True)
    auto = [r for r in rows if r["backend"].startswith("auto=")]
    assert len(auto) == 1 and auto[0]["backend"] == "auto=triton_int8_fp8" and auto[0]["status"] == "ok"
    assert auto[0]["note"].startswith("auto chose triton_int8_fp8: 0.40x SDPA at (float16, D64, Nq<=128")


@pytest.mark.gpu
def test_on_a_gpu_auto_measures_real_backends_and_is_never_slower_than_sdpa():
    from comfyui_sage_rdna4.kernels import sage_attention

    tuner = tuner_mod.Tuner(store=decisions.DecisionStore(enabled=False), enabled=True)
    q, k, v = (t.cuda() for t in tensors(nq=2048, nk=2048, d=128, dtype=torch.bfloat16))
    call = describe_call(q, k, v)
    found = settled_route(call, "auto", quantized_only=True, tensors=(q, k, v), tuner=tuner)
    backend = found.backend
    decision = tuner.decision_for(call)
    assert decision is not None and "sdpa" in decision.timings and all(ms > 0 for ms in decision.timings.values())
    if backend is None:
        assert found.kind == routing.EXACT and found.reason.startswith("auto: SDPA")
    else:
        assert decision.ratio(backend.name) < decisions.QUANTIZED_MUST_BEAT
        # measuring does not change the result: the chosen backend's output, as when named explicitly
        torch.testing.assert_close(sage_attention(q, k, v, kernel=backend.name),
                                   backend(q, k, v, call, q.shape[-1] ** -0.5)[0], rtol=0, atol=0)


def test_a_first_call_asks_each_candidate_once(registered):
    """Deciding a new kind of call asks each backend's rule once (no second `ready` for the one just measured)."""
    backends, _, tuner = registered({"sdpa": 5.0, "triton_int8_fp8": 2.0, "triton_int8_fp16": 3.0})
    asked = []
    for backend in backends.values():
        real = backend.why_not
        backend.why_not = lambda call, real=real, name=backend.name: asked.append(name) or real(call)
    qkv = tensors()
    found = settled_route(gpu_call(qkv), "auto", quantized_only=True, tensors=qkv, tuner=tuner)
    assert found.backend.name == "triton_int8_fp8"
    assert sorted(asked) == ["sdpa", "triton_int8_fp16", "triton_int8_fp8"]
    asked.clear()  # another call of the same kind: the decision is kept, the chosen backend asked about this call
    settled_route(gpu_call(qkv), "auto", quantized_only=True, tensors=qkv, tuner=tuner)
    assert asked == ["triton_int8_fp8"]


def test_measuring_alone_is_a_first_use_part_with_its_seconds():
    from comfyui_sage_rdna4.kernels import first_use_costs
    backends, _, tuner = setup({"sdpa": 10.0, "triton_int8_fp8": 5.0})
    qkv = tensors()
    mark = first_use_costs.mark()
    choose(tuner, backends, gpu_call(qkv), qkv)
    (part, seconds), = first_use_costs.since(mark)
    assert part.startswith("auto measured float16, D64") and part.endswith("alone") and seconds >= 0
    choose(tuner, backends, gpu_call(qkv), qkv)  # decided: nothing measured, nothing added
    assert len(first_use_costs.since(mark)) == 1


def test_an_exact_route_carries_a_check_of_a_remembered_sdpa_choice_only(registered):
    """In the step, an EXACT route hands calls to the tuner's measurement only when that measures a remembered SDPA
    choice: where the quantized choice refuses this very call, its watch (for the calls it serves) stays out."""
    backends, _, _ = registered({"sdpa": 5.0, "triton_int8_fp8": 4.0}, refuse={"triton_int8_fp8": "not this call"})
    qkv = tensors()
    call = gpu_call(qkv)
    key = decisions.tune_key(call)
    sentinel = object()

    class Book:
        def __init__(self, decision):
            self.decision_ = decision

        def decision(self, method, call):
            return self.decision_

        def measuring(self, call):
            return sentinel

    quantized = decisions.Decision(key, {"sdpa": 5.0, "triton_int8_fp8": 4.0})
    found = routing.route(call, quantized_only=True, tuner=Book(quantized), method=decisions.IN_STEP)
    assert found.kind == routing.EXACT and found.measurement is None
    assert found.passed_over["triton_int8_fp8"] == "not this call"
    exact = decisions.Decision(key, {"sdpa": 5.0, "triton_int8_fp8": 6.0})
    found = routing.route(call, quantized_only=True, tuner=Book(exact), method=decisions.IN_STEP)
    assert found.kind == routing.EXACT and found.measurement is sentinel
