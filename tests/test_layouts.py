"""ComfyUI layout adapters and mask expansion."""
import pytest
import torch

from comfyui_sage_rdna4.sage_patch.layouts import (
    expand_mask,
    from_hnd,
    head_split_shapes,
    hnd_views,
    strided_hnd,
    strided_layout,
    to_hnd,
)


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


def test_a_value_with_its_heads_unflattened_is_viewed_as_comfyui_views_it():
    q, k, v = torch.randn(2, 5, 3 * 4), torch.randn(2, 7, 3 * 4), torch.randn(2, 7, 3, 4)
    _, kh, vh = to_hnd(q, k, v, 3, skip_reshape=False)
    assert vh.shape == (2, 3, 7, 4) and torch.equal(vh, v.view(2, -1, 3, 4).transpose(1, 2))
    assert kh.shape == (2, 3, 7, 4)
    with pytest.raises(ValueError, match="v width 10"):
        to_hnd(q, k, torch.randn(2, 7, 2, 5), 3, skip_reshape=False)


def test_skip_reshape_passes_through():
    q = torch.randn(1, 2, 3, 4)
    assert to_hnd(q, q, q, 2, skip_reshape=True)[0] is q
    assert from_hnd(q, skip_output_reshape=True) is q


def test_mask_expansion_follows_comfyui():
    assert expand_mask(None) is None
    assert expand_mask(torch.ones(5, 6)).shape == (1, 1, 5, 6)
    assert expand_mask(torch.ones(2, 5, 6)).shape == (2, 1, 5, 6)
    assert expand_mask(torch.ones(2, 3, 5, 6)).shape == (2, 3, 5, 6)


def test_from_hnd_is_the_reshape_for_any_output_layout():
    for out in (torch.randn(2, 3, 7, 5), torch.randn(2, 7, 3, 5).transpose(1, 2)):  # copy needed / a view
        b, h, n, d = out.shape
        assert from_hnd(out, skip_output_reshape=False).shape == (b, n, h * d)
        assert torch.equal(from_hnd(out, skip_output_reshape=False), out.transpose(1, 2).reshape(b, n, h * d))


def test_strided_views_are_the_view_and_transpose_views():
    """The plan's as_strided views, taken from one call, remade on another call's tensors of the same shapes and
    strides at another storage offset (slices of a fused qkv): the same elements as view + transpose."""
    def slices(seed):
        qkv = torch.randn(2, 5, 3 * 12, generator=torch.Generator().manual_seed(seed))
        return qkv[..., :12], qkv[..., 12:24], qkv[..., 24:]
    first = slices(0)
    shapes = head_split_shapes(*first, 3)
    layout = strided_layout(*hnd_views(*first, shapes))
    second = slices(1)
    for fast, slow in zip(strided_hnd(*second, layout), hnd_views(*second, shapes)):
        assert fast.shape == slow.shape and fast.stride() == slow.stride()
        assert fast.data_ptr() == slow.data_ptr() and torch.equal(fast, slow)


def test_no_strided_layout_for_a_tensor_subclass():
    class Sub(torch.Tensor):
        pass
    q = torch.randn(1, 2, 3, 4)
    assert strided_layout(q, q, q) is not None
    assert strided_layout(q, q.as_subclass(Sub), q) is None


# ------------------------------------------------------------------------------------------------------
# gfx12 WMMA operand layouts (kernels/backends/hip/kernel_abi.py) against AMD's Matrix Instruction Calculator
# ------------------------------------------------------------------------------------------------------
def _calculator_a_slot(i, k, element_bytes):
    """(lane, element) of A[i][k] for the wave32 dense RDNA4 16x16x16 WMMA, as AMD's calculator computes them
    (ROCm/amd_matrix_instruction_calculator, InstCalcGfx12.__get_input_lane / __get_input_reg): the register and
    its sub-dword field give the element (little-endian within the dword)."""
    if element_bytes == 2:
        lane, reg, field = 16 * ((k // 4) % 2) + i, 2 * (k // 8) + (k // 2) % 2, k % 2
        return lane, 2 * reg + field
    lane, reg, field = 16 * (k // 8) + i, (k // 4) % 2, k % 4
    return lane, 4 * reg + field


def test_wmma_operand_lanes_follow_amds_calculator():
    """lanes_from_a / lanes_from_b / lanes_from_d put every element where the calculator says gfx12 holds it: 8-bit
    A[i][k] in lane 16 (k // 8) + i, f16 A[i][k] with lanes 0-15 holding K 0-3 and 8-11, lanes 16-31 K 4-7 and
    12-15; B the same with its column; D[i][j] in lane 16 (i // 8) + j, register i % 8."""
    from comfyui_sage_rdna4.kernels.backends.hip import kernel_abi
    ids = torch.arange(256).view(16, 16)
    for dtype, nbytes in ((torch.int16, 2), (torch.int8, 1)):  # stand-ins of the element size (f16; iu8/fp8)
        m = (ids % 128).to(dtype) if nbytes == 1 else ids.to(dtype)
        a_l, b_l = kernel_abi.lanes_from_a(m), kernel_abi.lanes_from_b(m)
        for i in range(16):
            for k in range(16):
                lane, e = _calculator_a_slot(i, k, nbytes)
                assert int(a_l[lane, e]) == int(m[i, k]), (nbytes, i, k)
                assert int(b_l[lane, e]) == int(m[k, i]), (nbytes, k, i)  # B[k][j]: lane from j = i here
    d_l = kernel_abi.lanes_from_d(ids)
    for i in range(16):
        for j in range(16):
            assert int(d_l[16 * (i // 8) + j, i % 8]) == int(ids[i, j])
    assert torch.equal(kernel_abi.d_from_lanes(d_l), ids)
