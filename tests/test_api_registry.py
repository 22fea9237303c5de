"""The public API and the registry: explicit kernels never get answered by another backend."""
import threading
import time

import pytest
import torch

from comfyui_sage_rdna4.kernels import (
    BACKEND_NAMES,
    KernelRefused,
    available_backends,
    registry,
    routing,
    sage_attention,
)
from comfyui_sage_rdna4.kernels.call_spec import describe_call
from comfyui_sage_rdna4.kernels.metrics import cosine
from comfyui_sage_rdna4.kernels.reference import exact_attention
from fakes import FakeBackend


def qkv(b=1, h=2, n=64, d=64, dtype=torch.float16, hkv=None):
    g = torch.Generator().manual_seed(0)
    hkv = hkv or h
    return (torch.randn(b, h, n, d, generator=g).to(dtype), torch.randn(b, hkv, n, d, generator=g).to(dtype),
            torch.randn(b, hkv, n, d, generator=g).to(dtype))


def test_available_backends_names_every_backend_with_a_reason_or_none():
    avail = available_backends("cpu")
    assert set(avail) == set(BACKEND_NAMES)
    assert avail["reference"] is None and avail["sdpa"] is None
    for name in ("hip_int8_fp8", "hip_int8_fp16", "comfy_kitchen", "sageattention"):
        assert isinstance(avail[name], str) and avail[name], name  # a reason, not a silent False


def test_explicit_reference_runs_and_matches_exact():
    q, k, v = qkv()
    out = sage_attention(q, k, v, kernel="reference")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert cosine(out, exact_attention(q, k, v)[0]) > 0.998


def test_explicit_unavailable_kernel_raises_with_its_reason():
    q, k, v = qkv()
    with pytest.raises(KernelRefused) as err:
        sage_attention(q, k, v, kernel="hip_int8_fp8")
    assert err.value.backend == "hip_int8_fp8"
    assert err.value.reason == registry.get_backend("hip_int8_fp8").why_not(describe_call(q, k, v))


def test_sdpa_refuses_lse_and_auto_moves_on():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(KernelRefused, match="log-sum-exp"):
        sage_attention(q, k, v, kernel="sdpa", return_lse=True)
    out, lse = sage_attention(q, k, v, kernel="auto", return_lse=True)
    assert lse.shape == (1, 2, 64)
    torch.testing.assert_close(lse, exact_attention(q, k, v, return_lse=True)[1], atol=0.05, rtol=0)


def test_auto_on_cpu_is_sdpa():
    q, k, v = qkv()
    route = routing.route(describe_call(q, k, v), "auto")
    assert route.kind == routing.RUN and route.backend.name == "sdpa" and route.decision is None
    assert route.reason == "auto: no quantized kernel takes this call (none is built for cpu)"


def test_quantized_only_selection_says_why_exact_attention_runs():
    q, k, v = qkv()
    route = routing.route(describe_call(q, k, v), "auto", quantized_only=True)
    assert route.kind == routing.REFUSE and route.backend is None and route.decision is None
    assert route.kernel == "auto" and route.reason.startswith("auto: no quantized kernel takes this call")


def test_explicit_kernel_selection_carries_its_refusal():
    q, k, v = qkv()
    call = describe_call(q, k, v)
    route = routing.route(call, "hip_int8_fp8")
    reason = registry.get_backend("hip_int8_fp8").why_not(call)
    assert route.kind == routing.REFUSE and route.backend.name == route.kernel == "hip_int8_fp8"
    assert reason and route.reason == reason and route.message == f"hip_int8_fp8: {reason}"
    assert routing.route(call, "reference").kind == routing.RUN


def test_kernel_refused_names_the_backend_once():
    plain = KernelRefused("triton_int8_fp8", "head_dim 512 above 256")
    assert str(plain) == "triton_int8_fp8: head_dim 512 above 256"
    named = KernelRefused("triton_int8_fp8", "triton_int8_fp8: head_dim 512 above 256")
    assert str(named) == "triton_int8_fp8: head_dim 512 above 256"
    disabled = KernelRefused("hip_int8_fp8", "hip_int8_fp8 disabled on cuda:0: self-check failed (x)")
    assert str(disabled).count("hip_int8_fp8") == 1
    assert named.reason == "triton_int8_fp8: head_dim 512 above 256" and named.backend == "triton_int8_fp8"


def test_nhd_layout_matches_hnd():
    q, k, v = qkv()
    hnd = sage_attention(q, k, v, kernel="reference")
    nhd = sage_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), tensor_layout="NHD",
                         kernel="reference")
    torch.testing.assert_close(nhd.transpose(1, 2), hnd)


def test_gqa_through_the_api():
    q, k, v = qkv(h=4, hkv=2, dtype=torch.float32)
    out = sage_attention(q, k, v, kernel="sdpa")
    ref = sage_attention(q, k, v, kernel="reference")
    assert cosine(out, ref) > 0.998


