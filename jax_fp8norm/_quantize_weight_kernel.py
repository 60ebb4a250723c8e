"""The JAX primitive of the weight quantiser's kernel (src/common/quantize_weight.h): ``w
[K, F]`` to FP4 square tiles, as :func:`jax_fp8norm.quantize.quantize_weight_tiles`
states it in jnp. Its rules are registered through jax_fp8norm._lowering as the norm's
are: the CPU kernel (or the emulated CUDA one while the FFI layer's switch is on), the
CUDA kernel where the build has it, the jnp statement elsewhere. Results: (codes [K, F]
float4_e2m1fn, tile scales [K // block, ceil(F / block)] e4m3 or e8m0, global scale []
float32, 1 for MXFP4)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_fp8norm import _ffi
from jax_fp8norm._dtypes import E4M3, E8M0, FP4
from jax_fp8norm._lowering import eager_impl, map_over_batch, register_lowerings, twin_lowering

OP = "quantize_weight"
# The rule of each format's tiles: the target's format attribute by name.
FORMAT_NAMES = {True: "nvfp4_tiles", False: "mxfp4_tiles"}

quantize_weight_p = Primitive(f"fp8norm_{OP}")
quantize_weight_p.multiple_results = True


def _abstract_eval(w, *, block: int, nvfp4: bool):
    k, f = w.shape
    return [
        w.update(dtype=np.dtype(FP4), weak_type=False),
        jax.core.ShapedArray((k // block, -(-f // block)), np.dtype(E4M3 if nvfp4 else E8M0)),
        jax.core.ShapedArray((), np.dtype(np.float32)),
    ]


def _twin(w, *, block: int, nvfp4: bool):
    from jax_fp8norm import quantize  # quantize imports this module

    codes, scales, gs = quantize.weight_tiles_reference(w, block, nvfp4)
    return codes, scales, np.float32(1.0) if gs is None else gs


def _ffi_rule(target: str, platform: str):
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, w, *, block, nvfp4):
        return rule(
            ctx,
            w,
            format=np.int64(_ffi.WEIGHT_FORMAT_CODES[FORMAT_NAMES[nvfp4]]),
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
    codes, scales, gs = quantize_weight_p.bind(w, block=block, nvfp4=nvfp4)
    return codes, scales, gs if nvfp4 else None
