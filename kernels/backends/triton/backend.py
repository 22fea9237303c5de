"""`triton_int8_fp8` and `triton_int8_fp16`: the Triton prologue (or the HIP one) + the Triton attention.

The acceptance rule is stated once, in `refuse`; `_unavailable` judges the environment only.
On a GPU (ROCm and NVIDIA; not the CPU interpreter) the first use of a device by each kernel + prologue
combination runs the shared self-check (`Backend.verify`, kernels/self_check.py); a failure takes the
backend out of service there (the dispatcher then falls back with that reason).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ... import launch_split
from ...call_spec import mask_refusal, mask_scope
from ...gating import Verdicts
from ...registry import Backend
from .configs import MAX_HEAD_DIM, attention_config

CPU_REASON = "Triton needs a GPU; on CPU it runs only under TRITON_INTERPRET=1"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# ROCm targets whose Triton backend lowers our dots: fp8e4nv (OCP e4m3) exists on gfx12 and gfx950 only.
ROCM_FP8_ARCHS = ("gfx1200", "gfx1201", "gfx950")
ROCM_INT8_ARCH_PREFIXES = ("gfx11", "gfx12", "gfx90a", "gfx94", "gfx95")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_import_error() -> Optional[str]:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return f"triton is not importable: {type(exc).__name__}: {exc}"
    return None


def _hip_prologue():
    """(refusal_fn, quantize_fn) of the HIP prologue, or a reason string when it is not there."""
    try:
        from ..hip.prologue import hip_prologue_refusal, hip_quantize_qkv
    except Exception as exc:
        return f"the HIP prologue is not available: {type(exc).__name__}: {exc}"
    return hip_prologue_refusal, hip_quantize_qkv


def lse_smooth_term(q: torch.Tensor, k_mean: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q . mean(K) * sm_scale per query row (B, Hq, Nq) in FP32: what smooth_k took out of every score.

    Computed a few heads at a time so an FP32 copy of a 75k-token q never exists whole."""
    b, hq, nq, d = q.shape
    group = hq // k_mean.shape[1]
    mean = k_mean.repeat_interleave(group, dim=1).unsqueeze(-1)  # (B, Hq, D, 1)
    out = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    step = max(1, (1 << 26) // max(1, b * nq * d))
    for h0 in range(0, hq, step):
        h1 = min(hq, h0 + step)
        out[:, h0:h1] = torch.matmul(q[:, h0:h1].float(), mean[:, h0:h1]).squeeze(-1) * sm_scale
    return out


class TritonBackend(Backend):
    own_prologue = "triton"

    def __init__(self, pv: str):
        super().__init__(Verdicts())
        if pv not in ("fp8", "fp16"):
            raise ValueError(f"pv must be 'fp8' or 'fp16', got {pv!r}")
        self.pv = pv
        self.name = f"triton_int8_{pv}"
        self.description = (f"Triton: INT8 Q.K, {pv.upper()} P.V, FP32 accumulation "
                            f"(RDNA4 fallback, NVIDIA, interpreter)")

    # -- environment ---------------------------------------------------------------------
    def _unavailable(self, device_type, index):
        missing = _triton_import_error()
        if missing:
            return missing
        if device_type == "cpu":
            return None if _interpreting() else CPU_REASON
        if device_type != "cuda":
            return f"device type {device_type!r} is not supported (CUDA or ROCm GPUs)"
        if _interpreting():
            return None
        from ...call_spec import device_arch, is_rocm
        arch = device_arch(device_type, index)
        if is_rocm():
            if self.pv == "fp8" and arch not in ROCM_FP8_ARCHS:
                return f"{arch} has no OCP FP8 (e4m3fn) dot in Triton; FP8 P.V needs gfx1200/gfx1201/gfx950"
            if not arch.startswith(ROCM_INT8_ARCH_PREFIXES):
                return f"{arch} is not a target of these kernels (gfx11, gfx12, gfx90a, gfx94x, gfx950)"
            return None
        major = int(arch.split("_")[1]) // 10 if arch.startswith("sm_") else 0
        if major < 8:
            return f"{arch}: needs sm_80 or newer (INT8 tensor-core dots)"
        if self.pv == "fp8" and arch in ("sm_80", "sm_86", "sm_87"):
            return f"{arch} has no FP8 tensor cores; use triton_int8_fp16"
        return None

    def needs_verification(self, call):
        return call.device_type == "cuda" and not _interpreting()  # the interpreter runs no GPU code

    def warm_up(self, run):
        """Compile the Triton kernels `run()` launches side by side before they are needed (precompile.py): what the
        self-check calls before its cases. None under the interpreter (nothing to compile) or with
        SAGE_RDNA4_TRITON_PRECOMPILE=0."""
        from ... import settings
        if _interpreting() or not settings.triton_precompile():
            return None
        from .precompile import warm_up
        return warm_up(run)

    # -- one call --------------------------------------------------------------------------
    def refuse(self, call):
        if call.dtype not in DTYPES:
            return f"dtype {call.dtype} is not fp16, bf16 or fp32"
        if call.has_zero_size:
            return "a zero-size q, k or v"
        if call.head_dim > MAX_HEAD_DIM or call.v_head_dim > MAX_HEAD_DIM:
            return f"head_dim {call.head_dim} / v_head_dim {call.v_head_dim} above {MAX_HEAD_DIM}"
        reason = mask_refusal(call)
        if reason:
            return reason
        if call.prologue == "hip":
            hip = _hip_prologue()
            if isinstance(hip, str):
                return hip
            reason = hip[0](call)
            return f"HIP prologue: {reason}" if reason else None
        from .prologue import triton_prologue_refusal
        return triton_prologue_refusal(call)

    def launch(self, q, k, v, call, sm_scale, attn_mask):
        prologue, attention = _kernel_modules()
        cfg = attention_config(call.arch, max(call.head_dim, call.v_head_dim), self.pv)
        bias = key_end = plain = live = None
        if attn_mask is not None:
            if mask_scope(attn_mask) != "keys":  # a plan keyed without the mask's strides must not reach row 0 only
                raise ValueError(f"a mask {tuple(attn_mask.shape)} that differs between query rows reached the "
                                 "Triton kernels, which take key-only masks")
            # Key-only (refuse): one FP32 base-2 bias per (batch or 1, head or 1, key), and the keys it leaves live.
            bias, key_end, plain, live = masks_module().key_mask_operands(attn_mask, call.batch, call.q_heads,
                                                                          call.kv_heads, call.kv_len)
        if call.prologue == "hip":
            qq = _hip_prologue()[1](q, k, v, sm_scale=sm_scale, smooth_k=call.smooth_k, pv=self.pv,
                                    qk_group=call.qk_group, smooth_v=call.smooth_v, live=live)
        else:
            qq = prologue.triton_quantize_qkv(q, k, v, sm_scale=sm_scale, smooth_k=call.smooth_k, pv=self.pv,
                                              qk_group=call.qk_group, v_transposed=cfg.v_transposed,
                                              smooth_v=call.smooth_v, reuse_buffers=True, pad_k_scale_rows=True,
                                              live=live)
        if call.smooth_v and qq.v_mean is None:
            # Never hand out an output that lacks V's mean: the prologue ignored smooth_v.
            raise RuntimeError(f"the {call.prologue} prologue returned no v_mean for a smooth_v call")
        out = None
        q_strides = q.stride()
        if call.out_nhd or q_strides[1] < q_strides[2]:
            # The caller reshapes the output token-major, or q is an NHD tensor seen as HND: write the output NHD,
            # so the caller's reshape is free.
            b, hq, nq, _ = q.shape
            out = torch.empty((b, nq, hq, call.v_head_dim), dtype=q.dtype, device=q.device).transpose(1, 2)
        out, lse = split_launches(attention.attention_from_quantized_triton, qq, pv=self.pv, config=cfg,
                                  is_causal=call.is_causal, return_lse=call.return_lse, out_dtype=q.dtype, out=out,
                                  key_bias=bias, key_end=key_end, key_plain=plain,
                                  key_fill=attn_mask is not None and attn_mask.dtype == torch.bool)
        if lse is not None and qq.k_mean is not None:
            lse += lse_smooth_term(q, qq.k_mean, sm_scale)
        return out, lse


def split_launches(attend, qq, *, pv, config, is_causal, return_lse, out_dtype, out, key_bias=None, key_end=None,
                   key_fill=False, key_plain=None):
    """`attend` (attention_from_quantized_triton) as one launch, or, above the device's work bound, once per
    piece of kernels/launch_split.py on views of the same tensors (each output element computed as in one launch;
    the LSE pieces are copied into one tensor)."""
    b, hq, nq, d = qq.q8.shape
    _, hkv, nk, dv = qq.v.shape
    pieces = launch_split.split_attention(b, hq, hkv, nq, nk, d, dv, pv=pv, causal=is_causal,
                                          bound=launch_split.work_bound(qq.q8.device), row_block=config.block_m)
    kw = dict(pv=pv, config=config, is_causal=is_causal, return_lse=return_lse, out_dtype=out_dtype,
              key_fill=key_fill)
    if len(pieces) == 1:
        return attend(qq, out=out, key_bias=key_bias, key_end=key_end, key_plain=key_plain, **kw)
    if out is None:
        out = torch.empty((b, hq, nq, dv), dtype=out_dtype, device=qq.q8.device)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=qq.q8.device) if return_lse else None
    for pc in pieces:
        rows = (slice(pc.b0, pc.b1), slice(pc.h0, pc.h1), slice(pc.n0, pc.n1))
        bias, end, plain = (_piece_rows(t, pc) for t in (key_bias, key_end, key_plain))
        _, part_lse = attend(launch_split.quantized_piece(qq, pc, hq // hkv), out=out[rows], key_bias=bias,
                             key_end=end, key_plain=plain, **kw)
        if lse is not None:
            lse[rows] = part_lse
    return out, lse


def _piece_rows(t: Optional[torch.Tensor], pc) -> Optional[torch.Tensor]:
    """A key-mask operand (1 or B, 1 or Hq, ...) for one piece: its batch and head ranges, where it has them."""
    if t is None:
        return None
    t = t[pc.b0:pc.b1] if t.shape[0] > 1 else t
    return t[:, pc.h0:pc.h1] if t.shape[1] > 1 else t


_modules = None


def _kernel_modules():
    """(prologue, attention) modules, imported at the first launch (this module must import without triton,
    whose absence `_unavailable` reports) and kept, not imported again per call. Their functions are read
    from the modules at each call, so a test may still replace one."""
    global _modules
    if _modules is None:
        from . import attention, prologue
        _modules = (prologue, attention)
    return _modules


def masks_module():
    """kernels/backends/triton/masks.py, imported at the first masked launch (it needs triton)."""
    from . import masks
    return masks


def make_backend(pv: str) -> Backend:
    return TritonBackend(pv)
