"""Step, block, short-call and cross-attention policies (issue 6), on transformer_options built the way
ComfyUI builds them: `sample_sigmas` is the whole schedule (samplers.py, inner_sample), `sigmas` the
current timestep per batch row (calc_cond_batch), `block_index`/`total_blocks` set by the model's block loop.
"""
import math

import pytest
import torch

from comfyui_sage_rdna4.sage_patch import PatchConfig, SageAttentionOverride
from comfyui_sage_rdna4.sage_patch.policies import CallPolicies, parse_blocks, step_fraction
from fakes import comfy_attention

# -- parse_blocks ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,expected", [
    ("", (set(), 0, 0)),
    ("   ", (set(), 0, 0)),
    ("0,1,5", ({0, 1, 5}, 0, 0)),
    ("last 2", (set(), 0, 2)),
    ("first 1, last 2", (set(), 1, 2)),
    (" Last 3 ", (set(), 0, 3)),
    ("2-4", ({2, 3, 4}, 0, 0)),
    ("0; 3 ,7-8", ({0, 3, 7, 8}, 0, 0)),
    ("last 1, last 3", (set(), 0, 3)),       # the larger count wins
    ("first 0", (set(), 0, 0)),
])
def test_parse_blocks(spec, expected):
    assert parse_blocks(spec) == expected


@pytest.mark.parametrize("spec", ["5-2", "foo", "-1", "last", "last -1", "1.5", "first two"])
def test_parse_blocks_rejects_what_it_cannot_read(spec):
    with pytest.raises(ValueError):
        parse_blocks(spec)


