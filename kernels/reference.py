"""The torch reference: the quantized algorithm exactly as the kernels should compute it.

Slow but exact to the spec in `quant.py`, on CPU or GPU. Work is chunked over query rows so a
32k-token call never holds an N x N score matrix. Causal masking is top-left aligned (key j is
visible to query i when j <= i), as PyTorch SDPA's `is_causal`. A query row that can see no key
returns zeros with LSE -inf.

The P grid (what the kernels round P to before P.V) is part of the spec: FP16 P is fp16(2**(s - row max) *
2**15); FP8 P is e4m3(448 * 2**(s - top)) with top the row max, or with `p_tile` each key tile's own max,
floored 64 below the running max (`fp8_p_tops`: the HIP kernels' rule with p_tile = their BN, the Triton
kernels' with their BLOCK_N). Nothing here has run on RDNA4.

Masks: bool selects (True keeps), floating adds in natural-log units, as SDPA; both enter the base-2 scores as
`quant.mask_bias_base2` (finite values floored at -FP32 max, so a row masked everywhere with -finfo.max is a
uniform average, as in SDPA, and a row with every key -inf/False gives zeros and LSE -inf, as torch 2.13's SDPA on
CPU). With a key-only mask the dead keys leave the K/V statistics (`quant.live_keys`).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import quant
from .call_spec import key_mask, mask_scope

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
                        return_lse: bool = False, smooth_v: bool = False, p_tile: Optional[int] = None
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantized attention on HND tensors. Returns (out in q.dtype, natural-log LSE (B, Hq, Nq) or None).
    `p_tile`: FP8 P's grid (see `attention_from_quantized`)."""
    if pv not in ("fp8", "fp16"):
        raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
    if sm_scale is None:
        sm_scale = quant.default_sm_scale(q.shape[3])
    live = None
    if attn_mask is not None and mask_scope(attn_mask) == "keys":
        # A key-only mask: dead keys (far below their head's largest bias) get bias -inf and leave the K/V
        # statistics (quant.live_keys); the mask is then handed on as that base-2 bias, back in natural-log units.
        bias = quant.mask_bias_base2(key_mask(attn_mask, k.shape[2]))
        live = quant.live_keys(bias, k.shape[1])
        key_bias, key_fill, attn_mask = quant.key_mask_bias(bias), attn_mask.dtype == torch.bool, None
    else:
        key_bias, key_fill = None, False
    qq = quant.quantize_qkv_torch(q, k, v, sm_scale=sm_scale, smooth_k=smooth_k, pv=pv, qk_group=qk_group,
                                  smooth_v=smooth_v, live=live)
    return attention_from_quantized(qq, pv=pv, is_causal=is_causal, attn_mask=attn_mask, return_lse=return_lse,
                                    q=q, sm_scale=sm_scale, out_dtype=q.dtype, p_tile=p_tile, key_bias=key_bias,
                                    key_fill=key_fill)


def fp8_p_tops(s: torch.Tensor, p_tile: int) -> torch.Tensor:
    """Each key's FP8 P top (base 2, shape of s): the max of its tile of p_tile keys (tiles from key 0), at least
    the running max through that tile less FP8_TILE_SHIFT_RANGE. 0 where no key was seen yet (masked keys then
    give P = 0); NaN scores make their row's tops NaN."""
    nk = s.shape[-1]
    tiles = torch.nn.functional.pad(s, (0, -nk % p_tile), value=-math.inf).unflatten(-1, (-1, p_tile))
    tile_max = tiles.amax(dim=-1)
    running = torch.cummax(tile_max, dim=-1).values
    top = torch.maximum(tile_max, running - quant.FP8_TILE_SHIFT_RANGE)
    top = torch.where(top == -math.inf, torch.zeros_like(top), top)
    return top.repeat_interleave(p_tile, dim=-1)[..., :nk]


def rounded_pv(s: torch.Tensor, p: torch.Tensor, row_max: torch.Tensor, v_f: torch.Tensor, *, pv: str,
               p_tile: Optional[int], model_flushing_wmma: bool) -> torch.Tensor:
    """P.V on the spec's P grid, in units of the row max's P (1 at the max). p = exp2(s - row_max); row_max: 0 in
    empty rows."""
    if pv == "fp16":
        top = 2.0 ** quant.FP16_P_LOG2_TOP
        p = (p * top).half().float()
        if model_flushing_wmma:
            p = torch.where(p < quant.FP16_MIN_NORMAL, torch.zeros_like(p), p)
        return torch.matmul(p, v_f) / top
    top = row_max if p_tile is None else fp8_p_tops(s, p_tile)
    p = quant.quantize_p_fp8(p if p_tile is None else torch.exp2(s - top))
    if model_flushing_wmma:
        p = torch.where(p < quant.E4M3_MIN_NORMAL, torch.zeros_like(p), p)
    if p_tile is not None:
        p = p * torch.exp2(top - row_max)  # each tile's P in units of the row max's
    return torch.matmul(p, v_f) / quant.FP8_MAX


