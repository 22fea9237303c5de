"""The callable ComfyUI calls as `transformer_options["optimized_attention_override"]`.

ComfyUI's `wrap_attn` calls `override(func, *args, **kwargs)` where `func` is the attention the
call site resolved (SDPA, sage, ...) and args/kwargs follow
`f(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)`.
Every call either runs the configured kernel or is passed on (to `func`, or to the override that was on
the model before) with the reason counted.

What newer ComfyUI versions add, read from their source (2026, up to 0.38):
  * q/k/v wrapped in `AttentionTensorContainer` by Flux, Wan and others: wrap_attn unwraps them
    before calling an override that has no `container_function` attribute, so this class must never
    grow one (it would be handed the containers, without `func`);
  * `enable_gqa=True` with k/v carrying fewer heads than q, in both layouts (`layouts.to_hnd`);
  * `scale`, `low_precision_attention=False` (Wan's image cross attention), `preferred_attention`
    (popped by wrap_attn; passed on untouched if a version leaves it in), and any other keyword:
    all reach `func` unchanged when the call is not ours;
  * `block_index`, `total_blocks` and `block_type` in transformer_options (Flux, Wan: `policies.py`);
  * the core "Model Attention Backend" node writes the same transformer_options key through
    `ModelPatcher.set_model_optimized_attention`. Patched after it, this override passes the calls it
    does not take to that node's choice (`previous`); patched before it, it is replaced by it.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from ..kernels.registry import KernelRefused
from ..kernels.routing import EXACT, MEASURE, RUN
from ..kernels.tuner import Tuner, default_tuner
from .call_plans import CallPlan, PlanCache, call_signature, make_plan
from .compiled_call import TRACEABLE, traced_call
from .compiled_call import register as register_for_traces
from .config import PatchConfig
from .layouts import MALFORMED, from_hnd, hnd_inputs
from .policies import CallPolicies
from .stats import PatchStats

log = logging.getLogger("sage_rdna4")
_POSITIONAL = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")
_DEFAULTS = {"mask": None, "attn_precision": None, "skip_reshape": False, "skip_output_reshape": False}
_REQUIRED = ("q", "k", "v", "heads")


def bind_attention_args(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Name ComfyUI's attention arguments whether they came by position or keyword."""
    if len(args) == 4:  # ComfyUI's own calls: q, k, v, heads by position, the rest by keyword (the hit path)
        q, k, v, heads = args
        get = kwargs.get
        return {"q": q, "k": k, "v": v, "heads": heads, "mask": get("mask"), "attn_precision": get("attn_precision"),
                "skip_reshape": get("skip_reshape", False), "skip_output_reshape": get("skip_output_reshape", False)}
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"attention called with {len(args)} positional arguments")
    bound = dict(_DEFAULTS)
    bound.update(zip(_POSITIONAL, args))
    for name in _POSITIONAL[len(args):]:
        if name in kwargs:
            bound[name] = kwargs[name]
    if len(args) < len(_REQUIRED):
        missing = [n for n in _REQUIRED if n not in bound]
        if missing:
            raise TypeError(f"attention called without {', '.join(missing)}")
    return bound


# How the stats count the calls of an A/B baseline run (every call goes where it went without this patch).
BASELINE_CALLS = "own attention"


