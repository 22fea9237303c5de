"""auto's decisions: what was measured for one kind of call, and where it is kept.

A kind of call is a `TuneKey` (dtype, head dims, causal, GQA, length buckets, mask kind, quantization options):
what, besides the GPU, makes one backend faster than another. A `Decision` holds the times measured for it, SDPA
included, and ranks the quantized backends that beat SDPA by the margin. `DecisionBook` keeps them in memory per
(way of measuring, device, key); `DecisionStore` on disk (one entry per key, way of measuring, GPU identity,
driver, torch, pack version and kernel source digest, in the cache folder's auto_decisions/:
kernels/disk_cache.py). SAGE_RDNA4_AUTOTUNE_CACHE=0 keeps decisions in memory only (kernels/settings.py).
Measuring itself is kernels/tuner.py's job. Never imports ComfyUI.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import settings
from .cache_identity import code_digest, gpu_identity, pack_version
from .disk_cache import AUTO_DECISIONS, EntryStore, cache_key

log = logging.getLogger(__name__)

SDPA = "sdpa"
IN_STEP, ALONE = "in step", "alone"  # how a decision was measured
# A quantized backend must measure at most 1 - MARGIN times SDPA to be taken, and a watched choice reverts when
# it measures over 1 + MARGIN: exact attention wins ties and noise (why 3 %: docs/MEASUREMENTS.md, "auto in the
# step").
MARGIN = 0.03
QUANTIZED_MUST_BEAT = 1.0 - MARGIN
FILE_FORMAT = 2    # 2: entries say how they were measured
# A stored timing is believed only when finite and above 0 and within these ratios to SDPA's: no kernel run is
# 1000x off exact attention either way, so such a number is a damaged or edited entry, and is measured again.
PLAUSIBLE_RATIO = (1e-3, 1e3)

def length_bucket(n: int) -> int:
    """The power of two at or above n: calls of similar length share one measurement."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class TuneKey:
    """What, besides the GPU, makes one backend faster than another for a call."""
    dtype: str
    head_dim: int
    v_head_dim: int
    causal: bool
    gqa: bool
    q_bucket: int
    k_bucket: int
    mask: str
    options: str  # prologue, qk_group, smooth_k, smooth_v: they select different code

    def label(self) -> str:
        """Short, for notes and reports."""
        dims = f"D{self.head_dim}" + (f"/Dv{self.v_head_dim}" if self.v_head_dim != self.head_dim else "")
        extras = "".join((", causal" if self.causal else "", ", GQA" if self.gqa else "",
                          f", {self.mask} mask" if self.mask != "none" else ""))
        return f"{self.dtype}, {dims}, Nq<={self.q_bucket}, Nk<={self.k_bucket}{extras}"

    def ident(self) -> str:
        """Complete and stable: the entry's name in the JSON file."""
        return (f"{self.label()} | mask={self.mask} causal={int(self.causal)} gqa={int(self.gqa)} "
                f"| {self.options}")


def tune_key(call) -> TuneKey:
    options = (f"prologue={call.prologue} qk={call.qk_group} smooth_k={int(call.smooth_k)} "
               f"smooth_v={int(call.smooth_v)}")
    return TuneKey(dtype=str(call.dtype).replace("torch.", ""), head_dim=call.head_dim, v_head_dim=call.v_head_dim,
                   causal=call.is_causal, gqa=call.q_heads != call.kv_heads, q_bucket=length_bucket(call.q_len),
                   k_bucket=length_bucket(call.kv_len), mask=call.mask, options=options)


