"""Gradients. The FP8 outputs of the ops are not differentiable: JAX gives a cotangent the
dtype of its primal, so a gradient reaching ``y`` would be rounded to FP8 (and mostly
underflow to zero). ``jax.grad`` through :func:`jax_fp8norm.rms_norm_fp8` or
:func:`jax_fp8norm.add_rms_norm_fp8` therefore raises an error that says so.

What training code differentiates instead is the dequantised output, ``f32(y) *
f32(scales)``: :func:`rms_norm_fp8_dequantized` and :func:`add_rms_norm_fp8_dequantized`
run the fused kernel forward and, backward, the straight-through rule: the cotangent of the
dequantised output flows back as the gradient of the unquantised RMSNorm
``h * rsqrt(mean(h^2) + eps) * (gamma + weight_offset)``, computed in float32, to x,
gamma and the residual (rounding, clamping and scale_ub are treated as the identity).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from jax_fp8norm._primitives import add_rms_norm_fp8_p, rms_norm_fp8_p
from jax_fp8norm._validation import NormParams, validate
from jax_fp8norm.reference import DEFAULT_EPS


def _no_gradient(public_name: str):
    def rule(primals, tangents, **params):
        raise TypeError(
            f"jax_fp8norm.{public_name} has no gradient: its output y is FP8, and a "
            "cotangent rounded to FP8 would be mostly zeros. Differentiate "
            f"jax_fp8norm.{public_name}_dequantized (the same kernel forward, a "
            "straight-through RMSNorm gradient backward), or stop_gradient the inputs."
        )

    return rule


ad.primitive_jvps[rms_norm_fp8_p] = _no_gradient("rms_norm_fp8")
ad.primitive_jvps[add_rms_norm_fp8_p] = _no_gradient("add_rms_norm_fp8")


def _rms_norm_f32(h: jax.Array, gamma: jax.Array, p: NormParams) -> jax.Array:
    """The unquantised RMSNorm in float32, whose gradient is the straight-through one."""
    h = h.astype(jnp.float32)
    mean_square = jnp.mean(h * h, axis=-1, keepdims=True)
    return h * jax.lax.rsqrt(mean_square + p.eps) * (gamma.astype(jnp.float32) + p.weight_offset)


def _dequantize(y: jax.Array, scales: jax.Array) -> jax.Array:
    return y.astype(jnp.float32) * scales.astype(jnp.float32)


@functools.cache
def _rms_norm_dequantized(p: NormParams):
    @jax.custom_vjp
    def fn(x, gamma):
        return _dequantize(*rms_norm_fp8_p.bind(x, gamma, **p.as_dict()))

    def fwd(x, gamma):
        return fn(x, gamma), (x, gamma)

    def bwd(saved, cotangent):
        x, gamma = saved
        _, vjp = jax.vjp(lambda x, g: _rms_norm_f32(x, g, p), x, gamma)
        return vjp(cotangent)

    fn.defvjp(fwd, bwd)
    return fn


@functools.cache
def _add_rms_norm_dequantized(p: NormParams):
    @jax.custom_vjp
    def fn(x, residual, gamma):
        y, scales, residual_out = add_rms_norm_fp8_p.bind(x, residual, gamma, **p.as_dict())
        return _dequantize(y, scales), residual_out

    def fwd(x, residual, gamma):
        return fn(x, residual, gamma), (x, residual, gamma)

    def bwd(saved, cotangents):
        x, residual, gamma = saved
        ct_normed, ct_residual_out = cotangents
        h = x.astype(jnp.float32) + residual.astype(jnp.float32)
        _, vjp = jax.vjp(lambda h, g: _rms_norm_f32(h, g, p), h, gamma)
        ct_h, ct_gamma = vjp(ct_normed)
        # residual_out is h rounded to the residual's dtype: straight through as well.
        ct_h = ct_h + ct_residual_out.astype(jnp.float32)
        return ct_h.astype(x.dtype), ct_h.astype(residual.dtype), ct_gamma

    fn.defvjp(fwd, bwd)
    return fn


# The keywords of the ops, with their defaults.
_KEYWORDS = {
    "eps": DEFAULT_EPS,
    "weight_offset": 0.0,
    "scale_ub": None,
    "out_dtype": jnp.float8_e4m3fn,
    "scale_dtype": jnp.float32,
}


def _params(x, gamma, residual, keywords: dict) -> NormParams:
    unknown = sorted(set(keywords) - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; expected {sorted(_KEYWORDS)}")
    return validate(x, gamma, residual, **(_KEYWORDS | keywords))


def rms_norm_fp8_dequantized(x: jax.Array, gamma: jax.Array, **keywords) -> jax.Array:
    """``f32(y) * f32(scales)`` of :func:`jax_fp8norm.rms_norm_fp8`, differentiable.

    Forward: the fused kernel, then the dequantisation; the value is exactly that of the
    op's outputs. Backward: the straight-through rule (see the module docstring).

    Args: as for :func:`jax_fp8norm.rms_norm_fp8`, keywords included (eps, weight_offset,
    scale_ub, out_dtype, scale_dtype; the same defaults).

    Returns:
      ``[..., N]`` float32.
    """
    return _rms_norm_dequantized(_params(x, gamma, None, keywords))(x, gamma)


def add_rms_norm_fp8_dequantized(
    x: jax.Array, residual: jax.Array, gamma: jax.Array, **keywords
) -> tuple[jax.Array, jax.Array]:
    """``(f32(y) * f32(scales), residual_out)`` of :func:`jax_fp8norm.add_rms_norm_fp8`,
    differentiable with the straight-through rule; ``residual_out``'s cotangent flows to
    ``x`` and ``residual`` unchanged.

    Args: as for :func:`jax_fp8norm.add_rms_norm_fp8`, keywords included.

    Returns:
      ``[..., N]`` float32 and ``[..., N]`` in ``x.dtype``.
    """
    return _add_rms_norm_dequantized(_params(x, gamma, residual, keywords))(x, residual, gamma)
