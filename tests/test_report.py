"""The A/B report's numbers, text, JSON and plot, and the fidelity/accuracy helpers: known inputs, known outputs."""
import json
import math

import pytest
import torch

from comfyui_sage_rdna4.kernels.reference import exact_attention
from comfyui_sage_rdna4.sage_patch import ab_benchmark
from comfyui_sage_rdna4.sage_patch import report as report_mod
from comfyui_sage_rdna4.sage_patch.report import (
    PATCHED_COLOR,
    SDPA_COLOR,
    format_report_text,
    plot_step_times,
    report_json,
    summarize_steps,
)


def steps(times, attention=None):
    attention = attention or [None] * len(times)
    return [{"index": i, "sigma": 1.0 - i / 10, "step_ms": t, "host_ms": t, "attention_ms": a}
            for i, (t, a) in enumerate(zip(times, attention))]


def test_totals_exclude_the_warmup_step():
    s = summarize_steps(steps([100.0, 50.0, 50.0], [40.0, 20.0, 20.0]),
                        steps([300.0, 25.0, 25.0], [290.0, 5.0, 5.0]), warmup=1)
    t = s["totals"]
    assert t["warmup_steps_excluded"] == 1 and t["measured_steps"] == 2
    assert t["sdpa_ms"] == 100.0 and t["patched_ms"] == 50.0
    assert t["ratio"] == pytest.approx(0.5) and t["speedup"] == pytest.approx(2.0)
    assert t["attention_speedup"] == pytest.approx(4.0)
    assert t["sdpa_attention_share"] == pytest.approx(0.4) and t["patched_attention_share"] == pytest.approx(0.2)
    first, second = s["per_step"][0], s["per_step"][1]
    assert first["warmup"] and not second["warmup"]
    assert first["ratio"] == pytest.approx(3.0) and second["ratio"] == pytest.approx(0.5)
    assert second["patched_attention_share"] == pytest.approx(0.2)


def test_warmup_never_swallows_every_step_and_runs_pair_by_position():
    s = summarize_steps(steps([10.0, 20.0]), steps([5.0]), warmup=1)
    assert s["totals"]["steps_compared"] == 1
    assert s["totals"]["measured_steps"] == 1 and s["totals"]["speedup"] == pytest.approx(2.0)
    assert "attention_speedup" not in s["totals"]  # no attention times given
    assert summarize_steps([], [], warmup=1)["totals"]["measured_steps"] == 0


def make_report():
    s = summarize_steps(steps([100.0, 50.0, 50.0], [40.0, 20.0, 20.0]),
                        steps([300.0, 25.0, 25.0], [290.0, 5.0, 5.0]))
    return {"kernel": "reference", "model": "Flux", "latent_shape": [1, 16, 8, 8], "steps": 3, "cfg": 1.0,
            "seed": 7, "sampler": "euler", "scheduler": "simple", "device": "cpu", "clock": "host clock", **s,
            "fidelity": {"latent_psnr_db": float("inf"), "latent_cosine": 1.0, "image_psnr_db": None},
            "attention_accuracy": [{"step": 0, "call": 0, "shape": "B1 H2 Nq24 Nk24 D64", "backend": "reference",
                                    "cosine": 0.9998, "rel_l1": 0.02}],
            "calls": {"patched": {"reference": 4}, "sdpa": {"sdpa": 6}},
            "fallbacks": {"reference: head_dim 300 is too large": 2}, "routed": {"short call (< 64 query tokens)": 1},
            "passed_over": {"hip_int8_fp8": {"hip_int8_fp8 disabled on cuda:0: self-check failed: NaN": 4}},
            "notes": ["block policy cannot apply: this model passes no block_index"]}


def test_text_report_shows_every_part():
    text = format_report_text(make_report())
    assert "(warm-up, excluded)" in text.splitlines()[4]
    assert "ratio 0.500, speed-up 2.000x" in text
    assert "attention speed-up 4.000x" in text
    assert "image PSNR n/a (no VAE connected)" in text and "latent PSNR inf dB" in text
    assert "cosine 0.99980, rel L1 0.0200" in text
    assert "2 x reference: head_dim 300 is too large" in text
    assert "exact by policy (short call (< 64 query tokens)): 1" in text
    assert "note: block policy cannot apply" in text
    assert "patched run, calls served: reference 4" in text
    assert "kernels 'auto' passed over" in text
    assert "auto passed over hip_int8_fp8 on 4 calls: hip_int8_fp8 disabled on cuda:0: self-check failed: NaN" in text


