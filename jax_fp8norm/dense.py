"""The fused norm and the linear layer after it, differentiable: what a training step
calls (docs/spec.md, "The layer: rms_norm_dense").

    out = fp8norm.rms_norm_dense(x, gamma, w, recipe="mxfp8")
    out, residual_out = fp8norm.add_rms_norm_dense(x, residual, gamma, w, recipe="nvfp4")

One ``jax.custom_vjp`` per layer. Forward: the fused norm's training form (the codes of
``n`` for the forward GEMM, the columnwise codes kept for the weight gradient, each row's
``r``), the weight quantised along K from its float master copy, and
:func:`jax_fp8norm.matmul.fp8_matmul`. Backward: the output gradient quantised twice by
the recipe's gradient format (:data:`GRADIENT_FORMATS`; blocked along the output features
for dgrad, along the rows for wgrad), the weight quantised again along its output
features, the dgrad and wgrad GEMMs, then the fused norm backward to ``dx`` and ``dgamma``
(and ``dresidual``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._allreduce import xla_sum
from jax_fp8norm._backward import add_backward, rms_backward
from jax_fp8norm._checks import (
    check_axis_name,
    check_columnwise,
    check_reduce_dtype,
    validate,
)
from jax_fp8norm._dtypes import E8M0, FLOAT_DTYPES
from jax_fp8norm._groups import divide
from jax_fp8norm._params import NormKeywords, NormParams, as_operand
from jax_fp8norm._primitives import add_rms_norm_fp8_p, rms_norm_fp8_p
from jax_fp8norm._signatures import norm_keywords
from jax_fp8norm.matmul import (
    fp8_matmul,
    nvfp4_global_scale,
    quantize_blocks,
    quantize_fp4_rows,
    quantize_per_channel,
    quantize_weights_mxfp4,
    quantize_weights_nvfp4,
)

__all__ = [
    "GRADIENT_FORMATS",
    "add_rms_norm_dense",
    "allreduce_add_rms_norm_dense",
    "gradient_format",
    "rms_norm_dense",
    "unquantized_rms_norm_dense",
]

# The format of the output gradient's codes, by the layout of the norm's scales: E5M2 (its
# range) beside the FP8 recipes' E4M3 activations and weights, as Transformer Engine's
# HYBRID format; MXFP8 keeps E4M3 with its e8m0 blocks, as TE's MXFP8 recipe; the FP4
# recipes quantise the gradient as they quantise everything else.
GRADIENT_FORMATS = {
    "per_row": "float8_e5m2, one float32 scale per row (dgrad) or per column (wgrad)",
    "static": "float8_e5m2, one float32 scale per row (dgrad) or per column (wgrad)",
    "per_group": "float8_e5m2, power-of-two float8_e8m0fnu scales per block of the group",
    "mxfp8": "float8_e4m3fn, float8_e8m0fnu scales per 32",
    "nvfp4": "float4_e2m1fn, float8_e4m3fn scales per 16; global scales from the gradient, "
    "one per row (dgrad) or one for the call (wgrad)",
    "mxfp4": "float4_e2m1fn, float8_e8m0fnu scales per 32",
}


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the layer quantises the operands it makes itself: the weight, ``w^T`` and the
    output gradient."""

    kind: str  # a key of GRADIENT_FORMATS
    block: int | None  # along the contraction axis; None: one scale per row or column
    weight_dtype: np.dtype
    gradient_dtype: np.dtype

    @property
    def columnwise(self) -> bool:
        """Whether the wgrad GEMM takes the norm's columnwise codes (blocks along the
        rows); the per-row recipe has none and folds its row scales into the gradient."""
        return self.kind != "per_row"


