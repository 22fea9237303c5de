"""The self-check's warm-up (kernels/backends/triton/precompile.py): its cases' Triton kernels are collected by one
pass that runs nothing, then compiled side by side, before the checks run. On the CPU: the collection (it sees every
kernel the checks launch, in this thread only), the concurrent submission (a stand-in for Triton's compile), and that
no warm-up failure becomes a verdict. The seconds it saves need a GPU: tools/first_use_cost.py."""
import dataclasses
import importlib
import threading

import pytest
import torch

pytest.importorskip("triton")

from comfyui_sage_rdna4.kernels.backends.triton import launcher, precompile  # noqa: E402
from comfyui_sage_rdna4.kernels.call_spec import describe_call  # noqa: E402
from comfyui_sage_rdna4.kernels.registry import get_backend  # noqa: E402
from comfyui_sage_rdna4.kernels.verify.compile_keys import CompileKeys, compile_key  # noqa: E402

sc = importlib.import_module("comfyui_sage_rdna4.kernels.self_check")
ACCURATE = sc.Variant("triton", "token", True, False)


class Exploding:
    """A kernel stand-in that fails the test if it is ever launched."""
    def __getitem__(self, grid):
        raise AssertionError("launched while collecting")


def test_collecting_runs_nothing_and_only_in_its_own_thread():
    fn, seen = Exploding(), []

    def other_thread():
        class Runs:
            def __getitem__(self, grid):
                return lambda *a, **k: seen.append(("ran", grid, a))
        launcher.launch(Runs(), (2, 1), (7,), {}, None)

    def run():
        launcher.launch(fn, [3, 4], [1, 2], {"X": 1}, None)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    launches = precompile.collect_launches(run)
    assert launches == [(fn, (3, 4), (1, 2), {"X": 1})]
    assert seen == [("ran", (2, 1), (7,))]  # another thread's launch ran while this one collected
    assert launcher.COLLECTING.get() is None


def test_the_collecting_pass_sees_every_kernel_the_checks_compile():
    """The warm-up's one call per case collects the very compile keys the self-check's own calls launch."""
    backend = get_backend("triton_int8_fp8")
    like = dataclasses.replace(describe_call(*[torch.zeros(1, 1, 1, 64)] * 3), device_type="cuda", device_index=0,
                               arch="sm_90")
    cases = [c for c in sc.DEFAULT_CASES if backend.refuse(sc.case_call(c, like, ACCURATE)) is None]
    attention = sc.backend_attention(backend, ACCURATE)
    launches = precompile.collect_launches(lambda: sc.call_each(attention, cases, "cpu"))
    collected = {compile_key(fn, args, meta) for fn, grid, args, meta in launches}
    with CompileKeys() as keys:  # the same calls, launched (recorded) as the checks launch them
        for case in cases:
            sc.call_case(attention, case, "cpu")
    assert collected == set(keys.distinct()) and len(collected) >= 15


def test_kernels_are_compiled_side_by_side_under_tritons_async_mode(monkeypatch):
    from triton.runtime import _async_compile

    class FakeJit:
        def __init__(self):
            self.calls = []

        def warmup(self, *args, grid, **meta):
            self.calls.append((args, grid, meta, _async_compile.active_mode.get() is not None))

    monkeypatch.setattr(precompile, "JITFunction", FakeJit)
    a, b = FakeJit(), FakeJit()
    submitted = precompile.compile_concurrently([(a, (1,), (5, 6), {"N": 1}), (Exploding(), (1,), (), {}),
                                                 (b, (2, 3), (), {"num_warps": 4})], workers=3)
    assert submitted == 2  # the stand-in that is no JITFunction is left alone
    assert a.calls == [((5, 6), (1,), {"N": 1}, True)] and b.calls == [((), (2, 3), {"num_warps": 4}, True)]


def test_a_failed_warm_up_is_no_verdict():
    """A warm-up that cannot compile (here: no GPU driver for Triton's path) says why and raises nothing; a case
    whose call raises during the warm-up is judged by its own check."""
    backend = get_backend("triton_int8_fp16")
    case = sc.DEFAULT_CASES[0]
    result = precompile.warm_up(lambda: sc.call_each(sc.backend_attention(backend, ACCURATE), [case], "cpu"))
    assert result.launches >= 3 and result.error  # collected, then Triton's compile path had no device

    ref = sc.backend_attention(get_backend("reference"), sc.Variant("auto", "token", True, False))
    calls = []

    def attention(q, k, v, is_causal=False, **kw):
        calls.append(q.shape)
        if len(calls) == 1:
            raise RuntimeError("planted: the warm-up's call fails")
        return ref(q, k, v, is_causal=is_causal, **kw)
    attention.warm_up = lambda run: (run(), "warmed")[1]
    small = sc.Case("small", "peaked", torch.float16, 64, 1, 2, 2, 70, 90)
    res = sc.run_self_check(attention, "cpu", [small])
    assert res.passed and res.warm_up == "warmed" and len(calls) == 3  # warm-up once, then the check's two calls


def test_the_warm_up_runs_each_accepted_case_once_before_any_check():
    ref = sc.backend_attention(get_backend("reference"), sc.Variant("auto", "token", True, False))
    order = []

    def attention(q, k, v, is_causal=False, **kw):
        order.append(("call", tuple(q.shape)))
        return ref(q, k, v, is_causal=is_causal, **kw)

    def warm_up(run):
        order.append("warm-up")
        run()
        order.append("warmed")
    attention.warm_up = warm_up
    cases = [sc.Case("a", "peaked", torch.float16, 64, 1, 2, 2, 70, 90),
             sc.Case("b", "peaked", torch.bfloat16, 64, 1, 2, 2, 40, 50, return_lse=True),  # declined
             sc.Case("c", "diffuse", torch.float16, 64, 1, 4, 2, 30, 60)]
    res = sc.run_self_check(attention, "cpu", cases)
    assert res.passed and [c.name for c in res.skipped] == ["b"]
    assert order[:4] == ["warm-up", ("call", (1, 2, 70, 64)), ("call", (1, 4, 30, 64)), "warmed"]
    assert len(order) == 4 + 2 * 2  # then each check's two calls


def test_the_warm_up_is_off_under_the_interpreter_and_with_its_setting(monkeypatch):
    backend = get_backend("triton_int8_fp8")
    ran = []
    monkeypatch.setenv("SAGE_RDNA4_TRITON_PRECOMPILE", "0")
    assert backend.warm_up(lambda: ran.append(1)) is None and ran == []
    monkeypatch.setenv("SAGE_RDNA4_TRITON_PRECOMPILE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.warm_up(lambda: ran.append(1)) is None and ran == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    result = backend.warm_up(lambda: ran.append(1))
    assert ran == [1] and result.launches == 0 and result.submitted == 0 and not result.error
