"""The override called the way ComfyUI's wrap_attn calls it (comfy/ldm/modules/attention.py), with fakes.py's
stand-ins for wrap_attn and attention_pytorch."""
import copy

import pytest
import torch

from comfyui_sage_rdna4.kernels import KernelRefused
from comfyui_sage_rdna4.kernels.metrics import cosine
from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride, bind_attention_args
from fakes import comfy_attention, marker_attention, wrap_attn


def wrap_attn_call(override, func, *args, **kwargs):
    """What wrap_attn does when transformer_options holds an override."""
    assert kwargs.get("transformer_options")["optimized_attention_override"] is override
    return wrap_attn(func)(*args, **kwargs)


def make(kernel="reference", **cfg):
    ov = SageAttentionOverride(PatchConfig(kernel=kernel, **cfg))
    return ov, {"optimized_attention_override": ov}


def bnhd(b=2, n=96, heads=4, d=64, nk=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    nk = nk or n
    return (torch.randn(b, n, heads * d, generator=g).to(dtype), torch.randn(b, nk, heads * d, generator=g).to(dtype),
            torch.randn(b, nk, heads * d, generator=g).to(dtype))


def test_runs_the_kernel_in_comfy_layout():
    ov, to = make()
    q, k, v = bnhd()
    out = wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    assert out.shape == q.shape
    assert cosine(out, comfy_attention(q, k, v, 4, _inside_attn_wrapper=True)) > 0.998
    assert ov.stats.snapshot()["calls"] == {"reference": 1}


def test_a_value_with_its_heads_unflattened_runs_the_kernel_as_sd3_passes_it():
    """SD3's MMDiT hands v over as (b, n, heads, d) beside flattened q and k; ComfyUI's attention views it as
    (b, -1, heads, d) all the same, so the kernel takes it (it was refused as malformed) with the same output."""
    ov, to = make()
    q, k, v = bnhd()
    v4 = v.view(2, 96, 4, 64)
    out = wrap_attn_call(ov, comfy_attention, q, k, v4, 4, transformer_options=to)
    flat = wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    assert torch.equal(out, flat)
    assert cosine(out, comfy_attention(q, k, v, 4, _inside_attn_wrapper=True)) > 0.998
    assert ov.stats.snapshot()["calls"] == {"reference": 2} and not ov.stats.snapshot()["fallbacks"]


@pytest.mark.parametrize("skip_reshape,skip_output_reshape",
                         [(False, False), (True, False), (False, True), (True, True)])
def test_all_layout_combinations(skip_reshape, skip_output_reshape):
    ov, to = make()
    q, k, v = bnhd()
    args = (q, k, v) if not skip_reshape else tuple(t.view(2, -1, 4, 64).transpose(1, 2) for t in (q, k, v))
    out = wrap_attn_call(ov, comfy_attention, *args, heads=4, skip_reshape=skip_reshape,
                         skip_output_reshape=skip_output_reshape, transformer_options=to)
    expected = comfy_attention(*args, 4, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                          _inside_attn_wrapper=True)
    assert out.shape == expected.shape
    assert cosine(out, expected) > 0.998


@pytest.mark.parametrize("skip_output_reshape", [False, True])
def test_the_kernel_is_told_whether_the_call_site_reshapes_its_output(monkeypatch, skip_output_reshape):
    """A call site that turns the output into (b, n, h*d) is described with out_nhd (a kernel then writes it
    token-major and the reshape is a view); one that keeps (b, h, n, d) is not. Both flags are in the plan's key,
    so the two calls of one shape get plans of their own."""
    from comfyui_sage_rdna4.kernels import registry
    backend = registry.get_backend("reference")
    seen, launch = [], backend.launch

    def spy(q, k, v, call, sm_scale, mask):
        seen.append(call.out_nhd)
        return launch(q, k, v, call, sm_scale, mask)
    monkeypatch.setattr(backend, "launch", spy)
    ov, to = make()
    args = tuple(t.view(2, -1, 4, 64).transpose(1, 2) for t in bnhd())
    for flag in (skip_output_reshape, not skip_output_reshape, skip_output_reshape):
        wrap_attn_call(ov, comfy_attention, *args, heads=4, skip_reshape=True, skip_output_reshape=flag,
                       transformer_options=to)
    want = not skip_output_reshape
    assert seen == [want, not want, want]


def test_heads_and_mask_by_position_or_keyword():
    q, k, v = bnhd(nk=80)
    mask = torch.randn(96, 80)
    for args, kwargs in [((q, k, v, 4, mask), {}), ((q, k, v), {"heads": 4, "mask": mask}),
                         ((q, k, v, 4), {"mask": mask.unsqueeze(0).expand(2, 96, 80)})]:
        ov, to = make()
        out = wrap_attn_call(ov, comfy_attention, *args, transformer_options=to, **kwargs)
        assert cosine(out, comfy_attention(q, k, v, 4, mask=mask, _inside_attn_wrapper=True)) > 0.998
        assert ov.stats.snapshot()["calls"] == {"reference": 1}


def test_unavailable_kernel_falls_back_with_reason_counted_once_logged(caplog):
    ov, to = make(kernel="hip_int8_fp8")
    q, k, v = bnhd()
    before = comfy_attention.calls
    with caplog.at_level("WARNING", logger="sage_rdna4"):
        for _ in range(3):
            out = wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    assert comfy_attention.calls == before + 3
    torch.testing.assert_close(out, comfy_attention(q, k, v, 4, _inside_attn_wrapper=True))
    fallbacks = ov.stats.snapshot()["fallbacks"]
    assert sum(fallbacks.values()) == 3 and len(fallbacks) == 1
    assert next(iter(fallbacks)).startswith("hip_int8_fp8: ")
    assert len([r for r in caplog.records if "falls back" in r.message]) == 1


def test_raise_mode_stops_with_the_reason():
    ov, to = make(kernel="hip_int8_fp8", on_unsupported="raise")
    q, k, v = bnhd()
    with pytest.raises(KernelRefused):
        wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)


