"""One self-check for every quantized attention kernel: real shapes, judged per (batch, head, query block).

`self_check(attention, device)` returns None when `attention` agrees with exact FP32 attention on every
case it takes, else a reason naming the case, the (batch, head, query block), the metric and its bound.
`attention(q, k, v, is_causal=False)` takes and returns HND tensors (B, H, N, D) on `device` and uses the
default softmax scale 1/sqrt(head_dim); a case that needs the LSE calls it with `return_lse=True` and
expects `(out, lse)`, one with a softmax scale of its own passes `scale=`. It is what every HIP and Triton
kernel + prologue combination runs on the user's GPU before its first call (kernels/gating.py), and it runs
on the CPU too (the torch reference passes it in every variant of options, each judged by its own bounds).

Why these cases: a kernel that is right on short, peaked inputs can still lose output mass on
near-uniform attention over tens of thousands of keys (an accumulator that truncates), or get one batch,
head or query block wrong. So the cases use batch 2, several heads (GQA where the backend takes it),
query lengths over 8 query blocks of 128 rows with tails that are no multiple of 64, thousands of keys,
cross-attention lengths (512 text keys), head_dim 64 and 128, fp16 and bf16, peaked and diffuse logits,
causal, a precision probe: diffuse attention over 16400 keys with a V channel offset, where the
output is close to the offset and rel L1 sees a loss of scale directly, and a long tail: every row's max
in key 0 and thousands of keys at 2^-8..2^-16.8 of it, where a kernel whose P.V drops the small weights
(FP8 or FP16 P subnormal under a WMMA that flushes them) while its row sum counts them loses the tail's
output; a causal case where each row's own key decides its output (a dropped key or a diagonal one key off
moves whole rows), and a non-default softmax scale. Each (batch, head), and each query block of the long
cases, must meet its case kind's bound on its own, so a single wrong one fails. Where rel L1 is too blunt for
a 1 % error, sharper oracles judge: the least-squares gain of the output (a scale error), the LSE's mean over
a head's rows (an LSE offset), and each query row of the diagonal case (one wrong row).

Nothing here imports ComfyUI. The exact reference (kernels.reference.exact_attention) runs on `device`,
chunked over query rows.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import quant
from .reference import exact_attention

log = logging.getLogger(__name__)

FAILED = "self-check failed"  # in every failure reason a backend is disabled with
NOT_CHECKED = "self-check could not run"  # in the reason of a call refused because memory ran out during it
CALLS_PER_CASE = 2  # check_case calls the attention twice per case: the second call must repeat the first's bits
QUERY_BLOCK = 128  # rows per query block: the largest BLOCK_M of our kernels (Triton and HIP)


@dataclass(frozen=True)
class Bound:
    max_rel_l1: float
    min_cosine: Optional[float] = None
    # |g - 1| per (batch, head), g = sum(o.e) / sum(e.e) the least-squares gain of the output over exact attention:
    # the spec's rounding is near unbiased, so on the cases with this bound g stays within 2e-3 of 1, where rel L1
    # cannot see a 1 % scale error.
    max_gain_error: Optional[float] = None
    # rel L1 of each query row on its own (sum|o - e| / sum|e| over the row): one wrong row (a dropped key) shows.
    max_row_rel_l1: Optional[float] = None


# Bounds per case kind, applied to every (batch, head) and every query block of 128 rows on its own. They hold in
# every variant (qk_group, smooth_k, smooth_v: the spec's rel L1 differs by up to 1.3x between them, within the
# margins below); only the LSE's bound differs per variant (LSE_SPEC_ERROR).
# Measured on these very inputs on the CPU (tools/self_check_calibration.py, docs/VERIFICATION.md; worst over
# (batch, head, block) and, where not said otherwise, over the 16 variants):
#   peaked   torch reference (the spec: INT8 Q.K per token, FP8 P.V): cos >= 0.99925, rel L1 <= 0.0386 (per-token
#            INT8 with smooth_k; every variant: cos >= 0.99872, rel L1 <= 0.0499).
#            Planted faults: a copied query block cos 0.34, a zeroed block cos 0 / rel L1 1.0, a copied
#            batch or head or a wrong kv head cos <= 0.35 / rel L1 >= 1.1; sm_scale ignored (custom-scale) >= 0.2.
#   diffuse  reference rel L1 <= 0.0430 (zero-mean V: outputs are small, FP8 P's rounding shows). Planted
#            faults: rel L1 >= 0.69 (copied head; batch, kv head, zeroed block 1.0-1.6).
#   probe    reference rel L1 <= 0.0021 (peers 0.0015-0.01 here, our fixed kernels ~0.002), gain error <= 0.0018
#            (0.0002 with smooth_v: FP8 P's rounding of near-equal weights is slightly biased, and without smooth_v
#            the V offset carries it). Planted faults: output x 0.95 0.0515; an accumulator of 13 mantissa bits
#            truncated every 16 keys 0.0238 (12 bits: 0.045; 16 bits: 0.0044, passes); a copied batch or head 0.39;
#            output x 1.01 gain error >= 0.008.
#   long-tail reference rel L1 <= 0.0040 (FP16 P.V, smooth_v 0.0016), gain error <= 0.0016. The
#            HIP kernels in the host simulator FP8 0.0026, FP16 0.0015; under an emulated flushing WMMA FP8 0.0067
#            (key 0's tile drops its keys 2^-14.8 below key 0 from P.V), FP16 0.0015. Planted faults: P.V
#            without the weights below 2^-14.8 of the row max (the former FP8 kernel under a flush) 0.17-0.20;
#            those dropped from the row sum too 0.16-0.18; the former FP16 P grid under a flush 0.28-0.31.
#   diagonal reference rel L1 <= 0.0228, one row <= 0.0293, gain error <= 0.0012 (causal: 0.0223, 0.0268,
#            0.0007). Planted faults (causal): the diagonal one key late or early, or the first key dropped, rel L1
#            >= 1.2; the last key dropped, its row 1.06 (query block 0.037). Without causal: the last key dropped,
#            its row 1.74 (block 0.70; the 260-row 2-head case before it took GQA), where every other case passes it.
# Cosine says nothing on the probe (its output is mostly the V offset: a 5 % scale loss keeps cos 0.99999),
# and rel L1 of zero-mean diffuse outputs is large by nature, so each kind has its own bound. The probe's
# sits below the 5 % scale loss it must reject and below a 13-bit truncating accumulator at 16400 keys
# (which would reach ~0.11 at 75600 keys). The long tail's sits 5.3x above the worst passing figure, and every
# query block of every planted fault lies 4.5x above it or more (docs/MEASUREMENTS.md#the-long-tail-self-check-case).
# The gain bounds (2.8x and 3.5x the spec's worst) sit below a 1 % scale error, which rel L1 bounds of 0.015-0.08
# cannot see. The peaked and diffuse cases get none (the spec's gain error reaches 0.008 and 0.006 there), nor the
# long tail: the HIP FP8 kernels' P grid under a flushing WMMA loses 0.65 % of its output there, by design.
BOUNDS: Dict[str, Bound] = {
    "peaked": Bound(max_rel_l1=0.08, min_cosine=0.995),
    "diffuse": Bound(max_rel_l1=0.08),
    "probe": Bound(max_rel_l1=0.015, max_gain_error=0.005),
    "long-tail": Bound(max_rel_l1=0.035),
    "diagonal": Bound(max_rel_l1=0.05, max_gain_error=0.004, max_row_rel_l1=0.1),
}
# LSE error, natural-log units, max over rows, on the LSE case: what the spec reaches per (qk_group, smooth_k)
# (smooth_v changes nothing). Without smooth_k the case's K channel offset coarsens INT8 K, per block of tokens
# more so; a kernel run with those options computes exactly that (the H200's Triton FP8 kernel: 0.1452 at block128).
LSE_SPEC_ERROR: Dict[Tuple[str, bool], float] = {
    ("token", True): 0.0169, ("block32", True): 0.0205, ("block64", True): 0.0194, ("block128", True): 0.0280,
    ("token", False): 0.0780, ("block32", False): 0.1317, ("block64", False): 0.1061, ("block128", False): 0.1452,
}
LSE_MARGIN = 2.0  # the bound: LSE_MARGIN x the spec's figure
MAX_LSE_ERROR = LSE_MARGIN * LSE_SPEC_ERROR[("token", True)]  # the accurate options' bound
# |mean LSE error| over a (batch, head)'s rows: the spec's rounding of the scores moves the LSE both ways, so its
# mean stays <= 0.0031 in every variant (0.0002 with smooth_k) while a constant offset of the LSE moves it whole.
MAX_LSE_BIAS = 0.02


@dataclass(frozen=True)
class CaseBounds:
    """What one variant's self-check holds each case to: a Bound per case kind, and the LSE's."""
    case: Dict[str, Bound]
    max_lse_error: float
    max_lse_bias: float  # |mean over a (batch, head)'s rows of the LSE error|


def bounds_for(variant: Optional["Variant"]) -> CaseBounds:
    """The bounds of `variant` (None: the accurate options, per-token INT8 with smooth_k)."""
    key = ("token", True) if variant is None else (variant.qk_group, bool(variant.smooth_k))
    return CaseBounds(BOUNDS, LSE_MARGIN * LSE_SPEC_ERROR[key], MAX_LSE_BIAS)


SCALE_LOSS_MUST_FAIL = 0.05  # the output scale loss the probe is built to reject (tests plant it)
# The long tail (long_tail_inputs): every row's max in key 0, the other keys' weights 2^-8.4..2^-16.8 of it, 1/weight
# uniform (each octave holds the same share of the tail's mass), each row's tail stretched by n/127 with n in
# 121..127 (2^-8..2^-16 at the least). 15-24 % of a row's tail weight lies below 2^-14.8, where FP8 P topped at the
# row max is subnormal (FP16 P in [0, 1]: below 2^-14).
LONG_TAIL_LOG2 = (8.4, 16.8)
LONG_TAIL_STRETCH = (121, 127)
DIAGONAL_SCORE = 25.0  # diagonal_inputs: query i's score of key i at the default scale (natural log)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "peaked" | "diffuse" | "probe" | "long-tail": the inputs and the bound (BOUNDS)
    dtype: torch.dtype
    head_dim: int
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    is_causal: bool = False
    return_lse: bool = False  # optional: only for backends that return the LSE (see default_accepts)
    scale: Optional[float] = None  # softmax scale passed as `scale=`; None: the default 1/sqrt(head_dim), not passed
    key_mask: bool = False  # optional: a key-only padding mask over keys that hold huge values (`padding_mask`)

    @property
    def gqa(self) -> bool:
        return self.q_heads != self.kv_heads

    @property
    def per_block(self) -> bool:
        return self.q_len > QUERY_BLOCK

    @property
    def bound(self) -> Bound:
        return BOUNDS[self.kind]

    def label(self) -> str:
        return (f"'{self.name}' ({str(self.dtype).replace('torch.', '')} D{self.head_dim} B{self.batch} "
                f"Hq{self.q_heads}/Hkv{self.kv_heads} Nq{self.q_len} Nk{self.kv_len} {self.kind}"
                f"{' causal' if self.is_causal else ''}{' +LSE' if self.return_lse else ''}"
                f"{'' if self.scale is None else f' scale {self.scale:g}'}"
                f"{' +key mask' if self.key_mask else ''})")


# Every length is a tail: none is a multiple of 64 except the 512 text keys of cross-attention.
# Cost with the torch reference on 2 shared CPU cores: 2.8 s of CPU time, 1.5 s wall (per case, wall: probe
# 0.75 s, causal-gqa 0.26, diffuse 0.15, long-keys 0.12, long-tail 0.10, cross-attention 0.10, lse 0.03), most
# of it the reference itself; the test suite prints the time of each run in its "sage_rdna4 counts" section.
# The three cases added last: causal-diagonal 0.013-0.025 s, diagonal 0.006-0.010, custom-scale 0.018-0.035 (best
# of 5, 2 or 1 torch threads on the same, busier, cores; the seven above unchanged: docs/VERIFICATION.md).
DEFAULT_CASES: Tuple[Case, ...] = (
    # image tokens attending 512 text keys; 9 query blocks
    Case("cross-attention", "peaked", torch.bfloat16, 128, 2, 2, 2, 1100, 512),
    # query blocks and causal masking over 9 blocks, GQA
    Case("causal-gqa", "peaked", torch.float16, 64, 2, 2, 1, 1090, 1090, is_causal=True),
    # several thousand keys, peaked
    Case("long-keys", "peaked", torch.float16, 128, 2, 2, 2, 200, 3000),
    # several thousand keys, near-uniform attention on zero-mean V (small outputs), GQA
    Case("diffuse", "diffuse", torch.bfloat16, 64, 2, 4, 2, 150, 3000),
    # the precision probe: near-uniform attention over 16400 keys, V with a channel offset
    Case("precision-probe", "probe", torch.bfloat16, 128, 2, 2, 2, 100, 16400),
    # a long tail of small weights behind one large one: P.V and the row sum must count the same keys
    Case("long-tail", "long-tail", torch.bfloat16, 128, 2, 2, 2, 200, 2100),
    # LSE (optional): causal, GQA, both tails
    Case("lse", "peaked", torch.bfloat16, 64, 2, 4, 2, 200, 333, is_causal=True, return_lse=True),
    # causal where the diagonal decides each row (diagonal_inputs): a mask one key off, or a dropped key
    Case("causal-diagonal", "diagonal", torch.float16, 128, 2, 2, 1, 330, 330, is_causal=True),
    # the same without the mask: each row is its next key's V, so any dropped key but key 0 moves a row (GQA as
    # 'diffuse': the two share one compiled kernel, kernels/verify/compile_keys.py)
    Case("diagonal", "diagonal", torch.bfloat16, 64, 2, 4, 2, 250, 250),
    # a softmax scale of its own (only for callables taking `scale`, see default_accepts)
    Case("custom-scale", "peaked", torch.float16, 64, 2, 2, 2, 260, 900, scale=0.06),
    # A key-only padding mask (HunyuanVideo's: -finfo.max on the padding, in q's dtype), padding keys holding K and V
    # PADDING_SCALE times larger: a kernel that lets them into the row max or the K/V statistics fails.
    Case("padded-keys", "peaked", torch.bfloat16, 128, 2, 2, 2, 300, 1100, return_lse=True, key_mask=True),
)
PADDING_SCALE = 1000.0
PADDED_KEYS = (180, 357)  # masked keys at the end of batch 0, 1


def checks_fingerprint(cases: Sequence[Case] = DEFAULT_CASES) -> str:
    """What a remembered pass was checked against: the cases and every bound (the pass cache keys by it, so a
    change of either runs the check again)."""
    return repr([repr(c) for c in cases]) + repr(BOUNDS)


def default_accepts(case: Case) -> bool:
    """A plain `attention(q, k, v, is_causal=False)` is assumed to take GQA and causal, not to return LSE nor to
    take a `scale` or a mask."""
    return not case.return_lse and case.scale is None and not case.key_mask


def padding_mask(case: Case, device) -> torch.Tensor:
    """The key-mask case's additive mask (B, 1, 1, Nk) in the case's dtype: 0, or -finfo.max on batch b's last
    PADDED_KEYS[b] keys."""
    m = torch.zeros(case.batch, 1, 1, case.kv_len, dtype=case.dtype)
    for b in range(case.batch):
        m[b, ..., case.kv_len - PADDED_KEYS[b % len(PADDED_KEYS)]:] = -torch.finfo(case.dtype).max
    return m.to(device)


def make_inputs(case: Case, device, seed: Optional[int] = None):
    """Deterministic q, k, v (HND, case dtype) on `device` for the case's kind.

    peaked: randn q, k with a per-channel K offset (3 * randn per channel); diffuse: q, k = 0.7 * randn;
    probe: diffuse, and v = randn + 2 + 2 * |randn(D)| (a positive offset per channel); long-tail:
    `long_tail_inputs`."""
    if seed is None:
        seed = int.from_bytes(hashlib.sha256(case.name.encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    if case.kind == "long-tail":
        return tuple(t.to(device=device, dtype=case.dtype) for t in long_tail_inputs(case, g))
    if case.kind == "diagonal":
        return tuple(t.to(device=device, dtype=case.dtype) for t in diagonal_inputs(case, g))
    b, hq, hkv, d = case.batch, case.q_heads, case.kv_heads, case.head_dim
    q = torch.randn(b, hq, case.q_len, d, generator=g)
    k = torch.randn(b, hkv, case.kv_len, d, generator=g)
    v = torch.randn(b, hkv, case.kv_len, d, generator=g)
    if case.kind == "peaked":
        k += 3.0 * torch.randn(b, hkv, 1, d, generator=g)
    else:
        q *= 0.7
        k *= 0.7
        if case.kind == "probe":
            v += 2.0 + 2.0 * torch.randn(b, hkv, 1, d, generator=g).abs()
    if case.key_mask:  # the padding keys hold huge values (they must reach neither the row max nor any scale)
        for bi in range(b):
            pad = case.kv_len - PADDED_KEYS[bi % len(PADDED_KEYS)]
            k[bi, :, pad:] *= PADDING_SCALE
            v[bi, :, pad:] *= PADDING_SCALE
    return tuple(t.to(device=device, dtype=case.dtype) for t in (q, k, v))


def long_tail_inputs(case: Case, g: torch.Generator):
    """FP64 q, k, v whose base-2 scores put, in every row, the max in key 0 and the other keys
    stretch * u below it: 2^u uniform over 2^LONG_TAIL_LOG2, stretch = n / 127 per row.

    q and k are nonzero in one channel per (batch, kv head) only, so INT8 per token is exact (and stays
    so after smooth_k, which shifts each row's scores by one constant); q's n is an integer in
    LONG_TAIL_STRETCH, 127 on every 32nd row, so Q's INT8 per block of 32..128 rows is exact too (K's is
    within 0.06 of the scores, base 2). V is
    1 +- 0.25 on the tail and 0 at key 0 (exact in any V scale; key 0 holds ~85 % of the weight): the
    output is the tail's alone, so a share of the tail's weight lost from P.V shows as that share of rel L1.
    Kernels get the default scale 1/sqrt(D), which is what this builds for."""
    b, hq, hkv, d, nq, nk = case.batch, case.q_heads, case.kv_heads, case.head_dim, case.q_len, case.kv_len
    lo, hi = LONG_TAIL_LOG2
    u = torch.log2(2.0 ** lo + (2.0 ** hi - 2.0 ** lo) * torch.rand(b, hkv, nk, generator=g, dtype=torch.float64))
    u[..., 0] = 0.0
    n_lo, n_hi = LONG_TAIL_STRETCH
    n = torch.randint(n_lo, n_hi + 1, (b, hq, nq), generator=g).double()
    n[..., ::32] = n_hi
    unit = n_hi * quant.qk_multiplier(quant.default_sm_scale(d))  # score of q = 127, k = 1, in base 2
    channel = torch.randint(0, d, (b, hkv), generator=g)
    q = torch.zeros(b, hq, nq, d, dtype=torch.float64)
    k = torch.zeros(b, hkv, nk, d, dtype=torch.float64)
    group = hq // hkv
    for bi in range(b):
        for h in range(hkv):
            c = int(channel[bi, h])
            k[bi, h, :, c] = 1.5 - u[bi, h] / unit  # key 0 at 1.5, the tail within (0.1, 1.2) for D 64..256
            q[bi, h * group:(h + 1) * group, :, c] = n[bi, h * group:(h + 1) * group]
    v = 1.0 + 0.25 * (2.0 * torch.rand(b, hkv, nk, d, generator=g, dtype=torch.float64) - 1.0)
    v[:, :, 0] = 0.0
    return q, k, v


def diagonal_inputs(case: Case, g: torch.Generator):
    """q, k, v (FP32) where query i's best key is key i + 1 and its next best key i, by a wide margin (DIAGONAL_GAP).

    Causal, each row then all but copies v_i: a causal mask one key late (row i sees key i + 1) or one early (row i
    misses key i) gives every row another key's V, and a dropped key j leaves row j (and with it its query block)
    without its V. Keys are random directions of norm sqrt(D); the rest of each row's keys lie >= DIAGONAL_GAP below
    key i at the default scale (1/sqrt(D))."""
    b, hq, hkv, d, nq, nk = case.batch, case.q_heads, case.kv_heads, case.head_dim, case.q_len, case.kv_len
    k = torch.randn(b, hkv, nk, d, generator=g)
    k = k / k.norm(dim=-1, keepdim=True) * math.sqrt(d)
    nxt = torch.cat([k[:, :, 1:], torch.zeros_like(k[:, :, :1])], dim=2)  # the last key has no next key
    # score(i, i) = a * sqrt(D), score(i, i + 1) = 1.5 * a * sqrt(D) at scale 1/sqrt(D)
    a = DIAGONAL_SCORE / math.sqrt(d)
    q = a * (k[:, :, :nq] + 1.5 * nxt[:, :, :nq])
    q = q.repeat_interleave(hq // hkv, dim=1) + 0.1 * torch.randn(b, hq, nq, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    return q, k, v


@dataclass
class CaseResult:
    case: Case
    reason: Optional[str]  # None: passed
    worst_rel_l1: float = math.nan  # worst over (batch, head) and, for long cases, query blocks
    worst_cosine: float = math.nan
    lse_error: Optional[float] = None
    seconds: float = 0.0
    gain_error: float = math.nan  # worst |sum(o.e) / sum(e.e) - 1| over (batch, head)
    worst_row_rel_l1: float = math.nan  # worst rel L1 of one query row
    lse_bias: Optional[float] = None  # worst |mean LSE error| over (batch, head)


@dataclass
class SelfCheckResult:
    reason: Optional[str]
    results: List[CaseResult] = field(default_factory=list)
    skipped: List[Case] = field(default_factory=list)
    seconds: float = 0.0
    warm_up: object = None  # what the attention's warm_up returned (the Triton backends: precompile.WarmUp)

    @property
    def passed(self) -> bool:
        return self.reason is None


def _block_sums(out: torch.Tensor, exact: torch.Tensor, rows: int):
    """Per (batch, head, query block of `rows`): sum|o-e|, sum|e|, sum o*e, sum o^2, sum e^2 in FP64."""
    b, h, n, d = exact.shape
    nb = max(1, math.ceil(n / rows))
    pad = nb * rows - n
    o, e = out.double(), exact.double()
    if pad:
        o = torch.nn.functional.pad(o, (0, 0, 0, pad))
        e = torch.nn.functional.pad(e, (0, 0, 0, pad))
    o, e = o.reshape(b, h, nb, rows * d), e.reshape(b, h, nb, rows * d)
    return torch.stack([(o - e).abs().sum(-1), e.abs().sum(-1), (o * e).sum(-1), (o * o).sum(-1),
                        (e * e).sum(-1)]).cpu()


def _rel_cos(s: torch.Tensor):
    diff, mag, dot, oo, ee = s
    rel = torch.where(mag > 0, diff / mag.clamp_min(1e-300), diff)
    denom = (oo * ee).sqrt()
    cos = torch.where(denom > 0, dot / denom.clamp_min(1e-300), (oo == ee).double())
    return rel, cos


def _first_violation(rel: torch.Tensor, cos: torch.Tensor, bound: Bound) -> Optional[Tuple[Tuple[int, ...], str]]:
    """Index and text of the worst violation in `rel`/`cos` (same shape), or None."""
    bad_rel = rel > bound.max_rel_l1
    bad_cos = (cos < bound.min_cosine) if bound.min_cosine is not None else torch.zeros_like(bad_rel)
    if bound.min_cosine is not None and bool(bad_cos.any()):
        idx = tuple(int(i) for i in torch.nonzero(cos == cos[bad_cos].min())[0])
        return idx, (f"cosine {float(cos[idx]):.4f} < {bound.min_cosine} "
                     f"(rel L1 {float(rel[idx]):.4f}, max {bound.max_rel_l1})")
    if bool(bad_rel.any()):
        idx = tuple(int(i) for i in torch.nonzero(rel == rel[bad_rel].max())[0])
        return idx, f"rel L1 {float(rel[idx]):.4f} > {bound.max_rel_l1}"
    return None


def _where(case: Case, b: int, h: int, block: Optional[int] = None) -> str:
    kv = f" (kv head {h // (case.q_heads // case.kv_heads)})" if case.gqa else ""
    text = f"batch {b}, head {h}{kv}"
    if block is not None:
        r0 = block * QUERY_BLOCK
        text += f", query block {block} (rows {r0}-{min(case.q_len, r0 + QUERY_BLOCK) - 1})"
    return text


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a failed allocation: the device's state at that moment, no verdict on the kernel."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_case(attention: Callable, case: Case, device, inputs=None, mask=None):
    """(out, lse or None) of `attention` on the case's inputs (`make_inputs` and `padding_mask` unless given)."""
    q, k, v = inputs if inputs is not None else make_inputs(case, device)
    extra = {} if case.scale is None else {"scale": case.scale}
    if case.key_mask:
        extra["attn_mask"] = mask if mask is not None else padding_mask(case, device)
    if case.return_lse:
        got = attention(q, k, v, is_causal=case.is_causal, return_lse=True, **extra)
        return got if isinstance(got, tuple) else (got, None)
    got = attention(q, k, v, is_causal=case.is_causal, **extra)
    return (got[0] if isinstance(got, tuple) else got), None


