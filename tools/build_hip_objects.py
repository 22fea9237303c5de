"""Rebuild the shipped gfx12 code objects and their manifests (kernels/backends/hip/prebuilt/) from the sources.

    python tools/build_hip_objects.py            # rewrite every object and manifest
    python tools/build_hip_objects.py --check    # rebuild in a temporary folder, compare, write nothing

Run it after any change to kernels/backends/hip/src/ (tests/test_prebuilt_objects.py fails until you do). It
compiles `kernel_abi.module_source("hip")`, the translation unit the runtime hands hiprtc, with Debian's clang-19
and lld-19 (apt-get install clang-19 lld-19) and the flags of shipped_objects.BUILD_FLAGS. The build is
deterministic: the same compiler gives the same bytes wherever it runs (tests/test_prebuilt_objects.py rebuilds
and compares).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional, Tuple

from pack_loader import load_pack

CLANG_CANDIDATES = ("clang++-19", "/usr/lib/llvm-19/bin/clang++")


def find_clang() -> Optional[str]:
    for name in CLANG_CANDIDATES:
        path = shutil.which(name) or (name if os.path.isabs(name) and os.path.exists(name) else None)
        if path:
            return path
    return None


def compiler_version(clang: str) -> str:
    """The compiler's `--version` first line (e.g. 'Debian clang version 19.1.7 (3~deb12u1)')."""
    out = subprocess.run([clang, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip()


def compile_object(clang: str, source: str, arch: str, extra_flags: Tuple[str, ...] = ()) -> Tuple[bytes, str]:
    """(code object, compiler stderr) for one arch. Compiled in a fresh folder under fixed relative names, so no
    path of this machine can reach the object."""
    from comfyui_sage_rdna4.kernels.backends.hip import shipped_objects as shipped
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, shipped.SOURCE_NAME), "w", encoding="utf-8", newline="\n") as fh:
            fh.write(source)
        cmd = [clang, *shipped.build_flags(arch), *extra_flags, "-o", "sage_kernels.co", shipped.SOURCE_NAME]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if res.returncode != 0:
            raise RuntimeError(f"clang failed for {arch} ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        with open(os.path.join(tmp, "sage_kernels.co"), "rb") as fh:
            return fh.read(), res.stderr


def build(arch: str, clang: str):
    """(image, Manifest) of the current sources for `arch`."""
    load_pack()
    from comfyui_sage_rdna4.kernels.backends.hip import runtime
    from comfyui_sage_rdna4.kernels.backends.hip import shipped_objects as shipped
    bundle = runtime.source_bundle("hip")
    image, _ = compile_object(clang, bundle.text, arch)
    version = shipped.code_object_version(image)
    if version != shipped.CODE_OBJECT_VERSION:
        raise RuntimeError(f"{arch}: clang wrote code object version {version}, not {shipped.CODE_OBJECT_VERSION}")
    manifest = shipped.Manifest(arch=arch, source_digest=bundle.digest, compiler=compiler_version(clang),
                                flags=tuple(shipped.build_flags(arch)), sha256=shipped.sha256(image),
                                size=len(image), code_object_version=version)
    return image, manifest


def main(argv: Optional[List[str]] = None) -> int:
    load_pack()
    from comfyui_sage_rdna4.kernels.backends.hip import shipped_objects as shipped
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare a fresh build with the shipped files; write nothing")
    ap.add_argument("--arch", action="append", choices=shipped.ARCHS, help="default: all")
    ap.add_argument("--out", default=shipped.PREBUILT_DIR, help="folder to write (default: the shipped one)")
    args = ap.parse_args(argv)
    clang = find_clang()
    if clang is None:
        print("clang++-19 not found (apt-get install clang-19 lld-19)", file=sys.stderr)
        return 2
    differ = 0
    os.makedirs(args.out, exist_ok=True)
    for arch in args.arch or shipped.ARCHS:
        image, manifest = build(arch, clang)
        line = f"{arch}: {manifest.size} bytes, sha256 {manifest.sha256[:16]}, source {manifest.source_digest[:16]}"
        if args.check:
            try:
                with open(shipped.object_path(arch, args.out), "rb") as fh:
                    same = fh.read() == image
                with open(shipped.manifest_path(arch, args.out), encoding="utf-8") as fh:
                    same = same and fh.read() == manifest.to_json()
            except OSError:
                same = False
            differ += not same
            print(f"{line}: {'same as shipped' if same else 'DIFFERS from the shipped object or manifest'}")
            continue
        with open(shipped.object_path(arch, args.out), "wb") as fh:
            fh.write(image)
        with open(shipped.manifest_path(arch, args.out), "w", encoding="utf-8", newline="\n") as fh:
            fh.write(manifest.to_json())
        print(f"{line}: written to {os.path.relpath(shipped.object_path(arch, args.out))}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
