"""Which ComfyUI model families the patch serves: each family built in a real ComfyUI at its real width, heads, head
dim and token counts (random weights, depth cut to a few blocks), sampled unpatched and patched with each kernel.

    COMFYUI_PATH=/path/to/ComfyUI python3 tools/model_table.py --out DIR [--kernels auto,triton_int8_fp8]
        [--families flux,ltxv] [--steps 4] [--tiny] [--profile] [--rounds 3]

Per family and kernel: the share of attention calls and of attention time a quantized kernel served, the head dims
and masks seen (none / keys / rows), the median step ratio against the unpatched run, the latent PSNR against it,
and why calls fell back. Attention that never reaches ComfyUI's override (a call site without transformer_options)
is counted too, from torch's SDPA calls in the unpatched run. DIR/model_table.json and DIR/model_table.md are
rewritten after each family, so a run cut short keeps its rows; a family that fails is a row with its error.
--tiny: the tiny CPU versions (the CPU test); there, set TRITON_INTERPRET=1 for the Triton kernels to run.
A cut model's step is mostly host time, whose speed drifts between runs: --rounds N times N rounds (unpatched, then
each kernel) and reports the median of the rounds' ratios; --profile adds each run's host and GPU profile.
The families and their inputs are in tests/comfy_harness.py (loaded by path).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

import torch

from pack_loader import load_harness, load_pack

DEFAULT_KERNELS = "auto,triton_int8_fp8"
WARMUP = 1


class CallRecorder:
    """Stands in front of an override for one sampling run: per attention call, its step, head dim, token counts,
    mask kind, who ran it and its time (device events on a GPU, read after the run)."""

    def __init__(self, override, pack):
        self.override = override
        self.pack = pack
        self.calls: List[dict] = []
        self.inside = False

    def __deepcopy__(self, memo):
        return self  # ModelPatcher deep-copies model_options: the clone must record here too

    def __call__(self, func, *args, **kwargs):
        p = self.pack
        bound = p.bind_attention_args(args, kwargs)
        q, k = bound.q, bound.k
        heads = bound.heads
        if bound.skip_reshape:
            head_dim, nq, nk = q.shape[-1], q.shape[-2], k.shape[-2]
        else:
            head_dim, nq, nk = q.shape[-1] // heads, q.shape[1], k.shape[1]
        mask = p.expand_mask(bound.mask)
        timer = p.step_timer_of(self.override)
        row = {"step": timer.current_step if timer is not None else -1, "head_dim": int(head_dim), "nq": int(nq),
               "nk": int(nk), "heads": int(heads), "batch": int(q.shape[0]), "mask": p.mask_scope(mask),
               "mask_shape": list(mask.shape) if mask is not None else None}
        before = self.override.stats.snapshot()
        cuda = q.is_cuda
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        self.inside = True
        try:
            out = self.override(func, *args, **kwargs)
        finally:
            self.inside = False
        if cuda:
            end.record()
            row["_events"] = (start, end)
        else:
            row["ms"] = (time.perf_counter() - t0) * 1e3
        after = self.override.stats.snapshot()
        row["ran"] = p.who_ran(before, after)
        row["cut"] = sum(after.get("cuts", {}).values()) > sum(before.get("cuts", {}).values())
        if row["step"] < WARMUP and not self.override.baseline and torch.is_tensor(out):
            # The warm-up step is not timed: there each call's output is compared with the call site's own
            # attention on the same inputs (per-call rel L1, the figure beside the latent PSNR).
            with torch.no_grad():
                own = func(*args, **kwargs)
            row["rel_l1"] = p.rel_l1(out, own)
        self.calls.append(row)
        return out

    def finish(self) -> List[dict]:
        if any("_events" in c for c in self.calls):
            torch.cuda.synchronize()
        for c in self.calls:
            events = c.pop("_events", None)
            if events is not None:
                c["ms"] = float(events[0].elapsed_time(events[1]))
        return self.calls


@contextlib.contextmanager
def counting_sdpa(recorder: Optional[CallRecorder]):
    """Counts torch SDPA calls made outside the override (attention ComfyUI's override never sees)."""
    original = torch.nn.functional.scaled_dot_product_attention
    counts = {"outside": 0}

    def counted(*args, **kwargs):
        if recorder is None or not recorder.inside:
            counts["outside"] += 1
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counted
    try:
        yield counts
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


class Pack:
    """The pack's pieces the table uses, imported once the pack is loaded."""

    def __init__(self):
        from comfyui_sage_rdna4.kernels.call_spec import mask_scope
        from comfyui_sage_rdna4.kernels.metrics import rel_l1
        from comfyui_sage_rdna4.kernels.registry import get_backend
        from comfyui_sage_rdna4.sage_patch import ab_benchmark
        from comfyui_sage_rdna4.sage_patch.config import PatchConfig
        from comfyui_sage_rdna4.sage_patch.install import OVERRIDE_KEY, patch_model
        from comfyui_sage_rdna4.sage_patch.layouts import bind_attention_args, expand_mask
        from comfyui_sage_rdna4.sage_patch.report import summarize_steps
        from comfyui_sage_rdna4.sage_patch.stats import PatchStats
        from comfyui_sage_rdna4.sage_patch.timing import step_timer_of

        self.mask_scope, self.get_backend, self.ab, self.rel_l1 = mask_scope, get_backend, ab_benchmark, rel_l1
        self.PatchConfig, self.OVERRIDE_KEY, self.patch_model = PatchConfig, OVERRIDE_KEY, patch_model
        self.expand_mask, self.bind_attention_args, self.summarize_steps = expand_mask, bind_attention_args, \
            summarize_steps
        self.PatchStats, self.step_timer_of = PatchStats, step_timer_of
        self.who_ran = ab_benchmark._who_ran

    def quantized(self, ran: str) -> bool:
        if ran.startswith(("fallback", "exact by policy", "unknown")):
            return False
        try:
            return bool(self.get_backend(ran).quantized)
        except ValueError:  # "own attention" (the baseline's label) and the like
            return False


SYNC_OPS = ("Synchronize", "aten::_local_scalar_dense", "aten::item", "cudaMemcpy ", "aten::nonzero")


def profile_summary(prof, steps: int) -> dict:
    """Where a profiled sampling run spent host and device time, per step: the busiest host ops by self time, the
    busiest GPU kernels, and every op that waits for the device (a sync stalls a host-bound step)."""
    events = prof.key_averages()
    per_step = max(steps, 1)
    cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)
    gpu = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    return {"host_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1e3 / per_step,
            "gpu_ms_per_step": sum(e.self_device_time_total for e in events) / 1e3 / per_step,
            "top_host": [(e.key[:80], e.count, round(e.self_cpu_time_total / 1e3 / per_step, 3)) for e in cpu[:25]],
            "top_gpu": [(e.key[:80], e.count, round(e.self_device_time_total / 1e3 / per_step, 3)) for e in gpu[:15]],
            "syncs": [(e.key[:80], e.count, round(e.cpu_time_total / 1e3 / per_step, 3)) for e in events
                      if any(s in e.key for s in SYNC_OPS)]}


