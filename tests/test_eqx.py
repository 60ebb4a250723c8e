"""The equinox module: ``equinox.nn.RMSNorm``'s constructor, fields and call (one example,
vmapped by the caller), bit for bit the FP8 control (the op's codes dequantised, the bias
added in float32 and the sum rounded to x's dtype, as equinox computes), with its bias,
``use_weight=False`` and a multi-axis ``shape``."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_rows, same_bits

import jax_fp8norm as fp8norm
from jax_fp8norm.eqx import QuantizedOutput, RMSNormFP8


def control(x, weight, bias, **keywords):
    """The FP8 control of a batch ``x`` ``[B, *shape]``: each example flattened to one row,
    the op's codes dequantised, the bias added in float32, rounded once to x's dtype."""
    rows = x.reshape(x.shape[0], -1)
    gamma = None if weight is None else weight.reshape(-1)
    codes = fp8norm.rms_norm_fp8(rows, gamma, **keywords)
    out = fp8norm.dequantize(*codes, global_scale=keywords.get("global_scale"))
    if bias is not None:
        out = out + bias.reshape(-1).astype(jnp.float32)
    return out.astype(x.dtype).reshape(x.shape)


def trained_looking(norm: eqx.nn.RMSNorm, seed: int) -> eqx.nn.RMSNorm:
    """``norm`` with a weight and bias away from their initial ones and zeros."""
    for i, where in enumerate((lambda m: m.weight, lambda m: m.bias)):
        if where(norm) is not None:
            noise = random_rows(seed + i, norm.shape, np.float32, spread=0.3)
            norm = eqx.tree_at(where, norm, where(norm) + jnp.asarray(noise, where(norm).dtype))
    return norm


CASES = {
    # shape, x dtype, eqx.nn.RMSNorm's arguments, recipe keywords
    "bias_f32": ((256,), jnp.float32, {}, {}),
    "bias_bf16": ((256,), jnp.bfloat16, {}, {"recipe": "fp8_group128"}),
    "no_bias_bf16_weight": ((256,), jnp.bfloat16, {"use_bias": False, "dtype": jnp.bfloat16}, {}),
    "no_weight": ((128,), jnp.float16, {"use_weight": False, "use_bias": False}, {}),
    "multi_axis": ((4, 64), jnp.float32, {"eps": 1e-6}, {"recipe": "mxfp8"}),
    "static": ((256,), jnp.bfloat16, {}, {"recipe": "fp8_static", "static_scale": 0.02}),
}


@pytest.mark.parametrize("case", CASES)
def test_vmapped_module_matches_the_control(case):
    shape, x_dtype, arguments, keywords = CASES[case]
    x = jnp.asarray(random_rows(1, (6, *shape), x_dtype))
    norm = trained_looking(eqx.nn.RMSNorm(shape, **arguments), seed=2)
    fp8 = RMSNormFP8.from_rmsnorm(norm, **keywords)
    # The same fields, holding the same arrays: the norm's state loads as it is.
    assert (fp8.weight is norm.weight) and (fp8.bias is norm.bias)
    assert (fp8.shape, fp8.eps, fp8.use_weight, fp8.use_bias) == (
        norm.shape,
        norm.eps,
        norm.use_weight,
        norm.use_bias,
    )
    got = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(fp8, x)
    want_plain = jax.vmap(norm)(x)
    assert got.dtype == want_plain.dtype == x.dtype and got.shape == x.shape
    same_bits(got, control(x, norm.weight, norm.bias, eps=norm.eps, **keywords))
    assert np.isfinite(np.asarray(got, np.float32)).all()
    # The swap is in effect, and FP8's rounding (2^-4 relative, plus an E4M3 subnormal's
    # step under each scale and the bias's rounding) is all it changes.
    difference = np.abs(np.asarray(got, np.float32) - np.asarray(want_plain, np.float32))
    assert difference.max() > 0
    normed = np.asarray(want_plain, np.float32) - (
        0 if norm.bias is None else np.asarray(norm.bias, np.float32)
    )
    ulp = float(jnp.finfo(x_dtype).eps)
    bound = (2.0**-4 + 2 * ulp) * np.abs(normed) + 2.0**-8 + 2 * ulp * np.abs(want_plain)
    assert (difference <= bound).all()


def test_the_constructor_matches_equinoxs():
    for arguments in ({}, {"use_bias": False}, {"use_weight": False, "dtype": jnp.bfloat16}):
        norm, fp8 = eqx.nn.RMSNorm((4, 16), **arguments), RMSNormFP8((4, 16), **arguments)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), (norm.weight, norm.bias)) == (
            jax.tree.map(lambda a: (a.shape, a.dtype), (fp8.weight, fp8.bias))
        )
        assert fp8.eps == norm.eps == 1e-5


def test_state_key_and_quantized_output():
    x = jnp.asarray(random_rows(3, (256,), jnp.bfloat16))
    norm = RMSNormFP8(256, use_bias=False)
    state = {"anything": 1}
    out, state_out = norm(x, state, key=jax.random.key(0))
    assert state_out is state
    same_bits(out, norm(x))
    codes = RMSNormFP8(256, use_bias=False, quantized_output=True, recipe="mxfp8")(x)
    assert isinstance(codes, QuantizedOutput)
    want = fp8norm.rms_norm_fp8(x, jnp.ones(256), recipe="mxfp8", eps=1e-5)
    same_bits(codes.y, want[0])
    same_bits(codes.scales, want[1])
    with pytest.raises(AttributeError, match="quantized_output"):
        codes.astype(jnp.float32)
    with pytest.raises(TypeError, match="quantized_output"):
        jnp.sum(codes)


def test_gradients_reach_the_weight_and_the_bias():
    x = jnp.asarray(random_rows(4, (8, 4, 32), jnp.float32))
    w = jnp.asarray(random_rows(5, (8, 4, 32), jnp.float32))
    norm = trained_looking(eqx.nn.RMSNorm((4, 32)), seed=6)
    fp8 = RMSNormFP8.from_rmsnorm(norm)
    grads = eqx.filter_grad(lambda m: jnp.sum(w * jax.vmap(m)(x)))(fp8)

    # Vmapped as the module is: under vmap the per-example weight gradients are summed by
    # jax's transpose of the broadcast, not in the kernel's exact sum over every row.
    def direct(weight, bias):
        def one(x):
            return fp8norm.rms_norm_fp8_dequantized(x.reshape(128), weight.reshape(128), eps=1e-5)

        out = jax.vmap(one)(x)
        return jnp.sum(w * (out + bias.reshape(128)).reshape(x.shape))

    want = jax.grad(direct, argnums=(0, 1))(norm.weight, norm.bias)
    same_bits(grads.weight, want[0])
    same_bits(grads.bias, want[1])
    assert np.any(np.asarray(grads.weight) != 0)


def test_adamw_on_the_inexact_arrays_leaves_a_calibrated_scale_alone():
    """equinox's usual training step (the model's inexact arrays through optax.adamw,
    whose weight decay shrinks every parameter it is given) trains the weight and leaves
    the calibrated static_scale and NVFP4's global_scale as they were: constants, not
    parameters, so the call keeps the calibration's codes."""
    optax = pytest.importorskip("optax")
    x = jnp.asarray(random_rows(8, (4, 32), jnp.float32))
    for name, keywords in (
        ("static_scale", {"recipe": "fp8_static", "static_scale": 0.02}),
        ("global_scale", {"recipe": "nvfp4", "global_scale": 0.0021}),
    ):
        model = RMSNormFP8(32, **keywords)
        before = float(np.float32(keywords[name]))
        optimizer = optax.adamw(1e-2, weight_decay=0.5)
        state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        for _ in range(2):
            grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
            params = eqx.filter(model, eqx.is_inexact_array)
            updates, state = optimizer.update(grads, state, params)
            model = eqx.apply_updates(model, updates)
        assert float(np.asarray(getattr(model, name)).reshape(-1)[0]) == before, name
        assert np.any(np.asarray(model.weight) != 1), "the weight trained"
        same_bits(jax.vmap(model)(x), control(x, model.weight, model.bias, **keywords))


