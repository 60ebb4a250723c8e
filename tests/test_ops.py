"""The kernels (CPU and GPU) against the pure-jnp reference, under the spec's accuracy rule,
plus the edge cases the spec defines exactly."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact import nearest_in_dtype, rms_norm_rows
from helpers import (
    EXTENDED,
    FLOATS,
    FP8S,
    assert_kernel_matches,
    assert_same_bits,
    check_against_reference,
    random_gamma,
    random_rows,
    reference_on_cpu,
    run_on,
)

import jax_fp8norm as fp8norm

FP8_MAX = {jnp.float8_e4m3fn: 448.0, jnp.float8_e4m3fnuz: 240.0}


def check_rms(platform, x, gamma, *, jit=True, **kw):
    return check_against_reference(platform, "rms_norm_fp8", x, gamma, jit=jit, **kw)


def check_add(platform, x, residual, gamma, *, jit=True, **kw):
    return check_against_reference(platform, "add_rms_norm_fp8", x, residual, gamma, jit=jit, **kw)


@pytest.mark.sampled(48)
@pytest.mark.parametrize(
    "x_dtype,gamma_dtype,out_dtype,scale_dtype",
    list(itertools.product(FLOATS, FLOATS, FP8S, FLOATS)),
    ids=lambda d: jnp.dtype(d).name,
)
def test_every_dtype_combination(platform, x_dtype, gamma_dtype, out_dtype, scale_dtype):
    x = random_rows(0, (37, 520), x_dtype)
    residual = random_rows(1, (37, 520), x_dtype)
    gamma = random_gamma(2, 520, gamma_dtype)
    kw = dict(out_dtype=out_dtype, scale_dtype=scale_dtype)
    (y, scales), _ = check_rms(platform, x, gamma, **kw)
    assert y.dtype == jnp.dtype(out_dtype) and y.shape == x.shape
    assert scales.dtype == jnp.dtype(scale_dtype) and scales.shape == (37, 1)
    (y, scales, residual_out), _ = check_add(platform, x, residual, gamma, **kw)
    assert residual_out.dtype == x.dtype and residual_out.shape == x.shape


@pytest.mark.parametrize(
    "shape", [(4096,), (3, 1000), (2, 3, 257), (2, 2, 3, 96), (1, 2, 1, 3, 64)], ids=str
)
def test_ranks(platform, shape):
    x = random_rows(3, shape, jnp.bfloat16)
    gamma = random_gamma(4, shape[-1], jnp.float32)
    (_y, scales), _ = check_rms(platform, x, gamma)
    assert scales.shape == shape[:-1] + (1,)
    check_add(platform, x, random_rows(5, shape, jnp.bfloat16), gamma)


# The default tier: a width below a lane block, one past a vector, one of each kernel's
# row layouts, and one past 65536 (extended: the rest).
@pytest.mark.sampled(12)
@pytest.mark.parametrize(
    "hidden",
    [
        1,
        *(pytest.param(h, marks=EXTENDED) for h in (2, 97, 4096, 16384, 32768, 65536)),
        7,
        1025,
        5137,
        70001,
    ],
)
@pytest.mark.parametrize("x_dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
def test_hidden_sizes(platform, hidden, x_dtype):
    rows = 3 if hidden > 8192 else 9
    x = random_rows(hidden, (rows, hidden), x_dtype)
    gamma = random_gamma(6, hidden, jnp.float32)
    check_rms(platform, x, gamma)
    check_add(platform, x, random_rows(7, (rows, hidden), x_dtype), gamma)


def test_many_rows(platform):
    # More rows than the CPU kernel puts in one task, and than a GPU wave holds.
    x = random_rows(8, (3000, 256), jnp.bfloat16)
    gamma = random_gamma(9, 256, jnp.bfloat16)
    check_rms(platform, x, gamma)


def test_eager_matches_jit(platform):
    x = random_rows(10, (16, 384), jnp.float16)
    gamma = random_gamma(11, 384, jnp.float32)
    eager, _ = check_rms(platform, x, gamma, jit=False, scale_dtype=jnp.bfloat16)
    jitted, _ = check_rms(platform, x, gamma, jit=True, scale_dtype=jnp.bfloat16)
    assert_same_bits(eager, jitted)


# Offsets that the input dtype does not hold: step 1 rounds them through it (f32(T(wo))).
# 1 + 2^-8 + 2^-30 is just above a bfloat16 tie: rounded once it is 1 + 2^-7, rounded
# through float32 first (a tie there) it would be 1.
UNREPRESENTABLE_OFFSETS = [
    (jnp.bfloat16, 0.1),
    (jnp.bfloat16, 1 + 2**-8 + 2**-30),
    (jnp.float16, 1 / 3),
    (jnp.float32, 0.1),
]


@pytest.mark.parametrize(
    ("dtype", "weight_offset"),
    UNREPRESENTABLE_OFFSETS,
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_weight_offset_is_rounded_through_the_input_dtype(platform, dtype, weight_offset):
    """The kernels against tests/exact.py's statement of steps 1-7 (the offset rounded once
    to the input dtype by exact arithmetic, the sum of squares in integers): the rounding
    is shared code of the kernels and the reference, so only an oracle of its own sees it."""
    x = random_rows(14, (16, 256), dtype)
    gamma = (random_gamma(15, 256, jnp.float32) * 0.1).astype(np.float32)
    want = rms_norm_rows(x, gamma, weight_offset=weight_offset)
    # The dtype does not hold the offset, and (for 16-bit inputs) rounding it only to
    # float32 would change the scales.
    assert float(nearest_in_dtype(weight_offset, dtype)) != weight_offset
    if dtype != jnp.float32:
        unrounded = rms_norm_rows(x, gamma, weight_offset=weight_offset, offset_dtype=np.float32)
        assert not np.array_equal(unrounded[1], want[1])
    got = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, weight_offset=weight_offset)
    assert_kernel_matches(platform, got, want)


@pytest.mark.parametrize("weight_offset", [1.0, -0.5, 0.1])
def test_weight_offset(platform, weight_offset):
    x = random_rows(12, (20, 640), jnp.bfloat16)
    gamma = random_gamma(13, 640, jnp.bfloat16) * 0.1
    check_rms(platform, x, gamma.astype(jnp.bfloat16), weight_offset=weight_offset)
    check_add(platform, x, x, gamma.astype(jnp.bfloat16), weight_offset=weight_offset)


@pytest.mark.parametrize("gamma_dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
def test_negative_zero_gamma(platform, gamma_dtype):
    """gamma + weight_offset with weight_offset 0.0 turns a -0.0 in gamma into +0.0 (the
    spec's step 3), so those columns are zeros with x's sign, in the kernels and in the
    reference alike (XLA's simplifier drops an addition of 0.0; the reference must not)."""
    x = random_rows(14, (6, 96), jnp.bfloat16)
    gamma = random_gamma(15, 96, gamma_dtype)
    gamma[::3] = -0.0
    (y, _), _ = check_rms(platform, x, gamma)
    want = np.where(np.signbit(x[:, ::3].astype(np.float32)), 0x80, 0x00)
    np.testing.assert_array_equal(y.view(np.uint8)[:, ::3], want)
    check_add(platform, x, x, gamma)


@pytest.mark.parametrize("out_dtype", FP8S, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("scale_dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
def test_scale_ub_that_binds(platform, out_dtype, scale_dtype):
    x = random_rows(14, (24, 512), jnp.float32, spread=0.0)
    gamma = np.ones(512, np.float32)
    ub = 0.5  # far below every row's abs-max (several units after normalisation)
    (y, scales), _ = check_rms(
        platform, x, gamma, scale_ub=ub, out_dtype=out_dtype, scale_dtype=scale_dtype
    )
    fp8_max = FP8_MAX[out_dtype]
    expected_scale = np.asarray(
        np.float32(np.asarray(ub).astype(scale_dtype)) / np.float32(fp8_max)
    ).astype(scale_dtype)
    np.testing.assert_array_equal(scales, np.full((24, 1), expected_scale, scales.dtype))
    y32 = y.astype(np.float32)
    assert np.abs(y32).max() == fp8_max  # the clamp bites
    assert not np.isnan(y32).any()


def test_scale_ub_that_does_not_bind(platform):
    x = random_rows(15, (24, 512), jnp.bfloat16, spread=0.0)
    gamma = random_gamma(16, 512, jnp.float32)
    (_, bounded), _ = check_rms(platform, x, gamma, scale_ub=1e4)
    (_, unbounded), _ = check_rms(platform, x, gamma)
    np.testing.assert_array_equal(bounded, unbounded)


@pytest.mark.parametrize("x_dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
def test_zero_rows(platform, x_dtype):
    x = random_rows(17, (6, 300), x_dtype)
    x[[1, 4]] = 0
    gamma = random_gamma(18, 300, jnp.float32)
    (y, scales), _ = check_rms(platform, x, gamma)
    assert (scales[[1, 4]] == 0).all()
    assert (y[[1, 4]].astype(np.float32) == 0).all()
    assert (scales[[0, 2, 3, 5]] > 0).all()
    # The residual cancels x exactly: h is zero.
    (y, scales, _residual_out), _ = check_add(platform, x, -x, gamma)
    assert (scales == 0).all() and (y.astype(np.float32) == 0).all()


def test_zero_row_with_eps_that_rounds_to_zero(platform):
    x = np.zeros((3, 64), np.float16)
    x[0] = 1.0
    gamma = np.ones(64, np.float16)
    (y, scales), _ = check_rms(platform, x, gamma, eps=1e-8)
    assert not np.isnan(scales).any() and not np.isnan(y.astype(np.float32)).any()
    assert (scales[1:] == 0).all() and scales[0] > 0


@pytest.mark.sampled(2)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("out_dtype", FP8S, ids=lambda d: jnp.dtype(d).name)
def test_non_finite_rows(platform, bad, out_dtype):
    x = random_rows(19, (5, 200), jnp.bfloat16)
    x[2, 17] = bad
    gamma = random_gamma(20, 200, jnp.float32)
    (y, scales), (_y_ref, _) = check_rms(platform, x, gamma, out_dtype=out_dtype)
    assert np.isnan(scales[2]).all() and np.isnan(y[2].astype(np.float32)).all()
    assert not np.isnan(scales[[0, 1, 3, 4]]).any()
    assert not np.isnan(y[[0, 1, 3, 4]].astype(np.float32)).any()
    (y, scales, _), _ = check_add(platform, x, np.zeros_like(x), gamma, out_dtype=out_dtype)
    assert np.isnan(scales[2]).all() and np.isnan(y[2].astype(np.float32)).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e38], ids=["nan", "inf", "overflows"])
@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("out_dtype", FP8S, ids=lambda d: jnp.dtype(d).name)
def test_non_finite_gamma(platform, bad, group_size, out_dtype):
    # Finite rows whose normalised values are not: a NaN or Inf gamma, or a finite one so
    # large that (x * r) * gamma overflows. The abs-max is then NaN or Inf, the reciprocal
    # 0, and the product at that column NaN (NaN * 0, Inf * 0); the kernels' vector path
    # that skips NaN tests must not be taken for such rows.
    x = random_rows(23, (3, 256), jnp.float32)
    x[:, 70] = 50.0 * np.abs(x).max(axis=1)  # so that |x * r| > 1 there
    gamma = random_gamma(24, 256, jnp.float32)
    gamma[70] = bad
    (y, _scales), _ = check_rms(platform, x, gamma, out_dtype=out_dtype, group_size=group_size)
    assert np.isnan(y[:, 70].astype(np.float32)).all()
    assert not np.isnan(np.delete(y, 70, axis=1).astype(np.float32)).any()


def test_sum_of_squares_overflow(platform):
    x = random_rows(21, (4, 128), jnp.float32, spread=0.0)
    x[1] *= 1e20  # finite values, but their squares overflow float32
    gamma = random_gamma(22, 128, jnp.float32)
    (y, scales), _ = check_rms(platform, x, gamma)
    assert np.isnan(scales[1]).all() and np.isnan(y[1].astype(np.float32)).all()
    assert np.isfinite(scales[[0, 2, 3]]).all()
    # In add_rms_norm_fp8 the sum of two finite bf16 rows can itself overflow.
    big = np.full((2, 64), 3e38, np.float32)
    (y, scales, residual_out), _ = check_add(platform, big, big, np.ones(64, np.float32))
    assert np.isnan(scales).all() and np.isinf(residual_out).all()


@pytest.mark.parametrize("shape", [(0, 128), (2, 0, 64), (3, 0), (2, 4, 0), (0,)], ids=str)
def test_empty_inputs(platform, shape):
    x = np.zeros(shape, np.float32)
    gamma = np.ones((shape[-1],), np.float32)
    y, scales = run_on(platform, fp8norm.rms_norm_fp8, x, gamma)
    assert y.shape == shape and scales.shape == shape[:-1] + (1,)
    np.testing.assert_array_equal(scales, np.zeros(shape[:-1] + (1,), np.float32))
    y, scales, residual_out = run_on(platform, fp8norm.add_rms_norm_fp8, x, x, gamma)
    assert residual_out.shape == shape
    np.testing.assert_array_equal(scales, np.zeros(shape[:-1] + (1,), np.float32))


def test_jit_lowers_to_the_custom_call():
    x = jnp.ones((8, 256), jnp.bfloat16)
    gamma = jnp.ones((256,), jnp.float32)
    lowered = jax.jit(fp8norm.rms_norm_fp8).lower(x, gamma)
    text = lowered.as_text()
    assert "stablehlo.custom_call @fp8norm_rms_norm_fp8" in text
    assert "stablehlo.reduce" not in text  # no jnp formula beside it
    compiled = lowered.compile().as_text()
    assert 'custom_call_target="fp8norm_rms_norm_fp8"' in compiled
    text = jax.jit(fp8norm.add_rms_norm_fp8).lower(x, x, gamma).as_text()
    assert "stablehlo.custom_call @fp8norm_add_rms_norm_fp8" in text
    assert "stablehlo.reduce" not in text


def test_cuda_lowering(monkeypatch):
    from jax_fp8norm import _fallback

    monkeypatch.setattr(_fallback, "_warned", set())
    x = jnp.ones((8, 256), jnp.bfloat16)
    gamma = jnp.ones((256,), jnp.float32)
    traced = jax.jit(fp8norm.rms_norm_fp8).trace(x, gamma)
    if fp8norm.built_with_cuda():
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "stablehlo.custom_call @fp8norm_rms_norm_fp8" in text
    else:  # the twin: tests/test_fallback.py
        with pytest.warns(fp8norm.KernelFallbackWarning, match="no CUDA kernels"):
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "custom_call @fp8norm" not in text


def test_constants_reach_the_kernel(platform):
    # eps large enough to matter: the kernel must use it (and its rounding to bf16).
    x = random_rows(23, (8, 64), jnp.bfloat16, spread=0.0) * 0.01
    gamma = np.ones(64, np.float32)
    (_, small), _ = check_rms(platform, x.astype(jnp.bfloat16), gamma, eps=1e-6)
    (_, large), _ = check_rms(platform, x.astype(jnp.bfloat16), gamma, eps=0.1)
    assert (large < small).all()


@pytest.mark.sampled(40)
@pytest.mark.default_platforms("cpu", "simt-warp_rows")
@pytest.mark.parametrize("x_dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(64, 4096), (33, 1000), (3, 70001), (4096, 2)], ids=str)
def test_bitwise_equal_to_reference(platform, x_dtype, shape):
    # On cpu and simt, stronger than the spec's rule: the compensated sum of squares makes
    # each row's sum the correctly rounded one on every path, and every other step is the
    # same IEEE float32 operation, so the outputs agree bit for bit (on a GPU, whose
    # reciprocal square root may move a tie, the accuracy rule: assert_kernel_matches).
    # 4096 x 2 with 16-bit scales: XLA's CPU backend once fused the reference's scale
    # rounding away there (a one-code difference in 1% of y).
    x = random_rows(41, shape, x_dtype)
    residual = random_rows(42, shape, x_dtype)
    gamma = random_gamma(43, shape[-1], jnp.bfloat16)
    check_add(platform, x, residual, gamma, scale_dtype=jnp.bfloat16)
    check_rms(platform, x, gamma, scale_dtype=jnp.float16)
    check_rms(platform, x, gamma)


@pytest.mark.default_platforms("cpu", "simt-block_registers")
@pytest.mark.parametrize("residual_dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_float32_sum_with_16bit_residual(platform, residual_dtype):
    # The path a float32 all-reduce takes: a float32 x meets a 16-bit residual stream, and
    # residual_out comes back in the residual's dtype.
    from jax_fp8norm._checks import make_params
    from jax_fp8norm._primitives import add_rms_norm_fp8_p

    x = random_rows(44, (19, 1030), jnp.float32)
    residual = random_rows(45, (19, 1030), residual_dtype)
    gamma = random_gamma(46, 1030, jnp.float32)
    p = make_params(
        residual_dtype,
        eps=1e-6,
        weight_offset=0.0,
        scale_ub=None,
        out_dtype=jnp.float8_e4m3fn,
        scale_dtype=jnp.float32,
    )
    out = run_on(
        platform, lambda *a: add_rms_norm_fp8_p.bind(*a, **p.as_dict()), x, residual, gamma
    )
    h = x + residual.astype(np.float32)
    ref = reference_on_cpu(
        fp8norm.reference.add_rms_norm_fp8, h, np.zeros_like(h), gamma, eps=p.eps
    )
    assert out[2].dtype == jnp.dtype(residual_dtype)
    np.testing.assert_array_equal(out[2], h.astype(residual_dtype))
    assert_kernel_matches(platform, out[:2], [np.asarray(r) for r in ref[:2]])


# ------------------------------------------------------------------ amax beside a static scale
def _amax_rows(hidden: int, x_dtype) -> tuple[np.ndarray, list[int]]:
    """Rows for the amax: finite ones, a row of zeros, a NaN, an Inf and (where the dtype
    holds such values) a finite row whose sum of squares overflows; and the rows whose
    outputs are NaN."""
    x = random_rows(61, (8, hidden), x_dtype)
    x[1] = 0
    x[2, hidden // 2] = np.nan
    x[3, 0] = np.inf
    non_finite = [2, 3]
    if float(np.finfo(x.dtype).max) > 1e30:
        x[4] = x[4].astype(np.float32) * 1e20
        non_finite.append(4)
    return x, non_finite


@pytest.mark.parametrize(
    "hidden,x_dtype",
    [(64, jnp.float32), (1000, jnp.bfloat16), (4104, jnp.float16)],
    ids=["64-float32", "1000-bfloat16", "4104-float16"],
)
def test_static_scale_amax(platform, hidden, x_dtype):
    # Each row's amax beside a static scale, the reference's bits; y and scales those of
    # the call without it. For a finite row it is step 4's abs-max: the one a dynamic
    # float32 scale with no bound divides by FP8_MAX (scale = f32(amax / 448)). A row
    # whose outputs are NaN gives the one quiet NaN, an overflowing one included.
    x, non_finite = _amax_rows(hidden, x_dtype)
    gamma = random_gamma(62, hidden, jnp.float32)
    kw = dict(static_scale=0.02)
    (y, scales, amax), _ = check_rms(platform, x, gamma, return_amax=True, **kw)
    assert amax.dtype == np.float32 and amax.shape == (8, 1)
    (y_plain, scales_plain), _ = check_rms(platform, x, gamma, **kw)
    assert_same_bits((y, scales), (y_plain, scales_plain))
    (_, dynamic), _ = check_rms(platform, x, gamma)
    finite = [i for i in range(8) if i not in non_finite]
    assert np.isfinite(amax[finite]).all() and (amax[[i for i in finite if i != 1]] > 0).all()
    assert_same_bits(amax[finite] / np.float32(448.0), dynamic[finite])
    assert (amax[non_finite].view(np.uint32) == 0x7FC00000).all() and amax[1, 0] == 0
    residual = random_rows(63, x.shape, x_dtype)
    (*_, amax_add), _ = check_add(platform, x, residual, gamma, return_amax=True, **kw)
    assert amax_add.shape == (8, 1) and np.isnan(amax_add[non_finite]).all()
    # With the columnwise outputs, after amax: the same amax.
    outs, _ = check_rms(platform, x, gamma, return_amax=True, columnwise=True, **kw)
    assert len(outs) == 5 and outs[3].shape == (hidden, 8)
    assert_same_bits(outs[2], amax)


def test_amax_of_empty_rows_and_under_vmap(platform):
    x = np.zeros((3, 0), np.float32)
    _, _, amax = run_on(
        platform,
        fp8norm.rms_norm_fp8,
        x,
        np.ones(0, np.float32),
        static_scale=0.5,
        return_amax=True,
    )
    assert_same_bits(amax, np.zeros((3, 1), np.float32))
    x = random_rows(64, (2, 3, 96), jnp.bfloat16)
    gamma = random_gamma(65, 96, jnp.float32)
    batched = run_on(
        platform,
        jax.vmap(lambda x: fp8norm.rms_norm_fp8(x, gamma, static_scale=0.02, return_amax=True)),
        x,
    )
    want = reference_on_cpu(
        fp8norm.reference.rms_norm_fp8, x, gamma, static_scale=0.02, return_amax=True
    )
    assert_same_bits(batched, want)


def test_amax_with_sharded_rows():
    # Under jit with the rows sharded over two devices: each device's rows' amax.
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("rows",))
    x = random_rows(66, (4, 3, 128), jnp.bfloat16)
    gamma = random_gamma(67, 128, jnp.float32)
    sharded = jax.device_put(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    )
    fn = jax.jit(lambda x: fp8norm.rms_norm_fp8(x, gamma, static_scale=0.02, return_amax=True))
    got = fn(sharded)
    assert got[2].sharding.is_equivalent_to(sharded.sharding, 3)
    want = reference_on_cpu(
        fp8norm.reference.rms_norm_fp8, x, gamma, static_scale=0.02, return_amax=True
    )
    assert_same_bits([np.asarray(o) for o in got], want)


@pytest.mark.parametrize("twin", [False, True], ids=["op", "twin"])
def test_return_amax_needs_a_static_scale(twin):
    ops = fp8norm.reference if twin else fp8norm
    x, gamma = np.ones((2, 32), np.float32), np.ones(32, np.float32)
    for kw in (dict(), dict(recipe="fp8_row"), dict(group_size=8)):
        with pytest.raises(ValueError, match=r"return_amax=True .* static_scale"):
            ops.rms_norm_fp8(x, gamma, return_amax=True, **kw)
        with pytest.raises(ValueError, match="return_amax"):
            ops.add_rms_norm_fp8(x, x, gamma, return_amax=True, **kw)
    with pytest.raises(TypeError, match="return_amax must be a bool"):
        ops.rms_norm_fp8(x, gamma, static_scale=0.1, return_amax=1)


@pytest.mark.parametrize("handler", ["cpu", "simt"])
def test_amax_handler_refusals(handler):
    # Calls that bypass the Python checks: the handler refuses an amax without a static
    # scale, of the wrong dtype, or missing among the results its form names.
    from cases import GAMMA, X, ffi_call, handler_target

    target = handler_target(handler, "rms_norm_fp8")
    rows = [
        jax.ShapeDtypeStruct((4, 16), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((4, 1), jnp.float32),
    ]
    amax = jax.ShapeDtypeStruct((4, 1), jnp.float32)
    scale = jnp.full((1,), 0.02, jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        good = ffi_call(target, (*rows, amax), X, GAMMA, scale, with_amax=True)
        twin = fp8norm.reference.rms_norm_fp8(X, GAMMA, static_scale=scale, return_amax=True)
        np.testing.assert_array_equal(
            np.asarray(good[2]).view(np.uint32), np.asarray(twin[2]).view(np.uint32)
        )
        for outs, args, message in [
            ((*rows, amax), (X, GAMMA), "with_amax needs a static scale"),
            (
                (*rows, jax.ShapeDtypeStruct((4, 1), jnp.bfloat16)),
                (X, GAMMA, scale),
                "amax must be float32",
            ),
            (rows, (X, GAMMA, scale), r"with_amax=1.*the form has 1 results"),
        ]:
            with pytest.raises(Exception, match=message):
                jax.block_until_ready(ffi_call(target, outs, *args, with_amax=True))