def test_the_baseline_is_named_own_attention_not_sdpa():
    """The baseline run is the model's own attention (on a CPU ComfyUI often sub-quadratic): the text must not
    call it SDPA, and names ComfyUI's choice when the report carries it."""
    plain = format_report_text(make_report())
    assert plain.splitlines()[0].endswith("vs the model's own attention")
    assert "own ms" in plain and "attn own" in plain and "SDPA ms" not in plain and "exact SDPA" not in plain
    assert "own attention 100.0 ms, patched 50.0 ms" in plain
    assert "own attention run, calls served: sdpa 6" in plain
    named = format_report_text({**make_report(), "baseline_name": "sub-quadratic"})
    assert named.splitlines()[0].endswith("vs the model's own attention (sub-quadratic)")
    assert "fidelity of the patched result vs the own attention (sub-quadratic) run" in named
    assert report_mod.baseline_label({"baseline_name": None}) == "own attention"


def test_comfyui_attention_is_named_from_its_function(monkeypatch):
    import sys
    import types

    from comfyui_sage_rdna4.sage_patch.ab_benchmark import comfy_attention_name

    def attention_sub_quad():
        pass
    module = types.SimpleNamespace(optimized_attention=attention_sub_quad)
    for name, value in (("comfy", types.ModuleType("comfy")), ("comfy.ldm", types.ModuleType("comfy.ldm")),
                        ("comfy.ldm.modules", types.SimpleNamespace(attention=module)),
                        ("comfy.ldm.modules.attention", module)):
        monkeypatch.setitem(sys.modules, name, value)
    assert comfy_attention_name() == "sub-quadratic"
    module.optimized_attention = lambda: None  # a name this does not know: no guess
    assert comfy_attention_name() is None


def test_cpu_report_says_its_timings_are_no_speed_claims():
    """On the CPU the same graph has measured 0.46x to 4.4x: the report must not read as a speed result."""
    assert report_mod.timing_caveat(torch.device("cpu")) == report_mod.CPU_CAVEAT
    assert report_mod.timing_caveat("cpu") == report_mod.CPU_CAVEAT
    assert report_mod.timing_caveat(torch.device("cuda", 0)) is None
    assert report_mod.timing_caveat(None) is None  # unknown device: no claim either way
    cpu = format_report_text({**make_report(), "timing_caveat": report_mod.CPU_CAVEAT}).splitlines()
    assert cpu[2] == "CPU run: timings here are not speed claims (no GPU)"
    assert next(line for line in cpu if line.startswith("total over")).endswith("(CPU: not a speed claim)")
    gpu = format_report_text({**make_report(), "device": "NVIDIA H200 (sm_90)", "timing_caveat": None})
    assert "not speed claim" not in gpu and "not a speed claim" not in gpu


def test_a_save_error_is_in_the_text():
    text = format_report_text({**make_report(), "save_error": "report not saved: PermissionError: denied"})
    assert text.splitlines()[-1] == "WARNING: report not saved: PermissionError: denied"


def test_text_report_without_measured_steps_says_so():
    report = {**make_report(), **summarize_steps(steps([10.0]), steps([10.0]))}
    report["totals"]["measured_steps"] = 0
    assert "no measured steps" in format_report_text(report)


def test_json_round_trips_and_writes_infinity_as_text():
    data = json.loads(report_json(make_report()))
    assert data["fidelity"]["latent_psnr_db"] == "inf"
    assert data["totals"]["speedup"] == pytest.approx(2.0)
    assert data["per_step"][0]["warmup"] is True


def test_save_report_writes_json_in_the_given_folder(tmp_path):
    path = ab_benchmark.save_report(make_report(), str(tmp_path / "sage_rdna4"))
    assert path.startswith(str(tmp_path)) and path.endswith(".json")
    assert ab_benchmark.load_report(path)["kernel"] == "reference"


def _has_color(img, color, tol=0.02):
    target = torch.tensor(color, dtype=torch.float32) / 255
    return bool(((img[0] - target).abs().max(dim=-1).values < tol).any())


def test_plot_is_a_comfy_image_with_both_runs():
    per_step = make_report()["per_step"]
    img = plot_step_times(per_step, "t")
    assert img.shape == (1, 384, 768, 3) and img.dtype == torch.float32
    assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
    assert _has_color(img, SDPA_COLOR) and _has_color(img, PATCHED_COLOR)


def test_plot_of_nothing_is_still_an_image():
    img = plot_step_times([], "t", width=200, height=100)
    assert img.shape == (1, 100, 200, 3)
    assert not _has_color(img, SDPA_COLOR)


def test_fidelity_known_numbers():
    a = torch.tensor([0.0, 1.0, 0.0, 1.0])
    f = ab_benchmark.fidelity(a, a + 0.1)  # range 1, mse 0.01 -> 20 dB
    assert f["latent_psnr_db"] == pytest.approx(20.0, abs=1e-4)
    assert f["latent_cosine"] < 1.0 and f["image_psnr_db"] is None
    same = ab_benchmark.fidelity(a, a)
    assert same["latent_psnr_db"] == math.inf and same["latent_cosine"] == pytest.approx(1.0)
    img = torch.full((1, 4, 4, 3), 0.5)
    f = ab_benchmark.fidelity(a, a, img, img + 0.01)  # peak 1, mse 1e-4 -> 40 dB
    assert f["image_psnr_db"] == pytest.approx(40.0, abs=1e-3)


