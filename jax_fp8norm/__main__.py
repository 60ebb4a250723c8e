"""``python -m jax_fp8norm``: runs both ops on the default backend on model-sized shapes
(per-row scales, and rms_norm_fp8 with 1x128 group, MXFP8, NVFP4 and MXFP4 scales too;
NVFP4 with a global scale calibrated on the shape's input), checks them
against the pure-jnp reference (bit for bit on the CPU backend, native or emulated
kernels; the spec's accuracy rule on a GPU) and prints a line per op and shape. Exits
non-zero if any check fails, after reporting every shape. ``--tp N`` runs the
tensor-parallel Llama block example (jax_fp8norm/examples/llama_tp_block.py) instead
(``--fp4 nvfp4|mxfp4``: its FP4 mode).

Times are wall-clock per call of the jitted function (dispatch included, median of
``--iters`` calls after a warm-up): the kernel's, and that of the textbook jnp formula a
user would write instead, under jax.jit (``xla formula``: the benchmark's
``xla_formula``, the same layout, not the same bits). The exact reference twin is run
for the check, not timed. They are a sanity check, not a benchmark
(``python -m jax_fp8norm.bench``). The emulated CUDA kernels are not timed unless
``--iters`` asks: the emulation is a model of the kernels' threads, and its time says
nothing of a GPU's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8norm as fp8norm
from jax_fp8norm import _ffi, testing
from jax_fp8norm._dtypes import DTYPE_BY_NAME, FP4
from jax_fp8norm.bench.implementations import formula_add_rms_norm_fp8, formula_rms_norm_fp8
from jax_fp8norm.bench.timing import blocking, interleaved_seconds

DEFAULT_SHAPES = ((16, 4096), (512, 4096), (256, 8192), (64, 7168))


# The block-scaled recipes checked beside the per-row one: every recipe with blocks
# (jax_fp8norm.recipes); NVFP4's global scale is the shape's: _nvfp4_global_scale.
BLOCK_RECIPES = tuple(name for name, recipe in fp8norm.RECIPES.items() if recipe.block)


@jax.jit
def _nvfp4_global_scale(x, gamma) -> jax.Array:
    """amax(|n|) / (448 * 6) of the normalised rows n (a decode scale), calibrated on x
    itself."""
    n = fp8norm.reference.textbook_rms_norm(x, gamma)
    return jnp.max(jnp.abs(n)) / (448.0 * 6.0)


def _agreement(out, ref) -> str:
    y, y_ref = np.asarray(out[0]), np.asarray(ref[0])
    code_index = testing.fp4_code_index if y.dtype == FP4 else testing.fp8_code_index
    step = np.abs(code_index(y) - code_index(y_ref))
    scales, ref_scales = np.asarray(out[1]), np.asarray(ref[1])
    if scales.dtype.itemsize == 1:  # e8m0 or e4m3: compare the codes
        same = np.mean(scales.view(np.uint8) == ref_scales.view(np.uint8))
        return f"identical {np.mean(step == 0):8.4%}  max step {step.max()}  scales same {same:.2%}"
    scale_ulp = testing.ulp_distance(scales, ref_scales).max()
    return f"identical {np.mean(step == 0):8.4%}  max step {step.max()}  scale ulp {scale_ulp:.0f}"


def _run_shape(rows: int, hidden: int, dtype, iters: int) -> bool:
    key = jax.random.PRNGKey(rows * 131 + hidden)
    kx, kr, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (rows, hidden), dtype)
    residual = jax.random.normal(kr, (rows, hidden), dtype)
    gamma = 1.0 + 0.1 * jax.random.normal(kg, (hidden,), jnp.float32)
    ok = True
    cases = [
        ("rms_norm_fp8", fp8norm.rms_norm_fp8, fp8norm.reference.rms_norm_fp8, (x, gamma), {}),
        (
            "add_rms_norm_fp8",
            fp8norm.add_rms_norm_fp8,
            fp8norm.reference.add_rms_norm_fp8,
            (x, residual, gamma),
            {},
        ),
    ]
    formulas = {"rms_norm_fp8": formula_rms_norm_fp8, "add_rms_norm_fp8": formula_add_rms_norm_fp8}
    for recipe in BLOCK_RECIPES:
        keywords = {"recipe": recipe}
        if recipe == "nvfp4":
            keywords["global_scale"] = _nvfp4_global_scale(x, gamma)
        layout = fp8norm.RECIPES[recipe].example()
        if hidden % layout["group_size"] == 0:
            rms = (fp8norm.rms_norm_fp8, fp8norm.reference.rms_norm_fp8, (x, gamma), keywords)
            cases.append((f"rms {recipe}", *rms))
            layout.pop("static_scale")
            formulas[f"rms {recipe}"] = functools.partial(
                formula_rms_norm_fp8, **layout, global_scale=keywords.get("global_scale")
            )
    for name, op, ref_op, args, keywords in cases:
        kernel = jax.jit(functools.partial(op, **keywords))
        reference = jax.jit(functools.partial(ref_op, **keywords))
        formula = jax.jit(formulas[name])
        out, ref = kernel(*args), reference(*args)
        try:
            if jax.default_backend() == "gpu":
                testing.assert_matches_reference(out, ref)
            else:
                testing.assert_same_bits(out, ref)
            verdict = "ok"
        except AssertionError as error:
            verdict, ok = f"FAILED: {error}", False
        timing = "not timed"
        if iters > 0:
            _, times = interleaved_seconds(
                {"kernel": blocking(kernel, *args), "formula": blocking(formula, *args)}, iters
            )
            t_kernel, t_formula = (statistics.median(times[k]) for k in ("kernel", "formula"))
            timing = f"kernel {t_kernel * 1e6:9.1f} us  xla formula {t_formula * 1e6:9.1f} us"
        print(f"{name:>17} {rows:6d} x {hidden:<6d} {_agreement(out, ref)}  {timing}  {verdict}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_fp8norm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPE_BY_NAME), default="bfloat16", help="x dtype"
    )
    parser.add_argument(
        "--shape",
        action="append",
        metavar="ROWSxHIDDEN",
        help="repeatable; default: a few model shapes",
    )
    parser.add_argument(
        "--iters",
        type=int,
        help="timed calls per op and shape (0: not timed); default 20, or 0 when the CPU "
        "backend runs the emulated CUDA kernels",
    )
    parser.add_argument(
        "--tp",
        type=int,
        metavar="N",
        help="instead: run the tensor-parallel Llama block example on N devices "
        "(N virtual CPU devices when there are fewer than N GPUs)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        metavar="G",
        help="with --tp: activation scales per 1xG group (128: DeepSeek-V3 style)",
    )
    parser.add_argument(
        "--fp4",
        choices=("nvfp4", "mxfp4"),
        help="with --tp: the FP4 mode: the norms emit NVFP4 or MXFP4 and the MLP's gate and "
        "up matmuls take FP4 operands (FP4 weights)",
    )
    parser.add_argument(
        "--allreduce-method",
        choices=("auto", "xla", "one_shot", "two_shot"),
        help="with --tp: the all-reduces' method (one_shot, two_shot: emulated on the CPU)",
    )
    args = parser.parse_args(argv)
    if args.allreduce_method is not None and args.tp is None:
        parser.error("--allreduce-method is a mode of the tensor-parallel example: give --tp N")
    if args.fp4 is not None and args.tp is None:
        parser.error("--fp4 is a mode of the tensor-parallel example: give --tp N too")
    if args.iters is not None and args.iters < 0:
        parser.error(f"--iters {args.iters}: expected 0 or more")
    if args.fp4 is not None and args.group_size is not None:
        parser.error("--group-size: the FP4 format fixes the group (16 NVFP4, 32 MXFP4)")
    if args.tp is not None:
        # Virtual CPU devices must be requested before jax's backends start.
        jax.config.update("jax_num_cpu_devices", max(args.tp, 1))
        from jax_fp8norm.examples import llama_tp_block

        return llama_tp_block.report(
            args.tp, args.group_size, args.fp4, args.allreduce_method or "auto"
        )
    shapes = (
        [tuple(int(v) for v in s.lower().split("x")) for s in args.shape]
        if args.shape
        else DEFAULT_SHAPES
    )
    device = jax.devices()[0]
    kernels = ""
    emulated = jax.default_backend() == "cpu" and _ffi.emulating()
    if emulated:
        kernels = f"; CPU backend runs the emulated CUDA kernels ({fp8norm.cuda_kernel()})"
    elif jax.default_backend() == "gpu":
        kernels = f"; CUDA kernel variant {fp8norm.cuda_kernel()}"
    print(
        f"jax_fp8norm {fp8norm.__version__} on {jax.default_backend()} ({device.device_kind}); "
        f"jax {jax.__version__}; CUDA kernels built: {fp8norm.built_with_cuda()}{kernels}"
    )
    print(
        f"x {args.dtype}, gamma float32, y float8_e4m3fn, scales float32 per row or per 1x128 "
        "group, or e8m0 per 1x32 group (MXFP8); y float4_e2m1fn, scales e4m3 per 1x16 group "
        "and a global scale (NVFP4) or e8m0 per 1x32 group (MXFP4); reference: jnp twin, "
        + ("accuracy rule" if jax.default_backend() == "gpu" else "bit for bit")
    )
    iters = args.iters
    if iters is None:
        iters = 0 if emulated else 20
    dtype = DTYPE_BY_NAME[args.dtype]
    results = [_run_shape(rows, hidden, dtype, iters) for rows, hidden in shapes]
    ok = all(results)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