@dataclass
class Decision:
    """What was measured for one key. `timings` holds median ms per backend, SDPA included; `samples` how many
    timed calls each median is over; `reverted` why a choice was taken back by the watch (then only SDPA runs)."""
    key: TuneKey
    timings: Dict[str, float]
    failed: Dict[str, str] = field(default_factory=dict)   # raised while measured
    passed_over: Dict[str, str] = field(default_factory=dict)  # not measured: why each refused (not stored on disk)
    source: str = "measured"                               # or "disk"
    method: str = ALONE
    samples: Dict[str, int] = field(default_factory=dict)
    reverted: Optional[str] = None
    candidates: Tuple[str, ...] = ()  # the quantized backends it was measured among (the disk entry's key)
    # Timed again in a later step (of this process or the one that measured it) and found to hold: an SDPA choice
    # with it is not timed again in later processes (kernels/tuner.py, `Tuner._checked_name`).
    confirmed: bool = False

    def __post_init__(self):
        sdpa_ms = self.timings[SDPA]
        quantized = sorted((ms, name) for name, ms in self.timings.items() if name != SDPA)
        winners = [name for ms, name in quantized if ms <= QUANTIZED_MUST_BEAT * sdpa_ms]
        # Fastest first, SDPA after the quantized backends that beat it; nothing after SDPA is ever taken.
        self.ranking: Tuple[str, ...] = (SDPA,) if self.reverted else tuple(winners) + (SDPA,)
        self.best_quantized: Optional[Tuple[str, float]] = (
            (quantized[0][1], self.ratio(quantized[0][1])) if quantized else None)
        self.summary = self._summary()

    @property
    def chosen(self) -> str:
        return self.ranking[0]

    def ratio(self, name: str) -> float:
        sdpa_ms = self.timings[SDPA]
        return self.timings[name] / sdpa_ms if sdpa_ms > 0 else math.inf

    def sdpa_reason(self) -> str:
        """Why a quantized-only caller gets nothing: exact attention is the fastest here."""
        return f"auto: {self._why_sdpa()}"

    def _why_sdpa(self) -> str:
        if self.reverted:
            return self.reverted
        if self.best_quantized is None:
            return "no quantized kernel could be measured on this shape"
        name, ratio = self.best_quantized
        where = " in the step" if self.method == IN_STEP else ""
        if ratio > 1.0:
            return f"SDPA measured faster{where} on this shape (best quantized: {name} {ratio:.2f}x SDPA)"
        return (f"SDPA kept{where} on this shape (best quantized: {name} {ratio:.2f}x SDPA, not at or under "
                f"{QUANTIZED_MUST_BEAT:.2f}x)")

    def _summary(self) -> str:
        chosen = self.chosen
        head = f"auto chose {chosen}: " + (f"{self.ratio(chosen):.2f}x SDPA" if chosen != SDPA else self._why_sdpa())
        measured = ", ".join(f"{name} {self.ratio(name):.2f}x" + (f" ({self.samples[name]} calls)"
                                                                  if name in self.samples else "")
                             for name in sorted(self.timings, key=self.timings.get))
        failed = "".join(f"; {name}: {reason}" for name, reason in self.failed.items())
        origin = "; from disk" if self.source == "disk" else ""
        return f"{head} at ({self.key.label()}) [measured {self.method}: {measured}{failed}{origin}]"

    def as_row(self) -> dict:
        """Per kind of call, for reports: what was chosen and its measured ratio to SDPA."""
        return {"kind": self.key.label(), "chosen": self.chosen, "ratio": self.ratio(self.chosen),
                "method": self.method, "reverted": self.reverted, "source": self.source,
                "ratios": {name: self.ratio(name) for name in self.timings}, "samples": dict(self.samples)}

    def to_json(self, candidates: Sequence[str]) -> dict:
        return {"timings": self.timings, "failed": self.failed, "candidates": sorted(candidates),
                "method": self.method, "samples": self.samples, "reverted": self.reverted, "confirmed": self.confirmed}

    @classmethod
    def from_json(cls, key: TuneKey, entry: dict) -> "Decision":
        timings = {str(n): float(ms) for n, ms in entry["timings"].items()}
        failed = {str(n): str(r) for n, r in entry.get("failed", {}).items()}
        samples = {str(n): int(c) for n, c in (entry.get("samples") or {}).items()}
        reverted = entry.get("reverted")
        return cls(key, timings, failed, source="disk", method=str(entry.get("method", ALONE)), samples=samples,
                   reverted=str(reverted) if reverted else None, confirmed=entry.get("confirmed") is True)


def implausible(timings: Dict[str, float]) -> Optional[str]:
    """What makes stored `timings` unbelievable (see PLAUSIBLE_RATIO), or None."""
    if SDPA not in timings:
        return "no SDPA timing"
    for name, ms in timings.items():
        if not (math.isfinite(ms) and ms > 0):
            return f"{name} {ms} ms"
    sdpa_ms, (low, high) = timings[SDPA], PLAUSIBLE_RATIO
    for name, ms in timings.items():
        if not low <= ms / sdpa_ms <= high:
            return f"{name} {ms:.4g} ms is {ms / sdpa_ms:.3g}x SDPA's {sdpa_ms:.4g} ms, outside {low:g}-{high:g}x"
    return None


