"""``python -m jax_fp8norm``: runs both ops on the default backend on model-sized shapes
(per-row scales, and rms_norm_fp8 with 1x128 group and MXFP8 scales too), checks them
against the pure-jnp reference with the spec's accuracy rule and prints a short report.
Exits non-zero if any check fails. ``--tp N`` runs the tensor-parallel Llama block example
(jax_fp8norm/examples/llama_tp_block.py) instead.

Times are wall-clock per call of the jitted function (dispatch included, median of
``--iters`` calls after a warm-up); they are a sanity check, not a benchmark.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8norm as fp8norm
from jax_fp8norm import _ffi, testing
from jax_fp8norm._dtypes import DTYPE_BY_NAME

DEFAULT_SHAPES = ((16, 4096), (512, 4096), (256, 8192), (64, 7168))


def _median_seconds(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# The scale layouts checked beside the per-row one: (label, keywords).
SCALINGS = (
    ("per row", {}),
    ("group 128", {"group_size": 128}),
    ("MXFP8", {"group_size": 32, "scale_dtype": jnp.float8_e8m0fnu}),
)


def _agreement(out, ref) -> str:
    y, y_ref = np.asarray(out[0]), np.asarray(ref[0])
    step = np.abs(testing.fp8_code_index(y) - testing.fp8_code_index(y_ref))
    scales, ref_scales = np.asarray(out[1]), np.asarray(ref[1])
    if scales.dtype == testing.E8M0:
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
    for label, keywords in SCALINGS[1:]:
        if hidden % keywords["group_size"] == 0:
            rms = (fp8norm.rms_norm_fp8, fp8norm.reference.rms_norm_fp8, (x, gamma), keywords)
            cases.append((f"rms {label}", *rms))
    for name, op, ref_op, args, keywords in cases:
        kernel = jax.jit(functools.partial(op, **keywords))
        reference = jax.jit(functools.partial(ref_op, **keywords))
        out, ref = kernel(*args), reference(*args)
        try:
            testing.assert_matches_reference(out, ref)
            verdict = "ok"
        except AssertionError as error:
            verdict, ok = f"FAILED: {error}", False
        t_kernel = _median_seconds(kernel, args, iters)
        t_ref = _median_seconds(reference, args, iters)
        print(
            f"{name:>17} {rows:6d} x {hidden:<6d} {_agreement(out, ref)}  "
            f"kernel {t_kernel * 1e6:9.1f} us  jnp {t_ref * 1e6:9.1f} us  {verdict}"
        )
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
    parser.add_argument("--iters", type=int, default=20, help="timed calls per op and shape")
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
    args = parser.parse_args(argv)
    if args.tp is not None:
        # Virtual CPU devices must be requested before jax's backends start.
        jax.config.update("jax_num_cpu_devices", max(args.tp, 1))
        from jax_fp8norm.examples import llama_tp_block

        return llama_tp_block.report(args.tp, args.group_size)
    shapes = (
        [tuple(int(v) for v in s.lower().split("x")) for s in args.shape]
        if args.shape
        else DEFAULT_SHAPES
    )
    device = jax.devices()[0]
    kernels = ""
    if jax.default_backend() == "cpu" and _ffi.emulating_cuda():
        kernels = f"; CPU backend runs the emulated CUDA kernels ({fp8norm.cuda_kernel()})"
    elif jax.default_backend() == "gpu":
        kernels = f"; CUDA kernel variant {fp8norm.cuda_kernel()}"
    print(
        f"jax_fp8norm {fp8norm.__version__} on {jax.default_backend()} ({device.device_kind}); "
        f"jax {jax.__version__}; CUDA kernels built: {fp8norm.built_with_cuda()}{kernels}"
    )
    print(
        f"x {args.dtype}, gamma float32, y float8_e4m3fn, scales float32 per row or per 1x128 "
        "group, or e8m0 per 1x32 group (MXFP8); reference: jnp twin"
    )
    ok = all(
        _run_shape(rows, hidden, DTYPE_BY_NAME[args.dtype], args.iters) for rows, hidden in shapes
    )
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
