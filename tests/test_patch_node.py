"""The Patch node without ComfyUI: nodes/patch_node.py loaded against a small stand-in for `comfy_api.latest`
(only what the module touches at import and in execute). The real ComfyUI: tests/test_comfyui_integration.py.

A prompt JSON reaches execute() without the UI's combo checks, so the node itself must refuse a bad value.
"""
import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _stub_io():
    """comfy_api.latest.io as far as patch_node uses it: inputs keep their id and keyword arguments."""
    io = types.ModuleType("comfy_api.latest.io")

    def socket(name):
        return type(name, (), {"Input": staticmethod(lambda id, **kw: types.SimpleNamespace(id=id, **kw)),
                               "Output": staticmethod(lambda **kw: types.SimpleNamespace(**kw))})
    for name in ("Model", "Combo", "Boolean", "Float", "String", "Int", "Conditioning", "Latent", "Vae", "Image"):
        setattr(io, name, socket(name))
    io.ComfyNode = type("ComfyNode", (), {})
    io.Schema = lambda **kw: types.SimpleNamespace(**kw)
    io.NodeOutput = lambda *args, **kw: types.SimpleNamespace(args=args, **kw)
    return io


@pytest.fixture
def patch_node(monkeypatch):
    latest = types.ModuleType("comfy_api.latest")
    latest.io = _stub_io()
    monkeypatch.setitem(sys.modules, "comfy_api", types.ModuleType("comfy_api"))
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    return load_node_module(monkeypatch, "patch_node")


