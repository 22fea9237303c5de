"""Whether Triton's compiles overlap in threads, and what a busy Python thread beside them costs; no GPU needed.

    python kernels/verify/triton_compile_gil.py [--kernels 8] [--workers 2] [--modes serial,threads,processes,...]

Compiles up to 8 distinct attention kernels for sm_90 ahead of time (triton_aot.py), each mode into
a fresh Triton cache: one at a time (`serial`), on `--workers` threads (`threads`) or spawned processes
(`processes`, their start included), one at a time beside a pure-Python busy thread of the same process
(`busy_thread`) or beside a busy process (`busy_process`). One JSON line per mode: wall seconds, and for the busy
thread its share of the rate it has alone. A busy thread that keeps most of its rate while the compiles take much
longer means the compiles hold the GIL for little of their time but wait for it often (docs/MEASUREMENTS.md,
"Test time limits")."""
import argparse
import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time

MODES = ("serial", "threads", "processes", "busy_thread", "busy_process")
VARIANTS = [(d, pv, causal) for d in (64, 128) for pv in ("fp8", "fp16") for causal in (False, True)]


def load_pack():
    """The repo as the pack, through the tools' loader (this file runs as a script, and in spawned processes)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "tools"))
    from pack_loader import load_pack as load
    load()


def compile_one(variant) -> float:
    load_pack()
    from comfyui_sage_rdna4.kernels.backends.triton.configs import attention_config
    from comfyui_sage_rdna4.kernels.verify import triton_aot

    d, pv, causal = variant
    t0 = time.perf_counter()
    triton_aot._compile_attention("sm_90", d, pv, attention_config("sm_90", d, pv), is_causal=causal,
                                  return_lse=causal)
    return time.perf_counter() - t0


def _use_cache(folder: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = folder


class Spinner:
    """A pure-Python loop on a thread of this process, counting."""

    def __init__(self):
        self.count, self._stop = 0, False
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self):
        n = 0
        while not self._stop:
            n += 1
            if n % 1000 == 0:
                self.count = n
        self.count = n

    def __enter__(self):
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.rate = self.count / (time.perf_counter() - self._started)


def run_mode(mode: str, variants, workers: int) -> dict:
    cache = tempfile.mkdtemp(prefix=f"triton_gil_{mode}_")
    _use_cache(cache)
    result = {"mode": mode, "kernels": len(variants)}
    t0 = time.perf_counter()
    if mode == "threads":
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(compile_one, variants))
    elif mode == "processes":
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn, initializer=_use_cache,
                                                    initargs=(cache,)) as pool:
            list(pool.map(compile_one, variants))
    elif mode == "busy_thread":
        with Spinner() as during:
            for v in variants:
                compile_one(v)
        wall = time.perf_counter() - t0
        with Spinner() as alone:
            time.sleep(wall)
        result["spinner_rate_kept"] = round(during.rate / alone.rate, 3)
    elif mode == "busy_process":
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for v in variants:
                compile_one(v)
        finally:
            busy.kill()
            busy.wait()
    else:
        for v in variants:
            compile_one(v)
    result["wall_s"] = round(time.perf_counter() - t0 if mode != "busy_thread" else wall, 2)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=len(VARIANTS), help=f"1 to {len(VARIANTS)}")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not 1 <= args.kernels <= len(VARIANTS):
        ap.error(f"modes from {', '.join(MODES)}; --kernels 1 to {len(VARIANTS)}")
    load_pack()
    from comfyui_sage_rdna4.kernels.verify.triton_aot import nvidia_missing

    missing = nvidia_missing()
    if missing:
        print(f"triton_compile_gil.py: {missing}", file=sys.stderr)
        return 2
    _use_cache(tempfile.mkdtemp(prefix="triton_gil_warm_"))
    compile_one(VARIANTS[0])  # imports and Triton's own first-use costs, outside every mode's clock
    for mode in modes:
        print(json.dumps(run_mode(mode, VARIANTS[:args.kernels], args.workers)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
