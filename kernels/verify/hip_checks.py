"""Checks of the HIP kernels against the spec, shared by the CPU simulator tests and the GPU harness.

Each check takes `run` (a function executing a list of kernel_abi.Launch: host_sim.run or
cupy_runner.run) and tensors on the device `run` executes on. Bit-exact comparisons are made against
quant.quantize_qkv_torch evaluated on the CPU: on CUDA, torch computes `tensor / python_scalar` as a
multiplication by the reciprocal, so torch's own CUDA quantizers can differ from its CPU ones in the
last bit of a scale; the CPU result is the spec.
"""
from __future__ import annotations

import math
from typing import Callable, Dict

import torch

from .. import metrics, quant, reference
from ..backends.hip import kernel_abi

QQ_FIELDS = ("q8", "q_scale", "k8", "k_scale", "v", "v_scale", "k_mean", "v_mean")


# ------------------------------------------------------------------------------------------ WMMA
def wmma_case(kind: str, seed: int = 0):
    """Integer-valued operands whose products and sums are exact in fp32: the emulated WMMA must match
    the plain matrix product bit for bit. Returns (a_lanes, b_lanes, c_lanes as int32 words, expected D)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "iu8":
        a = torch.randint(-128, 128, (16, 16), generator=g, dtype=torch.int32)
        b = torch.randint(-128, 128, (16, 16), generator=g, dtype=torch.int32)
        c = torch.randint(-10 ** 6, 10 ** 6, (16, 16), generator=g, dtype=torch.int32)
        al, bl, cl = a.to(torch.int8), b.to(torch.int8), c
        want = a @ b + c
    else:
        # A spans the format (e4m3: subnormal 2^-9 up to 448; f16: 2^-7 up to 1024), B holds small
        # integers, so every partial sum fits fp32's 24 bits and any summation order is exact.
        if kind == "fp8":
            pool_a = torch.tensor([0.0, 1.0, -1.0, 2.5, -3.0, 0.125, 448.0, -448.0, 0.001953125, 14.0, -0.75, 96.0])
            cast = torch.float8_e4m3fn
        else:
            pool_a = torch.tensor([0.0, 1.0, -1.5, 2.0, 0.25, -7.0, 1024.0, -0.0078125, 3.75, 65.0])
            cast = torch.float16
        pool_b = torch.tensor([0.0, 1.0, -1.0, 2.0, -3.0, 4.0])
        a = pool_a[torch.randint(0, len(pool_a), (16, 16), generator=g)]
        b = pool_b[torch.randint(0, len(pool_b), (16, 16), generator=g)]
        c = torch.randint(-1000, 1000, (16, 16), generator=g).float()
        al, bl, cl = a.to(cast), b.to(cast), c
        want = (a.double() @ b.double() + c.double()).float()
    a_l = kernel_abi.lanes_from_a(al).contiguous().view(torch.int32)
    b_l = kernel_abi.lanes_from_b(bl).contiguous().view(torch.int32)
    c_l = kernel_abi.lanes_from_d(cl).contiguous().view(torch.int32)
    return a_l, b_l, c_l, want


def run_wmma(run: Callable, kind: str, device, seed: int = 0):
    a_l, b_l, c_l, want = wmma_case(kind, seed)
    return _probe(run, kind, device, a_l, b_l, c_l), want


def subnormal_wmma_case(kind: str, seed: int = 0):
    """fp8/f16 operands with subnormals of the input format (e4m3: m * 2^-9, f16: below 2^-14) and the smallest
    normal in A's even K and B's odd K, small integers elsewhere, so each product has one small factor and every sum
    is exact in fp32 (C: small integers). Returns (a_lanes, b_lanes, c_lanes, D with the subnormals read exactly,
    D with them read as zero: the emulation's emu_flush_subnormal)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "fp8":
        cast, tiny = torch.float8_e4m3fn, 2.0 ** -6
        small = [2.0 ** -9, 3 * 2.0 ** -9, -5 * 2.0 ** -9, 7 * 2.0 ** -9, 2.0 ** -6]
    elif kind == "f16":
        cast, tiny = torch.float16, 2.0 ** -14
        small = [2.0 ** -15, -3 * 2.0 ** -16, 2.0 ** -16, 2.0 ** -24, 2.0 ** -14]
    else:
        raise ValueError(f"no subnormal case for {kind!r}")
    small, ints = torch.tensor(small), torch.tensor([1.0, -2.0, 3.0])
    even = (torch.arange(16) % 2 == 0)

    def pick(pool, shape):
        return pool[torch.randint(0, len(pool), shape, generator=g)]
    a = torch.where(even[None, :], pick(small, (16, 16)), pick(ints, (16, 16)))  # A[m][k]
    b = torch.where(even[:, None], pick(ints, (16, 16)), pick(small, (16, 16)))  # B[k][n]
    c = torch.randint(-8, 9, (16, 16), generator=g).float()
    assert torch.equal(a.to(cast).float(), a) and torch.equal(b.to(cast).float(), b)

    def flushed(x):
        return torch.where(x.abs() < tiny, torch.zeros_like(x), x)
    exact = (a.double() @ b.double() + c.double()).float()
    flush = (flushed(a).double() @ flushed(b).double() + c.double()).float()
    a_l = kernel_abi.lanes_from_a(a.to(cast)).contiguous().view(torch.int32)
    b_l = kernel_abi.lanes_from_b(b.to(cast)).contiguous().view(torch.int32)
    c_l = kernel_abi.lanes_from_d(c).contiguous().view(torch.int32)
    return a_l, b_l, c_l, exact, flush


def run_subnormal_wmma(run: Callable, kind: str, device, seed: int = 0):
    """The emulated WMMA on subnormal_wmma_case: (D, D exact, D flushed)."""
    a_l, b_l, c_l, exact, flush = subnormal_wmma_case(kind, seed)
    return _probe(run, kind, device, a_l, b_l, c_l), exact, flush


def run_f16_k_order(run: Callable, device) -> torch.Tensor:
    """The emulated f16 WMMA sums its 16 products one by one in K order (gfx12_prelude.h wmma_f16), so rounding shows
    which K an element is taken as: row 0 of A holds 1 at K 4..7 and 2048 at K 8 (B: 1 and 8192), 0 elsewhere.
    Summed in K order, 4 + 2^24 is exact; summed with K 8 before K 4..7 (the K that lanes 16-31's first elements
    would have in the contiguous 8h + e order) the four 1s are lost. Returns D[0][0] (2^24 + 4 in AMD's order)."""
    a = torch.zeros(16, 16)
    b = torch.zeros(16, 16)
    a[0, 4:8], b[4:8, 0] = 1.0, 1.0
    a[0, 8], b[8, 0] = 2048.0, 8192.0
    a_l = kernel_abi.lanes_from_a(a.half()).contiguous().view(torch.int32)
    b_l = kernel_abi.lanes_from_b(b.half()).contiguous().view(torch.int32)
    c_l = kernel_abi.lanes_from_d(torch.zeros(16, 16)).contiguous().view(torch.int32)
    return _probe(run, "f16", device, a_l, b_l, c_l)[0, 0]


def _probe(run: Callable, kind: str, device, a_l, b_l, c_l) -> torch.Tensor:
    d_l, launches = kernel_abi.wmma_probe_plan(kind, a_l.to(device), b_l.to(device), c_l.to(device))
    run(launches)
    d_l = d_l.cpu()
    return kernel_abi.d_from_lanes(d_l if kind == "iu8" else d_l.view(torch.float32))


# ------------------------------------------------------------------------------------------ e4m3 conversion
def e4m3_probe_values() -> torch.Tensor:
    """fp32 values across the e4m3 range and past 448, both signs: zero, subnormals and a subnormal tie, ties to
    even, the top binade, 448 and the next fp32 above it, 464 (the tie past the largest code), 480, huge, Inf; NaN."""
    top = float(torch.nextafter(torch.tensor(448.0), torch.tensor(math.inf)))
    pos = [0.0, 2.0 ** -10, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -6, 0.3, 1.0, 1.0625, 1.1875, 17.0, 240.0, 416.0,
           432.0, 440.0, 447.9, 448.0, top, 448.03, 463.99, 464.0, 480.0, 1e6, 3e38, math.inf]
    vals = pos + [-x for x in pos] + [math.nan, 0.5, 1.0, 2.0]
    return torch.tensor(vals, dtype=torch.float32)


def e4m3_expected(x: torch.Tensor, nonsat: bool) -> torch.Tensor:
    """The e4m3 bytes of fp32 x: round to nearest even, saturating to +-448 (the emulation's default), or with
    `nonsat` NaN (0x7f, 0xff when negative) for |x| > 448, Inf included. NaN gives 0x7f."""
    sat = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).clone()
    sat[torch.isnan(x)] = 0x7F
    if nonsat:
        over = x.abs() > 448.0
        sat[over] = torch.where(x[over] < 0, 0xFF, 0x7F).to(torch.uint8)
    return sat


