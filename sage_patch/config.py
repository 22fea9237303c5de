"""What a patch does, as chosen on the node. Immutable: one config per patched model."""
from __future__ import annotations

from dataclasses import dataclass

from ..kernels.call_spec import PROLOGUES
from ..kernels.registry import BACKEND_NAMES

ON_UNSUPPORTED = ("fallback", "raise")
# The one rule for kernel and prologue values; the node offers exactly these. A prompt JSON can skip the UI's
# combo check, so an unknown value must stop here rather than fail in KSampler or make every call fall back.
KERNEL_CHOICES = ("auto", *BACKEND_NAMES)
PROLOGUE_CHOICES = PROLOGUES


def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


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
