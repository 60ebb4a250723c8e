"""FP4 training's parts (docs/spec.md, "FP4 training"), their proofs at the level of the
statements (jax_fp8norm._fp4_parts), the quantisers (jax_fp8norm.quantize), the NumPy twin
(tests/layer_twin.py) and the layer: stochastic rounding unbiased in every E2M1 interval,
its random bits a function of the key, the stream and the element's place alone; the
Hadamard transform exact on unquantised operands; the weight's 2-D tiles one matrix for
both GEMMs; the keywords' refusals and the unquantised recipe. The layer's bits against
the twin in each combination of parts are tests/test_layer_bits.py's."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import layer_twin
import numpy as np
import pytest
from helpers import EXTENDED, random_gamma, random_rows, recipe, rerun_with_virtual_cpu_devices
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_layer_bits import NEEDS_THE_NORMS_TRANSFORM

import jax_fp8norm as fp8norm
from jax_fp8norm import _fp4_parts as parts
from jax_fp8norm import quantize
from jax_fp8norm.dense import training_parts
from jax_fp8norm.reference import unquantized_rms_norm_dense

ROWS, K, F = 64, 64, 64
NUM_DEVICES = 8
FP4 = ("nvfp4", "mxfp4")
# NVFP4 in the default tier, MXFP4 in the extended tier too.
RECIPE_TIERS = ["nvfp4", pytest.param("mxfp4", marks=EXTENDED)]
# One value inside each E2M1 interval, at two fractions of it.
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
INSIDE = [lo + f * (hi - lo) for lo, hi in itertools.pairwise(GRID) for f in (0.3, 0.75)]


def _words(seed: int) -> jax.Array:
    return parts.key_words(jax.random.key(seed))


def _deq(codes) -> np.ndarray:
    return np.asarray(codes).astype(np.float32)


# --- Stochastic rounding: unbiased, exact where representable --------------------------


def _stochastic_roundings():
    """Each statement of the rounding: the jnp one, the twin's, and the gradient's rowwise
    quantiser (MXFP4 blocks whose largest value 6 gives them the scale 1)."""

    @jax.jit
    def blocks(q, bits):
        block = jnp.concatenate([jnp.full(q.shape[:-1] + (1,), 6.0), q], -1)
        padded = jnp.pad(block, ((0, 0), (0, -block.shape[1] % 32)))
        bits = jnp.pad(
            jnp.concatenate([bits[:, :1], bits], -1),
            ((0, 0), (0, padded.shape[1] - block.shape[1])),
        )
        codes, scales, _ = quantize.quantize_rows(padded, fp8norm.RECIPES["mxfp4"].gradient, bits)
        return codes[:, 1 : q.shape[1] + 1], scales

    def quantiser(q, bits):
        codes, scales = blocks(q, bits)
        assert np.all(np.asarray(scales).astype(np.float32) == 1)
        return codes

    return {
        "round_fp4": lambda q, bits: jax.jit(parts.round_fp4)(jnp.asarray(q), jnp.asarray(bits)),
        "twin": lambda q, bits: layer_twin.round_e2m1(np.asarray(q), np.asarray(bits)),
        "quantiser": lambda q, bits: quantiser(jnp.asarray(q), jnp.asarray(bits)),
    }


@pytest.mark.parametrize("how", ["round_fp4", "twin", "quantiser"])
def test_stochastic_rounding_is_unbiased_in_every_interval(how):
    """The mean of 4096 draws (the bits of 4096 counters) of a value inside each interval,
    positive and negative, within 4 standard errors of the value; rounding to nearest is
    not (so an SR that rounds to nearest fails here)."""
    draws = 4096
    values = np.array(INSIDE + [-v for v in INSIDE], np.float32)
    q = np.broadcast_to(values, (draws, values.size))
    bits = parts.random_bits(_words(1), draws, values.size)
    mean = _deq(_stochastic_roundings()[how](q, bits)).astype(np.float64).mean(0)
    a = np.abs(values)
    lo = np.array([max(g for g in GRID if g <= v) for v in a])
    hi = np.array([min(g for g in GRID if g > v) for v in a])
    frac = (a - lo) / (hi - lo)
    standard_error = (hi - lo) * np.sqrt(frac * (1 - frac) / draws)
    assert np.all(np.abs(mean - values) <= 4 * standard_error), (values, mean)
    nearest = _deq(values.astype(jnp.float4_e2m1fn))
    assert np.all(np.abs(nearest - values) > 4 * standard_error)


@pytest.mark.parametrize("how", ["round_fp4", "twin", "quantiser"])
def test_representable_values_never_move(how):
    """frac is exact: every E2M1 value, of either sign, is its own code whatever the bits
    (the extremes of u included)."""
    values = np.array(GRID + [-g for g in GRID], np.float32)
    bits = np.array([0, 0xFF, 0x100, 0x7FFFFFFF, 0xFFFFFEFF, 0xFFFFFFFF], np.uint32)
    q = np.broadcast_to(values, (bits.size, values.size))
    got = _deq(_stochastic_roundings()[how](q, np.broadcast_to(bits[:, None], q.shape)))
    np.testing.assert_array_equal(got, q)
    assert np.array_equal(np.signbit(got), np.signbit(q))


# --- The random bits: the key, the stream and the element's place ----------------------


def test_random_bits_are_the_elements_place():
    """A sub-rectangle's bits (placed by row0) are the big one's slice; the streams and
    the keys give other bits; each element is Threefry-2x32 of its (row, column)."""
    words = parts.stream_key(_words(2), parts.DGRAD_STREAM)
    big = np.asarray(parts.random_bits(words, 96, 48))
    np.testing.assert_array_equal(
        np.asarray(parts.random_bits(words, 16, 32, row0=40)), big[40:56, :32]
    )
    traced = jax.jit(lambda r: parts.random_bits(words, 8, 48, row0=r))(jnp.int32(88))
    np.testing.assert_array_equal(np.asarray(traced), big[88:])
    one = jax.extend.random.threefry_2x32(words, jnp.array([37, 11], jnp.uint32))
    assert int(one[0]) == big[37, 11]
    wgrad = np.asarray(parts.random_bits(parts.stream_key(_words(2), parts.WGRAD_STREAM), 96, 48))
    other = np.asarray(parts.random_bits(parts.stream_key(_words(3), parts.DGRAD_STREAM), 96, 48))
    assert np.mean(wgrad == big) < 0.01 and np.mean(other == big) < 0.01
    # fold_in's statement: jax.random.fold_in of a threefry key.
    folded = jax.random.key_data(jax.random.fold_in(jax.random.key(2), parts.DGRAD_STREAM))
    np.testing.assert_array_equal(np.asarray(folded), np.asarray(words))


@pytest.mark.parametrize("name", RECIPE_TIERS)
def test_the_gradients_copies_take_the_bits_of_their_place(name):
    """The dgrad copy of G's first rows is that of a call with those rows alone; both copies
    are the twin's (whose bits are the element's, whatever the recipe's block), and round
    stochastically (not the round-to-nearest codes)."""
    fmt = fp8norm.RECIPES[name].gradient
    g = np.random.default_rng(5).standard_normal((ROWS, F)).astype(np.float32)
    dgrad = parts.stream_key(_words(4), parts.DGRAD_STREAM)
    wgrad = parts.stream_key(_words(4), parts.WGRAD_STREAM)
    rows_copy = jax.jit(lambda g, words: quantize.quantize_gradient_rows(g, fmt, words))
    codes, _, row_scales = rows_copy(g, dgrad)
    first = rows_copy(g[:16], dgrad)
    np.testing.assert_array_equal(_deq(first[0]), _deq(codes)[:16])
    twin_fmt = layer_twin.SPEC_TABLE[name][1]
    gs = None if row_scales is None else np.asarray(row_scales)
    bits = layer_twin.gradient_bits(jax.random.key(4), parts.DGRAD_STREAM, ROWS, F)
    want, _ = layer_twin.quantize_rows(g, twin_fmt, gs, bits)
    np.testing.assert_array_equal(_deq(codes), _deq(want))
    nearest = jax.jit(lambda g: quantize.quantize_gradient_rows(g, fmt)[0])(g)
    assert np.mean(_deq(nearest) != _deq(codes)) > 0.1
    columns_copy = jax.jit(lambda g, words: quantize.quantize_gradient_columns(g, fmt, words))
    w_codes, _, w_gs = columns_copy(g, wgrad)
    bits = layer_twin.gradient_bits(jax.random.key(4), parts.WGRAD_STREAM, ROWS, F)
    want, _ = layer_twin.quantize_columns(g, twin_fmt, w_gs, bits)
    np.testing.assert_array_equal(_deq(w_codes), _deq(want))


def _layer_grads(name, add=False, **layer_keywords):
    """jitted ``(x, gamma, w, g, key) -> (out, dx, dgamma, dw)`` of the FP4 layer (the
    transform off until the norm's columnwise codes take it)."""
    keywords = {**recipe(name), "hadamard": False, **layer_keywords}

    def loss(x, gamma, w, g, key):
        if add:
            out, _ = fp8norm.add_rms_norm_dense(x, x, gamma, w, key=key, **keywords)
        else:
            out = fp8norm.rms_norm_dense(x, gamma, w, key=key, **keywords)
        return jnp.sum(out.astype(jnp.float32) * g), out

    def grads(x, gamma, w, g, key):
        (dx, dgamma, dw), out = jax.grad(loss, (0, 1, 2), has_aux=True)(x, gamma, w, g, key)
        return out, dx, dgamma, dw

    return jax.jit(grads)


def _operands(seed=0, rows=ROWS):
    x = random_rows(seed, (rows, K), np.float32, spread=1.0)
    gamma = random_gamma(seed, K, np.float32)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, F)) / 8).astype(np.float32)
    g = rng.standard_normal((rows, F)).astype(np.float32)
    return x, gamma, w, g


