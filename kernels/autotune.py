"""`auto` that measures: the fastest backend per kind of call, timed on the user's GPU at first use.

The static preference list (registry.auto_order) is a guess made on other GPUs. On a CUDA/ROCm device,
the first call of each kind (TuneKey: dtype, head dims, causal, GQA, mask kind, quantization options and
power-of-two buckets of the query and key lengths) times, on that call's own tensors, SDPA and every
candidate that accepts the call (`ready(call) is None`, which runs a backend's first-use self-check):
one untimed warm-up (compilation, caches), SETTLE_MS of calls whose times are not kept (the GPU's clocks
settle to this backend's load), then up to TIMED_REPEATS repeats timed with CUDA events, each right behind
LOAD_MS of queued GEMMs (as inside a model step, where attention follows the block's matrix multiplications
and the GPU sits at its power cap), the median kept. A
candidate whose first timed repeat is over DROP_FACTOR x the fastest so far is not repeated. When the
fastest quantized candidate lands near the bar (CLOSE_CALL, a ratio to SDPA between 0.90 and 1.03), it and
SDPA are timed CLOSE_CALL_TURNS more times in turns, each turn settled first, and the medians of all their
repeats decide: a drift in the GPU's state while SDPA was measured first cannot then tip the choice.
A quantized backend is taken only when it beats SDPA by QUANTIZED_MUST_BEAT: `auto` never
picks one slower than exact attention on the measured shape. A candidate that raises while measured is
left out with its reason; nothing here ever raises to the caller.

Decisions live in memory and on disk (one entry per kind of call, GPU identity, driver, torch, pack version
and kernel source digest, in the cache folder's auto_decisions/: kernels/disk_cache.py). SAGE_RDNA4_AUTOTUNE=0
turns measuring off (the static order decides); SAGE_RDNA4_AUTOTUNE_CACHE=0 keeps decisions in memory only
(kernels/settings.py). Never imports ComfyUI.
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
TIMED_REPEATS = 3        # per candidate after its warm-up and settling; the median is kept
DROP_FACTOR = 3.0        # a first timed repeat over 3x the fastest so far ends that candidate's measuring
QUANTIZED_MUST_BEAT = 0.97  # a quantized backend must run under 0.97x SDPA: exact attention wins ties and noise
CLOSE_CALL = (0.90, 1.03)  # a best quantized ratio to SDPA in here is measured again, in turns with SDPA
CLOSE_CALL_TURNS = 2       # extra settled (SDPA, candidate) timings for such a close call
# Before its timed calls a backend runs, timed but not kept, until SETTLE_MS of its own GPU time have passed
# (at least SETTLE_CALLS[0] calls, at most SETTLE_CALLS[1]): the GPU's clocks follow the power drawn by what ran
# before, and an unsettled timing misranks (figures: docs/MEASUREMENTS.md, "auto").
SETTLE_MS = 100.0
SETTLE_CALLS = (1, 20)
# Right ahead of each timed call, LOAD_MS of matrix multiplications (LOAD_SIDE x LOAD_SIDE, half precision) are
# queued on the same stream: inside a model step attention follows the block's GEMMs, which hold a GPU at its
# power cap, and a kernel timed alone runs at other clocks (figures: docs/MEASUREMENTS.md, "Clocks under the
# power cap"). Where the operands do not fit in memory, the calls are timed without it.
LOAD_MS = 40.0
LOAD_SIDE = 4096
LOAD_MAX_GEMMS = 400
FILE_FORMAT = 1
# A stored timing is believed only when finite and above 0 and within these ratios to SDPA's: no kernel run is
# 1000x off exact attention either way, so such a number is a damaged or edited entry, and is measured again.
PLAUSIBLE_RATIO = (1e-3, 1e3)

# timer(fn, device) -> milliseconds of one call of fn; injectable so tests need no GPU.
Timer = Callable[[Callable[[], object], torch.device], float]
# power_load(device, dtype) -> a callable that queues the load ahead of a timed call, or None (no load there).
PowerLoad = Callable[[torch.device, torch.dtype], Optional[Callable[[], None]]]


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
    """One call of fn timed with CUDA events on the current stream (waits for it: first use only)."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def gemm_power_load(device: torch.device, dtype: torch.dtype) -> Optional[Callable[[], None]]:
    """A callable that queues about LOAD_MS of GEMMs on the current stream without waiting for them, or None where
    none can run (not a GPU, or no memory for the operands: 3 x 32 MiB)."""
    if device.type != "cuda":
        return None
    half = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16
    try:
        a = torch.randn(LOAD_SIDE, LOAD_SIDE, device=device, dtype=half)
        b, out = torch.randn_like(a), torch.empty_like(a)
        gemm = lambda: torch.matmul(a, b, out=out)  # noqa: E731
        cuda_event_ms(gemm, device)  # the first one sets up the BLAS library
        one = cuda_event_ms(gemm, device)
    except Exception as exc:  # out of memory, or no BLAS for this dtype: time without the load
        log.info("auto times without its power load: %s: %s", type(exc).__name__, exc)
        return None
    count = max(1, min(LOAD_MAX_GEMMS, math.ceil(LOAD_MS / max(one, 1e-3))))

    def load():
        for _ in range(count):
            gemm()
    return load


