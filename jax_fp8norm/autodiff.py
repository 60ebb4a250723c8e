"""Gradients. The FP8 outputs of the ops are not differentiable: JAX gives a cotangent the
dtype of its primal, so a gradient reaching ``y`` would be rounded to FP8 (and mostly
underflow to zero). ``jax.grad`` through :func:`jax_fp8norm.rms_norm_fp8` or
:func:`jax_fp8norm.add_rms_norm_fp8` therefore raises an error that says so (the
primitives' JVP rule, in jax_fp8norm._primitives).

What training code differentiates instead is the dequantised output, ``f32(y) *
f32(scales)`` (each scale repeated over its group, times NVFP4's global scale):
:func:`rms_norm_fp8_dequantized` and :func:`add_rms_norm_fp8_dequantized` run the fused
kernel forward and, backward, the straight-through rule: the cotangent of the dequantised
output flows back as the gradient of the unquantised RMSNorm ``h * rsqrt(mean(h^2) + eps)
* (gamma + weight_offset)``, computed in float32, to x, gamma and the residual (rounding,
clamping, scale_ub and the choice of scales, dynamic or calibrated, are treated as the
identity).
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp

from jax_fp8norm._checks import validate
from jax_fp8norm._params import NormKeywords, NormParams
from jax_fp8norm._primitives import add_rms_norm_fp8_p, rms_norm_fp8_p
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm.recipes import dequantize


def _rms_norm_f32(h: jax.Array, gamma: jax.Array, p: NormParams) -> jax.Array:
    """The unquantised RMSNorm in float32, whose gradient is the straight-through one."""
    h = h.astype(jnp.float32)
    mean_square = jnp.mean(h * h, axis=-1, keepdims=True)
    return h * jax.lax.rsqrt(mean_square + p.eps) * (gamma.astype(jnp.float32) + p.weight_offset)


def _global_scale(p: NormParams, static: tuple) -> jax.Array | None:
    """NVFP4's global scale, the operand after gamma, which dequantisation multiplies by."""
    return static[0] if p.has_global_scale else None


@functools.cache
def _rms_norm_dequantized(p: NormParams):
    @jax.custom_vjp
    def fn(x, gamma, *static):
        y, scales = rms_norm_fp8_p.bind(x, gamma, *static, **p.as_dict())
        return dequantize(y, scales, _global_scale(p, static))

    def fwd(x, gamma, *static):
        return fn(x, gamma, *static), (x, gamma, static)

    def bwd(saved, cotangent):
        x, gamma, static = saved
        _, vjp = jax.vjp(lambda x, g: _rms_norm_f32(x, g, p), x, gamma)
        # The calibrated or global scale is a constant of the straight-through rule.
        return (*vjp(cotangent), *(jnp.zeros_like(s) for s in static))

    fn.defvjp(fwd, bwd)
    return fn


@functools.cache
def _add_rms_norm_dequantized(p: NormParams):
    @jax.custom_vjp
    def fn(x, residual, gamma, *static):
        y, scales, residual_out = add_rms_norm_fp8_p.bind(
            x, residual, gamma, *static, **p.as_dict()
        )
        return dequantize(y, scales, _global_scale(p, static)), residual_out

    def fwd(x, residual, gamma, *static):
        return fn(x, residual, gamma, *static), (x, residual, gamma, static)

    def bwd(saved, cotangents):
        x, residual, gamma, static = saved
        ct_normed, ct_residual_out = cotangents
        h = x.astype(jnp.float32) + residual.astype(jnp.float32)
        _, vjp = jax.vjp(lambda h, g: _rms_norm_f32(h, g, p), h, gamma)
        ct_h, ct_gamma = vjp(ct_normed)
        # residual_out is h rounded to the residual's dtype: straight through as well.
        ct_h = ct_h + ct_residual_out.astype(jnp.float32)
        zeros = tuple(jnp.zeros_like(s) for s in static)
        return ct_h.astype(x.dtype), ct_h.astype(residual.dtype), ct_gamma, *zeros

    fn.defvjp(fwd, bwd)
    return fn


@norm_keywords
def rms_norm_fp8_dequantized(
    x: jax.Array, gamma: jax.Array, **keywords: Unpack[NormKeywords]
) -> jax.Array:
    """``f32(y) * f32(scales)`` of :func:`jax_fp8norm.rms_norm_fp8` (each scale repeated
    over its group), differentiable.

    Forward: the fused kernel, then the dequantisation; the value is exactly that of the
    op's outputs. Backward: the straight-through rule (see the module docstring).

    Args:
      x, gamma: as for :func:`jax_fp8norm.rms_norm_fp8`.
      {keywords}

    Returns:
      ``[..., N]`` float32.
    """
    call = validate(x, gamma, **keywords)
    return _rms_norm_dequantized(call.params)(*call.operands(x, gamma))


@norm_keywords
def add_rms_norm_fp8_dequantized(
    x: jax.Array, residual: jax.Array, gamma: jax.Array, **keywords: Unpack[NormKeywords]
) -> tuple[jax.Array, jax.Array]:
    """``(f32(y) * f32(scales), residual_out)`` of :func:`jax_fp8norm.add_rms_norm_fp8`,
    differentiable with the straight-through rule; ``residual_out``'s cotangent flows to
    ``x`` and ``residual`` unchanged.

    Args:
      x, residual, gamma: as for :func:`jax_fp8norm.add_rms_norm_fp8`.
      {keywords}

    Returns:
      ``[..., N]`` float32 and ``[..., N]`` in ``x.dtype``.
    """
    call = validate(x, gamma, residual, **keywords)
    return _add_rms_norm_dequantized(call.params)(*call.operands(x, residual, gamma))
