"""An SDPA choice is timed again in a later step of the process that made it and stored as confirmed; a later
process then trusts it without timing anything (kernels/tuner.py, `Tuner._checked_name`). A check of an SDPA
choice disagrees only when the best quantized kernel now meets the bar (step_trials.Recheck).

The scene is test_step_trials' (fake backends on a simulated clock, each answering q times its own factor).
"""
import logging

import pytest
import torch
from test_step_trials import FLUX_CALLS, IDENTITY, Scene

from comfyui_sage_rdna4.kernels import decisions, step_trials

CHECK_CALLS = step_trials.WATCH_CALLS + step_trials.WARMUP_CALLS  # quantized calls of one check (and as many SDPA)
LATER_TURN = step_trials.Recheck.LATER_TURN
REMEMBERED_TURN = step_trials.Recheck.REMEMBERED_TURN


def stored(tmp_path):
    return decisions.DecisionStore(str(tmp_path), enabled=True, identity=lambda device: IDENTITY)


def on_disk(store, decision):
    return store.load(torch.device("cpu"), decision.key, decision.candidates, decisions.IN_STEP)


def test_an_sdpa_choice_confirmed_in_its_own_process_is_trusted_by_the_next(monkeypatch, tmp_path):
    """Wan 14B's self-attention with `sageattention` on an H100 (2026-12-06): SDPA kept with the best at 0.99x. Its
    first process checks the choice once more in the step after the decision (4 pairs) and stores it as confirmed;
    the next process runs exact attention alone from its first call and times nothing."""
    store = stored(tmp_path)
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.9}, store=store)
    scene.step()
    decision = scene.decision()
    assert decision.chosen == "sdpa" and not decision.confirmed and not on_disk(store, decision).confirmed
    second = scene.step()
    assert second[:2 * CHECK_CALLS].count("triton_int8_fp8") == CHECK_CALLS
    assert second[2 * CHECK_CALLS:] == ["sdpa"] * (FLUX_CALLS - 2 * CHECK_CALLS)
    assert scene.override.stats.snapshot()["routed"][LATER_TURN] == CHECK_CALLS
    assert decision.confirmed and on_disk(store, decision).confirmed
    marks = scene.events.marks
    assert scene.step() == ["sdpa"] * FLUX_CALLS and scene.events.marks == marks  # nothing timed after it

    later = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.9}, store=store)
    assert later.step() == ["sdpa"] * FLUX_CALLS and later.step() == ["sdpa"] * FLUX_CALLS
    assert later.events.marks == 0 and later.backends["triton_int8_fp8"].runs == 0
    assert later.decision().source == "disk" and later.decision().confirmed


def test_a_process_that_ends_before_the_check_leaves_it_to_the_next_one(monkeypatch, tmp_path):
    """One step only: the choice is stored unconfirmed. The next process checks it (as before this rule), stores it
    confirmed, and the one after that times nothing."""
    store = stored(tmp_path)
    Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 10.5}, store=store).step()
    second = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 10.5}, store=store)
    assert second.step().count("triton_int8_fp8") == CHECK_CALLS
    assert second.override.stats.snapshot()["routed"][REMEMBERED_TURN] == CHECK_CALLS
    assert on_disk(store, second.decision()).confirmed
    third = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 10.5}, store=store)
    assert third.step() == ["sdpa"] * FLUX_CALLS and third.events.marks == 0


def test_without_a_decision_store_nothing_is_checked_again(monkeypatch):
    """Nothing on disk, no later process to spare: the step after the decision runs exact attention alone."""
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.9})
    scene.step()
    assert scene.decision().chosen == "sdpa"
    assert scene.step() == ["sdpa"] * FLUX_CALLS and not scene.decision().confirmed


