"""The A/B report as numbers, text, JSON and a plot. Pure: no ComfyUI, testable on its own.

Conventions (stated in the report too): `ratio` = patched time / baseline time (below 1 is faster);
`speedup` = baseline time / patched time (above 1 is faster). The baseline is the model's own attention (what it
runs without the patch; `baseline_label`); its figures keep the keys `sdpa_*` so saved reports stay readable.
The first `warmup` steps of each run are
shown but left out of every total, median and ratio, since they carry compilation and autotuning.
"""
from __future__ import annotations

import json
import math
import statistics
from typing import List, Optional, Sequence

import torch

from .stats import format_passed_over

# On the CPU both runs time the torch reference of the algorithm (or the Triton interpreter) on a shared CPU:
# the same graph has shown 0.46x to 4.4x there, so a CPU report must not read as a speed result.
CPU_CAVEAT = "CPU run: timings here are not speed claims (no GPU)"


def timing_caveat(device) -> Optional[str]:
    """CPU_CAVEAT when the runs were on the CPU (`device`: the model's load device), else None."""
    if device is None:
        return None
    try:
        return CPU_CAVEAT if torch.device(device).type == "cpu" else None
    except (RuntimeError, TypeError, ValueError):  # not a device torch knows: say nothing rather than guess
        return None


def baseline_label(report: dict) -> str:
    """What the baseline run ran, for labels: "own attention", with ComfyUI's name for it where known."""
    name = report.get("baseline_name")
    return f"own attention ({name})" if name else "own attention"


def _share(attention_ms: Optional[float], step_ms: float) -> Optional[float]:
    if attention_ms is None or step_ms <= 0:
        return None
    return attention_ms / step_ms


def _div(a: float, b: float) -> Optional[float]:
    return a / b if b > 0 else None


def summarize_steps(baseline_steps: Sequence[dict], patched_steps: Sequence[dict], warmup: int = 1) -> dict:
    """Per-step comparison and totals of two runs given as lists of StepTiming.as_dict() entries.

    Steps are paired by position; a run with fewer steps limits the comparison."""
    n = min(len(baseline_steps), len(patched_steps))
    warmup = min(warmup, max(n - 1, 0))  # always keep at least one measured step
    per_step = []
    for i in range(n):
        b, p = baseline_steps[i], patched_steps[i]
        per_step.append({
            "index": i, "warmup": i < warmup, "sigma": p.get("sigma"),
            "sdpa_ms": b["step_ms"], "patched_ms": p["step_ms"], "ratio": _div(p["step_ms"], b["step_ms"]),
            "sdpa_attention_ms": b.get("attention_ms"), "patched_attention_ms": p.get("attention_ms"),
            "sdpa_attention_share": _share(b.get("attention_ms"), b["step_ms"]),
            "patched_attention_share": _share(p.get("attention_ms"), p["step_ms"]),
        })
    measured = [s for s in per_step if not s["warmup"]]
    totals = {"steps_compared": n, "warmup_steps_excluded": warmup, "measured_steps": len(measured)}
    if measured:
        sdpa = sum(s["sdpa_ms"] for s in measured)
        patched = sum(s["patched_ms"] for s in measured)
        totals.update({
            "sdpa_ms": sdpa, "patched_ms": patched, "speedup": _div(sdpa, patched), "ratio": _div(patched, sdpa),
            "sdpa_median_step_ms": statistics.median(s["sdpa_ms"] for s in measured),
            "patched_median_step_ms": statistics.median(s["patched_ms"] for s in measured),
        })
        if all(s["sdpa_attention_ms"] is not None and s["patched_attention_ms"] is not None for s in measured):
            sa = sum(s["sdpa_attention_ms"] for s in measured)
            pa = sum(s["patched_attention_ms"] for s in measured)
            totals.update({"sdpa_attention_ms": sa, "patched_attention_ms": pa, "attention_speedup": _div(sa, pa),
                           "sdpa_attention_share": _div(sa, sdpa), "patched_attention_share": _div(pa, patched)})
    return {"per_step": per_step, "totals": totals}


