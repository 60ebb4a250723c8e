"""The shapes framework code hands the ops (docs/spec.md, "Shapes, dtypes and shardings"):
gamma=None, a gamma of shape (1, ..., 1, N) or broadcast over the normalised axes,
normalisation over several trailing axes, the dequantised twins' dtype and out_sharding.
Each form is held to the kernels' own form of the same call, bit for bit.

Like the sharding modules, a session with fewer than 8 devices reruns the out_sharding
tests in a subprocess with 8.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TIERS, assert_same_bits, random_gamma, random_rows
from helpers import rerun_with_virtual_cpu_devices as rerun
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm
from jax_fp8norm.reference import exact_sum

# The norm over the last two axes of x [4, 8, 4, 16]: 32 rows of N = 64.
SHAPE, NORMALISED = (4, 8, 4, 16), (4, 16)
FLAT = (4, 8, 64)


def run(fn, *args, **kw):
    """``fn(*args, **kw)`` as one jitted program (the reference twins' jnp is slow eager)."""
    return jax.jit(functools.partial(fn, **kw))(*args)


def _rows(add: bool, dtype=jnp.bfloat16, shape=SHAPE):
    x = random_rows(1, shape, dtype)
    return (x, random_rows(2, shape, dtype)) if add else (x,)


def _op(where: str, add: bool):
    module = fp8norm if where == "op" else fp8norm.reference
    return module.add_rms_norm_fp8 if add else module.rms_norm_fp8


@pytest.mark.parametrize(
    ("where", "add", "kw"),
    [
        ("op", False, {}),
        ("op", True, {"group_size": 16}),
        ("op", False, {"recipe": "mxfp8", "columnwise": True}),
        ("op", True, {"static_scale": 0.05, "columnwise": True}),
        ("reference", True, {"group_size": 16}),
    ],
    ids=str,
)
def test_several_axes_are_the_flattened_row(where, add, kw):
    rows = _rows(add)
    gamma = random_gamma(3, 64, jnp.float32)
    fn = _op(where, add)
    got = run(fn, *rows, gamma.reshape(NORMALISED), reduction_axes=(-2, 3), **kw)
    want = run(fn, *(r.reshape(FLAT) for r in rows), gamma, **kw)
    # y and residual_out in x's shape; scales [4, 8, groups] and y_t [N, rows] as the
    # flattened call's
    assert got[0].shape == SHAPE and got[1].shape == want[1].shape
    assert_same_bits(got, [w.reshape(SHAPE) if w.shape == FLAT else w for w in want])
    assert_same_bits([fp8norm.dequantize(*got[:2])], [fp8norm.dequantize(*want[:2]).reshape(SHAPE)])


def test_dequantize_refuses_scales_that_do_not_fit_y():
    # Neither broadcast (one scale for every row) nor cut short (groups that leave part of
    # a row without a scale): a clear refusal naming both shapes.
    y = jnp.zeros((4, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scales of shape \(1, 1\) do not fit y of shape"):
        fp8norm.dequantize(y, jnp.ones((1, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"scales' last axis \(3\) must divide the row of y"):
        fp8norm.dequantize(y, jnp.ones((4, 3), jnp.float32))


@pytest.mark.parametrize("gamma_shape", [(16,), (1, 16), (4, 1), (1, 1, 1, 4, 16), ()])
def test_a_broadcast_gamma_is_the_tiled_one(gamma_shape):
    x = random_rows(4, SHAPE, jnp.float32)
    gamma = random_gamma(5, 64, jnp.bfloat16)[: int(np.prod(gamma_shape))].reshape(gamma_shape)
    # its leading axes beyond the two normalised ones are of size 1
    tiled = np.broadcast_to(gamma.reshape(gamma.shape[max(gamma.ndim - 2, 0) :]), NORMALISED)
    got = run(fp8norm.rms_norm_fp8, x, gamma, reduction_axes=(-2, -1))
    want = run(fp8norm.rms_norm_fp8, x.reshape(FLAT), np.ascontiguousarray(tiled).reshape(-1))
    assert_same_bits(got, (want[0].reshape(SHAPE), want[1]))


@pytest.mark.parametrize("where", ["op", "reference"])
def test_gemma_qk_norm_gamma(where):
    # Gemma's QK-norm: x [batch, seq, heads, D], scale (1, 1, 1, D).
    x = random_rows(6, (2, 3, 4, 32), jnp.bfloat16)
    gamma = random_gamma(7, 32, jnp.float32)
    fn = _op(where, False)
    assert_same_bits(run(fn, x, gamma.reshape(1, 1, 1, 32)), run(fn, x, gamma))


@pytest.mark.parametrize(
    ("where", "add", "x_dtype", "offset"),
    [
        ("op", False, jnp.bfloat16, 1.0),
        ("op", True, jnp.float32, 1e8),  # f32(1 - 1e8) + 1e8 is 0, not 1
        ("reference", True, jnp.bfloat16, 1.0),
    ],
    ids=str,
)
def test_no_gamma_is_a_weight_of_one(where, add, x_dtype, offset):
    # Whatever weight_offset, the weight is 1 exactly: gamma = ones with no offset, and
    # gamma = zeros with an offset of 1.
    rows = _rows(add, x_dtype, shape=(5, 32))
    fn = _op(where, add)
    ones, zeros = np.ones(32, np.float32), np.zeros(32, np.float32)
    want = run(fn, *rows, ones, recipe="mxfp8")
    assert_same_bits(run(fn, *rows, recipe="mxfp8"), want)
    assert_same_bits(run(fn, *rows, None, weight_offset=offset, recipe="mxfp8"), want)
    assert_same_bits(run(fn, *rows, zeros, weight_offset=1.0, recipe="mxfp8"), want)
    if where == "op":  # eagerly too
        assert_same_bits(fn(*rows, weight_offset=offset, recipe="mxfp8"), want)


@pytest.mark.parametrize(
    ("add", "x_dtype", "gamma_dtype", "dtype", "want"),
    [
        (False, jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16),
        (True, jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16),
        (False, jnp.bfloat16, jnp.float32, None, jnp.float32),
        (True, jnp.float16, jnp.bfloat16, None, jnp.float32),
        (False, jnp.float16, None, None, jnp.float16),
        (True, jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32),
        (False, jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16),
    ],
    ids=str,
)
def test_the_twins_dtype_is_the_product_rounded_once(add, x_dtype, gamma_dtype, dtype, want):
    rows = _rows(add, x_dtype, shape=(6, 64))
    gamma = None if gamma_dtype is None else random_gamma(8, 64, gamma_dtype)
    twin = fp8norm.add_rms_norm_fp8_dequantized if add else fp8norm.rms_norm_fp8_dequantized
    got = run(twin, *rows, gamma, dtype=dtype, group_size=32)
    y, scales, *residual_out = run(_op("op", add), *rows, gamma, group_size=32)
    product = np.asarray(y, np.float32) * np.repeat(np.asarray(scales, np.float32), 32, axis=-1)
    assert np.isfinite(product).all() and np.any(product != 0)
    assert_same_bits([got[0] if add else got], [jnp.asarray(product).astype(want)])
    if add:
        assert_same_bits([got[1]], residual_out)


def test_twins_gradients_through_no_gamma_and_a_broadcast_gamma():
    x = random_rows(9, (6, 4, 16), jnp.float32)
    w = random_rows(10, (6, 4, 16), jnp.float32, spread=0.0)
    twin = fp8norm.rms_norm_fp8_dequantized

    def grads(fn, *args):
        argnums = tuple(range(len(args)))
        return jax.jit(jax.grad(lambda *a: jnp.sum(w * fn(*a)), argnums=argnums))(*args)

    # gamma=None: dx of a weight of one
    (dx_none,) = grads(lambda x: twin(x, None, reduction_axes=(-2, -1)), x)
    (dx_ones,) = grads(lambda x: twin(x, jnp.ones((4, 16)), reduction_axes=(-2, -1)), x)
    assert np.isfinite(np.asarray(dx_none)).all() and np.any(np.asarray(dx_none) != 0)
    assert_same_bits([dx_none], [dx_ones])
    # gamma (16,) broadcast over (4, 16): dx of the tiled gamma; dgamma the exact sum of
    # the tiled gamma's over the 4 positions (in float32: gamma's dtype is then JAX's cast).
    gamma = jnp.asarray(random_gamma(11, 16, jnp.float32))
    dx, dgamma = grads(lambda x, g: twin(x, g, reduction_axes=(1, 2)), x, gamma)
    tiled = jnp.tile(gamma, 4).reshape(4, 16)
    dx_t, dgamma_t = grads(lambda x, g: twin(x, g, reduction_axes=(1, 2)), x, tiled)
    assert_same_bits([dx], [dx_t])
    assert np.all(np.asarray(dgamma_t) != 0)
    assert_same_bits([dgamma], [run(functools.partial(exact_sum, axis=0), dgamma_t)])
    # (1, 1, 16) gamma: the (16,) gamma's gradient reshaped.
    gamma = jnp.asarray(random_gamma(12, 16, jnp.float32))

    def add_twin(x, g):
        return fp8norm.add_rms_norm_fp8_dequantized(x, x, g)[0]

    _, dg = grads(add_twin, x, gamma)
    _, dg_1 = grads(add_twin, x, gamma.reshape(1, 1, 16))
    assert_same_bits([dg_1], [dg.reshape(1, 1, 16)])


BAD_AXES = [
    (0, ValueError, "trailing"),
    ((-3, -1), ValueError, "trailing"),
    ((0, 1), ValueError, "trailing"),
    (3, ValueError, "out of range"),
    ((-4, -1), ValueError, "out of range"),
    ((-1, 2), ValueError, "twice"),
    ((), ValueError, "at least one"),
    ("last", TypeError, "an int or a sequence"),
    (True, TypeError, "an int or a sequence"),
]
BAD_GAMMAS = [(5,), (2, 4), (3, 3), (4, 3), (2, 3, 4), (3, 4, 1)]


@pytest.mark.parametrize(
    "fn",
    [
        fp8norm.rms_norm_fp8,
        fp8norm.rms_norm_fp8_dequantized,
        fp8norm.reference.rms_norm_fp8,
    ],
    ids=lambda f: f.__module__ + "." + f.__name__,
)
def test_bad_shapes_name_the_argument(fn):
    x = jnp.ones((2, 3, 4), jnp.float32)
    for axes, error, match in BAD_AXES:
        with pytest.raises(error, match=f"reduction_axes.*{match}|{match}.*reduction_axes"):
            fn(x, jnp.ones((3, 4)), reduction_axes=axes)
    for shape in BAD_GAMMAS:
        with pytest.raises(ValueError, match=r"^gamma must have shape \(3, 4\)"):
            fn(x, jnp.ones(shape), reduction_axes=(1, 2))
    with pytest.raises(TypeError, match="out_sharding must be"):
        fn(x, out_sharding="d")
    with pytest.raises(ValueError, match=r"out_sharding=.* no mesh in context"):
        fn(x, out_sharding=P("d"))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, "nope"])
def test_the_twins_refuse_a_bad_dtype(dtype):
    x = jnp.ones((2, 16), jnp.float32)
    with pytest.raises(TypeError, match="dtype must be"):
        fp8norm.rms_norm_fp8_dequantized(x, dtype=dtype)
    with pytest.raises(TypeError, match="dtype must be"):
        fp8norm.add_rms_norm_fp8_dequantized(x, x, dtype=dtype)


if len(jax.devices("cpu")) < 8:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun(__file__, 8, tier, "-k", "out_sharding or allreduce")

else:

    def _spec(a) -> P:
        """``a``'s partition spec without trailing Nones (automatic axes drop them)."""
        entries = list(a.sharding.spec)
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    @pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
    @pytest.mark.parametrize("form", ["named", "spec"])
    def test_out_sharding_places_the_outputs(axis_type, form):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
        x = jax.device_put(random_rows(13, (8, 4, 16), jnp.float32), NamedSharding(mesh, P()))
        gamma = jnp.asarray(random_gamma(14, 16, jnp.float32))
        spec = P("data", None, "model")
        target = NamedSharding(mesh, spec) if form == "named" else spec
        want = fp8norm.add_rms_norm_fp8(x, x, gamma)
        twin = fp8norm.rms_norm_fp8_dequantized

        def placed(fn, *args, jit, **kw):
            fn = functools.partial(fn, out_sharding=target, **kw)
            fn = jax.jit(fn) if jit else fn
            with jax.set_mesh(mesh) if form == "spec" else contextlib.nullcontext():
                return fn(*args)

        for jit in (False, True):
            y, scales, residual_out = placed(fp8norm.add_rms_norm_fp8, x, x, gamma, jit=jit)
            assert _spec(y) == spec and _spec(residual_out) == spec
            assert _spec(scales) == P("data")
            assert_same_bits((y, scales, residual_out), want)
            # two normalised axes: scales [8, 1] take the batch axis's entry
            _, scales = placed(fp8norm.rms_norm_fp8, x, gamma, jit=jit, reduction_axes=(1, 2))
            assert scales.shape == (8, 1) and _spec(scales) == P("data")
            value = placed(twin, x, gamma, jit=jit, reduction_axes=(1, 2))
            assert _spec(value) == spec

    def test_allreduce_takes_no_gamma_and_several_axes():
        # Two devices' partials of x [3, 4, 16], the norm over (4, 16): the op on the
        # partials' float32 sum (exact for two) with the flattened rows and a weight of 1.
        mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,))
        partials = random_rows(15, (2, 3, 4, 16), jnp.float32)
        residual = random_rows(16, (3, 4, 16), jnp.float32)
        got = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
            partials, residual, None, mesh=mesh, axis_name="tp", reduction_axes=(-2, -1)
        )
        h = (partials[0] + partials[1]).reshape(3, 64)
        want = fp8norm.add_rms_norm_fp8(h, residual.reshape(3, 64), np.ones(64, np.float32))
        assert got[0].shape == (3, 4, 16) and got[1].shape == (3, 1)
        assert_same_bits(got, (want[0].reshape(3, 4, 16), want[1], want[2].reshape(3, 4, 16)))
