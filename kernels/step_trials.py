"""`auto` measured on the model's own calls inside the sampling step (the ComfyUI override's way).

A transformer step calls attention with one shape once per block (Flux 57 times per model call, Wan 40). While a
kind of call (decisions.TuneKey) is undecided, a `StepTrial` hands its calls in turn to SDPA (the call site's own
attention) and to each candidate that accepts it, so every call still returns a correct output: the one of the
backend that ran it, or, for a candidate not yet through its self-check (`unchecked`), exact attention's, run after
it (only the candidate is timed). Each call is bracketed by two device events on the model's
current stream; nothing waits for them inside the step. At the step boundary (sage_patch/timing.py) the events
are read, after one wait for the last of them. Once every backend has SAMPLES timed calls, their trimmed means
decide (decisions.Decision: SDPA unless a quantized backend measured at most 1 - MARGIN times SDPA). Deciding only
at a boundary means each backend's calls cover the whole step, every kind of block in it. A candidate already
over 1 + MARGIN times SDPA after ELIMINATE_AFTER timed calls takes no more turns (it could not win, and each of
its turns costs the step time); when none is left, SDPA is decided at that boundary.

A quantized choice is then kept under a `Watch`: every WATCH_EVERY steps, WATCH_CALLS calls of that kind run on
SDPA and as many on the chosen backend, in adjacent pairs spread over the step, timed the same way. When the
newest of them show the choice over
1 + MARGIN times SDPA, the kind of call reverts to SDPA, and the stored decision says so.

Nothing here depends on a GPU model: `events` is injectable (tests script the elapsed times). The tuner
(kernels/tuner.py) makes them and keeps them per kind of call. Never imports ComfyUI or the registry.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Dict, List, Optional, Sequence

import torch

from .decisions import IN_STEP, MARGIN, QUANTIZED_MUST_BEAT, SDPA, Decision, TuneKey

log = logging.getLogger(__name__)

SAMPLES = 12         # timed calls per backend before deciding (why: docs/MEASUREMENTS.md, "auto in the step")
# What a backend's timings come to: their mean with the top and bottom TRIM of them left out. Calls of one kind
# take different times in different blocks (Flux: about 4 % apart between its double and single blocks), so a
# median jumps between those groups; a trimmed mean does not, and a stray slow call does not move it either.
TRIM = 0.2
WARMUP_CALLS = 1     # a backend's first calls of a trial carry compilation and caches: not kept
ELIMINATE_AFTER = SAMPLES // 2  # timed calls of a candidate (and of SDPA) before it can be left out as losing
MAX_PENDING = 4096   # timed calls waiting for a step boundary; past it calls run on SDPA, untimed, until one
WATCH_EVERY = 4      # after a quantized choice: one step in this many is a watch step
WATCH_CALLS = 3      # calls of each (SDPA, the choice) timed in a watch step, spread over the step
WATCH_KEEP = 6       # newest watch timings kept per side; the revert reads their medians
WATCH_MIN = 3        # timings per side before a revert can be judged


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """The mean of `values` without the lowest and highest `trim` share of them."""
    ordered = sorted(values)
    cut = int(len(ordered) * trim)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


class DeviceEvents:
    """Marks on the device's current stream; read only after `wait` (at a step boundary)."""

    @staticmethod
    def mark(device):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    @staticmethod
    def wait(event) -> None:
        event.synchronize()

    @staticmethod
    def elapsed_ms(start, end) -> float:
        return float(start.elapsed_time(end))


