"""FP4 outputs (docs/spec.md, "FP4 outputs: NVFP4 and MXFP4"): the kernels against the
reference on every platform (bit for bit on cpu and simt), the reference's NVFP4 against
jax.nn's own quantiser, the edge groups, traced global scales, the physical layout of
float4_e2m1fn buffers and the ops' transformations."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from exact import spec_sum_of_squares
from helpers import (
    EXTENDED,
    FLOATS,
    REQUIRE_GPU,
    assert_kernel_matches,
    assert_same_bits,
    check_against_reference,
    device_of,
    gpu_devices,
    kernels_of,
    layout,
    random_gamma,
    random_rows,
    reference_on_cpu,
    run_on,
)

import jax_fp8norm as fp8norm
from jax_fp8norm import _ffi as fp8norm_ffi

F4 = jnp.float4_e2m1fn
E4M3 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu
FORMATS = {name: layout(name, data=False) for name in ("nvfp4", "mxfp4")}
# The global scale an NVFP4 caller computes from calibration: amax / (448 * 6).
GLOBAL_SCALE = np.float32(0.0021)

check = check_against_reference


def _format(name: str, **extra) -> dict:
    kw = dict(FORMATS[name], **extra)
    if name == "nvfp4" and "global_scale" not in kw:
        kw["global_scale"] = GLOBAL_SCALE
    return kw


def _codes(y) -> np.ndarray:
    return np.asarray(y).view(np.uint8)


# Hidden sizes 64 to 16384 (7168: DeepSeek-V3; 2880 and 5120: shapes whose rows are not
# a power of two), each format, each op. The default tier takes a few per platform.
SIZE_CASES = [
    pytest.param(fmt, hidden, dtype, marks=() if default else EXTENDED)
    for fmt in FORMATS
    for hidden in (64, 512, 2880, 4096, 5120, 7168, 16384)
    for dtype in FLOATS
    for default in [
        (fmt, hidden, dtype)
        in {
            ("nvfp4", 512, jnp.bfloat16),
            ("mxfp4", 7168, jnp.bfloat16),
            ("nvfp4", 64, jnp.float32),
            ("mxfp4", 2880, jnp.float16),
        }
    ]
]


@pytest.mark.parametrize(
    ("fmt", "hidden", "dtype"), SIZE_CASES, ids=lambda v: getattr(v, "__name__", str(v))
)
def test_fp4_matches_the_reference(platform, fmt, hidden, dtype):
    rows = 3 if hidden >= 4096 else 11
    x = random_rows(hidden, (rows, hidden), dtype)
    residual = random_rows(hidden + 1, (rows, hidden), dtype)
    gamma = random_gamma(hidden, hidden, jnp.float32)
    kw = _format(fmt)
    (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **kw)
    assert y.dtype == np.dtype(F4) and y.shape == (rows, hidden)
    assert scales.shape == (rows, hidden // kw["group_size"])
    assert scales.dtype == np.dtype(kw["scale_dtype"])
    check(platform, "add_rms_norm_fp8", x, residual, gamma, **kw)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("group", [2, 6, 64, 128])
def test_fp4_other_group_sizes(platform, fmt, group):
    # Any even group size: pairs of codes never straddle a group.
    hidden = 768
    x = random_rows(group, (5, hidden), jnp.bfloat16)
    gamma = random_gamma(group, hidden, jnp.bfloat16)
    check(platform, "rms_norm_fp8", x, gamma, **_format(fmt, group_size=group))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp4_options_and_many_rows(platform, fmt):
    # eps, weight_offset, MXFP4's scale_ub, the rows of a 3-D input.
    kw = _format(fmt, eps=1e-3, weight_offset=1.0)
    if fmt == "mxfp4":
        kw["scale_ub"] = 0.5
    x = random_rows(3, (4, 33, 96), jnp.bfloat16, spread=6.0)
    gamma = random_gamma(4, 96, jnp.float32)
    check(platform, "rms_norm_fp8", x, gamma, **kw)


def _edge_rows(hidden: int, group: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Rows that reach every edge group of the spec: zeros, a NaN, an Inf, a sum of squares
    past float32 (only when the input dtype can hold it), a group of tiny values beside
    large ones, all-equal values and large values beside small ones. Groups 1 and 3 of
    every row meet a NaN and an Inf gamma; the zero and signed-zero groups (0 and 2 of
    row 1) meet finite gammas of both signs."""
    rng = np.random.default_rng(group)
    x = rng.standard_normal((8, hidden)).astype(np.float32)
    x[0] = 0.0  # a zero row
    x[1, :group] = 0.0  # one zero group
    x[1, 2 * group : 3 * group] = -0.0  # signed zeros
    x[2, 5] = np.nan
    x[3, 7] = np.inf
    x[4, :group] = 1e-6  # a group far below the row's scale
    x[4, group:] = 1e3
    x[5] = 2.5
    finfo = jnp.finfo(dtype)
    x[6] = float(finfo.max) / 2 if np.dtype(dtype) == np.float32 else float(finfo.max) * 0.9
    x[7, ::3] = -x[7, ::3] * 40
    gamma = rng.standard_normal(hidden).astype(np.float32)
    gamma[group : 2 * group] = np.nan  # a NaN gamma: one group's values are NaN
    gamma[3 * group] = np.inf
    return x.astype(dtype), gamma


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp4_edge_groups(platform, fmt, dtype):
    kw = _format(fmt)
    group = kw["group_size"]
    x, gamma = _edge_rows(8 * group, group, dtype)
    (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **kw)
    scales32 = scales.astype(np.float32)
    codes = _codes(y).reshape(8, 8, group)
    # FP4 has no NaN: a non-finite group has a NaN scale and zero codes, so that it
    # dequantises to NaN; a NaN or Inf anywhere in a row makes the whole row so.
    nan_groups = np.isnan(scales32)
    assert nan_groups[2].all() and nan_groups[3].all()
    if np.dtype(dtype) == np.float32:
        assert nan_groups[6].all()  # its sum of squares overflows
    assert nan_groups[:, 1].all() and nan_groups[:, 3].all()  # the NaN and Inf gammas
    assert (codes[nan_groups] == 0).all()
    dequantized = run_on(
        "cpu", lambda y, s: (fp8norm.dequantize(y, s, kw.get("global_scale")),), y, scales
    )[0]
    assert np.isnan(dequantized.reshape(8, 8, group)[nan_groups]).all()
    # A zero row or group: scale 0 (NVFP4) or 2^-127 (MXFP4): byte 0 either way. Its
    # codes: NVFP4's are +0 (y = 0 where the scale is 0); MXFP4's are E2M1 of n * 2^127,
    # a zero with the sign of n = (x * r) * gamma: negative where exactly one of x and
    # gamma is. (Groups 1 and 3 of row 0 meet the NaN and Inf gammas: 0 * Inf is NaN.)
    zero_groups = [(0, b) for b in (0, 2, 4, 5, 6, 7)] + [(1, 0), (1, 2)]
    x32 = x.astype(np.float32).reshape(8, 8, group)
    gamma_groups = gamma.reshape(8, group)
    for row, b in zero_groups:
        assert _codes(scales)[row, b] == 0, (row, b)
        negative = np.signbit(x32[row, b]) != np.signbit(gamma_groups[b])
        want = np.where(negative, 0x8, 0x0) if fmt == "mxfp4" else np.zeros(group, int)
        np.testing.assert_array_equal(codes[row, b], want, f"zero group {b} of row {row}")
    assert np.signbit(x32[1, 2]).all() and not np.signbit(x32[1, 0]).any()
    assert (gamma_groups[2] < 0).any() and (gamma_groups[2] > 0).any()
    # A group far below its row's scale: NVFP4's scale rounds to 0, MXFP4 keeps a
    # power of two of its own.
    if fmt == "nvfp4":
        assert _codes(scales)[4, 0] == 0 and (codes[4, 0] & 0x7 == 0).all()
    else:
        assert (codes[4, 0] & 0x7).max() >= 5
    # Every other group uses the top of the range: its largest value is 3 or more (code 5).
    used = ~nan_groups & (_codes(scales) != 0)
    assert ((codes & 0x7).max(axis=-1)[used] >= 5).all()