@pytest.mark.parametrize("name", RECIPE_TIERS)
def test_the_layers_gradients_are_a_function_of_the_key(name):
    """One key twice: the same bits; another key: other dx and dw (the value, which no
    gradient rounding touches, the same)."""
    grads = _layer_grads(name)
    operands = _operands(1)
    a = grads(*operands, jax.random.key(10))
    b = grads(*operands, jax.random.key(10))
    c = grads(*operands, jax.random.key(11))
    for got, want in zip(b, a, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(c[0]), np.asarray(a[0]))
    for i, what in ((1, "dx"), (3, "dw")):
        assert np.mean(np.asarray(c[i]) != np.asarray(a[i])) > 0.5, what


def _sharded_case(axis_type, name):
    mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(axis_type,))
    rows = NamedSharding(mesh, P("data", None))
    x, gamma, w, g = _operands(2, rows=256)
    grads = _layer_grads(name)
    key = jax.random.key(12)
    context = jax.set_mesh(mesh) if axis_type == AxisType.Explicit else _nothing()
    with context:
        sharded = grads(jax.device_put(x, rows), gamma, w, jax.device_put(g, rows), key)
    cpu0 = jax.devices("cpu")[0]
    single = grads(*(jax.device_put(v, cpu0) for v in (x, gamma, w, g)), key)
    return sharded, single


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    ("axis_type", "name"),
    [
        (AxisType.Explicit, "nvfp4"),
        pytest.param(AxisType.Auto, "nvfp4", marks=EXTENDED),
        pytest.param(AxisType.Explicit, "mxfp4", marks=EXTENDED),
        pytest.param(AxisType.Auto, "mxfp4", marks=EXTENDED),
    ],
)
def test_the_bits_do_not_depend_on_the_mesh(axis_type, name):
    """256 rows over 8 devices under jit (whole blocks: each device quantises its own rows
    of G): the layer's partitioning gives each element its global row, so every output
    and gradient is the unsharded call's, but for the order of the GEMMs' float32 sums
    (XLA's: 2^-16 of the largest value; a row's SR bits drawn from its row on its device
    move dx and dw by a quantisation step, about 2^-3 of them)."""
    if len(jax.devices("cpu")) < NUM_DEVICES:
        rerun_with_virtual_cpu_devices(__file__, NUM_DEVICES, "default", "-k", "mesh")
        return
    sharded, single = _sharded_case(axis_type, name)
    for what, got, want in zip(("out", "dx", "dgamma", "dw"), sharded, single, strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        tolerance = 2.0**-16 * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=2.0**-16, atol=tolerance, err_msg=what)


