"""CPU tests of the HIP loader: cache keys and rebuilds, arch parsing, library discovery and error
paths, backend acceptance, and the first-use self-check disabling a deliberately broken kernel."""
import json
import os
import threading
import types

import pytest
import torch

from comfyui_sage_rdna4.kernels import disk_cache, quant, registry, settings
from comfyui_sage_rdna4.kernels.backends.hip import backend as hip_backend
from comfyui_sage_rdna4.kernels.backends.hip import compiler, runtime, shipped_objects
from comfyui_sage_rdna4.kernels.backends.hip import prologue as hip_prologue
from comfyui_sage_rdna4.kernels.call_spec import describe_call
from comfyui_sage_rdna4.kernels.gating import Verdicts
from comfyui_sage_rdna4.kernels.reference import attention_from_quantized
from comfyui_sage_rdna4.kernels.routing import route
from comfyui_sage_rdna4.kernels.self_check import CALLS_PER_CASE, DEFAULT_CASES, Case
from comfyui_sage_rdna4.kernels.verify import cuda_twin  # the loader on NVIDIA, for the tests that use it
from fakes import CompilerFactory, FakeCompiler, FakeRuntime, amdgpu_elf, write_prebuilt


@pytest.fixture(autouse=True)
def fresh_environment_verdicts(monkeypatch):
    """Tests fake devices and versions; keep the per-device environment answers from leaking between them."""
    monkeypatch.setattr(runtime, "_ENV_VERDICTS", {})


# -- arch detection ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, arch", [
    ("gfx1201:sramecc+:xnack-", "gfx1201"),
    ("gfx1200", "gfx1200"),
    (" gfx1201:xnack- ", "gfx1201"),
    ("gfx90a:sramecc+:xnack-", "gfx90a"),
    ("", "gfx_unknown"),
])
def test_parse_gcn_arch(name, arch):
    assert runtime.parse_gcn_arch(name) == arch


def test_nvrtc_target_falls_back_to_ptx_for_unknown_arch():
    assert cuda_twin.nvrtc_target(90, [75, 80, 90]) == "sm_90"
    assert cuda_twin.nvrtc_target(120, [75, 80, 90]) == "compute_90"  # newer GPU than nvrtc knows: PTX
    assert cuda_twin.nvrtc_target(90, []) == "sm_90"


# -- the code-object cache (kernels/disk_cache.py's own tests: tests/test_disk_cache.py) --------------

def code_objects(folder):
    return disk_cache.EntryStore(disk_cache.HIP_CODE_OBJECTS, str(folder))


def _corrupt(path):
    blob = open(path, "rb").read()
    open(path, "wb").write(blob[:-1] + bytes([blob[-1] ^ 0xFF]))


SRC = compiler.SourceBundle("k.hip", 'extern "C" __global__ void k() {}', (("p.h", "// prelude"),))


def test_build_cached_compiles_once_then_hits(tmp_path):
    c, comp = code_objects(tmp_path), FakeCompiler()
    first = comp.build_cached(c, SRC, "gfx1201", [], "hip-1")
    second = comp.build_cached(code_objects(tmp_path), SRC, "gfx1201", [], "hip-1")
    assert comp.compiles == 1 and not first.from_cache and second.from_cache
    assert first.image == second.image


def test_build_cached_rebuilds_corrupt_entry(tmp_path):
    comp = FakeCompiler()
    built = comp.build_cached(code_objects(tmp_path), SRC, "gfx1201", [], "hip-1")
    _corrupt(built.path)
    again = comp.build_cached(code_objects(tmp_path), SRC, "gfx1201", [], "hip-1")
    assert comp.compiles == 2 and not again.from_cache and again.image == built.image
    assert code_objects(tmp_path).load(again.key, "k-gfx1201")[0] == built.image


@pytest.mark.parametrize("change", ["runtime", "compiler", "source", "flags"])
def test_build_cached_misses_after_version_or_source_change(tmp_path, change):
    c, comp = code_objects(tmp_path), FakeCompiler()
    comp.build_cached(c, SRC, "gfx1201", [], "hip-1")
    src, runtime_v, flags = SRC, "hip-1", []
    if change == "runtime":
        runtime_v = "hip-2"
    elif change == "compiler":
        comp._version = "fake-2.0"
    elif change == "source":
        src = compiler.SourceBundle("k.hip", SRC.text, (("p.h", "// prelude, edited"),))
    else:
        flags = ["-DX=1"]
    built = comp.build_cached(c, src, "gfx1201", flags, runtime_v)
    assert not built.from_cache and comp.compiles == 2


def test_source_bundle_from_dir_hashes_headers(tmp_path):
    (tmp_path / "main.hip").write_text('#include "pre.h"\n')
    (tmp_path / "pre.h").write_text("// v1\n")
    (tmp_path / "notes.txt").write_text("ignored")
    a = compiler.SourceBundle.from_dir(str(tmp_path), "main.hip")
    assert a.name == "main.hip" and dict(a.headers) == {"pre.h": "// v1\n"}
    (tmp_path / "pre.h").write_text("// v2\n")
    assert compiler.SourceBundle.from_dir(str(tmp_path), "main.hip").digest != a.digest
    with pytest.raises(FileNotFoundError):
        compiler.SourceBundle.from_dir(str(tmp_path), "missing.hip")


