"""The Triton GPU fuzz's kernels compiled in background processes while the rest of a GPU run goes on.

`test_fuzz_gpu` for a Triton backend needs some 130 kernels (its calls' and its three variants' self-checks);
compiled in the test's own process, side by side on threads, they took about half its time (a compile beside other
Python threads keeps waiting for the GIL: docs/MEASUREMENTS.md, "Test time limits"). A GPU run that selects those
tests starts, at its beginning, a few processes per backend (`tests/test_fuzz.py --prewarm-shard`): each collects the
same launches, compiles its shard of their distinct kernels (kernels/verify/compile_keys.shard) into Triton's cache
on disk, and prints one JSON line. The run moves those fuzz tests to its end; each waits for its backend's processes
(a bounded wait, then they are stopped) before its own calls, which then load the kernels instead of compiling them.
Nothing here judges anything: a process that fails costs only time, and the summary says so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

TEST_FUZZ = Path(__file__).resolve().parent / "test_fuzz.py"
WAIT_S = 90  # a test waits this long at most for its backend's processes, then stops them and compiles the rest
FUZZ_TEST = "test_fuzz_gpu[triton_"


def enabled() -> bool:
    """SAGE_TEST_PREWARM=0 turns off every compile ahead of the tests (these processes, the emulated builds, the GPU
    fuzz's own warm-up)."""
    return os.environ.get("SAGE_TEST_PREWARM", "1").strip() != "0"


def _is_triton_fuzz(nodeid: str) -> bool:
    return nodeid.rsplit("::", 1)[-1].startswith(FUZZ_TEST)


def fuzz_kernels(nodeids) -> List[str]:
    """The Triton backends whose GPU fuzz test is among `nodeids`."""
    return sorted({nodeid.rsplit("[", 1)[-1][:-1] for nodeid in nodeids if _is_triton_fuzz(nodeid)})


def fuzz_last(items) -> list:
    """`items` with the Triton GPU fuzz tests moved to the end, the order otherwise kept: their processes then have
    the rest of the run to compile."""
    return sorted(items, key=lambda item: _is_triton_fuzz(item.nodeid))


def processes_per_kernel(cpus: Optional[int] = None) -> int:
    """Two on a 16-core host: with the emulated builds' threads and the tests beside them, the cores stay busy."""
    return max(1, min(4, (cpus or os.cpu_count() or 1) // 8))


def shard_command(kernel: str, index: int, count: int) -> List[str]:
    return [sys.executable, str(TEST_FUZZ), "--prewarm-shard", kernel, str(index), str(count)]


@dataclass
class Shard:
    kernel: str
    index: int
    count: int
    process: subprocess.Popen
    output: Path
    started: float = field(default_factory=time.perf_counter)
    ended: Optional[float] = None
    stopped: bool = False  # still running when its test could wait no longer

    def result(self) -> Dict:
        """Its JSON line, or {"error": why there is none}."""
        code = self.process.poll()
        text = self.output.read_text(errors="replace") if self.output.exists() else ""
        lines = [line for line in text.splitlines() if line.startswith("{")]
        if self.stopped:
            return {"error": f"stopped after {self.ended - self.started:.0f} s, not finished"}
        if code != 0 or not lines:
            tail = " | ".join(text.strip().splitlines()[-3:])[-300:]
            return {"error": f"exit status {code}: {tail or 'no output'}"}
        try:
            return json.loads(lines[-1])
        except ValueError:
            return {"error": f"unreadable result line: {lines[-1][:200]}"}


SHARDS: List[Shard] = []
WAITED: Dict[str, float] = {}  # kernel -> seconds its test waited


def start(kernels, per_kernel: int, command: Callable = shard_command) -> List[Shard]:
    """One process per shard (it lowers its own priority), its output in a temporary file."""
    folder = Path(tempfile.mkdtemp(prefix="sage_triton_prewarm_"))
    for kernel in kernels:
        for index in range(per_kernel):
            output = folder / f"{kernel}-{index}.txt"
            with open(output, "w") as sink:
                process = subprocess.Popen(command(kernel, index, per_kernel), stdout=sink, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL,
                                           env=dict(os.environ, PYTHONWARNINGS="ignore"))
            SHARDS.append(Shard(kernel, index, per_kernel, process, output))
    return SHARDS


def wait(kernel: str, timeout: float = WAIT_S) -> List[Shard]:
    """Waits for `kernel`'s processes, `timeout` seconds in all; those still running then are stopped."""
    mine = [s for s in SHARDS if s.kernel == kernel]
    t0 = time.perf_counter()
    for shard in mine:
        try:
            shard.process.wait(timeout=max(0.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            shard.process.kill()
            shard.process.wait()
            shard.stopped = True
        if shard.ended is None:
            shard.ended = time.perf_counter()
    if mine:
        WAITED[kernel] = time.perf_counter() - t0
    return mine


def stop_all() -> None:
    """At the end of the run: no process outlives it."""
    for shard in SHARDS:
        if shard.process.poll() is None:
            shard.process.kill()
            shard.process.wait()
            shard.stopped = True
            shard.ended = time.perf_counter()


def summary_lines() -> List[str]:
    lines = []
    for kernel in sorted({s.kernel for s in SHARDS}):
        mine = [s for s in SHARDS if s.kernel == kernel]
        results = [s.result() for s in mine]
        good = [r for r in results if "error" not in r]
        compiled = sum(r.get("compiled", 0) for r in good)
        distinct = max((r.get("distinct", 0) for r in good), default=0)
        # A process's end is seen only when its test waits for it (or the run ends): the span says when that was,
        # and each process's own clock (its line below) how long it worked.
        asked = max(s.ended or time.perf_counter() for s in mine) - min(s.started for s in mine)
        waited = (f"; its test asked {asked:.1f} s after they started and waited {WAITED[kernel]:.1f} s"
                  if kernel in WAITED else f"; its test never asked ({asked:.1f} s after they started)")
        lines.append(f"[triton prewarm {kernel}] {len(good)} of {len(mine)} processes compiled {compiled} of "
                     f"{distinct} kernels{waited}")
        lines += [f"[triton prewarm {kernel}] shard {s.index}: {r['error']}" if "error" in r else
                  f"[triton prewarm {kernel}] shard {s.index}: {r.get('mine')} kernels; its launches collected in "
                  f"{r.get('collect_s')} s, done in {r.get('seconds')} s; host load {r.get('load_1min')} at its end"
                  for s, r in zip(mine, results)]
    return lines