@pytest.mark.parametrize("now, measured_again", [(1.05, False), (1.00, False), (0.98, False), (0.96, True)])
def test_a_check_of_sdpa_disagrees_only_where_the_best_kernel_now_meets_the_bar(monkeypatch, tmp_path, caplog, now,
                                                                                 measured_again):
    """SDPA stored with fp8 at 0.99x. A later process reads fp8 at `now` x SDPA: slower than stored says nothing
    against SDPA (the old rule, 3 % either way, measured 1.05x and 0.96x again); at or under 0.97x fp8 could now be
    chosen, so the kind is measured again."""
    store = stored(tmp_path)
    Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.9}, store=store).step()
    later = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 10.0 * now}, store=store)
    with caplog.at_level(logging.WARNING):
        later.step()
    said = [r.getMessage() for r in caplog.records if "is measured again" in r.getMessage()]
    assert bool(said) == measured_again
    if measured_again:
        assert said[0].startswith("auto's remembered choice for (") and "0.99x stored" in said[0]
        assert later.decision() is None  # a trial measures it again
    else:
        assert later.decision().chosen == "sdpa" and on_disk(store, later.decision()).confirmed


def test_a_check_in_its_own_process_that_disagrees_measures_again_once(monkeypatch, tmp_path, caplog):
    """fp8 measured 1.00x (SDPA kept); in the next step it reads 0.90x (the check disagrees) and the kind is measured
    again. That trial, fp8 at 1.00x again, keeps SDPA as its second measurement: confirmed, not checked a third
    time, so a kind near the bar cannot loop between checks and trials."""
    store = stored(tmp_path)
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 10.0}, store=store)
    scene.step()
    scene.in_step["triton_int8_fp8"] = 9.0
    with caplog.at_level(logging.WARNING):
        scene.step()
    said = [r.getMessage() for r in caplog.records if "is measured again" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("auto's choice for (") and "1.00x in its trial" in said[0]
    scene.in_step["triton_int8_fp8"] = 10.0
    for _ in range(3):
        scene.step()
        if scene.decision() is not None:
            break
    decision = scene.decision()
    assert decision.chosen == "sdpa" and decision.source == "measured" and decision.confirmed
    assert on_disk(store, decision).confirmed
    runs = scene.backends["triton_int8_fp8"].runs
    assert scene.step() == ["sdpa"] * FLUX_CALLS and scene.backends["triton_int8_fp8"].runs == runs


def test_a_check_that_finds_a_winner_hands_the_kind_to_a_trial_that_takes_it(monkeypatch, tmp_path):
    """SDPA kept at 1.02x; a step later fp8 runs at 0.80x: the check disagrees and the trial that follows takes fp8."""
    store = stored(tmp_path)
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 10.2}, store=store)
    scene.step()
    scene.in_step["triton_int8_fp8"] = 8.0
    for _ in range(4):
        scene.step()
        decision = scene.decision()
        if decision is not None and decision.chosen != "sdpa":
            break
    assert decision.chosen == "triton_int8_fp8" and decision.ratio("triton_int8_fp8") == pytest.approx(0.8)


def test_a_reverted_choice_is_confirmed(monkeypatch, tmp_path):
    """The watch's revert is itself a later measurement: stored confirmed, with no check after it."""
    store = stored(tmp_path)
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp16": 8.0}, store=store)
    scene.step()
    scene.in_step["triton_int8_fp16"] = 10.5  # 1.05x: past the watch's margin, inside the recheck band
    for _ in range(step_trials.WATCH_EVERY):
        scene.step()
    decision = scene.decision()
    assert decision.reverted and decision.confirmed and on_disk(store, decision).confirmed
    runs = scene.backends["triton_int8_fp16"].runs
    assert scene.step() == ["sdpa"] * FLUX_CALLS and scene.backends["triton_int8_fp16"].runs == runs


@pytest.mark.parametrize("value, confirmed", [(True, True), ("true", False), (1, False), (None, False)])
def test_only_a_stored_true_is_confirmed(value, confirmed):
    key = decisions.TuneKey("float16", 64, 64, False, False, 256, 256, "none", "")
    entry = {"timings": {"sdpa": 1.0, "triton_int8_fp8": 1.02}, "confirmed": value}
    assert decisions.Decision.from_json(key, entry).confirmed is confirmed
