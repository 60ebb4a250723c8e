"""A Flax NNX pre-norm decoder block (causal attention, then a SiLU MLP) with its norms
swapped for ``RMSNormFP8``, two ways:

- as a drop-in: every ``nnx.RMSNorm`` of the model replaced in place by
  ``RMSNormFP8.from_rmsnorm`` (its scale Variable as it is), nothing else changed: each
  returns the array ``nnx.RMSNorm`` returns, with the values of the FP8 codes;
- fused: the MLP's norm also takes the residual add (``residual=``), returning the
  dequantised FP8 rows and the new residual in one kernel call.

Both trained through the straight-through gradient.

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


def swap_rmsnorms(model: nnx.Module, **keywords) -> nnx.Module:
    """Every ``nnx.RMSNorm`` in ``model`` replaced, in place, by the ``RMSNormFP8`` made
    from it with ``keywords`` (the recipe). Its state keeps its paths: a checkpoint of the
    model loads as it is."""
    norms = [(path, node) for path, node in nnx.iter_graph(model) if type(node) is nnx.RMSNorm]
    for path, norm in norms:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        fp8_norm = RMSNormFP8.from_rmsnorm(norm, **keywords)
        if isinstance(path[-1], int):
            parent[path[-1]] = fp8_norm
        else:
            setattr(parent, path[-1], fp8_norm)
    return model


class FusedDecoderBlock(nnx.Module):
    """``block`` with ``h = x + attention`` and the MLP's norm in one fused call: the MLP
    reads ``f32(y) * scales``, the FP8 rows an FP8 matmul would take."""

    def __init__(self, block: DecoderBlock, **keywords):
        self.block = swap_rmsnorms(block, **keywords)

    def __call__(self, x: jax.Array) -> jax.Array:
        y, h = self.block.mlp_norm(self.block.attend(x), residual=x)
        return h + self.block.mlp(y)


def relative_error(got: jax.Array, want: jax.Array) -> float:
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def main(recipe: str = "fp8_row") -> dict:
    block = DecoderBlock(128, 4, 256, rngs=nnx.Rngs(0))
    # Trained-looking norms: their scales away from ones.
    for i, norm in enumerate((block.attention_norm, block.mlp_norm)):
        norm.scale[...] = 1 + 0.1 * jax.random.normal(jax.random.key(1 + i), (128,))
    # Each swap works on a copy: the original block stays, for comparison.
    swapped = swap_rmsnorms(nnx.clone(block), recipe=recipe)
    fused = FusedDecoderBlock(nnx.clone(block), recipe=recipe)
    x = jax.random.normal(jax.random.key(3), (2, 16, 128), jnp.float32)
    forward = nnx.jit(lambda m, x: m(x))
    want = forward(block, x)

    def loss(module):
        return jnp.mean(module(x) ** 2)

    grads = nnx.grad(loss)(fused)
    got_fused, got_swapped = forward(fused, x), forward(swapped, x)
    result = {
        "relative_error": relative_error(got_fused, want),
        "drop_in_relative_error": relative_error(got_swapped, want),
        # The residual add inside the kernel is the add before it: h in float32 either way.
        "fused_equals_drop_in": bool(jnp.array_equal(got_fused, got_swapped)),
        "scale_gradient_norm": float(jnp.linalg.norm(grads.block.mlp_norm.scale[...])),
    }
    print(
        f"NNX decoder block, {recipe}: every norm swapped, output within "
        f"{result['drop_in_relative_error']:.2%} of the unquantised block; the MLP's norm "
        f"fused with the residual add, the same bits: {result['fused_equals_drop_in']}; its "
        f"scale gets a gradient of norm {result['scale_gradient_norm']:.3g}"
    )
    return result


if __name__ == "__main__":
    main()
