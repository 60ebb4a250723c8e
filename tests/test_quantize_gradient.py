"""The output gradient's FP4 quantiser as a kernel (jax_fp8norm._quantize_kernels, behind
quantize_gradient_rows / quantize_gradient_columns): its bits against the jnp twins
(reference_quantize_gradient_rows / _columns) on every platform, for NVFP4 and MXFP4, both
copies, round-to-nearest and stochastic rounding, the wgrad copy's Hadamard transform on
and off; stochastic rounding's bits independent of the CPU's split into tasks and of the
platform, and unbiased; the edge cases and the checks of its arguments."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXTENDED, is_gpu, run_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm
from jax_fp8norm import _ffi, _fp4_parts, quantize
from jax_fp8norm.recipes import RECIPES

FORMATS = ("nvfp4", "mxfp4")
KEY = jnp.array([7, 2026], jnp.uint32)


def fmt_of(name: str):
    return RECIPES[name].gradient


def words(stream: int = _fp4_parts.DGRAD_STREAM, key=KEY):
    return _fp4_parts.stream_key(key, stream)


def gradient(shape, seed: int = 0) -> np.ndarray:
    """Rows of magnitudes from 1e-3 to 1e3, a zero block of rows and of columns, and a
    column of one value repeated."""
    rng = np.random.default_rng(seed)
    r = shape[0]
    g = rng.standard_normal(shape) * 10 ** rng.uniform(-3, 3, (r, 1))
    g[:, :3] = 0.0
    g[: min(r, 32)] *= 0
    g[:, -1] = 0.75
    return g.astype(np.float32)


def quantizer(columns: bool, fmt, stream_words, mask, *, reference: bool = False):
    """The call of one copy (the kernel's or the twin's) as a function of g."""
    if columns:
        fn = (
            quantize.reference_quantize_gradient_columns
            if reference
            else quantize.quantize_gradient_columns
        )
        return lambda g: fn(g, fmt, stream_words, mask)
    fn = quantize.reference_quantize_gradient_rows if reference else quantize.quantize_gradient_rows
    return lambda g: fn(g, fmt, stream_words)


def bits_of(value: np.ndarray) -> np.ndarray:
    value = np.asarray(value)
    return value.view(np.uint8 if value.dtype.itemsize == 1 else np.uint32)


def assert_same_outputs(got, want):
    """Codes and scales bit for bit; global scales bit for bit, any NaN as any NaN."""
    assert len(got) == len(want)
    names = ("codes", "scales", "global scale")[: len(got)]
    for name, x, y in zip(names, got, want, strict=True):
        if y is None:
            assert x is None, name
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape)
        if x.dtype == np.float32:
            nan = np.isnan(y)
            np.testing.assert_array_equal(np.isnan(x), nan, err_msg=name)
            np.testing.assert_array_equal(bits_of(x)[~nan], bits_of(y)[~nan], err_msg=name)
        else:
            np.testing.assert_array_equal(bits_of(x), bits_of(y), err_msg=name)


def run_copy(platform, columns, fmt, g, stream_words, mask):
    """The kernel's outputs on ``platform`` and the twin's (on the CPU)."""
    fn = quantizer(columns, fmt, stream_words, mask)
    got = jax.jit(fn)(jax.device_put(g, jax.devices("gpu" if is_gpu(platform) else "cpu")[0]))
    want = jax.jit(quantizer(columns, fmt, stream_words, mask, reference=True))(g)
    return got, want


# (format, columns, stochastic, hadamard): the columns copy is the only one with a
# transform; its shape has an odd F, whose packed bytes straddle rows.
CASES = [
    (name, columns, stochastic, hadamard)
    for name, columns, stochastic, hadamard in itertools.product(
        FORMATS, (False, True), (False, True), (False, True)
    )
    if columns or not hadamard
]


@pytest.mark.sampled(3)
@pytest.mark.parametrize(("name", "columns", "stochastic", "hadamard"), CASES)
def test_bits_match_twin(platform, name, columns, stochastic, hadamard):
    fmt = fmt_of(name)
    shape = (96, 37) if columns else (40, 160)
    stream = words(_fp4_parts.WGRAD_STREAM if columns else _fp4_parts.DGRAD_STREAM)
    mask = _fp4_parts.HADAMARD_SIGNS[fmt.block] if hadamard else None
    got, want = run_copy(
        platform, columns, fmt, gradient(shape), stream if stochastic else None, mask
    )
    assert_same_outputs(got, want)


SHAPES = [(32, 64), (64, 32), (160, 96), (256, 1), (32, 4097)]


@EXTENDED
@pytest.mark.parametrize(
    ("name", "columns", "stochastic", "hadamard", "shape"),
    [
        (*case, shape)
        for case, shape in itertools.product(CASES, SHAPES)
        # The blocked axis a multiple of the block.
        if (shape[0] if case[1] else shape[1]) % fmt_of(case[0]).block == 0
    ],
)
def test_bits_match_twin_shapes(platform, name, columns, stochastic, hadamard, shape):
    fmt = fmt_of(name)
    mask = 0 if hadamard and name == "mxfp4" else _fp4_parts.HADAMARD_SIGNS[fmt.block]
    got, want = run_copy(
        platform,
        columns,
        fmt,
        gradient(shape, seed=shape[0]),
        words() if stochastic else None,
        mask if hadamard else None,
    )
    assert_same_outputs(got, want)


def test_stochastic_bits_do_not_depend_on_tasks():
    """The CPU kernel split into one row (block of rows) per task, seven, and its default:
    the same bits; the first rows of a large call are those of a call of those rows."""
    fmt = fmt_of("nvfp4")
    g = gradient((160, 256), seed=3)
    outputs = {}
    try:
        for rows in (1, 7, 0):
            _ffi._fp8norm_cpu.set_quantize_gradient_task_rows(rows)
            for columns in (False, True):
                fn = jax.jit(quantizer(columns, fmt, words(), None))
                outputs[rows, columns] = fn(g)
    finally:
        _ffi._fp8norm_cpu.set_quantize_gradient_task_rows(0)
    for columns in (False, True):
        assert_same_outputs(outputs[1, columns], outputs[0, columns])
        assert_same_outputs(outputs[7, columns], outputs[0, columns])
    head = jax.jit(quantizer(False, fmt, words(), None))(g[:48])
    whole = outputs[0, False]
    assert_same_outputs(head, tuple(None if o is None else o[:48] for o in whole))


def test_stochastic_bits_do_not_depend_on_platform():
    fmt = fmt_of("mxfp4")
    g = gradient((64, 96), seed=4)
    for columns in (False, True):
        fn = quantizer(columns, fmt, words(), _fp4_parts.HADAMARD_SIGNS[32] if columns else None)
        cpu = run_on("cpu", lambda g, fn=fn: fn(g)[:2], g)
        with jax_fp8norm.simt.kernels():
            simt = run_on("cpu", lambda g, fn=fn: fn(g)[:2], g)
        assert_same_outputs(cpu, simt)


# One value in each FP4 interval (and on its ends) of a group whose scale is 1: MXFP4's
# with 6 in it, NVFP4's under the row's global scale 6 / 2688, whose block scale is 448.
VALUES = np.array(
    [6.0, 0.1, 0.3, 0.5, 0.6, 0.8, 1.1, 1.4, 1.6, 1.9, 2.2, 2.7, 3.2, 3.7, 4.5, 5.5]
    + [-0.05, -0.45, -0.7, -1.2, -1.75, -2.5, -3.5, -5.1, 0.2, 0.9, 1.3, 2.9, 4.1, 5.9, -6, 0],
    np.float32,
)
DRAWS = 2048


def dequantized(codes, scales, gs, block: int, columns: bool):
    codes = np.asarray(codes).astype(np.float32)
    scales = np.asarray(scales).astype(np.float32)
    axis = 0 if columns else 1
    deq = codes * np.repeat(scales, block, axis=axis)
    # run_on gives MXFP4's missing global scale as an object array of None.
    return deq if gs is None or gs.dtype == object else deq * gs


def interval_bounds(value: np.ndarray):
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    a = np.abs(value)
    hi = grid[np.searchsorted(grid, a, side="left")]
    lo = grid[np.searchsorted(grid, a, side="right") - 1]
    return lo, hi


def sr_mean_error(platform, name: str, columns: bool, stochastic: bool) -> np.ndarray:
    """|mean of the dequantised draws - value| in standard errors of an unbiased rounding,
    per value, over DRAWS rows (or columns) whose bits differ."""
    fmt = fmt_of(name)
    values = VALUES[: fmt.block] if name == "nvfp4" else VALUES
    g = np.tile(
        values[:, None] if columns else values[None, :], (1, DRAWS) if columns else (DRAWS, 1)
    )
    stream = words() if stochastic else None
    out = run_on(platform, quantizer(columns, fmt, stream, None), g)
    deq = dequantized(*out, fmt.block, columns)
    draws = deq if columns else deq.T  # [values, draws]
    lo, hi = interval_bounds(values)
    se = np.sqrt((hi - np.abs(values)) * (np.abs(values) - lo) / DRAWS)
    error = np.abs(draws.mean(axis=1) - values)
    return error / np.maximum(se, 1e-6)


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_stochastic_rounding_is_unbiased(platform, name, columns):
    assert np.all(sr_mean_error(platform, name, columns, True) < 5.0)


@pytest.mark.parametrize("name", FORMATS)
def test_round_to_nearest_is_not_unbiased(name):
    """The unbiasedness test's check fails for rounding to nearest: it can fail."""
    assert not np.all(sr_mean_error("cpu", name, False, False) < 5.0)


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_non_finite_and_zero_blocks(platform, name, columns):
    fmt = fmt_of(name)
    g = gradient((64, 64), seed=5)
    g[5, 7] = np.nan
    g[40, 50] = np.inf
    g[48:64, 32:64] = 0.0
    got, want = run_copy(platform, columns, fmt, g, words(), None)
    assert_same_outputs(got, want)
    codes, scales = np.asarray(got[0]).astype(np.float32), bits_of(got[1])
    nan_code = 0x7F if name == "nvfp4" else 0xFF
    if columns:
        # NVFP4's tensor scale is NaN: every scale NaN, every code 0.
        if name == "nvfp4":
            assert np.isnan(got[2]) and np.all(scales == nan_code) and np.all(codes == 0)
        else:
            assert scales[0, 7] == nan_code and np.all(codes[:32, 7] == 0)
    else:
        assert np.all(codes[5] == 0) if name == "nvfp4" else np.all(codes[5, :32] == 0)
        assert np.all(scales[5] == nan_code) if name == "nvfp4" else scales[5, 0] == nan_code
        assert np.all(codes[48:64, 32:64] == 0)


