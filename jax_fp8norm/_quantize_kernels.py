"""The output gradient's FP4 quantiser as a kernel (src/common/quantize_gradient.h): the
primitive behind :func:`jax_fp8norm.quantize.quantize_gradient_rows` and
:func:`~jax_fp8norm.quantize.quantize_gradient_columns` for the NVFP4 and MXFP4 recipes,
registered through jax_fp8norm._lowering as the norm's are: the CPU kernel, the CUDA
kernel (emulated on the CPU while the FFI layer's switch is on), and the twins of
jax_fp8norm.quantize (``reference_quantize_gradient_rows`` and ``_columns``) where a
build has no kernel.

Operands: ``g`` float32 ``[R, F]`` and the stream's key words (uint32 ``[2]``; zeros when
the codes are rounded to nearest). Results: the codes ``[R, F]`` float4_e2m1fn, the block
scales (``[R, F // block]`` for the rows copy, ``[R // block, F]`` for the columns copy)
and NVFP4's float32 global scales (``[R, 1]`` for the rows copy, ``[1]`` for the columns
copy, ``[0]`` for MXFP4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp8norm import _ffi
from jax_fp8norm._backward import _varying
from jax_fp8norm._dtypes import E4M3, E8M0, FP4
from jax_fp8norm._lowering import eager_impl, map_over_batch, register_lowerings, twin_lowering
from jax_fp8norm.recipes import NVFP4, POWER_OF_TWO, RECIPES, OperandFormat

OP = "quantize_gradient"
# The blocks the kernels take: the recipes' (HadamardBlock's sizes too).
KERNEL_BLOCKS = {True: RECIPES["nvfp4"].block, False: RECIPES["mxfp4"].block}


def has_kernel(fmt: OperandFormat) -> bool:
    """Whether the kernel quantises the gradient in ``fmt``: FP4 in the recipe's block."""
    return fmt.element == FP4 and fmt.block == KERNEL_BLOCKS[fmt.rule == NVFP4]


def _shapes(g, *, nvfp4: bool, block: int, columns: bool):
    r, f = g.shape
    scales = (r // block, f) if columns else (r, f // block)
    global_scales = ((1,) if columns else (r, 1)) if nvfp4 else (0,)
    return scales, global_scales


def _placed(g, shape: tuple, *, rows: bool) -> dict:
    """The sharding of a result of ``shape`` where ``g`` has an explicit one: the rows
    copy's results split as g's rows, the columns copy's whole (its blocks span the rows,
    its global scale every row); nothing to say otherwise."""
    sharding = getattr(g, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()) or not hasattr(sharding, "spec"):
        return {}
    spec = tuple(sharding.spec) + (None,) * (len(g.shape) - len(sharding.spec))
    placed = (spec[0],) + (None,) * (len(shape) - 1) if rows and shape else (None,) * len(shape)
    if rows and len(shape) == len(g.shape) and shape[-1] == g.shape[-1]:
        placed = spec
    return {"sharding": NamedSharding(mesh, P(*placed))}


def _abstract_eval(g, key, *, nvfp4, block, columns, stochastic, hadamard_mask):
    scales, global_scales = _shapes(g, nvfp4=nvfp4, block=block, columns=columns)
    # Inside shard_map the results vary over the axes the operands vary over.
    varying = _varying((g, key))
    return [
        g.update(
            shape=shape,
            dtype=np.dtype(dtype),
            weak_type=False,
            **varying,
            **_placed(g, shape, rows=not columns),
        )
        for shape, dtype in (
            (g.shape, FP4),
            (scales, E4M3 if nvfp4 else E8M0),
            (global_scales, np.float32),
        )
    ]


def _twin(g, key, *, nvfp4, block, columns, stochastic, hadamard_mask):
    from jax_fp8norm import quantize  # quantize imports this module

    fmt = OperandFormat(FP4, block, NVFP4 if nvfp4 else POWER_OF_TWO)
    words = key if stochastic else None
    if columns:
        mask = None if hadamard_mask < 0 else hadamard_mask
        codes, scales, gs = quantize.reference_quantize_gradient_columns(g, fmt, words, mask)
    else:
        codes, scales, gs = quantize.reference_quantize_gradient_rows(g, fmt, words)
    _, shape = _shapes(g, nvfp4=nvfp4, block=block, columns=columns)
    gs = jnp.zeros(shape, jnp.float32) if gs is None else jnp.reshape(gs, shape)
    return [codes, scales, gs]


def _ffi_rule(target: str, platform: str):
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, g, key, *, nvfp4, block, columns, stochastic, hadamard_mask):
        return rule(
            ctx,
            g,
            key,
            nvfp4=bool(nvfp4),
            block=np.int64(block),
            columns=bool(columns),
            stochastic=bool(stochastic),
            hadamard_mask=np.int64(hadamard_mask),
            fp4_layout=np.int64(_ffi.fp4_layout(platform)),
        )

    return lowering