def test_loader_rebuilds_entry_the_driver_rejects(tmp_path):
    cache_, comp, rt = code_objects(tmp_path), FakeCompiler(), FakeRuntime()
    target = comp.target_for_device(0)
    key = disk_cache.cache_key(source=SRC.digest, target=target, compiler=comp.version(), runtime=rt.version(),
                           flags=comp.options(target, []))
    cache_.store(key, "k-gfx1201", b"stale image from an older driver")
    loader = runtime.KernelLoader(rt, comp, code_objects(tmp_path))
    kern = loader.kernel(0, SRC, "k", ["ptr"])
    assert comp.compiles == 1 and rt.loaded and not rt.loaded[0].startswith(b"stale")
    assert loader.kernel(0, SRC, "k", ["ptr"]) is kern  # loaded once per device
    assert code_objects(tmp_path).load(key, "k-gfx1201")[0] == rt.loaded[0]


def test_loader_raises_when_a_fresh_build_is_rejected(tmp_path):
    class Stale(FakeCompiler):
        def compile(self, source, target, extra_flags=()):
            self.compiles += 1
            return b"stale always"

    loader = runtime.KernelLoader(FakeRuntime(), Stale(), code_objects(tmp_path))
    with pytest.raises(runtime.LaunchError):
        loader.kernel(0, SRC, "k", [])


# -- shipped code objects (the files themselves: tests/test_prebuilt_objects.py) ----------------------

SHIPPED_IMAGE = amdgpu_elf("gfx1201", b"shipped code object for gfx1201 " * 64)


def prebuilt_loader(tmp_path, factory, rt=None, arch="gfx1201"):
    folder = tmp_path / "prebuilt"
    folder.mkdir(exist_ok=True)
    loader = runtime.KernelLoader(rt or FakeRuntime(), None, code_objects(tmp_path / "cache"),
                                  compiler_factory=factory, prebuilt=shipped_objects.ShippedObjects(str(folder)),
                                  arch_of=lambda index: arch)
    return loader, folder


def test_a_matching_shipped_object_is_loaded_without_a_compiler(tmp_path):
    factory = CompilerFactory()
    loader, folder = prebuilt_loader(tmp_path, factory)
    made = write_prebuilt(folder, "gfx1201", SHIPPED_IMAGE, SRC.digest)
    kern = loader.kernel(0, SRC, "k", ["ptr"])
    assert factory.made == 0 and loader._compiler is None  # no compiler made, so none called
    assert loader.runtime.loaded == [SHIPPED_IMAGE] and kern.module == ("module", SHIPPED_IMAGE)
    assert loader.served == {0: f"prebuilt gfx1201 {made.sha256[:8]}"} and not loader.prebuilt_refusals
    assert not list((tmp_path / "cache").glob("**/*.bin"))  # nothing went to the disk cache
    assert loader.kernel(0, SRC, "k2", []).module is kern.module  # one module per device and source


def _edited(folder):
    write_prebuilt(folder, "gfx1201", SHIPPED_IMAGE, "0" * 64)  # built from other sources


def _damaged(folder):
    write_prebuilt(folder, "gfx1201", SHIPPED_IMAGE, SRC.digest)
    path = shipped_objects.object_path("gfx1201", str(folder))
    blob = bytearray(open(path, "rb").read())
    blob[100] ^= 0x01
    open(path, "wb").write(bytes(blob))


def _other_arch_only(folder):
    write_prebuilt(folder, "gfx1200", SHIPPED_IMAGE, SRC.digest)


def _refused(folder):
    image = amdgpu_elf("gfx1201", b"stale" + SHIPPED_IMAGE)  # FakeRuntime refuses an ELF whose body is b"stale..."
    write_prebuilt(folder, "gfx1201", image, SRC.digest)


@pytest.mark.parametrize("plant, words", [
    (_edited, ["built from other sources", shipped_objects.REBUILD_COMMAND]),
    (_damaged, ["damaged", "sha256"]),
    (_other_arch_only, ["no prebuilt code object for gfx1201", "shipped: gfx1200"]),
    (_refused, ["the runtime refused the prebuilt gfx1201", "hipModuleLoadData failed: invalid image"]),
], ids=["edited-source", "damaged-bytes", "missing-arch", "runtime-refusal"])
def test_the_compiler_serves_when_the_shipped_object_cannot(tmp_path, caplog, plant, words):
    factory = CompilerFactory()
    loader, folder = prebuilt_loader(tmp_path, factory)
    plant(folder)
    with caplog.at_level("INFO", logger=runtime.__name__):
        loader.kernel(0, SRC, "k", ["ptr"])
    assert factory.made == 1 and factory.compiler.compiles == 1
    assert loader.runtime.loaded[-1] == f"{SRC.digest}:gfx1201:fake-1.0".encode()  # the compiler's build
    assert loader.served == {0: "fake 1.0"}
    reason = loader.prebuilt_refusals[0]
    assert all(w in reason for w in words), reason
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert reason in logged and "fake 1.0" in logged  # the reason and the path that served, in the log
    if plant is _refused:  # the runtime's own error, logged as a warning
        assert any(r.levelname == "WARNING" and "invalid image" in r.getMessage() for r in caplog.records)


def test_extra_flags_always_compile(tmp_path):
    factory = CompilerFactory()
    loader, folder = prebuilt_loader(tmp_path, factory)
    write_prebuilt(folder, "gfx1201", SHIPPED_IMAGE, SRC.digest)
    loader.kernel(0, SRC, "k", [], extra_flags=["-DX=1"])
    assert factory.made == 1 and SHIPPED_IMAGE not in loader.runtime.loaded


def test_a_refused_object_without_a_compiler_names_both(tmp_path):
    loader, folder = prebuilt_loader(tmp_path, CompilerFactory(missing="hiprtc (the HIP runtime compiler) not found"))
    _refused(folder)
    with pytest.raises(compiler.CompilerUnavailable) as err:
        loader.kernel(0, SRC, "k", [])
    assert "runtime refused the prebuilt gfx1201" in str(err.value) and "hiprtc" in str(err.value)


