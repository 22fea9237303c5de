"""The backend registry: one acceptance rule per backend, used by `auto` and by the backend itself.

A backend answers, each with a reason string or None:
  * `unavailable(device_type, index)`: can it run on this device at all (import, driver, arch)?
  * `refuse(call)`: can it take this particular call (dtype, head_dim, mask, ...)?
  * `why_not(call)`: both, plus a first-use verification already recorded as failed. A pure query.
  * `ready(call)`: `why_not`, then the first-use verification (`verify`) where it has not run yet: the one
    step that runs a kernel's self-check. `choose_backend` and `backend(q, k, v, call, ...)` ask it, so a
    forced kernel can never be answered by another one, nor serve a call unverified.

`choose_backend` returns a `Selection`: the backend, the backends passed over and why, and whether (and why)
exact attention was chosen instead. Callers that keep selections per call signature (the ComfyUI override)
trust them only while `decision_generation()` is unchanged: a backend disabled by its verification bumps it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

import torch

from .call_spec import AUTOGRAD_REFUSAL, AttentionCall

# Stable names, in the order the node lists them.
BACKEND_NAMES = (
    "hip_int8_fp8",
    "hip_int8_fp16",
    "triton_int8_fp8",
    "triton_int8_fp16",
    "comfy_kitchen",
    "sageattention",
    "sdpa",
    "reference",
)


_generation = 0
_generation_lock = threading.Lock()


def decision_generation() -> int:
    """A number that changes whenever a decision made earlier may no longer hold: a backend disabled (by its
    self-check or by hand) or a failed self-check verdict recorded. A cache of decisions compares it to the one
    it read before deciding. (Replacing `_REGISTRY` entries or `_disabled` directly, as tests do, bumps nothing:
    call `invalidate_decisions` after such a change.)"""
    return _generation


def invalidate_decisions() -> None:
    """Tell every cache of backend decisions that its entries are stale (see `decision_generation`)."""
    global _generation
    with _generation_lock:  # two bumps at once must not collapse into one
        _generation += 1


class KernelRefused(RuntimeError):
    """An explicitly requested backend cannot take this call; `reason` says why.

    The message names the backend once, also when the reason already starts with its name."""

    def __init__(self, backend: str, reason: str):
        named = reason.startswith(f"{backend}:") or reason.startswith(f"{backend} ")
        super().__init__(reason if named else f"{backend}: {reason}")
        self.backend = backend
        self.reason = reason


class Backend:
    """Base class. Subclasses set `name`, `description`, and implement `_unavailable`, `refuse`, `launch`.

    A backend built with a `selfcheck` (kernels.self_check.SelfCheck) proves itself on first use of each device
    and variant (`verify`) wherever `needs_verification(call)` says so; `own_prologue` is the prologue its
    `prologue="auto"` means."""

    name: str = ""
    description: str = ""
    quantized: bool = True
    own_prologue: str = ""

    def __init__(self, selfcheck=None) -> None:
        self._availability: Dict[tuple, Optional[str]] = {}
        self._disabled: Dict[tuple, str] = {}
        self._lock = threading.Lock()
        self.selfcheck = selfcheck

    # -- environment -------------------------------------------------------------------------
    def _unavailable(self, device_type: str, index: Optional[int]) -> Optional[str]:
        raise NotImplementedError

    def unavailable(self, device_type: str, index: Optional[int] = None) -> Optional[str]:
        key = (device_type, index)
        if key in self._disabled:
            return self._disabled[key]
        if key not in self._availability:
            try:
                reason = self._unavailable(device_type, index)
            except Exception as exc:  # a probe must never take the process down
                reason = f"availability probe failed: {type(exc).__name__}: {exc}"
            self._availability[key] = reason
        return self._availability[key]

    def disable(self, device_type: str, index: Optional[int], reason: str) -> None:
        """Take the backend out of service on one device for the rest of the process."""
        with self._lock:
            self._disabled[(device_type, index)] = reason
        invalidate_decisions()  # after the write: a decision cached from now on sees the backend disabled

    # -- one call ----------------------------------------------------------------------------
    def refuse(self, call: AttentionCall) -> Optional[str]:
        raise NotImplementedError

    def why_not(self, call: AttentionCall) -> Optional[str]:
        """Why this backend cannot take `call`, or None; runs nothing (a verification not yet made is no reason)."""
        if not call.same_device:
            return "q, k, v (and mask) are on different devices"
        if not call.same_dtype:
            return "q, k, v have different dtypes"
        if call.requires_grad and self.quantized:  # stated before availability: true of every quantized backend
            return AUTOGRAD_REFUSAL
        reason = self.unavailable(call.device_type, call.device_index) or self.refuse(call)
        if reason or self.selfcheck is None:
            return reason
        return self.selfcheck.verdict(call.device_type, call.device_index, self.variant(call))[1]

    # -- first-use verification -------------------------------------------------------------------
    def prologue_of(self, call: AttentionCall) -> str:
        """The prologue that serves `call`: 'auto' is the backend's own."""
        return self.own_prologue if call.prologue == "auto" else call.prologue

    def variant(self, call: AttentionCall):
        """What, besides the shape, selects the code serving `call` (kernels.self_check.Variant)."""
        return self.selfcheck.variant_of(call, self.prologue_of(call))

    def needs_verification(self, call: AttentionCall) -> bool:
        """Whether `call` runs code that must pass the self-check on its device first (no GPU interpreter)."""
        return self.selfcheck is not None

    def verify(self, call: AttentionCall) -> Optional[str]:
        """The first-use step: the self-check of this call's device and variant, run once (or recalled)."""
        if not self.needs_verification(call):
            return None
        return self.selfcheck.guard(self, call, self.variant(call))

    def ready(self, call: AttentionCall) -> Optional[str]:
        """`why_not`, then `verify`: None only when the backend may serve `call` now."""
        return self.why_not(call) or self.verify(call)

    def launch(self, q, k, v, call: AttentionCall, sm_scale: float, attn_mask):
        """Run on HND tensors; return (out HND in q.dtype, lse (B, Hq, Nq) float32 or None)."""
        raise NotImplementedError

    def __call__(self, q, k, v, call: AttentionCall, sm_scale: float, attn_mask=None):
        reason = self.ready(call)
        if reason:
            raise KernelRefused(self.name, reason)
        return self.launch(q, k, v, call, sm_scale, attn_mask)


