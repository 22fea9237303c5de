"""The CuPy harness compiles the sources by part (kernels/verify/cupy_runner.py): each launch goes to the part that
defines its kernel, and each part compiles alone into exactly its kernels. CPU only; the compile test needs nvcc."""
import shutil
import subprocess

import pytest

from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi
from comfyui_sage_rdna4.kernels.verify import cupy_runner


def test_every_kernel_has_a_part_and_the_probes_are_found():
    names = kernel_abi.all_kernel_names()
    parts = {name: cupy_runner.part_of(name) for name in names}
    assert set(parts.values()) == set(cupy_runner.PARTS)
    assert cupy_runner.PROBE_KERNELS == {n for n, p in parts.items() if p == "probes"}
    assert {"sage_acc_probe", "sage_wmma_probe", "sage_e4m3_probe"} <= cupy_runner.PROBE_KERNELS
    assert parts["sage_qk_scores_d64"] == "attention" and parts["sage_colstats_finalize"] == "prologue"


def test_a_part_carries_its_options_and_the_probes_no_attention_kernels():
    probes = cupy_runner.part_source("probes", acc_trunc_bits=13)
    assert probes.startswith("#define SG_EMU_ACC_TRUNC_BITS 13\n")
    for instantiation in ("SG_ATTN(f8", "SG_ATTN(f16", "SG_ATTN_KMASK(f8", "SG_QK_SCORES(64)"):  # gone, macros kept
        assert instantiation not in probes
    assert "SG_ATTN(f8" in cupy_runner.part_source("attention")
    assert cupy_runner.part_source("all") == kernel_abi.module_source("cuda")
    with pytest.raises(ValueError, match="unknown part"):
        cupy_runner.part_source("epilogue")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("nm") is None, reason="needs nvcc and nm")
@pytest.mark.parametrize("part", cupy_runner.PARTS)
def test_each_part_compiles_alone_into_its_kernels(tmp_path, part):
    src = tmp_path / f"{part}.cu"
    src.write_text(cupy_runner.part_source(part))
    cubin = tmp_path / f"{part}.cubin"
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-w", "-o", str(cubin), str(src)], check=True,
                   capture_output=True, timeout=600)
    symbols = subprocess.run(["nm", str(cubin)], check=True, capture_output=True, text=True).stdout.split()
    defined = {s for s in symbols if s.startswith("sage_")}
    want = {n for n in kernel_abi.all_kernel_names() if cupy_runner.part_of(n) == part}
    assert defined == want


