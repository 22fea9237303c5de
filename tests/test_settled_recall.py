"""A later process takes up a remembered decision before any candidate is asked anything (an SDPA choice that needs
no check is kept; a quantized one asks only itself, and is checked), when the packages the candidates rest on are
installed as they were (kernels/tuner.py, `Tuner.recall_settled`;
kernels/decisions.py, `DecisionStore.load_unchanged`; kernels/registry.py, `installed_packages`).

Why: on an H100 with both peers installed, a later session's first Wan 14B step was 1.20-1.27x SDPA's with no
quantized call at all; asking comfy-kitchen whether it is available imports it (0.51-0.62 s of the 0.53-0.73 s).
The scene is test_step_trials' (fake backends on a simulated clock).
"""
import importlib
import logging
import os
import sys

import pytest
import torch
from test_step_trials import FLUX_CALLS, IDENTITY, Scene

from comfyui_sage_rdna4.kernels import decisions, registry, routing
from comfyui_sage_rdna4.kernels import tuner as tuner_mod
from comfyui_sage_rdna4.kernels.call_spec import describe_call
from comfyui_sage_rdna4.kernels.dispatch import settled_route

INSTALLED = {"comfy_kitchen": "/site/comfy_kitchen/__init__.py 100 1", "triton": "/site/triton/__init__.py 200 2"}


def stored(tmp_path, installed=INSTALLED):
    return decisions.DecisionStore(str(tmp_path), enabled=True, identity=lambda device: IDENTITY,
                                   installed=lambda: dict(installed))


def asked(scene):
    """How often the scene's quantized candidates were asked whether they are available."""
    return sum(b.availability_checks for name, b in scene.backends.items() if name != "sdpa")


def first_process(monkeypatch, tmp_path, timings, steps=2):
    store = stored(tmp_path)
    scene = Scene(monkeypatch, timings, store=store)
    for _ in range(steps):
        scene.step()
    return scene.decision()


def test_a_confirmed_sdpa_choice_asks_no_candidate_in_a_later_process(monkeypatch, tmp_path):
    """Confirmed in its own process (fp8 at 0.99x): the next one answers every call with exact attention and never
    asks fp8 or fp16 whether they can run, so a peer's package would not be imported."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 9.9, "triton_int8_fp16": 12.0}
    assert first_process(monkeypatch, tmp_path, timings).confirmed
    later = Scene(monkeypatch, timings, store=stored(tmp_path))
    listed = []
    real = routing.quantized_candidates
    monkeypatch.setattr(routing, "quantized_candidates", lambda call: listed.append(call) or real(call))
    assert later.step() == ["sdpa"] * FLUX_CALLS
    assert asked(later) == 0 and later.events.marks == 0 and listed == []  # not even loaded
    decision = later.decision()
    assert decision.source == "disk" and decision.confirmed and decision.chosen == "sdpa"
    assert decision.candidates == ("triton_int8_fp16", "triton_int8_fp8")


def test_a_choice_far_from_the_bar_needs_no_confirming_to_skip_the_candidates(monkeypatch, tmp_path):
    """fp8 at 1.50x: no check would time it again, so even the one-step process's unconfirmed choice is kept
    without asking."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 15.0}
    decision = first_process(monkeypatch, tmp_path, timings, steps=1)
    assert decision.chosen == "sdpa" and not decision.confirmed
    later = Scene(monkeypatch, timings, store=stored(tmp_path))
    assert later.step() == ["sdpa"] * FLUX_CALLS and asked(later) == 0