def _nvfp4_in_numpy(normed: np.ndarray, gs: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The spec's NVFP4 of float32 normalised rows, in NumPy (every division correctly
    rounded, ml_dtypes' conversions): (codes, scale codes)."""
    t = (normed / gs).reshape(*normed.shape[:-1], -1, 16)
    amax = np.abs(t).max(axis=-1)
    scale = np.minimum(amax / np.float32(6), np.float32(448)).astype(ml_dtypes.float8_e4m3fn)
    scale32 = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(t / scale32[..., None], -6, 6)
    q = np.where(scale32[..., None] == 0, np.float32(0), q).astype(ml_dtypes.float4_e2m1fn)
    return q.reshape(normed.shape).view(np.uint8), scale.view(np.uint8)


def _normed_in_numpy(x: np.ndarray, gamma: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Steps 1-3 of the spec in NumPy float32 (each operation correctly rounded), from
    tests/exact.py's sum of squares: the normalised rows ``n``, all NaN on a row holding
    NaN or Inf or whose sum of squares overflows."""
    x32 = x.astype(np.float32)
    eps32 = np.float32(np.asarray(eps, x.dtype))
    normed = np.full(x32.shape, np.nan, np.float32)
    for i, row in enumerate(x32):
        if not np.isfinite(row).all():
            continue
        ss = spec_sum_of_squares(row)
        if not np.isfinite(ss):
            continue
        denom = np.float32(ss / np.float32(row.size)) + eps32
        r = np.float32(0) if denom == 0 else np.float32(1) / np.sqrt(denom)
        with np.errstate(invalid="ignore", over="ignore"):
            normed[i] = (row * r) * gamma.astype(np.float32)
    return normed


def _mxfp4_in_numpy(normed: np.ndarray, group: int, scale_ub=None):
    """The spec's MXFP4 of float32 normalised rows, in NumPy: per group q = min(amax,
    scale_ub) / 6, the scale the smallest power of two >= q and at least 2^-127, codes
    E2M1(clamp(n / scale, -6, 6)) by ml_dtypes; a group holding NaN or Inf has a NaN scale
    (0xFF) and codes 0. Returns (codes, scale bytes)."""
    blocks = normed.reshape(*normed.shape[:-1], -1, group)
    with np.errstate(invalid="ignore"):
        amax = np.abs(blocks).max(axis=-1)
    bound = np.float32(np.inf if scale_ub is None else scale_ub)
    q = (np.minimum(amax, bound) / np.float32(6)).astype(np.float32)
    finite = np.isfinite(blocks).all(axis=-1)
    exponent = np.full(q.shape, -127, np.int64)
    for index in zip(*np.nonzero(finite & (q > 0)), strict=True):
        mantissa, e = np.frexp(np.float64(q[index]))  # q = mantissa * 2^e, exact
        exponent[index] = max(-127, e - 1 if mantissa == 0.5 else e)
    scale_bytes = np.where(finite, exponent + 127, 0xFF).astype(np.uint8)
    scale = np.ldexp(np.float64(1), exponent)
    quotient = blocks.astype(np.float64) / scale[..., None]  # exact: a power of two
    clamped = np.clip(np.where(finite[..., None], quotient, 0.0), -6, 6).astype(np.float32)
    codes = clamped.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return codes.reshape(normed.shape), scale_bytes


def _mxfp4_oracle_rows(dtype) -> np.ndarray:
    """Random rows over 14 decades of magnitude, and the edge groups (_edge_rows)."""
    rows = [random_rows(40 + i, (8, 384), np.float32, spread=7.0) for i in range(3)]
    edges, _ = _edge_rows(384, 48, dtype)
    rows.append(edges.astype(np.float32))
    return np.concatenate(rows).astype(dtype)


# scale_ub = 0.75 (1 + 2^-12): q = scale_ub / 6 lies just above 2^-3, so the capped groups'
# scale is 2^-2, where a scale_ub rounded to 0.75 on the way (through bfloat16, say) would
# give 2^-3.
@pytest.mark.parametrize(
    ("group", "scale_ub", "dtype"),
    [(32, None, jnp.float32), (6, 0.75 * (1 + 2**-12), jnp.bfloat16), (48, 1e-3, jnp.float32)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_mxfp4_matches_an_independent_oracle(platform, group, scale_ub, dtype):
    """MXFP4's power-of-two rule written out in NumPy from the spec (not from the
    reference): the kernels give its bits on cpu and simt (the accuracy rule on a GPU),
    and the reference gives them everywhere."""
    x = _mxfp4_oracle_rows(dtype)
    gamma = random_gamma(group, x.shape[-1], jnp.float32)
    codes, scale_bytes = _mxfp4_in_numpy(_normed_in_numpy(x, gamma), group, scale_ub)
    # The oracle meets its cases: NaN groups, the floor 2^-127, scale_ub's cap, clamped
    # codes (+-6) and both signs of zero.
    assert (scale_bytes == 0xFF).any() and (scale_bytes == 0).any()
    assert ((codes & 0x7) == 7).any() and (codes == 0x8).any() and (codes == 0).any()
    if scale_ub is not None:
        cap = int(np.frexp(np.float64(np.float32(scale_ub) / np.float32(6)))[1]) + 127
        assert ((scale_bytes == cap) | (scale_bytes == cap - 1)).mean() > 0.2
    want = (codes.view(ml_dtypes.float4_e2m1fn), scale_bytes.view(ml_dtypes.float8_e8m0fnu))
    kw = _format("mxfp4", group_size=group, scale_ub=scale_ub)
    assert_same_bits(reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma, **kw), want)
    got = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)
    assert_kernel_matches(platform, got, want)


# Where jax keeps the quantiser behind jax.nn.scaled_matmul's configs (jax 0.10 to 0.12):
# private modules, so that a jax that moves it fails here (never skips).
JAX_NN_QUANTISER_MODULES = (
    "jax._src.cudnn.scaled_matmul_stablehlo",
    "jax._src.nn.scaled_matmul_stablehlo",
    "jax._src.nn.scaled_matmul",
)


def jax_nn_quantiser(modules=JAX_NN_QUANTISER_MODULES):
    """jax.nn's block quantiser, ``quantize(x, config) -> (codes, block scales)``: public if
    jax.nn offers it, else from the first of ``modules`` that has it. Fails
    (does not skip) if none has it: the spec names it as the definition of NVFP4."""
    public = getattr(jax.nn, "quantize", None)
    if callable(public):
        return public
    import importlib

    tried = []
    for name in modules:
        try:
            quantize = getattr(importlib.import_module(name), "quantize", None)
        except ImportError as error:
            tried.append(f"{name} ({error})")
            continue
        if callable(quantize):
            return quantize
        tried.append(f"{name} (no quantize)")
    pytest.fail(
        f"jax {jax.__version__} moved jax.nn's block quantiser: not public in jax.nn and "
        f"not in {'; '.join(tried)}. Find it (the quantize step behind "
        "jax.nn.get_scaled_dot_general_config) and add its module to "
        "JAX_NN_QUANTISER_MODULES."
    )


def test_the_jax_nn_quantiser_is_found(monkeypatch):
    assert callable(jax_nn_quantiser())
    # Where no module has it, the lookup fails loudly instead of skipping.
    monkeypatch.setattr(jax.nn, "quantize", None, raising=False)
    with pytest.raises(pytest.fail.Exception, match=r"moved jax\.nn's block quantiser"):
        jax_nn_quantiser(("jax._src.no_such_module", "jax.numpy"))


def test_nvfp4_matches_jax_nn_quantiser():
    """The spec's NVFP4 is jax.nn's own quantiser (the one behind jax.nn.scaled_matmul's
    nvfp4 config) applied to the normalised float32 rows, on every group whose scale is not
    0 (there jax divides 0 by 0): the kernel gives the bits of that definition, written
    out in NumPy, everywhere. XLA compiles jax.nn's divisions by a broadcast scalar into
    multiplications by its rounded reciprocal, so jax.nn's results as XLA runs them may
    differ from the definition in rare elements; the test bounds how rare, and checks that
    the definition is on the kernel's side wherever they differ."""
    quantize = jax_nn_quantiser()
    from jax_fp8norm.reference import sum_of_squares

    rng = np.random.default_rng(0)
    hidden = 1024
    mismatched = total = 0
    for trial in range(6):
        x = random_rows(trial, (64, hidden), jnp.float32, spread=float(rng.uniform(1, 12)))
        gamma = random_gamma(trial, hidden, jnp.float32)
        gs = np.float32(np.exp(rng.uniform(-9, 2)))
        kw = _format("nvfp4", global_scale=jnp.float32(gs))
        y, scales = run_on("cpu", fp8norm.rms_norm_fp8, x, gamma, **kw)
        # The normalised rows by the spec's steps 1-3, in NumPy float32 (each operation
        # correctly rounded), from the reference's exact sum of squares.
        (ss,) = run_on("cpu", lambda x: (sum_of_squares(x),), x)
        r = np.float32(1) / np.sqrt(ss / np.float32(hidden) + np.float32(1e-6))
        normed = (x * r) * gamma
        codes, scale_codes = _nvfp4_in_numpy(normed, gs)
        np.testing.assert_array_equal(_codes(scales), scale_codes)
        np.testing.assert_array_equal(_codes(y), codes)

        def jax_nn_quantize(n, gs):
            return quantize(n[None], jax.nn.get_scaled_dot_general_config("nvfp4", gs))

        want_y, want_scales = run_on("cpu", jax_nn_quantize, normed, np.full((1,), gs, np.float32))
        nonzero = scale_codes != 0
        assert nonzero.mean() > 0.5
        keep = np.repeat(nonzero, 16, axis=-1)
        same_scales = _codes(want_scales[0]) == scale_codes
        same_codes = _codes(want_y[0]) == codes
        mismatched += (~same_scales[nonzero]).sum() + (~same_codes[keep]).sum()
        total += nonzero.sum() + keep.sum()
    assert mismatched <= total * 1e-4, (mismatched, total)


