"""`auto` that measures: per kind of call, a quantized backend only where it was measured faster than SDPA.

Two ways to measure, one decision format:
  * **in the step** (the ComfyUI override, `IN_STEP`): the model's own calls are the measurement. While a
    kind of call (TuneKey) is undecided, its calls are spread over SDPA and each candidate that accepts it,
    each timed with device events on the model's stream and read at the step boundary
    (kernels/step_trials.py). Once decided, a quantized choice stays watched and reverts to SDPA when it turns
    slow.
  * **alone** (`ALONE`: the public API and the benchmark, where there is no step): the first call of each kind
    times, on its own tensors, SDPA and every candidate: one untimed warm-up, then TIMED_REPEATS timed calls,
    the median kept. Inside a model step a kernel can run at other clocks than alone (docs/MEASUREMENTS.md,
    "Clocks under the power cap"), so the ComfyUI path never uses these.
Either way a quantized backend is taken only when its measured ratio to SDPA is at most 1 - MARGIN: `auto`
never picks one the measurement did not show faster than exact attention. A candidate that raises while
measured is left out with its reason; nothing here ever raises to the caller.

Decisions live in memory and on disk (one entry per kind of call, way of measuring, GPU identity, driver,
torch, pack version and kernel source digest, in the cache folder's auto_decisions/: kernels/disk_cache.py).
SAGE_RDNA4_AUTOTUNE=0 turns measuring off (the static order decides); SAGE_RDNA4_AUTOTUNE_CACHE=0 keeps
decisions in memory only (kernels/settings.py). Never imports ComfyUI.
"""
from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import settings
from .cache_identity import code_digest, gpu_identity, pack_version
from .disk_cache import AUTO_DECISIONS, EntryStore, cache_key
from .quant import default_sm_scale

log = logging.getLogger(__name__)

SDPA = "sdpa"
IN_STEP, ALONE = "in step", "alone"  # how a decision was measured
# A quantized backend must measure at most 1 - MARGIN times SDPA to be taken, and a watched choice reverts when
# it measures over 1 + MARGIN: exact attention wins ties and noise (why 3 %: docs/MEASUREMENTS.md, "auto in the
# step").
MARGIN = 0.03
QUANTIZED_MUST_BEAT = 1.0 - MARGIN
TIMED_REPEATS = 3  # alone: timed calls per candidate after its warm-up; the median is kept
FILE_FORMAT = 2    # 2: entries say how they were measured
# A stored timing is believed only when finite and above 0 and within these ratios to SDPA's: no kernel run is
# 1000x off exact attention either way, so such a number is a damaged or edited entry, and is measured again.
PLAUSIBLE_RATIO = (1e-3, 1e3)

# timer(fn, device) -> milliseconds of one call of fn; injectable so tests need no GPU.
Timer = Callable[[Callable[[], object], torch.device], float]


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


def cuda_event_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of fn timed with CUDA events on the current stream (waits for it: `alone` only)."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


@dataclass
class Decision:
    """What was measured for one key. `timings` holds median ms per backend, SDPA included; `samples` how many
    timed calls each median is over; `reverted` why a choice was taken back by the watch (then only SDPA runs)."""
    key: TuneKey
    timings: Dict[str, float]
    failed: Dict[str, str] = field(default_factory=dict)   # raised while measured
    refused: Dict[str, str] = field(default_factory=dict)  # why_not at first use (not stored on disk)
    source: str = "measured"                               # or "disk"
    method: str = ALONE
    samples: Dict[str, int] = field(default_factory=dict)
    reverted: Optional[str] = None
    candidates: Tuple[str, ...] = ()  # the quantized backends it was measured among (the disk entry's key)

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
                "method": self.method, "samples": self.samples, "reverted": self.reverted}

    @classmethod
    def from_json(cls, key: TuneKey, entry: dict) -> "Decision":
        timings = {str(n): float(ms) for n, ms in entry["timings"].items()}
        failed = {str(n): str(r) for n, r in entry.get("failed", {}).items()}
        samples = {str(n): int(c) for n, c in (entry.get("samples") or {}).items()}
        reverted = entry.get("reverted")
        return cls(key, timings, failed, source="disk", method=str(entry.get("method", ALONE)), samples=samples,
                   reverted=str(reverted) if reverted else None)


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
    and replaced."""

    LABEL = "autotune"

    def __init__(self, root: Optional[str] = None, enabled: Optional[bool] = None,
                 identity: Callable[[torch.device], Optional[dict]] = gpu_identity):
        self._root = root
        self._enabled = enabled
        self._identity = identity
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
        try:
            entry_key, _ = self._entry_key(device, key, method)
            if entry_key is None:
                return None
            entry = self.entries().load_json(entry_key, self.LABEL)
            if not isinstance(entry, dict) or entry.get("candidates") != sorted(candidates):
                return None  # a backend came or went since: measure again
            decision = Decision.from_json(key, entry)
            problem = implausible(decision.timings)
            if problem:
                log.warning("auto's stored decision for (%s) is implausible (%s); measuring again", key.label(),
                            problem)
                return None
            return decision if set(decision.timings) <= set(candidates) | {SDPA} else None
        except Exception:  # a corrupt cache is never a reason to fail a call
            return None

    def save(self, device: torch.device, decision: Decision, candidates: Sequence[str]) -> Optional[str]:
        """Write the decision's entry; its path, or None when nothing was written."""
        try:
            entry_key, header = self._entry_key(device, decision.key, decision.method)
            if entry_key is None:
                return None
            return self.entries().store_json(entry_key, self.LABEL, decision.to_json(candidates),
                                             {"header": header, "tune_key": decision.key.ident()})
        except Exception as exc:
            log.info("could not write the autotune cache: %s: %s", type(exc).__name__, exc)
            return None