_REGISTRY: Dict[str, Backend] = {}
_LOADERS: Dict[str, Callable[[], Backend]] = {}


def register_lazy(name: str, loader: Callable[[], Backend]) -> None:
    """Backends are built on first use so importing the package stays cheap and never fails."""
    _LOADERS[name] = loader


class _BrokenBackend(Backend):
    """Stands in for a backend whose module failed to import, carrying the import error as its reason."""

    def __init__(self, name: str, reason: str):
        super().__init__()
        self.name = name
        self._reason = reason

    def _unavailable(self, device_type, index):
        return self._reason

    def refuse(self, call):
        return self._reason


# One lock per name: two threads' first calls make one instance (one self-check), and a slow import of one
# backend (Triton) does not hold up the first call of another.
_CREATION_LOCKS: Dict[str, threading.Lock] = {name: threading.Lock() for name in BACKEND_NAMES}


def get_backend(name: str) -> Backend:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel {name!r}; choose 'auto' or one of {', '.join(BACKEND_NAMES)}")
    backend = _REGISTRY.get(name)
    if backend is not None:  # made already: no lock on the path of every call
        return backend
    with _CREATION_LOCKS[name]:
        if name not in _REGISTRY:  # another thread may have made it while this one waited
            # Every name has a loader: importing the package runs backends/__init__.py, which registers them all.
            try:
                backend = _LOADERS[name]()
            except Exception as exc:
                backend = _BrokenBackend(name, f"failed to load: {type(exc).__name__}: {exc}")
            _REGISTRY[name] = backend
        return _REGISTRY[name]


def auto_order(call: AttentionCall) -> List[str]:
    """Preference for `auto` where it does not measure, best first, per device family.

    RDNA4: our HIP kernels, then our Triton kernels, then installed peers, then SDPA. NVIDIA: SageAttention2,
    then SDPA (our Triton kernels and comfy-kitchen are slower than cuDNN SDPA at image sizes there; `auto`
    that measures weighs them too: `auto_candidates`). CPU and anything else: SDPA (the reference is a spec,
    not a speed path). Figures: docs/MEASUREMENTS.md.
    """
    if call.device_type == "cuda" and call.rocm:
        if call.arch in ("gfx1200", "gfx1201"):
            return ["hip_int8_fp8", "hip_int8_fp16", "triton_int8_fp8", "triton_int8_fp16",
                    "comfy_kitchen", "sageattention", "sdpa"]
        return ["comfy_kitchen", "triton_int8_fp16", "sdpa"]
    if call.device_type == "cuda":
        return ["sageattention", "sdpa"]
    return ["sdpa"]


def auto_candidates(call: AttentionCall) -> List[str]:
    """What a measuring `auto` weighs, in the static order (ties and the fallback keep that order).

    On NVIDIA our Triton kernels and comfy-kitchen join SageAttention: measuring keeps a slower one out."""
    order = auto_order(call)
    if call.device_type == "cuda" and not call.rocm:
        extra = [n for n in ("triton_int8_fp8", "triton_int8_fp16", "comfy_kitchen") if n not in order]
        order = [n for n in order if n != "sdpa"] + extra + ["sdpa"]
    return order


@dataclass(frozen=True)
class Selection:
    """What `choose_backend` decided for one call.

    `backend` runs the call; None means the call site's own exact attention (only for `quantized_only`).
    `passed_over`: backends `auto` considered ahead of the one taken, and why each was passed over.
    `exact_reason`: why exact attention was chosen instead of a quantized kernel (None: it was not);
    `measured` says it was auto's measurement (SDPA faster on this shape), not that nothing quantized takes
    the call. `refusal`: why an explicitly named backend cannot take this call (None: it can).
    `decision`: auto's measured decision for this kind of call (kernels.autotune.Decision), if it measured.
    `trial` (in the step only): the kernels.step_trials.StepTrial measuring this kind of call (then `backend` is
    None and nothing is decided yet), or the Watch kept on a quantized decision."""
    backend: Optional[Backend]
    passed_over: Mapping[str, str] = field(default_factory=dict)
    exact_reason: Optional[str] = None
    measured: bool = False
    refusal: Optional[str] = None
    decision: Optional[object] = None
    trial: Optional[object] = None


