"""The ops' outputs in the layouts other JAX quantisation libraries take.

qwix (``qwix.QArray(qvalue, scale)``, dequantised as ``qvalue * broadcast(scale)``) wants:
a float scale (float32 or bfloat16: it refuses ``float8_e8m0fnu`` and ``float8_e4m3fn``
scales), of the rank of the values, each axis dividing the values' (so ``[..., N // G]``
for the ops' scales as they are, and ``(1, N)`` for per-output-channel weight scales of
``(N,)``); and no second scale, so NVFP4's global scale is folded into the block scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_QWIX_SCALE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def qwix_layout(
    values: jax.Array, scales: jax.Array, *, global_scale=None, scale_dtype=jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """``(qvalue, scale)`` for ``qwix.QArray``: ``values`` as they are (FP8 or FP4 codes);
    ``scales`` (the ops' ``[..., N // G]``, or a weight quantiser's ``(N,)`` per output
    channel of ``[K, N]`` weights) in ``scale_dtype``, times ``global_scale`` (NVFP4's
    decode scale) where given, shaped to the values' rank."""
    values, scales = jnp.asarray(values), jnp.asarray(scales)
    if np.dtype(scale_dtype) not in _QWIX_SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be float32 or bfloat16, got {np.dtype(scale_dtype)}")
    if scales.ndim == values.ndim - 1 and values.ndim >= 2:
        scales = jnp.expand_dims(scales, -2)  # one scale per output channel: (1, N)
    if scales.ndim != values.ndim or any(
        s == 0 or v % s for v, s in zip(values.shape, scales.shape, strict=True)
    ):
        raise ValueError(
            f"scales of shape {tuple(scales.shape)} do not tile values of shape "
            f"{tuple(values.shape)}"
        )
    scale = scales.astype(jnp.float32)
    if global_scale is not None:
        scale = scale * jnp.reshape(jnp.asarray(global_scale, jnp.float32), ())
    return values, scale.astype(scale_dtype)


def to_qwix(values: jax.Array, scales: jax.Array, *, global_scale=None, scale_dtype=jnp.float32):
    """A ``qwix.QArray`` of ``values`` and ``scales`` (:func:`qwix_layout`); needs qwix.

    ``qwix.dequantize(to_qwix(y, scales))`` equals :func:`jax_fp8norm.dequantize` of the
    same outputs, bit for bit without a global scale (with one, the product is rounded
    once more where it is folded in)."""
    try:
        import qwix
    except ImportError as error:
        raise ImportError("to_qwix needs qwix: `python -m pip install qwix`") from error
    qvalue, scale = qwix_layout(values, scales, global_scale=global_scale, scale_dtype=scale_dtype)
    return qwix.QArray(qvalue=qvalue, scale=scale, qtype=qvalue.dtype)


__all__ = ["qwix_layout", "to_qwix"]