@pytest.mark.parametrize("columns", [False, True])
def test_blocked_axis_not_a_multiple_is_an_error(columns):
    fmt = fmt_of("nvfp4")
    g = np.ones((40, 40) if columns else (32, 40), np.float32)
    with pytest.raises(ValueError, match=r"g's .* needs (R|F) a multiple of the block 16"):
        quantizer(columns, fmt, None, None)(g)


def test_bad_arguments_are_errors():
    fmt = fmt_of("mxfp4")
    g = np.ones((64, 64), np.float32)
    with pytest.raises(ValueError, match="g must be a float array"):
        quantize.quantize_gradient_rows(np.ones((64,), np.float32), fmt)
    with pytest.raises(ValueError, match="stream_words must be uint32"):
        quantize.quantize_gradient_rows(g, fmt, jnp.zeros((3,), jnp.uint32))
    with pytest.raises(ValueError, match="hadamard_mask must have one bit per row"):
        quantize.quantize_gradient_columns(g, fmt, None, 2**32)


@pytest.mark.parametrize("shape", [(0, 32), (32, 0)])
@pytest.mark.parametrize("name", FORMATS)
def test_no_elements(platform, name, shape):
    """Empty outputs, and NVFP4's global scales of no values those of a zero amax, 1."""
    fmt = fmt_of(name)
    for columns in (False, True):
        out = run_on(platform, quantizer(columns, fmt, words(), None), np.zeros(shape, np.float32))
        assert out[0].shape == shape
        if name == "nvfp4":
            assert np.all(out[2] == 1.0)


