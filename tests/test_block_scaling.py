"""Scales per group, powers of two and calibrated scales (docs/spec.md, the section of that
name): scales per group of ``group_size`` elements, power-of-two and e8m0 scales, and
calibrated static scales, on every platform. The CPU kernel and the emulated CUDA kernels must give
the reference's bits; a GPU, the spec's accuracy rule."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    EXTENDED,
    FLOATS,
    assert_same_bits,
    check_against_reference,
    is_gpu,
    is_simt,
    random_gamma,
    random_rows,
    reference_on_cpu,
    run_on,
)

import jax_fp8norm as fp8norm

E8M0 = jnp.float8_e8m0fnu
FP8_MAX = {jnp.float8_e4m3fn: 448.0, jnp.float8_e4m3fnuz: 240.0}
NAN_CODE = {jnp.float8_e4m3fn: 0x7F, jnp.float8_e4m3fnuz: 0x80}


# The op against its reference: bit for bit on the CPU and emulated kernels, by the
# accuracy rule on a GPU (where rsqrt may move a tie).
check = check_against_reference


# Hidden sizes (7168: DeepSeek-V3) with every group size of the issue that divides them;
# the default tier takes the short rows and DeepSeek-V3's 1x128.
GROUP_CASES = [
    (hidden, group)
    if hidden < 4096 or (hidden, group) == (7168, 128)
    else pytest.param(hidden, group, marks=EXTENDED)
    for hidden in (96, 384, 7168, 16384)
    for group in (1, 3, 32, 64, 128, hidden)
    if hidden % group == 0
]


@pytest.mark.sampled(8)
@pytest.mark.parametrize(("hidden", "group"), GROUP_CASES, ids=lambda v: str(v))
def test_group_sizes(platform, hidden, group):
    rows = 3 if hidden > 4096 else 9
    x = random_rows(hidden + group, (rows, hidden), jnp.bfloat16)
    residual = random_rows(group, (rows, hidden), jnp.bfloat16)
    gamma = random_gamma(hidden, hidden, jnp.float32)
    (_, scales), _ = check(platform, "rms_norm_fp8", x, gamma, group_size=group)
    assert scales.shape == (rows, hidden // group) and scales.dtype == np.float32
    # MXFP8 (e8m0 scales) and the add variant with DeepSeek-style float32 UE8M0 scales.
    (_, e8m0), _ = check(platform, "rms_norm_fp8", x, gamma, group_size=group, scale_dtype=E8M0)
    assert e8m0.dtype == np.dtype(E8M0) and e8m0.shape == scales.shape
    check(
        platform,
        "add_rms_norm_fp8",
        x,
        residual,
        gamma,
        group_size=group,
        power_of_two_scales=True,
    )


@pytest.mark.sampled(28)
@pytest.mark.parametrize("x_dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "scale_kw",
    [
        dict(scale_dtype=jnp.float32),
        dict(scale_dtype=jnp.float16),
        dict(scale_dtype=jnp.bfloat16),
        dict(scale_dtype=E8M0),
        dict(scale_dtype=jnp.float32, power_of_two_scales=True),
        dict(scale_dtype=jnp.bfloat16, power_of_two_scales=True),
    ],
    ids=lambda kw: "-".join(
        f"{k}={jnp.dtype(v).name if k == 'scale_dtype' else v}" for k, v in kw.items()
    ),
)
@pytest.mark.parametrize("out_dtype", list(FP8_MAX), ids=lambda d: jnp.dtype(d).name)
def test_every_dtype_with_groups(platform, x_dtype, scale_kw, out_dtype):
    x = random_rows(1, (11, 512), x_dtype, spread=3.0)
    residual = random_rows(2, (11, 512), x_dtype)
    gamma = random_gamma(3, 512, jnp.bfloat16)
    kw = dict(group_size=128, out_dtype=out_dtype, **scale_kw)
    (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **kw)
    assert y.dtype == np.dtype(out_dtype) and scales.shape == (11, 4)
    assert scales.dtype == np.dtype(scale_kw["scale_dtype"])
    check(platform, "add_rms_norm_fp8", x, residual, gamma, **kw)


@pytest.mark.parametrize(
    "scale_dtype", [jnp.float32, jnp.bfloat16, E8M0], ids=lambda d: jnp.dtype(d).name
)
@pytest.mark.parametrize("scale_ub", [None, 0.5, 3.0])
def test_power_of_two_scales_bound_the_group_and_are_exact(platform, scale_dtype, scale_ub):
    x = random_rows(5, (16, 256), jnp.float32, spread=4.0)
    gamma = random_gamma(6, 256, jnp.float32)
    kw = dict(group_size=32, scale_dtype=scale_dtype, power_of_two_scales=True, scale_ub=scale_ub)
    (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **kw)
    s = scales.astype(np.float32)
    mantissa, _ = np.frexp(s)
    assert np.all(mantissa == 0.5), "every scale is a power of two"
    assert s.min() >= (2.0**-127 if scale_dtype == E8M0 else 2.0**-126)
    largest = np.abs(np.asarray(y).astype(np.float32)).reshape(16, 8, 32).max(-1)
    if scale_ub is None:
        # amax / scale <= FP8_MAX, and > FP8_MAX / 2 as the scale is the smallest power of
        # two that fits: no element is clipped by its group's scale, and the range is used.
        assert np.all((largest >= 224.0) & (largest <= 448.0))
    else:
        # A bounded group saturates at FP8_MAX instead.
        assert largest.max() == 448.0


def _model_exponent(a: float, fp8_max: float, floor: int) -> int:
    """The biased exponent of the smallest power of two >= fl32(a / fp8_max), at least
    `floor`; below 2^-126, decided from a exactly (docs/spec.md)."""
    q = float(np.float32(a) / np.float32(fp8_max))  # NumPy: no denormal flushing
    if q < 2.0**-126:
        exponent = 1 if a > fp8_max * 2.0**-127 else 0
    else:
        mantissa, e = math.frexp(q)  # q = mantissa * 2^e, mantissa in [0.5, 1)
        exponent = (e - 1 if mantissa == 0.5 else e) + 127
    return max(exponent, floor)


def test_power_of_two_boundaries_match_the_definition(platform):
    # (Note: gammas of -0.0 and subnormal ones are kept out. The kernels add weight_offset
    # = +0.0 to them as IEEE says, giving +0 (after flushing); XLA simplifies the reference's
    # ``gamma + 0.0`` to ``gamma``, keeping the sign of zero.)
    # x = 1 and eps = 0 make r exactly 1, so a group's abs-max is exactly the largest |gamma|
    # of the group: each group below probes one boundary of the power-of-two rule.
    fp8_max = 448.0
    edge = np.float32(fp8_max * 2.0**-127)
    amaxes = [
        edge,  # q at 2^-127 exactly: byte 0
        np.nextafter(edge, np.float32(np.inf)),  # just above: 2^-126
        np.float32(fp8_max * 2.0**-126),  # q = 2^-126 exactly
        np.nextafter(np.float32(fp8_max * 2.0**-126), np.float32(np.inf)),
        np.nextafter(np.float32(fp8_max * 2.0**-126), np.float32(0)),
        np.float32(2.0**-126),  # the smallest normal abs-max: q subnormal
        np.float32(fp8_max),  # q = 1
        np.nextafter(np.float32(fp8_max), np.float32(np.inf)),
        np.float32(fp8_max * 1.5),
        np.float32(3.0e38),  # near float32's largest
        np.float32(0.0),  # a zero group: the floor
        np.float32(1e-30),
    ]
    group = 8
    hidden = group * len(amaxes)
    gamma = np.zeros(hidden, np.float32)
    for i, a in enumerate(amaxes):
        gamma[i * group] = a
        # A smaller element of the other sign; no -0 and no subnormal (see the note).
        gamma[i * group + 3] = -a * np.float32(0.5) if a >= 2.0**-125 else 0.0
    x = np.ones((2, hidden), np.float32)
    for scale_dtype, floor in ((E8M0, 0), (jnp.float32, 1), (jnp.bfloat16, 1)):
        kw = dict(group_size=group, scale_dtype=scale_dtype, power_of_two_scales=True, eps=0.0)
        (_, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **kw)
        want = [_model_exponent(float(a), fp8_max, floor) for a in amaxes]
        if scale_dtype == E8M0:
            got = np.asarray(scales).view(np.uint8)[0].tolist()
        else:
            got = [
                (b >> 23) & 0xFF for b in np.asarray(scales[0]).astype(np.float32).view(np.uint32)
            ]
        assert got == want, (scale_dtype, got, want)


def test_edge_rows_of_grouped_scales(platform):
    hidden, group = 256, 32
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, hidden)).astype(np.float32)
    x[1] = 0.0  # a zero row
    x[2, :group] = 0.0  # a zero group in an ordinary row
    x[3, 100] = np.nan
    x[4, 5] = -np.inf
    x[5] = 3e20  # its sum of squares overflows float32
    gamma = random_gamma(8, hidden, jnp.float32)
    for scale_dtype, power_of_two in ((jnp.float32, False), (jnp.float32, True), (E8M0, True)):
        kw = dict(group_size=group, scale_dtype=scale_dtype, power_of_two_scales=power_of_two)
        (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **kw)
        s = np.asarray(scales).astype(np.float32)
        zero_scale = (2.0**-127 if scale_dtype == E8M0 else 2.0**-126) if power_of_two else 0.0
        assert np.all(s[1] == zero_scale) and s[2, 0] == zero_scale
        assert np.all(y[1].astype(np.float32) == 0)
        assert np.all(y[2, :group].astype(np.float32) == 0)
        assert np.all(np.isfinite(s[[0, 2]])) and np.all(s[0] > 0)
        for row in (3, 4, 5):
            assert np.all(np.isnan(s[row])), row
            assert np.all(np.asarray(y[row]).view(np.uint8) == NAN_CODE[jnp.float8_e4m3fn]), row
        if scale_dtype == E8M0:
            assert np.all(np.asarray(scales)[3:].view(np.uint8) == 0xFF)


def test_empty_rows_and_hidden(platform):
    gamma = np.zeros((0,), np.float32)
    x = np.zeros((3, 0), np.float32)
    (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, group_size=4)
    assert y.shape == (3, 0) and scales.shape == (3, 0)
    (_, scales), _ = check(platform, "rms_norm_fp8", x, gamma, scale_dtype=E8M0)
    assert scales.shape == (3, 1) and np.all(np.asarray(scales).view(np.uint8) == 0)
    (_, scales), _ = check(platform, "rms_norm_fp8", x, gamma, static_scale=0.25)
    assert np.all(scales == 0.25)
    empty = np.zeros((0, 64), np.float32)
    (y, scales), _ = check(platform, "rms_norm_fp8", empty, np.ones(64, np.float32), group_size=32)
    assert scales.shape == (0, 2)


# ------------------------------------------------------------------------- static scales


@pytest.mark.sampled(2)
@pytest.mark.parametrize("x_dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("scale_dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
def test_static_scale(platform, x_dtype, scale_dtype):
    x = random_rows(9, (13, 1024), x_dtype, spread=1.0)
    residual = random_rows(10, (13, 1024), x_dtype, spread=1.0)
    gamma = random_gamma(11, 1024, jnp.float32)
    kw = dict(static_scale=0.0123, scale_dtype=scale_dtype)
    (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **kw)
    rounded = np.float32(np.asarray(0.0123, np.float32).astype(scale_dtype))
    assert scales.shape == (13, 1) and np.all(scales.astype(np.float32) == rounded)
    # Values past FP8_MAX * scale saturate instead of becoming NaN.
    assert np.abs(y.astype(np.float32)).max() == 448.0
    check(platform, "add_rms_norm_fp8", x, residual, gamma, **kw)


def test_static_scale_is_traced_data(platform):
    x = random_rows(12, (8, 512), jnp.bfloat16, spread=0.5)
    gamma = random_gamma(13, 512, jnp.bfloat16)

    @jax.jit
    def fn(x, gamma, scale):
        return fp8norm.rms_norm_fp8(x, gamma, static_scale=scale)

    outs = []
    for scale in (np.float32(0.01), np.float32(0.02), np.float32(0.04)):
        out = run_on(platform, fn, x, gamma, scale, jit=False)
        want = reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma, static_scale=scale)
        if platform != "gpu":
            assert_same_bits(out, want)
        assert np.all(out[1] == scale)
        outs.append(out)
    assert fn._cache_size() == 1, "one compilation for every scale value"
    # A larger scale gives smaller codes.
    assert np.abs(outs[2][0].astype(np.float32)).sum() < np.abs(outs[0][0].astype(np.float32)).sum()
    # A (1,) array and a bfloat16 scalar array are accepted too.
    for scale in (np.array([0.03], np.float32), jnp.asarray(0.03, jnp.bfloat16)):
        check(platform, "rms_norm_fp8", x, gamma, static_scale=scale)


@pytest.mark.parametrize(
    "scale", [0.0, -0.5, float("nan"), float("inf"), -float("inf"), 1e-40], ids=repr
)
def test_invalid_static_scale_makes_every_y_nan(platform, scale):
    x = random_rows(14, (5, 128), jnp.float32)
    x[1] = 0.0
    gamma = random_gamma(15, 128, jnp.float32)
    for out_dtype in FP8_MAX:
        (y, scales), _ = check(
            platform, "rms_norm_fp8", x, gamma, static_scale=jnp.float32(scale), out_dtype=out_dtype
        )
        assert np.all(np.asarray(y).view(np.uint8) == NAN_CODE[out_dtype])
        s = np.asarray(scales)
        assert s.shape == (5, 1)
        if not math.isnan(scale) and scale != 1e-40:
            assert np.all(s == np.float32(scale))
    if scale == 1e-40:
        # scales hold s = f32(bfloat16(1e-40)), a subnormal: 2^-133, the bits 0x0001.
        (y, scales), _ = check(
            platform, "rms_norm_fp8", x, gamma, static_scale=jnp.float32(scale),
            scale_dtype=jnp.bfloat16,
        )  # fmt: skip
        assert np.all(np.asarray(y).view(np.uint8) == NAN_CODE[jnp.float8_e4m3fn])
        assert np.all(np.asarray(scales).view(np.uint16) == 0x0001)


def test_static_scale_edge_rows(platform):
    x = random_rows(16, (4, 256), jnp.float32)
    x[1] = 0.0
    x[2, 7] = np.nan
    x[3] = 3e20
    gamma = random_gamma(17, 256, jnp.float32)
    (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, static_scale=0.5)
    assert np.all(scales == 0.5), "a non-finite row keeps the calibrated scale"
    codes = np.asarray(y).view(np.uint8)
    assert np.all(y[1].astype(np.float32) == 0)
    assert np.all(codes[2] == 0x7F) and np.all(codes[3] == 0x7F)
    assert not np.any(codes[0] == 0x7F)
    # A scale whose reciprocal would be subnormal: the reciprocal is 0 everywhere.
    (y, _), _ = check(platform, "rms_norm_fp8", x, gamma, static_scale=2.0**127)
    assert np.all(y[[0, 1]].astype(np.float32) == 0)


def test_vmap_over_static_scales_and_groups(platform):
    x = random_rows(18, (3, 6, 256), jnp.bfloat16)
    gamma = random_gamma(19, 256, jnp.float32)
    scales = np.array([0.01, 0.02, 0.05], np.float32)
    fn = jax.vmap(lambda x, s: fp8norm.rms_norm_fp8(x, gamma, static_scale=s))
    got = run_on(platform, fn, x, scales)
    for i in range(3):
        want = reference_on_cpu(fp8norm.reference.rms_norm_fp8, x[i], gamma, static_scale=scales[i])
        if platform != "gpu":
            assert_same_bits([g[i] for g in got], want)
    grouped = jax.vmap(lambda x: fp8norm.rms_norm_fp8(x, gamma, group_size=64, scale_dtype=E8M0))
    got = run_on(platform, grouped, x)
    want = reference_on_cpu(
        lambda x: fp8norm.reference.rms_norm_fp8(x, gamma, group_size=64, scale_dtype=E8M0), x
    )
    assert got[1].shape == (3, 6, 4)
    if platform != "gpu":
        assert_same_bits(got, want)


# ------------------------------------------------------------------------- consumers


def _as_tuple(fn):
    return lambda *args, **kw: (fn(*args, **kw),)


def _dequantized_sum(x, residual, gamma, **kw):
    return fp8norm.add_rms_norm_fp8_dequantized(x, residual, gamma, **kw)[0].sum()


def test_dequantized_twins_repeat_group_scales(platform):
    x = random_rows(20, (4, 256), jnp.float32, spread=0.5)
    residual = random_rows(21, (4, 256), jnp.float32, spread=0.5)
    gamma = random_gamma(22, 256, jnp.float32)
    for kw in (dict(group_size=32), dict(group_size=64, scale_dtype=E8M0), dict(static_scale=0.01)):
        # The twin's forward pass is f32(y) * each group's scale repeated over the group,
        # here written in NumPy over the reference's outputs (the kernel's on a GPU, where
        # they may differ from the reference by the accuracy rule).
        if is_gpu(platform):
            source = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)
        else:
            source = reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma, **kw)
        y, scales = (np.asarray(o).astype(np.float32) for o in source)
        want = y * np.repeat(scales, x.shape[-1] // scales.shape[-1], axis=-1)
        (got,) = run_on(platform, _as_tuple(fp8norm.rms_norm_fp8_dequantized), x, gamma, **kw)
        np.testing.assert_array_equal(got, want)
        grads = run_on(
            platform,
            jax.grad(functools.partial(_dequantized_sum, **kw), argnums=(0, 2)),
            x,
            residual,
            gamma,
        )
        assert all(np.all(np.isfinite(g)) for g in grads)
        assert np.abs(grads[1]).sum() > 0


@pytest.mark.parametrize(
    "kw", [dict(group_size=64), dict(static_scale=0.01)], ids=["group64", "static"]
)
def test_rows_strided_over_few_blocks(platform, kw):
    # A grid of 3 blocks makes each block take several rows in turn, with rows held by
    # several warps (4096 bf16: 4 warps of 4 vectors in warp_rows, 8 warps of 2 vectors in
    # block_registers). Without the
    # row-wide abs-max, the barrier that kept the next row's partial sums from being
    # written early must still be there.
    if not is_simt(platform):
        pytest.skip("the emulated device's grid limit")
    x = random_rows(30, (12, 4096), jnp.bfloat16)
    gamma = random_gamma(31, 4096, jnp.float32)
    with fp8norm.simt.device(max_grid_x=3):
        fp8norm.simt.take_launches()
        check(platform, "rms_norm_fp8", x, gamma, **kw)
        launches = fp8norm.simt.take_launches()
    assert launches and all(launch["blocks"] <= 3 for launch in launches)
