"""The exact sums of the reference twins (docs/spec.md, "Exact sums"): each row's sum of
squares and the backward's sums, in integer arithmetic, so that their bits depend on no
order of XLA's. :mod:`jax_fp8norm.reference` states the kernels' math with them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._groups import as_bits, from_bits

# The sum of squares in integer arithmetic. A float32 square x * x is M^2 * 2^(2E) with M
# its 24-bit significand: an integer of at most 48 bits at an even bit offset. Placed on one
# fixed-point grid and added as 16-bit limbs in uint32, the squares sum exactly, and integer
# addition gives the same result in any order, so no choice of XLA's (reduction order,
# fusion, reassociation, FMA contraction) can change it. The grid starts at 2^-172: squares
# below 2^-126 (|x| < 2^-63, float32 subnormals) count as zero, as the kernels flush them.
_LIMB_BITS = 16
_LIMB_MASK = (1 << _LIMB_BITS) - 1
# Elements summed before carrying: a limb takes at most one piece (below 2^16) from each
# element, so 2^16 elements' pieces, plus a carry below 2^16, stay below 2^32. The
# chunks' 16-bit limbs then add up the same way, at most 2^16 of them.
_CHUNK = 1 << 16
_MAX_CHUNKS = 1 << 16
_MIN_EXPONENT = 64  # biased float32 exponent of 2^-63: the smallest |x| whose square counts
_MAX_EXPONENT = 190  # of 2^63: |x| >= 2^64 has a square of 2^128 or more, beyond float32
# 16-bit limbs of the grid: a square is below 2^(48 + 252) on it, 2^16 chunks of 2^16 of
# them below 2^332, so 21 limbs hold any row of at most 2^32 elements.
_LIMBS = 21
# The rounding window below the highest nonzero limb (see _round_sum).
_WINDOW = 6


def _square_limbs(h: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """Each element's exact square on the grid: (the index of its lowest 16-bit limb, the four
    16-bit pieces at that limb and the three above it)."""
    u32 = jnp.uint32
    bits = as_bits(h)
    exponent = (bits >> 23) & u32(0xFF)
    counted = (exponent >= _MIN_EXPONENT) & (exponent <= _MAX_EXPONENT)
    significand = jnp.where(counted, (bits & u32(0x7FFFFF)) | u32(0x800000), u32(0))
    # The square in three 16-bit limbs, from products of at most 32 bits.
    m0, m1 = significand & u32(_LIMB_MASK), significand >> 16
    low = m0 * m0
    middle = u32(2) * m1 * m0 + (low >> 16)
    high = m1 * m1 + (middle >> 16)  # below 2^16: the square is below 2^48
    limbs = (low & u32(_LIMB_MASK), middle & u32(_LIMB_MASK), high)
    # Bit offset on the grid: 2 * (exponent - 64), even, 0..252.
    offset = u32(2) * (jnp.clip(exponent, _MIN_EXPONENT, _MAX_EXPONENT) - u32(_MIN_EXPONENT))
    base, shift = offset >> 4, offset & u32(15)
    back = u32(16) - shift  # 16 when shift is 0: a uint32 shifted right by 16 of a limb is 0
    pieces = [(limbs[0] << shift) & u32(_LIMB_MASK)]
    for k in (1, 2):
        pieces.append(((limbs[k] << shift) | (limbs[k - 1] >> back)) & u32(_LIMB_MASK))
    pieces.append(limbs[2] >> back)
    return base, pieces


def _carry(limbs: jax.Array) -> jax.Array:
    """Limbs [..., L] of any uint32 values below 2^32 - 2^16 to 16-bit limbs of the same
    number (the carry out of the top limb must be 0, which _LIMBS guarantees)."""

    def step(carry, limb):
        total = limb + carry
        return total >> _LIMB_BITS, total & jnp.uint32(_LIMB_MASK)

    zero = jnp.zeros_like(limbs[..., 0])  # typed as the limbs are (inside shard_map too)
    _, out = jax.lax.scan(step, zero, jnp.moveaxis(limbs, -1, 0))
    return jnp.moveaxis(out, 0, -1)


def _exact_sum_limbs(h: jax.Array) -> jax.Array:
    """The exact sum of squares of each row of float32 ``h`` [R, N], as 16-bit limbs [R, 21]
    on the grid (value = sum of limbs[l] * 2^(16 l) * 2^-172)."""
    rows, n = h.shape
    chunks = max(1, -(-n // _CHUNK))
    if chunks > _MAX_CHUNKS:
        raise ValueError(f"rows of {n} elements: at most {_CHUNK * _MAX_CHUNKS} supported")
    width = -(-n // chunks)
    h = jnp.pad(h, ((0, 0), (0, chunks * width - n)))  # zeros add nothing
    base, pieces = _square_limbs(h.reshape(rows * chunks, width))
    return _magnitude_limbs(base, pieces, rows, chunks)


def _round_sum(limbs: jax.Array, grid_exponent: int = -172, near_ties: bool = True) -> jax.Array:
    """The float32 of the exact sum in 16-bit ``limbs`` [R, L] (value: sum of limbs[l] *
    2^(16 l + grid_exponent)), rounded to nearest, ties to even, with the exponent range
    unbounded, then +inf past float32 and +0 below 2^-126. ``near_ties``: as the spec's "The
    sum of squares" says, a sum within 2^-26 of an ulp of a rounding tie rounds as the tie
    (s + RN(S - s), s = RN(S), rounded once more); the compensated float32 sums of the
    kernels round those near-ties so. Without it, the float32 nearest to the sum."""
    u32 = jnp.uint32
    rows, count = limbs.shape
    index = jnp.arange(count, dtype=jnp.int32)
    nonzero = limbs != 0
    top = jnp.max(jnp.where(nonzero, index, -1), axis=-1)  # -1: the sum is 0
    # Six limbs from the top down (zeros below limb 0), and whether any limb below them is
    # nonzero.
    padded = jnp.concatenate([jnp.zeros((rows, _WINDOW), u32), limbs], axis=-1)
    at = top[:, None] + _WINDOW - jnp.arange(_WINDOW, dtype=jnp.int32)[None, :]
    g = jnp.take_along_axis(padded, jnp.maximum(at, 0), axis=-1)
    below = jnp.any(nonzero & (index[None, :] < (top - (_WINDOW - 1))[:, None]), axis=-1)
    # Shift the window left so that the sum's leading bit is bit 79 of five 16-bit limbs.
    shift = (jax.lax.clz(g[:, 0]) - u32(16)).astype(u32)  # 0..15 for a nonzero top limb
    shift = jnp.where(top >= 0, shift, u32(0))
    back = u32(16) - shift
    w = [((g[:, k] << shift) | (g[:, k + 1] >> back)) & u32(_LIMB_MASK) for k in range(5)]
    left_out = g[:, 5] & ((u32(1) << back) - u32(1))
    # 24 significant bits, the next 26 (the half-ulp is their bit 25), and whether all the
    # bits below those are zero.
    significand = (w[0] << 8) | (w[1] >> 8)
    fraction = ((w[1] & u32(0xFF)) << 18) | (w[2] << 2) | (w[3] >> 14)
    rest_zero = ((w[3] & u32(0x3FFF)) == 0) & (w[4] == 0) & (left_out == 0) & ~below
    half = u32(1 << 25)
    if near_ties:
        near_tie = (
            (fraction == half - 1) | (fraction == half) | ((fraction == half + 1) & rest_zero)
        )
        up = jnp.where(near_tie, (significand & u32(1)) == 1, fraction >= half)
    else:
        odd = (significand & u32(1)) == 1
        up = (fraction > half) | ((fraction == half) & (~rest_zero | odd))
    significand = significand + up.astype(u32)
    carried = significand >> 24  # rounded up to 2^24
    significand = jnp.where(carried == 1, u32(1 << 23), significand)
    # The leading bit is bit 16 * top + 15 - shift of the grid.
    leading = top * 16 + 15 - shift.astype(jnp.int32) + carried.astype(jnp.int32)
    biased = leading + grid_exponent + 127
    finite = from_bits((jnp.maximum(biased, 0).astype(u32) << 23) | (significand & u32(0x7FFFFF)))
    result = jnp.where(biased >= 255, jnp.float32(np.inf), finite)
    return jnp.where((top >= 0) & (biased > 0), result, jnp.float32(0))


def sum_of_squares(h: jax.Array) -> jax.Array:
    """The spec's sum of squares of each row of float32 ``h`` [..., N]: the float32 nearest
    to the exact sum of the exact squares (docs/spec.md, "The sum of squares"), computed in
    integer arithmetic that no XLA rewrite can change. +inf where the sum overflows float32,
    NaN where a row holds NaN or +-Inf. Returns shape ``h.shape[:-1] + (1,)``."""
    h = jnp.asarray(h, jnp.float32)
    lead, n = h.shape[:-1], h.shape[-1]
    if n == 0 or int(np.prod(lead)) == 0:
        return jnp.zeros(lead + (1,), jnp.float32)
    rows = h.reshape(-1, n)
    exponent = (as_bits(rows) >> 23) & jnp.uint32(0xFF)
    total = _round_sum(_exact_sum_limbs(rows))
    overflow = jnp.any(exponent > _MAX_EXPONENT, axis=-1)
    total = jnp.where(overflow, jnp.float32(np.inf), total)
    total = jnp.where(jnp.any(exponent == 0xFF, axis=-1), jnp.float32(np.nan), total)
    return total.reshape(lead + (1,))


# The backward's sums (docs/spec.md, "Training: the backward pass"): float32 terms of
# either sign, summed exactly on a grid whose bit 0 is 2^-149. A finite term below 2^-126
# counts as zero (flushed). A normal term is m * 2^(e - 1) units (m its 24-bit significand,
# e its biased exponent): three 16-bit pieces at limb (e - 1) // 16. The positive and the
# negative terms are summed apart, in the same integer limbs as the sum of squares, and
# subtracted.
_TERM_GRID_EXPONENT = -149


def _term_limbs(bits: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """Each normal term's magnitude on the grid: (its lowest limb, three 16-bit pieces)."""
    u32 = jnp.uint32
    exponent = (bits >> 23) & u32(0xFF)
    normal = (exponent > 0) & (exponent < 0xFF)
    significand = jnp.where(normal, (bits & u32(0x7FFFFF)) | u32(0x800000), u32(0))
    m0, m1 = significand & u32(_LIMB_MASK), significand >> 16
    offset = jnp.maximum(exponent, u32(1)) - u32(1)  # 0..254
    base, shift = offset >> 4, offset & u32(15)
    back = u32(16) - shift
    pieces = [
        (m0 << shift) & u32(_LIMB_MASK),
        ((m1 << shift) | (m0 >> back)) & u32(_LIMB_MASK),
        m1 >> back,
    ]
    return base, pieces


