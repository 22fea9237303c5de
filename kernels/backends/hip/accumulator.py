"""The accumulator probe's operands and its reading: how many fraction bits a WMMA chain's C keeps, and whether it
rounds or truncates what it drops.

The case: `STEPS` chained WMMAs (each D the next C, as a single-chain P.V accumulates), C starting at +-2^16 in
the elements under test. A is diagonal, so each step adds one exact product to element (m, n):
delta = a_m * B[m][n] = +-p * 2^(16 - j), for j in LADDER and p in (1, 3/2). With p = 1 the chain's exact result
2^16 + STEPS * 2^(16 - j) needs j fraction bits: an accumulator keeping N bits gets it exactly for j <= N and
keeps C unchanged from j = N + 1 on (the increment is half a unit of its last bit or less: ties go to the even C).
With p = 3/2 at j = N + 1 each step adds 3/4 of a unit: rounding to nearest moves C up, truncation leaves it.

Expected values come from exact arithmetic (fractions): `exact` is the definition, c0 + STEPS * delta. The reading
(`read`) counts fraction bits along the p = 1 ladder, takes the mode from p = 3/2 one rung above, says whether
every element whose partial sums are all fp32 numbers came out exact ("full FP32", what a single chain needs),
and names the narrowest accumulator model (`chain`: N fraction bits, rounding or truncating, stored as fp32) that
predicts every element. Nothing here has run on RDNA4 hardware.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, Optional, Tuple

import torch

STEPS = 16
C0_EXP = 16
LADDER = tuple(range(6, 29))  # j: an increment of 2^(C0_EXP - j); e4m3 products reach down to 2^-12
PATTERNS = (Fraction(1), Fraction(3, 2))
FP32_BITS = 23
NEAREST, TRUNCATE = "rounds to nearest", "truncates"
MODELS = tuple((bits, mode) for bits in range(LADDER[0] - 1, FP32_BITS + 4) for mode in (NEAREST, TRUNCATE))


@dataclass(frozen=True)
class Element:
    row: int
    col: int
    sign: int      # +1 or -1: C and the increment share it
    j: int
    p: Fraction

    @property
    def c0(self) -> Fraction:
        return Fraction(self.sign * 2 ** C0_EXP)

    @property
    def delta(self) -> Fraction:
        return self.sign * self.p * Fraction(2) ** (C0_EXP - self.j)

    @property
    def exact(self) -> Fraction:
        return self.c0 + STEPS * self.delta


def _layout() -> Tuple[Tuple[Element, ...], Dict[int, int]]:
    """The elements under test (16 per row, j rising along the rows, positive rows 0-2, negative rows 3-5) and
    each row's diagonal A exponent, chosen so that every B entry is a normal e4m3 and f16 number."""
    pairs = [(j, p) for j in LADDER for p in PATTERNS]
    elements, a_exp = [], {}
    for half, sign in enumerate((1, -1)):
        for r in range(math.ceil(len(pairs) / 16)):
            row = 3 * half + r
            chunk = pairs[16 * r:16 * r + 16]
            top = max(C0_EXP - j for j, _ in chunk)
            a_exp[row] = min(8, max(-6, top - 6))
            elements += [Element(row, col, sign, j, p) for col, (j, p) in enumerate(chunk)]
    return tuple(elements), a_exp


ELEMENTS, ROW_A_EXP = _layout()


