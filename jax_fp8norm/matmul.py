"""FP8 matmul with the scales this package produces: per-row activation scales (the
``scales`` of :func:`jax_fp8norm.rms_norm_fp8`) and per-output-channel weight scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (
    np.dtype(jnp.float8_e4m3fn),
    np.dtype(jnp.float8_e4m3fnuz),
    np.dtype(jnp.float8_e5m2),
)


def fp8_matmul(
    a: jax.Array,
    a_scales: jax.Array,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """``(f32(a) @ f32(w)) * a_scales * w_scales``, accumulated in float32.

    Args:
      a: ``[..., K]`` FP8 activations. a_scales: ``[..., 1]``, one scale per row.
      w: ``[K, M]`` FP8 weights. w_scales: ``[M]``, one scale per output channel.
      out_dtype: the result's dtype (bfloat16, float16 or float32).

    Returns:
      ``[..., M]`` in ``out_dtype``. The matmul consumes the FP8 operands directly
      (``preferred_element_type=float32``), so a GPU backend may run it as an FP8 GEMM.
    """
    for name, value in (("a", a), ("w", w)):
        if np.dtype(value.dtype) not in FP8_DTYPES:
            raise TypeError(f"{name} must be an FP8 array, got {value.dtype}")
    if w.ndim != 2 or a.shape[-1] != w.shape[0]:
        raise ValueError(f"w must have shape (a.shape[-1], M); got a {a.shape}, w {w.shape}")
    if tuple(a_scales.shape) != tuple(a.shape[:-1]) + (1,):
        raise ValueError(f"a_scales must have shape a.shape[:-1] + (1,), got {a_scales.shape}")
    if tuple(w_scales.shape) != (w.shape[1],):
        raise ValueError(f"w_scales must have shape ({w.shape[1]},), got {w_scales.shape}")
    acc = jax.lax.dot_general(
        a, w, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    scaled = acc * a_scales.astype(jnp.float32) * w_scales.astype(jnp.float32)
    return scaled.astype(out_dtype)


def quantize_per_channel(w: jax.Array, out_dtype=jnp.float8_e4m3fn) -> tuple[jax.Array, jax.Array]:
    """``[K, M]`` weights to FP8 with one float32 scale per output channel (column):
    ``scale = max_k |w[k, m]| / FP8_MAX``; a zero column gets scale 1."""
    fp8_max = float(jnp.finfo(out_dtype).max)
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=0)
    scales = jnp.where(amax > 0, amax / fp8_max, 1.0)
    return (w32 / scales).astype(out_dtype), scales