def test_auto_on_cpu_falls_back_and_says_why():
    ov, to = make(kernel="auto")
    q, k, v = bnhd()
    wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    (reason,) = ov.stats.snapshot()["fallbacks"]
    assert reason.startswith("auto: no quantized kernel takes this call")


def test_low_precision_attention_false_is_honoured():
    ov, to = make()
    q, k, v = bnhd()
    before = comfy_attention.calls
    wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to, low_precision_attention=False)
    assert comfy_attention.calls == before + 1
    assert ov.stats.snapshot()["routed"] == {"low_precision_attention=False": 1}


def test_extra_kwargs_from_newer_comfyui_are_accepted():
    ov, to = make()
    q, k, v = bnhd()
    out = wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to, enable_gqa=False,
                         low_precision_attention=True, some_future_flag=1)
    assert out.shape == q.shape and ov.stats.snapshot()["calls"] == {"reference": 1}


def test_explicit_scale_kwarg_is_used():
    ov, to = make()
    q, k, v = bnhd(n=32)
    out = wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to, scale=0.01)
    flat = comfy_attention(q, k, v, 4, _inside_attn_wrapper=True)
    hnd = [t.view(2, -1, 4, 64).transpose(1, 2) for t in (q, k, v)]
    scaled = torch.nn.functional.scaled_dot_product_attention(*hnd, scale=0.01).transpose(1, 2).reshape(2, 32, 256)
    assert cosine(out, scaled) > cosine(out, flat)


def test_kernel_exception_falls_back_instead_of_crashing(monkeypatch):
    from comfyui_sage_rdna4.kernels import registry
    backend = registry.get_backend("reference")

    def boom(*a, **k):
        raise RuntimeError("device lost")
    monkeypatch.setattr(backend, "launch", boom)
    ov, to = make()
    q, k, v = bnhd()
    out = wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    assert out.shape == q.shape
    assert list(ov.stats.snapshot()["fallbacks"]) == ["reference failed: RuntimeError: device lost"]