# --- The Hadamard transform ---------------------------------------------------------


@pytest.mark.parametrize("d", [16, 32])
def test_the_transform_is_exact_on_unquantised_operands(d):
    """(M X)^T (M G) / d = X^T G to float32 rounding (a few ulps of the result's scale),
    with the recipe's signs; the twin's transform has the same bits."""
    rng = np.random.default_rng(d)
    x = rng.standard_normal((4 * d, 24)).astype(np.float32)
    g = rng.standard_normal((4 * d, 40)).astype(np.float32)
    x[3, 5] = 80.0  # an outlier, which the transform spreads over its block
    mask = parts.HADAMARD_SIGNS[d]
    transform = jax.jit(lambda v: parts.hadamard_rows(v, d, mask))
    mx, mg = (np.asarray(transform(v)) for v in (x, g))
    for v, mv in ((x, mx), (g, mg)):
        np.testing.assert_array_equal(layer_twin.hadamard_rows(v, d, mask), mv)
    got = mx.astype(np.float64).T @ mg.astype(np.float64) / d
    want = x.astype(np.float64).T @ g.astype(np.float64)
    scale = np.abs(x).astype(np.float64).T @ np.abs(g).astype(np.float64)
    assert np.all(np.abs(got - want) <= 8 * 2.0**-24 * scale)
    # The outlier spread over its block: every row of the transformed block holds it.
    others = np.abs(x[:d, 5]).sum() - 80.0
    assert np.all(np.abs(mx[:d, 5]) >= 80.0 - others)


