"""The override called the way ComfyUI 2026 (0.3x, read from its source, not run here) calls it.

`dispatch` below is this project's own stand-in for that version's `wrap_attn`, written from its
behaviour: q/k/v may arrive wrapped in single-use containers, which are unwrapped into tensors before an
override without a `container_function` attribute is called (one with it gets the containers and no
`func`); `preferred_attention` is taken out of the keywords; the override is consulted before the
call site's preferred attention and before `func`. Models put block_index / total_blocks / block_type in
transformer_options (Flux: double then single blocks, each numbered from 0; Wan: one stack), pass
`heads=` by keyword, `enable_gqa=True` with fewer k/v heads, `scale`, and `low_precision_attention=False`
for Wan's image cross attention. The core "Model Attention Backend" node installs its choice under the
same key through `ModelPatcher.set_model_optimized_attention`.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from comfyui_sage_rdna4.kernels.metrics import cosine
from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride, install
from fakes import FakePatcher


class Container:
    """Single-owner tensor holder: take() hands the tensor over once."""

    def __init__(self, tensor):
        self.tensor = tensor

    def take(self):
        if self.tensor is None:
            raise RuntimeError("container already consumed")
        tensor, self.tensor = self.tensor, None
        return tensor


def dispatch(func):
    """Stand-in for the 2026 wrap_attn."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        preferred = kwargs.pop("preferred_attention", None)
        containers = args[:3] if len(args) >= 3 and isinstance(args[0], Container) else None
        added = "_inside_attn_wrapper" not in kwargs
        try:
            if added:
                kwargs["_inside_attn_wrapper"] = True
                override = (kwargs.get("transformer_options") or {}).get("optimized_attention_override")
                if override is not None:
                    if containers is not None:
                        if hasattr(override, "container_function"):
                            return override.container_function(*args, **kwargs)
                        args = tuple(c.take() for c in containers) + args[3:]
                    return override(func, *args, **kwargs)
                if preferred is not None and preferred.function is not None:
                    return preferred.function(*args, **kwargs)
            if containers is not None:
                args = tuple(c.take() for c in containers) + args[3:]
            return func(*args, **kwargs)
        finally:
            if added:
                del kwargs["_inside_attn_wrapper"]
    return wrapper


SEEN = []


def _heads(q, k, v, heads, skip_reshape, enable_gqa):
    if skip_reshape:
        return q, k, v
    b, d = q.shape[0], q.shape[-1] // heads
    kv = k.shape[-1] // d if enable_gqa else heads
    return (q.view(b, -1, heads, d).transpose(1, 2), k.view(b, -1, kv, d).transpose(1, 2),
            v.view(b, -1, kv, d).transpose(1, 2))


def site_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kwargs):
    """The call site's exact attention, with 2026's keywords (scale, enable_gqa)."""
    SEEN.append(dict(kwargs))
    assert not isinstance(q, Container)
    gqa = kwargs.get("enable_gqa", False)
    q, k, v = _heads(q, k, v, heads, skip_reshape, gqa)
    if mask is not None:
        mask = mask.unsqueeze(0) if mask.ndim == 2 else mask
        mask = mask.unsqueeze(1) if mask.ndim == 3 else mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=kwargs.get("scale"), enable_gqa=gqa)
    if not skip_output_reshape:
        b, h, n, d = out.shape
        out = out.transpose(1, 2).reshape(b, n, h * d)
    return out


optimized_attention = dispatch(site_attention)


class PreferredAttention:
    """What a model hands as preferred_attention (its per-module choice); must not run under our patch."""

    def __init__(self):
        self.calls = 0
        self.function = self.run

    def run(self, *args, **kwargs):
        self.calls += 1
        return site_attention(*args, **kwargs)


def set_model_optimized_attention(model_options, attention):
    """What ModelPatcher.set_model_optimized_attention does (Model Attention Backend): an override that
    drops `func` and runs its own choice; it carries the choice's container_function when there is one."""
    def chosen_override(_func, *args, **kwargs):
        return attention(*args, **kwargs)
    if getattr(attention, "container_function", None) is not None:
        chosen_override.container_function = attention.container_function
    model_options.setdefault("transformer_options", {})["optimized_attention_override"] = chosen_override


