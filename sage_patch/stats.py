"""Per-patch counters: calls per backend, fallbacks per reason, calls routed by each policy, the
backends `auto` passed over per (backend, reason), and what a measuring `auto` chose per kind of call.

Cheap and always on. Thread-safe, since ComfyUI may sample on a worker thread while the UI thread
reads a snapshot. Each kind of fallback reason, and each (backend, kind of reason) that `auto` passed
over (a backend that cannot run here, refuses the call, or failed its self-check), is logged once per
patch, not once per call; the counts keep growing.

Bounded whatever the calls: a reason's kind is its text with the numbers taken out (calls of changing sizes
give texts that differ only there). Each counter keeps the first TEXTS_PER_KIND texts of a kind as they are,
counts later ones under the kind, and past MAX_REASONS keys counts the rest under OTHER. A key, once made,
never changes, so deltas between two snapshots (the step timer, the A/B report) stay right.
"""
from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

log = logging.getLogger("sage_rdna4")


MAX_REASONS = 50      # keys per counter (fallbacks, routed, each backend's skips), OTHER aside
TEXTS_PER_KIND = 5    # texts of one kind kept as they are; the numbers in them are what a user reads
MAX_LOGGED = 1000     # messages remembered as logged (each is logged once)
MORE = " (and more of this kind)"
OTHER = f"other reasons (past the {MAX_REASONS} the stats keep apart)"
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def _warn_beside_progress_bars(*args) -> None:
    """log.warning on a line of its own while ComfyUI's sampler draws a tqdm bar (it lands mid-bar otherwise)."""
    try:
        from tqdm import tqdm
        write_mode = tqdm.external_write_mode
    except Exception:  # no tqdm: nothing draws bars
        log.warning(*args)
        return
    with write_mode():
        log.warning(*args)


def reason_kind(reason: str) -> str:
    """The reason with its numbers (and hex addresses) replaced by '#'."""
    return _NUMBERS.sub("#", reason)


class _Reasons:
    """Counts per reason over a bounded set of keys (the module's docstring says which). PatchStats' lock guards it."""

    __slots__ = ("counts", "_kept")

    def __init__(self):
        self.counts: Dict[str, int] = {}
        self._kept: Dict[str, int] = {}  # kind -> its texts kept as keys

    def add(self, reason: str) -> Optional[str]:
        """Count one `reason`; returns its kind when the text was new (OTHER when it went there), else None."""
        counts = self.counts
        n = counts.get(reason)
        if n is not None:  # the common case: a known text
            counts[reason] = n + 1
            return None
        kind = reason_kind(reason)
        kept = self._kept.get(kind, 0)
        if kept < TEXTS_PER_KIND and len(counts) < MAX_REASONS:
            self._kept[kind] = kept + 1
            key = reason
        else:
            key = kind + MORE
            if key not in counts and len(counts) >= MAX_REASONS:
                key = kind = OTHER
        counts[key] = counts.get(key, 0) + 1
        return kind


RAN, ROUTED, FELL_BACK = "ran", "routed", "fell back"


class Outcome(NamedTuple):
    """How one attention call ended, as the stats count it (`PatchStats.record`).

    `kind`: RAN on the backend `label`; ROUTED to exact attention on purpose (a policy, auto's choice, its
    measuring turn: `label` says which); FELL_BACK to the call site's attention for the reason `label`.
    `passed_over`: the backends auto passed over to reach it, and why; `ran`: what auto took before the call fell
    back, or whose measuring turn it was. `choice`: auto's decision, when this call's plan was new."""
    kind: str
    label: str
    passed_over: Optional[Mapping[str, str]] = None
    ran: Optional[str] = None
    choice: Any = None