def load_node_module(monkeypatch, stem):
    """nodes/<stem>.py without nodes/__init__.py (which needs the real comfy_api); its sibling nodes/inputs.py
    is put in place first, as the module's relative import expects it."""
    inputs = importlib.util.spec_from_file_location("comfyui_sage_rdna4.nodes.inputs", ROOT / "nodes" / "inputs.py")
    inputs_module = importlib.util.module_from_spec(inputs)
    inputs.loader.exec_module(inputs_module)
    monkeypatch.setitem(sys.modules, "comfyui_sage_rdna4.nodes.inputs", inputs_module)
    spec = importlib.util.spec_from_file_location(f"comfyui_sage_rdna4.nodes.{stem}", ROOT / "nodes" / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not kept in sys.modules: the stand-in must not outlive this test
    return module


def node_input(module, name):
    schema = module.PatchSageAttentionRDNA4.define_schema()
    return next(i for i in schema.inputs if i.id == name)


def execute(module, **overrides):
    args = dict(model=object(), kernel="auto", smooth_k=True, prologue="auto", on_unsupported="fallback")
    args.update(overrides)
    return module.PatchSageAttentionRDNA4.execute(**args)


@pytest.mark.parametrize("field, bad, choice", [("kernel", "hip_int8", "hip_int8_fp8"),
                                                ("prologue", "rocm", "triton")])
def test_the_node_refuses_an_unknown_kernel_or_prologue_before_patching(patch_node, monkeypatch, field, bad,
                                                                        choice):
    patched = []
    monkeypatch.setattr(patch_node, "patch_model", lambda model, config: patched.append(config) or (model, None))
    with pytest.raises(ValueError) as exc:
        execute(patch_node, **{field: bad})
    message = str(exc.value)
    assert patched == []  # refused when the patch is made, not on the first attention call in KSampler
    assert "Patch Sage Attention (RDNA4)" in message and field in message and repr(bad) in message
    assert f"'{choice}'" in message and "'auto'" in message, message
    # The same node with a valid value patches.
    out = execute(patch_node, **{field: choice})
    assert len(patched) == 1 and getattr(patched[0], field) == choice and out.args[0] is not None


@pytest.mark.parametrize("spec", ["0-1000000000", "0-5,7-"])
def test_the_node_refuses_a_bad_block_spec_before_patching(patch_node, monkeypatch, spec):
    """exact_blocks is free text a workflow sets: a spec that is unreadable or names too many blocks stops at the
    node, with its name and the rule, not inside the first attention call (nor by exhausting memory)."""
    patched = []
    monkeypatch.setattr(patch_node, "patch_model", lambda model, config: patched.append(config) or (model, None))
    with pytest.raises(ValueError) as exc:
        execute(patch_node, exact_blocks=spec)
    message = str(exc.value)
    assert patched == []
    assert message.startswith("Patch Sage Attention (RDNA4): exact_blocks"), message
    assert "at most 10000 block indices" in message or "cannot read block spec" in message, message


def test_the_node_offers_exactly_the_values_the_config_takes(patch_node):
    from comfyui_sage_rdna4.sage_patch import config

    assert tuple(node_input(patch_node, "kernel").options) == config.KERNEL_CHOICES
    assert tuple(node_input(patch_node, "prologue").options) == config.PROLOGUE_CHOICES


def test_the_kernel_tooltip_says_auto_may_keep_exact_attention(patch_node):
    """auto measures each shape on first use and keeps SDPA where no quantized kernel is faster there: a user who
    picks auto and sees no speed-up must be able to read why in the tooltip."""
    tooltip = node_input(patch_node, "kernel").tooltip
    assert tooltip == patch_node.KERNEL_TOOLTIP
    assert "SDPA" in tooltip and "exact attention" in tooltip
    assert "auto" in tooltip and "faster" in tooltip and "measure" in tooltip


# -- queue time: validate_inputs, as ComfyUI calls it before anything runs ---------------------------------------
@pytest.mark.parametrize("inputs, words", [
    ({"exact_blocks": "0-5,7-"}, ["exact_blocks", "cannot read block spec '7-'"]),
    ({"exact_blocks": "0-1000000000"}, ["exact_blocks", "at most 10000 block indices"]),
    ({"step_start": 0.8, "step_end": 0.2}, ["step_start <= step_end", "0.8", "0.2"]),
    ({"step_start": 1.5}, ["step_start <= step_end"]),  # ComfyUI skips the min/max of a validated input
    ({"kernel": "hip_int8"}, ["kernel must be one of", "'hip_int8_fp8'", "'hip_int8'"]),
    ({"prologue": "rocm"}, ["prologue must be one of", "'rocm'"]),
    ({"on_unsupported": "ignore"}, ["on_unsupported", "'ignore'"]),
    ({"cross_attention": "fast"}, ["cross_attention", "'fast'"]),
    ({"kernel": 3}, ["kernel must be one of", "got 3"]),
])
def test_bad_inputs_fail_at_queue_time_naming_the_node(patch_node, inputs, words):
    """ComfyUI checks a V3 node's ranges at queue time but not its combos, block specs or step order: before,
    /prompt accepted them and the run failed at the node. validate_inputs returns the reason, node name first."""
    result = patch_node.PatchSageAttentionRDNA4.validate_inputs(**inputs)
    assert isinstance(result, str), result
    assert result.startswith("Patch Sage Attention (RDNA4): "), result
    for word in words:
        assert word in result, (word, result)


def test_good_and_linked_inputs_pass_queue_time_validation(patch_node):
    validate = patch_node.PatchSageAttentionRDNA4.validate_inputs
    assert validate(kernel="triton_int8_fp8", prologue="triton", on_unsupported="raise", step_start=0.1,
                    step_end=0.9, exact_blocks="first 1, last 2", cross_attention="exact") is True
    # A widget turned into an input and fed by a link arrives as None: its value is checked when the node runs.
    assert validate() is True and validate(step_start=None, step_end=0.0) is True


def test_validate_inputs_names_only_what_it_checks(patch_node):
    """ComfyUI skips its own min/max check for every input validate_inputs takes (and for all of them when it
    takes **kwargs): min_seq_len must stay out so its range is still checked."""
    import inspect

    spec = inspect.getfullargspec(patch_node.PatchSageAttentionRDNA4.validate_inputs)
    assert spec.varkw is None and "min_seq_len" not in spec.args


@pytest.mark.parametrize("field, bad", [("step_start", None), ("step_end", "0.5"), ("exact_blocks", None),
                                        ("min_seq_len", 1.5), ("smooth_k", "yes"), ("kernel", None)])
def test_a_wrong_type_names_the_node_and_the_input(patch_node, monkeypatch, field, bad):
    """From issue 32: a value of the wrong type (a direct call, a link from a node of another type) raised a bare
    TypeError or AttributeError from inside the config."""
    monkeypatch.setattr(patch_node, "patch_model", lambda model, config: (model, None))
    with pytest.raises(ValueError) as exc:
        execute(patch_node, **{field: bad})
    message = str(exc.value)
    assert message.startswith(f"Patch Sage Attention (RDNA4): {field} must be"), message
    assert repr(bad) in message