quantize_gradient_p = Primitive(f"fp8norm_{OP}")
quantize_gradient_p.multiple_results = True
quantize_gradient_p.def_abstract_eval(_abstract_eval)
quantize_gradient_p.def_impl(functools.partial(eager_impl, quantize_gradient_p))
register_lowerings(quantize_gradient_p, OP, _ffi_rule, twin_lowering(OP, _twin))
batching.primitive_batchers[quantize_gradient_p] = functools.partial(
    map_over_batch, quantize_gradient_p
)


def check_gradient(g, block: int, columns: bool) -> jax.Array:
    """``g`` as float32 ``[R, F]``, its blocked axis (R for the columns copy, F for the
    rows copy) a multiple of ``block``; a ValueError naming ``g`` otherwise."""
    if np.ndim(g) != 2 or not jnp.issubdtype(jnp.result_type(g), jnp.floating):
        raise ValueError(
            f"g must be a float array of shape (R, F), got {jnp.result_type(g)} {np.shape(g)}"
        )
    r, f = np.shape(g)
    axis, size = ("R", r) if columns else ("F", f)
    if size % block:
        copy = "columns (wgrad)" if columns else "rows (dgrad)"
        raise ValueError(
            f"g's {copy} copy needs {axis} a multiple of the block {block}; got g of shape "
            f"({r}, {f})"
        )
    return jnp.asarray(g, jnp.float32)


def check_stream_words(words) -> jax.Array:
    if np.shape(words) != (2,) or np.dtype(getattr(words, "dtype", None)) != np.uint32:
        raise ValueError(
            "stream_words must be uint32[2] (jax_fp8norm._fp4_parts.stream_key of the key), "
            f"got {getattr(words, 'dtype', type(words).__name__)} {np.shape(words)}"
        )
    return jnp.asarray(words)


def check_hadamard_mask(mask, block: int) -> int:
    if mask is None:
        return -1
    if isinstance(mask, bool) or not isinstance(mask, (int, np.integer)):
        raise ValueError(f"hadamard_mask must be an int or None, got {type(mask).__name__}")
    if not 0 <= int(mask) < 2**block:
        raise ValueError(f"hadamard_mask must have one bit per row of a block of {block}: {mask}")
    return int(mask)


def quantize_gradient(g, fmt: OperandFormat, stream_words, *, columns: bool, hadamard_mask=None):
    """The kernel's ``(codes, scales, global scale or None)`` of ``g`` in ``fmt`` (an FP4
    format :func:`has_kernel` takes), as quantize_gradient_rows (``columns`` False) or
    quantize_gradient_columns return them: the rows copy's global scales ``[R, 1]``, the
    columns copy's one of shape ``()``."""
    nvfp4 = fmt.rule == NVFP4
    g = check_gradient(g, fmt.block, columns)
    mask = check_hadamard_mask(hadamard_mask, fmt.block)
    stochastic = stream_words is not None
    words = check_stream_words(stream_words) if stochastic else jnp.zeros((2,), jnp.uint32)
    codes, scales, gs = quantize_gradient_p.bind(
        g,
        words,
        nvfp4=nvfp4,
        block=fmt.block,
        columns=columns,
        stochastic=stochastic,
        hadamard_mask=mask,
    )
    if not nvfp4:
        return codes, scales, None
    return codes, scales, (jnp.reshape(gs, ()) if columns else gs)
