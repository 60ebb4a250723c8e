"""``RMSNormFP8``: the fused op as a Flax Linen module (needs ``flax``; ``pip install
jax_fp8norm[linen]``), a drop-in for ``flax.linen.RMSNorm``.

A model swaps the class it builds (a constructor argument, or the module attribute its
code reads, patched) and gets the same parameter (``scale``), the same output (an array in
the dtype ``nn.RMSNorm`` computes) and the same call (``__call__(x, *, mask=None)``), with
the normalised values rounded through the FP8 (or FP4) codes: ``f32(y) * scales`` of
:func:`jax_fp8norm.rms_norm_fp8`, through the differentiable twin
(:func:`jax_fp8norm.rms_norm_fp8_dequantized`, the straight-through gradient).
``quantized_output=True`` returns the codes and scales themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jax_fp8norm._modules import (
    QuantizedOutput,
    keywords_given,
    module_axes,
    module_keywords,
    quantized_output,
    scale_as_gamma,
)
from jax_fp8norm._params import NORM_KEYWORDS
from jax_fp8norm._shapes import product_sharding
from jax_fp8norm.autodiff import add_rms_norm_fp8_dequantized, rms_norm_fp8_dequantized
from jax_fp8norm.ops import add_rms_norm_fp8, rms_norm_fp8

__all__ = ["QuantizedOutput", "RMSNormFP8"]

# The recipe's attributes: the ops' keywords but eps, which is nn.RMSNorm's epsilon here.
RECIPE_FIELDS = tuple(name for name in NORM_KEYWORDS if name != "eps")


class RMSNormFP8(nn.Module):
    """RMSNorm quantised to FP8 (or FP4) and dequantised, with ``nn.RMSNorm``'s attributes
    and parameter.

    Attributes (``nn.RMSNorm``'s):
      epsilon: added to the mean square (the ops' ``eps``: rounded through x's dtype).
      dtype: the output's dtype; None for ``nn.RMSNorm``'s, ``result_type(x, scale)``
        (x's dtype without a scale). The norm itself reads ``x`` in its own dtype and
        reduces in float32, as ``nn.RMSNorm`` does.
      param_dtype: the ``scale`` parameter's dtype.
      use_scale: False for no parameter (the op's ``gamma=None``).
      scale_init: ``init(key, shape, param_dtype)``; None for ones, or zeros with
        ``weight_offset=1.0`` (Gemma's ``1 + scale``), so that a new module is the
        identity RMSNorm.
      reduction_axes: the normalised axes: trailing and contiguous (the op flattens them
        into one row).
      feature_axes: the axes of ``scale``; they must be among the reduction axes (the
        kernel's weight is one over the normalised values).
      axis_name, axis_index_groups: None only: the kernel normalises the rows on each
        device; a mean over a mesh axis is not one of its inputs.
      use_fast_variance: accepted and without effect, as in ``nn.RMSNorm`` (an RMSNorm has
        no mean to subtract).
      force_float32_reductions: True only: the kernel always reduces in float32.

    Attributes (the recipe): ``recipe``, ``weight_offset``, ``scale_ub``, ``out_dtype``,
    ``scale_dtype``, ``group_size``, ``power_of_two_scales``, ``static_scale``,
    ``global_scale``, as the ops' keywords of these names (:func:`jax_fp8norm.rms_norm_fp8`)
    and with their defaults; one left at its default is not given to the op, so that a
    ``recipe`` sets it. Checked when the module is made (a ValueError or TypeError naming
    the attribute); ``group_size`` against the normalised size at the call.

      quantized_output: return a :class:`QuantizedOutput` (the codes ``y`` and their
        ``scales``, then ``residual_out`` with a residual: the op's outputs) instead of
        the dequantised array: the explicit choice of the FP8 output, for a next layer
        that consumes codes. Not differentiable.
    """

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_scale: bool = True
    scale_init: Callable | None = None
    reduction_axes: Any = -1
    feature_axes: Any = -1
    axis_name: Any = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True
    recipe: str | None = None
    weight_offset: float = 0.0
    scale_ub: float | None = None
    out_dtype: Any = jnp.float8_e4m3fn
    scale_dtype: Any = jnp.float32
    group_size: int | None = None
    power_of_two_scales: bool = False
    static_scale: Any = None
    global_scale: Any = None
    quantized_output: bool = False
    # Not nn.RMSNorm's: there only to refuse eps= by name (this module's is epsilon).
    eps: Any = None

    def __post_init__(self):
        super().__post_init__()
        # Checked where the module is made, not at its first call inside a model's apply.
        self.op_keywords()

    def op_keywords(self) -> dict[str, Any]:
        """The ops' keywords of a call (after checking the attributes)."""
        for name in ("axis_name", "axis_index_groups"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported: RMSNormFP8 normalises "
                    "each row on its own device (the kernel takes no mean over a mesh axis); "
                    "under jit, shard the batch and leave the normalised axes unsharded"
                )
        if self.force_float32_reductions is not True:
            raise ValueError(
                "force_float32_reductions=False is not supported: the kernel always reduces "
                "in float32"
            )
        for name in ("use_scale", "use_fast_variance", "quantized_output"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        module_axes(self.reduction_axes, self.feature_axes, None)
        given = keywords_given({name: getattr(self, name) for name in RECIPE_FIELDS})
        if self.eps is not None:
            given["eps"] = self.eps  # refused by name: nn.RMSNorm's is epsilon
        keywords, scales = module_keywords(given, eps=self.epsilon, eps_name="epsilon")
        return keywords | {k: v for k, v in scales.items() if v is not None}

    def _gamma(self, x: jax.Array):
        """The ``scale`` parameter (shaped by ``feature_axes``, as nn.RMSNorm's) as the
        op's gamma over the normalised axes; None without one."""
        _, features = module_axes(self.reduction_axes, self.feature_axes, x.ndim)
        if not self.use_scale:
            return None
        init = self.scale_init
        if init is None:
            offset = self.weight_offset
            init = nn.initializers.zeros if offset == 1.0 else nn.initializers.ones
        shape = tuple(x.shape[a] for a in features)
        scale = self.param("scale", init, shape, self.param_dtype)
        return scale_as_gamma(scale, x.shape, self.reduction_axes, self.feature_axes)

    @nn.compact
    def __call__(self, x, *, mask=None, residual=None):
        """``x``: the input; the axes ``reduction_axes`` are normalised. ``mask`` must be
        None (the kernel's mean is over every element of a row). ``residual``: added to
        ``x`` first, in float32 (:func:`jax_fp8norm.add_rms_norm_fp8`).

        Returns the dequantised normalised values in ``dtype`` (as ``nn.RMSNorm`` returns),
        and ``residual_out`` (in x's dtype) after them with a residual; with
        ``quantized_output``, a :class:`QuantizedOutput` of the op's outputs."""
        if mask is not None:
            raise ValueError(
                "mask is not supported: the kernel takes the mean square over every element "
                "of the normalised axes"
            )
        x = jnp.asarray(x)
        if x.ndim == 0:
            raise ValueError("x must have rank >= 1, got a scalar")
        keywords = self.op_keywords()
        gamma = self._gamma(x)
        axes = {
            "reduction_axes": self.reduction_axes,
            "out_sharding": product_sharding(x, gamma, self.reduction_axes),
        }
        if self.quantized_output:
            if residual is None:
                return quantized_output(rms_norm_fp8(x, gamma, **axes, **keywords), False)
            outputs = add_rms_norm_fp8(x, residual, gamma, **axes, **keywords)
            return quantized_output(outputs, True)
        if residual is None:
            return rms_norm_fp8_dequantized(x, gamma, dtype=self.dtype, **axes, **keywords)
        return add_rms_norm_fp8_dequantized(
            x, residual, gamma, dtype=self.dtype, **axes, **keywords
        )
