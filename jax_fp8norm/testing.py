"""The accuracy rule of docs/spec.md as NumPy assertions, for this project's tests and
for users who check their own kernels or models against the reference.

- scales: relative error at most 4 units in the last place of the scale dtype;
- y: every element within one FP8 code step, and at least 99.9% identical;
- residual_out: within one unit in the last place of the input dtype.
Power-of-two scales (``power_of_two_scales=True`` or ``float8_e8m0fnu``): at least 99.9%
identical to the reference's and the rest one power of two away; ``y`` obeys its rule
where its group's scale is identical. Scales per group (``[..., N // G]``) are compared
group by group. NaN must stand exactly where the reference has NaN, in every output.
FP4 (NVFP4, MXFP4): scales identical to the reference's in at least 99.9% of groups and
otherwise one e4m3 code (or one power of two) away; where a group's scale is identical,
``y`` within one FP4 step and at least 99.9% identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jax_fp8norm._dtypes import E8M0, FP4

# Explicit mantissa widths and smallest normal exponents: np.finfo does not cover
# every ml_dtypes type on every NumPy version.
_MANTISSA_BITS = {np.dtype(jnp.float32): 23, np.dtype(jnp.float16): 10, np.dtype(jnp.bfloat16): 7}
_MIN_EXP = {np.dtype(jnp.float32): -126, np.dtype(jnp.float16): -14, np.dtype(jnp.bfloat16): -126}

MAX_SCALE_ULP = 4
MAX_RESIDUAL_ULP = 1
MAX_FP8_CODE_STEP = 1
MIN_IDENTICAL_FRACTION = 0.999


def _nan_positions_match(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    a_nan, e_nan = np.isnan(actual), np.isnan(expected)
    if not np.array_equal(a_nan, e_nan):
        where = np.argwhere(a_nan != e_nan)[:5].tolist()
        raise AssertionError(f"{what}: NaN positions differ from the reference, e.g. at {where}")


def ulp_distance(actual, expected) -> np.ndarray:
    """|actual - expected| in units of the last place of ``expected`` (in its dtype)."""
    expected = np.asarray(expected)
    dtype = np.dtype(expected.dtype)
    a = np.asarray(actual).astype(np.float64)
    e = expected.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        exponent = np.floor(np.log2(np.abs(e), where=e != 0, out=np.zeros_like(e)))
        ulp = np.exp2(np.maximum(exponent, _MIN_EXP[dtype]) - _MANTISSA_BITS[dtype])
        same = (a == e) | (np.isnan(a) & np.isnan(e))
        return np.where(same, 0.0, np.abs(a - e) / ulp)


def fp8_code_index(y) -> np.ndarray:
    """Position of each FP8 value on the number line, in code steps (0 for +-0)."""
    bits = np.asarray(y).view(np.uint8).astype(np.int32)
    magnitude = bits & 0x7F
    return np.where(bits & 0x80, -magnitude, magnitude)


def _exponent_steps(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Powers of two between power-of-two scales (0 where equal or both NaN)."""
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        steps = np.abs(np.log2(a) - np.log2(e))
    same = (a == e) | (np.isnan(a) & np.isnan(e))
    return np.where(same, 0.0, steps)


