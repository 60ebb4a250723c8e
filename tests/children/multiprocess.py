"""One process of tests/test_multiprocess.py: joins a 2-process jax.distributed job on
localhost, with 4 virtual CPU devices per process and gloo collectives, builds one
8-device mesh across both processes and runs, under jax.jit:

- allreduce_residual_rms_norm_fp8 inside jax.shard_map, each device holding its own
  partial sum, with reduce_dtype None (the input dtype) and float32;
- rms_norm_fp8 with x sharded along rows over the 8 devices.

Every input is regenerated here from fixed seeds, so each process checks the shards it
can address against references it computes alone on the full inputs. All the multi-process
programs run before any check, so a failed check cannot leave the other process waiting
in a collective. Prints `FAIL process <i> <check>: <why>` for each failed check and ends with
`PASS process <i>` (exit 0) or `FAILED process <i>` (exit 1).

Usage: python children/multiprocess.py PROCESS_ID PORT [--corrupt]. --corrupt flips one bit
of one expected value, to see the failure a wrong result gives.
"""

from __future__ import annotations

import os
import sys

# The tests' helpers are in the directory above.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import sys
import time
import traceback
import zlib

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
ROWS, HIDDEN = 24, 4096  # the all-reduce's rows; rms_norm_fp8 gets 8 rows per device


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("process_id", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("--corrupt", action="store_true")
    args = parser.parse_args()
    me = f"process {args.process_id}"
    start = time.monotonic()

    import jax

    # All before jax starts its backend: CPU only (a GPU, if any, is not this test's
    # subject), 4 devices per process, and gloo for the collectives between processes.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=NUM_PROCESSES,
        process_id=args.process_id,
        initialization_timeout=120,
    )
    devices = jax.devices()
    print(
        f"{me}: distributed init {time.monotonic() - start:.1f} s, {len(devices)} devices, "
        f"local {[d.id for d in jax.local_devices()]}",
        flush=True,
    )
    assert jax.process_count() == NUM_PROCESSES, jax.process_count()
    assert len(devices) == NUM_PROCESSES * LOCAL_DEVICES, devices

    import jax.numpy as jnp
    import numpy as np
    from helpers import assert_same_bits, random_gamma, random_rows
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_fp8norm as fp8norm

    # Explicit axes, jax.make_mesh's default in jax 0.10.2, for the shard_map; the row
    # sharded rms_norm_fp8 runs on both kinds (Auto is where custom_partitioning decides).
    meshes = {
        kind: jax.make_mesh((NUM_PROCESSES * LOCAL_DEVICES,), ("tp",), axis_types=(kind,))
        for kind in (AxisType.Explicit, AxisType.Auto)
    }
    mesh = meshes[AxisType.Explicit]
    size = mesh.shape["tp"]

    def global_array(value, mesh, spec):
        """The global array of ``value`` (the same full value in every process), each
        process supplying the shards of its own devices."""
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    # The inputs, from fixed seeds (as tests/allreduce_cases.py builds them).
    partials = random_rows(7, (size, ROWS, HIDDEN), jnp.bfloat16, spread=0.5)
    residual = random_rows(8, (ROWS, HIDDEN), jnp.bfloat16, spread=0.5)
    gamma = random_gamma(9, HIDDEN, jnp.float32)
    x = random_rows(10, (size * 8, HIDDEN), jnp.bfloat16)

    # 1. Every multi-process program, outputs kept as their addressable shards.
    def under_shard_map(op, reduce_dtype, **kw):
        def per_device(p, r, g):
            return op(p[0], r, g, axis_name="tp", reduce_dtype=reduce_dtype, **kw)

        fn = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P(), P())
        )
        return jax.jit(fn)(
            global_array(partials, mesh, P("tp")),
            global_array(residual, mesh, P()),
            global_array(gamma, mesh, P()),
        )

    outputs = {}
    timings = {}
    for reduce_name, reduce_dtype in (("x_dtype", None), ("float32", jnp.float32)):
        for impl_name, impl in (("op", fp8norm), ("twin", fp8norm.reference)):
            t = time.monotonic()
            out = under_shard_map(impl.allreduce_residual_rms_norm_fp8, reduce_dtype)
            jax.block_until_ready(out)
            timings[f"allreduce-{reduce_name}-{impl_name}"] = time.monotonic() - t
            outputs[("allreduce", reduce_name, impl_name)] = out
    t = time.monotonic()
    outputs[("allreduce", "x_dtype", "wrapper")] = jax.block_until_ready(
        jax.jit(
            lambda p, r, g: fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                p, r, g, mesh=mesh, axis_name="tp"
            )
        )(
            global_array(partials, mesh, P("tp")),
            global_array(residual, mesh, P()),
            global_array(gamma, mesh, P()),
        )
    )
    timings["allreduce-wrapper"] = time.monotonic() - t
    # The one-kernel methods need every device in one process: under the emulation, auto
    # is XLA's all-reduce here, and an explicit method refuses (at lowering, in both
    # processes alike, before any collective).
    t = time.monotonic()
    with fp8norm.simt.kernels():
        outputs[("allreduce", "x_dtype", "auto-emulated")] = jax.block_until_ready(
            under_shard_map(fp8norm.allreduce_residual_rms_norm_fp8, None, method="auto")
        )
        try:
            under_shard_map(fp8norm.allreduce_residual_rms_norm_fp8, None, method="one_shot")
            refusal = None
        except ValueError as error:
            refusal = str(error)
    timings["allreduce-methods"] = time.monotonic() - t
    row_hlo = {}
    for kind, m in meshes.items():
        t = time.monotonic()
        fn = jax.jit(fp8norm.rms_norm_fp8)
        placed = (global_array(x, m, P("tp", None)), global_array(gamma, m, P()))
        outputs[("rows", kind)] = jax.block_until_ready(fn(*placed))
        row_hlo[kind] = fn.lower(*placed).compile().as_text()
        timings[f"rows-{kind.name}"] = time.monotonic() - t
    print(
        f"{me}: programs ran in " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()),
        flush=True,
    )

    # 2. The references, computed here alone on the full inputs, on a local device.
    local = jax.local_devices()[0]

    def reference(fn, *arrays, **kw):
        placed = [jax.device_put(np.asarray(a), local) for a in arrays]
        return [np.array(o) for o in jax.jit(lambda *a: fn(*a, **kw))(*placed)]

    # The all-reduced sum: XLA's CPU all-reduce of bfloat16 over gloo matched a float32
    # sum rounded once to bfloat16 (a bfloat16 running sum, in any order, matched about
    # half the elements). The order of the float32 additions is gloo's and changes along
    # the row: no local order matched every element of a float32 all-reduce (6 of 81920
    # differed by one unit in one trial). So the local references hold the outputs to the
    # spec's accuracy rule (jax_fp8norm.testing), and the reference twin run under the same
    # shard_map, with the same all-reduce, holds them bit for bit.
    total = partials.astype(np.float32).sum(0)
    bf16_eps = float(np.asarray(fp8norm.reference.DEFAULT_EPS).astype(jnp.bfloat16))
    expected = {}
    expected["x_dtype"] = reference(
        fp8norm.reference.add_rms_norm_fp8, total.astype(jnp.bfloat16), residual, gamma
    )
    h = total + residual.astype(np.float32)
    y, scales, h32 = reference(
        fp8norm.reference.add_rms_norm_fp8, h, np.zeros_like(h), gamma, eps=bf16_eps
    )
    expected["float32"] = [y, scales, h32.astype(jnp.bfloat16)]
    expected["rows"] = reference(fp8norm.rms_norm_fp8, x, gamma)  # the kernel on one device
    expected["rows-reference"] = reference(fp8norm.reference.rms_norm_fp8, x, gamma)
    if args.corrupt:
        expected["rows"][0].view(np.uint8)[3, 5] ^= 1

    # 3. The checks, each on this process's addressable shards.
    failures = []

    def check(name, fn):
        try:
            fn()
        except Exception as error:
            failures.append(name)
            lines = [line.strip() for line in f"{type(error).__name__}: {error}".splitlines()]
            print(f"FAIL {me} {name}: {' | '.join(filter(None, lines[:6]))}", flush=True)
            if not isinstance(error, AssertionError):
                traceback.print_exc(limit=3)

    def shards_against(outs, want, compare):
        """compare(got, expected) on each addressable device: its shard of every output,
        and the same index of each full expected output."""
        per_output = [
            [(s.device.id, s.index, np.asarray(s.data)) for s in out.addressable_shards]
            for out in outs
        ]
        count = len(per_output[0])
        assert count == LOCAL_DEVICES, count
        for k in range(count):
            got = [entries[k][2] for entries in per_output]
            exp = [w[entries[k][1]] for w, entries in zip(want, per_output, strict=True)]
            try:
                compare(got, exp)
            except AssertionError as error:
                raise AssertionError(f"device {per_output[0][k][0]}: {error}") from None

    def same_on_every_device(outs):
        for out in outs:
            assert out.sharding.is_fully_replicated, out.sharding
            assert len(out.addressable_shards) == LOCAL_DEVICES

    for reduce_name in ("x_dtype", "float32"):
        op = outputs[("allreduce", reduce_name, "op")]
        twin = outputs[("allreduce", reduce_name, "twin")]
        want = expected[reduce_name]
        check(f"allreduce-{reduce_name}-replicated", lambda op=op: same_on_every_device(op))
        check(
            f"allreduce-{reduce_name}-shapes",
            lambda op=op: _equal(
                [(o.shape, o.dtype) for o in op],
                [
                    ((ROWS, HIDDEN), jnp.float8_e4m3fn),
                    ((ROWS, 1), jnp.float32),
                    ((ROWS, HIDDEN), jnp.bfloat16),
                ],
            ),
        )
        check(
            f"allreduce-{reduce_name}-vs-local-reference",
            lambda op=op, want=want: shards_against(op, want, assert_same_bits),
        )
        # The twin's shards are the full outputs (replicated): the op's bit for bit.
        twin_full = [np.asarray(o.addressable_shards[0].data) for o in twin]
        check(
            f"allreduce-{reduce_name}-bits-vs-twin-same-all-reduce",
            lambda op=op, twin_full=twin_full: shards_against(op, twin_full, assert_same_bits),
        )
        # For the record: how much of it is bit for bit the local reference as well.
        same = [
            f"{name} {np.mean(np.asarray(o.addressable_shards[0].data) == w):.6f}"
            for name, o, w in zip(("y", "scales", "residual_out"), op, want, strict=True)
        ]
        print(f"{me}: allreduce-{reduce_name} identical to the local reference: {same}", flush=True)
    wrapper = outputs[("allreduce", "x_dtype", "wrapper")]
    op_full = [
        np.asarray(o.addressable_shards[0].data) for o in outputs[("allreduce", "x_dtype", "op")]
    ]
    check(
        "allreduce-wrapper-bits-vs-shard_map",
        lambda: shards_against(wrapper, op_full, assert_same_bits),
    )
    twin_full = [
        np.asarray(o.addressable_shards[0].data) for o in outputs[("allreduce", "x_dtype", "twin")]
    ]
    check(
        "allreduce-auto-emulated-is-xla",
        lambda: shards_against(
            outputs[("allreduce", "x_dtype", "auto-emulated")], twin_full, assert_same_bits
        ),
    )
    check(
        "allreduce-one-shot-refuses-several-processes",
        lambda: _equal(refusal is not None and "several processes" in refusal, True),
    )
    for kind in meshes:
        out = outputs[("rows", kind)]
        row_sharding = NamedSharding(meshes[kind], P("tp", None))

        def rows_sharded(out=out, row_sharding=row_sharding):
            for o in out:
                assert o.sharding.is_equivalent_to(row_sharding, o.ndim), o.sharding
                for s in o.addressable_shards:
                    assert s.data.shape[0] == o.shape[0] // size, (s.index, s.data.shape)

        check(f"rows-{kind.name}-stay-sharded", rows_sharded)
        check(
            f"rows-{kind.name}-one-kernel-call-no-collectives",
            lambda kind=kind: _one_kernel_call_no_collectives(row_hlo[kind]),
        )
        check(
            f"rows-{kind.name}-vs-local-reference",
            lambda out=out: shards_against(out, expected["rows-reference"], assert_same_bits),
        )
        check(
            f"rows-{kind.name}-bits-vs-one-device",
            lambda out=out: shards_against(out, expected["rows"], assert_same_bits),
        )
        check(
            f"rows-{kind.name}-bits-vs-local-reference",
            lambda out=out: shards_against(out, expected["rows-reference"], assert_same_bits),
        )

    # 4. One collective after the checks, which both processes reach whatever failed: the
    # replicated outputs must be the same bits in both processes.
    digests = np.array(
        [
            zlib.crc32(np.asarray(o.addressable_shards[0].data).tobytes())
            for key in sorted(k for k in outputs if k[0] == "allreduce")
            for o in outputs[key]
        ],
        np.uint32,
    )
    everyone = np.asarray(multihost_utils.process_allgather(digests))
    check(
        "allreduce-same-bits-in-every-process",
        lambda: _equal(everyone.tolist(), [digests.tolist()] * NUM_PROCESSES),
    )
    jax.distributed.shutdown()

    elapsed = time.monotonic() - start
    if failures:
        print(f"FAILED {me}: {len(failures)} checks failed in {elapsed:.1f} s", flush=True)
        return 1
    print(f"PASS {me}: all checks in {elapsed:.1f} s", flush=True)
    return 0


def _equal(got, want):
    if got != want:
        raise AssertionError(f"{got} != {want}")


def _one_kernel_call_no_collectives(hlo: str) -> None:
    from helpers import collectives_in

    calls = hlo.count('custom_call_target="fp8norm_rms_norm_fp8"')
    assert calls == 1, f"{calls} kernel calls in the row-sharded program"
    assert not collectives_in(hlo), f"collectives in the row-sharded program: {collectives_in(hlo)}"


if __name__ == "__main__":
    sys.exit(main())
