"""Every SAGE_RDNA4_* environment variable the pack reads, in one place: its name, default, accepted values and
meaning (`SETTINGS`, which the README's Settings table must match: tests/test_settings.py), and one small function
per setting that the rest of the pack asks. No other module reads a SAGE_RDNA4_ variable.

Accepted values (case and surrounding spaces ignored): switches take 1/true/on/yes or 0/false/off/no; a choice
takes one of its words; the cache folder must be an absolute path (`~` expanded); the workspace budget is a
number of MiB from 0 to MAX_WORKSPACE_MB. Unset or empty means the default. Anything else means the default too,
with a one-line warning naming the variable, its value and the default used (a number out of range is clamped,
with a warning). Each variable has one parser here; a value is parsed, and warned about, once per process.

Each function reads the environment when called, so a variable set later (or by a test) takes effect;
where a caller keeps what it built from a setting (the Triton config table, a loader's cache folder),
it reads the setting once and says so. Imports nothing of the pack.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

log = logging.getLogger(__name__)


SWITCH_WORDS = "1/true/on/yes or 0/false/off/no"


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # what applies when the variable is unset or empty, in words
    doc: str      # one line: what setting it changes
    accepted: str = SWITCH_WORDS  # the values it takes, in words


FP8_CVT_WORDS = ("asm", "software")  # a choice's words: the first is its default
LAUNCH_WORDS = ("direct", "triton")
PV_CHAIN_WORDS = ("auto", "two-level", "single")
DEFAULT_WORKSPACE_MB = 128
MAX_WORKSPACE_MB = 65536  # 64 GiB: more than any card this pack runs on holds; a larger figure is a typo

CACHE = Setting("SAGE_RDNA4_CACHE", "the user cache folder",
                "folder of the on-disk caches: HIP code objects, self-check passes, auto's measured choices",
                "an absolute path (~ expanded)")
AUTOTUNE = Setting("SAGE_RDNA4_AUTOTUNE", "1", "0: auto measures nothing, the fixed preference order decides")
AUTOTUNE_CACHE = Setting("SAGE_RDNA4_AUTOTUNE_CACHE", "1", "0: auto's measured choices are kept in memory only")
SELF_CHECK = Setting("SAGE_RDNA4_SELF_CHECK", "1",
                     "0 (developers only): kernels serve calls without their first-use self-check")
SELF_CHECK_CACHE = Setting("SAGE_RDNA4_SELF_CHECK_CACHE", "1",
                           "0: the first-use self-check runs in every process instead of remembering a pass")
TRITON_FP8_CVT = Setting("SAGE_RDNA4_TRITON_FP8_CVT", "asm",
                         "software: the RDNA4 Triton FP8 kernel converts P with Triton's code, not v_cvt_pk_fp8_f32",
                         "asm or software")
TRITON_PRECOMPILE = Setting("SAGE_RDNA4_TRITON_PRECOMPILE", "1",
                            "0: a self-check's Triton kernels compile one at a time as launched, not together first")
TRITON_LAUNCH = Setting("SAGE_RDNA4_TRITON_LAUNCH", "direct",
                        "triton: every Triton launch goes through Triton's own path, not the direct launcher",
                        "direct or triton")
WORKSPACE_MB = Setting("SAGE_RDNA4_WORKSPACE_MB", str(DEFAULT_WORKSPACE_MB),
                       "MiB of prologue buffers kept for reuse between calls (0 keeps none)",
                       f"a number of MiB from 0 to {MAX_WORKSPACE_MB}")
HIP_EMULATE = Setting("SAGE_RDNA4_HIP_EMULATE", "0",
                      "1: the HIP backends run on NVIDIA through the gfx12 WMMA emulation (verification only)")
EMU_FP8_NONSAT = Setting("SAGE_RDNA4_EMU_FP8_NONSAT", "0",
                         "1: the gfx12 emulation's FP8 conversion gives NaN above 448 (verification only)")

HIP_PV_CHAIN = Setting("SAGE_RDNA4_HIP_PV_CHAIN", "auto",
                       "the HIP P.V accumulation: auto (the single chain where the probe reads full FP32 and it passes "
                       "the self-check's accumulation cases), two-level or single (forced, for a comparison)",
                       "auto, two-level or single")
PADDING_CUT = Setting("SAGE_RDNA4_PADDING_CUT", "1",
                      "0: a patched model's prompt-padding masks reach the kernels as masks instead of being cut "
                      "from K and V")

SETTINGS: Tuple[Setting, ...] = (CACHE, AUTOTUNE, AUTOTUNE_CACHE, SELF_CHECK, SELF_CHECK_CACHE, TRITON_FP8_CVT,
                                 TRITON_PRECOMPILE, TRITON_LAUNCH, WORKSPACE_MB, HIP_EMULATE, EMU_FP8_NONSAT,
                                 HIP_PV_CHAIN, PADDING_CUT)


def raw(setting: Setting) -> str:
    """The variable's text as set ('' when unset)."""
    return os.environ.get(setting.name, "")


# -- parsing: one parser per kind of value, each value parsed (and warned about) once per process -------------

_parsed: Dict[Tuple[str, str], object] = {}
_parsed_lock = threading.Lock()


