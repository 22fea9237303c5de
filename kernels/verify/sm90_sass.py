"""What ptxas makes of the Triton attention kernel for the H200 (sm_90), without a GPU.

Compiles each shipped sm_90 configuration (or one given with --config) ahead of time, runs the ptxas that
ships with Triton with -v on its PTX (registers, spills, and ptxas's own notes, such as C7514: every wgmma
of the kernel serialised), disassembles the cubin with Triton's nvdisasm and prints, per loop that issues
warpgroup MMAs, its instruction count and mix, and how the wgmma waits are spread (`WARPGROUP.DEPBAR.LE gsb0,
N`: N > 0 would mean a wgmma still runs while other work is issued).

    python kernels/verify/sm90_sass.py [--head-dims 64,128] [--pv fp8,fp16] [--config BM,BN,WARPS,STAGES,ACC[,fold]]

2026-12-01, Triton 3.6: every shipped entry is serialised by ptxas (C7514/C7515) and every wait is `gsb0, 0x0`;
the "split" accumulation forms are not serialised, but were slower where they fit (figures, the causes and the
un-serialised variants tried: docs/MEASUREMENTS.md#the-sm_90-kernel; kernels/verify/ncu_profile.py shows where the
warps wait).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

if __package__:
    from ..backends.triton.configs import AttentionConfig, attention_config
    from . import triton_aot
else:  # run as a script: load the repo as the pack with the tools' loader
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "tools"))
    from pack_loader import load_pack
    load_pack()
    from comfyui_sage_rdna4.kernels.backends.triton.configs import AttentionConfig, attention_config
    from comfyui_sage_rdna4.kernels.verify import triton_aot


def _nvidia_bin(tool: str) -> str:
    import triton  # only here: importing this module must not need triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
LABEL = re.compile(r"^\s*(\.L_x_\d+):\s*$\n\s*/\*([0-9a-f]{4,})\*/", re.M)


def ptxas_info(ptx: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([_nvidia_bin("ptxas"), "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    return run.stderr


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_nvidia_bin("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout


def mma_loops(sass: str):
    """(instruction count, opcode counts) of every backward-branch loop that holds a warpgroup MMA."""
    instructions = [(int(a, 16), text) for a, text in INSTRUCTION.findall(sass)]
    labels = {name: int(addr, 16) for name, addr in LABEL.findall(sass)}
    for addr, text in instructions:
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if m and labels.get(m.group(1), addr + 1) < addr:
            body = [t for a, t in instructions if labels[m.group(1)] <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            if any(op.endswith("GMMA") for op in ops):
                yield len(body), ops


def report(d: int, pv: str, cfg: AttentionConfig) -> None:
    kernel, label = triton_aot._compile_attention("sm_90", d, pv, cfg)
    info = ptxas_info(kernel.asm["ptx"])
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    serial = re.search(r"serialized due to (.*?) in the function", info)
    sass = disassemble(kernel.asm["cubin"])
    waits = collections.Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    print(f"{label}: {regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} bytes spilled, "
          f"shared {kernel.metadata.shared} B; wgmma waits {dict(waits)}; "
          f"{'SERIALISED by ptxas: ' + serial.group(1) if serial else 'not serialised'}")
    for count, ops in mma_loops(sass):
        print(f"    loop of {count} instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))


def parse_config(text: str) -> AttentionConfig:
    bm, bn, warps, stages, acc, *rest = text.split(",")
    return AttentionConfig(int(bm), int(bn), int(warps), int(stages), v_transposed=True, pv_accumulate=acc,
                           fold_q_scale=bool(rest and rest[0] == "fold"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--pv", default="fp8,fp16")
    ap.add_argument("--config", default=None, help="BM,BN,WARPS,STAGES,ACC[,fold] instead of the shipped entries")
    args = ap.parse_args()
    missing = triton_aot.nvidia_missing()
    if missing:
        print(missing)
        return 2
    for d in (int(x) for x in args.head_dims.split(",")):
        for pv in args.pv.split(","):
            cfg = parse_config(args.config) if args.config else attention_config("sm_90", d, pv)
            if args.config and pv == "fp16":
                cfg = AttentionConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                                      pv_accumulate=cfg.pv_accumulate, fold_q_scale=cfg.fold_q_scale)
            report(d, pv, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