@pytest.fixture(autouse=True)
def no_comfy_check(monkeypatch):
    monkeypatch.setattr(install, "override_hook_missing", lambda: None)
    SEEN.clear()


def patched(kernel="reference", base=None, **cfg):
    model, ov = install.patch_model(base or FakePatcher(), PatchConfig(kernel=kernel, **cfg))
    return ov, model.model_options["transformer_options"]


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_the_override_never_opts_into_containers():
    ov, _ = patched()
    assert not hasattr(ov, "container_function")
    assert not hasattr(SageAttentionOverride, "container_function")


def test_flux_call_with_containers_preferred_attention_and_block_info():
    """Flux (comfy/ldm/flux/math.py 2026): (b, h, n, d) after RoPE in containers, skip_reshape, mask=None."""
    ov, to = patched()
    q, k, v = rnd(1, 4, 96, 64, seed=1), rnd(1, 4, 96, 64, seed=2), rnd(1, 4, 96, 64, seed=3)
    boxes = [Container(t) for t in (q, k, v)]
    preferred = PreferredAttention()
    options = dict(to, block_index=3, total_blocks=19, block_type="double")
    out = optimized_attention(*boxes, 4, skip_reshape=True, mask=None, transformer_options=options,
                              preferred_attention=preferred)
    assert all(b.tensor is None for b in boxes)  # unwrapped once, by the dispatcher
    assert preferred.calls == 0
    assert out.shape == (1, 96, 256)
    assert cosine(out, site_attention(q, k, v, 4, skip_reshape=True)) > 0.998
    assert ov.stats.snapshot()["calls"] == {"reference": 1}


def test_wan_self_and_cross_attention_calls():
    """Wan (comfy/ldm/wan/model.py 2026): containers of (b, s, n*d), heads by keyword; the image cross
    attention of i2v asks for low_precision_attention=False, which stays on the call site's attention."""
    ov, to = patched()
    b, s, n, d = 1, 80, 4, 32
    x = [rnd(b, s, n * d, seed=i) for i in range(3)]
    ctx = [rnd(b, 24, n * d, seed=10 + i) for i in range(3)]
    options = dict(to, block_index=0, total_blocks=30, block_type="double", grid_sizes=(1, 8, 10))
    out = optimized_attention(*[Container(t) for t in x], heads=n, preferred_attention=PreferredAttention(),
                              transformer_options=options)
    assert out.shape == (b, s, n * d) and cosine(out, site_attention(*x, n)) > 0.998
    img = optimized_attention(Container(x[0]), *[Container(t) for t in ctx[:2]], heads=n,
                              preferred_attention=PreferredAttention(), transformer_options=options,
                              low_precision_attention=False)
    assert SEEN[-1].get("low_precision_attention") is False  # reached the call site unchanged
    torch.testing.assert_close(img, site_attention(x[0], ctx[0], ctx[1], n))
    snap = ov.stats.snapshot()
    assert snap["calls"] == {"reference": 1} and snap["routed"] == {"low_precision_attention=False": 1}


def run_flux_blocks(to, double=19, single=38):
    """One Flux forward pass as 2026 numbers it: double blocks 0..18 then single blocks 0..37."""
    q = rnd(1, 2, 40, 32)
    for kind, count in (("double", double), ("single", single)):
        for i in range(count):
            options = dict(to, total_blocks=count, block_type=kind, block_index=i)
            optimized_attention(*[Container(t) for t in (q, q, q)], 2, skip_reshape=True, transformer_options=options)


def test_exact_blocks_follow_flux_numbering():
    ov, to = patched(exact_blocks="0, last 1")
    run_flux_blocks(to)
    snap = ov.stats.snapshot()
    # block 0 and the last block of each kind: double 0, double 18, single 0, single 37
    assert snap["routed"] == {"block 0 kept exact": 2, "block 18 kept exact": 1, "block 37 kept exact": 1}
    assert snap["calls"] == {"reference": 19 + 38 - 4} and snap["notes"] == []


