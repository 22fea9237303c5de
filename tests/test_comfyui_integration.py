"""The pack inside a real ComfyUI checkout (COMFYUI_PATH), on tiny random-weight Flux / Wan / SD models.

Loads the pack the way ComfyUI does (nodes.load_custom_node on a folder named like a custom node), runs
the Patch node and the A/B node, samples with comfy's own sampler and checks that every attention call
ran the chosen kernel or fell back with its reason in the stats. The count of attention calls comes from
outside the pack: the exact attention ComfyUI runs on the CPU (sub-quadratic attention) is counted.
"""
import asyncio
import importlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.comfyui
ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """ComfyUI imported on the CPU, with the pack loaded from custom_nodes-like folder."""
    if not os.environ.get("COMFYUI_PATH"):
        pytest.skip("COMFYUI_PATH is not set")
    import comfy_harness as harness

    harness.comfy_import(cpu=True)
    import folder_paths

    import nodes

    custom = tmp_path_factory.mktemp("custom_nodes")
    link = custom / "ComfyUI-Sage-RDNA4"
    link.symlink_to(ROOT, target_is_directory=True)
    loaded = asyncio.run(nodes.load_custom_node(str(link)))
    out_dir = tmp_path_factory.mktemp("output")
    folder_paths.set_output_directory(str(out_dir))
    return {"harness": harness, "nodes": nodes, "loaded": loaded, "link": link, "output": out_dir}


def pack_module(env, name):
    """A submodule of the copy of the pack that ComfyUI loaded (not the tests' own copy)."""
    node_cls = env["nodes"].NODE_CLASS_MAPPINGS["PatchSageAttentionRDNA4"]
    package = node_cls.__module__.rsplit(".nodes", 1)[0]
    return importlib.import_module(f"{package}.{name}")


def patch(env, model, kernel, **extra):
    node = env["nodes"].NODE_CLASS_MAPPINGS["PatchSageAttentionRDNA4"]
    args = dict(model=model, kernel=kernel, smooth_k=True, prologue="auto", on_unsupported="fallback")
    args.update(extra)
    return node.execute(**args).result[0]


MODELS = {
    "flux": lambda h: (h.tiny_flux(), h.flux_conditioning(seed=1), h.flux_conditioning(seed=2),
                       h.image_latent(16, 64, 64), 1.0),
    "wan": lambda h: (h.tiny_wan(), h.text_conditioning(32, 64, 1), h.text_conditioning(32, 64, 2),
                      h.video_latent(5, 32, 32), 4.0),
    "sd15": lambda h: (h.tiny_sd15(), h.text_conditioning(8, 64, 1), h.text_conditioning(8, 64, 2),
                       h.image_latent(4, 64, 64), 4.0),
}


def sample(model, pos, neg, latent, cfg, seed=0):
    import comfy.sample

    lat = comfy.sample.fix_empty_latent_channels(model, latent["samples"])
    noise = comfy.sample.prepare_noise(lat, seed)
    return comfy.sample.sample(model, noise, STEPS, cfg, "euler", "simple", pos, neg, lat, disable_pbar=True,
                               seed=seed)


@pytest.fixture
def exact_attention_counter(monkeypatch):
    """Counts the calls of the exact attention ComfyUI runs on the CPU (sub-quadratic attention)."""
    import comfy.ldm.modules.attention as attention

    if attention.optimized_attention.__name__ != "attention_sub_quad":
        pytest.skip(f"ComfyUI chose {attention.optimized_attention.__name__} here, not sub-quadratic attention")
    count = {"n": 0}
    original = attention.efficient_dot_product_attention

    def counting(*args, **kwargs):
        count["n"] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(attention, "efficient_dot_product_attention", counting)
    return count


def test_pack_loads_as_a_custom_node(env):
    nodes = env["nodes"]
    assert env["loaded"] is True
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["PatchSageAttentionRDNA4"] == "Patch Sage Attention (RDNA4)"
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["SageAttentionBenchmarkRDNA4"] == "Sage Attention Benchmark (RDNA4)"
    web_dirs = [os.path.realpath(p) for p in nodes.EXTENSION_WEB_DIRS.values()]
    assert web_dirs.count(os.path.realpath(ROOT / "web")) == 1  # registered once: the frontend loads it once


