"""The torch reference: the quantized algorithm exactly as the kernels should compute it.

Slow but exact to the spec in `quant.py`, on CPU or GPU. Work is chunked over query rows so a
32k-token call never holds an N x N score matrix. Causal masking is top-left aligned (key j is
visible to query i when j <= i), as PyTorch SDPA's `is_causal`. A query row that can see no key
returns zeros with LSE -inf.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import quant

# Elements of FP32 scores held at once (~128 MiB); bounds memory for any sequence length.
SCORE_BUDGET = 1 << 25


def expand_kv_heads(t: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Repeat K/V heads for grouped-query attention (head h of q uses kv head h // group)."""
    group = q_heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def qk_scores_base2(q8, sq, k8, sk) -> torch.Tensor:
    """Base-2 scores from INT8 operands: (int32 dot) * q_scale * k_scale, as the kernels do."""
    acc = torch.matmul(q8.float(), k8.float().transpose(-1, -2))  # exact: |sum| < 2**24 for D <= 1040
    return acc * sq.unsqueeze(-1) * sk.unsqueeze(-2)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                        sm_scale: Optional[float] = None, smooth_k: bool = True, pv: str = "fp8",
                        qk_group: str = "token", attn_mask: Optional[torch.Tensor] = None,
                        return_lse: bool = False, smooth_v: bool = False
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantized attention on HND tensors. Returns (out in q.dtype, natural-log LSE (B, Hq, Nq) or None)."""
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
    if sm_scale is None:
        sm_scale = quant.default_sm_scale(q.shape[3])
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=sm_scale, smooth_k=smooth_k, pv=pv, qk_group=qk_group,
                                  smooth_v=smooth_v)
    return attention_from_quantized(qq, pv=pv, is_causal=is_causal, attn_mask=attn_mask, return_lse=return_lse,
                                    q=q, sm_scale=sm_scale, out_dtype=q.dtype)


def attention_from_quantized(qq: quant.QuantizedQKV, *, pv: str, is_causal: bool = False,
                             attn_mask: Optional[torch.Tensor] = None, return_lse: bool = False,
                             q: Optional[torch.Tensor] = None, sm_scale: Optional[float] = None,
                             out_dtype: torch.dtype = torch.float32):
    """The attention half of the spec, fed by any prologue's output.

    For the LSE's smooth_k correction pass the original `q` and `sm_scale`."""
    b, hq, nq, _ = qq.q8.shape
    nk, dv = qq.k8.shape[2], qq.v.shape[3]
    device = qq.q8.device
    k8, sk = expand_kv_heads(qq.k8, hq), expand_kv_heads(qq.k_scale, hq)
    v_f = expand_kv_heads(qq.v, hq).float()
    v_scale = expand_kv_heads(qq.v_scale, hq).unsqueeze(2)
    v_mean = None if qq.v_mean is None else expand_kv_heads(qq.v_mean, hq).unsqueeze(2)

    out = torch.empty((b, hq, nq, dv), dtype=torch.float32, device=device)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=device) if return_lse else None
    if attn_mask is not None:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).expand(b, hq, nq, nk)
    rows = max(1, SCORE_BUDGET // max(1, b * hq * nk))
    key_idx = torch.arange(nk, device=device)
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        s = qk_scores_base2(qq.q8[:, :, r0:r1], qq.q_scale[:, :, r0:r1], k8, sk)
        if attn_mask is not None:
            m = attn_mask[:, :, r0:r1]
            if m.dtype == torch.bool:
                s = s.masked_fill(~m, -math.inf)
            else:
                s = s + m.float() * quant.LOG2E
        if is_causal:
            q_idx = torch.arange(r0, r1, device=device)
            s = s.masked_fill(key_idx[None, :] > q_idx[:, None], -math.inf)
        row_max = s.amax(dim=-1, keepdim=True) if nk else s.new_full((*s.shape[:-1], 1), -math.inf)
        # Only a row that sees no key (max -inf) is empty and gives zeros; a NaN row max (NaN in q, k or
        # the mask) must stay NaN so bad inputs show instead of turning into a silent black patch.
        alive = row_max != -math.inf
        p = torch.exp2(s - torch.where(alive, row_max, torch.zeros_like(row_max)))
        p = torch.where(alive, p, torch.zeros_like(p))
        row_sum = p.sum(dim=-1, keepdim=True)
        if pv == "fp8":
            acc = torch.matmul(quant.quantize_p_fp8(p), v_f) / quant.FP8_MAX
        else:
            acc = torch.matmul(p.half().float(), v_f)
        o = acc / row_sum * v_scale  # divide first: acc * v_scale overflows FP32 for V near the bf16/fp32 max
        if v_mean is not None:
            o = o + v_mean  # smooth_v: the rows of P sum to 1, so the mean comes back whole
        out[:, :, r0:r1] = torch.where(alive, o, torch.zeros_like(o))
        if lse is not None:
            lse[:, :, r0:r1] = torch.where(alive, (row_max + torch.log2(row_sum)) * math.log(2.0),
                                           torch.full_like(row_max, -math.inf)).squeeze(-1)
    if lse is not None and qq.k_mean is not None and q is not None:
        # smooth_k shifted every score of a row by q.mean*sm_scale; put it back (empty rows stay -inf).
        mean = expand_kv_heads(qq.k_mean.unsqueeze(2), hq)
        shift = torch.matmul(q.float(), mean.transpose(-1, -2)).squeeze(-1) * sm_scale
        lse = torch.where(lse == -math.inf, lse, lse + shift)
    return saturating_cast(out, out_dtype), lse


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast, clamping finite overflow to the dtype's largest value (NaN stays NaN).

    The output is a convex combination of V, but FP8 rounding of P can lift it up to ~6 % above max|V|:
    V at 65504 in fp16 (or at the bf16/fp32 max) would otherwise come out as Inf."""
    if dtype.is_floating_point:
        big = torch.finfo(dtype).max
        x = x.clamp(-big, big)
    return x.to(dtype)


def exact_attention(q, k, v, *, is_causal=False, sm_scale=None, attn_mask=None, return_lse=False):
    """Exact FP32 attention with the same conventions (mask units, causal alignment, empty rows)."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    if sm_scale is None:
        sm_scale = quant.default_sm_scale(d)
    # FP32, or FP64 for FP64 inputs (tests use that as ground truth for inputs near the bf16/fp32 max).
    acc_t = torch.promote_types(q.dtype, torch.float32)
    kf, vf = expand_kv_heads(k.to(acc_t), hq), expand_kv_heads(v.to(acc_t), hq)
    out = torch.empty((b, hq, nq, v.shape[3]), dtype=acc_t, device=q.device)
    lse = torch.empty((b, hq, nq), dtype=acc_t, device=q.device)
    if attn_mask is not None:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).expand(b, hq, nq, nk)
    rows = max(1, SCORE_BUDGET // max(1, b * hq * nk))
    key_idx = torch.arange(nk, device=q.device)
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        s = torch.matmul(q[:, :, r0:r1].to(acc_t), kf.transpose(-1, -2)) * sm_scale
        if attn_mask is not None:
            m = attn_mask[:, :, r0:r1]
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.to(acc_t)
        if is_causal:
            q_idx = torch.arange(r0, r1, device=q.device)
            s = s.masked_fill(key_idx[None, :] > q_idx[:, None], -math.inf)
        l = torch.logsumexp(s, dim=-1, keepdim=True) if nk else s.new_full((*s.shape[:-1], 1), -math.inf)
        # Empty rows (l = -inf) give zeros; a NaN (or +inf) l must propagate, not become zeros.
        p = torch.where(l != -math.inf, torch.exp(s - l), torch.zeros_like(s))
        o = torch.matmul(p, vf)
        # A row that sees no key is zero even where V holds NaN/Inf (0 * NaN would make it NaN).
        out[:, :, r0:r1] = torch.where(l == -math.inf, torch.zeros_like(o), o)
        lse[:, :, r0:r1] = l.squeeze(-1)
    return out, (lse if return_lse else None)
