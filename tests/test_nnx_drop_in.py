"""RMSNormFP8 as a drop-in for flax.nnx.RMSNorm: its constructor arguments, its result
(an array of nnx's dtype, through the module's promote_dtype), its ``scale`` Variable with
the metadata and sharding (Explicit and Auto mesh axes), several trailing reduction axes,
and the FP8 codes one explicit choice away (``quantized_output=True``), refused clearly
where they meet an array operation. Each output is held to an FP8 control (the quantised
op and ``dequantize`` on nnx's promoted inputs, bit for bit) and to nnx.RMSNorm itself
within the control's FP8 rounding, and not equal to it. The model trained with
nnx.Optimizer is in the extended tier."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXTENDED, TIERS, random_rows, rerun_with_virtual_cpu_devices, same_bits

nnx = pytest.importorskip("flax.nnx")

from flax.nnx.nn import dtypes as nnx_dtypes  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_fp8norm as fp8norm  # noqa: E402
from jax_fp8norm.nnx import QuantizedOutput, RMSNormFP8  # noqa: E402

N = 64


def _linspace_init(key, shape, dtype):
    """A trained-looking scale, the same whatever the key, so that the modules compared
    hold the same one."""
    return jnp.linspace(0.5, 1.5, shape[0], dtype=dtype)


def _nnx_norm(n: int = N, **kwargs) -> nnx.RMSNorm:
    return nnx.RMSNorm(n, scale_init=_linspace_init, rngs=nnx.Rngs(0), **kwargs)


def fp8_control(x, scale, dtype, **keywords):
    """What the drop-in must return: nnx's promoted inputs through the quantised op, the
    codes dequantised in float32 and rounded once to nnx's result dtype."""
    y, scales = fp8norm.rms_norm_fp8(x, scale, **keywords)
    return fp8norm.dequantize(y, scales).astype(dtype)


def e4m3_rounding_bound(reference, scales):
    """Per element, half an E4M3 spacing at ``reference / scale`` (times the scale): how far
    FP8 rounding alone may move a value, plus a few float32 units for the two norms'
    own arithmetic."""
    v = np.abs(np.asarray(reference, np.float64) / scales) * (1 + 2**-20)
    exponent = np.floor(np.log2(np.maximum(v, 2.0**-6)))  # E4M3: subnormal below 2^-6
    return 0.5 * 2.0 ** (exponent - 3) * scales + 1e-5 * np.abs(reference)


def assert_within_fp8_rounding_of(got, reference, scales):
    """``got`` within the FP8 control's own rounding of nnx.RMSNorm's ``reference`` and
    not equal to it: the quantised path ran."""
    got, reference = np.asarray(got, np.float64), np.asarray(reference, np.float64)
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(reference))
    error = np.abs(got - reference)
    assert np.all(error <= e4m3_rounding_bound(reference, scales)), error.max()
    assert error.max() > 0


def test_float32_drop_in_equals_the_fp8_control_and_nnx_within_rounding():
    x = random_rows(1, (4, 8, N), jnp.float32)
    norm = _nnx_norm(epsilon=1e-5)
    module = RMSNormFP8.from_rmsnorm(norm)
    out = nnx.jit(lambda m, x: m(x))(module, x)
    assert isinstance(out, jax.Array) and out.shape == x.shape and out.dtype == jnp.float32
    same_bits(out, fp8_control(x, norm.scale[...], jnp.float32, eps=1e-5))
    _, scales = fp8norm.rms_norm_fp8(x, norm.scale[...], eps=1e-5)
    assert_within_fp8_rounding_of(out, norm(x), np.asarray(scales, np.float64))
    # The next layer takes it as it took nnx.RMSNorm's output.
    assert nnx.Linear(N, 3, rngs=nnx.Rngs(1))(out).shape == (4, 8, 3)


