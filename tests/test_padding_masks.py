"""kernels/padding_masks.py and its use by the override: a prompt-padding mask becomes the same attention over
fewer keys, read once per mask object and model evaluation, never on a mask's first call."""
import pytest
import torch

from comfyui_sage_rdna4.kernels import registry
from comfyui_sage_rdna4.kernels.metrics import cosine
from comfyui_sage_rdna4.kernels.padding_masks import SeenMasks, kept_keys, padding_cut
from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride
from fakes import comfy_attention, marker_attention, wrap_attn

BF16_MAX = torch.finfo(torch.bfloat16).max


def padding(n, kept, dtype=torch.bfloat16, batch=1):
    """HunyuanVideo's mask: (batch, 1, n), 0 on the kept keys, -finfo.max on the rest."""
    m = torch.full((batch, 1, n), -torch.finfo(dtype).max, dtype=dtype)
    for b, keep in enumerate(kept if isinstance(kept[0], (list, tuple, range)) else [kept] * batch):
        m[b, 0, list(keep)] = 0
    return m


@pytest.mark.parametrize("mask, end, drop, index", [
    (padding(100, range(90)), 90, True, None),                                      # HunyuanVideo: a suffix pads
    (padding(100, range(90)).unsqueeze(1) == 0, 90, True, None),                    # the same as bool (B, 1, 1, N)
    (padding(100, range(100)), 100, True, None),                                    # nothing pads: a zero bias
    (torch.zeros(2, 1, 1), 100, True, None),                                        # one zero broadcast over keys
    (padding(16, [range(5), range(9)], batch=2), 9, False, None),                   # CFG: ends 5 and 9 (LTX-Video)
    (padding(20, list(range(6)) + list(range(10, 20))), 20, True, list(range(6)) + list(range(10, 20))),  # Lumina 2
])
def test_kept_keys_reads_what_can_go(mask, end, drop, index):
    kept = kept_keys(mask, 100 if mask.shape[-1] in (1, 100) else mask.shape[-1])
    assert (kept.end, kept.drop_mask) == (end, drop)
    assert (kept.index.tolist() if kept.index is not None else None) == index


def test_a_mask_with_soft_values_keeps_its_mask_and_loses_only_the_padding():
    m = padding(50, range(40)).float()
    m[0, 0, :40] = torch.linspace(-3, 2, 40)
    kept = kept_keys(m, 50)
    assert (kept.end, kept.drop_mask) == (40, False)


@pytest.mark.parametrize("fill", [float("-inf"), float("nan")])
def test_rows_without_a_usable_largest_bias_cut_nothing(fill):
    """A row masked everywhere with -inf, or holding NaN, keeps every key under the spec (quant.dead_keys):
    nothing is cut and the mask stays, so such a row gives what the masked kernels and SDPA give."""
    m = padding(30, range(20), dtype=torch.float32, batch=2)
    m[1, 0, :] = fill
    kept = kept_keys(m, 30)
    assert (kept.end, kept.drop_mask) == (30, False) and not kept.cuts_anything(30)


def cut(k, v, m, token_dim=1):
    """padding_cut on a mask's second call (the first only notes it)."""
    seen = SeenMasks()
    padding_cut(seen, k, v, m, token_dim)
    return padding_cut(seen, k, v, m, token_dim)[:3]


def test_the_cut_narrows_or_gathers_along_the_token_dim():
    k = torch.randn(2, 20, 8)
    v = torch.randn(2, 20, 8)
    m = padding(20, list(range(6)) + list(range(10, 20)), dtype=torch.float32)
    kc, vc, mc = cut(k, v, m)
    assert mc is None and torch.equal(kc, torch.cat([k[:, :6], k[:, 10:]], 1)) and torch.equal(vc[:, 6:], v[:, 10:])
    m = padding(20, [range(5), range(9)], batch=2, dtype=torch.float32)
    kc, vc, mc = cut(k, v, m)
    assert kc.data_ptr() == k.data_ptr() and kc.shape == (2, 9, 8) and torch.equal(mc, m[..., :9])
    kh, vh = k.view(2, 20, 2, 4).transpose(1, 2), v.view(2, 20, 2, 4).transpose(1, 2)  # HND: tokens on dim 2
    kc, vc, mc = cut(kh, vh, m, token_dim=2)
    assert torch.equal(kc, kh[:, :, :9]) and torch.equal(vc, vh[:, :, :9])