def assert_power_of_two_scales_close(actual, expected) -> np.ndarray:
    """The power-of-two rule for scales; returns where the scales are identical."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    _nan_positions_match(actual.astype(np.float32), expected.astype(np.float32), "scales")
    steps = _exponent_steps(actual, expected)
    if steps.size and steps.max() > 1:
        i = np.unravel_index(np.argmax(steps), steps.shape)
        raise AssertionError(
            f"scales: {steps.max()} powers of two from the reference at {i}; at most 1 allowed"
        )
    identical = steps == 0
    if identical.size and identical.mean() < MIN_IDENTICAL_FRACTION:
        raise AssertionError(
            f"scales: only {identical.mean():.4%} identical to the reference; "
            f"at least {MIN_IDENTICAL_FRACTION:.1%} required"
        )
    return identical


def assert_scales_close(actual, expected, max_ulp: int = MAX_SCALE_ULP) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    _nan_positions_match(actual, expected, "scales")
    dist = ulp_distance(actual, expected)
    if dist.size and dist.max() > max_ulp:
        i = np.unravel_index(np.argmax(dist), dist.shape)
        raise AssertionError(
            f"scales: {dist.max():.1f} ulp from the reference at {i} "
            f"({actual[i]} vs {expected[i]}); at most {max_ulp} allowed"
        )


def assert_residual_close(actual, expected, max_ulp: int = MAX_RESIDUAL_ULP) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    _nan_positions_match(actual, expected, "residual_out")
    dist = ulp_distance(actual, expected)
    if dist.size and dist.max() > max_ulp:
        i = np.unravel_index(np.argmax(dist), dist.shape)
        raise AssertionError(
            f"residual_out: {dist.max():.1f} ulp from the reference at {i}; at most {max_ulp}"
        )


def assert_fp8_close(
    actual,
    expected,
    max_code_step: int = MAX_FP8_CODE_STEP,
    min_identical: float = MIN_IDENTICAL_FRACTION,
) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a32, e32 = actual.astype(np.float32), expected.astype(np.float32)
    _nan_positions_match(a32, e32, "y")
    finite = ~np.isnan(e32)
    step = np.abs(fp8_code_index(actual) - fp8_code_index(expected))[finite]
    if step.size == 0:
        return
    if step.max() > max_code_step:
        bad = np.argwhere((np.abs(fp8_code_index(actual) - fp8_code_index(expected)) > 1) & finite)
        i = tuple(bad[0])
        raise AssertionError(
            f"y: {step.max()} FP8 code steps from the reference at {i} "
            f"({a32[i]} vs {e32[i]}); at most {max_code_step} allowed"
        )
    identical = float(np.mean(step == 0))
    if identical < min_identical:
        raise AssertionError(
            f"y: only {identical:.4%} of elements identical to the reference; "
            f"at least {min_identical:.1%} required"
        )


def fp4_code_index(y) -> np.ndarray:
    """Position of each FP4 E2M1 value on the number line, in code steps (0 for +-0)."""
    bits = np.asarray(y).view(np.uint8).astype(np.int32)
    magnitude = bits & 0x7
    return np.where(bits & 0x8, -magnitude, magnitude)


def _assert_fp4_close(actual: Sequence, expected: Sequence) -> None:
    """The FP4 rule (module docstring) for ``(y, scales)``."""
    y, want_y = np.asarray(actual[0]), np.asarray(expected[0])
    scales, want_scales = np.asarray(actual[1]), np.asarray(expected[1])
    assert (y.dtype, y.shape) == (want_y.dtype, want_y.shape), (y.dtype, y.shape, want_y.shape)
    assert (scales.dtype, scales.shape) == (want_scales.dtype, want_scales.shape)
    _nan_positions_match(scales.astype(np.float32), want_scales.astype(np.float32), "scales")
    if scales.dtype == E8M0:
        steps = _exponent_steps(scales, want_scales)
    else:  # e4m3 codes: their index on the number line
        steps = np.abs(fp8_code_index(scales) - fp8_code_index(want_scales))
        steps = np.where(np.isnan(want_scales.astype(np.float32)), 0, steps)
    if steps.size and steps.max() > 1:
        i = np.unravel_index(np.argmax(steps), steps.shape)
        raise AssertionError(f"scales: {steps.max()} codes from the reference at {i}; at most 1")
    identical = steps == 0
    if identical.size and identical.mean() < MIN_IDENTICAL_FRACTION:
        raise AssertionError(
            f"scales: only {identical.mean():.4%} identical to the reference; "
            f"at least {MIN_IDENTICAL_FRACTION:.1%} required"
        )
    if not y.size:
        return
    keep = np.repeat(identical, y.shape[-1] // identical.shape[-1], axis=-1)
    step = np.abs(fp4_code_index(y) - fp4_code_index(want_y))[keep]
    if step.size and step.max() > 1:
        raise AssertionError(f"y: {step.max()} FP4 steps from the reference; at most 1")
    if step.size and np.mean(step == 0) < MIN_IDENTICAL_FRACTION:
        raise AssertionError(
            f"y: only {np.mean(step == 0):.4%} of elements identical to the reference; "
            f"at least {MIN_IDENTICAL_FRACTION:.1%} required"
        )


def assert_matches_reference(
    actual: Sequence, expected: Sequence, power_of_two: bool | None = None
) -> None:
    """Checks ``(y, scales[, residual_out])`` against the reference's outputs.
    ``power_of_two``: the scales are powers of two (None: if their dtype is e8m0)."""
    assert len(actual) == len(expected), (len(actual), len(expected))
    scales, want_scales = np.asarray(actual[1]), np.asarray(expected[1])
    if np.asarray(actual[0]).dtype == FP4:
        _assert_fp4_close(actual, expected)
        if len(actual) == 3:
            assert_residual_close(actual[2], expected[2])
        return
    if power_of_two is None:
        power_of_two = scales.dtype == E8M0
    if power_of_two:
        identical = assert_power_of_two_scales_close(scales, want_scales)
        y, want_y = np.asarray(actual[0]), np.asarray(expected[0])
        assert y.shape == want_y.shape, (y.shape, want_y.shape)
        if y.size:
            group = y.shape[-1] // identical.shape[-1]
            keep = np.repeat(identical, group, axis=-1)
            assert_fp8_close(y[keep], want_y[keep])
    else:
        assert_fp8_close(actual[0], expected[0])
        assert_scales_close(scales, want_scales)
    if len(actual) == 3:
        assert_residual_close(actual[2], expected[2])


def assert_same_bits(got, want) -> None:
    """Every output of ``got`` equals the one of ``want`` at its position, bit for bit (NaN
    payloads, signed zeros and FP8 codes included), with the same dtype and shape."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = np.asarray(g), np.asarray(w)
        assert (g.dtype, g.shape) == (w.dtype, w.shape), (i, g.dtype, g.shape, w.dtype, w.shape)
        width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[g.dtype.itemsize]
        np.testing.assert_array_equal(
            g.view(width), w.view(width), err_msg=f"output {i} ({g.dtype}) differs in its bits"
        )
