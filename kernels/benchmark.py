"""The main job: every available backend against SDPA on real models' attention shapes.

For each shape it prints time relative to SDPA measured in the same run (median and range of repeats) and
the accuracy against exact FP32 attention (cosine, relative L1) as a table, and as JSON with --json. A
quantized backend below the accuracy floor is a self-check failure (exit status 1); so is one named with
--backends that did not run, and a run where no quantized backend ran. Needs no ComfyUI.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

import torch

from .api import sage_attention
from .call_spec import describe_call
from .metrics import cosine, rel_l1
from .reference import exact_attention
from .registry import BACKEND_NAMES, get_backend

COSINE_FLOOR = 0.99  # self-check: a quantized backend below this against exact attention fails


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


GPU_SHAPES = [
    Shape("flux_1mp", 1, 24, 4608, 128, "bfloat16"),        # Flux at 1024x1024: 4096 image + 512 text tokens
    Shape("flux_2mp", 1, 24, 8704, 128, "bfloat16"),        # Flux at 1536x1536 (2.25 MP): 8192 + 512 tokens
    Shape("wan_480p", 1, 40, 32760, 128, "bfloat16"),       # Wan 2.x 832x480, 81 frames
    Shape("wan_720p", 1, 40, 75600, 128, "bfloat16"),       # Wan 2.x 1280x720, 81 frames
    Shape("sdxl_1mp_d64", 2, 10, 4096, 64, "float16"),      # SDXL at 1024x1024, first-level self attention
]
CPU_SHAPES = [
    Shape("flux_small", 1, 4, 1024, 128, "bfloat16"),
    Shape("wan_small", 1, 2, 2048, 128, "bfloat16"),
    Shape("sdxl_small", 2, 2, 1024, 64, "float16"),
]
SMOKE_SHAPES = [Shape("tiny", 1, 2, 128, 64, "float16")]  # a seconds-long check of the plumbing, any device
GPU_REPS, CPU_REPS = 20, 7
SDPA_VARIANTS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION"}


# Input kinds (the self-check's kinds at benchmark sizes, kernels/self_check.py make_inputs):
#   standard         Gaussian q/k/v with a per-channel offset on K (the case smooth_k exists for): peaked logits
#   diffuse          q, k = 0.7 * randn: near-uniform attention over every key, zero-mean V
#   diffuse_voffset  diffuse, and V = randn + 2 + 2 * |randn(D)| per channel: the output is mostly the offset,
#                    and an accumulator that loses small increments over long key loops shows as rel L1
#   regional_voffset the keys in REGIONS contiguous runs (as a video's frames); each query puts ~90 % of its
#                    weight on its own run's keys, and V carries a per-run channel offset (std 3). A global
#                    channel mean (smooth_v) does not take those offsets out, so an accumulator that loses small
#                    increments still fails here (H200, Wan 480p: FP8 "mma" accumulation with smooth_v rel L1
#                    0.10, the shipped accumulation 0.002; docs/MEASUREMENTS.md)
INPUT_KINDS = ("standard", "diffuse", "diffuse_voffset", "regional_voffset")
# Kinds whose output is mostly a V offset: cosine cannot see a loss of scale there, so only rel L1 judges them.
OFFSET_KINDS = ("diffuse_voffset", "regional_voffset")
# rel L1 bound of a quantized backend per input kind (the cosine floor holds for every kind but OFFSET_KINDS).
# diffuse_voffset: the project's accuracy target for long diffuse rows (peers 0.0015-0.01, our fixed kernels
# ~0.002), regional_voffset the same;
# diffuse: the self-check's bound (FP8 P.V, the spec itself included, reaches ~0.04 on zero-mean diffuse
# outputs by the rounding of P and V alone).
REL_L1_BOUND = {"standard": None, "diffuse": 0.08, "diffuse_voffset": 0.02, "regional_voffset": 0.02}
REGIONS, REGION_WEIGHT, REGION_V_OFFSET = 4, 0.9, 3.0


def _regional(q, k, v, gen):
    """q, k, v of the regional_voffset kind from q, k (0.7 * randn) and v (randn) of shape (B, H, N, D)."""
    b, h, n, d = q.shape
    region = torch.arange(n) * REGIONS // n
    per = n / REGIONS
    # A shared unit direction per run adds a^2 / sqrt(d) to the logits of same-run pairs: the boost that gives
    # a run of `per` keys REGION_WEIGHT of a row's weight against the other n - per keys (noise logits ~0).
    boost = math.log(REGION_WEIGHT / (1.0 - REGION_WEIGHT) * max(n - per, 1.0) / per)
    direction = torch.randn(REGIONS, d, generator=gen)
    direction = direction / direction.norm(dim=1, keepdim=True)
    lift = math.sqrt(boost * math.sqrt(d)) * direction[region]
    offsets = REGION_V_OFFSET * torch.randn(b, h, REGIONS, d, generator=gen)
    return q + lift, k + lift, v + offsets[:, :, region]


def make_inputs(shape: Shape, device: torch.device, seed: int = 0, kind: str = "standard"):
    """q, k, v (HND) of `shape` for one of INPUT_KINDS, deterministic per seed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    size = (shape.batch, shape.heads, shape.seq, shape.head_dim)
    channel = (1, shape.heads, 1, shape.head_dim)
    q = torch.randn(size, generator=gen)
    k = torch.randn(size, generator=gen)
    v = torch.randn(size, generator=gen)
    if kind == "standard":
        k += 3.0 * torch.randn(channel, generator=gen)
    else:
        q *= 0.7
        k *= 0.7
        if kind == "diffuse_voffset":
            v += 2.0 + 2.0 * torch.randn(channel, generator=gen).abs()
        elif kind == "regional_voffset":
            q, k, v = _regional(q, k, v, gen)
    return [t.to(device=device, dtype=shape.torch_dtype) for t in (q, k, v)]