def test_nvfp4_global_scale_is_data(platform):
    """A traced global scale: one compiled program for every value, each value's bits; a
    global scale that is not a positive normal float32 makes every scale NaN."""
    x = random_rows(1, (6, 256), jnp.bfloat16)
    gamma = random_gamma(1, 256, jnp.float32)
    traces = []

    def layer(x, gamma, gs):
        traces.append(1)
        return fp8norm.rms_norm_fp8(x, gamma, **_format("nvfp4", global_scale=gs))

    fn = jax.jit(layer)
    device = device_of(platform)
    x_d, g_d = jax.device_put(x, device), jax.device_put(gamma, device)
    values = (np.float32(1.0), np.float32(0.003), np.float32(7.5))
    bad_values = (0.0, -0.0, -1.0, np.nan, np.inf, -np.inf, 1e-40)
    with kernels_of(platform):
        outs = [
            [np.asarray(o) for o in fn(x_d, g_d, jax.device_put(np.float32(gs), device))]
            for gs in values + bad_values
        ]
    assert len(traces) == 1
    for gs, got in zip(values + bad_values, outs, strict=True):
        want = reference_on_cpu(
            fp8norm.reference.rms_norm_fp8, x, gamma, **_format("nvfp4", global_scale=gs)
        )
        assert_kernel_matches(platform, got, want)
        if gs in values:
            assert (_codes(want[1]) != 0x7F).all() and (_codes(want[0]) != 0).any()
            continue
        # Every scale NaN (e4m3fn's 0x7F) and every code +0, in the reference and the
        # kernel alike: dequantised, every value is NaN.
        for name, (y, scales) in (("reference", want), (platform, got)):
            assert (_codes(scales) == 0x7F).all(), (name, gs, np.unique(_codes(scales)))
            assert (_codes(y) == 0).all(), (name, gs, np.unique(_codes(y)))
    # A float32 array of shape (1,) is a global scale too.
    check(
        platform, "rms_norm_fp8", x, gamma, **_format("nvfp4", global_scale=np.ones(1, np.float32))
    )