class SageAttentionOverride:
    def __init__(self, config: PatchConfig, stats: Optional[PatchStats] = None, previous=None,
                 baseline: bool = False, tuner: Optional[Tuner] = None):
        """`previous`: the override that was on the model before this patch (the "Model Attention
        Backend" node's, another pack's), called as `previous(func, *args, **kwargs)` for every call this
        patch does not run, so those calls do what they did before the patch. `baseline`: run every call as
        without this patch, timed like a kernel call (the A/B benchmark's run A). `tuner`: auto's measuring
        (default: the process's one, kernels.tuner.default_tuner)."""
        self.config = config
        self._tuner = tuner
        self.op_id = register_for_traces(self)  # how a torch.compile graph names this patch (compiled_call.py)
        self.baseline = baseline
        self.stats = stats or PatchStats()
        self.policies = CallPolicies(config)
        self.previous = previous
        self.attention_timer = None  # set by the step timer when attention time is measured
        self.plans = PlanCache()  # per call signature: the described call and the backend decision

    def __deepcopy__(self, memo):
        # ModelPatcher.clone() deep-copies model_options; a clone of a patched model is the same patch.
        return self

    def _pass_on(self, func, args, kwargs):
        """What the call would have run without this patch: the previous override, or the call site's own."""
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _fallback(self, func, args, kwargs, reason: str, kernel: str, passed_over=None, ran=None):
        """The call site's answer for a call this patch cannot run (config on_unsupported="raise": KernelRefused);
        `passed_over` and `ran`: what auto passed over, and took, before the call fell back (stats.py)."""
        if self.config.on_unsupported == "raise":
            raise KernelRefused(kernel, reason)
        self.stats.record_fallback(reason, passed_over, ran)
        return self._pass_on(func, args, kwargs)

    @property
    def tuner(self) -> Tuner:
        return self._tuner or default_tuner()

    def _plan_call(self, key, q, k, v, mask, view_shapes, scale):
        """The plan of a call not seen before (call_plans.make_plan), stored for its signature; a str is the reason
        the call is malformed."""
        plan = make_plan(q, k, v, mask, view_shapes, scale, self.config, self.tuner)
        if isinstance(plan, str):
            return plan
        self.plans.store(key, plan)
        if plan.route.decision is not None:  # new, or changed (a watch reverted it): the stats show and log it
            self.stats.record_choice(plan.route.decision)
        return plan

    def _launch(self, backend, plan: CallPlan, q, k, v, mask, kwargs, skip_output_reshape):
        """The backend's output for this call in the call site's layout, inside the attention timer when one is on."""
        scale = kwargs.get("scale")
        sm_scale = float(scale) if scale is not None else plan.default_scale
        timer = self.attention_timer
        if timer is None:
            out = backend.launch(q, k, v, plan.call, sm_scale, mask)[0]
        else:
            with timer.measure():
                out = backend.launch(q, k, v, plan.call, sm_scale, mask)[0]
        return from_hnd(out, skip_output_reshape)

    def _measured_call(self, plan: CallPlan, name: str, func, args, kwargs, q, k, v, mask, skip_output_reshape):
        """One call `auto`'s trial (or watch) handed to `name`, bracketed by its device events. SDPA's turn is the
        call site's own attention, as when SDPA is chosen; a candidate's turn runs as a RUN route's call does,
        output reshape included."""
        trial = plan.route.measurement
        if name != "sdpa":
            return self._run(trial.backend(name), plan, func, args, kwargs, q, k, v, mask, skip_output_reshape, trial)
        start = trial.begin()
        out = self._pass_on(func, args, kwargs)
        trial.record(name, start)
        self.stats.record_routed(trial.SDPA_TURN, plan.route.passed_over, name)
        return out

    def step_boundary(self) -> None:
        """The end of a model evaluation (sage_patch/timing.py): `auto`'s trials and watches read the step's
        device events now, and may decide (which remakes the plans on their next call)."""
        for trial in self.plans.trials():
            try:
                trial.end_step()
            except Exception as exc:  # measuring must never take the sampling run down
                log.warning("[sage_rdna4] auto's in-step measurement failed: %s: %s", type(exc).__name__, exc)

    def _baseline_call(self, func, args, kwargs):
        """The A/B baseline's call: what the model runs without this patch, inside the attention timer."""
        self.stats.record_call(BASELINE_CALLS)
        timer = self.attention_timer
        if timer is None:
            return self._pass_on(func, args, kwargs)
        with timer.measure():
            return self._pass_on(func, args, kwargs)

    def __call__(self, func, *args, **kwargs):
        if TRACEABLE and torch.compiler.is_compiling():  # inside a torch.compile trace: one opaque op
            return self._traced(func, args, kwargs)
        if self.baseline:
            return self._baseline_call(func, args, kwargs)
        try:
            a = bind_attention_args(args, kwargs)
        except TypeError as exc:
            return self._fallback(func, args, kwargs, f"unrecognised attention call: {exc}", self.config.kernel)
        if kwargs.get("low_precision_attention", True) is False:
            self.stats.record_routed("low_precision_attention=False")
            return self._pass_on(func, args, kwargs)
        # A call whose signature was seen before reuses that call's plan (call_plans.py); only what the plan
        # cannot know (policies, scale, enable_gqa) is judged again below.
        key = call_signature(a)
        plan = self.plans.get(key)
        try:
            q, k, v, mask, view_shapes = hnd_inputs(a, plan)
        except MALFORMED as exc:
            # A call we cannot read (heads not dividing the width, a batch of 0, not tensors) is handed to the
            # call site unchanged: it is ComfyUI's to accept or reject, never ours to crash on.
            return self._fallback(func, args, kwargs, f"malformed call: {type(exc).__name__}: {exc}",
                                  self.config.kernel)
        call = plan.call if plan is not None else None  # the shapes the plan was made for (shape reads cost time)
        q_heads, kv_heads = (call.q_heads, call.kv_heads) if call is not None else (q.shape[1], k.shape[1])
        if kv_heads != q_heads and not kwargs.get("enable_gqa", False):
            # ComfyUI only groups heads when the call says so; anything else is the call site's to judge.
            return self._fallback(func, args, kwargs, f"malformed call: k/v have {kv_heads} heads, q {q_heads}, "
                                  "without enable_gqa", self.config.kernel)
        if self.policies.active:  # no policy configured: nothing to ask per call
            q_len, kv_len = (call.q_len, call.kv_len) if call is not None else (q.shape[2], k.shape[2])
            policy, inactive = self.policies.route_exact(kwargs.get("transformer_options"), q_len, kv_len)
            if inactive:
                self.stats.note(inactive)
            if policy:
                self.stats.record_routed(policy)
                return self._pass_on(func, args, kwargs)
        if plan is None:
            plan = self._plan_call(key, q, k, v, mask, view_shapes, kwargs.get("scale"))
            if isinstance(plan, str):
                return self._fallback(func, args, kwargs, plan, self.config.kernel)
        return self._follow(plan, func, args, kwargs, q, k, v, mask, a["skip_output_reshape"])

    def _traced(self, func, args, kwargs):
        """What a torch.compile trace records for this call: `sage_rdna4::attention`, whose body at run time is this
        override; or, for a call the op cannot carry, the call site's own attention (sage_patch/compiled_call.py)."""
        try:
            bound = bind_attention_args(args, kwargs)
        except TypeError:
            return func(*args, **kwargs)
        out = traced_call(self.op_id, func, args, kwargs, bound, self.policies.uses_steps)
        return out if out is not None else func(*args, **kwargs)

    def _follow(self, plan: CallPlan, func, args, kwargs, q, k, v, mask, skip_output_reshape):
        """Run one call the way its plan's route says; each outcome is counted once, with the backends auto passed
        over to reach it (not available, refused, failed its self-check)."""
        route = plan.route
        if route.measurement is not None:  # auto measuring this kind of call in the step, or watching its choice
            name = route.measurement.pick()
            if name is not None:
                return self._measured_call(plan, name, func, args, kwargs, q, k, v, mask, skip_output_reshape)
        if route.kind == RUN:
            return self._run(route.backend, plan, func, args, kwargs, q, k, v, mask, skip_output_reshape)
        if route.kind != EXACT and route.kind != MEASURE:
            return self._fallback(func, args, kwargs, route.message, route.kernel, route.passed_over)
        # Exact attention by auto's choice, or its untimed turn while it measures.
        self.stats.record_routed(route.reason if route.kind == EXACT else route.measurement.SDPA_TURN,
                                 route.passed_over)
        return self._pass_on(func, args, kwargs)

    def _run(self, backend, plan: CallPlan, func, args, kwargs, q, k, v, mask, skip_output_reshape, trial=None):
        """A call `backend` runs: the plan holds its answer, made under the current decision generation, so it
        launches directly (calling the backend would ask again). `trial`: the measurement that handed it this call,
        which times it with device events, or leaves the backend out when it fails."""
        passed_over = plan.route.passed_over
        start = trial.begin() if trial is not None else None
        try:
            out = self._launch(backend, plan, q, k, v, mask, kwargs, skip_output_reshape)
        except torch.cuda.OutOfMemoryError:
            raise  # the call site's attention would run out of memory too; let ComfyUI handle it
        except Exception as exc:  # a kernel failure must not take the ComfyUI process down
            reason = (f"{backend.name}: {exc.reason}" if isinstance(exc, KernelRefused)
                      else f"{backend.name} failed: {type(exc).__name__}: {exc}")
            if trial is not None:  # left out of the trial; this call gets the call site's answer
                trial.fail(backend.name, reason)
            return self._fallback(func, args, kwargs, reason, backend.name, passed_over, backend.name)
        if trial is not None:
            trial.record(backend.name, start)
        self.stats.record_call(backend.name, passed_over)
        return out
