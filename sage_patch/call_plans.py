"""What the override decides once per call signature, and keeps for the next calls with that signature.

A Flux step makes ~57 attention calls of a handful of signatures; describing each call and asking every
backend's rule again (arch, availability, shape limits, the self-check verdict) cost more host time than
some of those calls take on the GPU. A signature (`layouts.AttentionArgs.signature`) is everything those
decisions read; the patch's config is fixed per cache. A plan keeps the final `routing.Route` of its calls and is
trusted only while `registry.decision_generation()` is the one it was made under, so a backend that its
self-check (or anything else) disables is never served from here.

What depends on the call itself and not on its signature (transformer_options: step, block_index;
`scale`, `enable_gqa`, `low_precision_attention`) is not in a plan: the override reads it on every call.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, Optional, Union

from ..kernels.call_spec import AttentionCall, describe_call
from ..kernels.dispatch import settled_route
from ..kernels.quant import default_sm_scale
from ..kernels.registry import decision_generation
from ..kernels.routing import EXACT, MEASURE, RUN, Route
from .config import PatchConfig
from .stats import FELL_BACK, RAN, ROUTED, Outcome

MAX_PLANS = 256  # distinct signatures kept per patch; a long session of changing sizes evicts the oldest


@dataclass(frozen=True)
class CallPlan:
    view_shapes: Optional[tuple]      # layouts.head_split_shapes, None when the call came HND (skip_reshape)
    call: AttentionCall
    route: Route                      # where these calls go (final: no step left to take)
    default_scale: float              # 1/sqrt(head_dim), for calls without `scale`
    generation: int                   # registry.decision_generation() before the route was asked for
    strided: Optional[tuple] = None   # layouts.strided_layout of the HND views, None: take view_shapes' path

    @cached_property
    def outcome(self) -> Outcome:
        """What the stats count for a call that goes as the route says, no trial's turn taken: RUN's backend, exact
        attention by auto's choice (EXACT) or while it measures (MEASURE's untimed calls), or REFUSE's reason."""
        route = self.route
        if route.kind == RUN:
            return Outcome(RAN, route.backend.name, route.passed_over)
        if route.kind == EXACT:
            return Outcome(ROUTED, route.reason, route.passed_over)
        if route.kind == MEASURE:
            return Outcome(ROUTED, route.measurement.SDPA_TURN, route.passed_over)
        return Outcome(FELL_BACK, route.message, route.passed_over)


def make_plan(q, k, v, mask, view_shapes: Optional[tuple], strided: Optional[tuple], scale, config: PatchConfig,
              tuner, out_nhd: bool = False) -> Union[CallPlan, str]:
    """The plan of a call whose signature has none yet (its HND q, k, v, broadcast mask and their layout, as
    layouts.hnd_inputs gives them): the call described, and its final route (dispatch.settled_route, which takes
    the first-use checks and auto's measuring it asks for). `out_nhd`: the call site wants (B, N, H * D) back. A str
    is the reason the call is malformed."""
    try:
        call = describe_call(q, k, v, attn_mask=mask, smooth_k=config.smooth_k, prologue=config.prologue,
                             qk_group=config.qk_group, smooth_v=config.smooth_v, out_nhd=out_nhd)
    except ValueError as exc:
        return f"malformed call: {exc}"
    generation = decision_generation()  # read before deciding: a change meanwhile leaves the plan stale
    default_scale = default_sm_scale(call.head_dim)
    # With the tensors, `auto` on a GPU measures this kind of call on its own calls in the step (the route's trial),
    # then runs what measured fastest. Not for an autograd call: nothing quantized takes it, and that empty decision
    # would stick to its kind of call.
    route = settled_route(call, config.kernel, quantized_only=True, tuner=tuner,
                          tensors=None if call.requires_grad else (q, k, v),
                          sm_scale=float(scale) if scale is not None else default_scale, attn_mask=mask, in_step=True)
    return CallPlan(view_shapes, call, route, default_scale, generation, strided)


class PlanCache:
    """Plans by signature, for one patch (one config). Lookups take no lock (a dict read is atomic); stores do."""

    def __init__(self, max_entries: int = MAX_PLANS):
        self.max_entries = max_entries
        self._plans: Dict[tuple, CallPlan] = {}
        self._lock = threading.Lock()

    def get(self, key: Optional[tuple]) -> Optional[CallPlan]:
        if key is None:
            return None
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable `heads`: nothing to cache
            return None
        if plan is None or plan.generation != decision_generation():
            return None
        return plan

    def store(self, key: Optional[tuple], plan: CallPlan) -> None:
        if key is None:
            return
        with self._lock:
            try:
                self._plans.pop(key, None)  # a replaced (stale) plan counts as new: evicted last
                self._plans[key] = plan
            except TypeError:
                return
            while len(self._plans) > self.max_entries:
                del self._plans[next(iter(self._plans))]

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def trials(self) -> list:
        """The distinct trials and watches of the plans kept (stale ones too: a finished trial ignores a boundary)."""
        with self._lock:
            found = {id(p.route.measurement): p.route.measurement for p in self._plans.values()
                     if p.route.measurement is not None}
        return list(found.values())

    def __len__(self) -> int:
        return len(self._plans)
