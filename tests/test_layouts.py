"""ComfyUI layout adapters and mask expansion."""
import torch

from comfyui_sage_rdna4.sage_patch.layouts import expand_mask, from_hnd, to_hnd


def test_bnhd_roundtrip_is_a_view_and_exact():
    b, n, h, d = 2, 7, 3, 5
    q = torch.randn(b, n, h * d)
    qh, kh, vh = to_hnd(q, q, q, h, skip_reshape=False)
    assert qh.shape == (b, h, n, d)
    assert qh.data_ptr() == q.data_ptr()  # no copy
    assert torch.equal(qh[1, 2, 4], q[1, 4, 2 * d:3 * d])
    assert torch.equal(from_hnd(qh, skip_output_reshape=False), q)


def test_value_head_dim_may_differ():
    q = torch.randn(1, 4, 2 * 8)
    v = torch.randn(1, 6, 2 * 3)
    qh, kh, vh = to_hnd(q, torch.randn(1, 6, 16), v, 2, skip_reshape=False)
    assert vh.shape == (1, 2, 6, 3) and kh.shape == (1, 2, 6, 8)


def test_skip_reshape_passes_through():
    q = torch.randn(1, 2, 3, 4)
    assert to_hnd(q, q, q, 2, skip_reshape=True)[0] is q
    assert from_hnd(q, skip_output_reshape=True) is q


def test_mask_expansion_follows_comfyui():
    assert expand_mask(None) is None
    assert expand_mask(torch.ones(5, 6)).shape == (1, 1, 5, 6)
    assert expand_mask(torch.ones(2, 5, 6)).shape == (2, 1, 5, 6)
    assert expand_mask(torch.ones(2, 3, 5, 6)).shape == (2, 3, 5, 6)
