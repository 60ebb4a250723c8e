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
    NormParams,
    check_axis_name,
    check_reduce_dtype,
    validate,
)

DEFAULT_EPS = 1e-6


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


def quantize_rows(h: jax.Array, gamma: jax.Array, p: NormParams) -> tuple[jax.Array, jax.Array]:
    """Steps 2-7 of the spec on float32 rows ``h`` [..., N]: returns (y, scales)."""
    f32 = jnp.float32
    n = h.shape[-1]
    scale_shape = h.shape[:-1] + (1,)
    if n == 0:
        return jnp.zeros(h.shape, p.out_dtype), jnp.zeros(scale_shape, p.scale_dtype)
    sum_sq = sum_of_squares(h)
    denom = _divide(sum_sq, n) + f32(p.eps)
    r = jnp.where(denom == 0, f32(0), _divide(jnp.ones_like(denom), jnp.sqrt(denom)))
    normed = (h * r) * (gamma.astype(f32) + f32(p.weight_offset))
    amax = jnp.max(jnp.abs(normed), axis=-1, keepdims=True)
    bounded = jnp.minimum(_round_through(amax, p.scale_dtype), f32(p.scale_ub))
    scale32 = _round_through(_divide(bounded, p.fp8_max), p.scale_dtype)
    scale = scale32.astype(p.scale_dtype)  # exact: scale32 is a scale_dtype value
    inverse = _divide(jnp.ones_like(scale32), scale32)
    recip = jnp.where((scale32 == 0) | ~jnp.isfinite(inverse), f32(0), inverse)
    # The barrier keeps XLA from folding normed * (1 / scale) into normed / scale.
    q = jnp.clip(normed * jax.lax.optimization_barrier(recip), -p.fp8_max, p.fp8_max)
    # A NaN or Inf in the row, or an overflowing sum of squares: the whole row is NaN.
    row_finite = jnp.isfinite(sum_sq)
    q = jnp.where(row_finite, q, f32(np.nan))
    scale = jnp.where(row_finite, scale, jnp.asarray(np.nan, p.scale_dtype))
    return q.astype(p.out_dtype), scale


def rms_norm_fp8(
    x: jax.Array,
    gamma: jax.Array,
    *,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
    scale_ub: float | None = None,
    out_dtype=jnp.float8_e4m3fn,
    scale_dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """Reference of :func:`jax_fp8norm.rms_norm_fp8`; same arguments and results."""
    p = validate(
        x,
        gamma,
        eps=eps,
        weight_offset=weight_offset,
        scale_ub=scale_ub,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
    )
    return quantize_rows(jnp.asarray(x).astype(jnp.float32), jnp.asarray(gamma), p)


def add_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
    scale_ub: float | None = None,
    out_dtype=jnp.float8_e4m3fn,
    scale_dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of :func:`jax_fp8norm.add_rms_norm_fp8`; same arguments and results."""
    p = validate(
        x,
        gamma,
        residual,
        eps=eps,
        weight_offset=weight_offset,
        scale_ub=scale_ub,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
    )
    return _add_quantize(jnp.asarray(x), jnp.asarray(residual), jnp.asarray(gamma), p)


def _add_quantize(x, residual, gamma, p: NormParams):
    """h = x + residual in float32; (y, scales) of the unrounded h; h in residual's dtype."""
    h = x.astype(jnp.float32) + residual.astype(jnp.float32)
    y, scales = quantize_rows(h, gamma, p)
    return y, scales, h.astype(residual.dtype)


def allreduce_residual_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    axis_name,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
    scale_ub: float | None = None,
    out_dtype=jnp.float8_e4m3fn,
    scale_dtype=jnp.float32,
    reduce_dtype=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of :func:`jax_fp8norm.allreduce_residual_rms_norm_fp8`; same arguments."""
    p = validate(
        x,
        gamma,
        residual,
        eps=eps,
        weight_offset=weight_offset,
        scale_ub=scale_ub,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
    )
    h = all_reduce(jnp.asarray(x), axis_name, reduce_dtype)
    return _add_quantize(h, jnp.asarray(residual), jnp.asarray(gamma), p)


def all_reduce(x: jax.Array, axis_name, reduce_dtype) -> jax.Array:
    """The all-reduce step of allreduce_residual_rms_norm_fp8, shared with the op: the sum
    of ``x`` over the bound axis (or axes), in ``x.dtype`` (None) or float32."""
    reduce = check_reduce_dtype(reduce_dtype, x.dtype)
    return jax.lax.psum(x.astype(reduce), check_axis_name(axis_name))