def test_causal_with_mask_on_sdpa_backend():
    q, k, v = qkv(dtype=torch.float32)
    mask = torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) > 0.2
    mask.fill_diagonal_(True)
    out = sage_attention(q, k, v, kernel="sdpa", is_causal=True, attn_mask=mask)
    exact, _ = exact_attention(q, k, v, is_causal=True, attn_mask=mask)
    torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bad", [
    dict(tensor_layout="BHSD"), dict(kernel="flash9"), dict(prologue="cuda"), dict(qk_group="block7")])
def test_bad_arguments_raise_value_error(bad):
    q, k, v = qkv()
    with pytest.raises(ValueError):
        sage_attention(q, k, v, **bad)


def test_malformed_shapes_raise_value_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="head_dim"):
        sage_attention(q, k[..., :32], v)
    with pytest.raises(ValueError, match="multiple"):
        sage_attention(q, k[:, :1].expand(1, 3, 64, 64), v[:, :1].expand(1, 3, 64, 64))
    with pytest.raises(ValueError, match="mask"):
        sage_attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.bool))


@pytest.mark.parametrize("kernel", ["auto", "sdpa", "reference"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.complex64])
def test_integer_and_complex_masks_are_refused_with_the_rule(kernel, dtype):
    """A 0/1 integer mask would be added as +0/+1 (torch SDPA refuses it); a complex one loses its imaginary part."""
    q, k, v = qkv(n=16, dtype=torch.float32)
    mask = torch.ones(16, 16, dtype=dtype)
    name = str(dtype).replace("torch.", "")
    with pytest.raises(ValueError, match=rf"mask dtype {name} .*bool .*selects.*floating.*adds"):
        sage_attention(q, k, v, attn_mask=mask, kernel=kernel)
    with pytest.raises(ValueError, match=rf"mask dtype {name}"):
        describe_call(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kernel", ["auto", "sdpa", "reference"])
@pytest.mark.parametrize("shape", [(16,), ()])
def test_a_mask_of_fewer_than_two_dims_is_refused_as_comfyui_and_sdpa_do(kernel, shape):
    """ComfyUI's attention gives a 2-D mask a batch dim and a 3-D one a heads dim, and hands anything else to SDPA,
    which fails on a (Nk,) mask inside torch: refused here, for every kernel, with the ranks accepted."""
    q, k, v = qkv(n=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"mask of {len(shape)} dims: .*2, 3 or 4"):
        sage_attention(q, k, v, attn_mask=torch.zeros(shape), kernel=kernel)


@pytest.mark.parametrize("kernel", ["auto", "sdpa", "reference"])
def test_head_dim_zero_is_refused_in_the_call_description(kernel):
    q, k, v = qkv(n=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dim 0"):
        sage_attention(q[..., :0], k[..., :0], v, kernel=kernel)


def test_autograd_calls_are_refused_by_every_quantized_backend_with_one_reason():
    """The quantized kernels are for inference: the Triton/HIP ones return no grad_fn and the reference's gradient is
    not attention's (dq 105-120 % off). An explicit quantized kernel raises with the reason; none runs the call."""
    q, k, v = qkv(n=16, dtype=torch.float32)
    q.requires_grad_(True)
    call = describe_call(q, k, v)
    assert call.requires_grad
    reasons = {name: registry.get_backend(name).why_not(call) for name in BACKEND_NAMES}
    quantized = [name for name in BACKEND_NAMES if registry.get_backend(name).quantized]
    assert set(quantized) == set(BACKEND_NAMES) - {"sdpa"}
    assert len({reasons[name] for name in quantized}) == 1 and "requires grad" in reasons["reference"], reasons
    assert reasons["sdpa"] is None
    for name in quantized:
        with pytest.raises(KernelRefused) as err:
            sage_attention(q, k, v, kernel=name)
        assert err.value.backend == name and err.value.reason == reasons[name]


def test_a_mask_that_requires_grad_makes_the_call_an_autograd_call():
    q, k, v = qkv(n=16, dtype=torch.float32)
    bias = torch.zeros(16, 16, requires_grad=True)
    with pytest.raises(KernelRefused, match="requires grad"):
        sage_attention(q, k, v, attn_mask=bias, kernel="reference")


def test_without_grad_mode_the_same_tensors_are_an_inference_call():
    q, k, v = qkv(n=16, dtype=torch.float32)
    q.requires_grad_(True)
    assert describe_call(q, k, v).requires_grad  # described (and kept) under grad mode first
    with torch.no_grad():
        assert not describe_call(q, k, v).requires_grad  # the kept description is not reused
        out = sage_attention(q, k, v, kernel="reference")
    assert out.grad_fn is None and cosine(out, exact_attention(q.detach(), k, v)[0]) > 0.998


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_exact_attention_keeps_serving_autograd_calls(kernel):
    q, k, v = (t.requires_grad_(True) for t in qkv(n=16, dtype=torch.float32))
    sage_attention(q, k, v, kernel=kernel).square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.nn.functional.scaled_dot_product_attention(q, k, v).square().sum().backward()
    for g, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_unsupported_dtype_refused_by_reference():
    q, k, v = qkv(dtype=torch.float64)
    with pytest.raises(KernelRefused, match="dtype"):
        sage_attention(q, k, v, kernel="reference")


def test_one_rule_used_by_dispatcher_and_wrapper(monkeypatch):
    # Accepts only head_dim 64: checks that dispatcher and wrapper apply the same rule.
    picky = FakeBackend("sdpa", refuse=lambda call: None if call.head_dim == 64 else
                        f"head_dim {call.head_dim} is not 64")
    monkeypatch.setitem(registry._REGISTRY, "sdpa", picky)
    q, k, v = qkv(d=32)
    call = describe_call(q, k, v)
    route = routing.route(call, "auto")
    assert route.backend is not picky
    assert route.passed_over["sdpa"] == "head_dim 32 is not 64"
    with pytest.raises(KernelRefused, match="head_dim 32 is not 64"):
        picky(q, k, v, call, 1.0)
    assert picky.runs == 0
    q, k, v = qkv(d=64)
    assert routing.route(describe_call(q, k, v), "auto").backend is picky


def test_every_backend_name_has_a_loader():
    """get_backend relies on it: importing the package registers a loader for every listed name."""
    assert set(registry._LOADERS) == set(BACKEND_NAMES)


def test_a_backend_that_fails_to_import_reports_why(monkeypatch):
    def broken():
        raise ImportError("libfoo.so not found")
    monkeypatch.setitem(registry._LOADERS, "sageattention", broken)
    monkeypatch.delitem(registry._REGISTRY, "sageattention", raising=False)
    reason = registry.get_backend("sageattention").unavailable("cpu", None)
    assert "libfoo.so not found" in reason
    monkeypatch.delitem(registry._REGISTRY, "sageattention", raising=False)


def test_disable_takes_a_backend_out_of_service(monkeypatch):
    b = registry.get_backend("reference")
    monkeypatch.setattr(b, "_disabled", {})
    b.disable("cpu", None, "self-check failed: cosine 0.2")
    q, k, v = qkv()
    with pytest.raises(KernelRefused, match="self-check failed"):
        sage_attention(q, k, v, kernel="reference")


@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "bool_mask", "float_mask"])
def test_sdpa_launch_shortcut_is_sdpa_hnd(case):
    """sdpa's launch calls torch directly when there is no mask and no head grouping; every case equals sdpa_hnd."""
    from comfyui_sage_rdna4.kernels.backends.sdpa import sdpa_hnd
    q, k, v = qkv(n=16, dtype=torch.float32, hkv=1 if case == "gqa" else None)
    mask = {"bool_mask": torch.rand(16, 16) > 0.3, "float_mask": torch.randn(16, 16)}.get(case)
    call = describe_call(q, k, v, attn_mask=mask, is_causal=case == "causal")
    out, lse = registry.get_backend("sdpa").launch(q, k, v, call, 0.125, mask)
    assert lse is None
    assert torch.equal(out, sdpa_hnd(q, k, v, 0.125, mask, is_causal=case == "causal"))


