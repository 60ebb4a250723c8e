"""A Flax NNX pre-norm decoder block (causal attention, then a SiLU MLP), and the same block
with the MLP's norm fused with the residual add and quantised to FP8: ``RMSNormFP8`` made
from the block's own ``nnx.RMSNorm`` (its state as it is) returns the dequantised FP8 rows
and the new residual in one kernel call. Trained through the straight-through gradient.

    python -m jax_fp8norm.examples.nnx_decoder_block
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp8norm.nnx import RMSNormFP8


class DecoderBlock(nnx.Module):
    """x + attention(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, dim: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(dim, epsilon=1e-5, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, dim, decode=False, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(dim, epsilon=1e-5, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def attend(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:-1]))
        return self.attention(self.attention_norm(x), mask=mask)

    def mlp(self, y: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.up(y)))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + self.attend(x)
        return h + self.mlp(self.mlp_norm(h))


class FusedDecoderBlock(nnx.Module):
    """``block`` with ``h = x + attention`` and the MLP's norm in one fused call: the MLP
    reads ``f32(y) * scales``, the FP8 rows a FP8 matmul would take."""

    def __init__(self, block: DecoderBlock, **keywords):
        self.block = block
        self.mlp_norm = RMSNormFP8.from_rmsnorm(block.mlp_norm, dequantize=True, **keywords)

    def __call__(self, x: jax.Array) -> jax.Array:
        y, h = self.mlp_norm(self.block.attend(x), x)
        return h + self.block.mlp(y)


def relative_error(got: jax.Array, want: jax.Array) -> float:
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def main(recipe: str = "fp8_row") -> dict:
    block = DecoderBlock(128, 4, 256, rngs=nnx.Rngs(0))
    # A trained-looking MLP norm: its scale away from ones.
    block.mlp_norm.scale[...] = 1 + 0.1 * jax.random.normal(jax.random.key(1), (128,))
    fused = FusedDecoderBlock(block, recipe=recipe)
    x = jax.random.normal(jax.random.key(2), (2, 16, 128), jnp.float32)
    want = nnx.jit(lambda m, x: m(x))(block, x)
    got = nnx.jit(lambda m, x: m(x))(fused, x)

    def loss(module):
        return jnp.mean(module(x) ** 2)

    grads = nnx.grad(loss)(fused)
    scale_grad = grads.mlp_norm.scale[...]
    result = {
        "relative_error": relative_error(got, want),
        "scale_gradient_norm": float(jnp.linalg.norm(scale_grad)),
    }
    print(
        f"NNX decoder block, {recipe}: output within {result['relative_error']:.2%} of the "
        f"unquantised block; the fused norm's scale gets a gradient of norm "
        f"{result['scale_gradient_norm']:.3g}"
    )
    return result


if __name__ == "__main__":
    main()
