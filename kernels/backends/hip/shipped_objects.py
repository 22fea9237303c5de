"""The gfx12 code objects shipped in prebuilt/: how they are built, and whether one may serve these sources.

`tools/build_hip_objects.py` compiles the whole translation unit (`kernel_abi.module_source("hip")`, the text
hiprtc is handed) once per arch with Debian's clang-19 and writes `sage_kernels-<arch>.co` beside a manifest
`sage_kernels-<arch>.json`: the source digest (compiler.SourceBundle.digest), the compiler's version line, the
flags, the object's sha256 and size, its code object version. The loader (runtime.KernelLoader) takes an object
only when the manifest's digest is the digest of the sources it was asked to run and the bytes hash to the
manifest's sha256; otherwise hiprtc compiles at first use, with the reason this module gives.

BUILD_FLAGS is the one statement of the compile: the build script and kernels/verify/hip_static_check.py both
read it. Code object version 5: the newest that ROCm/clr (f9f995c, 2024-10) recognises (metadata 1.0-1.2 =
V3-V5 in rocclr/device/devprogram.cpp; "-code-object-version" takes 4 or 5 in rocclr's OPTIONS.def, default 5),
and clang-19's default. The Windows HIP runtime is the same clr with its PAL backend: a plain ELF takes the same
hipamd path (FatBinaryInfo) on both OSes. References: docs/VERIFICATION.md, "Prebuilt code objects". Nothing
here has run on RDNA4 hardware.

Only the standard library: the static check loads this file by path.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

PREBUILT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prebuilt")
ARCHS = ("gfx1200", "gfx1201")
SOURCE_NAME = "sage_kernels.hip"        # the SourceBundle name the runtime gives the translation unit
CODE_OBJECT_VERSION = 5
REBUILD_COMMAND = "python tools/build_hip_objects.py"
# -cuid: clang otherwise names a symbol (__hip_cuid_<hash>) after the input file's path, so the bytes would
# depend on where the build ran.
BUILD_FLAGS = ("-x", "hip", "-nogpulib", "-nogpuinc", "--cuda-device-only", "--no-gpu-bundle-output", "-O3",
               "-std=c++17", f"-mcode-object-version={CODE_OBJECT_VERSION}", "-cuid=sage_rdna4")

# e_ident[EI_ABIVERSION] of an amdgcn-amd-amdhsa ELF (ELFOSABI_AMDGPU_HSA = 64) -> code object version
_OSABI_AMDGPU_HSA = 64
_ABI_TO_VERSION = {1: 3, 2: 4, 3: 5, 4: 6}


def build_flags(arch: str) -> List[str]:
    """clang's arguments for one arch, before `-o OUT INPUT`."""
    return [*BUILD_FLAGS[:2], f"--offload-arch={arch}", *BUILD_FLAGS[2:]]


def object_path(arch: str, folder: str = PREBUILT_DIR) -> str:
    return os.path.join(folder, f"sage_kernels-{arch}.co")


def manifest_path(arch: str, folder: str = PREBUILT_DIR) -> str:
    return os.path.join(folder, f"sage_kernels-{arch}.json")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_object_version(image: bytes) -> Optional[int]:
    """The code object version an AMDGPU HSA ELF declares, or None for anything else."""
    if image[:4] != b"\x7fELF" or len(image) < 16 or image[7] != _OSABI_AMDGPU_HSA:
        return None
    return _ABI_TO_VERSION.get(image[8])


@dataclass(frozen=True)
class Manifest:
    arch: str
    source_digest: str
    compiler: str               # the compiler's `--version` first line
    flags: Tuple[str, ...]
    sha256: str
    size: int
    code_object_version: int

    def to_json(self) -> str:
        doc = asdict(self)
        doc["flags"] = list(self.flags)
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        doc = json.loads(text)
        doc["flags"] = tuple(doc["flags"])
        return cls(**doc)


@dataclass(frozen=True)
class Prebuilt:
    """A shipped object checked against its manifest and the sources: ready for hipModuleLoadData."""
    image: bytes
    manifest: Manifest

    @property
    def label(self) -> str:
        return f"prebuilt {self.manifest.arch} {self.manifest.sha256[:8]}"


def read_manifest(arch: str, folder: str = PREBUILT_DIR) -> Tuple[Optional[Manifest], Optional[str]]:
    """(manifest, None), or (None, why there is none or it cannot be read)."""
    path = manifest_path(arch, folder)
    if not os.path.exists(path):
        shipped = [a for a in ARCHS if os.path.exists(manifest_path(a, folder))]
        return None, f"no prebuilt code object for {arch} (shipped: {', '.join(shipped) or 'none'})"
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return Manifest.from_json(fh.read()), None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return None, f"the prebuilt {arch} manifest {os.path.basename(path)} is unreadable: {exc}"


def stale_reason(manifest: Manifest, source_digest: str) -> Optional[str]:
    """Why an object built from other sources must not serve these, or None when the digests agree."""
    if manifest.source_digest == source_digest:
        return None
    return (f"the prebuilt {manifest.arch} object was built from other sources (manifest digest "
            f"{manifest.source_digest[:12]}, these sources {source_digest[:12]}): sources edited here, or changed "
            f"without `{REBUILD_COMMAND}`")


def check(arch: str, source_digest: str, folder: str = PREBUILT_DIR) -> Tuple[Optional[Prebuilt], Optional[str]]:
    """(the object, None) when the shipped object for `arch` may serve sources of `source_digest`; else
    (None, the reason): none for this arch, an unreadable manifest, other sources, missing or damaged bytes."""
    manifest, reason = read_manifest(arch, folder)
    if manifest is None:
        return None, reason
    reason = stale_reason(manifest, source_digest)
    if reason:
        return None, reason
    try:
        with open(object_path(arch, folder), "rb") as fh:
            image = fh.read()
    except OSError as exc:
        return None, f"the prebuilt {arch} object cannot be read: {exc}"
    got = sha256(image)
    if got != manifest.sha256 or len(image) != manifest.size:
        return None, (f"the prebuilt {arch} object is damaged: sha256 {got[:12]}, {len(image)} bytes; its manifest "
                      f"says {manifest.sha256[:12]}, {manifest.size} bytes")
    return Prebuilt(image, manifest), None


class ShippedObjects:
    """`check` once per (arch, digest) and process: the loader and the environment check ask the same question."""

    def __init__(self, folder: Optional[str] = None):
        self.folder = folder or PREBUILT_DIR
        self._answers: Dict[Tuple[str, str], Tuple[Optional[Prebuilt], Optional[str]]] = {}
        self._lock = threading.Lock()

    def find(self, arch: str, source_digest: str) -> Tuple[Optional[Prebuilt], Optional[str]]:
        key = (arch, source_digest)
        with self._lock:
            if key not in self._answers:
                self._answers[key] = check(arch, source_digest, self.folder)
            return self._answers[key]