def _transformed_layer_cases():
    cases = []
    for name in FP4:
        for hadamard in (False, True):
            marks = [NEEDS_THE_NORMS_TRANSFORM] if hadamard else []
            cases.append(pytest.param(name, hadamard, marks=marks))
    return cases


@pytest.mark.parametrize(("name", "hadamard"), _transformed_layer_cases())
def test_the_layers_dw_is_within_the_formats_error_with_and_without_the_transform(name, hadamard):
    """The layer's dw against float64 n^T g: the relative RMS error of FP4's rounding of
    both operands (about 0.13 measured) with the transform as without; a layer that left
    either operand untransformed is off by the whole of dw. NVFP4's norm takes a global
    scale with room for the transformed n (up to d times |n|)."""
    x, gamma, w, g = _operands(3, rows=128)
    keywords = {**recipe(name), "stochastic_rounding": False, "hadamard": hadamard}
    h = x.astype(np.float64)
    n = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + 1e-6) * gamma
    if name == "nvfp4":
        keywords["global_scale"] = float(np.abs(n).max() * 16 / 2688)

    def loss(w):
        return jnp.sum(fp8norm.rms_norm_dense(x, gamma, w, **keywords) * g)

    dw = np.asarray(jax.jit(jax.grad(loss))(w), np.float64)
    want = n.T @ g
    error = np.sqrt(np.mean((dw - want) ** 2) / np.mean(want**2))
    assert 0.01 < error < 0.25, error


# --- 2-D weight tiles -------------------------------------------------------------------


