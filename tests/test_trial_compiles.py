"""A trial's Triton candidates compile their kernels for the call side by side before its first turn
(kernels/dispatch.py, `compile_side_by_side`), instead of each at its own first turn, one after another.

Why: on an H100, Wan 14B's first-ever `auto` step spent 12.8-13.9 s compiling the two Triton candidates' kernels in
their first turns (self- and cross-attention), of +14.1-20.0 s over SDPA's first step.
The scene is test_step_trials' (fake backends on a simulated clock); a fake `warm_up` stands in for the Triton
backends' (precompile.py), running what it is given as the real one collects it.
"""
import time

from test_step_trials import IDENTITY, Scene

from comfyui_sage_rdna4.kernels import decisions, first_use_costs


class WarmUp:
    """Records each warm-up and which backends launched inside it."""

    def __init__(self, scene, seconds=0.0):
        self.scene, self.seconds, self.launched = scene, seconds, []

    def __call__(self, run):
        before = len(self.scene.ran)
        run()
        time.sleep(self.seconds)
        self.launched.append(self.scene.ran[before:])


def with_warm_up(scene, names, seconds=0.0):
    warm = WarmUp(scene, seconds)
    for name in names:
        scene.backends[name].warm_up = warm
    return warm


def test_a_trial_compiles_every_triton_candidate_at_once_before_its_turns(monkeypatch):
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.0, "triton_int8_fp16": 12.0})
    warm = with_warm_up(scene, ["triton_int8_fp8", "triton_int8_fp16"])
    first = scene.step()
    assert warm.launched == [["triton_int8_fp8", "triton_int8_fp16"]]  # one warm-up, both candidates in it
    assert scene.backends["triton_int8_fp8"].runs == first.count("triton_int8_fp8") + 1  # its turns, and the warm-up
    scene.step()
    assert len(warm.launched) == 1 and scene.decision().chosen == "triton_int8_fp8"


def test_only_the_candidates_with_a_warm_up_launch_in_it(monkeypatch):
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.0, "triton_int8_fp16": 12.0})
    warm = with_warm_up(scene, ["triton_int8_fp16"])
    scene.step()
    assert warm.launched == [["triton_int8_fp16"]]


def test_no_warm_up_without_a_trial(monkeypatch, tmp_path):
    """A later process recalls the stored decision: nothing is compiled ahead for it."""
    store = decisions.DecisionStore(str(tmp_path), enabled=True, identity=lambda device: IDENTITY)
    timings = {"sdpa": 10.0, "triton_int8_fp8": 8.0}
    first = Scene(monkeypatch, timings, store=store)
    with_warm_up(first, ["triton_int8_fp8"])
    first.step()
    assert first.decision().chosen == "triton_int8_fp8"
    later = Scene(monkeypatch, timings, store=store)
    warm = with_warm_up(later, ["triton_int8_fp8"])
    later.step()
    assert warm.launched == [] and later.decision().source == "disk"


def test_a_candidate_that_raises_in_the_warm_up_leaves_the_others_compiled_and_fails_in_its_turn(monkeypatch):
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.0, "triton_int8_fp16": 12.0},
                  raises={"triton_int8_fp8": RuntimeError("no kernel")})
    warm = with_warm_up(scene, ["triton_int8_fp8", "triton_int8_fp16"])
    scene.step()
    assert warm.launched == [["triton_int8_fp8", "triton_int8_fp16"]]  # fp8 raised there, fp16 still launched
    scene.step()
    decision = scene.decision()
    assert "triton_int8_fp8" in decision.failed and "no kernel" in decision.failed["triton_int8_fp8"]


def test_the_warm_up_is_a_first_use_part_of_its_own(monkeypatch):
    scene = Scene(monkeypatch, {"sdpa": 10.0, "triton_int8_fp8": 9.0, "triton_int8_fp16": 12.0})
    with_warm_up(scene, ["triton_int8_fp8", "triton_int8_fp16"], seconds=0.03)
    mark = first_use_costs.mark()
    scene.step()
    parts = [(part, seconds) for part, seconds in first_use_costs.since(mark) if part.startswith("compiling")]
    (part, seconds), = parts
    assert part.startswith("compiling the kernels of triton_int8_fp8, triton_int8_fp16 side by side while auto "
                           "measures (B1 Hq2 Hkv2 Nq256 Nk256 D64 float16")
    assert seconds >= 0.03
