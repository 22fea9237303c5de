"""Hardware probes: what the HIP kernels assume of the gfx12 instructions, checked on each device at first use.

The probe kernels (src/sage_probes.hip) run one wave each, 10 launches in all; the expected values come from the
spec (AMD's RDNA4 operand layouts in kernel_abi, IEEE/OCP rounding) computed here in torch. Each probe names
the assumption it checks and the backends that rely on it. Verdicts:
  pass     the device did what the kernels assume;
  differs  it did not: the dependent backends are disabled on that device, with the probe named in the reason;
  reading  a fact recorded for the field report that no kernel relies on (FP8 conversion above 448: the kernels
           keep P <= 447.9953 and V at most 448; subnormal WMMA inputs: flushed or kept); the accumulator
           readings (accumulator.py) also decide whether the single-chain P.V may serve (`full_fp32`).
A WMMA probe cannot see a K permutation shared by A and B: the sum over K is the same, and so is every kernel's
result, so such a permutation is harmless. Nothing here has run on RDNA4 hardware yet: the expected values are the
documented layouts and the emulation (CUDA, host simulator) matches them.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ... import first_use_costs
from . import accumulator, pv_chain
from . import kernel_abi as abi

log = logging.getLogger(__name__)

PASS, DIFFERS, READING = "pass", "differs", "reading"
FP8, FP16 = "hip_int8_fp8", "hip_int8_fp16"
BOTH = (FP8, FP16)
QK_BIAS = 0x3E22F983  # sage_attention.hip: the Q.K chain's start, the bits of the float 1/(2 pi)
ACCUMULATOR_PROBES = {FP8: "wmma_fp8_accumulator", FP16: "wmma_f16_accumulator"}


@dataclass(frozen=True)
class ProbeResult:
    name: str
    verdict: str
    found: str
    expected: str
    checks: str  # the assumption
    backends: Tuple[str, ...]  # the backends relying on it (disabled when it differs)
    full_fp32: Optional[bool] = None  # accumulator probes: C keeps full FP32 across a chain

    def as_dict(self) -> Dict:
        out = {"name": self.name, "verdict": self.verdict, "found": self.found, "expected": self.expected,
               "checks": self.checks, "backends": list(self.backends)}
        if self.full_fp32 is not None:
            out["full_fp32"] = self.full_fp32
        return out


@dataclass
class ProbeReport:
    device: str
    results: List[ProbeResult] = field(default_factory=list)
    error: Optional[str] = None  # the probes could not run: every HIP backend is disabled with it
    seconds: float = 0.0
    launches: int = 0

    def failures(self) -> List[ProbeResult]:
        return [r for r in self.results if r.verdict == DIFFERS]

    def disabled_reason(self, backend: str) -> Optional[str]:
        """Why `backend` may not run on this device after the probes, or None."""
        if self.error:
            return f"hardware probes could not run: {self.error}"
        bad = [r for r in self.failures() if backend in r.backends]
        if not bad:
            return None
        return "; ".join(f"hardware probe {r.name} differs ({r.checks}): found {r.found}, expected {r.expected}"
                         for r in bad)

    def single_chain_refusal(self, backend: str) -> Optional[str]:
        """Why `backend`'s single-chain P.V must not serve on this device (its WMMA's accumulator not read as full
        FP32), or None."""
        if self.error:
            return f"hardware probes could not run: {self.error}"
        name = ACCUMULATOR_PROBES[backend]
        found = next((r for r in self.results if r.name == name), None)
        if found is None:
            return f"the accumulator probe {name} did not run"
        return None if found.full_fp32 else f"{name}: {found.found}"

    def summary(self) -> str:
        if self.error:
            return f"hardware probes on {self.device} could not run: {self.error}"
        count = {v: sum(r.verdict == v for r in self.results) for v in (PASS, DIFFERS, READING)}
        readings = ", ".join(f"{r.name}: {r.found}" for r in self.results if r.verdict == READING)
        failed = ", ".join(r.name for r in self.failures())
        return (f"hardware probes on {self.device}: {count[PASS]} passed, {count[DIFFERS]} differ"
                f"{' (' + failed + ')' if failed else ''}; readings: {readings or 'none'}; "
                f"{self.launches} launches in {1e3 * self.seconds:.1f} ms")

    def as_dict(self) -> Dict:
        return {"device": self.device, "error": self.error, "seconds": round(self.seconds, 4),
                "launches": self.launches, "results": [r.as_dict() for r in self.results]}


class _Counting:
    """The `run` function handed to the probes, counting launches."""

    def __init__(self, run: Callable):
        self.run, self.launches = run, 0

    def __call__(self, launches: Sequence) -> None:
        launches = list(launches)
        self.launches += len(launches)
        self.run(launches)


# ------------------------------------------------------------------------------------------ helpers
def _lanes(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], device):
    """The per-lane fragments on `device`; C None stays None (the probe kernel's constant 0)."""
    return (abi.lanes_from_a(a).contiguous().view(torch.int32).to(device),
            abi.lanes_from_b(b).contiguous().view(torch.int32).to(device),
            None if c is None else abi.lanes_from_d(c).contiguous().view(torch.int32).to(device))


def _wmma(run, kind: str, a, b, c, device) -> torch.Tensor:
    lanes = _lanes(a, b, c, device)  # kept alive until the launch has run (a plan holds addresses only)
    d_l, launches = abi.wmma_probe_plan(kind, *lanes)
    run(launches)
    d_l = d_l.cpu()
    return abi.d_from_lanes(d_l if kind == "iu8" else d_l.view(torch.float32))


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """'n of 256 elements differ, first D[i][j] = x (want y)', '' when equal (NaN equal to NaN)."""
    same = (got == want) | (torch.isnan(got.float()) & torch.isnan(want.float()))
    if bool(same.all()):
        return ""
    i, j = [int(t) for t in (~same).nonzero()[0]]
    return (f"{int((~same).sum())} of {same.numel()} elements differ, first D[{i}][{j}] = {got[i, j].item()} "
            f"(want {want[i, j].item()})")


def _layout_case(kind: str):
    """A, B, C with distinct values whose exact products and sums fit fp32: a K order A and B disagree on, a row or
    column permutation, or a misplaced C changes D (fixed seed: the same case on every device)."""
    g = torch.Generator().manual_seed(1234)
    if kind == "iu8":
        a = torch.randint(-128, 128, (16, 16), generator=g, dtype=torch.int32)
        b = torch.randint(-128, 128, (16, 16), generator=g, dtype=torch.int32)
        c = torch.randint(-10 ** 6, 10 ** 6, (16, 16), generator=g, dtype=torch.int32)
        return a.to(torch.int8), b.to(torch.int8), c, a @ b + c
    if kind == "fp8":
        pool = torch.tensor([1.0, -1.0, 2.5, -3.0, 0.125, 448.0, -448.0, 14.0, -0.75, 96.0, 5.0, -6.5])
        cast = torch.float8_e4m3fn
    else:
        pool = torch.tensor([1.0, -1.5, 2.0, 0.25, -7.0, 1024.0, -0.0078125, 3.75, 65.0, -9.0, 11.0])
        cast = torch.float16
    a = pool[torch.randint(0, len(pool), (16, 16), generator=g)]
    b = torch.randint(-4, 5, (16, 16), generator=g).float()
    c = torch.randint(-1000, 1000, (16, 16), generator=g).float()
    return a.to(cast), b.to(cast), c, (a.double() @ b.double() + c.double()).float()


# ------------------------------------------------------------------------------------------ probes
_WMMA_USERS = {"iu8": BOTH, "fp8": (FP8,), "f16": (FP16,)}
_WMMA_NAMES = {"iu8": "wmma_i32_16x16x16_iu8 (signed x signed)", "fp8": "wmma_f32_16x16x16_fp8_fp8",
               "f16": "wmma_f32_16x16x16_f16"}


def probe_wmma_layout(run, device, kind: str) -> ProbeResult:
    a, b, c, want = _layout_case(kind)
    got = _wmma(run, kind, a, b, c, device)
    bad = _mismatch(got, want)
    return ProbeResult(f"wmma_{kind}_layout", DIFFERS if bad else PASS, bad or "D = A.B + C exactly",
                       "D = A.B + C exactly (RDNA4 A/B/C/D placement, K order of AMD's calculator)",
                       f"{_WMMA_NAMES[kind]}: A/B/C/D element placement and K order", _WMMA_USERS[kind])


def probe_qk_bias(run, device) -> ProbeResult:
    a, b, _, _ = _layout_case("iu8")
    dot = a.int() @ b.int()
    a_l, b_l, _ = _lanes(a, b, None, device)
    d_l, f_l, launches = abi.bias_probe_plan(a_l, b_l)
    run(launches)
    raw, unbiased = abi.d_from_lanes(d_l.cpu()), abi.d_from_lanes(f_l.cpu())
    bad = _mismatch(raw, dot + QK_BIAS) or _mismatch(unbiased, dot.float())
    return ProbeResult("iu8_bias_constant", DIFFERS if bad else PASS, bad or "C = 0x3E22F983, unbias_dot exact",
                       "D = 0x3E22F983 + A.B and unbias_dot(D) = A.B exactly",
                       "the iu8 WMMA reads the float inline constant 1/(2 pi) in C as its bit pattern", BOTH)


def _subnormal_case(kind: str):
    """K 0-7: subnormal A times small integers in B; K 8-15: integers in A times subnormal B. Every product is a
    small multiple of the format's subnormal step, so the sums are exact; flushing A, B or both shows."""
    step, cast = (2.0 ** -9, torch.float8_e4m3fn) if kind == "fp8" else (2.0 ** -24, torch.float16)
    g = torch.Generator().manual_seed(99)
    sub = lambda shape: torch.randint(1, 8, shape, generator=g).float() * step  # noqa: E731
    ints = lambda shape: torch.randint(1, 5, shape, generator=g).float()  # noqa: E731
    a = torch.cat([sub((16, 8)), ints((16, 8))], dim=1)
    b = torch.cat([ints((8, 16)), sub((8, 16))], dim=0)
    return a.to(cast), b.to(cast), a, b, step


def probe_wmma_subnormal(run, device, kind: str) -> ProbeResult:
    a8, b8, a, b, step = _subnormal_case(kind)
    got = _wmma(run, kind, a8, b8, None, device)  # C = the constant 0, as the P.V chains start
    a_sub, b_sub = a.abs() < 64 * step, b.abs() < 64 * step
    ways = {"kept": (a, b), "flushed": (a * ~a_sub, b * ~b_sub), "flushed in A only": (a * ~a_sub, b),
            "flushed in B only": (a, b * ~b_sub)}
    found = next((name for name, (x, y) in ways.items()
                  if not _mismatch(got, (x.double() @ y.double()).float())), None)
    fmt = "e4m3" if kind == "fp8" else "f16"
    if found is None:
        found = "neither kept nor flushed: " + _mismatch(got, (a.double() @ b.double()).float())
    users = "P.V below 2^-6 of the row max" if kind == "fp8" else "P.V below 2^-14 of the row max"
    return ProbeResult(f"wmma_{kind}_subnormal", READING, found, "kept (the emulation decodes them exactly)",
                       f"{fmt} subnormal WMMA inputs kept or flushed ({users}; subnormal-accuracy work)",
                       (FP8,) if kind == "fp8" else (FP16,))


def probe_accumulator(run, device, kind: str) -> ProbeResult:
    """A chain of accumulator.STEPS WMMAs whose exact sums tell how many fraction bits C keeps (accumulator.py)."""
    a, b, c = accumulator.operands()
    cast = torch.float8_e4m3fn if kind == "fp8" else torch.float16
    a_l, b_l, c_l = _lanes(a.to(cast), b.to(cast), c, device)
    d_l, launches = abi.acc_probe_plan(kind, a_l, b_l, c_l, accumulator.STEPS)
    run(launches)
    reading = accumulator.read(abi.d_from_lanes(d_l.cpu().view(torch.float32)))
    backend = FP8 if kind == "fp8" else FP16
    return ProbeResult(ACCUMULATOR_PROBES[backend], READING, reading.text(),
                       "full FP32 lets the single-chain P.V serve; fewer bits: the two-level P.V only",
                       f"{_WMMA_NAMES[kind]}: fraction bits C keeps across a chain, rounding or truncation",
                       (backend,), full_fp32=reading.full_fp32)


# In-range inputs (their bytes: torch's RNE e4m3), a subnormal, and the overflow inputs the reading classifies.
_E4M3_EXACT = (0.0, 1.0, 0.3, -2.5, 447.0, 448.0, -448.0, 2.0 ** -6)
_E4M3_SUB = 2.0 ** -8  # 2 steps of 2^-9: byte 0x02
_E4M3_OVER = (449.0, 464.0, 1e6, math.inf, -449.0, -math.inf)


def _is_nan_code(c: int) -> bool:
    return c & 0x7F == 0x7F


def _e4m3_class(over: Dict[float, int]) -> str:
    """What the conversion does past 448, from the bytes of _E4M3_OVER."""
    pos = [over[x] for x in (449.0, 464.0, 1e6, math.inf)]
    sat = [c & 0x7F == 0x7E for c in pos]
    if all(sat):
        kind = "saturates to 448 (Inf included)"
    elif all(_is_nan_code(c) for c in pos):
        kind = "NaN above 448"
    elif sat[0] and sat[1] and all(_is_nan_code(c) for c in pos[2:]):
        kind = "rounds to nearest first, NaN when the rounded value passes 448"
    elif all(sat[:3]) and _is_nan_code(pos[3]):
        kind = "saturates finite values, Inf gives NaN"
    else:
        kind = "unclassified"
    return f"{kind} (" + ", ".join(f"{x:g} -> 0x{c:02X}" for x, c in over.items()) + ")"


def probe_e4m3(run, device) -> List[ProbeResult]:
    xs = list(_E4M3_EXACT) + [_E4M3_SUB, math.nan] + list(_E4M3_OVER)
    xs += [1.0] * (-len(xs) % 4)  # the probe converts 4 values per thread
    x = torch.tensor(xs, dtype=torch.float32).to(device)
    out, launches = abi.e4m3_probe_plan(x)
    run(launches)
    got = [int(c) for c in out.cpu()]
    n = len(_E4M3_EXACT)
    want = [int(c) for c in torch.tensor(_E4M3_EXACT).to(torch.float8_e4m3fn).view(torch.uint8)]
    bad = [f"{xv:g} -> 0x{c:02X} (want 0x{w:02X})" for xv, c, w in zip(_E4M3_EXACT, got, want) if c != w]
    if not _is_nan_code(got[n + 1]):
        bad.append(f"nan -> 0x{got[n + 1]:02X} (want 0x7F or 0xFF)")
    conv = ProbeResult("e4m3_convert", DIFFERS if bad else PASS, "; ".join(bad) or "in-range values and NaN exact",
                       "round to nearest even for |x| <= 448 in pack_e4m3x4's byte order, NaN kept",
                       "v_cvt_pk_fp8_f32 (pack_e4m3x4) in range: P and V quantization", (FP8,))
    sub = got[n]
    over = dict(zip(_E4M3_OVER, got[n + 2:n + 2 + len(_E4M3_OVER)]))
    sub_text = "subnormal 2^-8 kept (0x02)" if sub == 0x02 else f"subnormal 2^-8 -> 0x{sub:02X} (want 0x02)"
    reading = ProbeResult("e4m3_overflow", READING, f"{_e4m3_class(over)}; {sub_text}",
                          "saturates or NaN above 448: either is safe (the kernels keep P <= 447.9953, V <= 448)",
                          "v_cvt_pk_fp8_f32 above 448, at Inf and at a subnormal (no clamp bit on gfx12)", (FP8,))
    return [conv, reading]


def _lane_inputs():
    lane = torch.arange(32, dtype=torch.float32)
    x = torch.empty(64)
    x[:32] = (lane + 1) * 0.25 * torch.where(lane % 2 == 0, 1.0, -1.0)
    x[7] = -11.75  # the largest magnitude: wave_abs_max must find it in every lane
    x[32:] = 1.0 + (2 * lane + 1) * 2.0 ** -11  # half-way between fp16 neighbours: RNE shows
    halves = torch.stack([lane * 0.5, -lane * 0.125 - 1.0], dim=1).half()  # (lo, hi) per lane, exact sums
    w = halves.contiguous().view(torch.int32).view(32)
    return x, w, halves


def probe_lanes(run, device) -> List[ProbeResult]:
    x, w, halves = _lane_inputs()
    x_dev, w_dev = x.to(device), w.to(device)
    out, launches = abi.lane_probe_plan(x_dev, w_dev)
    run(launches)
    rows = out.cpu()
    lane = torch.arange(32)
    v = x[:32]
    want = {name: v[lane ^ m] for name, m in (("lane_xor<1>", 1), ("lane_xor<2>", 2), ("lane_xor<4>", 4),
                                              ("lane_xor<8>", 8), ("lane_xor<16>", 16),
                                              ("lane_xor16_full_wave", 16))}
    want["wave_abs_max"] = v.abs().max().expand(32)
    want["add_f16x2"] = v + (halves[:, 0].float() + halves[:, 1].float())
    want["add_f16x2 from 0"] = halves[:, 0].float() + halves[:, 1].float()
    pack = torch.stack([v.half(), x[32:].half()], dim=1).contiguous().view(torch.int32).view(32)
    results = []
    for group, names, users, checks in (
            ("lane_shuffles", abi.LANE_PROBE_ROWS[:7], BOTH,
             "ds_swizzle xor 1-8, v_permlanex16 (lane_xor<16>, lane_xor16_full_wave), wave_abs_max"),
            ("f16_pack_dot", abi.LANE_PROBE_ROWS[7:], (FP16,),
             "v_dot2_f32_f16 (add_f16x2) and v_fma_mix RNE packing (pack_f16x2): the FP16 P and its row sum")):
        bad = []
        for name in names:
            got = rows[abi.LANE_PROBE_ROWS.index(name)]
            ref = pack if name == "pack_f16x2" else want[name].contiguous().view(torch.int32)
            diff = (got != ref).nonzero()
            if len(diff):
                i = int(diff[0])
                bad.append(f"{name}: {len(diff)} lanes differ, lane {i} = 0x{int(got[i]) & 0xFFFFFFFF:08X} "
                           f"(want 0x{int(ref[i]) & 0xFFFFFFFF:08X})")
        results.append(ProbeResult(group, DIFFERS if bad else PASS, "; ".join(bad) or "every lane as specified",
                                   "each lane gets its partner's value; exact sums; fp16 round to nearest even",
                                   checks, users))
    return results


def run_probes(run: Callable, device, label: Optional[str] = None) -> ProbeReport:
    """Every probe through `run` (a function executing kernel_abi launches in order) on tensors of `device`.
    A probe that raises makes the report's `error` (the probes could not run)."""
    report = ProbeReport(label or str(device))
    counting = _Counting(run)
    start = time.perf_counter()
    try:
        results = [probe_wmma_layout(counting, device, kind) for kind in ("iu8", "fp8", "f16")]
        results.append(probe_qk_bias(counting, device))
        results += [probe_wmma_subnormal(counting, device, kind) for kind in ("fp8", "f16")]
        results += [probe_accumulator(counting, device, kind) for kind in ("fp8", "f16")]
        results += probe_e4m3(counting, device)
        results += probe_lanes(counting, device)
        report.results = results
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    report.seconds = time.perf_counter() - start
    report.launches = counting.launches
    return report


# ------------------------------------------------------------------------------------------ once per device
def device_runner(device_type: str, index: Optional[int]):
    """(run, device) of the product path: the loaded kernels (prebuilt or hiprtc; emulated on NVIDIA)."""
    from .runtime import kernel_bundle, resolve_device, run_launches
    index = resolve_device(index)
    return (lambda launches: run_launches(index, kernel_bundle(), launches)), torch.device(device_type, index)


_REPORTS: Dict[tuple, ProbeReport] = {}
_LOCKS: Dict[tuple, threading.Lock] = {}
_GUARD = threading.Lock()


def recorded(device_type: str, index: Optional[int]) -> Optional[ProbeReport]:
    """The device's report if the probes ran in this process; runs nothing."""
    return _REPORTS.get((device_type, index))


def probe_device(device_type: str, index: Optional[int]) -> ProbeReport:
    """The probes of one device, run once per process (concurrent first callers wait for that run), logged once:
    an INFO line summarising, a WARNING per probe that differs or when they could not run."""
    key = (device_type, index)
    if key in _REPORTS:
        return _REPORTS[key]
    with _GUARD:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key in _REPORTS:
            return _REPORTS[key]
        label = f"{device_type}:{index}" if index is not None else device_type
        started = time.perf_counter()
        try:
            run, device = device_runner(device_type, index)
            report = run_probes(run, device, label)
        except Exception as exc:
            report = ProbeReport(label, error=f"{type(exc).__name__}: {exc}")
        first_use_costs.record(f"hardware probes on {label}", time.perf_counter() - started)
        if report.error:
            log.warning("%s; the HIP kernels are disabled there", report.summary())
        else:
            log.info("%s", report.summary())
            for r in report.failures():
                log.warning("hardware probe %s on %s differs (%s): found %s, expected %s; disables %s", r.name,
                            label, r.checks, r.found, r.expected, ", ".join(r.backends))
        _REPORTS[key] = report
        return report


def forget() -> None:
    """Drop the recorded reports, and the P.V chains chosen from them (tests)."""
    with _GUARD:
        _REPORTS.clear()
        _LOCKS.clear()
    pv_chain.forget()