def test_attention_accuracy_against_exact():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    exact, _ = exact_attention(q, k, v, sm_scale=8 ** -0.5)
    sample = {"step": 0, "call": 3, "backend": "x", "q": q, "k": k, "v": v, "mask": None, "sm_scale": 8 ** -0.5}
    good = ab_benchmark.attention_accuracy([{**sample, "out": exact}])[0]
    assert good["cosine"] == pytest.approx(1.0) and good["rel_l1"] == pytest.approx(0.0, abs=1e-12)
    assert good["shape"] == "B1 H2 Nq16 Nk16 D8" and good["call"] == 3
    bad = ab_benchmark.attention_accuracy([{**sample, "out": exact * 1.1}])[0]
    assert bad["rel_l1"] == pytest.approx(0.1, rel=1e-6)


def test_accuracy_flags_a_planted_bad_call(caplog):
    """Issue 10 item 6: a sampled call far above what its kernel reaches on the self-check is flagged, on the
    report (text and JSON) and in the console; sound calls are not."""
    from comfyui_sage_rdna4.kernels.accuracy_flags import FLAG_REL_L1, flag_level
    from comfyui_sage_rdna4.kernels.reference import reference_attention

    g = torch.Generator().manual_seed(0)
    # Video-like: near-uniform attention over many keys, V with a channel offset.
    q = 0.7 * torch.randn(1, 2, 64, 64, generator=g)
    k = 0.7 * torch.randn(1, 2, 2000, 64, generator=g)
    v = torch.randn(1, 2, 2000, 64, generator=g) + 2 + 2 * torch.randn(1, 2, 1, 64, generator=g).abs()
    q, k, v = q.half(), k.half(), v.half()
    good, _ = reference_attention(q, k, v)
    exact, _ = exact_attention(q, k, v)
    base = {"step": 0, "q": q, "k": k, "v": v, "mask": None, "sm_scale": 64 ** -0.5}
    samples = [
        {**base, "call": 0, "backend": "hip_int8_fp8", "out": good},  # the spec: ~0.002
        {**base, "call": 1, "backend": "triton_int8_fp8", "out": (exact * 0.9).half()},  # lost 10 % of its mass
        {**base, "call": 3, "backend": "triton_int8_fp16", "out": (exact * 0.97).half()},  # 3 %: too much for FP16
        {**base, "call": 7, "backend": "triton_int8_fp8", "out": (exact * 0.97).half()},  # 3 %: within FP8's level
        {**base, "call": 15, "backend": "fallback: head_dim 256", "out": exact.half()},
    ]
    rows = ab_benchmark.attention_accuracy(samples)
    assert [r["flagged"] for r in rows] == [False, True, True, False, False]
    assert rows[0]["rel_l1"] < 0.01 and rows[1]["rel_l1"] == pytest.approx(0.1, abs=2e-3)
    assert rows[1]["flag_rel_l1"] == FLAG_REL_L1["fp8"] == flag_level("hip_int8_fp8")
    assert rows[2]["flag_rel_l1"] == FLAG_REL_L1["fp16"] == flag_level("fallback: x")
    with caplog.at_level("WARNING", logger="sage_rdna4"):
        flags = ab_benchmark.accuracy_flags(rows)
    assert len(flags) == 2 and "call 1 of step 0" in flags[0] and "triton_int8_fp8" in flags[0]
    assert f"rel L1 {rows[1]['rel_l1']:.4f} against exact FP32 exceeds 0.05" in flags[0]
    assert sum("sage_rdna4 A/B" in r.getMessage() for r in caplog.records) == 2
    text = format_report_text({"attention_accuracy": rows, "accuracy_flags": flags})
    assert text.count("FLAGGED") == 2 and text.count("WARNING: attention call") == 2
    nan = ab_benchmark.attention_accuracy([{**base, "call": 31, "backend": "triton_int8_fp8",
                                             "out": torch.full_like(good, float("nan"))}])
    assert nan[0]["flagged"]
    assert json.loads(report_json({"attention_accuracy": rows}))["attention_accuracy"][1]["flagged"] is True


def test_the_text_report_says_what_first_use_cost_the_patched_run():
    text = format_report_text({"first_use": [{"part": "self-check triton_int8_fp8 (triton prologue) on cuda:0",
                                             "seconds": 12.5}, {"part": "hardware probes on cuda:0", "seconds": 0.5}]})
    assert ("first use in the patched run: 13.00 s (self-check triton_int8_fp8 (triton prologue) on cuda:0 12.50 s; "
            "hardware probes on cuda:0 0.50 s)") in text
