"""The parts of FP4 training beyond round-to-nearest, stated once in jnp (docs/spec.md,
"FP4 training"): the random bits of stochastic rounding, the stochastic rounding of a
scaled value to E2M1, and the Hadamard transform of the weight-gradient GEMM's operands.
The quantisers (jax_fp8norm.quantize) and the kernels' tests read them; the kernels
compute the same bits with src/common/fp4_parts.h.

The random bits of an element are Threefry-2x32 (20 rounds, JAX's own generator) keyed by
the caller's key folded with a stream id, at the counter ``(row, column)`` of the element
in its operand: a function of the key, the stream and the element's place alone, so that
they do not depend on the thread count, the variant, the block size or the platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

from jax_fp8norm._dtypes import FP4

# The streams of the output gradient's two copies: the dgrad copy (blocked along the
# output features) and the wgrad copy (blocked along the rows).
DGRAD_STREAM = 1
WGRAD_STREAM = 2

# The Hadamard transform's fixed signs, one bit per row of a block (bit i set: row i is
# negated before the butterfly), by block size: the same for every layer and step. Drawn
# once from a fixed seed (numpy's ``rng = default_rng(2509)``, then ``rng.integers(0, 2**16)``
# and ``rng.integers(0, 2**32)``); zero is the deterministic transform (every sign +1).
HADAMARD_SIGNS = {16: 0xC05D, 32: 0x6DEB8448}


def key_words(key, name: str = "key") -> jax.Array:
    """The caller's key as Threefry's two uint32 key words: a typed JAX key of the default
    ``threefry2x32`` implementation, or the raw ``uint32[2]`` of ``jax.random.PRNGKey``; a
    ValueError naming ``name`` otherwise."""
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(key)
        if str(impl) != "threefry2x32" or key.shape != ():
            raise ValueError(
                f"{name} must be one threefry2x32 key (jax.random.key(seed)), got a key of "
                f"shape {key.shape} and implementation {impl}"
            )
        return jax.random.key_data(key)
    dtype = getattr(key, "dtype", None)
    if dtype is None or np.dtype(dtype) != np.uint32 or tuple(np.shape(key)) != (2,):
        raise ValueError(
            f"{name} must be a JAX PRNG key (jax.random.key(seed), or the uint32[2] of "
            f"jax.random.PRNGKey), got {type(key).__name__} "
            f"{getattr(key, 'dtype', '')} {tuple(np.shape(key))}"
        )
    return jnp.asarray(key)


def stream_key(words: jax.Array, stream: int) -> jax.Array:
    """``words`` folded with ``stream``: ``threefry_2x32(words, (0, stream))``, what
    ``jax.random.fold_in`` gives for a threefry key."""
    return threefry_2x32(words, jnp.array([0, stream], jnp.uint32))


def random_bits(words: jax.Array, rows: int, cols: int, row0=0) -> jax.Array:
    """uint32 ``[rows, cols]``: element ``(i, j)`` the first output word of
    ``threefry_2x32(words, (row0 + i, j))``; ``row0`` (an int or a traced int32) places
    the block of rows in its operand."""
    if rows * cols == 0:
        return jnp.zeros((rows, cols), jnp.uint32)
    r = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.uint32)[:, None], (rows, cols))
    r = r + jnp.asarray(row0).astype(jnp.uint32)
    c = jnp.broadcast_to(jnp.arange(cols, dtype=jnp.uint32)[None, :], (rows, cols))
    out = threefry_2x32(words, jnp.concatenate([r.ravel(), c.ravel()]))
    return out[: rows * cols].reshape(rows, cols)


def round_fp4(q: jax.Array, bits: jax.Array | None) -> jax.Array:
    """E2M1 codes of float32 ``q`` already scaled and clamped to [-6, 6]: to nearest
    (ties to even) where ``bits`` is None, else stochastically: with ``lo <= |q| <= hi``
    the adjacent E2M1 magnitudes, ``frac = (|q| - lo) / (hi - lo)`` (exact) and ``u =
    (bits >> 8) * 2^-24``, ``hi`` where ``u < frac``, else ``lo``, with ``q``'s sign. A
    magnitude below the smallest normal float32 counts as zero, so that flushing denormals
    cannot change a code."""
    if bits is None:
        return q.astype(FP4)
    f32 = jnp.float32
    a = jnp.abs(q)
    a = jnp.where(a < f32(2.0**-126), f32(0), a)
    # The E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: steps of 0.5 below 2, 1 below 4, 2.
    step = jnp.where(a < 2, f32(0.5), jnp.where(a < 4, f32(1), f32(2)))
    lo = jnp.floor(a / step) * step  # exact: step is a power of two
    frac = (a - lo) / step  # exact; 0 where |q| is representable
    u = (bits >> 8).astype(f32) * f32(2.0**-24)
    magnitude = jnp.where(u < frac, lo + step, lo)
    return jnp.where(jnp.signbit(q), -magnitude, magnitude).astype(FP4)


def signs(d: int, mask: int) -> np.ndarray:
    """The float32 sign vector of ``mask``: -1 where bit i is set."""
    return np.where((mask >> np.arange(d)) & 1, np.float32(-1), np.float32(1)).astype(np.float32)


def hadamard_rows(v: jax.Array, d: int, mask: int) -> jax.Array:
    """``M v`` for float32 ``v [R, C]``, ``R`` a multiple of ``d``: per block of ``d`` rows
    of each column, the signs of ``mask`` (:func:`signs`), then the unnormalised
    Walsh-Hadamard butterfly in float32 (stage ``s`` maps rows ``(i, i + 2^s)``, bit ``s``
    of ``i`` clear, to ``(a + b, a - b)``; stages in increasing ``s``). ``(M X)^T (M G) =
    d X^T G``: the wgrad GEMM's result is multiplied by ``1 / d``."""
    rows, cols = v.shape
    if d & (d - 1) or d < 2 or rows % d:
        raise ValueError(f"the Hadamard transform takes blocks of a power of two rows; got {d}")
    b = v.astype(jnp.float32).reshape(rows // d, d, cols) * signs(d, mask)[None, :, None]
    span = 1
    while span < d:
        b = b.reshape(rows // d, d // (2 * span), 2, span, cols)
        top, bottom = b[:, :, 0], b[:, :, 1]
        b = jnp.stack([top + bottom, top - bottom], axis=2)
        span *= 2
    return b.reshape(rows, cols)