@pytest.mark.parametrize("handler", ["cpu", "simt"])
def test_handler_refuses_bad_buffers(handler):
    """A call that bypasses the wrapper with scales of the wrong shape: the handler's
    error, naming the op, and no write out of bounds."""
    target = (_ffi.EMULATED_TARGETS if handler == "simt" else _ffi.TARGETS)["quantize_gradient"]
    shapes = (
        jax.ShapeDtypeStruct((32, 32), jnp.float4_e2m1fn),
        jax.ShapeDtypeStruct((32, 3), jnp.float8_e4m3fn),  # [32, 2] for blocks of 16
        jax.ShapeDtypeStruct((32, 1), jnp.float32),
    )
    call = jax.ffi.ffi_call(target, shapes)
    attrs = dict(
        nvfp4=True,
        block=np.int64(16),
        columns=False,
        stochastic=False,
        hadamard_mask=np.int64(-1),
        fp4_layout=np.int64(_ffi.fp4_layout("cpu")),
    )
    with pytest.raises(Exception, match="quantize_gradient: scales must be"):
        jax.block_until_ready(
            jax.jit(lambda g, k: call(g, k, **attrs))(
                jnp.ones((32, 32), jnp.float32), jnp.zeros((2,), jnp.uint32)
            )
        )


def test_lowers_to_the_kernel():
    """The wrappers lower to the kernel's target, the emulated one under the emulation."""
    fn = quantizer(True, fmt_of("nvfp4"), words(), 0)
    g = np.ones((32, 32), np.float32)
    assert 'custom_call_target="fp8norm_quantize_gradient"' in jax.jit(fn).lower(g).as_text(
        dialect="hlo"
    )
    with jax_fp8norm.simt.kernels():
        text = jax.jit(fn).lower(g).as_text(dialect="hlo")
    assert 'custom_call_target="fp8norm_simt_quantize_gradient"' in text


