"""NVFP4 with per-row global scales (docs/spec.md, "FP4 outputs", ``global_scale="per_row"``):
the kernels against the twins bit for bit on cpu and simt (y, scales, global_scales, and
the columnwise outputs with each column's global scale), a row's codes independent of the
other rows (and, columnwise, a column's of the other columns), the edge rows (zero, NaN,
tiny, exactly at the floor), the all-reduce and sharded forms, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    EXTENDED,
    FLOATS,
    assert_same_bits,
    check_against_reference,
    random_gamma,
    random_rows,
    run_on,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm

PER_ROW = {"recipe": "nvfp4", "global_scale": "per_row"}
ROWS = 96  # a multiple of every group size below, for the columnwise blocks
NVFP4 = {"out_dtype": jnp.float4_e2m1fn, "scale_dtype": jnp.float8_e4m3fn}
FLOOR = np.float32(2.0**-126)
check = check_against_reference


def _rows(seed: int, shape, dtype=jnp.bfloat16) -> np.ndarray:
    """Rows of magnitudes 10^-2.5 .. 10^2.5 with an outlier in some of them, so that rows'
    global scales differ widely."""
    x = random_rows(seed, shape, dtype, spread=2.5).astype(np.float32)
    x[::3, 5] *= 30.0
    return x.astype(jnp.dtype(dtype))


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])


# (hidden, group, dtype): the default tier takes a few, the rest are extended.
CASES = [
    pytest.param(hidden, group, dtype, marks=() if default else EXTENDED)
    for hidden in (96, 384, 960, 2880, 6144)
    for group in (16, 32, 6)
    for dtype in FLOATS
    for default in [
        (hidden, group, dtype)
        in {(384, 16, jnp.bfloat16), (96, 6, jnp.float32), (960, 32, jnp.float16)}
    ]
]


@pytest.mark.parametrize(("hidden", "group", "dtype"), CASES)
@pytest.mark.parametrize("op", ["rms_norm_fp8", "add_rms_norm_fp8"])
def test_per_row_matches_the_reference(platform, op, hidden, group, dtype):
    x = _rows(hidden, (ROWS, hidden), dtype)
    gamma = random_gamma(hidden + 1, hidden, jnp.float32)
    args = (
        (x, gamma) if op == "rms_norm_fp8" else (x, _rows(hidden + 2, (ROWS, hidden), dtype), gamma)
    )
    kw = dict(NVFP4, group_size=group, global_scale="per_row")
    (_, scales, *rest), _ = check(platform, op, *args, **kw)
    global_scales = rest[-1]
    assert global_scales.shape == (ROWS, 1) and global_scales.dtype == np.float32
    assert scales.shape == (ROWS, hidden // group) and scales.dtype == np.dtype(jnp.float8_e4m3fn)
    # The rows' global scales differ (the test would not see a shared one).
    assert len(np.unique(global_scales)) > ROWS - 8
    # Columnwise: each column's global scale, [N, 1], after y_t and scales_t.
    (*_, y_t, scales_t, global_scales_t), _ = check(platform, op, *args, columnwise=True, **kw)
    assert y_t.shape == (hidden, ROWS) and scales_t.shape == (hidden, ROWS // group)
    assert global_scales_t.shape == (hidden, 1) and global_scales_t.dtype == np.float32
    assert len(np.unique(global_scales_t)) > hidden // 2


@pytest.mark.parametrize("columnwise", [False, True])
def test_per_row_3d_and_training_forms(platform, columnwise):
    x = _rows(7, (2, 16, 128))
    gamma = random_gamma(8, 128, jnp.float32)
    outs, _ = check(platform, "rms_norm_fp8", x, gamma, columnwise=columnwise, **PER_ROW)
    assert outs[2].shape == (2, 16, 1)
    outs, _ = check(
        platform,
        "rms_norm_fp8_training",
        x.reshape(32, 128),
        gamma,
        columnwise=columnwise,
        **PER_ROW,
    )
    # (y, scales, inverse_rms, global_scales[, y_t, scales_t, global_scales_t])
    assert outs[3].shape == (32, 1) and len(outs) == (7 if columnwise else 4)


def test_a_rows_codes_depend_on_that_row_alone(platform):
    # Row 0's codes, scales and global scale stay when another row becomes huge; under one
    # global scale for the tensor (its amax / 2688, the usual calibration) they change, so
    # the comparison can fail.
    hidden = 256
    gamma = random_gamma(1, hidden, jnp.float32)
    x = _rows(2, (16, hidden), jnp.float32)
    huge = x.copy()
    huge[5] *= 1e6
    huge[5, 7] = 3e4 * np.abs(huge[5]).max()  # a row amax far above the others'
    run = lambda x, **kw: run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)  # noqa: E731
    a, b = run(x, **PER_ROW), run(huge, **PER_ROW)
    for got, want in zip(a, b, strict=True):
        assert_same_bits(np.delete(got, 5, axis=0), np.delete(want, 5, axis=0))
    tensor = {"recipe": "nvfp4"}
    ta = run(x, global_scale=float(a[2].max()), **tensor)
    tb = run(huge, global_scale=float(b[2].max()), **tensor)
    assert not np.array_equal(_bits(ta[0][0]), _bits(tb[0][0]))
    # Columnwise: column 3's codes and global scale stay when column 9's gamma becomes huge.
    run_t = lambda g: run_on(  # noqa: E731
        platform, fp8norm.rms_norm_fp8, x, g, columnwise=True, **PER_ROW
    )
    big = gamma.copy()
    big[9] = 1e9
    (*_, y_t, s_t, gs_t), (*_, y_t2, s_t2, gs_t2) = run_t(gamma), run_t(big)
    for got, want in ((y_t, y_t2), (s_t, s_t2), (gs_t, gs_t2)):
        assert_same_bits(np.delete(got, 9, axis=0), np.delete(want, 9, axis=0))
    assert not np.array_equal(_bits(gs_t[9]), _bits(gs_t2[9]))


def _floor_rows(hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """x of rows of ones (with eps=0, r = 1 exactly, so n = gamma) and the gammas that
    put a row's amax exactly at 2688 * 2^-126 (gs exactly the floor), one float32 step
    above it, and far below it (the floor); a zero row; a NaN row; a row whose sum of
    squares overflows; an ordinary row."""
    at_floor = np.float32(2688.0) * FLOOR
    x = np.ones((8, hidden), np.float32)
    x[3] = 0.0
    x[4, 3] = np.nan
    x[5] = 3e38
    x[6] = np.linspace(-2.0, 2.0, hidden, dtype=np.float32)
    x[7, 1] = np.inf
    return x, at_floor


def test_edge_rows(platform):
    hidden = 64
    x, at_floor = _floor_rows(hidden)
    rows = []
    for scale in (at_floor, np.nextafter(at_floor, np.float32(1)), at_floor * np.float32(1e-3)):
        gamma = np.full((hidden,), scale, np.float32)
        (y, scales, gs), _ = check(platform, "rms_norm_fp8", x, gamma, eps=0.0, **PER_ROW)
        rows.append(gs[:3, 0])
        assert np.array_equal(y.view(np.uint8)[3], np.zeros_like(y.view(np.uint8)[3]))
        # A zero row: the floor, scales 0, codes 0.
        assert gs[3, 0] == FLOOR and not scales[3].view(np.uint8).any()
        # NaN, overflowing and Inf rows: NaN global scale, NaN scales (0x7F), codes 0.
        for row in (4, 5, 7):
            assert np.isnan(gs[row, 0]) and (scales[row].view(np.uint8) == 0x7F).all()
            assert not y[row].view(np.uint8).any()
    exactly, above, tiny = rows
    assert _bits(exactly[0]) == _bits(FLOOR) and _bits(tiny[0]) == _bits(FLOOR)
    assert _bits(above[0]) == _bits(FLOOR) + 1
    # At the floor, each group's scale is its amax / (gs * 6) = 448, rounded.
    (_, scales, _), _ = check(
        platform, "rms_norm_fp8", x, np.full((hidden,), at_floor, np.float32), eps=0.0, **PER_ROW
    )
    assert (scales[0].astype(np.float32) == 448.0).all()
    # A finite row whose n overflows (a huge gamma): NaN as a row that is not finite.
    x = np.zeros((2, hidden), np.float32)
    x[:, 0] = 8.0  # r = 1 with eps=0, so n_0 = 8 * gamma_0 = +Inf
    (y, scales, gs), _ = check(
        platform, "rms_norm_fp8", x, np.full((hidden,), 3e38, np.float32), eps=0.0, **PER_ROW
    )
    assert np.isnan(gs).all() and (scales.view(np.uint8) == 0x7F).all() and not y.any()


def test_columnwise_nan_row_makes_every_columns_global_scale_nan(platform):
    x = _rows(3, (32, 64), jnp.float32)
    x[17, 2] = np.nan
    gamma = random_gamma(4, 64, jnp.float32)
    (*_, y_t, scales_t, gs_t), _ = check(
        platform, "rms_norm_fp8", x, gamma, columnwise=True, **PER_ROW
    )
    assert np.isnan(gs_t).all() and not y_t.view(np.uint8).any()
    assert (scales_t.view(np.uint8) == 0x7F).all()


def test_empty_shapes(platform):
    gamma = np.ones((32,), np.float32)
    (_, _, gs, _, _, gs_t), _ = check(
        platform, "rms_norm_fp8", np.zeros((0, 32), np.float32), gamma, columnwise=True, **PER_ROW
    )
    assert gs.shape == (0, 1) and gs_t.shape == (32, 1) and (gs_t == FLOOR).all()
    (_, _, gs), _ = check(
        platform,
        "rms_norm_fp8",
        np.zeros((3, 0), np.float32),
        np.ones((0,), np.float32),
        **PER_ROW,
    )
    assert (gs == FLOOR).all()


def test_dequantised_values_track_n():
    # The codes dequantise with each row's own global scale: n within NVFP4's rounding,
    # across rows whose magnitudes span 10^6.
    x = _rows(11, (32, 128), jnp.float32)
    gamma = random_gamma(12, 128, jnp.float32)
    y, scales, gs = fp8norm.rms_norm_fp8(x, gamma, **PER_ROW)
    deq = np.asarray(fp8norm.dequantize(y, scales, gs))
    n = np.asarray(fp8norm.rms_norm_fp8_dequantized(x, gamma, dtype=jnp.float32, **PER_ROW))
    assert_same_bits(deq, n)
    exact = fp8norm.reference.textbook_rms_norm(jnp.asarray(x), jnp.asarray(gamma), 1e-6)
    err = np.abs(deq - np.asarray(exact)) / np.abs(np.asarray(exact)).max(axis=-1, keepdims=True)
    # At most half an e2m1 step (1 of 6 at the top) of the row's largest value, and the
    # block scale's own rounding.
    assert err.max() < 0.2


@pytest.mark.parametrize("method", ["xla", "auto"])
def test_allreduce_and_sharded_jit(platform, method):
    # The all-reduce op sums with XLA's all-reduce (the one-kernel methods exchange no
    # global scales), then the add kernel; a sharded jit keeps each device's rows, and
    # columnwise gathers them (a column's global scale takes every row).
    devices = jax.devices("cpu")[:2]
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tp",))
    partials = _rows(21, (2, 32, 128), jnp.float32)
    residual = _rows(22, (32, 128), jnp.float32)
    gamma = random_gamma(23, 128, jnp.float32)
    with jax.default_device(devices[0]):
        from helpers import kernels_of

        with kernels_of(platform):
            got = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                partials, residual, gamma, mesh=mesh, axis_name="tp", method=method, **PER_ROW
            )
            h = partials.sum(axis=0, dtype=np.float32)
            want = fp8norm.reference.add_rms_norm_fp8(h, residual, gamma, **PER_ROW)
            assert_same_bits([np.asarray(o) for o in got], [np.asarray(o) for o in want])
            for columnwise in (False, True):
                sharded = jax.device_put(h, NamedSharding(mesh, P("tp")))
                fn = jax.jit(
                    lambda h, c=columnwise: fp8norm.rms_norm_fp8(h, gamma, columnwise=c, **PER_ROW)
                )
                want = fp8norm.reference.rms_norm_fp8(h, gamma, columnwise=columnwise, **PER_ROW)
                assert_same_bits(
                    [np.asarray(o) for o in fn(sharded)], [np.asarray(o) for o in want]
                )


def test_bad_input():
    x = np.ones((4, 128), np.float32)
    gamma = np.ones((128,), np.float32)
    for op in (fp8norm.rms_norm_fp8, fp8norm.reference.rms_norm_fp8):
        for kw in ({"recipe": "mxfp4"}, {}, {"recipe": "fp8_group128"}):
            with pytest.raises(ValueError, match="global_scale='per_row' is NVFP4's"):
                op(x, gamma, global_scale="per_row", **kw)
        with pytest.raises(TypeError, match="global_scale must be a float, a float32 array"):
            op(x, gamma, recipe="nvfp4", global_scale="per_tensor")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
    with pytest.raises(ValueError, match="global_scale='per_row' sums the partials"):
        fp8norm.sharded_allreduce_residual_rms_norm_fp8(
            np.ones((2, 4, 128), np.float32),
            x,
            gamma,
            mesh=mesh,
            axis_name="tp",
            method="one_shot",
            **PER_ROW,
        )


@pytest.mark.parametrize("handler", ["cpu", "simt"])
def test_handler_refusals(handler):
    # Calls that bypass the Python checks: the handler refuses per-row global scales beside
    # a global scale operand, with MXFP4 or FP8, and without their result (or with one of
    # the wrong dtype).
    from cases import ffi_call, handler_target

    target = handler_target(handler, "rms_norm_fp8")
    x, gamma = jnp.ones((4, 32), jnp.bfloat16), jnp.ones((32,), jnp.float32)
    f4, e4m3, e8m0 = jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    sds = jax.ShapeDtypeStruct
    rows = [sds((4, 32), f4), sds((4, 2), e4m3)]
    gs = sds((4, 1), jnp.float32)
    kw = dict(group_size=16, per_row_global_scale=True)
    with jax.default_device(jax.devices("cpu")[0]):
        good = ffi_call(target, (*rows, gs), x, gamma, **kw)
        twin = fp8norm.reference.rms_norm_fp8(x, gamma, **PER_ROW)
        assert_same_bits([np.asarray(o) for o in good], [np.asarray(o) for o in twin])
        one = jnp.ones((1,), jnp.float32)
        mxfp4 = [sds((4, 32), f4), sds((4, 1), e8m0)]
        for outs, args, extra, message in [
            ((*rows, gs), (x, gamma, one), {}, "takes no global_scale operand"),
            ((*mxfp4, gs), (x, gamma), {"power_of_two_scales": True, "group_size": 32},
             "per_row_global_scale is NVFP4's"),
            (rows, (x, gamma), {}, r"per_row_global_scale=1.*the form has 1 results"),
            ((*rows, sds((4, 1), jnp.bfloat16)), (x, gamma), {}, "global_scales must be float32"),
        ]:  # fmt: skip
            with pytest.raises(Exception, match=message):
                jax.block_until_ready(ffi_call(target, outs, *args, **{**kw, **extra}))
