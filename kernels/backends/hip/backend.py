"""`hip_int8_fp8` / `hip_int8_fp16`: the gfx12 HIP kernels as registered backends.

Acceptance, stated once:
  * environment (`runtime.environment_refusal`): ROCm gfx1200/gfx1201 with the HIP runtime, and the shipped
    code object for the arch (prebuilt/) loaded or else hiprtc to compile the kernels;
    on NVIDIA only the gfx12 emulation, only when SAGE_RDNA4_HIP_EMULATE=1 (never a speed path, and
    the registry's `auto` order never lists HIP outside gfx12 anyway);
  * the call (`attention_refusal`): the one shape rule that `refuse` and the launch wrapper
    `hip_attention` both apply; key-only masks are taken (call_spec.mask_refusal states which), through the
    masked entry points with the mask's operands from masks.py;
  * the prologue the call asks for: 'auto'/'hip' -> the HIP prologue, 'triton' -> the Triton one;
  * the hardware probes (probes.py), once per device before any self-check: a probe that differs disables
    the backends relying on it there, through `Backend.disable` as a failed self-check does;
  * the first-use self-check (`Backend.verify`, kernels/self_check.py), once per device and kernel +
    prologue combination, so `auto` falls back past a kernel that failed it and an explicit request gets
    the reason.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ... import quant
from ...call_spec import AttentionCall, mask_refusal
from ...gating import Verdicts
from ...registry import Backend, KernelRefused, get_backend
from . import probes, pv_chain
from . import prologue as hip_prologue
from .runtime import environment_refusal, kernel_bundle, run_launches

PV_MODES = ("fp8", "fp16")
ACCUMULATION_CASE_KINDS = ("probe", "long-tail")  # the self-check cases a single chain must pass before it serves
DTYPES = (torch.float16, torch.bfloat16)


def kernel_abi():
    """The kernel author's description of the kernels; imported lazily (its absence is a refusal reason)."""
    from . import kernel_abi as abi
    return abi


def attention_refusal(call: AttentionCall, pv: str) -> Optional[str]:
    """The shape rule of the HIP attention kernels (not the prologue's, not the device's)."""
    if pv not in PV_MODES:
        return f"P.V mode must be one of {PV_MODES}, got {pv!r}"
    if call.dtype not in DTYPES:
        return f"dtype {call.dtype} is not fp16 or bf16"
    try:
        dims = tuple(kernel_abi().HEAD_DIMS)
    except Exception as exc:
        return f"kernel descriptions (kernel_abi) failed to load: {type(exc).__name__}: {exc}"
    if call.head_dim not in dims:
        return f"head_dim {call.head_dim} is not one of {dims}"
    if call.v_head_dim != call.head_dim:
        return f"v head_dim {call.v_head_dim} differs from q/k head_dim {call.head_dim}"
    reason = mask_refusal(call)
    if reason:
        return reason
    if call.has_zero_size:
        return "a zero-size q, k or v"
    # The kernels' own geometry rule (grid limits, 32-bit offsets inside one kv head), stated in kernel_abi.
    return kernel_abi().attention_shape_refusal(call.batch, call.q_heads, call.kv_heads, call.q_len, call.kv_len,
                                                call.head_dim, call.v_head_dim, pv)


def prologue_refusal(call: AttentionCall) -> Optional[str]:
    """Why the prologue the call asks for cannot quantize it, or None."""
    if call.prologue == "triton":
        try:
            from ..triton.prologue import triton_prologue_refusal
        except Exception as exc:
            return f"the Triton prologue is unavailable: {type(exc).__name__}: {exc}"
        reason = triton_prologue_refusal(call)
        return f"Triton prologue: {reason}" if reason else None
    reason = hip_prologue.hip_prologue_refusal(call)
    return f"HIP prologue: {reason}" if reason else None


def quantize(q, k, v, call: AttentionCall, sm_scale: float, pv: str, live=None) -> quant.QuantizedQKV:
    """`live` (a key-only mask's live keys, bool): dead keys stay out of the K/V statistics, in either prologue."""
    # With smooth_v, v_mean comes back in the QuantizedQKV; the attention kernel adds it to the output.
    kw = dict(sm_scale=sm_scale, smooth_k=call.smooth_k, pv=pv, qk_group=call.qk_group, smooth_v=call.smooth_v)
    if live is not None:
        kw["live"] = live
    if call.prologue == "triton":
        from ..triton.prologue import triton_quantize_qkv
        return triton_quantize_qkv(q, k, v, **kw)
    return hip_prologue.hip_quantize_qkv(q, k, v, **kw)


