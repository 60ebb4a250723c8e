"""The ops inside JAX transformations and compilation paths: vmap, AOT lower/compile and
jax.export. Each is held bit for bit to the same op called without the transformation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, device_of, is_simt, random_gamma, random_rows, recipe

import jax_fp8norm as fp8norm
from jax_fp8norm import _ffi as fp8norm_ffi
from jax_fp8norm import _primitives


def _stack(outs_per_example, axis=0):
    return [
        np.stack([np.asarray(o[i]) for o in outs_per_example], axis)
        for i in range(len(outs_per_example[0]))
    ]


def _custom_calls(fn, *args) -> int:
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    targets = [*fp8norm_ffi.TARGETS.values(), *fp8norm_ffi.EMULATED_TARGETS.values()]
    return sum(hlo.count(f'custom_call_target="{t}"') for t in targets)


@pytest.mark.parametrize("in_axis", [0, 1, 2])
def test_vmap_over_x_is_one_kernel_call(platform, in_axis):
    # A batch of 5 per-example [3, 96] arrays, the batch axis at in_axis.
    x = np.moveaxis(random_rows(1, (5, 3, 96), jnp.bfloat16), 0, in_axis)
    gamma = random_gamma(2, 96, jnp.float32)
    axis = in_axis
    with jax.default_device(device_of(platform)):
        fn = jax.vmap(lambda x: fp8norm.rms_norm_fp8(x, gamma, weight_offset=0.5), in_axes=axis)
        got = jax.jit(fn)(x)
        per_example = [
            fp8norm.rms_norm_fp8(np.take(x, b, axis), gamma, weight_offset=0.5)
            for b in range(x.shape[axis])
        ]
        assert _custom_calls(fn, x) == 1
    assert_same_bits(got, _stack(per_example))


def test_vmap_of_rank1_rows(platform):
    x = random_rows(3, (7, 128), jnp.float16)
    gamma = random_gamma(4, 128, jnp.bfloat16)
    with jax.default_device(device_of(platform)):
        got = jax.jit(jax.vmap(fp8norm.rms_norm_fp8, in_axes=(0, None)))(x, gamma)
        want = fp8norm.rms_norm_fp8(x, gamma)
    assert got[1].shape == (7, 1)
    assert_same_bits(got, want)


def test_vmap_over_x_and_gamma(platform):
    x = random_rows(5, (4, 6, 64), jnp.bfloat16)
    gammas = np.stack([random_gamma(10 + b, 64, jnp.float32) for b in range(4)])
    with jax.default_device(device_of(platform)):
        got = jax.jit(jax.vmap(fp8norm.rms_norm_fp8))(x, gammas)
        per_example = [fp8norm.rms_norm_fp8(x[b], gammas[b]) for b in range(4)]
    assert_same_bits(got, _stack(per_example))


@pytest.mark.parametrize("in_axes", [(0, 0, None), (0, None, None), (None, 0, 0), (1, 1, None)])
def test_vmap_add(platform, in_axes):
    rng_x = random_rows(6, (3, 8, 64), jnp.float32)
    rng_r = random_rows(7, (3, 8, 64), jnp.float32)
    x = rng_x if in_axes[0] == 0 else (rng_x[0] if in_axes[0] is None else np.moveaxis(rng_x, 0, 1))
    residual = (
        rng_r if in_axes[1] == 0 else (rng_r[0] if in_axes[1] is None else np.moveaxis(rng_r, 0, 1))
    )
    gamma = (
        np.stack([random_gamma(20 + b, 64, jnp.float32) for b in range(3)])
        if in_axes[2] == 0
        else random_gamma(20, 64, jnp.float32)
    )

    def pick(value, axis, b):
        return value if axis is None else np.take(value, b, axis)

    with jax.default_device(device_of(platform)):
        got = jax.jit(jax.vmap(fp8norm.add_rms_norm_fp8, in_axes=in_axes))(x, residual, gamma)
        per_example = [
            fp8norm.add_rms_norm_fp8(
                *(pick(v, a, b) for v, a in zip((x, residual, gamma), in_axes, strict=True))
            )
            for b in range(3)
        ]
    assert_same_bits(got, _stack(per_example))


def test_nested_vmap(platform):
    x = random_rows(8, (2, 3, 4, 32), jnp.bfloat16)
    gamma = random_gamma(9, 32, jnp.bfloat16)
    with jax.default_device(device_of(platform)):
        fn = jax.vmap(jax.vmap(lambda x: fp8norm.rms_norm_fp8(x, gamma)))
        got = jax.jit(fn)(x)
        want = fp8norm.rms_norm_fp8(x, gamma)
        assert _custom_calls(fn, x) == 1
    assert_same_bits(got, want)


def test_aot_lower_compile(platform):
    x = random_rows(11, (16, 256), jnp.bfloat16)
    residual = random_rows(12, (16, 256), jnp.bfloat16)
    gamma = random_gamma(13, 256, jnp.float32)
    device = device_of(platform)
    x, residual, gamma = (jax.device_put(a, device) for a in (x, residual, gamma))
    lowered = jax.jit(fp8norm.add_rms_norm_fp8).lower(x, residual, gamma)
    targets = fp8norm_ffi.EMULATED_TARGETS if is_simt(platform) else fp8norm_ffi.TARGETS
    assert targets["add_rms_norm_fp8"] in lowered.as_text()
    compiled = lowered.compile()
    assert_same_bits(compiled(x, residual, gamma), fp8norm.add_rms_norm_fp8(x, residual, gamma))


def test_export_round_trip(platform):
    pytest.importorskip("flatbuffers", reason="jax.export's serialisation needs flatbuffers")
    x = random_rows(14, (2, 8, 512), jnp.bfloat16)
    gamma = random_gamma(15, 512, jnp.bfloat16)

    def layer(x, gamma):
        y, scales = fp8norm.rms_norm_fp8(x, gamma, weight_offset=1.0)
        return y.astype(jnp.float32) * scales

    exported = jax.export.export(
        jax.jit(layer),
        platforms=["cuda" if platform == "gpu" else "cpu"],
        disabled_checks=fp8norm.EXPORT_DISABLED_CHECKS,
    )(x, gamma)
    restored = jax.export.deserialize(exported.serialize())
    device = device_of(platform)
    x, gamma = jax.device_put(x, device), jax.device_put(gamma, device)
    np.testing.assert_array_equal(
        np.asarray(restored.call(x, gamma)), np.asarray(jax.jit(layer)(x, gamma))
    )


def test_export_without_disabled_checks_names_the_target():
    x = jnp.ones((2, 64), jnp.float32)
    gamma = jnp.ones((64,), jnp.float32)
    with pytest.raises(ValueError, match=_primitives.TARGETS[0]):
        jax.export.export(jax.jit(fp8norm.rms_norm_fp8), platforms=["cpu"])(x, gamma)


BLOCK_SCALINGS = {
    "group128": recipe("fp8_group128"),
    "mxfp8": recipe("mxfp8"),
    "ue8m0": dict(group_size=64, power_of_two_scales=True),
}


@pytest.mark.parametrize("scaling", list(BLOCK_SCALINGS))
def test_export_and_aot_with_block_scales_and_a_static_scale(platform, scaling):
    pytest.importorskip("flatbuffers", reason="jax.export's serialisation needs flatbuffers")
    x = random_rows(16, (2, 8, 512), jnp.bfloat16)
    residual = random_rows(17, (2, 8, 512), jnp.bfloat16)
    gamma = random_gamma(18, 512, jnp.float32)
    kw = BLOCK_SCALINGS[scaling]

    def layer(x, residual, gamma, act_scale):
        y, scales, h = fp8norm.add_rms_norm_fp8(x, residual, gamma, **kw)
        y2, s2 = fp8norm.rms_norm_fp8(h, gamma, static_scale=act_scale)
        return fp8norm.reference.dequantize(y, scales), y2, s2

    act_scale = np.float32(0.03)
    exported = jax.export.export(
        jax.jit(layer),
        platforms=["cuda" if platform == "gpu" else "cpu"],
        disabled_checks=fp8norm.EXPORT_DISABLED_CHECKS,
    )(x, residual, gamma, act_scale)
    restored = jax.export.deserialize(exported.serialize())
    device = device_of(platform)
    args = [jax.device_put(a, device) for a in (x, residual, gamma, act_scale)]
    want = jax.jit(layer)(*args)
    assert_same_bits(restored.call(*args), want)
    compiled = jax.jit(layer).lower(*args).compile()
    assert_same_bits(compiled(*args), want)
    # Another calibrated scale through the same compiled function.
    args[3] = jax.device_put(np.float32(0.06), device)
    assert_same_bits(compiled(*args), jax.jit(layer)(*args))