def test_fp4_layout_of_the_cpu_backend():
    """XLA's CPU backend holds float4_e2m1fn buffers two per byte (its layout says
    E(4)), as the handlers are told; a custom call's FP4 output decodes to the reference
    only under that layout, and an fp4_layout the handlers do not know is refused."""
    assert fp8norm_ffi.fp4_layout("cpu") == fp8norm_ffi.FP4_LAYOUT_CODES["packed_low_first"]
    hlo = jax.jit(lambda v: v.astype(F4)).lower(jnp.ones((8,), jnp.float32)).compile().as_text()
    assert "f4e2m1fn[8]{0:E(4)}" in hlo, hlo
    # The element order: the round target writes element 2k in the low nibble, and XLA
    # reads those bytes back as these values.
    values = np.float32([1, 2, 3, 4, 6, -1, 0.5, 0])
    (got,) = run_on("cpu", lambda v: (fp8norm.ops.round_float32(v, F4),), values)
    np.testing.assert_array_equal(
        got.view(np.uint8), values.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    )
    with pytest.raises(NotImplementedError, match="does not know"):
        fp8norm_ffi.fp4_layout("tpu")


def test_fp4_layout_of_the_gpu_backend():
    """On a GPU (tools/gpu_check.sh runs this first): XLA's CUDA backend holds
    float4_e2m1fn buffers packed too, as _ffi.FP4_LAYOUTS says, and the kernel's FP4
    output decodes to the reference's values within the accuracy rule."""
    gpus = gpu_devices()
    if not gpus:
        if REQUIRE_GPU:
            pytest.fail("FP8NORM_REQUIRE_GPU is set but jax sees no GPU")
        pytest.skip("no GPU backend available to jax")
    with jax.default_device(gpus[0]):
        hlo = jax.jit(lambda v: v.astype(F4)).lower(jnp.ones((8,), jnp.float32)).compile().as_text()
    packed = "f4e2m1fn[8]{0:E(4)}" in hlo
    packed_code = fp8norm_ffi.FP4_LAYOUT_CODES["packed_low_first"]
    assert packed == (fp8norm_ffi.fp4_layout("cuda") == packed_code), hlo
    x = random_rows(3, (64, 2048), jnp.bfloat16)
    gamma = random_gamma(3, 2048, jnp.float32)
    for fmt in FORMATS:
        check("gpu", "rms_norm_fp8", x, gamma, **_format(fmt))