def test_the_first_get_backend_from_many_threads_makes_one_instance(monkeypatch):
    """16 threads ask at once for a backend whose loader is slow: one instance, one load, so its first-use
    self-check runs once (not once per instance)."""
    loads = []

    def slow_loader():
        loads.append(threading.current_thread().name)
        time.sleep(0.2)  # long enough for every thread to reach get_backend while the first one loads
        return FakeBackend("sageattention")

    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_LOADERS", {**registry._LOADERS, "sageattention": slow_loader})
    start = threading.Barrier(16)
    got = []

    def ask():
        start.wait()
        got.append(registry.get_backend("sageattention"))

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 16 and all(b is got[0] for b in got), f"{len({id(b) for b in got})} instances"
    assert len(loads) == 1, f"the loader ran {len(loads)} times"
    assert registry.get_backend("sageattention") is got[0] and len(loads) == 1  # later calls: the same, no load


def test_sdpa_asks_for_comfyuis_implementation_order_on_a_gpu():
    """On a GPU the sdpa backend runs SDPA with cuDNN's implementation first, as ComfyUI's own attention does
    (torch's default puts it last: on the H200 that cost a Flux step 1.13x); on the CPU it changes nothing."""
    import types

    from torch.nn.attention import SDPBackend

    from comfyui_sage_rdna4.kernels.backends import sdpa
    if sdpa._PRIORITY is None:
        pytest.skip("this torch cannot set SDPA's implementation order")
    order = torch._C._get_sdp_priority_order
    before = order()
    with sdpa._on_gpu_order(types.SimpleNamespace(is_cuda=True)):
        assert order()[0] == int(SDPBackend.CUDNN_ATTENTION) and order()[1] == int(SDPBackend.FLASH_ATTENTION)
    assert order() == before
    with sdpa._on_gpu_order(torch.zeros(1)):
        assert order() == before