def call_each(attention: Callable, cases: Sequence[Case], device) -> None:
    """Each case called once, any failure left for its check to judge (a warm-up's pass: run_self_check)."""
    for case in cases:
        try:
            call_case(attention, case, device)
        except Exception:  # noqa: BLE001  (check_case calls it again and gives the verdict)
            pass


def check_case(attention: Callable, case: Case, device, bounds: Optional["CaseBounds"] = None) -> CaseResult:
    """Run one case and judge it against `bounds` (default: the accurate variant's); the result's reason is None
    when it passed. Every figure is measured before any is judged (tools/self_check_calibration.py reads them)."""
    device = torch.device(device)
    bounds = bounds or bounds_for(None)
    t0 = time.perf_counter()
    label = f"case {case.label()}"

    def done(reason, **kw):
        return CaseResult(case, reason, seconds=time.perf_counter() - t0, **kw)

    q, k, v = make_inputs(case, device)
    mask = padding_mask(case, device) if case.key_mask else None

    def call():
        return call_case(attention, case, device, (q, k, v), mask)

    try:
        out, lse = call()
        _sync(device)
        # The same call again: a backend's later calls may take another host path than its first (the Triton
        # backend's direct launches and kept buffers, kernels/backends/triton), and they must give the same bits.
        again, _ = call()
        _sync(device)
    except Exception as exc:  # any failure of the kernel path is a verdict, not a crash
        if out_of_memory(exc):
            raise  # but memory that ran out says nothing of the kernel: gating.Verdicts.ensure tries again later
        return done(f"{label}: raised {type(exc).__name__}: {exc}")
    want_shape = (case.batch, case.q_heads, case.q_len, case.head_dim)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want_shape or out.dtype != case.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        return done(f"{label}: output {got}, expected {want_shape} {case.dtype}")
    if out.device != q.device:
        return done(f"{label}: output on {out.device}, expected {q.device}")
    finite = torch.isfinite(out)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite)[0].tolist()
        where = _where(case, bad[0], bad[1], bad[2] // QUERY_BLOCK)
        return done(f"{label}: output has NaN/Inf ({where}, row {bad[2]})")
    if not isinstance(again, torch.Tensor) or again.shape != out.shape or not torch.equal(again, out):
        return done(f"{label}: the same call a second time gave a different output")
    exact, exact_lse = exact_attention(q, k, v, is_causal=case.is_causal, sm_scale=case.scale,
                                       return_lse=case.return_lse, attn_mask=mask)
    sums = _block_sums(out.float(), exact, QUERY_BLOCK)
    rel_bh, cos_bh = _rel_cos(sums.sum(-1))  # per (batch, head)
    rel_blk, cos_blk = _rel_cos(sums)  # per (batch, head, query block)
    rel_row, _ = _rel_cos(_block_sums(out.float(), exact, 1))  # per (batch, head, query row)
    diff, mag, dot, oo, ee = sums.sum(-1)
    gain_err = torch.where(ee > 0, dot / ee.clamp_min(1e-300) - 1, torch.where(oo > 0, math.inf, 0.0)).abs()
    worst = dict(worst_rel_l1=float(rel_blk.max() if case.per_block else rel_bh.max()),
                 worst_cosine=float(cos_blk.min() if case.per_block else cos_bh.min()),
                 gain_error=float(gain_err.max()), worst_row_rel_l1=float(rel_row.max()))
    lse_err = lse_mean = None
    if case.return_lse:
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != want_shape[:3]:
            return done(f"{label}: LSE missing or of shape {None if lse is None else tuple(lse.shape)}, "
                        f"expected {want_shape[:3]}", **worst)
        got, want = lse.double().cpu(), exact_lse.double().cpu()
        signed = torch.where((got == want) & torch.isinf(want), torch.zeros_like(got), got - want)  # both -inf: agree
        signed = torch.where(torch.isnan(signed), torch.full_like(signed, math.inf), signed)
        lse_err, lse_mean = signed.abs(), signed.mean(-1).abs()  # per row; per (batch, head)
        worst.update(lse_error=float(lse_err.max()), lse_bias=float(lse_mean.max()))
    bound = bounds.case[case.kind]
    # Query blocks first where there are several (the reason then names the block), then each (batch, head).
    if case.per_block:
        hit = _first_violation(rel_blk, cos_blk, bound)
        if hit:
            (b, h, blk), text = hit
            return done(f"{label}: {_where(case, b, h, blk)}: {text} against exact FP32", **worst)
    hit = _first_violation(rel_bh, cos_bh, bound)
    if hit:
        (b, h), text = hit
        return done(f"{label}: {_where(case, b, h)}: {text} against exact FP32", **worst)
    if bound.max_row_rel_l1 is not None and worst["worst_row_rel_l1"] > bound.max_row_rel_l1:
        b, h, r = torch.nonzero(rel_row == rel_row.max())[0].tolist()
        return done(f"{label}: {_where(case, b, h, r // QUERY_BLOCK)}: row {r}: rel L1 {float(rel_row.max()):.4f} > "
                    f"{bound.max_row_rel_l1} against exact FP32", **worst)
    if bound.max_gain_error is not None and not worst["gain_error"] <= bound.max_gain_error:
        b, h = torch.nonzero(gain_err == gain_err.max())[0].tolist()
        gain = float(dot[b, h] / ee[b, h]) if float(ee[b, h]) > 0 else math.inf
        return done(f"{label}: {_where(case, b, h)}: output scale {gain:.4f} x exact (least squares; allowed "
                    f"1 +- {bound.max_gain_error}) against exact FP32", **worst)
    if case.return_lse:
        if not worst["lse_error"] <= bounds.max_lse_error:
            b, h, r = torch.nonzero(lse_err == lse_err.max())[0].tolist()
            return done(f"{label}: {_where(case, b, h, r // QUERY_BLOCK)}: LSE off by {worst['lse_error']:.4f} at "
                        f"row {r} (max {bounds.max_lse_error})", **worst)
        if not worst["lse_bias"] <= bounds.max_lse_bias:
            b, h = torch.nonzero(lse_mean == lse_mean.max())[0].tolist()
            return done(f"{label}: {_where(case, b, h)}: LSE off by {float(signed[b, h].mean()):+.4f} on average "
                        f"over the rows (max {bounds.max_lse_bias})", **worst)
    return done(None, **worst)


def runnable_cases(attention: Callable, cases: Sequence[Case] = DEFAULT_CASES,
                   accepts: Optional[Callable[[Case], bool]] = None) -> Tuple[List[Case], List[Case]]:
    """(the cases `run_self_check` runs, those it skips). `accepts`: as there. A GQA case the callable declines
    runs with as many kv heads as q heads instead."""
    accepts = accepts or getattr(attention, "accepts", None) or default_accepts
    to_run, skipped = [], []
    for case in cases:
        if not accepts(case) and case.gqa and accepts(replace(case, kv_heads=case.q_heads)):
            case = replace(case, kv_heads=case.q_heads)  # GQA declined: the same case with one kv head per q head
        (to_run if accepts(case) else skipped).append(case)
    return to_run, skipped


def run_self_check(attention: Callable, device, cases: Sequence[Case] = DEFAULT_CASES,
                   accepts: Optional[Callable[[Case], bool]] = None, stop_at_first: bool = True,
                   variant: Optional["Variant"] = None) -> SelfCheckResult:
    """Run every case `accepts` takes (default: the `accepts` that `attention` carries, else `default_accepts`); the
    first failure is the verdict. The bounds are `variant`'s (`bounds_for`); without one, those of the variant
    `attention` carries (`backend_attention` sets it), else the accurate options'.

    A GQA case the callable declines runs with as many kv heads as q heads instead. Running out of memory
    (`out_of_memory`) is no verdict: it is raised."""
    device = torch.device(device)
    bounds = bounds_for(variant if variant is not None else getattr(attention, "variant", None))
    t0 = time.perf_counter()
    result = SelfCheckResult(None)
    to_run, result.skipped = runnable_cases(attention, cases, accepts)
    warm_up = getattr(attention, "warm_up", None)
    if warm_up is not None and to_run:
        # Each case called once, for the kernels it needs (a Triton backend compiles them side by side first).
        result.warm_up = warm_up(lambda: call_each(attention, to_run, device))
    for case in to_run:
        r = check_case(attention, case, device, bounds)
        result.results.append(r)
        if r.reason and result.reason is None:
            result.reason = r.reason
            if stop_at_first:
                break
    if not result.results:
        result.reason = "no case of the self-check is accepted"
    result.seconds = time.perf_counter() - t0
    return result


def self_check(attention: Callable, device, *, accepts: Optional[Callable[[Case], bool]] = None,
               cases: Sequence[Case] = DEFAULT_CASES) -> Optional[str]:
    """None when `attention` passes every case it accepts on `device`, else the reason of the first failure.

    `attention(q, k, v, is_causal=False)` takes and returns HND tensors (B, H, N, D) on `device` (softmax
    scale 1/sqrt(D)). `accepts(case) -> bool` declines cases the callable cannot take (GQA: `case.gqa`,
    then the case runs without GQA; causal: `case.is_causal`; LSE: `case.return_lse`, then called with
    return_lse=True -> (out, lse)); by default every case but the LSE one runs. An out-of-memory error is
    raised, not judged."""
    return run_self_check(attention, device, cases, accepts).reason


# -- first use of a backend on a device ------------------------------------------------------------------

class Variant(NamedTuple):
    """What, besides the shape, selects the code that serves a call: prologue and quantization options."""
    prologue: str
    qk_group: str
    smooth_k: bool
    smooth_v: bool

    @property
    def accurate(self) -> bool:
        """The options a sound kernel must pass with (per-token INT8, smooth_k on): a failure there is a defect."""
        return self.qk_group == "token" and self.smooth_k

    def describe(self) -> str:
        return (f"{self.prologue} prologue, qk_group {self.qk_group}, smooth_k {'on' if self.smooth_k else 'off'}, "
                f"smooth_v {'on' if self.smooth_v else 'off'}")


def case_call(case: Case, like_call, variant):
    """The call a case makes, described without allocating it on the device (for `refuse`)."""
    from .call_spec import describe_call
    meta = torch.device("meta")
    q = torch.empty(case.batch, case.q_heads, case.q_len, case.head_dim, dtype=case.dtype, device=meta)
    kv = torch.empty(case.batch, case.kv_heads, case.kv_len, case.head_dim, dtype=case.dtype, device=meta)
    mask = torch.empty(case.batch, 1, 1, case.kv_len, dtype=case.dtype, device=meta) if case.key_mask else None
    call = describe_call(q, kv, kv, attn_mask=mask, is_causal=case.is_causal, return_lse=case.return_lse,
                         smooth_k=variant.smooth_k, prologue=variant.prologue, qk_group=variant.qk_group,
                         smooth_v=variant.smooth_v)
    return replace(call, device_type=like_call.device_type, device_index=like_call.device_index,
                   arch=like_call.arch, rocm=like_call.rocm)


def backend_attention(backend, variant: Variant, like_call=None) -> Callable:
    """`attention(q, k, v, is_causal=False, return_lse=False, scale=None)` through `backend.launch` with the variant's
    options (scale None: 1/sqrt(head_dim)). With `like_call` (a call on the device checked) it carries `accepts`:
    the cases the backend takes there, by its own `refuse`, which `run_self_check` runs."""
    from .call_spec import describe_call
    from .refusal import KernelRefused

    def accepts(case: Case) -> bool:
        return backend.refuse(case_call(case, like_call, variant)) is None

    def attention(q, k, v, is_causal=False, return_lse=False, scale=None, attn_mask=None):
        call = describe_call(q, k, v, attn_mask=attn_mask, is_causal=is_causal, return_lse=return_lse,
                             smooth_k=variant.smooth_k, prologue=variant.prologue, qk_group=variant.qk_group,
                             smooth_v=variant.smooth_v)
        reason = backend.refuse(call)
        if reason:
            raise KernelRefused(backend.name, reason)
        out, lse = backend.launch(q, k, v, call, quant.default_sm_scale(q.shape[-1]) if scale is None else scale,
                                  attn_mask)
        return (out, lse) if return_lse else out
    attention.variant = variant  # run_self_check judges it by this variant's bounds
    if like_call is not None:
        attention.accepts = accepts
    if hasattr(backend, "warm_up"):  # run_self_check lets it compile the cases' kernels first (Triton)
        attention.warm_up = backend.warm_up
    return attention