@pytest.mark.parametrize("change", ["upgraded", "installed", "removed"])
def test_a_package_changed_since_asks_the_candidates_again(monkeypatch, tmp_path, change):
    """The candidates are asked again, as before this shortcut; their answer recalls the same stored choice."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 9.9}
    assert first_process(monkeypatch, tmp_path, timings).confirmed
    now = dict(INSTALLED)
    if change == "upgraded":
        now["comfy_kitchen"] = "/site/comfy_kitchen/__init__.py 100 3"
    elif change == "installed":
        now["sageattention"] = "/site/sageattention/__init__.py 50 4"
    else:
        now["comfy_kitchen"] = "absent"
    later = Scene(monkeypatch, timings, store=stored(tmp_path, now))
    assert later.step() == ["sdpa"] * FLUX_CALLS
    assert asked(later) == 1 and later.events.marks == 0  # asked, recalled by its candidates, nothing timed
    assert later.decision().source == "disk" and later.decision().confirmed


def test_a_choice_that_a_check_would_time_is_left_to_the_candidates(monkeypatch, tmp_path):
    """Unconfirmed and inside the band (fp8 at 1.05x, the process ended after one step): the shortcut does not take
    it, and the later process checks it as before."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 10.5}
    first_process(monkeypatch, tmp_path, timings, steps=1)
    later = Scene(monkeypatch, timings, store=stored(tmp_path))
    ran = later.step()
    assert asked(later) == 1 and "triton_int8_fp8" in ran


def test_a_quantized_choice_asks_only_itself_is_checked_and_stored_confirmed(monkeypatch, tmp_path):
    """fp8 chosen at 0.80x (fp16 measured 1.20x): the later process asks fp8 alone, before it serves, checks it
    against SDPA and keeps it; fp16 is never asked, so a peer in its place would not be imported."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 8.0, "triton_int8_fp16": 12.0}
    assert first_process(monkeypatch, tmp_path, timings).chosen == "triton_int8_fp8"
    later = Scene(monkeypatch, timings, store=stored(tmp_path))
    ran = later.step() + later.step()
    assert later.backends["triton_int8_fp8"].availability_checks == 1
    assert later.backends["triton_int8_fp16"].availability_checks == 0 and "triton_int8_fp16" not in ran
    assert ran.count("triton_int8_fp8") > FLUX_CALLS
    decision = later.decision()
    assert decision.source == "disk" and decision.confirmed
    assert decisions.DecisionStore.load(stored(tmp_path), torch.device("cpu"), decision.key,
                                        ["triton_int8_fp16", "triton_int8_fp8"], decisions.IN_STEP).confirmed


def test_a_quantized_choice_that_no_longer_holds_is_measured_among_every_candidate(monkeypatch, tmp_path, caplog):
    """fp8 stored at 0.80x reads 1.00x now: the check disagrees, and the trial that follows asks every candidate,
    recalls nothing from disk, and its decision (the second measurement) is confirmed: no loop of checks."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 8.0, "triton_int8_fp16": 12.0}
    first_process(monkeypatch, tmp_path, timings)
    later = Scene(monkeypatch, {**timings, "triton_int8_fp8": 10.0}, store=stored(tmp_path))
    with caplog.at_level(logging.WARNING):
        for _ in range(6):
            later.step()
            decision = later.decision()
            if decision is not None and decision.source == "measured":
                break
    assert sum("is measured again" in r.getMessage() for r in caplog.records) == 1
    assert later.backends["triton_int8_fp16"].availability_checks == 1  # asked once the check disagreed
    assert decision.source == "measured" and decision.confirmed and decision.chosen == "sdpa"
    assert set(decision.timings) == {"sdpa", "triton_int8_fp8", "triton_int8_fp16"}


def test_a_chosen_backend_that_now_refuses_leaves_the_calls_to_sdpa(monkeypatch, tmp_path):
    """The recalled choice is asked before it serves: refusing now, its calls get exact attention."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 8.0}
    first_process(monkeypatch, tmp_path, timings)
    later = Scene(monkeypatch, timings, store=stored(tmp_path), refuse={"triton_int8_fp8": "not today"})
    assert later.step() == ["sdpa"] * FLUX_CALLS and later.backends["triton_int8_fp8"].runs == 0


def test_an_entry_without_what_was_installed_is_recalled_the_old_way(monkeypatch, tmp_path):
    """An entry written before the shortcut (no 'installed') still counts, through the candidates."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 9.9}
    decision = first_process(monkeypatch, tmp_path, timings)
    store = stored(tmp_path)
    entry_key, _ = store._entry_key(torch.device("cpu"), decision.key, decisions.IN_STEP)
    entry = store.entries().load_json(entry_key, store.LABEL)
    del entry["installed"]
    store.entries().store_json(entry_key, store.LABEL, entry, {})
    later = Scene(monkeypatch, timings, store=store)
    assert later.step() == ["sdpa"] * FLUX_CALLS and asked(later) == 1 and later.decision().confirmed


