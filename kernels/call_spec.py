"""One attention call, described once, so every backend judges the same facts.

Tensors are always seen in HND layout here: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv).
The public API turns NHD views into HND views (no copy) before describing the call.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

QK_GROUPS = ("token", "block32", "block64", "block128")
PROLOGUES = ("auto", "hip", "triton")
# The one rule for autograd (Backend.why_not): the Triton/HIP kernels return no grad_fn and the reference's gradient
# is not attention's, so a call that needs a gradient goes to exact attention.
AUTOGRAD_REFUSAL = ("an input requires grad (grad mode on): the quantized kernels are for inference and give no "
                    "correct gradient; exact attention serves autograd")


@functools.lru_cache(maxsize=None)
def device_arch(device_type: str, index: Optional[int]) -> str:
    """'cpu', 'sm_90' on NVIDIA, 'gfx1201' on ROCm (feature suffixes like ':sramecc+' dropped)."""
    if device_type != "cuda":
        return device_type
    return arch_from_properties(torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()))


def arch_from_properties(props) -> str:
    """The arch name of a GPU from its torch device properties (uncached: `device_arch` caches it per device)."""
    if getattr(torch.version, "hip", None):
        return str(getattr(props, "gcnArchName", "gfx_unknown")).split(":")[0]
    return f"sm_{getattr(props, 'major', 0)}{getattr(props, 'minor', 0)}"


def is_rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


@dataclass(frozen=True)
class AttentionCall:
    device_type: str
    device_index: Optional[int]
    arch: str
    rocm: bool
    dtype: torch.dtype
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    mask: str  # "none" | "bool" | "float"
    mask_shape: Optional[Tuple[int, ...]]
    mask_scope: str  # "none" | "keys" (one value per key: `key_mask`) | "rows" (differs between query rows)
    is_causal: bool
    return_lse: bool
    smooth_k: bool
    smooth_v: bool
    prologue: str
    qk_group: str
    last_dim_contiguous: bool
    same_dtype: bool
    same_device: bool
    has_zero_size: bool
    requires_grad: bool  # grad mode is on and q, k, v or the mask requires grad: AUTOGRAD_REFUSAL
    # The caller turns the output into (B, Nq, Hq * Dv) (ComfyUI's reshape): a kernel that writes it token-major
    # makes that reshape a view instead of a copy of the whole output.
    out_nhd: bool = False

    def short(self) -> str:
        return (f"B{self.batch} Hq{self.q_heads} Hkv{self.kv_heads} Nq{self.q_len} Nk{self.kv_len} "
                f"D{self.head_dim} {str(self.dtype).replace('torch.', '')} on {self.arch}")


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> None:
    """Errors that no backend could serve: the call itself is malformed."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    b, hq, _, d = q.shape
    bk, hk, nk, dk = k.shape
    bv, hv, nv, _ = v.shape
    if not (b == bk == bv):
        raise ValueError(f"batch sizes differ: q {b}, k {bk}, v {bv}")
    if hk != hv or nk != nv:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share heads and length")
    if d != dk:
        raise ValueError(f"q head_dim {d} != k head_dim {dk}")
    if d == 0:  # would reach the quantizers' amax() over an empty dim
        raise ValueError("q/k head_dim 0: attention needs at least one channel")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q heads {hq} must be a multiple of k/v heads {hk}")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            # Added as a bias, a 0/1 integer mask would shift scores by +0/+1 instead of selecting (torch SDPA
            # refuses it) and a complex one would lose its imaginary part.
            raise ValueError(f"mask dtype {str(attn_mask.dtype).replace('torch.', '')} is not accepted: a bool mask "
                             "selects (True keeps), a floating mask adds to the scores")
        if attn_mask.dim() < 2:
            # ComfyUI unsqueezes 2-D and 3-D masks and hands anything else to SDPA, which fails on it inside torch.
            raise ValueError(f"mask of {attn_mask.dim()} dims: a mask has 2, 3 or 4 dims and broadcasts to "
                             "(B, Hq, Nq, Nk)")
        nq = q.shape[2]
        try:
            full = torch.broadcast_shapes(tuple(attn_mask.shape), (b, hq, nq, nk))
        except RuntimeError:
            full = None
        # Broadcasting must not grow the output: a (3, Nq, Nk) mask with one head broadcasts *with*
        # (3, 1, Nq, Nk) but not *to* it.
        if full != (b, hq, nq, nk):
            raise ValueError(f"mask shape {tuple(attn_mask.shape)} does not broadcast to {(b, hq, nq, nk)}")


MASK_SCOPES = ("none", "keys", "rows")


