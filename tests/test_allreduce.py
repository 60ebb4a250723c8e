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
    TIERS,
    assert_same_bits,
    random_gamma,
    random_rows,
    rerun_with_virtual_cpu_devices,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm

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
