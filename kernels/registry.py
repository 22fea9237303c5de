"""The backend registry: one acceptance rule per backend, used by `auto` and by the backend itself.

A backend answers, each with a reason string or None:
  * `unavailable(device_type, index)`: can it run on this device at all (import, driver, arch)?
  * `refuse(call)`: can it take this particular call (dtype, head_dim, mask, ...)?
  * `why_not(call)`: both, plus a first-use verification already recorded as failed. A pure query.
  * `check_pending(call)`: whether a first-use verification must still run before it may serve the call.
  * `verify(call)`: that verification (kernels/gating.py runs it when a route asks for it); `ready(call)` is
    `why_not`, then `verify`: what `backend(q, k, v, call, ...)` asks, so a forced kernel can never serve a
    call unverified.

Where a call goes is kernels/routing.py's query over these answers. Callers that keep routes per call signature
(the ComfyUI override) trust them only while `decision_generation()` is unchanged: a backend disabled by its
verification bumps it.
"""
from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import first_use_costs
from .call_spec import AUTOGRAD_REFUSAL, AttentionCall
from .gating import first_use_check

# Re-exported: every cache of decisions and every caller that catches a refusal reads them from here.
from .generation import decision_generation, invalidate_decisions  # noqa: F401
from .refusal import KernelRefused, named_reason  # noqa: F401
from .self_check import Variant

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


class Backend:
    """Base class. Subclasses set `name`, `description`, and implement `_unavailable`, `refuse`, `launch`.

    A backend built with `verdicts` (kernels.gating.Verdicts) proves itself on first use of each device and
    variant (`verify`) wherever `needs_verification(call)` says so; one built with a `probe` (the HIP backends:
    the device's hardware probes) runs it first, once per device. `own_prologue` is the prologue its
    `prologue="auto"` means."""

    name: str = ""
    description: str = ""
    quantized: bool = True
    own_prologue: str = ""

    def __init__(self, verdicts=None, probe=None) -> None:
        self._availability: Dict[tuple, Optional[str]] = {}
        self._disabled: Dict[tuple, str] = {}
        self._lock = threading.Lock()
        self.verdicts = verdicts
        self.probe = probe  # pending(device_type, index) -> bool, refusal(device_type, index) -> reason or None

    # -- environment -------------------------------------------------------------------------
    def _unavailable(self, device_type: str, index: Optional[int]) -> Optional[str]:
        raise NotImplementedError

    def unavailable(self, device_type: str, index: Optional[int] = None) -> Optional[str]:
        key = (device_type, index)
        if key in self._disabled:
            return self._disabled[key]
        if self.verdicts is not None and key in self.verdicts.disabled:  # failed its self-check there
            return self.verdicts.disabled[key]
        if key not in self._availability:
            started = time.perf_counter()
            try:
                reason = self._unavailable(device_type, index)
            except Exception as exc:  # a probe must never take the process down
                reason = f"availability probe failed: {type(exc).__name__}: {exc}"
            self._availability[key] = reason
            # A peer's check imports its package: a first-use cost, as a kernel's compile is.
            where = device_type if index is None else f"{device_type}:{index}"
            first_use_costs.record_if_slow(f"checking that {self.name} is available on {where}",
                                           time.perf_counter() - started)
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
        if reason or self.verdicts is None:
            return reason
        return self.verdicts.recorded.get((call.device_type, call.device_index, self.variant(call)))

    # -- first-use verification -------------------------------------------------------------------
    def variant(self, call: AttentionCall) -> Variant:
        """What, besides the shape, selects the code serving `call`: its prologue ('auto' is the backend's own) and
        quantization options. The self-check runs, and its verdict is kept, once per device and variant."""
        prologue = self.own_prologue if call.prologue == "auto" and self.own_prologue else call.prologue
        return Variant(prologue, call.qk_group, bool(call.smooth_k), bool(call.smooth_v))

    def needs_verification(self, call: AttentionCall) -> bool:
        """Whether `call` runs code that must pass the self-check on its device first (no GPU interpreter)."""
        return self.verdicts is not None

    def check_pending(self, call: AttentionCall) -> bool:
        """Whether `verify` must still run before the backend may serve `call` (probes or a verdict not recorded)."""
        if self.probe is not None and self.probe.pending(call.device_type, call.device_index):
            return True
        if not self.needs_verification(call):
            return False
        return (call.device_type, call.device_index, self.variant(call)) not in self.verdicts.recorded

    def timed_before_check(self) -> bool:
        """Whether auto may time this backend in the step before its self-check (its answer unused, exact attention
        answering that call), and check it only if it wins. Not a backend with hardware probes (HIP): its code has
        never run on the user's card, so it runs on no model call before both have passed."""
        return self.probe is None

    def verify(self, call: AttentionCall) -> Optional[str]:
        """The first-use step (kernels/gating.py): the device's probes, then the self-check of this call's device
        and variant, each run once (or recalled)."""
        return first_use_check(self, call)

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
_PACKAGES: Dict[str, Tuple[str, ...]] = {}