@contextlib.contextmanager
def profiled(enabled: bool, steps: int, into: dict):
    """torch.profiler over the block when `enabled`; its summary lands in into["profile"]."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    into["profile"] = profile_summary(prof, steps)


def sample_run(pack: Pack, model, config, baseline: bool, inputs, steps: int, seed: int = 0):
    """One sampling run through the override, recorded call by call."""
    positive, negative, latent, cfg = inputs
    label = "table baseline" if baseline else f"table {config.kernel}"
    patched, override = pack.patch_model(model, config, pack.PatchStats(f"sage_rdna4[{label}]"), baseline=baseline)
    recorder = CallRecorder(override, pack)
    patched.model_options["transformer_options"][pack.OVERRIDE_KEY] = recorder
    with counting_sdpa(recorder) as sdpa:
        samples = pack.ab._sample(patched, latent, seed, steps, cfg, "euler", "simple", positive, negative, None)
    run = pack.step_timer_of(override).last_run
    return samples, run, recorder.finish(), sdpa["outside"], override.stats.snapshot()["auto_decisions"]


def _share(part: float, whole: float) -> Optional[float]:
    return part / whole if whole > 0 else None


def call_summary(pack: Pack, calls: List[dict], base_calls: Optional[List[dict]] = None) -> dict:
    """Shares over the measured steps (warm-up left out, or every step where there is only one)."""
    every_step = len({c["step"] for c in calls}) <= WARMUP
    keep = [every_step or c["step"] >= WARMUP for c in calls]
    measured = [c for c, k in zip(calls, keep) if k]
    served = [pack.quantized(c["ran"]) for c in measured]
    total_ms = sum(c["ms"] for c in measured)
    q_ms = sum(c["ms"] for c, s in zip(measured, served) if s)
    out = {"calls": len(measured), "quantized_calls": sum(served),
           "call_share": _share(sum(served), len(measured)), "attention_ms": total_ms,
           "time_share": _share(q_ms, total_ms)}
    if base_calls is not None and len(base_calls) == len(calls):
        # The same calls in the same order: the unpatched run's time of the calls a quantized kernel took here,
        # i.e. the share of the model's own attention time the kernel took over.
        base = [b for b, k in zip(base_calls, keep) if k]
        base_ms = sum(b["ms"] for b in base)
        out["own_time_share"] = _share(sum(b["ms"] for b, s in zip(base, served) if s), base_ms)
    ran: Dict[str, int] = {}
    by_mask: Dict[str, Dict[str, int]] = {}
    for c, s in zip(measured, served):
        ran[c["ran"]] = ran.get(c["ran"], 0) + 1
        kind = by_mask.setdefault(c["mask"], {"calls": 0, "quantized": 0})
        kind["calls"] += 1
        kind["quantized"] += int(s)
    out["ran"], out["by_mask"] = ran, by_mask  # by_mask: which kinds of mask the kernel took, per kind
    out["cut_calls"] = sum(1 for c in measured if c.get("cut"))  # padding masks cut from K and V
    # Per-call accuracy of the quantized calls, from the warm-up step (CallRecorder).
    errors = sorted(c["rel_l1"] for c in calls if "rel_l1" in c and pack.quantized(c["ran"]))
    out["rel_l1_median"] = statistics.median(errors) if errors else None
    out["rel_l1_max"] = errors[-1] if errors else None
    return out


def calls_seen(calls: List[dict]) -> dict:
    """Head dims and masks of a run's calls: kinds, shapes and the token counts they came with."""
    kinds: Dict[str, int] = {}
    shapes: Dict[str, int] = {}
    for c in calls:
        kinds[c["mask"]] = kinds.get(c["mask"], 0) + 1
        key = (f"D{c['head_dim']} H{c['heads']} B{c['batch']} Nq{c['nq']} Nk{c['nk']} mask {c['mask']}"
               + (f" {tuple(c['mask_shape'])}" if c["mask_shape"] else ""))
        shapes[key] = shapes.get(key, 0) + 1
    steps = max(len({c["step"] for c in calls}), 1)
    flop = sum(4.0 * c["batch"] * c["heads"] * c["nq"] * c["nk"] * c["head_dim"] for c in calls) / steps
    return {"head_dims": sorted({c["head_dim"] for c in calls}), "mask_kinds": kinds, "shapes": shapes,
            "attention_tflop_per_step": flop / 1e12}


