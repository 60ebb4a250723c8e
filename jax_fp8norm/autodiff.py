"""Gradients. The FP8 outputs of the ops are not differentiable: JAX gives a cotangent the
dtype of its primal, so a gradient reaching ``y`` would be rounded to FP8 (and mostly
underflow to zero). ``jax.grad`` through :func:`jax_fp8norm.rms_norm_fp8` or
:func:`jax_fp8norm.add_rms_norm_fp8` therefore raises an error that says so (the
primitives' JVP rule, in jax_fp8norm._primitives).

What training code differentiates instead is the dequantised output, ``f32(y) *
f32(scales)`` (each scale repeated over its group, times NVFP4's global scale):
:func:`rms_norm_fp8_dequantized` and :func:`add_rms_norm_fp8_dequantized` run the fused
kernel's training form forward (which saves each row's r) and, backward, the fused
backward kernel (jax_fp8norm._vjp, docs/spec.md "Training: the backward pass"): the
straight-through rule, the cotangent of the dequantised output arriving as that of the
normalised ``n`` (rounding, clamping, scale_ub and the choice of scales, dynamic or
calibrated, are treated as the identity), with order-free exact sums for each row's ``c``
and for ``dgamma``.

The twins take the ops' framework shapes (gamma None or broadcast, ``reduction_axes``,
``out_sharding``: jax_fp8norm._shapes) and return ``dtype`` if given, else
``jnp.result_type(x, gamma)`` (``x.dtype`` for gamma None): the float32 product rounded
once to it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jax_fp8norm._params import NormKeywords, NormOutputs, NormParams, global_scale_operand
from jax_fp8norm._shapes import shaped_call
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm._vjp import differentiable_norm
from jax_fp8norm.recipes import dequantize


@dataclasses.dataclass(frozen=True)
class _Dequantize:
    """The head of the differentiable twins: ``f32(y) * f32(scales)`` (times NVFP4's global
    scale) rounded once to ``dtype``, whose cotangent is that of ``n`` (straight through)."""

    params: NormParams
    dtype: np.dtype
    num_operands: ClassVar[int] = 0
    columnwise: ClassVar[bool] = False
    hadamard: ClassVar[None] = None

    def apply(self, outs: NormOutputs, operands: tuple, static: tuple) -> tuple:
        gs = outs.global_scales  # each row's, with global_scale="per_row"
        gs = global_scale_operand(self.params, static) if gs is None else gs
        value = dequantize(outs.y, outs.scales, gs)
        return value.astype(self.dtype), ()

    def check_training(self, x_shape: tuple, operands: tuple) -> None:
        pass

    def kept(self, outs: NormOutputs) -> tuple:
        return ()

    def backward(self, g, operands: tuple, static: tuple, kept: tuple, residuals: tuple) -> tuple:
        # In float32 (exactly g's values), so that a psum of dn over devices adds in float32
        # whatever the value's dtype.
        return g.astype(jnp.float32), ()


@norm_keywords
def rms_norm_fp8_dequantized(
    x: jax.Array,
    gamma: jax.Array | None = None,
    *,
    reduction_axes: int | tuple[int, ...] = -1,
    dtype: DTypeLike | None = None,
    out_sharding=None,
    **keywords: Unpack[NormKeywords],
) -> jax.Array:
    """``f32(y) * f32(scales)`` of :func:`jax_fp8norm.rms_norm_fp8` (each scale repeated
    over its group), differentiable.

    Forward: the fused kernel, then the dequantisation; the value is exactly that of the
    op's outputs. Backward: the straight-through rule (see the module docstring).

    Args:
      x, gamma, reduction_axes, out_sharding: as for :func:`jax_fp8norm.rms_norm_fp8`.
      dtype: the value's dtype (float32, float16 or bfloat16); None for
        ``jnp.result_type(x, gamma)`` (``x.dtype`` for gamma None).
      {keywords}

    Returns:
      ``x.shape`` in ``dtype``: the float32 product rounded once to it.
    """
    shaped = shaped_call(
        (x,), gamma, keywords, reduction_axes=reduction_axes, out_sharding=out_sharding
    )
    params = shaped.call.params
    head = _Dequantize(params, shaped.value_dtype(dtype))
    value = differentiable_norm(params, False, head)(*shaped.operands())
    return shaped.finish(NormOutputs(y=value, scales=None)).y


@norm_keywords
def add_rms_norm_fp8_dequantized(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array | None = None,
    *,
    reduction_axes: int | tuple[int, ...] = -1,
    dtype: DTypeLike | None = None,
    out_sharding=None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, jax.Array]:
    """``(f32(y) * f32(scales), residual_out)`` of :func:`jax_fp8norm.add_rms_norm_fp8`,
    differentiable with the straight-through rule; ``residual_out``'s cotangent flows to
    ``x`` and ``residual`` unchanged.

    Args:
      x, residual, gamma, reduction_axes, out_sharding: as for
        :func:`jax_fp8norm.add_rms_norm_fp8`.
      dtype: as for :func:`rms_norm_fp8_dequantized`.
      {keywords}

    Returns:
      ``x.shape`` in ``dtype`` (as for :func:`rms_norm_fp8_dequantized`) and ``x.shape``
      in ``x.dtype`` (``residual_out``).
    """
    shaped = shaped_call(
        (x, residual), gamma, keywords, reduction_axes=reduction_axes, out_sharding=out_sharding
    )
    params = shaped.call.params
    head = _Dequantize(params, shaped.value_dtype(dtype))
    value, residual_out = differentiable_norm(params, True, head)(*shaped.operands())
    outs = shaped.finish(NormOutputs(y=value, scales=None, residual_out=residual_out))
    return outs.y, outs.residual_out
