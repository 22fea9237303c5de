"""Compiling the Triton kernels a set of calls will launch side by side, before the calls run.

A first use (the self-check of a variant: kernels/self_check.py) launches some twenty kernels Triton has not
compiled yet, and each launch compiles its own in turn (0.3-1.5 s each on the H200's host). `warm_up(run)` runs
`run` once with every Triton launch collected instead of run (launcher.COLLECTING, this thread only), then compiles
each collected kernel through Triton's own path (`JITFunction.warmup` under Triton's AsyncCompileMode) on a pool of
threads; the calls that follow find every kernel compiled. Nothing here decides a verdict: a kernel that fails to
compile is left to the real launch, which raises as it would have.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, List

from triton.runtime.jit import JITFunction

from . import launcher

log = logging.getLogger(__name__)
MAX_WORKERS = 8


@dataclass
class WarmUp:
    launches: int = 0  # Triton launches `run` made
    submitted: int = 0  # of them, compiled (or found) through Triton's path
    seconds: float = 0.0
    error: str = ""  # why it stopped early, if it did (the calls then compile as before)


def collect_launches(run: Callable[[], object]) -> List[tuple]:
    """Every Triton launch `run()` makes, as (fn, grid, args, meta), none of them run. Whatever `run` computes
    from a launch's outputs is garbage: only the launches count."""
    sink: List[tuple] = []
    token = launcher.COLLECTING.set(sink)
    try:
        run()
    finally:
        launcher.COLLECTING.reset(token)
    return sink


def compile_concurrently(launches: List[tuple], workers: int) -> int:
    """Compile the kernels of `launches` on `workers` threads; returns how many were submitted (Triton skips those
    in its cache, and compiles one of several equal ones)."""
    from triton.runtime._async_compile import AsyncCompileMode

    jitted = [(fn, grid, args, meta) for fn, grid, args, meta in launches if isinstance(fn, JITFunction)]
    if not jitted:
        return 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        with AsyncCompileMode(pool, ignore_errors=True):  # on exit: waits for every compile, fills Triton's cache
            for fn, grid, args, meta in jitted:
                fn.warmup(*args, grid=grid, **meta)
    return len(jitted)


def warm_up(run: Callable[[], object], workers: int = 0) -> WarmUp:
    """Collect `run`'s launches, then compile their kernels side by side. Never raises for the kernels' sake."""
    t0 = time.perf_counter()
    result = WarmUp()
    try:
        launches = collect_launches(run)
        result.launches = len(launches)
        result.submitted = compile_concurrently(launches, workers or min(MAX_WORKERS, os.cpu_count() or 1))
    except Exception as exc:  # noqa: BLE001  (the real calls compile and judge as before)
        result.error = f"{type(exc).__name__}: {exc}"
        log.debug("sage_rdna4: Triton warm-up stopped: %s", result.error)
    result.seconds = time.perf_counter() - t0
    return result