def test_a_mask_is_read_on_its_second_call_and_forgotten_at_the_evaluation_end():
    seen = SeenMasks()
    m = padding(64, range(50))
    k = v = torch.randn(1, 64, 16)
    assert padding_cut(seen, k, v, m, 1)[3] is None and seen.reads == 0  # first call: no sync
    for _ in range(3):
        kc, vc, mc, kept = padding_cut(seen, k, v, m, 1)
        assert kc.shape == (1, 50, 16) and mc is None
    assert seen.reads == 1
    view = m.unsqueeze(1)  # another view of the same mask is another entry, also read on its second call
    assert padding_cut(seen, k, v, view, 1)[3] is None and padding_cut(seen, k, v, view, 1)[3] is not None
    assert seen.reads == 2
    seen.forget()
    assert padding_cut(seen, k, v, m, 1)[3] is None


def test_a_mask_written_in_place_is_read_again_and_inference_masks_are_kept_for_the_evaluation():
    seen = SeenMasks()
    k = v = torch.randn(1, 64, 16)
    m = padding(64, range(50))
    padding_cut(seen, k, v, m, 1)
    assert padding_cut(seen, k, v, m, 1)[0].shape[1] == 50
    m[..., 40:50] = -BF16_MAX  # ten more keys padded, in place: a new version, so a new mask (first call: no cut)
    assert padding_cut(seen, k, v, m, 1)[3] is None
    assert padding_cut(seen, k, v, m, 1)[0].shape[1] == 40 and seen.reads == 2
    with torch.inference_mode():  # no version to read there: the evaluation's end (forget) is the bound
        mi = padding(64, range(30))
        padding_cut(seen, k, v, mi, 1)
        assert padding_cut(seen, k, v, mi, 1)[0].shape[1] == 30


def test_a_new_mask_object_per_call_costs_no_read():
    seen = SeenMasks()
    k = v = torch.randn(1, 64, 16)
    for _ in range(5):
        assert padding_cut(seen, k, v, padding(64, range(50)), 1)[3] is None
    assert seen.reads == 0


@pytest.mark.parametrize("mask", [
    torch.zeros(1, 64, dtype=torch.int64),            # the call's own check reports it
    torch.zeros(64, 64),                              # differs between query rows as far as strides tell
    torch.zeros(1, 1, 1, 1, 64),                      # five dims
])
def test_masks_that_are_not_key_only_padding_are_never_read(mask, monkeypatch):
    from comfyui_sage_rdna4.kernels import padding_masks

    def no_read(_):
        raise AssertionError("the mask's values were read")
    monkeypatch.setattr(padding_masks, "mask_bias_base2", no_read)
    seen = SeenMasks()
    k = v = torch.randn(1, 64, 16)
    for _ in range(3):
        assert padding_cut(seen, k, v, mask, 1)[3] is None


# -- in the override -----------------------------------------------------------------------------------------------

def patched(kernel="reference"):
    ov = SageAttentionOverride(PatchConfig(kernel=kernel))
    return ov, {"optimized_attention_override": ov}


