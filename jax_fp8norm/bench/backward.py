"""The training forms, the columnwise outputs and the fused backward against XLA, calls
interleaved.

Times, on one shape and with calls interleaved (each round calls every entry once; the
report gives each entry's minimum and median wall time per call, dispatch included;
each comparison is a group timed on its own):
the fused backward (``rms_norm_backward``, ``add_rms_norm_backward``) against XLA's
autodiff of the plain float32 formula (``jax.vjp`` of ``h * rsqrt(mean(h^2) + eps) *
gamma``, the residual add included for the add variant), the training form of the
forward against the plain op, each recipe's two layouts (``columnwise=True``) against
its rowwise op alone (``--recipes``: by default every recipe of the benchmark's ops with
block or static scales, with their keywords, ``bench/ops.py``'s ``SCALED_OPS``), and
MXFP8's against the textbook formula quantising ``n`` and its transpose.
On a GPU it adds the time the bytes would take at the device's peak bandwidth
(``--peak-tbps``, H200: 4.8), a floor that no kernel beats, and for each recipe the
ratio of the two layouts' bytes to the rowwise op's, the floor of their time ratio where
the op is bound by memory.

    python -m jax_fp8norm.bench.backward [--rows 4096] [--hidden 4096] [--dtype bfloat16]
                                          [--rounds 20] [--recipes mxfp8,nvfp4,...]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import jax_fp8norm as fp8norm
from jax_fp8norm import _training
from jax_fp8norm._dtypes import DTYPE_BY_NAME
from jax_fp8norm.bench.implementations import formula_quantize
from jax_fp8norm.bench.ops import SCALED_OPS, op_bytes, op_function
from jax_fp8norm.bench.timing import blocking, interleaved_seconds
from jax_fp8norm.recipes import apply_recipe

# The benchmark's ops whose recipe has a columnwise form, by their recipe.
COLUMNWISE_OPS = {
    keywords["recipe"]: op
    for op, (_, keywords) in SCALED_OPS.items()
    if fp8norm.RECIPES[keywords["recipe"]].columnwise
}
COLUMNWISE_RECIPES = tuple(COLUMNWISE_OPS)


def backward_bytes(rows: int, hidden: int, dtype, add: bool) -> int:
    """What the fused backward reads and writes: dn (float32), x (and residual,
    d_residual_out) and r read, dx (and dresidual) written, gamma and dgamma."""
    item = jnp.dtype(dtype).itemsize
    per_row = hidden * (4 + item + item) + 4 + (3 * hidden * item if add else 0)
    return rows * per_row + 8 * hidden


def forward_bytes(rows: int, hidden: int, dtype, recipe: str, columnwise: bool) -> int:
    """What the forward moves: the rowwise op's bytes (``op_bytes``); with ``columnwise``,
    y_t's codes and scales_t's scales (one per block of rows, or one per column for a
    static scale) too."""
    op = COLUMNWISE_OPS[recipe]
    moved = op_bytes(op, rows, hidden, dtype)
    if not columnwise:
        return moved
    keywords = apply_recipe(SCALED_OPS[op][1])
    code_bits = jnp.finfo(keywords["out_dtype"]).bits
    group = keywords.get("group_size")
    scale_bytes = jnp.dtype(keywords.get("scale_dtype", jnp.float32)).itemsize
    return (
        moved
        + rows * hidden * code_bits // 8
        + hidden * (rows // group if group else 1) * scale_bytes
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_fp8norm.bench.backward", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--peak-tbps", type=float, default=4.8)
    parser.add_argument(
        "--recipes",
        type=lambda text: [name for name in text.split(",") if name],
        default=list(COLUMNWISE_RECIPES),
        help="comma-separated; the recipes whose two layouts are timed",
    )
    args = parser.parse_args(argv)
    for name in args.recipes:  # an unknown name fails here, before anything is timed
        if name not in COLUMNWISE_OPS:
            raise ValueError(f"--recipes: each recipe one of {list(COLUMNWISE_OPS)}, got {name!r}")
    dtype = DTYPE_BY_NAME[args.dtype]
    shape = (args.rows, args.hidden)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], shape, dtype)
    residual = jax.random.normal(keys[1], shape, dtype)
    dn = jax.random.normal(keys[2], shape, jnp.float32)
    gamma = 1.0 + 0.1 * jax.random.normal(keys[3], (args.hidden,), jnp.float32)
    *_, r = _training.rms_norm_fp8_training(x, gamma)
    *_, r_add = _training.add_rms_norm_fp8_training(x, residual, gamma)
    d_residual_out = dn.astype(dtype)

    @jax.jit
    def xla_backward(dn, x, gamma):
        return jax.vjp(fp8norm.reference.textbook_rms_norm, x, gamma)[1](dn)

    @jax.jit
    def xla_add_backward(dn, d_residual_out, x, residual, gamma):
        def f(x, residual, gamma):
            h = x.astype(jnp.float32) + residual.astype(jnp.float32)
            return fp8norm.reference.textbook_rms_norm(h, gamma), h.astype(residual.dtype)

        return jax.vjp(f, x, residual, gamma)[1]((dn, d_residual_out))

    # Three groups, each timed interleaved on its own: a group's calls allocate outputs
    # of the same sizes, so none of them pays for the page faults of another's.
    groups = [
        {
            "backward: kernel": blocking(jax.jit(_training.rms_norm_backward), dn, x, gamma, r),
            "backward: XLA autodiff": blocking(xla_backward, dn, x, gamma),
        },
        {
            "add backward: kernel": blocking(
                jax.jit(_training.add_rms_norm_backward),
                dn,
                d_residual_out,
                x,
                residual,
                gamma,
                r_add,
            ),
            "add backward: XLA autodiff": blocking(
                xla_add_backward, dn, d_residual_out, x, residual, gamma
            ),
        },
        {
            "forward: plain": blocking(jax.jit(fp8norm.rms_norm_fp8), x, gamma),
            "forward: training form": blocking(jax.jit(_training.rms_norm_fp8_training), x, gamma),
        },
    ]
    xla_both = jax.jit(
        lambda x, gamma: (
            formula_quantize(
                n := fp8norm.reference.textbook_rms_norm(x, gamma),
                32,
                jnp.float8_e4m3fn,
                jnp.float8_e8m0fnu,
            ),
            formula_quantize(n.T, 32, jnp.float8_e4m3fn, jnp.float8_e8m0fnu),
        )
    )
    # Each alone: their outputs differ in size, and a call that reuses another's freed
    # memory pays none of the page faults that one that maps new memory does.
    for name in args.recipes:
        norm = op_function(fp8norm, COLUMNWISE_OPS[name])
        for columnwise, label in ((False, "rowwise"), (True, "rowwise + columnwise")):
            op = jax.jit(
                lambda x, g, norm=norm, columnwise=columnwise: norm(x, g, columnwise=columnwise)
            )
            groups.append({f"{name}: {label}": blocking(op, x, gamma)})
    if "mxfp8" in args.recipes:
        groups.append({"mxfp8: XLA formula, both": blocking(xla_both, x, gamma)})
    times = {}
    for calls in groups:
        times.update(interleaved_seconds(calls, args.rounds)[1])
    device = jax.devices()[0]
    print(
        f"x {args.dtype} {args.rows} x {args.hidden}, dn float32, gamma float32, on "
        f"{device.device_kind}; {args.rounds} interleaved rounds"
    )
    for name, t in times.items():
        print(
            f"  {name:>36}: min {min(t) * 1e3:8.3f} ms  median {statistics.median(t) * 1e3:8.3f} ms"
        )
    for op, base in (("backward", "backward"), ("add backward", "add backward")):
        ratio = min(times[f"{base}: XLA autodiff"]) / min(times[f"{op}: kernel"])
        print(f"  {op}: XLA autodiff / kernel = {ratio:.2f}x")
    training = min(times["forward: training form"]) / min(times["forward: plain"])
    print(f"  forward: training form / plain = {training:.2f}x")
    for name in args.recipes:
        both = min(times[f"{name}: rowwise + columnwise"])
        ratio = both / min(times[f"{name}: rowwise"])
        print(f"  {name}: rowwise + columnwise / rowwise = {ratio:.2f}x")
    if "mxfp8" in args.recipes:
        xla = min(times["mxfp8: XLA formula, both"])
        both = min(times["mxfp8: rowwise + columnwise"])
        print(f"  mxfp8: XLA formula, both / kernel, both = {xla / both:.2f}x")
    if device.platform == "gpu":
        for add in (False, True):
            moved = backward_bytes(args.rows, args.hidden, dtype, add)
            floor = moved / (args.peak_tbps * 1e12)
            print(
                f"  {'add ' if add else ''}backward bytes {moved / 1e6:.1f} MB: "
                f"{floor * 1e6:.1f} us at {args.peak_tbps} TB/s"
            )
        for name in args.recipes:
            rowwise, both = (
                forward_bytes(args.rows, args.hidden, dtype, name, columnwise)
                for columnwise in (False, True)
            )
            print(
                f"  {name}: bytes {rowwise / 1e6:.1f} MB rowwise, {both / 1e6:.1f} MB both "
                f"layouts: {both / rowwise:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
