"""Verification build options for a whole test run, from the environment.

SAGE_RDNA4_EMU_FP8_NONSAT=1 builds every emulated module (the CuPy harness, the host simulator, the loader's CUDA
twin) with fp8_nonsat (kernel_abi.VERIFY_OPTIONS): the emulated e4m3 conversion then gives NaN above 448, the
non-saturating reading of gfx12's v_cvt_pk_fp8_f32, so the GPU and simulator tests run against that reading. An
option a caller passes explicitly wins over the environment's.
"""
from __future__ import annotations

from typing import Dict

from .. import settings


def env_options() -> Dict[str, int]:
    return {"fp8_nonsat": 1} if settings.emu_fp8_nonsat_requested() else {}


def with_env(options: Dict[str, int]) -> Dict[str, int]:
    """`options` over the environment's (explicit options win)."""
    return {**env_options(), **options}