def test_patch_node_returns_a_clone_and_leaves_the_model_alone(env):
    model = env["harness"].tiny_flux()
    model.model_options.setdefault("transformer_options", {})["someone_elses_option"] = 42
    patched = patch(env, model, "reference")
    assert patched is not model and patched.model is model.model  # a clone shares the weights
    opts = patched.model_options["transformer_options"]
    assert opts["someone_elses_option"] == 42
    assert type(opts["optimized_attention_override"]).__name__ == "SageAttentionOverride"
    assert "optimized_attention_override" not in model.model_options["transformer_options"]
    key = pack_module(env, "sage_patch.timing").WRAPPER_KEY
    assert patched.get_wrappers("predict_noise", key) and not model.get_wrappers("predict_noise", key)


@pytest.mark.parametrize("kernel", ["reference", "auto"])
@pytest.mark.parametrize("name", ["flux", "wan", "sd15"])
def test_every_attention_call_runs_the_kernel_or_falls_back_with_a_reason(env, exact_attention_counter, name,
                                                                          kernel):
    model, pos, neg, latent, cfg = MODELS[name](env["harness"])
    plain = sample(model, pos, neg, latent, cfg)
    n_calls = exact_attention_counter["n"]
    assert n_calls > 0
    exact_attention_counter["n"] = 0

    patched = patch(env, model, kernel)
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    out = sample(patched, pos, neg, latent, cfg)
    stats = override.stats.snapshot()
    handled = sum(stats["calls"].values()) + sum(stats["fallbacks"].values()) + sum(stats["routed"].values())
    assert handled == n_calls  # every call the model made reached the override and was accounted for
    if kernel == "reference":
        assert stats["calls"] == {"reference": n_calls} and not stats["fallbacks"]
        assert exact_attention_counter["n"] == 0  # nothing ran ComfyUI's own attention
        assert torch.nn.functional.cosine_similarity(out.flatten(), plain.flatten(), dim=0) > 0.999
    else:  # no quantized kernel exists on the CPU: each call falls back, with the reason counted
        assert stats["calls"] == {}
        assert list(stats["fallbacks"].values()) == [n_calls]
        assert "auto: no quantized kernel takes this call" in next(iter(stats["fallbacks"]))
        assert exact_attention_counter["n"] == n_calls
        assert torch.equal(out, plain)  # the fallback is the call site's own attention, bit for bit
    assert "optimized_attention_override" not in model.model_options.get("transformer_options", {})


def test_step_timer_reports_once_per_sampling_run(env, caplog, capsys):
    model, pos, neg, latent, cfg = MODELS["flux"](env["harness"])
    patched = patch(env, model, "reference")
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    timer = pack_module(env, "sage_patch.timing").step_timer_of(override)
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="sage_rdna4"):
        sample(patched, pos, neg, latent, cfg)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "sage_rdna4" and r.levelno == logging.INFO)
    assert logged.count(f"{STEPS} steps in") == 1 and "ran reference" in logged
    assert "steps in" not in capsys.readouterr().out  # through logging, not print()
    run = timer.last_run
    assert len(run.steps) == STEPS  # euler: one model evaluation per step
    sigmas = [s.sigma for s in run.steps]
    assert sigmas == sorted(sigmas, reverse=True) and all(s.step_ms > 0 for s in run.steps)
    assert all(s.attention_ms is None for s in run.steps)  # attention timing is off unless asked
    assert run.calls == {"reference": 2 * STEPS}  # tiny Flux: one double + one single block per step


class StubVAE:
    """Only what the A/B node uses of a VAE: decode(latent) -> IMAGE in [0, 1]."""

    def decode(self, samples):
        img = torch.sigmoid(samples[:, :3]).movedim(1, -1)
        return img.repeat_interleave(8, 1).repeat_interleave(8, 2)


