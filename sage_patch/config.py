"""What a patch does, as chosen on the node. Immutable: one config per patched model."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Set, Tuple

from ..kernels.call_spec import PROLOGUES
from ..kernels.registry import BACKEND_NAMES

ON_UNSUPPORTED = ("fallback", "raise")
# The one rule for kernel and prologue values; the node offers exactly these. A prompt JSON can skip the UI's
# combo check, so an unknown value must stop here rather than fail in KSampler or make every call fall back.
KERNEL_CHOICES = ("auto", *BACKEND_NAMES)
PROLOGUE_CHOICES = PROLOGUES


def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


# exact_blocks is free text any shared workflow sets: what a spec may expand to is bounded (no model has more than
# a few hundred blocks), so "0-1000000000" is refused instead of building a billion-entry set.
MAX_BLOCK_INDICES = 10_000
MAX_BLOCK_INDEX = 100_000  # indices are under it; 'first N' / 'last N' take N up to it
_BOUND = (f"a block spec names at most {MAX_BLOCK_INDICES} block indices, each under {MAX_BLOCK_INDEX} "
          "(no model has more than a few hundred blocks)")


def _quoted(part: str) -> str:
    return repr(part if len(part) <= 40 else part[:40] + "...")


def _block_number(digits: str, limit: int, part: str, rule: str) -> int:
    """int(digits) if it is at most `limit`, else ValueError with `rule`; never converts a long digit string."""
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(limit)) or int(digits) > limit:
        raise ValueError(f"block spec {_quoted(part)} is past the bound: {rule}")
    return int(digits)


def parse_blocks(spec: str) -> Tuple[Set[int], int, int]:
    """'' -> nothing; '0,1,5' -> those indices; 'last 2' -> the last two; 'first 1, last 2' both.

    Returns (indices, first_n, last_n). ValueError for what it cannot read or what is past the bound."""
    indices: Set[int] = set()
    first_n = last_n = 0
    for part in (p.strip().lower() for p in spec.replace(";", ",").split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(first|last)\s+(\d+)", part)
        if m:
            n = _block_number(m.group(2), MAX_BLOCK_INDEX, part, f"'first N' and 'last N' take N at most "
                                                                 f"{MAX_BLOCK_INDEX}")
            if m.group(1) == "first":
                first_n = max(first_n, n)
            else:
                last_n = max(last_n, n)
            continue
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)  # an index, or a range
        if m:
            lo = _block_number(m.group(1), MAX_BLOCK_INDEX - 1, part, _BOUND)
            hi = lo if m.group(2) is None else _block_number(m.group(2), MAX_BLOCK_INDEX - 1, part, _BOUND)
            if lo > hi:
                raise ValueError(f"block range {_quoted(part)} runs backwards")
            if len(indices) + (hi - lo + 1) > MAX_BLOCK_INDICES:  # checked before the range is expanded
                raise ValueError(f"block spec {_quoted(part)} is past the bound: {_BOUND}")
            indices.update(range(lo, hi + 1))
            continue
        raise ValueError(f"cannot read block spec {_quoted(part)}: use indices '0,3', ranges '2-5', 'first N' or "
                         "'last N'")
    return indices, first_n, last_n


@dataclass(frozen=True)
class PatchConfig:
    kernel: str = "auto"            # "auto" or a backend name (kernels.BACKEND_NAMES)
    smooth_k: bool = True
    smooth_v: bool = False          # take V's per-channel mean out before quantizing (exact)
    prologue: str = "auto"          # "auto" | "hip" | "triton"
    on_unsupported: str = "fallback"  # "fallback": the call site's own attention; "raise": stop with the reason
    qk_group: str = "token"
    # Policies (which calls stay exact); see sage_patch/policies.py.
    step_start: float = 0.0         # fraction of the schedule where quantized attention starts
    step_end: float = 1.0           # ... and where it stops
    exact_blocks: str = ""          # e.g. "last 2", "0,1,5", "" for none
    min_seq_len: int = 0            # calls with fewer query tokens go to exact attention
    cross_attention: str = "quantized"  # "quantized" | "exact" (calls whose Q and K lengths differ)
    time_attention: bool = False    # per-step attention time from device events (costs a little)

    def __post_init__(self):
        if self.kernel not in KERNEL_CHOICES:
            raise ValueError(f"kernel must be one of {_choices(KERNEL_CHOICES)}, got {self.kernel!r}")
        if self.prologue not in PROLOGUE_CHOICES:
            raise ValueError(f"prologue must be one of {_choices(PROLOGUE_CHOICES)}, got {self.prologue!r}")
        if self.on_unsupported not in ON_UNSUPPORTED:
            raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got {self.on_unsupported!r}")
        if not 0.0 <= self.step_start <= self.step_end <= 1.0:
            raise ValueError(f"need 0 <= step_start <= step_end <= 1, got {self.step_start}, {self.step_end}")
        if self.cross_attention not in ("quantized", "exact"):
            raise ValueError(f"cross_attention must be 'quantized' or 'exact', got {self.cross_attention!r}")
        if self.min_seq_len < 0:
            raise ValueError("min_seq_len must be >= 0")
        try:  # here, not when the override is built: the Patch node then names itself in the error
            parse_blocks(self.exact_blocks)
        except ValueError as exc:
            raise ValueError(f"exact_blocks: {exc}") from None
