"""The mask rule in kernels/call_spec.py: which masks are key-only (one value per key, whatever the query row), the
refusal that names the kind, and the describe cache telling an expanded mask from a materialized one."""
import pytest
import torch

from comfyui_sage_rdna4.kernels import quant
from comfyui_sage_rdna4.kernels.call_spec import describe_call, key_mask, mask_refusal, mask_scope
from comfyui_sage_rdna4.sage_patch.layouts import expand_mask

Q = torch.zeros(2, 4, 8, 16)
K = torch.zeros(2, 2, 6, 16)


@pytest.mark.parametrize("shape,scope", [
    ((6,), None),                 # 1-D: malformed (check_shapes raises)
    ((1, 6), "keys"),             # SDPA: (1, 1, 1, 6)
    ((8, 6), "rows"),
    ((1, 1, 6), "keys"),
    ((2, 1, 1, 6), "keys"),
    ((1, 4, 1, 6), "keys"),
    ((2, 1, 8, 6), "rows"),
    ((2, 4, 8, 6), "rows"),
])
def test_mask_scope_by_shape(shape, scope):
    mask = torch.zeros(shape)
    if scope is None:
        with pytest.raises(ValueError):
            describe_call(Q, K, K, attn_mask=mask)
        return
    call = describe_call(Q, K, K, attn_mask=mask)
    assert call.mask_scope == scope == mask_scope(mask)
    reason = mask_refusal(call)
    if scope == "rows":
        assert "differs between query rows" in reason and str(tuple(shape)) in reason and "float" in reason
    else:
        assert reason is None


def test_expanded_rows_are_key_only_and_materialized_ones_are_not():
    """A stride-0 expand along the query dim is recognised without reading the mask; the same values materialized
    are not (telling would read Nq x Nk values per call), and the describe cache keeps the two apart."""
    per_key = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    expanded = per_key.expand(2, 1, 8, 6)
    materialized = expanded.contiguous()
    assert describe_call(Q, K, K, attn_mask=expanded).mask_scope == "keys"
    assert describe_call(Q, K, K, attn_mask=materialized).mask_scope == "rows"
    assert describe_call(Q, K, K, attn_mask=expanded).mask_scope == "keys"  # after the cached materialized call
    assert key_mask(expanded, 6).shape == (2, 1, 6)


def test_no_query_row_is_no_key_mask():
    """An expanded mask over zero query rows has no row to read: described as "rows" (the call is zero-size)."""
    q = torch.zeros(2, 4, 0, 16)
    call = describe_call(q, K, K, attn_mask=torch.zeros(2, 1, 1, 6).expand(2, 1, 0, 6))
    assert call.mask_scope == "rows" and call.has_zero_size


def test_comfyui_3d_key_mask_becomes_key_only():
    """HunyuanVideo's (1, 1, N) bias: ComfyUI's rule makes it (1, 1, 1, N), one value per key."""
    mask = torch.zeros(1, 1, 6)
    assert mask_scope(expand_mask(mask)) == "keys"
    assert key_mask(expand_mask(mask), 6).shape == (1, 1, 6)


def test_bias_units_and_the_floor():
    m = torch.tensor([0.0, -1.0, -float("inf"), -torch.finfo(torch.float32).max, float("nan")])
    b = quant.mask_bias_base2(m)
    assert b[0] == 0 and b[1] == pytest.approx(-quant.LOG2E) and b[2] == -float("inf")
    assert b[3] == -quant.FP32_MAX  # -finfo.max * log2(e) would overflow to -inf: floored, still finite
    assert torch.isnan(b[4])
    bf16 = quant.mask_bias_base2(torch.tensor([-torch.finfo(torch.bfloat16).max], dtype=torch.bfloat16))
    assert bf16[0] == -quant.FP32_MAX
    keep = quant.mask_bias_base2(torch.tensor([True, False]))
    assert keep.tolist() == [0.0, -float("inf")]


def test_live_keys_rule():
    bias = torch.tensor([[[0.0, -8000.0, -8200.0, -float("inf")],      # head 0: keys 2, 3 dead
                          [-float("inf")] * 4,                         # head 1: nothing live: all kept
                          [-quant.FP32_MAX, -quant.FP32_MAX, -float("inf"), -quant.FP32_MAX],  # swamped: 2 dead
                          [0.0, 0.0, 0.0, float("nan")]]])             # NaN compares false: kept
    per_head = quant.live_keys(bias, 4)
    assert per_head.tolist() == [[[True, True, False, False], [True] * 4, [True, True, False, True], [True] * 4]]
    grouped = quant.live_keys(bias, 2)  # kv head 0 = q heads 0, 1: the union
    assert grouped.tolist() == [[[True] * 4, [True] * 4]]
