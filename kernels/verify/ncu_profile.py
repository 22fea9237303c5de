"""Where an attention kernel's warps wait on an NVIDIA GPU, read by Nsight Compute (ncu) from public calls.

    python kernels/verify/ncu_profile.py [--shape wan_480p] [--heads 8] [--kernel triton_int8_fp8]
                                         [--kernel-regex _sage_attn_fwd] [--out DIR]

Runs `ncu --set full` on a child process that makes three public `sage_attention` calls at one shape (fewer
heads than the shape's keep the 38 replays short; per-CTA behaviour does not depend on the head count) and
profiles the kernel's launch in the third (the first two compile, self-check and warm up outside the profiled
range). From the report it prints the scheduler figures (issue slots busy, eligible warps per scheduler,
occupancy, registers, local-memory spill requests), the warp-stall samples by reason, and the most-sampled SASS
instructions with their main reason; it keeps the report (`profile.ncu-rep`, its details page as `details.txt`)
and writes `summary.json`.

2026-12-01, H200, shipped D128 FP8 kernel at Wan 480p (8 heads): issue slots 49 % busy, 0.71 eligible warps
per scheduler, stalls: selected 26 %, barrier 24 % (nearly all at `WARPGROUP.DEPBAR` after each Q.K and P.V
wgmma: ptxas serialised them, see sm90_sass.py), wait 18 %, not selected 11 %, short scoreboard 9 %.
Needs ncu on PATH (or in /usr/local/cuda/bin) and access to the GPU's performance counters.
"""
import argparse
import collections
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

STALL_PREFIX = "stall_"
SAMPLES = "Warp Stall Sampling (All Samples)"
# Lines of `ncu --page details` worth carrying into the summary: (label in the report, key in the summary).
DETAIL_METRICS = [
    ("Duration", "duration"),
    ("SM Frequency", "sm_frequency"),
    ("Issue Slots Busy", "issue_slots_busy_pct"),
    ("Eligible Warps Per Scheduler", "eligible_warps_per_scheduler"),
    ("Active Warps Per Scheduler", "active_warps_per_scheduler"),
    ("Registers Per Thread", "registers_per_thread"),
    ("Achieved Occupancy", "achieved_occupancy_pct"),
    ("Local Memory Spilling Requests", "local_spill_requests"),
    ("L2 Hit Rate", "l2_hit_rate_pct"),
]
PIPE_LINE = re.compile(r"\s*(?:(?:INF|OPT|WRN)\s+)?(\S.*?) is the highest-utilized pipeline \(([\d.]+)%\)")


def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def stall_summary(source_csv: str, top: int = 10) -> Dict[str, object]:
    """Warp-stall samples of `ncu --page source --csv --print-source sass`: the share of each reason (issued
    and not issued together) and the `top` most-sampled instructions, each with its largest reason."""
    lines = source_csv.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError("no SASS source table in this ncu output (expected a header row starting with \"Address\")")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith(STALL_PREFIX) and "(Not Issued)" not in h]
    if SAMPLES not in col or not reasons:
        raise ValueError("the SASS table has no warp-stall sampling columns (profile with --set full)")
    by_reason = collections.Counter()
    per_instruction = []
    for row in body:
        if len(row) < len(header):
            continue
        counts = {r: _number(row[col[r]]) or 0.0 for r in reasons}
        by_reason.update(counts)
        samples = _number(row[col[SAMPLES]]) or 0.0
        if samples:
            main = max(counts, key=counts.get)
            per_instruction.append((samples, row[col["Address"]], row[col["Source"]].strip(), main))
    total = sum(by_reason.values())
    if not total:
        raise ValueError("the SASS table holds no stall samples")
    per_instruction.sort(key=lambda x: -x[0])
    return {
        "samples": total,
        "by_reason": {r[len(STALL_PREFIX):]: round(v / total, 4) for r, v in by_reason.most_common() if v},
        "top": [{"share": round(s / total, 4), "address": a, "sass": src, "reason": r[len(STALL_PREFIX):]}
                for s, a, src, r in per_instruction[:top]],
    }


def detail_metrics(details: str) -> Dict[str, object]:
    """The DETAIL_METRICS found in `ncu --page details` text (first occurrence each), and the pipeline ncu names
    as the most used with its share."""
    found: Dict[str, object] = {}
    for line in details.splitlines():
        for label, key in DETAIL_METRICS:
            if key in found:
                continue
            m = re.match(rf"\s*{re.escape(label)}\s+(?:(\S+)\s+)?([\d,.]+)\s*$", line)
            if m:
                found[key] = _number(m.group(2))
                if key == "duration" and m.group(1):
                    found["duration_unit"] = m.group(1)
        pipe = PIPE_LINE.match(line)
        if pipe and "top_pipe" not in found:
            found["top_pipe"] = {"name": pipe.group(1).strip(), "pct": float(pipe.group(2))}
    return found