@pytest.mark.parametrize("columns", [False, True])
def test_sharded_rows_give_the_twins_bits(columns):
    """g split by rows over 4 devices (tests/helpers.py asks XLA for 8; as many as there
    are, where a caller asked for fewer): under jit the twins' bits of the whole; inside
    shard_map (the rows copy) each device's rows those of a call of its rows alone, their
    random bits those of their local rows, as the spec says of a user's shard_map."""
    devices = jax.devices("cpu")[:4]
    devices = devices[: 2 ** (len(devices).bit_length() - 1)]  # 128 rows split evenly
    mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    fmt = fmt_of("nvfp4")
    g = gradient((128, 64), seed=6)
    mask = _fp4_parts.HADAMARD_SIGNS[16] if columns else None
    fn = quantizer(columns, fmt, words(), mask)
    sharded = jax.device_put(g, NamedSharding(mesh, P("dp")))
    assert_same_outputs(
        jax.jit(fn)(sharded), quantizer(columns, fmt, words(), mask, reference=True)(g)
    )
    if not columns:
        per_device = jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=(P("dp"), P("dp"), P("dp")))
        )(sharded)
        rows = 128 // len(devices)
        for d in range(len(devices)):
            part = slice(d * rows, (d + 1) * rows)
            want = quantizer(False, fmt, words(), None, reference=True)(g[part])
            assert_same_outputs(tuple(np.asarray(o)[part] for o in per_device), want)


def test_vmap_is_one_call_per_element():
    fmt = fmt_of("nvfp4")
    g = np.stack([gradient((32, 64), seed=s) for s in range(2)])
    batched = jax.vmap(quantizer(False, fmt, words(), None))(g)
    for i in range(2):
        one = quantizer(False, fmt, words(), None)(g[i])
        assert_same_outputs(tuple(o[i] for o in batched), one)