REFUSED = {
    "shape": ({"shape": ()}, ValueError),
    "group_size": ({"shape": (4, 6), "group_size": 16}, ValueError),
    "eps": ({"shape": 8, "eps": float("nan")}, ValueError),
    "use_bias": ({"shape": 8, "quantized_output": True}, ValueError),
    "use_weight": ({"shape": 8, "use_weight": 1}, TypeError),
    "recipe": ({"shape": 64, "recipe": "mxfp9"}, ValueError),
    "unexpected": ({"shape": 8, "bogus": 1e-6}, TypeError),
    # Flax's name for eps: refused by name, saying to use equinox's (eps=).
    "epsilon=: .* eps=": ({"shape": 8, "epsilon": 1e-6}, TypeError),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_by_name(name):
    arguments, error = REFUSED[name]
    with pytest.raises(error, match=name):
        RMSNormFP8(**arguments)


def test_one_example_at_a_time():
    with pytest.raises(ValueError, match="vmap"):
        RMSNormFP8(16)(jnp.ones((2, 16)))


def test_the_frameworks_are_optional_dependencies():
    """pyproject's extras name each module's framework, and the package imports neither
    framework unless its module is imported."""
    root = Path(__file__).resolve().parents[1]
    with open(root / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert [r.split(">")[0] for r in extras["eqx"]] == ["equinox"]
    assert [r.split(">")[0] for r in extras["linen"]] == ["flax"]
    script = (
        "import sys, jax_fp8norm, jax_fp8norm.interop, jax_fp8norm.matmul\n"
        "assert not {'equinox', 'flax'} & set(sys.modules), sorted(sys.modules)\n"
        "import jax_fp8norm.eqx\n"
        "assert 'flax' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
