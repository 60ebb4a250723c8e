"""The pure-jnp reference against an independent float64 NumPy statement of the spec."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import FLOATS, FP8S, random_gamma, random_rows, reference_on_cpu

import jax_fp8norm as fp8norm
from jax_fp8norm.testing import assert_matches_reference, assert_same_bits


def numpy_rms_norm_fp8(
    x,
    gamma,
    residual=None,
    *,
    eps=1e-6,
    weight_offset=0.0,
    scale_ub=None,
    out_dtype=jnp.float8_e4m3fn,
    scale_dtype=jnp.float32,
):
    """docs/spec.md written again in float64 NumPy, rounding with ml_dtypes."""
    x_dtype, out_dtype, scale_dtype = np.dtype(x.dtype), np.dtype(out_dtype), np.dtype(scale_dtype)
    fp8_max = float(ml_dtypes.finfo(out_dtype).max)

    def t(v):  # round through the input dtype
        return np.asarray(v, np.float64).astype(x_dtype).astype(np.float64)

    def s(v):  # round through the scale dtype
        return np.asarray(v, np.float64).astype(scale_dtype).astype(np.float64)

    h = x.astype(np.float64)
    if residual is not None:
        h = h + residual.astype(np.float64)
    n = h.shape[-1]
    with np.errstate(all="ignore"):
        mean_sq = (h * h).sum(-1, keepdims=True) / n
        denom = mean_sq + t(eps)
        r = np.where(denom == 0, 0.0, 1.0 / np.sqrt(denom))
        normed = (h * r) * (gamma.astype(np.float64) + t(weight_offset))
        amax = np.abs(normed).max(-1, keepdims=True)
        ub = np.inf if scale_ub is None else s(scale_ub)
        scale = s(np.minimum(s(amax), ub) / fp8_max)
        recip = np.where((scale == 0) | ~np.isfinite(1.0 / scale), 0.0, 1.0 / scale)
        q = np.clip(normed * recip, -fp8_max, fp8_max)
        # float32's range decides which rows are non-finite.
        row_ok = np.isfinite((h.astype(np.float32) ** 2).sum(-1, keepdims=True, dtype=np.float32))
        row_ok &= np.isfinite(h).all(-1, keepdims=True)
        q = np.where(row_ok, q, np.nan)
        scale = np.where(row_ok, scale, np.nan)
        outs = [q.astype(out_dtype), scale.astype(scale_dtype)]
        if residual is not None:
            outs.append(h.astype(x_dtype))
    return tuple(outs)


@pytest.mark.sampled(28)
@pytest.mark.parametrize(
    "x_dtype,gamma_dtype,out_dtype,scale_dtype",
    list(itertools.product(FLOATS, FLOATS, FP8S, FLOATS)),
    ids=lambda d: jnp.dtype(d).name,
)
def test_reference_matches_float64(x_dtype, gamma_dtype, out_dtype, scale_dtype):
    x = random_rows(30, (64, 300), x_dtype)
    residual = random_rows(31, (64, 300), x_dtype)
    gamma = random_gamma(32, 300, gamma_dtype)
    kw = dict(out_dtype=out_dtype, scale_dtype=scale_dtype)
    ref = reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma, **kw)
    assert_matches_reference(ref, numpy_rms_norm_fp8(x, gamma, **kw))
    ref = reference_on_cpu(fp8norm.reference.add_rms_norm_fp8, x, residual, gamma, **kw)
    assert_matches_reference(ref, numpy_rms_norm_fp8(x, gamma, residual, **kw))


@pytest.mark.parametrize(
    "kw",
    [
        dict(weight_offset=1.0),
        dict(scale_ub=0.3),
        dict(scale_ub=0.3, scale_dtype=jnp.bfloat16, out_dtype=jnp.float8_e4m3fnuz),
        dict(scale_ub=1e6),
        dict(eps=0.5),
        dict(eps=0.0),
    ],
    ids=str,
)
def test_reference_keywords_match_float64(kw):
    x = random_rows(33, (16, 4096), jnp.bfloat16)
    gamma = random_gamma(34, 4096, jnp.float32)
    assert_matches_reference(
        reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma, **kw),
        numpy_rms_norm_fp8(x, gamma, **kw),
    )


def test_reference_edge_rows_match_float64():
    x = random_rows(35, (6, 128), jnp.float32)
    x[0] = 0
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    x[3] *= 1e20  # squares overflow float32
    gamma = random_gamma(36, 128, jnp.float32)
    ref = reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma)
    assert_matches_reference(ref, numpy_rms_norm_fp8(x, gamma))
    y, scales = (np.asarray(a) for a in ref)
    assert scales[0] == 0 and np.isnan(scales[1:4]).all() and np.isfinite(scales[4:]).all()
    assert np.isnan(y[1:4].astype(np.float32)).all()


def test_reference_large_hidden_matches_float64():
    x = random_rows(37, (4, 65536), jnp.float16)
    gamma = random_gamma(38, 65536, jnp.bfloat16)
    assert_matches_reference(
        reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma), numpy_rms_norm_fp8(x, gamma)
    )


def test_dequantised_output_approximates_rmsnorm():
    # The point of the op: f32(y) * scales is RMSNorm(x) * gamma to FP8 precision.
    x = random_rows(39, (32, 1024), jnp.float32)
    gamma = random_gamma(40, 1024, jnp.float32)
    y, scales = reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma, eps=0.0)
    expected = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True)) * gamma
    dequantised = y.astype(np.float32) * scales
    amax = np.abs(expected).max(-1, keepdims=True)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, or of the
    # smallest normal step times the scale for small values.
    bound = np.maximum(np.abs(expected) * 2.0**-4, amax / 448 * 2.0**-6) * 1.01
    assert (np.abs(dequantised - expected) <= bound).all()


def test_rounding_to_the_scale_dtype_matches_ml_dtypes():
    # The reference rounds to float16 / bfloat16 in integer arithmetic (XLA may drop a
    # convert round trip); it must agree with ml_dtypes' conversion everywhere.
    from jax_fp8norm.reference import _round_through

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = [0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001, 0x387FFFFF, 0x7F7F8000, 1]
    values = np.concatenate(
        [
            bits.view(np.float32),
            np.array(edges, np.uint32).view(np.float32),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0], np.float32),
            (rng.standard_normal(1 << 18) * 10.0 ** rng.uniform(-9, 5, 1 << 18)).astype(np.float32),
        ]
    )
    for dtype in (jnp.bfloat16, jnp.float16):
        got = np.asarray(jax.jit(lambda v, dtype=dtype: _round_through(v, dtype))(values))
        with np.errstate(over="ignore", invalid="ignore"):
            want = values.astype(dtype).astype(np.float32)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (jnp.dtype(dtype).name, values[~same][:5], got[~same][:5])


def test_what_the_optimization_barriers_protect():
    """The reference's divisions by constants (FP8_MAX, N) and 1 / sqrt stay one correctly
    rounded division each under jit: XLA's simplifier would turn a division by a constant
    into a multiplication by its rounded reciprocal, and 1 / sqrt into an rsqrt
    (docs/spec.md). Should a barrier stop protecting them, this says so."""
    from jax_fp8norm._groups import divide

    rng = np.random.default_rng(7)
    a = (rng.standard_normal(1 << 16) * 10.0 ** rng.uniform(-5, 5, 1 << 16)).astype(np.float32)
    for constant in (448.0, 240.0, 4099.0, 3.0):
        got = np.asarray(jax.jit(lambda v, c=constant: divide(v, c))(a))
        np.testing.assert_array_equal(
            got.view(np.uint32), (a / np.float32(constant)).view(np.uint32)
        )
        # The rewrite the barrier prevents does change bits here:
        assert np.any(a * (np.float32(1) / np.float32(constant)) != a / np.float32(constant))
    d = np.abs(a) + np.float32(1e-6)
    got = np.asarray(jax.jit(lambda v: divide(jnp.ones_like(v), jnp.sqrt(v)))(d))
    np.testing.assert_array_equal(got.view(np.uint32), (np.float32(1) / np.sqrt(d)).view(np.uint32))


@pytest.mark.parametrize(
    ("op", "kw"),
    [
        ("add_rms_norm_fp8_training", dict(recipe="mxfp8", columnwise=True)),
        ("rms_norm_backward", dict(weight_offset=1.0)),
    ],
    ids=["add-training-columnwise", "backward"],
)
def test_the_tests_twin_programs_are_the_twin(op, kw):
    """reference_on_cpu runs a twin with its exact sums compiled apart (helpers.py): the
    same bits as the twin jitted whole. The forward twin takes each row's sum of squares
    twice (for y and for r), the backward two exact sums, along each axis."""
    x = random_rows(40, (2, 32, 96), jnp.bfloat16, spread=30)
    gamma = random_gamma(41, 96, jnp.float32)
    fn = getattr(fp8norm.reference, op)
    if op == "rms_norm_backward":
        *_, r = reference_on_cpu(fp8norm.reference.rms_norm_fp8_training, x, gamma, **kw)
        args = (random_rows(42, x.shape, jnp.float32, spread=30), x, gamma, np.asarray(r))
    else:
        args = (x, random_rows(43, x.shape, jnp.bfloat16, spread=30), gamma)
    with jax.default_device(jax.devices("cpu")[0]):
        whole = jax.jit(lambda *a: fn(*a, **kw))(*args)
    apart = reference_on_cpu(fn, *args, **kw)
    for got, want in zip(apart, whole, strict=True):
        assert_same_bits(got, np.asarray(want))


def test_the_backward_twins_flush_x_before_their_math(monkeypatch):
    """docs/spec.md, "Subnormals": every input of the backward, x included, is a zero of
    its sign where |v| <= 2^-126, in the rms backward as in the add backward. XLA's CPU
    treats subnormal operands of its arithmetic as zeros itself, so that an unflushed x
    changes no bit of dx or dgamma here (it would where XLA keeps subnormals, a GPU): the
    rows each twin hands its math (reference.backward_rows) are checked instead, with the
    float32 and bfloat16 subnormals, 2^-126 itself and its neighbour above."""
    tiny = np.float32(2.0**-126)
    values = [2.0**-130, -(2.0**-133), tiny, -tiny, np.nextafter(tiny, 1), 2.0**-149, 1.0, -0.0]
    row = np.array(values * 4, np.float32)
    rows_seen = []
    backward_rows = fp8norm.reference.backward_rows

    def spy(dn, h, *rest):
        rows_seen.append(h)
        return backward_rows(dn, h, *rest)

    monkeypatch.setattr(fp8norm.reference, "backward_rows", spy)

    def twins(dn, gamma, r, *xs):
        outs = []
        for x in xs:
            outs.append(fp8norm.reference.rms_norm_backward(dn, x, gamma, r))
            outs.append(
                fp8norm.reference.add_rms_norm_backward(
                    dn, dn.astype(x.dtype), x, jnp.zeros_like(x), gamma, r
                )
            )
        return outs, rows_seen

    xs = [row[None], row[None].astype(jnp.bfloat16)]
    dn, gamma, r = (
        np.ones((1, row.size), np.float32),
        np.ones(row.size, np.float32),
        np.ones((1, 1)),
    )
    with jax.default_device(jax.devices("cpu")[0]):
        _, seen = jax.jit(twins)(dn, gamma, r.astype(np.float32), *xs)
    assert len(seen) == 4
    for x, h in zip([x for x in xs for _ in range(2)], seen, strict=True):
        x32 = np.asarray(x, np.float32)
        want = np.where(np.abs(x32) <= tiny, np.copysign(np.float32(0), x32), x32)
        assert np.count_nonzero(want != x32) >= 8  # subnormals in x, in both dtypes
        np.testing.assert_array_equal(np.asarray(h).view(np.uint32), want.view(np.uint32))
