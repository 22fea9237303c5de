"""Key-only masks in the HIP kernels, on the CPU.

The host side (backends/hip/masks.py, kernel_abi): a bool mask becomes bias 0 / -inf, a float mask (any dtype)
mask * log2(e) in FP32 floored at -FP32 max, dead keys -inf; the key end, the live keys and their counts; the plans'
entry points and arguments; per-row masks refused with their kind. Then the masked kernels themselves through the
host simulator (kernels/verify/host_sim.py: the same sources, the gfx12 WMMA emulated): the prologue with live keys
bit-exact against quant.quantize_qkv_torch(live=...), and the masked attention against the spec's attention half,
the whole spec and exact attention with the mask, on padding keys 1000x larger than the rest. A simulator case takes
5-15 s of CPU: one per path runs by default, the rest is marked slow."""
import math

import pytest
import torch

from comfyui_sage_rdna4.kernels import quant
from comfyui_sage_rdna4.kernels.backends.hip import backend as hip_backend
from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi
from comfyui_sage_rdna4.kernels.backends.hip.masks import key_mask_operands
from comfyui_sage_rdna4.kernels.call_spec import describe_call, key_mask
from comfyui_sage_rdna4.kernels.verify import hip_checks, host_sim

CPU = torch.device("cpu")
LOG2E = 1.4426950408889634
FP32_MAX = torch.finfo(torch.float32).max
SLOW = pytest.mark.slow
needs_sim = pytest.mark.skipif(host_sim.host_compiler() is None, reason="no host C++ compiler for the simulator")


# -- the operands -----------------------------------------------------------------------------------------------

