"""A MaxText-style decoder block, its activations quantised by qwix as MaxText quantises
them, run two ways and compared.

MaxText's own arithmetic (maxtext/layers/normalizations.py ``RMSNorm``, linears.py
``DenseGeneral``, quantizations.py's qwix rule): the norm in float32, its output rounded
to bfloat16, times the bfloat16 weight; each projection a ``lax.dot_general`` of bfloat16
activations and a ``(D, H, Dh)``-style kernel, which ``qwix.QtProvider`` (through
``qwix.quantize_model``) intercepts: it quantises the activations to E4M3 (one scale per
token, per 1 x 128 tile, or a fixed scale) and the kernel per output channel, then runs
qwix's ``dot_general`` on the two.

Ours: the same block and the same rule, but each norm is ``rms_norm_fp8`` (``fp8_row``,
``fp8_group128`` or ``fp8_static``): its codes and scales, as a ``qwix.QArray``
(``interop.to_qwix``), go to the same ``dot_general`` (``interop.qwix_dot_general``) with
the kernel quantised as the rule quantises it. Nothing is quantised twice.

The codes agree except where MaxText's rounding of the norm's output to bfloat16 moves a
value across an E4M3 rounding boundary; the projections differ by the projection of that
difference, and by bfloat16 rounding.

    python -m jax_fp8norm.examples.maxtext_block
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

import jax_fp8norm as fp8norm
from jax_fp8norm import interop

E4M3 = jnp.float8_e4m3fn
# MaxText's activation quantisation, and the recipe of ours that matches it.
SCHEMES = {
    "per_token": ("fp8_row", None),
    "tile_128": ("fp8_group128", 128),
    "fixed_scale": ("fp8_static", None),
}
NORM_FED = ("query", "key", "value", "wi_0", "wi_1")  # the projections a norm feeds


class RMSNorm(nnx.Module):
    """maxtext.layers.normalizations.RMSNorm: float32 weight, bfloat16 output."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-5, rngs: nnx.Rngs):
        self.epsilon = epsilon
        self.dtype = jnp.bfloat16
        self.scale = nnx.Param(1 + 0.1 * jax.random.normal(rngs.params(), (num_features,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)
        mean2 = jnp.mean(jax.lax.square(x), axis=-1, keepdims=True)
        y = jnp.asarray(x * jax.lax.rsqrt(mean2 + self.epsilon), self.dtype)
        scale = jnp.asarray(self.scale[...], self.dtype)
        return jnp.einsum("...k,k->...k", y, scale)


class FusedRMSNorm(nnx.Module):
    """``norm``'s weight and epsilon in ``rms_norm_fp8``: the codes as a ``qwix.QArray``."""

    def __init__(self, norm: RMSNorm, recipe: str, static_scale=None):
        self.scale, self.epsilon = norm.scale, norm.epsilon
        self.keywords = {"recipe": recipe}
        if static_scale is not None:
            self.keywords["static_scale"] = static_scale

    def __call__(self, x: jax.Array) -> qwix.QArray:
        y, scales = fp8norm.rms_norm_fp8(x, self.scale[...], eps=self.epsilon, **self.keywords)
        return interop.to_qwix(y, scales)


class DenseGeneral(nnx.Module):
    """maxtext.layers.linears.DenseGeneral (no bias): ``lax.dot_general`` of the inputs and
    the ``in_features + out_features`` kernel, both in bfloat16, over ``axis``. A
    ``QArray`` input (the fused norm's codes) goes to qwix's ``dot_general`` as it is."""

    def __init__(self, in_features, out_features, *, axis=-1, tile_size=None, rngs: nnx.Rngs):
        self.in_shape = tuple(np.atleast_1d(in_features).tolist())
        self.axis = tuple(np.atleast_1d(axis).tolist())
        shape = self.in_shape + tuple(np.atleast_1d(out_features).tolist())
        scale = 1 / np.sqrt(np.prod(self.in_shape))
        self.kernel = nnx.Param(scale * jax.random.truncated_normal(rngs.params(), -2, 2, shape))
        self.tile_size = tile_size  # the rule's: the kernel's tiles match the codes'
        self.dtype = jnp.bfloat16

    def __call__(self, inputs) -> jax.Array:
        kernel = jnp.asarray(self.kernel[...], self.dtype)
        axis = tuple(a % inputs.ndim for a in self.axis)
        numbers = ((axis, tuple(range(len(axis)))), ((), ()))
        if isinstance(inputs, qwix.QArray):
            out = interop.qwix_dot_general(
                inputs, kernel, numbers, rhs_qtype=E4M3, rhs_tile_size=self.tile_size
            )
            return out.astype(self.dtype)
        return jax.lax.dot_general(jnp.asarray(inputs, self.dtype), kernel, numbers)


class NormFed(nnx.Module):
    """A norm and the projections it feeds (attributes by MaxText's names, so a qwix rule's
    ``module_path`` finds them): ``{name: projection(norm(x))}``."""

    def __init__(self, norm, **projections: DenseGeneral):
        self.norm, self.names = norm, tuple(projections)
        for name, projection in projections.items():
            setattr(self, name, projection)

    def __call__(self, x: jax.Array) -> dict:
        y = self.norm(x)
        return {name: getattr(self, name)(y) for name in self.names}


class DecoderLayer(nnx.Module):
    """MaxText's pre-norm decoder layer (llama2-style): norm, query / key / value, causal
    attention, out; residual ``h``; norm, wi_0 / wi_1 (SiLU-gated), wo; residual. Returns
    the norm-fed projections, ``h`` and the output."""

    def __init__(self, dim=256, heads=2, head_dim=128, mlp=512, *, tile_size=None, rngs):
        def dense(i, o, **keywords):
            return DenseGeneral(i, o, tile_size=tile_size, rngs=rngs, **keywords)

        self.attention_in = NormFed(
            RMSNorm(dim, rngs=rngs), **{n: dense(dim, (heads, head_dim)) for n in NORM_FED[:3]}
        )
        self.out = dense((heads, head_dim), dim, axis=(-2, -1))
        self.mlp_in = NormFed(RMSNorm(dim, rngs=rngs), wi_0=dense(dim, mlp), wi_1=dense(dim, mlp))
        self.wo = dense(mlp, dim)

    def __call__(self, x: jax.Array) -> dict:
        p = self.attention_in(x)
        scale = 1 / np.sqrt(p["key"].shape[-1])
        logits = jnp.einsum("bthd,bshd->bhts", p["query"], p["key"]) * scale
        causal = jnp.tril(jnp.ones(logits.shape[-2:], bool))
        probs = jax.nn.softmax(jnp.where(causal, logits.astype(jnp.float32), -jnp.inf), axis=-1)
        attention = jnp.einsum("bhts,bshd->bthd", probs.astype(x.dtype), p["value"])
        h = x + self.out(attention)
        m = self.mlp_in(h)
        return {**p, **m, "h": h, "output": h + self.wo(jax.nn.silu(m["wi_0"]) * m["wi_1"])}


def fused_layer(layer: DecoderLayer, recipe: str, static_scales: dict) -> DecoderLayer:
    """``layer`` with both norms ``rms_norm_fp8`` (their weights shared)."""
    fused = nnx.clone(layer)
    for part in ("attention_in", "mlp_in"):
        norm = getattr(layer, part).norm
        getattr(fused, part).norm = FusedRMSNorm(norm, recipe, static_scales.get(part))
    return fused


def maxtext_rules(tile_size, fixed_ranges: dict) -> list:
    """MaxText's qwix ``fp8`` rule (quantizations.get_quantization_rule: E4M3 weights and
    activations, one scale per output channel and per token), with the tiles of a
    subchannel rule, and for a fixed scale ``act_calibration_method="fixed,-A,A"`` on the
    projections each norm feeds (A its observed amax); the other projections per token."""

    def rule(path, method="absmax"):
        return qwix.QtRule(
            module_path=path,
            weight_qtype=E4M3,
            act_qtype=E4M3,
            tile_size=tile_size,
            act_calibration_method=method,
            op_names=("dot_general",),
        )

    paths = {"attention_in": ".*(query|key|value)", "mlp_in": ".*(wi_0|wi_1)"}
    fixed = [rule(paths[p], f"fixed,-{a!r},{a!r}") for p, a in fixed_ranges.items()]
    return [*fixed, rule(".*")]


def maxtext_activations(y: jax.Array, tile_size, fixed_range=None) -> qwix.QArray:
    """qwix's quantisation of a norm's bfloat16 output under the rule (the replay of what
    its QtProvider does inside the intercepted ``dot_general``)."""
    if fixed_range is not None:
        method = f"fixed,-{fixed_range!r},{fixed_range!r}"
        return qwix.quantize(y, E4M3, calibration_method=method)
    tiles = {y.ndim - 1: tile_size} if tile_size else None
    return qwix.quantize(y, E4M3, channelwise_axes=tuple(range(y.ndim - 1)), tiled_axes=tiles)


def maxtext_kernel(dense: DenseGeneral) -> qwix.QArray:
    """qwix's quantisation of a kernel under the rule: per output channel, the contracted
    axis in the rule's tiles."""
    kernel = jnp.asarray(dense.kernel[...], dense.dtype)
    contracted = len(dense.in_shape)
    tiles = {contracted - 1: dense.tile_size} if dense.tile_size else None
    channels = tuple(range(contracted, kernel.ndim))
    return qwix.quantize(kernel, E4M3, channelwise_axes=channels, tiled_axes=tiles)


def maxtext_fixed_scale(fixed_range: float) -> float:
    """The scale qwix's ``fixed,-A,A`` calibration gives bfloat16 activations: A / 448,
    rounded to bfloat16 (it does not read the values)."""
    q = maxtext_activations(jnp.zeros((1, 1), jnp.bfloat16), None, fixed_range)
    return float(q.scale.reshape(()))


def observed_amax(norm: RMSNorm, x: jax.Array, static_scale: float = 1.0) -> float:
    """The largest ``|n|`` of the norm's output over the batch, which the kernel returns
    beside a static scale (``return_amax=True``): what delayed scaling records for the next
    step's scale (MaxText's ``fp8`` / ``nanoo_fp8`` keep a history of it)."""
    *_, amax = fp8norm.rms_norm_fp8(
        x,
        norm.scale[...],
        eps=norm.epsilon,
        recipe="fp8_static",
        static_scale=static_scale,
        return_amax=True,
    )
    return float(jnp.max(amax))


def exact_ratios(norm: RMSNorm, x: jax.Array, scales: jax.Array) -> np.ndarray:
    """``n / scale`` in float64: what either path's codes round."""
    x = np.asarray(x, np.float64)
    n = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + norm.epsilon)
    n = n * np.asarray(norm.scale[...], np.float64)
    scales = np.asarray(scales, np.float64)
    return n / np.repeat(scales, n.shape[-1] // scales.shape[-1], axis=-1)


# How far MaxText's ratio can be from the exact one: bfloat16 roundings (each at most 2^-8
# relative) of the normalised value, the weight and their product (3), of the scale (those
# 3 through the amax, and the division by 448), and of the division by the scale (1).
BF16_ROUNDINGS = 8 * 2.0**-8


def compare_codes(ours: qwix.QArray, theirs: qwix.QArray, ratios: np.ndarray) -> dict:
    """The share of identical codes, and whether every differing code is explained by
    MaxText's bfloat16 roundings: the two codes neighbours in E4M3, and the rounding
    boundary between them within those roundings of the exact ratio."""
    a = np.asarray(ours.qvalue).view(np.uint8).astype(np.int32)
    b = np.asarray(theirs.qvalue).view(np.uint8).astype(np.int32)
    fa, fb = (np.asarray(q.qvalue, np.float64) for q in (ours, theirs))
    differ = fa != fb
    magnitude_a, magnitude_b = a & 0x7F, b & 0x7F
    same_side = ((a ^ b) & 0x80 == 0) | (magnitude_a == 0) | (magnitude_b == 0)
    neighbours = same_side & (np.abs(magnitude_a - magnitude_b) == 1)
    boundary = (fa + fb) / 2
    near = np.abs(ratios - boundary) <= BF16_ROUNDINGS * np.abs(ratios) + 2.0**-20
    return {
        "identical_codes": float(1 - differ.mean()),
        "differing_codes": int(differ.sum()),
        "differing_explained": int((differ & neighbours & near).sum()),
    }


def relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def dequantized(q: qwix.QArray) -> np.ndarray:
    """``f32(codes) * scale`` in float64 (exact), broadcast over the tiles."""
    codes, scale = np.asarray(q.qvalue, np.float64), np.asarray(q.scale, np.float64)
    for axis, (n, s) in enumerate(zip(codes.shape, scale.shape, strict=True)):
        scale = np.repeat(scale, n // s, axis=axis)
    return codes * scale


def compare_part(layer, fused, part: str, x, rules, tile_size, fixed_range) -> dict:
    """One norm and its projections, both ways, on the same input ``x``."""
    maxtext_part, our_part = getattr(layer, part), getattr(fused, part)
    provider = qwix.QtProvider(rules)
    want = qwix.quantize_model(maxtext_part, provider, x)(x)
    got = qwix.quantize_model(our_part, qwix.QtProvider(rules), x)(x)
    theirs = maxtext_activations(maxtext_part.norm(x), tile_size, fixed_range)
    ours = our_part.norm(x)
    result = compare_codes(ours, theirs, exact_ratios(maxtext_part.norm, x, ours.scale))
    ours_scale, their_scale = (np.asarray(q.scale, np.float64) for q in (ours, theirs))
    result["scale_relative_difference"] = float(np.max(np.abs(ours_scale / their_scale - 1)))
    if fixed_range is not None:  # ours took MaxText's fixed scale
        result["same_scale"] = bool(np.all(ours_scale == their_scale))
        # This step's amax, for the next step's scale, against MaxText's bfloat16 outputs'
        amax = observed_amax(maxtext_part.norm, x, float(ours_scale.reshape(-1)[0]))
        their_amax = float(jnp.max(jnp.abs(maxtext_part.norm(x).astype(jnp.float32))))
        result["observed_amax_relative_difference"] = abs(amax / their_amax - 1)
    result["activation_relative_difference"] = relative(dequantized(ours), dequantized(theirs))
    replayed, beyond = True, 0.0
    for name in maxtext_part.names:
        kernel = maxtext_kernel(getattr(maxtext_part, name))
        numbers = (((x.ndim - 1,), (0,)), ((), ()))
        replay = qwix.dot_general(theirs, kernel, numbers)
        replayed &= bool(np.array_equal(np.asarray(replay), np.asarray(want[name])))
        # The projections' difference, less the projection of the codes' difference.
        codes_difference = np.tensordot(
            dequantized(ours) - dequantized(theirs), dequantized(kernel), axes=1
        )
        difference = np.asarray(got[name], np.float64) - np.asarray(want[name], np.float64)
        beyond = max(beyond, relative(difference - codes_difference + want[name], want[name]))
        result[f"{name}_relative_difference"] = relative(got[name], want[name])
    result["replay_is_maxtext"] = replayed
    result["difference_beyond_the_codes"] = beyond
    return result


def main(scheme: str = "per_token", seed: int = 0) -> dict:
    recipe, tile_size = SCHEMES[scheme]
    layer = DecoderLayer(tile_size=tile_size, rngs=nnx.Rngs(seed))
    # bfloat16 activations whose magnitudes vary per token, a step before and this one
    k = jax.random.split(jax.random.key(seed + 1), 3)
    spread = jnp.exp(jax.random.normal(k[0], (2, 32, 1)))
    x_before, x = (
        (spread * jax.random.normal(i, (2, 32, 256))).astype(jnp.bfloat16) for i in k[1:]
    )
    fixed_ranges, static_scales = {}, {}
    if scheme == "fixed_scale":  # delayed scaling: the scale from the step before's amax
        h_before = layer(x_before)["h"]
        for part, before in (("attention_in", x_before), ("mlp_in", h_before)):
            fixed_ranges[part] = observed_amax(getattr(layer, part).norm, before)
            static_scales[part] = maxtext_fixed_scale(fixed_ranges[part])
    rules = maxtext_rules(tile_size, fixed_ranges)
    fused = fused_layer(layer, recipe, static_scales)
    want = qwix.quantize_model(layer, qwix.QtProvider(rules), x)(x)
    got = qwix.quantize_model(fused, qwix.QtProvider(rules), x)(x)
    result = {
        "scheme": scheme,
        "recipe": recipe,
        "output_relative_difference": relative(got["output"], want["output"]),
    }
    for part, inputs in (("attention_in", x), ("mlp_in", want["h"])):
        numbers = compare_part(layer, fused, part, inputs, rules, tile_size, fixed_ranges.get(part))
        result.update({f"{part}.{key}": value for key, value in numbers.items()})
    print(f"MaxText-style block, qwix {scheme} against rms_norm_fp8 {recipe}:")
    for key, value in result.items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return result


if __name__ == "__main__":
    for name in SCHEMES:
        main(name)
