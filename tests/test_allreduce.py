"""allreduce_residual_rms_norm_fp8 under shard_map, on 8 virtual CPU devices.

The virtual devices must be requested before jax starts, so in a normal test session this
module only runs itself again in a subprocess with XLA_FLAGS set, leaving the other
modules' single-device session alone; the subprocess runs the real cases.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    EXTENDED,
    REQUIRE_GPU,
    TIERS,
    assert_matches_reference,
    assert_same_bits,
    gpu_devices,
    random_gamma,
    random_rows,
    rerun_with_virtual_cpu_devices,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm
import jax_fp8norm as fp8norm
import jax_fp8norm._allreduce
import jax_fp8norm.simt

NUM_DEVICES = 8
HAVE_DEVICES = len(jax.devices("cpu")) >= NUM_DEVICES


if not HAVE_DEVICES:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(__file__, NUM_DEVICES, tier)

else:

    def _mesh(size: int) -> jax.sharding.Mesh:
        return jax.make_mesh((size,), ("tp",), devices=jax.devices("cpu")[:size])

    def _run(op, mesh, partials, residual, gamma, **kw):
        """op inside shard_map: each device gets its own partial sum."""

        def per_device(p, r, g):
            return op(p[0], r, g, axis_name="tp", **kw)

        fn = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P(), P())
        )
        placed = (
            jax.device_put(partials, NamedSharding(mesh, P("tp"))),
            jax.device_put(residual, NamedSharding(mesh, P())),
            jax.device_put(gamma, NamedSharding(mesh, P())),
        )
        return jax.jit(fn)(*placed)

    def _kernel_and_reference(mesh, partials, residual, gamma, **kw):
        """The op and its reference twin under the same shard_map, as NumPy."""
        return [
            _run(op, mesh, partials, residual, gamma, **kw)
            for op in (
                fp8norm.allreduce_residual_rms_norm_fp8,
                fp8norm.reference.allreduce_residual_rms_norm_fp8,
            )
        ]

    def _numpy(outputs):
        return [np.asarray(o) for o in outputs]

    def _inputs(size, rows, hidden, dtype=jnp.bfloat16):
        partials = random_rows(rows * 7 + size, (size, rows, hidden), dtype, spread=0.5)
        residual = random_rows(rows + 1, (rows, hidden), dtype, spread=0.5)
        gamma = random_gamma(hidden, hidden, jnp.float32)
        return partials, residual, gamma

    def _assert_same_on_every_device(outputs):
        for out in outputs:
            shards = [np.asarray(s.data).view(np.uint8) for s in out.addressable_shards]
            assert len(shards) >= 1
            for shard in shards[1:]:
                np.testing.assert_array_equal(shard, shards[0])

    @pytest.mark.sampled(23)
    @pytest.mark.parametrize("size", [1, 2, 4, 8])
    @pytest.mark.parametrize("rows", [1, 8, 17, 20, 1024])
    @pytest.mark.parametrize("hidden", [4096, 8192])
    @pytest.mark.parametrize("reduce_dtype", [None, jnp.float32], ids=["x_dtype", "float32"])
    def test_matches_reference(size, rows, hidden, reduce_dtype):
        mesh = _mesh(size)
        partials, residual, gamma = _inputs(size, rows, hidden)
        out, ref = _kernel_and_reference(mesh, partials, residual, gamma, reduce_dtype=reduce_dtype)
        assert out[0].shape == (rows, hidden) and out[0].dtype == jnp.float8_e4m3fn
        assert out[1].shape == (rows, 1) and out[2].dtype == jnp.bfloat16
        assert_same_bits(_numpy(out), _numpy(ref))
        _assert_same_on_every_device(out)

    @pytest.mark.parametrize("size", [2, 8])
    def test_float32_reduction_matches_the_unsharded_sum(size):
        # In float32 the sum of the partials, added to the residual in float32, is the
        # add_rms_norm_fp8 of that sum: compare with the reference on one device. XLA's CPU
        # all-reduce adds the partials in device order (x_0 + x_1 + ...); should that
        # order change, this test says so.
        partials, residual, gamma = _inputs(size, 20, 4096)
        out = _run(
            fp8norm.allreduce_residual_rms_norm_fp8,
            _mesh(size),
            partials,
            residual,
            gamma,
            reduce_dtype=jnp.float32,
        )
        total = functools.reduce(np.add, partials.astype(np.float32))
        h = total + residual.astype(np.float32)
        ref = jax.jit(fp8norm.reference.add_rms_norm_fp8)(h, np.zeros_like(h), gamma)
        ref = [np.asarray(ref[0]), np.asarray(ref[1]), h.astype(jnp.bfloat16)]
        assert_same_bits(_numpy(out), ref)

    def test_keywords_and_dtypes_pass_through():
        mesh = _mesh(4)
        partials, residual, gamma = _inputs(4, 8, 512, jnp.float16)
        kw = dict(
            scale_ub=0.05,
            weight_offset=1.0,
            out_dtype=jnp.float8_e4m3fnuz,
            scale_dtype=jnp.bfloat16,
        )
        out, ref = _kernel_and_reference(mesh, partials, residual, gamma, **kw)
        assert out[0].dtype == jnp.float8_e4m3fnuz and out[1].dtype == jnp.bfloat16
        assert_same_bits(_numpy(out), _numpy(ref))

    @pytest.mark.parametrize(
        "kw",
        [
            dict(group_size=128),
            dict(group_size=32, scale_dtype=jnp.float8_e8m0fnu),
            dict(group_size=128, power_of_two_scales=True, reduce_dtype=jnp.float32),
            dict(static_scale=0.02),
            dict(
                group_size=16,
                out_dtype=jnp.float4_e2m1fn,
                scale_dtype=jnp.float8_e4m3fn,
                global_scale=0.003,
            ),
            dict(group_size=32, out_dtype=jnp.float4_e2m1fn, scale_dtype=jnp.float8_e8m0fnu),
        ],
        ids=["group128", "mxfp8", "ue8m0-float32", "static", "nvfp4", "mxfp4"],
    )
    def test_block_scaled_and_static_scales(kw):
        mesh = _mesh(4)
        partials, residual, gamma = _inputs(4, 17, 1024)
        out, ref = _kernel_and_reference(mesh, partials, residual, gamma, **kw)
        groups = 1024 // kw["group_size"] if "group_size" in kw else 1
        assert out[1].shape == (17, groups)
        assert_same_bits(out, ref)
        _assert_same_on_every_device(out)
        # The wrapper for callers outside shard_map, a static scale as an array.
        for name in ("static_scale", "global_scale"):
            if name in kw:
                kw = dict(kw, **{name: jnp.float32(kw[name])})
        wrapped = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
            partials, residual, gamma, mesh=mesh, axis_name="tp", **kw
        )
        assert_same_bits(wrapped, out)

    def test_sharded_wrapper_for_callers_outside_shard_map():
        mesh = _mesh(8)
        partials, residual, gamma = _inputs(8, 17, 4096)
        out = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
            partials, residual, gamma, mesh=mesh, axis_name="tp"
        )
        ref = _run(
            fp8norm.reference.allreduce_residual_rms_norm_fp8, mesh, partials, residual, gamma
        )
        assert_same_bits(_numpy(out), _numpy(ref))
        assert all(o.sharding.is_fully_replicated for o in out)
        _assert_same_on_every_device(out)
        # The same under an outer jit.
        jitted = jax.jit(
            lambda p, r, g: fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                p, r, g, mesh=mesh, axis_name="tp"
            )
        )(partials, residual, gamma)
        assert_same_bits(jitted, out)

    @pytest.mark.parametrize("reduce_dtype", [None, jnp.float32], ids=["x_dtype", "float32"])
    def test_compiled_hlo_is_one_all_reduce_and_the_custom_call(reduce_dtype):
        mesh = _mesh(8)
        partials, residual, gamma = _inputs(8, 64, 4096)

        def fn(p, r, g):
            return fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                p, r, g, mesh=mesh, axis_name="tp", reduce_dtype=reduce_dtype
            )

        hlo = jax.jit(fn).lower(partials, residual, gamma).compile().as_text()
        assert len(re.findall(r"\ball-reduce(?:-start)?\(", hlo)) == 1, hlo
        assert hlo.count('custom_call_target="fp8norm_add_rms_norm_fp8"') == 1, hlo
        for op in ("all-gather", "all-to-all", "reduce-scatter", "transpose(", " copy("):
            assert op not in hlo, (op, hlo)

    def test_unknown_axis_name():
        mesh = _mesh(2)
        partials, residual, gamma = _inputs(2, 4, 256)

        def bad(p, r, g, axis_name):
            return fp8norm.allreduce_residual_rms_norm_fp8(p, r, g, axis_name="dp")

        with pytest.raises(ValueError, match="axis_name 'dp' is not bound"):
            _run(bad, mesh, partials, residual, gamma)
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
        partials, _, gamma = _inputs(2, 4, 256)
        with pytest.raises(error, match=match):
            _run(fp8norm.allreduce_residual_rms_norm_fp8, _mesh(2), partials, residual, gamma)

    def test_bad_reduce_dtype_and_partials():
        partials, residual, gamma = _inputs(2, 4, 256)
        with pytest.raises(TypeError, match="reduce_dtype must be"):
            _run(
                fp8norm.allreduce_residual_rms_norm_fp8,
                _mesh(2),
                partials,
                residual,
                gamma,
                reduce_dtype=jnp.int8,
            )
        with pytest.raises(ValueError, match="partials must have shape"):
            fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                partials[:1], residual, gamma, mesh=_mesh(2), axis_name="tp"
            )

    @pytest.mark.parametrize("tp", [1, 8])
    def test_llama_block_example(tp):
        from jax_fp8norm.examples import llama_tp_block

        errors = llama_tp_block.run(tp, platform="cpu")
        assert errors["platform"] == "cpu"
        assert errors["residual"] <= llama_tp_block.RESIDUAL_TOLERANCE
        assert errors["next_input"] <= llama_tp_block.NEXT_INPUT_TOLERANCE
        assert errors["devices_identical"] == 1.0

    @pytest.mark.parametrize("method", [pytest.param("one_shot", marks=EXTENDED), "two_shot"])
    def test_llama_block_example_one_kernel(method):
        from jax_fp8norm.examples import llama_tp_block

        config = llama_tp_block.Config(allreduce_method=method)
        errors = llama_tp_block.run(4, config, platform="cpu")
        assert errors["emulated"] == 1.0
        assert errors["residual"] <= llama_tp_block.RESIDUAL_TOLERANCE
        assert errors["next_input"] <= llama_tp_block.NEXT_INPUT_TOLERANCE
        assert errors["devices_identical"] == 1.0
        with pytest.raises(ValueError, match="allreduce_method must be one of"):
            llama_tp_block.Config(allreduce_method="nccl")

    @pytest.mark.parametrize("fp4", ["nvfp4", "mxfp4"])
    def test_llama_block_example_fp4(fp4):
        from jax_fp8norm.examples import llama_tp_block

        config = llama_tp_block.Config(fp4=fp4)
        errors = llama_tp_block.run(8, config, platform="cpu")
        residual_tolerance, next_tolerance = llama_tp_block.tolerances(config)
        assert (residual_tolerance, next_tolerance) == llama_tp_block.FP4_TOLERANCES[fp4]
        assert errors["residual"] <= residual_tolerance
        assert errors["next_input"] <= next_tolerance
        # FP4 loses more than FP8, but only that: a lost global or block scale would be
        # far off.
        assert errors["residual"] > llama_tp_block.RESIDUAL_TOLERANCE
        assert errors["devices_identical"] == 1.0

    def test_llama_block_example_fp4_config():
        from jax_fp8norm.examples import llama_tp_block

        with pytest.raises(ValueError, match="fp4 must be one of"):
            llama_tp_block.Config(fp4="fp4")
        with pytest.raises(ValueError, match="group_size is fixed"):
            llama_tp_block.Config(fp4="nvfp4", group_size=128)

    # ------------------------------------------------------------ one-kernel methods
    # method="one_shot" / "two_shot": the CUDA kernel, emulated (jax_fp8norm.simt), one
    # virtual CPU device per GPU. The outputs must equal the reference twin's fixed-order
    # fold bit for bit, on every device. kernel_check holds the kernel to the CPU kernel at
    # more shapes, in long sequences and replays, and reports deadlocks.

    ONE_KERNEL = ("one_shot", "two_shot")

    def _fixed_order_reference(method, mesh, *args, **kw):
        """The reference twin's outputs for ``method``, as NumPy."""
        op = fp8norm.reference.allreduce_residual_rms_norm_fp8
        return _numpy(_run(op, mesh, *args, method=method, **kw))

    def _emulated(method, mesh, *args, **kw):
        """The op's outputs for ``method``, the CUDA kernels emulated, as NumPy."""
        with jax_fp8norm.simt.kernels():
            op = fp8norm.allreduce_residual_rms_norm_fp8
            # Every device's call done, not only the one whose copy NumPy reads.
            return _numpy(jax.block_until_ready(_run(op, mesh, *args, method=method, **kw)))

    def _run_stacked(op, mesh, partials, residual, gamma, **kw):
        """op inside shard_map, each device's outputs stacked (out_specs P("tp")), so that
        every device's copy is compared."""

        def per_device(p, r, g):
            return tuple(o[None] for o in op(p[0], r, g, axis_name="tp", **kw))

        fn = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P("tp"), P(), P()),
            out_specs=(P("tp"), P("tp"), P("tp")),
            check_vma=False,
        )
        return jax.jit(fn)(jax.device_put(partials, NamedSharding(mesh, P("tp"))), residual, gamma)

    @pytest.mark.sampled(8)
    @pytest.mark.parametrize("method", ONE_KERNEL)
    @pytest.mark.parametrize("size", [2, 4, 8])
    @pytest.mark.parametrize("rows", [1, 7, 33])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
    def test_one_kernel_matches_the_fixed_order_reference(method, size, rows, dtype):
        mesh = _mesh(size)
        partials, residual, gamma = _inputs(size, rows, 1024, dtype)
        with jax_fp8norm.simt.kernels():
            out = _run_stacked(
                fp8norm.allreduce_residual_rms_norm_fp8,
                mesh,
                partials,
                residual,
                gamma,
                method=method,
            )
        ref = _run_stacked(
            fp8norm.reference.allreduce_residual_rms_norm_fp8,
            mesh,
            partials,
            residual,
            gamma,
            method=method,
        )
        assert out[0].shape == (size, rows, 1024) and out[2].dtype == dtype
        assert_same_bits(_numpy(out), _numpy(ref))
        for o in _numpy(out):  # every device holds the same bits
            for d in range(1, size):
                np.testing.assert_array_equal(o[d].view(np.uint8), o[0].view(np.uint8))

    def test_fixed_order_reference_is_the_left_fold():
        # The reference states the order: ((x_0 + x_1) + x_2) + x_3 in float32, then the
        # residual; the same as NumPy's left fold on one device.
        mesh = _mesh(4)
        partials, residual, gamma = _inputs(4, 9, 1024)
        ref = _fixed_order_reference("one_shot", mesh, partials, residual, gamma)
        total = partials[0].astype(np.float32)
        for k in range(1, 4):
            total = total + partials[k].astype(np.float32)
        h = total + residual.astype(np.float32)
        y, scales, _ = jax.jit(fp8norm.reference.add_rms_norm_fp8)(h, np.zeros_like(h), gamma)
        assert_same_bits(ref, [np.asarray(y), np.asarray(scales), h.astype(jnp.bfloat16)])
        # ... and not the same bits as XLA's bfloat16 all-reduce.
        xla = _fixed_order_reference("xla", mesh, partials, residual, gamma)
        assert not np.array_equal(xla[2].view(np.uint16), ref[2].view(np.uint16))

    @pytest.mark.sampled(4)
    @pytest.mark.parametrize("method", ONE_KERNEL)
    @pytest.mark.parametrize(
        "kw",
        [
            dict(group_size=128),
            dict(group_size=32, scale_dtype=jnp.float8_e8m0fnu),
            dict(static_scale=0.02),
            dict(
                group_size=16,
                out_dtype=jnp.float4_e2m1fn,
                scale_dtype=jnp.float8_e4m3fn,
                global_scale=0.003,
            ),
            dict(group_size=32, out_dtype=jnp.float4_e2m1fn, scale_dtype=jnp.float8_e8m0fnu),
            dict(scale_ub=0.05, weight_offset=1.0, out_dtype=jnp.float8_e4m3fnuz),
        ],
        ids=["group128", "mxfp8", "static", "nvfp4", "mxfp4", "ub-offset-fnuz"],
    )
    def test_one_kernel_keywords(method, kw):
        mesh = _mesh(4)
        partials, residual, gamma = _inputs(4, 10, 1024)
        out = _emulated(method, mesh, partials, residual, gamma, **kw)
        ref = _fixed_order_reference(method, mesh, partials, residual, gamma, **kw)
        assert_same_bits(out, ref)
        # The wrapper for callers outside shard_map takes the method too.
        with jax_fp8norm.simt.kernels():
            wrapped = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                partials, residual, gamma, mesh=mesh, axis_name="tp", method=method, **kw
            )
        assert_same_bits(_numpy(wrapped), ref)

    @pytest.mark.parametrize("method", ONE_KERNEL)
    def test_one_kernel_in_a_scan_of_25_calls(method):
        # A decoder's residual stream: each call's residual_out is the next one's residual,
        # 25 calls of one compiled custom call (one workspace, the epochs on the device).
        mesh = _mesh(4)
        steps, rows, hidden = 25, 5, 1024
        partials = random_rows(3, (4, steps, rows, hidden), jnp.bfloat16, spread=0.5)
        residual = random_rows(4, (rows, hidden), jnp.bfloat16, spread=0.5)
        gamma = random_gamma(5, hidden, jnp.float32)

        def layers(op, p, r, g):
            def step(res, x):
                y, s, res = op(x, res, g, axis_name="tp", method=method)
                return res, (y, s)

            return jax.lax.scan(step, r, p[0])

        def run(op):
            fn = jax.shard_map(
                functools.partial(layers, op),
                mesh=mesh,
                in_specs=(P("tp"), P(), P()),
                out_specs=(P(), (P(), P())),
            )
            placed = jax.device_put(partials, NamedSharding(mesh, P("tp")))
            return jax.jit(fn)(placed, residual, gamma)

        with jax_fp8norm.simt.kernels():
            out = run(fp8norm.allreduce_residual_rms_norm_fp8)
        ref = run(fp8norm.reference.allreduce_residual_rms_norm_fp8)
        assert_same_bits(jax.tree.leaves(out), jax.tree.leaves(ref))
        assert out[1][0].shape == (steps, rows, hidden)

    def test_one_kernel_replayed_calls_and_a_2d_mesh():
        # One compiled function called again and again, with other inputs in between: no
        # call sees another's data. Then tensor parallel over "tp" inside a (2, 4) mesh: one
        # group per "dp" row.
        mesh = _mesh(4)
        a = _inputs(4, 6, 1024)
        b = _inputs(4, 6, 1024, jnp.bfloat16)
        b = (b[0][::-1].copy(), b[1] * 2, b[2])
        with jax_fp8norm.simt.kernels():
            fn = jax.jit(
                jax.shard_map(
                    lambda p, r, g: fp8norm.allreduce_residual_rms_norm_fp8(
                        p[0], r, g, axis_name="tp", method="two_shot"
                    ),
                    mesh=mesh,
                    in_specs=(P("tp"), P(), P()),
                    out_specs=(P(), P(), P()),
                )
            )
            stacked = NamedSharding(mesh, P("tp"))
            runs = [_numpy(fn(jax.device_put(p, stacked), r, g)) for p, r, g in (a, b, a, a, b)]
        for args, got in zip((a, b, a, a, b), runs, strict=True):
            assert_same_bits(got, _fixed_order_reference("two_shot", mesh, *args))

        grid = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices("cpu")[:8])
        partials = random_rows(8, (4, 16, 512), jnp.bfloat16, spread=0.5)
        residual = random_rows(9, (16, 512), jnp.bfloat16, spread=0.5)
        gamma = random_gamma(10, 512, jnp.float32)

        def run(op, **kw):
            return jax.jit(
                jax.shard_map(
                    lambda p, r, g: op(p[0], r, g, axis_name="tp", method="one_shot"),
                    mesh=grid,
                    in_specs=(P("tp", "dp"), P("dp"), P()),
                    out_specs=(P("dp"), P("dp"), P("dp")),
                )
            )(
                jax.device_put(partials, NamedSharding(grid, P("tp", "dp"))),
                jax.device_put(residual, NamedSharding(grid, P("dp"))),
                gamma,
            )

        with jax_fp8norm.simt.kernels():
            out = run(fp8norm.allreduce_residual_rms_norm_fp8)
        assert_same_bits(
            _numpy(out), _numpy(run(fp8norm.reference.allreduce_residual_rms_norm_fp8))
        )

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
            (2, 512, "xla"),
            (4, 384, "one_shot"),
            (4, 512, "two_shot"),
            (8, 96, "one_shot"),
            (8, 128, "two_shot"),
            (8, 8192, "xla"),
        ],
    )
    def test_auto_on_the_emulated_devices_follows_the_table(size, rows, chosen):
        mesh = _mesh(size)
        payload = rows * 1024 * 2
        assert chosen == jax_fp8norm._allreduce.select(
            "auto",
            platform="cpu",
            emulating=True,
            cuda_built=False,
            processes=1,
            num_devices=size,
            payload_bytes=payload,
        )
        with jax_fp8norm.simt.kernels():
            text = _lowered(mesh, rows, 1024)
        codes = re.findall(r"method = (\d+) : i64", text)
        if chosen == "xla":
            assert "fp8norm_simt_add_rms_norm_fp8" in text and not codes, text
            assert "all_reduce" in text
        else:
            assert codes == [str(jax_fp8norm._allreduce.METHOD_CODES[chosen])], text
            assert "all_reduce" not in text

    def test_one_kernel_methods_where_they_cannot_run():
        mesh = _mesh(2)
        # The CPU kernels (no emulation): auto is XLA's all-reduce; an explicit method says why.
        assert "fp8norm_add_rms_norm_fp8" in _lowered(mesh, 8, 1024)
        with pytest.raises(ValueError, match="only under the SIMT emulation"):
            _lowered(mesh, 8, 1024, method="one_shot")
        with pytest.raises(ValueError, match="method must be one of"):
            _lowered(mesh, 8, 1024, method="nccl")
        # A tuple of axes: auto takes XLA's all-reduce, an explicit method refuses.
        grid = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices("cpu")[:4])
        partials, residual, gamma = _inputs(4, 4, 256)

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
        assert_same_bits(_numpy(auto), _numpy(over_both("xla")))
        with pytest.raises(ValueError, match="'xla', 'one_shot' or 'two_shot'"):
            _fixed_order_reference("auto", mesh, *_inputs(2, 4, 256))

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
        mesh = _mesh(size)
        partials, residual, gamma = _inputs(size, rows, hidden)
        jax_fp8norm.simt.take_launches()
        _emulated(method, mesh, partials, residual, gamma)
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

    def test_allreduce_benchmark_runs_and_checks(capsys):
        from jax_fp8norm.bench import allreduce as bench

        argv = ["--rows", "3,17", "--hidden", "256", "--rounds", "1", "--devices", "2"]
        assert bench.main([*argv, "--emulate"]) == 0
        out = capsys.readouterr().out
        assert "2 x cpu (emulated CUDA kernels)" in out
        for name in ("xla all-reduce + jnp formula", "method='xla'", "method='two_shot'"):
            assert out.count(name) == 2, out
        assert bench.main(argv) == 0  # without the emulation: the XLA rows only
        assert "method='one_shot'" not in capsys.readouterr().out

    @pytest.mark.parametrize("method", ONE_KERNEL)
    def test_one_kernel_on_the_gpus(method):
        # Every GPU jax sees, in one group (one GPU: the n = 1 path); the accuracy rule
        # against the reference twin, the same bits on every GPU.
        gpus = gpu_devices()
        if not gpus:
            if REQUIRE_GPU:
                pytest.fail("FP8NORM_REQUIRE_GPU is set but no GPU backend is available")
            pytest.skip("no GPU backend available to jax")
        mesh = jax.make_mesh((len(gpus),), ("tp",), devices=gpus)
        for rows in (1, 7, 64):
            partials, residual, gamma = _inputs(len(gpus), rows, 4096)
            out = _run(
                fp8norm.allreduce_residual_rms_norm_fp8,
                mesh,
                partials,
                residual,
                gamma,
                method=method,
            )
            ref = _run(
                fp8norm.reference.allreduce_residual_rms_norm_fp8,
                mesh,
                partials,
                residual,
                gamma,
                method=method,
            )
            assert_matches_reference(_numpy(out), _numpy(ref))
            _assert_same_on_every_device(out)

    def test_one_kernel_under_vmap_pmap_and_varying_operands():
        mesh = _mesh(4)
        partials, residual, gamma = _inputs(4, 6, 256)
        # vmap inside shard_map: the batch joins the rows, one call.
        batched = np.stack([partials, partials[::-1]], axis=1)  # [4, 2, 6, 256]

        def run(op, **kw):
            def per_device(p, r, g):
                return jax.vmap(lambda x: op(x, r, g, axis_name="tp", **kw))(p[0])

            return jax.jit(
                jax.shard_map(per_device, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P())
            )(jax.device_put(batched, NamedSharding(mesh, P("tp"))), residual, gamma)

        with jax_fp8norm.simt.kernels():
            out = run(fp8norm.allreduce_residual_rms_norm_fp8, method="two_shot")
        assert out[0].shape == (2, 6, 256)
        # The reference per batch element: XLA compiles the vmapped reference's scalar
        # divisions otherwise (a reciprocal, one unit off in some scales).
        for k in range(2):
            ref = _fixed_order_reference("two_shot", mesh, batched[:, k], residual, gamma)
            assert_same_bits([o[k] for o in _numpy(out)], ref)

        # A residual that differs between devices: the outputs vary over the axis too.
        def varying(p, r, g):
            outs = fp8norm.allreduce_residual_rms_norm_fp8(
                p[0], r[0], g, axis_name="tp", method="one_shot"
            )
            assert all("tp" in jax.typeof(o).manual_axis_type.varying for o in outs)
            return tuple(o[None] for o in outs)

        residuals = np.stack([residual] * 4)
        with jax_fp8norm.simt.kernels():
            jax.jit(
                jax.shard_map(
                    varying, mesh=mesh, in_specs=(P("tp"), P("tp"), P()), out_specs=P("tp")
                )
            )(
                jax.device_put(partials, NamedSharding(mesh, P("tp"))),
                jax.device_put(residuals, NamedSharding(mesh, P("tp"))),
                gamma,
            )

        # pmap (a shard_map over its devices in this jax): the one-kernel methods run there.
        def under_pmap(op, method):
            return jax.pmap(
                lambda p: op(p, residual, gamma, axis_name="i", method=method),
                axis_name="i",
                devices=jax.devices("cpu")[:4],
            )(partials)

        with jax_fp8norm.simt.kernels():
            got = under_pmap(fp8norm.allreduce_residual_rms_norm_fp8, "one_shot")
        want = under_pmap(fp8norm.reference.allreduce_residual_rms_norm_fp8, "one_shot")
        assert_same_bits(_numpy(got), _numpy(want))