@pytest.mark.parametrize(
    ("x_dtype", "param_dtype", "dtype"),
    [
        (jnp.bfloat16, jnp.bfloat16, None),  # a bfloat16 model: bfloat16 out
        (jnp.bfloat16, jnp.float32, None),  # promoted to the scale's float32
        (jnp.float32, jnp.bfloat16, None),
        (jnp.float16, jnp.float16, None),
        (jnp.float32, jnp.float32, jnp.bfloat16),  # dtype= wins
        (jnp.bfloat16, jnp.bfloat16, jnp.float32),
    ],
)
def test_result_dtype_is_nnx_s(x_dtype, param_dtype, dtype):
    x = random_rows(2, (6, N), x_dtype)
    norm = _nnx_norm(param_dtype=param_dtype, dtype=dtype)
    want = norm(x)
    out = RMSNormFP8.from_rmsnorm(norm)(x)
    assert out.dtype == want.dtype
    px, pscale = nnx_dtypes.promote_dtype((x, norm.scale[...]), dtype=dtype)
    same_bits(out, fp8_control(px, pscale, want.dtype))
    made = RMSNormFP8(N, param_dtype=param_dtype, dtype=dtype, scale_init=_linspace_init)
    same_bits(made(x), out)


def test_a_custom_promote_dtype_is_honoured():
    calls = []

    def to_float16(args, *, dtype=None):
        calls.append(dtype)
        return tuple(None if a is None else jnp.asarray(a, jnp.float16) for a in args)

    x = random_rows(3, (5, N), jnp.float32)
    norm = _nnx_norm(promote_dtype=to_float16)
    want = norm(x)
    assert want.dtype == jnp.float16
    for module in (
        RMSNormFP8.from_rmsnorm(norm),
        RMSNormFP8(N, promote_dtype=to_float16, scale_init=_linspace_init),
    ):
        calls.clear()
        out = module(x)
        assert calls == [None] and out.dtype == jnp.float16
        scale16 = norm.scale[...].astype(jnp.float16)
        same_bits(out, fp8_control(x.astype(jnp.float16), scale16, jnp.float16))


def test_every_nnx_constructor_argument_is_taken():
    ours = inspect.signature(RMSNormFP8).parameters
    theirs = inspect.signature(nnx.RMSNorm.__init__).parameters
    assert [p for p in theirs if p != "self" and p not in ours] == []
    x = random_rows(4, (3, N), jnp.float32)
    module = RMSNormFP8(
        N,
        epsilon=1e-5,
        use_fast_variance=False,  # no effect in nnx.RMSNorm either: no mean subtracted
        axis_name=None,
        axis_index_groups=None,
        scale_metadata={"note": "kept"},
        rngs=nnx.Rngs(0),
    )
    assert module.scale.get_metadata()["note"] == "kept"
    same_bits(module(x), fp8_control(x, jnp.ones(N), jnp.float32, eps=1e-5))
    # nnx.RMSNorm's attributes read the same on the module made from it.
    norm = _nnx_norm(epsilon=1e-5, use_fast_variance=False)
    converted = RMSNormFP8.from_rmsnorm(norm)
    for name in (
        "num_features epsilon dtype param_dtype use_scale reduction_axes feature_axes "
        "axis_name axis_index_groups use_fast_variance promote_dtype"
    ).split():
        assert getattr(converted, name) == getattr(norm, name), name


def test_the_call_takes_nnx_rmsnorm_s_arguments_as_it_does():
    """x and mask positional, as nnx.RMSNorm.__call__ takes them; residual= keyword-only."""
    ours = inspect.signature(RMSNormFP8.__call__).parameters
    theirs = inspect.signature(nnx.RMSNorm.__call__).parameters
    assert [(p.name, p.kind) for p in theirs.values()] == [
        (p.name, p.kind) for p in ours.values() if p.name != "residual"
    ]
    assert ours["residual"].kind == inspect.Parameter.KEYWORD_ONLY


