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
import time
from typing import NamedTuple, Optional, Tuple

import torch

from ..kernels import first_use_costs, settings
from ..kernels.padding_masks import SeenMasks, padding_cut
from ..kernels.registry import Backend, KernelRefused
from ..kernels.routing import RUN
from ..kernels.step_trials import Measurement
from ..kernels.tuner import Tuner, default_tuner
from .call_plans import CallPlan, PlanCache, make_plan
from .compiled_call import TRACEABLE, traced_call
from .compiled_call import register as register_for_traces
from .config import PatchConfig
from .layouts import MALFORMED, bind_attention_args, from_hnd, hnd_inputs
from .policies import CallPolicies
from .stats import FELL_BACK, RAN, ROUTED, Outcome, PatchStats

log = logging.getLogger("sage_rdna4")

# How the stats count the calls of an A/B baseline run (every call goes where it went without this patch).
BASELINE_CALLS = "own attention"


class Turn(NamedTuple):
    """Who takes one call, as `SageAttentionOverride._turn` decides it. Without a `backend` the call site's own
    attention takes it, counted as `outcome`; with one, our kernel runs on the HND `inputs` (q, k, v, mask) as the
    `plan` says, and `outcome` is what the stats count if it succeeds. `trial`: auto's trial or watch that times
    this call with device events. `kernel`: what a raised refusal names (config on_unsupported="raise"). `cut`: what
    the call's padding mask let the kernel leave out (kernels/padding_masks.py), counted if the kernel runs.
    `unchecked`: the backend is only timed (it has not passed its self-check yet); the call site's attention then
    answers the call, as `outcome` says."""
    outcome: Outcome
    backend: Optional[Backend] = None
    plan: Optional[CallPlan] = None
    inputs: Tuple = ()
    skip_output_reshape: bool = False
    trial: Optional[Measurement] = None
    kernel: str = ""
    cut: str = ""
    unchecked: bool = False


