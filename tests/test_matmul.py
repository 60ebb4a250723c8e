"""fp8_matmul against the dequantised float64 matmul: FP8, and FP4 (NVFP4, MXFP4) operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import device_of, random_rows, run_on

import jax_fp8norm as fp8norm
from jax_fp8norm.matmul import fp8_matmul, matmul_path, native_block_scaled_available
from jax_fp8norm.quantize import (
    quantize_blocks,
    quantize_per_channel,
    quantize_weights_mxfp4,
    quantize_weights_nvfp4,
)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_fp8_matmul_matches_dequantised_matmul(platform, out_dtype):
    x = random_rows(50, (2, 24, 512), jnp.bfloat16)
    gamma = np.ones(512, np.float32)
    w = np.random.default_rng(51).standard_normal((512, 384)).astype(np.float32) / 20
    (a, a_scales) = run_on(platform, fp8norm.rms_norm_fp8, x, gamma)
    w8, w_scales = (np.asarray(v) for v in quantize_per_channel(w))
    (out,) = run_on(
        platform,
        lambda *args: (fp8_matmul(*args, out_dtype=out_dtype),),
        a,
        a_scales,
        w8,
        w_scales,
    )
    expected = (a.astype(np.float64) * a_scales) @ (w8.astype(np.float64) * w_scales)
    assert out.shape == (2, 24, 384) and out.dtype == jnp.dtype(out_dtype)
    tolerance = 1e-5 if out_dtype == jnp.float32 else 2**-8
    scale = np.abs(expected).max()
    assert np.abs(out.astype(np.float64) - expected).max() <= tolerance * scale


def test_quantize_per_channel():
    w = np.random.default_rng(52).standard_normal((64, 32)).astype(np.float32)
    w[:, 3] = 0
    w8, scales = (np.asarray(v) for v in quantize_per_channel(w))
    assert w8.dtype == jnp.float8_e4m3fn and scales.shape == (32,)
    assert scales[3] == 1 and (w8[:, 3].astype(np.float32) == 0).all()
    np.testing.assert_allclose(np.abs(w8.astype(np.float32)).max(0)[np.arange(32) != 3], 448)
    dequantised = w8.astype(np.float32) * scales
    assert np.abs(dequantised - w).max() <= np.abs(w).max() * 2.0**-4


def test_fp8_matmul_bad_input():
    a = jnp.ones((4, 8), jnp.float8_e4m3fn)
    s = jnp.ones((4, 1), jnp.float32)
    w = jnp.ones((8, 3), jnp.float8_e4m3fn)
    ws = jnp.ones((3,), jnp.float32)
    with pytest.raises(TypeError, match="a must be an FP8 array"):
        fp8_matmul(a.astype(jnp.bfloat16), s, w, ws)
    with pytest.raises(ValueError, match="w must have shape"):
        fp8_matmul(a, s, jnp.ones((7, 3), jnp.float8_e4m3fn), ws)
    with pytest.raises(ValueError, match="a_scales must have shape"):
        fp8_matmul(a, jnp.ones((4,), jnp.float32), w, ws)
    with pytest.raises(ValueError, match="w_scales must have shape"):
        fp8_matmul(a, s, w, jnp.ones((4,), jnp.float32))
    with pytest.raises(ValueError, match="a_scales must have shape"):
        fp8_matmul(a, jnp.ones((4, 3), jnp.float32), w, ws)  # 3 groups do not divide K = 8
    with pytest.raises(ValueError, match="w_scales must have shape"):
        fp8_matmul(a, s, w, jnp.ones((3, 3), jnp.float32))


def _dequantized(v, scales, axis):
    """v times its scales, each repeated over its group along `axis` (per-channel weight
    scales [M] broadcast over the rows)."""
    v = np.asarray(v).astype(np.float64)
    scales = np.asarray(scales).astype(np.float64)
    if scales.ndim == v.ndim:
        scales = np.repeat(scales, v.shape[axis] // scales.shape[axis], axis=axis)
    return v * scales


@pytest.mark.sampled(4)
@pytest.mark.default_platforms("cpu", "simt-block_shared")
@pytest.mark.parametrize(
    "norm_kw",
    [
        dict(group_size=128),
        dict(group_size=128, power_of_two_scales=True),
        dict(group_size=32, scale_dtype=jnp.float8_e8m0fnu),
    ],
    ids=["group128", "group128-ue8m0", "mxfp8"],
)
@pytest.mark.parametrize("weights", ["per_channel", "blocks"])
def test_fp8_matmul_with_block_scales(platform, norm_kw, weights):
    x = random_rows(53, (3, 16, 512), jnp.bfloat16)
    gamma = np.ones(512, np.float32)
    w = np.random.default_rng(54).standard_normal((512, 256)).astype(np.float32) / 20
    a, a_scales = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **norm_kw)
    quantize = quantize_per_channel if weights == "per_channel" else quantize_blocks
    w8, w_scales = (np.asarray(v) for v in quantize(w))
    (out,) = run_on(
        platform,
        lambda *args: (fp8_matmul(*args, out_dtype=jnp.float32),),
        a,
        a_scales,
        w8,
        w_scales,
    )
    expected = _dequantized(a, a_scales, -1) @ _dequantized(w8, w_scales, 0)
    assert out.shape == (3, 16, 256)
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()
    mxfp8 = "scale_dtype" in norm_kw and weights == "blocks"
    want_path = "scaled_matmul" if mxfp8 and native_block_scaled_available() else "dequantize"
    assert matmul_path(a, a_scales, w8, w_scales) == want_path


def test_quantize_blocks():
    w = np.random.default_rng(55).standard_normal((128, 16)).astype(np.float32)
    w[:32, 2] = 0
    w[64:96, 5] *= 2.0**-120  # amax / 448 below 2^-126: decided from the abs-max
    w8, scales = (np.asarray(v) for v in quantize_blocks(w))
    assert w8.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float8_e8m0fnu
    assert scales.shape == (4, 16)
    s = scales.astype(np.float32)
    assert np.all(np.frexp(s)[0] == 0.5), "powers of two"
    largest = np.abs(w8.astype(np.float32)).reshape(4, 32, 16).max(1)
    nonzero = np.ones((4, 16), bool)
    nonzero[0, 2] = nonzero[2, 5] = False
    assert np.all((largest[nonzero] >= 224) & (largest[nonzero] <= 448))
    # The norm's power-of-two rule (docs/spec.md, "Scales"): e8m0's floor is 2^-127, its
    # byte 0, for a zero block and for one whose amax / 448 is at most 2^-127.
    assert s[0, 2] == 2.0**-127 and np.all(w8[:32, 2].astype(np.float32) == 0)
    amax = np.abs(w[64:96, 5]).max()
    assert s[2, 5] == (2.0**-127 if amax <= 448 * 2.0**-127 else 2.0**-126), (amax, s[2, 5])
    np.testing.assert_allclose(_dequantized(w8, scales, 0), w, rtol=2**-3, atol=0)
    # A block holding NaN or Inf: a NaN scale (0xFF) and zero codes, as MXFP4's.
    w[32:64, 7] = np.inf
    w8, scales = (np.asarray(v) for v in quantize_blocks(w))
    assert scales.view(np.uint8)[1, 7] == 0xFF and np.all(w8[32:64, 7].astype(np.float32) == 0)


def _gpu_of_capability(platform: str, capability: float, what: str):
    """The GPU, if the platform is one of at least this compute capability; else a skip."""
    if platform != "gpu":
        pytest.skip("a GPU-only check")
    device = device_of("gpu")
    if float(getattr(device, "compute_capability", "0")) < capability:
        pytest.skip(f"{device.device_kind} has no {what}")
    return device


def test_mxfp8_goes_to_cudnn_on_blackwell(platform):
    # jax.nn.scaled_matmul lowers MXFP8 operands to cuDNN's block-scaled GEMM on GPUs of
    # compute capability 10.0 and newer; fp8_matmul must take that path there.
    device = _gpu_of_capability(platform, 10.0, "block-scaled tensor cores")
    a = jnp.ones((64, 256), jnp.float8_e4m3fn)
    a_scales = jnp.ones((64, 8), jnp.float8_e8m0fnu)
    w, w_scales = quantize_blocks(jnp.ones((256, 128), jnp.float32))
    args = [jax.device_put(v, device) for v in (a, a_scales, w, w_scales)]
    assert matmul_path(*args) == "scaled_matmul"
    hlo = jax.jit(fp8_matmul).lower(*args).compile().as_text()
    assert "cudnn" in hlo.lower(), hlo[-3000:]


def test_fp8_matmul_is_an_fp8_gemm_on_gpu(platform):
    # On GPUs with FP8 tensor cores (sm_89 and newer) XLA runs the FP8 dot as a cuBLASLt
    # FP8 GEMM rather than converting the operands to a wider type first.
    device = _gpu_of_capability(platform, 8.9, "FP8 tensor cores")
    a = jnp.ones((64, 256), jnp.float8_e4m3fn)
    w = jnp.ones((256, 128), jnp.float8_e4m3fn)
    a_scales, w_scales = jnp.ones((64, 1), jnp.float32), jnp.ones((128,), jnp.float32)
    args = [jax.device_put(v, device) for v in (a, a_scales, w, w_scales)]
    hlo = jax.jit(fp8_matmul).lower(*args).compile().as_text()
    assert "__cublas$lt$matmul$f8" in hlo, hlo[-3000:]


# ----- FP4 operands. The activations are quantised here, in numpy and ml_dtypes, by the
# SPEC's rules for the norm ops' FP4 rows, independently of the package.

F4 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


def _rows_nvfp4(x, global_scale):
    """float32 rows [..., K] to NVFP4: (y float4_e2m1fn, scales [..., K // 16] e4m3)."""
    t = np.asarray(x, np.float32) / np.float32(global_scale)
    blocks = t.reshape(*t.shape[:-1], -1, 16)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scales = np.minimum(amax / np.float32(6), np.float32(448)).astype(E4M3)
    s = scales.astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(s > 0, np.clip(blocks / s, -6, 6), 0).astype(np.float32)
    return y.reshape(t.shape).astype(F4), scales[..., 0]


def _rows_mxfp4(x):
    """float32 rows [..., K] to MXFP4: (y float4_e2m1fn, scales [..., K // 32] e8m0)."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    mantissa, e = np.frexp(np.maximum(amax / np.float32(6), np.float32(2.0**-126)))
    exponent = np.where(amax == 0, -127, np.where(mantissa == 0.5, e - 1, e))
    y = np.clip(blocks * np.ldexp(np.float32(1), -exponent), -6, 6).astype(np.float32)
    scales = (exponent + 127).astype(np.uint8).view(E8M0)
    return y.reshape(x.shape).astype(F4), scales[..., 0]


def _deq(v, scales, axis, global_scale=1.0):
    """The float64 dequantisation: v times its block scales repeated along `axis`."""
    v = np.asarray(v).astype(np.float64)
    s = np.asarray(scales).astype(np.float64)
    return v * np.repeat(s, v.shape[axis] // s.shape[axis], axis=axis) * global_scale


def _fp4_operands(fmt, rows_shape, k=256, n=64, a_gs=0.03, w_gs=None):
    """FP4 (a, a_scales, w, w_scales, w_global_scale) with random data."""
    rng = np.random.default_rng(60)
    x = rng.standard_normal((*rows_shape, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) / 20
    if fmt == "nvfp4":
        a, a_scales = _rows_nvfp4(x, a_gs)
        w4, w_scales, gs = quantize_weights_nvfp4(w, w_gs)
        return a, a_scales, w4, w_scales, gs
    a, a_scales = _rows_mxfp4(x)
    w4, w_scales = quantize_weights_mxfp4(w)
    return a, a_scales, w4, w_scales, None


@pytest.mark.parametrize("rows_shape", [(32,), (2, 3, 8)], ids=["2d", "batched"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_matmul_matches_dequantised_matmul(fmt, rows_shape):
    a_gs = 0.03
    a, a_scales, w4, w_scales, w_gs = _fp4_operands(fmt, rows_shape, a_gs=a_gs)
    kwargs = dict(a_global_scale=a_gs, w_global_scale=w_gs) if fmt == "nvfp4" else {}
    out = np.asarray(fp8_matmul(a, a_scales, w4, w_scales, out_dtype=jnp.float32, **kwargs))
    if fmt == "nvfp4":
        expected = _deq(a, a_scales, -1, a_gs) @ _deq(w4, w_scales, 0, float(w_gs))
    else:
        expected = _deq(a, a_scales, -1) @ _deq(w4, w_scales, 0)
    assert out.shape == (*rows_shape, 64) and out.dtype == np.float32
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    want = "scaled_matmul" if fmt == "nvfp4" and native_block_scaled_available() else "dequantize"
    assert matmul_path(a, a_scales, w4, w_scales) == want
    # bfloat16 out: the float32 result rounded.
    out16 = fp8_matmul(a, a_scales, w4, w_scales, **kwargs)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out16), out.astype(jnp.bfloat16))


def test_fp4_matmul_path_on_cpu():
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the default backend is not the CPU")
    for fmt in ("nvfp4", "mxfp4"):
        a, a_scales, w4, w_scales, _ = _fp4_operands(fmt, (4,), k=64, n=8)
        assert matmul_path(a, a_scales, w4, w_scales) == "dequantize"


def test_nvfp4_traced_global_scales_compile_once():
    a, a_scales, w4, w_scales, w_gs = _fp4_operands("nvfp4", (16,), k=128, n=32)
    traces = []

    @jax.jit
    def matmul(a_gs, w_gs):
        traces.append(None)
        return fp8_matmul(
            a,
            a_scales,
            w4,
            w_scales,
            out_dtype=jnp.float32,
            a_global_scale=a_gs,
            w_global_scale=w_gs,
        )

    base = _deq(a, a_scales, -1) @ _deq(w4, w_scales, 0)
    for a_gs, w_scale in ((0.03, 1.0), (2.5, 0.125)):
        w_gs_now = np.asarray(w_gs, np.float32).reshape(1) * np.float32(w_scale)  # shape (1,)
        out = np.asarray(matmul(jnp.asarray(a_gs, jnp.float32), jnp.asarray(w_gs_now)))
        expected = base * np.float64(np.float32(a_gs)) * np.float64(w_gs_now[0])
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert len(traces) == 1


def _documented_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type):
    """jax.nn.scaled_matmul's math, as its docstring states it (it has no CPU lowering)."""
    assert lhs.ndim == rhs.ndim == lhs_scales.ndim == rhs_scales.ndim == 3
    assert lhs.shape[::2] == rhs.shape[::2] and lhs_scales.shape[::2] == rhs_scales.shape[::2]
    assert lhs_scales.shape[1] == lhs.shape[1] and rhs_scales.shape[1] == rhs.shape[1]
    block = lhs.shape[-1] // lhs_scales.shape[-1]
    a = lhs.astype(jnp.float32) * jnp.repeat(lhs_scales.astype(jnp.float32), block, -1)
    b = rhs.astype(jnp.float32) * jnp.repeat(rhs_scales.astype(jnp.float32), block, -1)
    out = jnp.einsum("BMK,BNK->BMN", a, b, precision=jax.lax.Precision.HIGHEST)
    return out.astype(preferred_element_type)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_scaled_matmul_path_operands(monkeypatch, fmt):
    # The "scaled_matmul" path (Blackwell only) with jax.nn.scaled_matmul replaced by its
    # documented math: the operands' layout (rows flattened, w transposed to [N, K]) and
    # the NVFP4 global scales give the dequantised product.
    import jax_fp8norm.matmul as matmul

    if fmt == "nvfp4":
        a, a_scales, w, w_scales, w_gs = _fp4_operands("nvfp4", (2, 8), k=128, n=32)
        kwargs = dict(a_global_scale=0.03, w_global_scale=w_gs)
        expected = _deq(a, a_scales, -1, 0.03) @ _deq(w, w_scales, 0, float(w_gs))
    else:
        rng = np.random.default_rng(63)
        a, a_scales = quantize_blocks(rng.standard_normal((128, 16)).astype(np.float32))
        a, a_scales = np.asarray(a).T.reshape(2, 8, 128), np.asarray(a_scales).T.reshape(2, 8, 4)
        w, w_scales = quantize_blocks(rng.standard_normal((128, 32)).astype(np.float32))
        kwargs = {}
        expected = _deq(a, a_scales, -1) @ _deq(w, w_scales, 0)
    monkeypatch.setattr(matmul, "native_block_scaled_available", lambda: True)
    monkeypatch.setattr(jax.nn, "scaled_matmul", _documented_scaled_matmul)
    assert matmul_path(a, a_scales, w, w_scales) == "scaled_matmul"
    out = jax.jit(lambda *args: fp8_matmul(*args, out_dtype=jnp.float32, **kwargs))(
        a, a_scales, w, w_scales
    )
    assert out.shape == (2, 8, 32)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_quantize_weights_nvfp4():
    rng = np.random.default_rng(61)
    w = rng.standard_normal((64, 24)).astype(np.float32)
    w[16:32, 5] = 0  # a zero block
    w[:, 7] /= 1000  # a column of small blocks
    w4, scales, gs = (np.asarray(v) for v in quantize_weights_nvfp4(w))
    assert w4.dtype == F4 and scales.dtype == E4M3 and gs.dtype == np.float32
    assert w4.shape == (64, 24) and scales.shape == (4, 24) and gs.shape == ()
    assert gs == np.float32(np.abs(w).max()) / np.float32(448 * 6)
    s = scales.astype(np.float32)
    assert s.max() == 448 and s[1, 5] == 0 and not np.isnan(s).any()
    assert np.all(w4[16:32, 5].astype(np.float32) == 0)
    # The same codes and scales as the row quantiser on w's columns.
    rows_y, rows_s = _rows_nvfp4(w.T, gs)
    np.testing.assert_array_equal(w4.T.view(np.uint8), rows_y.view(np.uint8))
    np.testing.assert_array_equal(scales.T.view(np.uint8), rows_s.view(np.uint8))
    _assert_within_one_fp4_step(w, w4, np.repeat(s, 16, axis=0) * np.float64(gs))
    # An explicit global scale, a traced one too; an all-zero w gets 1.0.
    w4b, scales_b, gs_b = jax.jit(quantize_weights_nvfp4)(w, jnp.float32(0.01))
    assert gs_b == np.float32(0.01)
    rows_y, rows_s = _rows_nvfp4(w.T, 0.01)
    np.testing.assert_array_equal(np.asarray(w4b).T.view(np.uint8), rows_y.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales_b).T.view(np.uint8), rows_s.view(np.uint8))
    w4z, scales_z, gs_z = quantize_weights_nvfp4(np.zeros((16, 3), np.float32))
    assert gs_z == 1 and np.all(np.asarray(scales_z).astype(np.float32) == 0)
    assert np.all(np.asarray(w4z).astype(np.float32) == 0)


def test_quantize_weights_mxfp4():
    rng = np.random.default_rng(62)
    w = rng.standard_normal((96, 20)).astype(np.float32)
    w[32:64, 3] = 0
    w[64:, 9] = np.nan
    w4, scales = (np.asarray(v) for v in quantize_weights_mxfp4(w))
    assert w4.dtype == F4 and scales.dtype == E8M0 and scales.shape == (3, 20)
    codes = scales.view(np.uint8)
    assert codes[1, 3] == 0 and np.all(w4[32:64, 3].astype(np.float32) == 0)
    assert codes[2, 9] == 0xFF and np.all(w4[64:, 9].astype(np.float32) == 0)
    finite = np.ones((3, 20), bool)
    finite[2, 9] = False
    # The same codes and scales as the row quantiser on w's (finite) columns.
    rows_y, rows_s = _rows_mxfp4(np.where(np.isnan(w), 0, w).T)
    same = np.repeat(finite, 32, axis=0).T
    np.testing.assert_array_equal(w4.T.view(np.uint8)[same], rows_y.view(np.uint8)[same])
    np.testing.assert_array_equal(
        scales.view(np.uint8).T[finite.T], rows_s.view(np.uint8)[finite.T]
    )
    s = scales.astype(np.float32)
    largest = np.abs(w4.astype(np.float32)).reshape(3, 32, 20).max(1)
    nonzero = finite.copy()
    nonzero[1, 3] = False
    assert np.all(largest[nonzero] >= 3), "no block scale larger than needed"
    keep = np.repeat(finite, 32, axis=0)
    _assert_within_one_fp4_step(w[keep], w4[keep], np.repeat(s, 32, axis=0)[keep])


def _assert_within_one_fp4_step(w, w4, scale):
    """|deq - w| within one FP4 step (0.5 below 2, 1 below 4, else 2) of |w| / scale,
    in units of the element's block scale; zero blocks exact."""
    w = np.asarray(w, np.float64)
    scale = np.asarray(scale, np.float64)
    deq = np.asarray(w4).astype(np.float64) * scale
    with np.errstate(invalid="ignore", divide="ignore"):
        magnitude = np.where(scale > 0, np.abs(w) / scale, 0)
    step = np.select([magnitude < 2, magnitude < 4], [0.5, 1.0], 2.0)
    assert np.all(np.abs(deq - w) <= step * scale)
    assert np.all(deq[scale == 0] == 0) and np.all(w[scale == 0] == 0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_non_finite_weight_block_among_varied_magnitudes(jit):
    # One NaN and one Inf block in columns of magnitudes over twelve decades: XLA's max
    # reduction need not carry a NaN through, so the rule must read every element.
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 48)) * 10.0 ** rng.uniform(-6, 6, (256, 48))
    w = w.astype(np.float32)
    w[16:32, 1] = np.nan
    w[33, 2] = np.inf
    for quantise, nan_code, bad in (
        (lambda w: quantize_weights_nvfp4(w, 0.01)[:2], 0x7F, [(1, 1), (2, 2)]),
        (quantize_weights_mxfp4, 0xFF, [(0, 1), (1, 2)]),
    ):
        y, scales = (jax.jit(quantise) if jit else quantise)(w)
        codes = np.asarray(scales).view(np.uint8)
        block = w.shape[0] // codes.shape[0]
        y = np.asarray(y, np.float32)
        for b, column in bad:
            assert codes[b, column] == nan_code
            assert np.all(y[b * block : (b + 1) * block, column] == 0)
        good = np.ones(codes.shape, bool)
        good[tuple(zip(*bad, strict=True))] = False
        assert not np.any(codes[good] == nan_code)


