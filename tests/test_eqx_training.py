"""A small equinox transformer, vmapped over the batch and over the tokens as equinox
models are, with every ``eqx.nn.RMSNorm`` swapped through ``RMSNormFP8.from_rmsnorm``
(a default one with its bias, a multi-axis one over the attention's heads, one without
weight or bias) and trained a few steps with optax.

The swapped model is held to an FP8 control (the same model with a hand-written norm:
each example flattened to one row through the dequantised twin, the bias added after)
bit for bit, at every step, parameters and losses; and to the unswapped model within
what FP8's rounding moves it, and no closer."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EXTENDED, same_bits

import jax_fp8norm as fp8norm
from jax_fp8norm.eqx import RMSNormFP8

pytestmark = EXTENDED

VOCAB, DIM, HEADS, SEQ, BATCH = 61, 64, 2, 12, 8


class Block(eqx.Module):
    norm1: eqx.Module
    attention: eqx.nn.MultiheadAttention
    head_norm: eqx.Module
    norm2: eqx.Module
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.RMSNorm(DIM)
        self.attention = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.head_norm = eqx.nn.RMSNorm((HEADS, DIM // HEADS), use_bias=False)
        self.norm2 = eqx.nn.RMSNorm(DIM, use_weight=False, use_bias=False)
        self.mlp = eqx.nn.MLP(DIM, DIM, 2 * DIM, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):  # one sequence, [SEQ, DIM]
        h = jax.vmap(self.norm1)(x)
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        a = self.attention(h, h, h, mask=mask).reshape(SEQ, HEADS, DIM // HEADS)
        x = x + jax.vmap(self.head_norm)(a).reshape(SEQ, DIM)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Model(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: list
    final_norm: eqx.Module
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.embedding = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.blocks = [Block(k) for k in keys[1:3]]
        self.final_norm = eqx.nn.RMSNorm(DIM)
        self.head = eqx.nn.Linear(DIM, VOCAB, key=keys[3])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.final_norm)(x))


class ControlNorm(eqx.Module):
    """The FP8 control: one example flattened to one row through the dequantised twin,
    the bias added in float32, rounded to x's dtype."""

    weight: jax.Array | None
    bias: jax.Array | None
    eps: float = eqx.field(static=True)
    recipe: str = eqx.field(static=True)

    def __call__(self, x):
        gamma = None if self.weight is None else self.weight.reshape(-1)
        keywords = {"eps": self.eps, "recipe": self.recipe}
        out = fp8norm.rms_norm_fp8_dequantized(x.reshape(-1), gamma, **keywords)
        out = out.astype(jnp.float32)
        if self.bias is not None:
            out = out + self.bias.reshape(-1).astype(jnp.float32)
        return out.astype(x.dtype).reshape(x.shape)


def swap(model, make):
    def is_norm(m):
        return isinstance(m, eqx.nn.RMSNorm)

    return jax.tree.map(lambda m: make(m) if is_norm(m) else m, model, is_leaf=is_norm)


def train(model, tokens, steps):
    optimizer = optax.adam(3e-3)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(model):
        logits = jax.vmap(model)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = optimizer.update(grads, state, params)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(steps):
        model, state, loss = step(model, state)
        losses.append(loss)
    return model, np.asarray(losses)


@pytest.mark.parametrize("recipe", ["fp8_row", "mxfp8"])
def test_vmapped_equinox_model_trains_as_its_control(recipe):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1)), jnp.int32)
    plain = Model(jax.random.key(0))
    swapped = swap(plain, lambda m: RMSNormFP8.from_rmsnorm(m, recipe=recipe))
    controlled = swap(plain, lambda m: ControlNorm(m.weight, m.bias, m.eps, recipe))
    assert (
        sum(
            isinstance(m, RMSNormFP8)
            for m in jax.tree.leaves(swapped, is_leaf=lambda m: isinstance(m, RMSNormFP8))
        )
        == 7
    )

    forward = eqx.filter_jit(lambda model, tokens: jax.vmap(model)(tokens))
    logits = forward(swapped, tokens[:, :-1])
    same_bits(logits, forward(controlled, tokens[:, :-1]))
    plain_logits = forward(plain, tokens[:, :-1])
    # The logits move by what FP8's roundings add up to through the model, which the noise
    # control measures: the unswapped model with every norm's weighted values moved by up
    # to FP8's bound (a uniform relative 2^-4). Rounding to the nearest code moves less
    # on average, and not nothing.
    keys = iter(jax.random.split(jax.random.key(1), 7))
    noisy = swap(plain, lambda m: NoisyNorm(m, next(keys)))
    fp8_moved = relative_rms(logits, plain_logits)
    noise_moved = relative_rms(forward(noisy, tokens[:, :-1]), plain_logits)
    assert noise_moved / 4 < fp8_moved < noise_moved

    steps = 6
    trained, losses = train(swapped, tokens, steps)
    trained_control, control_losses = train(controlled, tokens, steps)
    _, plain_losses = train(plain, tokens, steps)
    same_bits(losses, control_losses)
    arrays = [jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (trained, trained_control)]
    for got, want in zip(*arrays, strict=True):
        same_bits(got, want)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    # Training tracks the original: each step's loss near it (a few tenths of a percent
    # here), not equal.
    relative = np.abs(losses - plain_losses) / plain_losses
    assert relative.max() > 0 and relative.max() < 2.0**-6


def relative_rms(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))


class NoisyNorm(eqx.Module):
    """The noise control: equinox's norm, its weighted values (before the bias) moved by a
    uniform relative 2^-4, FP8's largest rounding step; the noise drawn per example."""

    norm: eqx.nn.RMSNorm
    key: jax.Array

    def __call__(self, x):
        out = self.norm(x)
        bias = 0 if self.norm.bias is None else self.norm.bias
        seed = jax.lax.bitcast_convert_type(x.reshape(-1)[0], jnp.uint32)
        u = jax.random.uniform(
            jax.random.fold_in(self.key, seed), x.shape, minval=-(2.0**-4), maxval=2.0**-4
        )
        return (out - bias) * (1 + u) + bias
