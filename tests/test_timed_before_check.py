"""auto in the step times a candidate without hardware probes before its first-use self-check, and checks only a
candidate that won (kernels/routing.py, Backend.timed_before_check).

The scene is test_step_trials' (fake backends on a simulated clock, each answering q times its own factor), with
self-check verdicts that count how often they were asked to check and answer as the test says.
"""
import time

import pytest
from test_step_trials import FACTOR, FLUX_CALLS, HEADS, IDENTITY, Scene

from comfyui_sage_rdna4.kernels import decisions, first_use_costs, step_trials
from comfyui_sage_rdna4.kernels import tuner as tuner_mod
from comfyui_sage_rdna4.kernels.call_spec import describe_call
from comfyui_sage_rdna4.kernels.dispatch import settled_route
from comfyui_sage_rdna4.kernels.generation import invalidate_decisions
from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride

UNCHECKED = step_trials.Measurement.UNCHECKED_TURN
SDPA_TURN = step_trials.StepTrial.SDPA_TURN


class CountingVerdicts:
    """What kernels.gating.Verdicts gives the registry (`recorded`, `disabled`, `guard`): each first check of a
    device and variant is counted and answers `reason` (None: passed)."""

    def __init__(self, reason=None):
        self.reason = reason
        self.recorded, self.disabled = {}, {}
        self.checks = 0

    def guard(self, backend, call, variant=None):
        key = (call.device_type, call.device_index, variant or backend.variant(call))
        if key not in self.recorded:
            self.checks += 1
            self.recorded[key] = self.reason
            if self.reason:
                self.disabled[key[:2]] = self.reason
                invalidate_decisions()
        return self.recorded[key]


class PassingProbe:
    """A HIP backend's hardware probes (pending until asked, then passed), counting when they ran."""

    def __init__(self):
        self.ran = 0

    def pending(self, device_type, index):
        return self.ran == 0

    def refusal(self, device_type, index):
        self.ran += 1
        return None


def checked_scene(monkeypatch, in_step, reasons=None, probes=(), **scene_args):
    scene = Scene(monkeypatch, in_step, **scene_args)
    verdicts = {}
    for name in list(in_step)[1:]:
        backend = scene.backends[name]
        backend.verdicts = verdicts[name] = CountingVerdicts((reasons or {}).get(name))
        if name in probes:
            backend.probe = PassingProbe()
    return scene, verdicts


def test_candidates_that_lose_in_the_step_are_never_self_checked(monkeypatch):
    """Both Triton candidates lose to SDPA (1.2x, 1.1x): timed on their turns, exact attention answering those
    calls, and neither self-check runs. Every call of the step got exact attention's output."""
    scene, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 12.0, "triton_int8_fp16": 11.0})
    first = scene.step()
    assert first == ["sdpa"] * FLUX_CALLS and scene.site_calls == FLUX_CALLS
    assert scene.backends["triton_int8_fp8"].runs == FLUX_CALLS // 3 == scene.backends["triton_int8_fp16"].runs
    decision = scene.decision()
    assert decision.chosen == "sdpa"
    # only the candidate's own call is timed, not the exact attention that answered it
    assert decision.ratio("triton_int8_fp8") == pytest.approx(1.2) and decision.ratio("triton_int8_fp16") == \
        pytest.approx(1.1)
    assert verdicts["triton_int8_fp8"].checks == 0 == verdicts["triton_int8_fp16"].checks
    routed = scene.override.stats.snapshot()["routed"]
    assert routed[UNCHECKED] == 2 * FLUX_CALLS // 3 and routed[SDPA_TURN] == FLUX_CALLS // 3
    assert scene.step() == ["sdpa"] * FLUX_CALLS
    assert verdicts["triton_int8_fp8"].checks == 0 == verdicts["triton_int8_fp16"].checks


def test_the_winner_is_self_checked_before_it_serves_a_call(monkeypatch):
    """fp16 wins (0.80x); fp8 (0.99x) is within the margin, so not a winner. The next call checks fp16 only; from
    then on fp16 answers every call."""
    scene, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.9, "triton_int8_fp16": 8.0})
    assert scene.step() == ["sdpa"] * FLUX_CALLS
    assert scene.decision().chosen == "triton_int8_fp16" and verdicts["triton_int8_fp16"].checks == 0
    assert scene.step() == ["triton_int8_fp16"] * FLUX_CALLS
    assert verdicts["triton_int8_fp16"].checks == 1 and verdicts["triton_int8_fp8"].checks == 0


def test_a_winner_that_fails_its_self_check_never_answers_and_the_next_winner_is_checked(monkeypatch):
    """fp16 (0.80x) and fp8 (0.90x) both win; fp16 fails its self-check, so fp8 is checked and serves. fp16's output
    is never returned, in its trial turns or after."""
    reason = "triton_int8_fp16 disabled on cpu: self-check failed (planted)"
    scene, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.0, "triton_int8_fp16": 8.0},
                                    reasons={"triton_int8_fp16": reason})
    assert scene.step() == ["sdpa"] * FLUX_CALLS
    assert scene.decision().ranking == ("triton_int8_fp16", "triton_int8_fp8", "sdpa")
    assert scene.step() == ["triton_int8_fp8"] * FLUX_CALLS
    assert verdicts["triton_int8_fp16"].checks == 1 and verdicts["triton_int8_fp8"].checks == 1
    assert scene.override.stats.snapshot()["passed_over"]["triton_int8_fp16"] == {reason: FLUX_CALLS}


def test_the_only_winner_failing_its_self_check_leaves_exact_attention(monkeypatch):
    reason = "triton_int8_fp8 disabled on cpu: self-check failed (planted)"
    scene, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 5.0},
                                    reasons={"triton_int8_fp8": reason})
    scene.step()
    assert scene.decision().chosen == "triton_int8_fp8"
    assert scene.step() == ["sdpa"] * FLUX_CALLS and verdicts["triton_int8_fp8"].checks == 1


