"""The shipped gfx12 code objects (kernels/backends/hip/prebuilt/) are the build of the shipped sources.

Without a compiler: every manifest names the digest of the sources the runtime would hand hiprtc, the bytes hash
to the manifest, the ELF says code object v5 for its arch, and nothing of the build machine is in it. With Debian's
clang-19 (marker hipcc): a rebuild gives the same bytes when its version line is the manifest's, and the occupancy
the static check derives from the metadata is the compiler's own figure. None of this has run on RDNA4 hardware.
"""
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from comfyui_sage_rdna4.kernels.backends.hip import runtime, shipped_objects
from comfyui_sage_rdna4.kernels.verify import hip_static_check
from fakes import amdgpu_elf, write_prebuilt

ROOT = Path(__file__).resolve().parents[1]
EF_AMDGPU_MACH = {"gfx1200": 0x048, "gfx1201": 0x04E}  # LLVM's ELF.h (EF_AMDGPU_MACH_AMDGCN_GFX120x)


def bundle():
    return runtime.source_bundle("hip")


@pytest.mark.parametrize("arch", shipped_objects.ARCHS)
def test_the_shipped_object_is_the_build_of_these_sources(arch):
    found, reason = shipped_objects.check(arch, bundle().digest)
    assert found is not None, f"{reason}. Run `{shipped_objects.REBUILD_COMMAND}` and commit its output."
    m, image = found.manifest, found.image
    assert m.arch == arch and m.flags == tuple(shipped_objects.build_flags(arch))
    assert m.code_object_version == shipped_objects.CODE_OBJECT_VERSION == shipped_objects.code_object_version(image)
    assert int.from_bytes(image[48:52], "little") & 0xFF == EF_AMDGPU_MACH[arch]  # e_flags: the processor
    assert 100_000 < m.size < 1_000_000, m.size  # the whole unit: ~300 KB with clang-19


def test_the_source_digest_is_the_runtime_bundles():
    """The loader looks objects up by kernel_bundle().digest on ROCm; the build script by source_bundle('hip')."""
    from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi
    assert bundle().name == shipped_objects.SOURCE_NAME
    assert bundle().text == kernel_abi.module_source("hip")


def test_edited_sources_fail_with_the_rebuild_command(tmp_path):
    write_prebuilt(tmp_path, "gfx1201", amdgpu_elf("gfx1201", b"object"), "1" * 64)
    found, reason = shipped_objects.check("gfx1201", bundle().digest, str(tmp_path))
    assert found is None and shipped_objects.REBUILD_COMMAND in reason and "other sources" in reason
    assert shipped_objects.check("gfx1201", "1" * 64, str(tmp_path))[0] is not None  # the same files, digest agreeing


@pytest.mark.parametrize("damage", ["flip", "truncate", "no object", "bad manifest"])
def test_damaged_files_are_refused_with_a_reason(tmp_path, damage):
    write_prebuilt(tmp_path, "gfx1201", amdgpu_elf("gfx1201", bytes(range(256))), "2" * 64)
    obj, man = Path(shipped_objects.object_path("gfx1201", str(tmp_path))), \
        Path(shipped_objects.manifest_path("gfx1201", str(tmp_path)))
    if damage == "flip":
        blob = bytearray(obj.read_bytes())
        blob[10] ^= 0x40
        obj.write_bytes(bytes(blob))
    elif damage == "truncate":
        obj.write_bytes(obj.read_bytes()[:-1])
    elif damage == "no object":
        obj.unlink()
    else:
        man.write_text("{not json")
    found, reason = shipped_objects.check("gfx1201", "2" * 64, str(tmp_path))
    want = {"flip": "damaged", "truncate": "damaged", "no object": "cannot be read", "bad manifest": "unreadable"}
    assert found is None and want[damage] in reason, reason


def _manifest_doc(arch="gfx1201", image=None, digest="3" * 64):
    image = image if image is not None else amdgpu_elf(arch, b"body")
    return image, {"arch": arch, "source_digest": digest, "compiler": "fake clang 19",
                   "flags": list(shipped_objects.build_flags(arch)), "sha256": shipped_objects.sha256(image),
                   "size": len(image), "code_object_version": 5}


def _plant(folder, image, doc=None, text=None):
    Path(shipped_objects.object_path("gfx1201", str(folder))).write_bytes(image)
    Path(shipped_objects.manifest_path("gfx1201", str(folder))).write_text(text if text is not None else
                                                                           json.dumps(doc))


def _deep(depth):
    return "[" * depth + "]" * depth


