"""How far a sampled real call (the A/B node) may be from exact attention before it is flagged.

By P.V precision: FP8 at the scale loss the self-check's probe must reject, FP16 (and exact fallbacks) at the
per-call accuracy target. A sound kernel sits far below: 0.0007-0.003 on real self-attention (peers, our FP16),
FP8 ~0.002-0.03.
"""
from __future__ import annotations

from .self_check import SCALE_LOSS_MUST_FAIL

FLAG_REL_L1 = {"fp8": SCALE_LOSS_MUST_FAIL, "fp16": 0.02}


def flag_level(backend: str) -> float:
    """The rel L1 above which a sampled call run by `backend` is flagged (see FLAG_REL_L1)."""
    name = backend.lower()
    # The reference is the spec of the FP8 path (INT8 Q.K, FP8 P.V): it is judged as an FP8 kernel.
    exact = name.startswith(("sdpa", "fallback", "exact")) and "fp8" not in name
    return FLAG_REL_L1["fp16"] if exact or name.endswith("fp16") else FLAG_REL_L1["fp8"]
