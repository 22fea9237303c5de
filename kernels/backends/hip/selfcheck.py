"""First-use self-check: a HIP kernel proves itself on the user's GPU before it serves a real call.

Nobody here owns an RDNA4 GPU, so the kernels' first real execution on gfx12 hardware happens on a
user's machine. Before a backend serves its first call on a device it runs a few small problems
(both dtypes, both head dims, causal, GQA, tails) and compares them with SDPA in FP32. A failure,
an exception or a NaN disables that backend on that device for the process, with the reason
logged and kept by `Backend.disable` (so stats and `available_backends` show it), and the call
falls back to the next backend. The check runs once per device, under a lock, so concurrent first
calls wait for one result.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from ..sdpa import sdpa_hnd
from ...metrics import cosine, rel_l1

log = logging.getLogger(__name__)

# Quantized attention against exact on these inputs is ~0.999 cosine (fp8) / ~0.9999 (fp16);
# the bounds catch a broken kernel (wrong layout, lane, scale) without tripping on quantization.
MIN_COSINE = 0.99
MAX_REL_L1 = 0.12
MAX_LSE_ERROR = 0.05  # natural-log units


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    is_causal: bool
    return_lse: bool


# Small, with tails (no length is a multiple of 16 or 64), GQA, both dtypes, both head dims, causal.
DEFAULT_CASES: Tuple[Case, ...] = (
    Case(torch.float16, 128, 2, 2, 97, 161, False, False),
    Case(torch.bfloat16, 128, 4, 2, 130, 130, True, True),
    Case(torch.float16, 64, 2, 1, 77, 77, True, False),
    Case(torch.bfloat16, 64, 2, 2, 65, 200, False, True),
)

# run(q, k, v, is_causal, sm_scale, return_lse) -> (out, lse or None); raise to signal refusal/failure.
Runner = Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]


def make_inputs(case: Case, device, seed: int = 1234):
    """Deterministic inputs with a per-channel K offset (what smooth_k exists for)."""
    g = torch.Generator().manual_seed(seed)
    d = case.head_dim
    q = torch.randn(1, case.q_heads, case.q_len, d, generator=g)
    k = torch.randn(1, case.kv_heads, case.kv_len, d, generator=g) + 3.0 * torch.randn(1, case.kv_heads, 1, d, generator=g)
    v = torch.randn(1, case.kv_heads, case.kv_len, d, generator=g)
    return tuple(t.to(device=device, dtype=case.dtype) for t in (q, k, v))


def exact_lse(q, k, is_causal, sm_scale):
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * sm_scale
    if is_causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril().logical_not(), -math.inf)
    return torch.logsumexp(s, dim=-1)


def check_case(run: Runner, case: Case, device) -> Optional[str]:
    """None when the kernel agrees with SDPA on this case, else what went wrong."""
    q, k, v = make_inputs(case, device)
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    label = (f"{str(case.dtype).replace('torch.', '')} D{case.head_dim} Hq{case.q_heads}/Hkv{case.kv_heads} "
             f"Nq{case.q_len} Nk{case.kv_len}{' causal' if case.is_causal else ''}")
    try:
        out, lse = run(q, k, v, case.is_causal, sm_scale, case.return_lse)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # any failure of the kernel path is a verdict, not a crash
        return f"{label}: raised {type(exc).__name__}: {exc}"
    want = sdpa_hnd(q.float(), k.float(), v.float(), sm_scale, None, case.is_causal)
    if tuple(out.shape) != tuple(want.shape) or out.dtype != case.dtype:
        return f"{label}: output {tuple(out.shape)} {out.dtype}, expected {tuple(want.shape)} {case.dtype}"
    if not torch.isfinite(out).all():
        return f"{label}: output has NaN/Inf"
    cos, err = cosine(out.float(), want), rel_l1(out.float(), want)
    if not (cos >= MIN_COSINE and err <= MAX_REL_L1):
        return f"{label}: cosine {cos:.4f} (min {MIN_COSINE}), rel L1 {err:.4f} (max {MAX_REL_L1}) against SDPA"
    if case.return_lse:
        if lse is None or tuple(lse.shape) != tuple(out.shape[:3]):
            return f"{label}: LSE missing or of shape {None if lse is None else tuple(lse.shape)}"
        diff = float((lse.float() - exact_lse(q, k, case.is_causal, sm_scale)).abs().max())
        if not diff <= MAX_LSE_ERROR:
            return f"{label}: LSE off by {diff:.4f} (max {MAX_LSE_ERROR})"
    return None


def run_selfcheck(run: Runner, device, cases: Sequence[Case] = DEFAULT_CASES,
                  accepts: Optional[Callable[[Case], bool]] = None) -> Optional[str]:
    """Run every case the backend accepts; the first failure is the verdict."""
    device = torch.device(device)
    ran = 0
    for case in cases:
        if accepts is not None and not accepts(case):
            continue
        ran += 1
        problem = check_case(run, case, device)
        if problem:
            return f"self-check failed on {problem}"
    return None if ran else "self-check had no case this backend accepts"


class SelfCheck:
    """Once-per-device verdicts for one backend; thread-safe."""

    def __init__(self, cases: Sequence[Case] = DEFAULT_CASES):
        self.cases = tuple(cases)
        self._verdicts: Dict[Tuple[str, Optional[int]], Optional[str]] = {}
        self._locks: Dict[Tuple[str, Optional[int]], threading.Lock] = {}
        self._guard = threading.Lock()

    def verdict(self, device_type: str, index: Optional[int]) -> Tuple[bool, Optional[str]]:
        """(checked, reason) without running anything."""
        key = (device_type, index)
        return key in self._verdicts, self._verdicts.get(key)

    def ensure(self, backend, device_type: str, index: Optional[int], run: Runner,
               accepts: Optional[Callable[[Case], bool]] = None) -> Optional[str]:
        """Run the check on first use of the device; a failure disables `backend` there. Returns the reason."""
        key = (device_type, index)
        if key in self._verdicts:
            return self._verdicts[key]
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key in self._verdicts:  # another thread finished it while we waited
                return self._verdicts[key]
            device = torch.device(device_type, index) if index is not None else torch.device(device_type)
            try:
                reason = run_selfcheck(run, device, self.cases, accepts)
            except Exception as exc:
                reason = f"self-check crashed: {type(exc).__name__}: {exc}"
            if reason:
                reason = f"{backend.name} disabled on {device}: {reason}"
                log.warning("%s; calls fall back to the next backend", reason)
                backend.disable(device_type, index, reason)
            else:
                log.info("%s passed its self-check on %s", backend.name, device)
            self._verdicts[key] = reason
            return reason
