"""The kernels' shared float32 -> FP8 / float16 / bfloat16 rounding (src/fp8norm_math.h)
against ml_dtypes, on every boundary and tie, on each platform."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import run_on

import jax_fp8norm as fp8norm
from jax_fp8norm.ops import round_float32

TARGETS = [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float16, jnp.bfloat16, jnp.float4_e2m1fn]


def _all_finite_values(dtype) -> np.ndarray:
    """Every finite value of a 8- or 16-bit float type, as float64, sorted, unique."""
    width = np.dtype(dtype).itemsize
    if np.dtype(dtype) == np.dtype(jnp.float4_e2m1fn):
        width = 0.5  # 16 codes, one per byte in NumPy
    bits = np.arange(int(2 ** (8 * width)), dtype=np.uint8 if width <= 1 else np.uint16)
    with np.errstate(invalid="ignore", over="ignore"):
        values = bits.view(dtype).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def _boundary_inputs(dtype) -> np.ndarray:
    """Every representable value, every midpoint (tie) between neighbours, and the float32
    numbers just either side of each, plus values past the largest, subnormal inputs,
    zeros, infinities and NaN."""
    values = _all_finite_values(dtype)
    mids = (values[:-1] + values[1:]) / 2
    top = values[-1]
    step = values[-1] - values[-2]
    beyond = np.array([top + step / 2, top + step, 2 * top, 1e30, 3e38], np.float64)
    candidates = np.concatenate([values, mids, beyond, -beyond])
    with np.errstate(over="ignore"):
        f32 = candidates.astype(np.float32)
    f32 = np.concatenate(
        [
            f32,
            np.nextafter(f32, np.float32(np.inf)),
            np.nextafter(f32, np.float32(-np.inf)),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1e-45], np.float32),
        ]
    )
    return f32


def _same(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    return (actual.view(np.uint8) == expected.view(np.uint8)).reshape(actual.shape + (-1,)).all(
        -1
    ) | (np.isnan(a) & np.isnan(e))


@pytest.mark.parametrize("dtype", TARGETS, ids=lambda d: jnp.dtype(d).name)
def test_boundaries_and_ties_match_ml_dtypes(platform, dtype):
    inputs = _boundary_inputs(dtype)
    (actual,) = run_on(platform, lambda v: (round_float32(v, dtype),), inputs)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = inputs.astype(dtype)
    same = _same(actual, expected)
    if np.dtype(dtype) == np.dtype(jnp.float16) or np.dtype(dtype) == np.dtype(jnp.bfloat16):
        # Only float32 subnormal inputs may differ: they may be flushed to zero (spec).
        tiny = np.abs(inputs) < np.finfo(np.float32).tiny
        same |= tiny & (actual.astype(np.float64) == 0)
    bad = np.flatnonzero(~same)
    assert bad.size == 0, [
        (float(inputs[i]), actual[i].view(np.uint8).tolist(), expected[i].view(np.uint8).tolist())
        for i in bad[:8]
    ]
    # The inputs hold every tie, and ties round both ways (to the even neighbour).
    values = _all_finite_values(dtype)
    ties = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    assert np.isin(ties, inputs).all()
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = ties.astype(dtype).astype(np.float64)
    assert np.any(rounded > ties) and np.any(rounded < ties)


@pytest.mark.parametrize("dtype", TARGETS, ids=lambda d: jnp.dtype(d).name)
def test_random_float32_match_ml_dtypes(platform, dtype):
    rng = np.random.default_rng(0)
    # Random bit patterns over all normal float32 exponents, both signs.
    bits = rng.integers(0x00800000, 0x7F800000, size=200_000, dtype=np.uint32)
    bits |= rng.integers(0, 2, size=bits.size, dtype=np.uint32) << 31
    inputs = bits.view(np.float32)
    (actual,) = run_on(platform, lambda v: (round_float32(v, dtype),), inputs)
    with np.errstate(over="ignore", invalid="ignore"):
        same = _same(actual, inputs.astype(dtype))
    assert same.all(), inputs[~same][:8]


def test_fp8_special_encodings():
    fn = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 464.0, 465.0], np.float32)
    (got,) = run_on("cpu", lambda v: (round_float32(v, jnp.float8_e4m3fn),), fn)
    codes = got.view(np.uint8)
    assert codes[0] & 0x7F == 0x7F and codes[2] & 0x7F == 0x7F  # NaN, no Inf in e4m3fn
    assert codes[4] == 0x80  # -0 is kept
    assert codes[5] == 0x7E  # 464 is the tie between 448 and 480: even mantissa, 448
    assert codes[6] & 0x7F == 0x7F  # past the tie: NaN, as in ml_dtypes
    (got,) = run_on("cpu", lambda v: (round_float32(v, jnp.float8_e4m3fnuz),), fn)
    codes = got.view(np.uint8)
    assert codes[0] == 0x80 and codes[1] == 0x80  # the single NaN code
    assert codes[4] == 0x00  # no -0 in e4m3fnuz
    assert got.dtype == np.dtype(ml_dtypes.float8_e4m3fnuz)


def test_round_rejects_bad_dtypes():
    with pytest.raises(TypeError, match="x must be float32"):
        round_float32(jnp.ones(3, jnp.float16), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="dtype must be"):
        round_float32(jnp.ones(3, jnp.float32), jnp.int8)


@pytest.mark.parametrize(
    "dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz], ids=lambda d: d.__name__
)
def test_reference_fp8_conversion_matches_ml_dtypes(dtype):
    """The one rounding the reference leaves to XLA (docs/spec.md): its float32 -> FP8
    conversion of clamped values, on every boundary and tie, and its NaN code."""
    fp8_max = float(jnp.finfo(dtype).max)
    inputs = _boundary_inputs(dtype)
    inputs = inputs[np.isnan(inputs) | (np.abs(inputs) <= fp8_max)]
    inputs = np.concatenate([inputs, np.float32([np.nan, -np.nan])])
    (actual,) = run_on("cpu", lambda v: (fp8norm.reference._to_fp8(v, dtype),), inputs)
    expected = inputs.astype(dtype).view(np.uint8).copy()
    expected[np.isnan(inputs)] = 0x7F if np.dtype(dtype) == np.dtype(jnp.float8_e4m3fn) else 0x80
    np.testing.assert_array_equal(actual.view(np.uint8), expected)


def test_fp4_special_encodings():
    """FP4 E2M1: saturation at 6 (no Inf), the ties to even, signed zeros, and an odd count
    (its last packed byte holds one code)."""
    v = np.array([6.0, 7.0, np.inf, -np.inf, -0.0, 0.25, 0.75, 2.5, 5.0, -1e-30, 1.75], np.float32)
    (got,) = run_on("cpu", lambda v: (round_float32(v, jnp.float4_e2m1fn),), v)
    codes = got.view(np.uint8).tolist()
    assert codes == [0x7, 0x7, 0x7, 0xF, 0x8, 0x0, 0x2, 0x4, 0x6, 0x8, 0x4]
    assert got.dtype == np.dtype(ml_dtypes.float4_e2m1fn)


def test_reference_fp4_conversion_matches_ml_dtypes():
    """The reference's float32 -> FP4 conversion of clamped values (XLA's), on every
    boundary and tie."""
    inputs = _boundary_inputs(jnp.float4_e2m1fn)
    inputs = inputs[np.abs(inputs) <= 6.0]
    (actual,) = run_on("cpu", lambda v: (v.astype(jnp.float4_e2m1fn),), inputs)
    expected = inputs.astype(ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))
