"""The fused norm and the linear layer after it, differentiable: what a training step
calls (docs/spec.md, "The layer: rms_norm_dense").

    out = fp8norm.rms_norm_dense(x, gamma, w, recipe="mxfp8")
    out, residual_out = fp8norm.add_rms_norm_dense(x, residual, gamma, w, recipe="nvfp4")

The layer is the norm's custom_vjp (jax_fp8norm._vjp) with a GEMM as its head. Forward:
the fused norm's training form (the codes of ``n`` for the forward GEMM, the columnwise
codes kept for the weight gradient, each row's ``r``), the weight quantised along K from
its float master copy by the recipe's weight format (``Recipe.weight``), and
:func:`jax_fp8norm.matmul.fp8_matmul`. Backward: the output gradient quantised twice by
the recipe's gradient format (``Recipe.gradient``; blocked along the output features for
dgrad, along the rows for wgrad), the weight quantised again along its output features,
the dgrad and wgrad GEMMs, then the fused norm backward to ``dx`` and ``dgamma`` (and
``dresidual``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._allreduce import xla_sum
from jax_fp8norm._checks import PER_ROW, check_axis_name, check_columnwise, check_reduce_dtype
from jax_fp8norm._dtypes import E4M3, FLOAT_DTYPES, FP4
from jax_fp8norm._fp4_parts import DGRAD_STREAM, WGRAD_STREAM, key_words, stream_key
from jax_fp8norm._params import (
    NormKeywords,
    NormOutputs,
    NormParams,
    as_operand,
    global_scale_operand,
)
from jax_fp8norm._shapes import shaped_call
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm._unfused import unquantized_rms_norm_dense
from jax_fp8norm._vjp import differentiable_norm, summed_over_devices
from jax_fp8norm.matmul import fp8_matmul
from jax_fp8norm.quantize import (
    quantize_columns,
    quantize_gradient_columns,
    quantize_gradient_rows,
    quantize_weight_tiles,
    tile_scales,
)
from jax_fp8norm.recipes import apply_recipe, recipe_of

__all__ = ["add_rms_norm_dense", "allreduce_add_rms_norm_dense", "rms_norm_dense"]


@dataclasses.dataclass(frozen=True)
class TrainingParts:
    """The parts of FP4 training one layer call uses (docs/spec.md, "FP4 training"):
    stochastic rounding of the output gradient, the Hadamard transform of the wgrad
    GEMM's operands (its sign mask; None for none) and the weight's 2-D tiles. The FP8
    recipes use none."""

    stochastic_rounding: bool = False
    hadamard: int | None = None
    weight_tiles: bool = False


def training_parts(recipe, stochastic_rounding, hadamard, weight_tiles) -> TrainingParts:
    """The parts of a call of ``recipe`` from its keywords: None is the recipe's default
    (every part on for FP4, none for FP8); True where the recipe has no such part, or a
    value that is not a bool (or a sign mask for ``hadamard``), is a ValueError."""
    given = {
        "stochastic_rounding": stochastic_rounding,
        "hadamard": hadamard,
        "weight_tiles": weight_tiles,
    }
    # NumPy's booleans as Python's: the identity tests below would take np.False_ for a
    # part switched on and np.True_ for the sign mask 1.
    given = {k: bool(v) if isinstance(v, np.bool_) else v for k, v in given.items()}
    stochastic_rounding, hadamard, weight_tiles = given.values()
    for name, value in given.items():
        ok = value is None or isinstance(value, (bool, np.bool_))
        if name == "hadamard" and isinstance(value, numbers.Integral):
            ok = True
        if not ok:
            accepted = "None, True or False" + (" or a sign mask" if name == "hadamard" else "")
            raise ValueError(f"{name} must be {accepted}, got {value!r}")
    if not recipe.fp4:
        for name, value in given.items():
            if value is not None and value is not False:
                raise ValueError(
                    f"{name} is a part of the FP4 recipes' training (nvfp4, mxfp4); "
                    f"{recipe.name} rounds to nearest: drop {name}"
                )
        return TrainingParts()
    mask = recipe.hadamard_signs
    if hadamard is False:
        mask = None
    elif hadamard is not None and hadamard is not True:
        mask = int(hadamard)
        if not 0 <= mask < 2**recipe.block:
            raise ValueError(
                f"hadamard must be True, False or a sign mask of {recipe.block} bits (the "
                f"recipe's block), got {hadamard!r}"
            )
    return TrainingParts(
        stochastic_rounding=stochastic_rounding is not False,
        hadamard=mask,
        weight_tiles=weight_tiles is not False,
    )


@dataclasses.dataclass(frozen=True)
class _Gemm:
    """The head of the layer: the GEMM of the norm's codes with the weight ``w``, quantised
    on every call by the recipe's weight format (along K, or in 2-D tiles that the dgrad
    GEMM reads too). Its backward quantises the output gradient twice by the recipe's
    gradient format (blocked along the output features for dgrad, along the rows for
    wgrad; stochastically rounded with the call's key, the wgrad copy Hadamard-transformed
    as the norm's columnwise codes are), and ``w`` along its output features unless its
    tiles serve both GEMMs."""

    params: NormParams
    result_dtype: np.dtype
    parts: TrainingParts = TrainingParts()
    keyed: bool = False  # whether the call has a key, the operand after w

    @property
    def num_operands(self) -> int:
        return 2 if self.keyed else 1

    @property
    def columnwise(self) -> bool:
        """Whether the wgrad GEMM takes the norm's columnwise codes (blocks along the
        rows); a recipe without that form folds its row scales into the gradient."""
        return recipe_of(self.params).columnwise

    @property
    def hadamard(self) -> int | None:
        """The sign mask of the norm's columnwise codes' transform (None: none)."""
        return self.parts.hadamard

    def _weight(self, w: jax.Array):
        """``(codes [K, F], scales along K, global scale, residuals)``: the weight as the
        forward GEMM takes it, and what the dgrad GEMM reads of it (its 2-D tiles)."""
        fmt = recipe_of(self.params).weight
        if not self.parts.weight_tiles:
            return (*quantize_columns(w, fmt), ())
        codes, tiles, gs = quantize_weight_tiles(w, fmt)
        scales = tile_scales(tiles, fmt.block, w.shape[1], transposed=False)
        return codes, scales, gs, (codes, tiles, gs)

    def apply(self, outs: NormOutputs, operands: tuple, static: tuple) -> tuple:
        w = operands[0]
        w_codes, w_scales, w_global, residuals = self._weight(w)
        per_row = self.params.per_row_global_scale
        out = fp8_matmul(
            outs.y,
            outs.scales,
            w_codes,
            w_scales,
            out_dtype=jnp.float32 if per_row else self.result_dtype,
            a_global_scale=1.0 if per_row else global_scale_operand(self.params, static),
            w_global_scale=w_global,
        )
        if per_row:  # each row's global scale multiplies its row of the float32 product
            out = (out * outs.global_scales).astype(self.result_dtype)
        return out, residuals

    def check_training(self, x_shape: tuple, operands: tuple) -> None:
        """What the backward needs beyond the forward, checked when the layer is
        differentiated: the rows come padded to the columnwise blocks (jax_fp8norm._vjp),
        the output features must be whole blocks of dgrad's, and stochastic rounding
        needs the caller's key."""
        recipe = recipe_of(self.params)
        check_columnwise(recipe.columnwise, self.params, x_shape)
        w = operands[0]
        block = recipe.gradient.block
        if block is not None and w.shape[1] % block:
            raise ValueError(
                f"w's output features (prod(w.shape[1:]) = {w.shape[1]}) must be a multiple of "
                f"the recipe's block ({block}): the gradient's dgrad GEMM is blocked along them"
            )
        if self.parts.stochastic_rounding and not self.keyed:
            raise ValueError(
                f"key is required to differentiate the {recipe.name} layer with "
                "stochastic_rounding (an FP4 recipe's default): pass key=, a JAX PRNG key, a "
                'fresh one each step (docs/training.md, "The key"), or '
                "stochastic_rounding=False"
            )

    def kept(self, outs: NormOutputs) -> tuple:
        """The columnwise codes (and each column's global scale), or the rowwise ones whose
        scales go into the gradient."""
        if not self.columnwise:
            return (outs.y, outs.scales)
        if self.params.per_row_global_scale:
            return (outs.y_t, outs.scales_t, outs.global_scales_t)
        return (outs.y_t, outs.scales_t)

    def _columnwise_global_scale(self, static: tuple):
        """The global scale the norm's columnwise codes were quantised under: the call's
        (1.0 for none), times ``d`` with the transform (jax_fp8norm.reference.
        quantize_columns), None for a format without one."""
        gs = global_scale_operand(self.params, static)
        if gs is None or self.hadamard is None:
            return gs
        return jnp.asarray(gs, jnp.float32) * jnp.float32(recipe_of(self.params).block)

    def _stream(self, operands: tuple, stream: int):
        """The key folded with ``stream`` where the gradient is rounded stochastically."""
        if not self.parts.stochastic_rounding:
            return None
        return stream_key(operands[1], stream)

    def backward(self, g, operands: tuple, static: tuple, kept: tuple, residuals: tuple) -> tuple:
        """``(dn [rows, K], (dw [K, F], ...))`` from the cotangent ``g [..., F]``, dn float32
        and dw summed over the devices that share ``w``, in ``w``'s dtype."""
        w = operands[0]
        recipe = recipe_of(self.params)
        k, f = w.shape
        no_key = (np.zeros((2,), jax.dtypes.float0),) if self.keyed else ()
        g = g.reshape(-1, f).astype(jnp.float32)
        if g.shape[0] == 0:  # no rows: nothing to quantise, nothing summed
            return jnp.zeros((0, k), jnp.float32), (jnp.zeros((k, f), w.dtype), *no_key)
        g_codes, g_scales, g_row_scales = quantize_gradient_rows(
            g, recipe.gradient, self._stream(operands, DGRAD_STREAM)
        )
        if residuals:  # the forward's tiles, transposed
            codes, tiles, wt_global = residuals
            wt_codes = codes.T
            wt_scales = tile_scales(tiles, recipe.weight.block, f, transposed=True)
        else:
            wt_codes, wt_scales, wt_global = quantize_columns(w.T, recipe.weight)
        dn = fp8_matmul(
            g_codes,
            g_scales,
            wt_codes,
            wt_scales,
            out_dtype=jnp.float32,
            a_global_scale=None if wt_global is None else 1.0,
            w_global_scale=wt_global,
        )
        if g_row_scales is not None:
            dn = dn * g_row_scales
        codes, scales, *column_global = kept
        if self.columnwise:  # y_t [K, rows] and scales_t
            gw = g
        else:  # the rows' codes; their scales go into the gradient
            gw = g * scales.reshape(-1, 1).astype(jnp.float32)
            codes, scales = codes.reshape(-1, k).T, jnp.ones((k, 1), jnp.float32)
        gw_codes, gw_scales, gw_global = quantize_gradient_columns(
            gw, recipe.gradient, self._stream(operands, WGRAD_STREAM), self.hadamard
        )
        dw = fp8_matmul(
            codes,
            scales,
            gw_codes,
            gw_scales,
            out_dtype=jnp.float32,
            a_global_scale=1.0 if column_global else self._columnwise_global_scale(static),
            w_global_scale=gw_global,
        )
        if column_global:  # each column of n's global scale multiplies its row of dw
            dw = dw * column_global[0]
        if self.hadamard is not None:  # (M X)^T (M G) = d X^T G; 1 / d is exact
            dw = dw * jnp.float32(1.0 / recipe.gradient.block)
        return dn, (summed_over_devices(w, dw).astype(w.dtype), *no_key)