def step_ratio(pack: Pack, base_steps: List[dict], steps: List[dict]) -> Optional[float]:
    """The median of the per-step ratios patched / unpatched, warm-up left out."""
    summary = pack.summarize_steps(base_steps, steps, WARMUP)
    ratios = [s["ratio"] for s in summary["per_step"] if not s["warmup"] and s["ratio"] is not None]
    return statistics.median(ratios) if ratios else None


def repeat_rounds(pack: Pack, model, inputs, row: dict, steps: int, rounds: int, say) -> None:
    """Rounds 2..`rounds`: the unpatched run again, then each kernel's timed run again, each kernel's step ratio
    against the unpatched run of its own round. A cut model's step is mostly host time, and the host's speed drifts
    between runs (docs/MEASUREMENTS.md, model table): runs next to each other share it. The reported ratio becomes
    the median of the rounds'."""
    entries = {k: e for k, e in row["kernels"].items() if "error" not in e}
    for entry in entries.values():
        entry["round_ratios"] = [entry["median_step_ratio"]]
    for _ in range(rounds - 1):
        base_steps = [s.as_dict() for s in sample_run(pack, model, pack.PatchConfig(kernel="sdpa"), True, inputs,
                                                      steps)[1].steps]
        for kernel, entry in entries.items():
            run = sample_run(pack, model, pack.PatchConfig(kernel=kernel), False, inputs, steps)[1]
            entry["round_ratios"].append(step_ratio(pack, base_steps, [s.as_dict() for s in run.steps]))
    for kernel, entry in entries.items():
        ratios = [r for r in entry["round_ratios"] if r is not None]
        entry["median_step_ratio"] = statistics.median(ratios) if ratios else None
        say(f"  {kernel}: step ratio per round {', '.join(_num(r, '.3f') for r in entry['round_ratios'])}; "
            f"median {_num(entry['median_step_ratio'], '.3f')}")