@pytest.fixture
def rocm_gfx1201(monkeypatch, tmp_path):
    """environment_refusal's view of a ROCm gfx1201 machine: FakeRuntime for the HIP runtime, the shipped objects
    from tmp_path/prebuilt, SRC as the kernels' sources, no compiler made yet. Returns (folder, set_compiler)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(gcnArchName="gfx1201:sramecc-:xnack-"))
    monkeypatch.setattr(runtime, "_RUNTIMES", {"hip": FakeRuntime()})
    monkeypatch.setattr(runtime, "_LOADERS", {})
    monkeypatch.setattr(runtime, "_BUNDLES", {"hip": SRC})
    monkeypatch.setattr(compiler, "_COMPILERS", {})
    monkeypatch.setattr(compiler, "_COMPILER_ERRORS", {})
    monkeypatch.setenv("SAGE_RDNA4_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    monkeypatch.setattr(shipped_objects, "PREBUILT_DIR", str(folder))

    def set_compiler(factory):
        monkeypatch.setattr(compiler, "_FACTORIES", {"hiprtc": factory})

    return folder, set_compiler


def test_no_hiprtc_and_a_matching_object_is_available(rocm_gfx1201):
    folder, set_compiler = rocm_gfx1201
    factory = CompilerFactory(missing="hiprtc (the HIP runtime compiler) not found; tried: libhiprtc.so")
    set_compiler(factory)
    made = write_prebuilt(folder, "gfx1201", SHIPPED_IMAGE, SRC.digest)
    assert runtime.environment_refusal("cuda", 0) is None
    assert runtime.code_paths() == {0: f"prebuilt gfx1201 {made.sha256[:8]}"}
    assert runtime.code_path_line() == f"prebuilt gfx1201 {made.sha256[:8]}"
    assert "hiprtc" not in compiler._COMPILER_ERRORS  # the compiler was never even looked for


@pytest.mark.parametrize("plant, words", [
    (_refused, "the runtime refused the prebuilt gfx1201"),
    (_edited, "built from other sources"),
    (lambda folder: None, "no prebuilt code object for gfx1201"),
])
def test_no_hiprtc_and_an_unusable_object_is_a_refusal_naming_both(rocm_gfx1201, plant, words):
    folder, set_compiler = rocm_gfx1201
    set_compiler(CompilerFactory(missing="hiprtc (the HIP runtime compiler) not found; tried: libhiprtc.so"))
    plant(folder)
    reason = runtime.environment_refusal("cuda", 0)
    assert reason and words in reason and "hiprtc (the HIP runtime compiler) not found" in reason, reason


def test_hiprtc_present_and_a_refused_object_is_available(rocm_gfx1201):
    folder, set_compiler = rocm_gfx1201
    set_compiler(CompilerFactory())
    _refused(folder)
    assert runtime.environment_refusal("cuda", 0) is None  # hiprtc compiles at first use
    assert "runtime refused" in runtime.get_loader().prebuilt_refusals[0]


def _manifest_field(name, value):
    def plant(folder):
        made = write_prebuilt(folder, "gfx1201", SHIPPED_IMAGE, SRC.digest)
        doc = json.loads(made.to_json())
        doc[name] = value
        with open(shipped_objects.manifest_path("gfx1201", str(folder)), "w") as fh:
            fh.write(json.dumps(doc))
    return plant


def _nested(folder):
    write_prebuilt(folder, "gfx1201", SHIPPED_IMAGE, SRC.digest)
    with open(shipped_objects.manifest_path("gfx1201", str(folder)), "w") as fh:
        fh.write("[" * 100_000 + "]" * 100_000)


def _elf_for_gfx1200(folder):
    write_prebuilt(folder, "gfx1201", amdgpu_elf("gfx1200", b"built for the other arch"), SRC.digest)


MALFORMED = [  # the cases: each made kernel() raise TypeError/RecursionError, or loaded the wrong arch
    (_manifest_field("sha256", 12345), "sha256 is 12345"),
    (_manifest_field("sha256", None), "sha256 is null"),
    (_manifest_field("source_digest", 12345), "source_digest is 12345"),
    (_manifest_field("source_digest", None), "source_digest is null"),
    (_nested, "unreadable"),
    (_manifest_field("arch", "gfx1200"), "is for \"gfx1200\", not this device's gfx1201"),
    (_elf_for_gfx1200, "its ELF is for gfx1200"),
]
MALFORMED_IDS = ["sha256-number", "sha256-null", "digest-number", "digest-null", "nested-100000", "manifest-arch",
                 "elf-arch"]


@pytest.mark.parametrize("plant, words", MALFORMED, ids=MALFORMED_IDS)
def test_a_malformed_shipped_object_is_a_reason_and_hiprtc_serves(tmp_path, plant, words):
    factory = CompilerFactory()
    loader, folder = prebuilt_loader(tmp_path, factory)
    plant(folder)
    kern = loader.kernel(0, SRC, "k", ["ptr"])  # no exception: the compiler built it
    assert factory.made == 1 and kern.module == ("module", f"{SRC.digest}:gfx1201:fake-1.0".encode())
    assert loader.served == {0: "fake 1.0"} and words in loader.prebuilt_refusals[0], loader.prebuilt_refusals
    assert all(not image.startswith(b"\x7fELF") for image in loader.runtime.loaded)  # the shipped bytes never loaded


@pytest.mark.parametrize("plant, words", MALFORMED, ids=MALFORMED_IDS)
def test_a_malformed_shipped_object_in_the_environment_check(rocm_gfx1201, plant, words):
    """Without hiprtc: a refusal naming both reasons. With it: available, and kernel() compiles."""
    folder, set_compiler = rocm_gfx1201
    plant(folder)
    set_compiler(CompilerFactory(missing="hiprtc (the HIP runtime compiler) not found; tried: libhiprtc.so"))
    reason = runtime.environment_refusal("cuda", 0)
    assert reason and words in reason and "hiprtc (the HIP runtime compiler) not found" in reason, reason
    for answers in (runtime._ENV_VERDICTS, runtime._LOADERS, compiler._COMPILER_ERRORS):  # a new process
        answers.clear()
    factory = CompilerFactory()
    set_compiler(factory)
    assert runtime.environment_refusal("cuda", 0) is None
    runtime.get_loader().kernel(0, SRC, "k", ["ptr"])
    assert factory.made == 1 and runtime.code_paths() == {0: "fake 1.0"}
    assert runtime.code_path_line() == "fake 1.0"


def test_an_unreadable_device_arch_is_a_reason_not_an_exception(tmp_path):
    factory = CompilerFactory()
    folder = tmp_path / "prebuilt"
    folder.mkdir()

    def no_arch(index):
        raise RuntimeError("device properties unreadable")
    loader = runtime.KernelLoader(FakeRuntime(), None, code_objects(tmp_path / "cache"), compiler_factory=factory,
                                  prebuilt=shipped_objects.ShippedObjects(str(folder)), arch_of=no_arch)
    loader.kernel(0, SRC, "k", [])
    assert factory.made == 1 and "RuntimeError: device properties unreadable" in loader.prebuilt_refusals[0]


def test_the_emulation_never_looks_for_shipped_objects(monkeypatch, tmp_path):
    """On NVIDIA (the 'cuda' platform) the loader compiles; the shipped gfx12 objects are not its code."""
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv(settings.HIP_EMULATE.name, "1")
    monkeypatch.setenv("SAGE_RDNA4_CACHE", str(tmp_path))
    monkeypatch.setattr(runtime, "_RUNTIMES", {"cuda": FakeRuntime()})
    monkeypatch.setattr(runtime, "_LOADERS", {})
    factory = CompilerFactory()
    monkeypatch.setattr(compiler, "_FACTORIES", {**compiler._FACTORIES, "nvrtc": factory})
    monkeypatch.setattr(compiler, "_COMPILERS", {})
    monkeypatch.setattr(compiler, "_COMPILER_ERRORS", {})
    loader = runtime.get_loader()
    assert loader.prebuilt is None and factory.made == 0
    loader.kernel(0, SRC, "k", [])
    assert factory.made == 1 and runtime.code_paths() == {0: "fake 1.0"} and not loader.prebuilt_refusals


def test_the_path_that_served_shows_in_the_stats_and_the_benchmark(monkeypatch):
    from comfyui_sage_rdna4.kernels import benchmark
    from comfyui_sage_rdna4.sage_patch.stats import PatchStats
    monkeypatch.setattr(runtime, "code_path_line", lambda: "prebuilt gfx1201 1a2b3c4d")
    stats = PatchStats()
    stats.record_call("hip_int8_fp8")
    stats.record_call("sdpa")
    summary = stats.summary()
    assert "ran hip_int8_fp8: 1 (prebuilt gfx1201 1a2b3c4d)" in summary
    assert "ran sdpa: 1\n" in summary + "\n" and "sdpa: 1 (" not in summary
    assert benchmark.environment()["hip_code"] == "prebuilt gfx1201 1a2b3c4d"
    assert "prebuilt" in hip_backend.make_backend("fp8").description


# -- launch arguments -------------------------------------------------------------------------------

def test_pack_args_kinds_and_limits():
    t = torch.zeros(4)
    held, arr = runtime.pack_args(["ptr", "i32", "i64", "f32", "u32", "ptr"], [t, -5, 1 << 40, 0.5, 7, None])
    assert held[0].value == t.data_ptr() and held[1].value == -5 and held[2].value == 1 << 40
    assert abs(held[3].value - 0.5) < 1e-9 and held[4].value == 7 and held[5].value is None
    import ctypes
    assert arr[2] == ctypes.addressof(held[2])  # the void** slots point at the values
    with pytest.raises(ValueError, match="does not fit i32"):
        runtime.pack_args(["i32"], [1 << 31])
    with pytest.raises(ValueError, match="takes 2 arguments"):
        runtime.pack_args(["i32", "i32"], [1])
    with pytest.raises(ValueError, match="unknown argument kind"):
        runtime.pack_args(["f64"], [1.0])


# -- libraries: discovery and missing ones -----------------------------------------------------------

def test_missing_hip_runtime_gives_a_reason(tmp_path):
    with pytest.raises(runtime.RuntimeUnavailable, match="HIP runtime.*not found.*libamdhip64"):
        runtime.HipRuntime([str(tmp_path / "libamdhip64.so.7")])
    with pytest.raises(runtime.RuntimeUnavailable, match="CUDA driver.*not found"):
        cuda_twin.CudaRuntime([str(tmp_path / "libcuda.so.1")])


def test_missing_compilers_give_a_reason(tmp_path):
    with pytest.raises(compiler.CompilerUnavailable, match="hiprtc.*not found.*libhiprtc"):
        compiler.HiprtcCompiler([str(tmp_path / "libhiprtc.so.7")])
    with pytest.raises(compiler.CompilerUnavailable, match="nvrtc.*not found"):
        cuda_twin.NvrtcCompiler([str(tmp_path / "libnvrtc.so.13")])


def test_library_without_entry_point_gives_a_reason():
    import ctypes.util
    libc = ctypes.util.find_library("c")
    if not libc:
        pytest.skip("no libc to stand in for a wrong library")
    with pytest.raises(runtime.RuntimeUnavailable, match="has no hip"):
        runtime.HipRuntime([libc])


def test_runtime_reason_is_cached_and_stable(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "_RUNTIMES", {})
    monkeypatch.setattr(runtime, "_RUNTIME_ERRORS", {})
    monkeypatch.setattr(runtime, "hip_library_candidates", lambda: [str(tmp_path / "libamdhip64.so")])
    first = runtime.runtime_unavailable_reason("hip")
    assert first and "libamdhip64.so" in first
    assert runtime.runtime_unavailable_reason("hip") == first


def test_nvrtc_candidates_prefer_torch_cuda_major(monkeypatch, tmp_path):
    for sub, name in (("cu13", "libnvrtc.so.13"), ("cuda_nvrtc", "libnvrtc.so.12"),
                      ("cu13", "libnvrtc-builtins.so.13.0")):
        d = tmp_path / "nvidia" / sub / "lib"
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(b"")
    monkeypatch.setattr(cuda_twin.sys, "path", [str(tmp_path)])
    monkeypatch.setattr(cuda_twin, "loaded_library_paths", lambda fragment: [])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    found = cuda_twin.nvrtc_candidates()
    files = [p for p in found if os.path.sep in p]
    if cuda_twin.sys.platform == "win32":
        pytest.skip("Linux file names")
    assert files[0].endswith("cu13/lib/libnvrtc.so.13")
    assert any(p.endswith("cuda_nvrtc/lib/libnvrtc.so.12") for p in files)
    assert not any("builtins" in p for p in found)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert [p for p in cuda_twin.nvrtc_candidates() if os.path.sep in p][0].endswith("libnvrtc.so.12")


def test_hip_candidates_start_with_the_loaded_library(monkeypatch):
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    monkeypatch.setattr(runtime, "loaded_library_paths", lambda frag: ["/opt/x/lib/libamdhip64.so.7"])
    assert runtime.hip_library_candidates()[0] == "/opt/x/lib/libamdhip64.so.7"
    monkeypatch.setattr(runtime.sys, "platform", "win32")
    monkeypatch.setattr(runtime, "windows_loaded_module", lambda names: [r"C:\torch\lib\amdhip64_7.dll"])
    names = runtime.hip_library_candidates()
    assert names[0] == r"C:\torch\lib\amdhip64_7.dll"
    assert "amdhip64_7.dll" in names and "amdhip64_6.dll" in names


def test_nvrtc_compiles_a_tiny_kernel_when_present():
    """Exercises the real nvrtc binding on a machine without a GPU, when the nvrtc wheel is installed."""
    reason = compiler.compiler_unavailable_reason("nvrtc")
    if reason:
        pytest.skip(reason)
    comp = compiler.get_compiler("nvrtc")
    src = compiler.SourceBundle("t.cu", '#include "h.h"\nextern "C" __global__ void k(float* x) { x[0] = two(); }',
                                (("h.h", "__device__ inline float two() { return 2.0f; }"),))
    cubin = comp.compile(src, "sm_90")
    assert cubin[:4] == b"\x7fELF"
    assert b".entry k" in comp.compile(src, "compute_90")  # PTX names the entry point
    with pytest.raises(compiler.CompileError, match="error"):
        comp.compile(compiler.SourceBundle("bad.cu", "not C++ at all"), "sm_90")


# -- acceptance -------------------------------------------------------------------------------------

def _call(dtype=torch.float16, d=128, dv=None, hq=2, hkv=2, nq=40, nk=40, mask=None, prologue="auto",
          causal=False, lse=False, device="cpu"):
    q = torch.empty(1, hq, nq, d, dtype=dtype, device=device)
    k = torch.empty(1, hkv, nk, d, dtype=dtype, device=device)
    v = torch.empty(1, hkv, nk, dv or d, dtype=dtype, device=device)
    return describe_call(q, k, v, attn_mask=mask, prologue=prologue, is_causal=causal, return_lse=lse)


def test_environment_refuses_cpu_and_other_gpus(monkeypatch):
    assert "ROCm gfx1200/gfx1201" in runtime.environment_refusal("cpu", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(gcnArchName="gfx1100:xnack-"))
    assert "this GPU is gfx1100" in runtime.environment_refusal("cuda", 0)


def test_environment_on_nvidia_needs_explicit_emulation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.delenv(settings.HIP_EMULATE.name, raising=False)
    assert settings.HIP_EMULATE.name in runtime.environment_refusal("cuda", 0)
    monkeypatch.setenv(settings.HIP_EMULATE.name, "1")
    monkeypatch.setattr(runtime, "runtime_unavailable_reason", lambda kind: "no libcuda here")
    assert runtime.environment_refusal("cuda", 0) == "no libcuda here"  # past the emulation gate


TWIN = "comfyui_sage_rdna4.kernels.verify.cuda_twin"


@pytest.fixture
def without_the_twin(monkeypatch):
    """This process as a user's run has it: the CUDA twin neither imported nor registered (restored after)."""
    from comfyui_sage_rdna4.kernels import verify
    monkeypatch.setattr(runtime, "_PLATFORMS", {"hip": runtime._PLATFORMS["hip"]})
    monkeypatch.setattr(runtime, "_RUNTIMES", {})
    monkeypatch.setattr(runtime, "_RUNTIME_ERRORS", {})
    monkeypatch.setattr(compiler, "_FACTORIES", {"hiprtc": compiler.HiprtcCompiler})
    monkeypatch.setattr(compiler, "_COMPILERS", {})
    monkeypatch.setattr(compiler, "_COMPILER_ERRORS", {})
    monkeypatch.setattr(verify, "cuda_twin", cuda_twin)  # the import below rebinds it: put it back after
    monkeypatch.delitem(__import__("sys").modules, TWIN)


