"""The building block of a custom_vjp around an FP8 / FP4 matmul (docs/spec.md,
"Training: the training forms, the backward pass and columnwise outputs"): the norm's
codes and, as jax.vjp gives them, a backward function (a pytree, to keep as a
custom_vjp's residual):

    (y, scales, y_t, scales_t), backward = fp8norm.rms_norm_fp8_vjp(
        x, gamma, recipe="mxfp8", columnwise=True)
    dx, dgamma = backward(dn)

The quantisation passes the gradient straight through: ``dn`` is the cotangent of the
normalised ``n = (h * r) * (gamma + weight_offset)`` (that of the dequantised output).
Both of the backward's sums, each row's ``c`` and ``dgamma``'s over the rows, are the
float32 nearest to their exact sums: the bits of ``dx`` and ``dgamma`` do not depend on
the batch, the split of the rows among threads, or the kernel. ``dgamma`` across devices
(data parallelism) is the caller's psum.

Beneath it, the ops' training forms (each row's r saved) and the checked fused backward,
for the tests and the benchmarks: ``rms_norm_fp8_training(x, gamma) -> (y, scales,
inverse_rms)`` and ``rms_norm_backward(dn, x, gamma, inverse_rms) -> (dx, dgamma)``.
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax
from jax.tree_util import Partial

from jax_fp8norm._backward import add_rms_norm_backward_p, rms_norm_backward_p
from jax_fp8norm._checks import check_backward
from jax_fp8norm._params import NormKeywords, as_operand
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm.ops import checked_norm

__all__ = [
    "add_rms_norm_backward",
    "add_rms_norm_fp8_training",
    "add_rms_norm_fp8_vjp",
    "rms_norm_backward",
    "rms_norm_fp8_training",
    "rms_norm_fp8_vjp",
]


@norm_keywords
def rms_norm_fp8_training(
    x: jax.Array,
    gamma: jax.Array,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """:func:`jax_fp8norm.rms_norm_fp8`, also returning each row's ``r`` for the backward.

    Args:
      x, gamma, columnwise, hadamard: as for :func:`jax_fp8norm.rms_norm_fp8`.
      {keywords}

    Returns:
      ``(y, scales, inverse_rms)``: ``y`` and ``scales`` bit for bit those of
      :func:`jax_fp8norm.rms_norm_fp8`; ``inverse_rms`` is ``[..., 1]`` float32, each row's
      ``r = 1 / sqrt(ss / N + eps)``. With ``columnwise``: then ``y_t, scales_t``.
    """
    _, outs = checked_norm(
        (x,), gamma, keywords, columnwise=columnwise, training=True, hadamard=hadamard
    )
    return outs.returned(training=True)


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
    """:func:`jax_fp8norm.add_rms_norm_fp8`, also returning each row's ``r``.

    Args:
      x, residual, gamma, columnwise, hadamard: as for :func:`jax_fp8norm.add_rms_norm_fp8`.
      {keywords}

    Returns:
      ``(y, scales, residual_out, inverse_rms)``; ``inverse_rms`` is ``[..., 1]`` float32.
      With ``columnwise``: then ``y_t, scales_t``.
    """
    _, outs = checked_norm(
        (x, residual), gamma, keywords, columnwise=columnwise, training=True, hadamard=hadamard
    )
    return outs.returned(training=True)


def rms_norm_backward(
    dn: jax.Array,
    x: jax.Array,
    gamma: jax.Array,
    inverse_rms: jax.Array,
    *,
    weight_offset: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """The fused backward of :func:`jax_fp8norm.rms_norm_fp8`.

    Args:
      dn: ``[..., N]`` float32, float16 or bfloat16: the cotangent of the normalised output.
      x, gamma: the forward's.
      inverse_rms: ``[..., 1]`` float32, as :func:`rms_norm_fp8_training` returned it.
      weight_offset: the forward's (rounded through ``x.dtype`` as it was there).

    Returns:
      ``(dx, dgamma)``: ``dx`` is ``[..., N]`` in ``x.dtype``; ``dgamma`` is ``[N]`` float32,
      summed over every row of the call.
    """
    wo = check_backward(dn, x, gamma, inverse_rms, weight_offset=weight_offset)
    operands = (as_operand(a) for a in (dn, x, gamma, inverse_rms))
    dx, dgamma = rms_norm_backward_p.bind(*operands, weight_offset=wo, add=False)
    return dx, dgamma


def add_rms_norm_backward(
    dn: jax.Array,
    d_residual_out: jax.Array,
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    inverse_rms: jax.Array,
    *,
    weight_offset: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused backward of :func:`jax_fp8norm.add_rms_norm_fp8`: ``dh = dx + d_residual_out``
    in float32, the gradient of both ``x`` and ``residual``.

    Args:
      dn: ``[..., N]``: the cotangent of the normalised output.
      d_residual_out: ``[..., N]`` in the residual's dtype: the cotangent of
        ``residual_out``.
      x, residual, gamma: the forward's.
      inverse_rms: ``[..., 1]`` float32, as :func:`add_rms_norm_fp8_training` returned it.
      weight_offset: the forward's.

    Returns:
      ``(dx, dresidual, dgamma)``: ``dh`` rounded to ``x.dtype`` and to the residual's
      dtype, and ``dgamma`` ``[N]`` float32.
    """
    wo = check_backward(dn, x, gamma, inverse_rms, residual, d_residual_out, weight_offset)
    operands = (as_operand(a) for a in (dn, d_residual_out, x, residual, gamma, inverse_rms))
    dx, dresidual, dgamma = add_rms_norm_backward_p.bind(*operands, weight_offset=wo, add=True)
    return dx, dresidual, dgamma


