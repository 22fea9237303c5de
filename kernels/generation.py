"""One number that says whether decisions made earlier about backends may still hold.

Caches of decisions (the ComfyUI override's plans) keep the number they read before deciding and trust an entry
only while it is unchanged. Whatever can change a backend's answer bumps it: a backend disabled (by its
self-check, its probes, or by hand), a failed self-check verdict, a check that could not run, auto deciding or
reverting a kind of call.
"""
from __future__ import annotations

import threading

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
