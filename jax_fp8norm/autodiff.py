"""Gradients. The FP8 outputs of the ops are not differentiable: JAX gives a cotangent the
dtype of its primal, so a gradient reaching ``y`` would be rounded to FP8 (and mostly
underflow to zero). ``jax.grad`` through :func:`jax_fp8norm.rms_norm_fp8` or
:func:`jax_fp8norm.add_rms_norm_fp8` therefore raises an error that says so (the
primitives' JVP rule, in jax_fp8norm._primitives).

What training code differentiates instead is the dequantised output, ``f32(y) *
f32(scales)`` (each scale repeated over its group, times NVFP4's global scale):
:func:`rms_norm_fp8_dequantized` and :func:`add_rms_norm_fp8_dequantized` run the fused
kernel's training form forward (which saves each row's r) and, backward, the fused
backward kernel (jax_fp8norm.training, docs/spec.md "Training: the backward pass"): the
straight-through rule, the cotangent of the dequantised output arriving as that of the
normalised ``n`` (rounding, clamping, scale_ub and the choice of scales, dynamic or
calibrated, are treated as the identity), with order-free exact sums for each row's ``c``
and for ``dgamma``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Unpack

import jax
import jax.numpy as jnp

from jax_fp8norm._backward import add_backward, rms_backward
from jax_fp8norm._checks import validate
from jax_fp8norm._params import NormKeywords, NormParams
from jax_fp8norm._primitives import add_rms_norm_fp8_p, rms_norm_fp8_p
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm.recipes import dequantize


def _global_scale(p: NormParams, static: tuple) -> jax.Array | None:
    """NVFP4's global scale, the operand after gamma, which dequantisation multiplies by."""
    return static[0] if p.has_global_scale else None


@functools.cache
def _rms_norm_dequantized(p: NormParams):
    training = dataclasses.replace(p, with_inverse_rms=True)

    @jax.custom_vjp
    def fn(x, gamma, *static):
        y, scales = rms_norm_fp8_p.bind(x, gamma, *static, **p.as_dict())
        return dequantize(y, scales, _global_scale(p, static))

    def fwd(x, gamma, *static):
        y, scales, inverse_rms = rms_norm_fp8_p.bind(x, gamma, *static, **training.as_dict())
        return dequantize(y, scales, _global_scale(p, static)), (x, gamma, inverse_rms, static)

    def bwd(saved, cotangent):
        x, gamma, inverse_rms, static = saved
        dx, dgamma = rms_backward(cotangent, x, gamma, inverse_rms, p.weight_offset)
        # The calibrated or global scale is a constant of the straight-through rule.
        return (dx, dgamma.astype(gamma.dtype), *(jnp.zeros_like(s) for s in static))

    fn.defvjp(fwd, bwd)
    return fn


@functools.cache
def _add_rms_norm_dequantized(p: NormParams):
    training = dataclasses.replace(p, with_inverse_rms=True)

    @jax.custom_vjp
    def fn(x, residual, gamma, *static):
        y, scales, residual_out = add_rms_norm_fp8_p.bind(
            x, residual, gamma, *static, **p.as_dict()
        )
        return dequantize(y, scales, _global_scale(p, static)), residual_out

    def fwd(x, residual, gamma, *static):
        y, scales, residual_out, inverse_rms = add_rms_norm_fp8_p.bind(
            x, residual, gamma, *static, **training.as_dict()
        )
        out = dequantize(y, scales, _global_scale(p, static)), residual_out
        return out, (x, residual, gamma, inverse_rms, static)

    def bwd(saved, cotangents):
        x, residual, gamma, inverse_rms, static = saved
        ct_normed, ct_residual_out = cotangents
        # residual_out is h rounded to the residual's dtype: straight through as well.
        dx, dresidual, dgamma = add_backward(
            ct_normed, ct_residual_out, x, residual, gamma, inverse_rms, p.weight_offset
        )
        zeros = tuple(jnp.zeros_like(s) for s in static)
        return dx, dresidual, dgamma.astype(gamma.dtype), *zeros

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