@dataclass(frozen=True)
class Timing:
    median: float
    low: float     # the fastest repeat
    high: float    # the slowest repeat
    reps: int
    host: Optional[float] = None  # median ms the host spent issuing one call, without waiting for the device
    clock_mhz: Optional[float] = None  # median SM clock read while the repeats ran (None: not readable here)


def sm_clock_mhz(device: torch.device) -> Optional[float]:
    """The GPU's current SM clock in MHz as torch reads it (NVML on NVIDIA, amdsmi on AMD), or None where it
    cannot be read (no such library, no GPU). Under a power cap the clock follows the power drawn, so a kernel
    that draws less power runs at a higher clock: the benchmark shows it beside each time."""
    if device.type != "cuda":
        return None
    try:
        mhz = torch.cuda.clock_rate(device)
    except Exception:  # pynvml / amdsmi missing or refusing: the column shows "-"
        return None
    return float(mhz) if isinstance(mhz, (int, float)) and mhz > 0 else None


def time_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> Timing:
    """Milliseconds per call over `reps` timed repeats after `warmup` untimed ones: median and range, and the
    median host time of issuing the call (the wall time of `fn()` itself, not waiting for the device: Python,
    checks, allocations, launches). On the CPU nothing runs asynchronously, so both are the same wall time."""
    for _ in range(warmup):
        fn()
    times: List[float] = []
    host: List[float] = []
    clocks: List[float] = []
    if device.type == "cuda":
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            # Read while the call's kernels run (after end.record(), so the read never delays the timed work;
            # a call shorter than its own issue time may be over by then and read the idle clock).
            mhz = sm_clock_mhz(device)
            if mhz is not None:
                clocks.append(mhz)
            end.synchronize()  # each repeat starts on an idle device, so issuing never waits for earlier work
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        host = times
    return Timing(statistics.median(times), min(times), max(times), len(times), statistics.median(host),
                  statistics.median(clocks) if clocks else None)


def median_time_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    return time_ms(fn, device, reps, warmup).median


def exact_fp32(q, k, v) -> torch.Tensor:
    """Exact attention in FP32: SDPA's FP32 kernels on a GPU (fast at 75k tokens), chunked torch on CPU."""
    if q.device.type == "cuda":
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return exact_attention(q, k, v)[0]