def measure_family(pack: Pack, model, inputs, kernels: List[str], steps: int, say, auto_priming: int = 0,
                   profile: bool = False, rounds: int = 1) -> dict:
    """`profile`: each timed run again under torch.profiler (after the timed one, which it would slow). `rounds`:
    more rounds of timed runs, unpatched then each kernel (`repeat_rounds`)."""
    base_config = pack.PatchConfig(kernel="sdpa")
    t = time.time()
    base_latent, base_run, base_calls, outside, _ = sample_run(pack, model, base_config, True, inputs, steps)
    base_profile: dict = {}
    with profiled(profile, steps, base_profile):
        sample_run(pack, model, base_config, True, inputs, steps)
    seen = calls_seen(base_calls)
    say(f"  unpatched: {time.time() - t:.1f} s, {len(base_calls)} attention calls through the override, "
        f"{outside} SDPA calls outside it; {seen['attention_tflop_per_step']:.2f} TFLOP of attention per step")
    base_steps = [s.as_dict() for s in base_run.steps]
    row = {"seen": seen, "calls_per_step": len(base_calls) / max(len(base_steps), 1),
           "sdpa_outside_override": outside,
           "comfy_attention": pack.ab.comfy_attention_name(),
           "baseline_median_step_ms": statistics.median(s["step_ms"] for s in base_steps[WARMUP:] or base_steps),
           "kernels": {}, **({"baseline_profile": base_profile["profile"]} if profile else {})}
    for kernel in kernels:
        t = time.time()
        decided, config = [], pack.PatchConfig(kernel=kernel)
        try:
            if kernel == "auto" and auto_priming:
                # With the depth cut, a kind of call comes a few times a step, not 40-60: auto's in-step trial
                # (12 timed calls per backend) would still be measuring in the timed steps. A first run lets it
                # decide, as the first step of a full-depth model does; the timed run then uses its decisions.
                decided = sample_run(pack, model, config, False, inputs, auto_priming)[4]
            latent, run, calls, _, decisions = sample_run(pack, model, config, False, inputs, steps)
            kernel_profile: dict = {}
            with profiled(profile, steps, kernel_profile):  # a settled auto: its decisions are the process's
                sample_run(pack, model, config, False, inputs, steps)
        except Exception as exc:  # one kernel's failure must not cost the others
            row["kernels"][kernel] = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"  {kernel}: failed: {type(exc).__name__}: {exc}")
            continue
        summary = pack.summarize_steps(base_steps, [s.as_dict() for s in run.steps], WARMUP)
        fid = pack.ab.fidelity(base_latent, latent)
        entry = {**call_summary(pack, calls, base_calls),
                 "median_step_ratio": step_ratio(pack, base_steps, [s.as_dict() for s in run.steps]),
                 "per_step_ms": [s["patched_ms"] for s in summary["per_step"]],
                 "latent_psnr_db": fid["latent_psnr_db"], "latent_cosine": fid["latent_cosine"],
                 "fallbacks": run.fallbacks, "routed": run.routed, "passed_over": run.passed_over,
                 "first_use": [{"part": part, "seconds": s} for part, s in run.first_use],
                 "auto_decisions": decided + [d for d in decisions if d not in decided],
                 "seconds": time.time() - t, **kernel_profile}
        row["kernels"][kernel] = entry
        say(f"  {kernel}: {time.time() - t:.1f} s; calls quantized {_pct(entry['call_share'])}, time "
            f"{_pct(entry['time_share'])}; step ratio {_num(entry['median_step_ratio'], '.3f')}; latent PSNR "
            f"{_num(entry['latent_psnr_db'], '.1f')} dB; fallbacks {entry['fallbacks'] or 'none'}")
    row["baseline_per_step_ms"] = [s["step_ms"] for s in base_steps]
    if rounds > 1:
        repeat_rounds(pack, model, inputs, row, steps, rounds, say)
    return row


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-" if x is None else str(x)
    return format(x, spec)


