"""The sum of squares as the spec defines it (docs/spec.md, "The sum of squares"): the
reference, the CPU kernel and every emulated CUDA variant against an exact oracle in
integer arithmetic (tests/exact.py), on long constant rows, random rows and rows whose
squares span a wide range; and against each other on constructed near-ties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact import (
    correctly_rounded_sum_of_squares,
    distance_to_tie,
    inverse_rms,
    rms_norm_rows,
    spec_sum_of_squares,
)
from helpers import (
    EXTENDED,
    FLOATS,
    assert_kernel_matches,
    assert_same_bits,
    is_gpu,
    reference_on_cpu,
    run_on,
)

import jax_fp8norm as fp8norm
from jax_fp8norm import _training

# Constant rows: the padding rows of a batch are constant, and they are where a summation
# order shows most (every addition rounds the same way).
CONSTANTS = (-1.0673828, 3.3, 1.0 / 3.0, 0.1, 1e-3, 700.0)


def _reference_sum_of_squares(x) -> np.ndarray:
    return np.asarray(jax.jit(fp8norm.reference.sum_of_squares)(jnp.asarray(x, jnp.float32)))


# The oracle's outputs by input, each checked against the reference once: every platform
# of a test compares with the same ones.
_oracle_outputs: dict = {}


def _oracle(x, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The oracle's (y, scales, r) of rows ``x``, after holding the reference's sum of
    squares and its (y, scales) to them, bit for bit."""
    key = (x.dtype.str, x.shape, x.tobytes(), eps)
    if key not in _oracle_outputs:
        gamma = np.ones(x.shape[-1], np.float32)
        want = rms_norm_rows(x, gamma, eps=eps)
        want_ss = np.asarray([spec_sum_of_squares(row) for row in x.astype(np.float32)])
        np.testing.assert_array_equal(
            _reference_sum_of_squares(x)[:, 0].view(np.uint32), want_ss.view(np.uint32)
        )
        assert_same_bits(reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma, eps=eps), want)
        eps32 = np.float32(np.asarray(eps, x.dtype))
        r = np.asarray([[inverse_rms(ss, x.shape[-1], eps32)] for ss in want_ss])
        _oracle_outputs[key] = (*want, r)
    return _oracle_outputs[key]


def _check_rows_against_oracle(platform, x, eps: float = 1e-6):
    """The op on ``platform`` against the oracle: bit for bit on cpu and simt, by the
    accuracy rule on a GPU (and the reference bit for bit, once per input). The training
    form's ``r`` (the kernel's sum of squares, seen where no rounding of y hides it) bit for
    bit on cpu and simt."""
    ones = np.ones(x.shape[-1], np.float32)
    y, scales, r = run_on(platform, _training.rms_norm_fp8_training, x, ones, eps=eps)
    want_y, want_scales, want_r = _oracle(x, eps)
    assert_kernel_matches(platform, (y, scales), (want_y, want_scales))
    if not is_gpu(platform):
        assert_same_bits([r], [want_r])


# Rows of 40000 elements and more are the extended tier's (the default tier's reproducer
# test below holds the reference alone on 100000).
LENGTHS = [3, 4099] + [pytest.param(n, marks=EXTENDED) for n in (40000, 100000, 1 << 17)]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
def test_constant_rows_match_the_exact_sum(platform, dtype, length):
    x = np.stack([np.full(length, c) for c in CONSTANTS]).astype(jnp.dtype(dtype))
    _check_rows_against_oracle(platform, x)


@pytest.mark.parametrize("length", [1, 520, 70001])
def test_random_and_wide_range_rows_match_the_exact_sum(platform, length):
    rng = np.random.default_rng(length)
    normal = rng.standard_normal((3, length)) * 10.0 ** rng.uniform(-3, 3, (3, 1))
    # Squares from 2^-100 to 2^100 in one row: most additions drop whole squares' bits.
    wide = np.exp2(rng.uniform(-50, 50, (3, length))) * rng.choice([-1, 1], (3, length))
    x = np.concatenate([normal, wide]).astype(np.float32)
    _check_rows_against_oracle(platform, x)


def test_the_reproducer_of_a_reassociated_reference():
    """100000 x -1.0673828: a lax.reduce with a TwoSum combiner, as XLA's CPU backend
    reassociates it, gave scales 3 ulps off here."""
    x = np.full((1, 100000), -1.0673828, np.float32)
    assert _reference_sum_of_squares(x)[0, 0] == correctly_rounded_sum_of_squares(x[0])