def _layout(p: NormParams) -> _Layout:
    e4m3, e5m2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
    if p.fp4:
        kind = "nvfp4" if p.nvfp4 else "mxfp4"
        return _Layout(kind, p.group_size, p.out_dtype, p.out_dtype)
    if p.has_static_scale:
        return _Layout("static", None, p.out_dtype, e5m2)
    if p.group_size is None:
        return _Layout("per_row", None, p.out_dtype, e5m2)
    if p.scale_dtype == E8M0 and p.group_size == 32:
        return _Layout("mxfp8", 32, p.out_dtype, e4m3)
    return _Layout("per_group", p.group_size, p.out_dtype, e5m2)


def gradient_format(**keywords) -> str:
    """The output gradient's format for the norm keywords ``keywords`` (a recipe, or the
    keywords that set the scales' layout): a value of :data:`GRADIENT_FORMATS`."""
    params = validate(jnp.zeros((1, 256), jnp.float32), jnp.ones(256), **keywords).params
    return GRADIENT_FORMATS[_layout(params).kind]


def _quantize_columns(v: jax.Array, layout: _Layout, dtype: np.dtype, global_scale=None):
    """``v [R, C]`` quantised along R, as :func:`fp8_matmul` takes its ``w``: ``(codes [R,
    C], scales [C] or [R // block, C], global scale or None)``; NVFP4's global scale is
    ``global_scale``, or by default ``max|v| / (448 * 6)``."""
    if layout.kind == "nvfp4":
        return quantize_weights_nvfp4(v, global_scale)
    if layout.kind == "mxfp4":
        return (*quantize_weights_mxfp4(v), None)
    if layout.block is None:
        return (*quantize_per_channel(v, dtype), None)
    return (*quantize_blocks(v, layout.block, dtype), None)


def _quantize_rows(v: jax.Array, layout: _Layout, dtype: np.dtype):
    """``v [R, C]`` quantised along C, as :func:`fp8_matmul` takes its ``a``: ``(codes [R,
    C], scales [R, 1] or [R, C // block], row_scales [R, 1] or None)``. Every row is
    quantised on its own: NVFP4 gives each row its global scale, ``max|row| / (448 *
    6)`` (1 for a zero row), returned as ``row_scales``, by which the GEMM's rows are
    multiplied; one global scale for the whole gradient would tie a row's bits to the
    batch."""
    if layout.kind == "nvfp4":
        row_scales = nvfp4_global_scale(jnp.max(jnp.abs(v), axis=1, keepdims=True))
        return (*quantize_fp4_rows(divide(v, row_scales), "nvfp4"), row_scales)
    if layout.kind == "mxfp4":
        return (*quantize_fp4_rows(v, "mxfp4"), None)
    if layout.block is None:
        return (*quantize_per_channel(v, dtype, axis=1), None)
    return (*quantize_blocks(v, layout.block, dtype, axis=1), None)


def _activation_global_scale(p: NormParams, static: tuple):
    """NVFP4's global scale of the norm's codes: the operand after gamma, or 1."""
    if not p.nvfp4:
        return None
    return static[0] if p.has_global_scale else jnp.float32(1.0)


def _forward_gemm(p, layout, y, scales, w, static, result_dtype):
    w_codes, w_scales, w_global = _quantize_columns(w, layout, layout.weight_dtype)
    return fp8_matmul(
        y,
        scales,
        w_codes,
        w_scales,
        out_dtype=result_dtype,
        a_global_scale=_activation_global_scale(p, static),
        w_global_scale=w_global,
    )