def markdown(rows: List[dict], kernels: List[str], meta: dict) -> str:
    sizes = "tiny CPU sizes" if meta["tiny"] else "real width, heads and tokens"
    lines = [f"# Model table ({meta['device']}, {meta['when']})", "",
             f"ComfyUI {meta['comfyui']}; {meta['steps']} steps of euler, the first a warm-up left out of the "
             f"shares and ratios; weights random; depth cut as each row says; {sizes}.",
             "calls / time: share of the attention calls and of their time a quantized kernel served (time: in the "
             "patched run; own: of the unpatched run's attention time). ratio: median patched / unpatched step time. "
             "rel L1: each quantized call of the warm-up step against the call site's own attention on its inputs. "
             "cut: measured calls whose padding mask was cut from K and V.",
             ""]
    head = "| family | depth run (of) | head dims | masks seen (calls) | outside override |"
    sep = "| --- | --- | --- | --- | --- |"
    for k in kernels:
        head += f" {k}: calls / time / own | ratio | PSNR dB | rel L1 median / max | cut |"
        sep += " --- | --- | --- | --- | --- |"
    lines += [head + " elapsed s |", sep + " --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | {r.get('depth', '-')} | failed: {r['error'].splitlines()[0][:160]} |"
                         + " |" * (3 + 5 * len(kernels)) + f" {r['elapsed_s']:.0f} |")
            continue
        seen = r["seen"]
        masks = ", ".join(f"{k} {v}" for k, v in sorted(seen["mask_kinds"].items()))
        line = (f"| {r['label']} | {r['depth']} | {', '.join(map(str, seen['head_dims']))} | {masks} | "
                f"{r['sdpa_outside_override']} |")
        for k in kernels:
            e = r["kernels"].get(k, {})
            if "error" in e:
                line += f" failed: {e['error'][:80]} | - | - | - | - |"
                continue
            line += (f" {_pct(e.get('call_share'))} / {_pct(e.get('time_share'))} / {_pct(e.get('own_time_share'))}"
                     f" | {_num(e.get('median_step_ratio'), '.3f')} | {_num(e.get('latent_psnr_db'), '.1f')} |"
                     f" {_num(e.get('rel_l1_median'), '.4f')} / {_num(e.get('rel_l1_max'), '.4f')} |"
                     f" {e.get('cut_calls', 0)} |")
        lines.append(line + f" {r['elapsed_s']:.0f} |")
    lines += ["", "Fallback reasons (calls in the whole run, warm-up included):", ""]
    for r in rows:
        for k, e in r.get("kernels", {}).items():
            for reason, n in sorted({**e.get("fallbacks", {}), **e.get("routed", {})}.items()):
                lines.append(f"- {r['label']}, {k}: {n} x {reason}")
    lines += ["", "auto's decisions (kind of call: choice):", ""]
    for r in rows:
        for d in r.get("kernels", {}).get("auto", {}).get("auto_decisions", []):
            ratios = ", ".join(f"{n} {_num(x, '.3f')}" for n, x in sorted(d.get("ratios", {}).items()))
            lines.append(f"- {r['label']}: {d.get('kind')}: {d.get('chosen')} (x SDPA: {ratios}; samples "
                         f"{d.get('samples')}{'; reverted' if d.get('reverted') else ''})")
    lines += ["", "What ComfyUI's code passes as masks, per family:", ""]
    lines += [f"- {r['label']}: {r['masks']}" for r in rows]
    return "\n".join(lines) + "\n"