def test_fp4_unknown_layout_is_refused(monkeypatch):
    monkeypatch.setitem(fp8norm_ffi.FP4_LAYOUT_CODES, "packed_low_first", 5)
    jax.clear_caches()
    try:
        x = jnp.ones((2, 32), jnp.float32)
        with pytest.raises(Exception, match="fp4_layout 5 is not"):
            jax.block_until_ready(
                jax.jit(functools.partial(fp8norm.rms_norm_fp8, **FORMATS["mxfp4"]))(x, x[0])
            )
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_fp4_under_vmap_jit_and_dequantised_gradients():
    x = random_rows(2, (3, 4, 128), jnp.bfloat16)
    gamma = random_gamma(2, 128, jnp.float32)
    kw = _format("nvfp4")
    batched = jax.jit(jax.vmap(lambda x: fp8norm.rms_norm_fp8(x, gamma, **kw)))(x)
    assert_same_bits(batched, fp8norm.rms_norm_fp8(x, gamma, **kw))
    # The dequantised twin: the kernel's outputs times the global scale, differentiable.
    value = fp8norm.rms_norm_fp8_dequantized(x, gamma, **kw)
    y, scales = fp8norm.rms_norm_fp8(x, gamma, **kw)
    assert_same_bits([value], [fp8norm.dequantize(y, scales, GLOBAL_SCALE)])
    grad = jax.grad(lambda g: fp8norm.rms_norm_fp8_dequantized(x, g, **kw).sum())(gamma)
    assert grad.shape == gamma.shape and np.isfinite(np.asarray(grad)).all()
    with pytest.raises(TypeError, match="no gradient"):
        jax.grad(lambda g: fp8norm.rms_norm_fp8(x, g, **kw)[0].astype(jnp.float32).sum())(gamma)


