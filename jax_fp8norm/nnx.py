"""``RMSNormFP8`` and ``RMSNormDense``: the fused ops and the fused layer as Flax NNX
modules (needs ``flax``; ``pip install jax_fp8norm[nnx]``).

``RMSNormFP8`` is a drop-in for ``flax.nnx.RMSNorm``: it takes the same constructor
arguments, keeps the same ``scale`` parameter (its metadata and sharding included) and,
called as ``norm(x)``, returns what ``nnx.RMSNorm`` returns, an array of the dtype nnx gives
(through the module's ``promote_dtype``), with the values of the FP8 (or FP4) codes: the
differentiable twins' ``f32(y) * scales`` (straight-through gradient,
:mod:`jax_fp8norm.autodiff`). ``quantized_output=True`` returns the codes and scales
themselves (:class:`QuantizedOutput`), for a layer that takes them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Unpack

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jax_fp8norm._modules import (
    REMOVED_DEQUANTIZE,
    QuantizedOutput,
    module_axes,
    module_keywords,
    quantized_output,
    scale_as_gamma,
)
from jax_fp8norm._params import NORM_KEYWORDS, NormKeywords
from jax_fp8norm._shapes import check_axes, product_sharding
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm._unfused import unquantized_rms_norm_dense
from jax_fp8norm.autodiff import add_rms_norm_fp8_dequantized, rms_norm_fp8_dequantized
from jax_fp8norm.dense import UNQUANTIZED, add_rms_norm_dense, rms_norm_dense
from jax_fp8norm.ops import add_rms_norm_fp8, rms_norm_fp8

__all__ = ["QuantizedOutput", "RMSNormDense", "RMSNormFP8"]


class RMSNormFP8(nnx.Module):
    """RMSNorm with FP8 quantisation (dynamic scales per row or per group, or a calibrated
    static scale) or FP4; a drop-in for ``flax.nnx.RMSNorm``.

    Called as ``norm(x)`` it returns what ``nnx.RMSNorm`` returns: an array of ``x``'s shape
    in the dtype nnx gives (``dtype`` if set, else that of ``x`` and ``scale`` after the
    module's ``promote_dtype``), with the values of the quantised codes, ``f32(y) *
    scales`` rounded once to that dtype, and the straight-through gradient. An
    ``nnx.RMSNorm``'s state loads as it is (``nnx.update(fp8_norm, nnx.state(norm))``), or
    :meth:`from_rmsnorm` makes the module of a norm, keeping its ``scale`` Variable.

    Args (``nnx.RMSNorm``'s, in its order):
      num_features: the size of the scale (x's last axis).
      epsilon: added to the mean square (nnx's default, 1e-6): the ops' ``eps``, by nnx's
        name (``eps=`` is refused, naming epsilon).
      dtype: the result's dtype, and that ``x`` and ``scale`` are promoted to; None: inferred
        from them, as nnx does.
      param_dtype: the ``scale`` parameter's dtype.
      use_scale: False for no parameter (weight 1: ``gamma=None`` to the ops).
      scale_init: ``init(key, (num_features,), param_dtype)``; by default ones, or zeros
        with ``weight_offset=1.0`` (Gemma), so that a new module is the identity RMSNorm.
      reduction_axes: the normalised axes: trailing and contiguous, ending at the last
        (``-1``, ``(-2, -1)``, or ``2`` for a rank-3 ``x``), normalised as one row of their
        product; other axes are refused (the kernels read a row's elements contiguously).
      feature_axes: the scale's axes, among the reduction axes (the kernels multiply every
        row by one weight over its values): ``(num_features,)`` laid along them and
        broadcast over the other normalised axes, as nnx reshapes it.
      axis_name, axis_index_groups: must be None. nnx.RMSNorm averages the mean square
        over a mapped axis with them (``lax.pmean``, a row split over devices); the kernels
        normalise a whole row on one device. Under ``jax.jit`` a row sharded over a mesh
        axis needs neither: it is gathered.
      use_fast_variance: accepted for nnx's signature, without effect, as in nnx.RMSNorm
        itself: it only changes how a mean is subtracted, and an RMSNorm subtracts none.
      promote_dtype: ``promote_dtype((x, scale), dtype=dtype)`` -> ``(x, scale)``, nnx's by
        default.
      rngs: the key of ``scale_init`` (one ``rngs.params()`` is drawn with a scale, as nnx
        draws it, so that the layers made after take the keys they would).
      scale_metadata: the ``scale`` Param's metadata (``out_sharding``, ...), as nnx's.
      quantized_output: return the codes and scales (:class:`QuantizedOutput`, the op's
        outputs) instead of the dequantised array; not differentiable.
      The keywords of :func:`jax_fp8norm.rms_norm_fp8` (checked at construction, except
      that group_size is checked against N here and against each input at the call). A
      ``static_scale`` or ``global_scale`` array is kept as given (data, not a parameter):
      {keywords}
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype=None,
        param_dtype=jnp.float32,
        use_scale: bool = True,
        scale_init=None,
        reduction_axes=-1,
        feature_axes=-1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype=nnx_dtypes.promote_dtype,
        rngs: nnx.Rngs | None = None,
        scale_metadata=MappingProxyType({}),
        quantized_output: bool = False,
        **keywords: Unpack[NormKeywords],
    ):
        for name, value in (("axis_name", axis_name), ("axis_index_groups", axis_index_groups)):
            if value is not None:
                raise ValueError(
                    f"{name}={value!r}: RMSNormFP8 normalises each row whole on one device; "
                    "nnx.RMSNorm's cross-device mean over a mapped axis (lax.pmean inside "
                    "pmap or shard_map) is not what the kernels compute. Under jax.jit a "
                    "row sharded over a mesh axis needs no axis_name: it is gathered"
                )
        # Checked now as far as x's rank is not needed (negative axes).
        axes = module_axes(reduction_axes, feature_axes, None)
        if not isinstance(quantized_output, bool):
            raise TypeError(f"quantized_output must be a bool, got {quantized_output!r}")
        # Over several axes a row's length is known at the call, which checks the group.
        single = axes is not None and len(axes[0]) == 1
        keywords, scales = module_keywords(
            keywords, eps=epsilon, eps_name="epsilon", n=num_features if single else None
        )
        offset = keywords.get("weight_offset", NORM_KEYWORDS["weight_offset"][0])
        self.scale: nnx.Param | None
        if use_scale:
            key = rngs.params() if rngs is not None else jax.random.key(0)
            if scale_init is None:
                value = jnp.full((num_features,), 0.0 if offset == 1.0 else 1.0, param_dtype)
            else:
                value = jnp.asarray(scale_init(key, (num_features,), param_dtype))
            self.scale = nnx.Param(value, **scale_metadata)
        else:
            self.scale = nnx.data(None)
        # The calibrated and global scales are data (arrays the module carries, not
        # parameters: nnx.Optimizer(wrt=nnx.Param) leaves them); the rest are static.
        for name, value in scales.items():
            setattr(self, name, nnx.data(value) if value is not None else None)
        self.keywords = keywords
        # nnx.RMSNorm's attributes, so that code reading them reads the same.
        self.num_features = num_features
        self.epsilon = keywords["eps"]
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = None
        self.axis_index_groups = None
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype
        self.quantized_output = quantized_output

    @classmethod
    def from_rmsnorm(cls, norm: nnx.RMSNorm, **keywords) -> RMSNormFP8:
        """The module of ``norm``: its constructor arguments, and its ``scale`` Variable
        itself (value, metadata, sharding), shared with ``norm`` (``nnx.clone(norm)``
        first for a module of its own); quantising as ``keywords`` say (the recipe
        keywords, ``quantized_output``)."""
        if "dequantize" in keywords:
            raise TypeError(REMOVED_DEQUANTIZE)
        module = cls(
            norm.num_features,
            epsilon=norm.epsilon,
            dtype=norm.dtype,
            param_dtype=norm.param_dtype,
            use_scale=False,  # norm's own Variable follows
            reduction_axes=norm.reduction_axes,
            feature_axes=norm.feature_axes,
            axis_name=norm.axis_name,
            axis_index_groups=norm.axis_index_groups,
            use_fast_variance=norm.use_fast_variance,
            promote_dtype=norm.promote_dtype,
            **keywords,
        )
        if norm.use_scale:
            module.scale = norm.scale
            module.use_scale = True
        return module

    def call_keywords(self) -> dict:
        """The ops' keywords of a call: the static ones and the module's scale arrays."""
        keywords = dict(self.keywords)
        if self.static_scale is not None:
            keywords["static_scale"] = self.static_scale
        if self.global_scale is not None:
            keywords["global_scale"] = self.global_scale
        return keywords

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, *, residual=None):
        """``x``: ``[..., N]``. Returns the normalised ``x`` as nnx.RMSNorm does (the
        dequantised codes); with ``residual=``, ``h = x + residual`` is normalised in the
        same kernel and ``(out, residual_out)`` returned: ``out`` as without a residual,
        ``residual_out`` h in x's dtype (x and residual, of one dtype, are not promoted:
        the residual stream keeps its dtype). With ``quantized_output=True``: a
        :class:`QuantizedOutput`.

        ``mask`` (nnx.RMSNorm's second argument) must be None: nnx takes the mean square
        over the masked elements only and normalises every element by it, which the
        kernels, taking the whole row's, cannot reproduce exactly."""
        if mask is not None:
            raise ValueError(
                "mask: RMSNormFP8 takes no mask. nnx.RMSNorm's mask restricts the mean "
                "square to the masked elements; the kernels take it over the whole row, so "
                "the result could not be nnx's. Pass mask=None (a residual goes by its "
                "keyword, residual=)"
            )
        x = jnp.asarray(x)
        scale = self.scale[...] if self.scale is not None else None
        promoted, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        # nnx.RMSNorm's result dtype: that of its promoted operands, or dtype.
        dtype = nnx_dtypes.canonicalize_dtype(promoted, scale, dtype=self.dtype)
        # With a residual the rows keep their dtype: the residual stream's, which
        # residual_out carries on (nnx.RMSNorm has no residual to promote).
        x = promoted if residual is None else x
        # The scale along feature_axes, broadcast over the other normalised axes, as nnx
        # reshapes it; on Explicit mesh axes the op gathers a sharded one and places the
        # output as nnx's x * scale is placed.
        gamma = scale_as_gamma(scale, x.shape, self.reduction_axes, self.feature_axes)
        keywords = self.call_keywords()
        keywords["reduction_axes"] = self.reduction_axes
        keywords["out_sharding"] = product_sharding(x, gamma, self.reduction_axes)
        if self.quantized_output:
            if residual is None:
                return quantized_output(rms_norm_fp8(x, gamma, **keywords), residual=False)
            out = add_rms_norm_fp8(x, residual, gamma, **keywords)
            return quantized_output(out, residual=True)
        if residual is None:
            return rms_norm_fp8_dequantized(x, gamma, dtype=dtype, **keywords)
        return add_rms_norm_fp8_dequantized(x, residual, gamma, dtype=dtype, **keywords)


RMSNormFP8 = norm_keywords(RMSNormFP8, exclude=("eps",))


class RMSNormDense(nnx.Module):
    """RMSNorm over the last axis, then a linear layer without bias, trained in FP8 / FP4:
    :func:`jax_fp8norm.rms_norm_dense` (or :func:`jax_fp8norm.add_rms_norm_dense` when
    given a residual) under the recipe of its keywords, with float master weights.

    Args:
      in_features: K, the normalised axis.
      out_features: F, an int or a tuple of output axes (an einsum weight ``(K, 2, H)``).
      epsilon: the ops' ``eps``, by nnx.RMSNorm's name (``eps=`` is refused).
      param_dtype: the master weights' dtype (float32 by default).
      kernel_init: ``init(key, (K, *F), param_dtype)``; LeCun normal by default, as
        ``nnx.Linear``.
      fused: False runs the same layer unquantised, for comparison:
        :func:`jax_fp8norm.reference.unquantized_rms_norm_dense` (the RMSNorm in float32, the
        matmul in the input's dtype), differentiated by jax; so does ``recipe="bfloat16"``.
      stochastic_rounding, hadamard, weight_tiles: the layer's parts of FP4 training
        (:func:`jax_fp8norm.rms_norm_dense`; None: the recipe's defaults).
      rng_collection: the stream of ``rngs`` that gives the stochastic rounding a fresh key
        on every call (as ``nnx.Dropout``'s ``"dropout"``); a key passed to the call wins.
      rngs: the key of ``kernel_init`` (required, as for ``nnx.Linear``) and the stream
        ``rng_collection`` (forked: the module keeps its own; without that stream or a
        default one, an FP4 module's calls to be differentiated take ``key=``).
      The keywords of :func:`jax_fp8norm.rms_norm_fp8` (the recipe's; a ``static_scale`` or
      ``global_scale`` array is kept as given, data rather than a parameter):
      {keywords}

    Parameters: ``norm.scale`` ([K], the norm's weight, ones; ``norm`` is an
    :class:`RMSNormFP8`) and ``kernel`` ([K, *F]).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | tuple[int, ...],
        *,
        epsilon: float = 1e-6,
        param_dtype=jnp.float32,
        kernel_init=None,
        fused: bool = True,
        stochastic_rounding: bool | None = None,
        hadamard: bool | int | None = None,
        weight_tiles: bool | None = None,
        rng_collection: str = "rounding",
        rngs: nnx.Rngs,
        **keywords: Unpack[NormKeywords],
    ):
        features = check_axes(out_features, "out_features")
        if keywords.get("recipe") == UNQUANTIZED:  # the unquantised layer
            keywords.pop("recipe")
            fused = False
        if not features or any(f < 1 for f in features):
            raise ValueError(f"out_features must be positive sizes, got {out_features!r}")
        self.norm = RMSNormFP8(in_features, epsilon=epsilon, param_dtype=param_dtype, **keywords)
        init = kernel_init or nnx.initializers.lecun_normal()
        kernel = init(rngs.params(), (in_features, *features), param_dtype)
        self.kernel = nnx.Param(jnp.asarray(kernel))
        self.out_features = out_features
        self.fused = fused
        self.parts = {
            "stochastic_rounding": stochastic_rounding,
            "hadamard": hadamard,
            "weight_tiles": weight_tiles,
        }
        try:
            self.rounding = rngs[rng_collection].fork()
        except KeyError:  # no such stream (and no default): the calls give their key=
            self.rounding = nnx.data(None)

    def __call__(self, x: jax.Array, residual: jax.Array | None = None, *, key=None):
        """``x``: ``[..., K]``; ``key``: the stochastic rounding's (default: the next of the
        module's ``rng_collection`` stream). Returns ``[..., *F]`` in x's dtype, and with a
        residual ``(out, residual_out)``."""
        gamma, w = self.norm.scale[...], self.kernel[...]
        keywords = self.norm.call_keywords()
        if self.fused:
            if key is None and self.rounding is not None:
                key = self.rounding()
            parts = dict(self.parts, key=key)
            if residual is None:
                return rms_norm_dense(x, gamma, w, **keywords, **parts)
            return add_rms_norm_dense(x, residual, gamma, w, **keywords, **parts)
        eps = keywords.get("eps", NORM_KEYWORDS["eps"][0])
        offset = keywords.get("weight_offset", NORM_KEYWORDS["weight_offset"][0])
        return unquantized_rms_norm_dense(x, gamma, w, residual, eps=eps, weight_offset=offset)


RMSNormDense = norm_keywords(RMSNormDense, exclude=("eps",))