@norm_keywords
def rms_norm_fp8_vjp(
    x: jax.Array,
    gamma: jax.Array,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    **keywords: Unpack[NormKeywords],
) -> tuple[tuple[jax.Array, ...], Partial]:
    """:func:`jax_fp8norm.rms_norm_fp8` for a following FP8 / FP4 matmul, with its backward
    as :func:`jax.vjp` gives one: the codes go to the matmul, the straight-through cotangent
    of ``n`` comes back.

    Args:
      x, gamma, columnwise, hadamard: as for :func:`jax_fp8norm.rms_norm_fp8`.
      {keywords}

    Returns:
      ``(outputs, backward)``: ``outputs`` those of :func:`jax_fp8norm.rms_norm_fp8` (``(y,
      scales)``, then ``y_t, scales_t`` with ``columnwise``), bit for bit; ``backward(dn)``
      takes the cotangent of ``n`` (the matmul's gradient of its dequantised input, of
      ``x``'s shape, float32, float16 or bfloat16) to ``(dx, dgamma)`` with the fused
      backward (:func:`rms_norm_backward`), ``dgamma`` in ``gamma``'s dtype.
      ``backward`` is a :class:`jax.tree_util.Partial` holding ``x``, ``gamma`` and each
      row's ``r``: a pytree, which a ``jax.custom_vjp``'s forward can return as its residual.
    """
    params, outs = checked_norm(
        (x,), gamma, keywords, columnwise=columnwise, training=True, hadamard=hadamard
    )
    backward = Partial(
        _backward_function(_rms_vjp_backward, params.weight_offset),
        as_operand(x),
        as_operand(gamma),
        outs.inverse_rms,
    )
    return outs.returned(training=False), backward


@norm_keywords
def add_rms_norm_fp8_vjp(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    **keywords: Unpack[NormKeywords],
) -> tuple[tuple[jax.Array, ...], Partial]:
    """:func:`jax_fp8norm.add_rms_norm_fp8` with its backward, as :func:`rms_norm_fp8_vjp`.

    Args:
      x, residual, gamma, columnwise, hadamard: as for :func:`jax_fp8norm.add_rms_norm_fp8`.
      {keywords}

    Returns:
      ``(outputs, backward)``: ``outputs`` those of :func:`jax_fp8norm.add_rms_norm_fp8`
      (``(y, scales, residual_out)``, then ``y_t, scales_t``); ``backward(dn,
      d_residual_out)`` returns ``(dx, dresidual, dgamma)`` (:func:`add_rms_norm_backward`),
      ``dgamma`` in ``gamma``'s dtype.
    """
    rows = (x, residual)
    params, outs = checked_norm(
        rows, gamma, keywords, columnwise=columnwise, training=True, hadamard=hadamard
    )
    backward = Partial(
        _backward_function(_add_vjp_backward, params.weight_offset),
        as_operand(x),
        as_operand(residual),
        as_operand(gamma),
        outs.inverse_rms,
    )
    return outs.returned(training=False), backward


@functools.cache
def _backward_function(backward, weight_offset: float):
    """One function per backward and weight_offset: a Partial's function is part of its
    tree structure, so the same one keeps a jitted consumer from tracing again."""
    return functools.partial(backward, weight_offset=weight_offset)


def _rms_vjp_backward(x, gamma, inverse_rms, dn, *, weight_offset):
    dx, dgamma = rms_norm_backward(dn, x, gamma, inverse_rms, weight_offset=weight_offset)
    return dx, dgamma.astype(gamma.dtype)


def _add_vjp_backward(x, residual, gamma, inverse_rms, dn, d_residual_out, *, weight_offset):
    dx, dresidual, dgamma = add_rms_norm_backward(
        dn, d_residual_out, x, residual, gamma, inverse_rms, weight_offset=weight_offset
    )
    return dx, dresidual, dgamma.astype(gamma.dtype)