def _magnitude_limbs(base, pieces, rows: int, chunks: int) -> jax.Array:
    """The exact sums of ``rows`` rows of pieces (each row in ``chunks`` cells of [rows *
    chunks, width] arrays) as 16-bit limbs [rows, _LIMBS]: piece k of an element goes to limb
    base + k of its row's chunk, in one scatter-add, then the chunks are carried and added."""
    cell = jnp.arange(rows * chunks, dtype=jnp.uint32)[:, None] * jnp.uint32(_LIMBS) + base
    at = jnp.stack([cell + jnp.uint32(k) for k in range(len(pieces))])
    sums = jnp.zeros((rows * chunks * _LIMBS,), jnp.uint32)
    sums = sums.at[at.reshape(-1)].add(jnp.stack(pieces).reshape(-1))
    limbs = _carry(sums.reshape(rows, chunks, _LIMBS))
    if chunks > 1:
        limbs = _carry(limbs.sum(axis=1, dtype=jnp.uint32))
    return limbs.reshape(rows, _LIMBS)


def _subtract(big: jax.Array, small: jax.Array) -> jax.Array:
    """``big - small`` of 16-bit limbs [R, L], big >= small."""

    def step(borrow, limbs):
        b, s = limbs
        difference = b + jnp.uint32(1 << _LIMB_BITS) - s - borrow
        return jnp.uint32(1) - (difference >> _LIMB_BITS), difference & jnp.uint32(_LIMB_MASK)

    zero = jnp.zeros_like(big[..., 0])
    _, out = jax.lax.scan(step, zero, (jnp.moveaxis(big, -1, 0), jnp.moveaxis(small, -1, 0)))
    return jnp.moveaxis(out, 0, -1)