def test_the_emulation_is_imported_only_when_asked_for(without_the_twin, monkeypatch):
    import sys
    monkeypatch.delenv(settings.HIP_EMULATE.name, raising=False)
    with pytest.raises(runtime.RuntimeUnavailable, match=f"verification, when {settings.HIP_EMULATE.name}=1"):
        runtime.get_platform("cuda")
    assert runtime.runtime_unavailable_reason("cuda") == runtime.emulation_refusal()
    with pytest.raises(compiler.CompilerUnavailable, match="no runtime compiler named 'nvrtc'"):
        compiler.get_compiler("nvrtc")
    assert TWIN not in sys.modules
    monkeypatch.setenv(settings.HIP_EMULATE.name, "1")  # not cached: asking again after the switch works
    platform = runtime.get_platform("cuda")
    assert TWIN in sys.modules and (platform.kind, platform.compiler_kind, platform.source_target) == \
        ("cuda", "nvrtc", "cuda")
    assert platform.make_runtime is sys.modules[TWIN].CudaRuntime and "nvrtc" in compiler._FACTORIES
    assert runtime.compiler_kind("cuda") == "nvrtc"


def test_a_missing_twin_is_a_reason_not_a_crash(without_the_twin, monkeypatch):
    monkeypatch.setenv(settings.HIP_EMULATE.name, "1")
    monkeypatch.setitem(__import__("sys").modules, TWIN, None)  # as if kernels/verify/ were not shipped
    reason = runtime.runtime_unavailable_reason("cuda")
    assert reason and "cuda_twin.py) cannot be imported" in reason