class Measurement:
    """What a trial and a watch share: the calls they hand out (`pick`), timed with device events and read at the
    step boundary (`end_step`)."""

    def __init__(self, device, events):
        self.device = device
        self.events = events
        self._pending: List[tuple] = []  # (backend name, start mark, end mark)
        self._lock = threading.Lock()
        self._launched: set = set()  # backends that have had a call here

    SDPA_TURN = ""  # why a call handed to exact attention runs it (the stats count the call under this)
    # Why exact attention answers a call on which an unchecked candidate was timed (the stats count it under this).
    UNCHECKED_TURN = "auto: timing a candidate before its self-check (exact attention's answer)"
    passed_over: Dict[str, str]  # the candidates not measured, and why
    # Candidates timed before their first-use self-check: each of their timed calls is answered by exact attention
    # (the call site's), run after them; a decision that picks one checks it first (routing.route).
    unchecked: frozenset = frozenset()

    def pick(self) -> Optional[str]:
        """Who runs (and times) this call; None: the untimed default."""
        raise NotImplementedError

    def backend(self, name: str):
        raise NotImplementedError

    def fail(self, name: str, reason: str) -> None:
        raise NotImplementedError

    def end_step(self) -> Optional[Decision]:
        raise NotImplementedError

    def begin(self):
        return self.events.mark(self.device)

    def first_launch(self, name: str) -> bool:
        """Whether this is `name`'s first call handed out here: the one that compiles or loads its kernels, which
        the caller reports as a first-use cost (kernels/first_use_costs.py)."""
        with self._lock:
            first = name not in self._launched
            self._launched.add(name)
        return first

    def record(self, name: str, start) -> None:
        end = self.events.mark(self.device)
        with self._lock:
            self._pending.append((name, start, end))

    def _read(self) -> List[tuple]:
        """(name, ms) of the calls timed since the last boundary, in call order; one wait, for the last mark."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return []
        self.events.wait(pending[-1][2])
        out = []
        for name, start, end in pending:
            ms = self.events.elapsed_ms(start, end)
            if math.isfinite(ms) and ms > 0:
                out.append((name, ms))
        return out


class StepTrial(Measurement):
    """Measures one kind of call on the model's own calls; decides through `on_decided(decision, keep)` (`keep`:
    whether the decision may be stored on disk). `confirmed`: this trial measures again a decision that a check in
    a later step disagreed with, so its own decision is that decision's second measurement (Decision.confirmed)."""

    SDPA_TURN = "auto: measuring this kind of call in the step (exact attention's turn)"

    def __init__(self, key: TuneKey, device, candidates: Sequence, passed_over: Dict[str, str], events, on_decided,
                 unchecked: Sequence[str] = (), confirmed: bool = False):
        super().__init__(device, events)
        self.key = key
        self.unchecked = frozenset(unchecked)
        self.confirmed = confirmed
        self.passed_over = dict(passed_over)
        self.backends = {b.name: b for b in candidates}
        self.names = [SDPA] + [b.name for b in candidates]
        self.failed: Dict[str, str] = {}
        self.eliminated: List[str] = []  # measured slower than SDPA beyond the margin: no more turns
        self.samples: Dict[str, List[float]] = {name: [] for name in self.names}
        self._seen: Dict[str, int] = {name: 0 for name in self.names}
        self._on_decided = on_decided
        self._turn = 0
        self._steps = 0
        self.done = False

    def backend(self, name: str):
        return self.backends[name]

    def pick(self) -> Optional[str]:
        """The backend that runs (and times) this call; None: run SDPA untimed (decided, or too much pending)."""
        if self.done or len(self._pending) >= MAX_PENDING:
            return None
        active = [n for n in self.names if n not in self.failed and n not in self.eliminated]
        # The turn starts one backend later each step: no backend always gets the same blocks of the model.
        name = active[(self._turn + self._steps) % len(active)]
        self._turn += 1
        return name

    def fail(self, name: str, reason: str) -> None:
        """A candidate raised while measured: left out of the trial (and of the decision) with its reason."""
        self.failed[name] = reason

    def _eliminate_losers(self, active: List[str]) -> None:
        """Leave out the candidates whose ELIMINATE_AFTER or more timings already put them over 1 + MARGIN times
        SDPA's: the watch reverts a choice at that ratio, so no later sample could make one of them the choice."""
        sdpa = self.samples[SDPA]
        if len(sdpa) < ELIMINATE_AFTER:
            return
        limit = trimmed_mean(sdpa) * (1 + MARGIN)
        for name in active:
            mine = self.samples[name]
            if (name != SDPA and name not in self.eliminated and len(mine) >= ELIMINATE_AFTER
                    and trimmed_mean(mine) > limit):
                self.eliminated.append(name)

    def end_step(self) -> Optional[Decision]:
        """At a step boundary: read this step's timings; decide once each backend has SAMPLES of them."""
        timed = self._read()
        if self.done or (not timed and self._turn == 0):
            return None
        self._turn = 0
        self._steps += 1
        for name, ms in timed:
            self._seen[name] += 1
            if self._seen[name] > WARMUP_CALLS and name not in self.failed:
                self.samples[name].append(ms)
        if log.isEnabledFor(logging.DEBUG):  # the raw per-call times, in call order (docs/MEASUREMENTS.md)
            log.debug("auto trial (%s) step %d: %s", self.key.label(), self._steps,
                      "; ".join(f"{name} {ms:.4f}" for name, ms in timed))
        active = [n for n in self.names if n not in self.failed]
        self._eliminate_losers(active)
        running = [n for n in active if n not in self.eliminated]
        if len(running) > 1 and any(len(self.samples[n]) < SAMPLES for n in running):
            return None
        timings = {n: trimmed_mean(self.samples[n]) for n in active}
        decision = Decision(self.key, timings, dict(self.failed), dict(self.passed_over), method=IN_STEP,
                            samples={n: len(self.samples[n]) for n in active},
                            candidates=tuple(n for n in self.names if n != SDPA), confirmed=self.confirmed)
        self.done = True
        # An out-of-memory is this moment's, not the shape's: such a decision is not kept on disk.
        transient = any("OutOfMemoryError" in reason for reason in self.failed.values())
        self._on_decided(decision, not transient)
        return decision