def _near_tie_rows(length: int) -> np.ndarray:
    """Rows whose exact sum of squares lies on or within 2^-96 of an ulp of a float32
    rounding tie, the values at scattered positions of a zero row (so that they fall in
    different lanes, threads and warps), at several binades."""
    rng = np.random.default_rng(length)
    patterns = [
        [1.0, 2.0**-12],  # 1 + 2^-24: a tie, to even (1)
        [1.0, 2.0**-12, 2.0**-60],  # just above that tie: exact rounding says 1 + 2^-23
        [1.0, 2.0**-12, 2.0**-12, 2.0**-12],  # 1 + 3 * 2^-24: a tie, to even (1 + 2^-22)
        [1.0, 2.0**-12, 2.0**-12, 2.0**-12, 2.0**-60],  # just above it
        [1.0, 2.0**-12, 2.0**-60, 2.0**-61, 2.0**-62],
    ]
    rows = []
    for values in patterns:
        for binade in (-40, 0, 30):
            row = np.zeros(length)
            at = rng.choice(length, len(values), replace=False)
            row[at] = np.asarray(values) * 2.0**binade * rng.choice([-1, 1], len(values))
            rows.append(row)
    return np.asarray(rows, np.float32)


@pytest.mark.parametrize("length", [5, 4099])
def test_near_ties_agree_everywhere(platform, length):
    x = _near_tie_rows(length)
    assert all(distance_to_tie(row) * 2**96 < 1 for row in x)
    # The oracle's near-tie rule is the reference's sum of squares and, through the scales,
    # the kernels'.
    _check_rows_against_oracle(platform, x)
    # Some of these rows do round otherwise when rounded exactly: the rule matters here.
    exact = np.asarray([correctly_rounded_sum_of_squares(row) for row in x])
    assert np.any(exact != np.asarray([spec_sum_of_squares(row) for row in x]))


def _rows_with(length: int, rows: list[list[float]], seed: int) -> np.ndarray:
    """Zero rows of ``length`` holding each list's values at scattered positions (so that
    they fall in different lanes, threads and warps), with random signs."""
    rng = np.random.default_rng(seed)
    out = np.zeros((len(rows), length))
    for i, values in enumerate(rows):
        at = rng.choice(length, len(values), replace=False)
        out[i, at] = np.asarray(values) * rng.choice([-1, 1], len(values))
    return out


@pytest.mark.parametrize("length", [5, 4099])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_finite_squares_whose_sum_overflows(platform, dtype, length):
    """Every square finite, their sum past float32: a NaN row (scale and y), as the spec's
    edge cases say; just below the overflow, a finite row."""
    top = 2.0**64 * (1 - 2.0**-8)  # the largest bfloat16 below 2^64: its square is finite
    rows = [
        [2.0**63] * 3,  # 3 * 2^126: finite
        [2.0**63] * 4,  # 2^128: overflows
        [1.5 * 2.0**63] * 2,  # 1.125 * 2^128: overflows, each square 1.125 * 2^127
        [top],  # 2^128 - 2^121 + 2^112: finite, near the top
        [top, 2.0**52],  # the same plus 2^104: still finite
        [top, 2.0**63],  # plus 2^126: overflows
        [2.0**64],  # a square that overflows itself
    ]
    x = _rows_with(length, rows, length).astype(jnp.dtype(dtype))
    squares = [sum(v * v for v in row) for row in rows]
    overflow = np.asarray(squares) >= 2.0**128 * (1 - 2.0**-25)  # rounds past FLT_MAX
    assert list(overflow) == [False, True, True, False, False, True, True]
    y, scales, _ = _oracle(x)
    assert np.isnan(scales[overflow]).all() and np.isfinite(scales[~overflow]).all()
    assert (y[overflow].view(np.uint8) == 0x7F).all()
    _check_rows_against_oracle(platform, x)


@pytest.mark.parametrize("length", [5, 4099])
def test_squares_at_the_flushing_boundary(platform, length):
    """Values near 2^-63, whose squares are near 2^-126 (float32's smallest normal): a
    square of 2^-63 or more counts, one below it counts as zero. Beside 2^-52 (a square of
    2^-104, whose ulp is 2^-127) each counted square moves the sum by two ulps; eps = 0
    lets the sum reach the scales."""
    below = float(np.nextafter(np.float32(2.0**-63), np.float32(0)))
    above = float(np.nextafter(np.float32(2.0**-63), np.float32(1)))
    rows = [
        [2.0**-52],
        [2.0**-52, 2.0**-63],  # + 2^-126
        [2.0**-52] + [2.0**-63] * 3,  # + 3 * 2^-126
        [2.0**-52] + [below] * 3,  # squares below 2^-126: + 0
        [2.0**-52] + [above] * 2,  # + 2 * (1 + 2^-22 + 2^-46) 2^-126
        [2.0**-63] * length,  # a mean square of exactly 2^-126
        [below] * length,  # every square counts as zero: ss = 0, r = 0
    ]
    x = _rows_with(length, rows, length + 1).astype(np.float32)
    _, scales, _ = _oracle(x, eps=0.0)
    # The counted squares show in the scales (a larger sum, a smaller scale); the
    # uncounted ones do not.
    assert scales[0, 0] > scales[1, 0] > scales[2, 0] and scales[0, 0] > scales[4, 0]
    assert scales[3, 0] == scales[0, 0] and scales[6, 0] == 0 and scales[5, 0] > 0
    _check_rows_against_oracle(platform, x, eps=0.0)
