"""The ops' outputs handed to qwix: its QArray takes them (float scales of the values'
rank, NVFP4's global scale folded in) and dequantises them as jax_fp8norm.dequantize
does."""

from __future__ import annotations

import functools

import jax
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
    if global_scale is None:
        want = np.asarray(fp8norm.dequantize(y, scales))
    else:  # folded in: f32(y) * f32(f32(s) * gs), where the package rounds f32(y) * s first
        folded = np.asarray(scales.astype(jnp.float32)) * np.float32(global_scale)
        group = y.shape[-1] // scales.shape[-1]
        want = np.asarray(y.astype(jnp.float32)) * np.repeat(folded, group, axis=-1)
    assert np.all(np.isfinite(want)) and np.any(want != 0)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


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


# The projection of a MaxText-style DenseGeneral: [B, S, D] x [D, H, Dh], D contracted.
PROJECTION = (((2,), (0,)), ((), ()))
W = random_rows(3, (256, 4, 32), jnp.float32, spread=0.5)
TILED = ("fp8_row", "fp8_group128")  # tiles of 128 or more: qwix's GEMM runs on the codes


def _hand_gemm_of_the_codes(y, scales, w):
    """What qwix's GEMM of the codes computes, by hand: against a float ``w``, the float32
    GEMM of ``f32(y) * scales``; against a quantised ``w``, per contracted tile the float32
    GEMM of the codes, times both scales, the tiles summed."""
    if not isinstance(w, qwix.QArray):
        return jax.lax.dot_general(fp8norm.dequantize(y, scales), w, PROJECTION)
    tile = y.shape[-1] // scales.shape[-1]
    parts = [
        jax.lax.dot_general(
            y[..., t * tile : (t + 1) * tile].astype(jnp.float32),
            w.qvalue[t * tile : (t + 1) * tile].astype(jnp.float32),
            PROJECTION,
        )
        * scales[..., t : t + 1, None].astype(jnp.float32)
        * w.scale
        for t in range(scales.shape[-1])
    ]
    return functools.reduce(jnp.add, parts)  # two tiles at most: a sum in any order


def _assert_the_codes_reach_the_gemm(gemm, name, w):
    y, scales = fp8norm.rms_norm_fp8(X, GAMMA, **recipe(name))
    got = np.asarray(gemm(interop.to_qwix(y, scales, global_scale=None), w))
    want = np.asarray(_hand_gemm_of_the_codes(y, scales, w))
    assert np.all(np.isfinite(want)) and np.any(want != 0)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _gemm(q, w):
    return interop.qwix_dot_general(q, w, PROJECTION)


@pytest.mark.parametrize("name", ["fp8_row", "fp8_group128", "fp8_static", "mxfp8", "mxfp4"])
def test_the_codes_reach_a_float_weights_gemm_unchanged(name):
    _assert_the_codes_reach_the_gemm(_gemm, name, jnp.asarray(W, jnp.bfloat16))


@pytest.mark.parametrize("name", TILED)
def test_the_codes_reach_a_quantised_weights_gemm_unchanged(name):
    wq = qwix.quantize(jnp.asarray(W), jnp.float8_e4m3fn, channelwise_axes=(1, 2))
    _assert_the_codes_reach_the_gemm(_gemm, name, wq)
    # rhs_qtype quantises the weight as qwix's QtProvider does: the same QArray
    y, scales = fp8norm.rms_norm_fp8(X, GAMMA, **recipe(name))
    q = interop.to_qwix(y, scales)
    untiled = np.asarray(_gemm(q, wq))
    np.testing.assert_array_equal(
        np.asarray(interop.qwix_dot_general(q, W, PROJECTION, rhs_qtype=jnp.float8_e4m3fn)),
        untiled,
    )
    if name == "fp8_group128":  # rhs_tile_size: the weight's scales per tile of 128 of D
        tiled = qwix.quantize(
            jnp.asarray(W), jnp.float8_e4m3fn, channelwise_axes=(1, 2), tiled_axes={0: 128}
        )
        got = np.asarray(
            interop.qwix_dot_general(
                q, W, PROJECTION, rhs_qtype=jnp.float8_e4m3fn, rhs_tile_size=128
            )
        )
        want = np.asarray(_gemm(q, tiled))
        assert np.all(np.isfinite(want))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.any(got != untiled)  # the tiles change the GEMM: the check can fail