def test_benchmark_node_end_to_end(env, caplog, capsys):
    import comfy.utils

    nodes = env["nodes"]
    model, pos, neg, latent, cfg = MODELS["flux"](env["harness"])
    patched = patch(env, model, "reference")
    progress = []
    comfy.utils.set_progress_bar_global_hook(
        lambda value, total, preview, node_id=None: progress.append((value, total)))
    capsys.readouterr()
    try:
        with caplog.at_level(logging.INFO, logger="sage_rdna4"):
            out = nodes.NODE_CLASS_MAPPINGS["SageAttentionBenchmarkRDNA4"].execute(
                model=patched, positive=pos, negative=neg, latent=latent, seed=3, steps=STEPS, cfg=cfg,
                sampler_name="euler", scheduler="simple", vae=StubVAE())
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
    latent_out, plot, text = out.result
    # The report goes to the console through logging (in order, with ComfyUI's timestamps), not print().
    assert text in [r.getMessage() for r in caplog.records if r.name == "sage_rdna4"]
    assert "speed-up" not in capsys.readouterr().out
    assert latent_out["samples"].shape == latent["samples"].shape
    assert plot.shape == (1, 384, 768, 3)
    assert progress[-1] == (2 * STEPS, 2 * STEPS) and len(progress) == 2 * STEPS
    report = json.loads(out.ui["sage_rdna4_report"][0])
    assert out.ui["text"] == [text]
    assert report["kernel"] == "reference" and report["totals"]["measured_steps"] == STEPS - 1
    assert [s["warmup"] for s in report["per_step"]] == [True] + [False] * (STEPS - 1)
    assert report["calls"] == {"patched": {"reference": 2 * STEPS}, "sdpa": {"own attention": 2 * STEPS}}
    assert report["fidelity"]["latent_cosine"] > 0.999 and report["fidelity"]["image_psnr_db"] > 30
    assert report["attention_accuracy"] and all(a["cosine"] > 0.998 for a in report["attention_accuracy"])
    assert all(a["backend"] == "reference" for a in report["attention_accuracy"])
    assert "speed-up" in text and "(warm-up, excluded)" in text
    # The baseline is named for what ComfyUI runs (sub-quadratic on a CPU ComfyUI, not SDPA).
    import comfy.ldm.modules.attention as comfy_attention

    from comfyui_sage_rdna4.sage_patch.ab_benchmark import ATTENTION_NAMES

    own = ATTENTION_NAMES[comfy_attention.optimized_attention.__name__]
    assert report["baseline_name"] == own and text.splitlines()[0].endswith(f"vs the model's own attention ({own})")
    saved = list(Path(env["output"], "sage_rdna4").glob("ab_*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["kernel"] == "reference"
    # The input model is still patched with its own override and untouched by the A/B runs.
    assert type(patched.model_options["transformer_options"]["optimized_attention_override"]).__name__ == \
        "SageAttentionOverride"


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_a_compiled_model_gets_the_same_calls_and_no_graph_break_from_the_pack(env, name):
    """ComfyUI's TorchCompileModel path (set_torch_compile_wrapper, here with backend="aot_eager"): the patched model
    breaks the graph no more often than the unpatched one (for no reason of its own), and samples and counts as
    the eager patched model."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    model, pos, neg, latent, cfg = MODELS[name](env["harness"])

    def compiled_breaks(m):
        m = m.clone()
        set_torch_compile_wrapper(m, backend="aot_eager")
        torch._dynamo.reset()
        counters.clear()
        out = sample(m, pos, neg, latent, cfg)
        return out, dict(counters["graph_break"])

    _, plain_breaks = compiled_breaks(model)
    patched = patch(env, model, "reference")
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    eager = sample(patched, pos, neg, latent, cfg)
    eager_stats = override.stats.snapshot()
    override.stats.reset()
    out, breaks = compiled_breaks(patched)
    stats = override.stats.snapshot()
    # ComfyUI's own CPU attention (sub-quadratic) breaks graphs; the patch adds none (its op replaces those calls)
    assert sum(breaks.values()) <= sum(plain_breaks.values()) and set(breaks) <= set(plain_breaks)
    assert stats["calls"] == eager_stats["calls"] and sum(stats["calls"].values()) > 0 and not stats["fallbacks"]
    assert torch.allclose(out, eager, atol=1e-5, rtol=1e-5)