def operands() -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, B, C0) as fp32 16x16 values: A diagonal, B[m][n] = delta / a_m, C0 = +-2^16 under test, 0 elsewhere."""
    a, b, c = torch.zeros(16, 16), torch.zeros(16, 16), torch.zeros(16, 16)
    for row, e in ROW_A_EXP.items():
        a[row, row] = 2.0 ** e
    for el in ELEMENTS:
        b[el.row, el.col] = float(el.delta / Fraction(2) ** ROW_A_EXP[el.row])
        c[el.row, el.col] = float(el.c0)
    return a, b, c


# ------------------------------------------------------------------------------------------ exact models
def _lead(x: Fraction) -> int:
    """Exponent of the leading bit of x != 0."""
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    return e - 1 if x < Fraction(2) ** e else e


def round_bits(x: Fraction, bits: int, mode: str) -> Fraction:
    """x rounded to `bits` fraction bits below its leading bit: to nearest (ties to even) or toward zero."""
    if x == 0:
        return x
    unit = Fraction(2) ** (_lead(x) - bits)
    q = x / unit
    return (round(q) if mode == NEAREST else math.trunc(q)) * unit


def chain(el: Element, bits: int, mode: str, steps: int = STEPS) -> Fraction:
    """The chain's result on an accumulator that keeps `bits` fraction bits, rounding or truncating each step's
    exact sum, and stores C as fp32 between steps (round to nearest even)."""
    c = el.c0
    for _ in range(steps):
        c = round_bits(round_bits(c + el.delta, bits, mode), FP32_BITS, NEAREST)
    return c


def fp32_exact(el: Element) -> bool:
    """Every partial sum of the chain is an fp32 number: any fp32 accumulator, however it rounds, is exact."""
    return all(round_bits(el.c0 + k * el.delta, FP32_BITS, NEAREST) == el.c0 + k * el.delta
               for k in range(1, STEPS + 1))


def model_output(bits: int, mode: str) -> torch.Tensor:
    """D (16x16 fp32) that an accumulator of `bits` fraction bits (rounding or truncating) gives."""
    return _model_output(bits, mode).clone()


@functools.lru_cache(maxsize=None)
def _model_output(bits: int, mode: str) -> torch.Tensor:
    d = torch.zeros(16, 16, dtype=torch.float64)
    for el in ELEMENTS:
        d[el.row, el.col] = float(chain(el, bits, mode))
    return d.float()


# ------------------------------------------------------------------------------------------ the reading
@dataclass(frozen=True)
class Reading:
    bits: Optional[int]            # fraction bits kept along the ladder (LADDER[0] - 1: fewer than LADDER[0])
    mode: Optional[str]            # NEAREST, TRUNCATE, or None where no rung above `bits` says
    full_fp32: bool                # every fp32-exact chain exact, nothing outside the tested elements
    models: Tuple[Tuple[int, str], ...]  # the narrowest exact model that predicts every element, if one does
    problems: Tuple[str, ...]      # elements off every model (first few), non-finite results

    def text(self) -> str:
        if self.bits is None:
            return "unreadable: " + "; ".join(self.problems)
        bits = (f"fewer than {LADDER[0]}" if self.bits < LADDER[0] else
                f"{self.bits} or more" if self.bits >= LADDER[-1] else str(self.bits))
        parts = [f"{bits} fraction bits kept across {STEPS} chained WMMAs", self.mode or "rounding not read"]
        parts.append("full FP32" if self.full_fp32 else "not full FP32")
        if self.models:
            b, m = self.models[0]
            parts.append(f"as a {b}-bit accumulator that {m}")
        else:
            parts.append("no N-bit model predicts every element: " + "; ".join(self.problems))
        return ", ".join(parts)


def read(d: torch.Tensor) -> Reading:
    """The reading of the chain's D (16x16 fp32, as the probe returns it)."""
    d = d.float()
    if not bool(torch.isfinite(d).all()):
        bad = int((~torch.isfinite(d)).sum())
        return Reading(None, None, False, (), (f"{bad} of 256 elements are not finite",))
    got = {(el.row, el.col): Fraction(float(d[el.row, el.col])) for el in ELEMENTS}
    tested = torch.zeros(16, 16, dtype=torch.bool)
    for el in ELEMENTS:
        tested[el.row, el.col] = True
    stray = int((d[~tested] != 0).sum())
    problems = [f"{stray} untested elements are not 0"] if stray else []
    bits = LADDER[-1]
    for el in ELEMENTS:
        if el.p == 1 and got[el.row, el.col] != el.exact:
            bits = min(bits, el.j - 1)
    rung = [el for el in ELEMENTS if el.p == PATTERNS[1] and el.j == bits + 1]
    mode = None
    if rung:
        moved = {abs(got[el.row, el.col]) > abs(el.c0) for el in rung}
        kept = {got[el.row, el.col] == el.c0 for el in rung}
        mode = NEAREST if moved == {True} else TRUNCATE if kept == {True} else None
    full = not stray and all(got[el.row, el.col] == el.exact for el in ELEMENTS if fp32_exact(el))
    # The narrowest model that predicts every element (a model of fewer bits than the ladder read fails a rung that
    # came out exact, so only wider ones are tried; the first match ends the search: first use pays for few).
    match = None if stray else next((m for m in MODELS if bits <= m[0] <= bits + 3
                                     and torch.equal(_model_output(*m), d)), None)
    models = (match,) if match else ()
    if not models:
        near = _model_output(bits, mode or TRUNCATE)
        diff = [(el, float(near[el.row, el.col])) for el in ELEMENTS
                if Fraction(float(near[el.row, el.col])) != got[el.row, el.col]]
        problems += [f"D[{el.row}][{el.col}] (j {el.j}, p {el.p}) = {float(got[el.row, el.col])!r}, the "
                     f"{bits}-bit model {want!r}" for el, want in diff[:3]]
    return Reading(bits, mode, full, models, tuple(problems))
