"""An exact oracle of the spec's per-row op, in Python integers and fractions: the sum of
squares with no floating-point addition at all, then steps 2-7 one correctly rounded
float32 operation at a time (NumPy's float32 arithmetic and ml_dtypes' conversions are
IEEE operations, rounded once each).

It covers the default keywords (per-row float32 scales, ``float8_e4m3fn``, no
``scale_ub``) and ``weight_offset``, which is all it needs: the other keywords only change
steps 4-7, which the rest of the suite holds to the reference bit for bit.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np

FP8_MAX = np.float32(448.0)
_F32_MIN_EXPONENT = -126
_F32_MANTISSA_BITS = 23


def exact_sum_of_squares(row) -> Fraction:
    """The exact sum of the exact squares of a float32 row (any float dtype, widened to
    float32 exactly). Squares below 2^-126 count as zero, as the spec lets every
    implementation flush them. Integers only: a finite float32 is m * 2^e with an integer
    m below 2^24, so its square is m^2 * 2^(2e); the squares of each exponent are summed
    as integers, and those sums shifted onto one grid."""
    bits = np.asarray(row, np.float32).reshape(-1).view(np.uint32).astype(np.int64)
    biased = (bits >> 23) & 0xFF
    if np.any(biased == 0xFF):
        raise ValueError("the oracle takes finite rows only")
    significand = (bits & 0x7FFFFF) | 0x800000
    exponent = biased - 150  # value = significand * 2^exponent for a normal float32
    counted = biased >= 64  # |x| >= 2^-63: the square is at least 2^-126
    total = Fraction(0)
    for e in np.unique(exponent[counted]).tolist():
        m = significand[counted & (exponent == e)]
        high, low = m >> 12, m & 0xFFF  # m^2 = high^2 2^24 + 2 high low 2^12 + low^2
        integer = (
            (int(np.sum(high * high)) << 24)
            + (int(np.sum(2 * high * low)) << 12)
            + int(np.sum(low * low))
        )
        total += integer * Fraction(2) ** (2 * e)
    return total


def nearest_float32(value: Fraction) -> Fraction:
    """``value`` rounded to the nearest float32, ties to even; +-inf past the largest."""
    if value == 0:
        return Fraction(0)
    sign = -1 if value < 0 else 1
    magnitude = abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    ulp = Fraction(2) ** (max(exponent, _F32_MIN_EXPONENT) - _F32_MANTISSA_BITS)
    units, remainder = divmod(magnitude, ulp)
    if remainder > ulp / 2 or (remainder == ulp / 2 and units % 2 == 1):
        units += 1
    rounded = units * ulp
    if rounded >= Fraction(2) ** 128:
        return Fraction(sign) * Fraction(10) ** 400  # stands for inf; see as_float32
    return sign * rounded


def as_float32(value: Fraction) -> np.float32:
    if abs(value) > Fraction(2) ** 128:
        return np.float32(np.inf if value > 0 else -np.inf)
    return np.float32(float(value))  # exact: value is a float32


def spec_sum_of_squares(row) -> np.float32:
    """The spec's ``ss``: the float32 nearest to the exact sum, except that a sum within 2^-26
    of an ulp of a rounding tie rounds as the tie would (docs/spec.md, "The sum of
    squares"): ``RN(s + RN(S - s))`` with ``s = RN(S)``."""
    exact = exact_sum_of_squares(row)
    s = nearest_float32(exact)
    if abs(s) > Fraction(2) ** 128:  # overflows float32 (nearest_float32's stand-in)
        return np.float32(np.inf)
    return as_float32(nearest_float32(s + nearest_float32(exact - s)))


def correctly_rounded_sum_of_squares(row) -> np.float32:
    """The float32 nearest to the exact sum, with no exception for near-ties."""
    return as_float32(nearest_float32(exact_sum_of_squares(row)))


def distance_to_tie(row) -> Fraction:
    """How far the exact sum lies from the nearest float32 rounding tie, in ulps of its
    rounded value (0.5 means exactly on a float32)."""
    exact = exact_sum_of_squares(row)
    s = nearest_float32(exact)
    if s == 0:
        return Fraction(1, 2)
    exponent = abs(s).numerator.bit_length() - abs(s).denominator.bit_length()
    if Fraction(2) ** exponent > abs(s):
        exponent -= 1
    ulp = Fraction(2) ** (max(exponent, _F32_MIN_EXPONENT) - _F32_MANTISSA_BITS)
    return abs(abs(exact - s) - ulp / 2) / ulp


# (significand bits, smallest normal exponent) of the input dtypes.
_FORMATS = {"float32": (24, -126), "float16": (11, -14), "bfloat16": (8, -126)}


def nearest_in_dtype(value: float, dtype) -> np.float32:
    """``value`` (a Python float, exactly) rounded once to the nearest ``dtype`` value (float32,
    float16 or bfloat16), ties to even, as a float32: the spec's ``f32(T(v))``. Fractions
    only, no conversion of NumPy's or ml_dtypes'; finite results only."""
    bits, min_exponent = _FORMATS[np.dtype(dtype).name]
    exact = Fraction(value)
    if exact == 0:
        return np.float32(value)  # keeps the sign of a zero
    magnitude = abs(exact)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    ulp = Fraction(2) ** (max(exponent, min_exponent) - (bits - 1))
    units, remainder = divmod(magnitude, ulp)
    if remainder > ulp / 2 or (remainder == ulp / 2 and units % 2 == 1):
        units += 1
    return np.float32(float(units * ulp) * (1 if exact > 0 else -1))


def inverse_rms(ss: np.float32, n: int, eps32: np.float32) -> np.float32:
    """The spec's ``r`` of a row of ``n`` elements from its sum of squares ``ss`` (the
    oracle's, spec_sum_of_squares): the quiet NaN 0x7FC00000 when the sum is not finite, 0
    when ``ss / N + eps`` is 0."""
    if not np.isfinite(ss):
        return np.float32(np.nan)
    denom = np.float32(ss / np.float32(n)) + eps32
    return np.float32(0) if denom == 0 else np.float32(1) / np.sqrt(denom)


def rms_norm_rows(
    x, gamma, eps: float = 1e-6, weight_offset: float = 0.0, offset_dtype=None
) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-7 of the spec for rows of ``x`` [R, N] of finite values with the default
    keywords (and any ``weight_offset``), from the oracle's sum of squares: (y as
    float8_e4m3fn, scales as float32 [R, 1]); a row whose sum of squares overflows float32
    is NaN. ``offset_dtype`` (default: x's, as the spec says) is the dtype the
    offset is rounded through, for tests that show what another rounding would change."""
    x = np.asarray(x)
    eps32 = np.float32(np.asarray(eps, x.dtype))
    x32 = x.astype(np.float32)
    # Step 1: f32(T(weight_offset)).
    wo32 = nearest_in_dtype(weight_offset, x.dtype if offset_dtype is None else offset_dtype)
    g32 = np.asarray(gamma).astype(np.float32) + wo32
    ys, scales = [], []
    for row in x32:
        r = inverse_rms(spec_sum_of_squares(row), row.size, eps32)
        if np.isnan(r):  # a sum of squares past float32: a NaN row (step 7)
            ys.append(np.full(row.shape, np.nan, np.float32).astype(ml_dtypes.float8_e4m3fn))
            scales.append(np.float32(np.nan))
            continue
        n = (row * r) * g32
        scale = np.float32(np.max(np.abs(n), initial=np.float32(0)) / FP8_MAX)
        with np.errstate(divide="ignore"):
            inverse = np.float32(1) / scale
        recip = inverse if scale != 0 and np.isfinite(inverse) else np.float32(0)
        q = np.clip(n * recip, -FP8_MAX, FP8_MAX)
        ys.append(q.astype(ml_dtypes.float8_e4m3fn))
        scales.append(scale)
    return np.stack(ys), np.asarray(scales, np.float32)[:, None]


def flushed(values) -> np.ndarray:
    """float32 ``values`` with every magnitude at most 2^-126 a zero of its sign: the
    backward's rule for inputs and results."""
    v = np.asarray(values, np.float32)
    return np.where(np.abs(v) <= np.float32(2.0**-126), np.copysign(np.float32(0), v), v)


def backward_sum(terms) -> np.float32:
    """The spec's sum of the backward's float32 ``terms``: the float32 nearest to their exact
    sum (ties to even, the exponent range unbounded), a term below 2^-126 counting as zero,
    +0 below 2^-126 and for an exact zero; NaN and infinities as the spec says. Python
    integers and fractions only."""
    terms = np.asarray(terms, np.float32).reshape(-1)
    nan = np.isnan(terms).any()
    plus, minus = (terms == np.inf).any(), (terms == -np.inf).any()
    if nan or (plus and minus):
        return np.float32(np.nan)
    if plus or minus:
        return np.float32(np.inf if plus else -np.inf)
    # Every float32 is an integer multiple of 2^-149: the terms on that grid, as integers
    # (exact in float64, whose exponent reaches 2^277), summed exactly.
    kept = terms[np.abs(terms) >= np.float32(2.0**-126)].astype(np.float64)
    total = Fraction(sum(int(v) for v in np.ldexp(kept, 149).tolist()), 2**149)
    if total == 0:
        return np.float32(0)
    magnitude = abs(total)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    ulp = Fraction(2) ** (exponent - _F32_MANTISSA_BITS)  # 24 bits whatever the exponent
    units, remainder = divmod(magnitude, ulp)
    if remainder > ulp / 2 or (remainder == ulp / 2 and units % 2 == 1):
        units += 1
    rounded = units * ulp
    if rounded >= Fraction(2) ** 128:
        return np.float32(np.inf if total > 0 else -np.inf)
    if rounded < Fraction(2) ** _F32_MIN_EXPONENT:
        return np.float32(0)
    return np.float32(float(rounded) * (1 if total > 0 else -1))


def backward_rows(dn, x, gamma, r, weight_offset: float = 0.0):
    """The spec's backward for float32 rows, one IEEE float32 operation at a time (NumPy's),
    each input and result flushed, the sums by :func:`backward_sum`: (dx, dgamma)."""
    f = flushed
    dn, x = f(dn), f(x)
    g = f(f(np.asarray(gamma, np.float32)) + np.float32(weight_offset))
    r = f(np.asarray(r, np.float32).reshape(-1, 1))
    n = x.shape[-1]
    with np.errstate(invalid="ignore", over="ignore"):
        return _backward_rows(dn, x, g, r, n)


def _backward_rows(dn, x, g, r, n):
    f = flushed
    u = f(x * r)
    a = f(dn * g)
    c = np.array([backward_sum(row) for row in f(a * u)], np.float32)[:, None]
    c_over_n = f(c / np.float32(n))
    dx = f(r * f(a - f(u * c_over_n)))
    dx = np.where(np.isnan(dx), np.float32(np.nan), dx)  # the one quiet NaN
    dgamma = np.array([backward_sum(column) for column in f(dn * u).T], np.float32)
    return dx, dgamma
