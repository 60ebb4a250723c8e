"""The ops' outputs handed to qwix: its QArray takes them (float scales of the values'
rank, NVFP4's global scale folded in) and dequantises them as jax_fp8norm.dequantize
does."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from helpers import RECIPE_NAMES, random_gamma, random_rows, recipe

import jax_fp8norm as fp8norm
from jax_fp8norm import interop, quantize

X = random_rows(0, (2, 3, 256), jnp.bfloat16)
GAMMA = random_gamma(1, 256, jnp.float32)


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_qwix_dequantizes_the_ops_outputs_as_the_package_does(name):
    keywords = recipe(name)
    y, scales = fp8norm.rms_norm_fp8(X, GAMMA, **keywords)
    global_scale = keywords.get("global_scale")
    q = interop.to_qwix(y, scales, global_scale=global_scale)
    assert isinstance(q, qwix.QArray) and q.scale.dtype == jnp.float32
    assert q.scale.shape == scales.shape
    got = np.asarray(qwix.dequantize(q))
    want = np.asarray(fp8norm.dequantize(y, scales, global_scale=global_scale))
    if global_scale is None:
        np.testing.assert_array_equal(got, want)
    else:  # folded in: f32(y) * (s * gs) against (f32(y) * s) * gs, one rounding apart
        np.testing.assert_allclose(got, want, rtol=2**-23, atol=0)
        assert np.any(got != 0)


def test_weight_scales_per_output_channel_become_one_row():
    w = random_rows(2, (128, 64), jnp.float32)
    w8, scales = quantize.quantize_per_channel(w)
    assert scales.shape == (64,)
    q = interop.to_qwix(w8, scales)
    assert q.scale.shape == (1, 64)
    want = w8.astype(jnp.float32) * scales
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(q)), np.asarray(want))


def test_the_layout_refuses_what_qwix_would():
    y, scales = fp8norm.rms_norm_fp8(X, GAMMA, **recipe("mxfp8"))
    with pytest.raises(ValueError, match="do not tile"):
        interop.qwix_layout(y, scales[..., :3])
    with pytest.raises(TypeError, match="scale_dtype must be float32 or bfloat16"):
        interop.qwix_layout(y, scales, scale_dtype=jnp.float8_e8m0fnu)
    qvalue, scale = interop.qwix_layout(y, scales, scale_dtype=jnp.bfloat16)
    assert qvalue is not None and scale.dtype == jnp.bfloat16  # e8m0 is exact in bf16
    np.testing.assert_array_equal(
        np.asarray(scale, np.float32), np.asarray(scales.astype(jnp.float32))
    )
