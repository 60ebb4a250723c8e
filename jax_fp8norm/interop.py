"""The ops' outputs in the layouts other JAX quantisation libraries take.

qwix (``qwix.QArray(qvalue, scale)``, dequantised as ``qvalue * broadcast(scale)``) wants:
a float scale (float32 or bfloat16: it refuses ``float8_e8m0fnu`` and ``float8_e4m3fn``
scales), of the rank of the values, each axis dividing the values' (so ``[..., N // G]``
for the ops' scales as they are, and ``(1, N)`` for per-output-channel weight scales of
``(N,)``); and no second scale, so NVFP4's global scale is folded into the block scales.

qwix's ``dot_general`` and ``einsum`` (``qwix.dot_general``, ``qwix.einsum``) take such a
``QArray`` as an operand and send its codes to the GEMM as they are. Its quantised-training
path (``QtProvider``'s intercepted ``jax.lax.dot_general``, ``dot_general_qt``, how MaxText
runs it) does not: it calibrates and quantises every float operand, and a ``QArray`` is
not an array it takes. :func:`qwix_dot_general` is the entry point for the norm's codes.
"""

from __future__ import annotations

import functools

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


def _qwix():
    try:
        import qwix
    except ImportError as error:
        raise ImportError("this needs qwix: `python -m pip install qwix`") from error
    return qwix


def to_qwix(values: jax.Array, scales: jax.Array, *, global_scale=None, scale_dtype=jnp.float32):
    """A ``qwix.QArray`` of ``values`` and ``scales`` (:func:`qwix_layout`); needs qwix.

    ``qwix.dequantize(to_qwix(y, scales))`` equals :func:`jax_fp8norm.dequantize` of the
    same outputs, bit for bit without a global scale (with one, the product is rounded
    once more where it is folded in)."""
    qwix = _qwix()
    qvalue, scale = qwix_layout(values, scales, global_scale=global_scale, scale_dtype=scale_dtype)
    return qwix.QArray(qvalue=qvalue, scale=scale, qtype=qvalue.dtype)


def _quantize_like_a_weight(qwix, rhs, contracting, *, qtype, tile_size, calibration_method):
    # As qwix's QtProvider quantises a weight (dot_general.get_how_to_quantize): one scale
    # per element of every axis not contracted, the last contracted axis cut into tiles.
    channelwise = [a for a in range(rhs.ndim) if a not in contracting]
    tiled = {contracting[-1]: tile_size} if tile_size and contracting else None
    return qwix.quantize(
        rhs,
        qtype,
        channelwise_axes=channelwise,
        tiled_axes=tiled,
        calibration_method=calibration_method,
    )


def qwix_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    *,
    rhs_qtype=None,
    rhs_tile_size: int | None = None,
    rhs_calibration_method: str = "absmax",
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """``qwix.dot_general`` of the norm's codes: ``lhs`` a ``qwix.QArray`` (:func:`to_qwix`)
    whose codes and scales reach the GEMM unchanged.

    ``rhs`` is a ``QArray`` used as it is, or an array: with ``rhs_qtype`` it is quantised
    as qwix's ``QtProvider`` quantises a weight (MaxText's ``fp8`` rule: one scale per
    output channel, ``rhs_tile_size`` tiles on the last contracted axis,
    ``rhs_calibration_method``), and without it qwix dequantises ``lhs`` and runs the GEMM in
    float. qwix's interception is off while it runs, so a ``QtProvider`` around the call
    (``qwix.quantize_model``) is not offered the codes' GEMM."""
    qwix = _qwix()
    if not isinstance(lhs, qwix.QArray):
        raise TypeError(
            f"lhs must be a qwix.QArray of the norm's codes (interop.to_qwix(y, scales)), got "
            f"{type(lhs).__name__}: a float lhs is quantised by qwix's own rule"
        )
    (lhs_contracting, rhs_contracting), _ = dimension_numbers
    rhs_contracting = [int(a) % np.ndim(rhs) for a in rhs_contracting]
    if not isinstance(rhs, qwix.QArray) and rhs_qtype is not None:
        if rhs_tile_size is not None and lhs_contracting:
            axis = int(lhs_contracting[-1]) % lhs.ndim
            lhs_tile = lhs.shape[axis] // lhs.scale.shape[axis]
            if lhs.scale.shape[axis] > 1 and lhs_tile != rhs_tile_size:
                raise ValueError(
                    f"rhs_tile_size={rhs_tile_size} differs from lhs's tiles of {lhs_tile} "
                    "on the contracted axis; qwix contracts tiles of one size"
                )
        rhs = _quantize_like_a_weight(
            qwix,
            jnp.asarray(rhs),
            rhs_contracting,
            qtype=rhs_qtype,
            tile_size=rhs_tile_size,
            calibration_method=rhs_calibration_method,
        )
    elif rhs_qtype is not None or rhs_tile_size is not None:
        raise ValueError(
            "rhs_qtype and rhs_tile_size quantise an array rhs: "
            + ("rhs is already a QArray" if isinstance(rhs, qwix.QArray) else "give rhs_qtype")
        )
    call = functools.partial(
        qwix.dot_general,
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    try:
        from qwix._src import interception
    except ImportError:  # a private module: where it has gone, the call runs as it is
        return call()
    return interception.disable_interceptions(call)()


__all__ = ["qwix_dot_general", "qwix_layout", "to_qwix"]
