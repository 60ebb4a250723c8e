"""The implementations the benchmark times, registered in :data:`REGISTRY`.

- ``fp8norm``: this package's kernel; with ``--variants`` one entry per CUDA kernel
  variant instead (``fp8norm:warp_rows`` and so on), each checked against the reference;
- ``xla_reference``: ``jax.jit`` of the pure-jnp twin (``jax_fp8norm.reference``), exact
  to the same bits as the kernel;
- ``xla_formula``: ``jax.jit`` of the textbook jnp formula (mean, rsqrt, amax, divide,
  clip, cast) a user would otherwise write;
- ``torch_compile``: ``torch.compile`` of that formula, when torch is importable;
- ``copy``: an element-wise copy moving the same number of bytes (the ceiling);
- ``numpy_copy`` (CPU backend only): ``np.copyto`` of the same number of bytes, one pair
  of buffers (so cache-resident for small shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8norm as fp8norm
from jax_fp8norm import reference, testing
from jax_fp8norm._dtypes import OUT_MAX
from jax_fp8norm.bench import timing
from jax_fp8norm.bench.ops import PER_ROW_OPS, op_function
from jax_fp8norm.bench.registry import Case, Implementation, Registry, Timing, spare_colour

# Okabe and Ito's colour-blind-safe palette, one colour per implementation, fixed so that a
# colour means the same implementation in every panel and every figure; the copies grey.
COLOURS = {
    "fp8norm": "#0072B2",
    "xla_reference": "#E69F00",
    "xla_formula": "#009E73",
    "torch_compile": "#CC79A7",
    "copy": "#999999",
    "numpy_copy": "#404040",
}
# `auto` is the kernel a plain fp8norm entry runs, so it keeps fp8norm's colour.
VARIANT_COLOURS = {
    "auto": COLOURS["fp8norm"],
    "block_shared": "#56B4E9",
    "warp_rows": "#D55E00",
    "block_registers": "#882255",
}


def formula_rms_norm_fp8(
    x,
    gamma,
    eps=reference.DEFAULT_EPS,
    *,
    group_size=None,
    out_dtype=jnp.float8_e4m3fn,
    scale_dtype=jnp.float32,
    power_of_two_scales=False,
    global_scale=None,
):
    """The textbook formula a user would write, without the reference's exactness (rsqrt,
    mean, divide by the scale): per row, or per group of ``group_size`` with scales in
    ``scale_dtype``, rounded up to a power of two if ``power_of_two_scales`` or in
    ``float8_e8m0fnu``, and, for FP4 with e4m3 scales, NVFP4's ``global_scale``."""
    normed = reference.textbook_rms_norm(x, gamma, eps)
    if global_scale is not None:
        normed = normed / global_scale
    return formula_quantize(normed, group_size, out_dtype, scale_dtype, power_of_two_scales)