def test_unknown_platforms_are_refused_with_the_known_ones():
    with pytest.raises(runtime.RuntimeUnavailable, match=r"no GPU runtime is registered for 'xpu' \(known: .*'hip'"):
        runtime.get_platform("xpu")


def test_dynamic_shared_memory_opt_in_only_where_the_runtime_needs_it():
    calls = []

    class Opt(FakeRuntime):
        dynamic_shared_limit = 1024

        def set_max_dynamic_shared(self, function, nbytes, device_index):
            calls.append(nbytes)

        def launch(self, *args):
            pass

    for rt, want in ((FakeRuntime(), []), (Opt(), [4096])):
        calls.clear()
        rt.launch = lambda *args: None
        kern = runtime.LoadedKernel(rt, None, None, "k", 0, [])
        kern((1,), (1,), [], shared_bytes=4096, stream=0)
        kern((1,), (1,), [], shared_bytes=2048, stream=0)  # within what was opted into already
        assert calls == want
    assert cuda_twin.CudaRuntime.dynamic_shared_limit == 48 * 1024 and runtime.HipRuntime.dynamic_shared_limit is None


def test_auto_never_lists_hip_on_nvidia():
    call = _call()
    nvidia = types.SimpleNamespace(**{**call.__dict__, "device_type": "cuda", "rocm": False, "arch": "sm_90"})
    assert not [n for n in registry.auto_order(nvidia) if n.startswith("hip")]