def _parse(setting: Setting, parser: Callable[[str], Tuple[object, Optional[str]]]):
    """`parser(text)` -> (value, warning or None), remembered per (variable, text): a setting asked on every
    call costs a dict lookup, and a bad value is reported once, not once per call."""
    text = raw(setting)
    key = (setting.name, text)
    with _parsed_lock:
        if key in _parsed:
            return _parsed[key]
    value, warning = parser(text)
    with _parsed_lock:
        if key not in _parsed:
            _parsed[key] = value
            if warning:
                log.warning("%s=%r %s", setting.name, text, warning)
    return value


_TRUE_WORDS = frozenset(("1", "true", "on", "yes"))
_FALSE_WORDS = frozenset(("0", "false", "off", "no"))


def _switch(setting: Setting, default: bool) -> bool:
    def parse(text: str):
        word = text.strip().lower()
        if not word:
            return default, None
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS, None
        return default, (f"is not a switch value ({SWITCH_WORDS}); using the default, "
                         f"{'1 (on)' if default else '0 (off)'}")
    return _parse(setting, parse)


def _choice(setting: Setting, words: Tuple[str, ...]) -> str:
    """One of `words` (the first is the default)."""
    def parse(text: str):
        word = text.strip().lower()
        if not word:
            return words[0], None
        if word in words:
            return word, None
        return words[0], f"is not one of {', '.join(words)}; using the default, {words[0]}"
    return _parse(setting, parse)


def _cache_folder(text: str):
    folder = os.path.expanduser(text.strip())
    if not folder:
        return None, None
    if not os.path.isabs(folder):  # relative to wherever ComfyUI was started: never what was meant
        return None, "is not an absolute path; using the default, the user cache folder"
    return folder, None


def _workspace_mb(text: str):
    word = text.strip()
    if not word:
        return float(DEFAULT_WORKSPACE_MB), None
    try:
        mb = float(word)
    except ValueError:
        mb = math.nan
    if not math.isfinite(mb):  # "inf"/"nan" parse as floats but are no budget
        return float(DEFAULT_WORKSPACE_MB), f"is not a number of MiB; using the default, {DEFAULT_WORKSPACE_MB}"
    if mb < 0 or mb > MAX_WORKSPACE_MB:
        clamped = float(min(max(mb, 0.0), MAX_WORKSPACE_MB))
        return clamped, f"is outside 0..{MAX_WORKSPACE_MB} MiB; using {clamped:g}"
    return mb, None


# -- the settings ------------------------------------------------------------------------------------------

def cache_dir() -> Optional[str]:
    """The absolute folder SAGE_RDNA4_CACHE names (~ expanded), or None for the default."""
    return _parse(CACHE, _cache_folder)


def autotune_enabled() -> bool:
    return _switch(AUTOTUNE, True)


def autotune_cache_enabled() -> bool:
    return _switch(AUTOTUNE_CACHE, True)


def padding_cut_enabled() -> bool:
    return _switch(PADDING_CUT, True)


def self_check_enabled() -> bool:
    return _switch(SELF_CHECK, True)


def self_check_cache_enabled() -> bool:
    return _switch(SELF_CHECK_CACHE, True)


def triton_fp8_cvt() -> str:
    return _choice(TRITON_FP8_CVT, FP8_CVT_WORDS)


def triton_launch() -> str:
    return _choice(TRITON_LAUNCH, LAUNCH_WORDS)


def triton_fp8_cvt_software() -> bool:
    return triton_fp8_cvt() == "software"


def triton_precompile() -> bool:
    return _switch(TRITON_PRECOMPILE, True)


def triton_launch_through_triton() -> bool:
    return triton_launch() == "triton"


def workspace_budget_bytes() -> int:
    """SAGE_RDNA4_WORKSPACE_MB in bytes, within 0..MAX_WORKSPACE_MB MiB."""
    return int(_parse(WORKSPACE_MB, _workspace_mb) * 2 ** 20)


def hip_emulation_requested() -> bool:
    return _switch(HIP_EMULATE, False)


def emu_fp8_nonsat_requested() -> bool:
    return _switch(EMU_FP8_NONSAT, False)


def hip_pv_chain() -> str:
    return _choice(HIP_PV_CHAIN, PV_CHAIN_WORDS)


def in_effect() -> Dict[str, object]:
    """Each variable that is set: its text and the value the pack uses (for the field report)."""
    used = {CACHE: cache_dir, AUTOTUNE: autotune_enabled, AUTOTUNE_CACHE: autotune_cache_enabled,
            SELF_CHECK: self_check_enabled, SELF_CHECK_CACHE: self_check_cache_enabled,
            TRITON_FP8_CVT: triton_fp8_cvt, TRITON_LAUNCH: triton_launch,
            WORKSPACE_MB: lambda: workspace_budget_bytes() / 2 ** 20, HIP_EMULATE: hip_emulation_requested,
            EMU_FP8_NONSAT: emu_fp8_nonsat_requested, HIP_PV_CHAIN: hip_pv_chain}
    return {s.name: {"text": raw(s), "used": used[s]()} for s in SETTINGS if raw(s)}