def formula_quantize(normed, group_size, out_dtype, scale_dtype, power_of_two_scales=False):
    """The textbook quantisation of float32 ``normed`` [..., N] in groups of ``group_size``
    along its last axis (None: the whole axis): (y, scales)."""
    n = normed.shape[-1]
    group = group_size or n
    grouped = normed.reshape(normed.shape[:-1] + (n // group, group))
    out_max = OUT_MAX[np.dtype(out_dtype)]
    scale = jnp.max(jnp.abs(grouped), axis=-1, keepdims=True) / out_max
    if power_of_two_scales or np.dtype(scale_dtype) == np.dtype(jnp.float8_e8m0fnu):
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    scale = scale.astype(scale_dtype)
    y = jnp.clip(grouped / scale.astype(jnp.float32), -out_max, out_max).astype(out_dtype)
    return y.reshape(normed.shape), scale[..., 0]


def formula_add_rms_norm_fp8(x, residual, gamma, eps=reference.DEFAULT_EPS):
    h = x.astype(jnp.float32) + residual.astype(jnp.float32)
    y, scale = formula_rms_norm_fp8(h, gamma, eps)
    return y, scale, h.astype(x.dtype)


FORMULAS = {"rms_norm_fp8": formula_rms_norm_fp8, "add_rms_norm_fp8": formula_add_rms_norm_fp8}


def kernel_function(op: str) -> Callable:
    return op_function(fp8norm, op)


def reference_function(op: str) -> Callable:
    return op_function(reference, op)


def formula_function(op: str) -> Callable:
    return FORMULAS[op]


def check_kernel(op: str, args: tuple) -> None:
    """Holds the kernel's outputs on the timed inputs to the spec's accuracy rule against
    the reference twin (which meets it by definition)."""
    out = jax.jit(kernel_function(op))(*args)
    ref = jax.jit(reference_function(op))(*args)
    testing.assert_matches_reference(out, ref)


def _time_jax(fn: Callable, input_sets: Sequence[tuple], case: Case) -> Timing:
    seconds = timing.device_seconds(fn, input_sets, case.calls, case.repeats)
    return Timing(seconds, case.calls, timing.distinct_input_sets(input_sets))


def _measure_with(build: Callable[[str], Callable]) -> Callable[[Case], Timing]:
    return lambda case: _time_jax(build(case.op), case.input_sets, case)


def _measure_kernel(case: Case) -> Timing:
    check_kernel(case.op, case.input_sets[0])
    return _time_jax(kernel_function(case.op), case.input_sets, case)


def kernel_variant(variant: str) -> Implementation:
    """The kernel with one CUDA kernel variant forced, as ``fp8norm:<variant>``."""

    def measure(case: Case) -> Timing:
        # The launch reads the variant on every call: one compiled program serves all.
        with fp8norm.use_cuda_kernel(variant):
            return _measure_kernel(case)

    name = f"fp8norm:{variant}"
    return Implementation(
        name=name,
        colour=VARIANT_COLOURS.get(variant) or spare_colour(name),
        description=f"this package's kernel, CUDA kernel variant {variant}",
        measure=measure,
        checked=True,
        build=kernel_function,
    )


def _copy_inputs(total_bytes: int, count: int, device: jax.Device) -> list[tuple]:
    # Half the op's bytes read and half written: the same traffic as the op.
    words = max(1, total_bytes // 8)
    key = jax.device_put(np.uint32(0x5A5A5A5A), device)
    return [(jax.device_put(np.full(words, i, np.uint32), device), key) for i in range(count)]


def _copy(words, key):
    return (words ^ key,)


def _measure_copy(case: Case) -> Timing:
    return _time_jax(_copy, _copy_inputs(case.nbytes, case.calls, case.device), case)


def _measure_numpy_copy(case: Case) -> Timing:
    # One pair of buffers, timed one copy at a time: no program of K calls to serialise.
    src = np.ones(max(1, case.nbytes // 2), np.uint8)
    dst = np.empty_like(src)
    seconds = timing.shortest_seconds(lambda: np.copyto(dst, src), case.repeats)
    return Timing(seconds, calls=1, distinct_inputs=1)


def _torch_dtype(torch, dtype):
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        jnp.dtype(dtype).name
    ]


def _measure_torch(case: Case) -> Timing | None:
    try:
        import torch
    except ImportError:
        return None
    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    fp8 = torch.float8_e4m3fn

    def formula(x, gamma, residual=None):
        h = x.float() if residual is None else x.float() + residual.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + reference.DEFAULT_EPS)
        normed = h * r * gamma.float()
        scale = normed.abs().amax(-1, keepdim=True) / 448.0
        y = (normed / scale).clamp(-448.0, 448.0).to(fp8)
        return (y, scale) if residual is None else (y, scale, h.to(x.dtype))

    compiled = torch.compile(formula)
    sets = []
    for s in case.input_sets:
        t = [torch.from_numpy(np.asarray(a).astype(np.float32)).to(device) for a in s]
        t = [a.to(_torch_dtype(torch, s[0].dtype)) for a in t]
        sets.append((t[0], t[-1]) if case.op == "rms_norm_fp8" else (t[0], t[2], t[1]))

    def run(k: int):
        for i in range(k):
            compiled(*sets[i % len(sets)])
        if cuda:
            torch.cuda.synchronize()

    t_one = timing.shortest_seconds(lambda: run(1), case.repeats)
    t_many = timing.shortest_seconds(lambda: run(case.calls), case.repeats)
    distinct = min(case.calls, timing.distinct_input_sets(case.input_sets))
    return Timing(timing.per_call(t_one, t_many, case.calls), case.calls, distinct)


REGISTRY = Registry(
    Implementation(
        name="fp8norm",
        colour=COLOURS["fp8norm"],
        description="this package's kernel",
        measure=_measure_kernel,
        checked=True,
        build=kernel_function,
        variant=kernel_variant,
    ),
    Implementation(
        name="xla_reference",
        colour=COLOURS["xla_reference"],
        description="jax.jit of the pure-jnp twin, the kernel's bits",
        measure=_measure_with(reference_function),
        checked=True,
        build=reference_function,
    ),
    Implementation(
        name="xla_formula",
        colour=COLOURS["xla_formula"],
        description="jax.jit of the textbook jnp formula",
        measure=_measure_with(formula_function),
        ops=PER_ROW_OPS,
        build=formula_function,
    ),
    Implementation(
        name="torch_compile",
        colour=COLOURS["torch_compile"],
        description="torch.compile of the textbook formula",
        measure=_measure_torch,
        ops=PER_ROW_OPS,
    ),
    Implementation(
        name="copy",
        colour=COLOURS["copy"],
        description="an XLA element-wise op moving the op's bytes",
        measure=_measure_copy,
        ceiling=True,
    ),
    Implementation(
        name="numpy_copy",
        colour=COLOURS["numpy_copy"],
        description="np.copyto of the op's bytes",
        measure=_measure_numpy_copy,
        backends=("cpu",),
        ceiling=True,
    ),
)
IMPLS = REGISTRY.names
