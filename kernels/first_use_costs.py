"""What first uses cost in this process, part by part: each self-check (its kernels' compiles included), each
device's hardware probes, each kind of call `auto` measured alone, the host time of each kernel's first call
while `auto` measures in the step (where its compiles land when it is timed before its self-check), and loading a
backend or checking that it is available (which imports an installed peer's package). A sampling run
reports the parts added while it ran (sage_patch/timing.py), so a user sees what made the first step slow. (The
rest of auto's measuring in the step is spread over the model's own calls and shows in the step times.)"""
from __future__ import annotations

import threading
from typing import List, Tuple

MAX_KEPT = 512  # parts kept: a long session's oldest go first
REPORTED_S = 0.01  # parts that take less host time are not recorded (a warm cache, a package imported already)

_entries: List[Tuple[int, str, float]] = []  # (sequence number, part, seconds)
_count = 0
_lock = threading.Lock()


def record(part: str, seconds: float) -> None:
    global _count
    with _lock:
        _count += 1
        _entries.append((_count, part, float(seconds)))
        del _entries[:-MAX_KEPT]


def record_if_slow(part: str, seconds: float) -> None:
    """`record`, when `seconds` reach REPORTED_S."""
    if seconds >= REPORTED_S:
        record(part, seconds)


def mark() -> int:
    """A point to ask `since` from."""
    return _count


def since(point: int) -> List[Tuple[str, float]]:
    """(part, seconds) recorded after `point`, oldest first."""
    with _lock:
        return [(part, seconds) for n, part, seconds in _entries if n > point]


def describe(parts: List[Tuple[str, float]]) -> str:
    """One line: the total and each part."""
    total = sum(seconds for _, seconds in parts)
    return f"first use {total:.2f} s: " + "; ".join(f"{part} {seconds:.2f} s" for part, seconds in parts)
