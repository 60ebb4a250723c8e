"""The Flax Linen module: a class substitution for ``nn.RMSNorm`` that returns what it
returns (an array, in its dtype), bit for bit the FP8 control (the op's codes
dequantised, cast as nn.RMSNorm casts), with the recipe's attributes checked where the
module is made and what it cannot honour refused by name."""

from __future__ import annotations

import functools
import inspect
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TIERS, random_rows, rerun_with_virtual_cpu_devices, same_bits
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm
from jax_fp8norm.linen import RECIPE_FIELDS, QuantizedOutput, RMSNormFP8


def control(x, gamma, dtype, residual=None, **keywords):
    """The FP8 control: the op's codes dequantised in float32, rounded once to ``dtype``."""
    if residual is None:
        return fp8norm.dequantize(*fp8norm.rms_norm_fp8(x, gamma, **keywords)).astype(dtype)
    y, scales, residual_out = fp8norm.add_rms_norm_fp8(x, residual, gamma, **keywords)
    return fp8norm.dequantize(y, scales).astype(dtype), residual_out


def swapped_pair(x, seed=0, **attributes):
    """nn.RMSNorm and RMSNormFP8 with the same attributes and the same trained-looking
    scale; returns the two modules, the variables and nn.RMSNorm's output."""
    plain = nn.RMSNorm(**{k: v for k, v in attributes.items() if k not in RECIPE_FIELDS})
    variables = plain.init(jax.random.key(seed), x)
    variables = jax.tree.map(
        lambda s: s + jnp.asarray(random_rows(seed, s.shape, np.float32, spread=0.5), s.dtype),
        variables,
    )
    return plain, RMSNormFP8(**attributes), variables


CASES = {
    # x dtype, attributes: nn.RMSNorm promotes bfloat16 x with a float32 scale to float32
    "bf16_x_f32_scale": (jnp.bfloat16, {}),
    "bf16_x_bf16_scale": (jnp.bfloat16, {"param_dtype": jnp.bfloat16}),
    "explicit_dtype": (jnp.float32, {"dtype": jnp.float16}),
    "no_scale": (jnp.bfloat16, {"use_scale": False}),
    "f16_group128": (jnp.float16, {"recipe": "fp8_group128", "epsilon": 1e-5}),
    "static": (jnp.bfloat16, {"recipe": "fp8_static", "static_scale": jnp.float32(0.02)}),
}


@pytest.mark.parametrize("case", CASES)
def test_returns_what_nn_rmsnorm_returns_with_the_control_bits(case):
    x_dtype, attributes = CASES[case]
    x = jnp.asarray(random_rows(1, (3, 5, 256), x_dtype))
    plain, fp8, variables = swapped_pair(x, **attributes)
    want_dtype = plain.apply(variables, x).dtype
    # The same parameters: an nn.RMSNorm checkpoint loads as it is.
    fp8_variables = fp8.init(jax.random.key(0), x)
    assert jax.tree.structure(fp8_variables) == jax.tree.structure(variables)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), fp8_variables) == jax.tree.map(
        lambda a: (a.shape, a.dtype), variables
    )
    got = jax.jit(fp8.apply)(variables, x)
    scale = variables["params"]["scale"] if attributes.get("use_scale", True) else None
    keywords = {k: v for k, v in attributes.items() if k in RECIPE_FIELDS}
    keywords["eps"] = attributes.get("epsilon", 1e-6)
    same_bits(got, control(x, scale, want_dtype, **keywords))
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_recipe_attributes_residual_and_quantized_output():
    x = jnp.asarray(random_rows(2, (4, 256), jnp.bfloat16))
    residual = jnp.asarray(random_rows(3, (4, 256), jnp.bfloat16))
    keywords = {"recipe": "mxfp8", "weight_offset": 1.0, "eps": 1e-6}
    norm = RMSNormFP8(recipe="mxfp8", weight_offset=1.0)
    variables = norm.init(jax.random.key(0), x)
    # With weight_offset=1.0 a new module is the identity RMSNorm: Gemma's zeros.
    np.testing.assert_array_equal(np.asarray(variables["params"]["scale"]), np.zeros(256))
    scale = jnp.asarray(random_rows(4, (256,), np.float32, spread=0.3))
    variables = {"params": {"scale": scale}}
    out, residual_out = norm.apply(variables, x, residual=residual)
    same_bits(out, control(x, scale, jnp.float32, residual, **keywords)[0])
    same_bits(residual_out, control(x, scale, jnp.float32, residual, **keywords)[1])

    codes = RMSNormFP8(recipe="mxfp8", weight_offset=1.0, quantized_output=True)
    got = codes.apply(variables, x)
    assert isinstance(got, QuantizedOutput)
    same_bits(got.y, fp8norm.rms_norm_fp8(x, scale, **keywords)[0])
    same_bits(got.scales, fp8norm.rms_norm_fp8(x, scale, **keywords)[1])
    got_add = codes.apply(variables, x, residual=residual)
    assert isinstance(got_add, QuantizedOutput)
    for got_one, want_one in zip(
        got_add, fp8norm.add_rms_norm_fp8(x, residual, scale, **keywords), strict=True
    ):
        same_bits(got_one, want_one)
    same_bits(got_add.residual_out, residual_out)
    # Used as the array it is not, it names the choice that made it.
    w = jnp.ones((256, 8), jnp.bfloat16)
    for use in (lambda o: o.shape, lambda o: o @ w, lambda o: jnp.tanh(o), lambda o: o + 1.0):
        with pytest.raises((TypeError, AttributeError), match="quantized_output"):
            use(got)


