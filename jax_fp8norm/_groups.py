"""The rounding of float32 groups to the block formats, stated once: the power-of-two
scale rule (MXFP8, MXFP4, UE8M0) and FP4's codes and scales (NVFP4, MXFP4). The reference
twins (reference.py) quantise the normalised rows' groups with it, and matmul.py's weight
quantisers the weights' blocks, so that an FP4 weight and an FP4 activation are rounded
by the same rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._dtypes import E4M3, E8M0, FP4_MAX
from jax_fp8norm._fp4_parts import round_fp4
from jax_fp8norm._params import NormParams


def divide(numerator: jax.Array, denominator) -> jax.Array:
    """``numerator / denominator`` rounded once, as the spec says. XLA's simplifier turns a
    division by a constant into a multiplication by its rounded reciprocal, and
    ``1 / sqrt`` into an approximate rsqrt; a barrier keeps the divisor opaque to it."""
    denominator = jnp.broadcast_to(jnp.asarray(denominator, numerator.dtype), numerator.shape)
    return numerator / jax.lax.optimization_barrier(denominator)


def as_bits(value: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(value, jnp.uint32)


def from_bits(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def power_of_two_exponents(amax: jax.Array, p: NormParams) -> tuple[jax.Array, jax.Array]:
    """Steps 5-6 with power-of-two scales: :func:`power_of_two` of ``min(amax, scale_ub)``
    with the call's format and scale dtype."""
    a = jnp.minimum(amax, jnp.float32(p.scale_ub))
    return power_of_two(a, p.out_max, e8m0=p.scale_dtype == E8M0)


def power_of_two(a: jax.Array, out_max: float, *, e8m0: bool) -> tuple[jax.Array, jax.Array]:
    """The power-of-two scale rule, the one the norm's groups and the layer's weights and
    gradients take: (the scales' biased float32 exponents, their float32 reciprocals).
    P(q) is the smallest power of two >= q = a / out_max, at least 2^-127 in e8m0 (its
    byte 0) and 2^-126 in a float type; a q below 2^-126 is decided from ``a``, so that
    denormal flushing cannot change it (src/common/fp8norm_math.h, PowerOfTwoExponent). A
    NaN or infinite ``a`` gives exponent 0xFF (e8m0's NaN) and reciprocal 0."""
    u32 = jnp.uint32
    q = as_bits(divide(a, out_max))
    exponent = (q >> 23) & u32(0xFF)
    rounded_up = jnp.where(
        (exponent != 0xFF) & ((q & u32(0x7FFFFF)) != 0), exponent + u32(1), exponent
    )
    tiny_limit = np.float32(out_max) * np.float32(2.0**-127)  # a normal float32
    tiny = jnp.where(a > tiny_limit, u32(1), u32(0))
    exponent = jnp.where(exponent == 0, tiny, rounded_up)
    exponent = jnp.maximum(exponent, u32(0 if e8m0 else 1))
    recip = jnp.where(exponent <= 253, from_bits((u32(254) - exponent) << 23), jnp.float32(0))
    return exponent, recip


# The per-row (or per-column) NVFP4 global scale maps a row's amax onto the top of the
# format's range, 448 * 6: the largest e4m3 block scale times the largest e2m1 code.
PER_ROW_GLOBAL_DIVISOR = 448.0 * FP4_MAX
# Its floor, the smallest normal float32: a global scale must be a positive normal number.
PER_ROW_GLOBAL_FLOOR = 2.0**-126


def abs_max(v: jax.Array, axis: int) -> jax.Array:
    """max |v| along ``axis`` (kept, of size 1), on the magnitudes' bits, which order as the
    floats do (every NaN above +inf): no float comparison flushes or drops a NaN."""
    magnitudes = as_bits(v) & jnp.uint32(0x7FFFFFFF)
    return from_bits(jnp.max(magnitudes, axis=axis, keepdims=True, initial=jnp.uint32(0)))


