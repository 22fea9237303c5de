"""The Triton backend's host work per call (issue 11 item 2), with every kernel launch recorded instead of run:
bf16 takes exactly the path fp16 takes (no conversion, no contiguity copy, the same launches), q/k/v reach the
kernels as the caller's views, and a repeated signature reuses its launch geometry."""
import pytest
import torch

pytest.importorskip("triton")

from comfyui_sage_rdna4.kernels.backends.triton import attention as triton_attention  # noqa: E402
from comfyui_sage_rdna4.kernels.backends.triton import prologue as triton_prologue  # noqa: E402
from comfyui_sage_rdna4.kernels.backends.triton.backend import TritonBackend  # noqa: E402
from comfyui_sage_rdna4.kernels.call_spec import describe_call  # noqa: E402

KERNELS = ((triton_prologue, "_kv_stats"), (triton_prologue, "_kv_finalize"), (triton_prologue, "_quantize_qkv"),
           (triton_attention, "_sage_attn_fwd"))


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch as (kernel, grid, positional args, keyword args), none run."""
    seen = []

    class Recorded:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append((self.name, grid, args, meta))

    for module, name in KERNELS:
        monkeypatch.setattr(module, name, Recorded(name))
    return seen


def comfy_qkv(dtype, n=80, heads=4, d=128, seed=0):
    """q, k, v as the override hands them over: HND views of ComfyUI's (b, n, heads*d) tensors."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, heads * d, generator=g).to(dtype).view(1, n, heads, d).transpose(1, 2)
            for _ in range(3)]


def run(launches, dtype, pv="fp8"):
    launches.clear()
    q, k, v = comfy_qkv(dtype)
    out, lse = TritonBackend(pv).launch(q, k, v, describe_call(q, k, v), 0.088, None)
    return (q, k, v), out, lse, list(launches)


def _shape_of(arg):
    """A launch argument without its dtype and data: tensors by shape, everything else as is."""
    return ("tensor", tuple(arg.shape), arg.stride()) if isinstance(arg, torch.Tensor) else arg


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_bf16_takes_the_fp16_host_path(launches, pv):
    (q16, k16, v16), out16, lse16, fp16 = run(launches, torch.float16, pv)
    (qbf, kbf, vbf), outbf, lsebf, bf16 = run(launches, torch.bfloat16, pv)
    assert [name for name, *_ in fp16] == [name for name, *_ in bf16] == ["_kv_stats", "_quantize_qkv",
                                                                          "_sage_attn_fwd"]
    for (name, grid, args, meta), (_, grid_bf, args_bf, meta_bf) in zip(fp16, bf16):
        assert grid == grid_bf and meta == meta_bf, name
        assert [_shape_of(a) for a in args] == [_shape_of(a) for a in args_bf], name
    # the inputs reach the kernels as they came: no cast, no contiguous copy
    stats, quantize = bf16[0][2], bf16[1][2]
    assert stats[0] is kbf and stats[1] is vbf
    assert quantize[0] is qbf and quantize[1] is kbf and quantize[2] is vbf
    # buffers the prologue allocates do not follow the input dtype; the output is the input's dtype, written NHD
    for (_, _, args, _), (_, _, args_bf, _) in zip(fp16, bf16):
        for a, b in zip(args, args_bf):
            if isinstance(a, torch.Tensor) and a.dtype not in (torch.float16, torch.bfloat16):
                assert a.dtype == b.dtype
    assert out16.dtype == torch.float16 and outbf.dtype == torch.bfloat16
    assert outbf.transpose(1, 2).is_contiguous()  # the caller's reshape to (b, n, h*d) is a view
    assert lse16 is None and lsebf is None


def test_a_repeated_signature_reuses_its_launch_geometry(launches):
    run(launches, torch.float16)
    prologue_hits = triton_prologue.prologue_launch.cache_info().hits
    attention_hits = triton_attention.attention_launch.cache_info().hits
    run(launches, torch.bfloat16)  # the dtype is no part of the geometry
    assert triton_prologue.prologue_launch.cache_info().hits == prologue_hits + 1
    assert triton_attention.attention_launch.cache_info().hits == attention_hits + 1


def test_kernels_know_whether_they_are_interpreted():
    """INTERPRETER / EXACT_P_ROUND follow how triton.jit built the kernels, not the environment of each call."""
    from triton.runtime.jit import JITFunction
    assert triton_prologue.INTERPRETED == (not isinstance(triton_prologue._quantize_qkv, JITFunction))
