"""Per-patch counters: calls per backend, fallbacks per reason, calls routed by each policy.

Cheap and always on. Thread-safe, since ComfyUI may sample on a worker thread while the UI thread
reads a snapshot. Each distinct fallback reason is logged once per patch, not once per call.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Dict

log = logging.getLogger("sage_rdna4")


class PatchStats:
    def __init__(self, label: str = "sage_rdna4"):
        self.label = label
        self._lock = threading.Lock()
        self._calls: Counter = Counter()
        self._fallbacks: Counter = Counter()
        self._routed: Counter = Counter()
        self._logged = set()
        self._notes = []

    def record_call(self, backend: str) -> None:
        with self._lock:
            self._calls[backend] += 1

    def record_fallback(self, reason: str) -> None:
        with self._lock:
            self._fallbacks[reason] += 1
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            log.warning("[%s] attention falls back to the call site's own attention: %s", self.label, reason)

    def record_routed(self, policy: str) -> None:
        """A policy sent this call to exact attention on purpose (not a failure)."""
        with self._lock:
            self._routed[policy] += 1

    def note(self, message: str) -> None:
        """Something the user should know once (a policy that cannot apply); not counted per call."""
        with self._lock:
            first = message not in self._logged
            self._logged.add(message)
            if first:
                self._notes.append(message)
        if first:
            log.warning("[%s] %s", self.label, message)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        with self._lock:
            return {"calls": dict(self._calls), "fallbacks": dict(self._fallbacks), "routed": dict(self._routed),
                    "notes": list(self._notes)}

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._fallbacks.clear()
            self._routed.clear()

    def summary(self) -> str:
        snap = self.snapshot()
        total = sum(snap["calls"].values()) + sum(snap["fallbacks"].values()) + sum(snap["routed"].values())
        lines = [f"{self.label}: {total} attention calls"]
        for name, n in sorted(snap["calls"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  ran {name}: {n}")
        for policy, n in sorted(snap["routed"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  exact by policy ({policy}): {n}")
        for reason, n in sorted(snap["fallbacks"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  fell back ({reason}): {n}")
        for note in snap["notes"]:
            lines.append(f"  note: {note}")
        return "\n".join(lines)