def run_e4m3(run: Callable, x: torch.Tensor, device) -> torch.Tensor:
    """The kernels' e4m3 conversion (pack_e4m3x4) of fp32 x through the probe kernel: uint8 bytes on the CPU."""
    out, launches = kernel_abi.e4m3_probe_plan(x.to(device).contiguous())
    run(launches)
    return out.cpu()


# ------------------------------------------------------------------------------------------ truncating accumulator
# The pure-torch twin of the prelude's emu_trunc_acc (SG_EMU_ACC_TRUNC_BITS, kernel_abi.VERIFY_OPTIONS): per output
# element the terms C and the 16 exact products are aligned to the largest exponent emax among the nonzero terms,
# every bit below 2^(emax - bits) is dropped (truncation toward zero), the aligned terms are summed exactly and the
# sum is normalised to `bits` fraction bits, again truncating toward zero, and stored as fp32 (round to nearest even,
# exact for bits <= 23). NaN/Inf terms give the plain sum.
_SIGN = -(1 << 31)


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """Exponent of the leading bit of finite nonzero fp32 values (subnormals: -127), as emu_exponent."""
    ef = (x.view(torch.int32) >> 23) & 0xFF
    return torch.where(ef > 0, ef - 127, torch.full_like(ef, -127))


def trunc_to_grid(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """fp32 x truncated toward zero to a multiple of 2^g (elementwise; g broadcast), as emu_trunc_to_grid."""
    u = x.view(torch.int32)
    ef = (u >> 23) & 0xFF
    drop = g - (ef.clamp(min=1) - 150)
    mask = ~(torch.bitwise_left_shift(torch.ones_like(drop), drop.clamp(0, 23)) - 1)
    out = torch.where(drop <= 0, u, torch.where(drop >= 24, u & _SIGN, u & mask))
    return out.view(torch.float32)


def trunc_acc_model(terms: torch.Tensor, bits: int) -> torch.Tensor:
    """terms (..., 17) fp32: C then the 16 products (exact in fp32). Returns the truncating accumulator's D (...)."""
    terms = terms.float().contiguous()
    finite = torch.isfinite(terms).all(dim=-1)
    nonzero = terms != 0
    exps = torch.where(nonzero, _exponent(terms), torch.full_like(terms, -1000, dtype=torch.int32))
    emax = exps.amax(dim=-1)
    aligned = trunc_to_grid(terms, (emax - bits).unsqueeze(-1))
    s = aligned.double().sum(dim=-1)  # exact; normalised in double, then stored as fp32 (emu_trunc_acc)
    lead = torch.frexp(s).exponent - 1
    grid = torch.ldexp(torch.ones_like(s), (lead - bits).to(torch.float64))
    r = torch.where(s == 0, s, torch.trunc(s / grid) * grid).float()
    r = torch.where(emax == -1000, terms[..., 0] + 0.0, r)
    plain = terms[..., 1:].sum(dim=-1) + terms[..., 0]
    return torch.where(finite, r, plain)


def trunc_wmma_expected(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bits: int) -> torch.Tensor:
    """D of one 16x16x16 WMMA (A, B as their fp32 values, C fp32) under the truncation model."""
    prods = a.float()[:, None, :] * b.float().t()[None, :, :]  # (m, n, k): A[m][k] * B[k][n]
    terms = torch.cat([c.float()[:, :, None], prods], dim=-1)
    return trunc_acc_model(terms, bits)


def trunc_wmma_case(kind: str, seed: int = 0):
    """fp8 or f16 operands and a C whose magnitude varies over 2^-4 .. 2^24 per element (zeros included), so
    that a 13-bit accumulator drops some products entirely, truncates others and keeps the rest.
    Returns (a_lanes, b_lanes, c_lanes, (a, b, c) as fp32 values)."""
    g = torch.Generator().manual_seed(1000 + seed)
    cast = torch.float8_e4m3fn if kind == "fp8" else torch.float16
    a = (torch.randn(16, 16, generator=g) * 8).to(cast)
    b = (torch.randn(16, 16, generator=g) * 2).to(cast)
    c = torch.randn(16, 16, generator=g) * torch.exp2(torch.randint(-4, 25, (16, 16), generator=g).float())
    c[0, :4] = 0.0
    a_l = kernel_abi.lanes_from_a(a).contiguous().view(torch.int32)
    b_l = kernel_abi.lanes_from_b(b).contiguous().view(torch.int32)
    c_l = kernel_abi.lanes_from_d(c).contiguous().view(torch.int32)
    return a_l, b_l, c_l, (a.float(), b.float(), c)


def run_trunc_wmma(run: Callable, kind: str, device, bits: int, seed: int = 0):
    """The probe kernel on trunc_wmma_case through `run` (a build with the truncation option for `kind`), and what
    the torch model expects. Returns (got, expected, exact)."""
    a_l, b_l, c_l, (a, b, c) = trunc_wmma_case(kind, seed)
    got = _probe(run, kind, device, a_l, b_l, c_l)
    exact = (a.double() @ b.double() + c.double()).float()
    return got, trunc_wmma_expected(a, b, c, bits), exact


# ------------------------------------------------------------------------------------------ inputs
def make_qkv(b, hq, hkv, nq, nk, d, dtype, device, layout: str = "hnd", seed: int = 0, k_offset: float = 3.0):
    """q, k, v as HND views: 'hnd' contiguous, 'nhd' transposed views of (B, N, H, D) buffers, 'fused' views
    of one (B, N, (Hq + 2 Hkv) D) projection (needs nq == nk). K gets a per-channel offset (smooth_k's case)."""
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(d, generator=g) * k_offset
    if layout == "fused":
        assert nq == nk
        qkv = torch.randn(b, nq, (hq + 2 * hkv) * d, generator=g)
        qkv[..., hq * d:(hq + hkv) * d] += offset.repeat(hkv)
        qkv = qkv.to(dtype).to(device)
        q = qkv[..., :hq * d].unflatten(-1, (hq, d)).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hkv) * d].unflatten(-1, (hkv, d)).transpose(1, 2)
        v = qkv[..., (hq + hkv) * d:].unflatten(-1, (hkv, d)).transpose(1, 2)
        return q, k, v
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g) + offset
    v = torch.randn(b, hkv, nk, d, generator=g)
    q, k, v = (t.to(dtype).to(device) for t in (q, k, v))
    if layout == "nhd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q, k, v


