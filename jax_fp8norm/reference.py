"""Pure-jnp twins of the kernels: the same signatures and the same math (docs/spec.md).

They are the references the tests hold the kernels to, and a readable statement of what
the kernels compute. They run anywhere jax runs, but are two or more XLA fusions where
the kernels are one pass.
"""

from __future__ import annotations

import dataclasses
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm import _groups
from jax_fp8norm._allreduce import xla_sum
from jax_fp8norm._checks import (
    check_axis_name,
    check_backward,
    check_columnwise,
    check_hadamard,
    check_reduce_dtype,
    check_return_amax,
    validate,
)
from jax_fp8norm._dtypes import E8M0
from jax_fp8norm._exact_sums import exact_sum, sum_of_squares
from jax_fp8norm._fp4_parts import hadamard_rows
from jax_fp8norm._groups import as_bits, divide, fp4_groups, from_bits, power_of_two_exponents
from jax_fp8norm._params import DEFAULT_EPS, NormKeywords, NormParams, named_outputs
from jax_fp8norm._shapes import shaped_call
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm._unfused import textbook_rms_norm, unquantized_rms_norm_dense
from jax_fp8norm.recipes import dequantize

__all__ = [
    "DEFAULT_EPS",
    "add_quantize",
    "add_rms_norm_backward",
    "add_rms_norm_fp8",
    "add_rms_norm_fp8_training",
    "all_reduce",
    "allreduce_residual_rms_norm_fp8",
    "dequantize",
    "exact_sum",
    "fixed_order_sum",
    "inverse_rms",
    "quantize_columns",
    "quantize_rows",
    "rms_norm_backward",
    "rms_norm_fp8",
    "rms_norm_fp8_training",
    "row_amax",
    "row_global_scales",
    "sum_of_squares",
    "textbook_rms_norm",
    "unquantized_rms_norm_dense",
]


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


def _nearest_scales(amax: jax.Array, p: NormParams) -> tuple[jax.Array, jax.Array]:
    """Steps 5-6 with nearest rounding: (scale as float32, recip)."""
    f32 = jnp.float32
    bounded = jnp.minimum(_round_through(amax, p.scale_dtype), f32(p.scale_ub))
    scale32 = _round_through(divide(bounded, p.out_max), p.scale_dtype)
    inverse = divide(jnp.ones_like(scale32), scale32)
    recip = jnp.where((scale32 == 0) | ~jnp.isfinite(inverse), f32(0), inverse)
    return scale32, recip


def _to_scale_dtype(scale32: jax.Array, dtype) -> jax.Array:
    """float32 ``scale32``, each a ``dtype`` value or NaN, in ``dtype``, exactly (the last
    step of a scale: no bfloat16 operation may follow it). bfloat16 takes
    the high half of the bits, as integers up to the end: XLA's CPU backend computes
    bfloat16 operations in float32 with subnormals flushed to zero (a convert, even a
    broadcast), and a bfloat16 scale can be subnormal (a static scale of 1e-40). The
    barrier keeps XLA from moving the bitcast ahead of a broadcast."""
    if np.dtype(dtype) == np.dtype(jnp.bfloat16):
        high = (jax.lax.bitcast_convert_type(scale32, jnp.uint32) >> 16).astype(jnp.uint16)
        return jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(high), jnp.bfloat16)
    return scale32.astype(dtype)


def _static_scales(static_scale: jax.Array, p: NormParams) -> tuple[jax.Array, jax.Array]:
    """The calibrated scale: (scale as float32, recip); recip NaN for a scale that is not
    a positive normal finite float32, 0 where 1 / scale would be subnormal."""
    scale32 = _round_through(static_scale.astype(jnp.float32).reshape(()), p.scale_dtype)
    bits = as_bits(scale32)
    valid = (bits >= 0x00800000) & (bits < 0x7F800000)
    inverse = divide(jnp.ones_like(scale32), scale32)
    recip = jnp.where(as_bits(inverse) >= 0x00800000, inverse, jnp.float32(0))
    return scale32, jnp.where(valid, recip, jnp.float32(np.nan))


def _inverse_rms_of(sum_sq: jax.Array, n: int, eps: float) -> jax.Array:
    """Step 2: r = 1 / sqrt(ss / N + eps32), 0 where the denominator is 0; a row of no
    elements has a mean square of 0."""
    f32 = jnp.float32
    denom = divide(sum_sq, max(n, 1)) + f32(eps)
    return jnp.where(denom == 0, f32(0), divide(jnp.ones_like(denom), jnp.sqrt(denom)))