def register_lazy(name: str, loader: Callable[[], Backend], packages: Sequence[str] = ()) -> None:
    """Backends are built on first use so importing the package stays cheap and never fails. `packages`: the
    installed Python packages whose presence decides whether the backend can be available (`installed_packages`)."""
    _LOADERS[name] = loader
    _PACKAGES[name] = tuple(packages)


def installed_packages() -> Dict[str, str]:
    """Per package a backend rests on: its file and that file's size and time, or 'absent'. It finds and never
    imports (a peer's import costs up to 0.5 s), so auto can tell that nothing was installed, upgraded or removed
    since it stored a decision (kernels/tuner.py, `Tuner.recall_settled`)."""
    return {package: _where_installed(package) for package in sorted({p for ps in _PACKAGES.values() for p in ps})}


def _where_installed(package: str) -> str:
    try:
        spec = importlib.util.find_spec(package)
        if spec is None:
            return "absent"
        if not spec.origin or not os.path.isfile(spec.origin):  # a namespace package: where it is, no file to date
            return ", ".join(spec.submodule_search_locations or ()) or "no origin"
        stat = os.stat(spec.origin)
        return f"{spec.origin} {stat.st_size} {stat.st_mtime_ns}"
    except Exception as exc:  # a package whose lookup fails is stated as such: it then matches nothing stored
        return f"lookup failed: {type(exc).__name__}"


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
            started = time.perf_counter()
            try:
                backend = _LOADERS[name]()
            except Exception as exc:
                backend = _BrokenBackend(name, f"failed to load: {type(exc).__name__}: {exc}")
            first_use_costs.record_if_slow(f"loading {name} (its modules)", time.perf_counter() - started)
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


PENDING = "first-use checks not run yet"  # readiness: the backend may take the call once its checks have run


def readiness(backend: Backend, call: AttentionCall, checked: Mapping[str, Optional[str]]) -> Optional[str]:
    """None when `backend` may serve `call` now, the reason when it cannot, or PENDING (its first-use checks have
    not run). `checked`: first-use results of this very call (a check that could not run leaves no verdict)."""
    if backend.name in checked:
        return checked[backend.name]
    reason = backend.why_not(call)
    if reason is None and backend.check_pending(call):
        return PENDING
    return reason


def readiness_in_order(names: Sequence[str], call: AttentionCall, checked: Mapping[str, Optional[str]],
                       quantized_only: bool) -> List[Tuple[str, Backend, Optional[str]]]:
    """(name, backend, readiness) in `names`' order, up to and including the first that is ready or PENDING: what
    a preference order asks, and no more (a later backend's rule is not asked)."""
    found = []
    for name in names:
        backend = get_backend(name)
        if quantized_only and not backend.quantized:
            continue
        state = readiness(backend, call, checked)
        found.append((name, backend, state))
        if state is None or state is PENDING:
            break
    return found


def quantized_candidates(call: AttentionCall) -> List[Backend]:
    """The quantized backends a measuring `auto` weighs for `call` (auto_candidates, SDPA aside)."""
    return [b for b in (get_backend(n) for n in auto_candidates(call) if n != "sdpa") if b.quantized]


def none_takes(call: AttentionCall, passed_over: Mapping[str, str]) -> str:
    detail = "; ".join(f"{n}: {r}" for n, r in passed_over.items()) or f"none is built for {call.arch}"
    return f"auto: no quantized kernel takes this call ({detail})"


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