def test_backend_names_and_unavailable_on_cpu():
    for pv in ("fp8", "fp16"):
        b = hip_backend.make_backend(pv)
        assert b.name == f"hip_int8_{pv}"
        assert "ROCm" in b.why_not(_call())
    with pytest.raises(ValueError):
        hip_backend.make_backend("int4")


@pytest.mark.parametrize("kw, words", [
    (dict(dtype=torch.float32), "not fp16 or bf16"),
    (dict(d=96), "head_dim 96"),
    (dict(dv=64), "v head_dim 64"),
    (dict(mask=torch.ones(40, 40, dtype=torch.bool)), "a bool mask (40, 40) that differs between query rows"),
    (dict(mask=torch.zeros(1, 2, 40, 40)), "a float mask (1, 2, 40, 40) that differs between query rows"),
    (dict(nq=0), "zero-size"),
])
def test_attention_refusal_reasons(kw, words):
    reason = hip_backend.attention_refusal(_call(**kw), "fp8")
    assert reason and words in reason
    assert hip_backend.attention_refusal(_call(), "fp8") is None


@pytest.mark.parametrize("mask", [
    torch.ones(1, 40, dtype=torch.bool),                       # 2-D, ComfyUI's unsqueezed to (1, 1, 40)
    torch.zeros(1, 1, 1, 40, dtype=torch.bfloat16),            # HunyuanVideo's additive key bias
    torch.zeros(1, 2, 1, 40),                                  # one row per head
    torch.zeros(1, 1, 1, 40, dtype=torch.float16).expand(1, 2, 40, 40),  # expanded over the query rows
])
def test_key_only_masks_are_taken(mask):
    """One value per (batch or 1, head or 1, key), in any float dtype or bool: the HIP kernels take it (the kind
    and shape rule is call_spec.mask_refusal's, the same one the Triton kernels apply)."""
    call = _call(mask=mask)
    assert call.mask_scope == "keys"
    for pv in ("fp8", "fp16"):
        assert hip_backend.attention_refusal(call, pv) is None


def test_launch_wrapper_uses_the_same_rule():
    call = _call(d=96)
    with pytest.raises(registry.KernelRefused, match="head_dim 96"):
        hip_backend.hip_attention(None, call, "fp8", 0.1)


def test_missing_triton_prologue_is_a_refusal(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "comfyui_sage_rdna4.kernels.backends.triton.prologue", None)
    reason = hip_backend.prologue_refusal(_call(prologue="triton"))
    assert reason and "Triton prologue is unavailable" in reason


def test_hip_prologue_refuses_cpu():
    reason = hip_backend.prologue_refusal(_call(prologue="hip"))
    assert reason and reason.startswith("HIP prologue:")


# -- the self-check ---------------------------------------------------------------------------------

