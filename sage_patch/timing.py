"""Per-step timing of a patched model's sampling runs, and per-step attention time on request.

How it hooks in (ComfyUI's own extension points, nothing global):
  * an OUTER_SAMPLE wrapper brackets one sampling run (it also sees the run fail);
  * a PREDICT_NOISE wrapper brackets one model evaluation, i.e. one step of a one-evaluation sampler
    such as euler (a two-evaluation sampler such as heun records two entries per step).
On a GPU each step is bracketed by two device events on the current stream, so the GPU work of the step
is counted, not just its launches; events are read once, after the run, with a single synchronize: no
sync inside the run. On the CPU the host clock is exact. The end of each model evaluation is also the step
boundary at which `auto`'s in-step measurement reads its events (`override.step_boundary`, kernels/step_trials.py):
while it measures, that is one wait per evaluation, between two steps, never inside one. Attention time per
step is measured only when the patch asks for it (`PatchConfig.time_attention`): then
`override.attention_timer` is set and the override brackets each kernel call with events. Otherwise
`attention_timer` stays None and the override does no extra work at all.
Once per run, a short summary and the patch's stats go to the console through `logging` (logger
"sage_rdna4", level INFO), so ComfyUI's log shows them in order with everything else.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..kernels import first_use_costs
from .stats import delta_passed_over

WRAPPER_KEY = "sage_rdna4_step_timer"
log = logging.getLogger("sage_rdna4")
try:
    from comfy.patcher_extension import WrappersMP

    OUTER_SAMPLE, PREDICT_NOISE = WrappersMP.OUTER_SAMPLE, WrappersMP.PREDICT_NOISE
except ImportError:  # outside ComfyUI (tests with a stand-in patcher): ComfyUI's names for the two hooks
    OUTER_SAMPLE, PREDICT_NOISE = "outer_sample", "predict_noise"
MAX_RUNS_KEPT = 8

_TIMERS: "weakref.WeakKeyDictionary[object, StepTimer]" = weakref.WeakKeyDictionary()


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


class _Stopwatch:
    """One interval: device events on a GPU (read later), host clock otherwise (read now)."""

    __slots__ = ("device", "start", "end", "host_start", "host_ms")

    def __init__(self, device):
        self.device = device if _is_cuda(device) else None
        self.start = self.end = None
        self.host_start = 0.0
        self.host_ms = 0.0

    def begin(self):
        if self.device is not None:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(torch.cuda.current_stream(self.device))
        self.host_start = time.perf_counter()
        return self

    def finish(self):
        self.host_ms = (time.perf_counter() - self.host_start) * 1e3
        if self.device is not None:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record(torch.cuda.current_stream(self.device))
        return self

    def device_ms(self) -> Optional[float]:
        """GPU time between the two events; only valid after the device was synchronized."""
        if self.start is None or self.end is None:
            return None
        return float(self.start.elapsed_time(self.end))

    def ms(self) -> float:
        dev = self.device_ms()
        return self.host_ms if dev is None else dev


class AttentionTimer:
    """`override.attention_timer`: the override runs each kernel call inside `measure()`."""

    def __init__(self, device):
        self.device = device
        self._pending: List[_Stopwatch] = []

    @contextlib.contextmanager
    def measure(self):
        watch = _Stopwatch(self.device).begin()
        try:
            yield
        finally:
            self._pending.append(watch.finish())

    def drain(self) -> List[_Stopwatch]:
        pending, self._pending = self._pending, []
        return pending


@dataclass
class StepTiming:
    index: int
    sigma: Optional[float]
    step_ms: float                 # device time on a GPU, host time on the CPU
    host_ms: float                 # host wall time (launch-bound on a GPU without a sync)
    attention_ms: Optional[float]  # None unless attention timing was on
    attention_calls: int = 0

    def as_dict(self) -> dict:
        return {"index": self.index, "sigma": self.sigma, "step_ms": self.step_ms, "host_ms": self.host_ms,
                "attention_ms": self.attention_ms, "attention_calls": self.attention_calls}


@dataclass
class RunTiming:
    label: str
    clock: str                     # "cuda events" or "host clock"
    steps: List[StepTiming] = field(default_factory=list)
    total_ms: float = 0.0          # the whole run (OUTER_SAMPLE), host clock after a final sync
    calls: Dict[str, int] = field(default_factory=dict)       # attention calls of this run per backend
    fallbacks: Dict[str, int] = field(default_factory=dict)   # per reason
    routed: Dict[str, int] = field(default_factory=dict)      # exact on purpose, per policy
    passed_over: Dict[str, Dict[str, int]] = field(default_factory=dict)  # auto passed over: backend -> reason -> n
    first_use: List[Tuple[str, float]] = field(default_factory=list)  # (part, seconds): kernels/first_use_costs.py

    def step_times(self) -> List[float]:
        return [s.step_ms for s in self.steps]

    def as_dict(self) -> dict:
        return {"label": self.label, "clock": self.clock, "total_ms": self.total_ms,
                "steps": [s.as_dict() for s in self.steps], "calls": dict(self.calls),
                "fallbacks": dict(self.fallbacks), "routed": dict(self.routed),
                "passed_over": {name: dict(reasons) for name, reasons in self.passed_over.items()},
                "first_use": [{"part": part, "seconds": seconds} for part, seconds in self.first_use]}

    def summary_line(self) -> str:
        times = self.step_times()
        if not times:
            return f"{self.label}: sampling run with no model evaluations timed"
        rest = times[1:] or times
        line = (f"{self.label}: {len(times)} steps in {self.total_ms / 1e3:.2f} s; per step median "
                f"{statistics.median(rest):.1f} ms after a first (warm-up) step of {times[0]:.1f} ms ({self.clock})")
        attn = [s.attention_ms for s in self.steps[1:] or self.steps if s.attention_ms is not None]
        if attn:
            share = sum(attn) / max(sum(rest), 1e-9)
            line += f"; attention {statistics.median(attn):.1f} ms/step = {100 * share:.0f}% of the step"
        if self.first_use:  # what made the first step slow: self-checks (compiles included), probes, measuring
            line += f"\n  {first_use_costs.describe(self.first_use)}"
        return line


def _delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def log_summary(text: str) -> None:
    """The default console output of a run's summary: one INFO record of the "sage_rdna4" logger."""
    log.info("%s", text)


