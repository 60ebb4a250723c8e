"""Gradients: the dequantised ops' straight-through rule against jax.grad of a plain jnp
RMSNorm, and a clear error (never silent zeros) when differentiating the FP8 ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import device_of, random_gamma, random_rows

import jax_fp8norm as fp8norm


def rms_norm(h, gamma, eps=1e-6, weight_offset=0.0):
    """RMSNorm in float32, written independently of the package."""
    h = h.astype(jnp.float32)
    inv = 1.0 / jnp.sqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + eps)
    return (h * inv) * (gamma.astype(jnp.float32) + weight_offset)


def _weights(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.sampled(2)
@pytest.mark.default_platforms("cpu", "simt-block_shared")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_rms_norm_dequantized_forward_and_gradient(platform, dtype):
    x = random_rows(1, (6, 256), dtype)
    gamma = random_gamma(2, 256, jnp.float32)
    w = _weights((6, 256), 3)
    kw = {"weight_offset": 1.0, "eps": 1e-5}
    with jax.default_device(device_of(platform)):
        value = jax.jit(lambda x, g: fp8norm.rms_norm_fp8_dequantized(x, g, **kw))(x, gamma)
        y, scales = fp8norm.rms_norm_fp8(x, gamma, **kw)
        np.testing.assert_array_equal(
            np.asarray(value), np.asarray(y, np.float32) * np.asarray(scales)
        )
        loss = lambda x, g: jnp.sum(w * fp8norm.rms_norm_fp8_dequantized(x, g, **kw))  # noqa: E731
        eps = float(jnp.asarray(1e-5, dtype))  # the op rounds eps through x's dtype
        loss_ref = lambda x, g: jnp.sum(w * rms_norm(x, g, eps, 1.0))  # noqa: E731
        gx, gg = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, gamma)
        rx, rg = jax.grad(loss_ref, argnums=(0, 1))(x, gamma)
    assert gx.dtype == jnp.dtype(dtype) and gg.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(gg), np.asarray(rg), rtol=1e-4, atol=1e-5)
    tol = 1e-4 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(gx, np.float32), np.asarray(rx, np.float32), rtol=tol, atol=tol
    )
    assert np.all(np.isfinite(np.asarray(gx, np.float32))) and np.any(np.asarray(gx) != 0)


def test_add_rms_norm_dequantized_gradient(platform):
    x = random_rows(4, (5, 128), jnp.float32)
    residual = random_rows(5, (5, 128), jnp.float32)
    gamma = random_gamma(6, 128, jnp.bfloat16)
    w1, w2 = _weights((5, 128), 7), _weights((5, 128), 8)

    def loss(x, r, g):
        normed, residual_out = fp8norm.add_rms_norm_fp8_dequantized(x, r, g)
        return jnp.sum(w1 * normed) + jnp.sum(w2 * residual_out)

    def loss_ref(x, r, g):
        h = x + r
        return jnp.sum(w1 * rms_norm(h, g)) + jnp.sum(w2 * h)

    with jax.default_device(device_of(platform)):
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, residual, gamma)
        want = jax.grad(loss_ref, argnums=(0, 1, 2))(x, residual, gamma)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2e-3, atol=2e-3
        )


def test_gradient_under_vmap():
    x = random_rows(9, (3, 4, 64), jnp.float32)
    gamma = random_gamma(10, 64, jnp.float32)
    w = _weights((4, 64), 11)
    # A linear loss: its cotangent does not depend on the (quantised) forward value.
    grad = jax.grad(lambda x: jnp.sum(w * fp8norm.rms_norm_fp8_dequantized(x, gamma)))
    grad_ref = jax.grad(lambda x: jnp.sum(w * rms_norm(x, gamma)))
    np.testing.assert_allclose(
        np.asarray(jax.vmap(grad)(x)), np.asarray(jax.vmap(grad_ref)(x)), rtol=1e-3, atol=1e-4
    )


@pytest.mark.parametrize("op", ["rms_norm_fp8", "add_rms_norm_fp8"])
def test_fp8_ops_refuse_gradients_by_name(op):
    x = jnp.ones((2, 32), jnp.float32)
    gamma = jnp.ones((32,), jnp.float32)
    args = (x, gamma) if op == "rms_norm_fp8" else (x, x, gamma)

    def loss(x):
        y, scales = getattr(fp8norm, op)(x, *args[1:])[:2]
        return jnp.sum(y.astype(jnp.float32) * scales)

    with pytest.raises(TypeError, match=f"{op}_dequantized"):
        jax.grad(loss)(x)


def test_gradient_elsewhere_is_unaffected():
    # The op on inputs that carry no tangent needs no rule.
    x = jnp.ones((2, 32), jnp.float32)
    gamma = jnp.ones((32,), jnp.float32)

    def loss(a):
        y, scales = fp8norm.rms_norm_fp8(x, gamma)
        return a * jnp.sum(y.astype(jnp.float32) * scales)

    expected = np.sum(np.asarray(fp8norm.rms_norm_fp8_dequantized(x, gamma)))
    np.testing.assert_allclose(float(jax.grad(loss)(2.0)), expected, rtol=1e-6)


def test_dequantized_keywords_are_checked():
    x = jnp.ones((2, 32), jnp.float32)
    gamma = jnp.ones((32,), jnp.float32)
    with pytest.raises(TypeError, match="epsilon"):
        fp8norm.rms_norm_fp8_dequantized(x, gamma, epsilon=1e-5)
    with pytest.raises(ValueError, match="eps"):
        fp8norm.add_rms_norm_fp8_dequantized(x, x, gamma, eps=-1.0)