def good_attention(qq, call, pv, sm_scale, q=None, key_mask=None):
    """The spec's attention half, with a key-only mask as the masked HIP kernels take it (KeyMaskOperands)."""
    return attention_from_quantized(qq, pv=pv, is_causal=call.is_causal, return_lse=call.return_lse,
                                    q=q, sm_scale=sm_scale, out_dtype=call.dtype,
                                    key_bias=None if key_mask is None else key_mask.bias,
                                    key_fill=key_mask is not None and key_mask.fill)


def mask_ignoring_attention(qq, call, pv, sm_scale, q=None, key_mask=None):
    return good_attention(qq, call, pv, sm_scale, q)


def garbage_attention(qq, call, pv, sm_scale, q=None, key_mask=None):
    b, h, n, _ = qq.q8.shape
    out = torch.randn(b, h, n, qq.v.shape[3], generator=torch.Generator().manual_seed(0)).to(call.dtype)
    return out, (torch.zeros(b, h, n) if call.return_lse else None)


# Small cases for the machinery tests (the full default set runs once, in the first test): both dtypes,
# both head dims, GQA, causal, LSE, batch 2, two query blocks.
SMALL_CASES = (
    Case("small", "peaked", torch.float16, 128, 2, 2, 2, 97, 161),
    Case("small-lse", "peaked", torch.bfloat16, 64, 2, 4, 2, 130, 130, is_causal=True, return_lse=True),
)


@pytest.fixture
def cpu_hip_backend(monkeypatch):
    """A HIP backend that accepts CPU tensors, with the torch prologue standing in for the HIP one."""
    monkeypatch.setattr(hip_prologue, "hip_prologue_refusal", lambda call: None)
    monkeypatch.setattr(hip_prologue, "hip_quantize_qkv", quant.quantize_qkv_torch)
    b = hip_backend.make_backend("fp8")
    b.verdicts = Verdicts(SMALL_CASES)
    monkeypatch.setattr(b, "_unavailable", lambda device_type, index: None)
    return b


def test_selfcheck_passes_a_correct_kernel(cpu_hip_backend):
    cpu_hip_backend.attention_impl = good_attention
    cpu_hip_backend.verdicts = Verdicts()  # the full default set, as on a user's GPU
    assert cpu_hip_backend.ready(_call()) is None
    assert cpu_hip_backend.verdicts.verdict("cpu", None, cpu_hip_backend.variant(_call())) == (True, None)
    result = cpu_hip_backend.verdicts.last_result
    # LSE too, and the key-mask case: the HIP kernels take key-only masks
    assert [r.case for r in result.results] == list(DEFAULT_CASES)
    assert any(c.key_mask for c in DEFAULT_CASES) and not result.skipped


def _statistics_with_dead_keys(q, k, v, live=None, **kw):
    return quant.quantize_qkv_torch(q, k, v, **kw)  # the padding's 1000x K and V in the means and scales


@pytest.mark.parametrize("attention, prologue, words", [
    (mask_ignoring_attention, None, "rel L1"),                 # the padding reaches the row max and the P.V sum
    (good_attention, _statistics_with_dead_keys, "cosine"),    # the padding coarsens the kept keys' K and V codes
])
def test_selfcheck_padded_keys_catches_a_hip_path_that_drops_the_mask(cpu_hip_backend, monkeypatch, attention,
                                                                       prologue, words):
    """The HIP backend's own path (backend.launch: masks.key_mask_operands, the prologue with the live keys, the
    attention with the key bias) through the self-check's padded-keys case: an attention that ignores the bias, or a
    prologue that keeps the padding keys (1000x larger) in the K/V statistics, fails it by name."""
    cpu_hip_backend.attention_impl = attention
    if prologue is not None:
        monkeypatch.setattr(hip_prologue, "hip_quantize_qkv", prologue)
    cpu_hip_backend.verdicts = Verdicts(tuple(c for c in DEFAULT_CASES if c.key_mask))
    reason = cpu_hip_backend.ready(_call())
    assert reason and "'padded-keys'" in reason and words in reason, reason


def _nan_attention(qq, call, pv, s, q=None, key_mask=None):
    return torch.full((*qq.q8.shape[:3], qq.v.shape[3]), float("nan"), dtype=call.dtype), None


@pytest.mark.parametrize("broken, words", [
    (garbage_attention, "cosine"),
    (_nan_attention, "NaN"),
    (lambda *a, **k: (_ for _ in ()).throw(RuntimeError("hipModuleLaunchKernel failed")), "raised RuntimeError"),
])
def test_selfcheck_disables_a_broken_kernel(cpu_hip_backend, monkeypatch, broken, words):
    cpu_hip_backend.attention_impl = broken
    call = _call()
    assert cpu_hip_backend.why_not(call) is None  # a pure query: nothing has been checked yet
    reason = cpu_hip_backend.ready(call)
    assert reason and "self-check failed (hip prologue" in reason and words in reason
    assert cpu_hip_backend.why_not(call) == reason
    assert cpu_hip_backend.unavailable("cpu", None) == reason  # disabled for the process, reason kept
    with pytest.raises(registry.KernelRefused, match="self-check failed"):
        cpu_hip_backend(torch.randn(1, 2, 40, 128).half(), torch.randn(1, 2, 40, 128).half(),
                        torch.randn(1, 2, 40, 128).half(), call, 0.1)
    # auto falls back past it, and records why
    monkeypatch.setitem(registry._REGISTRY, "hip_int8_fp8", cpu_hip_backend)
    monkeypatch.setattr(registry, "auto_order", lambda c: ["hip_int8_fp8", "sdpa"])
    found = route(call)
    assert found.backend.name == "sdpa" and "self-check failed" in found.passed_over["hip_int8_fp8"]


def test_selfcheck_catches_a_wrong_lse(cpu_hip_backend):
    def bad_lse(qq, call, pv, sm_scale, q=None):
        out, lse = good_attention(qq, call, pv, sm_scale, q)
        return out, (None if lse is None else lse + 1.0)

    cpu_hip_backend.attention_impl = bad_lse
    reason = cpu_hip_backend.ready(_call())
    assert reason and "LSE off by" in reason