def test_bool_mask_becomes_zero_or_minus_inf():
    keep = torch.tensor([[True, True, False, True, False, False]])  # (B 1, Nk 6), 2-D as ComfyUI hands it on
    km = key_mask_operands(keep, kv_heads=2, kv_len=6)
    bias = km.attention.bias
    assert bias.dtype == torch.float32 and bias.shape == (1, 1, 6) and bias.is_contiguous()
    assert bias.tolist() == [[[0.0, 0.0, -math.inf, 0.0, -math.inf, -math.inf]]]
    assert km.attention.key_end.dtype == torch.int32 and km.attention.key_end.tolist() == [[4]]
    assert km.attention.fill is True
    assert km.live.dtype == torch.bool and km.live.tolist() == [[[True, True, False, True, False, False]]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float_mask_in_any_dtype_becomes_an_fp32_base2_bias(dtype):
    """Soft values are mask * log2(e) in FP32 (the mask's own values, whatever its dtype); -finfo.max of the mask's
    dtype floors at -FP32 max and, 8192 or more below the row's largest, is dead (-inf); -inf stays -inf."""
    m = torch.tensor([0.5, -3.0, 0.0, -torch.finfo(dtype).max, -math.inf, 2.0], dtype=dtype).view(1, 1, 1, 6)
    km = key_mask_operands(m, kv_heads=1, kv_len=6)
    want = (m.float().view(6)[[0, 1, 2, 5]] * LOG2E).tolist()
    got = km.attention.bias.view(6)
    assert got[[0, 1, 2, 5]].tolist() == want
    assert got[3] == -math.inf and got[4] == -math.inf  # dead: far below the largest bias
    assert km.attention.fill is False
    assert km.attention.key_end.tolist() == [[6]]
    assert km.live.view(6).tolist() == [True, True, True, False, False, True]


def test_a_row_masked_everywhere_keeps_its_keys():
    """Every key at -finfo.max: all equal, none dead (SDPA's uniform average), bias -FP32 max; every key -inf: none
    dead either (its rows are empty), key end Nk."""
    swamped = torch.full((2, 1, 1, 5), -torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    km = key_mask_operands(swamped, kv_heads=1, kv_len=5)
    assert torch.equal(km.attention.bias, torch.full((2, 1, 5), -FP32_MAX))
    assert km.attention.key_end.tolist() == [[5], [5]] and bool(km.live.all())
    empty = key_mask_operands(torch.zeros(1, 1, 5, dtype=torch.bool), kv_heads=1, kv_len=5)
    assert bool((empty.attention.bias == -math.inf).all()) and empty.attention.key_end.tolist() == [[5]]


def test_broadcast_shapes_per_batch_and_head():
    """(B, Hq, 1, Nk) keeps one row per (batch, q head); a key is live for a kv head where any q head of its group
    keeps it; a mask expanded over the query rows (stride 0) is the same key-only mask."""
    m = torch.ones(2, 4, 1, 8, dtype=torch.bool)
    m[0, 0, 0, 6:] = False   # q head 0 (kv head 0) hides keys 6, 7; q head 1 keeps them
    m[0, 2, 0, 5:] = False   # kv head 1: both q heads hide 5..7
    m[0, 3, 0, 5:] = False
    m[1, :, 0, :2] = False   # batch 1: keys 0, 1 hidden everywhere
    km = key_mask_operands(m, kv_heads=2, kv_len=8)
    assert km.attention.bias.shape == (2, 4, 8)
    assert km.attention.key_end.tolist() == [[6, 8, 5, 5], [8, 8, 8, 8]]
    assert km.live.shape == (2, 2, 8)
    assert km.live[0, 0].all() and km.live[0, 1].tolist() == [True] * 5 + [False] * 3
    assert km.live[1, :, :2].any() == torch.tensor(False) and km.live[1, :, 2:].all()
    for mask in hip_checks.key_mask_variants(2, 4, 8, (3, 5)).values():  # the spec's own rule, every style
        raw = quant.mask_bias_base2(key_mask(mask, 8))
        assert torch.equal(key_mask_operands(mask, 2, 8).live, quant.live_keys(raw, 2))
    rows = torch.zeros(1, 1, 1, 8).masked_fill(~m[:1, :1], -math.inf).expand(1, 1, 30, 8)
    assert rows.stride(2) == 0
    assert torch.equal(key_mask_operands(rows, 1, 8).attention.bias, key_mask_operands(m[:1, :1], 1, 8).attention.bias)


def test_per_row_masks_are_refused_by_kind():
    per_row = torch.zeros(1, 1, 8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).tril().logical_not(), -math.inf)
    with pytest.raises(ValueError, match="differs between query rows"):
        key_mask_operands(per_row, 1, 8)
    q = torch.empty(1, 2, 8, 64, dtype=torch.float16)
    for mask, kind in ((per_row.half(), "float"), (per_row == 0, "bool")):
        call = describe_call(q, q, q, attn_mask=mask)
        reason = hip_backend.attention_refusal(call, "fp16")
        assert reason and f"a {kind} mask (1, 1, 8, 8) that differs between query rows" in reason


def test_live_keys_operands():
    live = torch.tensor([[[True, False, True, True]]])  # (1, 1, 4): broadcast over batch 2, kv heads 3
    lk = kernel_abi.live_keys(live, 2, 3, 4)
    assert lk.flags.dtype == torch.int8 and lk.flags.shape == (2, 3, 4) and lk.flags.is_contiguous()
    assert lk.flags[1, 2].tolist() == [1, 0, 1, 1]
    assert lk.count.dtype == torch.float64 and lk.count.tolist() == [3.0] * 6
    none = kernel_abi.live_keys(torch.zeros(1, 1, 4, dtype=torch.bool), 1, 1, 4)
    assert none.count.tolist() == [1.0]  # at least 1: the spec's clamp


def _qq(b=2, hq=4, hkv=2, nq=300, nk=200, d=64, pv="fp8"):
    q = torch.randn(b, hq, nq, d, dtype=torch.float16)
    k = torch.randn(b, hkv, nk, d, dtype=torch.float16)
    return q, quant.quantize_qkv_torch(q, k, k, sm_scale=0.125, pv=pv)


def test_attention_plan_takes_the_masked_entry_points_with_their_operands():
    q, qq = _qq()
    mask = torch.zeros(2, 4, 1, 200)
    mask[1, :, :, 150:] = -math.inf
    km = key_mask_operands(mask, 2, 200).attention
    _, _, plain = kernel_abi.attention_plan(qq, pv="fp8", is_causal=False, out_dtype=torch.float16)
    _, _, launches = kernel_abi.attention_plan(qq, pv="fp8", is_causal=False, out_dtype=torch.float16, key_mask=km)
    assert [ln.kernel for ln in plain] == ["sage_attn_i8f8_d64_f16"]
    assert [ln.kernel for ln in launches] == ["sage_attn_i8f8_d64_f16_kmask"]
    extra = launches[0].args[len(plain[0].args):]
    assert launches[0].args[:len(plain[0].args)][:7] == plain[0].args[:7]
    assert extra == (("ptr", km.bias.data_ptr()), ("i64", 4 * 200), ("i64", 200), ("ptr", km.key_end.data_ptr()),
                     ("i64", 4), ("i64", 1), ("i32", 0))
    # A mask with one row for all: strides 0 (the kernel reads the same row for every batch and head).
    shared = key_mask_operands(torch.zeros(1, 1, 200, dtype=torch.bool), 2, 200).attention
    _, _, launches = kernel_abi.attention_plan(qq, pv="fp8", is_causal=True,
                                               out_dtype=torch.bfloat16, key_mask=shared)
    assert launches[0].kernel == "sage_attn_i8f8_d64_bf16_kmask"
    assert launches[0].args[-7:] == (("ptr", shared.bias.data_ptr()), ("i64", 0), ("i64", 0),
                                     ("ptr", shared.key_end.data_ptr()), ("i64", 0), ("i64", 0), ("i32", 1))


def test_attention_plan_refuses_malformed_operands():
    _, qq = _qq()
    good = key_mask_operands(torch.zeros(2, 4, 1, 200), 2, 200).attention
    bad = [
        kernel_abi.KeyMaskOperands(good.bias.double(), good.key_end, False),
        kernel_abi.KeyMaskOperands(good.bias[..., :199], good.key_end, False),
        kernel_abi.KeyMaskOperands(good.bias[:, :3], good.key_end[:, :3], False),
        kernel_abi.KeyMaskOperands(good.bias, good.key_end.long(), False),
        kernel_abi.KeyMaskOperands(good.bias.transpose(0, 2).contiguous().transpose(0, 2), good.key_end, False),
    ]
    for km in bad:
        with pytest.raises(ValueError, match="key (bias|end) must be"):
            kernel_abi.attention_plan(qq, pv="fp8", is_causal=False, out_dtype=torch.float16, key_mask=km)


def test_prologue_plan_hands_the_live_keys_to_k_and_v_only():
    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 70, 64, dtype=torch.bfloat16)
    lk = kernel_abi.live_keys(torch.ones(1, 1, 70, dtype=torch.bool), 1, 1, 70)
    _, _, launches = kernel_abi.prologue_plan(q, k, k, sm_scale=0.125, smooth_k=True, pv="fp8", smooth_v=True,
                                              live=lk)
    flags, count = ("ptr", lk.flags.data_ptr()), ("ptr", lk.count.data_ptr())
    by_kind = [(ln.kernel, flags in ln.args, count in ln.args) for ln in launches]
    assert by_kind == [
        ("sage_colstats_bf16", True, False), ("sage_colstats_finalize", False, True),    # K mean: live count
        ("sage_colstats_bf16", True, False), ("sage_colstats_finalize", False, True),    # V mean
        ("sage_colstats_bf16", True, False), ("sage_colstats_finalize", False, False),   # V amax
        ("sage_quant_qk_d64_g1_bf16", False, False),                                      # Q: no mask
        ("sage_quant_qk_d64_g1_bf16", True, False), ("sage_quant_v_fp8_bf16", True, False)]
    _, _, plain = kernel_abi.prologue_plan(q, k, k, sm_scale=0.125, smooth_k=True, pv="fp8", smooth_v=True)
    assert all(("ptr", 0) in ln.args for ln in plain if ln.kernel != "sage_quant_qk_d64_g1_bf16")
    with pytest.raises(ValueError, match="live must be"):
        kernel_abi.prologue_plan(q, k, k, sm_scale=0.125, smooth_k=True, pv="fp8",
                                 live=kernel_abi.LiveKeys(lk.flags.bool(), lk.count))