class PatchStats:
    def __init__(self, label: str = "sage_rdna4"):
        self.label = label
        self._lock = threading.Lock()
        self._calls: Counter = Counter()
        self._fallbacks = _Reasons()
        self._routed = _Reasons()
        self._cuts = _Reasons()  # calls whose padding mask was cut from K and V, per what was cut
        self._passed_over: Dict[str, _Reasons] = {}  # backend -> reason -> calls where auto passed over it
        self._logged = set()  # what was logged once: bounded (_first_time)
        self._notes = []
        self._choices: Dict[str, str] = {}  # auto's measured decision per kind of call -> its summary
        self._choice_rows: Dict[str, dict] = {}  # the same, as Decision.as_row (chosen, ratio, method, reverted)

    def record(self, outcome: Outcome) -> None:
        """One call's outcome, counted once, with the backends auto passed over to reach it."""
        kind, label, passed_over, ran, choice = outcome
        if choice is not None:
            self.record_choice(choice)
        if kind == RAN:
            self.record_call(label, passed_over)
        elif kind == ROUTED:
            self.record_routed(label, passed_over, ran)
        else:
            self.record_fallback(label, passed_over, ran)

    def record_call(self, backend: str, passed_over: Optional[Dict[str, str]] = None) -> None:
        """One call `backend` ran; `passed_over`: the backends auto passed over to reach it (record_passed_over)."""
        if passed_over:
            self.record_passed_over(passed_over, backend)
        with self._lock:  # once per call: dict.get skips Counter's Python-level __missing__ machinery
            self._calls[backend] = self._calls.get(backend, 0) + 1

    def _first_time(self, key) -> bool:
        """Whether to log `key` now: once each, and no more than MAX_LOGGED keys kept (under the lock)."""
        if key in self._logged or len(self._logged) >= MAX_LOGGED:
            return False
        self._logged.add(key)
        return True

    def record_fallback(self, reason: str, passed_over: Optional[Dict[str, str]] = None,
                        ran: Optional[str] = None) -> None:
        """One call handed back to the call site's attention for `reason`; `passed_over` and `ran` (what auto took,
        if anything, before it failed) as record_passed_over takes them."""
        if passed_over:
            self.record_passed_over(passed_over, ran)
        with self._lock:
            kind = self._fallbacks.add(reason)
            first = kind is not None and self._first_time(("fallback", kind))
        if first and kind == OTHER:
            _warn_beside_progress_bars("[%s] attention falls back to the call site's own attention: %s (more kinds of "
                                       "reason than the stats keep: counted as %r from now on, not logged)",
                                       self.label, reason, OTHER)
        elif first:
            _warn_beside_progress_bars("[%s] attention falls back to the call site's own attention: %s", self.label,
                                       reason)

    def record_passed_over(self, passed_over: Dict[str, str], ran: Optional[str]) -> None:
        """`auto` passed over these backends (name -> reason) on one call; `ran` is what it took (None: nothing
        quantized took it, the call fell back). Not a call count of its own: the call is counted where it ran."""
        if not passed_over:
            return
        new = []
        with self._lock:
            for name, reason in passed_over.items():
                reasons = self._passed_over.get(name)
                if reasons is None:
                    reasons = self._passed_over[name] = _Reasons()
                kind = reasons.add(reason)
                if kind is not None and self._first_time(("skip", name, kind)):
                    new.append((name, reason))
        for name, reason in new:
            then = f"auto takes {ran} instead" if ran else "no quantized kernel takes the call: it falls back"
            # A self-check failure or a failed probe is a defect to report; a refusal is routine.
            level = logging.WARNING if ("self-check" in reason or "failed" in reason) else logging.INFO
            log.log(level, "[%s] auto passes over %s: %s (%s; counted from now on, logged once)",
                    self.label, name, reason, then)

    def record_choice(self, decision) -> None:
        """What a measuring `auto` chose for one kind of call (kernels.decisions.Decision): kept per kind, logged
        when new or changed (a watch that reverted it to SDPA), never cleared by `reset` (it outlives a run)."""
        label, summary = decision.key.ident(), decision.summary
        if self._choices.get(label) == summary:  # the common case: no lock taken
            return
        with self._lock:
            self._choices[label] = summary
            self._choice_rows[label] = decision.as_row()
        log.log(logging.WARNING if decision.reverted else logging.INFO, "[%s] %s", self.label, summary)

    def record_routed(self, policy: str, passed_over: Optional[Dict[str, str]] = None,
                      ran: Optional[str] = None) -> None:
        """A policy (or auto's choice, or its turn) sent this call to exact attention on purpose (not a failure);
        `passed_over` and `ran` as record_passed_over takes them."""
        if passed_over:
            self.record_passed_over(passed_over, ran)
        with self._lock:
            self._routed.add(policy)

    def record_cut(self, what: str) -> None:
        """One call our kernel ran with its prompt-padding mask cut from K and V (kernels/padding_masks.py); the
        call itself is counted where it ran."""
        with self._lock:
            self._cuts.add(what)

    def note(self, message: str) -> None:
        """Something the user should know once (a policy that cannot apply); not counted per call."""
        with self._lock:
            first = self._first_time(message)
            if first:
                self._notes.append(message)
        if first:
            log.warning("[%s] %s", self.label, message)

    def snapshot(self) -> dict:
        with self._lock:
            passed_over = {name: dict(reasons.counts) for name, reasons in self._passed_over.items()}
            return {"calls": dict(self._calls), "fallbacks": dict(self._fallbacks.counts),
                    "routed": dict(self._routed.counts), "cuts": dict(self._cuts.counts), "passed_over": passed_over,
                    "notes": list(self._notes),
                    "auto_choices": list(self._choices.values()),
                    "auto_decisions": [dict(row) for row in self._choice_rows.values()]}

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._fallbacks = _Reasons()
            self._routed = _Reasons()
            self._cuts = _Reasons()
            self._passed_over.clear()

    def summary(self) -> str:
        snap = self.snapshot()
        total = sum(snap["calls"].values()) + sum(snap["fallbacks"].values()) + sum(snap["routed"].values())
        lines = [f"{self.label}: {total} attention calls"]
        hip_code = hip_code_path() if any(name.startswith("hip_") for name in snap["calls"]) else None
        for name, n in sorted(snap["calls"].items(), key=lambda kv: -kv[1]):
            extra = [x for x in (hip_code, hip_pv_chain(name)) if x] if name.startswith("hip_") else []
            served = f" ({'; '.join(extra)})" if extra else ""
            lines.append(f"  ran {name}: {n}{served}")
        for policy, n in sorted(snap["routed"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  exact by policy ({policy}): {n}")
        for reason, n in sorted(snap["fallbacks"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  fell back ({reason}): {n}")
        for what, n in sorted(snap["cuts"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  of those ran, {what}: {n}")
        lines.extend(format_passed_over(snap["passed_over"], indent="  "))
        for choice in snap["auto_choices"]:
            lines.append(f"  {choice}")
        for note in snap["notes"]:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


def hip_code_path() -> Optional[str]:
    """What served the HIP kernels ('prebuilt gfx1201 1a2b3c4d', 'hiprtc 7.0'), asked only once they ran."""
    try:
        from ..kernels.backends.hip import runtime
        return runtime.code_path_line()
    except Exception:  # a stats line never fails over this
        return None


def hip_pv_chain(backend: str) -> Optional[str]:
    """The P.V chain a HIP backend ('hip_int8_fp16') chose at first use ('single P.V'), or None."""
    try:
        from ..kernels.backends.hip import pv_chain
        return pv_chain.stats_line(backend.rsplit("_", 1)[-1])
    except Exception:  # a stats line never fails over this
        return None


def format_passed_over(passed_over: Dict[str, Dict[str, int]], indent: str = "") -> List[str]:
    """Lines for the backends `auto` passed over: one per (backend, reason), most frequent first."""
    rows = sorted(((n, name, reason) for name, reasons in passed_over.items() for reason, n in reasons.items()),
                  key=lambda r: (-r[0], r[1], r[2]))
    return [f"{indent}auto passed over {name} on {n} call{'s' if n != 1 else ''}: {reason}" for n, name, reason in rows]


def delta_passed_over(after: Dict[str, Dict[str, int]], before: Dict[str, Dict[str, int]]) -> Dict[str, Dict[str, int]]:
    """What was added between two snapshots' "passed_over" entries."""
    out: Dict[str, Dict[str, int]] = {}
    for name, reasons in after.items():
        for reason, n in reasons.items():
            d = n - before.get(name, {}).get(reason, 0)
            if d:
                out.setdefault(name, {})[reason] = d
    return out
