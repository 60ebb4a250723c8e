"""The fused ops: RMSNorm with dynamic per-row FP8 quantisation, as XLA FFI custom calls.

Each public function validates its arguments (TypeError / ValueError naming the
argument), rounds the constants as docs/spec.md says and binds a JAX primitive that
lowers to one custom call on the CPU or CUDA backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fp8norm._primitives import add_rms_norm_fp8_p, rms_norm_fp8_p, round_p
from jax_fp8norm._validation import FLOAT_DTYPES, OUT_DTYPES, check_arrays, make_params
from jax_fp8norm.reference import DEFAULT_EPS


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
    """RMSNorm of each row of ``x``, quantised to FP8 with one dynamic scale per row.

    Args:
      x: ``[..., N]`` float32, float16 or bfloat16, rank >= 1; each of the
        ``prod(x.shape[:-1])`` rows is normalised on its own.
      gamma: ``[N]`` float32, float16 or bfloat16 (need not match ``x``).
      eps: added to the mean square; rounded through ``x.dtype``.
      weight_offset: added to gamma (1.0 for Gemma-style weights); rounded through
        ``x.dtype``.
      scale_ub: upper bound on a row's absolute maximum before it becomes a scale (the
        largest scale is ``scale_ub / FP8_MAX``); None for no bound.
      out_dtype: ``float8_e4m3fn`` (max 448) or ``float8_e4m3fnuz`` (max 240).
      scale_dtype: float32, float16 or bfloat16.

    Returns:
      ``(y, scales)``: ``y`` is ``[..., N]`` in ``out_dtype``; ``scales`` is
      ``[..., 1]`` in ``scale_dtype``. ``f32(y) * f32(scales)`` dequantises.
    """
    check_arrays(x, gamma)
    p = make_params(
        x.dtype,
        eps=eps,
        weight_offset=weight_offset,
        scale_ub=scale_ub,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
    )
    y, scales = rms_norm_fp8_p.bind(x, gamma, **p.as_dict())
    return y, scales


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
    """``h = x + residual`` in float32, then :func:`rms_norm_fp8` of ``h``, in one pass.

    Args:
      x, residual: ``[..., N]``, the same shape and dtype (float32, float16 or bfloat16).
      gamma and the keywords: as for :func:`rms_norm_fp8`.

    Returns:
      ``(y, scales, residual_out)``: ``y`` and ``scales`` as for :func:`rms_norm_fp8`,
      computed from the unrounded float32 ``h``; ``residual_out`` is ``h`` rounded to
      ``x.dtype`` (the next layer's residual).
    """
    check_arrays(x, gamma, residual)
    p = make_params(
        x.dtype,
        eps=eps,
        weight_offset=weight_offset,
        scale_ub=scale_ub,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
    )
    y, scales, residual_out = add_rms_norm_fp8_p.bind(x, residual, gamma, **p.as_dict())
    return y, scales, residual_out


def round_float32(x: jax.Array, dtype) -> jax.Array:
    """Rounds float32 ``x`` to ``dtype`` (float16, bfloat16 or an FP8 E4M3 type) with the
    kernels' own conversion code; for checking it against other implementations."""
    check = jnp.dtype(dtype)
    if jnp.dtype(x.dtype) != jnp.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if check not in FLOAT_DTYPES[1:] + OUT_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or an FP8 E4M3 type, got {check}")
    return round_p.bind(x, dtype=check)