@pytest.mark.parametrize("prologue", ["hip", "triton"])
def test_backend_launch_hands_the_mask_to_both_halves(monkeypatch, prologue):
    """HipBackend.launch: the prologue the call asks for gets the live keys, the attention the key bias and end (a
    bool mask: fill); an unmasked call gets neither. Both halves are stand-ins here (the simulator tests below run
    the kernels)."""
    from comfyui_sage_rdna4.kernels.backends.hip import prologue as hip_prologue
    seen = {}

    def quantize(q, k, v, live=None, **kw):
        seen["live"] = live
        return quant.quantize_qkv_torch(q, k, v, live=live, **kw)

    def attention(qq, call, pv, sm_scale, q=None, key_mask=None):
        seen["key_mask"] = key_mask
        return torch.zeros(q.shape, dtype=q.dtype), None

    if prologue == "triton":
        triton_prologue = pytest.importorskip("comfyui_sage_rdna4.kernels.backends.triton.prologue")
        monkeypatch.setattr(triton_prologue, "triton_quantize_qkv", quantize)
        monkeypatch.setattr(hip_prologue, "hip_quantize_qkv", None)  # must not be reached
    else:
        monkeypatch.setattr(hip_prologue, "hip_quantize_qkv", quantize)
    backend = hip_backend.make_backend("fp16")
    backend.attention_impl = attention
    q = torch.randn(2, 2, 30, 64, dtype=torch.float16)
    kv = q[:, :, :1].expand(2, 2, 50, 64)
    keep = torch.ones(2, 1, 1, 50, dtype=torch.bool)
    keep[1, ..., 40:] = False
    backend.launch(q, kv, kv, describe_call(q, kv, kv, attn_mask=keep, prologue=prologue), 0.125, keep)
    assert seen["live"].shape == (2, 1, 50) and seen["live"][1, 0, 40:].any() == torch.tensor(False)
    assert seen["key_mask"].fill and seen["key_mask"].key_end.tolist() == [[50], [40]]
    backend.launch(q, q, q, describe_call(q, q, q, prologue=prologue), 0.125, None)
    assert seen["live"] is None and seen["key_mask"] is None


