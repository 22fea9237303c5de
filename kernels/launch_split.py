"""One attention call cut into launches bounded in work, so no launch runs long enough to trip a GPU timeout.

Windows resets the GPU when one dispatch runs past the driver timeout (TDR, 2 s by default); a Wan 720p call
is one launch of ~1.2e14 operations, seconds on an RX 9060 XT. `split_attention` cuts a call into pieces
of (batch range, head range, query-row range); the HIP plan (kernel_abi.attention_plan) and the Triton backend
launch each piece on views or offset pointers of the same tensors, so every output element is computed by the
same code on the same inputs as in one launch (bit-identical). A call within the bound stays one piece.

The bound (`work_bound`, the one rule both read): the device's own dense INT8 rate (`OPS_PER_CLOCK` per CU/SM,
from public peak figures) x its CUs x its clock x 20 % efficiency x the seconds a launch may take on this OS
(0.25 s where a watchdog may apply; 1 s on Linux with ROCm, whose KFD user queues have none).
docs/MEASUREMENTS.md#split-launches gives each figure's source.

Cuts, coarsest first: whole batch elements; head ranges of one batch element (a multiple of the kv-head group,
so a piece's q heads share its kv heads); query-row ranges of one (batch, head), on multiples of the kernel's
BLOCK_M (not for causal calls: the kernels mask by the absolute query row, so a causal (batch, head) is one
piece, whatever its work).
"""
from __future__ import annotations

import contextlib
import platform
import sys
from typing import Dict, Iterator, List, NamedTuple, Optional

import torch

from .call_spec import arch_from_properties

# Dense INT8 WMMA / tensor-core operations per clock per CU (AMD) or SM (NVIDIA), a multiply-add counting 2:
# peak TOPS / (CUs x clock) from each architecture's published figures (docs/MEASUREMENTS.md#split-launches).
# AMD archs match by prefix; NVIDIA's exactly (sm_103 is not sm_100's rate).
OPS_PER_CLOCK = {
    "gfx12": 2048,    # RX 9070 XT: 389 TOPS / (64 CUs x 2.97 GHz)
    "gfx11": 512,     # Radeon PRO W7900: 122.6 TOPS / (96 CUs x 2.495 GHz)
    "gfx90a": 1024,   # Instinct MI250X: 383 TOPS / (220 CUs x 1.7 GHz)
    "sm_80": 4096,    # A100: 624 TOPS / (108 SMs x 1.41 GHz)
    "sm_89": 2048,    # L40S: 733 TOPS / (142 SMs x 2.52 GHz)
    "sm_90": 8192,    # H100 SXM: 1979 TOPS / (132 SMs x 1.83 GHz)
    "sm_100": 16384,  # B200: 4.5 POPS / 148 SMs, twice sm_90's per SM
}
CONSERVATIVE_OPS_PER_CLOCK = OPS_PER_CLOCK["gfx12"]  # any other arch: RDNA4's rate
ASSUMED_CLOCK_HZ = 2.0e9  # where the device reports no clock: below every RDNA4 card's game clock
EFFICIENCY = 0.20         # of that peak; an attention kernel with its softmax runs well below it
WATCHDOG_SECONDS = 0.25   # an eighth of Windows' 2 s TDR; also Linux NVIDIA (a display GPU has a watchdog) and WSL
NO_WATCHDOG_SECONDS = 1.0  # Linux + ROCm: KFD user queues have no timeout; 4x fewer tails, still far from any limit
# The bound per CU at RDNA4's rate, the assumed clock and the watchdog's seconds: 2.05e11. Off a GPU (the
# interpreter, the host simulator) a device of DEFAULT_CUS such CUs is assumed: an RX 9060 XT on Windows.
WORK_PER_CU = CONSERVATIVE_OPS_PER_CLOCK * ASSUMED_CLOCK_HZ * EFFICIENCY * WATCHDOG_SECONDS
DEFAULT_CUS = 32

_override: Optional[float] = None
_device_bounds: Dict[int, "LaunchBound"] = {}


class LaunchBound(NamedTuple):
    """What one launch may hold on one device, and the facts it comes from."""
    arch: str
    ops_per_clock: int
    cus: int
    clock_hz: float
    seconds: float
    os: str
    work: float  # operations (in the units of `call_work`) one launch may hold: the product of the above x EFFICIENCY


class Piece(NamedTuple):  # a NamedTuple: every call makes one, and a frozen dataclass costs 1 µs more
    """Batches [b0, b1), q heads [h0, h1), query rows [n0, n1) of one call: one launch."""
    b0: int
    b1: int
    h0: int
    h1: int
    n0: int
    n1: int


@contextlib.contextmanager
def work_bound_override(bound: Optional[float]) -> Iterator[None]:
    """Verification seam: every launch plan inside uses this bound (in the units of `call_work`)."""
    global _override
    before, _override = _override, bound
    try:
        yield
    finally:
        _override = before


def ops_per_clock(arch: str) -> int:
    """Dense INT8 operations per clock per CU/SM of `arch` ('gfx1201', 'sm_90'); RDNA4's for one not listed."""
    if arch.startswith("gfx"):
        return next((ops for name, ops in OPS_PER_CLOCK.items() if arch.startswith(name)), CONSERVATIVE_OPS_PER_CLOCK)
    return OPS_PER_CLOCK.get(arch, CONSERVATIVE_OPS_PER_CLOCK)


def host_os() -> str:
    """'windows', 'wsl' (Linux on the Windows GPU driver, so TDR applies), 'linux', or sys.platform."""
    if sys.platform.startswith("win"):
        return "windows"
    if sys.platform.startswith("linux"):
        return "wsl" if "microsoft" in platform.release().lower() else "linux"
    return sys.platform


