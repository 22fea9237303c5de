"""Does a kernel's gain over SDPA survive when the GPU is at its power cap, as inside a model step?

For one attention shape it times the public call of a kernel and of SDPA (CUDA events around the attention call
only), each right after 0, 1 or 3 GEMMs of a transformer block's QKV projection size, which bring the GPU to its
power cap as a model step does, and then in alternation (GEMM, kernel, GEMM, SDPA, ...). Beside each it prints the
SM clock and the power drawn during the attention calls, from `nvidia-smi` sampled every 20 ms (NVIDIA only; the
columns stay empty without it).

    python tools/power_cap.py [--shape 2,40,32760,128] [--kernel triton_int8_fp8] [--gemms 0,1,3] [--rounds 6]

Why: a kernel timed alone may run at a higher clock than inside a step, where GEMMs hold the GPU at its cap.
Figures: docs/MEASUREMENTS.md#clocks-under-the-power-cap
"""
import argparse
import datetime
import os
import statistics
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from pack_loader import load_pack

Sample = Tuple[float, float, float]  # (unix time, SM MHz, watts)
Window = Tuple[str, float, float]    # (label, unix start, unix end) of one timed attention call


def parse_smi_line(line: str) -> Optional[Sample]:
    """One line of `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits`."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return stamp, float(parts[1]), float(parts[2])
    except ValueError:  # a header, "[N/A]" or a truncated last line
        return None


def clocks_by_label(samples: Sequence[Sample], windows: Sequence[Window]) -> Dict[str, Tuple[float, float, int]]:
    """Mean SM clock and power of the samples that fall inside each label's windows: label -> (MHz, W, count)."""
    picked: Dict[str, List[Sample]] = {}
    for label, start, end in windows:
        picked.setdefault(label, []).extend(s for s in samples if start <= s[0] <= end)
    return {label: (statistics.mean(s[1] for s in got), statistics.mean(s[2] for s in got), len(got))
            for label, got in picked.items() if got}


class SmiSampler:
    """nvidia-smi writing the SM clock and power every 20 ms into a file while the context is open."""

    def __init__(self):
        self.samples: List[Sample] = []

    def __enter__(self):
        self._file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                           "--format=csv,noheader,nounits", "-lms", "20"], stdout=self._file,
                                          stderr=subprocess.DEVNULL)
        except OSError:
            self._proc = None
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            time.sleep(0.2)
            self._proc.terminate()
            self._proc.wait()
        self._file.close()
        with open(self._file.name) as f:
            self.samples = [s for s in map(parse_smi_line, f) if s is not None]
        os.unlink(self._file.name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2,40,32760,128", help="B,H,N,D of q, k and v (bf16)")
    ap.add_argument("--kernel", default="triton_int8_fp8")
    ap.add_argument("--gemms", default="0,1,3", help="GEMMs issued before each timed call, per pattern")
    ap.add_argument("--rounds", type=int, default=6, help="timed calls per backend and pattern")
    ap.add_argument("--hidden", type=int, default=5120,
                    help="model width: the GEMM is (B*N, hidden) x (hidden, 3*hidden)")
    args = ap.parse_args(argv)
    load_pack()
    import torch
    import torch.nn.functional as F

    from comfyui_sage_rdna4.kernels.api import sage_attention

    b, h, n, d = (int(x) for x in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    x = torch.randn(b * n, args.hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(args.hidden, 3 * args.hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
    backends = {"ours": lambda: sage_attention(q, k, v, kernel=args.kernel),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}
    for fn in backends.values():
        fn()
    gemm = lambda: x @ w  # noqa: E731
    gemm()
    torch.cuda.synchronize()
    windows: List[Window] = []

    def timed(label, fn, gemms):
        for _ in range(gemms):
            gemm()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time()
        start.record()
        fn()
        end.record()
        end.synchronize()
        windows.append((label, t0, time.time()))
        return start.elapsed_time(end)

    print(f"q/k/v B{b} H{h} N{n} D{d} bf16; {args.kernel} against SDPA; GEMM ({b * n}x{args.hidden}) x "
          f"({args.hidden}x{3 * args.hidden}) bf16")
    ratios = []
    with SmiSampler() as smi:
        for gemms in (int(g) for g in args.gemms.split(",")):
            ms = {name: statistics.median(timed(f"{gemms} GEMMs + {name}", fn, gemms) for _ in range(args.rounds))
                  for name, fn in backends.items()}
            ratios.append((f"{gemms} GEMMs before each call", f"{gemms} GEMMs", ms["ours"], ms["sdpa"]))
        alternating = {"ours": [], "sdpa": []}
        for _ in range(args.rounds):
            for name, fn in backends.items():
                alternating[name].append(timed(f"alternating + {name}", fn, 1))
        ratios.append(("one GEMM each, alternating", "alternating", statistics.median(alternating["ours"]),
                       statistics.median(alternating["sdpa"])))
    clocks = clocks_by_label(smi.samples, windows)
    print(f"{'pattern':<28} {'ours ms':>9} {'sdpa ms':>9} {'ratio':>7}   clocks during the calls (MHz, W)")
    for label, key, ours_ms, sdpa_ms in ratios:
        seen = [f"{name} {clocks[f'{key} + {name}'][0]:.0f} MHz {clocks[f'{key} + {name}'][1]:.0f} W"
                for name in backends if f"{key} + {name}" in clocks]
        print(f"{label:<28} {ours_ms:9.2f} {sdpa_ms:9.2f} {ours_ms / sdpa_ms:7.3f}   {'  '.join(seen) or '-'}")
    if not smi.samples:
        print("(no nvidia-smi samples: clocks not shown)")


if __name__ == "__main__":
    main()
