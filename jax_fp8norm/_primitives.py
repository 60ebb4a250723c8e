"""JAX primitives of the ops: abstract evaluation (the shape rule), lowering to the XLA FFI
custom calls per platform, and batching rules (vmap)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_fp8norm import _ffi

# FFI target names, the same on every platform.
RMS_NORM_FP8_TARGET = "fp8norm_rms_norm_fp8"
ADD_RMS_NORM_FP8_TARGET = "fp8norm_add_rms_norm_fp8"
ROUND_TARGET = "fp8norm_round"
TARGETS = (RMS_NORM_FP8_TARGET, ADD_RMS_NORM_FP8_TARGET, ROUND_TARGET)

# What jax.export must be told to serialise a function that uses the ops: our custom-call
# targets carry no cross-version compatibility guarantee from XLA, so the caller vouches
# for them (the deserialising process must import jax_fp8norm, which registers them).
EXPORT_DISABLED_CHECKS = tuple(jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS)


@functools.cache
def _jitted_bind(prim: Primitive, params: tuple) -> callable:
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def _eager_impl(prim: Primitive, *args, **params):
    """Eager calls compile the primitive once per set of parameters (and shapes)."""
    return _jitted_bind(prim, tuple(sorted(params.items())))(*args)


def _ffi_lowering(target: str):
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, eps, weight_offset, scale_ub, out_dtype, scale_dtype):
        del out_dtype, scale_dtype  # carried by the result types
        return rule(
            ctx,
            *args,
            eps=np.float32(eps),
            weight_offset=np.float32(weight_offset),
            scale_ub=np.float32(scale_ub),
        )

    return lowering


def _unavailable_cuda_lowering(ctx, *args, **params):
    raise RuntimeError(_ffi.CUDA_UNAVAILABLE_REASON)


def _norm_abstract_eval(*avals, eps, weight_offset, scale_ub, out_dtype, scale_dtype):
    # update() keeps x's sharding and manual axes (shard_map), which the outputs share.
    x = avals[0]
    outs = [
        x.update(shape=x.shape, dtype=np.dtype(out_dtype), weak_type=False),
        x.update(shape=x.shape[:-1] + (1,), dtype=np.dtype(scale_dtype), weak_type=False),
    ]
    if len(avals) == 3:  # x, residual, gamma: residual_out has the residual's dtype
        outs.append(x.update(shape=x.shape, dtype=avals[1].dtype, weak_type=False))
    return outs


def _register(prim: Primitive, target: str, make_rule) -> None:
    """The same FFI target name serves every platform; only the handler behind it differs."""
    prim.def_impl(functools.partial(_eager_impl, prim))
    mlir.register_lowering(prim, make_rule(target), platform="cpu")
    if _ffi.built_with_cuda():
        mlir.register_lowering(prim, make_rule(target), platform="cuda")
    else:
        mlir.register_lowering(prim, _unavailable_cuda_lowering, platform="cuda")


def _to_front(value, dim, size):
    """The batch axis first: moved there, or made by broadcasting an unbatched operand."""
    if dim is None:
        return jnp.broadcast_to(value, (size, *value.shape))
    return jnp.moveaxis(value, dim, 0)


def _norm_batching_rule(prim: Primitive):
    """vmap. Every leading axis of x is a row axis to the kernel, so a batch of x (and
    residual) with one shared gamma is one kernel call over more rows. A batch of gammas
    becomes a compiled loop (lax.map), one kernel call per gamma."""

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        rows = [_to_front(a, d, size) for a, d in zip(args[:-1], dims[:-1], strict=True)]
        gamma, gamma_dim = args[-1], dims[-1]
        if gamma_dim is None:
            outs = prim.bind(*rows, gamma, **params)
        else:
            gammas = jnp.moveaxis(gamma, gamma_dim, 0)
            outs = jax.lax.map(lambda a: prim.bind(*a, **params), (*rows, gammas))
        return outs, [0] * len(outs)

    return rule


def _make_norm_primitive(name: str, target: str) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(_norm_abstract_eval)
    _register(prim, target, _ffi_lowering)
    batching.primitive_batchers[prim] = _norm_batching_rule(prim)
    return prim


rms_norm_fp8_p = _make_norm_primitive("fp8norm_rms_norm_fp8", RMS_NORM_FP8_TARGET)
add_rms_norm_fp8_p = _make_norm_primitive("fp8norm_add_rms_norm_fp8", ADD_RMS_NORM_FP8_TARGET)

# Element-wise float32 -> float16 / bfloat16 / FP8 rounding with the kernels' own code;
# used by tests to check every rounding boundary on each platform.
round_p = Primitive("fp8norm_round")
round_p.def_abstract_eval(lambda x, *, dtype: x.update(dtype=np.dtype(dtype), weak_type=False))


def _round_lowering(target: str):
    rule = jax.ffi.ffi_lowering(target)
    return lambda ctx, x, *, dtype: rule(ctx, x)


_register(round_p, ROUND_TARGET, _round_lowering)
batching.defvectorized(round_p)
