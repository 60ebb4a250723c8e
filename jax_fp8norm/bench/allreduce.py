"""The all-reduce op: each method of ``allreduce_residual_rms_norm_fp8`` beside XLA's
all-reduce + our fused kernel (``method="xla"``) and XLA's all-reduce + the jnp formula
(the reference twin), on every device of one kind that jax finds, calls interleaved.

Each round calls every implementation once, on the same inputs, inside one ``shard_map``
over all the devices; the report gives each one's minimum and median wall time per call
(the jitted function, dispatch included), and checks that every one-kernel method's
outputs equal the reference's bit for bit. On one GPU only the n = 1 path runs, with the
set-up cost (the first call of a new call site: its workspace allocated and zeroed). On
the CPU the one-kernel methods run only under the SIMT emulation (``--emulate``), whose
times measure the emulation, not a GPU; without it the CPU runs the XLA rows only.

    python -m jax_fp8norm.bench.allreduce [--rows 8,32,128] [--hidden 8192] [--rounds 20]
    python -m jax_fp8norm.bench.allreduce --devices 8 --emulate   # 8 virtual CPU devices
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Sequence


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m jax_fp8norm.bench.allreduce", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", default="8,32,128", help="comma-separated row counts")
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--devices", type=int, default=0, help="on the CPU: this many virtual devices (default 8)"
    )
    parser.add_argument(
        "--emulate", action="store_true", help="on the CPU: run the one-kernel methods emulated"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if "jax" not in sys.modules:  # virtual CPU devices must be asked for before jax starts
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.devices or 8))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_fp8norm as fp8norm
    from jax_fp8norm import simt
    from jax_fp8norm.bench.timing import blocking, interleaved_seconds

    devices = jax.devices()
    if devices[0].platform == "cpu":
        devices = devices[: args.devices or 8]
    n = len(devices)
    mesh = jax.make_mesh((n,), ("tp",), devices=devices)
    gpu = devices[0].platform == "gpu"
    methods = ["xla"]
    if gpu or args.emulate:
        methods += ["one_shot", "two_shot"]
    emulated = args.emulate and not gpu

    def layer(op, **kw):
        def per_device(p, r, g):
            return op(p[0], r, g, axis_name="tp", **kw)

        return jax.jit(
            jax.shard_map(
                per_device, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P(), P())
            )
        )

    print(
        f"allreduce_residual_rms_norm_fp8, bfloat16 x {args.hidden}, on {n} x "
        f"{devices[0].device_kind}{' (emulated CUDA kernels)' if emulated else ''}; "
        f"{args.rounds} interleaved rounds"
    )
    with simt.kernels() if emulated else contextlib.nullcontext():
        for rows in (int(r) for r in args.rows.split(",")):
            key = jax.random.PRNGKey(rows)
            partials = jax.random.normal(key, (n, rows, args.hidden), jnp.bfloat16)
            residual = jax.random.normal(jax.random.PRNGKey(1), (rows, args.hidden), jnp.bfloat16)
            gamma = jnp.ones((args.hidden,), jnp.float32)
            placed = (jax.device_put(partials, NamedSharding(mesh, P("tp"))), residual, gamma)
            fns = {
                "xla all-reduce + jnp formula": layer(
                    fp8norm.reference.allreduce_residual_rms_norm_fp8
                ),
                **{
                    f"method={m!r}": layer(fp8norm.allreduce_residual_rms_norm_fp8, method=m)
                    for m in methods
                },
            }
            calls = {name: blocking(fn, *placed) for name, fn in fns.items()}
            first, times = interleaved_seconds(calls, args.rounds)
            for m in methods[1:]:
                want = layer(fp8norm.reference.allreduce_residual_rms_norm_fp8, method=m)(*placed)
                got = fns[f"method={m!r}"](*placed)
                same = all(
                    np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                    for a, b in zip(got, want, strict=True)
                )
                if not same:
                    print(f"  MISMATCH: method={m!r} differs from its reference twin")
                    return 1
            payload = rows * args.hidden * 2
            print(f"  rows {rows} ({payload / 1024:.0f} KiB per device's partial):")
            for name, t in times.items():
                print(
                    f"    {name:>30}: min {min(t) * 1e6:10.1f} us  median "
                    f"{statistics.median(t) * 1e6:10.1f} us  first call (compile, set-up) "
                    f"{first[name] * 1e3:8.1f} ms"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
