"""jax_fp8norm: fused RMSNorm + FP8 / FP4 quantisation for JAX.

    import jax_fp8norm as fp8norm
    y, scales = fp8norm.rms_norm_fp8(x, gamma)
    y, scales, residual_out = fp8norm.add_rms_norm_fp8(x, residual, gamma)
    # inside jax.shard_map, x a partial sum over the mesh axis "tp":
    y, scales, residual_out = fp8norm.allreduce_residual_rms_norm_fp8(
        x, residual, gamma, axis_name="tp")
    # NVFP4: FP4 codes, e4m3 scales per 16 elements, a global decode scale
    y, scales = fp8norm.rms_norm_fp8(x, gamma, recipe="nvfp4", global_scale=gs)
    # training: the norm and the linear layer after it, differentiable
    out = fp8norm.rms_norm_dense(x, gamma, w, recipe="mxfp8")

The contract is docs/spec.md; :mod:`jax_fp8norm.reference` holds the pure-jnp twins.
"""

from jax_fp8norm import reference, simt, testing
from jax_fp8norm._fallback import KernelFallbackWarning
from jax_fp8norm._ffi import (
    built_with_cuda,
    cpu_kernel_variant,
    cuda_kernel,
    cuda_kernel_variants,
    use_cuda_kernel,
)
from jax_fp8norm._primitives import EXPORT_DISABLED_CHECKS
from jax_fp8norm._training import add_rms_norm_fp8_vjp, rms_norm_fp8_vjp
from jax_fp8norm._version import __version__ as __version__
from jax_fp8norm.autodiff import add_rms_norm_fp8_dequantized, rms_norm_fp8_dequantized
from jax_fp8norm.dense import add_rms_norm_dense, allreduce_add_rms_norm_dense, rms_norm_dense
from jax_fp8norm.ops import (
    add_rms_norm_fp8,
    allreduce_residual_rms_norm_fp8,
    rms_norm_fp8,
    sharded_allreduce_residual_rms_norm_fp8,
)
from jax_fp8norm.recipes import RECIPES, Recipe, dequantize

# What users call: the ops, their differentiable twins, the layers, the building block of
# a layer of one's own (the *_vjp pair), the recipes, the platform's switches, and the
# modules of the pure-jnp twins, the emulated CUDA kernels and the test helpers. The
# modules jax_fp8norm.matmul, jax_fp8norm.quantize and jax_fp8norm.interop, and the
# framework modules jax_fp8norm.nnx, jax_fp8norm.linen and jax_fp8norm.eqx (each needing
# its framework), are imported by name.
__all__ = [
    "EXPORT_DISABLED_CHECKS",
    "RECIPES",
    "KernelFallbackWarning",
    "Recipe",
    "add_rms_norm_dense",
    "add_rms_norm_fp8",
    "add_rms_norm_fp8_dequantized",
    "add_rms_norm_fp8_vjp",
    "allreduce_add_rms_norm_dense",
    "allreduce_residual_rms_norm_fp8",
    "built_with_cuda",
    "cpu_kernel_variant",
    "cuda_kernel",
    "cuda_kernel_variants",
    "dequantize",
    "reference",
    "rms_norm_dense",
    "rms_norm_fp8",
    "rms_norm_fp8_dequantized",
    "rms_norm_fp8_vjp",
    "sharded_allreduce_residual_rms_norm_fp8",
    "simt",
    "testing",
    "use_cuda_kernel",
]
