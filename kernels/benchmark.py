"""The main job: every available backend against SDPA on real models' attention shapes.

For each shape it prints time relative to SDPA measured in the same run (median of repeats) and the
accuracy against exact FP32 attention (cosine, relative L1), as a table and as JSON. A quantized
backend below the accuracy floor is a self-check failure (exit status 1). Needs no ComfyUI.
"""
from __future__ import annotations

import argparse
import json
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
    Shape("wan_480p", 1, 40, 32760, 128, "bfloat16"),       # Wan 2.x 832x480, 81 frames
    Shape("wan_720p", 1, 40, 75600, 128, "bfloat16"),       # Wan 2.x 1280x720, 81 frames
    Shape("sdxl_1mp_d64", 2, 10, 4096, 64, "float16"),      # SDXL at 1024x1024, first-level self attention
]
CPU_SHAPES = [
    Shape("flux_small", 1, 4, 1024, 128, "bfloat16"),
    Shape("wan_small", 1, 2, 2048, 128, "bfloat16"),
    Shape("sdxl_small", 2, 2, 1024, 64, "float16"),
]
SDPA_VARIANTS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION"}


def make_inputs(shape: Shape, device: torch.device, seed: int = 0):
    """Diffusion-like inputs: Gaussian q/k/v with a per-channel offset on K (the case smooth_k exists for)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    size = (shape.batch, shape.heads, shape.seq, shape.head_dim)
    q = torch.randn(size, generator=gen)
    k = torch.randn(size, generator=gen) + 3.0 * torch.randn((1, shape.heads, 1, shape.head_dim), generator=gen)
    v = torch.randn(size, generator=gen)
    return [t.to(device=device, dtype=shape.torch_dtype) for t in (q, k, v)]


def median_time_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times: List[float] = []
    if device.type == "cuda":
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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


def bench_shape(shape: Shape, device: torch.device, backends: List[str], reps: int) -> List[Dict]:
    q, k, v = make_inputs(shape, device)
    exact = exact_fp32(q, k, v)
    rows: List[Dict] = []

    def record(name: str, fn, quantized: bool):
        try:
            out = fn()
            ms = median_time_ms(fn, device, reps)
        except Exception as exc:  # report, never abort the whole table
            rows.append({"backend": name, "status": f"error: {type(exc).__name__}: {exc}"})
            return
        rows.append({"backend": name, "status": "ok", "ms": ms, "cos": cosine(out, exact),
                     "rel_l1": rel_l1(out, exact), "quantized": quantized,
                     "finite": bool(torch.isfinite(out).all())})

    record("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), False)
    if device.type == "cuda":
        for variant in SDPA_VARIANTS:
            run = _sdpa_variant(variant)
            if run is not None:
                record(variant, lambda run=run: run(q, k, v), False)
    call = describe_call(q, k, v)
    for name in backends:
        if name == "sdpa":
            continue
        reason = get_backend(name).why_not(call)
        if reason:
            rows.append({"backend": name, "status": f"skipped: {reason}"})
            continue
        record(name, lambda name=name: sage_attention(q, k, v, kernel=name), get_backend(name).quantized)
    base = next((r["ms"] for r in rows if r["backend"] == "sdpa" and r["status"] == "ok"), None)
    best = min((r["ms"] for r in rows if r["backend"].startswith("sdpa") and r["status"] == "ok"), default=None)
    for r in rows:
        r["shape"] = shape.name
        if r["status"] == "ok":
            r["vs_sdpa"] = r["ms"] / base if base else None
            r["vs_best_sdpa"] = r["ms"] / best if best else None
    return rows


def format_table(rows: List[Dict]) -> str:
    lines = [f"{'shape':<14} {'backend':<18} {'ms':>9} {'/sdpa':>7} {'/best':>7} {'cosine':>9} {'relL1':>8}  note"]
    for r in rows:
        if r["status"] == "ok":
            flag = "" if (not r["quantized"] or (r["cos"] >= COSINE_FLOOR and r["finite"])) else "SELF-CHECK FAIL"
            lines.append(f"{r['shape']:<14} {r['backend']:<18} {r['ms']:9.3f} {r['vs_sdpa']:7.3f} "
                         f"{r['vs_best_sdpa']:7.3f} {r['cos']:9.5f} {r['rel_l1']:8.4f}  {flag}")
        else:
            lines.append(f"{r['shape']:<14} {r['backend']:<18} {'-':>9} {'-':>7} {'-':>7} {'-':>9} {'-':>8}  {r['status']}")
    return "\n".join(lines)


def self_check_failures(rows: List[Dict]) -> List[str]:
    return [f"{r['shape']}/{r['backend']}: cosine {r['cos']:.5f}" for r in rows
            if r["status"] == "ok" and r["quantized"] and (r["cos"] < COSINE_FLOOR or not r["finite"])]


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
    return info


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the GPU if there is one)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape names (GPU: " + ", ".join(s.name for s in GPU_SHAPES)
                             + "; CPU: " + ", ".join(s.name for s in CPU_SHAPES) + ")")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backend names (default: all; on a GPU all but the slow 'reference')")
    parser.add_argument("--reps", type=int, default=None, help="timed repeats per backend (median is reported)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    catalogue = {s.name: s for s in GPU_SHAPES + CPU_SHAPES}
    if args.shapes:
        unknown = [n for n in args.shapes.split(",") if n not in catalogue]
        if unknown:
            parser.error(f"unknown shapes {unknown}; choose from {sorted(catalogue)}")
        shapes = [catalogue[n] for n in args.shapes.split(",")]
    else:
        shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    default = [b for b in BACKEND_NAMES if device.type != "cuda" or b != "reference"]
    backends = [b for b in args.backends.split(",") if b] if args.backends else default
    for b in backends:
        if b not in BACKEND_NAMES:
            parser.error(f"unknown backend {b!r}; choose from {', '.join(BACKEND_NAMES)}")
    reps = args.reps or (20 if device.type == "cuda" else 3)

    env = environment()
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    rows: List[Dict] = []
    for shape in shapes:
        print(f"-- {shape.name}: B{shape.batch} H{shape.heads} N{shape.seq} D{shape.head_dim} {shape.dtype}", flush=True)
        rows.extend(bench_shape(shape, device, backends, reps))
    print(format_table(rows))
    print(json.dumps({"environment": env, "shapes": [asdict(s) for s in shapes], "rows": rows}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "shapes": [asdict(s) for s in shapes], "rows": rows}, f, indent=1)
    failures = self_check_failures(rows)
    if failures:
        print("SELF-CHECK FAILED: " + "; ".join(failures))
        return 1
    print(f"self-check passed: every quantized backend that ran reached cosine >= {COSINE_FLOOR} against exact FP32 attention")
    return 0