def attention_from_quantized(qq: quant.QuantizedQKV, *, pv: str, is_causal: bool = False,
                             attn_mask: Optional[torch.Tensor] = None, return_lse: bool = False,
                             q: Optional[torch.Tensor] = None, sm_scale: Optional[float] = None,
                             out_dtype: torch.dtype = torch.float32, p_tile: Optional[int] = None,
                             model_flushing_wmma: bool = False, key_bias: Optional[torch.Tensor] = None,
                             key_fill: bool = False):
    """The attention half of the spec, fed by any prologue's output.

    For the LSE's smooth_k correction pass the original `q` and `sm_scale`. `p_tile` (FP8 only): None rounds P
    against the row max; an int against each tile of p_tile keys' own max (`fp8_p_tops`), the kernels' one-pass
    rule. The row sum adds the unrounded P either way. `model_flushing_wmma` is for verification only (the product
    never passes it): P.V reads subnormal P (e4m3 below 2**-6, fp16 below 2**-14) as zero, as a matrix unit that
    flushes subnormal inputs would, while the row sum still counts them. `key_bias` (instead of `attn_mask`): a
    key-only mask as the kernels add it, FP32 base 2 (Bm, Hm, Nk) (`quant.key_mask_bias`); `key_fill` (a bool
    mask's): its -inf keys are set to -inf instead, whatever their score (a NaN score too), as a bool mask selects."""
    if p_tile is not None and (isinstance(p_tile, bool) or not isinstance(p_tile, int) or p_tile < 1):
        raise ValueError(f"p_tile must be a positive int or None, got {p_tile!r}")
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
    if key_bias is not None:
        key_bias = key_bias.unsqueeze(2).expand(b, hq, 1, nk)
    rows = max(1, SCORE_BUDGET // max(1, b * hq * nk))
    key_idx = torch.arange(nk, device=device)
    for r0 in range(0, nq, rows):
        r1 = min(nq, r0 + rows)
        s = qk_scores_base2(qq.q8[:, :, r0:r1], qq.q_scale[:, :, r0:r1], k8, sk)
        if attn_mask is not None:
            m = attn_mask[:, :, r0:r1]
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + quant.mask_bias_base2(m)
        if key_bias is not None:
            s = s.masked_fill(key_bias == -math.inf, -math.inf) if key_fill else s + key_bias
        if is_causal:
            q_idx = torch.arange(r0, r1, device=device)
            s = s.masked_fill(key_idx[None, :] > q_idx[:, None], -math.inf)
        row_max = s.amax(dim=-1, keepdim=True) if nk else s.new_full((*s.shape[:-1], 1), -math.inf)
        # Only a row that sees no key (max -inf) is empty and gives zeros; a NaN row max (NaN in q, k or
        # the mask) must stay NaN so bad inputs show instead of turning into a silent black patch.
        alive = row_max != -math.inf
        safe_max = torch.where(alive, row_max, torch.zeros_like(row_max))
        p = torch.exp2(s - safe_max)
        p = torch.where(alive, p, torch.zeros_like(p))
        row_sum = p.sum(dim=-1, keepdim=True)
        acc = rounded_pv(s, p, safe_max, v_f, pv=pv, p_tile=p_tile, model_flushing_wmma=model_flushing_wmma)
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
        top = s.amax(dim=-1, keepdim=True) if nk else s.new_full((*s.shape[:-1], 1), -math.inf)
        # Normalised by the row sum, not through the LSE: near -FP32 max (a -finfo.max mask on every key) the LSE
        # rounds to the max and exp(s - lse) would weigh every key 1. Empty rows (max -inf) give zeros; a NaN (or
        # +inf) max must propagate, not become zeros.
        e = torch.exp(s - torch.where(top == -math.inf, torch.zeros_like(top), top))
        total = e.sum(dim=-1, keepdim=True)
        l = torch.where(top == -math.inf, top, top + torch.log(total))
        o = torch.matmul(e, vf) / total
        # A row that sees no key is zero even where V holds NaN/Inf (0 * NaN would make it NaN).
        out[:, :, r0:r1] = torch.where(l == -math.inf, torch.zeros_like(o), o)
        lse[:, :, r0:r1] = l.squeeze(-1)
    return out, (lse if return_lse else None)