def format_summary(details: Dict[str, object], stalls: Dict[str, object]) -> str:
    out = ["scheduler: " + ", ".join(f"{k} {v}" for k, v in details.items() if k != "top_pipe")]
    if "top_pipe" in details:
        out.append(f"most used pipeline: {details['top_pipe']['name']} {details['top_pipe']['pct']} %")
    out.append(f"warp-stall samples ({stalls['samples']:.0f}) by reason:")
    out += [f"  {r:20s} {share * 100:5.1f} %" for r, share in stalls["by_reason"].items()]
    out.append("most-sampled instructions:")
    out += [f"  {t['share'] * 100:5.2f} %  {t['reason']:16s} {t['sass']}" for t in stalls["top"]]
    return "\n".join(out)


def _ncu() -> Optional[str]:
    found = shutil.which("ncu")
    if found:
        return found
    fallback = "/usr/local/cuda/bin/ncu"
    return fallback if os.path.exists(fallback) else None


def _child(args) -> int:
    """Inside ncu: two warm-up calls and the profiled one, at the shape (with --heads heads)."""
    _load_pack()
    import torch

    from comfyui_sage_rdna4.kernels import benchmark as bench
    from comfyui_sage_rdna4.kernels.api import sage_attention

    shape = {s.name: s for s in bench.GPU_SHAPES}[args.shape]
    heads = args.heads or shape.heads
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape.batch, heads, shape.seq, shape.head_dim, device="cuda", dtype=dtype,
                           generator=gen) for _ in range(3))
    for _ in range(2):  # compiles, self-checks and warms up, outside the profiled range
        sage_attention(q, k, v, kernel=args.kernel)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    sage_attention(q, k, v, kernel=args.kernel)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


def _load_pack():
    """The repo as the pack, with the tools' loader (this file may run as a script in the child)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "tools"))
    from pack_loader import load_pack
    load_pack()


def profile(args) -> int:
    ncu = _ncu()
    if ncu is None:
        print("ncu (Nsight Compute) is not on PATH nor in /usr/local/cuda/bin")
        return 2
    out_dir = args.out or os.path.join(os.getcwd(), "ncu_profile")
    os.makedirs(out_dir, exist_ok=True)
    report = os.path.join(out_dir, "profile")
    child = [sys.executable, os.path.abspath(__file__), "--child", "--shape", args.shape, "--kernel", args.kernel]
    if args.heads:
        child += ["--heads", str(args.heads)]
    # Only the call inside the child's profiler range: the warm-up calls also compile and self-check.
    run = subprocess.run([ncu, "--set", "full", "--import-source", "no", "--profile-from-start", "off",
                          "-k", f"regex:{args.kernel_regex}", "-c", "1", "-f", "-o", report] + child,
                         capture_output=True, text=True)
    if run.returncode != 0 or not os.path.exists(report + ".ncu-rep"):
        print(run.stdout[-3000:] + run.stderr[-3000:])
        return run.returncode or 1
    def read(*page):
        return subprocess.run([ncu, "--import", report + ".ncu-rep", *page], capture_output=True, text=True,
                              check=True).stdout
    details_text = read("--page", "details")
    with open(os.path.join(out_dir, "details.txt"), "w") as f:
        f.write(details_text)
    details = detail_metrics(details_text)
    stalls = stall_summary(read("--page", "source", "--csv", "--print-source", "sass"))
    label = f"{args.kernel} at {args.shape}" + (f" with {args.heads} heads" if args.heads else "")
    print(label)
    print(format_summary(details, stalls))
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"call": label, "kernel_regex": args.kernel_regex, "details": details, "stalls": stalls}, f,
                  indent=1)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="wan_480p", help="a GPU shape of the main job (kernels/benchmark.py)")
    ap.add_argument("--heads", type=int, default=8, help="heads instead of the shape's (0: the shape's)")
    ap.add_argument("--kernel", default="triton_int8_fp8", help="the sage_attention kernel= to call")
    ap.add_argument("--kernel-regex", default="_sage_attn_fwd", help="which GPU kernel of the call ncu profiles")
    ap.add_argument("--out", default=None, help="folder for the report and summary.json (default ./ncu_profile)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return _child(args) if args.child else profile(args)


if __name__ == "__main__":
    sys.exit(main())