@pytest.mark.parametrize("float_weight", [True, False])
def test_a_second_quantisation_fails_the_check(float_weight):
    def requantised(q, w):  # qwix's own per-token rule on the dequantised codes
        again = qwix.quantize(qwix.dequantize(q), jnp.float8_e4m3fn, channelwise_axes=(0, 1))
        return qwix.dot_general(again, w, PROJECTION)

    w = jnp.asarray(W, jnp.bfloat16)
    if not float_weight:
        w = qwix.quantize(jnp.asarray(W), jnp.float8_e4m3fn, channelwise_axes=(1, 2))
    # Group codes: a per-token rule on them moves codes. (fp8_row's codes, quantised per
    # token again, come back as they were, so no check could see a second quantisation
    # there, nor does one change the GEMM.)
    with pytest.raises(AssertionError):
        _assert_the_codes_reach_the_gemm(requantised, "fp8_group128", w)


# qwix 0.1.8's quantize_model uses flax APIs that newer flax deprecates (Module.iter_modules,
# Variable.value): warnings of qwix's code, not ours, which the newest-jax check would turn
# into errors.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:qwix")
def test_a_qtprovider_around_the_call_leaves_the_codes_alone():
    """Inside a model quantised by qwix's QtProvider (MaxText's fp8 rule), the call's GEMM
    is not intercepted: the same bits as outside it."""
    nnx = pytest.importorskip("flax.nnx")
    y, scales = fp8norm.rms_norm_fp8(X, GAMMA, **recipe("fp8_group128"))
    rule = qwix.QtRule(
        module_path=".*",
        weight_qtype=jnp.float8_e5m2,  # not the codes' type: a GEMM it saw would change
        act_qtype=jnp.float8_e5m2,
        op_names=("dot_general",),
    )

    class Projection(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.asarray(W, jnp.bfloat16))

        def __call__(self, y, scales, *, ours=True):
            w = self.kernel[...]
            if ours:
                return interop.qwix_dot_general(interop.to_qwix(y, scales), w, PROJECTION)
            return jax.lax.dot_general(fp8norm.dequantize(y, scales), w, PROJECTION)

    model = Projection()
    quantised = qwix.quantize_model(model, qwix.QtProvider([rule]), y, scales)
    want = model(y, scales)
    np.testing.assert_array_equal(np.asarray(quantised(y, scales)), np.asarray(want))
    intercepted = qwix.quantize_model(model, qwix.QtProvider([rule]), y, scales, ours=False)
    assert not np.array_equal(np.asarray(intercepted(y, scales, ours=False)), np.asarray(want))


def test_the_entry_point_refuses_a_float_lhs_and_mismatched_tiles():
    y, scales = fp8norm.rms_norm_fp8(X, GAMMA, **recipe("fp8_group128"))
    with pytest.raises(TypeError, match=r"lhs must be a qwix\.QArray"):
        interop.qwix_dot_general(fp8norm.dequantize(y, scales), W, PROJECTION)
    with pytest.raises(ValueError, match="rhs_tile_size=64 differs"):
        interop.qwix_dot_general(
            interop.to_qwix(y, scales), W, PROJECTION, rhs_qtype=jnp.float8_e4m3fn, rhs_tile_size=64
        )
    with pytest.raises(ValueError, match="rhs_tile_size"):
        interop.qwix_dot_general(interop.to_qwix(y, scales), W, PROJECTION, rhs_tile_size=128)