@pytest.mark.parametrize("spec, rule", [
    ("0-10000000", "at most 10000 block indices"),     # took 1.5 s and 588 MiB before it was bounded
    ("0-1000000000", "under 100000"),                   # raised MemoryError
    ("0-4999, 5000-10000", "at most 10000 block indices"),  # 10,001 indices from two ranges
    ("100000", "under 100000"),
    ("99990-100000", "under 100000"),
    ("last 100001", "at most 100000"),
    ("first 1" + "0" * 5000, "at most 100000"),          # too many digits for int(): still the rule's message
])
def test_a_block_spec_is_bounded_and_never_expanded_past_the_bound(spec, rule):
    """exact_blocks is free text any shared workflow sets: it may name at most 10,000 blocks, each under 100,000,
    and a spec past that is refused without expanding it."""
    import tracemalloc
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rule):
            parse_blocks(spec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"refusing {spec[:20]!r} allocated {peak} B"  # a full 10,000-index set is ~1 MiB


def test_a_block_spec_at_the_bounds_is_accepted():
    assert parse_blocks("0-9999") == (set(range(10000)), 0, 0)
    assert parse_blocks("99999, first 100000, last 100000") == ({99999}, 100000, 100000)
    assert parse_blocks("0007") == ({7}, 0, 0)  # leading zeros are no digits too many


def test_the_config_refuses_an_unbounded_block_spec_with_the_rule():
    with pytest.raises(ValueError, match="exact_blocks.*at most 10000 block indices"):
        PatchConfig(exact_blocks="0-10000000")
    with pytest.raises(ValueError, match="exact_blocks.*cannot read block spec"):
        PatchConfig(exact_blocks="last two")


def test_bad_block_spec_is_caught_when_the_node_builds_its_policies():
    with pytest.raises(ValueError, match="cannot read block spec"):
        CallPolicies(PatchConfig(exact_blocks="last two"))


# -- the schedule, as ComfyUI passes it ----------------------------------------------------------

def schedule(steps=10, sigma_max=14.6, sigma_min=0.03):
    """A descending Karras-like schedule with the final 0, as KSampler passes it."""
    ramp = torch.linspace(0, 1, steps)
    rho = 7.0
    s = (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([s, torch.zeros(1)])


def options(sched, step, block=None, total=None, batch=2, sigma=None):
    to = {"sample_sigmas": sched, "sigmas": torch.full((batch,), float(sched[step]) if sigma is None else sigma),
          "cond_or_uncond": [0, 1][:batch]}
    if block is not None:
        to["block_index"] = block
    if total is not None:
        to["total_blocks"] = total
    return to


def test_step_fraction_follows_the_schedule():
    sched = schedule(10)
    assert [step_fraction(options(sched, i)) for i in range(10)] == pytest.approx([i / 10 for i in range(10)])


def test_step_fraction_between_two_sigmas_belongs_to_the_step_it_is_inside():
    # dpm_2 evaluates at the geometric mean of sigma_i and sigma_i+1.
    sched = schedule(10)
    mid = math.sqrt(float(sched[3]) * float(sched[4]))
    assert step_fraction(options(sched, 0, sigma=mid)) == pytest.approx(0.3)


@pytest.mark.parametrize("to", [
    {},
    {"sigmas": torch.tensor([1.0])},                                    # no schedule (older ComfyUI)
    {"sample_sigmas": schedule(4)},                                     # no current sigma
    {"sigmas": torch.tensor([1.0]), "sample_sigmas": torch.tensor([1.0])},  # a 0-step schedule
    {"sigmas": torch.tensor([99.0]), "sample_sigmas": schedule(4)},     # above the schedule
    {"sigmas": torch.tensor([1.0]), "sample_sigmas": [3.0, 1.0, 0.0]},  # not a tensor
])
def test_step_fraction_unknown(to):
    assert step_fraction(to) is None


# -- a whole sampling run through route_exact -------------------------------------------------------

def run_schedule(policies, steps=10, blocks=19, q_len=64, kv_len=64, total=True):
    """Every (step, block) call of a run: counts of routed policies and of quantized calls."""
    sched = schedule(steps)
    routed, quantized, notes = {}, 0, set()
    for step in range(steps):
        for block in range(blocks):
            to = options(sched, step, block, blocks if total else None)
            policy, inactive = policies.route_exact(to, q_len, kv_len)
            if inactive:
                notes.add(inactive)
            if policy:
                key = "step" if policy.startswith("outside step range") else policy.split(" ")[0]
                routed[key] = routed.get(key, 0) + 1
            else:
                quantized += 1
    return routed, quantized, notes


def test_step_range_and_blocks_route_exactly_the_expected_calls():
    cfg = PatchConfig(step_start=0.2, step_end=0.9, exact_blocks="0, last 2")
    routed, quantized, notes = run_schedule(CallPolicies(cfg))
    # steps 0, 1 and 9 are outside [0.2, 0.9): 3 x 19; inside, blocks 0, 17, 18 stay exact: 7 x 3.
    assert routed == {"step": 57, "block": 21}
    assert quantized == 7 * 16
    assert not notes


def test_step_end_one_keeps_the_last_step_quantized():
    routed, quantized, _ = run_schedule(CallPolicies(PatchConfig(step_start=0.5)), steps=8, blocks=2)
    assert routed == {"step": 4 * 2} and quantized == 4 * 2


def test_empty_step_range_is_all_exact():
    routed, quantized, _ = run_schedule(CallPolicies(PatchConfig(step_start=0.5, step_end=0.5)), steps=4, blocks=3)
    assert quantized == 0 and routed == {"step": 12}


def test_first_n_and_ranges():
    routed, quantized, _ = run_schedule(CallPolicies(PatchConfig(exact_blocks="first 2, 5-6")), steps=2, blocks=10)
    assert routed == {"block": 2 * 4} and quantized == 2 * 6


def test_last_n_without_total_blocks_cannot_apply_and_says_so():
    routed, quantized, notes = run_schedule(CallPolicies(PatchConfig(exact_blocks="1, last 2")), steps=2,
                                            blocks=5, total=False)
    assert routed == {"block": 2}  # index 1 still works
    assert quantized == 8
    assert notes == {"'last N' blocks cannot apply: this model passes no total_blocks"}


def test_policies_without_their_inputs_do_not_route_and_note_why():
    pol = CallPolicies(PatchConfig(step_start=0.1, exact_blocks="0"))
    policy, inactive = pol.route_exact({}, 64, 64)
    assert policy is None
    assert "step range cannot apply" in inactive
    policy, inactive = pol.route_exact(None, 64, 64)
    assert policy is None and inactive


def test_short_calls_and_cross_attention():
    pol = CallPolicies(PatchConfig(min_seq_len=256, cross_attention="exact"))
    assert pol.route_exact({}, 255, 255)[0] == "short call (< 256 query tokens)"
    assert pol.route_exact({}, 256, 256)[0] is None
    assert pol.route_exact({}, 4096, 77)[0] == "cross attention kept exact"
    assert CallPolicies(PatchConfig()).route_exact({}, 4096, 77)[0] is None
    assert CallPolicies(PatchConfig()).route_exact({}, 1, 1)[0] is None  # min_seq_len 0 quantizes everything


def test_step_fraction_is_read_once_per_model_call(monkeypatch):
    """All attention calls of one forward pass share the sigmas tensor; on a GPU each read is a sync."""
    import comfyui_sage_rdna4.sage_patch.policies as policies_mod

    reads = []
    real = policies_mod.step_fraction
    monkeypatch.setattr(policies_mod, "step_fraction", lambda to: reads.append(1) or real(to))
    pol = CallPolicies(PatchConfig(step_start=0.2))
    sched = schedule(5)
    for step in range(5):
        to = options(sched, step)
        results = {pol.route_exact(dict(to, block_index=b), 64, 64)[0] for b in range(30)}
        assert len(results) == 1
    assert len(reads) == 5


@pytest.mark.parametrize("bad", [dict(step_start=0.6, step_end=0.4), dict(step_start=-0.1), dict(step_end=1.5),
                                 dict(min_seq_len=-1), dict(cross_attention="sometimes"),
                                 dict(on_unsupported="ignore")])
def test_config_rejects_impossible_settings(bad):
    with pytest.raises(ValueError):
        PatchConfig(**bad)


@pytest.mark.parametrize("field, bad, choices", [
    ("kernel", "hip_int8", ("auto", "hip_int8_fp8", "triton_int8_fp16", "sdpa", "reference")),
    ("kernel", "", ("auto", "sdpa")),
    ("prologue", "cuda", ("auto", "hip", "triton")),
    ("prologue", "HIP", ("auto", "hip", "triton")),  # a prompt JSON skips the UI's combo: exact spelling only
])
def test_config_refuses_an_unknown_kernel_or_prologue_naming_the_choices(field, bad, choices):
    """An unknown kernel failed only later in KSampler, an unknown prologue made every call fall back silently."""
    with pytest.raises(ValueError) as exc:
        PatchConfig(**{field: bad})
    message = str(exc.value)
    assert field in message and repr(bad) in message
    assert all(f"'{c}'" in message for c in choices), message


def test_config_takes_every_kernel_and_prologue_the_node_offers():
    from comfyui_sage_rdna4.kernels.call_spec import PROLOGUES
    from comfyui_sage_rdna4.kernels.registry import BACKEND_NAMES
    from comfyui_sage_rdna4.sage_patch import config

    assert config.KERNEL_CHOICES == ("auto", *BACKEND_NAMES) and config.PROLOGUE_CHOICES == PROLOGUES
    for kernel in config.KERNEL_CHOICES:
        assert PatchConfig(kernel=kernel).kernel == kernel
    for prologue in config.PROLOGUE_CHOICES:
        assert PatchConfig(prologue=prologue).prologue == prologue


# -- through the override: stats show how many calls each policy routed -----------------------------

def wrapped_call(override, q, k, v, heads, transformer_options):
    """How wrap_attn hands a call to the override."""
    to = dict(transformer_options, optimized_attention_override=override)
    return override(comfy_attention, q, k, v, heads, transformer_options=to, _inside_attn_wrapper=True)


def test_override_stats_count_each_policy():
    cfg = PatchConfig(kernel="reference", step_start=0.25, step_end=0.75, exact_blocks="last 1", min_seq_len=16,
                      cross_attention="exact")
    ov = SageAttentionOverride(cfg)
    sched = schedule(4)
    g = torch.Generator().manual_seed(0)
    img = torch.randn(1, 32, 2 * 16, generator=g)
    txt = torch.randn(1, 8, 2 * 16, generator=g)
    comfy_attention.calls = 0
    for step in range(4):
        for block in range(3):
            to = options(sched, step, block, 3, batch=1)
            out = wrapped_call(ov, img, img, img, 2, to)            # self attention, 32 tokens
            assert out.shape == img.shape and torch.isfinite(out).all()
            wrapped_call(ov, img, txt, txt, 2, to)                   # cross attention
            wrapped_call(ov, img[:, :8], img[:, :8], img[:, :8], 2, to)  # short call
    snap = ov.stats.snapshot()
    print(ov.stats.summary())
    # self attention: steps 1 and 2 in range, blocks 0 and 1 quantized -> 4 kernel calls.
    assert snap["calls"] == {"reference": 4}
    assert snap["routed"] == {"outside step range 0.25-0.75": 2 * 3, "block 2 kept exact": 2,
                              "cross attention kept exact": 12, "short call (< 16 query tokens)": 12}
    assert snap["fallbacks"] == {}
    assert comfy_attention.calls == 3 * 12 - 4  # everything not run by the kernel went to ComfyUI's attention
    assert "exact by policy (cross attention kept exact): 12" in ov.stats.summary()


def test_override_notes_a_policy_that_cannot_apply_once():
    ov = SageAttentionOverride(PatchConfig(kernel="reference", exact_blocks="last 2"))
    x = torch.randn(1, 16, 32)
    for block in range(5):
        wrapped_call(ov, x, x, x, 2, {"block_index": block})
    snap = ov.stats.snapshot()
    assert snap["calls"] == {"reference": 5}
    assert snap["notes"] == ["'last N' blocks cannot apply: this model passes no total_blocks"]


# -- a real ComfyUI run ----------------------------------------------------------------------------

@pytest.mark.comfyui
@pytest.mark.slow
def test_policies_in_a_real_comfyui_run():
    """Tiny SD1.5-type and Flux-type models sampled by ComfyUI's own sampler on the CPU.

    SD1.5: the step range routes exactly the first half of the calls; the rest are in block 0 of their
    SpatialTransformer (which sets block_index), so 'exact_blocks 0' routes them all.
    Flux: the step range routes half; the other half runs the quantized kernel; this ComfyUI's Flux passes no
    block_index, so 'last 1' must say it cannot apply (a newer one that does keeps the last block exact)."""
    import comfy_harness as harness

    harness.comfy_import(cpu=True)
    import comfy.sample

    from comfyui_sage_rdna4.sage_patch.install import patch_model

    def sample(model, cfg, latent, cond, steps=4):
        patched, ov = patch_model(model, cfg)
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
        out = comfy.sample.sample(patched, noise, steps, 1.0, "euler", "normal", cond, cond, latent, seed=0,
                                  disable_pbar=True)
        assert torch.isfinite(out).all()
        print(ov.stats.summary())
        snap = ov.stats.snapshot()
        by = lambda prefix: sum(n for p, n in snap["routed"].items() if p.startswith(prefix))  # noqa: E731
        return snap, by("outside step range"), by("block "), sum(snap["calls"].values())

    snap, steps_routed, blocks_routed, ran = sample(
        harness.tiny_sd15(), PatchConfig(kernel="reference", step_start=0.5, exact_blocks="0"),
        harness.image_latent(4, 64, 64)["samples"], harness.text_conditioning(8, 64))
    assert steps_routed > 0 and steps_routed == blocks_routed and ran == 0
    assert snap["fallbacks"] == {}

    snap, steps_routed, blocks_routed, ran = sample(
        harness.tiny_flux(), PatchConfig(kernel="reference", step_start=0.5, exact_blocks="last 1"),
        harness.image_latent(16, 64, 64)["samples"], harness.flux_conditioning())
    assert steps_routed > 0 and ran > 0 and snap["fallbacks"] == {}
    if blocks_routed:
        assert steps_routed == blocks_routed + ran
    else:
        assert steps_routed == ran
        assert any("cannot apply" in n for n in snap["notes"])