BASELINE_TURN = Turn(Outcome(RAN, BASELINE_CALLS))


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
        # Prompt-padding masks met in this model evaluation (read on their second call, forgotten at its end).
        self.seen_masks = SeenMasks() if settings.padding_cut_enabled() else None

    def __deepcopy__(self, memo):
        # ModelPatcher.clone() deep-copies model_options; a clone of a patched model is the same patch.
        return self

    @property
    def tuner(self) -> Tuner:
        return self._tuner or default_tuner()

    def step_boundary(self) -> None:
        """The end of a model evaluation (sage_patch/timing.py): `auto`'s trials and watches read the step's
        device events now, and may decide (which remakes the plans on their next call). The masks met in the step
        are forgotten: a mask met later is read again."""
        if self.seen_masks is not None:
            self.seen_masks.forget()
        for trial in self.plans.trials():
            try:
                trial.end_step()
            except Exception as exc:  # measuring must never take the sampling run down
                log.warning("[sage_rdna4] auto's in-step measurement failed: %s: %s", type(exc).__name__, exc)

    def __call__(self, func, *args, **kwargs):
        """Who takes this call (`_turn`), that call, and its outcome counted once (`PatchStats.record`)."""
        if TRACEABLE and torch.compiler.is_compiling():  # inside a torch.compile trace: one opaque op
            return traced_call(self.op_id, func, args, kwargs, self.policies.uses_steps)
        turn = self._turn(args, kwargs)
        outcome, backend, plan, inputs, skip_output_reshape, trial, kernel, cut, unchecked = turn
        timer, out = self.attention_timer, None
        if backend is not None:  # our kernel: the plan holds its answer, so it launches without asking again
            q, k, v, mask = inputs
            scale = kwargs.get("scale")
            sm_scale = float(scale) if scale is not None else plan.default_scale
            start = trial.begin() if trial is not None else None  # a trial's (or watch's) call, between events
            # A kernel's first call while auto measures compiles or loads it: reported as a first-use cost.
            first = time.perf_counter() if trial is not None and trial.first_launch(backend.name) else None
            try:
                if timer is None:
                    out = backend.launch(q, k, v, plan.call, sm_scale, mask)[0]
                else:
                    with timer.measure():
                        out = backend.launch(q, k, v, plan.call, sm_scale, mask)[0]
                out = from_hnd(out, skip_output_reshape)
            except torch.cuda.OutOfMemoryError:
                raise  # the call site's attention would run out of memory too; let ComfyUI handle it
            except Exception as exc:  # a kernel failure must not take the ComfyUI process down
                reason = (f"{backend.name}: {exc.reason}" if isinstance(exc, KernelRefused)
                          else f"{backend.name} failed: {type(exc).__name__}: {exc}")
                if trial is not None:  # left out of the trial; this call gets the call site's answer
                    trial.fail(backend.name, reason)
                outcome, out = Outcome(FELL_BACK, reason, outcome.passed_over, backend.name, outcome.choice), None
            else:
                if trial is not None:
                    trial.record(backend.name, start)
                if unchecked:  # timed only: its answer is not used before its self-check has passed
                    out = None
                elif cut:
                    self.stats.record_cut(cut)
            if first is not None:  # a launch alone takes well under REPORTED_S: more compiled or loaded kernels
                first_use_costs.record_if_slow(f"first call of {backend.name} while auto measures "
                                               f"({plan.call.short()})", time.perf_counter() - first)
        # (an unchecked candidate's failure only leaves it out: exact attention was to answer that call anyway)
        if out is None and outcome.kind == FELL_BACK and self.config.on_unsupported == "raise" and not unchecked:
            raise KernelRefused(backend.name if backend is not None else kernel, outcome.label)
        self.stats.record(outcome)  # counted before a call site's attention that may raise
        if out is not None:
            return out
        # The call site's own attention: what the call runs without this patch (the previous override, or func).
        timed = trial is not None and not unchecked  # exact attention's turn in auto's trial or watch
        start = trial.begin() if timed else None
        if turn is BASELINE_TURN and timer is not None:  # the A/B baseline is timed as a kernel call is
            with timer.measure():
                out = self.previous(func, *args, **kwargs) if self.previous is not None else func(*args, **kwargs)
        else:
            out = self.previous(func, *args, **kwargs) if self.previous is not None else func(*args, **kwargs)
        if start is not None:
            trial.record(outcome.ran, start)
        return out

    def _turn(self, args, kwargs) -> Turn:
        """Who takes this (eager) call: the call site's attention (the A/B baseline; a call unreadable, refused, or
        kept exact on purpose), or our kernel as the plan of its signature says (`auto`'s trial or watch may hand it
        to another candidate, or to SDPA)."""
        if self.baseline:
            return BASELINE_TURN
        kernel = self.config.kernel
        try:
            bound = bind_attention_args(args, kwargs)
        except TypeError as exc:
            return Turn(Outcome(FELL_BACK, f"unrecognised attention call: {exc}"), kernel=kernel)
        if kwargs.get("low_precision_attention", True) is False:
            return Turn(Outcome(ROUTED, "low_precision_attention=False"))
        cut, keys_as_sent = "", None
        if bound.mask is not None and self.seen_masks is not None:
            # A prompt's padding mask: our kernel gets the same attention over the kept keys (padding_masks.py); the
            # call site's own attention still gets the call as it came.
            token_dim = 2 if bound.skip_reshape else 1
            try:
                k, v, mask, kept = padding_cut(self.seen_masks, bound.k, bound.v, bound.mask, token_dim)
            except MALFORMED:  # a call we cannot read is judged, and reported, as it came
                kept = None
            if kept is not None:
                keys_as_sent = bound.k.shape[token_dim]
                cut = (f"padding mask: keys {keys_as_sent} -> {k.shape[token_dim]}, "
                       f"{'mask dropped' if mask is None else 'mask kept'}")
                bound = bound._replace(k=k, v=v, mask=mask)
        # A call whose signature was seen before reuses that call's plan (call_plans.py); only what the plan
        # cannot know (policies, scale, enable_gqa) is judged again below.
        key = bound.signature()
        plan = self.plans.get(key)
        try:
            q, k, v, mask, view_shapes, strided = hnd_inputs(bound, plan)
        except MALFORMED as exc:
            # A call we cannot read (heads not dividing the width, a batch of 0, not tensors) is handed to the
            # call site unchanged: it is ComfyUI's to accept or reject, never ours to crash on.
            return Turn(Outcome(FELL_BACK, f"malformed call: {type(exc).__name__}: {exc}"), kernel=kernel)
        call = plan.call if plan is not None else None  # the shapes the plan was made for (shape reads cost time)
        q_heads, kv_heads = (call.q_heads, call.kv_heads) if call is not None else (q.shape[1], k.shape[1])
        if kv_heads != q_heads and not kwargs.get("enable_gqa", False):
            # ComfyUI only groups heads when the call says so; anything else is the call site's to judge.
            return Turn(Outcome(FELL_BACK, f"malformed call: k/v have {kv_heads} heads, q {q_heads}, without "
                                "enable_gqa"), kernel=kernel)
        if self.policies.active:  # no policy configured: nothing to ask per call
            q_len, kv_len = (call.q_len, call.kv_len) if call is not None else (q.shape[2], k.shape[2])
            kv_len = keys_as_sent or kv_len  # the policies judge the call as it came (a cut is no cross attention)
            policy, inactive = self.policies.route_exact(kwargs.get("transformer_options"), q_len, kv_len)
            if inactive:
                self.stats.note(inactive)
            if policy:
                return Turn(Outcome(ROUTED, policy))
        choice = None
        if plan is None:  # a signature not seen before (or a stale plan): one planner decides, the cache keeps it
            plan = make_plan(q, k, v, mask, view_shapes, strided, kwargs.get("scale"), self.config, self.tuner,
                             out_nhd=not bound.skip_output_reshape)
            if isinstance(plan, str):
                return Turn(Outcome(FELL_BACK, plan), kernel=kernel)
            self.plans.store(key, plan)
            choice = plan.route.decision  # new, or changed (a watch reverted it): the stats show and log it
        route, outcome = plan.route, plan.outcome
        if choice is not None:
            outcome = outcome._replace(choice=choice)
        inputs, reshape = (q, k, v, mask), bound.skip_output_reshape
        trial = route.measurement  # auto measuring this kind of call in the step, or watching its choice
        name = trial.pick() if trial is not None else None
        if name is not None:
            if name == "sdpa":  # SDPA's turn is the call site's own attention, as when SDPA is chosen
                return Turn(Outcome(ROUTED, trial.SDPA_TURN, route.passed_over, name, choice), trial=trial)
            if name in trial.unchecked:  # timed before its self-check: the call site's attention answers
                return Turn(Outcome(ROUTED, trial.UNCHECKED_TURN, route.passed_over, name, choice),
                            trial.backend(name), plan, inputs, reshape, trial, unchecked=True)
            return Turn(Outcome(RAN, name, route.passed_over, None, choice), trial.backend(name), plan, inputs,
                        reshape, trial, cut=cut)
        if route.kind == RUN:
            return Turn(outcome, route.backend, plan, inputs, reshape, cut=cut)
        # Exact attention by auto's choice, or its untimed turn while it measures; a refusal names what was asked.
        return Turn(outcome, kernel=route.kernel)
