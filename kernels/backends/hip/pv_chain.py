"""Which P.V accumulation the HIP kernels use on a device: the two-level chain (any accumulator) or the single
chain (kernel_abi.CHAINS), chosen once per device and P.V mode at first use, after the hardware probes.

The single chain serves only where its kernel ships (kernel_abi.SINGLE_CHAIN_PV), the accumulator probe read the
WMMA's C as full FP32 (probes.ProbeReport.single_chain_refusal) and the self-check's cases that see lost P.V mass
(the precision probe and the long tail, backend.ACCUMULATION_CASE_KINDS) pass with it; otherwise the two-level
kernel, as before. SAGE_RDNA4_HIP_PV_CHAIN forces either (a volunteer's comparison: forcing the single chain onto
a unit not read as full FP32 is logged as a warning). The choice and its reason are kept here for the log and the
field report.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ... import settings
from . import kernel_abi

log = logging.getLogger(__name__)
TWO_LEVEL, SINGLE = kernel_abi.CHAINS


@dataclass(frozen=True)
class ChainChoice:
    chain: str
    why: str

    def line(self) -> str:
        return f"{self.chain} P.V ({self.why})"


_CHOICES: Dict[Tuple[str, str, Optional[int]], ChainChoice] = {}
_LOCK = threading.RLock()  # held while a choice is made: concurrent first callers wait for that one


def chosen(pv: str, device_type: str, index: Optional[int]) -> ChainChoice:
    """The choice made for this P.V mode and device; the two-level chain before any was made."""
    return _CHOICES.get((pv, device_type, index)) or ChainChoice(TWO_LEVEL, "no choice made yet: the default")


def recorded(pv: str, device_type: str, index: Optional[int]) -> Optional[ChainChoice]:
    return _CHOICES.get((pv, device_type, index))


def choose(pv: str, device_type: str, index: Optional[int], probe_refusal: Optional[str],
           long_tail: Callable[[], Optional[str]]) -> ChainChoice:
    """Decide once per (pv, device): `probe_refusal` is the probes' answer for the single chain (None: full FP32),
    `long_tail()` runs the self-check's precision-probe and long-tail cases on the single chain (None: passed)."""
    key = (pv, device_type, index)
    with _LOCK:
        if key not in _CHOICES:
            _CHOICES[key] = _decide(pv, probe_refusal, long_tail)
            log.info("hip_int8_%s on %s%s: %s", pv, device_type, "" if index is None else f":{index}",
                     _CHOICES[key].line())
        return _CHOICES[key]


def _decide(pv: str, probe_refusal: Optional[str], long_tail: Callable[[], Optional[str]]) -> ChainChoice:
    forced = settings.hip_pv_chain()
    if pv not in kernel_abi.SINGLE_CHAIN_PV:
        choice = ChainChoice(TWO_LEVEL, f"no single-chain {pv.upper()} kernel ships")
    elif forced == TWO_LEVEL:
        choice = ChainChoice(TWO_LEVEL, f"forced by {settings.HIP_PV_CHAIN.name}")
    elif forced == SINGLE:
        if probe_refusal:
            log.warning("%s=single: the single-chain P.V serves although %s", settings.HIP_PV_CHAIN.name,
                        probe_refusal)
        choice = ChainChoice(SINGLE, f"forced by {settings.HIP_PV_CHAIN.name}"
                                     + (f", although {probe_refusal}" if probe_refusal else ""))
    elif probe_refusal:
        choice = ChainChoice(TWO_LEVEL, probe_refusal)
    else:
        try:
            reason = long_tail()
        except Exception as exc:  # the check could not run (no memory, a launch error): the two-level kernel
            reason = f"it could not run: {type(exc).__name__}: {exc}"
        choice = (ChainChoice(TWO_LEVEL, f"the single chain failed the self-check's accumulation cases: {reason}")
                  if reason else ChainChoice(SINGLE, "the accumulator probe reads full FP32 and the single chain "
                                                     "passes the self-check's precision-probe and long-tail cases"))
    return choice


def stats_line(pv: str) -> Optional[str]:
    """The P.V chain of `pv`'s kernel in a stats line ('single-chain P.V'; per device where devices differ), or
    None before any choice."""
    with _LOCK:
        found = {(t, i): c.chain for (p, t, i), c in _CHOICES.items() if p == pv}
    if not found:
        return None
    if len(set(found.values())) == 1:
        return f"{next(iter(found.values()))} P.V"
    return ", ".join(f"{t}:{i} {c} P.V" for (t, i), c in sorted(found.items(), key=str))


def forget() -> None:
    """Drop the choices (tests)."""
    with _LOCK:
        _CHOICES.clear()