def diffuse_qkv(b, h, nq, nk, d, dtype, device, seed: int = 0, v_offset: bool = True):
    """Near-uniform attention over many keys (q, k = 0.7 randn), V = randn plus, with `v_offset`, a per-channel
    offset 2 + 2|randn(D)| (the precision case: where a truncating P.V accumulator loses mass)."""
    g = torch.Generator().manual_seed(seed)
    q = 0.7 * torch.randn(b, h, nq, d, generator=g)
    k = 0.7 * torch.randn(b, h, nk, d, generator=g)
    v = torch.randn(b, h, nk, d, generator=g)
    if v_offset:
        v = v + 2 + 2 * torch.randn(d, generator=g).abs()
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


def peaked_qkv(b, h, nq, nk, d, dtype, device, q_gain: float = 30.0, seed: int = 0):
    """make_qkv with q scaled by q_gain: row maxima of the base-2 scores in the hundreds (D128, sm_scale 1/sqrt(d)),
    where the softmax shift is rounded on a grid several times coarser than near log2(448), so an unguarded FP8 P
    of the row-max key lands above 448."""
    q, k, v = make_qkv(b, h, h, nq, nk, d, torch.float32, torch.device("cpu"), seed=seed)
    return tuple(t.to(dtype).to(device) for t in (q * q_gain, k, v))


