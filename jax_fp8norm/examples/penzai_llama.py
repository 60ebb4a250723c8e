"""penzai's Llama-like transformer with each block's second residual add fused with its
feed-forward RMSNorm and FP8 quantisation. ``FusedResidualBlock`` is a penzai layer made
from a ``TransformerBlock``'s own parts (its attention branch, its feed-forward norm's
scale and epsilon, a 0-d array as penzai keeps it, and its MLP): one
``add_rms_norm_fp8_dequantized`` call, mapped over the named axes with ``pz.nx.nmap``,
gives the dequantised FP8 rows the MLP reads and the new residual. A small random-weight
model; its logits are compared with the unmodified model's.

    python -m jax_fp8norm.examples.penzai_llama
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer import model_parts
from penzai.models.transformer.variants import llamalike_common

import jax_fp8norm as fp8norm


@pz.pytree_dataclass
class FusedResidualBlock(pz.nn.Layer):
    """``x + attention(x)`` and the feed-forward norm in one fused call, then the MLP and
    the second residual add."""

    attention: pz.nn.Layer  # pre-attention norm and attention: the first residual's delta
    scale: Any  # the feed-forward norm's scale parameter (over "embedding"), shared
    epsilon: jax.Array  # its epsilon, a concrete 0-d array
    mlp: pz.nn.Layer
    recipe: str = dataclasses.field(default="fp8_row", metadata={"pytree_node": False})

    @classmethod
    def from_block(cls, block: model_parts.TransformerBlock, recipe: str) -> FusedResidualBlock:
        attention_residual, feedforward_residual = block.sublayers
        norm, *mlp = feedforward_residual.delta.sublayers
        standardize, rescale = norm.sublayers
        return cls(
            attention=attention_residual.delta,
            scale=rescale.weights,
            epsilon=standardize.epsilon,
            mlp=pz.nn.Sequential(mlp),
            recipe=recipe,
        )

    def __call__(self, x, **side_inputs):
        attended = self.attention(x, **side_inputs)

        def fused(attended, residual, gamma):  # one row: [embedding]
            return fp8norm.add_rms_norm_fp8_dequantized(
                attended, residual, gamma, eps=self.epsilon, recipe=self.recipe
            )

        y, residual = pz.nx.nmap(fused)(
            attended.untag("embedding"), x.untag("embedding"), self.scale.value.untag("embedding")
        )
        y, residual = y.tag("embedding"), residual.tag("embedding")
        return self.mlp(y.astype(x.dtype), **side_inputs) + residual


def fuse(model, recipe: str = "fp8_row"):
    """``model`` with every TransformerBlock replaced by its FusedResidualBlock."""
    return (
        pz.select(model)
        .at_instances_of(model_parts.TransformerBlock)
        .apply(lambda block: FusedResidualBlock.from_block(block, recipe))
    )


def main(recipe: str = "fp8_row") -> float:
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=128,
        projection_dim=32,
        mlp_hidden_dim=256,
        num_decoder_blocks=2,
        vocab_size=256,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
        rms_norm_eps=1e-5,
    )
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    # Trained-looking norm weights (penzai's parameters are mutable variables).
    for norm in pz.select(model).at_instances_of(pz.nn.RMSLayerNorm).get_sequence():
        weights = norm.sublayers[1].weights
        noise = 0.1 * jax.random.normal(jax.random.key(1), weights.value.data_array.shape)
        weights.value = weights.value + pz.nx.wrap(noise).tag(*weights.value.named_axes)
    tokens = pz.nx.wrap(jax.random.randint(jax.random.key(2), (2, 16), 0, 256)).tag("batch", "seq")
    # The model is closed over, not an argument: its epsilons stay concrete (the op
    # compiles eps into the call, and refuses a traced one).
    want = jax.jit(lambda t: model(t).data_array)(tokens)
    fused = fuse(model, recipe)
    got = jax.jit(lambda t: fused(t).data_array)(tokens)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    print(f"penzai Llama, {recipe}: logits within {error:.2%} of the unfused model")
    return error


if __name__ == "__main__":
    main()