def _backward_gemms(p, layout, saved, g):
    """The cotangent ``g [..., F]`` of the layer's output to ``(dn [rows, K], dw [K, F]),
    both float32``."""
    w, static, codes = saved
    k, f = w.shape
    g = g.reshape(-1, f).astype(jnp.float32)
    if g.shape[0] == 0:  # no rows: nothing to quantise, nothing summed
        return jnp.zeros((0, k), jnp.float32), jnp.zeros((k, f), jnp.float32)
    g_codes, g_scales, g_row_scales = _quantize_rows(g, layout, layout.gradient_dtype)
    wt_codes, wt_scales, wt_global = _quantize_columns(w.T, layout, layout.weight_dtype)
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
    if layout.columnwise:
        n_codes, n_scales = codes  # y_t [K, rows], scales_t
        gw = g
    else:
        y, scales = codes  # the rows' codes; their scales go into the gradient
        n_codes = y.reshape(-1, k).T
        n_scales = jnp.ones((k, 1), jnp.float32)
        gw = g * scales.reshape(-1, 1).astype(jnp.float32)
    gw_codes, gw_scales, gw_global = _quantize_columns(gw, layout, layout.gradient_dtype)
    dw = fp8_matmul(
        n_codes,
        n_scales,
        gw_codes,
        gw_scales,
        out_dtype=jnp.float32,
        a_global_scale=_activation_global_scale(p, static),
        w_global_scale=gw_global,
    )
    return dn, dw


