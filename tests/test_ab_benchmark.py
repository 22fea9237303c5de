"""run_ab, the A/B node's work, without ComfyUI: a stand-in ModelPatcher and a sampler that runs the wrappers the
patch installed (OUTER_SAMPLE around the run, PREDICT_NOISE around each step) and one attention call per step
through the model's override, as ComfyUI's wrap_attn does. The real ComfyUI: tests/test_comfyui_integration.py.
"""
import copy
import json
import logging

import pytest
import torch

from comfyui_sage_rdna4.sage_patch import ab_benchmark, install
from comfyui_sage_rdna4.sage_patch.report import CPU_CAVEAT
from comfyui_sage_rdna4.sage_patch.timing import WRAPPER_KEY

STEPS = 3


class FakePatcher:
    """What patch_model and run_ab use of ComfyUI's ModelPatcher; clone() deep-copies model_options."""

    def __init__(self, load_device):
        self.model_options = {"transformer_options": {}}
        self.wrappers = {}
        self.load_device = load_device

    def clone(self):
        n = FakePatcher(self.load_device)
        n.model_options = copy.deepcopy(self.model_options)
        n.wrappers = copy.deepcopy(self.wrappers)
        return n

    def add_wrapper_with_key(self, kind, key, fn):
        self.wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, kind, key):
        self.wrappers.get(kind, {}).pop(key, None)


def comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    b, _, width = q.shape
    q, k, v = (t.view(b, -1, heads, width // heads).transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, width)


def fake_sample(model, latent, seed, steps, cfg, sampler_name, scheduler, positive, negative, on_step):
    (outer,), (predict,) = (model.wrappers[kind][WRAPPER_KEY] for kind in ("outer_sample", "predict_noise"))
    options = model.model_options["transformer_options"]
    override = options[install.OVERRIDE_KEY]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 64, 2 * 32, generator=gen)

    def model_step(x, timestep):
        to = dict(options, sigmas=timestep, optimized_attention_override=override)
        out = override(comfy_attention, q, q, q, 2, transformer_options=to, _inside_attn_wrapper=True)
        return x * 0.9 + out.mean()

    def run():
        x = latent["samples"].clone()
        for i in range(steps):
            x = predict(model_step, x, torch.tensor([1.0 - i / steps]))
            on_step(i, x, x, steps)
        return x
    return outer(run)


@pytest.fixture
def ab(monkeypatch):
    monkeypatch.setattr(install, "override_hook_missing", lambda: None)
    monkeypatch.setattr(ab_benchmark, "_sample", fake_sample)

    def run(save_dir, device="cpu"):
        latent = {"samples": torch.zeros(1, 4, 8, 8)}
        return ab_benchmark.run_ab(FakePatcher(torch.device(device)), None, None, latent, seed=1, steps=STEPS,
                                   cfg=1.0, sampler_name="euler", scheduler="simple", kernel="reference",
                                   save_dir=str(save_dir))
    return run


@pytest.fixture(autouse=True)
def plain_wrapper_kinds():
    from comfyui_sage_rdna4.sage_patch import timing
    if timing.OUTER_SAMPLE != "outer_sample":
        pytest.skip("ComfyUI is importable: its WrappersMP kinds are used, this stand-in sampler does not know them")


def test_a_cpu_run_says_its_timings_are_no_speed_claims(ab, tmp_path):
    out, report, text, plot, path = ab(tmp_path / "sage_rdna4")
    assert report["totals"]["measured_steps"] == STEPS - 1  # the runs were real and timed
    assert report["cpu_run"] is True and report["timing_caveat"] == CPU_CAVEAT
    assert CPU_CAVEAT == "CPU run: timings here are not speed claims (no GPU)"
    lines = text.splitlines()
    assert lines[2] == CPU_CAVEAT  # right under the header, before any figure
    total = next(line for line in lines if line.startswith("total over"))
    assert "speed-up" in total and "not a speed claim" in total
    saved = json.loads(open(path, encoding="utf-8").read())
    assert saved["cpu_run"] is True and saved["timing_caveat"] == CPU_CAVEAT


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_an_unwritable_output_folder_keeps_both_runs(ab, tmp_path, caplog, where):
    """The output folder is a file (or lies under one): the runs are returned, the save error logged and shown."""
    blocker = tmp_path / "output"
    blocker.write_text("not a folder")
    save_dir = blocker if where == "a-file" else blocker / "sage_rdna4"
    with caplog.at_level(logging.WARNING, logger="sage_rdna4"):
        out, report, text, plot, path = ab(save_dir)
    assert path is None and report["json_path"] is None
    assert out["samples"].shape == (1, 4, 8, 8) and plot.shape == (1, 384, 768, 3)
    assert report["totals"]["measured_steps"] == STEPS - 1 and report["calls"]["patched"] == {"reference": STEPS}
    assert report["save_error"].startswith("report not saved: ")
    assert ("NotADirectoryError" if where == "under-a-file" else "FileExistsError") in report["save_error"]
    assert f"WARNING: {report['save_error']}" in text
    assert any(report["save_error"] in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_the_baseline_is_the_models_own_attention(ab, tmp_path, monkeypatch):
    """Run A hands every call to the call site's attention (what the model runs without the patch) and times it;
    run B (kernel 'reference') never reaches it. Before, run A ran the pack's own SDPA backend instead."""
    seen = []
    real = comfy_attention

    def counting(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)
    monkeypatch.setitem(globals(), "comfy_attention", counting)
    out, report, text, plot, path = ab(tmp_path / "sage_rdna4")
    assert len(seen) == STEPS  # run A's calls, one per step; run B's went to the reference backend
    assert report["calls"]["sdpa"] == {"own attention": STEPS} and report["calls"]["patched"] == {"reference": STEPS}
    assert report["baseline"].startswith("the model's own attention")
    assert all(s["sdpa_attention_ms"] is not None and s["sdpa_attention_ms"] > 0 for s in report["per_step"])