@dataclass
class Decision:
    """What was measured for one key. `timings` holds median ms per backend, SDPA included."""
    key: TuneKey
    timings: Dict[str, float]
    failed: Dict[str, str] = field(default_factory=dict)   # raised while measured
    refused: Dict[str, str] = field(default_factory=dict)  # why_not at first use (not stored on disk)
    source: str = "measured"                               # or "disk"

    def __post_init__(self):
        sdpa_ms = self.timings[SDPA]
        quantized = sorted((ms, name) for name, ms in self.timings.items() if name != SDPA)
        winners = [name for ms, name in quantized if ms < QUANTIZED_MUST_BEAT * sdpa_ms]
        # Fastest first, SDPA after the quantized backends that beat it; nothing after SDPA is ever taken.
        self.ranking: Tuple[str, ...] = tuple(winners) + (SDPA,)
        self.best_quantized: Optional[Tuple[str, float]] = (
            (quantized[0][1], self.ratio(quantized[0][1])) if quantized else None)
        self.summary = self._summary()

    def ratio(self, name: str) -> float:
        sdpa_ms = self.timings[SDPA]
        return self.timings[name] / sdpa_ms if sdpa_ms > 0 else math.inf

    def sdpa_reason(self) -> str:
        """Why a quantized-only caller gets nothing: exact attention is the fastest here."""
        return f"auto: {self._why_sdpa()}"

    def _why_sdpa(self) -> str:
        if self.best_quantized is None:
            return "no quantized kernel could be measured on this shape"
        name, ratio = self.best_quantized
        if ratio > 1.0:
            return f"SDPA measured faster on this shape (best quantized: {name} {ratio:.2f}x SDPA)"
        return f"SDPA kept on this shape (best quantized: {name} {ratio:.2f}x SDPA, not under {QUANTIZED_MUST_BEAT}x)"

    def _summary(self) -> str:
        chosen = self.ranking[0]
        head = f"auto chose {chosen}: " + (f"{self.ratio(chosen):.2f}x SDPA" if chosen != SDPA else self._why_sdpa())
        measured = ", ".join(f"{name} {self.ratio(name):.2f}x" for name in sorted(self.timings, key=self.timings.get))
        failed = "".join(f"; {name}: {reason}" for name, reason in self.failed.items())
        origin = "; from disk" if self.source == "disk" else ""
        return f"{head} at ({self.key.label()}) [measured: {measured}{failed}{origin}]"

    def to_json(self, candidates: Sequence[str]) -> dict:
        return {"timings": self.timings, "failed": self.failed, "candidates": sorted(candidates)}

    @classmethod
    def from_json(cls, key: TuneKey, entry: dict) -> "Decision":
        timings = {str(n): float(ms) for n, ms in entry["timings"].items()}
        failed = {str(n): str(r) for n, r in entry.get("failed", {}).items()}
        return cls(key, timings, failed, source="disk")


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
    """Decisions on disk: one entry per TuneKey, GPU identity, pack version and code digest, in the cache
    folder's auto_decisions/ (kernels/disk_cache.py; `root`: another folder for them). A corrupt entry is a
    miss and is removed; one measured among other candidates, or with implausible timings, is measured again
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

    def header(self, device: torch.device) -> Optional[dict]:
        identity = self._identity(device)
        if identity is None:
            return None
        return {"format": FILE_FORMAT, "identity": identity, "pack": pack_version(), "code": code_digest()}

    def _entry_key(self, device: torch.device, key: TuneKey) -> Tuple[Optional[str], Optional[dict]]:
        """(entry key, header) of this device's decision for `key`; (None, None) when off or the GPU is unknown."""
        if not self.enabled:
            return None, None
        header = self.header(device)
        if header is None:
            return None, None
        return cache_key(kind="auto decision", tune_key=key.ident(), header=header), header

    def load(self, device: torch.device, key: TuneKey, candidates: Sequence[str]) -> Optional[Decision]:
        """The stored decision for key, if it was measured among exactly these candidates."""
        try:
            entry_key, _ = self._entry_key(device, key)
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
            entry_key, header = self._entry_key(device, decision.key)
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
    """Measured decisions per (device, TuneKey); thread-safe. `timer`, `store` and `power_load` are injectable
    for tests."""

    def __init__(self, timer: Optional[Timer] = None, store: Optional[DecisionStore] = None,
                 enabled: Optional[bool] = None, require_cuda: bool = True, power_load: Optional[PowerLoad] = None):
        self.timer = timer or cuda_event_ms
        self.power_load = power_load or gemm_power_load
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

    def decision_for(self, call) -> Optional[Decision]:
        return self._decisions.get((call.device_type, call.device_index, tune_key(call)))

    def clear(self) -> None:
        with self._lock:
            self._decisions.clear()

    def applies(self, call, tensors) -> bool:
        """Whether `auto` may answer this call from a measured decision (on the CPU it never does)."""
        if not self.enabled or tensors is None:
            return False
        return call.device_type == "cuda" or not self.require_cuda

    def may_measure_now(self, call, attn_mask) -> bool:
        if self.require_cuda and _capturing_or_compiling():
            return False
        return call.mask == "none" or attn_mask is not None  # a masked call is timed with its mask only

    def choose(self, call, candidates: Sequence, sdpa, tensors, sm_scale: Optional[float] = None,
               attn_mask=None) -> Optional[Tuple[object, Dict[str, str], Decision]]:
        """(backend, skipped, decision) from a measured decision, or None: use the static order.

        `candidates` are the quantized backends in the static order; `sdpa` is the exact yardstick. The
        backend returned is a candidate that accepts `call`, or `sdpa` when it is the fastest that does.
        A decision made earlier also serves calls that could not be measured now (a CUDA graph capture)."""
        if not self.applies(call, tensors):
            return None
        key = (call.device_type, call.device_index, tune_key(call))
        decision = self._decisions.get(key, _NOT_DECIDED)
        judged_here = False
        if decision is _NOT_DECIDED:
            if not self.may_measure_now(call, attn_mask):
                return None
            decision, judged_here = self._decide(key, call, candidates, sdpa, tensors, sm_scale, attn_mask)
        if decision is None:
            return None
        return self._pick(decision, call, candidates, sdpa, judged_here)

    # -- one decision ------------------------------------------------------------------------------
    def _decide(self, key, call, candidates, sdpa, tensors, sm_scale, attn_mask) -> Tuple[Optional[Decision], bool]:
        """The decision for key, and whether this call's candidates were judged (`ready`) in making it."""
        with self._lock:
            if key in self._decisions:  # another thread measured it while we waited
                return self._decisions[key], False
            started = time.perf_counter()
            try:
                decision = self._measure_or_load(key[2], call, candidates, sdpa, tensors, sm_scale, attn_mask)
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
        if not accepted:
            return None  # nothing quantized to weigh: the static order reports why
        names = [b.name for b in accepted]
        device = tensors[0].device
        stored = self.store.load(device, key, names)
        if stored is not None:
            stored.refused = refused
            return stored
        if sm_scale is None:
            sm_scale = default_sm_scale(call.head_dim)
        timings, failed, transient = self._measure([sdpa] + accepted, call, tensors, sm_scale, attn_mask)
        if SDPA not in timings:
            return None
        decision = Decision(key, timings, failed, refused)
        if not transient:  # an out-of-memory is this moment's, not the shape's: measure again next process
            self.store.save(device, decision, names)
        return decision

    def _measure(self, backends, call, tensors, sm_scale, attn_mask):
        """Median ms per backend (SDPA first, the yardstick), failures by name, and whether one ran out of memory."""
        q, k, v = tensors
        device = q.device
        samples: Dict[str, List[float]] = {}
        runs: Dict[str, Callable[[], object]] = {}
        failed: Dict[str, str] = {}
        transient = False
        best = math.inf
        with torch.no_grad():
            load = self.power_load(device, q.dtype)
            for backend in backends:
                def run(backend=backend):  # judged ready above: timed as the override's calls run it
                    return backend.launch(q, k, v, call, sm_scale, attn_mask)
                try:
                    times = self._timed_repeats(run, device, best, load)
                except Exception as exc:
                    transient |= isinstance(exc, torch.cuda.OutOfMemoryError)
                    failed[backend.name] = f"failed while auto measured it: {type(exc).__name__}: {exc}"
                    if backend.name == SDPA:
                        break  # without the yardstick nothing can be judged
                    continue
                samples[backend.name], runs[backend.name] = times, run
                best = min(best, statistics.median(times))
            close = self._close_call(samples)
            if close is not None:
                try:
                    for _ in range(CLOSE_CALL_TURNS):
                        for name in (SDPA, close):
                            self._settle(runs[name], device)
                            samples[name].append(self._timed(runs[name], device, load))
                except Exception as exc:  # it ran before: keep what was measured then, and say why it stopped
                    transient |= isinstance(exc, torch.cuda.OutOfMemoryError)
                    log.info("auto's second measurement of %s stopped: %s: %s", close, type(exc).__name__, exc)
        timings = {name: statistics.median(times) for name, times in samples.items()}
        return timings, failed, transient

    @staticmethod
    def _close_call(samples: Dict[str, List[float]]) -> Optional[str]:
        """The fastest quantized backend when its ratio to SDPA lies within CLOSE_CALL, else None."""
        if SDPA not in samples:
            return None
        sdpa_ms = statistics.median(samples[SDPA])
        quantized = [(statistics.median(times), name) for name, times in samples.items() if name != SDPA]
        if not quantized or sdpa_ms <= 0:
            return None
        ms, name = min(quantized)
        return name if CLOSE_CALL[0] <= ms / sdpa_ms <= CLOSE_CALL[1] else None

    def _settle(self, run, device) -> None:
        """Runs `run` until SETTLE_MS of its GPU time have passed (SETTLE_CALLS bounds the count)."""
        elapsed, calls = 0.0, 0
        while calls < SETTLE_CALLS[0] or (elapsed < SETTLE_MS and calls < SETTLE_CALLS[1]):
            elapsed += self.timer(run, device)
            calls += 1

    def _timed(self, run, device, load) -> float:
        """One timed call of `run`, right behind the power load where there is one (queued, not waited for)."""
        if load is not None:
            load()
        return self.timer(run, device)

    def _timed_repeats(self, run, device, best: float, load=None) -> List[float]:
        run()  # warm-up: compilation and caches, not timed (its time says nothing of the steady state)
        self._settle(run, device)
        first = self._timed(run, device, load)
        if first > DROP_FACTOR * best:
            return [first]  # clearly slower: one repeat is enough to rank it
        return [first] + [self._timed(run, device, load) for _ in range(TIMED_REPEATS - 1)]

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


_DEFAULT: Optional[Autotuner] = None


def default_tuner() -> Autotuner:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Autotuner()
    return _DEFAULT