def mask_4d(attn_mask: torch.Tensor) -> torch.Tensor:
    """The mask as SDPA broadcasts it: leading dims of size 1 added up to 4 (a view)."""
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def mask_scope(attn_mask: Optional[torch.Tensor]) -> str:
    """"keys" where the mask is one value per (batch, head, key), the same for every query row: its query dim is
    1 or a stride-0 expand. A mask materialized per row is "rows" even when its rows repeat: telling would mean
    reading Nq x Nk values (and a device sync) on every call. With no query row at all it is "rows" (no row to
    read the keys' values from; every quantized kernel refuses such a call anyway)."""
    if attn_mask is None:
        return "none"
    m = mask_4d(attn_mask)
    return "keys" if m.shape[2] == 1 or (m.shape[2] > 1 and m.stride(2) == 0) else "rows"


def key_mask(attn_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """A "keys" mask as (Bm, Hm, Nk) (a view; Bm, Hm are 1 where it broadcasts)."""
    m = mask_4d(attn_mask)
    return m[:, :, 0, :].expand(m.shape[0], m.shape[1], kv_len)


def mask_refusal(call: "AttentionCall") -> Optional[str]:
    """Why a kernel that takes key-only masks cannot take this call's mask, or None: the one rule for the
    dispatcher and the kernel wrappers."""
    if call.mask_scope == "rows":
        return (f"a {call.mask} mask {call.mask_shape} that differs between query rows is not supported; key-only "
                "masks (one value per key, the query dim 1 or expanded) are")
    return None


# Descriptions by everything they are a function of (describing a Flux-size call took 15-18 µs of
# host time, the key takes a few). Cleared when full; a malformed call raises before it is kept.
_DESCRIBED: dict = {}
_DESCRIBED_MAX = 512


def describe_call(q, k, v, *, attn_mask=None, is_causal=False, return_lse=False, smooth_k=True,
                  prologue="auto", qk_group="token", smooth_v=False, out_nhd=False) -> AttentionCall:
    mask_key = None if attn_mask is None else (attn_mask.shape, attn_mask.stride(), attn_mask.dtype,
                                                attn_mask.device)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (attn_mask is not None and attn_mask.requires_grad))
    key = (q.shape, k.shape, v.shape, q.stride(-1) if q.dim() else None, k.stride(-1) if k.dim() else None,
           v.stride(-1) if v.dim() else None, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, mask_key,
           is_causal, return_lse, smooth_k, prologue, qk_group, smooth_v, grad, out_nhd)
    try:
        call = _DESCRIBED.get(key)
    except TypeError:  # an unhashable option: described every time, never kept
        return _describe(q, k, v, attn_mask, is_causal, return_lse, smooth_k, prologue, qk_group, smooth_v, grad,
                         out_nhd)
    if call is None:
        call = _describe(q, k, v, attn_mask, is_causal, return_lse, smooth_k, prologue, qk_group, smooth_v, grad,
                         out_nhd)
        if len(_DESCRIBED) >= _DESCRIBED_MAX:
            _DESCRIBED.clear()
        _DESCRIBED[key] = call
    return call


def _describe(q, k, v, attn_mask, is_causal, return_lse, smooth_k, prologue, qk_group, smooth_v,
              requires_grad, out_nhd=False) -> AttentionCall:
    check_shapes(q, k, v, attn_mask)
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if qk_group not in QK_GROUPS:
        raise ValueError(f"qk_group must be one of {QK_GROUPS}, got {qk_group!r}")
    dev = q.device
    if attn_mask is None:
        mask_kind, mask_shape = "none", None
    else:
        mask_kind = "bool" if attn_mask.dtype == torch.bool else "float"
        mask_shape = tuple(attn_mask.shape)
    return AttentionCall(
        device_type=dev.type,
        device_index=dev.index,
        arch=device_arch(dev.type, dev.index),
        rocm=dev.type == "cuda" and is_rocm(),
        dtype=q.dtype,
        batch=q.shape[0],
        q_heads=q.shape[1],
        kv_heads=k.shape[1],
        q_len=q.shape[2],
        kv_len=k.shape[2],
        head_dim=q.shape[3],
        v_head_dim=v.shape[3],
        mask=mask_kind,
        mask_shape=mask_shape,
        mask_scope=mask_scope(attn_mask),
        is_causal=bool(is_causal),
        return_lse=bool(return_lse),
        smooth_k=bool(smooth_k),
        smooth_v=bool(smooth_v),
        prologue=prologue,
        qk_group=qk_group,
        last_dim_contiguous=all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, v)),
        same_dtype=q.dtype == k.dtype == v.dtype,
        same_device=q.device == k.device == v.device
        and (attn_mask is None or attn_mask.device == q.device),
        has_zero_size=q.numel() == 0 or k.numel() == 0 or v.numel() == 0,
        requires_grad=bool(requires_grad),
        out_nhd=bool(out_nhd),
    )