def _dequantised_views(w, name, tiles: bool):
    """The weight as the forward GEMM ([K, F], blocks along K) and the dgrad GEMM ([F, K],
    blocks along F) read it, dequantised in float64."""
    fmt = fp8norm.RECIPES[name].weight
    b = fmt.block

    @jax.jit
    def views(w):
        if tiles:
            codes, tile, gs = quantize.quantize_weight_tiles(w, fmt)
            forward = (codes, quantize.tile_scales(tile, b, w.shape[1], transposed=False), gs)
            dgrad = (codes.T, quantize.tile_scales(tile, b, w.shape[1], transposed=True), gs)
            return forward, dgrad
        return quantize.quantize_columns(w, fmt), quantize.quantize_columns(w.T, fmt)

    forward, dgrad = views(w)

    def deq(codes, scales, gs):
        s = np.repeat(np.asarray(scales).astype(np.float64), b, axis=0)[: codes.shape[0]]
        return _deq(codes).astype(np.float64) * s * (1.0 if gs is None else float(gs))

    return deq(*forward), deq(*dgrad)


@pytest.mark.parametrize("name", RECIPE_TIERS)
def test_the_forward_and_dgrad_read_one_tiled_weight(name):
    """The tiles' forward and dgrad views dequantise to one matrix (exactly, transposed);
    with 1-D blocks along K and along F, a weight with an outlier in a tile's column does
    not (the test sees a tile scale taken from the wrong axis). The tiles are the twin's,
    a partial tile at F's end (F = 3 blocks and a half) quantised as zero-padded."""
    b = fp8norm.RECIPES[name].block
    w = np.random.default_rng(6).standard_normal((2 * b, 3 * b + b // 2)).astype(np.float32)
    w[1, 2] = 40.0
    w[b + 3, 3 * b + 1] = -25.0  # in the partial tile
    forward, dgrad = _dequantised_views(jnp.asarray(w), name, tiles=True)
    np.testing.assert_array_equal(dgrad, forward.T)
    whole = jnp.asarray(w[:, : 3 * b])  # 1-D blocks along F take whole blocks
    forward_1d, dgrad_1d = _dequantised_views(whole, name, tiles=False)
    assert not np.array_equal(dgrad_1d, forward_1d.T)
    fmt = layer_twin.SPEC_TABLE[name][0]
    gs = layer_twin.nvfp4_global_scale(np.abs(w).max()) if name == "nvfp4" else None
    codes, forward_scales, _ = layer_twin.quantize_tiles(w, fmt, gs)
    weight_fmt = fp8norm.RECIPES[name].weight
    got_codes, tile, _ = jax.jit(lambda w: quantize.quantize_weight_tiles(w, weight_fmt))(w)
    np.testing.assert_array_equal(_deq(got_codes), _deq(codes))
    got = quantize.tile_scales(tile, b, w.shape[1], transposed=False)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), forward_scales.view(np.uint8))


# --- The keywords ------------------------------------------------------------------------


def _call(name="nvfp4", **keywords):
    x, gamma, w, _ = _operands(4, rows=32)
    return jax.jit(lambda x: fp8norm.rms_norm_dense(x, gamma, w, **recipe(name), **keywords))(x)


def _grad(name="nvfp4", rows=32, **keywords):
    x, gamma, w, _ = _operands(4, rows=rows)

    def loss(x, gamma, w):
        return jnp.sum(fp8norm.rms_norm_dense(x, gamma, w, **recipe(name), **keywords) ** 2)

    return jax.jit(jax.grad(loss, (0, 1, 2)))(x, gamma, w)


@pytest.mark.parametrize("name", RECIPE_TIERS)
def test_differentiating_without_a_key_names_it(name):
    with pytest.raises(ValueError, match="key"):
        _grad(name, hadamard=False)
    _call(name)  # the forward needs none
    dx, _, dw = _grad(name, stochastic_rounding=False, hadamard=False)
    assert np.all(np.isfinite(np.asarray(dx))) and np.all(np.isfinite(np.asarray(dw)))


