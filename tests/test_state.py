"""Memory and state (issue 6): patched calls and repeated patch/unpatch keep memory flat; two patched models
keep their own settings and stats; concurrent calls keep the stats consistent; copies of a patched model's
options share its override.

A stand-in ModelPatcher is used (fakes.FakePatcher: clone() deep-copies model_options, as ComfyUI's does); with
COMFYUI_PATH set, the real ModelPatcher too. `install.override_hook_missing` is stubbed where ComfyUI is absent.
"""
from __future__ import annotations

import copy
import gc
import threading
import tracemalloc
import weakref

import pytest
import torch

from comfyui_sage_rdna4.kernels.reference import reference_attention
from comfyui_sage_rdna4.sage_patch import PatchConfig, install
from fakes import FakePatcher, comfy_attention

HEADS, DIM = 2, 16


@pytest.fixture(autouse=True)
def comfy_hook_present(monkeypatch):
    monkeypatch.setattr(install, "override_hook_missing", lambda: None)


def call_through(model, q, k=None, v=None, **extra_options):
    """One attention call the way a model's block makes it: wrap_attn reads the merged transformer_options."""
    to = dict(model.model_options["transformer_options"], **extra_options)
    override = to["optimized_attention_override"]
    k = q if k is None else k
    v = q if v is None else v
    return override(comfy_attention, q, k, v, HEADS, transformer_options=to, _inside_attn_wrapper=True)


def tokens(n, seed=0, dtype=torch.float32):
    return torch.randn(1, n, HEADS * DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o))


class HostMemory:
    """Python heap (tracemalloc), gc-tracked objects and live tensors, before and after."""

    def __enter__(self):
        gc.collect()
        tracemalloc.start()
        self.t0 = tracemalloc.get_traced_memory()[0]
        self.objects0 = len(gc.get_objects())
        self.tensors0 = live_tensors()
        return self

    def __exit__(self, *exc):
        gc.collect()
        self.heap_growth = tracemalloc.get_traced_memory()[0] - self.t0
        tracemalloc.stop()
        self.object_growth = len(gc.get_objects()) - self.objects0
        self.tensor_growth = live_tensors() - self.tensors0
        print(f"heap +{self.heap_growth} B, gc objects +{self.object_growth}, tensors +{self.tensor_growth}")