DOMINANT_KEY, DOMINANT_NK = 70, 130


def dominant_key_qq(logits, d: int = 64) -> quant.QuantizedQKV:
    """A crafted FP8 QuantizedQKV (CPU): query row i sees one dominant key (DOMINANT_KEY, in the second key tile of
    DOMINANT_NK) at natural-log logit logits[i], the others at logits[i] / 2; V = 1 for the dominant key and 0.5 for
    the others, in every channel. The spec's output is 1 to within exp(-logit / 2)."""
    nq = len(logits)
    q8 = torch.zeros(1, 1, nq, d, dtype=torch.int8)
    q8[..., 0] = 127
    k8 = torch.zeros(1, 1, DOMINANT_NK, d, dtype=torch.int8)
    k8[..., 0] = 64
    k8[0, 0, DOMINANT_KEY, 0] = 127
    q_scale = (torch.tensor(logits, dtype=torch.float64) * (quant.LOG2E / (127 * 127))).float().view(1, 1, nq)
    k_scale = torch.ones(1, 1, DOMINANT_NK, dtype=torch.float32)
    v = torch.full((1, 1, DOMINANT_NK, d), 224.0).to(torch.float8_e4m3fn)
    v[0, 0, DOMINANT_KEY] = 448.0
    v_scale = torch.full((1, 1, d), 1 / 448, dtype=torch.float32)
    return quant.QuantizedQKV(q8, q_scale, k8, k_scale, v, v_scale, None)


def dominant_key_logits(n: int = 128):
    """1e2, 1e5, 1e6, 1e7 and logits log-spaced over 1e-2 .. 1e7 (the softmax shift negative, small and huge)."""
    return [1e2, 1e5, 1e6, 1e7] + torch.logspace(-2, 7, n - 4, dtype=torch.float64).tolist()


