"""``RMSNormFP8`` and ``RMSNormDense``: the fused ops and the fused layer as Flax NNX
modules (needs ``flax``; ``pip install jax_fp8norm[nnx]``).

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
from jax_fp8norm.dense import add_rms_norm_dense, rms_norm_dense
from jax_fp8norm.ops import add_rms_norm_fp8, rms_norm_fp8
from jax_fp8norm.reference import unquantized_rms_norm_dense


class RMSNormFP8(nnx.Module):
    """RMSNorm over the last axis with FP8 quantisation: dynamic scales per row or per
    group, or a calibrated static scale; or FP4.

    A drop-in for ``flax.nnx.RMSNorm``: the same constructor arguments where they mean the
    same (``num_features``, ``epsilon``, ``dtype``, ``param_dtype``, ``use_scale``,
    ``scale_init``, ``rngs``) and the same parameter, ``scale``, so that an
    ``nnx.RMSNorm``'s state loads as it is: ``nnx.update(fp8_norm, nnx.state(norm))``, or
    :meth:`from_rmsnorm`.

    Args:
      num_features: N, the size of the last axis.
      epsilon: ``eps`` by nnx.RMSNorm's name (give one of the two).
      dtype: the dtype ``x`` (and the residual) are cast to before the norm, and that of
        a dequantised output; None keeps the input's.
      param_dtype: the ``scale`` parameter's dtype.
      use_scale: False for no parameter (gamma 1).
      scale_init: the parameter's initializer, ``init(key, (N,), param_dtype)``; by
        default ones, or zeros with ``weight_offset=1.0`` (Gemma), so that a new module is
        the identity RMSNorm.
      reduction_axes, feature_axes: -1 only (the kernels normalise the last axis).
      dequantize: return ``f32(y) * scales`` (differentiable) instead of ``(y, scales)``.
      rngs: the key of ``scale_init``.
      The keywords of :func:`jax_fp8norm.rms_norm_fp8` (checked at construction, except
      that group_size is checked against N here and against each input's last axis at
      the call). A ``static_scale`` or ``global_scale`` array is kept as given (data, not
      a parameter):
      {keywords}
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        use_scale: bool = True,
        scale_init=None,
        reduction_axes=-1,
        feature_axes=-1,
        dequantize: bool = False,
        rngs: nnx.Rngs | None = None,
        **keywords: Unpack[NormKeywords],
    ):
        for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
            if axes not in (-1, (-1,), [-1]):
                raise ValueError(f"{name} must be -1 (the last axis), got {axes!r}")
        if epsilon is not None:
            if "eps" in keywords:
                raise ValueError("give epsilon or eps, not both")
            keywords["eps"] = epsilon
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        # Checked now, so that a bad keyword fails where the module is made.
        validate(jnp.zeros((1, num_features), jnp.float32), jnp.ones((num_features,)), **keywords)
        offset = keywords.get("weight_offset", NORM_KEYWORDS["weight_offset"][0])
        identity = jnp.full((num_features,), 0.0 if offset == 1.0 else 1.0, param_dtype)
        if not use_scale:
            self.scale = None
            self.gamma = nnx.data(identity)
        elif scale_init is None:
            self.scale = nnx.Param(identity)
        else:
            key = rngs.params() if rngs is not None else jax.random.key(0)
            self.scale = nnx.Param(jnp.asarray(scale_init(key, (num_features,), param_dtype)))
        # The calibrated and global scales are data (arrays the module carries); the rest
        # are static.
        static_scale = check_static_scale(keywords.pop("static_scale", None))
        self.static_scale = nnx.data(static_scale) if static_scale is not None else None
        global_scale = check_global_scale(keywords.pop("global_scale", None))
        self.global_scale = nnx.data(global_scale) if global_scale is not None else None
        self.keywords = keywords
        self.dequantize = dequantize

    @classmethod
    def from_rmsnorm(cls, norm: nnx.RMSNorm, **keywords) -> RMSNormFP8:
        """The module of ``norm`` (an ``nnx.RMSNorm`` over the last axis), with its
        epsilon, dtypes and scale, quantising as ``keywords`` say. One that reduces over a
        mesh axis (``axis_name``) is refused: the kernels normalise each row on its own."""
        if getattr(norm, "axis_name", None) is not None:
            raise ValueError(
                f"the nnx.RMSNorm reduces over the mesh axis {norm.axis_name!r}; RMSNormFP8 "
                "normalises each row on its own device"
            )
        module = cls(
            norm.num_features,
            epsilon=norm.epsilon,
            dtype=norm.dtype,
            param_dtype=norm.param_dtype,
            use_scale=norm.use_scale,
            reduction_axes=norm.reduction_axes,
            feature_axes=norm.feature_axes,
            **keywords,
        )
        if norm.use_scale:
            module.scale[...] = norm.scale[...]
        return module

    def call_keywords(self) -> dict:
        """The ops' keywords of a call: the static ones and the module's scale arrays."""
        keywords = dict(self.keywords)
        if self.static_scale is not None:
            keywords["static_scale"] = self.static_scale
        if self.global_scale is not None:
            keywords["global_scale"] = self.global_scale
        return keywords

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        """``x``: ``[..., N]`` (the second argument is a residual, not nnx.RMSNorm's mask,
        which it has none of). Returns ``(y, scales)``, or ``(y, scales, residual_out)``
        with a residual; with ``dequantize=True``, ``f32(y) * scales`` (in ``dtype`` if
        set; and ``residual_out``)."""
        gamma = self.gamma if self.scale is None else self.scale[...]
        if self.dtype is not None:
            x = jnp.asarray(x).astype(self.dtype)
            residual = None if residual is None else jnp.asarray(residual).astype(self.dtype)
        keywords = self.call_keywords()
        if residual is None:
            op = rms_norm_fp8_dequantized if self.dequantize else rms_norm_fp8
            out = op(x, gamma, **keywords)
        else:
            op = add_rms_norm_fp8_dequantized if self.dequantize else add_rms_norm_fp8
            out = op(x, residual, gamma, **keywords)
        if self.dequantize and self.dtype is not None:
            if residual is None:
                return out.astype(self.dtype)
            return out[0].astype(self.dtype), out[1]
        return out


