"""A tiny Gemma-3 in Flax Linen with every norm swapped for jax_fp8norm.linen.RMSNormFP8
by patching the one class its model code reads (``_layers.RMSNorm``), the parameters
loaded as they are: 13 norms over 2 layers, the rank-4 QK-norms and the zero-initialised
``(1 + scale)`` weights (``weight_offset=1.0``) included.

Google's ``gemma`` library (3.x on Python 3.11; 4.x needs 3.12) pulls in kauldron, grain,
orbax and sentencepiece, so the model is written here instead, line for line after
gemma/gm/nn/_layers.py and _modules.py (3.3.0): its Embedder, Attention (GQA, QK-norm,
RoPE, the sliding window on local layers), gated-GELU FeedForward and Block with the
pre/post attention and feed-forward norms, and the final norm before the tied decoder.

Each swapped model is held to an FP8 control (the same model with a hand-written norm:
the op's codes dequantised) bit for bit, each of its norms to the exact Gemma norm of the
same input within FP8's rounding and no closer, and the logits to the unswapped model's
within what that rounding moves them."""

from __future__ import annotations

import functools
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXTENDED, random_rows, same_bits

import jax_fp8norm as fp8norm
from jax_fp8norm.linen import RMSNormFP8

pytestmark = EXTENDED

K_MASK = -2.3819763e38  # gemma's


class Einsum(nn.Module):
    shape: tuple[int, ...]
    weight_name: str = "w"

    @nn.compact
    def __call__(self, eqn, x):
        w = self.param(self.weight_name, nn.initializers.normal(), self.shape)
        return jnp.einsum(eqn, x, w)


