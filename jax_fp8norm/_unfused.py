"""The unfused layers the benchmarks, the main job, the examples and the layer's
``recipe="bfloat16"`` compare with or run: the RMSNorm a user writes and the unquantised
layer, in float32 and differentiated by jax. Not the kernels' math (jax_fp8norm.reference
states that); jax_fp8norm.reference re-exports both."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fp8norm._params import DEFAULT_EPS


def textbook_rms_norm(
    h: jax.Array, gamma: jax.Array, eps: float = DEFAULT_EPS, weight_offset: float = 0.0
) -> jax.Array:
    """The RMSNorm a user writes, in float32 and differentiable by jax: ``h * rsqrt(mean(h
    * h) + eps) * (gamma + weight_offset)``. Not the kernels' math (the twins above state
    that): the unfused comparison the layer, the benchmarks, the main job and the examples
    draw."""
    h = h.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return h * r * (gamma.astype(jnp.float32) + weight_offset)


def unquantized_rms_norm_dense(
    x: jax.Array,
    gamma: jax.Array,
    w: jax.Array,
    residual: jax.Array | None = None,
    *,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
):
    """:func:`jax_fp8norm.rms_norm_dense` without quantisation, for comparison
    (differentiated by jax): ``h = x (+ residual)`` and its :func:`textbook_rms_norm`, the
    matmul in ``x.dtype`` accumulated in float32 (a plain bfloat16 layer for bfloat16
    inputs). ``w``: ``[K, *F]``, as the layer's. Returns ``out`` (``[..., *F]``) in
    ``x.dtype``, and with a residual ``(out, h in the residual's dtype)``."""
    h = x.astype(jnp.float32)
    if residual is not None:
        h = h + residual.astype(jnp.float32)
    n = textbook_rms_norm(h, gamma, eps, weight_offset).astype(x.dtype)
    flat = w.reshape(w.shape[0], -1).astype(x.dtype)
    out = jnp.matmul(n, flat, preferred_element_type=jnp.float32).astype(x.dtype)
    out = out.reshape(*out.shape[:-1], *w.shape[1:])
    return out if residual is None else (out, h.astype(residual.dtype))