def per_row_global_scale(amax: jax.Array, finite: jax.Array) -> jax.Array:
    """NVFP4's per-row global scale of rows with abs-max ``amax`` (float32): ``max(amax /
    2688, 2^-126)`` by a float32 division; the one quiet NaN where ``finite`` is false (a
    row that is not finite) or ``amax`` is not finite. A quotient below the floor (a
    subnormal one, which may be flushed, included) takes the floor."""
    gs = divide(amax, PER_ROW_GLOBAL_DIVISOR)
    gs = jnp.where(as_bits(gs) < jnp.uint32(0x00800000), jnp.float32(PER_ROW_GLOBAL_FLOOR), gs)
    return jnp.where(finite & jnp.isfinite(amax), gs, jnp.float32(np.nan))


def fp4_groups(
    grouped: jax.Array,
    row_finite: jax.Array,
    p: NormParams,
    global_scale: jax.Array | None,
    bits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """FP4 codes and scales of float32 normalised groups [..., groups, G] (docs/spec.md,
    "FP4 outputs"). NVFP4: t = n / gs, scale = e4m3(min(max|t| / 6, 448)), y =
    e2m1(clip(t / scale, -6, 6)). MXFP4: the power-of-two rule with FP4_MAX, y =
    e2m1(clip(n * (1 / scale), -6, 6)). A group that is not finite (in a row that is not,
    or holding NaN or Inf), or NVFP4 under a global scale that is not a positive normal
    float32, gets a NaN scale and zero codes; a zero NVFP4 scale gives zero codes. NVFP4
    values that overflow when divided by gs take the formula (scale 448, codes +-6).
    ``global_scale``: the one operand (shape (1,)), or with per-row global scales one per
    leading index, ``[..., 1]`` (``grouped.shape[:-2] + (1,)``). The codes are rounded to
    nearest, or stochastically with ``bits`` (uint32 of ``grouped``'s shape:
    jax_fp8norm._fp4_parts.round_fp4)."""
    if p.nvfp4 and global_scale is None:
        raise ValueError("NVFP4 (float8_e4m3fn scales) needs its global_scale operand")
    f32 = jnp.float32
    if p.nvfp4:
        if p.per_row_global_scale:
            gs = global_scale.astype(f32).reshape(grouped.shape[:-2] + (1, 1))
        else:
            gs = global_scale.astype(f32).reshape(())
        gs_bits = as_bits(gs)
        gs_valid = (gs_bits >= 0x00800000) & (gs_bits < 0x7F800000)
        # The barrier keeps XLA from folding (n / gs) / scale into n / (gs * scale).
        t = jax.lax.optimization_barrier(divide(grouped, gs))
        # Read from every element: XLA's max reductions need not carry a NaN through.
        holds_non_finite = ~jnp.all(jnp.isfinite(grouped), axis=-1)
        amax = jnp.max(jnp.abs(t), axis=-1, initial=f32(0))  # [..., groups]
        finite = row_finite & (gs_valid[..., 0] if gs.ndim else gs_valid) & ~holds_non_finite
        # The barrier keeps XLA from dropping the round trip through e4m3 (as jax.nn's
        # quantiser does too).
        scale = jax.lax.optimization_barrier(
            jnp.minimum(divide(amax, FP4_MAX), f32(448.0)).astype(E4M3)
        )
        scale32 = scale.astype(f32)
        zero = ~finite | (scale32 == 0)
        q = divide(t, jnp.where(zero, f32(1), scale32)[..., None])
        scale = jnp.where(finite, scale, jnp.asarray(np.nan, E4M3))
    else:
        amax = jnp.max(jnp.abs(grouped), axis=-1, initial=f32(0))
        zero = ~(row_finite & jnp.all(jnp.isfinite(grouped), axis=-1))
        exponent, recip = power_of_two_exponents(amax, p)
        # The barrier keeps XLA from folding n * (1 / scale) into n / scale.
        q = grouped * jax.lax.optimization_barrier(recip)[..., None]
        exponent = jnp.where(zero, jnp.uint32(0xFF), exponent).astype(jnp.uint8)
        scale = jax.lax.bitcast_convert_type(exponent, E8M0)
    q = jnp.clip(jnp.where(zero[..., None], f32(0), q), -FP4_MAX, FP4_MAX)
    return round_fp4(q, bits), scale