MALFORMED = {  # name: (change to the manifest document, or its whole text; words the reason must hold)
    "sha256-number": ({"sha256": 12345}, "sha256 is 12345, not a str"),
    "sha256-null": ({"sha256": None}, "sha256 is null, not a str"),
    "sha256-not-hex": ({"sha256": "Z" * 64}, "sha256 is " + json.dumps("Z" * 64)[:40]),
    "digest-number": ({"source_digest": 7}, "source_digest is 7, not a str"),
    "digest-null": ({"source_digest": None}, "source_digest is null, not a str"),
    "digest-short": ({"source_digest": "3" * 12}, "not 64 lowercase hex digits"),
    "size-text": ({"size": "313112"}, "size is \"313112\", not a int"),
    "size-bool": ({"size": True}, "size is true, not a int"),
    "size-negative": ({"size": -1}, "size is -1"),
    "flags-text": ({"flags": "-O3"}, "flags is \"-O3\", not a list"),
    "flags-numbers": ({"flags": [1, 2]}, "flags holds something other than strings"),
    "arch-list": ({"arch": ["gfx1201"]}, "arch is list, not a str"),
    "version-float": ({"code_object_version": 5.0}, "code_object_version is 5.0, not a int"),
    "missing-field": ({"sha256": KeyError}, "fields missing: sha256"),
    "extra-field": ({"extra": 1}, "fields unknown: extra"),
    "a-list": ("[1, 2]", "a JSON list, not an object"),
    "null": ("null", "a JSON NoneType, not an object"),
    "not-utf8": (b"\xff\xfe{}", "unreadable"),
    "nested-deep-in-a-field": ("NESTED", "nested too deep"),
    "nested-100000": (_deep(100_000), f"larger than {shipped_objects.MAX_MANIFEST_BYTES} bytes"),
    "nested-20000": (_deep(20_000), "nested too deep"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_manifest_is_one_reason_never_an_exception(tmp_path, name):
    """Wrong types, missing or extra fields, deep nesting, a huge file: check() answers (None, the reason), and
    the reason names the manifest and what is wrong with it."""
    change, words = MALFORMED[name]
    image, doc = _manifest_doc()
    if isinstance(change, dict):
        doc.update(change)
        doc = {k: v for k, v in doc.items() if v is not KeyError}
        _plant(tmp_path, image, doc)
    elif isinstance(change, bytes):
        _plant(tmp_path, image)
        Path(shipped_objects.manifest_path("gfx1201", str(tmp_path))).write_bytes(change)
    elif change == "NESTED":
        text = json.dumps(doc).replace(json.dumps(doc["sha256"]), _deep(5000))
        _plant(tmp_path, image, text=text)
    else:
        _plant(tmp_path, image, text=change)
    found, reason = shipped_objects.check("gfx1201", "3" * 64, str(tmp_path))
    assert found is None and "sage_kernels-gfx1201.json is unreadable" in reason and words in reason, reason
    assert "\n" not in reason and len(reason) < 400, reason


def test_the_well_formed_manifest_of_these_tests_is_accepted(tmp_path):
    """The oracle of the test above: the same document, unchanged, serves."""
    image, doc = _manifest_doc()
    _plant(tmp_path, image, doc)
    found, reason = shipped_objects.check("gfx1201", "3" * 64, str(tmp_path))
    assert reason is None and found.image == image and found.manifest.flags == tuple(doc["flags"])


@pytest.mark.parametrize("case, words", [
    ("manifest-for-gfx1200", "sage_kernels-gfx1201.json is for \"gfx1200\", not this device's gfx1201"),
    ("elf-for-gfx1200", "not code for gfx1201: its ELF is for gfx1200"),
    ("elf-for-gfx1100", "not code for gfx1201: its ELF is for EF_AMDGPU_MACH 0x041"),
    ("elf-of-another-machine", "not code for gfx1201: not an AMDGPU ELF"),
    ("not-an-elf", "not code for gfx1201: not an AMDGPU ELF"),
    ("code-object-v4", "declares code object version 4; its manifest says 5"),
])
def test_an_object_for_another_arch_is_refused(tmp_path, case, words):
    """The manifest's arch and the ELF's processor must both be the device's: bytes that hash right for their
    manifest but were built for another GPU never reach the driver."""
    image = {"elf-for-gfx1200": amdgpu_elf("gfx1200", b"body"), "elf-for-gfx1100": amdgpu_elf("gfx1100", b"body"),
             "elf-of-another-machine": amdgpu_elf("gfx1201", b"body", machine=62),  # EM_X86_64
             "not-an-elf": b"shipped code object for gfx1201 " * 4,
             "code-object-v4": amdgpu_elf("gfx1201", b"body", code_object_version=4)}.get(case)
    image, doc = _manifest_doc(image=image)
    if case == "manifest-for-gfx1200":
        doc["arch"] = "gfx1200"
    _plant(tmp_path, image, doc)
    found, reason = shipped_objects.check("gfx1201", "3" * 64, str(tmp_path))
    assert found is None and words in reason, reason


@pytest.mark.parametrize("arch", shipped_objects.ARCHS)
def test_the_shipped_objects_name_their_processor(arch):
    image = Path(shipped_objects.object_path(arch)).read_bytes()
    assert shipped_objects.elf_processor(image) == arch
    assert image[:20] == amdgpu_elf(arch)[:20] and image[48:52] == amdgpu_elf(arch)[48:52]  # the fake is faithful
    assert shipped_objects.elf_processor(image[:63]) is None and shipped_objects.elf_processor(b"") is None


def test_a_checker_error_is_a_reason_kept_for_the_arch(monkeypatch, tmp_path):
    calls = []

    def broken(arch, digest, folder):
        calls.append(arch)
        raise TypeError("unexpected")
    monkeypatch.setattr(shipped_objects, "check", broken)
    objects = shipped_objects.ShippedObjects(str(tmp_path))
    first = objects.find("gfx1201", "3" * 64)
    assert first == (None, "the prebuilt gfx1201 object could not be checked: TypeError: unexpected")
    assert objects.find("gfx1201", "3" * 64) == first and calls == ["gfx1201"]  # asked once


@pytest.mark.parametrize("arch", shipped_objects.ARCHS)
def test_no_path_or_time_of_the_build_machine_in_the_object(arch):
    image = Path(shipped_objects.object_path(arch)).read_bytes()
    texts = [t.decode() for t in re.findall(rb"[\x20-\x7e]{6,}", image)]
    assert not [t for t in texts if re.search(r"/tmp|/work|/home|/root|\\Users|\.hip\b|\d\d:\d\d:\d\d", t)]
    assert "__hip_cuid_" + "6d87581ee7fb5770" in image.decode("latin-1")  # -cuid=sage_rdna4, not a path hash


def test_the_static_check_reads_the_shipped_bytes(monkeypatch):
    seen = []
    monkeypatch.setattr(hip_static_check, "analyze_object", lambda obj, arch: seen.append((obj, arch)) or {})
    hip_static_check.analyze("gfx1201")
    assert seen == [(shipped_objects.object_path("gfx1201"), "gfx1201")]
    assert hip_static_check.shipped_objects.BUILD_FLAGS == shipped_objects.BUILD_FLAGS  # one statement of the flags


# -- rebuilding with the pinned compiler --------------------------------------------------------------

def build_tool(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))  # what `python tools/build_hip_objects.py` has on sys.path
    spec = importlib.util.spec_from_file_location("sage_rdna4_build_hip_objects",
                                                  ROOT / "tools" / "build_hip_objects.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def pinned_clang(tool, arch):
    clang = tool.find_clang()
    if clang is None or not shutil.which("ld.lld-19") and not Path("/usr/lib/llvm-19/bin/ld.lld").exists():
        pytest.skip("clang++-19 / ld.lld-19 not found (apt-get install clang-19 lld-19)")
    shipped, _ = shipped_objects.read_manifest(arch)
    version = tool.compiler_version(clang)
    if shipped is None or version != shipped.compiler:
        pytest.skip(f"installed compiler {version!r} is not the one the objects were built with "
                    f"({shipped.compiler if shipped else 'no manifest'!r}): bytes may differ")
    return clang


def assert_rebuild_identical(tool, arch):
    clang = pinned_clang(tool, arch)
    image, manifest = tool.build(arch, clang)
    shipped = Path(shipped_objects.object_path(arch)).read_bytes()
    assert image == shipped, (f"a rebuild of {arch} gives other bytes (sha256 {manifest.sha256[:12]}, shipped "
                              f"{shipped_objects.sha256(shipped)[:12]}): run `{shipped_objects.REBUILD_COMMAND}`")
    assert manifest.to_json() == Path(shipped_objects.manifest_path(arch)).read_text()


@pytest.mark.hipcc
def test_a_rebuild_of_gfx1201_is_byte_identical(monkeypatch):
    """~6 s of CPU; gfx1200 and the occupancy model: the slow test below."""
    assert_rebuild_identical(build_tool(monkeypatch), "gfx1201")


@pytest.mark.hipcc
@pytest.mark.slow
def test_a_rebuild_of_gfx1200_is_byte_identical_and_occupancy_is_the_compilers(monkeypatch, tmp_path):
    tool = build_tool(monkeypatch)
    assert_rebuild_identical(tool, "gfx1200")
    for arch in shipped_objects.ARCHS:
        pinned_clang(tool, arch)
        work = tmp_path / arch
        work.mkdir()
        obj, remarks = hip_static_check.compile_code_object(bundle().text, arch, str(work))
        assert Path(obj).read_bytes() == Path(shipped_objects.object_path(arch)).read_bytes()  # remarks change nothing
        compiler_says = hip_static_check.parse_occupancy(remarks)
        from_metadata = {n: ks.occupancy for n, ks in hip_static_check.analyze(arch).items()}
        assert compiler_says and from_metadata == compiler_says


def test_the_occupancy_model_on_known_figures():
    """LLVM 19's remarks for these (VGPRs, LDS, workgroup) triples, from kernels of this pack."""
    def ks(vgprs, lds, group=256):
        return hip_static_check.KernelStats("k", "gfx1201", vgprs=vgprs, lds_bytes=lds, workgroup_size=group,
                                            wavefront_size=32)
    cases = [((167, 19712), 9), ((190, 27904), 8), ((118, 10496), 12), ((144, 14592), 10), ((106, 32), 12),
             ((46, 19712), 12), ((34, 10496), 16), ((12, 2048), 16)]
    for (vgprs, lds), waves in cases:
        assert hip_static_check.occupancy_from_metadata(ks(vgprs, lds)) == waves, (vgprs, lds)
    assert hip_static_check.occupancy_from_metadata(ks(40, 70000)) == 0  # more LDS than a CU has
    assert sys.modules[hip_static_check.shipped_objects.__name__] is hip_static_check.shipped_objects


def test_the_cache_identity_covers_the_shipped_objects(monkeypatch, tmp_path):
    """Self-check passes and auto's choices are keyed by code_digest: a rebuilt object must change it."""
    from comfyui_sage_rdna4.kernels import cache_identity
    (tmp_path / "kernels" / "backends" / "hip" / "prebuilt").mkdir(parents=True)
    (tmp_path / "kernels" / "cache_identity.py").write_text("# stand-in\n")
    obj = tmp_path / "kernels" / "backends" / "hip" / "prebuilt" / "sage_kernels-gfx1201.co"
    obj.write_bytes(b"build one")
    monkeypatch.setattr(cache_identity, "__file__", str(tmp_path / "kernels" / "cache_identity.py"))
    digests = []
    for content in (b"build one", b"build two"):
        obj.write_bytes(content)
        cache_identity.code_digest.cache_clear()
        digests.append(cache_identity.code_digest())
    cache_identity.code_digest.cache_clear()
    assert digests[0] != digests[1]


def _measurements_block() -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "MEASUREMENTS.md").read_text(encoding="utf-8")
    begin, end = hip_static_check.SUMMARY_BEGIN, hip_static_check.SUMMARY_END
    assert text.count(begin) == 1 and text.count(end) == 1
    return text[text.index(begin):text.index(end) + len(end)]


def test_the_measurements_rows_of_the_shipped_objects_are_their_manifests():
    """Without a toolchain: each object's row in docs/MEASUREMENTS.md names its size, hash and source digest."""
    block = _measurements_block()
    for arch in shipped_objects.ARCHS:
        data = Path(shipped_objects.object_path(arch)).read_bytes()
        manifest, problem = shipped_objects.read_manifest(arch)
        assert problem is None
        name = Path(shipped_objects.object_path(arch)).name
        row = f"| `{name}` | {len(data)} | {shipped_objects.sha256(data)[:16]} | {manifest.source_digest[:16]} |"
        assert row in block, arch


@pytest.mark.hipcc
def test_the_measurements_block_is_what_the_static_check_prints_today():
    """The kernel counts and the attention kernels' figures in docs/MEASUREMENTS.md are the shipped bytes' own."""
    missing = hip_static_check.readers_missing()
    if missing:
        pytest.skip(missing)
    assert _measurements_block() == hip_static_check.summary_markdown(), \
        "docs/MEASUREMENTS.md is stale: paste `python kernels/verify/hip_static_check.py --summary` into it"


def test_the_fresh_build_compiles_what_the_runtime_compiles():
    from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi
    assert hip_static_check.source_files() == kernel_abi.SOURCE_FILES
    assert hip_static_check.fresh_sources() == kernel_abi.module_source("hip")