def hip_attention(qq: quant.QuantizedQKV, call: AttentionCall, pv: str, sm_scale: float,
                  q: Optional[torch.Tensor] = None, key_mask=None):
    """Launch wrapper of the attention kernel; applies the same rule as `refuse`. `key_mask`
    (kernel_abi.KeyMaskOperands) for a call with a key-only mask, None without a mask. The P.V chain of an unmasked
    call is the one chosen for the device at first use (pv_chain.py); masked calls run the two-level kernels."""
    reason = attention_refusal(call, pv)
    if reason:
        raise KernelRefused(f"hip_int8_{pv}", reason)
    if (key_mask is None) != (call.mask == "none"):
        raise ValueError(f"a {call.mask} mask call needs its key-mask operands, and only it takes them")
    chain = "two-level" if key_mask is not None else pv_chain.chosen(pv, qq.q8.device.type, qq.q8.device.index).chain
    out = None
    if call.out_nhd:  # the caller reshapes the output token-major: written so, that reshape is a view
        b, hq, nq, _ = qq.q8.shape
        out = torch.empty((b, nq, hq, call.v_head_dim), dtype=call.dtype, device=qq.q8.device).transpose(1, 2)
    return launch_attention(qq, pv=pv, is_causal=call.is_causal, return_lse=call.return_lse,
                            sm_scale=sm_scale, q=q, out_dtype=call.dtype, chain=chain, key_mask=key_mask, out=out)


def launch_attention(qq, *, pv, is_causal, return_lse, sm_scale, q, out_dtype, chain="two-level", key_mask=None,
                     out=None):
    out, lse, launches = kernel_abi().attention_plan(qq, pv=pv, is_causal=is_causal, out_dtype=out_dtype,
                                                      return_lse=return_lse, q=q, sm_scale=sm_scale, chain=chain,
                                                      key_mask=key_mask, out=out)
    run_launches(qq.q8.device.index, kernel_bundle(), launches)
    return out, lse


class _HardwareProbes:
    """The HIP part of a first use (`Backend.probe`): the device's hardware probes, once per process, before any
    self-check there."""

    def __init__(self, backend: "HipBackend"):
        self.backend = backend

    @staticmethod
    def pending(device_type: str, index: Optional[int]) -> bool:
        return device_type == "cuda" and probes.recorded(device_type, index) is None

    def refusal(self, device_type: str, index: Optional[int]) -> Optional[str]:
        return self.backend.probe_refusal(device_type, index)