class _AgainstSdpa(Measurement):
    """What a watch and a recheck share: one decision, one backend timed against SDPA in pairs of calls."""

    def __init__(self, decision: Decision, backend, device, events):
        super().__init__(device, events)
        self.decision = decision
        self.backend_name = backend.name
        self._backend = backend
        self.passed_over = dict(decision.passed_over)
        self.samples: Dict[str, List[float]] = {SDPA: [], backend.name: []}

    def backend(self, name: str):
        return self._backend


class Watch(_AgainstSdpa):
    """Keeps checking a quantized choice; reverts it through `on_revert(decision, keep)`."""

    SDPA_TURN = "auto: watching its choice (exact attention's turn, timed against it)"

    def __init__(self, decision: Decision, backend, device, events, on_revert):
        super().__init__(decision, backend, device, events)
        self.last_ratio: Optional[float] = None
        self._on_revert = on_revert
        self._steps = 0          # steps seen since the choice
        self._calls = 0          # calls of this kind in the current step
        self._calls_per_step = 0  # in the last step: spreads a watch step's timed calls over it
        self.done = False

    def fail(self, name: str, reason: str) -> None:
        """The choice raised on a watched call: that call falls back, as any call of it would (nothing to weigh)."""

    def watching(self) -> bool:
        return not self.done and self._steps % WATCH_EVERY == WATCH_EVERY - 1

    def pick(self) -> Optional[str]:
        """SDPA or the choice for a timed call of a watch step; None (the common case): the choice, untimed.

        The timed calls come in adjacent pairs (same kind of block), WATCH_CALLS pairs spread over the step, the
        pair's first call alternating between SDPA and the choice."""
        n = self._calls
        self._calls += 1
        if not self.watching():
            return None
        stride = max(2, self._calls_per_step // WATCH_CALLS)
        pair, offset = divmod(n, stride)
        if pair >= WATCH_CALLS or offset > 1:
            return None
        first_sdpa = (pair % 2 == 0) == (offset == 0)
        return SDPA if first_sdpa else self.backend_name

    def end_step(self) -> Optional[Decision]:
        if self._calls == 0:  # this kind of call did not run in that step
            self._read()
            return None
        self._steps += 1
        self._calls_per_step, self._calls = self._calls, 0
        for name, ms in self._read():
            kept = self.samples[name]
            kept.append(ms)
            del kept[:-WATCH_KEEP]
        sdpa, chosen = self.samples[SDPA], self.samples[self.backend_name]
        if self.done or len(sdpa) < WATCH_MIN or len(chosen) < WATCH_MIN:
            return None
        sdpa_ms, chosen_ms = trimmed_mean(sdpa), trimmed_mean(chosen)
        self.last_ratio = chosen_ms / sdpa_ms
        if self.last_ratio <= 1.0 + MARGIN:
            return None
        self.done = True
        old = self.decision
        reason = (f"reverted to SDPA: in later steps {self.backend_name} measured {self.last_ratio:.2f}x SDPA "
                  f"(over {len(chosen)} and {len(sdpa)} watched calls), slower than SDPA by more than "
                  f"{MARGIN:.0%}; it had measured {old.ratio(self.backend_name):.2f}x")
        decision = Decision(old.key, {SDPA: sdpa_ms, self.backend_name: chosen_ms}, dict(old.failed),
                            dict(old.passed_over), method=IN_STEP,
                            samples={SDPA: len(sdpa), self.backend_name: len(chosen)}, reverted=reason,
                            candidates=old.candidates, confirmed=True)
        self._on_revert(decision, True)
        return decision


class Recheck(_AgainstSdpa):
    """A decision timed again: one recalled from disk, in the first steps that run its kind of call, or an SDPA
    choice made in this process, in the steps after it. WATCH_CALLS adjacent pairs of SDPA and `backend` (the
    choice, or the best quantized candidate when SDPA was chosen) per step, timed as a watch times them, until
    WATCH_MIN of each. `on_result(agrees, ratio)` then says whether the decision holds: for a quantized choice,
    whether the ratio measured now is the stored one within MARGIN (relative); for SDPA, whether the best quantized
    candidate still misses the bar (QUANTIZED_MUST_BEAT), since reading it slower than stored says nothing against
    SDPA. Untimed calls take the route's default meanwhile.

    The first WARMUP_CALLS pairs are run but not kept, as in a trial: the check is often a backend's first call in
    this process, which loads its kernels and would read as many times slower than it is."""

    REMEMBERED_TURN = "auto: checking a remembered choice (exact attention's turn, timed against it)"
    LATER_TURN = "auto: checking its choice again in a later step (exact attention's turn, timed against it)"

    def __init__(self, decision: Decision, backend, device, events, on_result, unchecked: Sequence[str] = ()):
        super().__init__(decision, backend, device, events)
        self.SDPA_TURN = self.REMEMBERED_TURN if decision.source == "disk" else self.LATER_TURN
        self.unchecked = frozenset(unchecked) & {backend.name}
        self.stored_ratio = decision.ratio(backend.name)
        self.measured_ratio: Optional[float] = None
        self._failed: Optional[str] = None
        self._on_result = on_result
        self._calls = 0
        self._unkept = {SDPA: WARMUP_CALLS, self.backend_name: WARMUP_CALLS}  # timed calls still to drop, per side
        self.done = False

    def fail(self, name: str, reason: str) -> None:
        """The remembered backend raised while checked: that disagrees with any stored timing."""
        self._failed = reason

    def pick(self) -> Optional[str]:
        n = self._calls
        self._calls += 1
        pair, offset = divmod(n, 2)
        if self.done or pair >= WATCH_CALLS + max(self._unkept.values()):
            return None
        return SDPA if (pair % 2 == 0) == (offset == 0) else self.backend_name

    def end_step(self) -> Optional[bool]:
        calls, self._calls = self._calls, 0
        for name, ms in self._read():
            if self._unkept[name]:
                self._unkept[name] -= 1
            else:
                self.samples[name].append(ms)
        if self.done or (calls == 0 and self._failed is None):
            return None
        sdpa, mine = self.samples[SDPA], self.samples[self.backend_name]
        if self._failed is None and (len(sdpa) < WATCH_MIN or len(mine) < WATCH_MIN):
            return None
        agrees = False
        if self._failed is None:
            self.measured_ratio = trimmed_mean(mine) / trimmed_mean(sdpa)
            if self.decision.chosen == SDPA:
                agrees = self.measured_ratio > QUANTIZED_MUST_BEAT
            else:
                agrees = abs(self.measured_ratio / self.stored_ratio - 1.0) <= MARGIN
        self.done = True
        self._on_result(agrees, self.measured_ratio)
        return agrees
