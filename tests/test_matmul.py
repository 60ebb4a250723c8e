"""fp8_matmul against the dequantised float64 matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import device_of, random_rows, run_on

import jax_fp8norm as fp8norm
from jax_fp8norm.matmul import fp8_matmul, quantize_per_channel


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


def test_fp8_matmul_is_an_fp8_gemm_on_gpu(platform):
    # On GPUs with FP8 tensor cores (sm_89 and newer) XLA runs the FP8 dot as a cuBLASLt
    # FP8 GEMM rather than converting the operands to a wider type first.
    if platform != "gpu":
        pytest.skip("a GPU-only check")
    device = device_of("gpu")
    if float(getattr(device, "compute_capability", "0")) < 8.9:
        pytest.skip(f"{device.device_kind} has no FP8 tensor cores")
    a = jnp.ones((64, 256), jnp.float8_e4m3fn)
    w = jnp.ones((256, 128), jnp.float8_e4m3fn)
    a_scales, w_scales = jnp.ones((64, 1), jnp.float32), jnp.ones((128,), jnp.float32)
    args = [jax.device_put(v, device) for v in (a, a_scales, w, w_scales)]
    hlo = jax.jit(fp8_matmul).lower(*args).compile().as_text()
    assert "__cublas$lt$matmul$f8" in hlo, hlo[-3000:]