def _sdpa_variant(name: str):
    """A callable forcing one SDPA implementation, or None when this torch/device lacks it."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    backend = getattr(SDPBackend, SDPA_VARIANTS[name], None)
    if backend is None:
        return None

    def run(q, k, v):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return run


def bench_shape(shape: Shape, device: torch.device, backends: List[str], reps: int,
                warmup: int = 2, inputs: str = "standard", smooth_v: bool = False,
                with_auto: bool = False) -> List[Dict]:
    q, k, v = make_inputs(shape, device, kind=inputs)
    exact = exact_fp32(q, k, v)
    rows: List[Dict] = []

    def record(name: str, fn, quantized: bool):
        try:
            out = fn()
            t = time_ms(fn, device, reps, warmup)
        except Exception as exc:  # report, never abort the whole table
            rows.append({"backend": name, "status": f"error: {type(exc).__name__}: {exc}", "quantized": quantized})
            return
        rows.append({"backend": name, "status": "ok", "ms": t.median, "ms_min": t.low, "ms_max": t.high,
                     "reps": t.reps, "host_us": t.host * 1e3, "clock_mhz": t.clock_mhz,
                     "cos": cosine(out, exact), "rel_l1": rel_l1(out, exact),
                     "quantized": quantized, "finite": bool(torch.isfinite(out).all())})

    record("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), False)
    if device.type == "cuda":
        for variant in SDPA_VARIANTS:
            run = _sdpa_variant(variant)
            if run is not None:
                record(variant, lambda run=run: run(q, k, v), False)
    call = describe_call(q, k, v, smooth_v=smooth_v)
    for name in backends:
        if name == "sdpa":
            continue
        backend = get_backend(name)
        reason = backend.ready(call)  # runs its first-use self-check
        if reason:
            rows.append({"backend": name, "status": f"skipped: {reason}", "quantized": backend.quantized})
            continue
        record(name, lambda name=name: sage_attention(q, k, v, kernel=name, smooth_v=smooth_v), backend.quantized)
    if with_auto:  # one row: the backend auto takes, timed like the others, with auto's own measurement
        chosen, note = auto_choice(q, k, v, call)
        record(f"auto={chosen.name}", lambda: sage_attention(q, k, v, kernel="auto", smooth_v=smooth_v),
               chosen.quantized)
        rows[-1]["note"] = note
    base = next((r["ms"] for r in rows if r["backend"] == "sdpa" and r["status"] == "ok"), None)
    best = min((r["ms"] for r in rows if r["backend"].startswith("sdpa") and r["status"] == "ok"), default=None)
    for r in rows:
        r["shape"] = shape.name if inputs == "standard" else f"{shape.name}:{inputs}"
        r["inputs"] = inputs
        if r["status"] == "ok":
            r["vs_sdpa"] = r["ms"] / base if base else None
            r["vs_best_sdpa"] = r["ms"] / best if best else None
    return rows


def auto_choice(q, k, v, call):
    """What `auto` takes for this shape and why: on a GPU its first-use measurement (kernels/tuner.py)."""
    from .dispatch import settled_route

    route = settled_route(call, "auto", tensors=(q, k, v))
    decision = route.decision
    return route.backend, (decision.summary if decision is not None else "auto measured nothing here: static order")


COLUMNS = """\
columns: ms = median time per call over the timed repeats, and [fastest-slowest] repeat;
  host_us = median microseconds the host spent issuing one call (Python, checks, allocations, kernel launches),
          timed without waiting for the GPU; on the CPU there is no separate device, so it is the same wall
          time as ms (in microseconds);
  MHz = median SM clock read while the timed repeats ran (torch.cuda.clock_rate: NVML on NVIDIA, amdsmi on
          AMD; the driver averages it over its last sample period, 1/6 s to 1 s, so for short calls it reads
          the recent repeats; "-" where it cannot be read, and on the CPU). Under a power cap the clock follows
          the power a kernel draws: a faster time at a higher clock may not hold where the GPU is already near
          its cap, as inside a model step after its matrix multiplications (docs/MEASUREMENTS.md);
  /sdpa = this backend's median / PyTorch's default SDPA median on the same shape in this run
          (1 = as fast as SDPA, above 1 = slower, below 1 = faster);
  /best = the same ratio against the fastest SDPA variant measured here (sdpa, and on a GPU sdpa_cudnn
          and sdpa_flash where this torch has them; on the CPU only sdpa, so /best = /sdpa);
  cosine, relL1 = accuracy against exact FP32 attention on the same inputs (1 and 0 are exact); a quantized
          backend below cosine {floor} (not applied to the *_voffset inputs), or above its input kind's rel L1
          bound (diffuse 0.08, diffuse_voffset and regional_voffset 0.02), fails the self-check;
  auto=NAME (GPU, no --backends) = the backend kernel="auto" takes on this shape, timed like the others; its
          note gives auto's own first-use measurement (each backend's time / SDPA's)."""

CPU_NOTE = ("CPU figures are not speed claims: on the CPU the quantized path is the torch reference of the "
            "algorithm (or the Triton interpreter), a correctness check and no fast path, and timings on a shared CPU "
            "vary several-fold between runs; see the [fastest-slowest] range. Speed is measured on the GPU.")


