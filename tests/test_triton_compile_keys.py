"""How many Triton compiles the first use of a Triton backend costs, counted on the CPU (kernels/verify/
compile_keys.py: every launch's compile key, as Triton forms it, with nothing compiled or run), for the launch plans
of the H200 (sm_90) and of RDNA4 (gfx1201).

Figures (the self-check of one variant, DEFAULT_CASES, per backend): 30 compiles before sizes stopped being
specialized and the 'diagonal' case took 'diffuse''s GQA (10 of them the attention kernel), 21 after (8); a Flux-,
a long-K/V and an SDXL-sized call after it compile nothing more (before: 7). docs/MEASUREMENTS.md#first-use-compiles."""
import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from comfyui_sage_rdna4.kernels.call_spec import describe_call  # noqa: E402
from comfyui_sage_rdna4.kernels.registry import get_backend  # noqa: E402
from comfyui_sage_rdna4.kernels.self_check import (  # noqa: E402
    DEFAULT_CASES,
    Variant,
    backend_attention,
    case_call,
    run_self_check,
)
from comfyui_sage_rdna4.kernels.verify.compile_keys import CompileKeys  # noqa: E402

ARCHS = ("sm_90", "gfx1201")
ACCURATE = Variant("triton", "token", True, False)
# The most compiles one variant's self-check may cost per backend (all kernels; the attention kernel alone).
MAX_COMPILES, MAX_ATTENTION_COMPILES = 21, 8


def _self_check(name: str, arch: str, variant: Variant = ACCURATE, cases=DEFAULT_CASES):
    backend = get_backend(name)
    like = dataclasses.replace(describe_call(*[torch.zeros(1, 1, 1, 64)] * 3), device_type="cuda", device_index=0,
                               arch=arch)
    return run_self_check(backend_attention(backend, variant), "cpu", cases,
                          lambda case: backend.refuse(case_call(case, like, variant)) is None, stop_at_first=False)


def _nhd_call(name: str, heads: int, nq: int, nk: int, dtype=torch.bfloat16, d: int = 128):
    """A ComfyUI-like call: NHD tensors seen as HND, as the override passes them."""
    q = torch.randn(1, nq, heads, d, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, nk, heads, d, dtype=dtype).transpose(1, 2)
    return backend_attention(get_backend(name), ACCURATE)(q, k, k)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["triton_int8_fp8", "triton_int8_fp16"])
def test_a_variants_self_check_compiles_few_kernels(name, arch):
    with CompileKeys(arch) as keys:
        result = _self_check(name, arch)
    assert len(result.results) == len(DEFAULT_CASES)  # every case ran (nothing was judged: nothing ran)
    print(name, arch, keys.count(), keys.per_kernel())
    assert keys.count("_sage_attn_fwd") <= MAX_ATTENTION_COMPILES and keys.count() <= MAX_COMPILES, keys.per_kernel()
    # Every case launches the attention kernel: fewer compiles than cases means cases share them.
    assert len([k for k in keys.launches if k[0] == "_sage_attn_fwd"]) >= 2 * len(DEFAULT_CASES)


@pytest.mark.parametrize("arch", ARCHS)
def test_model_sized_calls_reuse_the_self_checks_compiles(arch):
    """After the accurate variant's self-check, calls of the sizes models make (Flux's 4608 tokens, a long
    sequence whose K/V statistics take their own finalize launch, SDXL's fp16 D64) need no compile of their own."""
    with CompileKeys(arch) as keys:
        _self_check("triton_int8_fp8", arch)
        before = keys.count()
        _nhd_call("triton_int8_fp8", 24, 4608, 4608)  # Flux 1 MP, bf16 D128
        _nhd_call("triton_int8_fp8", 2, 200, 9000)  # keys past 32 chunks of statistics (Wan's 32760)
        _nhd_call("triton_int8_fp8", 10, 4096, 77, dtype=torch.float16, d=64)  # SDXL cross-attention
        assert keys.count() == before, keys.distinct()[before:]


def test_sizes_are_not_specialized_on():
    """Two calls that differ only in lengths and head counts (a multiple of 16 or not, one kv head or two) make one
    compile per kernel: the sizes are runtime arguments Triton does not specialize on."""
    with CompileKeys("sm_90") as keys:
        _nhd_call("triton_int8_fp16", 2, 130, 333)
        first = keys.count()
        _nhd_call("triton_int8_fp16", 1, 256, 512)
        assert keys.count() == first == len(keys.per_kernel())


def test_the_recorder_sees_a_specializing_difference():
    """The counter is not blind: a change Triton does compile anew for (another head dim, causal) is counted."""
    with CompileKeys("sm_90") as keys:
        _nhd_call("triton_int8_fp16", 2, 130, 333)
        first = keys.count("_sage_attn_fwd")
        _nhd_call("triton_int8_fp16", 2, 130, 333, d=64)
        assert keys.count("_sage_attn_fwd") == first + 1


def test_the_first_use_tool_says_it_needs_a_gpu_on_the_cpu():
    """tools/first_use_cost.py (the H200 measurement of these compiles' seconds) stops with one line here."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the tool would run")
    tool = Path(__file__).resolve().parents[1] / "tools" / "first_use_cost.py"
    proc = subprocess.run([sys.executable, str(tool), "--shape", "sdxl"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == "first_use_cost.py: needs a GPU", proc.stderr



class _KeepLaunches(CompileKeys):
    """The recorder, keeping each launch as well, as precompile.collect_launches gives them."""

    def __init__(self, arch):
        super().__init__(arch)
        self.kept = []

    def _record(self, fn, grid, args, meta, key):
        self.kept.append((fn, grid, args, meta))
        return super()._record(fn, grid, args, meta, key)


def test_shards_deal_out_each_distinct_kernel_once():
    """compile_keys.shard: the shards of a set of launches hold every distinct compile key exactly once between them,
    one launch per key, sizes within one of each other, the same whatever order the launches were collected in."""
    from comfyui_sage_rdna4.kernels.verify.compile_keys import compile_key, shard

    with _KeepLaunches("sm_90") as keys:
        _nhd_call("triton_int8_fp16", 2, 130, 333)
        _nhd_call("triton_int8_fp16", 2, 130, 333, d=64)
        _nhd_call("triton_int8_fp16", 1, 256, 512)  # no new kernel: the first call's keys again
    launches = keys.kept

    def texts(part):
        return [repr(compile_key(fn, args, meta)) for fn, _, args, meta in part]

    distinct = set(texts(launches))
    assert len(launches) > len(distinct) == keys.count() >= 4
    for count in (1, 2, 3, len(distinct) + 2):
        parts = [shard(launches, i, count) for i in range(count)]
        assert sorted(k for part in parts for k in texts(part)) == sorted(distinct)  # each key once, none missed
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert [texts(p) for p in parts] == [texts(shard(launches[::-1], i, count)) for i in range(count)]
    with pytest.raises(ValueError, match="shard 2 of 2"):
        shard(launches, 2, 2)
