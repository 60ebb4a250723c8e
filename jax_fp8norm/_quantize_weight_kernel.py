"""The JAX primitive of the weight quantiser's kernel (src/common/quantize_weight.h): ``w
[K, F]`` to FP4 square tiles (jax_fp8norm.quantize.weight_tiles_reference states them in
jnp), or to FP8 E4M3 along K, one float32 scale per column or an e8m0 scale per block of
rows (quantize_per_channel and quantize_blocks). Its rules are registered through
jax_fp8norm._lowering as the norm's are: the CPU kernel (or the emulated CUDA one while
the FFI layer's switch is on), the CUDA kernel where the build has it, the jnp statement
elsewhere. Results: (codes [K, F], scales, global scale [] float32: NVFP4's, else 1)."""

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

OP = "quantize_weight"
# The formats, by the names of the target's format attribute (WeightFormat).
NVFP4_TILES, MXFP4_TILES = "nvfp4_tiles", "mxfp4_tiles"
FP8_CHANNELS, FP8_BLOCKS = "fp8_channels", "fp8_blocks"

quantize_weight_p = Primitive(f"fp8norm_{OP}")
quantize_weight_p.multiple_results = True


def _abstract_eval(w, *, format: str, block: int):
    k, f = w.shape
    if format == FP8_CHANNELS:
        codes, scales = E4M3, jax.core.ShapedArray((f,), np.dtype(np.float32))
    elif format == FP8_BLOCKS:
        codes, scales = E4M3, jax.core.ShapedArray((k // block, f), E8M0)
    else:
        scale_dtype = E4M3 if format == NVFP4_TILES else E8M0
        codes, scales = FP4, jax.core.ShapedArray((k // block, -(-f // block)), scale_dtype)
    # Inside shard_map the results vary over the axes w varies over; under an explicit
    # sharding the codes are placed as w, the scales and the global scale whole (a tile
    # spans rows and columns, the global scale every element).
    varying = _varying((w,))
    whole = _whole(w)
    return [
        w.update(dtype=np.dtype(codes), weak_type=False, **varying),
        w.update(shape=scales.shape, dtype=scales.dtype, weak_type=False, **varying, **whole),
        w.update(shape=(), dtype=np.dtype(np.float32), weak_type=False, **varying, **whole),
    ]


def _whole(w) -> dict:
    """The whole-array sharding of a result beside ``w`` where ``w`` has an explicit one."""
    sharding = getattr(w, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()) or not hasattr(sharding, "spec"):
        return {}
    return {"sharding": NamedSharding(mesh, P())}


def _twin(w, *, format: str, block: int):
    from jax_fp8norm import quantize  # quantize imports this module

    one = np.float32(1.0)
    if format == FP8_CHANNELS:
        return (*quantize.quantize_per_channel(w, jnp.float8_e4m3fn), one)
    if format == FP8_BLOCKS:
        return (*quantize.quantize_blocks(w, block, jnp.float8_e4m3fn), one)
    codes, scales, gs = quantize.weight_tiles_reference(w, block, format == NVFP4_TILES)
    return codes, scales, one if gs is None else gs


def _ffi_rule(target: str, platform: str):
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, w, *, format, block):
        return rule(
            ctx,
            w,
            format=np.int64(_ffi.WEIGHT_FORMAT_CODES[format]),
            block=np.int64(block),
            fp4_layout=np.int64(_ffi.fp4_layout(platform)),
        )

    return lowering


quantize_weight_p.def_abstract_eval(_abstract_eval)
quantize_weight_p.def_impl(functools.partial(eager_impl, quantize_weight_p))
register_lowerings(quantize_weight_p, OP, _ffi_rule, twin_lowering(OP, _twin))
batching.primitive_batchers[quantize_weight_p] = functools.partial(
    map_over_batch, quantize_weight_p
)


def quantize_weight_tiles(w: jax.Array, block: int, nvfp4: bool):
    """(codes, tile scales, global scale or None) of ``w [K, F]`` (float32, float16 or
    bfloat16; K a multiple of ``block``, checked by the caller) from the kernel."""
    fmt = NVFP4_TILES if nvfp4 else MXFP4_TILES
    codes, scales, gs = quantize_weight_p.bind(w, format=fmt, block=block)
    return codes, scales, gs if nvfp4 else None


def quantize_fp8_columns(w: jax.Array, block: int | None):
    """(codes float8_e4m3fn, scales) of ``w [K, F]`` (float32, float16 or bfloat16; K > 0,
    a multiple of ``block``, checked by the caller) along K from the kernel: float32 [F]
    per column where ``block`` is None, else e8m0 [K // block, F]."""
    fmt = FP8_CHANNELS if block is None else FP8_BLOCKS
    codes, scales, _ = quantize_weight_p.bind(w, format=fmt, block=block or 0)
    return codes, scales