class StepTimer:
    """Times the sampling runs of one patched model (shared by its clones, like the override)."""

    def __init__(self, override, device, printer: Optional[Callable[[str], None]] = None):
        # Weak: the patched model holds both the override and (through its wrappers) this timer; a strong
        # reference back would keep every override alive in the registry below after its model is gone.
        self._override = weakref.ref(override)
        self.device = device
        self.printer = printer if printer is not None else log_summary
        self.runs: List[RunTiming] = []
        self.listeners: List[Callable[[RunTiming], None]] = []
        self._run: Optional[RunTiming] = None
        self._watches: List[tuple] = []

    @property
    def override(self):
        return self._override()

    @property
    def current_step(self) -> int:
        """Index of the model evaluation now running in the current run; -1 outside a run."""
        return len(self._watches) if self._run is not None else -1

    @property
    def last_run(self) -> Optional[RunTiming]:
        return self.runs[-1] if self.runs else None

    # -- run ---------------------------------------------------------------------------------
    def begin_run(self) -> None:
        config = self.override.config
        self.override.attention_timer = AttentionTimer(self.device) if config.time_attention else None
        clock = "cuda events" if _is_cuda(self.device) else "host clock"
        # The A/B baseline runs the model's own attention whatever its config names: its label says so.
        label = "sage_rdna4[own attention]" if self.override.baseline else f"sage_rdna4[{config.kernel}]"
        self._run = RunTiming(label=label, clock=clock)
        self._watches = []
        self._stats_before = self.override.stats.snapshot()
        self._first_use_mark = first_use_costs.mark()
        self._run_start = time.perf_counter()

    def end_run(self) -> RunTiming:
        run = self._run
        if _is_cuda(self.device):
            torch.cuda.synchronize(self.device)  # once per run: every event below is now readable
        run.total_ms = (time.perf_counter() - self._run_start) * 1e3
        for index, (sigma, watch, attn) in enumerate(self._watches):
            # Only calls the chosen kernel ran are timed; a step where none did has no attention time.
            timed = self.override.attention_timer is not None and attn
            attention_ms = sum(w.ms() for w in attn) if timed else None
            sigma = float(sigma) if sigma is not None else None
            run.steps.append(StepTiming(index, sigma, watch.ms(), watch.host_ms, attention_ms, len(attn)))
        after = self.override.stats.snapshot()
        run.calls = _delta(after["calls"], self._stats_before["calls"])
        run.fallbacks = _delta(after["fallbacks"], self._stats_before["fallbacks"])
        run.routed = _delta(after["routed"], self._stats_before["routed"])
        run.passed_over = delta_passed_over(after["passed_over"], self._stats_before["passed_over"])
        run.first_use = first_use_costs.since(self._first_use_mark)
        self._run, self._watches = None, []
        self.override.attention_timer = None  # between runs the override does no timing work
        self.runs = (self.runs + [run])[-MAX_RUNS_KEPT:]
        return run

    def abort_run(self) -> None:
        self._run, self._watches = None, []
        self.override.attention_timer = None

    # -- ComfyUI wrappers --------------------------------------------------------------------
    def wrap_run(self, executor, *args, **kwargs):
        """OUTER_SAMPLE wrapper: one sampling run."""
        self.begin_run()
        try:
            out = executor(*args, **kwargs)
        except BaseException:
            self.abort_run()
            raise
        run = self.end_run()
        self.printer(run.summary_line() + "\n" + self.override.stats.summary())
        for listener in list(self.listeners):
            listener(run)
        return out

    def wrap_step(self, executor, x, timestep, *args, **kwargs):
        """PREDICT_NOISE wrapper: one model evaluation (one step of euler-like samplers)."""
        if self._run is None:  # called outside a sampling run we bracket: time nothing but auto's calls
            out = executor(x, timestep, *args, **kwargs)
            self.override.step_boundary()
            return out
        timer = self.override.attention_timer
        if timer is not None:
            timer.drain()  # attention outside a step is not attributed to one
        watch = _Stopwatch(self.device).begin()
        out = executor(x, timestep, *args, **kwargs)
        watch.finish()
        self.override.step_boundary()  # after the step's end mark: auto's one wait for its events is not counted
        # Keep sigma as a tensor: reading a GPU value now would synchronize inside the run.
        sigma = timestep.detach().flatten()[0] if torch.is_tensor(timestep) and timestep.numel() else timestep
        self._watches.append((sigma, watch, timer.drain() if timer is not None else []))
        return out


def step_timer_of(override) -> Optional[StepTimer]:
    """The timer `attach_step_timer` put on a patched model's override, if any."""
    return _TIMERS.get(override)


def attach_step_timer(patched_model, override, printer: Optional[Callable[[str], None]] = None) -> StepTimer:
    """Install the timing wrappers on `patched_model` (a clone) for `override`; returns the timer.

    Wrappers a clone inherited from an earlier patch are replaced, so a model is never timed twice."""
    timer = StepTimer(override, getattr(patched_model, "load_device", None), printer)
    _TIMERS[override] = timer
    remove = getattr(patched_model, "remove_wrappers_with_key", None)
    for kind, fn in ((OUTER_SAMPLE, timer.wrap_run), (PREDICT_NOISE, timer.wrap_step)):
        if remove is not None:
            remove(kind, WRAPPER_KEY)
        patched_model.add_wrapper_with_key(kind, WRAPPER_KEY, fn)
    return timer
