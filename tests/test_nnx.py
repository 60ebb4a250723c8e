"""The Flax NNX modules: RMSNormFP8's codes (quantized_output=True) are the functional
ops' outputs, its default output the differentiable twins' with the gradient reaching its
weight; RMSNormDense is the layer, for a weight of one or several output axes. The module
as a drop-in for nnx.RMSNorm is held in test_nnx_drop_in.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, device_of, random_rows, same_bits

nnx = pytest.importorskip("flax.nnx")

import jax_fp8norm as fp8norm  # noqa: E402
from jax_fp8norm.nnx import RMSNormFP8  # noqa: E402


def test_module_matches_the_ops(platform):
    x = random_rows(1, (4, 8, 256), jnp.bfloat16)
    residual = random_rows(2, (4, 8, 256), jnp.bfloat16)
    with jax.default_device(device_of(platform)):
        norm = RMSNormFP8(
            256,
            weight_offset=1.0,
            scale_dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,  # x's: no promotion
            quantized_output=True,
            rngs=nnx.Rngs(0),
        )
        np.testing.assert_array_equal(np.asarray(norm.scale[...]), np.zeros(256))
        norm.scale[...] = norm.scale[...] + 0.25
        gamma = np.full(256, 0.25, jnp.bfloat16)
        kw = {"weight_offset": 1.0, "scale_dtype": jnp.bfloat16}
        assert_same_bits(nnx.jit(lambda m, x: m(x))(norm, x), fp8norm.rms_norm_fp8(x, gamma, **kw))
        assert_same_bits(
            norm(x, residual=residual), fp8norm.add_rms_norm_fp8(x, residual, gamma, **kw)
        )


def test_scale_gets_a_gradient():
    x = random_rows(3, (6, 128), jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((6, 128)), jnp.float32)
    norm = RMSNormFP8(128)

    def loss(module):
        return jnp.sum(w * module(x))

    grads = nnx.grad(loss)(norm)
    expected = jax.grad(lambda g: jnp.sum(w * fp8norm.rms_norm_fp8_dequantized(x, g)))(
        norm.scale[...]
    )
    np.testing.assert_array_equal(np.asarray(grads.scale[...]), np.asarray(expected))
    assert np.any(np.asarray(expected) != 0)


def test_module_with_block_scales_and_a_static_scale(platform):
    x = random_rows(5, (4, 256), jnp.bfloat16)
    gamma = np.ones(256, np.float32)
    with jax.default_device(device_of(platform)):
        grouped = RMSNormFP8(
            256, group_size=128, scale_dtype=jnp.float8_e8m0fnu, quantized_output=True
        )
        y, scales = nnx.jit(lambda m, x: m(x))(grouped, x)
        assert scales.shape == (4, 2) and scales.dtype == jnp.float8_e8m0fnu
        want = fp8norm.rms_norm_fp8(x, gamma, group_size=128, scale_dtype=jnp.float8_e8m0fnu)
        assert_same_bits((y, scales), want)
        calibrated = RMSNormFP8(256, static_scale=jnp.float32(0.02))
        got = nnx.jit(lambda m, x: m(x))(calibrated, x)
        # nnx's dtype: bfloat16 x and a float32 scale promote to float32.
        want = fp8norm.rms_norm_fp8_dequantized(x.astype(jnp.float32), gamma, static_scale=0.02)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_module_checks_its_keywords_when_made():
    with pytest.raises(ValueError, match="group_size=100 must divide N"):
        RMSNormFP8(256, group_size=100)
    with pytest.raises(TypeError, match="unexpected keyword"):
        RMSNormFP8(256, group=128)


def _trained_rmsnorm(n: int, **kwargs) -> nnx.RMSNorm:
    norm = nnx.RMSNorm(n, rngs=nnx.Rngs(0), **kwargs)
    norm.scale[...] = jnp.asarray(1.0 + 0.1 * np.random.default_rng(6).standard_normal(n))
    return norm


def test_an_nnx_rmsnorm_state_loads_as_it_is():
    """nnx.RMSNorm's parameter's name, so that nnx.update loads its state; from_rmsnorm
    does the same in one call."""
    x = random_rows(7, (4, 256), jnp.bfloat16)
    norm = _trained_rmsnorm(256, epsilon=1e-5, dtype=jnp.float32)
    loaded = RMSNormFP8(256, epsilon=1e-5, dtype=jnp.float32, quantized_output=True)
    nnx.update(loaded, nnx.state(norm))
    gamma = norm.scale[...]
    want = fp8norm.rms_norm_fp8(x.astype(jnp.float32), gamma, eps=1e-5)
    assert_same_bits(loaded(x), want)
    got = RMSNormFP8.from_rmsnorm(norm)(x)
    assert got.dtype == jnp.float32
    want = fp8norm.rms_norm_fp8_dequantized(x.astype(jnp.float32), gamma, eps=1e-5)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_without_a_scale_parameter_and_with_an_initializer():
    x = random_rows(8, (2, 64), jnp.float32)
    bare = RMSNormFP8(64, use_scale=False, quantized_output=True)
    assert nnx.state(bare, nnx.Param) == nnx.State({})
    assert_same_bits(bare(x), fp8norm.rms_norm_fp8(x, jnp.ones(64)))
    init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, 0.5, 1.5)  # noqa: E731
    made = RMSNormFP8(
        64, scale_init=init, param_dtype=jnp.bfloat16, quantized_output=True, rngs=nnx.Rngs(3)
    )
    assert made.scale[...].dtype == jnp.bfloat16
    # nnx's promotion: float32 x and a bfloat16 scale meet in float32.
    assert_same_bits(made(x), fp8norm.rms_norm_fp8(x, made.scale[...].astype(jnp.float32)))
    assert not np.all(np.asarray(made.scale[...]) == 1)


def test_rms_norm_dense_module_is_the_layer():
    """RMSNormDense's output and gradients are rms_norm_dense's, bit for bit, with the key
    passed to the call; without one the module draws a fresh key from its rngs stream on
    every call; fused=False is the unquantised layer."""
    from jax_fp8norm.nnx import RMSNormDense

    module = RMSNormDense(256, 128, recipe="nvfp4", global_scale=0.0021, rngs=nnx.Rngs(0))
    key = jax.random.key(7)
    module.norm.scale[...] = jnp.linspace(0.5, 1.5, 256)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)), jnp.bfloat16)
    residual = x[::-1]
    gamma, w = module.norm.scale[...], module.kernel[...]
    assert w.dtype == jnp.float32 and w.shape == (256, 128)

    def loss(m, key=None):
        out, residual_out = m(x, residual, key=key)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(residual_out.astype(jnp.float32))

    grads = nnx.jit(nnx.grad(loss))(module, key)
    drawn = [nnx.jit(nnx.grad(loss))(module)["kernel"][...] for _ in range(2)]
    assert not np.array_equal(np.asarray(drawn[0]), np.asarray(drawn[1]))

    def layer_loss(gamma, w):
        out, residual_out = fp8norm.add_rms_norm_dense(
            x, residual, gamma, w, recipe="nvfp4", global_scale=0.0021, key=key
        )
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(residual_out.astype(jnp.float32))

    dgamma, dw = jax.jit(jax.grad(layer_loss, (0, 1)))(gamma, w)
    np.testing.assert_array_equal(np.asarray(grads["norm"]["scale"][...]), np.asarray(dgamma))
    np.testing.assert_array_equal(np.asarray(grads["kernel"][...]), np.asarray(dw))

    module.fused = False
    h = x.astype(jnp.float32) + residual.astype(jnp.float32)
    n = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * gamma
    want = n.astype(jnp.bfloat16).astype(jnp.float32) @ w.astype(jnp.bfloat16).astype(jnp.float32)
    out, residual_out = module(x, residual)
    assert out.dtype == jnp.bfloat16 and residual_out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)


def test_rms_norm_dense_module_takes_several_output_axes():
    """out_features as a tuple: the kernel is (K, *F), an einsum weight, and the module is
    rms_norm_dense of it, bit for bit, forward and weight gradient; fused=False the
    unquantised layer of the flattened weight, reshaped."""
    from jax_fp8norm.nnx import RMSNormDense

    module = RMSNormDense(64, (2, 16), recipe="mxfp8", rngs=nnx.Rngs(1))
    assert module.kernel[...].shape == (64, 2, 16)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 16, 64)), jnp.bfloat16)
    gamma, w = module.norm.scale[...], module.kernel[...]

    def loss(out):
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    step = nnx.jit(nnx.value_and_grad(lambda m: loss(m(x)), has_aux=True))
    (_, out), grads = step(module)
    assert out.shape == (2, 16, 2, 16) and out.dtype == jnp.bfloat16
    same_bits(out, fp8norm.rms_norm_dense(x, gamma, w, recipe="mxfp8"))
    layer = jax.jit(lambda w: loss(fp8norm.rms_norm_dense(x, gamma, w, recipe="mxfp8"))[0])
    dw = jax.grad(layer)(w)
    assert np.any(np.asarray(dw) != 0)
    same_bits(grads["kernel"][...], dw)
    module.fused = False
    flat = RMSNormDense(64, 32, fused=False, rngs=nnx.Rngs(1))
    flat.kernel[...] = w.reshape(64, 32)
    same_bits(module(x), flat(x).reshape(2, 16, 2, 16))
    with pytest.raises(ValueError, match="out_features"):
        RMSNormDense(64, (2, 0), rngs=nnx.Rngs(1))