def test_the_harness_keeps_fp32_subnormals_by_its_own_flags():
    """CuPy's compile path appends -ftz=true; the harness builds through the loader's nvrtc binding with -ftz=false
    and nothing from CuPy, so a K scale of FP32 tiny / 127 (a dead key's) stays the subnormal gfx12 computes."""
    assert cupy_runner.harness_options("sm_90") == ["--gpu-architecture=sm_90", "-std=c++17", "-ftz=false"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs a CUDA toolkit (its nvrtc)")
def test_the_harness_compiles_a_part_without_a_gpu():
    from comfyui_sage_rdna4.kernels.backends.hip.compiler import CompilerUnavailable
    try:
        compiler = cupy_runner.harness_compiler()
        assert compiler.options("sm_90", cupy_runner.HARNESS_FLAGS) == cupy_runner.harness_options("sm_90")
        code = cupy_runner.compile_part(compiler, "probes", "sm_90", acc_trunc_bits=13)
    except CompilerUnavailable as exc:
        pytest.skip(f"nvrtc not found: {exc}")
    assert code[:4] == b"\x7fELF" and b"sage_acc_probe" in code


def test_the_harness_says_why_it_cannot_run():
    reason = cupy_runner.harness_missing()
    assert reason is None or reason.startswith(("cupy unavailable", "nvrtc unavailable"))


@pytest.fixture
def fake_compiles(monkeypatch):
    """cupy_runner's build cache empty, its compiler a stand-in: each compile records its thread and may wait on
    its part's gate (a barrier the test sets in state["gates"]), then returns the part and options as bytes."""
    import threading

    monkeypatch.setattr(cupy_runner, "_CODE", {})
    monkeypatch.setattr(cupy_runner, "COMPILED", [])
    compiler = type("Compiler", (), {"target_for_device": lambda self, index: "sm_90"})()
    monkeypatch.setattr(cupy_runner, "harness_compiler", lambda: compiler)
    state = {"calls": [], "gates": {}, "fail": set()}

    def compile_part(compiler, part, target, **options):
        state["calls"].append((part, tuple(sorted(options.items())), threading.current_thread().name))
        if part in state["gates"]:
            state["gates"][part].wait(timeout=10)
        if part in state["fail"]:
            raise RuntimeError(f"planted nvrtc failure in {part}")
        return f"{part} {sorted(options.items())}".encode()

    monkeypatch.setattr(cupy_runner, "compile_part", compile_part)
    return state


def test_prewarm_compiles_builds_side_by_side_and_each_once(fake_compiles):
    """Two builds that can only finish together (a barrier of 2) finish: the prewarm's threads compile at the same
    time. The build a test then asks for is the prewarm's (compiled once, from a prewarm thread), with the options
    it was asked with; the log says which were compiled ahead."""
    import threading

    gate = threading.Barrier(2)
    fake_compiles["gates"] = {"attention": gate, "prologue": gate}
    builds = [("attention", {"acc_trunc_bits": 13}), ("prologue", {})]
    threads = cupy_runner.prewarm(builds, device_index=0, workers=2)
    for thread in threads:
        thread.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    key = (0, "attention", (("acc_trunc_bits", 13),))
    assert cupy_runner._code(key).result() == b"attention [('acc_trunc_bits', 13)]"
    assert cupy_runner._code((0, "prologue", ())).result() == b"prologue []"
    assert len(fake_compiles["calls"]) == 2  # asked again: nothing compiled twice
    assert {name.startswith("sage-emulated-prewarm") for *_, name in fake_compiles["calls"]} == {True}
    assert [c.prewarmed for c in cupy_runner.COMPILED] == [True, True]
    assert cupy_runner._code((0, "probes", ())).result() == b"probes []"  # not prewarmed: compiled when asked
    assert cupy_runner.COMPILED[-1].prewarmed is False and cupy_runner.COMPILED[-1].part == "probes"


def test_a_build_asked_for_while_the_prewarm_compiles_it_is_waited_for(fake_compiles):
    """A test asking for a build a prewarm thread is compiling gets that compile's result, not a second compile;
    a failed compile reaches every asker as the error it was."""
    import threading

    gate = threading.Barrier(2)  # the attention compile waits until the main thread arrives too
    fake_compiles["gates"] = {"attention": gate}
    threads = cupy_runner.prewarm([("attention", {}), ("probes", {})], device_index=0, workers=1)
    fake_compiles["fail"].add("probes")
    while not fake_compiles["calls"]:
        threading.Event().wait(0.01)
    future = cupy_runner._code((0, "attention", ()))  # in flight: the same future
    gate.wait(timeout=10)
    assert future.result(timeout=10) == b"attention []"
    for thread in threads:
        thread.join(timeout=20)
    with pytest.raises(RuntimeError, match="planted nvrtc failure in probes"):
        cupy_runner._code((0, "probes", ())).result()
    assert [c[0] for c in fake_compiles["calls"]] == ["attention", "probes"]


def test_the_gpu_runs_prewarmed_builds_are_valid_builds():
    """Every build the GPU test run compiles ahead (tests/conftest.py) names a part and options the harness
    takes, and none twice."""
    from conftest import EMULATED_BUILDS

    keys = [(part, tuple(sorted(options.items()))) for part, options in EMULATED_BUILDS]
    assert len(set(keys)) == len(keys)
    for part, options in EMULATED_BUILDS:
        assert part in cupy_runner.PARTS
        kernel_abi.option_defines(**options)  # unknown options or values out of range raise
    assert EMULATED_BUILDS[0][0] == "attention"  # the heaviest first


def test_the_runs_summary_names_builds_compiled_when_asked_and_prewarmed_ones_never_asked_for(monkeypatch):
    """The GPU run's summary lines: the builds' total, each build a test asked for that the prewarm list lacks, and
    each prewarmed build no test asked for (so the list can be kept to what the tests use)."""
    from conftest import emulated_build_lines

    acc = (("acc_trunc_bits", 13),)
    monkeypatch.setattr(cupy_runner, "COMPILED", [cupy_runner.Compiled("attention", (), 20.0, True),
                                                  cupy_runner.Compiled("probes", acc, 1.5, True),
                                                  cupy_runner.Compiled("prologue", acc, 4.0, False)])
    monkeypatch.setattr(cupy_runner, "ASKED", {("attention", ()), ("prologue", acc)})
    lines = emulated_build_lines()
    assert lines[0] == ("[emulated builds] 3 compiled, 25.5 s of nvrtc; 2 in the background ahead of the tests "
                        "(21.5 s)")
    assert lines[1:] == ["[emulated builds] compiled when asked (not in EMULATED_BUILDS): prologue "
                         "{'acc_trunc_bits': 13} 4.0 s",
                         "[emulated builds] compiled ahead, never asked for in this run: probes "
                         "{'acc_trunc_bits': 13} 1.5 s"]
    monkeypatch.setattr(cupy_runner, "ASKED", set())  # nothing asked (a run of Triton tests only): no verdict on use
    assert len(emulated_build_lines()) == 2


def test_a_gpu_run_prewarms_only_for_the_tests_that_use_the_emulation(tmp_path):
    """tests/conftest.py starts the nvrtc threads only when a selected GPU test's module uses the emulated builds
    (or the emulated HIP backends); GPU tests of the Triton kernels alone start none, and CPU tests never count."""
    from conftest import _gpu_modules_mentioning

    class Item:
        def __init__(self, path, gpu=True):
            self.fspath, self.keywords = path, {"gpu": True} if gpu else {}

    emulated, triton_only = tmp_path / "test_a_gpu.py", tmp_path / "test_b_gpu.py"
    emulated.write_text("from x import cupy_runner\n")
    triton_only.write_text("import triton\n")
    words = ("cupy_runner", "emulated_run")
    assert _gpu_modules_mentioning([Item(triton_only), Item(emulated)], words)
    assert not _gpu_modules_mentioning([Item(triton_only)], words)
    assert not _gpu_modules_mentioning([Item(emulated, gpu=False)], words)