def hunyuan_like(seed=0, n=96, kept=70, heads=4, d=32, batch=1):
    """(q, k, v) in ComfyUI's (B, N, H*D) layout with padding keys 1000x larger than the rest, and the mask."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, heads * d, generator=g) for _ in range(3))
    k[:, kept:] *= 1000
    v[:, kept:] *= 1000
    return q, k, v, padding(n, range(kept), dtype=torch.float32, batch=batch)


@pytest.fixture
def launches(monkeypatch):
    """(k's key count, whether a mask came) of every reference-kernel launch."""
    backend = registry.get_backend("reference")
    seen, launch = [], backend.launch

    def spy(q, k, v, call, sm_scale, mask):
        seen.append((k.shape[2], mask is not None))
        return launch(q, k, v, call, sm_scale, mask)
    monkeypatch.setattr(backend, "launch", spy)
    return seen


def test_the_override_runs_a_padding_masked_call_over_its_kept_keys(launches):
    """First call: the masked kernel; later calls of the evaluation: the kept keys alone, unmasked, with the same
    output as the masked spec (the cut leaves every statistic as it was) and SDPA's with the mask; counted."""
    ov, to = patched()
    q, k, v, m = hunyuan_like()
    outs = [wrap_attn(comfy_attention)(q, k, v, 4, mask=m, transformer_options=to) for _ in range(3)]
    assert launches == [(96, True), (70, False), (70, False)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[1], outs[2])
    exact = comfy_attention(q, k, v, 4, mask=m, _inside_attn_wrapper=True)
    assert cosine(outs[1], exact) > 0.999
    snap = ov.stats.snapshot()
    assert snap["calls"] == {"reference": 3}
    assert snap["cuts"] == {"padding mask: keys 96 -> 70, mask dropped": 2}
    assert "padding mask: keys 96 -> 70, mask dropped: 2" in ov.stats.summary()
    ov.step_boundary()  # the next evaluation's mask is read again, on its second call
    wrap_attn(comfy_attention)(q, k, v, 4, mask=m, transformer_options=to)
    assert launches[-1] == (96, True)


def test_cfg_rows_with_different_padding_keep_their_mask_over_fewer_keys(launches):
    ov, to = patched()
    q, k, v, _ = hunyuan_like(batch=2)
    m = padding(96, [range(40), range(70)], dtype=torch.float32, batch=2).unsqueeze(1)  # (2, 1, 1, 96)
    outs = [wrap_attn(comfy_attention)(q, k, v, 4, mask=m, transformer_options=to) for _ in range(2)]
    assert launches == [(96, True), (70, True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert cosine(outs[1], comfy_attention(q, k, v, 4, mask=m, _inside_attn_wrapper=True)) > 0.999


def test_kept_keys_that_are_not_a_prefix_are_gathered(launches):
    """Lumina 2's mask: the caption's padding sits between the caption and the image tokens."""
    ov, to = patched()
    q, k, v, _ = hunyuan_like(kept=96)
    keep = list(range(30)) + list(range(50, 96))
    m = padding(96, keep, dtype=torch.float32)
    k[:, 30:50] *= 1000
    v[:, 30:50] *= 1000
    outs = [wrap_attn(comfy_attention)(q, k, v, 4, mask=m, transformer_options=to) for _ in range(2)]
    assert launches == [(96, True), (76, False)]
    assert cosine(outs[1], comfy_attention(q, k, v, 4, mask=m, _inside_attn_wrapper=True)) > 0.999
    # Per-token K scales and per-channel V scales over the same keys: the same grids, another summation order.
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_the_call_site_gets_the_call_as_it_came(monkeypatch):
    """A call our kernel does not take goes to the call site's own attention with its mask and every key."""
    ov, to = patched(kernel="hip_int8_fp8")  # unavailable on the CPU: every call is handed back
    q, k, v, m = hunyuan_like()
    got = []

    def site(q_, k_, v_, heads, mask=None, **kw):
        got.append((k_.shape[1], mask is m))
        return "call site"
    for _ in range(3):
        assert wrap_attn(site)(q, k, v, 4, mask=m, transformer_options=to) == "call site"
    assert got == [(96, True)] * 3 and ov.stats.snapshot()["cuts"] == {}


def test_the_setting_turns_the_cut_off(monkeypatch, launches):
    from comfyui_sage_rdna4.kernels import settings
    monkeypatch.setenv(settings.PADDING_CUT.name, "off")
    monkeypatch.setattr(settings, "_parsed", {})
    ov, to = patched()
    q, k, v, m = hunyuan_like()
    for _ in range(3):
        wrap_attn(comfy_attention)(q, k, v, 4, mask=m, transformer_options=to)
    assert launches == [(96, True)] * 3 and ov.seen_masks is None


def test_the_a_b_baseline_is_never_cut():
    ov = SageAttentionOverride(PatchConfig(kernel="reference"), baseline=True)
    q, k, v, m = hunyuan_like()
    before = marker_attention.calls
    for _ in range(3):
        wrap_attn(marker_attention)(q, k, v, 4, mask=m, transformer_options={"optimized_attention_override": ov})
    assert marker_attention.calls == before + 3 and ov.stats.snapshot()["cuts"] == {}


def test_the_policies_judge_the_call_as_it_came(launches):
    """A cut self-attention call has fewer keys than queries; the cross-attention policy must not take it for one."""
    ov = SageAttentionOverride(PatchConfig(kernel="reference", cross_attention="exact"))
    to = {"optimized_attention_override": ov}
    q, k, v, m = hunyuan_like()
    for _ in range(3):
        wrap_attn(comfy_attention)(q, k, v, 4, mask=m, transformer_options=to)
    assert launches == [(96, True), (70, False), (70, False)] and not ov.stats.snapshot()["routed"]
