"""The override's per-signature plans (issue 11 item 2): a call whose signature was seen before skips
describing the call and asking the backends again, and must end exactly where the uncached path ends.

Proven by counting calls to describe_call / settled_route, never by timing."""
import importlib

import pytest
import torch

from comfyui_sage_rdna4.kernels import registry
from comfyui_sage_rdna4.kernels.dispatch import settled_route
from comfyui_sage_rdna4.kernels.gating import Verdicts
from comfyui_sage_rdna4.kernels.routing import REFUSE, RUN
from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride, call_plans, layouts
from comfyui_sage_rdna4.sage_patch import override as override_mod
from comfyui_sage_rdna4.sage_patch.call_plans import PlanCache
from fakes import FakeBackend


def site(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """ComfyUI's attention_pytorch contract; counts its calls."""
    site.calls += 1
    if not skip_reshape:
        b, _, width = q.shape
        q, k, v = (t.view(b, -1, heads, width // heads).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if skip_output_reshape:
        return out
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


site.calls = 0


def call(ov, q, k=None, v=None, heads=2, **kwargs):
    k = q if k is None else k
    v = q if v is None else v
    to = kwargs.pop("transformer_options", {})
    to = dict(to, optimized_attention_override=ov)
    return ov(site, q, k, v, heads, transformer_options=to, _inside_attn_wrapper=True, **kwargs)


@pytest.fixture
def counted(monkeypatch):
    """Counts of describe_call and settled_route made by the override's planner (call_plans.make_plan)."""
    counts = {"describe": 0, "choose": 0}
    real_describe, real_choose = call_plans.describe_call, call_plans.settled_route

    def describe(*a, **k):
        counts["describe"] += 1
        return real_describe(*a, **k)

    def choose(*a, **k):
        counts["choose"] += 1
        return real_choose(*a, **k)
    monkeypatch.setattr(call_plans, "describe_call", describe)
    monkeypatch.setattr(call_plans, "settled_route", choose)
    return counts


@pytest.fixture
def uncached(monkeypatch):
    """Turn the plan cache off: every call takes the path it took before plans existed."""
    def off():
        monkeypatch.setattr(PlanCache, "get", lambda self, key: None)
    return off


def x(n=32, width=64, seed=0, dtype=torch.float32):
    return torch.randn(1, n, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- a repeated signature is decided once -----------------------------------------------------------------

def test_a_repeated_signature_is_described_and_decided_once(counted):
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    q = x()
    outs = [call(ov, q) for _ in range(5)]
    assert counted == {"describe": 1, "choose": 1}
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert ov.stats.snapshot()["calls"] == {"reference": 5}


def test_the_backend_is_not_asked_again_on_a_hit(monkeypatch):
    """The backend's answer (`ready`: why_not and the self-check on a GPU) is kept by the plan: asked once."""
    backend = registry.get_backend("reference")
    asked = []
    real = backend.why_not
    monkeypatch.setattr(backend, "why_not", lambda c: asked.append(1) or real(c))
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    q = x()
    for _ in range(4):
        call(ov, q)
    assert len(asked) == 1 and ov.stats.snapshot()["calls"] == {"reference": 4}


@pytest.mark.parametrize("kernel", ["reference", "sdpa", "auto", "hip_int8_fp8"])
def test_the_plan_is_the_uncached_decision(kernel):
    ov = SageAttentionOverride(PatchConfig(kernel=kernel))
    q = x()
    call(ov, q)
    call(ov, q)
    (plan,) = ov.plans._plans.values()
    qh = q.view(1, -1, 2, 32).transpose(1, 2)
    fresh = call_plans.describe_call(qh, qh, qh, smooth_k=True, prologue="auto", qk_group="token", smooth_v=False,
                                       out_nhd=True)  # the call site reshapes its output
    assert plan.call == fresh
    route = settled_route(fresh, kernel, quantized_only=True)
    assert plan.route == route and route.final
    backend = route.backend
    reason = backend.why_not(fresh) if backend is not None else "none"
    assert (route.kind == RUN) == (reason is None)
    if reason and backend is not None:
        assert route.kind == REFUSE and route.reason == reason and route.kernel == backend.name
    if backend is None:
        assert route.kind == REFUSE and route.kernel == "auto" and route.reason.startswith("auto: no quantized")


SEQUENCE = [  # (kernel, calls): signatures repeated, changed, and calls each path ends differently
    ("reference", ["a", "a", "b", "a", "mask", "mask", "gqa_without_flag", "a"]),
    ("hip_int8_fp8", ["a", "a", "b"]),            # cannot run here: a fallback with its reason, every call
    ("auto", ["a", "b", "a"]),                     # nothing quantized on the CPU: counted fallbacks
    ("sdpa", ["a", "hnd", "hnd", "a"]),
]


def _run(kernel, names):
    ov = SageAttentionOverride(PatchConfig(kernel=kernel))
    a, b = x(seed=1), x(n=48, seed=2)
    hnd = x(seed=3).view(1, -1, 2, 32).transpose(1, 2)
    kv = x(seed=4)[..., :32]
    outs = []
    for name in names:
        if name == "a":
            outs.append(call(ov, a))
        elif name == "b":
            outs.append(call(ov, b))
        elif name == "mask":
            outs.append(call(ov, a, mask=torch.zeros(32, 32)))
        elif name == "gqa_without_flag":
            outs.append(call(ov, a, kv, kv))
        elif name == "hnd":
            outs.append(call(ov, hnd, skip_reshape=True))
    return outs, ov.stats.snapshot()


@pytest.mark.parametrize("kernel,names", SEQUENCE)
def test_outputs_and_stats_are_those_of_the_uncached_path(kernel, names, uncached):
    cached_outs, cached_stats = _run(kernel, names)
    uncached()
    plain_outs, plain_stats = _run(kernel, names)
    assert cached_stats == plain_stats
    assert all(torch.equal(c, p) for c, p in zip(cached_outs, plain_outs))


# -- what makes a plan miss --------------------------------------------------------------------------------

def test_a_change_of_shape_stride_dtype_mask_or_heads_misses(counted):
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    q = x()
    strided = torch.randn(1, 64, 64)[:, ::2]  # same shape, other strides
    assert strided.shape == q.shape and strided.stride() != q.stride()
    variants = [
        lambda: call(ov, q),
        lambda: call(ov, x(n=40)),                           # shape
        lambda: call(ov, strided),                           # strides
        lambda: call(ov, q.to(torch.bfloat16)),              # dtype
        lambda: call(ov, q, mask=torch.zeros(32, 32)),       # a mask
        lambda: call(ov, q, mask=torch.zeros(32, 32, dtype=torch.bool)),  # another mask kind
        lambda: call(ov, q, heads=4),                        # heads
    ]
    for i, run in enumerate(variants, 1):
        run()
        assert counted["describe"] == i
    for run in variants:  # every one of them is known now
        run()
    assert counted["describe"] == len(variants)
    assert ov.stats.snapshot()["calls"] == {"reference": 2 * len(variants)}


def test_disable_invalidates_the_plan(monkeypatch, counted):
    """A backend taken out of service (what its failed self-check does) is never served from a plan."""
    ref = registry.get_backend("reference")
    monkeypatch.setattr(ref, "_disabled", {})
    monkeypatch.setattr(registry, "auto_order", lambda c: ["reference", "sdpa"])
    ov = SageAttentionOverride(PatchConfig(kernel="auto"))
    q = x()
    call(ov, q)
    call(ov, q)
    assert ov.stats.snapshot()["calls"] == {"reference": 2} and counted["choose"] == 1
    before = registry.decision_generation()
    ref.disable("cpu", None, "reference disabled on cpu: self-check failed: planted")
    assert registry.decision_generation() != before
    site.calls = 0
    call(ov, q)
    call(ov, q)
    snap = ov.stats.snapshot()
    assert counted["choose"] == 2  # decided again once, then the new plan serves
    assert snap["calls"] == {"reference": 2} and site.calls == 2
    assert snap["passed_over"] == {"reference": {"reference disabled on cpu: self-check failed: planted": 2}}
    assert sum(snap["fallbacks"].values()) == 2


def test_a_failed_self_check_verdict_invalidates_plans():
    """A verdict that refuses only some options (no disable) changes decisions too."""
    sc = importlib.import_module("comfyui_sage_rdna4.kernels.self_check")  # `kernels.self_check` is a function

    def broken(q, k, v, is_causal=False, return_lse=False):
        raise RuntimeError("planted")

    backend = FakeBackend("fake_int8")
    check = Verdicts(cases=(sc.Case("tiny", "peaked", torch.float16, 64, 1, 1, 1, 16, 16),))
    before = registry.decision_generation()
    reason = check.ensure(backend, "cpu", None, broken, variant=sc.Variant("triton", "block64", True, False))
    assert reason and backend.unavailable("cpu", None) is None  # these options refused, the backend not disabled
    assert registry.decision_generation() != before


# -- what a plan must not hold: per-call policies -------------------------------------------------------------

def schedule(steps):
    """A descending schedule ending in 0, as KSampler passes `sample_sigmas`."""
    return torch.cat([torch.linspace(14.6, 0.03, steps), torch.zeros(1)])


def options(sched, step, block, total):
    """transformer_options of one call at `step` in block `block` of `total`."""
    return {"sample_sigmas": sched, "sigmas": torch.full((1,), float(sched[step])), "block_index": block,
            "total_blocks": total}


def test_step_range_and_block_policies_apply_on_every_hit(counted):
    cfg = PatchConfig(kernel="reference", step_start=0.25, step_end=0.75, exact_blocks="1, last 1")
    ov = SageAttentionOverride(cfg)
    q = x()
    sched = schedule(4)
    for step in range(4):
        for block in range(4):
            call(ov, q, transformer_options=options(sched, step, block, 4))
    snap = ov.stats.snapshot()
    # steps 1 and 2 are in range; there blocks 0 and 2 are quantized (1 and the last stay exact).
    assert snap["calls"] == {"reference": 4}
    assert snap["routed"] == {"outside step range 0.25-0.75": 8, "block 1 kept exact": 2, "block 3 kept exact": 2}
    assert counted["describe"] == 1  # one signature: the policies ran per call, the decision once


def test_scale_and_low_precision_are_read_per_call():
    ov = SageAttentionOverride(PatchConfig(kernel="sdpa"))
    q = x()
    plain = call(ov, q)
    scaled = call(ov, q, scale=0.01)
    assert not torch.equal(plain, scaled)
    hnd = q.view(1, -1, 2, 32).transpose(1, 2)
    want = torch.nn.functional.scaled_dot_product_attention(hnd, hnd, hnd, scale=0.01)
    torch.testing.assert_close(scaled, want.transpose(1, 2).reshape(1, 32, 64))
    site.calls = 0
    call(ov, q, low_precision_attention=False)
    assert site.calls == 1 and ov.stats.snapshot()["routed"] == {"low_precision_attention=False": 1}


def test_enable_gqa_is_read_per_call():
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    q, kv = x(), x(seed=1)[..., :32]
    call(ov, q, kv, kv, enable_gqa=True)
    call(ov, q, kv, kv)  # the same signature without the flag is the call site's to judge
    snap = ov.stats.snapshot()
    assert snap["calls"] == {"reference": 1}
    assert list(snap["fallbacks"]) == ["malformed call: k/v have 1 heads, q 2, without enable_gqa"]


# -- the cache itself ---------------------------------------------------------------------------------------------

def test_not_tensors_are_not_cached_and_still_reported():
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    out = ov(lambda *a, **k: "site", "q", "k", "v", 2, transformer_options={})
    assert out == "site" and len(ov.plans) == 0
    assert next(iter(ov.stats.snapshot()["fallbacks"])).startswith("malformed call")
    assert layouts.AttentionArgs(1, 2, 3, 2).signature() is None


def test_the_cache_keeps_at_most_its_bound():
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    ov.plans.max_entries = 3
    for n in range(8, 14):
        call(ov, x(n=n))
    assert len(ov.plans) == 3


def test_a_stale_plan_is_replaced(counted):
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    q = x()
    call(ov, q)
    registry.invalidate_decisions()
    call(ov, q)
    call(ov, q)
    assert counted["describe"] == 2 and len(ov.plans) == 1


# -- the hit path's shortcuts (second pass): each proven by counting calls, outputs equal to the slow path ------

def test_a_hit_remakes_the_views_with_as_strided_at_the_tensors_own_offset(monkeypatch, uncached):
    """Fused qkv projections hand q, k, v as slices of one tensor: same shapes and strides, other storage offsets.
    A hit's as_strided views must read each tensor's own elements, as the miss's view + transpose did."""
    def slices(seed):
        qkv = torch.randn(1, 32, 3 * 64, generator=torch.Generator().manual_seed(seed))
        return qkv[..., :64], qkv[..., 64:128], qkv[..., 128:]

    def run():
        ov = SageAttentionOverride(PatchConfig(kernel="reference"))
        return [call(ov, *slices(seed)) for seed in (1, 2, 3)]

    views = {"n": 0}
    real_views = layouts.hnd_views

    def counted_views(*a):
        views["n"] += 1
        return real_views(*a)
    monkeypatch.setattr(layouts, "hnd_views", counted_views)
    cached = run()
    assert views["n"] == 1  # the miss only: both hits took strided_hnd
    uncached()
    plain = run()
    assert views["n"] == 4
    assert all(torch.equal(c, p) for c, p in zip(cached, plain))


def test_a_tensor_subclass_keeps_view_and_transpose(monkeypatch):
    class Sub(torch.Tensor):
        pass
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    plain, sub = x(), x().as_subclass(Sub)
    call(ov, plain)
    call(ov, sub)
    plans = list(ov.plans._plans.values())
    assert len(plans) == 2  # the class is part of the signature
    assert plans[0].strided is not None and plans[1].strided is None
    out_sub = call(ov, sub)  # a hit on the subclass' plan: views made as on the miss
    assert torch.equal(out_sub.as_subclass(torch.Tensor), call(ov, plain))


def test_no_policy_configured_asks_no_policy_per_call(monkeypatch):
    asked = {"n": 0}
    real = override_mod.CallPolicies.route_exact

    def route_exact(self, *a):
        asked["n"] += 1
        return real(self, *a)
    monkeypatch.setattr(override_mod.CallPolicies, "route_exact", route_exact)
    for cfg, per_call in ((PatchConfig(kernel="reference"), 0), (PatchConfig(kernel="reference", min_seq_len=1), 1),
                          (PatchConfig(kernel="reference", cross_attention="exact"), 1)):
        asked["n"] = 0
        ov = SageAttentionOverride(cfg)
        for _ in range(3):
            call(ov, x())
        assert asked["n"] == 3 * per_call
        assert ov.stats.snapshot()["calls"] == {"reference": 3}


def test_skips_are_counted_only_when_a_backend_was_passed_over(monkeypatch):
    recorded = []
    real = override_mod.PatchStats.record_passed_over

    def record_passed_over(self, passed_over, ran):
        recorded.append(dict(passed_over))
        return real(self, passed_over, ran)
    monkeypatch.setattr(override_mod.PatchStats, "record_passed_over", record_passed_over)
    ov = SageAttentionOverride(PatchConfig(kernel="reference"))
    for _ in range(3):
        call(ov, x())
    assert recorded == []  # an explicit kernel passes nothing over
    monkeypatch.setattr(registry, "auto_order", lambda c: ["hip_int8_fp8", "reference", "sdpa"])
    ov = SageAttentionOverride(PatchConfig(kernel="auto"))
    for _ in range(3):
        call(ov, x())
    passed_over = ov.stats.snapshot()["passed_over"]
    assert len(recorded) == 3 and recorded[0] and all(r == recorded[0] for r in recorded)
    assert list(passed_over) == ["hip_int8_fp8"] and all(n == 3 for n in passed_over["hip_int8_fp8"].values())
    assert ov.stats.snapshot()["calls"] == {"reference": 3}