@pytest.mark.parametrize("features", [(-2, -1), -1, -2])
def test_several_reduction_axes(features):
    """reduction_axes=(-2, -1): one row of A * D values, the scale shaped by
    feature_axes as nn.RMSNorm shapes it, against the control of the flattened rows."""
    x = jnp.asarray(random_rows(5, (3, 4, 64), jnp.float32))
    plain, fp8, variables = swapped_pair(x, reduction_axes=(-2, -1), feature_axes=features)
    assert plain.apply(variables, x).shape == x.shape
    got = fp8.apply(variables, x)
    scale = variables["params"]["scale"]
    gamma = jnp.broadcast_to(scale if features != -2 else scale[:, None], (4, 64)).reshape(256)
    want = control(x.reshape(3, 256), gamma, jnp.float32).reshape(x.shape)
    same_bits(got, want)


def test_gradient_through_the_module():
    x = jnp.asarray(random_rows(6, (6, 128), jnp.float32))
    w = jnp.asarray(random_rows(7, (6, 128), jnp.float32))
    norm = RMSNormFP8(recipe="fp8_row")
    scale = jnp.asarray(random_rows(8, (128,), jnp.float32, spread=0.3))
    grads = jax.grad(lambda v: jnp.sum(w * norm.apply(v, x)))({"params": {"scale": scale}})

    def direct(g):
        return jnp.sum(w * fp8norm.rms_norm_fp8_dequantized(x, g, recipe="fp8_row"))

    same_bits(grads["params"]["scale"], jax.grad(direct)(scale))
    assert np.any(np.asarray(grads["params"]["scale"]) != 0)


if len(jax.devices("cpu")) < 8:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(__file__, 8, tier, "-k", "mesh")

else:

    def test_a_scale_sharded_over_an_explicit_mesh_axis():
        """On an Explicit (data, model) mesh, with the scale sharded over model as a
        sharded model holds it: the output has nn.RMSNorm's type (x's rows on data, the
        features on model, as its x * scale), the scale's gradient the scale's type, and
        both the unsharded call's bits; inside and outside the mesh context."""
        x0 = jnp.asarray(random_rows(9, (8, 32), jnp.float32))
        w = jnp.asarray(random_rows(10, (8, 32), jnp.float32))
        plain, fp8, variables = swapped_pair(x0, recipe="fp8_row")
        loss = lambda v, x: jnp.sum(w * fp8.apply(v, x))  # noqa: E731
        want, want_grad = fp8.apply(variables, x0), jax.grad(loss)(variables, x0)
        mesh = jax.make_mesh(
            (2, 4), ("data", "model"), (AxisType.Explicit,) * 2, devices=jax.devices("cpu")[:8]
        )
        x = jax.device_put(x0, NamedSharding(mesh, P("data", None)))
        sharded = jax.device_put(variables, NamedSharding(mesh, P("model")))
        got = jax.jit(fp8.apply)(sharded, x)
        same_bits(got, want)
        assert jax.typeof(got) == jax.typeof(plain.apply(sharded, x))
        assert jax.typeof(got).sharding.spec == P("data", "model")
        same_bits(fp8.apply(sharded, x), want)  # eager, outside the mesh context
        with jax.set_mesh(mesh):
            grad = jax.jit(jax.grad(loss))(sharded, x)["params"]["scale"]
        assert jax.typeof(grad) == jax.typeof(sharded["params"]["scale"])
        same_bits(grad, want_grad["params"]["scale"])
        assert np.all(np.isfinite(np.asarray(want)))


