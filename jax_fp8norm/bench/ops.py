"""The ops the benchmark times: their names, the functions behind them, the bytes each
must move, and the input sets of a shape."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm.recipes import apply_recipe, scales_per_row

PER_ROW_OPS = ("rms_norm_fp8", "add_rms_norm_fp8")

# NVFP4's activation global scale in the benchmark: a decode scale of the size
# amax(|n|) / (448 * 6) gives for these inputs (normal x, gamma near 1: amax about 5), a
# power of two so that it is exact. Its value changes no work the op does.
NVFP4_GLOBAL_SCALE = 2.0**-9

# The ops with other scale layouts: name -> (the op, its recipe and keywords). Only the
# kernel and the reference twin implement them.
SCALED_OPS = {
    "rms_norm_fp8/group128": ("rms_norm_fp8", {"recipe": "fp8_group128"}),
    "rms_norm_fp8/mxfp8": ("rms_norm_fp8", {"recipe": "mxfp8"}),
    "rms_norm_fp8/static": ("rms_norm_fp8", {"recipe": "fp8_static", "static_scale": 0.05}),
    "rms_norm_fp8/nvfp4": (
        "rms_norm_fp8",
        {"recipe": "nvfp4", "global_scale": NVFP4_GLOBAL_SCALE},
    ),
    "rms_norm_fp8/mxfp4": ("rms_norm_fp8", {"recipe": "mxfp4"}),
}
OPS = (*PER_ROW_OPS, *SCALED_OPS)


def base_op(op: str) -> str:
    """The op behind a benchmark op name ("rms_norm_fp8/group128" -> "rms_norm_fp8")."""
    return SCALED_OPS[op][0] if op in SCALED_OPS else op


def op_function(module: ModuleType, op: str) -> Callable:
    """The function computing a benchmark op in a module of the ops (``jax_fp8norm`` or
    ``jax_fp8norm.reference``), its scale layout's keywords bound."""
    if op not in SCALED_OPS:
        return getattr(module, op)
    name, keywords = SCALED_OPS[op]
    return functools.partial(getattr(module, name), **keywords)


def op_bytes(op: str, rows: int, hidden: int, dtype) -> int:
    """Bytes an op must move: x (and residual) and gamma read; y (and residual_out) and
    the scales written. gamma is counted in x's dtype, y as one byte per element (FP8) or
    half a byte (FP4: XLA packs two codes to a byte on the CPU and GPU backends)."""
    keywords = apply_recipe(SCALED_OPS[op][1]) if op in SCALED_OPS else {}
    groups = scales_per_row(hidden, keywords.get("group_size"))
    scale_bytes = jnp.dtype(keywords.get("scale_dtype", jnp.float32)).itemsize
    itemsize = jnp.dtype(dtype).itemsize
    elements = rows * hidden
    fp4 = jnp.dtype(keywords.get("out_dtype", jnp.float8_e4m3fn)) == jnp.float4_e2m1fn
    y_bytes = elements // 2 if fp4 else elements
    moved = elements * itemsize + hidden * itemsize + y_bytes + rows * groups * scale_bytes
    if base_op(op) == "add_rms_norm_fp8":
        moved += 2 * elements * itemsize
    return moved


def shape_inputs(
    op: str, rows: int, hidden: int, dtype, start: int, stop: int, device: jax.Device
) -> list[tuple]:
    """Input sets start..stop-1 of a shape: (x, gamma) or (x, residual, gamma), the same
    values whenever asked for; every set has its own x (and residual), all share gamma."""
    key = jax.random.PRNGKey(rows * 7919 + hidden)
    gamma = jax.device_put(
        (1.0 + 0.1 * np.random.default_rng(hidden).standard_normal(hidden)).astype(dtype), device
    )
    sets = []
    for i in range(start, stop):
        kx, kr = jax.random.split(jax.random.fold_in(key, i))
        with jax.default_device(device):
            x = jax.random.normal(kx, (rows, hidden), dtype)
            if base_op(op) == "add_rms_norm_fp8":
                residual = jax.random.normal(kr, (rows, hidden), dtype)
                sets.append((x, residual, gamma))
            else:
                sets.append((x, gamma))
    return sets