def _flat_weight(w) -> tuple[jax.Array, tuple[int, ...]]:
    """``w [K, *F]`` as the GEMMs take it, ``[K, prod(F)]``, and ``F``. A reshape outside the
    custom_vjp: jax's transpose of it gives ``dw`` in ``w``'s shape, and every GEMM and
    quantisation sees the same operands as a call with the flattened weight."""
    w = as_operand(w)
    features = tuple(w.shape[1:])
    return jnp.reshape(w, (w.shape[0], math.prod(features))), features


def _check_layer(x, w, params: NormParams, result_dtype, unquantized: bool = False) -> np.dtype:
    """Checks ``w`` against ``x`` and the recipe; returns the result's dtype."""
    w_dtype = np.dtype(w.dtype) if hasattr(w, "dtype") else np.asarray(w).dtype
    if w_dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"w must be float32, bfloat16 or float16 (the master weights), got {w_dtype}"
        )
    if np.ndim(w) < 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"w must have shape (x.shape[-1], *F) = ({x.shape[-1]}, *F), at least one output "
            f"axis; got {tuple(np.shape(w))}"
        )
    recipe = recipe_of(params)
    if not unquantized and recipe.fp4 and recipe.block != recipe.base.block:
        raise ValueError(
            f"the layer's {recipe.base.name.upper()} GEMMs take blocks of {recipe.base.block} "
            f"(the format's); got group_size={params.group_size}"
        )
    dtype = np.dtype(x.dtype if result_dtype is None else result_dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"result_dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


# The layer's unquantised recipe: the norm in float32, the GEMMs in the input's dtype.
UNQUANTIZED = "bfloat16"
# The keywords an unquantised call takes of the norm's: the rest quantise.
_UNQUANTIZED_KEYWORDS = ("eps", "weight_offset")


def _unquantized(rows: tuple, gamma, w, keywords: dict, result_dtype):
    """The layer of ``recipe="bfloat16"``: :func:`jax_fp8norm.reference.
    unquantized_rms_norm_dense` (differentiated by jax) with the norm's gamma and shape
    rules; a quantising keyword is a ValueError."""
    keywords = {k: v for k, v in keywords.items() if k != "recipe"}
    for name in keywords:
        if name not in _UNQUANTIZED_KEYWORDS:
            raise ValueError(
                f"recipe={UNQUANTIZED!r} quantises nothing, which contradicts the explicit "
                f"{name}: drop one of the two"
            )
    shaped = shaped_call(rows, gamma, keywords)
    params = shaped.call.params
    dtype = _check_layer(rows[0], w, params, result_dtype, unquantized=True)
    x, *residual = shaped.rows
    w, features = _flat_weight(w)
    value = unquantized_rms_norm_dense(
        x,
        shaped.gamma,
        w,
        residual[0] if residual else None,
        eps=params.eps,
        weight_offset=params.weight_offset,
    )
    out, residual_out = value if residual else (value, None)
    out = out.astype(dtype).reshape(rows[0].shape[:-1] + features)
    return out if residual_out is None else (out, residual_out)


def _layer_keywords(keywords: dict) -> dict:
    """The norm's keywords of a layer call: NVFP4's activations take each row's own global
    scale (``global_scale="per_row"``) unless the caller gives one, so that a row's codes
    depend on that row alone at the format's full range."""
    layout = apply_recipe(keywords)
    fp4 = layout.get("out_dtype") is not None and np.dtype(layout["out_dtype"]) == FP4
    nvfp4 = fp4 and np.dtype(layout.get("scale_dtype", np.float32)) == E4M3
    if nvfp4 and layout.get("global_scale") is None:
        return {**keywords, "global_scale": PER_ROW}
    return keywords


def _head(params: NormParams, dtype, key, parts: dict) -> tuple[_Gemm, tuple]:
    """The layer's GEMM head for a call, and its key operand (none without a key)."""
    resolved = training_parts(recipe_of(params), **parts)
    words = () if key is None else (key_words(key),)
    return _Gemm(params, dtype, resolved, bool(words)), words


def _layer(rows: tuple, gamma, w, keywords: dict, result_dtype, parts: tuple, summed=None):
    """The layer's call of every form: ``rows`` x (and the residual), ``summed`` the
    all-reduce's sum in place of x; ``parts`` the key and the parts' keywords. Returns
    ``out`` (and ``residual_out``)."""
    if keywords.get("recipe") == UNQUANTIZED:
        if summed is not None:
            rows = (summed.astype(rows[0].dtype), *rows[1:])
        return _unquantized(rows, gamma, w, keywords, result_dtype)
    key, *switches = parts
    x = rows[0]
    shaped = shaped_call(rows, gamma, _layer_keywords(keywords))
    params = shaped.call.params
    dtype = _check_layer(x, w, params, result_dtype)
    operands = shaped.operands()
    if summed is not None:
        operands = (summed, *operands[1:])
    w, features = _flat_weight(w)
    names = ("stochastic_rounding", "hadamard", "weight_tiles")
    head, key_operand = _head(params, dtype, key, dict(zip(names, switches, strict=True)))
    add = len(rows) == 2
    layer = differentiable_norm(params, add, head)
    n = len(rows) + 1  # the rows and gamma
    value = layer(*operands[:n], w, *key_operand, *operands[n:])
    out, residual_out = value if add else (value, None)
    out = out.reshape(x.shape[:-1] + features)
    return (out, residual_out) if add else out


@norm_keywords
def rms_norm_dense(
    x: jax.Array,
    gamma: jax.Array | None,
    w: jax.Array,
    *,
    result_dtype=None,
    key=None,
    stochastic_rounding: bool | None = None,
    hadamard: bool | int | None = None,
    weight_tiles: bool | None = None,
    **keywords: Unpack[NormKeywords],
) -> jax.Array:
    """``einsum("...k,kf->...f", RMSNorm(x) * gamma, w)`` through the fused norm and an
    FP8 / FP4 GEMM,
    differentiable in ``x``, ``gamma`` and ``w`` (module docstring; docs/spec.md, "The
    layer").

    Args:
      x: ``[..., K]`` float32, float16 or bfloat16 activations, any number of rows. With
        block scales, a differentiated call whose rows, ``prod(x.shape[:-1])``, are not a
        multiple of the block (the weight gradient's GEMM is blocked along them) runs the
        norm and the GEMMs on the rows padded with zero rows to the next multiple, and
        returns the caller's rows (docs/training.md, "Rows padded to the blocks"). To
        differentiate with block scales, ``prod(F)`` must be a multiple of the block (the
        dgrad GEMM is blocked along it); a call that is not differentiated takes any.
      gamma: the norm's weight: ``[K]``, a shape that broadcasts to it (``(1, K)``: its
        gradient in its shape, as :func:`jax_fp8norm.rms_norm_fp8` takes it), or None
        for no weight (exactly 1, whatever ``weight_offset``).
      w: ``[K, *F]`` float master weights (one or more output axes, as an einsum weight
        ``(D, 2, H)``), quantised on every call: along K for the forward GEMM, along the
        flattened ``F`` for the gradient's; the call is the ``[K, prod(F)]`` call reshaped,
        bit for bit, and ``dw`` has ``w``'s shape.
      result_dtype: the output's dtype; None: ``x.dtype``.
      key: a JAX PRNG key (a fresh one each step), the stochastic rounding's; required
        to differentiate with ``stochastic_rounding`` on (docs/training.md, "FP4
        training: the key and the parts").
      stochastic_rounding, hadamard, weight_tiles: FP4 training's parts (the output
        gradient rounded stochastically; the wgrad GEMM's operands Hadamard-transformed,
        ``hadamard`` True for the recipe's signs or an int sign mask; the weight in 2-D
        tiles both GEMMs read). None: on for nvfp4 and mxfp4, off for FP8 (where True is
        a ValueError); False: off.
      {keywords}

    Returns:
      ``[..., *F]`` in ``result_dtype``.
    """
    parts = (key, stochastic_rounding, hadamard, weight_tiles)
    return _layer((x,), gamma, w, keywords, result_dtype, parts)


@norm_keywords
def add_rms_norm_dense(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array | None,
    w: jax.Array,
    *,
    result_dtype=None,
    key=None,
    stochastic_rounding: bool | None = None,
    hadamard: bool | int | None = None,
    weight_tiles: bool | None = None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, jax.Array]:
    """:func:`rms_norm_dense` of ``h = x + residual``, also returning ``residual_out`` (``h``
    in the residual's dtype), whose cotangent flows to ``x`` and ``residual`` unchanged.

    Args:
      x, residual: ``[..., K]``, as for :func:`jax_fp8norm.add_rms_norm_fp8`.
      gamma, w, result_dtype, key, stochastic_rounding, hadamard, weight_tiles: as for
        :func:`rms_norm_dense`.
      {keywords}

    Returns:
      ``(out [..., *F], residual_out [..., K])``.
    """
    parts = (key, stochastic_rounding, hadamard, weight_tiles)
    return _layer((x, residual), gamma, w, keywords, result_dtype, parts)


@norm_keywords
def allreduce_add_rms_norm_dense(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array | None,
    w: jax.Array,
    *,
    axis_name,
    reduce_dtype=None,
    result_dtype=None,
    key=None,
    stochastic_rounding: bool | None = None,
    hadamard: bool | int | None = None,
    weight_tiles: bool | None = None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, jax.Array]:
    """The tensor-parallel form of :func:`add_rms_norm_dense`, inside ``jax.shard_map``:
    ``x`` is this device's partial sum (a row-parallel matmul's output), summed over
    ``axis_name`` by XLA's all-reduce (the ``"xla"`` method of
    :func:`jax_fp8norm.allreduce_residual_rms_norm_fp8`: the columnwise codes need the
    sum, which the one-kernel methods keep in registers), then the residual added,
    normalised, quantised and multiplied by ``w`` (whole, or split by columns over the
    same axis: column-parallel). Backward: ``x``'s cotangent is the sum's (every device's
    partial counts once); a column-parallel ``w`` gives each device a part of ``dn``,
    summed over the axis before the norm's backward.

    Args:
      x, residual: ``[..., K]``, the partial sum and the residual (the same on every
        device).
      gamma, w, result_dtype, key, stochastic_rounding, hadamard, weight_tiles: as for
        :func:`rms_norm_dense`.
      axis_name: the mesh axis (or a tuple of axes) to sum over.
      reduce_dtype: None to sum in ``x.dtype``, or float32.
      {keywords}

    Returns:
      ``(out [..., *F], residual_out [..., K])``, ``residual_out`` the same on every device.
    """
    reduce = check_reduce_dtype(reduce_dtype, x.dtype)
    summed_in = None if reduce == np.dtype(x.dtype) else reduce
    h = xla_sum(as_operand(x), check_axis_name(axis_name), summed_in)
    parts = (key, stochastic_rounding, hadamard, weight_tiles)
    return _layer((x, residual), gamma, w, keywords, result_dtype, parts, summed=h)