def _fmt(x, spec: str = ".1f", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def format_decision_row(row: dict) -> str:
    """One kind of call's decision (kernels.decisions.Decision.as_row) in a line."""
    ratios = row.get("ratios") or {}
    best = min(((r, n) for n, r in ratios.items() if n != "sdpa"), default=None)
    if row.get("chosen") != "sdpa":
        said = f"{row.get('chosen')} at {_fmt(row.get('ratio'), '.3f')}x SDPA"
    elif best is not None:
        said = f"sdpa (best quantized {best[1]} {best[0]:.3f}x)"
    else:
        said = "sdpa"
    how = f"measured {row.get('method')}" + (", from disk" if row.get("source") == "disk" else "")
    reverted = f"; {row['reverted']}" if row.get("reverted") else ""
    return f"{row.get('kind')}: {said} ({how}){reverted}"


def format_report_text(report: dict) -> str:
    """The report as a plain-text table (what the node's STRING output and the console show)."""
    t = report.get("totals", {})
    base = baseline_label(report)
    lines = [f"Sage Attention A/B (RDNA4 pack): kernel '{report.get('kernel', '?')}' vs the model's {base}",
             f"model {report.get('model', '?')} | latent {report.get('latent_shape', '?')} | "
             f"{report.get('sampler', '?')}/{report.get('scheduler', '?')} | steps {report.get('steps', '?')} | "
             f"cfg {report.get('cfg', '?')} | seed {report.get('seed', '?')} | {report.get('device', '?')} "
             f"({report.get('clock', '?')})"]
    caveat = report.get("timing_caveat")
    if caveat:
        lines.append(caveat)
    lines += ["",
             f"{'step':>4} {'own ms':>9} {'patched ms':>10} {'ratio':>6} {'attn own':>9} {'attn patched':>12}"]
    for s in report.get("per_step", []):
        mark = "  (warm-up, excluded)" if s["warmup"] else ""
        lines.append(f"{s['index']:>4} {_fmt(s['sdpa_ms']):>9} {_fmt(s['patched_ms']):>10} "
                     f"{_fmt(s['ratio'], '.3f'):>6} {_pct(s['sdpa_attention_share']):>9} "
                     f"{_pct(s['patched_attention_share']):>12}{mark}")
    lines.append("")
    if t.get("measured_steps"):
        lines.append(f"total over {t['measured_steps']} steps ({t['warmup_steps_excluded']} warm-up excluded): "
                     f"{base} {_fmt(t['sdpa_ms'])} ms, patched {_fmt(t['patched_ms'])} ms -> ratio "
                     f"{_fmt(t['ratio'], '.3f')}, speed-up {_fmt(t['speedup'], '.3f')}x"
                     + (" (CPU: not a speed claim)" if caveat else ""))
        if t.get("attention_speedup") is not None:
            lines.append(f"attention: own {_fmt(t['sdpa_attention_ms'])} ms ({_pct(t['sdpa_attention_share'])} of "
                         f"the step), patched {_fmt(t['patched_attention_ms'])} ms "
                         f"({_pct(t['patched_attention_share'])}) -> attention speed-up "
                         f"{_fmt(t['attention_speedup'], '.3f')}x")
    else:
        lines.append("no measured steps: sample at least 2 steps (the first is warm-up)")
    f = report.get("fidelity", {})
    lines.append(f"fidelity of the patched result vs the {base} run: latent PSNR "
                 f"{_fmt(f.get('latent_psnr_db'), '.2f')} dB, "
                 f"latent cosine {_fmt(f.get('latent_cosine'), '.6f')}, image PSNR "
                 f"{_fmt(f.get('image_psnr_db'), '.2f', 'n/a (no VAE connected)')}"
                 + (" dB" if f.get("image_psnr_db") is not None else ""))
    acc = report.get("attention_accuracy", [])
    if acc:
        lines.append("per-call attention accuracy vs exact fp32 (sampled calls):")
        for a in acc:
            flag = f"  <- FLAGGED (above {a.get('flag_rel_l1')})" if a.get("flagged") else ""
            lines.append(f"  step {a.get('step')} call {a.get('call')} {a.get('shape')} ran {a.get('backend')}: "
                         f"cosine {_fmt(a.get('cosine'), '.5f')}, rel L1 {_fmt(a.get('rel_l1'), '.4f')}{flag}")
    for msg in report.get("accuracy_flags", []):
        lines.append(f"WARNING: {msg}")
    calls = report.get("calls", {})
    for run, label in (("patched", "patched"), ("sdpa", base)):
        if run in calls:
            served = ", ".join(f"{k} {v}" for k, v in sorted(calls[run].items()))
            lines.append(f"{label} run, calls served: "
                         + (served or "none ran a kernel of this pack (see fallbacks)"))
    fallbacks = report.get("fallbacks", {})
    if fallbacks:
        lines.append("fallbacks (patched run) to the call site's own attention (their time is not in 'attn'):")
        lines.extend(f"  {n} x {reason}" for reason, n in sorted(fallbacks.items(), key=lambda kv: -kv[1]))
    passed_over = report.get("passed_over", {})
    if passed_over:
        lines.append("kernels 'auto' passed over in the patched run, and why (calls per backend and reason):")
        lines.extend(format_passed_over(passed_over, indent="  "))
    rows = report.get("auto_decisions", [])
    if rows:
        lines.append("what 'auto' chose per kind of call (ratio = its measured time / SDPA's):")
        lines.extend(f"  {format_decision_row(row)}" for row in rows)
    choices = report.get("auto_choices", [])
    if choices:
        lines.append("what 'auto' measured for each kind of call (ratio = time / SDPA time):")
        lines.extend(f"  {c}" for c in choices)
    for policy, n in sorted(report.get("routed", {}).items()):
        lines.append(f"exact by policy ({policy}): {n}")
    first_use = report.get("first_use") or []
    if first_use:  # what the patched run's warm-up step paid once: self-checks (compiles included), probes
        total = sum(p["seconds"] for p in first_use)
        lines.append(f"first use in the patched run: {total:.2f} s (" +
                     "; ".join(f"{p['part']} {p['seconds']:.2f} s" for p in first_use) + ")")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    if report.get("save_error"):
        lines.append(f"WARNING: {report['save_error']}")
    return "\n".join(lines)


def report_json(report: dict) -> str:
    """JSON with non-finite floats written as strings (JSON has no inf/nan)."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(report), indent=1, sort_keys=False)


# -- plot ----------------------------------------------------------------------------------------
SDPA_COLOR = (70, 130, 220)
PATCHED_COLOR = (235, 120, 40)


def _font(size: int):
    """Pillow's own font at `size` px (Pillow 10.1+ with FreeType); else its fixed bitmap font. The bitmap font's
    narrow spaces made a title read as one word."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ValueError, OSError, ImportError):
        return ImageFont.load_default()


def plot_step_times(per_step: List[dict], title: str = "time per step", width: int = 768,
                    height: int = 384, baseline: str = "own attention") -> torch.Tensor:
    """Per-step times of both runs as a ComfyUI IMAGE: float (1, H, W, 3) in [0, 1].

    Warm-up steps are drawn on a grey band and labelled as excluded."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    draw.font = _font(13)
    left, right, top, bottom = 64, width - 16, 52, height - 40
    draw.text((left, 8), title, fill=(0, 0, 0))
    values = [v for s in per_step for v in (s["sdpa_ms"], s["patched_ms"]) if v is not None]
    if not values:
        draw.text((left, height // 2), "no steps were timed", fill=(0, 0, 0))
        return _to_image_tensor(img)
    # Scale to the measured steps: a slow warm-up step would flatten them; it is clipped and labelled.
    measured = [v for s in per_step if not s["warmup"] for v in (s["sdpa_ms"], s["patched_ms"]) if v is not None]
    y_max = max(measured or values) * 1.15 or 1.0
    n = len(per_step)

    def xy(i, v):
        x = left + (right - left) * (0.5 if n == 1 else i / (n - 1))
        return x, bottom - (bottom - top) * (min(v, y_max) / y_max)

    warm = [s["index"] for s in per_step if s["warmup"]]
    if warm:
        x1 = xy(max(warm), 0)[0] + (0 if n == 1 else (right - left) / (2 * (n - 1)))
        draw.rectangle([left, top, x1, bottom], fill=(232, 232, 232))
        draw.text((left + 4, bottom - 16), "warm-up (excluded)", fill=(90, 90, 90))
    draw.line([left, top, left, bottom, right, bottom], fill=(0, 0, 0), width=1)
    for frac in (0.0, 0.5, 1.0):  # y ticks in ms
        y = bottom - (bottom - top) * frac
        draw.line([left - 4, y, left, y], fill=(0, 0, 0))
        draw.text((4, y - 6), f"{y_max * frac:.0f} ms", fill=(0, 0, 0))
    for i in range(n):
        if n <= 30 or i % max(1, n // 15) == 0:
            x = xy(i, 0)[0]
            draw.text((x - 4, bottom + 6), str(i), fill=(0, 0, 0))
    draw.text(((left + right) // 2 - 12, bottom + 22), "step", fill=(0, 0, 0))
    for key, color in (("sdpa_ms", SDPA_COLOR), ("patched_ms", PATCHED_COLOR)):
        pts = [xy(s["index"], s[key]) for s in per_step if s[key] is not None]
        if len(pts) > 1:
            draw.line(pts, fill=color, width=2)
        for x, y in pts:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        for s in per_step:
            if s[key] is not None and s[key] > y_max:  # clipped (warm-up): say its real value
                x, y = xy(s["index"], s[key])
                draw.text((x + 6, y + (2 if key == "sdpa_ms" else 14)), f"{s[key]:.0f} ms", fill=color)
    x = left
    for label, color in ((baseline, SDPA_COLOR), ("patched", PATCHED_COLOR)):  # legend under the title
        y = 28
        draw.rectangle([x, y + 3, x + 10, y + 13], fill=color)
        draw.text((x + 14, y), label, fill=(0, 0, 0))
        x += 14 + int(draw.textlength(label)) + 24
    return _to_image_tensor(img)


def _to_image_tensor(img) -> torch.Tensor:
    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return (data.view(img.height, img.width, 3).float() / 255.0).unsqueeze(0)
