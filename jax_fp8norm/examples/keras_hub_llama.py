"""keras-hub's Llama (Keras 3 on the jax backend) with each decoder layer's second residual
add fused with its feed-forward RMSNorm and FP8 quantisation: one
``add_rms_norm_fp8_dequantized`` call takes the attention output, the residual and the
layer's own ``scale`` variable (a Keras variable, converted by the op) and returns the
dequantised FP8 rows the MLP reads and the new residual. A small random-weight backbone;
its hidden states are compared with the unmodified model's.

    KERAS_BACKEND=jax python -m jax_fp8norm.examples.keras_hub_llama
"""

from __future__ import annotations

import os
import types

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax.numpy as jnp
import keras
import keras_hub
import numpy as np

import jax_fp8norm as fp8norm


def fused_decoder_call(
    layer,
    decoder_sequence,
    decoder_padding_mask=None,
    decoder_attention_mask=None,
    self_attention_cache=None,
    self_attention_cache_update_index=None,
    training=None,
    *,
    recipe: str = "fp8_row",
):
    """A LlamaTransformerDecoder's forward pass, its ``attention + residual`` and
    feed-forward norm fused (the sublayers are the layer's own)."""
    mask = layer._compute_self_attention_mask(
        decoder_sequence=decoder_sequence,
        decoder_padding_mask=decoder_padding_mask,
        decoder_attention_mask=decoder_attention_mask,
        self_attention_cache=self_attention_cache,
        self_attention_cache_update_index=self_attention_cache_update_index,
    )
    attended = layer._self_attention_layer(
        hidden_states=layer._self_attention_layernorm(decoder_sequence),
        attention_mask=mask,
        cache=self_attention_cache,
        cache_update_index=self_attention_cache_update_index,
    )
    if self_attention_cache is not None:
        attended, self_attention_cache = attended
    attended = layer._self_attention_dropout(attended, training=training)
    norm = layer._feedforward_layernorm
    y, residual = fp8norm.add_rms_norm_fp8_dequantized(
        attended, decoder_sequence, norm.scale, eps=norm.epsilon, recipe=recipe
    )
    y = y.astype(layer.compute_dtype)
    gate = layer.activation(layer._feedforward_gate_dense(y).astype(jnp.float32))
    up = layer._feedforward_intermediate_dense(y)
    out = layer._feedforward_output_dense(up * gate.astype(layer.compute_dtype)) + residual
    if self_attention_cache is not None:
        return out, self_attention_cache
    return out


def fuse(backbone, recipe: str = "fp8_row") -> None:
    """Every decoder layer of ``backbone`` runs fused_decoder_call from now on."""
    for layer in backbone.transformer_layers:

        def call(self, *args, **kwargs):
            return fused_decoder_call(self, *args, recipe=recipe, **kwargs)

        layer.call = types.MethodType(call, layer)


def main(recipe: str = "fp8_row") -> float:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=256,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=128,
        intermediate_dim=256,
        layer_norm_epsilon=1e-5,
    )
    for layer in backbone.transformer_layers:  # trained-looking norm weights
        scale = layer._feedforward_layernorm.scale
        scale.assign(1 + 0.1 * np.random.default_rng(1).standard_normal(scale.shape))
    inputs = {
        "token_ids": np.random.default_rng(2).integers(0, 256, (2, 16)),
        "padding_mask": np.ones((2, 16), bool),
    }
    want = np.asarray(backbone(inputs))
    fuse(backbone, recipe)
    got = np.asarray(backbone(inputs))
    error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"keras-hub Llama, {recipe}: hidden states within {error:.2%} of the unfused model")
    return error


if __name__ == "__main__":
    main()