RMSNormFP8 = norm_keywords(RMSNormFP8)


class RMSNormDense(nnx.Module):
    """RMSNorm over the last axis, then a linear layer without bias, trained in FP8 / FP4:
    :func:`jax_fp8norm.rms_norm_dense` (or :func:`jax_fp8norm.add_rms_norm_dense` when
    given a residual) under the recipe of its keywords, with float master weights.

    Args:
      in_features: K, the normalised axis.
      out_features: F.
      epsilon: ``eps`` by nnx.RMSNorm's name (give one of the two).
      param_dtype: the master weights' dtype (float32 by default).
      kernel_init: ``init(key, (K, F), param_dtype)``; LeCun normal by default, as
        ``nnx.Linear``.
      fused: False runs the same layer unquantised, for comparison:
        :func:`jax_fp8norm.reference.unquantized_rms_norm_dense` (the RMSNorm in float32, the
        matmul in the input's dtype), differentiated by jax.
      rngs: the key of ``kernel_init`` (required, as for ``nnx.Linear``).
      The keywords of :func:`jax_fp8norm.rms_norm_fp8` (the recipe's; a ``static_scale`` or
      ``global_scale`` array is kept as given, data rather than a parameter):
      {keywords}

    Parameters: ``norm.scale`` ([K], the norm's weight, ones; ``norm`` is an
    :class:`RMSNormFP8`) and ``kernel`` ([K, F]).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        epsilon: float | None = None,
        param_dtype=jnp.float32,
        kernel_init=None,
        fused: bool = True,
        rngs: nnx.Rngs,
        **keywords: Unpack[NormKeywords],
    ):
        self.norm = RMSNormFP8(in_features, epsilon=epsilon, param_dtype=param_dtype, **keywords)
        init = kernel_init or nnx.initializers.lecun_normal()
        kernel = init(rngs.params(), (in_features, out_features), param_dtype)
        self.kernel = nnx.Param(jnp.asarray(kernel))
        self.fused = fused

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        """``x``: ``[..., K]``. Returns ``[..., F]`` in x's dtype, and with a residual
        ``(out, residual_out)``."""
        gamma, w = self.norm.scale[...], self.kernel[...]
        keywords = self.norm.call_keywords()
        if self.fused:
            if residual is None:
                return rms_norm_dense(x, gamma, w, **keywords)
            return add_rms_norm_dense(x, residual, gamma, w, **keywords)
        eps = keywords.get("eps", NORM_KEYWORDS["eps"][0])
        offset = keywords.get("weight_offset", NORM_KEYWORDS["weight_offset"][0])
        return unquantized_rms_norm_dense(x, gamma, w, residual, eps=eps, weight_offset=offset)


RMSNormDense = norm_keywords(RMSNormDense)
