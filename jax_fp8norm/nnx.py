"""``RMSNormFP8``: the fused ops as a Flax NNX module (needs ``flax``; ``pip install
jax_fp8norm[nnx]``).

The module owns the RMSNorm weight and calls :func:`jax_fp8norm.rms_norm_fp8`, or
:func:`jax_fp8norm.add_rms_norm_fp8` when given a residual. With ``dequantize=True`` it
returns ``f32(y) * scales`` through the differentiable twins instead, for training with
the straight-through gradient (:mod:`jax_fp8norm.autodiff`).
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp8norm._checks import check_global_scale, check_static_scale, validate
from jax_fp8norm._params import NORM_KEYWORDS, NormKeywords
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm.autodiff import add_rms_norm_fp8_dequantized, rms_norm_fp8_dequantized
from jax_fp8norm.ops import add_rms_norm_fp8, rms_norm_fp8


class RMSNormFP8(nnx.Module):
    """RMSNorm over the last axis with FP8 quantisation: dynamic scales per row or per
    group, or a calibrated static scale.

    Args:
      num_features: N, the size of the last axis.
      param_dtype: the weight's dtype.
      dequantize: return ``f32(y) * scales`` (differentiable) instead of ``(y, scales)``.
      rngs: accepted for the NNX convention; the weight's initialisation is not random.
      The keywords of :func:`jax_fp8norm.rms_norm_fp8` (checked at construction, except
      that group_size is checked against N here and against each input's last axis at
      the call). With ``weight_offset=1.0`` (Gemma) the weight starts at zeros, else at
      ones, so that a new module is the identity RMSNorm. A ``static_scale`` array is kept
      as given (not a parameter):
      {keywords}
    """

    def __init__(
        self,
        num_features: int,
        *,
        param_dtype=jnp.float32,
        dequantize: bool = False,
        rngs: nnx.Rngs | None = None,
        **keywords: Unpack[NormKeywords],
    ):
        del rngs
        # Checked now, so that a bad keyword fails where the module is made.
        weight = jnp.ones((num_features,), param_dtype)
        validate(jnp.zeros((1, num_features), jnp.float32), weight, **keywords)
        offset = keywords.get("weight_offset", NORM_KEYWORDS["weight_offset"][0])
        start = 0.0 if offset == 1.0 else 1.0
        self.weight = nnx.Param(jnp.full((num_features,), start, param_dtype))
        # The calibrated and global scales are data (arrays the module carries); the rest
        # are static.
        static_scale = check_static_scale(keywords.pop("static_scale", None))
        self.static_scale = nnx.data(static_scale) if static_scale is not None else None
        global_scale = check_global_scale(keywords.pop("global_scale", None))
        self.global_scale = nnx.data(global_scale) if global_scale is not None else None
        self.keywords = keywords
        self.dequantize = dequantize

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        """``x``: ``[..., N]``. Returns ``(y, scales)``, or ``(y, scales, residual_out)``
        with a residual; with ``dequantize=True``, ``f32(y) * scales`` (and
        ``residual_out``)."""
        weight = self.weight[...]
        keywords = dict(self.keywords)
        if self.static_scale is not None:
            keywords["static_scale"] = self.static_scale
        if self.global_scale is not None:
            keywords["global_scale"] = self.global_scale
        if residual is None:
            op = rms_norm_fp8_dequantized if self.dequantize else rms_norm_fp8
            return op(x, weight, **keywords)
        op = add_rms_norm_fp8_dequantized if self.dequantize else add_rms_norm_fp8
        return op(x, residual, weight, **keywords)


RMSNormFP8 = norm_keywords(RMSNormFP8)
