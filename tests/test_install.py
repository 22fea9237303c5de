"""patch_model's clone semantics with a stand-in for ComfyUI's ModelPatcher (fakes.FakePatcher; the real one:
test_comfyui_*)."""
import copy

import pytest

from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride, install
from fakes import FakePatcher


@pytest.fixture
def no_comfy_check(monkeypatch):
    monkeypatch.setattr(install, "override_hook_missing", lambda: None)


def test_clone_is_patched_and_original_untouched(no_comfy_check):
    original = FakePatcher({"transformer_options": {"patches": {"x": [1]}, "other": "keep"}, "sampler_cfg": 1})
    before = copy.deepcopy(original.model_options)
    patched, override = install.patch_model(original, PatchConfig(kernel="reference"))
    assert patched is not original
    assert original.model_options == before
    to = patched.model_options["transformer_options"]
    assert to[install.OVERRIDE_KEY] is override
    assert to["patches"] == {"x": [1]} and to["other"] == "keep"
    assert patched.model_options["sampler_cfg"] == 1
    assert install.find_override(patched) is override
    assert install.find_override(original) is None


def test_repatching_replaces_our_override_and_keeps_settings_apart(no_comfy_check):
    base = FakePatcher()
    a, oa = install.patch_model(base, PatchConfig(kernel="reference", smooth_k=True))
    b, ob = install.patch_model(a, PatchConfig(kernel="sdpa", smooth_k=False))
    assert install.find_override(a) is oa and install.find_override(b) is ob
    assert oa.config.kernel == "reference" and ob.config.kernel == "sdpa"
    assert oa.stats is not ob.stats


def test_a_clone_of_a_patched_model_shares_the_patch(no_comfy_check):
    patched, override = install.patch_model(FakePatcher(), PatchConfig())
    assert install.find_override(patched.clone()) is override


def test_old_comfyui_is_refused_plainly(monkeypatch):
    monkeypatch.setattr(install, "override_hook_missing", lambda: "this ComfyUI is too old")
    with pytest.raises(RuntimeError, match="too old"):
        install.patch_model(FakePatcher(), PatchConfig())


def test_bad_policy_input_fails_at_patch_time(no_comfy_check):
    with pytest.raises(ValueError, match="block spec"):
        install.patch_model(FakePatcher(), PatchConfig(exact_blocks="the last ones"))
    with pytest.raises(ValueError):
        PatchConfig(step_start=0.8, step_end=0.2)


def test_without_comfyui_the_hook_check_says_so():
    import importlib.util
    if importlib.util.find_spec("comfy") is not None:
        pytest.skip("ComfyUI importable here")
    assert "cannot be imported" in install.override_hook_missing()


def test_override_type_is_exported():
    assert isinstance(SageAttentionOverride(PatchConfig()), SageAttentionOverride)