def test_the_call_takes_nn_rmsnorm_s_arguments_as_it_does():
    """x positional and mask keyword-only, as nn.RMSNorm.__call__ takes them (flax 0.12);
    residual= is the one addition, keyword-only too."""
    ours = inspect.signature(RMSNormFP8.__call__).parameters
    theirs = inspect.signature(nn.RMSNorm.__call__).parameters
    assert [(p.name, p.kind) for p in theirs.values()] == [
        (p.name, p.kind) for p in ours.values() if p.name != "residual"
    ]
    assert ours["residual"].kind == inspect.Parameter.KEYWORD_ONLY


REFUSED = {
    "axis_name": ({"axis_name": "batch"}, ValueError),
    "axis_index_groups": ({"axis_index_groups": [[0, 1]]}, ValueError),
    "force_float32_reductions": ({"force_float32_reductions": False}, ValueError),
    "group_size": ({"group_size": 0}, ValueError),
    "recipe": ({"recipe": "fp9"}, ValueError),
    "out_dtype": ({"out_dtype": jnp.int8}, TypeError),
    "epsilon": ({"epsilon": -1.0}, ValueError),
    "use_scale": ({"use_scale": "yes"}, TypeError),
    "scale_dtype": ({"recipe": "mxfp8", "scale_dtype": jnp.float16}, ValueError),
    "feature_axes": ({"feature_axes": -2}, ValueError),
    "reduction_axes": ({"reduction_axes": True}, TypeError),
    # The ops' name for epsilon: refused by name, saying to use nn.RMSNorm's (epsilon=).
    "eps=: .* epsilon=": ({"eps": 1e-6}, TypeError),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_where_the_module_is_made(name):
    attributes, error = REFUSED[name]
    with pytest.raises(error, match=name):
        RMSNormFP8(**attributes)


def test_refused_at_the_call():
    x = jnp.ones((2, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="mask"):
        RMSNormFP8().init(jax.random.key(0), x, mask=jnp.ones(x.shape, bool))
    with pytest.raises(ValueError, match="feature_axes"):
        RMSNormFP8(feature_axes=0).init(jax.random.key(0), x)  # positive: needs x's rank
    with pytest.raises(ValueError, match="reduction_axes"):
        RMSNormFP8(reduction_axes=(0, 2)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="group_size"):
        RMSNormFP8(group_size=128).init(jax.random.key(0), x)
    # use_fast_variance has no effect on an RMSNorm (nor on nn.RMSNorm): accepted.
    variables = RMSNormFP8(use_fast_variance=False).init(jax.random.key(0), x)
    same_bits(
        RMSNormFP8().apply(variables, x), RMSNormFP8(use_fast_variance=False).apply(variables, x)
    )


# Model code as a user has it: it reads the norm class from its module when it builds.
RMSNorm = nn.RMSNorm


class Block(nn.Module):
    """setup-style: the norm made in setup, by the module attribute."""

    def setup(self):
        self.norm = RMSNorm()
        self.dense = nn.Dense(64)

    def __call__(self, x):
        return x + self.dense(self.norm(x))


class CompactModel(nn.Module):
    """compact-style, with the norm class as a constructor argument."""

    norm_cls: type = nn.RMSNorm

    @nn.compact
    def __call__(self, x):
        x = Block()(x)
        return self.norm_cls(name="final_norm")(x)


def test_class_substitution_in_model_code(monkeypatch):
    """The model swaps its class (patched module attribute, or constructor argument) and
    keeps its parameters; every norm then gives the control's bits."""
    x = jnp.asarray(random_rows(9, (2, 8, 64), jnp.float32))
    plain = CompactModel()
    variables = plain.init(jax.random.key(1), x)
    want_plain = plain.apply(variables, x)
    swap = functools.partial(RMSNormFP8, recipe="fp8_row")
    monkeypatch.setattr(sys.modules[__name__], "RMSNorm", swap)
    swapped = CompactModel(norm_cls=swap)
    assert jax.tree.structure(swapped.init(jax.random.key(1), x)) == jax.tree.structure(variables)
    got = swapped.apply(variables, x)

    monkeypatch.setattr(sys.modules[__name__], "RMSNorm", ControlNorm)
    want = CompactModel(norm_cls=ControlNorm).apply(variables, x)
    same_bits(got, want)
    # The swap is in effect, and FP8's rounding is all it changes.
    difference = np.abs(np.asarray(got) - np.asarray(want_plain))
    assert 0 < difference.max() <= 2.0**-3 * np.abs(np.asarray(want_plain)).max()


class ControlNorm(nn.Module):
    """The FP8 control as a module: nn.RMSNorm's parameter, the op's codes dequantised."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        return control(x, scale, jnp.result_type(x, scale), recipe="fp8_row")
