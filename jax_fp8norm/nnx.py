"""``RMSNormFP8``: the fused ops as a Flax NNX module (needs ``flax``; ``pip install
jax_fp8norm[nnx]``).

The module owns the RMSNorm weight and calls :func:`jax_fp8norm.rms_norm_fp8`, or
:func:`jax_fp8norm.add_rms_norm_fp8` when given a residual. With ``dequantize=True`` it
returns ``f32(y) * scales`` through the differentiable twins instead, for training with
the straight-through gradient (:mod:`jax_fp8norm.autodiff`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp8norm.autodiff import add_rms_norm_fp8_dequantized, rms_norm_fp8_dequantized
from jax_fp8norm.ops import add_rms_norm_fp8, rms_norm_fp8
from jax_fp8norm.reference import DEFAULT_EPS


class RMSNormFP8(nnx.Module):
    """RMSNorm over the last axis with dynamic per-row FP8 quantisation.

    Args:
      num_features: N, the size of the last axis.
      eps, weight_offset, scale_ub, out_dtype, scale_dtype: as for
        :func:`jax_fp8norm.rms_norm_fp8`. With ``weight_offset=1.0`` (Gemma) the weight
        starts at zeros, else at ones, so that a new module is the identity RMSNorm.
      param_dtype: the weight's dtype.
      dequantize: return ``f32(y) * scales`` (differentiable) instead of ``(y, scales)``.
      rngs: accepted for the NNX convention; the weight's initialisation is not random.
    """

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = DEFAULT_EPS,
        weight_offset: float = 0.0,
        scale_ub: float | None = None,
        out_dtype=jnp.float8_e4m3fn,
        scale_dtype=jnp.float32,
        param_dtype=jnp.float32,
        dequantize: bool = False,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs
        start = 0.0 if weight_offset == 1.0 else 1.0
        self.weight = nnx.Param(jnp.full((num_features,), start, param_dtype))
        self.keywords = {
            "eps": eps,
            "weight_offset": weight_offset,
            "scale_ub": scale_ub,
            "out_dtype": out_dtype,
            "scale_dtype": scale_dtype,
        }
        self.dequantize = dequantize

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        """``x``: ``[..., N]``. Returns ``(y, scales)``, or ``(y, scales, residual_out)``
        with a residual; with ``dequantize=True``, ``f32(y) * scales`` (and
        ``residual_out``)."""
        weight = self.weight[...]
        if residual is None:
            op = rms_norm_fp8_dequantized if self.dequantize else rms_norm_fp8
            return op(x, weight, **self.keywords)
        op = add_rms_norm_fp8_dequantized if self.dequantize else add_rms_norm_fp8
        return op(x, residual, weight, **self.keywords)