def test_fp4_export_and_aot():
    pytest.importorskip("flatbuffers", reason="jax.export's serialisation needs flatbuffers")
    x = random_rows(5, (8, 512), jnp.bfloat16)
    residual = random_rows(6, (8, 512), jnp.bfloat16)
    gamma = random_gamma(7, 512, jnp.float32)

    def layer(x, residual, gamma, gs):
        y, s, h = fp8norm.add_rms_norm_fp8(x, residual, gamma, **_format("nvfp4", global_scale=gs))
        y2, s2 = fp8norm.rms_norm_fp8(h, gamma, **FORMATS["mxfp4"])
        return y, s, y2, s2

    args = (x, residual, gamma, np.float32(0.01))
    exported = jax.export.export(
        jax.jit(layer), platforms=["cpu"], disabled_checks=fp8norm.EXPORT_DISABLED_CHECKS
    )(*args)
    restored = jax.export.deserialize(exported.serialize())
    want = jax.jit(layer)(*args)
    assert_same_bits(restored.call(*args), want)
    compiled = jax.jit(layer).lower(*args).compile()
    assert_same_bits(compiled(*args), want)
    other = (*args[:3], np.float32(0.5))
    assert_same_bits(compiled(*other), jax.jit(layer)(*other))


def test_fp4_flax_module():
    nnx = pytest.importorskip("flax.nnx")
    from jax_fp8norm.nnx import RMSNormFP8

    x = random_rows(8, (4, 256), jnp.bfloat16)
    module = RMSNormFP8(
        256, quantized_output=True, **_format("nvfp4", global_scale=jnp.float32(0.02))
    )
    y, scales = module(x)
    want = fp8norm.rms_norm_fp8(x, module.scale[...], **_format("nvfp4", global_scale=0.02))
    assert_same_bits((y, scales), want)
    assert isinstance(module.global_scale, jax.Array)
    del nnx


