"""fp8_matmul against the dequantised float64 matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import device_of, random_rows, run_on

import jax_fp8norm as fp8norm
from jax_fp8norm.matmul import (
    fp8_matmul,
    matmul_path,
    native_block_scaled_available,
    quantize_blocks,
    quantize_per_channel,
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
    w8, scales = (np.asarray(v) for v in quantize_blocks(w))
    assert w8.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float8_e8m0fnu
    assert scales.shape == (4, 16)
    s = scales.astype(np.float32)
    assert np.all(np.frexp(s)[0] == 0.5), "powers of two"
    largest = np.abs(w8.astype(np.float32)).reshape(4, 32, 16).max(1)
    nonzero = np.ones((4, 16), bool)
    nonzero[0, 2] = False
    assert np.all((largest[nonzero] >= 224) & (largest[nonzero] <= 448))
    assert s[0, 2] == 2.0**-126 and np.all(w8[:32, 2].astype(np.float32) == 0)
    np.testing.assert_allclose(_dequantized(w8, scales, 0), w, rtol=2**-3, atol=0)


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