def _varying_axes(v: jax.Array) -> frozenset:
    """The shard_map axes along which ``v``'s value differs between devices."""
    manual = getattr(jax.typeof(v), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def _summed_over_devices(primal: jax.Array, cotangent: jax.Array) -> jax.Array:
    """Inside shard_map, ``cotangent`` psummed over the mesh axes along which it varies and
    ``primal`` does not: ``dn`` of a norm whose outputs are the same on every device of "tp"
    (the type of its ``inverse_rms``, which varies wherever any of the norm's operands
    does, does not vary there) and whose layer's weight is split by columns over "tp" is
    the sum of every device's part (summed in float32 before the norm's backward, so that
    dx is rounded once), and so is dgamma of a gamma replicated over the axis that splits
    the rows. Where the norm's outputs vary (x, gamma, the residual or a
    static or global scale differs between devices), each device's backward is its own,
    on its own dn, and dx, dresidual and dgamma are summed after it, once."""
    axes = tuple(sorted(_varying_axes(cotangent) - _varying_axes(primal)))
    return jax.lax.psum(cotangent, axes) if axes else cotangent


def _kept_codes(layout: _Layout, outs: tuple) -> tuple:
    """What the backward keeps of the norm's outputs: the columnwise codes and scales, or
    the per-row recipe's rowwise ones."""
    return tuple(outs[-2:]) if layout.columnwise else tuple(outs[:2])


def _parameter_gradients(gamma, dgamma, w, dw) -> tuple[jax.Array, jax.Array]:
    """The float32 ``dgamma`` and ``dw`` summed over the devices that share the parameter,
    then cast to the parameter's dtype."""
    return (
        _summed_over_devices(gamma, dgamma).astype(gamma.dtype),
        _summed_over_devices(w, dw).astype(w.dtype),
    )


@functools.cache
def _rms_norm_dense(p: NormParams, result_dtype: np.dtype):
    layout = _layout(p)
    training = dataclasses.replace(p, with_inverse_rms=True, columnwise=layout.columnwise)

    @jax.custom_vjp
    def fn(x, gamma, w, *static):
        y, scales = rms_norm_fp8_p.bind(x, gamma, *static, **p.as_dict())
        return _forward_gemm(p, layout, y, scales, w, static, result_dtype)

    def fwd(x, gamma, w, *static):
        _check_training(x.shape, w.shape, p)
        outs = rms_norm_fp8_p.bind(x, gamma, *static, **training.as_dict())
        out = _forward_gemm(p, layout, outs[0], outs[1], w, static, result_dtype)
        return out, (x, gamma, outs[2], (w, static, _kept_codes(layout, outs)))

    def bwd(saved, g):
        x, gamma, inverse_rms, gemm_saved = saved
        dn, dw = _backward_gemms(p, layout, gemm_saved, g)
        dn = _summed_over_devices(inverse_rms, dn)
        dx, dgamma = rms_backward(dn.reshape(x.shape), x, gamma, inverse_rms, p.weight_offset)
        zeros = tuple(jnp.zeros_like(s) for s in gemm_saved[1])
        dgamma, dw = _parameter_gradients(gamma, dgamma, gemm_saved[0], dw)
        return (_summed_over_devices(x, dx), dgamma, dw, *zeros)

    fn.defvjp(fwd, bwd)
    return fn


@functools.cache
def _add_rms_norm_dense(p: NormParams, result_dtype: np.dtype):
    layout = _layout(p)
    training = dataclasses.replace(p, with_inverse_rms=True, columnwise=layout.columnwise)

    @jax.custom_vjp
    def fn(x, residual, gamma, w, *static):
        y, scales, residual_out = add_rms_norm_fp8_p.bind(
            x, residual, gamma, *static, **p.as_dict()
        )
        return _forward_gemm(p, layout, y, scales, w, static, result_dtype), residual_out

    def fwd(x, residual, gamma, w, *static):
        _check_training(x.shape, w.shape, p)
        outs = add_rms_norm_fp8_p.bind(x, residual, gamma, *static, **training.as_dict())
        out = _forward_gemm(p, layout, outs[0], outs[1], w, static, result_dtype)
        saved = (x, residual, gamma, outs[3], (w, static, _kept_codes(layout, outs)))
        return (out, outs[2]), saved

    def bwd(saved, cotangents):
        x, residual, gamma, inverse_rms, gemm_saved = saved
        g, d_residual_out = cotangents
        dn, dw = _backward_gemms(p, layout, gemm_saved, g)
        dn = _summed_over_devices(inverse_rms, dn)
        dx, dresidual, dgamma = add_backward(
            dn.reshape(x.shape), d_residual_out, x, residual, gamma, inverse_rms, p.weight_offset
        )
        zeros = tuple(jnp.zeros_like(s) for s in gemm_saved[1])
        dgamma, dw = _parameter_gradients(gamma, dgamma, gemm_saved[0], dw)
        dx, dresidual = _summed_over_devices(x, dx), _summed_over_devices(residual, dresidual)
        return (dx, dresidual, dgamma, dw, *zeros)

    fn.defvjp(fwd, bwd)
    return fn


def _check_training(x_shape: tuple, w_shape: tuple, params: NormParams) -> None:
    """What the backward needs beyond the forward, checked when the layer is differentiated
    (an inference call takes any number of rows)."""
    layout = _layout(params)
    check_columnwise(layout.columnwise, params, x_shape)
    if layout.block is not None and w_shape[1] % layout.block:
        raise ValueError(
            f"w's output features ({w_shape[1]}) must be a multiple of the recipe's block "
            f"({layout.block}): the gradient's dgrad GEMM is blocked along them"
        )


def _check_layer(x, w, params: NormParams, result_dtype) -> np.dtype:
    """Checks ``w`` against ``x`` and the recipe; returns the result's dtype."""
    w_dtype = np.dtype(w.dtype) if hasattr(w, "dtype") else np.asarray(w).dtype
    if w_dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"w must be float32, bfloat16 or float16 (the master weights), got {w_dtype}"
        )
    if np.ndim(w) != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"w must have shape (x.shape[-1], F) = ({x.shape[-1]}, F); got {tuple(np.shape(w))}"
        )
    if params.fp4 and params.group_size != (16 if params.nvfp4 else 32):
        fmt, block = ("NVFP4", 16) if params.nvfp4 else ("MXFP4", 32)
        raise ValueError(
            f"the layer's {fmt} GEMMs take blocks of {block} (the format's); got "
            f"group_size={params.group_size}"
        )
    dtype = np.dtype(x.dtype if result_dtype is None else result_dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"result_dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype


@norm_keywords
def rms_norm_dense(
    x: jax.Array,
    gamma: jax.Array,
    w: jax.Array,
    *,
    result_dtype=None,
    **keywords: Unpack[NormKeywords],
) -> jax.Array:
    """``RMSNorm(x) * gamma @ w`` through the fused norm and an FP8 / FP4 GEMM,
    differentiable in ``x``, ``gamma`` and ``w`` (module docstring; docs/spec.md, "The
    layer").

    Args:
      x: ``[..., K]`` float32, float16 or bfloat16 activations. To differentiate with
        block scales, the number of rows, ``prod(x.shape[:-1])``, must be a multiple of the
        block (the weight gradient's GEMM is blocked along the rows), and so must F (the
        dgrad GEMM is blocked along it); a call that is not differentiated takes any.
      gamma: ``[K]``: the norm's weight.
      w: ``[K, F]`` float master weights, quantised on every call: along K for the
        forward GEMM, along F for the gradient's.
      result_dtype: the output's dtype; None: ``x.dtype``.
      {keywords}

    Returns:
      ``[..., F]`` in ``result_dtype``.
    """
    call = validate(x, gamma, **keywords)
    dtype = _check_layer(x, w, call.params, result_dtype)
    operands = call.operands(x, gamma)
    return _rms_norm_dense(call.params, dtype)(*operands[:2], as_operand(w), *operands[2:])


@norm_keywords
def add_rms_norm_dense(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    w: jax.Array,
    *,
    result_dtype=None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, jax.Array]:
    """:func:`rms_norm_dense` of ``h = x + residual``, also returning ``residual_out`` (``h``
    in the residual's dtype), whose cotangent flows to ``x`` and ``residual`` unchanged.

    Args:
      x, residual: ``[..., K]``, as for :func:`jax_fp8norm.add_rms_norm_fp8`.
      gamma, w, result_dtype: as for :func:`rms_norm_dense`.
      {keywords}

    Returns:
      ``(out [..., F], residual_out [..., K])``.
    """
    call = validate(x, gamma, residual, **keywords)
    dtype = _check_layer(x, w, call.params, result_dtype)
    operands = call.operands(x, residual, gamma)
    return _add_rms_norm_dense(call.params, dtype)(*operands[:3], as_operand(w), *operands[3:])


@norm_keywords
def allreduce_add_rms_norm_dense(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    w: jax.Array,
    *,
    axis_name,
    reduce_dtype=None,
    result_dtype=None,
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
      gamma, w, result_dtype: as for :func:`rms_norm_dense`.
      axis_name: the mesh axis (or a tuple of axes) to sum over.
      reduce_dtype: None to sum in ``x.dtype``, or float32.
      {keywords}

    Returns:
      ``(out [..., F], residual_out [..., K])``, ``residual_out`` the same on every device.
    """
    call = validate(x, gamma, residual, **keywords)
    reduce = check_reduce_dtype(reduce_dtype, x.dtype)
    dtype = _check_layer(x, w, call.params, result_dtype)
    summed_in = None if reduce == np.dtype(x.dtype) else reduce
    h = xla_sum(as_operand(x), check_axis_name(axis_name), summed_in)
    operands = call.operands(x, residual, gamma)
    layer = _add_rms_norm_dense(call.params, dtype)
    return layer(h, *operands[1:3], as_operand(w), *operands[3:])


def unquantized_rms_norm_dense(
    x: jax.Array,
    gamma: jax.Array,
    w: jax.Array,
    residual: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
):
    """The layer without quantisation, for comparison (differentiated by jax): ``h = x (+
    residual)`` and its RMSNorm in float32, the matmul in ``x.dtype`` accumulated in
    float32 (a plain bfloat16 layer for bfloat16 inputs). Returns ``out`` in ``x.dtype``,
    and with a residual ``(out, h in the residual's dtype)``."""
    h = x.astype(jnp.float32)
    if residual is not None:
        h = h + residual.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    n = (h * r * (gamma.astype(jnp.float32) + weight_offset)).astype(x.dtype)
    out = jnp.matmul(n, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return out if residual is None else (out, h.astype(residual.dtype))
