"""One attention call cut into launches bounded in work, so no launch runs long enough to trip a GPU timeout.

Windows resets the GPU when one dispatch runs past the driver timeout (TDR, about 2 s by default); a Wan 720p
call is one launch of ~1.2e14 operations, seconds on an RX 9060 XT. `split_attention` cuts a call into pieces
of (batch range, head range, query-row range); the HIP plan (kernel_abi.attention_plan) and the Triton backend
launch each piece on views or offset pointers of the same tensors, so every output element is computed by the
same code on the same inputs as in one launch (bit-identical). A call within the bound stays one piece.

Cuts, coarsest first: whole batch elements; head ranges of one batch element (a multiple of the kv-head group,
so a piece's q heads share its kv heads); query-row ranges of one (batch, head), on multiples of the kernel's
BLOCK_M (not for causal calls: the kernels mask by the absolute query row, so a causal (batch, head) is one
piece, whatever its work).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, NamedTuple, Optional

import torch

# Work of one launch per compute unit, in INT8/FP8 WMMA operations (a multiply-add is 2; FP16 P.V counts twice,
# RDNA4 runs FP16 WMMA at half rate): 2048 ops/clk/CU (RX 9070 XT: 389 TOPS / (64 CU x 2.97 GHz)) x 2.0 GHz
# x 20 % efficiency x 0.25 s = 2.05e11, i.e. 6.6e12 a launch on an RX 9060 XT (32 CU). docs/MEASUREMENTS.md#split
WORK_PER_CU = 2048 * 2.0e9 * 0.20 * 0.25
# CUs assumed where the device does not say (CPU: the interpreter, the host simulator): an RX 9060 XT.
DEFAULT_CUS = 32

_override: Optional[float] = None
_device_bounds: Dict[int, float] = {}


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


def work_bound(device: Optional[torch.device]) -> float:
    """The work one launch may hold on `device`: WORK_PER_CU per compute unit it reports."""
    if _override is not None:
        return _override
    if device is None or device.type != "cuda":
        return WORK_PER_CU * DEFAULT_CUS
    index = device.index if device.index is not None else torch.cuda.current_device()
    bound = _device_bounds.get(index)
    if bound is None:
        cus = getattr(torch.cuda.get_device_properties(index), "multi_processor_count", 0) or DEFAULT_CUS
        bound = _device_bounds[index] = WORK_PER_CU * cus
    return bound


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