def inverse_rms(h: jax.Array, eps: float) -> jax.Array:
    """Each row's r (step 2) of float32 rows ``h`` [..., N], with ``eps`` already rounded
    (f32(T(eps))): what the training forms return, float32 ``[..., 1]``; NaN for a row
    whose sum of squares is not finite (its outputs are NaN; so is its gradient)."""
    h = jnp.asarray(h, jnp.float32)
    sum_sq = sum_of_squares(h)
    r = _inverse_rms_of(sum_sq, h.shape[-1], eps)
    return jnp.where(jnp.isfinite(sum_sq), canonical_nan(r), jnp.float32(np.nan))


def canonical_nan(v: jax.Array) -> jax.Array:
    """float32 ``v`` with every NaN the one quiet NaN (0x7FC00000), as the kernels write
    the training form's r and the backward's outputs: which NaN an operation gives depends
    on the order of its operands."""
    return jnp.where(jnp.isnan(v), jnp.float32(np.nan), v)


def quantize_rows(
    h: jax.Array, gamma: jax.Array, p: NormParams, scale_operand: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Steps 2-7 of the spec on float32 rows ``h`` [..., N], with scales per row, per
    group, calibrated or FP4's: returns (y, scales). ``scale_operand``: the calibrated
    scale, or NVFP4's global scale (a float32 (1,) array); with per-row global scales,
    none (each row's is computed here, :func:`row_global_scales`)."""
    n = h.shape[-1]
    groups = p.groups(n)
    rows = h.shape[:-1]
    sum_sq = sum_of_squares(h)  # [..., 1]
    normed = _normalize(h, _inverse_rms_of(sum_sq, n, p.eps), gamma, p)
    if p.per_row_global_scale:
        scale_operand = _groups.per_row_global_scale(
            _groups.abs_max(normed, -1), jnp.isfinite(sum_sq)
        )
    grouped = normed.reshape(rows + (groups, n // groups if groups else 0))
    y, scales = _quantize_groups(grouped, jnp.isfinite(sum_sq), p, scale_operand)
    return y.reshape(h.shape), scales


def row_amax(h: jax.Array, gamma: jax.Array, p: NormParams) -> jax.Array:
    """Step 4's ``amax = max_j |n_j|`` of each float32 row of ``h`` [..., N], before any
    clip: what ``return_amax=True`` returns beside a static scale, float32 ``[..., 1]``
    (0 for a row of no elements). The one quiet NaN where an ``n_j`` is NaN or the row's
    sum of squares is not finite (docs/spec.md, "static_scale"). The maximum is taken on
    the magnitudes' bits, which order as the floats do (every NaN above +inf), so that no
    float comparison flushes or reorders it."""
    amax, finite = _row_abs_max(h, gamma, p)
    return jnp.where(finite, canonical_nan(amax), jnp.float32(np.nan))


def _row_abs_max(h: jax.Array, gamma: jax.Array, p: NormParams) -> tuple[jax.Array, jax.Array]:
    """Each float32 row's ``max_j |n_j|`` and whether its sum of squares is finite."""
    sum_sq = sum_of_squares(h)
    normed = _normalize(h, _inverse_rms_of(sum_sq, h.shape[-1], p.eps), gamma, p)
    return _groups.abs_max(normed, -1), jnp.isfinite(sum_sq)


def row_global_scales(h: jax.Array, gamma: jax.Array, p: NormParams) -> jax.Array:
    """Each float32 row's NVFP4 global scale with ``global_scale="per_row"``: ``max(amax /
    (448 * 6), 2^-126)`` of the row's ``n`` (steps 1-3), float32 ``[..., 1]``; NaN for a
    row that is not finite (its block scales are NaN, its codes 0)."""
    return _groups.per_row_global_scale(*_row_abs_max(h, gamma, p))


def quantize_columns(
    h: jax.Array,
    gamma: jax.Array,
    inverse_rms: jax.Array,
    p: NormParams,
    scale_operand: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The columnwise outputs (docs/spec.md, "Columnwise outputs") of float32 rows ``h``
    [..., N] with their saved ``inverse_rms`` [..., 1] (NaN for a row that is not finite):
    ``n`` transposed to [N, rows] and quantised along the rows in blocks of
    ``p.group_size`` by the recipe's group rule, a block with a row that is not finite
    taking that row's rule (NaN codes and scale; FP4: zero codes, NaN scale). A calibrated
    scale: the rowwise codes transposed, scales ``[N, 1]``. With ``p.hadamard_mask``, each
    column's blocks of ``n`` are transformed (hadamard_rows) before they are quantised,
    under ``d`` times the NVFP4 global scale (the transform's values are at most ``d``
    times n's). Returns (y_t, scales_t), and with per-row global scales each column's
    (from its abs-max of n over every row, NaN where a row is not finite; times ``d``
    with the transform), float32 ``[N, 1]``, which its blocks are quantised under,
    third."""
    n = h.shape[-1]
    rows = int(np.prod(h.shape[:-1], dtype=np.int64))
    r = inverse_rms.reshape(rows, 1)
    row_finite = ~jnp.isnan(r).reshape(rows)
    normed = _normalize(h.reshape(rows, n), r, gamma, p)
    if p.per_row_global_scale:
        gs_t = _groups.per_row_global_scale(_groups.abs_max(normed.T, -1), jnp.all(row_finite))
    if p.hadamard_mask is not None:
        normed = hadamard_rows(normed, p.group_size, p.hadamard_mask)
        if p.nvfp4:  # exact: d is a power of two
            d = jnp.float32(p.group_size)
            gs_t = gs_t * d if p.per_row_global_scale else scale_operand * d
    normed_t = normed.T  # [N, rows]
    if p.has_static_scale:
        y_t, _ = _quantize_groups(normed_t[..., None], row_finite[None, :], p, scale_operand)
        scale32 = jnp.broadcast_to(_static_scales(scale_operand, p)[0], (n, 1))
        return y_t.reshape(n, rows), _to_scale_dtype(scale32, p.scale_dtype)
    block = p.group_size
    grouped = normed_t.reshape(n, rows // block, block)
    block_finite = jnp.all(row_finite.reshape(rows // block, block), axis=-1)
    if p.per_row_global_scale:
        y_t, scales_t = _quantize_groups(grouped, block_finite[None, :], p, gs_t)
        return y_t.reshape(n, rows), scales_t, gs_t
    if p.hadamard_mask is not None and p.nvfp4:
        scale_operand = gs_t
    y_t, scales_t = _quantize_groups(grouped, block_finite[None, :], p, scale_operand)
    return y_t.reshape(n, rows), scales_t


def _normalize(h: jax.Array, r: jax.Array, gamma: jax.Array, p: NormParams) -> jax.Array:
    """Step 5: n = (h * r) * (gamma + weight_offset), in that order."""
    return (h * r) * _plus_constant(gamma.astype(jnp.float32), p.weight_offset)


def _quantize_groups(
    grouped: jax.Array, finite: jax.Array, p: NormParams, scale_operand: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Steps 6-7 of normalised groups [..., groups, G] (per row: one group of the row; a
    calibrated scale: any grouping), ``finite`` [..., groups] false where the group's rows
    are not all finite: (codes [..., groups, G], scales [..., groups])."""
    f32 = jnp.float32
    if p.fp4:
        return fp4_groups(grouped, finite, p, scale_operand)
    lead = grouped.shape[:-1]
    if p.has_static_scale:
        scale32, recip = _static_scales(scale_operand, p)
        scale32 = jnp.broadcast_to(scale32, lead)
        recip = jnp.broadcast_to(recip, lead)
        exponent = None
    else:
        amax = jnp.max(jnp.abs(grouped), axis=-1, initial=f32(0))  # [..., groups]
        if p.power_of_two_scales:
            exponent, recip = power_of_two_exponents(amax, p)
            scale32 = from_bits(exponent << 23)
        else:
            scale32, recip = _nearest_scales(amax, p)
            exponent = None
    # The barrier keeps XLA from folding normed * (1 / scale) into normed / scale.
    q = jnp.clip(grouped * jax.lax.optimization_barrier(recip)[..., None], -p.out_max, p.out_max)
    # A NaN or Inf in the row, or an overflowing sum of squares: the whole row is NaN (and
    # its scales, unless calibrated).
    q = jnp.where(finite[..., None], q, f32(np.nan))
    if p.scale_dtype == E8M0:
        exponent = jnp.where(finite, exponent, jnp.uint32(0xFF)).astype(jnp.uint8)
        scale = jax.lax.bitcast_convert_type(exponent, E8M0)
    else:
        if not p.has_static_scale:
            scale32 = jnp.where(finite, scale32, f32(np.nan))
        scale = _to_scale_dtype(scale32, p.scale_dtype)
    return _to_fp8(q, p.out_dtype), scale


# The NaN code of each FP8 format: the kernels write this one, whatever NaN they convert.
_FP8_NAN_CODE = {np.dtype(jnp.float8_e4m3fn): 0x7F, np.dtype(jnp.float8_e4m3fnuz): 0x80}


def _to_fp8(q: jax.Array, out_dtype) -> jax.Array:
    """float32 ``q`` (clamped to +-FP8_MAX, or NaN) rounded to nearest even in ``out_dtype``,
    every NaN as the format's one NaN code. XLA's conversion is what rounds (tests/
    test_reference.py holds it to ml_dtypes at every rounding boundary); the NaN code is
    set here, since XLA's conversion keeps a NaN's sign bit in e4m3fn."""
    codes = jax.lax.bitcast_convert_type(q.astype(out_dtype), jnp.uint8)
    codes = jnp.where(jnp.isnan(q), jnp.uint8(_FP8_NAN_CODE[np.dtype(out_dtype)]), codes)
    return jax.lax.bitcast_convert_type(codes, out_dtype)


def _plus_constant(value: jax.Array, constant: float) -> jax.Array:
    """float32 ``value + constant``, rounded once. Adding 0.0 still turns -0.0 into +0.0, as
    the kernels' addition does; XLA's simplifier drops an addition of 0.0, so that case is
    written as what it computes."""
    if constant != 0.0:
        return value + jnp.float32(constant)
    bits = as_bits(value)
    return from_bits(jnp.where(bits == jnp.uint32(0x80000000), jnp.uint32(0), bits))


def flush_tiny(v: jax.Array) -> jax.Array:
    """float32 ``v``, a zero of its sign where ``|v| <= 2^-126``: the backward's rule for every
    input and result (docs/spec.md, "Training: the backward pass")."""
    bits = as_bits(v)
    tiny = (bits & jnp.uint32(0x7FFFFFFF)) <= jnp.uint32(0x00800000)
    return jnp.where(tiny, from_bits(bits & jnp.uint32(0x80000000)), v)


def backward_rows(
    dn: jax.Array, h: jax.Array, gamma: jax.Array, r: jax.Array, weight_offset: float
) -> tuple[jax.Array, jax.Array]:
    """The backward of steps 2-3 on float32 rows ``h`` [R, N] (made of flushed operands:
    _flushed_sum) with their saved ``r`` [R, 1] and the cotangent ``dn`` of n: (dx [R, N]
    float32, before any rounding to a dtype; dgamma [N] float32). ``weight_offset``:
    f32(T(weight_offset))."""
    f32 = jnp.float32
    flush = flush_tiny
    n = h.shape[-1]
    g = flush(_plus_constant(flush(jnp.asarray(gamma).astype(f32)), weight_offset))
    dn = flush(jnp.asarray(dn).astype(f32))
    r = flush(r)
    u = flush(h * r)
    a = flush(dn * g)
    c = exact_sum(flush(a * u), axis=-1)[..., None]
    c_over_n = flush(divide(c, max(n, 1)))
    dx = canonical_nan(flush(r * flush(a - flush(u * c_over_n))))
    dgamma = exact_sum(flush(dn * u), axis=0)
    return dx, dgamma


def rms_norm_backward(
    dn: jax.Array, x: jax.Array, gamma: jax.Array, inverse_rms: jax.Array, *, weight_offset=0.0
) -> tuple[jax.Array, jax.Array]:
    """Reference of :func:`jax_fp8norm._training.rms_norm_backward`; same arguments and results."""
    wo = check_backward(dn, x, gamma, inverse_rms, weight_offset=weight_offset)
    return backward(dn, x, gamma, inverse_rms, wo)


def add_rms_norm_backward(
    dn: jax.Array,
    d_residual_out: jax.Array,
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    inverse_rms: jax.Array,
    *,
    weight_offset=0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference of :func:`jax_fp8norm._training.add_rms_norm_backward`; same arguments
    and results."""
    wo = check_backward(dn, x, gamma, inverse_rms, residual, d_residual_out, weight_offset)
    return add_backward(dn, d_residual_out, x, residual, gamma, inverse_rms, wo)


def _flushed_sum(*operands: jax.Array) -> jax.Array:
    """h as the backward takes it: each operand in float32, flushed, then added."""
    h = flush_tiny(operands[0].astype(jnp.float32))
    for operand in operands[1:]:
        h = h + flush_tiny(operand.astype(jnp.float32))
    return h


def backward(dn, x, gamma, inverse_rms, weight_offset: float):
    """(dx in x's dtype, dgamma float32 [N]) of checked arrays of any rank."""
    rows = (int(np.prod(x.shape[:-1])), x.shape[-1])
    dx, dgamma = backward_rows(
        dn.reshape(rows),
        _flushed_sum(x.reshape(rows)),
        gamma,
        inverse_rms.reshape(rows[0], 1),
        weight_offset,
    )
    return dx.reshape(x.shape).astype(x.dtype), dgamma


def add_backward(dn, d_residual_out, x, residual, gamma, inverse_rms, weight_offset: float):
    """(dx, dresidual, dgamma) of checked arrays: dh = dx + f32(d_residual_out), rounded to
    x's and the residual's dtypes."""
    rows = (int(np.prod(x.shape[:-1])), x.shape[-1])
    h = _flushed_sum(x.reshape(rows), residual.reshape(rows))
    dx, dgamma = backward_rows(
        dn.reshape(rows), h, gamma, inverse_rms.reshape(rows[0], 1), weight_offset
    )
    dh = flush_tiny(dx + flush_tiny(d_residual_out.reshape(rows).astype(jnp.float32)))
    dh = canonical_nan(dh)
    dh = dh.reshape(x.shape)
    return dh.astype(x.dtype), dh.astype(residual.dtype), dgamma


@norm_keywords
def rms_norm_fp8_training(
    x: jax.Array,
    gamma: jax.Array,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """Reference of :func:`jax_fp8norm._training.rms_norm_fp8_training`: ``(y, scales,
    inverse_rms)``, then ``y_t, scales_t`` with ``columnwise``.

    Keywords:
      {keywords}
    """
    call = validate(x, gamma, **keywords)
    x, gamma = jnp.asarray(x), jnp.asarray(gamma)
    return _outputs(call, x, None, gamma, True, columnwise, False, hadamard)


@norm_keywords
def add_rms_norm_fp8_training(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """Reference of :func:`jax_fp8norm._training.add_rms_norm_fp8_training`:
    ``(y, scales, residual_out, inverse_rms)``, then ``y_t, scales_t`` with ``columnwise``.

    Keywords:
      {keywords}
    """
    call = validate(x, gamma, residual, **keywords)
    x, residual, gamma = jnp.asarray(x), jnp.asarray(residual), jnp.asarray(gamma)
    return _outputs(call, x, residual, gamma, True, columnwise, False, hadamard)


@norm_keywords
def rms_norm_fp8(
    x: jax.Array,
    gamma: jax.Array | None = None,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    return_amax: bool = False,
    reduction_axes: int | tuple[int, ...] = -1,
    out_sharding=None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """Reference of :func:`jax_fp8norm.rms_norm_fp8`; same arguments and results.

    Keywords:
      {keywords}
    """
    shaped = shaped_call(
        (x,), gamma, keywords, reduction_axes=reduction_axes, out_sharding=out_sharding
    )
    amax = check_return_amax(return_amax, shaped.call.params)
    x = jnp.asarray(shaped.rows[0])
    gamma = jnp.asarray(shaped.gamma)
    outs = _outputs(shaped.call, x, None, gamma, False, columnwise, amax, hadamard)
    return _in_callers_shapes(shaped, outs, columnwise, amax)


@norm_keywords
def add_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array | None = None,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    return_amax: bool = False,
    reduction_axes: int | tuple[int, ...] = -1,
    out_sharding=None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """Reference of :func:`jax_fp8norm.add_rms_norm_fp8`; same arguments and results.

    Keywords:
      {keywords}
    """
    shaped = shaped_call(
        (x, residual), gamma, keywords, reduction_axes=reduction_axes, out_sharding=out_sharding
    )
    amax = check_return_amax(return_amax, shaped.call.params)
    x, residual = (jnp.asarray(r) for r in shaped.rows)
    gamma = jnp.asarray(shaped.gamma)
    outs = _outputs(shaped.call, x, residual, gamma, False, columnwise, amax, hadamard)
    return _in_callers_shapes(shaped, outs, columnwise, amax)


def _in_callers_shapes(shaped, outs: tuple, columnwise: bool, amax: bool = False) -> tuple:
    """A public twin's outputs of the kernels' rows in the caller's shapes and placement
    (jax_fp8norm._shapes), by name as the op's."""
    form = shaped.call.params.as_dict() | {"with_amax": amax, "columnwise": bool(columnwise)}
    named = named_outputs(outs, form, add=len(shaped.rows) == 2)
    return shaped.finish(named).returned(training=False)


def _outputs(
    call, x, residual, gamma, training: bool, columnwise, amax: bool = False, hadamard=None
) -> tuple[jax.Array, ...]:
    """(y, scales[, residual_out][, inverse_rms][, amax][, global_scales][, y_t, scales_t[,
    global_scales_t]]) of one checked call."""
    columnwise = check_columnwise(columnwise, call.params, x.shape)
    params = dataclasses.replace(
        call.params, hadamard_mask=check_hadamard(hadamard, call.params, columnwise)
    )
    if residual is None:
        h = x.astype(jnp.float32)
        outs = quantize_rows(h, gamma, call.params, call.scale_operand)
    else:
        outs = add_quantize(x, residual, gamma, call)
        h = x.astype(jnp.float32) + residual.astype(jnp.float32)
    if training or columnwise:
        r = inverse_rms(h, call.params.eps)
    if training:
        outs = (*outs, r)
    if amax:
        outs = (*outs, row_amax(h, gamma, call.params))
    if call.params.per_row_global_scale:
        outs = (*outs, row_global_scales(h, gamma, call.params))
    if columnwise:
        outs = (*outs, *quantize_columns(h, gamma, r, params, call.scale_operand))
    return outs


def add_quantize(x, residual, gamma, call):
    """h = x + residual in float32; (y, scales) of the unrounded h; h in residual's dtype."""
    h = x.astype(jnp.float32) + residual.astype(jnp.float32)
    y, scales = quantize_rows(h, gamma, call.params, call.scale_operand)
    return y, scales, h.astype(residual.dtype)


@norm_keywords
def allreduce_residual_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array | None = None,
    *,
    axis_name,
    reduce_dtype=None,
    method: str = "xla",
    columnwise: bool = False,
    reduction_axes: int | tuple[int, ...] = -1,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """Reference of :func:`jax_fp8norm.allreduce_residual_rms_norm_fp8`; same arguments.
    ``method`` is the method the op ran (its ``"auto"`` depends on the platform, so the
    reference takes only the explicit ones): ``"xla"`` is ``jax.lax.psum``; ``"one_shot"``
    and ``"two_shot"`` state the one-kernel order, an all-gather of the partials and a
    left fold in float32, ``((x_0 + x_1) + ...) + x_{n-1}``, before the residual.

    Keywords:
      {keywords}
    """
    shaped = shaped_call((x, residual), gamma, keywords, reduction_axes=reduction_axes)
    x, residual = (jnp.asarray(r) for r in shaped.rows)
    if method not in ("xla", "one_shot", "two_shot"):
        raise ValueError(
            f"method must be 'xla', 'one_shot' or 'two_shot' (the method the op ran), got "
            f"{method!r}"
        )
    if method == "xla":
        h = all_reduce(jnp.asarray(x), axis_name, reduce_dtype)
    else:
        h = fixed_order_sum(jnp.asarray(x), axis_name)
    gamma = jnp.asarray(shaped.gamma)
    outs = _outputs(shaped.call, h, residual, gamma, False, columnwise)
    return _in_callers_shapes(shaped, outs, columnwise)


def fixed_order_sum(x: jax.Array, axis_name) -> jax.Array:
    """The one-kernel methods' sum over the bound axis: every device's partial gathered,
    then added in float32 in the order of the axis, the same on every device."""
    (name,) = check_axis_name(axis_name)
    # "invarying": shard_map knows the gathered partials to be the same on every device.
    partials = jax.lax.all_gather(x, name, to="invarying").astype(jnp.float32)
    h = partials[0]
    for k in range(1, partials.shape[0]):
        h = h + partials[k]
    return h


def all_reduce(x: jax.Array, axis_name, reduce_dtype) -> jax.Array:
    """The all-reduce step of allreduce_residual_rms_norm_fp8 with ``method="xla"``: the sum
    of ``x`` over the bound axis (or axes), in ``x.dtype`` (None) or float32."""
    reduce = check_reduce_dtype(reduce_dtype, x.dtype)
    return xla_sum(x, check_axis_name(axis_name), reduce)