class DecisionStore:
    """Decisions on disk: one entry per TuneKey, way of measuring, GPU identity, pack version and code digest, in
    the cache folder's auto_decisions/ (kernels/disk_cache.py; `root`: another folder for them). A corrupt entry
    is a miss and is removed; one measured among other candidates, or with implausible timings, is measured again
    and replaced. Given `installed` (what is installed now: `registry.installed_packages`, which the tuner hands
    it), each entry also keeps that, and `load_unchanged` compares it."""

    LABEL = "autotune"

    def __init__(self, root: Optional[str] = None, enabled: Optional[bool] = None,
                 identity: Callable[[torch.device], Optional[dict]] = gpu_identity,
                 installed: Optional[Callable[[], Dict[str, str]]] = None):
        self._root = root
        self._enabled = enabled
        self._identity = identity
        self._installed = installed
        self._entries: Optional[EntryStore] = None

    @property
    def enabled(self) -> bool:
        return self._enabled if self._enabled is not None else settings.autotune_cache_enabled()

    def entries(self) -> EntryStore:
        if self._entries is None:
            self._entries = EntryStore(AUTO_DECISIONS, self._root)
        return self._entries

    def header(self, device: torch.device, method: str = ALONE) -> Optional[dict]:
        identity = self._identity(device)
        if identity is None:
            return None
        return {"format": FILE_FORMAT, "identity": identity, "pack": pack_version(), "code": code_digest(),
                "method": method}

    def _entry_key(self, device: torch.device, key: TuneKey, method: str) -> Tuple[Optional[str], Optional[dict]]:
        """(entry key, header) of this device's decision for `key`; (None, None) when off or the GPU is unknown."""
        if not self.enabled:
            return None, None
        header = self.header(device, method)
        if header is None:
            return None, None
        return cache_key(kind="auto decision", tune_key=key.ident(), header=header), header

    def load(self, device: torch.device, key: TuneKey, candidates: Sequence[str],
             method: str = ALONE) -> Optional[Decision]:
        """The stored decision for key, if it was measured among exactly these candidates."""
        return self._load(device, key, method, lambda entry: entry.get("candidates") == sorted(candidates))

    def load_unchanged(self, device: torch.device, key: TuneKey, method: str = ALONE) -> Optional[Decision]:
        """The stored decision for key, whatever it was measured among, if every package a backend rests on is
        installed as it was when the decision was stored: no candidate is asked anything. Its `candidates` are the
        stored ones."""
        if self._installed is None:
            return None
        # Quiet about an implausible entry: the candidates' own recall (`load`) follows and says it once.
        return self._load(device, key, method, lambda entry: entry.get("installed") == self._installed(), warn=False)

    def _load(self, device, key, method, still_valid, warn: bool = True) -> Optional[Decision]:
        try:
            entry_key, _ = self._entry_key(device, key, method)
            if entry_key is None:
                return None
            entry = self.entries().load_json(entry_key, self.LABEL)
            if not isinstance(entry, dict) or not isinstance(entry.get("candidates"), list) or not still_valid(entry):
                return None  # a backend came or went since: measure again
            decision = Decision.from_json(key, entry)
            decision.candidates = tuple(str(name) for name in entry["candidates"])
            problem = implausible(decision.timings)
            if problem:
                if warn:
                    log.warning("auto's stored decision for (%s) is implausible (%s); measuring again",
                                key.label(), problem)
                return None
            return decision if set(decision.timings) <= set(decision.candidates) | {SDPA} else None
        except Exception:  # a corrupt cache is never a reason to fail a call
            return None

    def save(self, device: torch.device, decision: Decision, candidates: Sequence[str]) -> Optional[str]:
        """Write the decision's entry; its path, or None when nothing was written."""
        try:
            entry_key, header = self._entry_key(device, decision.key, decision.method)
            if entry_key is None:
                return None
            entry = decision.to_json(candidates)
            if self._installed is not None:
                entry["installed"] = self._installed()
            return self.entries().store_json(entry_key, self.LABEL, entry,
                                             {"header": header, "tune_key": decision.key.ident()})
        except Exception as exc:
            log.info("could not write the autotune cache: %s: %s", type(exc).__name__, exc)
            return None


NOT_DECIDED = object()  # DecisionBook.get for a key nothing was decided for yet


class DecisionBook:
    """auto's decisions in memory, per (way of measuring, device type, device index, TuneKey); thread-safe. A key
    may hold None: nothing can be measured for it in this process (the static order serves it)."""

    def __init__(self):
        self._entries: Dict[tuple, Optional[Decision]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(method: str, call) -> tuple:
        return (method, call.device_type, call.device_index, tune_key(call))

    def get(self, key: tuple):
        """The decision, None (static order), or NOT_DECIDED."""
        return self._entries.get(key, NOT_DECIDED)

    def put(self, key: tuple, decision: Optional[Decision]) -> None:
        with self._lock:
            self._entries[key] = decision

    def forget(self, key: tuple) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def all(self) -> List[Decision]:
        return [d for d in list(self._entries.values()) if d is not None]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
