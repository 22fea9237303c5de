"""The Benchmark node without ComfyUI: nodes/benchmark_node.py against stand-ins for `comfy_api.latest.io`,
`comfy.samplers` (its two name lists) and `comfy.utils` (the progress bar). Its run (run_ab): test_ab_benchmark.py;
in the real ComfyUI and its frontend: test_comfyui_integration.py, test_web_extension.py.
"""
import sys
import types

import pytest
from test_patch_node import _stub_io, load_node_module

SAMPLERS = ["euler", "euler_ancestral", "dpmpp_2m"]
SCHEDULERS = ["simple", "normal", "karras"]
NAME = "Sage Attention Benchmark (RDNA4): "


@pytest.fixture
def bench(monkeypatch):
    latest = types.ModuleType("comfy_api.latest")
    latest.io = _stub_io()
    comfy = types.ModuleType("comfy")
    comfy.samplers = types.SimpleNamespace(SAMPLER_NAMES=SAMPLERS, SCHEDULER_NAMES=SCHEDULERS)
    comfy.utils = types.SimpleNamespace(ProgressBar=lambda total: types.SimpleNamespace(
        update_absolute=lambda done, total: None))
    for name, module in (("comfy_api", types.ModuleType("comfy_api")), ("comfy_api.latest", latest),
                         ("comfy", comfy), ("comfy.samplers", comfy.samplers), ("comfy.utils", comfy.utils)):
        monkeypatch.setitem(sys.modules, name, module)
    return load_node_module(monkeypatch, "benchmark_node")


def schema_input(module, name):
    return next(i for i in module.SageAttentionBenchmarkRDNA4.define_schema().inputs if i.id == name)


def test_the_benchmark_node_is_an_output_node(bench):
    """Without a downstream output node ComfyUI refused the prompt ("Prompt has no outputs"), and a cached re-run
    sent no `executed` event, so its report did not come back. Its outputs are still passed on."""
    schema = bench.SageAttentionBenchmarkRDNA4.define_schema()
    assert schema.is_output_node is True
    assert [o.display_name for o in schema.outputs] == ["LATENT", "plot", "report"]


@pytest.mark.parametrize("name", ["positive", "negative", "cfg", "scheduler", "model", "latent", "seed", "steps",
                                  "sampler_name", "vae", "kernel"])
def test_every_input_has_a_tooltip(bench, name):
    tooltip = getattr(schema_input(bench, name), "tooltip", None)
    assert isinstance(tooltip, str) and len(tooltip) > 20, (name, tooltip)


def test_the_description_names_the_baseline_as_the_models_own_attention(bench):
    description = bench.SageAttentionBenchmarkRDNA4.define_schema().description
    assert "own attention" in description and "exact SDPA" not in description


@pytest.mark.parametrize("inputs, words", [
    ({"kernel": "hip_int8"}, ["kernel must be one of", "'hip_int8'", "'from patch node'"]),
    ({"kernel": "sdpa"}, ["kernel must be one of", "'sdpa'"]),  # the baseline is not a kernel to compare
    ({"sampler_name": "eulr"}, ["sampler_name", "'eulr'", "'euler'"]),
    ({"scheduler": "linear"}, ["scheduler", "'linear'", "'karras'"]),
])
def test_bad_inputs_fail_at_queue_time_naming_the_node(bench, inputs, words):
    result = bench.SageAttentionBenchmarkRDNA4.validate_inputs(**inputs)
    assert isinstance(result, str) and result.startswith(NAME), result
    for word in words:
        assert word in result, (word, result)


def test_good_and_linked_inputs_pass_queue_time_validation(bench):
    validate = bench.SageAttentionBenchmarkRDNA4.validate_inputs
    assert validate(kernel="from patch node", sampler_name="dpmpp_2m", scheduler="karras") is True
    assert validate(kernel="triton_int8_fp8") is True and validate() is True


def run(bench, monkeypatch, **overrides):
    ran = []
    monkeypatch.setattr(bench, "run_ab", lambda *a, **kw: ran.append((a, kw)) or (None, {}, "", None, None))
    monkeypatch.setattr(bench, "report_json", lambda report: "{}")
    args = dict(model=object(), positive=[], negative=[], latent={"samples": None}, seed=0, steps=4, cfg=1.0,
                sampler_name="euler", scheduler="simple")
    args.update(overrides)
    return bench.SageAttentionBenchmarkRDNA4.execute(**args), ran


@pytest.mark.parametrize("field, bad, words", [
    ("kernel", "hip_int8", ["kernel must be one of", "'hip_int8'"]),
    ("steps", None, ["steps must be a number", "None"]),
    ("steps", 1, ["steps must be at least 2"]),
    ("seed", "7", ["seed must be a number"]),
    ("cfg", None, ["cfg must be a number"]),
    ("latent", None, ["latent must be a LATENT"]),
])
def test_execute_refuses_a_bad_input_with_the_node_name_before_sampling(bench, monkeypatch, field, bad, words):
    """An unknown kernel used to fail inside run_ab without the node's name; a wrong type with a bare TypeError."""
    with pytest.raises(ValueError) as exc:
        run(bench, monkeypatch, **{field: bad})
    message = str(exc.value)
    assert message.startswith(NAME), message
    for word in words:
        assert word in message, (word, message)


def test_execute_runs_and_sends_the_report_to_the_page(bench, monkeypatch):
    out, ran = run(bench, monkeypatch, kernel="triton_int8_fp8")
    assert len(ran) == 1 and ran[0][1]["kernel"] == "triton_int8_fp8"
    assert out.ui["sage_rdna4_report"] == ["{}"]
