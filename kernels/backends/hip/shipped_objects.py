"""The gfx12 code objects shipped in prebuilt/: how they are built, and whether one may serve these sources.

`tools/build_hip_objects.py` compiles the whole translation unit (`kernel_abi.module_source("hip")`, the text
hiprtc is handed) once per arch with Debian's clang-19 and writes `sage_kernels-<arch>.co` beside a manifest
`sage_kernels-<arch>.json`: the source digest (compiler.SourceBundle.digest), the compiler's version line, the
flags, the object's sha256 and size, its code object version. The loader (runtime.KernelLoader) takes an object
only when the manifest is well formed (every field of its type), is for the device's arch, names the digest of
the sources it was asked to run, and the bytes hash to the manifest's sha256 and are an AMDGPU ELF for the
device's processor; otherwise hiprtc compiles at first use, with the one reason this module gives. Nothing
here raises for a malformed file: a manifest of wrong types, nested too deep or too large is a reason too.

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
import re
import struct
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
# The processor an AMDGPU ELF is for: e_machine EM_AMDGPU and the EF_AMDGPU_MACH bits of e_flags (LLVM's
# BinaryFormat/ELF.h); only the archs shipped here are named.
_EM_AMDGPU = 224
_EF_AMDGPU_MACH_MASK = 0x0FF
_EF_AMDGPU_MACH = {0x048: "gfx1200", 0x04E: "gfx1201"}
MAX_MANIFEST_BYTES = 64 * 1024  # a manifest is ~500 bytes
_HEX64 = re.compile(r"[0-9a-f]{64}")


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


def elf_processor(image: bytes) -> Optional[str]:
    """The processor a 64-bit little-endian AMDGPU ELF is built for ('gfx1201'; 'EF_AMDGPU_MACH 0x041' for one
    not shipped here), or None when `image` is no such ELF."""
    if len(image) < 64 or image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:  # ELFCLASS64, little-endian
        return None
    (machine,) = struct.unpack_from("<H", image, 18)
    (flags,) = struct.unpack_from("<I", image, 48)
    if machine != _EM_AMDGPU:
        return None
    mach = flags & _EF_AMDGPU_MACH_MASK
    return _EF_AMDGPU_MACH.get(mach, f"EF_AMDGPU_MACH 0x{mach:03x}")


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
        """The manifest in `text`; ValueError saying what is wrong when it is not one (not JSON, nested too
        deep, a field missing, extra or of the wrong type)."""
        try:
            doc = json.loads(text)
        except RecursionError:
            raise ValueError("nested too deep to be a manifest") from None
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        fields = {"arch": str, "source_digest": str, "compiler": str, "flags": list, "sha256": str, "size": int,
                  "code_object_version": int}
        if set(doc) != set(fields):
            missing, extra = sorted(set(fields) - set(doc)), sorted(set(doc) - set(fields))
            raise ValueError("fields " + "; ".join(filter(None, (missing and f"missing: {', '.join(missing)}",
                                                                  extra and f"unknown: {', '.join(extra)}"))))
        for name, kind in fields.items():
            value = doc[name]
            if not isinstance(value, kind) or isinstance(value, bool):  # json's true is an int to isinstance
                raise ValueError(f"{name} is {_shown(value)}, not a {kind.__name__}")
        for name in ("source_digest", "sha256"):
            if not _HEX64.fullmatch(doc[name]):
                raise ValueError(f"{name} is {_shown(doc[name])}, not 64 lowercase hex digits")
        if not all(isinstance(f, str) for f in doc["flags"]):
            raise ValueError("flags holds something other than strings")
        if doc["size"] < 0:
            raise ValueError(f"size is {doc['size']}")
        doc["flags"] = tuple(doc["flags"])
        return cls(**doc)


def _shown(value) -> str:
    """A JSON value in a reason: its type and a short text of it."""
    text = json.dumps(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return f"{text[:40]}{'...' if len(text) > 40 else ''}"


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
        with open(path, "rb") as fh:
            blob = fh.read(MAX_MANIFEST_BYTES + 1)
        if len(blob) > MAX_MANIFEST_BYTES:
            raise ValueError(f"larger than {MAX_MANIFEST_BYTES} bytes")
        return Manifest.from_json(blob.decode("utf-8")), None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and json's errors are ValueErrors
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
    if manifest.arch != arch:
        return None, (f"the prebuilt manifest {os.path.basename(manifest_path(arch, folder))} is for "
                      f"{_shown(manifest.arch)}, not this device's {arch}")
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
    processor = elf_processor(image)
    if processor != arch:  # the right bytes for the manifest, built for another GPU: the driver must not get it
        return None, (f"the prebuilt {arch} object is not code for {arch}: "
                      f"{'its ELF is for ' + processor if processor else 'not an AMDGPU ELF'}")
    version = code_object_version(image)
    if version != manifest.code_object_version:
        return None, (f"the prebuilt {arch} object declares code object version {version}; its manifest says "
                      f"{manifest.code_object_version}")
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
                try:
                    self._answers[key] = check(arch, source_digest, self.folder)
                except Exception as exc:  # whatever the files hold, an answer: the loader then tries the compiler
                    self._answers[key] = None, f"the prebuilt {arch} object could not be checked: " \
                                               f"{type(exc).__name__}: {exc}"
            return self._answers[key]
