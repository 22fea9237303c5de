"""Where one attention call goes: a pure query over the backends' rules, the recorded verdicts and auto's decisions.

`route(call, kernel, ...)` answers with one `Route`, and changes nothing. Where the answer needs something that
has not happened yet it says so, and the caller takes that step itself, then asks again:
  * VERIFY: these backends have not passed their first-use checks on this device and variant
    (`gating.first_use_checks` runs the probes and self-checks). Measuring in the step asks it only of the backends
    with hardware probes; the others are timed unchecked (`Route.unchecked`) and checked once a decision picks
    them, so a backend that loses to SDPA costs no self-check;
  * MEASURE without a measurement: auto has no decision for this kind of call (`Tuner.begin_in_step` or
    `Tuner.measure_alone` measures, or recalls a stored decision).
Otherwise the route is final: RUN a backend (with the watch kept on auto's choice, if any), EXACT attention by
choice (auto measured SDPA faster), MEASURE with this trial (in the step), or REFUSE, with the reason of every
candidate. The ComfyUI override keeps the final route per call signature; what it does with each kind is read off
the route as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

from . import registry  # its preference orders are read through the module (tests replace them)
from .call_spec import AttentionCall
from .decisions import IN_STEP, NOT_DECIDED, SDPA, Decision
from .registry import (
    PENDING,
    Backend,
    get_backend,
    named_reason,
    none_takes,
    quantized_candidates,
    readiness,
    readiness_in_order,
)
from .step_trials import Measurement

RUN, EXACT, REFUSE, MEASURE, VERIFY = "run", "exact", "refuse", "measure", "verify"


@dataclass(frozen=True)
class Route:
    """What happens to one call.

    `backend`: RUN's backend (an exact one where the caller takes exact backends and auto found nothing faster);
    REFUSE's named backend, if one was named; a MEASURE's yardstick (SDPA) when it asks for measuring. `reason`:
    why exact attention (EXACT, or RUN of an exact backend), or why the call cannot run (REFUSE). `kernel`: what
    was asked for, named when a refusal is raised.
    `passed_over`: the candidates not taken, and why each. `decision`: auto's measured decision, if one decided.
    `measurement`: MEASURE's trial, or the watch on auto's quantized choice (RUN). `candidates`: the backends a
    measuring step weighs; `unchecked`: those of them it times before their first-use checks (their turns answer
    with exact attention); `unverified`: the backends whose first-use checks must run first (VERIFY)."""
    kind: str
    backend: Optional[Backend] = None
    reason: Optional[str] = None
    kernel: str = "auto"
    passed_over: Mapping[str, str] = field(default_factory=dict)
    decision: Optional[Decision] = None
    measurement: Optional[Measurement] = None
    candidates: Tuple[Backend, ...] = ()
    unverified: Tuple[Backend, ...] = ()
    unchecked: Tuple[Backend, ...] = ()

    @property
    def final(self) -> bool:
        """No step is asked for: the caller can act on this route."""
        return self.kind != VERIFY and not (self.kind == MEASURE and self.measurement is None)

    @property
    def message(self) -> Optional[str]:
        """REFUSE's reason naming what was asked for once (as KernelRefused words it)."""
        return named_reason(self.kernel, self.reason) if self.reason else None

    @property
    def ran(self) -> Optional[str]:
        return self.backend.name if self.kind == RUN else None


