"""The Flax NNX module: the same outputs as the functional ops, and a gradient that
reaches its weight through the dequantised path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, device_of, random_rows

nnx = pytest.importorskip("flax.nnx")

import jax_fp8norm as fp8norm  # noqa: E402
from jax_fp8norm.nnx import RMSNormFP8  # noqa: E402


def test_module_matches_the_ops(platform):
    x = random_rows(1, (4, 8, 256), jnp.bfloat16)
    residual = random_rows(2, (4, 8, 256), jnp.bfloat16)
    with jax.default_device(device_of(platform)):
        norm = RMSNormFP8(256, weight_offset=1.0, scale_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(np.asarray(norm.weight[...]), np.zeros(256))
        norm.weight[...] = norm.weight[...] + 0.25
        gamma = np.full(256, 0.25, np.float32)
        kw = {"weight_offset": 1.0, "scale_dtype": jnp.bfloat16}
        assert_same_bits(nnx.jit(lambda m, x: m(x))(norm, x), fp8norm.rms_norm_fp8(x, gamma, **kw))
        assert_same_bits(norm(x, residual), fp8norm.add_rms_norm_fp8(x, residual, gamma, **kw))


def test_weight_gets_a_gradient():
    x = random_rows(3, (6, 128), jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((6, 128)), jnp.float32)
    norm = RMSNormFP8(128, dequantize=True)

    def loss(module):
        return jnp.sum(w * module(x))

    grads = nnx.grad(loss)(norm)
    expected = jax.grad(lambda g: jnp.sum(w * fp8norm.rms_norm_fp8_dequantized(x, g)))(
        norm.weight[...]
    )
    np.testing.assert_array_equal(np.asarray(grads.weight[...]), np.asarray(expected))
    assert np.any(np.asarray(expected) != 0)


def test_module_with_block_scales_and_a_static_scale(platform):
    x = random_rows(5, (4, 256), jnp.bfloat16)
    gamma = np.ones(256, np.float32)
    with jax.default_device(device_of(platform)):
        grouped = RMSNormFP8(256, group_size=128, scale_dtype=jnp.float8_e8m0fnu)
        y, scales = nnx.jit(lambda m, x: m(x))(grouped, x)
        assert scales.shape == (4, 2) and scales.dtype == jnp.float8_e8m0fnu
        want = fp8norm.rms_norm_fp8(x, gamma, group_size=128, scale_dtype=jnp.float8_e8m0fnu)
        assert_same_bits((y, scales), want)
        calibrated = RMSNormFP8(256, static_scale=jnp.float32(0.02), dequantize=True)
        got = nnx.jit(lambda m, x: m(x))(calibrated, x)
        want = fp8norm.rms_norm_fp8_dequantized(x, gamma, static_scale=0.02)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_module_checks_its_keywords_when_made():
    with pytest.raises(ValueError, match="group_size=100 must divide N"):
        RMSNormFP8(256, group_size=100)
    with pytest.raises(TypeError, match="unexpected keyword"):
        RMSNormFP8(256, group=128)
