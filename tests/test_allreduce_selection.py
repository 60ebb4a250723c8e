"""allreduce_residual_rms_norm_fp8 on 8 virtual CPU devices: the method auto lowers to,
where a method cannot run, bad input, the benchmark driver, the edges (an empty last axis, an
abstract mesh), and the emulated one-kernel handler: its peer memory traffic and its refusals.

The set-up the all-reduce tests share, and the rerun in a subprocess with 8 devices for a
session with fewer, are in allreduce_cases.py.
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import (
    HAVE_DEVICES,
    NUM_DEVICES,
    ONE_KERNEL,
    allreduce_inputs,
    assert_every_copy,
    auto_on_emulated_devices,
    emulated,
    fixed_order_reference,
    numpy_of,
    run_in_shard_map,
    tp_mesh,
    with_method,
)
from helpers import (
    TIERS,
    assert_same_bits,
    recipe,
    rerun_with_virtual_cpu_devices,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm
import jax_fp8norm as fp8norm
import jax_fp8norm._allreduce
import jax_fp8norm._ffi
import jax_fp8norm.simt
from jax_fp8norm.recipes import apply_recipe

if not HAVE_DEVICES:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(__file__, NUM_DEVICES, tier)

else:

    def _lowered(mesh, rows, hidden, **kw):
        """The lowered text of the op, from the inputs' shapes only."""
        size = mesh.shape["tp"]
        partials = jax.ShapeDtypeStruct(
            (size, rows, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp"))
        )
        replicated = NamedSharding(mesh, P())
        residual = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16, sharding=replicated)
        gamma = jax.ShapeDtypeStruct((hidden,), jnp.float32, sharding=replicated)
        fn = jax.shard_map(
            lambda p, r, g: fp8norm.allreduce_residual_rms_norm_fp8(
                p[0], r, g, axis_name="tp", **kw
            ),
            mesh=mesh,
            in_specs=(P("tp"), P(), P()),
            out_specs=(P(), P(), P()),
        )
        return jax.jit(fn).lower(partials, residual, gamma).as_text()

    @pytest.mark.parametrize(
        "size,rows,chosen",
        [
            (2, 8, "one_shot"),
            (2, 256, "one_shot"),
            (2, 512, "one_shot"),
            (4, 384, "one_shot"),
            (4, 512, "two_shot"),
            (8, 96, "one_shot"),
            (8, 128, "two_shot"),
            (8, 8192, "two_shot"),
        ],
    )
    def test_auto_on_the_emulated_devices_follows_the_table(size, rows, chosen):
        mesh = tp_mesh(size)
        payload = rows * 1024 * 2
        assert chosen == auto_on_emulated_devices(size, payload)
        with jax_fp8norm.simt.kernels():
            text = _lowered(mesh, rows, 1024)
        codes = re.findall(r"method = (\d+) : i64", text)
        if chosen == "xla":
            assert "fp8norm_simt_add_rms_norm_fp8" in text and not codes, text
            assert "all_reduce" in text
        else:
            assert codes == [str(jax_fp8norm._allreduce.method_code(chosen))], text
            assert "all_reduce" not in text

    def test_one_kernel_methods_where_they_cannot_run():
        mesh = tp_mesh(2)
        # The CPU kernels (no emulation): auto is XLA's all-reduce; an explicit method says why.
        assert "fp8norm_add_rms_norm_fp8" in _lowered(mesh, 8, 1024)
        with pytest.raises(ValueError, match="only under the SIMT emulation"):
            _lowered(mesh, 8, 1024, method="one_shot")
        with pytest.raises(ValueError, match="method must be one of"):
            _lowered(mesh, 8, 1024, method="nccl")
        # A tuple of axes: auto takes XLA's all-reduce, an explicit method refuses.
        grid = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices("cpu")[:4])
        partials, residual, gamma = allreduce_inputs(4, 4, 256)

        def over_both(method):
            return jax.jit(
                jax.shard_map(
                    lambda p, r, g: fp8norm.allreduce_residual_rms_norm_fp8(
                        p[0, 0], r, g, axis_name=("dp", "tp"), method=method
                    ),
                    mesh=grid,
                    in_specs=(P("dp", "tp"), P(), P()),
                    out_specs=(P(), P(), P()),
                )
            )(
                jax.device_put(partials.reshape(2, 2, 4, 256), NamedSharding(grid, P("dp", "tp"))),
                residual,
                gamma,
            )

        with jax_fp8norm.simt.kernels():
            auto = over_both("auto")
            with pytest.raises(ValueError, match="one mesh axis"):
                over_both("two_shot")
        assert_same_bits(numpy_of(auto), numpy_of(over_both("xla")))
        with pytest.raises(ValueError, match="'xla', 'one_shot' or 'two_shot'"):
            fixed_order_reference("auto", mesh, *allreduce_inputs(2, 4, 256))

    def test_unknown_axis_name():
        mesh = tp_mesh(2)
        partials, residual, gamma = allreduce_inputs(2, 4, 256)

        def bad(p, r, g, axis_name):
            return fp8norm.allreduce_residual_rms_norm_fp8(p, r, g, axis_name="dp")

        with pytest.raises(ValueError, match="axis_name 'dp' is not bound"):
            run_in_shard_map(bad, mesh, partials, residual, gamma)
        with pytest.raises(ValueError, match="axis_name 'tp' is not bound"):
            fp8norm.allreduce_residual_rms_norm_fp8(partials[0], residual, gamma, axis_name="tp")
        with pytest.raises(ValueError, match="axis_name 'dp' is not an axis of the mesh"):
            fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                partials, residual, gamma, mesh=mesh, axis_name="dp"
            )

    @pytest.mark.parametrize(
        "residual,error,match",
        [
            (np.zeros((4, 255), jnp.bfloat16), ValueError, "residual must have the shape"),
            (np.zeros((4, 256), np.float32), TypeError, "residual must have the dtype"),
        ],
    )
    def test_bad_residual(residual, error, match):
        partials, _, gamma = allreduce_inputs(2, 4, 256)
        with pytest.raises(error, match=match):
            run_in_shard_map(
                fp8norm.allreduce_residual_rms_norm_fp8, tp_mesh(2), partials, residual, gamma
            )

    def test_bad_reduce_dtype_and_partials():
        partials, residual, gamma = allreduce_inputs(2, 4, 256)
        with pytest.raises(TypeError, match="reduce_dtype must be"):
            run_in_shard_map(
                fp8norm.allreduce_residual_rms_norm_fp8,
                tp_mesh(2),
                partials,
                residual,
                gamma,
                reduce_dtype=jnp.int8,
            )
        with pytest.raises(ValueError, match="partials must have shape"):
            fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                partials[:1], residual, gamma, mesh=tp_mesh(2), axis_name="tp"
            )

    def test_allreduce_benchmark_runs_and_checks(capsys):
        from jax_fp8norm.bench import allreduce as bench

        argv = ["--rows", "17", "--hidden", "256", "--rounds", "1", "--devices", "2"]
        assert bench.main([*argv, "--emulate"]) == 0
        out = capsys.readouterr().out
        assert "2 x cpu (emulated CUDA kernels)" in out
        for name in ("xla all-reduce + jnp formula", "method='xla'", "method='two_shot'"):
            assert out.count(name) == 1, out
        assert bench.main(argv) == 0  # without the emulation: the XLA rows only
        assert "method='one_shot'" not in capsys.readouterr().out

    @pytest.mark.parametrize(
        "kw",
        [
            {},
            dict(group_size=4),
            dict(scale_dtype=jnp.float8_e8m0fnu),
            dict(power_of_two_scales=True),
            dict(static_scale=0.3, scale_dtype=jnp.bfloat16),
            recipe("nvfp4", global_scale=0.5),
        ],
        ids=["row", "group", "e8m0", "power_of_two", "static", "nvfp4"],
    )
    def test_an_empty_last_axis_inside_shard_map(kw):
        # N == 0 is defined (docs/spec.md): every op, every method, as outside shard_map.
        mesh = tp_mesh(4)
        partials = np.zeros((4, 3, 0), jnp.bfloat16)
        residual = np.zeros((3, 0), jnp.bfloat16)
        gamma = np.zeros((0,), np.float32)
        want = numpy_of(
            jax.jit(functools.partial(fp8norm.reference.add_rms_norm_fp8, **kw))(
                residual, residual, gamma
            )
        )
        per_row = apply_recipe(kw).get("group_size") is None
        assert want[1].shape == ((3, 1) if per_row else (3, 0))
        for method in ("xla", "auto", *ONE_KERNEL):
            assert_every_copy(with_method(method, mesh, partials, residual, gamma, **kw), want)
        sharded = NamedSharding(mesh, P("tp"))
        rows = jax.device_put(np.zeros((4, 0), jnp.bfloat16), sharded)
        for emulating in (contextlib.nullcontext(), jax_fp8norm.simt.kernels()):
            with emulating:
                got = jax.jit(
                    jax.shard_map(
                        lambda x, g: (
                            *fp8norm.rms_norm_fp8(x, g, **kw),
                            *fp8norm.add_rms_norm_fp8(x, x, g, **kw),
                        ),
                        mesh=mesh,
                        in_specs=(P("tp"), P()),
                        out_specs=P("tp"),
                    )
                )(rows, gamma)
            ref = jax.jit(
                lambda x, g: (
                    *fp8norm.reference.rms_norm_fp8(x, g, **kw),
                    *fp8norm.reference.add_rms_norm_fp8(x, x, g, **kw),
                )
            )(np.zeros((4, 0), jnp.bfloat16), gamma)
            assert_same_bits(numpy_of(got), numpy_of(ref))

    def test_an_abstract_mesh():
        # Without concrete devices (jax.export over an AbstractMesh) auto is XLA's
        # all-reduce, and an explicit one-kernel method says why it cannot run.
        mesh = jax.sharding.AbstractMesh((4,), ("tp",))
        # Placed as in_specs says: where the mesh's axes are Explicit (jax 0.12's default),
        # shard_map checks the arguments' shardings against it.
        args = (
            jax.ShapeDtypeStruct((4, 8, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp"))),
            jax.ShapeDtypeStruct((8, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
            jax.ShapeDtypeStruct((256,), jnp.float32, sharding=NamedSharding(mesh, P())),
        )

        def exported(method):
            fn = jax.shard_map(
                lambda p, r, g: fp8norm.allreduce_residual_rms_norm_fp8(
                    p[0], r, g, axis_name="tp", method=method
                ),
                mesh=mesh,
                in_specs=(P("tp"), P(), P()),
                out_specs=(P(), P(), P()),
            )
            export = jax.export.export(
                jax.jit(fn), platforms=["cpu"], disabled_checks=fp8norm.EXPORT_DISABLED_CHECKS
            )
            return export(*args).mlir_module()

        with jax_fp8norm.simt.kernels():
            text = exported("auto")
            assert "all_reduce" in text and "fp8norm_simt_add_rms_norm_fp8" in text
            assert "allreduce_rms_norm_fp8" not in text
            for method in ONE_KERNEL:
                with pytest.raises(ValueError, match="a mesh of concrete devices"):
                    exported(method)

    def _peer_traffic(launches, size):
        """{position: (bytes read from peers, bytes written to peers)} of one call."""
        traffic = {}
        for launch in launches:
            spaces = {
                int(name.rsplit(" ", 1)[1]): stats
                for name, stats in launch["buffers"].items()
                if name.startswith("workspace of device ")
            }
            if len(spaces) != size:
                continue
            own = max(spaces, key=lambda k: spaces[k]["bytes_written"])
            peers = [spaces[k] for k in spaces if k != own]
            traffic[own] = (
                sum(p["bytes_read"] for p in peers),
                sum(p["bytes_written"] for p in peers),
            )
        return traffic

    @pytest.mark.sampled(2)
    @pytest.mark.parametrize("method", ONE_KERNEL)
    @pytest.mark.parametrize("size,rows", [(2, 8), (4, 10), (8, 3)])
    def test_peer_memory_traffic_is_the_design(method, size, rows):
        # docs/performance.md's bytes per device and call: one-shot reads every peer's
        # partial of every row; two-shot reads every peer's partial of its own slice and
        # every peer's outputs of theirs. Both write only flags (4 bytes per block, peer
        # and exchange) to their peers.
        hidden, x_bytes = 1024, 2
        mesh = tp_mesh(size)
        partials, residual, gamma = allreduce_inputs(size, rows, hidden)
        jax_fp8norm.simt.take_launches()
        emulated(method, mesh, partials, residual, gamma)
        traffic = _peer_traffic(jax_fp8norm.simt.take_launches(), size)
        assert sorted(traffic) == list(range(size))
        slices = [rows * k // size for k in range(size + 1)]
        for d, (read, written) in traffic.items():
            own = slices[d + 1] - slices[d]
            if method == "one_shot":
                blocks = min(rows, 64)
                want_read = (size - 1) * rows * hidden * x_bytes
                want_written = (size - 1) * blocks * 4
            else:
                blocks = min(-(-rows // size), 64)
                others = rows - own
                out_row = hidden * 1 + 4 + hidden * x_bytes  # y, one float32 scale, residual_out
                want_read = (size - 1) * own * hidden * x_bytes + others * out_row
                want_written = 2 * (size - 1) * blocks * 4
            assert (read, written) == (want_read, want_written), (d, method)

    def _raw_allreduce(mesh, partials, residual, gamma, **changes):
        """The emulated all-reduce's custom call with the attributes its lowering gives
        (jax_fp8norm._primitives), some of them changed: the handler's own refusals."""
        size, rows, hidden = partials.shape
        attributes = dict(
            eps=np.float32(1e-6),
            weight_offset=np.float32(0),
            scale_ub=np.float32(np.inf),
            group_size=np.int64(0),
            power_of_two_scales=False,
            fp4_layout=np.int64(jax_fp8norm._ffi.fp4_layout("cpu")),
            with_inverse_rms=False,
            columnwise=False,
            with_amax=False,
            per_row_global_scale=False,
            hadamard_mask=np.int64(-1),
            call_site=np.int64(np.random.default_rng().integers(1 << 62)),
            devices=np.array([d.id for d in mesh.devices.flat], np.int64),
            group_devices=np.int64(size),
            method=np.int64(jax_fp8norm._allreduce.method_code("one_shot")),
            rows=np.int64(rows),
            hidden=np.int64(hidden),
        )
        attributes.update(changes)
        call = jax.ffi.ffi_call(
            jax_fp8norm._ffi.EMULATED_TARGETS["allreduce_rms_norm_fp8"],
            (
                jax.ShapeDtypeStruct((rows, hidden), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((rows, 1), jnp.float32),
                jax.ShapeDtypeStruct((rows, hidden), partials.dtype),
            ),
        )
        fn = jax.shard_map(
            lambda p, r, g: tuple(o[None] for o in call(p[0], r, g, **attributes)),
            mesh=mesh,
            in_specs=(P("tp"), P(), P()),
            out_specs=P("tp"),
            check_vma=False,
        )
        placed = jax.device_put(partials, NamedSharding(mesh, P("tp")))
        return numpy_of(jax.block_until_ready(jax.jit(fn)(placed, residual, gamma)))

    def test_the_allreduce_handler_refuses_what_its_lowering_never_sends():
        mesh = tp_mesh(4)
        args = allreduce_inputs(4, 5, 256)
        # As lowered, the call runs and gives the op's bits: the refusals below are the
        # changed attribute's alone.
        assert_every_copy(
            _raw_allreduce(mesh, *args), fixed_order_reference("one_shot", mesh, *args)
        )
        others = np.array([d.id for d in jax.devices("cpu")[4:8]], np.int64)
        for changes, message in [
            (dict(group_devices=np.int64(0)), "groups must have 1 to 8 devices"),
            (dict(group_devices=np.int64(3)), "groups must have 1 to 8 devices"),
            (dict(group_devices=np.int64(16)), "groups must have 1 to 8 devices"),
            (dict(method=np.int64(7)), "unknown all-reduce method 7"),
            (dict(rows=np.int64(6)), "do not have the rows and hidden size"),
            (dict(hidden=np.int64(0)), "the all-reduce's rows and hidden size"),
            (dict(devices=others), "has no all-reduce workspace for this call"),
            (dict(with_inverse_rms=True), "only the plain form"),
            (dict(with_amax=True), "only the plain form"),
            (dict(per_row_global_scale=True), "only the plain form"),
            (dict(hadamard_mask=np.int64(0)), "only the plain form"),
            # Decoded as one struct of every attribute: a stray one, or one of another
            # type, is the FFI's refusal.
            (dict(stray=np.int64(0)), "Wrong number of attributes"),
            (dict(rows=np.int32(5)), "Wrong scalar data type"),
        ]:
            with pytest.raises(jax.errors.JaxRuntimeError, match=message):
                _raw_allreduce(mesh, *args, **changes)