@pytest.mark.parametrize("gs", [1.0, 0.25, 0.1, 3.0])
def test_nvfp4_ties(platform, gs):
    """Elements whose quotient (n / gs) / s lands on a rounding boundary of E2M1, or a few
    units in the last place beside it: the AVX2 lanes' fast quotient must fall back to the
    divisions there (src/cpu/cpu_avx2.h, Nvfp4Codes). With x a row of ones and eps = 0,
    r = 1 and the normalised row is gamma itself."""
    rng = np.random.default_rng(int(gs * 8))
    groups, boundaries = 64, np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    scales = (1 + rng.integers(1, 0x7E, groups)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    s = scales.astype(np.float32)[:, None]
    gamma = boundaries[rng.integers(0, 7, (groups, 16))] * s * np.float32(gs)
    gamma = gamma.astype(np.float32)
    gamma = (gamma.view(np.uint32) + rng.integers(-3, 4, gamma.shape).astype(np.uint32)).view(
        np.float32
    )
    gamma[:, 0] = np.float32(6) * s[:, 0] * np.float32(gs)  # the group's abs-max: scale s
    gamma *= np.where(rng.random(gamma.shape) < 0.5, -1, 1).astype(np.float32)
    x = np.ones((4, groups * 16), np.float32)
    kw = _format("nvfp4", global_scale=np.float32(gs), eps=0.0)
    check(platform, "rms_norm_fp8", x, gamma.reshape(-1), **kw)


@pytest.mark.parametrize(
    ("fmt", "hidden"), [("nvfp4", 16), ("nvfp4", 512), ("mxfp4", 32), ("mxfp4", 256)]
)
def test_fp4_one_group_per_row(platform, fmt, hidden):
    # group_size == N: FP4 takes the group paths with one group per row.
    x = random_rows(hidden, (9, hidden), jnp.bfloat16)
    gamma = random_gamma(hidden, hidden, jnp.float32)
    (_, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **_format(fmt, group_size=hidden))
    assert scales.shape == (9, 1)


def test_fp4_empty_shapes(platform):
    for shape in ((0, 64), (3, 0), (2, 0, 32)):
        x = np.zeros(shape, np.float32)
        gamma = np.ones(shape[-1], np.float32)
        for fmt in FORMATS:
            kw = _format(fmt)
            (y, scales), _ = check(platform, "rms_norm_fp8", x, gamma, **kw)
            groups = shape[-1] // kw["group_size"]
            assert y.shape == shape and scales.shape == shape[:-1] + (groups,)


def test_nvfp4_global_scale_overflow_takes_the_formula(platform):
    """Finite values that overflow float32 when divided by a tiny global scale: the
    group's scale saturates at 448 and its codes at +-6, as jax.nn's quantiser gives."""
    x = random_rows(11, (5, 256), jnp.float32, spread=1.0)
    gamma = np.full(256, 8.0, np.float32)
    (y, scales), _ = check(
        platform, "rms_norm_fp8", x, gamma, **_format("nvfp4", global_scale=np.float32(2e-38))
    )
    assert (_codes(scales) == 0x7E).mean() > 0.5  # 448
    assert ((_codes(y) & 0x7) == 7).mean() > 0.2  # 6


def test_nvfp4_batched_global_scales(platform):
    # vmap over the global scale: one kernel call per scale, in a compiled loop.
    x = random_rows(12, (4, 128), jnp.bfloat16)
    gamma = random_gamma(12, 128, jnp.float32)
    scales = np.float32([1.0, 0.003, 0.5])

    def batched(x, gamma, gs):
        return jax.vmap(
            lambda g: fp8norm.rms_norm_fp8(x, gamma, **_format("nvfp4", global_scale=g))
        )(gs)

    got = run_on(platform, batched, x, gamma, scales)
    for i, gs in enumerate(scales):
        want = reference_on_cpu(
            fp8norm.reference.rms_norm_fp8, x, gamma, **_format("nvfp4", global_scale=gs)
        )
        assert_kernel_matches(platform, [o[i] for o in got], want)
