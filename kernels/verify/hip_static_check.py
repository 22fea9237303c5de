"""Static checks of the HIP kernels for gfx1200/gfx1201 without a GPU or ROCm.

Compiles `kernel_abi.module_source('hip')` with clang-19 (Debian bookworm's clang-19 + lld-19), reads
the code object's AMDHSA metadata with llvm-readelf (VGPRs, SGPRs, spills, LDS), the compiler's
resource remarks (occupancy in waves per SIMD, as the compiler models it for the target), and the
disassembly from llvm-objdump: for every loop that contains v_wmma (a backward branch), how many
v_wmma it holds and how many other instructions run per v_wmma.

    python kernels/verify/hip_static_check.py [--arch gfx1201] [--kernel NAME]
    (it imports nothing of the pack: it only reads the sources in kernels/backends/hip/src)

The key loop's figures and their limits (non-WMMA instructions per v_wmma, waves per SIMD) are kept in
tests/test_hip_static_check.py (KEY_LOOP_LIMITS, MIN_WAVES) and in docs/MEASUREMENTS.md#hip-key-loop; now:
FP8 D128 5.44, FP16 D128 5.84, FP8 D64 8.56, FP16 D64 8.81 (history in docs/MEASUREMENTS.md).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ARCHS = ("gfx1200", "gfx1201")
LDS_LIMIT = 64 * 1024
TOOL_SUFFIXES = ("-19", "")


def find_tool(name: str) -> Optional[str]:
    """clang++-19 / llvm-readelf-19 / llvm-objdump-19 (or unsuffixed, or under /usr/lib/llvm-19/bin)."""
    for suffix in TOOL_SUFFIXES:
        path = shutil.which(name + suffix)
        if path:
            return path
    cand = Path("/usr/lib/llvm-19/bin") / name
    return str(cand) if cand.exists() else None


def toolchain_missing() -> Optional[str]:
    for tool in ("clang++", "llvm-readelf", "llvm-objdump", "ld.lld"):
        if find_tool(tool) is None:
            return f"{tool}-19 not found (apt-get install clang-19 lld-19 llvm-19)"
    return None


@dataclass
class LoopStats:
    start: int
    end: int
    wmma: int
    other: int                      # every non-WMMA instruction in the loop body
    # valu / salu / lds / vmem / wait (s_waitcnt*, s_nop, s_delay_alu)
    by_kind: Dict[str, int] = field(default_factory=dict)

    @property
    def other_per_wmma(self) -> float:
        return self.other / self.wmma if self.wmma else float("inf")

    @property
    def work_per_wmma(self) -> float:
        """Non-WMMA instructions excluding pure scheduling/wait instructions."""
        return (self.other - self.by_kind.get("wait", 0)) / self.wmma if self.wmma else float("inf")


@dataclass
class KernelStats:
    name: str
    arch: str
    vgprs: int = -1
    sgprs: int = -1
    vgpr_spills: int = -1
    sgpr_spills: int = -1
    lds_bytes: int = -1
    scratch_bytes: int = -1
    occupancy: int = -1             # waves per SIMD (compiler's model)
    wmma_total: int = 0
    wmma_kinds: Dict[str, int] = field(default_factory=dict)
    loops: List[LoopStats] = field(default_factory=list)

    @property
    def main_loop(self) -> Optional[LoopStats]:
        """The key loop: of the loops holding v_wmma, the one with the least other work per v_wmma
        (the unmasked loop; the masked diagonal/tail loop is reported beside it)."""
        loops = [l for l in self.loops if l.wmma]
        return min(loops, key=lambda l: l.other_per_wmma) if loops else None

    def line(self) -> str:
        ml = self.main_loop
        loop = (f"loop: {ml.wmma} wmma, {ml.other_per_wmma:.2f} other/wmma ({ml.work_per_wmma:.2f} without waits)"
                if ml else "no wmma loop")
        return (f"{self.arch} {self.name}: VGPRs {self.vgprs}, SGPRs {self.sgprs}, spills v{self.vgpr_spills}/"
                f"s{self.sgpr_spills}, LDS {self.lds_bytes} B, scratch {self.scratch_bytes} B, "
                f"waves/SIMD {self.occupancy}, v_wmma {self.wmma_total}; {loop}")


def compile_code_object(source: str, arch: str, out_dir: str, extra_flags=()) -> (str, str):
    """Compile one translation unit for `arch`; returns (code object path, compiler remarks)."""
    src = os.path.join(out_dir, "kernels.hip")
    obj = os.path.join(out_dir, f"kernels_{arch}.co")
    Path(src).write_text(source)
    cmd = [find_tool("clang++"), "-x", "hip", f"--offload-arch={arch}", "-nogpulib", "-nogpuinc",
           "--cuda-device-only", "--no-gpu-bundle-output", "-O3", "-std=c++17",
           "-Rpass-analysis=kernel-resource-usage", "-o", obj, src, *extra_flags]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"clang failed for {arch}:\n{res.stderr[-4000:]}")
    return obj, res.stderr


_META_KEYS = {".vgpr_count": "vgprs", ".sgpr_count": "sgprs", ".vgpr_spill_count": "vgpr_spills",
              ".sgpr_spill_count": "sgpr_spills", ".group_segment_fixed_size": "lds_bytes",
              ".private_segment_fixed_size": "scratch_bytes"}


def parse_notes(text: str, arch: str) -> Dict[str, KernelStats]:
    """Kernel records of the AMDHSA metadata (YAML as llvm-readelf --notes prints it)."""
    kernels: Dict[str, KernelStats] = {}
    for block in re.split(r"\n\s*-\s+\.args:", text)[1:]:
        m = re.search(r"^\s+\.name:\s+(\S+)", block, re.M)
        if not m:
            continue
        ks = KernelStats(m.group(1), arch)
        for key, attr in _META_KEYS.items():
            mm = re.search(r"^\s+" + re.escape(key) + r":\s+(\d+)", block, re.M)
            if mm:
                setattr(ks, attr, int(mm.group(1)))
        kernels[ks.name] = ks
    return kernels


def parse_occupancy(remarks: str) -> Dict[str, int]:
    occ, name = {}, None
    for line in remarks.splitlines():
        m = re.search(r"Function Name: (\S+)", line)
        if m:
            name = m.group(1)
        m = re.search(r"Occupancy \[waves/SIMD\]: (\d+)", line)
        if m and name:
            occ[name] = int(m.group(1))
    return occ


_INSN = re.compile(r"^\s+([a-z_][a-z0-9_.]*)\b(.*?)//\s*([0-9A-Fa-f]+):")
_FUNC = re.compile(r"^([0-9a-fA-F]+) <([^>]+)>:")
_TARGET = re.compile(r"<([^>+]+)\+0x([0-9a-fA-F]+)>")


def _kind(mn: str) -> str:
    if mn.startswith(("s_waitcnt", "s_wait_", "s_nop", "s_delay_alu")):
        return "wait"
    if mn.startswith("ds_"):
        return "lds"
    if mn.startswith(("global_", "buffer_", "flat_", "scratch_", "s_load", "s_buffer_load")):
        return "vmem"
    if mn.startswith("s_"):
        return "salu"
    return "valu"


def parse_disassembly(text: str) -> Dict[str, List[tuple]]:
    """{function: [(address, mnemonic, branch_target_or_None)]}"""
    funcs: Dict[str, List[tuple]] = {}
    cur, base = None, 0
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur, base = m.group(2), int(m.group(1), 16)
            funcs[cur] = []
            continue
        if cur is None:
            continue
        m = _INSN.match(line)
        if not m:
            continue
        mn, addr = m.group(1), int(m.group(3), 16)
        target = None
        if mn.startswith(("s_cbranch", "s_branch")):
            t = _TARGET.search(line)
            if t and t.group(1) == cur:
                target = base + int(t.group(2), 16)
        funcs[cur].append((addr, mn, target))
    return funcs


def loop_stats(insns: List[tuple]) -> List[LoopStats]:
    loops = []
    for addr, _, target in insns:
        if target is None or target > addr:
            continue
        body = [i for i in insns if target <= i[0] <= addr]
        wmma = sum(1 for i in body if i[1].startswith("v_wmma"))
        kinds: Dict[str, int] = {}
        for i in body:
            if not i[1].startswith("v_wmma"):
                kinds[_kind(i[1])] = kinds.get(_kind(i[1]), 0) + 1
        loops.append(LoopStats(target, addr, wmma, sum(kinds.values()), kinds))
    return loops


def analyze(arch: str, source: Optional[str] = None, work_dir: Optional[str] = None) -> Dict[str, KernelStats]:
    """Compile for `arch` and return statistics for every kernel."""
    if source is None:
        src_dir = Path(__file__).resolve().parents[1] / "backends" / "hip" / "src"
        names = ("gfx12_prelude.h", "sage_prologue.hip", "sage_attention.hip")
        source = "\n".join((src_dir / n).read_text() for n in names)
    with tempfile.TemporaryDirectory() as tmp:
        d = work_dir or tmp
        obj, remarks = compile_code_object(source, arch, d)
        notes = subprocess.run([find_tool("llvm-readelf"), "--notes", obj], capture_output=True, text=True,
                               check=True).stdout
        dis = subprocess.run([find_tool("llvm-objdump"), "-d", f"--mcpu={arch}", obj], capture_output=True,
                             text=True, check=True).stdout
    kernels = parse_notes(notes, arch)
    for name, occ in parse_occupancy(remarks).items():
        if name in kernels:
            kernels[name].occupancy = occ
    for name, insns in parse_disassembly(dis).items():
        if name not in kernels:
            continue
        ks = kernels[name]
        for _, mn, _ in insns:
            if mn.startswith("v_wmma"):
                ks.wmma_total += 1
                ks.wmma_kinds[mn] = ks.wmma_kinds.get(mn, 0) + 1
        ks.loops = loop_stats(insns)
    return kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", choices=ARCHS)
    ap.add_argument("--kernel", help="substring filter on kernel names")
    args = ap.parse_args(argv)
    missing = toolchain_missing()
    if missing:
        print(missing)
        return 2
    bad = 0
    for arch in args.arch or ARCHS:
        for name, ks in sorted(analyze(arch).items()):
            if args.kernel and args.kernel not in name:
                continue
            print(ks.line())
            for lp in ks.loops:
                if lp.wmma:
                    print(f"    loop {lp.start:#x}-{lp.end:#x}: {lp.wmma} wmma, {lp.other} other "
                          f"({lp.other_per_wmma:.2f}/wmma) {lp.by_kind}")
            if ks.vgpr_spills or ks.sgpr_spills or ks.lds_bytes > LDS_LIMIT:
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