# -- the kernels, through the host simulator --------------------------------------------------------------------

PAD = (30, 90)


@needs_sim
@pytest.mark.parametrize("pv,d,dtype,group,smooth_v", [
    ("fp8", 64, torch.float16, "token", False),
    pytest.param("fp16", 128, torch.bfloat16, "block32", True, marks=SLOW),
    pytest.param("fp8", 64, torch.bfloat16, "block64", True, marks=SLOW),
])
def test_prologue_with_live_keys_is_bit_exact(pv, d, dtype, group, smooth_v):
    """Dead keys (1000x larger) out of the K mean, the V mean and the K and V scales, their codes 0, the means over
    the live count: quant.quantize_qkv_torch(live=...) bit for bit, smooth_k on and off."""
    q, k, v = hip_checks.padded_qkv(2, 2, 1, 40, 150, d, dtype, CPU, PAD)
    mask = hip_checks.key_mask_variants(2, 2, 150, PAD)["-finfo.max bf16"]
    for smooth_k in (True, False):
        kw = dict(sm_scale=1 / math.sqrt(d), smooth_k=smooth_k, pv=pv, qk_group=group, smooth_v=smooth_v)
        qq, km = hip_checks.masked_prologue(host_sim.run, q, k, v, mask, **kw)
        assert hip_checks.masked_prologue_mismatches(qq, q, k, v, km, **kw) == {}
        assert not qq.k8[1, :, 150 - PAD[1]:].any() and not qq.v.float()[0, :, 150 - PAD[0]:].any()