def exact_sum(terms: jax.Array, axis: int = -1) -> jax.Array:
    """The backward's sum of float32 ``terms`` along ``axis``: the float32 nearest to the
    exact sum of the terms (ties to even), a term below 2^-126 counting as zero, then +-inf
    past float32's largest and +0 below 2^-126 (an exact zero included). NaN where a term is
    NaN or the terms hold both infinities, +-inf where they hold one. The same whatever the
    order, in integer arithmetic that no XLA rewrite can change. ``axis`` is removed."""
    terms = jnp.moveaxis(jnp.asarray(terms, jnp.float32), axis, -1)
    lead, k = terms.shape[:-1], terms.shape[-1]
    rows = int(np.prod(lead))
    if k == 0 or rows == 0:
        return jnp.zeros(lead, jnp.float32)
    chunks = max(1, -(-k // _CHUNK))
    if chunks > _MAX_CHUNKS:
        raise ValueError(f"sums of {k} terms: at most {_CHUNK * _MAX_CHUNKS} supported")
    width = -(-k // chunks)
    flat = jnp.pad(terms.reshape(rows, k), ((0, 0), (0, chunks * width - k)))
    bits = as_bits(flat.reshape(rows * chunks, width))
    base, pieces = _term_limbs(bits)
    negative = (bits >> 31) == 1
    sums = [
        _magnitude_limbs(base, [jnp.where(sign, p, jnp.uint32(0)) for p in pieces], rows, chunks)
        for sign in (~negative, negative)
    ]
    positive, negative_sum = sums
    index = jnp.arange(_LIMBS, dtype=jnp.int32)
    differ = jnp.max(jnp.where(positive != negative_sum, index, -1), axis=-1)
    at = jnp.maximum(differ, 0)[:, None]
    below = (jnp.take_along_axis(positive, at, -1) < jnp.take_along_axis(negative_sum, at, -1))[
        :, 0
    ]
    big = jnp.where(below[:, None], negative_sum, positive)
    small = jnp.where(below[:, None], positive, negative_sum)
    magnitude = _round_sum(_subtract(big, small), _TERM_GRID_EXPONENT, near_ties=False)
    total = jnp.where(below & (magnitude != 0), -magnitude, magnitude)
    total = jnp.where(differ < 0, jnp.float32(0), total)
    exponent = (bits >> 23) & jnp.uint32(0xFF)
    mantissa = bits & jnp.uint32(0x7FFFFF)
    special = (exponent == 0xFF).reshape(rows, -1)
    nan = jnp.any(special & (mantissa != 0).reshape(rows, -1), axis=-1)
    plus_inf = jnp.any(
        special & (mantissa == 0).reshape(rows, -1) & ~negative.reshape(rows, -1), -1
    )
    minus_inf = jnp.any(
        special & (mantissa == 0).reshape(rows, -1) & negative.reshape(rows, -1), -1
    )
    total = jnp.where(plus_inf, jnp.float32(np.inf), total)
    total = jnp.where(minus_inf, jnp.float32(-np.inf), total)
    total = jnp.where(nan | (plus_inf & minus_inf), jnp.float32(np.nan), total)
    return total.reshape(lead)