def launch_seconds(os_name: str, rocm: bool) -> float:
    """The time one launch may take: longer only where no watchdog can fire (Linux, ROCm's KFD queues)."""
    return NO_WATCHDOG_SECONDS if os_name == "linux" and rocm else WATCHDOG_SECONDS


def launch_bound(arch: str, cus: int, clock_khz: Optional[float], os_name: str, rocm: bool) -> LaunchBound:
    """The bound of a device with these properties (clock in kHz as the driver reports it; 0/None: unknown)."""
    return _bound(arch, ops_per_clock(arch), cus or DEFAULT_CUS, clock_khz * 1e3 if clock_khz else ASSUMED_CLOCK_HZ,
                  launch_seconds(os_name, rocm), os_name)


def _bound(arch: str, ops: int, cus: int, clock_hz: float, seconds: float, os_name: str) -> LaunchBound:
    return LaunchBound(arch, ops, cus, clock_hz, seconds, os_name, ops * cus * clock_hz * EFFICIENCY * seconds)


def device_bound(device: Optional[torch.device]) -> LaunchBound:
    """`launch_bound` of `device` from its properties (once per device); off a GPU, DEFAULT_CUS RDNA4 CUs."""
    if device is None or device.type != "cuda":
        return _bound("cpu", CONSERVATIVE_OPS_PER_CLOCK, DEFAULT_CUS, ASSUMED_CLOCK_HZ, WATCHDOG_SECONDS, host_os())
    index = device.index if device.index is not None else torch.cuda.current_device()
    bound = _device_bounds.get(index)
    if bound is None:
        props = torch.cuda.get_device_properties(index)
        rocm = bool(getattr(torch.version, "hip", None))
        bound = _device_bounds[index] = launch_bound(arch_from_properties(props),
                                                     getattr(props, "multi_processor_count", 0),
                                                     getattr(props, "clock_rate", 0), host_os(), rocm)
    return bound


def work_bound(device: Optional[torch.device]) -> float:
    """The work one launch may hold on `device` (the rule both the HIP plan and the Triton backend read)."""
    if _override is not None:
        return _override
    if device is not None and device.type == "cuda":  # the common case: one dict lookup (every call plans)
        bound = _device_bounds.get(device.index if device.index is not None else torch.cuda.current_device())
        if bound is not None:
            return bound.work
    return device_bound(device).work


def visible_keys(n0: int, n1: int, nk: int, causal: bool) -> int:
    """Sum over query rows [n0, n1) of the keys each sees (causal: key <= row)."""
    if not causal:
        return (n1 - n0) * nk

    def upto(n: int) -> int:  # sum over rows [0, n) of min(row + 1, nk)
        m = min(n, nk)
        return m * (m + 1) // 2 + (n - m) * nk
    return upto(n1) - upto(n0)


def call_work(rows_keys: int, d: int, dv: int, pv: str) -> float:
    """Operations for `rows_keys` (query row, key) pairs: Q.K at the INT8 rate, P.V at FP8's or FP16's (half)."""
    return 2.0 * rows_keys * (d + (2 if pv == "fp16" else 1) * dv)


def _even(units: int, parts: int) -> List[int]:
    """Cut points splitting `units` into `parts` runs whose lengths differ by at most one."""
    return [units * i // parts for i in range(parts + 1)]


def split_attention(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dv: int, *, pv: str, causal: bool,
                    bound: float, row_block: int) -> List[Piece]:
    """The pieces of one call, each within `bound` where a cut allows it (see the module docstring)."""
    head = call_work(visible_keys(0, nq, nk, causal) if causal else nq * nk, d, dv, pv)
    if b * hq * head <= bound:
        return [Piece(0, b, 0, hq, 0, nq)]
    if hq * head <= bound:
        per = int(bound // (hq * head))
        cuts = _even(b, -(-b // per))
        return [Piece(cuts[i], cuts[i + 1], 0, hq, 0, nq) for i in range(len(cuts) - 1)]
    group = hq // hkv
    pieces = []
    if group * head <= bound:
        groups_per = int(bound // (group * head))
        cuts = _even(hkv, -(-hkv // groups_per))
        for bi in range(b):
            pieces += [Piece(bi, bi + 1, cuts[i] * group, cuts[i + 1] * group, 0, nq) for i in range(len(cuts) - 1)]
        return pieces
    if causal:  # one (batch, head) each: its work may exceed the bound (module docstring)
        return [Piece(bi, bi + 1, h, h + 1, 0, nq) for bi in range(b) for h in range(hq)]
    blocks = -(-nq // row_block)
    blocks_per = max(1, int(bound // call_work(row_block * nk, d, dv, pv)))
    cuts = [min(nq, c * row_block) for c in _even(blocks, -(-blocks // blocks_per))]
    return [Piece(bi, bi + 1, h, h + 1, cuts[i], cuts[i + 1])
            for bi in range(b) for h in range(hq) for i in range(len(cuts) - 1)]


def quantized_piece(qq, pc: Piece, group: int):
    """The views of a prologue's output (quant.QuantizedQKV) that one piece reads; `group` = Hq // Hkv.
    q-side tensors are cut to the piece's batches, heads and rows, kv-side ones to its batches and kv heads."""
    qs = (slice(pc.b0, pc.b1), slice(pc.h0, pc.h1), slice(pc.n0, pc.n1))
    kvs = (slice(pc.b0, pc.b1), slice(pc.h0 // group, (pc.h1 - 1) // group + 1))

    def cut(t, index):
        return None if t is None else t[index]
    return type(qq)(qq.q8[qs], qq.q_scale[qs], qq.k8[kvs], qq.k_scale[kvs], qq.v[kvs], qq.v_scale[kvs],
                    cut(qq.k_mean, kvs), cut(qq.v_mean, kvs))