def looked_up(monkeypatch, store):
    looked = []
    real = store.load_unchanged
    monkeypatch.setattr(store, "load_unchanged", lambda *a, **k: looked.append(a) or real(*a, **k))
    return looked


def test_the_disk_is_looked_up_once_per_kind_of_call(monkeypatch, tmp_path):
    """Nothing stored: the shortcut finds nothing once, and a trial measures as before."""
    store = stored(tmp_path)
    looked = looked_up(monkeypatch, store)
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.0}, store=store)
    scene.step()
    scene.step()
    assert len(looked) == 1 and scene.decision().chosen == "triton_int8_fp8"


def test_a_kind_no_candidate_takes_is_looked_up_once_however_often_it_is_routed(monkeypatch, tmp_path):
    """No decision is ever made for it (the only candidate refuses it), so only the shortcut's own memory keeps
    each new call signature of the kind from reading the disk again."""
    store = stored(tmp_path)
    looked = looked_up(monkeypatch, store)
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.0}, store=store, refuse={"triton_int8_fp8": "no"})
    for length in (200, 220, 240):  # one length bucket: one kind of call
        hnd = tuple(torch.randn(1, 2, length, 64).half() for _ in range(3))
        found = settled_route(describe_call(*hnd), "auto", quantized_only=True, tuner=scene.tuner, tensors=hnd,
                              in_step=True)
        assert found.backend is None and "no" in found.reason
    assert len(looked) == 1


def test_an_implausible_entry_is_reported_once(monkeypatch, tmp_path, caplog):
    """The shortcut stays quiet about an entry it cannot trust; the candidates' recall says it once."""
    timings = {"sdpa": 10.0, "triton_int8_fp8": 9.9}
    decision = first_process(monkeypatch, tmp_path, timings)
    store = stored(tmp_path)
    entry_key, _ = store._entry_key(torch.device("cpu"), decision.key, decisions.IN_STEP)
    entry = store.entries().load_json(entry_key, store.LABEL)
    entry["timings"]["triton_int8_fp8"] = 0.0001
    store.entries().store_json(entry_key, store.LABEL, entry, {})
    with caplog.at_level(logging.WARNING):
        Scene(monkeypatch, timings, store=store).step()
    assert sum("is implausible" in r.getMessage() for r in caplog.records) == 1


def test_installed_packages_finds_without_importing_and_sees_a_reinstall(monkeypatch, tmp_path):
    """The real fingerprint: a package's file, size and time; 'absent' when missing; nothing imported."""
    package = tmp_path / "sage_fake_peer"
    package.mkdir()
    init = package / "__init__.py"
    init.write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setitem(registry._PACKAGES, "sage_fake_backend", ("sage_fake_peer", "sage_missing_peer"))
    before = registry.installed_packages()
    assert before["sage_fake_peer"].startswith(str(init)) and before["sage_missing_peer"] == "absent"
    assert "sage_fake_peer" not in sys.modules
    assert before == registry.installed_packages()
    os.utime(init, ns=(1, 1))  # reinstalled: the same file written at another time
    assert registry.installed_packages()["sage_fake_peer"] != before["sage_fake_peer"]
    assert {"comfy_kitchen", "sageattention", "triton"} <= set(before)  # the peers' and Triton's packages


def test_the_default_tuner_stores_what_is_installed():
    """Without this wiring the shortcut would never be taken outside these tests."""
    assert tuner_mod.Tuner().store._installed is registry.installed_packages
    assert decisions.DecisionStore().load_unchanged(torch.device("cpu"), None) is None  # no source: no shortcut