def run_table(families: List[str], kernels: List[str], out: Path, steps: int, tiny: bool, harness,
              say=print, auto_priming: int = 0, profile: bool = False, rounds: int = 1) -> List[dict]:
    pack = Pack()
    import comfyui_version  # noqa: F401  (ComfyUI's own version file, on sys.path with it)

    device = "cpu" if tiny else "cuda"
    meta = {"device": "CPU (tiny sizes)" if tiny else torch.cuda.get_device_name(0),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "comfyui": comfyui_version.__version__,
            "steps": steps, "tiny": tiny, "kernels": kernels, "torch": torch.__version__,
            "auto_priming_steps": auto_priming, "rounds": rounds}
    rows: List[dict] = []
    out.mkdir(parents=True, exist_ok=True)
    for name in families:
        family = harness.FAMILIES[name]
        t0 = time.time()
        row = {"family": name, "label": family.label, "masks": family.masks, "size": family.size,
               "full_depth": family.full_depth}
        say(f"{family.label}:")
        try:
            config = family.config(tiny)
            row["depth"] = ", ".join(f"{k}={config[k]}" for k in family.cut) + f" (of {family.full_depth})"
            dtype = torch.float32 if tiny else family.dtype
            model = harness.build_model(family.config_class, config, dtype, seed=0,
                                        device=None if tiny else device)
            row["random_buffers"] = harness.randomize_weight_buffers(model)
            inputs = family.inputs(tiny)
            row["latent_shape"] = list(inputs[2]["samples"].shape)
            row["cfg"] = inputs[3]
            row.update(measure_family(pack, model, inputs, kernels, steps, say, auto_priming, profile, rounds))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc(limit=8)
            say(f"  failed: {row['error']}")
        finally:
            model = None
            import comfy.model_management as mm

            mm.unload_all_models()  # ComfyUI keeps sampled models loaded: one family's weights at a time
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        row["elapsed_s"] = time.time() - t0
        say(f"  [{family.label}: {row['elapsed_s']:.1f} s]")
        rows.append(row)
        # Rewritten after each family: a run cut short keeps the rows it finished.
        from comfyui_sage_rdna4.sage_patch.report import report_json

        (out / "model_table.json").write_text(report_json({"meta": meta, "rows": rows}))
        (out / "model_table.md").write_text(markdown(rows, kernels, meta))
    return rows


def main() -> int:
    harness = load_harness()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default=DEFAULT_KERNELS)
    ap.add_argument("--families", default=",".join(harness.FAMILIES), help="comma-separated; default: all")
    ap.add_argument("--steps", type=int, default=4, help="sampling steps; the first is a warm-up")
    ap.add_argument("--tiny", action="store_true", help="tiny CPU versions of the families")
    ap.add_argument("--auto-priming", type=int, default=12,
                    help="steps of an untimed auto run before auto's timed one, for its in-step trials to decide "
                         "on the cut model (0: none)")
    ap.add_argument("--profile", action="store_true",
                    help="run each timed run once more under torch.profiler; its host/GPU summary goes in the JSON")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of timed runs (unpatched, then each kernel); the step ratio is the rounds' median")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be 1 or more")
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in harness.FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(harness.FAMILIES)}")
    if not args.tiny and not torch.cuda.is_available():
        ap.error("real sizes need a GPU; --tiny runs the tiny versions on the CPU")
    # The pack first, while ComfyUI is not importable (tools/ab_real_size.py says why).
    load_pack()
    harness.comfy_import(cpu=args.tiny)
    t0 = time.time()
    run_table(families, [k for k in args.kernels.split(",") if k], Path(args.out), args.steps, args.tiny, harness,
              say=lambda s: print(s, flush=True), auto_priming=args.auto_priming, profile=args.profile,
              rounds=args.rounds)
    print(f"table done in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
