"""Static checks of the HIP kernels for gfx1200/gfx1201 without a GPU or ROCm.

Reads the shipped code objects (kernels/backends/hip/prebuilt/, built by tools/build_hip_objects.py with
Debian bookworm's clang-19 + lld-19): the AMDHSA metadata with llvm-readelf (VGPRs, SGPRs, spills, LDS,
and from these the occupancy in waves per SIMD, `occupancy_from_metadata`), and the disassembly from
llvm-objdump: for every loop that contains v_wmma (a backward branch), how many v_wmma it holds and how
many other instructions run per v_wmma. `--fresh` compiles the sources as they are now instead (the translation
unit the runtime builds, kernel_abi.SOURCE_FILES, with the same flags, shipped_objects.BUILD_FLAGS), for trying
an edit before rebuilding the objects. `--summary` prints the Markdown block docs/MEASUREMENTS.md#prebuilt-code-
objects holds for the shipped objects (tests/test_prebuilt_objects.py checks the two are equal).

    python kernels/verify/hip_static_check.py [--arch gfx1201] [--kernel NAME] [--fresh | --summary]
    (it imports nothing of the pack but shipped_objects.py, loaded by path: standard library only)

The key loop's limits (non-WMMA instructions per v_wmma, waves per SIMD) are kept in
tests/test_hip_static_check.py (KEY_LOOP_LIMITS, MIN_WAVES); today's figures in the block `--summary` prints.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

HIP_DIR = Path(__file__).resolve().parents[1] / "backends" / "hip"


def _load_shipped_objects():
    """kernels/backends/hip/shipped_objects.py by path (this file also runs as a script, outside the package)."""
    name = "_sage_rdna4_shipped_objects"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HIP_DIR / "shipped_objects.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


shipped_objects = _load_shipped_objects()
ARCHS = shipped_objects.ARCHS
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


def toolchain_missing(tools=("clang++", "llvm-readelf", "llvm-objdump", "ld.lld")) -> Optional[str]:
    for tool in tools:
        if find_tool(tool) is None:
            return f"{tool}-19 not found (apt-get install clang-19 lld-19 llvm-19)"
    return None


def readers_missing() -> Optional[str]:
    """What reading a shipped object needs (no compiler)."""
    return toolchain_missing(("llvm-readelf", "llvm-objdump"))


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
    workgroup_size: int = -1        # .max_flat_workgroup_size
    wavefront_size: int = -1
    occupancy: int = -1             # waves per SIMD (LLVM 19's model, from the metadata)
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


REMARKS_FLAG = "-Rpass-analysis=kernel-resource-usage"


def compile_code_object(source: str, arch: str, out_dir: str, extra_flags=()) -> (str, str):
    """Compile one translation unit for `arch` with the shipped objects' flags plus the resource remarks;
    returns (code object path, compiler remarks)."""
    src = os.path.join(out_dir, shipped_objects.SOURCE_NAME)
    obj = os.path.join(out_dir, f"kernels_{arch}.co")
    Path(src).write_text(source)
    cmd = [find_tool("clang++"), *shipped_objects.build_flags(arch), REMARKS_FLAG, "-o", obj, src, *extra_flags]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"clang failed for {arch}:\n{res.stderr[-4000:]}")
    return obj, res.stderr


_META_KEYS = {".vgpr_count": "vgprs", ".sgpr_count": "sgprs", ".vgpr_spill_count": "vgpr_spills",
              ".sgpr_spill_count": "sgpr_spills", ".group_segment_fixed_size": "lds_bytes",
              ".private_segment_fixed_size": "scratch_bytes", ".max_flat_workgroup_size": "workgroup_size",
              ".wavefront_size": "wavefront_size"}

# LLVM 19's occupancy model for gfx12 in wave32 (what its resource remarks print): 1536 VGPRs per SIMD,
# allocated in granules of 24; 64 KiB of LDS shared by the 2 SIMDs a workgroup runs on; at most 16 waves per
# SIMD. tests/test_prebuilt_objects.py checks it against the remarks of a fresh build, kernel by kernel.
GFX12_VGPRS, GFX12_VGPR_GRANULE, GFX12_LDS, GFX12_SIMDS_PER_CU, GFX12_MAX_WAVES = 1536, 24, 64 * 1024, 2, 16


def occupancy_from_metadata(ks: "KernelStats") -> int:
    """Waves per SIMD that the kernel's VGPRs and LDS allow (SGPRs do not limit gfx10+)."""
    granules = -(-max(ks.vgprs, 1) // GFX12_VGPR_GRANULE)
    by_vgprs = min(GFX12_MAX_WAVES, GFX12_VGPRS // (granules * GFX12_VGPR_GRANULE))
    if ks.lds_bytes <= 0:
        return by_vgprs
    groups = GFX12_LDS // ks.lds_bytes
    if groups == 0:
        return 0
    waves_per_group = -(-ks.workgroup_size // ks.wavefront_size)
    by_lds = min(GFX12_MAX_WAVES, -(-groups * waves_per_group // GFX12_SIMDS_PER_CU))
    return min(by_vgprs, by_lds)


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


def shipped_object(arch: str) -> str:
    """The path of the code object shipped for `arch`."""
    return shipped_objects.object_path(arch)


def analyze_object(obj: str, arch: str) -> Dict[str, KernelStats]:
    """Statistics of every kernel in the code object at `obj`."""
    notes = subprocess.run([find_tool("llvm-readelf"), "--notes", obj], capture_output=True, text=True,
                           check=True).stdout
    dis = subprocess.run([find_tool("llvm-objdump"), "-d", f"--mcpu={arch}", obj], capture_output=True,
                         text=True, check=True).stdout
    kernels = parse_notes(notes, arch)
    for ks in kernels.values():
        ks.occupancy = occupancy_from_metadata(ks)
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


def source_files() -> tuple:
    """kernel_abi.SOURCE_FILES, read from its source (this tool imports nothing of the pack)."""
    tree = ast.parse((HIP_DIR / "kernel_abi.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SOURCE_FILES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError("kernel_abi.py defines no SOURCE_FILES")


def fresh_sources() -> str:
    """The translation unit as the sources are now: kernel_abi.module_source('hip') with no options."""
    return "\n".join((HIP_DIR / "src" / n).read_text() for n in source_files())


# The attention kernels of the summary, by what they are: (P.V, head dim) -> the kernel read (bf16 is the same code).
SUMMARY_KERNELS = {("FP8", 128): "sage_attn_i8f8_d128_f16", ("FP8", 64): "sage_attn_i8f8_d64_f16",
                   ("FP16", 128): "sage_attn_i8f16_d128_f16", ("FP16", 64): "sage_attn_i8f16_d64_f16",
                   ("FP16 single chain", 128): "sage_attn_i8f16_d128_f16_sc",
                   ("FP16 single chain", 64): "sage_attn_i8f16_d64_f16_sc",
                   # the same kernels with a key-only mask (the *_kmask entry points)
                   ("FP8, key mask", 128): "sage_attn_i8f8_d128_f16_kmask",
                   ("FP8, key mask", 64): "sage_attn_i8f8_d64_f16_kmask",
                   ("FP16, key mask", 128): "sage_attn_i8f16_d128_f16_kmask",
                   ("FP16, key mask", 64): "sage_attn_i8f16_d64_f16_kmask"}
SUMMARY_BEGIN, SUMMARY_END = "<!-- shipped objects: begin -->", "<!-- shipped objects: end -->"


def summary_markdown(archs=ARCHS) -> str:
    """The shipped objects' figures as docs/MEASUREMENTS.md keeps them, between SUMMARY_BEGIN and SUMMARY_END."""
    rows, per_arch = [], {}
    for arch in archs:
        path = Path(shipped_object(arch))
        data = path.read_bytes()
        manifest = json.loads(Path(shipped_objects.manifest_path(arch)).read_text())
        kernels = analyze(arch)
        per_arch[arch] = kernels
        rows.append(f"| `{path.name}` | {len(data)} | {shipped_objects.sha256(data)[:16]} | "
                    f"{str(manifest.get('source_digest'))[:16]} | {len(kernels)} |")
    lines = [SUMMARY_BEGIN, "| object | bytes | sha256 (first 16) | source digest (first 16) | kernels |",
             "| --- | --- | --- | --- | --- |", *rows, ""]
    same = all({n: k.line().split(" ", 1)[1] for n, k in per_arch[a].items()}
               == {n: k.line().split(" ", 1)[1] for n, k in per_arch[archs[0]].items()} for a in archs)
    lines.append("Attention kernels, " + ("the same figures on every arch" if same else f"on {archs[0]}") + ":")
    lines += ["", "| P·V | head dim | VGPRs | spills | LDS bytes | waves per SIMD | non-WMMA per `v_wmma` |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for (pv, d), name in SUMMARY_KERNELS.items():
        k = per_arch[archs[0]][name]
        lines.append(f"| {pv} | {d} | {k.vgprs} | {k.vgpr_spills + k.sgpr_spills} | {k.lds_bytes} | {k.occupancy} | "
                     f"{k.main_loop.other_per_wmma:.2f} |")
    lines.append(SUMMARY_END)
    return "\n".join(lines)


def analyze(arch: str, source: Optional[str] = None, work_dir: Optional[str] = None) -> Dict[str, KernelStats]:
    """Statistics for every kernel: of the shipped object for `arch`, or of a fresh build of `source`."""
    if source is None:
        return analyze_object(shipped_object(arch), arch)
    with tempfile.TemporaryDirectory() as tmp:
        obj, _ = compile_code_object(source, arch, work_dir or tmp)
        return analyze_object(obj, arch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", choices=ARCHS)
    ap.add_argument("--kernel", help="substring filter on kernel names")
    ap.add_argument("--fresh", action="store_true", help="compile the sources as they are now instead of "
                                                         "reading the shipped objects")
    ap.add_argument("--summary", action="store_true", help="print the shipped objects' Markdown summary")
    args = ap.parse_args(argv)
    if args.summary:
        missing = readers_missing()
        print(missing or summary_markdown(tuple(args.arch or ARCHS)))
        return 2 if missing else 0
    missing = toolchain_missing() if args.fresh else readers_missing()
    if missing:
        print(missing)
        return 2
    bad = 0
    for arch in args.arch or ARCHS:
        if args.fresh:
            print(f"{arch}: a fresh build of kernels/backends/hip/src")
            kernels = analyze(arch, fresh_sources())
        else:
            path = shipped_object(arch)
            print(f"{arch}: {os.path.relpath(path)} ({shipped_objects.sha256(Path(path).read_bytes())[:8]})")
            kernels = analyze(arch)
        for name, ks in sorted(kernels.items()):
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