class GemmaRMSNorm(nn.Module):
    """gemma's _layers.RMSNorm."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1]))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed_inputs = x * jax.lax.rsqrt(var + 1e-06)
        scale = jnp.expand_dims(scale, axis=range(len(x.shape) - 1))
        return normed_inputs * (1 + scale)


# The module the model code reads its layers from, as gemma's reads gemma.gm.nn._layers.
_layers = types.SimpleNamespace(RMSNorm=GemmaRMSNorm, Einsum=Einsum)


def apply_rope(inputs, positions, *, base_frequency, scale_factor=1.0):
    head_dim = inputs.shape[-1]
    freq_exponents = (2.0 / head_dim) * jnp.arange(0, head_dim // 2, dtype=jnp.float32)
    timescale = base_frequency**freq_exponents
    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :] / scale_factor
    sin, cos = jnp.sin(sinusoid_inp), jnp.cos(sinusoid_inp)
    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return jnp.concatenate([first_part, second_part], axis=-1).astype(inputs.dtype)


class Attention(nn.Module):
    num_heads: int
    num_kv_heads: int
    features: int
    head_dim: int
    local: bool
    rope_base_frequency: int
    rope_scale_factor: float
    sliding_window_size: int

    def setup(self):
        self.attn_vec_einsum = _layers.Einsum(shape=(self.num_heads, self.head_dim, self.features))
        self.q_einsum = _layers.Einsum(shape=(self.num_heads, self.features, self.head_dim))
        self.kv_einsum = _layers.Einsum(shape=(2, self.num_kv_heads, self.features, self.head_dim))
        self._query_norm = _layers.RMSNorm()
        self._key_norm = _layers.RMSNorm()

    def __call__(self, x, segment_pos, attn_mask):
        query_proj = self.q_einsum("BTD,NDH->BTNH", x)
        key_proj, value_proj = self.kv_einsum("BSD,CKDH->CBSKH", x)
        query_proj = self._query_norm(query_proj)
        key_proj = self._key_norm(key_proj)
        rope = {"base_frequency": self.rope_base_frequency, "scale_factor": self.rope_scale_factor}
        query_proj = apply_rope(query_proj, segment_pos, **rope)
        query_scaled = query_proj * self.head_dim**-0.5
        key_proj = apply_rope(key_proj, segment_pos, **rope)
        b, t, kg, h = query_scaled.shape
        query_scaled = query_scaled.reshape((b, t, self.num_kv_heads, kg // self.num_kv_heads, h))
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
        logits = logits.reshape((b, t, kg, -1))
        if self.local:
            cache_positions = segment_pos[..., None, :]
            positions = segment_pos[..., :, None]
            sliding_mask = cache_positions > positions - self.sliding_window_size
            sliding_mask *= cache_positions < positions + self.sliding_window_size
            attn_mask *= sliding_mask
        padded_logits = jnp.where((jnp.expand_dims(attn_mask, -2)), logits, K_MASK)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
        probs = probs.reshape((b, t, self.num_kv_heads, kg // self.num_kv_heads, -1))
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj).reshape((b, t, kg, h))
        return self.attn_vec_einsum("BTNH,NHD->BTD", encoded)


class FeedForward(nn.Module):
    features: int
    hidden_dim: int

    @nn.compact
    def __call__(self, x):
        gating = _layers.Einsum(
            shape=(2, self.features, self.hidden_dim), weight_name="gating_einsum"
        )
        nn.share_scope(self, gating)
        gate = gating("...F,NFH->...NH", x)
        activations = nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
        linear = _layers.Einsum(shape=(self.hidden_dim, self.features), weight_name="linear")
        nn.share_scope(self, linear)
        return linear("...H,HF->...F", activations)


class Block(nn.Module):
    config: dict
    local: bool

    def setup(self):
        c = self.config
        self.pre_attention_norm = _layers.RMSNorm()
        self.attn = Attention(
            num_heads=c["num_heads"],
            num_kv_heads=c["num_kv_heads"],
            features=c["embed_dim"],
            head_dim=c["head_dim"],
            local=self.local,
            # Gemma 3: local layers 10k, global ones 1M with a scale factor of 8.
            rope_base_frequency=10_000 if self.local else 1_000_000,
            rope_scale_factor=1.0 if self.local else 8.0,
            sliding_window_size=c["sliding_window_size"],
        )
        self.post_attention_norm = _layers.RMSNorm()
        self.pre_ffw_norm = _layers.RMSNorm()
        self.mlp = FeedForward(features=c["embed_dim"], hidden_dim=c["hidden_dim"])
        self.post_ffw_norm = _layers.RMSNorm()

    def __call__(self, x, segment_pos, attn_mask):
        inputs_normalized = self.pre_attention_norm(x)
        attn_output = self.attn(inputs_normalized, segment_pos, attn_mask)
        attn_output = self.post_attention_norm(attn_output)
        attn_output += x
        outputs = self.pre_ffw_norm(attn_output)
        outputs = self.mlp(outputs)
        outputs = self.post_ffw_norm(outputs)
        outputs += attn_output
        return outputs


CONFIG = {
    "vocab_size": 97,
    "embed_dim": 128,
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 64,
    "hidden_dim": 256,
    "sliding_window_size": 4,
}


class Gemma3(nn.Module):
    """Two layers, local then global (Gemma 3's pattern), the final norm, tied decoder."""

    config: dict

    def setup(self):
        c = self.config
        self.input_embedding = self.param(
            "input_embedding", nn.initializers.normal(), (c["vocab_size"], c["embed_dim"])
        )
        self.blocks = [Block(config=c, local=local) for local in (True, False)]
        self.final_norm = _layers.RMSNorm()

    def __call__(self, tokens):
        x = self.input_embedding[(tokens,)]
        x *= jnp.sqrt(self.config["embed_dim"]).astype(x.dtype)
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        attn_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        for block in self.blocks:
            x = block(x, positions, attn_mask)
        return jnp.dot(self.final_norm(x), self.input_embedding.T)


class ControlNorm(nn.Module):
    """The FP8 control: Gemma's parameter, the op's codes dequantised, cast as Gemma's
    norm promotes (x with the float32 scale)."""

    keywords: dict

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        y, scales = fp8norm.rms_norm_fp8(x, scale, weight_offset=1.0, **self.keywords)
        return fp8norm.dequantize(y, scales).astype(jnp.result_type(x, scale))


def trained_looking(variables):
    """Gemma's zero-initialised scales moved off zero, as a trained model's are."""
    leaves, tree = jax.tree.flatten_with_path(variables)
    moved = [
        leaf + jnp.asarray(random_rows(i, leaf.shape, np.float32, spread=0.3), leaf.dtype)
        if "scale" in jax.tree_util.keystr(path)
        else leaf
        for i, (path, leaf) in enumerate(leaves)
    ]
    return jax.tree.unflatten(tree, moved)


def recorded_norm_calls(model, variables, tokens):
    """Every RMSNormFP8 call of one apply: (x, output, scale)."""
    calls = []

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, RMSNormFP8) and context.method_name == "__call__":
            calls.append((args[0], out, context.module.variables["params"]["scale"]))
        return out

    with nn.intercept_methods(record):
        model.apply(variables, tokens)
    return calls


