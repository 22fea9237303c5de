"""Every SAGE_RDNA4_* environment variable the pack reads, in one place: its name, default and meaning
(`SETTINGS`, which the README's Settings table must match: tests/test_settings.py), and one small function
per setting that the rest of the pack asks. No other module reads a SAGE_RDNA4_ variable.

Each function reads the environment when called, so a variable set later (or by a test) takes effect;
where a caller keeps what it built from a setting (the Triton config table, a loader's cache folder),
it reads the setting once and says so. Imports nothing of the pack.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # what applies when the variable is unset or empty, in words
    doc: str      # one line: what setting it changes


CACHE = Setting("SAGE_RDNA4_CACHE", "the user cache folder",
                "folder of the on-disk caches: HIP code objects, self-check passes, auto's measured choices")
AUTOTUNE = Setting("SAGE_RDNA4_AUTOTUNE", "1", "0: auto measures nothing, the fixed preference order decides")
AUTOTUNE_CACHE = Setting("SAGE_RDNA4_AUTOTUNE_CACHE", "1", "0: auto's measured choices are kept in memory only")
SELF_CHECK = Setting("SAGE_RDNA4_SELF_CHECK", "1",
                     "0 (developers only): kernels serve calls without their first-use self-check")
SELF_CHECK_CACHE = Setting("SAGE_RDNA4_SELF_CHECK_CACHE", "1",
                           "0: the first-use self-check runs in every process instead of remembering a pass")
TRITON_FP8_CVT = Setting("SAGE_RDNA4_TRITON_FP8_CVT", "asm",
                         "software: the RDNA4 Triton FP8 kernel converts P with Triton's code, not v_cvt_pk_fp8_f32")
TRITON_LAUNCH = Setting("SAGE_RDNA4_TRITON_LAUNCH", "direct",
                        "triton: every Triton launch goes through Triton's own path, not the direct launcher")
WORKSPACE_MB = Setting("SAGE_RDNA4_WORKSPACE_MB", "128",
                       "MiB of prologue buffers kept for reuse between calls (0 keeps none; not a number: 128)")
HIP_EMULATE = Setting("SAGE_RDNA4_HIP_EMULATE", "0",
                      "1: the HIP backends run on NVIDIA through the gfx12 WMMA emulation (verification only)")
EMU_FP8_NONSAT = Setting("SAGE_RDNA4_EMU_FP8_NONSAT", "0",
                         "1: the gfx12 emulation's FP8 conversion gives NaN above 448 (verification only)")

SETTINGS: Tuple[Setting, ...] = (CACHE, AUTOTUNE, AUTOTUNE_CACHE, SELF_CHECK, SELF_CHECK_CACHE, TRITON_FP8_CVT,
                                 TRITON_LAUNCH, WORKSPACE_MB, HIP_EMULATE, EMU_FP8_NONSAT)
DEFAULT_WORKSPACE_MB = 128


def raw(setting: Setting) -> str:
    """The variable's text as set ('' when unset)."""
    return os.environ.get(setting.name, "")


def _not_zero(setting: Setting) -> bool:
    return raw(setting) != "0"  # on unless set to exactly "0"


def cache_dir() -> Optional[str]:
    """The folder SAGE_RDNA4_CACHE names (~ expanded), or None for the default."""
    text = raw(CACHE)
    return os.path.expanduser(text) if text else None


def autotune_enabled() -> bool:
    return _not_zero(AUTOTUNE)


def autotune_cache_enabled() -> bool:
    return _not_zero(AUTOTUNE_CACHE)


def self_check_enabled() -> bool:
    return _not_zero(SELF_CHECK)


def self_check_cache_enabled() -> bool:
    return _not_zero(SELF_CHECK_CACHE)


def triton_fp8_cvt_software() -> bool:
    return raw(TRITON_FP8_CVT) == "software"


def triton_launch_through_triton() -> bool:
    return raw(TRITON_LAUNCH) == "triton"


def workspace_budget_bytes() -> int:
    """SAGE_RDNA4_WORKSPACE_MB in bytes; unset, empty or not a finite number: the default; negative: 0."""
    text = raw(WORKSPACE_MB)
    try:
        mb = float(text) if text else DEFAULT_WORKSPACE_MB
    except ValueError:
        mb = DEFAULT_WORKSPACE_MB
    if not math.isfinite(mb):  # "inf"/"nan" parse as floats but are no budget
        mb = DEFAULT_WORKSPACE_MB
    return max(0, int(mb * 2 ** 20))


def hip_emulation_requested() -> bool:
    return raw(HIP_EMULATE) == "1"


def emu_fp8_nonsat_requested() -> bool:
    """Any value but empty or "0" turns the emulation's non-saturating FP8 conversion on."""
    return raw(EMU_FP8_NONSAT).strip() not in ("", "0")