def _capturing_or_compiling() -> bool:
    """Timing would break a CUDA graph capture or a torch.compile trace: those keep the static order."""
    try:
        if torch.cuda.is_current_stream_capturing():
            return True
    except Exception:
        pass
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


_NOT_DECIDED = object()


class _DecideLater(Exception):
    """A candidate could not be judged now and nothing says it will stay so (its first-use check ran out of
    memory): a decision made without it would leave it out for the rest of the process."""


class Autotuner:
    """Measured decisions per (way of measuring, device, TuneKey); thread-safe. This class measures alone (the
    public API); step_trials.InStepTuner adds the in-step way. `timer` and `store` are injectable for tests."""

    def __init__(self, timer: Optional[Timer] = None, store: Optional[DecisionStore] = None,
                 enabled: Optional[bool] = None, require_cuda: bool = True):
        self.timer = timer or cuda_event_ms
        self.store = store if store is not None else DecisionStore()
        self._enabled = enabled
        self.require_cuda = require_cuda  # tests with fake timers run the same logic on the CPU
        self._decisions: Dict[tuple, Optional[Decision]] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._enabled if self._enabled is not None else settings.autotune_enabled()

    def decisions(self) -> List[Decision]:
        """Every decision made or loaded in this process (for reports and the benchmark)."""
        return [d for d in list(self._decisions.values()) if d is not None]

    def decision_for(self, call, method: str = ALONE) -> Optional[Decision]:
        return self._decisions.get(self._key(call, method))

    @staticmethod
    def _key(call, method: str) -> tuple:
        return (method, call.device_type, call.device_index, tune_key(call))

    def clear(self) -> None:
        with self._lock:
            self._decisions.clear()

    def applies(self, call, tensors) -> bool:
        """Whether `auto` may answer this call from a measured decision (on the CPU it never does)."""
        if not self.enabled or tensors is None:
            return False
        return call.device_type == "cuda" or not self.require_cuda

    def may_measure_now(self, call, attn_mask) -> bool:
        if _capturing_or_compiling():
            return False
        return call.mask == "none" or attn_mask is not None  # a masked call is timed with its mask only

    def _accepted(self, call, candidates, sdpa):
        """(candidates ready for `call`, refusals by name), or None where nothing can be weighed."""
        if sdpa.why_not(call) is not None:
            return None  # no yardstick (e.g. the LSE is asked for): the static order decides
        accepted, refused = [], {}
        for backend in candidates:
            reason = backend.ready(call)  # runs the backend's first-use self-check
            if reason is None:
                accepted.append(backend)
            elif backend.why_not(call) is None:  # refused, yet no verdict recorded: the check could not run
                raise _DecideLater(reason)
            else:
                refused[backend.name] = reason
        return (accepted, refused) if accepted else None  # nothing quantized to weigh: the static order says why

    # -- alone (the public API, the benchmark) ------------------------------------------------------
    def choose(self, call, candidates: Sequence, sdpa, tensors, sm_scale: Optional[float] = None,
               attn_mask=None) -> Optional[Tuple[object, Dict[str, str], Decision]]:
        """(backend, skipped, decision) from a decision measured alone, or None: use the static order.

        `candidates` are the quantized backends in the static order; `sdpa` is the exact yardstick. The
        backend returned is a candidate that accepts `call`, or `sdpa` when it is the fastest that does.
        A decision made earlier also serves calls that could not be measured now (a CUDA graph capture)."""
        if not self.applies(call, tensors):
            return None
        key = self._key(call, ALONE)
        decision = self._decisions.get(key, _NOT_DECIDED)
        judged_here = False
        if decision is _NOT_DECIDED:
            if not self.may_measure_now(call, attn_mask):
                return None
            decision, judged_here = self._decide(key, call, candidates, sdpa, tensors, sm_scale, attn_mask)
        if decision is None:
            return None
        return self._pick(decision, call, candidates, sdpa, judged_here)

    def _decide(self, key, call, candidates, sdpa, tensors, sm_scale, attn_mask) -> Tuple[Optional[Decision], bool]:
        """The decision for key, and whether this call's candidates were judged (`ready`) in making it."""
        with self._lock:
            if key in self._decisions:  # another thread measured it while we waited
                return self._decisions[key], False
            started = time.perf_counter()
            try:
                decision = self._measure_or_load(key[3], call, candidates, sdpa, tensors, sm_scale, attn_mask)
            except _DecideLater as exc:  # nothing kept: the static order serves this call, a later one measures
                log.info("auto measures %s on a later call: %s", call.short(), exc)
                return None, True
            except Exception as exc:  # measuring must never take the call down: fall back to the static order
                log.warning("auto could not measure %s: %s: %s; using the static order", call.short(),
                            type(exc).__name__, exc)
                decision = None
            self._decisions[key] = decision
        if decision is not None:  # the time says what measuring cost this first call
            log.info("%s (%.2f s)", decision.summary, time.perf_counter() - started)
        return decision, True

    def _measure_or_load(self, key: TuneKey, call, candidates, sdpa, tensors, sm_scale, attn_mask):
        found = self._accepted(call, candidates, sdpa)
        if found is None:
            return None
        accepted, refused = found
        names = [b.name for b in accepted]
        device = tensors[0].device
        stored = self.store.load(device, key, names, ALONE)
        if stored is not None:
            stored.refused = refused
            return stored
        if sm_scale is None:
            sm_scale = default_sm_scale(call.head_dim)
        timings, failed, transient = self._measure([sdpa] + accepted, call, tensors, sm_scale, attn_mask)
        if SDPA not in timings:
            return None
        decision = Decision(key, timings, failed, refused, samples={n: TIMED_REPEATS for n in timings})
        if not transient:  # an out-of-memory is this moment's, not the shape's: measure again next process
            self.store.save(device, decision, names)
        return decision

    def _measure(self, backends, call, tensors, sm_scale, attn_mask):
        """Median ms per backend (SDPA first, the yardstick), failures by name, and whether one ran out of memory."""
        q, k, v = tensors
        device = q.device
        timings: Dict[str, float] = {}
        failed: Dict[str, str] = {}
        transient = False
        with torch.no_grad():
            for backend in backends:
                def run(backend=backend):  # judged ready above: timed as the public call runs it
                    return backend.launch(q, k, v, call, sm_scale, attn_mask)
                try:
                    run()  # warm-up: compilation and caches, not timed
                    timings[backend.name] = statistics.median(self.timer(run, device) for _ in range(TIMED_REPEATS))
                except Exception as exc:
                    transient |= isinstance(exc, torch.cuda.OutOfMemoryError)
                    failed[backend.name] = f"failed while auto measured it: {type(exc).__name__}: {exc}"
                    if backend.name == SDPA:
                        break  # without the yardstick nothing can be judged
        return timings, failed, transient

    # -- one call ----------------------------------------------------------------------------------
    @staticmethod
    def _pick(decision: Decision, call, candidates, sdpa, judged_here: bool = False):
        """The fastest measured backend that accepts this very call; SDPA once none ahead of it does.

        `judged_here`: the decision was made on this very call, whose measured candidates were found ready."""
        by_name = {b.name: b for b in candidates}
        skipped = {**decision.refused, **decision.failed}
        for name in decision.ranking:
            if name == SDPA:
                break
            backend = by_name.get(name)
            if backend is None:
                continue
            # Another call of the bucket: a self-check failure since, or a limit this call hits, shows here.
            reason = None if judged_here else backend.ready(call)
            if reason is None:
                return backend, skipped, decision
            skipped[name] = reason
        return sdpa, skipped, decision


# Made at import (it is cheap: no device or disk is touched before its first decision), so threads making the
# first plans at once share one tuner and its decisions.
_DEFAULT = Autotuner()


def default_tuner() -> Autotuner:
    return _DEFAULT