def _masked_case(name, pv, d, dtype, causal=False, nq=40, nk=150, hq=2, hkv=1, smooth_k=True):
    scale = 1.0 if name in ("per-head bool", "soft bias") else 1000.0  # live padding belongs in the statistics
    q, k, v = hip_checks.padded_qkv(2, hq, hkv, nq, nk, d, dtype, CPU, PAD, scale=scale)
    mask = hip_checks.key_mask_variants(2, hq, nk, PAD, nq=nq)[name]
    sm = 1 / math.sqrt(d)
    qq, km = hip_checks.masked_prologue(host_sim.run, q, k, v, mask, sm_scale=sm, pv=pv, smooth_k=smooth_k)
    out, lse = hip_checks.masked_attention(host_sim.run, qq, km, pv=pv, is_causal=causal, out_dtype=dtype,
                                           return_lse=True, q=q, sm_scale=sm)
    return out, lse, qq, km, q, k, v, mask


@needs_sim
@pytest.mark.parametrize("name,pv,d,dtype,causal", [
    ("-finfo.max bf16", "fp8", 64, torch.bfloat16, False),
    ("bool", "fp16", 128, torch.float16, False),
    pytest.param("neg-inf fp16", "fp8", 128, torch.float16, True, marks=SLOW),
    pytest.param("-finfo.max expanded", "fp16", 64, torch.bfloat16, False, marks=SLOW),
    pytest.param("per-head bool", "fp8", 64, torch.float16, False, marks=SLOW),
    pytest.param("soft bias", "fp16", 64, torch.float16, True, marks=SLOW),
    pytest.param("-finfo.max bf16 3d", "fp8", 128, torch.bfloat16, False, marks=SLOW),
])
def test_masked_attention_matches_the_spec(name, pv, d, dtype, causal):
    """Padding keys 1000x larger than the rest, hidden by the mask: the kernel follows the spec's attention half
    with the same key bias (same QuantizedQKV), the whole spec and exact attention with the mask, LSE included; the
    padding reaches neither the row max nor the statistics."""
    out, lse, qq, km, q, k, v, mask = _masked_case(name, pv, d, dtype, causal=causal)
    rep = hip_checks.masked_report(out, lse, qq, km, q, k, v, mask, pv=pv, is_causal=causal, sm_scale=1 / math.sqrt(d))
    print(name, pv, d, {k_: f"{v_:.2e}" for k_, v_ in rep.items()})
    hip_checks.assert_masked_attention_ok(rep, pv)


@needs_sim
@pytest.mark.parametrize("pv", ["fp8", pytest.param("fp16", marks=SLOW)])
def test_fully_masked_rows_follow_sdpa(pv):
    """Every key -inf: zeros and LSE -inf (torch 2.13's SDPA gives zeros too); every key at -finfo.max: the
    uniform average over the keys, as SDPA's FP32 sum swamps the scores (the shift must not push every P to 0)."""
    out, lse, *_ = _masked_case("all -inf", pv, 64, torch.float16, nk=100)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    out, lse, qq, km, q, k, v, mask = _masked_case("all -finfo.max", pv, 64, torch.float16, nk=100)
    uniform = v.float().mean(dim=2, keepdim=True).repeat_interleave(2, dim=1).expand(out.shape)
    err = float((out.float() - uniform).abs().sum() / uniform.abs().sum())
    assert err <= {"fp8": 0.05, "fp16": 0.01}[pv], err  # V's own rounding: the spec's error too
    ref, _ = hip_checks.hip_spec(qq, pv=pv, out_dtype=torch.float16, key_bias=km.attention.bias)
    assert float((out.float() - ref.float()).abs().sum() / ref.float().abs().sum()) < 2e-3
    assert torch.isfinite(lse).all()