@pytest.mark.parametrize("recipe", ["fp8_row", "mxfp8"])
def test_gemma3_with_every_norm_swapped(recipe, monkeypatch):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 16)), jnp.int32)
    model = Gemma3(config=CONFIG)
    variables = trained_looking(model.init(jax.random.key(0), tokens))
    plain = jax.jit(model.apply)(variables, tokens)

    monkeypatch.setattr(
        _layers, "RMSNorm", functools.partial(ControlNorm, keywords={"recipe": recipe})
    )
    want = jax.jit(model.apply)(variables, tokens)
    # The user's whole change: the class the model code reads.
    monkeypatch.setattr(
        _layers, "RMSNorm", functools.partial(RMSNormFP8, weight_offset=1.0, recipe=recipe)
    )
    swapped_variables = model.init(jax.random.key(0), tokens)
    assert jax.tree.structure(swapped_variables) == jax.tree.structure(variables)
    got = jax.jit(model.apply)(variables, tokens)
    same_bits(got, want)
    assert np.isfinite(np.asarray(got)).all()

    calls = recorded_norm_calls(model, variables, tokens)
    assert len(calls) == 13 and sum(x.ndim == 4 for x, _, _ in calls) == 4
    for x, out, scale in calls:
        x64, out64 = np.asarray(x, np.float64), np.asarray(out, np.float64)
        r = 1 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6)
        exact = x64 * r * (1 + np.asarray(scale, np.float64))
        error = np.abs(out64 - exact)
        # E4M3 rounds to 3 fraction bits: at most 2^-4 relative, plus half a subnormal
        # step (2^-10) of the block's scale, at most 2 * amax / 448 (mxfp8's power of two
        # rounded up), and the float32 arithmetic around it.
        amax = np.max(np.abs(exact), axis=-1, keepdims=True)
        assert (error <= 2.0**-4 * np.abs(exact) + 2.0**-9 * amax / 448 + 1e-5 * amax).all()
        # ... and no closer than FP8: most values move, by a few percent on average.
        relative = error[np.abs(exact) > amax / 8] / np.abs(exact)[np.abs(exact) > amax / 8]
        assert np.mean(relative > 2.0**-12) > 0.8 and 2.0**-9 < np.mean(relative) < 2.0**-5

    # The logits move by what those roundings add up to through the model, which the
    # noise control measures: the unswapped model with every norm's output moved by up
    # to FP8's bound (a uniform relative 2^-4). Rounding to the nearest code moves
    # less on average, and not nothing.
    monkeypatch.setattr(_layers, "RMSNorm", NoisyNorm)
    noisy = jax.jit(model.apply)(variables, tokens, rngs={"noise": jax.random.key(1)})
    fp8_moved, noise_moved = (relative_rms(out, plain) for out in (got, noisy))
    assert noise_moved / 4 < fp8_moved < noise_moved


def relative_rms(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))


class NoisyNorm(GemmaRMSNorm):
    """The noise control: Gemma's norm, its output moved by a uniform relative 2^-4,
    FP8's largest rounding step."""

    def __call__(self, x):
        out = super().__call__(x)
        bound = 2.0**-4
        u = jax.random.uniform(self.make_rng("noise"), out.shape, minval=-bound, maxval=bound)
        return out * (1 + u)
