"""FP8 matmul with the scales this package produces: per-row or per-group activation scales
(the ``scales`` of :func:`jax_fp8norm.rms_norm_fp8`, float or e8m0) and per-output-channel
or per-block weight scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._dtypes import E8M0

FP8_DTYPES = (
    np.dtype(jnp.float8_e4m3fn),
    np.dtype(jnp.float8_e4m3fnuz),
    np.dtype(jnp.float8_e5m2),
)
# What cuDNN's block-scaled GEMM (MXFP8, through jax.nn.scaled_matmul) takes: OCP FP8
# operands, e8m0 scales, blocks of 32 along K.
MXFP8_BLOCK = 32
MXFP8_OPERANDS = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def native_block_scaled_available() -> bool:
    """Whether jax.nn.scaled_matmul runs MXFP8 natively here: the default backend is a
    GPU with block-scaled tensor cores (compute capability 10.0 and newer, Blackwell),
    where jax lowers it to cuDNN. Elsewhere (CPU: no lowering at all) fp8_matmul
    dequantises instead."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    if device.platform != "gpu":
        return False
    return float(getattr(device, "compute_capability", "0")) >= 10.0


def matmul_path(a, a_scales, w, w_scales) -> str:
    """The path :func:`fp8_matmul` takes for these operands: "scaled_matmul" (MXFP8 on
    cuDNN), "fp8_dot" (one scale per row and per output channel: an FP8 GEMM with the
    scales applied to its float32 result) or "dequantize" (scales per group or block: the
    operands dequantised to float32, then a float32 matmul)."""
    per_row = a_scales.shape[-1] == 1
    per_channel = w_scales.ndim == 1
    if per_row and per_channel:
        return "fp8_dot"
    mxfp8 = (
        np.dtype(a_scales.dtype) == E8M0
        and np.dtype(w_scales.dtype) == E8M0
        and np.dtype(a.dtype) in MXFP8_OPERANDS
        and np.dtype(w.dtype) in MXFP8_OPERANDS
        and a.shape[-1] == MXFP8_BLOCK * a_scales.shape[-1]
        and w_scales.ndim == 2
        and w.shape[0] == MXFP8_BLOCK * w_scales.shape[0]
    )
    if mxfp8 and native_block_scaled_available():
        return "scaled_matmul"
    return "dequantize"


def _check(a, a_scales, w, w_scales) -> None:
    for name, value in (("a", a), ("w", w)):
        if np.dtype(value.dtype) not in FP8_DTYPES:
            raise TypeError(f"{name} must be an FP8 array, got {value.dtype}")
    if w.ndim != 2 or a.ndim < 1 or a.shape[-1] != w.shape[0]:
        raise ValueError(f"w must have shape (a.shape[-1], M); got a {a.shape}, w {w.shape}")
    k, m = w.shape
    groups = a_scales.shape[-1] if a_scales.ndim == a.ndim else 0
    if a_scales.ndim != a.ndim or tuple(a_scales.shape[:-1]) != tuple(a.shape[:-1]):
        groups = 0
    if groups == 0 or k % groups != 0:
        raise ValueError(
            "a_scales must have shape a.shape[:-1] + (1,) (per row) or a.shape[:-1] + "
            f"(K // G,) (per group of G dividing K = {k}); got {tuple(a_scales.shape)}"
        )
    per_channel = tuple(w_scales.shape) == (m,)
    per_block = w_scales.ndim == 2 and w_scales.shape[1] == m and w_scales.shape[0] > 0
    if not (per_channel or (per_block and k % w_scales.shape[0] == 0)):
        raise ValueError(
            f"w_scales must have shape ({m},) (per output channel) or (K // B, {m}) (per block "
            f"of B rows of w, B dividing K = {k}); got {tuple(w_scales.shape)}"
        )