def test_the_scale_draws_the_key_nnx_draws():
    """The layers made after the norm get the keys they would after nnx.RMSNorm."""
    ours, theirs = nnx.Rngs(0), nnx.Rngs(0)
    RMSNormFP8(N, rngs=ours)
    nnx.RMSNorm(N, rngs=theirs)
    same_bits(jax.random.key_data(ours.params()), jax.random.key_data(theirs.params()))
    init = nnx.initializers.uniform(1.0)
    same_bits(
        RMSNormFP8(N, scale_init=init, rngs=nnx.Rngs(3)).scale[...],
        nnx.RMSNorm(N, scale_init=init, rngs=nnx.Rngs(3)).scale[...],
    )


def test_what_the_kernels_cannot_honour_is_refused_by_name():
    for name, value in (("axis_name", "tp"), ("axis_index_groups", [[0, 1]])):
        with pytest.raises(ValueError, match=f"{name}=.*normalises each row whole"):
            RMSNormFP8(N, **{name: value})
    with pytest.raises(ValueError, match="axis_name='tp'"):
        RMSNormFP8.from_rmsnorm(nnx.RMSNorm(N, axis_name="tp", rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"feature_axes=-2 must be among reduction_axes"):
        RMSNormFP8(N, feature_axes=-2)
    with pytest.raises(ValueError, match=r"feature_axes=0 must be among reduction_axes"):
        RMSNormFP8(N, feature_axes=0)(jnp.ones((2, N)))
    with pytest.raises(TypeError, match=r"reduction_axes must be an int or a sequence"):
        RMSNormFP8(N, reduction_axes=True)
    with pytest.raises(ValueError, match=r"reduction_axes=\(-3, -1\).*trailing"):
        RMSNormFP8(N, reduction_axes=(-3, -1))
    with pytest.raises(ValueError, match=r"reduction_axes=0.*trailing"):
        RMSNormFP8(N, reduction_axes=0)(jnp.ones((2, 3, N)))
    # One rule for the three modules: the framework's own name, the other refused by name.
    with pytest.raises(TypeError, match=r"eps=: this RMSNormFP8 takes .* epsilon="):
        RMSNormFP8(N, eps=1e-6)


def test_dequantize_is_gone_and_says_what_replaces_it():
    for make in (
        lambda: RMSNormFP8(N, dequantize=True),
        lambda: RMSNormFP8.from_rmsnorm(_nnx_norm(), dequantize=False),
    ):
        with pytest.raises(TypeError, match=r"removed in jax_fp8norm 0\.3\.0.*quantized_output"):
            make()


def test_a_mask_is_refused_by_name():
    """nnx's mask restricts the mean square to the masked elements; the kernels take the
    whole row's. A mask (nnx's positional second argument) is refused, not read as a
    residual; mask=None is nnx's call."""
    x = random_rows(5, (4, N), jnp.float32)
    module = RMSNormFP8.from_rmsnorm(_nnx_norm())
    with pytest.raises(ValueError, match=r"mask: RMSNormFP8 takes no mask.*whole row"):
        module(x, jnp.ones((4, N), bool))
    same_bits(module(x, None), module(x))


def test_a_residual_goes_by_its_keyword():
    """The fused residual add: ``out`` in nnx's dtype (bfloat16 x and a float32 scale:
    float32), ``residual_out`` in the residual stream's own dtype, not promoted."""
    x = random_rows(6, (4, N), jnp.bfloat16)
    residual = random_rows(7, (4, N), jnp.bfloat16)
    norm = _nnx_norm()
    out, residual_out = RMSNormFP8.from_rmsnorm(norm)(x, residual=residual)
    y, scales, want_residual = fp8norm.add_rms_norm_fp8(x, residual, norm.scale[...])
    assert out.dtype == norm(x).dtype == jnp.float32
    same_bits(out, fp8norm.dequantize(y, scales))
    same_bits(residual_out, want_residual)
    assert residual_out.dtype == jnp.bfloat16


@pytest.mark.parametrize("shape", [(2, 3, N), (N,)])
def test_reduction_axes_name_the_last_axis_or_several(shape):
    x = random_rows(8, shape, jnp.float32)
    last = RMSNormFP8.from_rmsnorm(_nnx_norm())
    same_bits(RMSNormFP8.from_rmsnorm(_nnx_norm(reduction_axes=len(shape) - 1))(x), last(x))
    same_bits(RMSNormFP8.from_rmsnorm(_nnx_norm(reduction_axes=(-1,)))(x), last(x))


def test_a_norm_over_two_axes_is_one_row_of_their_product():
    """nnx.RMSNorm(16, reduction_axes=(-2, -1)): the mean square over [4, 16], the scale
    along the last axis. The control flattens by hand: rows of 64, the scale tiled."""
    x = random_rows(9, (3, 4, 16), jnp.float32)
    norm = _nnx_norm(16, reduction_axes=(-2, -1))
    out = RMSNormFP8.from_rmsnorm(norm)(x)
    assert out.shape == x.shape
    rows, gamma = x.reshape(3, 64), jnp.tile(norm.scale[...], 4)
    same_bits(out, fp8_control(rows, gamma, jnp.float32).reshape(x.shape))
    _, scales = fp8norm.rms_norm_fp8(rows, gamma)
    scales = np.asarray(scales, np.float64).reshape(3, 1, 1)
    assert_within_fp8_rounding_of(out, norm(x), scales)


def test_a_scale_along_another_normalised_axis():
    """nnx.RMSNorm(4, reduction_axes=(-2, -1), feature_axes=-2), legal in nnx: the scale
    along the rows' first normalised axis, broadcast along the last (nnx reshapes it to
    (4, 1)). The control: rows of 64, the scale repeated 16 times each; the gradient
    the control's (the broadcast's exact sum)."""
    x = random_rows(9, (3, 4, 16), jnp.float32)
    norm = nnx.RMSNorm(4, reduction_axes=(-2, -1), feature_axes=-2, rngs=nnx.Rngs(0))
    norm.scale[...] = jnp.asarray([0.5, 0.75, 1.25, 1.5], jnp.float32)
    rows, gamma = x.reshape(3, 64), jnp.repeat(norm.scale[...], 16)
    want = fp8_control(rows, gamma, jnp.float32).reshape(x.shape)
    made = RMSNormFP8(4, reduction_axes=(-2, -1), feature_axes=-2)
    nnx.update(made, nnx.state(norm))
    for module in (RMSNormFP8.from_rmsnorm(norm), made):
        same_bits(module(x), want)
    loss = lambda g: jnp.sum(fp8norm.rms_norm_fp8_dequantized(x, g, reduction_axes=(-2, -1)))  # noqa: E731
    grad = nnx.grad(lambda m: jnp.sum(m(x)))(made).scale[...]
    same_bits(grad, jax.grad(loss)(norm.scale[...][:, None]).reshape(4))
    assert np.all(np.isfinite(np.asarray(want)))


def test_without_a_scale_as_nnx():
    x = random_rows(10, (4, N), jnp.bfloat16)
    norm = nnx.RMSNorm(N, use_scale=False, rngs=nnx.Rngs(0))
    for module in (RMSNormFP8.from_rmsnorm(norm), RMSNormFP8(N, use_scale=False)):
        assert nnx.state(module, nnx.Param) == nnx.State({})
        out = module(x)
        assert out.dtype == norm(x).dtype == jnp.bfloat16  # x alone sets the dtype
        same_bits(out, fp8_control(x, jnp.ones(N, jnp.bfloat16), jnp.bfloat16))


def test_from_rmsnorm_keeps_the_scale_variable():
    norm = _nnx_norm(scale_metadata={"note": "kept"})
    module = RMSNormFP8.from_rmsnorm(norm, recipe="mxfp8")
    assert module.keywords["recipe"] == "mxfp8"
    assert module.scale is norm.scale and module.scale.get_metadata()["note"] == "kept"
    # nnx.RMSNorm's state loads as it is, by the parameter's name.
    loaded = RMSNormFP8(N)
    nnx.update(loaded, nnx.state(norm))
    x = random_rows(11, (2, N), jnp.float32)
    same_bits(loaded(x), RMSNormFP8.from_rmsnorm(norm)(x))


def _array_uses(out):
    x = jnp.ones((4, N))
    return {
        "jnp.asarray": lambda: jnp.asarray(out),
        "np.asarray": lambda: np.asarray(out),
        ".shape": lambda: out.shape,
        ".dtype": lambda: out.dtype,
        ".astype": lambda: out.astype(jnp.float32),
        "out + x": lambda: out + x,
        "x + out": lambda: x + out,
        "2 * out": lambda: 2 * out,
        "out * 2": lambda: out * 2,
        "out[..., 0]": lambda: out[..., 0],
        "jnp.tanh": lambda: jnp.tanh(out),
        "nnx.Linear": lambda: nnx.Linear(N, 3, rngs=nnx.Rngs(0))(out),
    }


def test_quantized_output_is_the_op_s_codes_and_refuses_array_use():
    x = random_rows(12, (4, N), jnp.bfloat16)
    residual = random_rows(13, (4, N), jnp.bfloat16)
    norm = _nnx_norm(param_dtype=jnp.bfloat16)
    module = RMSNormFP8.from_rmsnorm(norm, recipe="fp8_row", quantized_output=True)
    out = nnx.jit(lambda m, x: m(x))(module, x)
    assert isinstance(out, QuantizedOutput) and out._fields == ("y", "scales")
    y, _ = out
    same_bits(y, fp8norm.rms_norm_fp8(x, norm.scale[...])[0])
    same_bits(out.scales, fp8norm.rms_norm_fp8(x, norm.scale[...])[1])
    with_residual = module(x, residual=residual)
    assert with_residual._fields == ("y", "scales", "residual_out")
    for got, want in zip(
        with_residual, fp8norm.add_rms_norm_fp8(x, residual, norm.scale[...]), strict=True
    ):
        same_bits(got, want)
    for use, fn in _array_uses(out).items():
        with pytest.raises((TypeError, AttributeError), match="quantized_output=True") as error:
            fn()
        assert "out.y" in str(error.value), use


# The scale sharded over a mesh axis, as nnx.RMSNorm shards it from its metadata: 8 virtual
# CPU devices (helpers asks for them; a session with fewer reruns this part on 8).
HAVE_DEVICES = len(jax.devices("cpu")) >= 8
MODES = [AxisType.Explicit, AxisType.Auto]

if not HAVE_DEVICES:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(__file__, 8, tier, "-k", "mesh")

else:

    @pytest.mark.parametrize("mode", MODES, ids=["explicit", "auto"])
    def test_a_scale_sharded_over_a_mesh_axis(mode):
        x0 = random_rows(15, (8, N), jnp.float32)
        unsharded = RMSNormFP8.from_rmsnorm(_nnx_norm())
        want = unsharded(x0)
        want_grad = nnx.grad(lambda m: jnp.sum(m(x0) ** 2))(unsharded).scale[...]
        mesh = jax.make_mesh(
            (2, 4), ("data", "model"), axis_types=(mode, mode), devices=jax.devices("cpu")[:8]
        )
        with jax.set_mesh(mesh):
            norm = _nnx_norm(scale_metadata={"out_sharding": ("model",)})
            assert norm.scale[...].sharding.spec == P("model")
            module = RMSNormFP8.from_rmsnorm(norm)
            assert module.scale is norm.scale
            assert module.scale.get_metadata()["out_sharding"] == ("model",)
            made = RMSNormFP8(
                N, scale_metadata={"out_sharding": ("model",)}, scale_init=_linspace_init
            )
            assert made.scale.get_metadata()["out_sharding"] == ("model",)
            assert made.scale[...].sharding == norm.scale[...].sharding
            x = jax.device_put(x0, P("data", None))
            for m in (module, made):
                out = nnx.jit(lambda m, x: m(x))(m, x)
                same_bits(out, want)
                # On Explicit axes the sharding is the array's type: nnx's.
                assert jax.typeof(out) == jax.typeof(norm(x))
                grad = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(m).scale[...]
                assert jax.typeof(grad) == jax.typeof(m.scale[...])
                same_bits(grad, want_grad)
        # Outside the mesh context, where nnx.RMSNorm runs too: the mesh is the arrays'
        # own (their types'), eager and under jit.
        for m in (module, made):
            for out in (m(x), nnx.jit(lambda m, x: m(x))(m, x)):
                same_bits(out, want)
                assert jax.typeof(out) == jax.typeof(norm(x))


class _ControlNorm(nnx.Module):
    """The hand-written FP8 control: the norm's own scale through the differentiable twin."""

    def __init__(self, norm: nnx.RMSNorm):
        self.scale = norm.scale
        self.epsilon = norm.epsilon

    def __call__(self, x):
        return fp8norm.rms_norm_fp8_dequantized(x, self.scale[...], eps=self.epsilon)


@EXTENDED
def test_an_nnx_model_with_every_norm_swapped_trains_like_the_original():
    """The example's decoder block (attention and MLP, two nnx.RMSNorm) with every norm
    swapped by its swap_rmsnorms, trained five Adam steps through nnx.Optimizer: equal to
    the hand-written FP8 control bit for bit at every step, and tracking the unswapped
    block within FP8's noise (under 1% of the loss; about 0.2% here: e4m3 keeps 3 mantissa bits),
    never equal to it. The swap keeps the state's paths: a checkpoint loads as it is."""
    optax = pytest.importorskip("optax")
    from jax_fp8norm.examples.nnx_decoder_block import DecoderBlock, swap_rmsnorms

    base = DecoderBlock(N, 4, 128, rngs=nnx.Rngs(0))
    for i, norm in enumerate((base.attention_norm, base.mlp_norm)):
        norm.scale[...] = _linspace_init(None, (N,), jnp.float32)[:: 1 - 2 * i]
    control = nnx.clone(base)
    control.attention_norm = _ControlNorm(control.attention_norm)
    control.mlp_norm = _ControlNorm(control.mlp_norm)
    models = {"nnx": base, "fp8": swap_rmsnorms(nnx.clone(base)), "control": control}
    assert isinstance(models["fp8"].mlp_norm, RMSNormFP8)
    paths = lambda m: [p for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))]  # noqa: E731
    assert paths(models["fp8"]) == paths(base)
    x = jnp.asarray(random_rows(16, (4, 8, N), jnp.float32, spread=0.5))
    target = jnp.asarray(np.random.default_rng(17).standard_normal((4, 8, N)), jnp.float32)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            return jnp.mean((model(x) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    optimizers = {k: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for k, m in models.items()}
    losses = {k: [] for k in models}
    for _ in range(5):
        for k, model in models.items():
            losses[k].append(np.asarray(step(model, optimizers[k])))
    for got, want in zip(losses["fp8"], losses["control"], strict=True):
        same_bits(got, want)
    for name in ("attention_norm", "mlp_norm"):
        same_bits(
            getattr(models["fp8"], name).scale[...], getattr(models["control"], name).scale[...]
        )
    fp8, original = np.array(losses["fp8"]), np.array(losses["nnx"])
    assert np.all(np.isfinite(fp8)) and fp8[-1] < fp8[0] and original[-1] < original[0]
    relative = np.abs(fp8 - original) / original
    assert np.all(relative < 0.01) and np.all(relative > 0), relative
