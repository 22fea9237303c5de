"""The backend registry: one acceptance rule per backend, used by `auto` and by the backend itself.

A backend answers two questions, both with a reason string or None:
  * `unavailable(device_type, index)`: can it run on this device at all (import, driver, arch)?
  * `refuse(call)`: can it take this particular call (dtype, head_dim, mask, ...)?
`why_not(call)` joins the two; the dispatcher asks it, and `backend(q, k, v, call, ...)` asks it
again before launching, so a forced kernel can never be answered by another one.

Callers that cache decisions per call signature (the ComfyUI override) keep them only while
`decision_generation()` is unchanged: anything that can change a backend's answer bumps it.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .call_spec import AttentionCall

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
    """An explicitly requested backend cannot take this call; `reason` says why."""

    def __init__(self, backend: str, reason: str):
        super().__init__(f"{backend}: {reason}")
        self.backend = backend
        self.reason = reason


class Backend:
    """Base class. Subclasses set `name`, `description`, and implement `_unavailable`, `refuse`, `launch`."""

    name: str = ""
    description: str = ""
    quantized: bool = True

    def __init__(self) -> None:
        self._availability: Dict[Tuple[str, Optional[int]], Optional[str]] = {}
        self._disabled: Dict[Tuple[str, Optional[int]], str] = {}
        self._lock = threading.Lock()

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
        if not call.same_device:
            return "q, k, v (and mask) are on different devices"
        if not call.same_dtype:
            return "q, k, v have different dtypes"
        return self.unavailable(call.device_type, call.device_index) or self.refuse(call)

    def launch(self, q, k, v, call: AttentionCall, sm_scale: float, attn_mask):
        """Run on HND tensors; return (out HND in q.dtype, lse (B, Hq, Nq) float32 or None)."""
        raise NotImplementedError

    def __call__(self, q, k, v, call: AttentionCall, sm_scale: float, attn_mask=None):
        reason = self.why_not(call)
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


def get_backend(name: str) -> Backend:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel {name!r}; choose 'auto' or one of {', '.join(BACKEND_NAMES)}")
    if name not in _REGISTRY:
        # Every name has a loader: importing the package runs backends/__init__.py, which registers them all.
        try:
            backend: Backend = _LOADERS[name]()
        except Exception as exc:
            backend = _BrokenBackend(name, f"failed to load: {type(exc).__name__}: {exc}")
        _REGISTRY[name] = backend
    return _REGISTRY[name]


def auto_order(call: AttentionCall) -> List[str]:
    """Preference for `auto`, best first, per device family.

    RDNA4: our HIP kernels, then our Triton kernels, then installed peers, then SDPA.
    NVIDIA: SageAttention2 (0.74 / 0.71x cuDNN SDPA at Wan 480p / 720p on an H200, README) beats SDPA; our Triton path
    (public call 1.70 / 0.97 / 0.89x SDPA at Flux 1 MP / Wan 480p / Wan 720p, README) and comfy-kitchen (1.19-1.98x)
    are not faster than SDPA across the board there, so in this fixed order SDPA comes before them; `auto` that
    measures (autotune.py) takes them where they are faster on the user's GPU.
    CPU and anything else: SDPA (the reference is a spec, not a speed path).
    """
    if call.device_type == "cuda" and call.rocm:
        if call.arch in ("gfx1200", "gfx1201"):
            return ["hip_int8_fp8", "hip_int8_fp16", "triton_int8_fp8", "triton_int8_fp16",
                    "comfy_kitchen", "sageattention", "sdpa"]
        return ["comfy_kitchen", "triton_int8_fp16", "sdpa"]
    if call.device_type == "cuda":
        return ["sageattention", "sdpa"]
    return ["sdpa"]


AUTO_VERDICT = "auto"  # the key in `skipped` under which a measured `auto` says why nothing quantized runs


def auto_candidates(call: AttentionCall) -> List[str]:
    """What a measuring `auto` weighs, in the static order (ties and the fallback keep that order).

    On NVIDIA our Triton kernels and comfy-kitchen join SageAttention: measuring keeps a slower one out."""
    order = auto_order(call)
    if call.device_type == "cuda" and not call.rocm:
        extra = [n for n in ("triton_int8_fp8", "triton_int8_fp16", "comfy_kitchen") if n not in order]
        order = [n for n in order if n != "sdpa"] + extra + ["sdpa"]
    return order


def choose_backend(call: AttentionCall, kernel: str = "auto", quantized_only: bool = False, *,
                   tensors=None, sm_scale: Optional[float] = None, attn_mask=None,
                   on_choice: Optional[Callable] = None,
                   tuner=None) -> Tuple[Optional[Backend], Dict[str, str]]:
    """Return the backend that will run `call` and the reasons of those passed over.

    An explicit kernel is returned as is (it raises KernelRefused itself when called). `auto` given the
    call's `tensors` (q, k, v in HND) on a GPU takes the fastest backend measured for this kind of call
    (kernels/autotune.py; `on_choice(decision)` hears which); otherwise, and on the CPU, it walks the
    device's preference list and takes the first backend whose rule accepts the call.
    With `quantized_only` (the ComfyUI override, whose fallback is the call site's own exact
    attention) exact backends are skipped and None is returned when nothing quantized accepts, or when
    SDPA measured fastest (then `skipped[AUTO_VERDICT]` says so).
    """
    if kernel != "auto":
        return get_backend(kernel), {}
    if tensors is not None:
        measured = _measured_choice(call, quantized_only, tensors, sm_scale, attn_mask, on_choice, tuner)
        if measured is not None:
            return measured
    skipped: Dict[str, str] = {}
    for name in auto_order(call):
        backend = get_backend(name)
        if quantized_only and not backend.quantized:
            continue
        reason = backend.why_not(call)
        if reason is None:
            return backend, skipped
        skipped[name] = reason
    if quantized_only:
        return None, skipped
    # SDPA is last everywhere; reaching here means even it refused (e.g. LSE was asked for).
    return get_backend("reference"), skipped


def _measured_choice(call, quantized_only, tensors, sm_scale, attn_mask, on_choice, tuner):
    """choose_backend's answer from a measured decision, or None where nothing was measured."""
    from . import autotune  # imported on first use: it reads the self-check's cache helpers
    tuner = tuner or autotune.default_tuner()
    if not tuner.applies(call, tensors):
        return None
    names = [n for n in auto_candidates(call) if n != "sdpa"]
    candidates = [b for b in (get_backend(n) for n in names) if b.quantized]
    sdpa = get_backend("sdpa")
    picked = tuner.choose(call, candidates, sdpa, tensors, sm_scale, attn_mask)
    if picked is None:
        return None
    backend, skipped, decision = picked
    if on_choice is not None:
        on_choice(decision)
    if backend is sdpa and quantized_only:
        return None, {**skipped, AUTO_VERDICT: decision.sdpa_reason()}
    return backend, skipped


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