class _ChainPassCache:
    """The self-check's pass cache with the device's chosen P.V chain in its keys: a pass of the two-level kernel
    says nothing of the single chain (both live in one code object, so the code digest cannot tell them apart)."""

    def __init__(self, inner, pv: str):
        self.inner, self.pv = inner, pv

    def key(self, backend: str, variant, device, *args, **kwargs):
        chain = pv_chain.chosen(self.pv, device.type, device.index).chain
        return self.inner.key(f"{backend} ({chain} P.V)", variant, device, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class HipBackend(Backend):
    quantized = True
    own_prologue = "hip"

    def __init__(self, pv: str):
        verdicts = Verdicts()
        verdicts.cache = _ChainPassCache(verdicts.cache, pv)
        super().__init__(verdicts, probe=_HardwareProbes(self))
        if pv not in PV_MODES:
            raise ValueError(f"pv must be one of {PV_MODES}, got {pv!r}")
        self.pv = pv
        self.name = f"hip_int8_{pv}"
        self.description = (f"HIP gfx12 kernels: INT8 Q.K, {pv.upper()} P.V, FP32 accumulation "
                            f"(prebuilt gfx1200/gfx1201 code objects; compiled at first use with hiprtc where "
                            f"they cannot serve; emulated on NVIDIA)")
        # The kernel path after quantization; a test replaces it with a broken one to exercise the self-check.
        self.attention_impl: Callable = hip_attention

    # -- acceptance -----------------------------------------------------------------------------
    def _unavailable(self, device_type, index):
        reason = environment_refusal(device_type, index)
        if reason:
            return reason
        try:
            kernel_abi()
        except Exception as exc:
            return f"kernel descriptions (kernel_abi) failed to load: {type(exc).__name__}: {exc}"
        return None

    def refuse(self, call: AttentionCall) -> Optional[str]:
        return attention_refusal(call, self.pv) or prologue_refusal(call)

    # -- first use ------------------------------------------------------------------------------
    def probe_refusal(self, device_type: str, index: Optional[int]) -> Optional[str]:
        """The probes' verdict for this backend on one device; a failure disables it, and every other HIP backend
        it concerns, there (so `auto`, an explicit request and the stats all see the reason). HIP devices only
        (torch calls them 'cuda'): elsewhere no HIP kernel runs, and the environment refuses them anyway."""
        if device_type != "cuda":
            return None
        report = probes.probe_device(device_type, index)
        mine = None
        for name in probes.BOTH:
            reason = report.disabled_reason(name)
            if reason is None:
                continue
            reason = f"{name} disabled on {report.device}: {reason}"
            backend = self if name == self.name else get_backend(name)
            if backend.unavailable(device_type, index) != reason:
                backend.disable(device_type, index, reason)
            if name == self.name:
                mine = reason
        if mine is None:
            pv_chain.choose(self.pv, device_type, index, report.single_chain_refusal(self.name),
                            lambda: self.accumulation_refusal(device_type, index, "single"))
        return mine

    def accumulation_refusal(self, device_type: str, index: Optional[int], chain: str) -> Optional[str]:
        """The self-check's cases that see lost P.V mass (the precision probe: 16400 diffuse keys with a V offset;
        the long tail) on this backend's kernel with the given P.V chain: None when both pass, else the reason.
        A pass is kept on disk with the self-check's passes (same GPU, driver and code: not run again)."""
        from ...self_check import DEFAULT_CASES, checks_fingerprint, run_self_check
        cases = [c for c in DEFAULT_CASES if c.kind in ACCUMULATION_CASE_KINDS]
        device = torch.device(device_type, index)
        store = getattr(self.verdicts.cache, "inner", self.verdicts.cache)
        key = store.key(f"{self.name} ({chain} P.V, accumulation cases)", None, device, checks_fingerprint(cases))
        result = store.checked(key, self.name,
                               lambda: run_self_check(self.chain_attention(chain), device, cases, lambda c: True))
        return None if result is None else result.reason

    def chain_attention(self, chain: str) -> Callable:
        """attention(q, k, v, is_causal=False) -> out through this backend's prologue and the `chain` kernel (the
        self-check's calling convention; the field report times both chains with it)."""
        from ...call_spec import describe_call

        def attention(q, k, v, is_causal=False):
            call = describe_call(q, k, v, is_causal=is_causal)
            sm_scale = quant.default_sm_scale(call.head_dim)
            qq = quantize(q, k, v, call, sm_scale, self.pv)
            out, _ = launch_attention(qq, pv=self.pv, is_causal=is_causal, return_lse=False, sm_scale=sm_scale,
                                      q=q, out_dtype=call.dtype, chain=chain)
            return out
        return attention

    # -- running --------------------------------------------------------------------------------
    def launch(self, q, k, v, call: AttentionCall, sm_scale: float, attn_mask):
        if sm_scale is None or not math.isfinite(sm_scale):
            sm_scale = quant.default_sm_scale(call.head_dim)
        if attn_mask is None:
            qq = quantize(q, k, v, call, sm_scale, self.pv)
            return self.attention_impl(qq, call, self.pv, sm_scale, q)
        # A key-only mask (refuse): its bias per key for the attention, its live keys for the prologue's statistics.
        from .masks import key_mask_operands
        km = key_mask_operands(attn_mask, call.kv_heads, call.kv_len)
        qq = quantize(q, k, v, call, sm_scale, self.pv, live=km.live)
        return self.attention_impl(qq, call, self.pv, sm_scale, q, key_mask=km.attention)


def make_backend(pv: str) -> HipBackend:
    return HipBackend(pv)
