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
