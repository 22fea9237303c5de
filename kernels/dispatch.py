"""A call's final route: `routing.route`, after the explicit steps it asks for.

Used by the public API, the benchmark, the field report and the ComfyUI override alike, so each takes the same
steps in the same order: the first-use checks of the backends the route would take (`gating.first_use_checks`:
probes and self-checks), then auto's measuring of a kind of call it has no decision for (`Tuner.begin_in_step`
inside a sampling step, `Tuner.measure_alone` elsewhere). Each step leaves a verdict or a decision behind, so
the route is asked again until it needs none.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

from . import first_use_costs
from .call_spec import AttentionCall
from .decisions import ALONE, IN_STEP
from .gating import first_use_checks
from .quant import default_sm_scale
from .registry import BACKEND_NAMES
from .routing import MEASURE, VERIFY, Route, route
from .tuner import Tuner, default_tuner

# Each VERIFY round records at least one new verdict and a measuring step always leaves a decision or a
# measurement behind: more rounds than this would be a bug, which is reported rather than looped on.
MAX_ROUNDS = len(BACKEND_NAMES) + 3


def measuring_method(tuner: Tuner, call: AttentionCall, tensors, in_step: bool) -> Optional[str]:
    """How `auto` measures this call: IN_STEP, ALONE, or None (the static order: no tensors, measuring off, the
    CPU unless the tuner runs its GPU logic there)."""
    if not tuner.enabled or tensors is None:
        return None
    if call.device_type != "cuda" and tuner.require_cuda:
        return None
    return IN_STEP if in_step else ALONE


def settled_route(call: AttentionCall, kernel: str = "auto", *, quantized_only: bool = False,
                  tuner: Optional[Tuner] = None, tensors=None, sm_scale: Optional[float] = None, attn_mask=None,
                  in_step: bool = False) -> Route:
    """The final route of `call` (routing.route's arguments; `tensors`: q, k, v in HND, which auto measures on a
    GPU; `in_step`: measure on the model's own calls inside the sampling step, the ComfyUI override's way)."""
    tuner = tuner or default_tuner()
    method = measuring_method(tuner, call, tensors, in_step) if kernel == "auto" else None
    if method == IN_STEP and tuner.may_measure_now(call, attn_mask):
        tuner.recall_settled(call, tensors[0].device)  # a remembered choice, before its candidates are asked
    checked: Dict[str, Optional[str]] = {}
    for _ in range(MAX_ROUNDS):
        found = route(call, kernel, quantized_only=quantized_only, tuner=tuner, method=method, attn_mask=attn_mask,
                      checked=checked)
        if found.kind == VERIFY:  # gating: the first-use checks of the backends this route would take
            checked.update(first_use_checks(found.unverified, call))
        elif found.kind == MEASURE and found.measurement is None:  # measuring: auto's decision for this kind
            if method == IN_STEP:
                if tuner.begin_in_step(found, call, tensors[0].device):
                    compile_side_by_side(found.candidates, call, tensors, sm_scale, attn_mask)
            else:
                tuner.measure_alone(found, call, tensors, sm_scale, attn_mask)
            # just found ready for this very call (an unchecked one is not: a decision naming it asks VERIFY)
            checked.update({b.name: None for b in found.candidates if b not in found.unchecked})
        else:
            return found
    raise RuntimeError(f"the route of {call.short()} did not settle in {MAX_ROUNDS} rounds")


def compile_side_by_side(candidates: Sequence, call: AttentionCall, tensors, sm_scale: Optional[float],
                         attn_mask) -> None:
    """Before a trial's first turn: the kernels its candidates with a `warm_up` (the Triton backends) will launch
    for this call, collected and compiled at once on a pool of threads. Each would otherwise compile its own at its
    first turn, one after another (12.8 s of Wan 14B's first step on an H100). No kernel runs here (its launches
    are only collected), a failure only leaves the compiles to the turns, and the time is a first-use part."""
    compiling = [b for b in candidates if callable(getattr(b, "warm_up", None))]
    if not compiling:
        return
    q, k, v = tensors
    scale = sm_scale if sm_scale is not None else default_sm_scale(q.shape[-1])

    def launch_each():
        for backend in compiling:
            try:
                backend.launch(q, k, v, call, scale, attn_mask)
            except Exception:  # noqa: BLE001  (its turn launches it for real and reports what went wrong)
                continue

    started = time.perf_counter()
    compiling[0].warm_up(launch_each)  # collects every Triton launch made in this thread, whichever backend's
    first_use_costs.record_if_slow(f"compiling the kernels of {', '.join(b.name for b in compiling)} side by side "
                                   f"while auto measures ({call.short()})", time.perf_counter() - started)
