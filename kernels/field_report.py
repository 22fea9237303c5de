"""The field report: what a volunteer's run on their GPU shows, as one JSON file and one Markdown summary.

    python field_report.py [--out FOLDER]      (the root script; no arguments needed)

Sections, each run on its own (an error is recorded with its traceback and the next section runs):
environment (OS, Python, torch, HIP/ROCm, driver, GPU, CUs), libraries (which libamdhip64 and hiprtc were
found, where), the hardware probes (kernels/backends/hip/probes.py), the first-use self-check of every
quantized kernel and variant (per case: time, verdict), the HIP code path (prebuilt object or hiprtc), kernel
time against SDPA and accuracy on every input kind of kernels/benchmark.py, and what `auto` chooses per shape and why.
Beside the sections, the first-use ledger (kernels/first_use_costs.py): every first-use part the run paid, with its
seconds: each self-check (its Triton compiles included), the hardware probes, each kind of call auto measured.
On the CPU it is short: no GPU kernel runs there (the torch reference, the spec, takes the self-check), and the
benchmark uses one tiny shape, since the real shapes take minutes per call there.

A volunteer may run it once: nothing it finds is lost. The two files are made before the first section runs (an
--out that cannot take them stops the run at once, with one line), and rewritten, each atomically, after every
section: at any moment both are complete and valid, and name the sections still missing and why. Ctrl-C writes
what finished and exits with 130.
Never imports ComfyUI or kernels/verify/.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from typing import Callable, Dict, List, Optional

import torch

from . import benchmark as bench
from . import first_use_costs, launch_split, settings
from .call_spec import describe_call
from .disk_cache import write_atomically
from .dispatch import settled_route
from .registry import get_backend
from .routing import EXACT, RUN
from .self_check import DEFAULT_CASES, Variant, backend_attention, case_call, run_self_check

SCHEMA = 3  # 2: `status` and `missing` (sections not run, and why), written after every section; 3: `first_use`
QUANTIZED = ("hip_int8_fp8", "hip_int8_fp16", "triton_int8_fp8", "triton_int8_fp16")
GPU_SHAPES = ("flux_1mp", "flux_2mp", "sdxl_1mp_d64", "wan_480p")
CPU_SHAPES = ("tiny",)
CPU_NOTE = ("CPU run: no GPU kernel can run here. The self-check runs on the torch reference (the spec), the "
            "benchmark on the tiny shape only (the real shapes take minutes per call on the CPU), and the "
            "timings are no speed claims.")
GPU_REPS, CPU_REPS = 10, 3  # timed repeats on standard inputs; the other input kinds are timed once (accuracy)
PROBES_NOT_RUN = "hardware probes: not run"
TITLE = "SageAttention RDNA4 field report"


# ------------------------------------------------------------------------------------------ sections
def _error(exc: BaseException) -> Dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _driver_versions() -> Dict[str, Optional[str]]:
    """What the machine says about its GPU driver: amdgpu's module version (Linux DKMS driver), and the version
    number the HIP or CUDA driver API reports."""
    found: Dict[str, Optional[str]] = {}
    try:
        with open("/sys/module/amdgpu/version", encoding="utf-8") as fh:
            found["amdgpu_module"] = fh.read().strip()
    except OSError:
        found["amdgpu_module"] = None
    if getattr(torch.version, "hip", None):
        from .backends.hip.runtime import hip_library_candidates, open_first
        lib, _ = open_first(hip_library_candidates(), "the HIP runtime")
        version = ctypes.c_int(0)
        fn = lib.hipDriverGetVersion
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        found["hip_driver"] = str(version.value) if fn(ctypes.byref(version)) == 0 else None
    elif torch.version.cuda and torch.cuda.is_available():
        for name in ("libcuda.so.1", "nvcuda.dll", "libcuda.so"):
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            version = ctypes.c_int(0)
            if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
                found["cuda_driver"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
            break
    return found


def environment_section(device: torch.device) -> Dict:
    from .cache_identity import pack_version
    info = {"os": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "hip": getattr(torch.version, "hip", None), "cuda": torch.version.cuda, "pack_version": pack_version(),
            "device": str(device), "settings": settings.in_effect()}  # each set variable: its text and the value used
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as exc:  # absent, or broken: both worth knowing
        info["triton"] = f"not importable: {type(exc).__name__}: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, compute_units=props.multi_processor_count,  # SMs on NVIDIA
                    memory_gib=round(props.total_memory / 2**30, 1),
                    arch=describe_call(*[torch.zeros(1, 1, 1, 8, device=device)] * 3).arch)
        if info["hip"]:  # the full name with target features ('gfx1201:sramecc+:xnack-' style); ROCm only
            info["gcn_arch_name"] = getattr(props, "gcnArchName", None)
    info["driver"] = _driver_versions()
    info["launch_work_bound"] = (f"{launch_split.work_bound(device):.3g} operations per attention launch "
                                 f"(kernels/launch_split.py)")
    return info


def libraries_section(device: torch.device) -> Dict:
    """The HIP runtime and runtime compiler the HIP kernels would use, and where they were found."""
    from .backends.hip import compiler, runtime
    kind = runtime.runtime_kind()
    out: Dict[str, object] = {"runtime_kind": kind}
    if kind != "hip" and not settings.hip_emulation_requested():
        out["note"] = (f"not a ROCm build of PyTorch: the HIP kernels run here only as the gfx12 emulation, with "
                       f"{settings.HIP_EMULATE.name}=1")
        out["libamdhip64_on_disk"] = [p for p in runtime.hip_library_candidates() if os.path.isfile(p)]
        return out
    reason = runtime.runtime_unavailable_reason(kind)
    if reason:
        out["runtime"] = {"found": False, "reason": reason}
    else:
        rt = runtime.get_runtime(kind)
        out["runtime"] = {"found": True, "path": getattr(rt, "library", None), "version": rt.version()}
    ckind = runtime.compiler_kind(kind)
    reason = compiler.compiler_unavailable_reason(ckind)
    if reason:
        out["compiler"] = {"kind": ckind, "found": False, "reason": reason}
    else:
        comp = compiler.get_compiler(ckind)
        out["compiler"] = {"kind": ckind, "found": True, "path": getattr(comp, "library", None),
                           "version": comp.version()}
    if kind == "hip":
        from .backends.hip.platform import loaded_library_paths, windows_loaded_module
        out["loaded_in_process"] = (loaded_library_paths("amdhip64") + loaded_library_paths("hiprtc")
                                    + windows_loaded_module(["amdhip64_7.dll", "amdhip64_6.dll"]))
        out["hiprtc_on_disk"] = [p for p in compiler.hiprtc_candidates() if os.path.isfile(p)]
    return out


def hip_code_path_section(device: torch.device) -> Dict:
    """Which path serves the HIP kernels (a prebuilt code object or hiprtc), read after the self-check loaded
    them; 'unknown' where this version of the loader does not say."""
    from .backends.hip import runtime
    line_of: Optional[Callable[[], Optional[str]]] = getattr(runtime, "code_path_line", None)
    if line_of is None:
        return {"path": "unknown", "note": "this version of the HIP loader does not report it"}
    return {"path": line_of() or "none: no HIP kernel was loaded in this run"}


def _hip_refusal(device: torch.device) -> Optional[str]:
    """Why no HIP kernel (and so no probe) can run on `device`, or None."""
    if device.type != "cuda":
        return f"no GPU ({device.type}): the probes run the HIP kernels' instructions on an RDNA4 card"
    from .backends.hip.runtime import environment_refusal
    return environment_refusal(device.type, device.index)


def probes_section(device: torch.device) -> Dict:
    """The hardware probes of this device (the ones first use ran, or run now): every result with its verdict, what
    it found and what the spec expects; or why they could not run here."""
    refusal = _hip_refusal(device)
    if refusal:
        return {"status": "not run", "note": f"{PROBES_NOT_RUN}: {refusal}", "results": []}
    from .backends.hip import probes
    for name in ("hip_int8_fp8", "hip_int8_fp16"):  # as first use does: a failure disables what relies on it
        refuse = getattr(get_backend(name), "probe_refusal", None)
        if refuse is not None:
            refuse(device.type, device.index)
    report = probes.probe_device(device.type, device.index)
    status = "could not run" if report.error else ("failed" if report.failures() else "ran")
    return {"status": status, "note": report.summary(), **report.as_dict()}


PV_CHAIN_SHAPES = ("flux_1mp", "sdxl_1mp_d64")  # one D128 and one D64 shape


def pv_chain_section(device: torch.device, say: Callable[[str], None]) -> Dict:
    """The HIP P.V chain each backend took on this device at first use and why (the accumulator probe, the
    self-check's accumulation cases, SAGE_RDNA4_HIP_PV_CHAIN), and the attention kernel alone timed with each chain
    where a single chain ships, on the same quantized inputs (the prologue is shared, and not timed)."""
    from .backends.hip import kernel_abi, pv_chain
    out: Dict[str, object] = {"choices": {}, "timings": []}
    for pv in ("fp8", "fp16"):
        c = pv_chain.recorded(pv, device.type, device.index)
        out["choices"][f"hip_int8_{pv}"] = c.line() if c else "not chosen: the backend did not reach first use here"
    if device.type != "cuda":
        out["note"] = f"no GPU ({device.type}): nothing timed"
        return out
    catalogue = {s.name: s for s in bench.GPU_SHAPES}
    for pv in kernel_abi.SINGLE_CHAIN_PV:
        backend = get_backend(f"hip_int8_{pv}")
        reason = backend.unavailable(device.type, device.index)
        if reason:
            out["timings"].append({"kernel": backend.name, "unavailable": reason})
            continue
        for shape in (catalogue[n] for n in PV_CHAIN_SHAPES):
            say(f"  {backend.name} {shape.name}: {' and '.join(kernel_abi.CHAINS)} P.V")
            row = {"kernel": backend.name, "shape": shape.name, **_time_chains(shape, pv, device)}
            row["single / two-level"] = round(row["single ms"] / row["two-level ms"], 4)
            out["timings"].append(row)
            torch.cuda.empty_cache()
    return out


def _time_chains(shape, pv: str, device: torch.device) -> Dict[str, float]:
    """{'<chain> ms': median ms} of the HIP attention kernel of each chain on one quantized input of `shape`."""
    from .backends.hip import kernel_abi
    from .backends.hip.backend import launch_attention, quantize
    q, k, v = bench.make_inputs(shape, device)
    call = describe_call(q, k, v)
    sm = 1.0 / shape.head_dim ** 0.5
    qq = quantize(q, k, v, call, sm, pv)
    times = {}
    for chain in kernel_abi.CHAINS:
        def run(chain=chain):
            return launch_attention(qq, pv=pv, is_causal=False, return_lse=False, sm_scale=sm, q=q,
                                    out_dtype=call.dtype, chain=chain)
        times[f"{chain} ms"] = round(bench.time_ms(run, device, GPU_REPS).median, 4)
    return times


def self_check_targets(device: torch.device) -> List[Dict]:
    """What the self-check section runs: every quantized kernel that can run here with each prologue (the accurate
    options: per-token INT8, smooth_k on) and with smooth_v; on the CPU also the torch reference (the spec). Each
    target: kernel, variant (text), and either `attention` + `refuse` (case -> reason or None) or `unavailable`."""
    targets = []
    like = (describe_call(*[torch.zeros(1, 1, 1, 64, device=device, dtype=torch.float16)] * 3)
            if device.type == "cuda" else None)
    for name in QUANTIZED:
        backend = get_backend(name)
        reason = backend.unavailable(device.type, device.index)
        if reason:  # one line per kernel: no variant of it can run here
            targets.append({"kernel": name, "variant": "any", "unavailable": reason})
            continue
        own, other = backend.own_prologue, "triton" if backend.own_prologue == "hip" else "hip"
        for variant in (Variant(own, "token", True, False), Variant(other, "token", True, False),
                        Variant(own, "token", True, True)):
            targets.append({"kernel": name, "variant": variant.describe(),
                            "attention": backend_attention(backend, variant),
                            "refuse": lambda case, b=backend, v=variant: b.refuse(case_call(case, like, v))})
    if device.type != "cuda":
        targets.append({"kernel": "reference (the spec, CPU)", "variant": "torch prologue, per-token INT8, smooth_k on",
                        "attention": backend_attention(get_backend("reference"), Variant("auto", "token", True, False)),
                        "refuse": lambda case: None})
    return targets


CASES = DEFAULT_CASES  # the self-check's cases (kernels/self_check.py); tests run fewer


def self_check_section(device: torch.device, say: Callable[[str], None], results: Optional[List] = None) -> List[Dict]:
    """One entry per target, appended to `results` as each starts (what collect keeps of a section Ctrl-C stops)."""
    results = [] if results is None else results
    for target in self_check_targets(device):
        entry = {"kernel": target["kernel"], "variant": target["variant"]}
        results.append(entry)
        try:
            refusals = [None] if "unavailable" in target else [target["refuse"](c) for c in CASES]
            if "unavailable" in target or all(refusals):
                entry.update(status="not available", reason=target.get("unavailable") or refusals[0])
                continue
            say(f"  self-check {target['kernel']} ({target['variant']})")
            refuse = target["refuse"]
            res = run_self_check(target["attention"], device, CASES, lambda c, refuse=refuse: refuse(c) is None,
                                 stop_at_first=False)
        except Exception as exc:
            entry.update(status="error", **_error(exc))
            say(f"    error: {entry['error']}")
            continue
        entry.update(status="passed" if res.passed else "failed", reason=res.reason, seconds=round(res.seconds, 3),
                     cases=[{"case": r.case.label(), "verdict": "passed" if r.reason is None else "failed",
                             "reason": r.reason, "worst_rel_l1": _num(r.worst_rel_l1),
                             "worst_cosine": _num(r.worst_cosine), "lse_error": _num(r.lse_error),
                             "seconds": round(r.seconds, 3)} for r in res.results],
                     skipped_cases=[c.label() for c in res.skipped])
        if res.warm_up is not None:  # the Triton kernels compiled side by side before the cases (precompile.py)
            entry["warm_up"] = dict(vars(res.warm_up), seconds=round(res.warm_up.seconds, 3))
        say(f"    {entry['status']} in {res.seconds:.1f} s" + (f": {res.reason}" if res.reason else ""))
        # The first self-check of a kernel pays its compiles: the ledger shows it beside auto's own first uses.
        first_use_costs.record(f"self-check {target['kernel']} ({target['variant']}) on {device}", res.seconds)
    return results


def _num(x) -> Optional[float]:
    return None if x is None or x != x else float(x)  # NaN (not measured) as null


def _shapes(device: torch.device):
    names = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    catalogue = {s.name: s for s in bench.GPU_SHAPES + bench.CPU_SHAPES + bench.SMOKE_SHAPES}
    return [catalogue[n] for n in names]


def _benchmark_backends(device: torch.device) -> List[str]:
    """SDPA and every other backend that can run here (on a GPU not the slow reference)."""
    index = device.index if device.type == "cuda" else None
    return [n for n in bench.BACKEND_NAMES if n != "sdpa" and not (device.type == "cuda" and n == "reference")
            and get_backend(n).unavailable(device.type, index) is None]


ROW_KEYS = ("backend", "status", "ms", "ms_min", "ms_max", "reps", "vs_sdpa", "vs_best_sdpa", "cos", "rel_l1",
            "finite", "quantized")


def benchmark_section(device: torch.device, say: Callable[[str], None], out: Optional[Dict] = None) -> Dict:
    """Fills `out` (backends, reps, then each run as it finishes: what collect keeps if Ctrl-C stops it)."""
    backends = _benchmark_backends(device)
    reps = GPU_REPS if device.type == "cuda" else CPU_REPS
    out = {} if out is None else out
    out.update(backends=backends, reps=reps, runs=[])
    runs = out["runs"]
    for shape in _shapes(device):
        for kind in bench.INPUT_KINDS:
            say(f"  {shape.name} ({kind} inputs): sdpa, {', '.join(backends) or 'no other backend'}")
            entry = {"shape": shape.name, "inputs": kind, "batch": shape.batch, "heads": shape.heads,
                     "seq": shape.seq, "head_dim": shape.head_dim, "dtype": shape.dtype}
            try:
                timed = kind == "standard"
                rows = bench.bench_shape(shape, device, backends, reps if timed else 1, 1 if timed else 0, kind)
                entry["rows"] = [dict({k: r.get(k) for k in ROW_KEYS}, accuracy_problem=bench.accuracy_problem(r))
                                 for r in rows]
                entry["timed"] = timed
            except Exception as exc:
                entry.update(_error(exc))
                say(f"    error: {type(exc).__name__}: {exc}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            runs.append(entry)
    return out


def auto_section(device: torch.device, say: Callable[[str], None], out: Optional[List] = None) -> List[Dict]:
    """What the ComfyUI override's `auto` (quantized kernels only, the call site's attention otherwise) takes
    per shape, and why; on a GPU that is its first-use measurement. Each shape is appended to `out` when done."""
    out = [] if out is None else out
    for shape in _shapes(device):
        entry = {"shape": shape.name}
        try:
            q, k, v = bench.make_inputs(shape, device)
            route = settled_route(describe_call(q, k, v), "auto", quantized_only=True, tensors=(q, k, v))
            decision = getattr(route.decision, "summary", None)
            entry.update(chosen=route.ran or "exact attention (the call site's own)",
                         exact_reason=None if route.kind == RUN else route.reason, measured=route.kind == EXACT,
                         passed_over=dict(route.passed_over), decision=decision)
            del q, k, v
        except Exception as exc:
            entry.update(_error(exc))
        say(f"  {shape.name}: {entry.get('chosen', entry.get('error'))}")
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------------ the run
SECTIONS = ("environment", "libraries", "hardware_probes", "self_check", "hip_code_path", "hip_pv_chain", "benchmark",
            "auto")


NOT_RUN_YET = "not run yet: the report is still running"
INTERRUPTED = "not run: the report was stopped (Ctrl-C) before it"
INTERRUPTED_WHILE = "stopped (Ctrl-C) while it ran, after {seconds:.1f} s: its results are lost"
INTERRUPTED_PART = "stopped (Ctrl-C) while it ran, after {seconds:.1f} s: what it had finished is kept"


def new_report(device: torch.device) -> Dict:
    """The report before any section: every section missing, 'not run yet'."""
    return {"schema": SCHEMA, "title": TITLE, "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": str(device), "cpu_note": CPU_NOTE if device.type != "cuda" else None,
            "rdna4_note": "Nothing in this pack had run on an RDNA4 card before these reports.", "status": "running",
            "sections": {}, "missing": {name: NOT_RUN_YET for name in SECTIONS}, "errors": [], "seconds": 0.0,
            "first_use": first_use_ledger([])}


def first_use_ledger(parts) -> Dict:
    """The report's `first_use`: every part (first_use_costs: self-checks with their compiles, probes, auto's
    measuring) with its seconds, in the order paid, and their total."""
    return {"total_seconds": round(sum(seconds for _, seconds in parts), 3),
            "parts": [{"part": part, "seconds": round(seconds, 3)} for part, seconds in parts]}


def mark_interrupted(report: Dict, section: Optional[str] = None, seconds: float = 0.0, kept=None) -> None:
    """Ctrl-C: `section` (the one it hit, if any) is missing, with `kept` (what it had finished, if anything) as
    its data and status 'interrupted'; every other missing one was never run."""
    report["status"] = "interrupted"
    for name in report["missing"]:
        report["missing"][name] = INTERRUPTED
    if section is not None:
        report["missing"][section] = (INTERRUPTED_PART if kept else INTERRUPTED_WHILE).format(seconds=seconds)
        if kept:
            for item in kept if isinstance(kept, list) else []:
                item.setdefault("status", "interrupted")  # the self-check target it was running
            report["sections"][section] = {"status": "interrupted", "data": kept, "seconds": round(seconds, 2)}


def collect(device: Optional[torch.device] = None, say: Callable[[str], None] = print,
            on_section: Optional[Callable[[Dict], None]] = None, report: Optional[Dict] = None) -> Dict:
    """Run every section (in SECTIONS order) into `report` (default: a new_report) and return it: the dict the
    JSON file holds.

    `on_section(report)` is called after each section, with the report so far (its `missing` names each section
    not run and why): main rewrites the files there. Ctrl-C (KeyboardInterrupt) in a section stops the run: that
    section and the ones after it are missing, `status` is 'interrupted', and the report is returned (not
    raised) after a last `on_section`."""
    device = device or _device()
    t0 = time.perf_counter()
    report = report if report is not None else new_report(device)
    first_use_mark = first_use_costs.mark()  # the ledger holds what this run paid, not an earlier one in-process
    partial: Dict[str, object] = {"self_check": [], "benchmark": {}, "auto": []}  # filled as the long ones go
    runners = {"environment": lambda: environment_section(device),
               "libraries": lambda: libraries_section(device),
               "hardware_probes": lambda: probes_section(device),
               "self_check": lambda: self_check_section(device, say, partial["self_check"]),
               "hip_code_path": lambda: hip_code_path_section(device),
               "hip_pv_chain": lambda: pv_chain_section(device, say),
               "benchmark": lambda: benchmark_section(device, say, partial["benchmark"]),
               "auto": lambda: auto_section(device, say, partial["auto"])}

    def update() -> None:
        report["errors"] = errors_of(report)
        report["seconds"] = round(time.perf_counter() - t0, 1)
        report["first_use"] = first_use_ledger(first_use_costs.since(first_use_mark))
        if on_section is not None:
            on_section(report)

    for name in SECTIONS:
        say(f"[{time.perf_counter() - t0:6.1f} s] {name} ...")
        start = time.perf_counter()
        try:
            entry = {"status": "ok", "data": runners[name]()}
        except KeyboardInterrupt:
            kept = partial.get(name)
            if isinstance(kept, dict) and not kept.get("runs"):
                kept = None  # the benchmark had not finished a run
            mark_interrupted(report, name, time.perf_counter() - start, kept)
            say(f"  stopped (Ctrl-C) in {name}: writing what finished")
            update()
            return report
        except Exception as exc:
            entry = {"status": "error", **_error(exc)}
            say(f"  error: {entry['error']} (the report goes on)")
        entry["seconds"] = round(time.perf_counter() - start, 2)
        report["sections"][name] = entry
        del report["missing"][name]
        if name == SECTIONS[-1]:
            report["status"] = "complete"
        update()
    return report


def errors_of(report: Dict) -> List[Dict]:
    """Every error in the report, with where it happened: a section's, a self-check target's, a benchmark run's,
    an auto choice's."""
    found = []
    for name, sec in report["sections"].items():
        if sec["status"] == "error":
            found.append({"where": name, "error": sec["error"], "traceback": sec["traceback"]})
            continue
        data = sec.get("data")
        items = data.get("runs", []) if isinstance(data, dict) else data if isinstance(data, list) else []
        for item in items:
            if isinstance(item, dict) and "error" in item:
                where = " / ".join(str(item[k]) for k in ("kernel", "variant", "shape", "inputs") if k in item)
                found.append({"where": f"{name}: {where}", "error": item["error"], "traceback": item["traceback"]})
    return found