def _dequantize_weights(w: jax.Array, w_scales: jax.Array) -> jax.Array:
    scales = w_scales.astype(jnp.float32)
    if scales.ndim == 2:
        scales = jnp.repeat(scales, w.shape[0] // scales.shape[0], axis=0)
    return w.astype(jnp.float32) * scales


def fp8_matmul(
    a: jax.Array,
    a_scales: jax.Array,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """``dequantize(a, a_scales) @ dequantize(w, w_scales)``, accumulated in float32.

    Args:
      a: ``[..., K]`` FP8 activations.
      a_scales: ``[..., 1]`` (one scale per row) or ``[..., K // G]`` (one per group of G
        consecutive elements, e.g. DeepSeek-style 1x128 or MXFP8's 1x32), float32,
        float16, bfloat16 or float8_e8m0fnu: the ``scales`` of
        :func:`jax_fp8norm.rms_norm_fp8`.
      w: ``[K, M]`` FP8 weights.
      w_scales: ``[M]`` (one per output channel) or ``[K // B, M]`` (one per block of B
        rows of ``w`` in each column, e.g. MXFP8 weights with B = 32 and e8m0 scales).
      out_dtype: the result's dtype (bfloat16, float16 or float32).

    Returns:
      ``[..., M]`` in ``out_dtype``. :func:`matmul_path` says how it is computed: with
      per-row and per-channel scales the FP8 operands go to the dot directly
      (``preferred_element_type=float32``), an FP8 GEMM on GPUs that have one; MXFP8
      operands (e8m0 scales, blocks of 32) go to ``jax.nn.scaled_matmul``, cuDNN's
      block-scaled GEMM, on Blackwell GPUs; everything else is dequantised to float32
      first (any backend).
    """
    _check(a, a_scales, w, w_scales)
    path = matmul_path(a, a_scales, w, w_scales)
    if path == "fp8_dot":
        acc = jax.lax.dot_general(
            a, w, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        scaled = acc * a_scales.astype(jnp.float32) * w_scales.astype(jnp.float32)
        return scaled.astype(out_dtype)
    if path == "scaled_matmul":
        rows, k = a.shape[:-1], a.shape[-1]
        lhs = a.reshape(1, -1, k)
        lhs_scales = a_scales.reshape(1, -1, a_scales.shape[-1])
        rhs, rhs_scales = w.T[None], w_scales.T[None]
        out = jax.nn.scaled_matmul(
            lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32
        )
        return out.reshape(*rows, w.shape[1]).astype(out_dtype)
    scales = a_scales.astype(jnp.float32)
    if scales.shape[-1] > 1:
        scales = jnp.repeat(scales, a.shape[-1] // scales.shape[-1], axis=-1)
    a32 = a.astype(jnp.float32) * scales
    out = jax.lax.dot_general(
        a32,
        _dequantize_weights(w, w_scales),
        (((a.ndim - 1,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)


def quantize_per_channel(w: jax.Array, out_dtype=jnp.float8_e4m3fn) -> tuple[jax.Array, jax.Array]:
    """``[K, M]`` weights to FP8 with one float32 scale per output channel (column):
    ``scale = max_k |w[k, m]| / FP8_MAX``; a zero column gets scale 1."""
    fp8_max = float(jnp.finfo(out_dtype).max)
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=0)
    scales = jnp.where(amax > 0, amax / fp8_max, 1.0)
    return (w32 / scales).astype(out_dtype), scales


def quantize_blocks(
    w: jax.Array, block_size: int = MXFP8_BLOCK, out_dtype=jnp.float8_e4m3fn
) -> tuple[jax.Array, jax.Array]:
    """``[K, M]`` weights to MXFP8-style blocks: one e8m0 (power-of-two) scale per block of
    ``block_size`` rows in each column, the smallest power of two >= ``amax / FP8_MAX``
    (at least 2^-126), so that no weight is clipped. Returns ``(w8 [K, M], scales
    [K // block_size, M] float8_e8m0fnu)``."""
    k, m = w.shape
    if block_size <= 0 or k % block_size:
        raise ValueError(f"block_size must be a positive divisor of K = {k}, got {block_size}")
    fp8_max = float(jnp.finfo(out_dtype).max)
    blocks = w.astype(jnp.float32).reshape(k // block_size, block_size, m)
    amax = jnp.max(jnp.abs(blocks), axis=1)
    # q = mantissa * 2^e with mantissa in [0.5, 1): the power of two is 2^(e - 1) when q is
    # one, else 2^e. Exact, where a ceil of log2 may round a power of two up.
    mantissa, e = jnp.frexp(jnp.maximum(amax / fp8_max, 2.0**-126))
    exponent = jnp.where(mantissa == 0.5, e - 1, e)
    w8 = (blocks * jnp.exp2(-exponent.astype(jnp.float32))[:, None, :]).reshape(k, m)
    w8 = w8.astype(out_dtype)
    codes = (exponent + 127).astype(jnp.uint8)
    return w8, jax.lax.bitcast_convert_type(codes, E8M0)