def test_fp4_matmul_bad_input():
    a, a_s, w, w_s, gs = _fp4_operands("nvfp4", (4,), k=64, n=8)
    ma, ma_s, mw, mw_s, _ = _fp4_operands("mxfp4", (4,), k=64, n=8)
    g = dict(a_global_scale=1.0, w_global_scale=gs)
    with pytest.raises(ValueError, match=r"a and w .* must be of one format"):
        fp8_matmul(a, a_s, mw, mw_s, **g)  # NVFP4 a, MXFP4 w
    with pytest.raises(ValueError, match=r"a and w .* must be of one format"):
        fp8_matmul(ma, ma_s, w, w_s)
    fp8_w, fp8_ws = quantize_blocks(jnp.ones((64, 8), jnp.float32))
    with pytest.raises(ValueError, match=r"a and w .* must be of one format"):
        fp8_matmul(ma, ma_s, fp8_w, fp8_ws)  # FP4 a, FP8 w
    with pytest.raises(TypeError, match="a_scales of an FP4 a must be"):
        fp8_matmul(a, a_s.astype(np.float32), w, w_s, **g)
    with pytest.raises(ValueError, match="a_scales must have shape"):
        fp8_matmul(a, np.repeat(a_s, 2, axis=-1), w, w_s, **g)  # blocks of 8
    with pytest.raises(ValueError, match="w_scales must have shape"):
        fp8_matmul(a, a_s, w, w_s[:2], **g)  # blocks of 32 for NVFP4
    with pytest.raises(ValueError, match="w_scales must have shape"):
        fp8_matmul(a, a_s, w, w_s[0], **g)  # per channel: not an FP4 layout
    with pytest.raises(ValueError, match="a_scales must have shape"):
        fp8_matmul(ma, np.repeat(ma_s, 2, axis=-1), mw, mw_s)  # MXFP4 blocks of 16
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_matmul(a[:, :40], a_s[:, :2], w[:40], w_s[:2], **g)
    # Global scales: required for NVFP4, refused for the other formats.
    with pytest.raises(ValueError, match="need a_global_scale and w_global_scale"):
        fp8_matmul(a, a_s, w, w_s)
    with pytest.raises(ValueError, match="need a_global_scale and w_global_scale"):
        fp8_matmul(a, a_s, w, w_s, a_global_scale=1.0)
    with pytest.raises(ValueError, match="w_global_scale are only for NVFP4"):
        fp8_matmul(ma, ma_s, mw, mw_s, w_global_scale=1.0)
    fp8_a = jnp.ones((4, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="a_global_scale are only for NVFP4"):
        fp8_matmul(fp8_a, jnp.ones((4, 1)), fp8_a.T, jnp.ones((4,)), a_global_scale=1.0)
    with pytest.raises(ValueError, match="w_global_scale must have shape"):
        fp8_matmul(a, a_s, w, w_s, a_global_scale=1.0, w_global_scale=jnp.ones(2))
    with pytest.raises(TypeError, match="a_global_scale must have dtype float32"):
        fp8_matmul(a, a_s, w, w_s, a_global_scale=jnp.ones((), jnp.bfloat16), w_global_scale=gs)
    # The weight helpers.
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_weights_nvfp4(np.ones((24, 4), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_weights_mxfp4(np.ones((48, 4), np.float32))
    with pytest.raises(ValueError, match="shape \\(K, N\\)"):
        quantize_weights_mxfp4(np.ones((2, 32, 4), np.float32))


@pytest.mark.parametrize("fmt", ["blocks", "per_channel", "nvfp4", "mxfp4"])
def test_row_quantisers_are_the_weight_rule_transposed(fmt):
    """axis=1 (blocks along the rows of activations) gives the bits of the weights' rule on
    the transpose."""
    from jax_fp8norm.quantize import quantize_fp4_rows

    v = jnp.asarray(np.random.default_rng(5).standard_normal((48, 64)) * 3, jnp.float32)
    v = v.at[3].set(0.0).at[7, :16].set(1e-30)
    if fmt == "blocks":
        rows = quantize_blocks(v, 32, jnp.float8_e5m2, axis=1)
        cols = quantize_blocks(v.T, 32, jnp.float8_e5m2)
    elif fmt == "per_channel":
        rows = quantize_per_channel(v, jnp.float8_e5m2, axis=1)
        cols = quantize_per_channel(v.T, jnp.float8_e5m2)
        cols = (cols[0], cols[1][:, None])
    elif fmt == "nvfp4":
        rows = quantize_fp4_rows(v, "nvfp4", 0.01)
        cols = quantize_weights_nvfp4(v.T, 0.01)[:2]
    else:
        rows = quantize_fp4_rows(v, "mxfp4")
        cols = quantize_weights_mxfp4(v.T)
    codes, scales = (np.asarray(a) for a in rows)
    assert codes.shape == v.shape
    np.testing.assert_array_equal(codes.view(np.uint8), np.asarray(cols[0]).T.view(np.uint8))
    want = np.asarray(cols[1]).T if fmt != "per_channel" else np.asarray(cols[1])
    np.testing.assert_array_equal(scales.view(np.uint8), want.view(np.uint8))
    with pytest.raises(ValueError, match="axis must be"):
        quantize_blocks(v, 32, axis=2)
