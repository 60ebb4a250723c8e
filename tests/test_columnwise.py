"""The columnwise outputs (docs/spec.md, "Columnwise outputs"): the kernels' bits against
the twin on cpu and the emulated CUDA kernel, the twin against the spec computed
independently (NumPy and ml_dtypes), the rowwise outputs unchanged, each block's bits
depending on its own rows alone, vmap, edge shapes and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    assert_kernel_matches,
    random_gamma,
    random_rows,
    recipe,
    reference_on_cpu,
    run_on,
)

import jax_fp8norm as fp8norm
from jax_fp8norm import _training, reference, simt
from jax_fp8norm.recipes import RECIPES
from jax_fp8norm.testing import assert_same_bits

# The columnwise kernel has no variants of its own: one emulated platform serves the tests
# of the columnwise outputs alone.
COLUMNWISE_PLATFORMS = pytest.mark.parametrize(
    "platform", ["cpu", "simt-block_shared", "gpu"], indirect=True
)
BLOCK_RECIPES = [name for name, recipe in RECIPES.items() if recipe.block]


def block_of(name: str) -> int:
    """The rows of a columnwise block of the recipe ``name``: its block."""
    return RECIPES[name].block


def rows_with_specials(seed: int, shape, dtype) -> np.ndarray:
    """Rows of spread magnitudes, one holding a NaN, one an Inf, one all zeros."""
    x = random_rows(seed, shape, dtype).reshape(-1, shape[-1])
    x[3, 5] = np.nan
    x[130, -1] = np.inf
    x[200] = 0
    return x.reshape(shape)


def op_and_args(add: bool, shape, dtype, seed: int = 0):
    x = rows_with_specials(seed, shape, dtype)
    gamma = random_gamma(seed + 1, shape[-1], jnp.float32)
    if not add:
        return "rms_norm_fp8", (x, gamma)
    residual = random_rows(seed + 2, shape, dtype, spread=0.5)
    return "add_rms_norm_fp8", (x, residual, gamma)


# Every emulated variant: the rowwise outputs of the columnwise form come from the kernel
# variant in use (the columnwise kernel itself has one plan).
@pytest.mark.sampled(24)
@pytest.mark.default_platforms("cpu", "simt-block_shared")
@pytest.mark.parametrize("name", [*BLOCK_RECIPES, "fp8_static"])
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("shape", [(256, 256), (2, 128, 384)])
def test_columnwise_kernels_give_the_twins_bits(platform, name, add, dtype, shape):
    op, args = op_and_args(add, shape, dtype)
    kw = dict(recipe(name), columnwise=True)
    if name == "fp8_group128":
        kw["weight_offset"] = 1.0
    out = run_on(platform, getattr(fp8norm, op), *args, **kw)
    ref = reference_on_cpu(getattr(reference, op), *args, **kw)
    rows = int(np.prod(shape[:-1]))
    y_t, scales_t = out[-2:]
    assert y_t.shape == (shape[-1], rows)
    blocks = 1 if name == "fp8_static" else rows // block_of(name)
    assert scales_t.shape == (shape[-1], blocks)
    assert_kernel_matches(platform, out[:-2], ref[:-2], **recipe(name))
    assert_kernel_matches(platform, out[-2:], ref[-2:], **recipe(name))
    # The rowwise outputs are the op's without columnwise.
    kw.pop("columnwise")
    plain = run_on(platform, getattr(fp8norm, op), *args, **kw)
    assert_same_bits(out[:-2], plain)


# warp_rows' plan makes both layouts in one launch (the rows of a block, then their
# columns); the other variants, and warp_rows where it cannot hold the row, launch the
# rowwise kernel and then the columnwise one.
@pytest.mark.sampled(2)
@pytest.mark.parametrize("platform", ["simt-warp_rows", "simt-block_shared"], indirect=True)
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8_group128", "fp8_static"])
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
def test_warp_rows_makes_both_layouts_in_one_launch(platform, name, add):
    op, args = op_and_args(add, (2, 128, 256), jnp.bfloat16, seed=5)
    kw = dict(recipe(name), columnwise=True)
    simt.take_launches()
    out = run_on(platform, getattr(_training, f"{op}_training"), *args, **kw)
    # The launches that read x (a static scale's scales_t comes from a launch of its own).
    launches = [
        launch
        for launch in simt.take_launches()
        if launch["buffers"].get("x", {}).get("bytes_read", 0) > 0
    ]
    ref = reference_on_cpu(getattr(reference, f"{op}_training"), *args, **kw)
    assert_kernel_matches(platform, out, ref, **recipe(name))
    one_launch = platform == "simt-warp_rows"
    assert len(launches) == (1 if one_launch else 2)
    written = {
        buffer_name
        for launch in launches
        for buffer_name, buffer in launch["buffers"].items()
        if buffer["bytes_written"] > 0
    }
    assert {"y", "scales", "inverse_rms", "y_t"} <= written


@COLUMNWISE_PLATFORMS
@pytest.mark.parametrize(
    "hidden, kw",
    [(200, dict(group_size=8)), (200, recipe("fp8_static")), (48, recipe("nvfp4"))],
    ids=["group8", "static", "nvfp4"],
)
def test_widths_that_end_in_the_scalar_tails(platform, hidden, kw):
    """Rows whose codes end past the last 32 columns (the AVX2 lanes' tail) and whose
    transpose ends past the last 16 (the SSE2 blocks' tail)."""
    x = rows_with_specials(31, (256, hidden), jnp.bfloat16)
    gamma = random_gamma(32, hidden, jnp.float32)
    kw = dict(kw, columnwise=True)
    out = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)
    ref = reference_on_cpu(reference.rms_norm_fp8, x, gamma, **kw)
    assert_kernel_matches(platform, out[-2:], ref[-2:])


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
@pytest.mark.parametrize(
    "hidden, kw",
    [
        (224, recipe("mxfp8")),
        (176, recipe("nvfp4")),
        (256, recipe("fp8_group128")),
        (120, dict(group_size=8, scale_dtype=jnp.bfloat16)),
        (120, dict(group_size=8, scale_dtype=jnp.float8_e8m0fnu)),
    ],
    ids=["e8m0-64-blocks", "e4m3-128-blocks", "float32", "bfloat16-256-blocks", "e8m0-tails"],
)
def test_scales_t_of_many_blocks_and_each_scale_width(platform, hidden, kw):
    """2048 rows: 64 blocks and more a column (whole lines of one-byte scales_t, moved with
    non-temporal stores), scales of 1, 2 and 4 bytes, and widths that end in the
    transpose's 16-column and scalar strips (176, 120)."""
    x = random_rows(41, (2048, hidden), jnp.bfloat16)
    gamma = random_gamma(42, hidden, jnp.float32)
    kw = dict(kw, columnwise=True)
    out = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)
    ref = reference_on_cpu(reference.rms_norm_fp8, x, gamma, **kw)
    assert_kernel_matches(platform, out, ref)
    # Each column's blocks differ: a transpose of the wrong rows or columns shows.
    assert len(np.unique(np.asarray(out[-1]).view(np.uint8))) > 8
    if hidden == 224:
        # What makes the kernel write whole lines of scales_t with non-temporal stores:
        # XLA's CPU buffers start on 64 bytes.
        scales_t = jax.jit(lambda x: fp8norm.rms_norm_fp8(x, gamma, **kw)[-1])(x)
        assert scales_t.unsafe_buffer_pointer() % 64 == 0


