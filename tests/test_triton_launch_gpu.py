"""The Triton backend's host shortcuts on a real GPU (skipped without one): the direct launch runs exactly the
compiled kernel Triton's own launch would pick, for every kind of input the caller can hand over, and the kept
prologue workspace never mixes up calls, back to back or on two streams."""
import pytest
import torch

pytest.importorskip("triton")

from comfyui_sage_rdna4.kernels.api import sage_attention  # noqa: E402
from comfyui_sage_rdna4.kernels.backends.triton import launcher, prologue  # noqa: E402

pytestmark = pytest.mark.gpu
KERNELS = ("triton_int8_fp8", "triton_int8_fp16")


def tritons_kernel(fn, args, meta):
    """The compiled kernel JITFunction.run would launch for these arguments (its own binder and cache key)."""
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import compute_cache_key
    kernel_cache, key_cache, _, _, binder = fn.device_caches[driver.active.get_current_device()]
    kwargs = dict(meta, debug=meta.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    _, specialization, options = binder(*args, **kwargs)
    return kernel_cache.get(compute_cache_key(key_cache, specialization, options))


def variants(dtype):
    """q, k, v as callers hand them over: contiguous HND, NHD views, fused-qkv views, and a 2-byte misaligned base."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, n, d = 1, 4, 300, 128
    yield "hnd", [torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype) for _ in range(3)]
    yield "nhd", [torch.randn(b, n, h, d, device="cuda", generator=g).to(dtype).transpose(1, 2) for _ in range(3)]
    qkv = torch.randn(b, n, 3, h, d, device="cuda", generator=g).to(dtype)
    yield "fused", [qkv[:, :, i].transpose(1, 2) for i in range(3)]
    flat = torch.randn(3 * b * h * n * d + 1, device="cuda", generator=g).to(dtype)
    yield "misaligned", [flat[1 + i * b * h * n * d:1 + (i + 1) * b * h * n * d].view(b, h, n, d) for i in range(3)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_direct_launch_runs_the_kernel_triton_would_choose(kernel, dtype, monkeypatch):
    if launcher.fast_launch_refusal():
        pytest.skip(f"direct launch off here: {launcher.fast_launch_refusal()}")
    direct = []  # kernels launched through the direct path
    real_call = launcher.DirectLauncher.__call__

    def checking(self, grid, args, meta, key):
        before = len(self._compiled)
        kernel_obj = real_call(self, grid, args, meta, key)
        assert kernel_obj is tritons_kernel(self.fn, args, meta), self.fn.__name__
        if len(self._compiled) == before:  # nothing new kept: the launch found its entry and went direct
            direct.append(self.fn.__name__)
        return kernel_obj

    monkeypatch.setattr(launcher.DirectLauncher, "__call__", checking)
    for name, (q, k, v) in variants(dtype):
        first = sage_attention(q, k, v, kernel=kernel)   # may compile: Triton's own launch
        second = sage_attention(q, k, v, kernel=kernel)  # the direct launch
        assert torch.equal(first, second), name
    assert {"_kv_stats", "_quantize_qkv", "_sage_attn_fwd"} <= set(direct)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kept_workspace_never_mixes_up_calls(kernel):
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (2, 8, 1024, 128)
    sets = [[torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)] for _ in range(3)]
    alone = []
    for q, k, v in sets:
        alone.append(sage_attention(q, k, v, kernel=kernel))
        torch.cuda.synchronize()
    assert prologue.WORKSPACES.kept_bytes > 0
    # back to back on one stream, nothing waited for in between
    together = [sage_attention(q, k, v, kernel=kernel) for q, k, v in sets]
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    # two streams at once: each has its own workspace
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [sage_attention(q, k, v, kernel=kernel) for q, k, v in sets[:2]]
    main = [sage_attention(q, k, v, kernel=kernel) for q, k, v in sets[1:]]
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side[0], alone[0]) and torch.equal(on_side[1], alone[1])
    assert torch.equal(main[0], alone[1]) and torch.equal(main[1], alone[2])
