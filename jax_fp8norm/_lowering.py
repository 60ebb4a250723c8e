"""The rules every primitive of the package registers the same way: eager calls, lowering
to a kernel's FFI target per platform (the emulated CUDA kernels on the CPU while the FFI
layer's switch is on; the reference twin where this build has no kernel) and batching by
one call per batch element. The norm (jax_fp8norm._primitives), its backward
(jax_fp8norm._backward), the rounding check and the gradient quantiser
(jax_fp8norm._quantize_kernels) register through these."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_fp8norm import _fallback, _ffi


@functools.cache
def _jitted_bind(prim: Primitive, params: tuple, emulating: bool) -> callable:
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def eager_impl(prim: Primitive, *args, **params):
    """Eager calls compile the primitive once per set of parameters (and shapes), and per
    kind of kernel the CPU backend runs (native or emulated)."""
    return _jitted_bind(prim, tuple(sorted(params.items())), _ffi.emulating())(*args)


def lowering_platforms(ctx) -> tuple[str, ...]:
    """The platforms a lowering rule lowers for: one, or those sharing this rule when
    jax.export lowers for several."""
    return tuple(getattr(ctx, "platforms", None) or ctx.module_context.platforms)


def twin_lowering(op: str, twin):
    """Where this build has no kernel for the platform: the op's reference twin (``twin``,
    a function of the primitive's operands and parameters)."""
    lower = mlir.lower_fun(twin, multiple_results=True)

    def lowering(ctx, *args, **params):
        _fallback.lower_to_twin(op, lowering_platforms(ctx))
        return lower(ctx, *args, **params)

    return lowering


def _cuda_lowering(kernel_rule, fallback_rule):
    """The CUDA kernels where this build has them, else the twin; decided when lowering."""

    def lowering(ctx, *args, **params):
        rule = kernel_rule if _ffi.built_with_cuda() else fallback_rule
        return rule(ctx, *args, **params)

    return lowering


def _cpu_lowering(op: str, make_rule):
    """The CPU kernels, or the emulated CUDA ones while the FFI layer's switch is on."""
    rules = {
        target: make_rule(target, "cpu") for target in (_ffi.TARGETS[op], _ffi.EMULATED_TARGETS[op])
    }

    def lowering(ctx, *args, **params):
        return rules[_ffi.cpu_target(op)](ctx, *args, **params)

    return lowering


def register_lowerings(prim: Primitive, op: str, make_rule, twin) -> None:
    """``make_rule(target, platform)``: the lowering rule of a kernel's target. A native
    target's name is the same on every platform, only the handler behind it differs; on
    the CPU the FFI layer's switch may pick the emulated target instead. Every other
    platform (and CUDA in a build without its kernels) gets ``twin`` (a lowering rule)."""
    mlir.register_lowering(prim, _cpu_lowering(op, make_rule), platform="cpu")
    mlir.register_lowering(
        prim, _cuda_lowering(make_rule(_ffi.TARGETS[op], "cuda"), twin), platform="cuda"
    )
    mlir.register_lowering(prim, twin)


def to_front(value, dim, size):
    """The batch axis first: moved there, or made by broadcasting an unbatched operand."""
    if dim is None:
        return jnp.broadcast_to(value, (size, *value.shape))
    return jnp.moveaxis(value, dim, 0)


def batch_size(args, dims) -> int:
    """The size of the batch axis of the batched operands."""
    return next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)


def map_over_batch(prim: Primitive, args, dims, **params):
    """vmap as a compiled loop (lax.map): one call of ``prim`` per batch element, every
    result batched along its first axis."""
    size = batch_size(args, dims)
    front = tuple(to_front(a, d, size) for a, d in zip(args, dims, strict=True))
    outs = jax.lax.map(lambda a: prim.bind(*a, **params), front)
    return outs, [0] * len(outs)
