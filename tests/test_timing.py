"""The step timer: runs, steps, attention time on request, once-per-run console summary, no work when off."""
import logging
import time

import pytest
import torch

from comfyui_sage_rdna4.sage_patch.config import PatchConfig
from comfyui_sage_rdna4.sage_patch.override import SageAttentionOverride
from comfyui_sage_rdna4.sage_patch.stats import PatchStats
from comfyui_sage_rdna4.sage_patch.timing import (
    WRAPPER_KEY,
    AttentionTimer,
    RunTiming,
    StepTimer,
    StepTiming,
    step_timer_of,
)


def make_timer(time_attention, device="cpu"):
    override = SageAttentionOverride(PatchConfig(kernel="reference", time_attention=time_attention),
                                     PatchStats("test"))
    printed = []
    return StepTimer(override, torch.device(device), printed.append), override, printed


def fake_step(override, step_s=0.03, attention_s=0.01, calls=2):
    """Stands in for predict_noise: a step that spends part of its time in timed kernel calls."""
    def run(x, timestep, model_options=None, seed=None):
        t_end = time.perf_counter() + step_s
        for _ in range(calls):
            if override.attention_timer is not None:
                with override.attention_timer.measure():
                    time.sleep(attention_s / calls)
            override.stats.record_call("reference")
        time.sleep(max(0.0, t_end - time.perf_counter()))
        return x
    return run


def sample(timer, override, n_steps, **kw):
    def sampler():
        for i in range(n_steps):
            timer.wrap_step(fake_step(override, **kw), torch.zeros(1), torch.tensor([1.0 - i / n_steps]), {}, 0)
        return "samples"
    return timer.wrap_run(lambda: sampler())


def test_steps_are_timed_with_attention_when_asked():
    timer, override, printed = make_timer(time_attention=True)
    assert sample(timer, override, 3) == "samples"
    run = timer.last_run
    assert [s.index for s in run.steps] == [0, 1, 2]
    assert [s.sigma for s in run.steps] == pytest.approx([1.0, 2 / 3, 1 / 3])
    for s in run.steps:
        assert 28.0 <= s.step_ms < 300.0
        assert 9.0 <= s.attention_ms < s.step_ms
        assert s.attention_calls == 2
    assert run.calls == {"reference": 6} and run.fallbacks == {} and run.clock == "host clock"
    assert run.total_ms >= sum(run.step_times()) * 0.99
    assert override.attention_timer is None  # only set while a run is on: no timing work between runs


def test_prints_once_per_run_with_the_stats():
    timer, override, printed = make_timer(time_attention=True)
    sample(timer, override, 2)
    sample(timer, override, 2)
    assert len(printed) == 2
    assert "2 steps" in printed[0] and "warm-up" in printed[0] and "attention" in printed[0]
    assert "ran reference: 4" in printed[0] and "ran reference: 8" in printed[1]  # the patch's running stats
    assert timer.last_run.calls == {"reference": 4}  # ... while the run keeps its own counts
    assert len(timer.runs) == 2