@pytest.mark.extended
def test_a_call_past_the_kept_staging_has_its_halves_bits():
    """A call whose column scales (float32, one per 8 rows: 17 MB) are staged in memory of
    its own, past the 16 MB the CPU kernel keeps between calls, gives each half of its
    rows the bits of a call of that half alone (8.5 MB, staged in the kept buffer)."""
    rng = np.random.default_rng(61)
    x = jnp.asarray(rng.standard_normal((4352, 8192), np.float32), jnp.bfloat16)
    gamma = random_gamma(62, 8192, jnp.float32)
    kw = dict(group_size=8, scale_dtype=jnp.float32, columnwise=True)
    op = jax.jit(lambda x: fp8norm.rms_norm_fp8(x, gamma, **kw))
    y, scales, y_t, scales_t = op(x)
    for half in (slice(0, 2176), slice(2176, 4352)):
        y_h, scales_h, y_t_h, scales_t_h = op(x[half])
        assert_same_bits(y[half], y_h)
        assert_same_bits(scales[half], scales_h)
        assert_same_bits(y_t[:, half], y_t_h)
        assert_same_bits(scales_t[:, half.start // 8 : half.stop // 8], scales_t_h)


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
@pytest.mark.parametrize(
    "kw",
    [
        dict(recipe="nvfp4", global_scale=0.0037),
        dict(recipe="nvfp4", global_scale=1e38),  # fl(1 / gs) subnormal
        dict(recipe="nvfp4", global_scale=1e-39),  # gs subnormal, fl(1 / gs) infinite
        dict(recipe="nvfp4", global_scale=5e-39),  # gs subnormal, fl(1 / gs) normal
        dict(recipe="mxfp4", scale_ub=3.0),
    ],
    ids=[
        "nvfp4",
        "nvfp4-subnormal-reciprocal",
        "nvfp4-subnormal-gs",
        "nvfp4-subnormal-gs-normal-reciprocal",
        "mxfp4-ub",
    ],
)
def test_fp4_column_scales_at_their_edges(platform, kw):
    """FP4 column scales made 8 columns at a time where the lanes can, column by column
    where they cannot: zero columns (no codes), large n (gamma up to 1e30) and a column
    whose n is infinite in blocks of finite rows (gamma 3e38), n near 1e38 (gamma 2e38,
    whose codes a global scale of 1e38 leaves non-zero), global scales whose
    reciprocal or own value is subnormal, a bound on the scale; 112 columns (NVFP4: codes
    of a last 16 past the lanes' 96)."""
    hidden = 128 if kw["recipe"] == "mxfp4" else 112
    rng = np.random.default_rng(51)
    x = rng.standard_normal((64, hidden)) * 10.0 ** rng.uniform(-3, 3, (64, 1))
    x[:, [0, 9, 101]] = 0
    gamma = rng.standard_normal(hidden) * 10.0 ** rng.uniform(-2, 30, hidden)
    gamma[37] = 3e38
    gamma[40:44] = 2e38  # n near 1e38: codes under a global scale of 1e38 are not all zero
    x, gamma = jnp.asarray(x, jnp.bfloat16), jnp.asarray(gamma, jnp.float32)
    kw = dict(kw, columnwise=True)
    out = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)
    ref = reference_on_cpu(reference.rms_norm_fp8, x, gamma, **kw)
    assert_kernel_matches(platform, out, ref)


@COLUMNWISE_PLATFORMS
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
def test_training_forms_return_r_then_the_columnwise_outputs(platform, add):
    op, args = op_and_args(add, (256, 96), jnp.bfloat16)
    kw = dict(recipe("mxfp8"), columnwise=True)
    out = run_on(platform, getattr(_training, f"{op}_training"), *args, **kw)
    ref = reference_on_cpu(getattr(reference, f"{op}_training"), *args, **kw)
    assert_kernel_matches(platform, out[-2:], ref[-2:], **recipe("mxfp8"))
    assert out[-3].shape == (256, 1) and out[-3].dtype == np.float32
    training = run_on(platform, getattr(_training, f"{op}_training"), *args, **recipe("mxfp8"))
    assert_same_bits(out[:-2], training)


def spec_mxfp8_columnwise(x: np.ndarray, gamma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP8's columnwise outputs as the spec states them, in NumPy float32 and ml_dtypes:
    n = (h * r) * gamma per element, blocks of 32 rows per column, scale 2^e the smallest
    power of two >= amax / 448, codes e4m3fn(n * 2^-e) (finite rows, normal scales)."""
    h = x.astype(np.float32)
    r = np.asarray(reference.inverse_rms(h, np.float32(ml_dtypes.bfloat16(1e-6))))
    n = (h * r) * gamma.astype(np.float32)  # float32 products, in that order
    blocks = n.T.reshape(n.shape[1], -1, 32)
    q = np.max(np.abs(blocks), axis=-1) / np.float32(448)
    mantissa, exponent = np.frexp(q)
    exponent = np.where(mantissa == 0.5, exponent - 1, exponent).astype(np.int32)
    recip = np.ldexp(np.float32(1), -exponent).astype(np.float32)
    codes = (blocks * recip[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return codes.reshape(n.shape[1], -1), (exponent + 127).astype(np.uint8)


def test_twin_states_the_spec():
    x = random_rows(5, (96, 160), jnp.bfloat16)
    gamma = random_gamma(6, 160, jnp.float32)
    _, _, y_t, scales_t = jax.jit(
        lambda x, g: reference.rms_norm_fp8(x, g, recipe="mxfp8", columnwise=True)
    )(x, gamma)
    want_y, want_exponents = spec_mxfp8_columnwise(x, gamma)
    np.testing.assert_array_equal(np.asarray(scales_t).view(np.uint8), want_exponents)
    np.testing.assert_array_equal(np.asarray(y_t).view(np.uint8), want_y.view(np.uint8))


@COLUMNWISE_PLATFORMS
def test_static_scale_gives_the_rowwise_codes_transposed(platform):
    _, args = op_and_args(False, (270, 48), jnp.bfloat16)  # 270 rows: no block needed
    out = run_on(platform, fp8norm.rms_norm_fp8, *args, columnwise=True, **recipe("fp8_static"))
    y, scales, y_t, scales_t = out
    np.testing.assert_array_equal(y_t.view(np.uint8), y.view(np.uint8).T)
    assert scales_t.shape == (48, 1)
    np.testing.assert_array_equal(scales_t, np.full((48, 1), scales[0, 0]))


@COLUMNWISE_PLATFORMS
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_each_block_depends_on_its_own_rows(platform, name):
    """A block's codes and scales are the same in a call of its rows alone and in one where
    the blocks come in another order; a row that is not finite poisons its block only."""
    x = rows_with_specials(9, (256, 64), jnp.bfloat16)
    gamma = random_gamma(10, 64, jnp.float32)
    kw = dict(recipe(name), columnwise=True)
    block = block_of(name)
    whole = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)
    order = np.random.default_rng(0).permutation(256 // block)
    permuted = x.reshape(-1, block, 64)[order].reshape(256, 64)
    shuffled = run_on(platform, fp8norm.rms_norm_fp8, permuted, gamma, **kw)
    for got, want in zip(shuffled[-2:], whole[-2:], strict=True):
        got_blocks = got.reshape(got.shape[0], 256 // block, -1)
        want_blocks = want.reshape(want.shape[0], 256 // block, -1)
        assert_same_bits([got_blocks], [want_blocks[:, order]])
    first = run_on(platform, fp8norm.rms_norm_fp8, x[: 2 * block], gamma, **kw)
    assert_same_bits(first[-2:], [whole[-2][:, : first[-2].shape[1]], whole[-1][:, :2]])
    scale_bits = whole[-1].view(np.uint8)  # [columns, blocks]
    # Row 3 holds a NaN: the first block's scales are NaN in every column, the next not.
    nan_code = 0xFF if name == "mxfp8" else 0x7F
    assert np.all(scale_bits[:, 0] == nan_code) and not np.any(scale_bits[:, 1] == nan_code)


def test_vmap_gives_each_element_its_own_blocks():
    x = random_rows(11, (3, 64, 96), jnp.bfloat16)
    gamma = random_gamma(12, 96, jnp.float32)
    fn = lambda x: fp8norm.rms_norm_fp8(x, gamma, recipe="mxfp8", columnwise=True)  # noqa: E731
    batched = jax.jit(jax.vmap(fn))(x)
    assert batched[2].shape == (3, 96, 64)
    for i in range(3):
        assert_same_bits([b[i] for b in batched], jax.jit(fn)(x[i]))


@COLUMNWISE_PLATFORMS
@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (2, 0, 32)])
@pytest.mark.parametrize("name", ["mxfp8", "fp8_static"])
def test_empty_shapes(platform, shape, name):
    x = np.zeros(shape, jnp.bfloat16)
    gamma = np.ones(shape[-1], np.float32)
    kw = dict(recipe(name), columnwise=True)
    out = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)
    ref = reference_on_cpu(reference.rms_norm_fp8, x, gamma, **kw)
    assert_same_bits(out, ref)


@pytest.mark.parametrize(
    "kw, error, words",
    [
        ({}, ValueError, "a dynamic per-row scale has no columnwise form"),
        ({"recipe": "fp8_row"}, ValueError, "a dynamic per-row scale has no columnwise form"),
        ({"recipe": "mxfp8", "rows": 48}, ValueError, "must be a multiple of it"),
        ({"recipe": "fp8_group128", "rows": 64}, ValueError, "group_size=128 rows"),
        ({"recipe": "mxfp8", "columnwise": 1}, TypeError, "columnwise must be a bool"),
    ],
)
def test_columnwise_refuses_what_has_no_columnwise_form(kw, error, words):
    kw = dict(kw)
    rows = kw.pop("rows", 64)
    columnwise = kw.pop("columnwise", True)
    x = jnp.ones((rows, 128), jnp.bfloat16)
    gamma = jnp.ones(128, jnp.float32)
    for fn in (fp8norm.rms_norm_fp8, reference.rms_norm_fp8, _training.rms_norm_fp8_training):
        with pytest.raises(error, match=words):
            fn(x, gamma, columnwise=columnwise, **kw)
    with pytest.raises(error, match=words):
        fp8norm.add_rms_norm_fp8(x, x, gamma, columnwise=columnwise, **kw)


@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
def test_vjp_form_in_a_custom_vjp_layer(add):
    """rms_norm_fp8_vjp's codes feed a layer's matmul (y for the forward, y_t for the weight
    gradient) and its backward, kept as the custom_vjp's residual, gives the same dx and
    dgamma as jax.grad through the dequantised op, bit for bit."""
    x = random_rows(21, (64, 128), jnp.bfloat16)
    residual = random_rows(22, (64, 128), jnp.bfloat16, spread=0.5)
    gamma = random_gamma(23, 128, jnp.float32)
    w = jnp.asarray(np.random.default_rng(24).standard_normal((128, 32)), jnp.float32)
    kw = dict(recipe="mxfp8")
    rows = (x, residual) if add else (x,)

    def dequantized_t(y_t, scales_t):  # [N, rows]: blocks of 32 rows along the last axis
        return fp8norm.dequantize(y_t, scales_t).T

    @jax.custom_vjp
    def layer(rows, gamma, w):
        return fwd(rows, gamma, w)[0]

    def fwd(rows, gamma, w):
        op = fp8norm.add_rms_norm_fp8_vjp if add else fp8norm.rms_norm_fp8_vjp
        outs, backward = op(*rows, gamma, columnwise=True, **kw)
        n = fp8norm.dequantize(outs[0], outs[1])
        return n @ w, (backward, outs[-2], outs[-1], w)

    def bwd(saved, g):
        backward, y_t, scales_t, w = saved
        dn = g @ w.T
        grads = backward(dn, jnp.zeros_like(residual)) if add else backward(dn)
        dw = dequantized_t(y_t, scales_t).T @ g  # dW = n^T g from the columnwise codes
        return tuple(grads[:-1]), grads[-1], dw

    layer.defvjp(fwd, bwd)

    def twin_layer(rows, gamma, w):
        if add:
            n, _ = fp8norm.add_rms_norm_fp8_dequantized(*rows, gamma, **kw)
        else:
            n = fp8norm.rms_norm_fp8_dequantized(*rows, gamma, **kw)
        return n @ w

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))(rows, gamma, w)
    want = jax.jit(jax.grad(loss(twin_layer), argnums=(0, 1, 2)))(rows, gamma, w)
    assert_same_bits(got[0], want[0])  # dx (and dresidual)
    assert_same_bits([got[1]], [want[1]])  # dgamma
    # dW from the columnwise codes is the rowwise one's within MXFP8's precision.
    np.testing.assert_allclose(got[2], want[2], rtol=0.1, atol=0.05 * float(jnp.abs(want[2]).max()))
    outputs, backward = fp8norm.rms_norm_fp8_vjp(x, gamma, **kw)
    assert_same_bits(outputs, fp8norm.rms_norm_fp8(x, gamma, **kw))
    dn = random_rows(25, (64, 128), jnp.float32)
    _, _, r = _training.rms_norm_fp8_training(x, gamma, **kw)
    assert_same_bits(backward(dn), _training.rms_norm_backward(dn, x, gamma, r))