def choose_backend(call: AttentionCall, kernel: str = "auto", quantized_only: bool = False, *,
                   tensors=None, sm_scale: Optional[float] = None, attn_mask=None, tuner=None,
                   in_step: bool = False) -> Selection:
    """The backend that will run `call`, as a `Selection`.

    An explicit kernel is selected as is, with its refusal when it cannot take the call (its first-use
    verification runs here). `auto` given the call's `tensors` (q, k, v in HND) on a GPU takes the fastest
    backend measured for this kind of call: measured alone (kernels/autotune.py), or with `in_step` on the
    model's own calls inside the sampling step (kernels/step_trials.py: until that decides, the selection
    carries the `trial` and no backend). Otherwise, and on the CPU, it takes the first backend in the device's
    preference list that is `ready` for the call.
    With `quantized_only` (the ComfyUI override, whose fallback is the call site's own exact attention)
    exact backends are not candidates: the selection's backend is None, with `exact_reason`, when nothing
    quantized takes the call or when SDPA measured fastest.
    """
    if kernel != "auto":
        backend = get_backend(kernel)
        return Selection(backend, refusal=backend.ready(call))
    if tensors is not None:
        measured = (_in_step_selection(call, quantized_only, tensors, attn_mask, tuner) if in_step else
                    _measured_selection(call, quantized_only, tensors, sm_scale, attn_mask, tuner))
        if measured is not None:
            return measured
    passed_over: Dict[str, str] = {}
    for name in auto_order(call):
        backend = get_backend(name)
        if quantized_only and not backend.quantized:
            continue
        reason = backend.ready(call)
        if reason is None:
            exact = None if backend.quantized else _none_takes(call, passed_over)
            return Selection(backend, passed_over, exact_reason=exact)
        passed_over[name] = reason
    exact = _none_takes(call, passed_over)
    if quantized_only:
        return Selection(None, passed_over, exact_reason=exact)
    # SDPA is last everywhere; reaching here means even it refused (e.g. LSE was asked for).
    reference = get_backend("reference")
    return Selection(reference, passed_over, exact_reason=exact, refusal=reference.ready(call))


def _none_takes(call: AttentionCall, passed_over: Mapping[str, str]) -> str:
    detail = "; ".join(f"{n}: {r}" for n, r in passed_over.items()) or f"none is built for {call.arch}"
    return f"auto: no quantized kernel takes this call ({detail})"


def _measured_selection(call, quantized_only, tensors, sm_scale, attn_mask, tuner) -> Optional[Selection]:
    """choose_backend's answer from a measured decision, or None where nothing was measured."""
    names = [n for n in auto_candidates(call) if n != "sdpa"]
    candidates = [b for b in (get_backend(n) for n in names) if b.quantized]
    sdpa = get_backend("sdpa")
    from . import autotune  # imported on first use: it reads the disk cache and cache identity
    tuner = tuner or autotune.default_tuner()
    picked = tuner.choose(call, candidates, sdpa, tensors, sm_scale, attn_mask)  # None where it does not measure
    if picked is None:
        return None
    backend, passed_over, decision = picked
    if backend is not sdpa:
        return Selection(backend, passed_over, decision=decision)
    return Selection(None if quantized_only else sdpa, passed_over, exact_reason=decision.sdpa_reason(),
                     measured=True, decision=decision)


def _in_step_selection(call, quantized_only, tensors, attn_mask, tuner) -> Optional[Selection]:
    """choose_backend's answer in the step: a decision (with its watch), a trial still measuring, or None."""
    names = [n for n in auto_candidates(call) if n != "sdpa"]
    candidates = [b for b in (get_backend(n) for n in names) if b.quantized]
    sdpa = get_backend("sdpa")
    from . import step_trials  # imported on first use: it reads the disk cache and cache identity
    tuner = tuner or step_trials.default_tuner()
    answer = tuner.choose_in_step(call, candidates, sdpa, tensors, attn_mask, on_change=invalidate_decisions)
    if answer is None:
        return None
    if answer.decision is None:  # measuring: the trial hands each call to a backend
        return Selection(None, answer.skipped, trial=answer.trial)
    if answer.backend is not None:
        return Selection(answer.backend, answer.skipped, decision=answer.decision, trial=answer.trial)
    return Selection(None if quantized_only else sdpa, answer.skipped, exact_reason=answer.decision.sdpa_reason(),
                     measured=True, decision=answer.decision)


def available_backends(device=None) -> Dict[str, Optional[str]]:
    """Per backend name: None when it can run on `device` (default: the current accelerator or CPU),
    else the reason it cannot. Call-specific limits (dtype, head_dim) are not judged here."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return {name: get_backend(name).unavailable(device.type, index) for name in BACKEND_NAMES}
