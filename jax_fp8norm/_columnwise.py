"""JAX primitives of the columnwise outputs of rms_norm_fp8 and add_rms_norm_fp8
(docs/spec.md, "Columnwise outputs"), with every rule of each in this file: the shape
rule, the lowering (the CPU and CUDA kernels, the emulated CUDA kernels while the CPU
backend emulates them; elsewhere the reference twin, as jax_fp8norm._fallback says) and
batching. The pass runs after the op's training form, from the same inputs and each row's
saved r, so its ``n`` is the rowwise output's bit for bit.
Operands: rms: (x, gamma, inverse_rms[, scale]); add: (x, residual, gamma, inverse_rms[,
scale]). Results: (y_t [N, rows], scales_t [N, rows / group_size], or [N, 1] for a
calibrated scale). Parameters: the norm's (NormParams)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_fp8norm import _ffi, reference
from jax_fp8norm._params import NormCall, NormParams
from jax_fp8norm._primitives import eager_impl, norm_attributes, twin_lowering


def _num_row_operands(op: str) -> int:
    return 2 if op == "add_columnwise" else 1


def output_shapes(x_shape: tuple, p: NormParams) -> tuple[tuple, tuple]:
    """(y_t's shape, scales_t's shape) for an input of shape ``x_shape``."""
    n = x_shape[-1]
    rows = int(np.prod(x_shape[:-1], dtype=np.int64))
    blocks = 1 if p.has_static_scale else rows // p.group_size
    return (n, rows), (n, blocks)


def _abstract_eval(*avals, op, **params):
    p = NormParams(**params)
    x = avals[0]
    y_shape, scales_shape = output_shapes(x.shape, p)
    return [
        jax.core.ShapedArray(y_shape, np.dtype(p.out_dtype)),
        jax.core.ShapedArray(scales_shape, np.dtype(p.scale_dtype)),
    ]


def _twin(*operands, op, **params):
    p = NormParams(**params)
    rows = _num_row_operands(op)
    h = operands[0].astype(jnp.float32)
    if rows == 2:
        h = h + operands[1].astype(jnp.float32)
    gamma, inverse_rms, *scale = operands[rows:]
    return reference.quantize_columns(h, gamma, inverse_rms, p, scale[0] if scale else None)


def _ffi_rule(target: str, platform: str):
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, op, **params):
        return rule(ctx, *args, **norm_attributes(params, platform))

    return lowering


def _cpu_lowering(op: str):
    """The CPU kernel, or the emulated CUDA kernel while the FFI layer's switch is on."""
    rules = {t: _ffi_rule(t, "cpu") for t in (_ffi.TARGETS[op], _ffi.EMULATED_TARGETS[op])}

    def lowering(ctx, *args, **params):
        return rules[_ffi.cpu_target(op)](ctx, *args, **params)

    return lowering


def _cuda_lowering(op: str):
    """The CUDA kernel where this build has it, else the twin; decided when lowering."""
    kernel, twin = _ffi_rule(_ffi.TARGETS[op], "cuda"), twin_lowering(op, _twin)

    def lowering(ctx, *args, **params):
        return (kernel if _ffi.built_with_cuda() else twin)(ctx, *args, **params)

    return lowering


def _batching_rule(prim: Primitive):
    """vmap: one call per batch element (lax.map): each element's rows are blocked apart."""

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        front = [
            jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims, strict=True)
        ]
        outs = jax.lax.map(lambda a: prim.bind(*a, **params), tuple(front))
        return outs, [0] * len(outs)

    return rule


def _make_columnwise_primitive(op: str) -> Primitive:
    prim = Primitive(f"fp8norm_{op}")
    prim.multiple_results = True
    prim.def_abstract_eval(_abstract_eval)
    prim.def_impl(functools.partial(eager_impl, prim))
    mlir.register_lowering(prim, _cpu_lowering(op), platform="cpu")
    mlir.register_lowering(prim, _cuda_lowering(op), platform="cuda")
    mlir.register_lowering(prim, twin_lowering(op, _twin))
    batching.primitive_batchers[prim] = _batching_rule(prim)
    return prim


columnwise_p = _make_columnwise_primitive("columnwise")
add_columnwise_p = _make_columnwise_primitive("add_columnwise")


def bind_norm(
    prim: Primitive, call: NormCall, rows: tuple, gamma, *, training: bool, columnwise: bool
) -> tuple:
    """The outputs of an op's call (``prim``: the norm's primitive; ``rows``: x, or x and
    residual): (y, scales[, residual_out][, inverse_rms][, y_t, scales_t]). The columnwise
    pass runs after the training form, from its saved r."""
    params = dataclasses.replace(call.params, with_inverse_rms=training or columnwise)
    operands = call.operands(*rows, gamma)
    outs = tuple(prim.bind(*operands, **params.as_dict()))
    if not columnwise:
        return outs
    op = "add_columnwise" if len(rows) == 2 else "columnwise"
    pass_p = add_columnwise_p if len(rows) == 2 else columnwise_p
    row_operands, rest = operands[: len(rows)], operands[len(rows) :]
    columns = pass_p.bind(
        *row_operands, rest[0], outs[-1], *rest[1:], op=op, **call.params.as_dict()
    )
    return (*(outs if training else outs[:-1]), *columns)