def test_malformed_call_falls_back():
    ov, to = make()
    q, k, v = bnhd()
    out = wrap_attn_call(ov, lambda *a, **kw: "site", transformer_options=to)
    assert out == "site"
    assert "unrecognised attention call" in next(iter(ov.stats.snapshot()["fallbacks"]))


@pytest.mark.parametrize("mask, rule", [
    (torch.ones(96, 96, dtype=torch.int64), "mask dtype int64"),
    (torch.ones(96, 96, dtype=torch.uint8), "mask dtype uint8"),
    (torch.ones(96, 96, dtype=torch.complex64), "mask dtype complex64"),
    (torch.zeros(96), "mask of 1 dims"),
])
def test_a_mask_the_kernels_cannot_read_goes_to_the_call_site_counted(mask, rule):
    """The same rule as the public API (call_spec.check_shapes): an integer or complex mask, or a 1-D one, is a
    malformed call; the call site's own attention gets it unchanged (to accept or reject), and the reason is counted."""
    ov, to = make()
    q, k, v = bnhd()
    before = marker_attention.calls
    out = wrap_attn_call(ov, marker_attention, q, k, v, 4, mask=mask, transformer_options=to)
    assert out == "call site" and marker_attention.calls == before + 1
    snap = ov.stats.snapshot()
    (reason,) = snap["fallbacks"]
    assert reason.startswith("malformed call: ") and rule in reason, reason
    assert snap["calls"] == {}


class TinyAttentionModel(torch.nn.Module):
    """One attention block calling attention as ComfyUI's blocks do: through wrap_attn, with transformer_options."""

    def __init__(self, dim=64, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, transformer_options):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(wrap_attn(comfy_attention)(q, k, v, self.heads, transformer_options=transformer_options))


def _grads(model, x, to):
    model.zero_grad()
    model(x, to).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kernel", ["triton_int8_fp8", "reference"])
def test_training_through_the_override_gets_the_call_sites_gradients(kernel):
    """ComfyUI ships LoRA training nodes: an attention call under autograd goes to the call site's exact attention
    (the quantized kernels give no gradient, or a wrong one), and the reason is counted."""
    torch.manual_seed(0)
    model, x = TinyAttentionModel(), torch.randn(2, 32, 64)
    expected = _grads(model, x, {})
    ov, to = make(kernel)
    got = _grads(model, x, to)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    snap = ov.stats.snapshot()
    (reason,) = snap["fallbacks"]
    assert reason.startswith(f"{kernel}: ") and "requires grad" in reason, reason
    assert snap["fallbacks"][reason] == 1 and snap["calls"] == {}


def test_an_inference_call_of_the_same_signature_still_runs_the_kernel():
    """Grad mode is part of a call's signature: the plan made for an autograd call does not serve inference calls of
    the same shapes, nor the other way round."""
    torch.manual_seed(0)
    model, x = TinyAttentionModel(), torch.randn(2, 32, 64)
    ov, to = make("reference")
    with torch.no_grad():
        model(x, to)
    _grads(model, x, to)
    with torch.no_grad():
        model(x, to)
    snap = ov.stats.snapshot()
    assert snap["calls"] == {"reference": 2} and sum(snap["fallbacks"].values()) == 1, snap


def test_deepcopy_keeps_the_same_override():
    ov, to = make()
    assert copy.deepcopy({"transformer_options": to})["transformer_options"]["optimized_attention_override"] is ov


def test_bind_attention_args():
    a = bind_attention_args((1, 2, 3), {"heads": 8, "mask": "m", "transformer_options": {}})
    assert (a.q, a.heads, a.mask, a.skip_reshape) == (1, 8, "m", False)
    with pytest.raises(TypeError):
        bind_attention_args((1, 2), {})


@pytest.mark.parametrize("kwargs", [{}, {"mask": "m", "skip_reshape": True, "transformer_options": {}},
                                    {"attn_precision": "fp32", "skip_output_reshape": True, "scale": 0.5}])