@pytest.mark.parametrize("skip_reshape", [True, False])
def test_grouped_query_attention(skip_reshape):
    """enable_gqa=True: 8 query heads over 2 k/v heads, in both layouts."""
    ov, to = patched()
    hq, hkv, n, d = 8, 2, 48, 32
    if skip_reshape:
        q, k, v = rnd(1, hq, n, d, seed=1), rnd(1, hkv, n, d, seed=2), rnd(1, hkv, n, d, seed=3)
    else:
        q, k, v = rnd(1, n, hq * d, seed=1), rnd(1, n, hkv * d, seed=2), rnd(1, n, hkv * d, seed=3)
    out = optimized_attention(*[Container(t) for t in (q, k, v)], hq, skip_reshape=skip_reshape, enable_gqa=True,
                              transformer_options=to)
    expected = site_attention(q, k, v, hq, skip_reshape=skip_reshape, enable_gqa=True)
    assert out.shape == expected.shape == (1, n, hq * d)
    assert cosine(out, expected) > 0.998
    assert ov.stats.snapshot()["calls"] == {"reference": 1}


def test_fewer_kv_heads_without_enable_gqa_is_the_call_sites_to_judge():
    ov, to = patched()
    q, k = rnd(1, 8, 16, 32), rnd(1, 2, 16, 32)
    with pytest.raises(RuntimeError):  # SDPA itself refuses it; the override does not hide that
        optimized_attention(q, k, k, 8, skip_reshape=True, transformer_options=to)
    (reason,) = ov.stats.snapshot()["fallbacks"]
    assert "2 heads" in reason and "enable_gqa" in reason


def test_scale_with_containers():
    ov, to = patched()
    q, k, v = rnd(1, 2, 32, 64, seed=4), rnd(1, 2, 32, 64, seed=5), rnd(1, 2, 32, 64, seed=6)
    out = optimized_attention(*[Container(t) for t in (q, k, v)], 2, skip_reshape=True, scale=0.02,
                              transformer_options=to)
    assert cosine(out, site_attention(q, k, v, 2, skip_reshape=True, scale=0.02)) > 0.998
    assert cosine(out, site_attention(q, k, v, 2, skip_reshape=True)) < 0.99


def test_model_attention_backend_before_the_patch_gets_the_calls_the_patch_does_not_run():
    chosen_calls = []

    def backend_choice(*args, **kwargs):
        chosen_calls.append(kwargs.get("low_precision_attention"))
        return site_attention(*args, **kwargs)
    backend_choice.container_function = lambda *a, **k: pytest.fail("containers must be unwrapped before us")

    base = FakePatcher()
    set_model_optimized_attention(base.model_options, backend_choice)
    ov, to = patched(kernel="hip_int8_fp8", base=base, exact_blocks="0")
    assert ov.previous is base.model_options["transformer_options"]["optimized_attention_override"]
    q = rnd(1, 2, 32, 64)
    args = lambda: [Container(t) for t in (q, q, q)]  # noqa: E731
    optimized_attention(*args(), 2, skip_reshape=True, transformer_options=dict(to, block_index=0))  # policy
    optimized_attention(*args(), 2, skip_reshape=True, transformer_options=dict(to, block_index=1))  # refused
    optimized_attention(*args(), 2, skip_reshape=True, transformer_options=to, low_precision_attention=False)
    assert chosen_calls == [None, None, False]  # all three reached the node's choice, keywords intact
    snap = ov.stats.snapshot()
    assert snap["routed"] == {"block 0 kept exact": 1, "low_precision_attention=False": 1}
    assert sum(snap["fallbacks"].values()) == 1


def test_model_attention_backend_after_the_patch_replaces_it():
    """Documented, not fixable from here: the later node writes the same key."""
    model, ov = install.patch_model(FakePatcher(), PatchConfig(kernel="reference"))
    later = model.clone()
    set_model_optimized_attention(later.model_options, site_attention)
    assert install.find_override(later) is None and install.find_override(model) is ov


def test_repatching_keeps_the_override_that_was_under_the_first_patch():
    base = FakePatcher()
    set_model_optimized_attention(base.model_options, site_attention)
    under = base.model_options["transformer_options"]["optimized_attention_override"]
    first, _ = install.patch_model(base, PatchConfig(kernel="reference"))
    second, ov = install.patch_model(first, PatchConfig(kernel="sdpa"))
    assert ov.previous is not None and ov.previous.__qualname__ == under.__qualname__
    assert not isinstance(ov.previous, SageAttentionOverride)