def test_default_output_is_the_sage_rdna4_logger_not_stdout(caplog, capsys):
    override = SageAttentionOverride(PatchConfig(kernel="reference"), PatchStats("test"))
    timer = StepTimer(override, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="sage_rdna4"):
        sample(timer, override, 2)
    records = [r for r in caplog.records if r.name == "sage_rdna4"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "2 steps in" in records[0].getMessage() and "ran reference: 4" in records[0].getMessage()
    assert capsys.readouterr().out == ""


def test_a_run_keeps_the_skip_reasons_of_its_own_calls():
    timer, override, printed = make_timer(time_attention=False)
    override.stats.record_passed_over({"hip_int8_fp8": "not built for cpu"}, "reference")  # before the run

    def step(x, timestep, model_options=None, seed=None):
        override.stats.record_passed_over({"hip_int8_fp8": "not built for cpu"}, "reference")
        override.stats.record_call("reference")
        return x
    timer.wrap_run(lambda: [timer.wrap_step(step, torch.zeros(1), torch.tensor([1.0]), {}, 0) for _ in range(2)])
    assert timer.last_run.passed_over == {"hip_int8_fp8": {"not built for cpu": 2}}
    assert timer.last_run.as_dict()["passed_over"] == {"hip_int8_fp8": {"not built for cpu": 2}}
    assert "auto passed over hip_int8_fp8 on 3 calls: not built for cpu" in printed[-1]


def test_attention_timing_off_means_no_timer_at_all():
    timer, override, printed = make_timer(time_attention=False)
    sample(timer, override, 2)
    assert override.attention_timer is None  # the override then does no timing work on any call
    assert all(s.attention_ms is None and s.attention_calls == 0 for s in timer.last_run.steps)
    assert "attention" not in printed[0].splitlines()[0]


def test_failed_run_records_and_prints_nothing():
    timer, override, printed = make_timer(time_attention=True)

    def broken():
        timer.wrap_step(fake_step(override), torch.zeros(1), torch.tensor([1.0]))
        raise RuntimeError("interrupted")
    with pytest.raises(RuntimeError, match="interrupted"):
        timer.wrap_run(broken)
    assert printed == [] and timer.runs == [] and timer.current_step == -1


def test_step_outside_a_run_is_passed_through_untimed():
    timer, override, printed = make_timer(time_attention=True)
    out = timer.wrap_step(lambda x, t: x + 1, torch.zeros(1), torch.tensor([0.5]))
    assert float(out) == 1.0 and timer.runs == [] and timer.current_step == -1


def test_current_step_counts_model_evaluations():
    timer, override, _ = make_timer(time_attention=False)
    seen = []
    timer.begin_run()
    for _ in range(3):
        timer.wrap_step(lambda x, t: seen.append(timer.current_step) or x, torch.zeros(1), torch.tensor([1.0]))
    timer.end_run()
    assert seen == [0, 1, 2]


def test_summary_line_known_numbers():
    run = RunTiming("lbl", "host clock", total_ms=1000.0)
    run.steps = [StepTiming(0, 1.0, 500.0, 500.0, 100.0), StepTiming(1, 0.5, 200.0, 200.0, 50.0),
                 StepTiming(2, 0.2, 300.0, 300.0, 50.0)]
    line = run.summary_line()
    assert "3 steps in 1.00 s" in line and "median 250.0 ms" in line and "step of 500.0 ms" in line
    assert "attention 50.0 ms/step = 20% of the step" in line


def test_attention_timer_collects_and_drains():
    t = AttentionTimer(torch.device("cpu"))
    with t.measure():
        time.sleep(0.005)
    with pytest.raises(ValueError):
        with t.measure():
            raise ValueError("kernel failed")  # a failing call is still closed
    watches = t.drain()
    assert len(watches) == 2 and watches[0].ms() >= 4.0 and t.drain() == []


@pytest.mark.gpu
def test_cuda_events_count_gpu_work_not_launches():
    timer, override, printed = make_timer(time_attention=True, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")

    def gpu_step(x, timestep, *args):
        with override.attention_timer.measure():
            for _ in range(20):
                a @ a
        return x
    timer.wrap_run(lambda: timer.wrap_step(gpu_step, torch.zeros(1), torch.tensor([1.0])))
    s = timer.last_run.steps[0]
    assert timer.last_run.clock == "cuda events"
    assert s.step_ms >= s.attention_ms > 0.5  # 20 x 137 GFLOP cannot take under half a millisecond


@pytest.mark.comfyui
def test_attach_installs_one_pair_of_wrappers_per_model():
    import comfy_harness as harness

    harness.comfy_import()
    from comfy.patcher_extension import WrappersMP

    from comfyui_sage_rdna4.sage_patch.install import patch_model

    model = harness.tiny_flux()
    once, ov1 = patch_model(model, PatchConfig(kernel="reference"))
    twice, ov2 = patch_model(once, PatchConfig(kernel="sdpa"))  # re-patching a patched clone
    for kind in (WrappersMP.OUTER_SAMPLE, WrappersMP.PREDICT_NOISE):
        assert len(once.get_wrappers(kind, WRAPPER_KEY)) == 1
        assert len(twice.get_wrappers(kind, WRAPPER_KEY)) == 1
        assert model.get_wrappers(kind, WRAPPER_KEY) == []
    assert step_timer_of(ov1) is not step_timer_of(ov2)
    assert twice.get_wrappers(WrappersMP.PREDICT_NOISE, WRAPPER_KEY)[0].__self__ is step_timer_of(ov2)


def test_the_ab_baselines_run_is_named_for_the_models_own_attention():
    """The A/B baseline runs the call site's own attention whatever its config names: its run says so."""
    for baseline, label in ((True, "sage_rdna4[own attention]"), (False, "sage_rdna4[sdpa]")):
        override = SageAttentionOverride(PatchConfig(kernel="sdpa"), PatchStats("test"), baseline=baseline)
        timer = StepTimer(override, torch.device("cpu"), [].append)
        sample(timer, override, 2)
        assert timer.last_run.label == label


def test_a_fallback_warning_clears_the_progress_bar_first(monkeypatch, caplog):
    """ComfyUI's sampler draws a tqdm bar: the first fallback of a kind is written through tqdm's external write
    mode, so it gets a line of its own instead of landing mid-bar."""
    tqdm = pytest.importorskip("tqdm")
    entered = []

    class Mode:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(tqdm.tqdm, "external_write_mode", classmethod(lambda cls, *a, **k: Mode()))
    stats = PatchStats("test")
    with caplog.at_level(logging.WARNING):
        stats.record_fallback("reason one")
        stats.record_fallback("reason one")  # the same kind again: counted, not logged
    assert entered == [True] and "reason one" in caplog.text


def test_a_run_reports_what_first_use_cost_it_by_part():
    """Parts recorded during a run (a self-check, probes, auto measuring alone) show in that run's record and
    summary line, and not in the next run's."""
    from comfyui_sage_rdna4.kernels import first_use_costs
    timer, override, printed = make_timer(False)

    def step_with_a_first_use(x, timestep, model_options=None, seed=None):
        first_use_costs.record("self-check triton_int8_fp8 (triton prologue) on cuda:0", 12.5)
        return x
    timer.wrap_run(lambda: timer.wrap_step(step_with_a_first_use, torch.zeros(1), torch.tensor([1.0]), {}, 0))
    run = timer.last_run
    assert run.first_use == [("self-check triton_int8_fp8 (triton prologue) on cuda:0", 12.5)]
    assert "first use 12.50 s: self-check triton_int8_fp8 (triton prologue) on cuda:0 12.50 s" in run.summary_line()
    assert run.as_dict()["first_use"] == [{"part": "self-check triton_int8_fp8 (triton prologue) on cuda:0",
                                           "seconds": 12.5}]
    sample(timer, override, 2)
    assert timer.last_run.first_use == [] and "first use" not in timer.last_run.summary_line()