def test_a_candidate_with_hardware_probes_is_checked_before_it_is_timed(monkeypatch):
    """A HIP backend (it has probes) is probed and self-checked on the first call, before any trial turn, and its
    turns answer with its own output; the probe-less candidate beside it is still timed unchecked."""
    scene, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "hip_int8_fp8": 12.0, "triton_int8_fp16": 11.0},
                                    probes=("hip_int8_fp8",))
    FACTOR["hip_int8_fp8"] = 5.0
    try:
        first = scene.step(6)
    finally:
        del FACTOR["hip_int8_fp8"]
    assert scene.backends["hip_int8_fp8"].probe.ran == 1 and verdicts["hip_int8_fp8"].checks == 1
    assert first == ["sdpa", "hip_int8_fp8", "sdpa"] * 2  # the Triton turn answered by exact attention
    assert verdicts["triton_int8_fp16"].checks == 0 and scene.backends["triton_int8_fp16"].runs == 2


def test_measuring_alone_checks_every_candidate_first(monkeypatch):
    """The public API measures alone, on the call's own tensors, and runs the winner's output at once: every
    candidate is checked before it is timed there."""
    scene, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 12.0, "triton_int8_fp16": 11.0})
    alone = tuner_mod.Tuner(timer=lambda fn, device: (fn(), 1.0)[1], store=decisions.DecisionStore(enabled=False),
                            enabled=True, require_cuda=False)
    hnd = tuple(t.view(1, 256, HEADS, 64).transpose(1, 2) for t in (scene.q, scene.k, scene.v))
    route = settled_route(describe_call(*hnd), "auto", tensors=hnd, tuner=alone)
    assert route.decision is not None and not route.unchecked
    assert verdicts["triton_int8_fp8"].checks == 1 == verdicts["triton_int8_fp16"].checks


def test_a_remembered_sdpa_choice_is_rechecked_against_an_unchecked_kernel_without_using_it(monkeypatch, tmp_path):
    """A later process recalls SDPA (fp8 stored at 1.05x, inside the recheck band): the recheck times fp8 on its
    pairs, but those calls answer with exact attention and fp8's self-check never runs."""
    store = decisions.DecisionStore(str(tmp_path), enabled=True, identity=lambda device: IDENTITY)
    scene, _ = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 10.5}, store=store)
    scene.step()
    assert scene.decision().chosen == "sdpa"
    again, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 10.5}, store=store)
    first = again.step()
    timed = step_trials.WATCH_CALLS + step_trials.WARMUP_CALLS
    assert first == ["sdpa"] * FLUX_CALLS and again.backends["triton_int8_fp8"].runs == timed
    assert again.decision().source == "disk" and again.decision().chosen == "sdpa"
    assert verdicts["triton_int8_fp8"].checks == 0


def test_a_remembered_quantized_choice_is_self_checked_before_its_first_call(monkeypatch, tmp_path):
    """A later process recalls fp8 as the choice (0.50x): fp8 is checked before the first call it answers."""
    store = decisions.DecisionStore(str(tmp_path), enabled=True, identity=lambda device: IDENTITY)
    scene, _ = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 5.0}, store=store)
    scene.step()
    assert scene.decision().chosen == "triton_int8_fp8"
    again, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 5.0}, store=store)
    again.override(again.call_site, again.q, again.k, again.v, HEADS)
    assert verdicts["triton_int8_fp8"].checks == 1
    assert "triton_int8_fp8" in again.step() and verdicts["triton_int8_fp8"].checks == 1
    assert again.decision().source == "disk"


def test_an_unchecked_candidate_that_raises_is_left_out_and_raises_nothing(monkeypatch):
    """Even with on_unsupported="raise": exact attention was to answer that call, so the failure only leaves the
    candidate out of the trial (and the stats count it)."""
    scene, verdicts = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 5.0, "triton_int8_fp16": 8.0},
                                    raises={"triton_int8_fp8": RuntimeError("boom")})
    scene.override = SageAttentionOverride(PatchConfig(kernel="auto", on_unsupported="raise"))
    assert scene.step() == ["sdpa"] * FLUX_CALLS
    decision = scene.decision()
    assert decision.chosen == "triton_int8_fp16" and decision.failed == {
        "triton_int8_fp8": "triton_int8_fp8 failed: RuntimeError: boom"}
    assert scene.backends["triton_int8_fp8"].runs == 1 and verdicts["triton_int8_fp8"].checks == 0
    assert scene.override.stats.snapshot()["fallbacks"] == {"triton_int8_fp8 failed: RuntimeError: boom": 1}


def test_a_first_call_that_compiles_is_reported_as_a_first_use_cost(monkeypatch):
    """Timed before its self-check, a Triton kernel compiles on its first trial call: that call's host time is a
    part of the first-use ledger, under the kernel's name; a first call that only launches is not."""
    scene, _ = checked_scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 12.0, "triton_int8_fp16": 11.0})
    compiling = scene.backends["triton_int8_fp8"]
    work = compiling.attention

    def first_call_compiles(q, k, v, is_causal=False):
        if compiling.runs == 1:
            time.sleep(0.05)
        return work(q, k, v, is_causal=is_causal)
    compiling.attention = first_call_compiles
    mark = first_use_costs.mark()
    scene.step()
    parts = first_use_costs.since(mark)
    assert [part for part, _ in parts] == [
        "first call of triton_int8_fp8 while auto measures (B1 Hq2 Hkv2 Nq256 Nk256 D64 float16 on cpu)"]
    assert 0.05 <= parts[0][1] < 1.0
