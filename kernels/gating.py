"""First use of a backend on a device: the explicit step a route asks for (routing.VERIFY).

`first_use_checks(backends, call)` runs what each backend must pass before it serves a call on a device and variant
(`Backend.verify`: the HIP backends' hardware probes, then the self-check). `Verdicts` keeps one backend's
self-check verdicts: the numeric check itself is kernels/self_check.py, passes kept on disk kernels/pass_cache.py.
A failure disables the backend on that device (or refuses that variant's calls) and tells every cache of decisions
(`registry.invalidate_decisions`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from . import first_use_costs, settings
from .generation import invalidate_decisions
from .pass_cache import PassCache
from .self_check import (
    DEFAULT_CASES,
    FAILED,
    NOT_CHECKED,
    Case,
    SelfCheckResult,
    Variant,
    backend_attention,
    checks_fingerprint,
    out_of_memory,
    run_self_check,
)

log = logging.getLogger(__name__)


def first_use_checks(backends: Sequence, call) -> Dict[str, Optional[str]]:
    """Run each backend's first-use checks for `call`'s device and variant (once; later calls recall the verdict).
    Per backend name: None when it may serve the call, else why not."""
    return {backend.name: first_use_check(backend, call) for backend in backends}


def first_use_check(backend, call) -> Optional[str]:
    """`Backend.verify`: the device's hardware probes where the backend has them (HIP), then the self-check of the
    call's device and variant through the backend's own `Verdicts`."""
    probe = backend.probe
    reason = probe.refusal(call.device_type, call.device_index) if probe is not None else None
    if reason or not backend.needs_verification(call):
        return reason
    verdicts: Verdicts = backend.verdicts
    return verdicts.guard(backend, call, backend.variant(call))


class Verdicts:
    """One backend's first-use self-check verdicts, once per (device, variant); thread-safe.

    The first call of a device and variant (prologue, qk_group, smooth_k, smooth_v) runs `self_check`
    through the backend's own `refuse` and `launch`; concurrent first calls wait for that one result. A
    failure, an exception or a NaN disables the backend on that device for the process (`Backend.disable`:
    `unavailable`, `available_backends` and every later call report the reason; the dispatcher falls back).
    Memory running out during the check is no verdict: that call is refused (NOT_CHECKED), nothing is
    recorded, and the next call checks again.
    A pass may come from the disk (`PassCache`): only passes are kept there, keyed by everything that could
    change the verdict."""

    def __init__(self, cases: Sequence[Case] = DEFAULT_CASES, cache: Optional[PassCache] = None):
        self.cases = tuple(cases)
        self.cache = cache if cache is not None else PassCache()
        # (device type, index, variant) -> None (passed) or the failure: read by Backend.why_not and check_pending
        self.recorded: Dict[tuple, Optional[str]] = {}
        self.disabled: Dict[tuple, str] = {}  # (device type, index) -> why the backend is out of service there
        self._locks: Dict[tuple, threading.Lock] = {}
        self._guard = threading.Lock()
        self.last_result: Optional[SelfCheckResult] = None


    def verdict(self, device_type: str, index: Optional[int], variant: Optional[Variant] = None
                ) -> Tuple[bool, Optional[str]]:
        """(checked, reason) without running anything."""
        key = (device_type, index, variant)
        return key in self.recorded, self.recorded.get(key)

    def guard(self, backend, call, variant: Optional[Variant] = None) -> Optional[str]:
        """`Backend.verify`: the verdict for this call's device and variant, checking on first use."""
        variant = variant or backend.variant(call)
        key = (call.device_type, call.device_index, variant)
        if key in self.recorded:
            return self.recorded[key]
        if not settings.self_check_enabled():  # developers measuring a kernel that fails it
            log.warning("%s on %s:%s serves calls WITHOUT its first-use self-check (%s)", backend.name,
                        call.device_type, call.device_index, f"{settings.SELF_CHECK.name}=0")
            self.recorded[key] = None
            return None
        return self.ensure(backend, call.device_type, call.device_index, backend_attention(backend, variant, call),
                           variant=variant)

    def ensure(self, backend, device_type: str, index: Optional[int], attention: Callable,
               accepts: Optional[Callable[[Case], bool]] = None, variant: Optional[Variant] = None) -> Optional[str]:
        """Run the check on first use of (device, variant); a failure disables `backend` there. Returns the reason.
        `accepts`: the cases to run (default: those `attention` accepts, `self_check.run_self_check`)."""
        key = (device_type, index, variant)
        if key in self.recorded:
            return self.recorded[key]
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key in self.recorded:  # another thread finished it while we waited
                return self.recorded[key]
            device = torch.device(device_type, index) if index is not None else torch.device(device_type)
            options = variant.describe() if variant else "default options"
            cache_key = (self.cache.key(backend.name, variant, device, checks_fingerprint(self.cases))
                         if device.type == "cuda" else None)
            started = time.perf_counter()
            try:  # a pass kept on disk, or the check run now (a pass is kept)
                result = self.cache.checked(cache_key, backend.name,
                                            lambda: run_self_check(attention, device, self.cases, accepts))
            except Exception as exc:
                if out_of_memory(exc):  # this moment's memory, not the kernel: no verdict, tried again later
                    return self._not_checked(backend, device, options, exc)
                reason, result = f"self-check crashed: {type(exc).__name__}: {exc}", None
            else:
                if result is None:
                    log.info("%s (%s): self-check passed earlier on this GPU, driver and code (cached)",
                             backend.name, options)
                    self.recorded[key] = None
                    return None
                self.last_result = result
                reason = result.reason
            first_use_costs.record(f"self-check {backend.name} ({options}) on {device}",
                                   time.perf_counter() - started)
            if reason:
                reason = f"{backend.name} disabled on {device}: {FAILED} ({options}): {reason}"
                log.warning("%s; calls fall back to the next backend", reason)
                # A kernel failing with the accurate options is broken: out of service on this device. Weaker
                # options can miss bounds the spec itself misses (docs/VERIFICATION.md): only calls with those
                # options are refused (`guard` returns this verdict for them).
                if variant is None or variant.accurate:
                    self.disabled[(device_type, index)] = reason  # Backend.unavailable reads it
            else:
                log.info("%s (%s) passed its self-check on %s: %d cases in %.2f s", backend.name, options, device,
                         len(result.results), result.seconds)
            self.recorded[key] = reason
            if reason:
                invalidate_decisions()  # calls with this variant are refused from now on
            return reason

    @staticmethod
    def _not_checked(backend, device: torch.device, options: str, exc: BaseException) -> str:
        """The reason for a call whose check ran out of memory; no verdict is recorded."""
        reason = (f"{backend.name} on {device}: {NOT_CHECKED} for lack of memory ({options}): "
                  f"{type(exc).__name__}: {exc}; it will be tried again on a later call")
        log.warning("%s; this call falls back", reason)
        invalidate_decisions()  # a plan made on this answer (the override's) must ask again on its next call
        return reason