def test_bind_attention_args_four_positional_is_the_general_binding(kwargs):
    """Four positional arguments (ComfyUI's own calls) take a shortcut: the same binding as the general path."""
    fast = bind_attention_args((1, 2, 3, 4), kwargs)
    general = bind_attention_args((1, 2, 3), dict(kwargs, heads=4))
    assert fast == general


# -- why auto passed a backend over (issue 12 §3) ---------------------------------------------------

def _prefer(monkeypatch, *names):
    from comfyui_sage_rdna4.kernels import registry
    monkeypatch.setattr(registry, "auto_order", lambda call: list(names))


def test_auto_records_why_a_preferred_backend_did_not_run(monkeypatch, caplog):
    """hip_int8_fp8 cannot run on the CPU; auto takes the next one. The reason is kept, counted, logged once."""
    from comfyui_sage_rdna4.kernels.registry import get_backend
    _prefer(monkeypatch, "hip_int8_fp8", "reference")
    ov, to = make("auto")
    q, k, v = bnhd(n=32)
    with caplog.at_level("INFO", logger="sage_rdna4"):
        for _ in range(3):
            wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    snap = ov.stats.snapshot()
    reason = get_backend("hip_int8_fp8").unavailable("cpu", None)
    assert reason
    assert snap["calls"] == {"reference": 3} and snap["fallbacks"] == {}
    assert snap["passed_over"] == {"hip_int8_fp8": {reason: 3}}
    logged = [r for r in caplog.records if "passes over hip_int8_fp8" in r.getMessage()]
    assert len(logged) == 1 and reason in logged[0].getMessage() and "reference" in logged[0].getMessage()
    assert f"auto passed over hip_int8_fp8 on 3 calls: {reason}" in ov.stats.summary()
    assert "3 attention calls" in ov.stats.summary()  # a skip is not a call of its own


def test_a_failed_self_check_is_recorded_as_the_reason(monkeypatch, caplog):
    """A self-check failure reaches auto as the reason Backend.disable stored; it is kept and logged as a warning."""
    from comfyui_sage_rdna4.kernels.registry import get_backend
    hip = get_backend("hip_int8_fp8")
    monkeypatch.setattr(hip, "_disabled", {})
    hip.disable("cpu", None, "hip_int8_fp8 disabled on cpu: self-check failed: NaN in case D128 fp16")
    _prefer(monkeypatch, "hip_int8_fp8", "reference")
    ov, to = make("auto")
    q, k, v = bnhd(n=32)
    with caplog.at_level("INFO", logger="sage_rdna4"):
        wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
        wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    snap = ov.stats.snapshot()
    assert snap["passed_over"] == {"hip_int8_fp8": {"hip_int8_fp8 disabled on cpu: self-check failed: NaN in case "
                                                "D128 fp16": 2}}
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "self-check failed" in r.getMessage()]
    assert len(warned) == 1


def test_each_backend_and_reason_is_kept_apart_and_a_fallback_keeps_them_too(monkeypatch):
    """Two backends passed over, then nothing quantized left: the call falls back, and both reasons are kept."""
    _prefer(monkeypatch, "hip_int8_fp8", "hip_int8_fp16", "sdpa")
    ov, to = make("auto")
    q, k, v = bnhd(n=32)
    comfy_attention.calls = 0
    wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    snap = ov.stats.snapshot()
    assert comfy_attention.calls == 1 and sum(snap["fallbacks"].values()) == 1 and snap["calls"] == {}
    assert set(snap["passed_over"]) == {"hip_int8_fp8", "hip_int8_fp16"}
    assert all(list(r.values()) == [1] for r in snap["passed_over"].values())


def test_an_explicit_kernel_records_no_skips():
    ov, to = make("reference")
    q, k, v = bnhd(n=32)
    wrap_attn_call(ov, comfy_attention, q, k, v, 4, transformer_options=to)
    assert ov.stats.snapshot()["passed_over"] == {}
