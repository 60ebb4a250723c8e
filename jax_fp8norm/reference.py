"""Pure-jnp twins of the kernels: the same signatures and the same math (docs/spec.md).

They are the references the tests hold the kernels to, and a readable statement of what
the kernels compute. They run anywhere jax runs, but are two or more XLA fusions where
the kernels are one pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._validation import (
    DEFAULT_EPS,
    E8M0,
    NormParams,
    check_axis_name,
    check_reduce_dtype,
    norm_keywords,
    validate,
)

__all__ = [
    "DEFAULT_EPS",
    "add_rms_norm_fp8",
    "all_reduce",
    "allreduce_residual_rms_norm_fp8",
    "dequantize",
    "quantize_rows",
    "rms_norm_fp8",
    "sum_of_squares",
]


def _divide(numerator: jax.Array, denominator) -> jax.Array:
    """``numerator / denominator`` rounded once, as the spec says. XLA's simplifier turns a
    division by a constant into a multiplication by its rounded reciprocal, and
    ``1 / sqrt`` into an approximate rsqrt; a barrier keeps the divisor opaque to it."""
    denominator = jnp.broadcast_to(jnp.asarray(denominator, numerator.dtype), numerator.shape)
    return numerator / jax.lax.optimization_barrier(denominator)


def _round_through(value: jax.Array, dtype) -> jax.Array:
    """float32 ``value`` rounded to ``dtype`` (float32, float16 or bfloat16; nearest, ties
    to even, overflow to +-inf, NaN kept), as float32.

    Spelled out in integer and power-of-two arithmetic rather than as a float32 -> 16-bit
    -> float32 round trip of converts. XLA may drop such a round trip as excess precision
    (xla_allow_excess_precision), and jaxlib 0.10.2's CPU backend skips it in a fused
    reduction: a max over rows followed by the converts, run as a "ynn_fusion", returns
    the unrounded values although the converts are still in the optimised HLO."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return value
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(value, u32)
    # Normal range: drop the low mantissa bits, rounding to nearest even on the integer.
    dropped = 16 if dtype == np.dtype(jnp.bfloat16) else 13
    half = u32((1 << (dropped - 1)) - 1)
    odd = (bits >> dropped) & u32(1)
    rounded_bits = (bits + half + odd) & ~u32((1 << dropped) - 1)
    rounded = jax.lax.bitcast_convert_type(rounded_bits, jnp.float32)
    if dtype == np.dtype(jnp.float16):
        # float16's subnormals are multiples of 2^-24; its largest finite value is 65504.
        subnormal = jax.lax.round(value * 2.0**24, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
        rounded = jnp.where(jnp.abs(value) < 2.0**-14, subnormal * 2.0**-24, rounded)
        rounded = jnp.where(jnp.abs(rounded) > 65504.0, jnp.copysign(jnp.inf, value), rounded)
    return jnp.where(jnp.isnan(value), value, rounded)


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    s = a + b
    b_virtual = s - a
    return s, (a - (s - b_virtual)) + (b - b_virtual)


def sum_of_squares(h: jax.Array) -> jax.Array:
    """``sum(h * h)`` over the last axis of float32 ``h``, keeping every rounding error
    (Dekker's exact square, TwoSum) in a second float32: the correctly rounded float32
    sum in all but vanishingly rare near-tie cases, as the kernels compute it
    (src/fp8norm_math.h, SumOfSquares). Returns shape ``h.shape[:-1] + (1,)``."""
    f32 = jnp.float32
    square = h * h
    c = f32(4097) * h
    high = c - (c - h)
    low = h - high
    square_error = ((high * high - square) + f32(2) * high * low) + low * low

    def combine(a, b):
        s, e = _two_sum(a[0], b[0])
        return s, (a[1] + b[1]) + e

    hi, lo = jax.lax.reduce((square, square_error), (f32(0), f32(0)), combine, (h.ndim - 1,))
    return (hi + lo)[..., None]


def _bits(value: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(value, jnp.uint32)


def _float(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _nearest_scales(amax: jax.Array, p: NormParams) -> tuple[jax.Array, jax.Array]:
    """Steps 5-6 with nearest rounding: (scale as float32, recip)."""
    f32 = jnp.float32
    bounded = jnp.minimum(_round_through(amax, p.scale_dtype), f32(p.scale_ub))
    scale32 = _round_through(_divide(bounded, p.fp8_max), p.scale_dtype)
    inverse = _divide(jnp.ones_like(scale32), scale32)
    recip = jnp.where((scale32 == 0) | ~jnp.isfinite(inverse), f32(0), inverse)
    return scale32, recip


def _power_of_two_exponents(amax: jax.Array, p: NormParams) -> tuple[jax.Array, jax.Array]:
    """Steps 5-6 with power-of-two scales: (the scales' biased float32 exponents, recip).
    P(q) is the smallest power of two >= q = min(amax, scale_ub) / FP8_MAX, at least 2^-127
    for e8m0 and 2^-126 otherwise; a q below 2^-126 is decided from the abs-max, so that
    denormal flushing cannot change it (src/common/fp8norm_math.h, PowerOfTwoExponent)."""
    u32 = jnp.uint32
    a = jnp.minimum(amax, jnp.float32(p.scale_ub))
    q = _bits(_divide(a, p.fp8_max))
    exponent = (q >> 23) & u32(0xFF)
    rounded_up = jnp.where(
        (exponent != 0xFF) & ((q & u32(0x7FFFFF)) != 0), exponent + u32(1), exponent
    )
    tiny_limit = np.float32(p.fp8_max) * np.float32(2.0**-127)  # a normal float32
    tiny = jnp.where(a > tiny_limit, u32(1), u32(0))
    exponent = jnp.where(exponent == 0, tiny, rounded_up)
    exponent = jnp.maximum(exponent, u32(0 if p.scale_dtype == E8M0 else 1))
    recip = jnp.where(exponent <= 253, _float((u32(254) - exponent) << 23), jnp.float32(0))
    return exponent, recip


def _static_scales(static_scale: jax.Array, p: NormParams) -> tuple[jax.Array, jax.Array]:
    """The calibrated scale: (scale as float32, recip); recip NaN for a scale that is not
    a positive normal finite float32, 0 where 1 / scale would be subnormal."""
    scale32 = _round_through(static_scale.astype(jnp.float32).reshape(()), p.scale_dtype)
    bits = _bits(scale32)
    valid = (bits >= 0x00800000) & (bits < 0x7F800000)
    inverse = _divide(jnp.ones_like(scale32), scale32)
    recip = jnp.where(_bits(inverse) >= 0x00800000, inverse, jnp.float32(0))
    return scale32, jnp.where(valid, recip, jnp.float32(np.nan))


def quantize_rows(
    h: jax.Array, gamma: jax.Array, p: NormParams, static_scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Steps 2-7 of the spec on float32 rows ``h`` [..., N], with scales per row, per
    group or calibrated (``static_scale``, a float32 (1,) array): returns (y, scales)."""
    f32 = jnp.float32
    n = h.shape[-1]
    groups = p.groups(n)
    rows = h.shape[:-1]
    sum_sq = sum_of_squares(h)  # [..., 1]
    denom = _divide(sum_sq, max(n, 1)) + f32(p.eps)
    r = jnp.where(denom == 0, f32(0), _divide(jnp.ones_like(denom), jnp.sqrt(denom)))
    normed = (h * r) * (gamma.astype(f32) + f32(p.weight_offset))
    grouped = normed.reshape(rows + (groups, n // groups if groups else 0))
    if static_scale is not None:
        scale32, recip = _static_scales(static_scale, p)
        scale32 = jnp.broadcast_to(scale32, rows + (1,))
        recip = jnp.broadcast_to(recip, rows + (1,))
        exponent = None
    else:
        amax = jnp.max(jnp.abs(grouped), axis=-1, initial=f32(0))  # [..., groups]
        if p.power_of_two_scales:
            exponent, recip = _power_of_two_exponents(amax, p)
            scale32 = _float(exponent << 23)
        else:
            scale32, recip = _nearest_scales(amax, p)
            exponent = None
    # The barrier keeps XLA from folding normed * (1 / scale) into normed / scale.
    q = jnp.clip(grouped * jax.lax.optimization_barrier(recip)[..., None], -p.fp8_max, p.fp8_max)
    # A NaN or Inf in the row, or an overflowing sum of squares: the whole row is NaN (and
    # its scales, unless calibrated).
    row_finite = jnp.isfinite(sum_sq)
    q = jnp.where(row_finite[..., None], q, f32(np.nan)).reshape(h.shape)
    if p.scale_dtype == E8M0:
        exponent = jnp.where(row_finite, exponent, jnp.uint32(0xFF)).astype(jnp.uint8)
        scale = jax.lax.bitcast_convert_type(exponent, E8M0)
    else:
        scale = scale32.astype(p.scale_dtype)  # exact: scale32 is a scale_dtype value
        if static_scale is None:
            scale = jnp.where(row_finite, scale, jnp.asarray(np.nan, p.scale_dtype))
    return q.astype(p.out_dtype), scale


@norm_keywords
def rms_norm_fp8(x: jax.Array, gamma: jax.Array, **keywords) -> tuple[jax.Array, jax.Array]:
    """Reference of :func:`jax_fp8norm.rms_norm_fp8`; same arguments and results.

    Keywords:
      {keywords}
    """
    call = validate(x, gamma, **keywords)
    return quantize_rows(
        jnp.asarray(x).astype(jnp.float32), jnp.asarray(gamma), call.params, call.static_scale
    )


@norm_keywords
def add_rms_norm_fp8(
    x: jax.Array, residual: jax.Array, gamma: jax.Array, **keywords
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of :func:`jax_fp8norm.add_rms_norm_fp8`; same arguments and results.

    Keywords:
      {keywords}
    """
    call = validate(x, gamma, residual, **keywords)
    return _add_quantize(jnp.asarray(x), jnp.asarray(residual), jnp.asarray(gamma), call)


def _add_quantize(x, residual, gamma, call):
    """h = x + residual in float32; (y, scales) of the unrounded h; h in residual's dtype."""
    h = x.astype(jnp.float32) + residual.astype(jnp.float32)
    y, scales = quantize_rows(h, gamma, call.params, call.static_scale)
    return y, scales, h.astype(residual.dtype)


@norm_keywords
def allreduce_residual_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    axis_name,
    reduce_dtype=None,
    **keywords,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of :func:`jax_fp8norm.allreduce_residual_rms_norm_fp8`; same arguments.

    Keywords:
      {keywords}
    """
    call = validate(x, gamma, residual, **keywords)
    h = all_reduce(jnp.asarray(x), axis_name, reduce_dtype)
    return _add_quantize(h, jnp.asarray(residual), jnp.asarray(gamma), call)


def dequantize(y: jax.Array, scales: jax.Array) -> jax.Array:
    """``f32(y) * f32(scales)``, each scale repeated over its group: float32 ``[..., N]``
    from the ``(y, scales)`` of any op (per row, per group, e8m0 or static)."""
    n = y.shape[-1]
    groups = scales.shape[-1]
    scales32 = scales.astype(jnp.float32)
    if groups > 1:
        scales32 = jnp.repeat(scales32, n // groups, axis=-1)
    return y.astype(jnp.float32) * scales32


def all_reduce(x: jax.Array, axis_name, reduce_dtype) -> jax.Array:
    """The all-reduce step of allreduce_residual_rms_norm_fp8, shared with the op: the sum
    of ``x`` over the bound axis (or axes), in ``x.dtype`` (None) or float32."""
    reduce = check_reduce_dtype(reduce_dtype, x.dtype)
    return jax.lax.psum(x.astype(reduce), check_axis_name(axis_name))