# ------------------------------------------------------------------------------------------ Markdown
def summary(report: Dict) -> List[str]:
    """A few lines a maintainer reads first: the GPU, the self-check verdicts, accuracy problems, errors."""
    sec = {name: report["sections"].get(name) or {} for name in SECTIONS}
    env = sec["environment"].get("data") or {}
    gpu = (f"GPU: {env['gpu']} ({env.get('gcn_arch_name') or env.get('arch')}, {env.get('compute_units')} compute "
           f"units)" if "gpu" in env else f"device: {report['device']} (no GPU)")
    lines = [f"{gpu}; torch {env.get('torch', '-')}, HIP {env.get('hip') or '-'}, CUDA {env.get('cuda') or '-'}"]
    checks = sec["self_check"].get("data") or []
    for status in ("passed", "failed", "error", "not available"):
        names = [t["kernel"] if t["variant"] == "any" else f"{t['kernel']} ({t['variant']})"
                 for t in checks if t["status"] == status]
        if names:
            lines.append(f"self-check {status}: {', '.join(names)}")
    bench_data = sec["benchmark"].get("data") or {}
    problems = [f"{run['shape']}/{run['inputs']}/{r['backend']}: {r['accuracy_problem']}"
                for run in bench_data.get("runs", []) for r in run.get("rows", []) if r.get("accuracy_problem")]
    lines.append("accuracy problems: " + ("; ".join(problems) if problems else "none"))
    probes = sec["hardware_probes"].get("data") or {}
    lines.append(probes.get("note") or f"{PROBES_NOT_RUN}: {sec['hardware_probes'].get('error', 'no data')}")
    ledger = report.get("first_use") or {}
    if ledger.get("parts"):
        slowest = max(ledger["parts"], key=lambda p: p["seconds"])
        lines.append(f"first use: {ledger['total_seconds']:.1f} s in {len(ledger['parts'])} parts (slowest: "
                     f"{slowest['part']}, {slowest['seconds']:.1f} s; under First use)")
    lines.append(f"errors: {len(report['errors'])}" + (" (under Errors, with tracebacks)" if report["errors"] else ""))
    missing = report.get("missing") or {}
    if missing:
        lines.append(f"missing sections ({report.get('status', 'running')}): " +
                     "; ".join(f"{name}: {why}" for name, why in missing.items()))
    return lines