def per_head_rel_l1(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Relative L1 per (batch, head): (B, H) in FP64, so one bad head or batch shows on its own."""
    o, e = out.double(), exact.double()
    return (o - e).abs().sum(dim=(2, 3)).cpu() / e.abs().sum(dim=(2, 3)).clamp_min(1e-300).cpu()


# ------------------------------------------------------------------------------------------ prologue
def prologue(run: Callable, q, k, v, *, sm_scale, smooth_k=True, pv="fp8", qk_group="token",
             smooth_v=False) -> quant.QuantizedQKV:
    qq, ws, launches = kernel_abi.prologue_plan(q, k, v, sm_scale=sm_scale, smooth_k=smooth_k, pv=pv, qk_group=qk_group,
                                                smooth_v=smooth_v)
    run(launches)
    del ws
    return qq


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of a and b (same shape and dtype, CPU) that differ; e4m3 compared by bits. Two NaNs count as
    equal: the spec fixes where a NaN appears (a NaN or Inf input), not its sign or payload."""
    if a.dtype == torch.float8_e4m3fn:
        diff = a.view(torch.uint8) != b.view(torch.uint8)
        a, b = a.float(), b.float()
    else:
        diff = a != b
    if a.is_floating_point():
        diff &= ~(torch.isnan(a) & torch.isnan(b))
    return int(diff.sum())


def prologue_mismatches(qq: quant.QuantizedQKV, q, k, v, *, sm_scale, smooth_k=True, pv="fp8",
                        qk_group="token", smooth_v=False) -> Dict[str, int]:
    """{field: number of elements that differ from the CPU torch prologue} (empty = bit-exact; for inputs
    holding NaN/Inf, NaN must sit exactly where the spec puts it)."""
    ref = quant.quantize_qkv_torch(q.cpu(), k.cpu(), v.cpu(), sm_scale=sm_scale, smooth_k=smooth_k, pv=pv,
                                   qk_group=qk_group, smooth_v=smooth_v)
    return field_mismatches(qq, ref)


def field_mismatches(qq: quant.QuantizedQKV, ref: quant.QuantizedQKV) -> Dict[str, int]:
    """{field: elements of `qq` (any device) that differ from `ref` (CPU); -1 for a field missing on one side or of
    another shape or dtype}."""
    bad = {}
    for name in QQ_FIELDS:
        a, b = getattr(qq, name), getattr(ref, name)
        if a is None or b is None:
            if (a is None) != (b is None):
                bad[name] = -1
            continue
        a = a.cpu()
        n = -1 if a.shape != b.shape or a.dtype != b.dtype else _differing(a, b)
        if n:
            bad[name] = n
    return bad


# ------------------------------------------------------------------------------------------ attention
def qk_scores(run: Callable, qq: quant.QuantizedQKV) -> torch.Tensor:
    scores, launches = kernel_abi.qk_scores_plan(qq.q8, qq.k8)
    run(launches)
    return scores


def qk_scores_expected(qq: quant.QuantizedQKV) -> torch.Tensor:
    q8 = qq.q8.cpu().to(torch.int32)
    k8 = reference.expand_kv_heads(qq.k8.cpu(), q8.shape[1]).to(torch.int32)
    return torch.einsum("bhqd,bhkd->bhqk", q8, k8)


def attention(run: Callable, qq: quant.QuantizedQKV, *, pv, is_causal, out_dtype, return_lse=False, q=None,
              sm_scale=1.0, out=None, chain="two-level"):
    out, lse, launches = kernel_abi.attention_plan(qq, pv=pv, is_causal=is_causal, out_dtype=out_dtype,
                                                    return_lse=return_lse, q=q, sm_scale=sm_scale, out=out,
                                                    chain=chain)
    run(launches)
    return out, lse


# The HIP kernels' FP8 P grid: each key tile of BN keys takes its own max as its 448 (sage_attention.hip attend_tile).
HIP_P_TILE = kernel_abi.ATT_BLOCK_N


def hip_spec(qq: quant.QuantizedQKV, **kwargs):
    """The spec's attention half on the HIP kernels' P grid (FP8: p_tile = BN; FP16 P has one grid)."""
    return reference.attention_from_quantized(qq, p_tile=HIP_P_TILE, **kwargs)


def attention_report(out, lse, qq, q, k, v, *, pv, is_causal, sm_scale) -> Dict[str, float]:
    """Kernel output against the spec's attention half on the kernel's P grid (same QuantizedQKV) and against exact
    attention."""
    ref_o, ref_l = hip_spec(qq, pv=pv, is_causal=is_causal, return_lse=lse is not None, q=q, sm_scale=sm_scale,
                            out_dtype=out.dtype)
    ex_o, ex_l = reference.exact_attention(q, k, v, is_causal=is_causal, sm_scale=sm_scale, return_lse=True)
    o, r = out.float(), ref_o.float()
    rep = {
        "rel_l1_vs_ref": metrics.rel_l1(o, r),
        "max_abs_vs_ref": float((o - r).abs().max()),
        "cos_vs_exact": metrics.cosine(o, ex_o),
        "rel_l1_vs_exact": metrics.rel_l1(o, ex_o),
        "ref_rel_l1_vs_exact": metrics.rel_l1(r, ex_o),
        "nonfinite": int((~torch.isfinite(o)).sum()),
    }
    if pv == "fp8":  # for the record: the spec's row-max grid, which FP8 P no longer shares with the kernel
        row_o, _ = reference.attention_from_quantized(qq, pv=pv, is_causal=is_causal, out_dtype=out.dtype)
        rep["rel_l1_vs_row_grid_ref"] = metrics.rel_l1(o, row_o.float())
    if lse is not None:
        rep["lse_max_abs_vs_ref"] = float((lse - ref_l).abs().max())
        rep["lse_max_abs_vs_exact"] = float((lse - ex_l).abs().max())
    return rep


# Tolerances of the kernel against the spec's attention half on the kernel's P grid (hip_spec: FP8 P rounded against
# each key tile's own max, as attend_tile does), same QuantizedQKV, outputs rounded to the same dtype. Both P.V kinds
# then differ only by exp2's last bit, the summation order and the output roundings they move: host simulator (CPU),
# tests/test_host_sim.py's attention cases: FP8 <= 2.4e-4, FP16 <= 9e-5 (figures:
# docs/MEASUREMENTS.md#one-p-grid-for-the-spec-and-the-kernels). Against the row max's grid FP8 differed by
# 0.5-3.3 % (held to 3 % then). The kernel may not be worse than the spec against exact attention either (below).
TOL_REL_L1_VS_REF = {"fp8": 2e-3, "fp16": 2e-3}
TOL_LSE = 2e-3


def assert_attention_ok(rep: Dict[str, float], pv: str) -> None:
    assert rep["nonfinite"] == 0, rep
    assert rep["rel_l1_vs_ref"] < TOL_REL_L1_VS_REF[pv], rep
    assert rep["cos_vs_exact"] > 0.998, rep
    assert rep["rel_l1_vs_exact"] < rep["ref_rel_l1_vs_exact"] * 1.1 + 2e-3, rep
    if "lse_max_abs_vs_ref" in rep:
        assert rep["lse_max_abs_vs_ref"] < TOL_LSE, rep


# ------------------------------------------------------------------------------------------ NaN/Inf, overflow
POISON_TOKEN, POISON_CHANNEL = 30, 5


def poisoned_qkv(where: str, value: float, dtype, device, nq=40, nk=100, d=64):
    """q, k, v (B1 H1, HND, on `device`) with one bad element at (POISON_TOKEN, POISON_CHANNEL) of `where`.
    The token lies inside the first key tile, so under causal masking rows before it never see it."""
    q, k, v = make_qkv(1, 1, 1, nq, nk, d, dtype, torch.device("cpu"), k_offset=1.0)
    {"q": q, "k": k, "v": v}[where][0, 0, POISON_TOKEN, POISON_CHANNEL] = value
    return tuple(t.to(device) for t in (q, k, v))


def assert_nonfinite_like_spec(out, lse, qq, q, k, v, *, where, pv, is_causal, sm_scale, smooth_k):
    """The NaN rule: outputs are non-finite exactly where the spec's attention half (same QuantizedQKV) is, and
    those are NaN (not a saturated or overflowed value); nothing is finite where exact attention is not
    (tests/test_fuzz.py's rule); the LSE is NaN where the spec's is; all other outputs match the spec."""
    qq_cpu = quant.QuantizedQKV(*(None if getattr(qq, f) is None else getattr(qq, f).cpu() for f in QQ_FIELDS))
    q, k, v, out = q.cpu(), k.cpu(), v.cpu(), out.cpu().float()
    ref, ref_lse = hip_spec(qq_cpu, pv=pv, is_causal=is_causal, return_lse=True, q=q, sm_scale=sm_scale,
                            out_dtype=q.dtype)
    exact, _ = reference.exact_attention(q, k, v, is_causal=is_causal, sm_scale=sm_scale)
    bad_out, bad_ref = ~torch.isfinite(out), ~torch.isfinite(ref.float())
    assert torch.isnan(out[bad_out]).all(), "non-finite outputs must be NaN"
    assert torch.equal(bad_out, bad_ref), f"{int(bad_out.sum())} non-finite outputs, spec has {int(bad_ref.sum())}"
    assert not (torch.isfinite(out) & ~torch.isfinite(exact)).any(), "a NaN/Inf input came out finite"
    if lse is not None:
        assert torch.equal(torch.isnan(lse.cpu()), torch.isnan(ref_lse)), "LSE NaN pattern differs from the spec"
    t, c = POISON_TOKEN, POISON_CHANNEL
    if where == "q":
        assert bad_out[0, 0, t].all(), "the bad query's row must be NaN"
    elif where == "k":
        assert bad_out[0, 0, t if is_causal else 0].all(), "a row that sees the bad key must be NaN"
        if is_causal and not smooth_k:
            assert not bad_out[0, 0, :t].any(), "rows before the bad key never see it"
    else:
        assert bad_out[0, 0, :, c].all() and not bad_out[0, 0, :, c + 1:].any(), "only the bad V channel is NaN"
    good = ~bad_ref
    if good.any():
        o, r = out[good], ref.float()[good]
        assert float((o - r).abs().sum() / r.abs().sum()) < TOL_REL_L1_VS_REF[pv]


def overflow_qkv(dtype, v_max: float, device, nq=40, nk=100, d=64):
    """V at the top of its range: channel POISON_CHANNEL holds +v_max everywhere, the next one -v_max."""
    q, k, v = make_qkv(1, 1, 1, nq, nk, d, torch.float32, torch.device("cpu"), k_offset=1.0)
    v = v / v.abs().amax() * v_max * 0.5
    v[..., POISON_CHANNEL] = v_max
    v[..., POISON_CHANNEL + 1] = -v_max
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


def assert_overflow_safe(out, qq, v, *, pv, is_causal):
    """Finite output; the constant channels come out as +-max|V| (FP8 rounding of P: within 7 %), never beyond
    the dtype's finite range; everything matches the spec's attention half."""
    qq_cpu = quant.QuantizedQKV(*(None if getattr(qq, f) is None else getattr(qq, f).cpu() for f in QQ_FIELDS))
    ref, _ = hip_spec(qq_cpu, pv=pv, is_causal=is_causal, out_dtype=out.dtype)
    o, c = out.cpu().float(), POISON_CHANNEL
    assert torch.isfinite(o).all(), f"{int((~torch.isfinite(o)).sum())} non-finite outputs"
    top = float(v.float().abs().max())
    assert torch.allclose(o[..., c], torch.full_like(o[..., c], top), rtol=0.07)
    assert torch.allclose(o[..., c + 1], torch.full_like(o[..., c + 1], -top), rtol=0.07)
    assert float(o.abs().max()) <= torch.finfo(out.dtype).max
    # In FP64: near 3e38 an FP32 sum of |ref| overflows to Inf and the ratio becomes NaN.
    o64, r64 = o.double(), ref.double()
    assert float((o64 - r64).abs().sum() / r64.abs().sum()) < TOL_REL_L1_VS_REF[pv]


# ------------------------------------------------------------------------------------------ key-only masks
def padded_qkv(b, hq, hkv, nq, nk, d, dtype, device, pad, scale: float = 1000.0, layout: str = "hnd", seed: int = 0):
    """make_qkv with batch i's last pad[i % len(pad)] keys' K and V `scale` times larger: padding a kernel must keep
    out of the row max and the K/V statistics when a mask hides it."""
    q, k, v = make_qkv(b, hq, hkv, nq, nk, d, torch.float32, torch.device("cpu"), seed=seed)
    for i in range(b):
        k[i, :, nk - pad[i % len(pad)]:] *= scale
        v[i, :, nk - pad[i % len(pad)]:] *= scale
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if layout == "nhd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return tuple(t.to(device) for t in (q, k, v))


def key_mask_variants(b: int, hq: int, nk: int, pad, device="cpu", nq: int = 70) -> Dict[str, torch.Tensor]:
    """Key-only masks as ComfyUI's models pass them, hiding batch i's last pad[i % len(pad)] keys (except where the
    name says otherwise): bool (True keeps), -inf in fp16, -finfo.max in bf16 (HunyuanVideo's), a 3-D one, one
    expanded over nq query rows (stride 0), a mask per head (bool), a soft bias (no key dead), every key -inf
    (rows with no key: zeros, LSE -inf), every key at -finfo.max (SDPA's uniform average)."""
    keep = torch.ones(b, 1, 1, nk, dtype=torch.bool)
    for i in range(b):
        keep[i, ..., nk - pad[i % len(pad)]:] = False
    neg_max = torch.zeros(b, 1, 1, nk, dtype=torch.bfloat16).masked_fill(~keep, -torch.finfo(torch.bfloat16).max)
    per_head = keep.expand(b, hq, 1, nk).clone()
    per_head[:, -1, :, : nk // 3] = False
    masks = {
        "bool": keep,
        "neg-inf fp16": torch.zeros(b, 1, 1, nk, dtype=torch.float16).masked_fill(~keep, -math.inf),
        "-finfo.max bf16": neg_max,
        "-finfo.max bf16 3d": neg_max[:1, 0],
        "per-head bool": per_head,
        "soft bias": torch.randn(b, hq, 1, nk, generator=torch.Generator().manual_seed(5)) * 2.0,
        "all -inf": torch.full((b, 1, 1, nk), -math.inf),
        "all -finfo.max": torch.full((1, 1, nk), -torch.finfo(torch.float32).max),
    }
    on_device = {name: m.to(device) for name, m in masks.items()}
    # Expanded on its device: copying an expanded tensor to another device materializes its rows.
    on_device["-finfo.max expanded"] = on_device["-finfo.max bf16"].expand(b, 1, nq, nk)
    return on_device


def masked_prologue(run: Callable, q, k, v, attn_mask, *, sm_scale, smooth_k=True, pv="fp8", qk_group="token",
                    smooth_v=False):
    """The HIP prologue with a key-only mask's live keys (backends/hip/masks.py), and the mask's operands.
    Returns (qq, HipKeyMask)."""
    from ..backends.hip.masks import key_mask_operands
    km = key_mask_operands(attn_mask, k.shape[1], k.shape[2])
    live = kernel_abi.live_keys(km.live, k.shape[0], k.shape[1], k.shape[2])
    qq, ws, launches = kernel_abi.prologue_plan(q, k, v, sm_scale=sm_scale, smooth_k=smooth_k, pv=pv,
                                                qk_group=qk_group, smooth_v=smooth_v, live=live)
    run(launches)
    del ws
    return qq, km


def masked_prologue_mismatches(qq, q, k, v, km, **kw) -> Dict[str, int]:
    """prologue_mismatches against quant.quantize_qkv_torch(live=...) of the same mask (CPU)."""
    return field_mismatches(qq, quant.quantize_qkv_torch(q.cpu(), k.cpu(), v.cpu(), live=km.live.cpu(), **kw))


def masked_attention(run: Callable, qq, km, *, pv, is_causal, out_dtype, return_lse=False, q=None, sm_scale=1.0):
    """The masked attention kernels (the *_kmask entry points) on a prologue's output."""
    out, lse, launches = kernel_abi.attention_plan(qq, pv=pv, is_causal=is_causal, out_dtype=out_dtype,
                                                    return_lse=return_lse, q=q, sm_scale=sm_scale,
                                                    key_mask=km.attention)
    run(launches)
    return out, lse


def cpu_keeping_broadcast(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU with its stride-0 (expanded) dims kept: a copy across devices materializes them, which would
    turn a key-only mask expanded over the query rows into a per-row one (call_spec.mask_scope "rows"), which the
    spec quantizes without leaving its dead keys out."""
    base = t[tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None)
                   for size, stride in zip(t.shape, t.stride()))]
    return base.cpu().expand(t.shape)


def masked_report(out, lse, qq, km, q, k, v, attn_mask, *, pv, is_causal, sm_scale) -> Dict[str, float]:
    """The masked kernel's output against the spec's attention half on the kernel's P grid with the same key bias
    (same QuantizedQKV), against exact attention with the mask, and against the whole spec
    (reference.reference_attention with the mask: its own quantization, dead keys out of the statistics)."""
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    qq_cpu = quant.QuantizedQKV(*(cpu(getattr(qq, f)) for f in QQ_FIELDS))
    q, k, v, mask = q.cpu(), k.cpu(), v.cpu(), cpu_keeping_broadcast(attn_mask)
    ref_o, ref_l = hip_spec(qq_cpu, pv=pv, is_causal=is_causal, return_lse=lse is not None, q=q, sm_scale=sm_scale,
                            out_dtype=out.dtype, key_bias=cpu(km.attention.bias), key_fill=km.attention.fill)
    ex_o, ex_l = reference.exact_attention(q, k, v, is_causal=is_causal, sm_scale=sm_scale, attn_mask=mask,
                                           return_lse=True)
    spec_o, _ = reference.reference_attention(q, k, v, is_causal=is_causal, sm_scale=sm_scale, pv=pv,
                                              attn_mask=mask, p_tile=HIP_P_TILE)
    o, r = out.cpu().float(), ref_o.float()
    rep = {
        "rel_l1_vs_ref": metrics.rel_l1(o, r),
        "max_abs_vs_ref": float((o - r).abs().max()),
        "rel_l1_vs_spec": metrics.rel_l1(o, spec_o.float()),
        "cos_vs_exact": metrics.cosine(o, ex_o),
        "rel_l1_vs_exact": metrics.rel_l1(o, ex_o),
        "ref_rel_l1_vs_exact": metrics.rel_l1(r, ex_o),
        "nonfinite": int((~torch.isfinite(o)).sum()),
        "zero_rows_vs_exact": int(((o == 0).all(-1) != (ex_o == 0).all(-1)).sum()),
    }
    if lse is not None:
        got, want = lse.cpu(), ref_l
        both_inf = (got == -math.inf) & (want == -math.inf)
        rep["lse_max_abs_vs_ref"] = float(torch.where(both_inf, 0.0, (got - want).abs()).max())
        rep["lse_inf_mismatch"] = int(((got == -math.inf) != (ex_l == -math.inf)).sum())
    return rep


def assert_masked_attention_ok(rep: Dict[str, float], pv: str) -> None:
    """The unmasked bounds (assert_attention_ok) for a masked call, plus: the same rows empty as exact attention's
    (a row whose every key is masked is 0 with LSE -inf), and within the spec's own bound of the whole spec."""
    assert rep["zero_rows_vs_exact"] == 0, rep
    if "lse_inf_mismatch" in rep:
        assert rep["lse_inf_mismatch"] == 0, rep
    assert rep["rel_l1_vs_spec"] < TOL_REL_L1_VS_REF[pv], rep
    assert_attention_ok(rep, pv)
