"""auto's measuring: the explicit step a route asks for when a kind of call has no decision yet.

Two ways to measure, one decision format (kernels/decisions.py):
  * **in the step** (the ComfyUI override, `IN_STEP`): `begin_in_step` recalls a stored decision or starts a
    `StepTrial` (kernels/step_trials.py) that spreads the model's own calls of that kind over SDPA and every ready
    candidate. When it decides, a quantized choice gets a `Watch`, which reverts it to SDPA when it turns slow.
  * **alone** (`ALONE`: the public API and the benchmark, where there is no step): `measure_alone` times, on the
    call's own tensors, SDPA and every ready candidate: one untimed warm-up, then TIMED_REPEATS timed calls, the
    median kept. Inside a model step a kernel can run at other clocks than alone (docs/MEASUREMENTS.md, "Clocks
    under the power cap"), so the ComfyUI path never uses these.
Either way a quantized backend is taken only when it measured at most 1 - MARGIN times SDPA. A candidate that
raises while measured is left out with its reason; nothing here raises to the caller.

One `Tuner` per process (`default_tuner()`); the override and tests may hand another one in.
SAGE_RDNA4_AUTOTUNE=0 turns measuring off (the static order decides). Never imports ComfyUI.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from functools import partial
from typing import Callable, Dict, List, Optional

import torch

from . import first_use_costs, registry, settings
from .decisions import ALONE, IN_STEP, NOT_DECIDED, SDPA, Decision, DecisionBook, DecisionStore
from .generation import invalidate_decisions
from .quant import default_sm_scale
from .step_trials import DeviceEvents, Measurement, Recheck, StepTrial, Watch

log = logging.getLogger(__name__)

TIMED_REPEATS = 3  # alone: timed calls per candidate after its warm-up; the median is kept
# A remembered SDPA choice is checked in the step only when its best quantized candidate was stored within this share
# of SDPA: farther out, the spread between processes (a few %) cannot flip it, SDPA is exact either way, and the
# check's calls would load the kernels into a later session's first step (docs/POLICIES.md).
SDPA_RECHECK_BAND = 0.10

# timer(fn, device) -> milliseconds of one call of fn; injectable so tests need no GPU.
Timer = Callable[[Callable[[], object], torch.device], float]


def cuda_event_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of fn timed with CUDA events on the current stream (waits for it: `alone` only)."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def capturing_or_compiling() -> bool:
    """Timing would break a CUDA graph capture or a torch.compile trace: a kind of call first seen there is not
    measured (a decision made earlier still serves it)."""
    try:
        if torch.cuda.is_current_stream_capturing():
            return True
    except Exception:
        pass
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


class Tuner:
    """auto's decisions (a DecisionBook in memory, a DecisionStore on disk) and the trials and watches measuring
    them in the step. `timer`, `store` and `events` are injectable so tests need no GPU; `require_cuda=False`
    runs the GPU logic on CPU tensors; `on_change` is told when a trial decides or a watch reverts (default:
    `generation.invalidate_decisions`, so plans made on the old answer are remade)."""

    def __init__(self, timer: Optional[Timer] = None, store: Optional[DecisionStore] = None,
                 enabled: Optional[bool] = None, require_cuda: bool = True, events=None,
                 on_change: Optional[Callable[[], None]] = None):
        self.timer = timer or cuda_event_ms
        self.store = store if store is not None else DecisionStore(installed=registry.installed_packages)
        self.events = events if events is not None else DeviceEvents()
        self.book = DecisionBook()
        self.require_cuda = require_cuda
        self._enabled = enabled
        self._on_change = on_change or invalidate_decisions
        self._measuring: Dict[tuple, Measurement] = {}  # in the step: a key's trial, or the watch of its choice
        self._unchecked: Dict[tuple, frozenset] = {}  # in the step: a key's candidates timed before their self-check
        self._recall_tried: set = set()  # keys `recall_settled` has looked up on disk (once per process each)
        self._asked_none: set = set()  # keys whose quantized choice it recalled with no candidate asked but that one
        self._measure_afresh: set = set()  # keys whose next trial measures among all candidates, recalling nothing
        self._lock = threading.Lock()

    # -- what routing reads (no side effect) ---------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled if self._enabled is not None else settings.autotune_enabled()

    @staticmethod
    def may_measure_now(call, attn_mask) -> bool:
        if capturing_or_compiling():
            return False
        return call.mask == "none" or attn_mask is not None  # a masked call is timed with its mask only

    def decision(self, method: str, call):
        """The decision for this call's kind: a Decision, None (the static order), or decisions.NOT_DECIDED."""
        return self.book.get(DecisionBook.key(method, call))

    def measuring(self, call) -> Optional[Measurement]:
        """In the step: the trial measuring this call's kind, or the watch kept on its quantized choice."""
        return self._measuring.get(DecisionBook.key(IN_STEP, call))

    def decisions(self) -> List[Decision]:
        """Every decision made or loaded in this process (for reports and the benchmark)."""
        return self.book.all()

    def decision_for(self, call, method: str = ALONE) -> Optional[Decision]:
        found = self.decision(method, call)
        return None if found is NOT_DECIDED else found

    def clear(self) -> None:
        with self._lock:
            self.book.clear()
            self._measuring.clear()
            self._unchecked.clear()
            self._recall_tried.clear()
            self._asked_none.clear()
            self._measure_afresh.clear()

    # -- measuring in the step ------------------------------------------------------------------
    def recall_settled(self, call, device) -> None:
        """Before any candidate is asked whether it can take this kind of call, if the packages the candidates rest
        on are installed as they were when this kind's decision was stored: keep an SDPA choice that no check would
        time again (`_checked_name`), or take up a quantized choice with its check against SDPA. Only the chosen
        backend is then asked (by the route, before it serves), so a later session loads no other candidate and
        imports no other peer (checking that comfy-kitchen is available imports it: 0.5 s, docs/MEASUREMENTS.md).
        A check that disagrees has the route ask every candidate for the trial that follows. Looked up once per
        kind of call; otherwise `begin_in_step` recalls by the candidates found ready."""
        key = DecisionBook.key(IN_STEP, call)
        with self._lock:
            if key in self._recall_tried or self.book.get(key) is not NOT_DECIDED or key in self._measuring:
                return
            self._recall_tried.add(key)
            decision = self.store.load_unchanged(device, key[3], IN_STEP)
            if decision is None:
                return
            checked = self._checked_name(decision)
            if checked is None:
                self.book.put(key, decision)
            elif checked == decision.chosen and checked in registry.BACKEND_NAMES:
                self._asked_none.add(key)
                self._measure(key, device, (registry.get_backend(checked),), decision, recalled=True)
            else:  # an SDPA choice checked against its best candidate: that one is asked first, the usual way
                return
        log.info("%s", decision.summary)

    def begin_in_step(self, route, call, device) -> bool:
        """The measuring step of a route that asks for it (routing.MEASURE without a measurement): the decision
        stored for this kind of call, rechecked in the step, or a new trial among `route.candidates` (those in
        `route.unchecked` timed before their self-check). True when it began a trial."""
        key = DecisionBook.key(IN_STEP, call)
        names = tuple(b.name for b in route.candidates)
        with self._lock:
            if self.book.get(key) is not NOT_DECIDED or key in self._measuring:  # another thread got here first
                return False
            self._unchecked[key] = frozenset(b.name for b in route.unchecked)
            afresh = key in self._measure_afresh  # a check of a decision recalled unasked disagreed
            self._measure_afresh.discard(key)
            decision = None if afresh else self.store.load(device, key[3], names, IN_STEP)
            if decision is not None:
                decision.passed_over = dict(route.passed_over)  # its candidates: set by the load, equal to `names`
            self._measure(key, device, route.candidates, decision, route.passed_over, recalled=True,
                          confirmed=afresh)
        if decision is not None:
            log.info("%s", decision.summary)
        return decision is None

    def _measure(self, key, device, candidates, decision: Optional[Decision], passed_over=None,
                 recalled: bool = False, on_disk: bool = False, confirmed: bool = False) -> None:
        """What measures this kind of call from now on (under the lock). Without a decision, a trial among
        `candidates` (`confirmed`: it measures again a decision a check disagreed with). A decision is kept in
        memory. One `recalled` from disk, or an SDPA choice just made and kept `on_disk` (which a later process may
        then trust unchecked), is timed again in a step where `_checked_against` names a backend (Recheck: kept when
        it holds, measured again when not). A quantized choice is then watched."""
        unchecked = self._unchecked.get(key, frozenset())
        if decision is None:
            self._measuring[key] = StepTrial(key[3], device, candidates, passed_over, self.events,
                                             partial(self._decided, key, device, candidates), unchecked, confirmed)
            return
        self.book.put(key, decision)
        fresh_sdpa = on_disk and decision.chosen == SDPA  # a later process may trust it once it is confirmed
        backend = self._checked_against(decision, candidates) if recalled or fresh_sdpa else None
        if backend is not None:
            # A quantized choice is checked before it serves (routing.route); the best of an SDPA choice may be
            # timed unchecked, as in a trial.
            self._measuring[key] = Recheck(decision, backend, device, self.events,
                                           partial(self._rechecked, key, device, candidates, backend.name),
                                           unchecked if decision.chosen == SDPA else ())
            return
        chosen = next((b for b in candidates if b.name == decision.chosen), None)
        if chosen is None:
            self._measuring.pop(key, None)
        else:
            self._measuring[key] = Watch(decision, chosen, device, self.events,
                                         partial(self._decided, key, device, candidates))

    @staticmethod
    def _checked_name(decision: Decision) -> Optional[str]:
        """The backend `decision` is timed against SDPA on before it stands, or None. A quantized choice: itself. An
        SDPA choice: its best quantized candidate, unless that was more than SDPA_RECHECK_BAND slower (no spread
        between runs could flip it) or a check in a later step already confirmed the choice."""
        if decision.chosen != SDPA:
            return decision.chosen
        if decision.confirmed or decision.best_quantized is None or \
                decision.ratio(decision.best_quantized[0]) > 1 + SDPA_RECHECK_BAND:
            return None
        return decision.best_quantized[0]

    @classmethod
    def _checked_against(cls, decision: Decision, candidates) -> Optional[object]:
        """`_checked_name`'s backend among `candidates` (None where it is not one now)."""
        name = cls._checked_name(decision)
        return next((b for b in candidates if b.name == name), None) if name is not None else None

    # -- what a trial, a recheck and a watch report at a step boundary (sage_patch/timing.py) ---------
    def _rechecked(self, key, device, candidates, name: str, agrees: bool, ratio: Optional[float]) -> None:
        """A recheck's result: the decision is kept (and stored as confirmed), or its kind of call is measured
        again (a trial whose decision is then the second measurement)."""
        with self._lock:
            decision = self.book.get(key)
            newly_confirmed = agrees and not decision.confirmed
            if agrees:
                decision.confirmed = True
                self._measure(key, device, candidates, decision)
            else:  # the timings no longer hold here: this kind of call is measured again
                self.book.forget(key)
                if key in self._asked_none:  # only the chosen backend is at hand: the route asks every candidate
                    self._asked_none.discard(key)
                    self._measuring.pop(key, None)
                    self._measure_afresh.add(key)
                else:
                    self._measure(key, device, candidates, None, decision.passed_over, confirmed=True)
        if newly_confirmed:
            self.store.save(device, decision, decision.candidates)
        if not agrees:
            now = f"{ratio:.2f}x SDPA" if ratio is not None else "a failure"
            which = "remembered choice" if decision.source == "disk" else "choice"
            log.warning("auto's %s for (%s) is measured again: %s gave %s in this step, %.2fx %s", which,
                        key[3].label(), name, now, decision.ratio(name),
                        "stored" if decision.source == "disk" else "in its trial")
        self._on_change()

    def _decided(self, key, device, candidates, decision: Decision, keep: bool) -> None:
        """A trial decided, or a watch reverted: kept in memory and (with `keep`) on disk; plans are remade."""
        with self._lock:
            self._measure(key, device, candidates, decision, on_disk=keep and self.store.enabled)
        if keep:
            self.store.save(device, decision, decision.candidates)
        log.log(logging.WARNING if decision.reverted else logging.INFO, "%s", decision.summary)
        self._on_change()

    # -- measuring alone (the public API, the benchmark) -------------------------------------------
    def measure_alone(self, route, call, tensors, sm_scale: Optional[float] = None, attn_mask=None) -> None:
        """The measuring step of a route that asks for it, without a step: time the route's yardstick (SDPA,
        `route.backend`) and `route.candidates` on the call's own tensors (or recall the stored decision) and keep
        the decision."""
        key = DecisionBook.key(ALONE, call)
        with self._lock:
            if self.book.get(key) is not NOT_DECIDED:  # another thread measured it while we waited
                return
            started = time.perf_counter()
            try:
                decision = self._measure_or_load(key[3], route, call, tensors, sm_scale, attn_mask)
            except Exception as exc:  # measuring must never take the call down: the static order serves it
                log.warning("auto could not measure %s: %s: %s; using the static order", call.short(),
                            type(exc).__name__, exc)
                decision = None
            self.book.put(key, decision)
        if decision is not None:  # the time says what measuring cost this first call
            seconds = time.perf_counter() - started
            first_use_costs.record(f"auto measured {decision.key.label()} alone", seconds)
            log.info("%s (%.2f s)", decision.summary, seconds)

    def _measure_or_load(self, key, route, call, tensors, sm_scale, attn_mask) -> Optional[Decision]:
        names = [b.name for b in route.candidates]
        device = tensors[0].device
        stored = self.store.load(device, key, names, ALONE)
        if stored is not None:
            stored.passed_over = dict(route.passed_over)
            return stored
        if sm_scale is None:
            sm_scale = default_sm_scale(tensors[0].shape[-1])
        timings, failed, transient = self._time([route.backend] + list(route.candidates), call, tensors, sm_scale,
                                                attn_mask)
        if SDPA not in timings:
            return None
        decision = Decision(key, timings, failed, dict(route.passed_over),
                            samples={n: TIMED_REPEATS for n in timings})
        if not transient:  # an out-of-memory is this moment's, not the shape's: measure again next process
            self.store.save(device, decision, names)
        return decision

    def _time(self, backends, call, tensors, sm_scale, attn_mask):
        """Median ms per backend (SDPA first, the yardstick), failures by name, and whether one ran out of memory."""
        q, k, v = tensors
        device = q.device
        timings: Dict[str, float] = {}
        failed: Dict[str, str] = {}
        transient = False
        with torch.no_grad():
            for backend in backends:
                def run(backend=backend):  # found ready by the route: timed as the public call runs it
                    return backend.launch(q, k, v, call, sm_scale, attn_mask)
                try:
                    run()  # warm-up: compilation and caches, not timed
                    timings[backend.name] = statistics.median(self.timer(run, device) for _ in range(TIMED_REPEATS))
                except Exception as exc:
                    transient |= isinstance(exc, torch.cuda.OutOfMemoryError)
                    failed[backend.name] = f"failed while auto measured it: {type(exc).__name__}: {exc}"
                    if backend.name == SDPA:
                        break  # without the yardstick nothing can be judged
        return timings, failed, transient


# Made at import (it is cheap: no device or disk is touched before its first decision), so threads making the
# first plans at once share one tuner and its decisions.
_DEFAULT = Tuner()


def default_tuner() -> Tuner:
    return _DEFAULT
