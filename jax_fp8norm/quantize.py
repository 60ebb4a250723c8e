"""The quantisers of the operands the layer makes itself, the weight and the output
gradient, in the formats of :mod:`jax_fp8norm.matmul`: FP8 per column or row, FP8 in
e8m0 blocks, NVFP4 and MXFP4. Blocks and scale floors are the recipes'
(:class:`jax_fp8norm.recipes.OperandFormat`); the power-of-two and FP4 rules are the norm
ops' own (jax_fp8norm._groups), so that a weight's scales and an activation's of one
format are the same function of their block (a non-finite FP8 block's codes aside: zero
here, as MXFP4's, where the norm keeps NaN codes).

:func:`quantize_columns` and :func:`quantize_rows` quantise by an OperandFormat; the
others are the formats' own functions, for users who quantise their weights once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm import _checks, _quantize_kernels, _quantize_weight_kernel
from jax_fp8norm._checks import check_float32_scalar
from jax_fp8norm._dtypes import E8M0, FP4, FP4_MAX
from jax_fp8norm._fp4_parts import hadamard_rows, random_bits
from jax_fp8norm._groups import divide, fp4_groups, power_of_two
from jax_fp8norm._params import NORM_KEYWORDS
from jax_fp8norm.recipes import (
    NEAREST,
    NVFP4,
    POWER_OF_TWO,
    RECIPES,
    OperandFormat,
    recipe_keywords,
)

E4M3_MAX = 448.0
NVFP4_BLOCK = RECIPES["nvfp4"].block
MXFP4_BLOCK = RECIPES["mxfp4"].block
MXFP8_BLOCK = RECIPES["mxfp8"].block
# The keywords of the norm ops that a weight quantiser leaves at their defaults.
_RECIPE_DEFAULTS = {
    name: default
    for name, (default, _) in NORM_KEYWORDS.items()
    if name not in ("recipe", "static_scale", "global_scale")
}
# The smallest normal float32: the floor of the scales made from an amax.
SMALLEST_NORMAL = np.float32(2.0**-126)


def quantize_columns(v: jax.Array, fmt: OperandFormat, global_scale=None, bits=None):
    """``v [R, C]`` quantised along R in the format ``fmt``, as
    :func:`jax_fp8norm.matmul.fp8_matmul` takes its ``w``: ``(codes [R, C], scales [C] or
    [R // block, C], global scale or None)``; NVFP4's global scale is ``global_scale``,
    or by default ``max|v| / (448 * 6)``. FP4 codes are rounded stochastically with
    ``bits`` (uint32 ``[R, C]``, the random bits of each element)."""
    if fmt.element == FP4:
        blocks = _fp4_blocks(v, fmt.block, "NVFP4" if fmt.rule == NVFP4 else "MXFP4")
        if fmt.rule != NVFP4:
            return (*_fp4_columns(blocks, "mxfp4", None, bits), None)
        gs = nvfp4_global_scale(abs_max(blocks)) if global_scale is None else global_scale
        gs = check_float32_scalar(gs, "global_scale")
        return (*_fp4_columns(blocks, "nvfp4", gs, bits), gs)
    if _fp8_kernel_takes(v, fmt):
        return (*_quantize_weight_kernel.quantize_fp8_columns(v, fmt.block), None)
    if fmt.block is None:
        return (*quantize_per_channel(v, fmt.element), None)
    return (*quantize_blocks(v, fmt.block, fmt.element), None)


def _fp8_kernel_takes(v, fmt: OperandFormat) -> bool:
    """Whether the weight quantiser's kernel quantises ``v`` along its rows in the FP8
    format ``fmt``: E4M3 per channel (nearest) or in e8m0 blocks (power of two), of a
    dtype the kernel reads, with rows (and whole blocks of them; others get the jnp
    functions' errors)."""
    if np.ndim(v) != 2 or np.dtype(fmt.element) != np.dtype(jnp.float8_e4m3fn):
        return False
    if np.dtype(v.dtype) not in _KERNEL_WEIGHT_DTYPES or v.shape[0] == 0:
        return False
    if fmt.block is None:
        return fmt.rule == NEAREST
    return fmt.rule == POWER_OF_TWO and v.shape[0] % fmt.block == 0


def quantize_rows(v: jax.Array, fmt: OperandFormat, bits=None):
    """``v [R, C]`` quantised along C in the format ``fmt``, as
    :func:`jax_fp8norm.matmul.fp8_matmul` takes its ``a``: ``(codes [R, C], scales [R, 1]
    or [R, C // block], row_scales [R, 1] or None)``. Every row is quantised on its own:
    NVFP4 gives each row its global scale, ``max|row| / (448 * 6)`` (1 for a zero row),
    returned as ``row_scales``, by which the GEMM's rows are multiplied; one global scale
    for the whole would tie a row's bits to the batch. FP4 codes are rounded
    stochastically with ``bits`` (uint32 ``[R, C]``)."""
    if fmt.rule == NVFP4:
        row_scales = nvfp4_global_scale(abs_max(v, axis=1))
        return (*quantize_fp4_rows(divide(v, row_scales), "nvfp4", bits=bits), row_scales)
    if fmt.element == FP4:
        return (*quantize_fp4_rows(v, "mxfp4", bits=bits), None)
    if fmt.block is None:
        return (*quantize_per_channel(v, fmt.element, axis=1), None)
    return (*quantize_blocks(v, fmt.block, fmt.element, axis=1), None)


def quantize_gradient_rows(g: jax.Array, fmt: OperandFormat, stream_words=None):
    """The output gradient's dgrad copy: ``g [R, F]`` float32 quantised along F
    (:func:`quantize_rows`), rounded stochastically where ``stream_words`` (the caller's
    key folded with the dgrad stream) is given, element ``(i, j)`` with the random bits of
    ``(i, j)``. NVFP4 and MXFP4 run the gradient quantiser's kernel
    (jax_fp8norm._quantize_kernels), whose bits are
    :func:`reference_quantize_gradient_rows`'s."""
    if _quantize_kernels.has_kernel(fmt):
        return _quantize_kernels.quantize_gradient(g, fmt, stream_words, columns=False)
    return reference_quantize_gradient_rows(g, fmt, stream_words)


def reference_quantize_gradient_rows(g: jax.Array, fmt: OperandFormat, stream_words=None):
    """The statement of :func:`quantize_gradient_rows` in jnp, its kernel's twin."""
    bits = None if stream_words is None else random_bits(stream_words, *g.shape)
    return quantize_rows(g, fmt, bits)


def quantize_gradient_columns(
    g: jax.Array, fmt: OperandFormat, stream_words=None, hadamard_mask: int | None = None
):
    """The output gradient's wgrad copy: ``g [R, F]`` float32, Hadamard-transformed over
    blocks of ``fmt.block`` rows where ``hadamard_mask`` is given (its signs; the wgrad
    GEMM's result then takes ``1 / block``), quantised along R (:func:`quantize_columns`),
    rounded stochastically where ``stream_words`` is given, element ``(i, j)`` of ``g``
    with the random bits of ``(i, j)``. NVFP4 and MXFP4 run the gradient quantiser's
    kernel (jax_fp8norm._quantize_kernels), whose bits are
    :func:`reference_quantize_gradient_columns`'s."""
    if _quantize_kernels.has_kernel(fmt):
        return _quantize_kernels.quantize_gradient(
            g, fmt, stream_words, columns=True, hadamard_mask=hadamard_mask
        )
    return reference_quantize_gradient_columns(g, fmt, stream_words, hadamard_mask)


def reference_quantize_gradient_columns(
    g: jax.Array, fmt: OperandFormat, stream_words=None, hadamard_mask: int | None = None
):
    """The statement of :func:`quantize_gradient_columns` in jnp, its kernel's twin."""
    if hadamard_mask is not None:
        g = hadamard_rows(g, fmt.block, hadamard_mask)
    bits = None if stream_words is None else random_bits(stream_words, *g.shape)
    return quantize_columns(g, fmt, bits=bits)


def quantize_weight_tiles(w: jax.Array, fmt: OperandFormat):
    """``w [K, F]`` FP4 in square tiles of ``fmt.block`` (docs/spec.md, "2-D weight
    scales"): one scale per ``block x block`` tile by the format's rule (NVFP4: e4m3 under
    the tensor's global scale ``max|w| / (448 * 6)``; MXFP4: e8m0), so that the forward
    GEMM (blocks along K) and the dgrad GEMM (blocks along F) read the same codes. A
    partial tile at F's end is quantised as that tile padded with zeros. Returns ``(codes
    [K, F], tile scales [K // block, ceil(F / block)], global scale or None)``; see
    :func:`tile_scales`. A kernel (CPU or CUDA) quantises float32, bfloat16 and float16
    weights; its bits are those of :func:`weight_tiles_reference`."""
    block = fmt.block
    nvfp4 = fmt.rule == NVFP4
    if fmt.element != FP4:
        raise ValueError(f"2-D weight tiles are FP4's; got {np.dtype(fmt.element).name}")
    _fp4_blocks(w, block, "NVFP4" if nvfp4 else "MXFP4")  # the checks of w
    if np.dtype(w.dtype) not in _KERNEL_WEIGHT_DTYPES:
        return weight_tiles_reference(w, block, nvfp4)
    return _quantize_weight_kernel.quantize_weight_tiles(w, block, nvfp4)


# The master weights' dtypes the weight quantiser's kernel reads; others take the jnp
# statement.
_KERNEL_WEIGHT_DTYPES = tuple(np.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))


def weight_tiles_reference(w: jax.Array, block: int, nvfp4: bool):
    """:func:`quantize_weight_tiles` in jnp, the statement its kernel gives the bits of
    (and runs as where a build has no kernel), ``w`` already checked."""
    k, f = w.shape
    fp = f + (-f % block)
    v = jnp.pad(jnp.asarray(w, jnp.float32), ((0, 0), (0, fp - f)))
    tiles = v.reshape(k // block, block, fp // block, block).transpose(0, 2, 1, 3)
    tiles = tiles.reshape(k // block, fp // block, block * block)
    gs = nvfp4_global_scale(abs_max(v)) if nvfp4 else None
    y, scales = _fp4_groups(tiles, "nvfp4" if nvfp4 else "mxfp4", gs)
    codes = y.reshape(k // block, fp // block, block, block).transpose(0, 2, 1, 3)
    return codes.reshape(k, fp)[:, :f], scales, gs


def tile_scales(scales: jax.Array, block: int, features: int, *, transposed: bool) -> jax.Array:
    """A tiled weight's scales ``[K // block, ceil(F / block)]`` as a GEMM of
    :func:`jax_fp8norm.matmul.fp8_matmul` takes them: ``[K // block, F]`` for the codes
    ``[K, F]`` (forward), or with ``transposed`` ``[F // block, K]`` for ``codes.T``
    (dgrad)."""
    if transposed:
        return jnp.repeat(scales.T, block, axis=1)
    return jnp.repeat(scales, block, axis=1)[:, :features]


def _check_axis(axis: int) -> int:
    if axis not in (0, 1, -1):
        raise ValueError(
            f"axis must be 0 (along K of [K, M] weights) or 1 (along rows), got {axis}"
        )
    return axis % 2


def quantize_per_channel(
    w: jax.Array, out_dtype=jnp.float8_e4m3fn, *, axis: int = 0
) -> tuple[jax.Array, jax.Array]:
    """``[K, M]`` weights to FP8 with one float32 scale per output channel (column):
    ``scale = max(max_k |w[k, m]| / FP8_MAX, 2^-126)``; a zero column gets scale 1. With
    ``axis=1``, one scale per row of ``[M, K]`` activations instead (scales ``[M, 1]``)."""
    axis = _check_axis(axis)
    fp8_max = float(jnp.finfo(out_dtype).max)
    w32 = w.astype(jnp.float32)
    amax = abs_max(w32, axis=axis)
    # At least the smallest normal float32: amax / FP8_MAX of a tiny nonzero column would
    # flush to zero and its codes to Inf.
    scales = jnp.where(amax > 0, jnp.maximum(divide(amax, fp8_max), SMALLEST_NORMAL), 1.0)
    codes = divide(w32, scales).astype(out_dtype)
    return codes, (scales[0] if axis == 0 else scales)


def quantize_blocks(
    w: jax.Array, block_size: int = MXFP8_BLOCK, out_dtype=jnp.float8_e4m3fn, *, axis: int = 0
) -> tuple[jax.Array, jax.Array]:
    """``[K, M]`` weights to MXFP8-style blocks: one e8m0 scale per block of
    ``block_size`` rows in each column, by the norm's power-of-two rule (the smallest
    power of two >= ``amax / FP8_MAX``, at least 2^-127), so that no weight is clipped; a
    block holding NaN or Inf gets a NaN scale (e8m0's 0xFF) and zero codes. Returns ``(w8
    [K, M], scales [K // block_size, M] float8_e8m0fnu)``. With ``axis=1``, blocks along
    the rows of ``[M, K]`` activations instead: scales ``[M, K // block_size]``."""
    axis = _check_axis(axis)
    k = w.shape[axis]
    if block_size <= 0 or k % block_size:
        raise ValueError(f"block_size must be a positive divisor of K = {k}, got {block_size}")
    fp8_max = float(jnp.finfo(out_dtype).max)
    shape = list(w.shape)
    shape[axis : axis + 1] = [k // block_size, block_size]
    blocks = w.astype(jnp.float32).reshape(shape)
    amax = jnp.max(jnp.abs(blocks), axis=axis + 1, keepdims=True)
    exponent, recip = power_of_two(amax, fp8_max, e8m0=True)
    # The barrier keeps XLA from folding w * (1 / scale) into w / scale.
    codes = blocks * jax.lax.optimization_barrier(recip)
    finite = jnp.all(jnp.isfinite(blocks), axis=axis + 1, keepdims=True)
    w8 = jnp.where(finite, codes, 0.0).reshape(w.shape).astype(out_dtype)
    scales = jnp.where(finite, exponent, jnp.uint32(0xFF)).astype(jnp.uint8)
    return w8, jax.lax.bitcast_convert_type(jnp.squeeze(scales, axis + 1), E8M0)


def _fp4_blocks(w, block: int, name: str) -> jax.Array:
    """``[K, N]`` weights as float32 ``[K // block, block, N]``: blocks along K."""
    if np.ndim(w) != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w must be a float array of shape (K, N), got {w.dtype} {np.shape(w)}")
    k, n = w.shape
    if k % block:
        raise ValueError(f"{name} weights need K a multiple of {block}; got K = {k}")
    return jnp.asarray(w, jnp.float32).reshape(k // block, block, n)


def abs_max(v: jax.Array, axis: int | None = None) -> jax.Array:
    """``max |v|`` over ``axis`` (kept, of size 1) or the whole array, NaN where a NaN is
    among the values: XLA's max reductions need not carry a NaN through, and a global scale
    made from a NaN-free maximum of a row or tensor holding NaN would quantise its finite
    values as if the NaN were not there."""
    v = jnp.asarray(v, jnp.float32)
    keep = axis is not None
    amax = jnp.max(jnp.abs(v), axis=axis, keepdims=keep)
    return jnp.where(jnp.any(jnp.isnan(v), axis=axis, keepdims=keep), jnp.float32(np.nan), amax)


def nvfp4_global_scale(amax: jax.Array) -> jax.Array:
    """NVFP4's global (decode) scale for values of largest magnitude ``amax``: ``amax /
    (448 * 6)``, which puts the largest block scale at 448, at least 2^-126 (a tiny amax
    would flush it to zero), 1 for a zero amax; a NaN amax stays NaN."""
    scale = jnp.maximum(divide(amax, E4M3_MAX * FP4_MAX), SMALLEST_NORMAL)  # NaN stays NaN
    return jnp.where(amax == 0, jnp.float32(1.0), scale)


def quantize_weights_nvfp4(
    w: jax.Array, global_scale=None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[K, N]`` weights to NVFP4: blocks of 16 rows of each column (along K, the
    contraction axis), the rule the norm ops use for rows (``t = w / global_scale``,
    ``s = E4M3(min(max|t| / 6, 448))`` per block, ``y = E2M1(clip(t / f32(s), -6, 6))``).

    ``global_scale`` (a decode scale: ``deq = f32(y) * f32(s) * global_scale``; a Python
    float or a float32 array of shape ``()`` or ``(1,)``) defaults to
    :func:`nvfp4_global_scale` of ``max|w|``: ``max|w| / (448 * 6)``, which puts the
    largest block scale at 448, at least 2^-126, and 1.0 for an all-zero ``w``. A zero
    block gets scale 0 and zero codes; a block holding NaN or Inf gets a NaN scale and zero
    codes (so it dequantises to NaN).

    Returns ``(w4 [K, N] float4_e2m1fn, scales [K // 16, N] float8_e4m3fn, global_scale
    float32 of shape ())``, the operand, ``w_scales`` and ``w_global_scale`` of
    :func:`fp8_matmul`.
    """
    blocks = _fp4_blocks(w, NVFP4_BLOCK, "NVFP4")
    if global_scale is None:
        amax = jnp.max(jnp.abs(blocks))
        # A NaN amax stays NaN (and so does every scale), never a silent 1.
        gs = nvfp4_global_scale(amax)
    else:
        gs = check_float32_scalar(global_scale, "global_scale")
    w4, scales = _fp4_columns(blocks, "nvfp4", gs)
    return w4, scales, gs


def quantize_weights_mxfp4(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[K, N]`` weights to MXFP4: blocks of 32 rows of each column (along K), each with
    an e8m0 scale, the smallest power of two >= ``amax / 6`` (the rule of
    :func:`quantize_blocks` with FP4's 6 in place of FP8_MAX), so that no weight is
    clipped. A block whose ``amax / 6`` is at most 2^-127 (a zero block) gets 2^-127,
    e8m0's code 0; a block holding NaN or Inf gets a NaN scale (code 0xFF) and zero codes.

    Returns ``(w4 [K, N] float4_e2m1fn, scales [K // 32, N] float8_e8m0fnu)``, the
    operand and ``w_scales`` of :func:`fp8_matmul`.
    """
    return _fp4_columns(_fp4_blocks(w, MXFP4_BLOCK, "MXFP4"), "mxfp4")


def _fp4_columns(blocks: jax.Array, recipe: str, global_scale=None, bits=None):
    """FP4 codes ``[K, N]`` and scales ``[K // block, N]`` of weight blocks ``[K // block,
    block, N]``, by the rule of the norm ops' groups (jax_fp8norm._groups.fp4_groups): each
    column's blocks are a row's groups; ``bits`` ``[K, N]`` round them stochastically."""
    kb, block, n = blocks.shape
    groups = jnp.transpose(blocks, (2, 0, 1))  # [N, K // block, block]
    if bits is not None:
        bits = jnp.transpose(bits.reshape(kb, block, n), (2, 0, 1))
    y, scales = _fp4_groups(groups, recipe, global_scale, bits)
    return jnp.transpose(y, (1, 2, 0)).reshape(kb * block, n), jnp.transpose(scales)


def _fp4_groups(groups: jax.Array, recipe: str, global_scale=None, bits=None):
    """FP4 codes ``[R, groups, block]`` and scales ``[R, groups]`` of float32 groups."""
    layout = {k: v for k, v in recipe_keywords(recipe).items() if k != "static_scale"}
    params = _checks.make_params(
        np.float32, **{**_RECIPE_DEFAULTS, **layout}, has_global_scale=global_scale is not None
    )
    operand = None if global_scale is None else jnp.reshape(global_scale, (1,))
    return fp4_groups(groups, jnp.ones((groups.shape[0], 1), bool), params, operand, bits)


def quantize_fp4_rows(v: jax.Array, recipe: str, global_scale=None, bits=None):
    """``[M, K]`` activations to FP4 along their rows, by the weights' rule (NVFP4 with
    ``global_scale``, 1.0 when None; or MXFP4): ``(codes [M, K], scales [M, K // block])``,
    the ``a`` and ``a_scales`` of :func:`fp8_matmul`; ``bits`` ``[M, K]`` round them
    stochastically."""
    block = NVFP4_BLOCK if recipe == "nvfp4" else MXFP4_BLOCK
    m, k = v.shape
    if k % block:
        raise ValueError(f"{recipe.upper()} rows need K a multiple of {block}; got K = {k}")
    if recipe == "nvfp4" and global_scale is None:
        global_scale = jnp.float32(1.0)
    groups = jnp.asarray(v, jnp.float32).reshape(m, k // block, block)
    if bits is not None:
        bits = bits.reshape(m, k // block, block)
    y, scales = _fp4_groups(groups, recipe, global_scale, bits)
    return y.reshape(m, k), scales