def first_use_rows(ledger: Dict) -> List[str]:
    """The ledger as a table: each part the run paid once, in order, with its seconds, and the total."""
    if not ledger.get("parts"):
        return ["No first-use part was paid in this run (or none has finished yet)."]
    rows = ["What this run paid once, in order: each self-check (its kernels' compiles included), the hardware "
            "probes, each kind of call auto measured.", "", "| part | seconds |", "| --- | --- |"]
    rows += [f"| {p['part']} | {p['seconds']:.2f} |" for p in ledger["parts"]]
    return rows + [f"| total | {ledger['total_seconds']:.2f} |"]


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def to_markdown(report: Dict) -> str:
    sec = report["sections"]
    lines = [f"# {TITLE}", "", f"Created {report['created_utc']} on `{report['device']}` in {report['seconds']} s. "
             f"{report['rdna4_note']}", ""]
    if report.get("cpu_note"):
        lines += [f"> {report['cpu_note']}", ""]
    lines += ["## Summary", ""] + [f"- {line}" for line in summary(report)] + [""]

    def body(name, render):
        s = sec.get(name)
        why = (report.get("missing") or {}).get(name, "not run")
        if s is None:
            return [f"**Missing:** {why}", ""]
        if s["status"] == "error":
            return [f"**Error:** `{s['error']}` (traceback under Errors)", ""]
        if s["status"] == "interrupted":  # Ctrl-C in it: what it had finished
            return [f"**Part of it:** {why}", ""] + render(s["data"]) + [""]
        return render(s["data"]) + [""]

    def kv(data):
        rows = ["| item | value |", "| --- | --- |"]
        for key, value in data.items():
            rows.append(f"| {key} | `{json.dumps(value) if isinstance(value, (dict, list)) else value}` |")
        return rows

    lines += ["## Environment", ""] + body("environment", kv)
    lines += ["## Libraries", ""] + body("libraries", kv)
    lines += ["## HIP code path", ""] + body("hip_code_path", kv)
    def probe_rows(data):
        rows = [data["note"], ""]
        if data.get("results"):
            rows += ["| probe | verdict | found | expected | checks | relied on by |",
                     "| --- | --- | --- | --- | --- | --- |"]
            rows += [f"| {r['name']} | {r['verdict']} | {r['found']} | {r['expected']} | {r['checks']} | "
                     f"{', '.join(r['backends'])} |" for r in data["results"]]
        return rows
    lines += ["## Hardware probes", ""] + body("hardware_probes", probe_rows)

    def chain_rows(data):
        rows = [f"- {name}: {line}" for name, line in data["choices"].items()] + [""]
        if data.get("note"):
            rows += [data["note"]]
        timed = [t for t in data["timings"] if "shape" in t]
        if timed:
            rows += ["| kernel | shape | two-level ms | single ms | single / two-level |",
                     "| --- | --- | --- | --- | --- |"]
            rows += [f"| {t['kernel']} | {t['shape']} | {t['two-level ms']} | {t['single ms']} | "
                     f"{t['single / two-level']} |" for t in timed]
        rows += [f"- {t['kernel']}: not timed: {t['unavailable']}" for t in data["timings"] if "unavailable" in t]
        return rows
    lines += ["## HIP P·V chain", ""] + body("hip_pv_chain", chain_rows)

    def checks(data):
        rows = ["| kernel | variant | verdict | time (s) | reason |", "| --- | --- | --- | --- | --- |"]
        for t in data:
            rows.append(f"| {t['kernel']} | {t['variant']} | {t['status']} | {_fmt(t.get('seconds'), '.1f')} | "
                        f"{t.get('reason') or t.get('error') or ''} |")
        for t in data:
            for c in t.get("cases", []):
                if c["verdict"] != "passed":
                    rows.append(f"| {t['kernel']} | {c['case']} | failed | {c['seconds']} | {c['reason']} |")
        return rows
    lines += ["## Self-check", ""] + body("self_check", checks)

    def bench_rows(data):
        kinds = list(dict.fromkeys(run["inputs"] for run in data["runs"]))
        rows = [f"Time: median of {data['reps']} repeats on standard inputs; /sdpa: over PyTorch SDPA's time on the "
                "same shape (below 1 is faster). Accuracy against exact FP32 attention: cosine on standard inputs, "
                "rel L1 per input kind (each run once).", "",
                "| shape | backend | ms | /sdpa | cosine | " + " | ".join(f"rel L1 {k}" for k in kinds) + " | note |",
                "| --- " * (5 + len(kinds)) + "| --- |"]
        table: Dict[tuple, Dict] = {}
        for run in data["runs"]:
            if "error" in run:
                table.setdefault((run["shape"], "-"), {})[run["inputs"]] = {"error": run["error"]}
                continue
            for r in run["rows"]:
                table.setdefault((run["shape"], r["backend"]), {})[run["inputs"]] = r
        for (shape, backend), by_kind in table.items():
            std = by_kind.get("standard", {})
            ok = std.get("status") == "ok"
            notes = [f"{k}: {r.get('error') or r.get('accuracy_problem') or r.get('status')}"
                     for k, r in by_kind.items() if r.get("error") or r.get("accuracy_problem") or
                     r.get("status", "ok") != "ok"]
            rel = [_fmt(by_kind.get(k, {}).get("rel_l1"), ".4f") for k in kinds]
            rows.append(f"| {shape} | {backend} | {_fmt(std.get('ms')) if ok else '-'} | "
                        f"{_fmt(std.get('vs_sdpa')) if ok else '-'} | {_fmt(std.get('cos'), '.5f')} | "
                        + " | ".join(rel) + f" | {'; '.join(notes)} |")
        return rows
    lines += ["## Kernel time and accuracy against SDPA", ""] + body("benchmark", bench_rows)

    def autos(data):
        rows = ["| shape | auto takes | why |", "| --- | --- | --- |"]
        for a in data:
            why = a.get("error") or a.get("decision") or a.get("exact_reason") or "first in the fixed order"
            rows.append(f"| {a['shape']} | {a.get('chosen', '-')} | {why} |")
        return rows
    lines += ["## What auto chose", ""] + body("auto", autos)
    lines += ["## First use", ""] + first_use_rows(report.get("first_use") or {}) + [""]
    lines += ["## Errors", ""]
    if not report["errors"]:
        lines += ["None.", ""]
    for e in report["errors"]:
        lines += [f"### {e['where']}", "", f"`{e['error']}`", "", "```", e["traceback"].rstrip(), "```", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ command line
class ReportFiles:
    """The report's JSON and Markdown files, each replaced atomically (a temporary file in the same folder, then
    os.replace), so a reader, a crash or Ctrl-C never sees half a file."""

    def __init__(self, stem: str):
        self.json_path, self.md_path = stem + ".json", stem + ".md"
        self.failed: Optional[str] = None  # the last write error, if the latest write failed

    def write(self, report: Dict) -> None:
        """Raises OSError when a file cannot be written (the caller decides whether that stops the run)."""
        for path, text in ((self.json_path, json.dumps(report, indent=1, default=str)),
                           (self.md_path, to_markdown(report))):
            write_atomically(path, text.encode("utf-8"))

    def write_quietly(self, report: Dict, say: Callable[[str], None]) -> None:
        """write(), saying (once per new error) instead of raising: a full disk mid-run must not stop the
        sections, and the next write tries again."""
        try:
            self.write(report)
            self.failed = None
        except OSError as exc:
            if str(exc) != self.failed:
                say(f"  could not write the report files: {exc} (the next section's write tries again)")
            self.failed = str(exc)


def _fail(text: str) -> int:
    print(f"field_report.py: error: {text}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="field_report.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for the two files (default: the current folder)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.out):
        return _fail(f"--out {args.out!r} is not a folder")
    stem = os.path.join(os.path.abspath(args.out), f"sage_rdna4_field_report_{datetime.now():%Y%m%d_%H%M%S}")
    files = ReportFiles(stem)
    device = _device()
    report = new_report(device)
    try:  # before any section: an --out that cannot take the files stops the run here, not 5-15 minutes later
        files.write(report)
    except OSError as exc:
        return _fail(f"cannot write the report into --out {args.out!r}: {exc}")
    print(f"{TITLE}: writing {stem}.json and {stem}.md, rewritten after each section; about 5-15 minutes on a "
          f"GPU, under a minute on the CPU. Ctrl-C stops it and keeps what finished.", flush=True)

    def say(text: str) -> None:
        print(text, flush=True)
    try:
        collect(device, say, on_section=lambda r: files.write_quietly(r, say), report=report)
    except KeyboardInterrupt:  # between sections, e.g. while the files were being written
        mark_interrupted(report)
        files.write_quietly(report, say)
    if files.failed:
        print(f"field_report.py: error: could not write the report files: {files.failed}", file=sys.stderr)
        return 1
    if report["status"] == "interrupted":
        print(f"stopped after {report['seconds']} s: {len(report['sections'])} of {len(SECTIONS)} sections "
              f"written; missing: {', '.join(report['missing'])}.")
    else:
        print(f"done in {report['seconds']} s, {len(report['errors'])} error(s).")
    print(f"JSON:     {stem}.json")
    print(f"Markdown: {stem}.md")
    print("Please open an issue on the project's tracker with the Markdown summary and attach the JSON file.")
    return 130 if report["status"] == "interrupted" else 0