def mixed_calls(model, n, schedule):
    """n calls mixing the kernel, a step-policy route, a short-call route and a refused dtype."""
    x, short, x64 = tokens(64), tokens(8, 1), tokens(64, 2, torch.float64)
    for i in range(n):
        step = (i // 10) % (schedule.numel() - 1)
        sigmas = schedule[step:step + 1].clone()  # a new tensor per model call, as calc_cond_batch makes
        kind = i % 4
        arg = short if kind == 2 else x64 if kind == 3 else x
        out = call_through(model, arg, sigmas=sigmas, sample_sigmas=schedule, block_index=i % 5, total_blocks=5)
        assert out.shape == arg.shape


def test_1000_patched_calls_keep_host_memory_flat():
    schedule = torch.linspace(10, 0, 9)
    patched, ov = install.patch_model(FakePatcher(), PatchConfig(kernel="reference", step_start=0.25,
                                                                 exact_blocks="last 1", min_seq_len=16))
    mixed_calls(patched, 100, schedule)  # warm-up: first-use caches, logging of each reason once
    with HostMemory() as mem:
        mixed_calls(patched, 1000, schedule)
    snap = ov.stats.snapshot()
    assert sum(snap["calls"].values()) + sum(snap["routed"].values()) + sum(snap["fallbacks"].values()) == 1100
    assert mem.tensor_growth <= 0
    assert mem.object_growth < 100
    assert mem.heap_growth < 64 * 1024


def test_10k_malformed_calls_of_distinct_widths_keep_and_log_a_bounded_set_of_reasons(caplog):
    """Every width gives its own reason text; the stats count them by kind (the text with its numbers taken out) past
    the first few, log each kind once, and keep a bounded set however many calls come."""
    from comfyui_sage_rdna4.sage_patch import stats as stats_mod

    patched, ov = install.patch_model(FakePatcher(), PatchConfig(kernel="reference"))
    widths = [3 * i + 1 for i in range(1, 10_001)]  # never a multiple of 3 heads: each call is malformed
    with caplog.at_level("WARNING", logger="sage_rdna4"):
        for w in widths:
            x = torch.zeros(1, 1, w)
            assert ov(lambda *a, **kw: "site", x, x, x, 3, transformer_options={}) == "site"
    snap = ov.stats.snapshot()
    assert sum(snap["fallbacks"].values()) == 10_000
    assert len(snap["fallbacks"]) <= stats_mod.MAX_REASONS + 1, len(snap["fallbacks"])
    kind = "malformed call: ValueError: q width # is not a multiple of heads=#"
    assert all(stats_mod.reason_kind(r).startswith(kind) for r in snap["fallbacks"]), list(snap["fallbacks"])[:3]
    logged = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert len(logged) == 1 and "q width 4 is not a multiple of heads=3" in logged[0].getMessage()
    assert len(ov.stats.summary().splitlines()) <= stats_mod.MAX_REASONS + 2


def test_reasons_past_the_bound_are_counted_and_the_summary_and_report_read_them():
    """The first texts of a kind are kept as they are (a user reads the numbers), later ones under their kind, and
    beyond MAX_REASONS keys the rest under one "other" key: counted, never dropped; keys never change, so the
    deltas the step timer and the A/B report take between two snapshots stay right."""
    from comfyui_sage_rdna4.sage_patch import stats as stats_mod
    from comfyui_sage_rdna4.sage_patch.report import format_report_text
    from comfyui_sage_rdna4.sage_patch.timing import _delta

    st = stats_mod.PatchStats("t")
    for i in range(20):
        st.record_fallback(f"hip_int8_fp8: head_dim {i} is not 64 or 128")
    before = st.snapshot()
    words = ["".join(chr(97 + (i // 26 ** j) % 26) for j in range(3)) for i in range(3 * stats_mod.MAX_REASONS)]
    for w in words:  # distinct kinds: no numbers to take out
        st.record_fallback(f"backend {w} refused")
        st.record_fallback(f"backend {w} refused")
    st.record_fallback("hip_int8_fp8: head_dim 3 is not 64 or 128")
    after = st.snapshot()
    fallbacks = after["fallbacks"]
    assert sum(fallbacks.values()) == 20 + 2 * len(words) + 1
    assert len(fallbacks) == stats_mod.MAX_REASONS + 1
    per_kind = stats_mod.TEXTS_PER_KIND
    assert [f"hip_int8_fp8: head_dim {i} is not 64 or 128" for i in range(per_kind)] == list(fallbacks)[:per_kind]
    assert fallbacks["hip_int8_fp8: head_dim 3 is not 64 or 128"] == 2  # a kept text keeps its own count
    assert fallbacks[stats_mod.reason_kind("hip_int8_fp8: head_dim 9 is not 64 or 128") + stats_mod.MORE] == \
        20 - per_kind
    other = fallbacks[stats_mod.OTHER]
    assert other == 2 * len(words) - 2 * (stats_mod.MAX_REASONS - per_kind - 1)
    assert all(before_n <= fallbacks[r] for r, before_n in before["fallbacks"].items())
    assert sum(_delta(after["fallbacks"], before["fallbacks"]).values()) == 2 * len(words) + 1
    assert f"fell back ({stats_mod.OTHER}): {other}" in st.summary()
    assert f"{other} x {stats_mod.OTHER}" in format_report_text({"fallbacks": fallbacks})


def test_repeated_patch_and_unpatch_free_everything():
    base = FakePatcher({"transformer_options": {"keep": 1}})
    before = copy.deepcopy(base.model_options)
    refs = []

    def cycle(i):
        patched, ov = install.patch_model(base, PatchConfig(kernel="reference", min_seq_len=i % 3))
        call_through(patched, tokens(32))
        refs.append(weakref.ref(ov))

    for i in range(20):
        cycle(i)
    with HostMemory() as mem:
        for i in range(300):
            cycle(i)
    assert base.model_options == before  # "unpatching" is dropping the clone: the input model never changed
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} overrides still alive after their patched models were dropped"
    # The 300 weakrefs kept in `refs` are gc objects themselves; beyond them, nothing may accumulate.
    assert mem.tensor_growth <= 0 and mem.object_growth - 300 < 100 and mem.heap_growth < 128 * 1024


@pytest.mark.comfyui
def test_real_model_patcher_patch_unpatch_frees_the_override():
    """ComfyUI's own ModelPatcher: clones share the override; dropping them frees it (and its step timer)."""
    import os
    import sys

    if os.environ["COMFYUI_PATH"] not in sys.path:
        sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    try:
        import comfy.model_patcher
    except ImportError as exc:
        pytest.skip(f"ComfyUI's dependencies are missing: {exc}")
    base = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))
    patched, ov = install.patch_model(base, PatchConfig(kernel="reference"))
    clone = patched.clone()
    assert install.find_override(clone) is ov and install.find_override(base) is None
    out = call_through(clone, tokens(32))
    assert out.shape == (1, 32, HEADS * DIM) and ov.stats.snapshot()["calls"] == {"reference": 1}
    ref = weakref.ref(ov)
    del patched, ov, clone
    gc.collect()
    assert ref() is None, "the override outlives every model patched with it (a leak per Patch node run)"


def test_two_patched_models_keep_their_own_settings_and_stats():
    base = FakePatcher()
    a, oa = install.patch_model(base, PatchConfig(kernel="reference", smooth_k=True))
    b, ob = install.patch_model(base, PatchConfig(kernel="reference", smooth_k=False, qk_group="block64",
                                                  min_seq_len=48))
    x, short = tokens(64, 3), tokens(32, 4)
    outs_a, outs_b = [], []
    for _ in range(3):  # interleaved, as two samplers in one graph would run them
        outs_a.append(call_through(a, x))
        outs_b.append(call_through(b, x))
        call_through(b, short)
        call_through(a, short)
    assert oa.stats.snapshot()["calls"] == {"reference": 6} and oa.stats.snapshot()["routed"] == {}
    assert ob.stats.snapshot()["calls"] == {"reference": 3}
    assert ob.stats.snapshot()["routed"] == {"short call (< 48 query tokens)": 3}
    # Each model's output is the spec under its own settings, bit for bit.
    qh = x.view(1, 64, HEADS, DIM).transpose(1, 2)
    for outs, kw in ((outs_a, dict(smooth_k=True)), (outs_b, dict(smooth_k=False, qk_group="block64"))):
        want, _ = reference_attention(qh, qh, qh, pv="fp8", **kw)
        want = want.transpose(1, 2).reshape(1, 64, HEADS * DIM)
        assert all(torch.equal(o, want) for o in outs)
    assert not torch.equal(outs_a[0], outs_b[0])
    assert oa.config.smooth_k and not ob.config.smooth_k


def test_copies_of_a_patched_models_options_share_its_override():
    patched, ov = install.patch_model(FakePatcher(), PatchConfig(kernel="reference"))
    options = copy.deepcopy(patched.model_options)
    assert options["transformer_options"][install.OVERRIDE_KEY] is ov
    assert copy.copy(ov) is not None
    clone = patched.clone().clone()
    assert install.find_override(clone) is ov
    call_through(clone, tokens(32))
    call_through(patched, tokens(32))
    assert ov.stats.snapshot()["calls"] == {"reference": 2}  # one patch, one set of stats


def test_concurrent_calls_keep_stats_consistent():
    patched, ov = install.patch_model(FakePatcher(), PatchConfig(kernel="reference", min_seq_len=16))
    threads, per_thread = 8, 60
    x, short, x64 = tokens(32, 5), tokens(8, 6), tokens(32, 7, torch.float64)
    expected = call_through(patched, x)
    ov.stats.reset()
    start = threading.Barrier(threads)
    errors = []

    def worker():
        try:
            start.wait()
            for i in range(per_thread):
                kind = i % 3
                out = call_through(patched, (x, short, x64)[kind])
                if kind == 0 and not torch.equal(out, expected):
                    errors.append("a concurrent call returned a different result")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in pool), "a thread hung"
    assert not errors, errors[:3]
    snap = ov.stats.snapshot()
    n = threads * per_thread // 3
    assert snap["calls"] == {"reference": n}
    assert snap["routed"] == {"short call (< 16 query tokens)": n}
    assert snap["fallbacks"] == {"reference: dtype torch.float64 is not fp16, bf16 or fp32": n}


def test_concurrent_patching_gives_independent_patches():
    base = FakePatcher()
    results = []
    start = threading.Barrier(6)

    def worker(i):
        start.wait()
        results.append(install.patch_model(base, PatchConfig(kernel="reference", min_seq_len=i)))

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
    overrides = [ov for _, ov in results]
    assert len({id(o) for o in overrides}) == 6
    assert sorted(o.config.min_seq_len for o in overrides) == list(range(6))
    assert all(install.find_override(m) is o for m, o in results)
    assert install.find_override(base) is None


@pytest.mark.gpu
def test_1000_patched_calls_keep_device_memory_flat(monkeypatch):
    """On the GPU, with whatever quantized kernel auto picks there (or the reference when none)."""
    monkeypatch.setenv("SAGE_RDNA4_HIP_EMULATE", "1")
    from comfyui_sage_rdna4.kernels.registry import get_backend

    kernel = next((k for k in ("triton_int8_fp8", "hip_int8_fp8", "triton_int8_fp16")
                   if get_backend(k).unavailable("cuda", torch.cuda.current_device()) is None), "reference")
    patched, ov = install.patch_model(FakePatcher(), PatchConfig(kernel=kernel))
    x = torch.randn(2, 1024, HEADS * 64, device="cuda", dtype=torch.float16)

    def run(n):
        for _ in range(n):
            out = ov(comfy_attention, x, x, x, HEADS, transformer_options={}, _inside_attn_wrapper=True)
        torch.cuda.synchronize()
        return out

    run(20)
    gc.collect()
    before = torch.cuda.memory_allocated()
    peak_before = torch.cuda.max_memory_allocated()
    run(1000)
    gc.collect()
    after = torch.cuda.memory_allocated()
    print(f"{kernel}: device memory {before} -> {after} B; peak {peak_before} -> {torch.cuda.max_memory_allocated()}")
    assert after <= before
    assert sum(ov.stats.snapshot()["calls"].values()) == 1020, ov.stats.summary()


def test_each_outcome_is_counted_once_under_its_kind():
    """PatchStats.record: one call per Outcome, under the backend it ran on, the routing, or the fallback's reason,
    with what auto passed over to reach it."""
    from comfyui_sage_rdna4.sage_patch.stats import FELL_BACK, RAN, ROUTED, Outcome, PatchStats
    st = PatchStats()
    st.record(Outcome(RAN, "reference", {"hip_int8_fp8": "not built for cpu"}))
    st.record(Outcome(ROUTED, "short call", None))
    st.record(Outcome(FELL_BACK, "reference failed: boom", {"hip_int8_fp8": "not built for cpu"}, "reference"))
    snap = st.snapshot()
    assert snap["calls"] == {"reference": 1}
    assert snap["routed"] == {"short call": 1}
    assert snap["fallbacks"] == {"reference failed: boom": 1}
    assert snap["passed_over"] == {"hip_int8_fp8": {"not built for cpu": 2}}