def _fmt(x: Optional[float], width: int, spec: str) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{spec}}"


def accuracy_problem(r: Dict) -> Optional[str]:
    """Why a quantized row fails the self-check (cosine floor, its input kind's rel L1 bound, non-finite)."""
    if r["status"] != "ok" or not r["quantized"]:
        return None
    kind = r.get("inputs", "standard")
    if not r["finite"]:
        return "non-finite output"
    if kind not in OFFSET_KINDS and r["cos"] < COSINE_FLOOR:
        return f"cosine {r['cos']:.5f} < {COSINE_FLOOR}"
    bound = REL_L1_BOUND.get(kind)
    if bound is not None and r["rel_l1"] > bound:
        return f"rel L1 {r['rel_l1']:.4f} > {bound} ({kind} inputs)"
    return None


def format_table(rows: List[Dict]) -> str:
    width = max([14] + [len(r["shape"]) for r in rows])
    lines = [f"{'shape':<{width}} {'backend':<20} {'ms':>9} {'[fastest-slowest]':>19} {'host_us':>9} {'MHz':>5} "
             f"{'/sdpa':>7} {'/best':>7} {'cosine':>9} {'relL1':>8}  note"]
    for r in rows:
        if r["status"] == "ok":
            flag = "SELF-CHECK FAIL" if accuracy_problem(r) else r.get("note", "")
            spread = f"[{r['ms_min']:.3f}-{r['ms_max']:.3f}]" if "ms_min" in r else ""
            lines.append(f"{r['shape']:<{width}} {r['backend']:<20} {r['ms']:9.3f} {spread:>19} "
                         f"{_fmt(r.get('host_us'), 9, '.1f')} {_fmt(r.get('clock_mhz'), 5, '.0f')} "
                         f"{_fmt(r['vs_sdpa'], 7, '.3f')} {_fmt(r['vs_best_sdpa'], 7, '.3f')} {r['cos']:9.5f} "
                         f"{r['rel_l1']:8.4f}  {flag}")
        else:
            lines.append(f"{r['shape']:<{width}} {r['backend']:<20} {'-':>9} {'-':>19} {'-':>9} {'-':>5} {'-':>7} "
                         f"{'-':>7} {'-':>9} {'-':>8}  {r['status']}")
    return "\n".join(lines)


def self_check_failures(rows: List[Dict]) -> List[str]:
    return [f"{r['shape']}/{r['backend']}: {accuracy_problem(r)}" for r in rows if accuracy_problem(r)]


def failed_self_check(reason: Optional[str]) -> bool:
    """A backend taken out of service by its first-use self-check on this device (Backend.disable's reason)."""
    return bool(reason) and "self-check" in reason


def run_problems(rows: List[Dict], requested: List[str], not_available: Optional[Dict[str, str]] = None) -> List[str]:
    """Why the run cannot count as a pass, besides accuracy: a backend that raised or failed its first-use
    self-check (always), and a backend the user named with --backends that did not run on some shape."""
    problems = [f"{b} failed its first-use self-check: {reason}" for b, reason in (not_available or {}).items()
                if failed_self_check(reason)]
    for r in rows:
        status = r["status"]
        if status.startswith("error"):
            problems.append(f"{r['shape']}/{r['backend']} failed: {status[len('error: '):]}")
        elif status.startswith("skipped") and (r["backend"] in requested or failed_self_check(status)):
            problems.append(f"{r['shape']}/{r['backend']} did not run: {status[len('skipped: '):]}")
    return problems