def test_selfcheck_runs_once_per_prologue_across_threads(cpu_hip_backend, monkeypatch):
    from comfyui_sage_rdna4.kernels.backends.triton import prologue as triton_prologue
    monkeypatch.setattr(triton_prologue, "triton_quantize_qkv", quant.quantize_qkv_torch)
    runs = []

    def counting(qq, call, pv, sm_scale, q=None):
        runs.append(1)
        return good_attention(qq, call, pv, sm_scale, q)

    cpu_hip_backend.attention_impl = counting
    call, results = _call(), []
    threads = [threading.Thread(target=lambda: results.append(cpu_hip_backend.ready(call))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [None] * 4
    calls = CALLS_PER_CASE * len(SMALL_CASES)
    assert len(runs) == calls  # every case accepted, LSE included
    cpu_hip_backend.ready(call)
    cpu_hip_backend.ready(_call(prologue="hip"))  # 'auto' is the HIP prologue: the same combination
    assert len(runs) == calls  # not run again
    cpu_hip_backend.ready(_call(prologue="triton"))  # another kernel + prologue combination: its own check
    assert len(runs) == 2 * calls


def test_selfcheck_without_acceptable_case_disables(cpu_hip_backend, monkeypatch):
    cpu_hip_backend.attention_impl = good_attention
    monkeypatch.setattr(hip_prologue, "hip_prologue_refusal", lambda call: "nothing fits")
    # the real call is refused by the prologue rule before the self-check is reached
    assert "nothing fits" in cpu_hip_backend.ready(_call())
    # the self-check itself, as if the call had been accepted: no case of it is
    reason = cpu_hip_backend.verdicts.guard(cpu_hip_backend, _call(), cpu_hip_backend.variant(_call()))
    assert reason and "no case" in reason


@pytest.mark.slow
def test_nvrtc_builds_the_whole_kernel_module_with_the_loader_flags(tmp_path, monkeypatch):
    """The exact CUDA build the loader makes for the emulation (sm_90, ptxas -O1), through the disk cache;
    every entry point of kernel_abi must be in the cubin. ~10 s on a 2-core CPU."""
    reason = compiler.compiler_unavailable_reason("nvrtc")
    if reason:
        pytest.skip(reason)
    from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi as abi
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(runtime, "_BUNDLES", {})
    bundle = runtime.kernel_bundle()
    comp = compiler.get_compiler("nvrtc")
    built = comp.build_cached(code_objects(tmp_path), bundle, "sm_90", [], "cuda-driver-test")
    assert built.image[:4] == b"\x7fELF" and built.path
    missing = [n for n in abi.all_kernel_names() if n.encode() not in built.image]
    assert not missing, missing
    again = comp.build_cached(code_objects(tmp_path), bundle, "sm_90", [], "cuda-driver-test")
    assert again.from_cache and again.image == built.image


def test_smooth_v_reaches_the_prologue_and_the_attention(cpu_hip_backend, monkeypatch):
    """The backend no longer refuses smooth_v: the prologue is asked for it and the attention gets its v_mean."""
    from comfyui_sage_rdna4.kernels.reference import reference_attention
    seen = []

    def prologue(q, k, v, **kw):
        seen.append(kw.get("smooth_v", False))
        return quant.quantize_qkv_torch(q, k, v, **kw)

    monkeypatch.setattr(hip_prologue, "hip_quantize_qkv", prologue)
    cpu_hip_backend.attention_impl = good_attention
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 2, 40, 128, generator=g).half() for _ in range(2))
    v = (torch.randn(1, 2, 40, 128, generator=g) + 4).half()
    call = describe_call(q, k, v, smooth_v=True)
    assert cpu_hip_backend.refuse(call) is None or "smooth_v" not in cpu_hip_backend.refuse(call)
    seen.clear()
    out, _ = cpu_hip_backend.launch(q, k, v, call, 0.1, None)
    assert seen == [True]
    want, _ = reference_attention(q, k, v, sm_scale=0.1, pv="fp8", smooth_v=True)
    assert torch.equal(out, want)


def test_a_gpu_runs_prewarm_builds_the_module_the_loader_then_takes_from_its_cache(tmp_path, monkeypatch):
    """tests/conftest.py compiles the backends' module ahead (cuda_twin.prewarm_loader_build) with the loader's own
    cache key: the first kernel call afterwards loads that build and compiles nothing; nothing is loaded ahead. A
    prewarm that fails leaves the failure to that first call and raises nothing itself."""
    from comfyui_sage_rdna4.kernels.verify import cuda_twin

    comp, rt = FakeCompiler(), FakeRuntime()
    loader = runtime.KernelLoader(rt, comp, code_objects(tmp_path))
    monkeypatch.setattr(runtime, "get_loader", lambda: loader)
    monkeypatch.setattr(runtime, "kernel_bundle", lambda: SRC)
    thread = cuda_twin.prewarm_loader_build(0)
    thread.join(timeout=30)
    assert not thread.is_alive() and comp.compiles == 1 and rt.loaded == []
    loader.kernel(0, SRC, "k", ["ptr"])
    assert comp.compiles == 1 and len(rt.loaded) == 1

    class Broken(FakeCompiler):
        def compile(self, source, target, extra_flags=()):
            raise compiler.CompileError("planted")

    monkeypatch.setattr(runtime, "get_loader", lambda: runtime.KernelLoader(rt, Broken(), code_objects(tmp_path / "b")))
    failed = cuda_twin.prewarm_loader_build(0)
    failed.join(timeout=30)
    assert not failed.is_alive()