@needs_sim
def test_bool_mask_selects_even_a_nan_key():
    """A bool mask selects: a masked key whose K holds NaN (smooth_k off, so only its own scale is NaN) scores -inf
    and the output stays the spec's, finite."""
    q, k, v = hip_checks.padded_qkv(1, 1, 1, 40, 100, 64, torch.float16, CPU, (20,))
    k[0, 0, 90, 3] = float("nan")  # inside the masked padding, before its end: the kernel reads its tile
    keep = torch.ones(1, 1, 1, 100, dtype=torch.bool)
    keep[..., 80:95] = False
    sm = 0.125
    qq, km = hip_checks.masked_prologue(host_sim.run, q, k, v, keep, sm_scale=sm, pv="fp16", smooth_k=False)
    assert km.attention.key_end.tolist() == [[100]] and bool(qq.k_scale[0, 0, 90].isnan())
    out, _ = hip_checks.masked_attention(host_sim.run, qq, km, pv="fp16", is_causal=False, out_dtype=torch.float16,
                                         q=q, sm_scale=sm)
    ref, _ = hip_checks.hip_spec(qq, pv="fp16", out_dtype=torch.float16, key_bias=km.attention.bias, key_fill=True)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert float((out.float() - ref.float()).abs().sum() / ref.float().abs().sum()) < 2e-3


@needs_sim
@pytest.mark.parametrize("units", [1e-9, pytest.param(1.0, marks=SLOW)])
def test_split_launches_address_the_mask_of_each_piece(units):
    """A call cut into launches (kernels/launch_split.py: one row block of one q head per launch, or one head) reads
    each piece's own mask row: a different key end per (batch, head), the same output and LSE bits as one launch."""
    from comfyui_sage_rdna4.kernels import launch_split as ls
    b, hq, hkv, nq, nk = 2, 2, 1, 150, 70
    q, k, v = hip_checks.make_qkv(b, hq, hkv, nq, nk, 64, torch.float16, CPU, layout="nhd")
    keep = torch.ones(b, hq, 1, nk, dtype=torch.bool)
    for i, (bi, h) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        keep[bi, h, :, nk - 5 - 20 * i:] = False
    sm = 0.125
    qq, km = hip_checks.masked_prologue(host_sim.run, q, k, v, keep, sm_scale=sm, pv="fp8")
    assert km.attention.key_end.tolist() == [[65, 45], [25, 5]]
    head = ls.call_work(ls.visible_keys(0, nq, nk, False), 64, 64, "fp8")
    results = []
    for bound in (None, units * head):
        with ls.work_bound_override(bound):
            out, lse, launches = kernel_abi.attention_plan(qq, pv="fp8", is_causal=False, out_dtype=torch.float16,
                                                           return_lse=True, q=q, sm_scale=sm, key_mask=km.attention)
        host_sim.run(launches)
        results.append((out, lse, len(launches)))
    (one, one_lse, n_one), (split, split_lse, n_split) = results
    assert n_one == 1 and n_split > 1
    assert torch.equal(one, split) and torch.equal(one_lse, split_lse)
    ref, _ = hip_checks.hip_spec(qq, pv="fp8", out_dtype=torch.float16, key_bias=km.attention.bias)
    assert float((one.float() - ref.float()).abs().sum() / ref.float().abs().sum()) < 2e-3


def test_the_report_moves_an_expanded_mask_to_the_cpu_as_key_only():
    """masked_report compares against the spec on the CPU: a copy across devices materializes a stride-0 expand
    (the spec then sees a per-row mask and keeps the padding in its statistics, as on the H200 for the GPU test's
    expanded case); hip_checks.cpu_keeping_broadcast keeps it key-only."""
    from comfyui_sage_rdna4.kernels.call_spec import mask_scope
    mask = hip_checks.key_mask_variants(2, 2, 150, PAD, nq=70)["-finfo.max expanded"]
    moved = hip_checks.cpu_keeping_broadcast(mask)
    assert moved.stride(2) == 0 and torch.equal(moved, mask) and mask_scope(moved) == "keys"
    assert mask_scope(mask.contiguous()) == "rows"  # what a materializing copy would hand the spec
    plain = torch.randn(2, 3, 4)
    assert torch.equal(hip_checks.cpu_keeping_broadcast(plain), plain)