def environment() -> Dict:
    info = {"torch": torch.__version__, "hip": getattr(torch.version, "hip", None),
            "cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["device"] = props.name
        info["arch"] = describe_call(*[torch.zeros(1, 1, 1, 8, device="cuda")] * 3).arch
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["hip_code"] = hip_code_path()
    return info


def hip_code_path() -> Optional[str]:
    """What serves the HIP kernels here ('prebuilt gfx1201 1a2b3c4d', 'hiprtc 7.0'): known once the backends
    were asked whether they run here (which loads a shipped object); None where they do not."""
    try:
        from .backends.hip import runtime
        return runtime.code_path_line()
    except Exception:  # the environment line never fails over this
        return None


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (what was wrong, and where to look), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def parse_device(parser: argparse.ArgumentParser, text: Optional[str]) -> torch.device:
    """--device: cpu, cuda or cuda:N, and only a GPU that torch can see."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"argument --device: {text!r} is not a device; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: {text!r}: only cpu, cuda or cuda:N are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"argument --device: {text!r}: torch sees no GPU here (torch {torch.__version__}, "
                         "torch.cuda.is_available() is False); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            parser.error(f"argument --device: {text!r}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}")
    if device.type == "cpu" and device.index is not None:
        device = torch.device("cpu")
    return device


EPILOG = """\
What the table shows:
  ms            median milliseconds per call over the timed repeats (--reps), then [fastest-slowest] repeat
  host_us       median microseconds the host spends issuing one call (Python, checks, allocations, kernel
                launches), timed without waiting for the GPU: the CPU cost per call beside the device time.
                On the CPU there is no separate device: host time is the call's wall time, the same as ms
  /sdpa         median / PyTorch's default SDPA median on the same shape in the same run:
                1 = as fast as SDPA, above 1 = slower, below 1 = faster
  /best         the same ratio against the fastest SDPA variant measured (sdpa; on a GPU also sdpa_cudnn and
                sdpa_flash when this torch has them); on the CPU only sdpa exists, so /best = /sdpa
  cosine relL1  accuracy against exact FP32 attention on the same inputs; a quantized backend below cosine
                {floor} fails the self-check

Exit status: 0 when every quantized backend that was asked for ran on every shape and passed the self-check;
1 when one failed it (here or in its first-use self-check), raised, or was named with --backends and did not
run (not available, or refused the shape), or when no quantized backend ran at all; 2 for a usage error.
Without --backends, backends that cannot run on this device are listed as "not available here" and do not
fail the run (unless the reason is a failed first-use self-check).

On the CPU the figures are not speed claims (the quantized path there is the torch reference of the algorithm,
and a shared CPU's timings vary several-fold between runs); more repeats are taken and the range is shown.
Under TRITON_INTERPRET=1 the Triton backends run on the CPU in Python: minutes per call at these shapes."""


def json_path_problem(path: str) -> Optional[str]:
    """Why --json PATH cannot be written (checked before the run, so a long benchmark is not lost at its end),
    or None. '-' is stdout."""
    if path == "-":
        return None
    if os.path.isdir(path):
        return f"{path!r} is a folder; give a file name in it"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(folder):
        return f"cannot write {path!r}: its folder does not exist ({folder})"
    if not os.path.isdir(folder):
        return f"cannot write {path!r}: {folder} is not a folder"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"cannot write {path!r}: the file is not writable"
    if not os.path.exists(path) and not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write {path!r}: its folder {folder} is not writable"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = _Parser(prog="benchmark.py", description=__doc__.splitlines()[0],
                     epilog=EPILOG.format(floor=COSINE_FLOOR), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU if there is one)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape names (GPU: " + ", ".join(s.name for s in GPU_SHAPES)
                             + "; CPU: " + ", ".join(s.name for s in CPU_SHAPES) + "; a quick check: "
                             + ", ".join(s.name for s in SMOKE_SHAPES) + ")")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backend names (default: all; on a GPU all but the slow 'reference'); "
                             "a quantized backend named here that does not run fails the run")
    parser.add_argument("--reps", type=positive_int, default=None,
                        help=f"timed repeats per backend, >= 1 (default {GPU_REPS} on a GPU, {CPU_REPS} on the CPU); "
                             "the median and the range are reported")
    parser.add_argument("--inputs", default="standard",
                        help="comma-separated input kinds: " + ", ".join(INPUT_KINDS) + " (default standard). "
                             "diffuse: near-uniform attention, zero-mean V; diffuse_voffset: the same with a "
                             "per-channel V offset, judged by rel L1 (a lost scale shows there, not in cosine); "
                             "regional_voffset: keys in runs that each query mostly attends within, V offset per "
                             "run (judged by rel L1 too)")
    parser.add_argument("--smooth-v", action="store_true",
                        help="run our kernels with smooth_v (V's per-channel mean out before quantizing, added back)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the results as JSON to PATH (checked before the run: a PATH that cannot be "
                             "written is a usage error); '-' writes them to stdout (the table then goes to stderr)")
    args = parser.parse_args(argv)

    if args.json:
        problem = json_path_problem(args.json)
        if problem:
            parser.error(f"argument --json: {problem}")
    device = parse_device(parser, args.device)
    catalogue = {s.name: s for s in GPU_SHAPES + CPU_SHAPES + SMOKE_SHAPES}
    if args.shapes:
        names = [n for n in args.shapes.split(",") if n]
        unknown = [n for n in names if n not in catalogue]
        if unknown or not names:
            parser.error(f"argument --shapes: unknown {unknown or args.shapes!r}; choose from {', '.join(catalogue)}")
        shapes = [catalogue[n] for n in names]
    else:
        shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    requested: List[str] = []
    if args.backends:
        requested = [b for b in args.backends.split(",") if b]
        bad = [b for b in requested if b not in BACKEND_NAMES]
        if bad or not requested:
            parser.error(f"argument --backends: unknown {bad or args.backends!r}; "
                         f"choose from {', '.join(BACKEND_NAMES)}")
    kinds = [k for k in args.inputs.split(",") if k]
    if not kinds or any(k not in INPUT_KINDS for k in kinds):
        parser.error(f"argument --inputs: unknown {args.inputs!r}; choose from {', '.join(INPUT_KINDS)}")
    reps = args.reps or (GPU_REPS if device.type == "cuda" else CPU_REPS)
    warmup = 2 if device.type == "cuda" else 1

    out = sys.stderr if args.json == "-" else sys.stdout

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    not_available: Dict[str, str] = {}
    if requested:
        backends = requested
    else:
        backends = []
        for b in BACKEND_NAMES:
            if device.type == "cuda" and b == "reference":
                continue
            reason = get_backend(b).unavailable(device.type, index)
            if reason:
                not_available[b] = reason
            else:
                backends.append(b)

    env = environment()
    say("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if not_available:
        say("backends left out (name one with --backends to make its absence an error):")
        for b, reason in not_available.items():
            say(f"  {b}: not available here: {reason}")
    if device.type == "cpu":
        say(CPU_NOTE)
        if os.environ.get("TRITON_INTERPRET") == "1" and any(b.startswith("triton") for b in backends):
            say("warning: TRITON_INTERPRET=1 runs the Triton kernels on the CPU in Python: expect minutes per call "
                "at these shapes (a quick check: --shapes tiny --reps 1)")
    rows: List[Dict] = []
    for shape in shapes:
        for kind in kinds:
            say(f"-- {shape.name}: B{shape.batch} H{shape.heads} N{shape.seq} D{shape.head_dim} {shape.dtype}, "
                f"{kind} inputs{', smooth_v' if args.smooth_v else ''}")
            rows.extend(bench_shape(shape, device, backends, reps, warmup, kind, args.smooth_v,
                                    with_auto=device.type == "cuda" and not requested))
    say(f"{reps} timed repeats per backend after {warmup} untimed warm-up call(s), on {device}.")
    say(COLUMNS.format(floor=COSINE_FLOOR))
    say(format_table(rows))

    failures = self_check_failures(rows)
    problems = run_problems(rows, requested, not_available)
    quantized_wanted = [b for b in backends if get_backend(b).quantized]
    ran = sorted({r["backend"] for r in rows if r["status"] == "ok" and r["quantized"]})
    timing_only = bool(requested) and not quantized_wanted  # e.g. --backends sdpa: nothing to self-check
    passed = not failures and not problems and (bool(ran) or timing_only)
    verdict = {"passed": passed, "self_check_failures": failures, "problems": problems,
               "quantized_backends_run": ran, "not_available": not_available}
    if args.json:
        doc = {"environment": env, "device": str(device), "reps": reps, "warmup": warmup, "inputs": kinds,
               "smooth_v": args.smooth_v,
               "shapes": [asdict(s) for s in shapes], "rows": rows, "verdict": verdict}
        if args.json == "-":
            json.dump(doc, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
            say(f"results written to {args.json}")
    if device.type == "cpu":
        say("(CPU timings: not speed claims.)")
    if failures:
        say("SELF-CHECK FAILED: " + "; ".join(failures))
    for p in problems:
        say(f"FAILED: {p}")
    if not ran:
        if timing_only:
            say("no quantized backend ran (none was asked for): timing only, nothing was self-checked")
        elif not quantized_wanted:
            say("no quantized backend ran: none is available on this device (see 'not available here' above)")
        else:
            say("no quantized backend ran")
    if not passed:
        return 1
    if ran:
        say(f"self-check passed: {', '.join(ran)} met the accuracy bounds against exact FP32 attention on every "
            f"shape and input kind")
    return 0