def route(call: AttentionCall, kernel: str = "auto", *, quantized_only: bool = False, tuner=None,
          method: Optional[str] = None, attn_mask=None,
          checked: Optional[Mapping[str, Optional[str]]] = None) -> Route:
    """The route of `call` for `kernel` ('auto' or a backend name); see the module's docstring.

    `quantized_only` (the ComfyUI override, whose fallback is the call site's own attention): exact backends are
    no candidates, and exact attention is EXACT or REFUSE. `tuner` (kernels.tuner.Tuner) holds auto's decisions
    and measurements; `method` (dispatch.measuring_method) is how auto measures this call, None for the static order.
    `checked`: first-use results of this very call, from gating.first_use_checks. Each backend's answer is
    `registry.readiness`, the one rule the backend's own wrapper applies too."""
    checked = checked or {}

    # An explicit kernel runs as it is, or is refused with its reason: never answered by another one.
    if kernel != "auto":
        backend = get_backend(kernel)
        state = readiness(backend, call, checked)
        if state is PENDING:
            return Route(VERIFY, kernel=kernel, unverified=(backend,))
        if state is not None:
            return Route(REFUSE, backend, state, kernel=kernel)
        return Route(RUN, backend, kernel=kernel)

    decision = tuner.decision(method, call) if method is not None else None

    # auto, measured: the fastest backend of the decision that is ready for this very call; SDPA after those.
    if isinstance(decision, Decision):
        # Only a ranking with quantized backends in it loads them: an SDPA choice asks no candidate anything.
        by_name = {b.name: b for b in quantized_candidates(call)} if len(decision.ranking) > 1 else {}
        passed_over = {**decision.passed_over, **decision.failed}
        for name in decision.ranking[:-1]:  # the ranking ends with SDPA
            backend = by_name.get(name)
            if backend is None:  # measured once, no longer a candidate here (gone since, or another device)
                continue
            state = readiness(backend, call, checked)
            if state is PENDING:
                return Route(VERIFY, unverified=(backend,))
            if state is None:
                watch = tuner.measuring(call) if method == IN_STEP and name == decision.chosen else None
                return Route(RUN, backend, passed_over=passed_over, decision=decision, measurement=watch)
            passed_over[name] = state
        # A remembered SDPA choice being checked now (a quantized choice's watch is for the calls it serves).
        check = tuner.measuring(call) if method == IN_STEP and decision.chosen == SDPA else None
        if quantized_only:
            return Route(EXACT, None, decision.sdpa_reason(), passed_over=passed_over, decision=decision,
                         measurement=check)
        return Route(RUN, get_backend(SDPA), decision.sdpa_reason(), passed_over=passed_over, decision=decision)

    # auto, not decided yet: a trial under way, or a measurement to begin among the ready candidates.
    weighed = {}  # why each candidate auto would have measured refused the call: named if none takes it
    if decision is NOT_DECIDED:
        measurement = tuner.measuring(call) if method == IN_STEP else None
        if measurement is not None:  # the trial hands each call of this kind to a backend
            return Route(MEASURE, passed_over=measurement.passed_over, measurement=measurement)
        # Measured only with a yardstick (SDPA takes the call) and where timing breaks no capture or trace.
        yardstick = get_backend(SDPA)
        if tuner.may_measure_now(call, attn_mask) and readiness(yardstick, call, checked) is None:
            candidates = quantized_candidates(call)
            states = [(b, readiness(b, call, checked)) for b in candidates]
            pending = [b for b, state in states if state is PENDING]
            # In the step a candidate without hardware probes is timed first and checked only if it wins (its turns
            # answer with exact attention); any other is judged before it is measured.
            unchecked = tuple(b for b in pending if method == IN_STEP and b.timed_before_check())
            unverified = tuple(b for b in pending if b not in unchecked)
            if unverified:
                return Route(VERIFY, unverified=unverified)
            ready = tuple(b for b, state in states if state is None) + unchecked
            weighed = {b.name: state for b, state in states if state is not None and state is not PENDING}
            # A check that could not run (memory ran out) left no verdict: a decision made without that candidate
            # would leave it out for the rest of the process, so this call takes the static order instead.
            not_checked = any(checked.get(b.name) is not None and b.why_not(call) is None for b in candidates)
            if ready and not not_checked:
                return Route(MEASURE, yardstick, passed_over=weighed, candidates=ready, unchecked=unchecked)

    # The static order: the first backend in the device's preference that is ready.
    passed_over = {}
    for name, backend, state in readiness_in_order(registry.auto_order(call), call, checked, quantized_only):
        if state is PENDING:
            return Route(VERIFY, passed_over=passed_over, unverified=(backend,))
        if state is None:
            exact = None if backend.quantized else none_takes(call, {**weighed, **passed_over})
            return Route(RUN, backend, exact, passed_over=passed_over)
        passed_over[name] = state
    reason = none_takes(call, {**weighed, **passed_over})
    if quantized_only:
        return Route(REFUSE, None, reason, passed_over=passed_over)
    # SDPA is last everywhere; reaching here means even it refused (e.g. the LSE was asked for).
    reference = get_backend("reference")
    refusal = readiness(reference, call, checked)
    if refusal is None:
        return Route(RUN, reference, reason, passed_over=passed_over)
    return Route(REFUSE, reference, refusal, kernel=reference.name, passed_over=passed_over)
