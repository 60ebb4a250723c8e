"""``RMSNormFP8``: the fused op as an equinox module (needs ``equinox``; ``pip install
jax_fp8norm[eqx]``), a drop-in for ``equinox.nn.RMSNorm``.

The same constructor (``shape, eps, use_weight, use_bias, dtype``), fields (``weight``,
``bias``) and call (one example of shape ``shape``, vmapped by the caller; ``state`` and
``key`` as equinox's), with the normalised values rounded through the FP8 (or FP4) codes:
``f32(y) * scales`` of :func:`jax_fp8norm.rms_norm_fp8` through the differentiable twin
(:func:`jax_fp8norm.rms_norm_fp8_dequantized`, the straight-through gradient), the bias
added after it in float32 and the sum rounded to x's dtype, as equinox computes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._modules import QuantizedOutput, module_keywords, quantized_output
from jax_fp8norm._params import NormKeywords
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm.autodiff import rms_norm_fp8_dequantized
from jax_fp8norm.ops import rms_norm_fp8

__all__ = ["QuantizedOutput", "RMSNormFP8"]

# ``state`` not given (equinox's own sentinel is private).
_NO_STATE = object()


def _shape(shape: Any) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, numbers.Integral) else shape
    if not isinstance(dims, (Sequence, numbers.Integral)) or isinstance(dims, str):
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    dims = tuple(int(d) for d in dims)
    if not dims or any(d <= 0 for d in dims):
        raise ValueError(
            f"shape must be one or more positive sizes (the normalised axes), got {shape!r}"
        )
    return dims


class RMSNormFP8(eqx.Module):
    """RMSNorm over the whole of one example (the axes of ``shape``), quantised to FP8 (or
    FP4) and dequantised, with ``equinox.nn.RMSNorm``'s constructor and fields.

    Args:
      shape: the shape of one example; every axis is normalised (the op flattens them
        into one row of ``prod(shape)`` values).
      eps: added to the mean square (rounded through x's dtype, as the ops do).
      use_weight: False for no weight (the op's ``gamma=None``).
      use_bias: add the learned ``bias`` after the dequantised values (in float32, then
        rounded to x's dtype, as equinox does).
      dtype: the weight's and bias's dtype; None for jax's default float.
      quantized_output: return a :class:`QuantizedOutput` (the codes ``y`` and their
        ``scales``) instead of the dequantised array, for a next layer that consumes
        codes; not differentiable, and not with a bias (which is added after dequantising).
      The keywords of :func:`jax_fp8norm.rms_norm_fp8` but ``eps`` (``epsilon=`` is
      refused, naming eps), checked here (a ``static_scale`` or ``global_scale`` is kept
      as a static Python float, its float32 value: a calibrated constant, not a leaf, so
      that ``eqx.filter(model, eqx.is_inexact_array)`` and the optimiser leave it alone;
      a new value makes a new module):
      {keywords}
    """

    shape: tuple[int, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    use_weight: bool = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    quantized_output: bool = eqx.field(static=True)
    keywords: tuple[tuple[str, Any], ...] = eqx.field(static=True)
    # Calibrated constants, not parameters: static Python floats (the float32 values), so
    # that eqx.filter(model, eqx.is_inexact_array) leaves them out of an optimiser's
    # parameters (adamw's weight decay would shrink an array leaf every step).
    static_scale: float | None = eqx.field(static=True)
    global_scale: float | str | None = eqx.field(static=True)
    weight: jax.Array | None
    bias: jax.Array | None

    def __init__(
        self,
        shape: int | Sequence[int],
        eps: float = 1e-5,
        use_weight: bool = True,
        use_bias: bool = True,
        dtype=None,
        *,
        quantized_output: bool = False,
        **keywords: Unpack[NormKeywords],
    ):
        shape = _shape(shape)
        for name, value in (
            ("use_weight", use_weight),
            ("use_bias", use_bias),
            ("quantized_output", quantized_output),
        ):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if quantized_output and use_bias:
            raise ValueError(
                "quantized_output=True needs use_bias=False: the bias is added to the "
                "dequantised values, which the codes are not"
            )
        # Checked now, so that a bad keyword fails where the module is made.
        keywords, scales = module_keywords(keywords, eps=eps, eps_name="eps", n=math.prod(shape))
        for name, value in scales.items():
            if isinstance(value, jax.core.Tracer):
                raise TypeError(
                    f"{name} must be concrete (a float, or an array outside jax.jit): the "
                    "module keeps it as a static float, out of the optimiser's parameters"
                )
        dtype = jax.dtypes.canonicalize_dtype(jnp.float64) if dtype is None else dtype
        self.shape = shape
        self.eps = float(eps)
        self.use_weight = bool(use_weight)
        self.use_bias = bool(use_bias)
        self.quantized_output = bool(quantized_output)
        self.weight = jnp.ones(shape, dtype) if use_weight else None
        self.bias = jnp.zeros(shape, dtype) if use_bias else None
        for name, value in scales.items():
            # A scale as a float; global_scale="per_row" as its string.
            kept = value if value is None or isinstance(value, str) else float(value[0])
            setattr(self, name, kept)
        keywords.pop("eps")
        self.keywords = tuple(sorted(keywords.items()))

    @classmethod
    def from_rmsnorm(cls, norm: eqx.nn.RMSNorm, **keywords: Unpack[NormKeywords]) -> RMSNormFP8:
        """The module of ``norm`` (an ``equinox.nn.RMSNorm``): its shape, eps, weight and
        bias (the arrays themselves), quantising as ``keywords`` say."""
        weight, bias = norm.weight, norm.bias
        dtype = next((a.dtype for a in (weight, bias) if a is not None), None)
        module = cls(norm.shape, norm.eps, norm.use_weight, norm.use_bias, dtype, **keywords)
        if weight is not None:
            module = eqx.tree_at(lambda m: m.weight, module, weight)
        if bias is not None:
            module = eqx.tree_at(lambda m: m.bias, module, bias)
        return module

    def op_keywords(self) -> dict[str, Any]:
        """The ops' keywords of a call: the static ones, eps, the normalised axes and the
        module's calibrated scales."""
        keywords = dict(self.keywords, eps=self.eps)
        keywords["reduction_axes"] = tuple(range(-len(self.shape), 0))
        for name in ("static_scale", "global_scale"):
            if getattr(self, name) is not None:
                keywords[name] = getattr(self, name)
        return keywords

    def __call__(self, x: jax.Array, state: Any = _NO_STATE, *, key: Any = None):
        """``x``: one example, of shape ``shape`` (``jax.vmap`` the module over a batch).
        ``state`` and ``key`` are ignored, as equinox's are.

        Returns the dequantised normalised values (plus the bias) in x's dtype, or with
        ``quantized_output`` a :class:`QuantizedOutput`; and ``state`` after it when given.
        """
        del key
        x = jnp.asarray(x)
        if tuple(x.shape) != self.shape:
            raise ValueError(
                f"RMSNormFP8(shape)(x) needs x.shape == shape: got shape={self.shape} and "
                f"x.shape={tuple(x.shape)}; the module normalises one example, so call it "
                "as jax.vmap(norm)(x) on a batch"
            )
        keywords = self.op_keywords()
        if self.quantized_output:
            out = quantized_output(rms_norm_fp8(x, self.weight, **keywords), False)
        elif self.use_bias:
            out = rms_norm_fp8_dequantized(x, self.weight, dtype=jnp.float32, **keywords)
            out = (out + self.bias.astype(jnp.float32)).astype(x.dtype)
        else:
            out = rms_norm_fp8_dequantized(x, self.weight, dtype=x.dtype, **keywords)
        return out if state is _NO_STATE else (out, state)


# The recipe keywords: the ops' but eps, which is equinox's argument here.
RMSNormFP8 = norm_keywords(RMSNormFP8, exclude=("eps",))