@pytest.mark.parametrize("keyword", ["stochastic_rounding", "hadamard", "weight_tiles"])
def test_the_fp8_recipes_refuse_the_fp4_parts(keyword):
    with pytest.raises(ValueError, match=keyword):
        _call("mxfp8", **{keyword: True})
    _call("mxfp8", **{keyword: False})


@pytest.mark.parametrize(
    ("name", "mask"), [("nvfp4", 2**16), ("nvfp4", -1), ("mxfp4", 2**32), ("mxfp4", "on")]
)
def test_a_bad_hadamard_mask_is_refused(name, mask):
    with pytest.raises(ValueError, match="hadamard"):
        _call(name, hadamard=mask, key=jax.random.key(0))


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(lambda: jax.random.key(0, impl="rbg"), id="rbg"),
        pytest.param(lambda: jax.random.split(jax.random.key(0)), id="two keys"),
        pytest.param(lambda: np.zeros(3, np.uint32), id="uint32[3]"),
        pytest.param(lambda: np.zeros(2, np.int32), id="int32[2]"),
        pytest.param(lambda: 7, id="int"),
    ],
)
def test_a_key_of_another_kind_is_refused(key):
    with pytest.raises(ValueError, match="key"):
        _call(key=key())


def test_the_raw_key_is_the_typed_keys_data():
    """jax.random.PRNGKey's uint32[2] gives the bits of jax.random.key of the same seed."""
    grads = _layer_grads("mxfp4")
    operands = _operands(5)
    typed = grads(*operands, jax.random.key(21))
    raw = grads(*operands, jax.random.PRNGKey(21))
    for a, b in zip(raw, typed, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("add", [False, pytest.param(True, marks=EXTENDED)])
def test_the_bfloat16_recipe_is_the_unquantised_layer(add):
    """recipe="bfloat16": reference.unquantized_rms_norm_dense, value and gradients, bit for
    bit, with the norm's eps (rounded through x's dtype, as every keyword of the layer's
    norm); a quantising keyword is refused."""
    x = random_rows(6, (32, K), jnp.bfloat16, spread=1.0)
    residual = random_rows(7, (32, K), jnp.bfloat16, spread=0.5)
    gamma = random_gamma(6, K, np.float32)
    w = (np.random.default_rng(6).standard_normal((K, F)) / 8).astype(np.float32)

    def layer(x, gamma, w):
        if add:
            out, residual_out = fp8norm.add_rms_norm_dense(x, residual, gamma, w, recipe="bfloat16")
            return out, residual_out
        return fp8norm.rms_norm_dense(x, gamma, w, recipe="bfloat16")

    def reference(x, gamma, w):
        eps = float(np.asarray(1e-6).astype(jnp.bfloat16).astype(np.float32))
        return unquantized_rms_norm_dense(x, gamma, w, residual if add else None, eps=eps)

    def value_and_grads(fn):
        def loss(x, gamma, w):
            value = fn(x, gamma, w)
            outs = value if add else (value,)
            return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in outs), value

        (dx, dgamma, dw), value = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(x, gamma, w)
        return [*jax.tree.leaves(value), dx, dgamma, dw]

    for got, want in zip(value_and_grads(layer), value_and_grads(reference), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="out_dtype"):
        fp8norm.rms_norm_dense(x, gamma, w, recipe="bfloat16", out_dtype=jnp.float8_e4m3fn)


def test_numpy_booleans_are_booleans():
    """np.False_ switches a part off and np.True_ takes the recipe's signs, as Python's."""
    r = fp8norm.RECIPES["nvfp4"]
    off = training_parts(r, np.False_, np.False_, np.False_)
    assert off == training_parts(r, False, False, False)
    on = training_parts(r, np.True_, np.True_, np.True_)
    assert on == training_parts(r, True, True, True) and on.hadamard == r.hadamard_signs
    with pytest.raises(ValueError, match="stochastic_rounding"):
        training_parts(fp8norm.RECIPES["mxfp8"], np.True_, None, None)
