"""allreduce_residual_rms_norm_fp8 under shard_map with method="xla" (XLA's all-reduce,
then the kernel), on 8 virtual CPU devices: the reference twin's bits, the keywords and
formats, the wrapper for callers outside shard_map, the compiled HLO, and the Llama
tensor-parallel block example.

The set-up the all-reduce tests share, and the rerun in a subprocess with 8 devices for a
session with fewer, are in allreduce_cases.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import (
    HAVE_DEVICES,
    NUM_DEVICES,
    allreduce_inputs,
    assert_same_on_every_device,
    numpy_of,
    run_in_shard_map,
    tp_mesh,
)
from helpers import (
    EXTENDED,
    TIERS,
    assert_same_bits,
    layout,
    rerun_with_virtual_cpu_devices,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm

if not HAVE_DEVICES:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(__file__, NUM_DEVICES, tier)

else:

    def _kernel_and_reference(mesh, partials, residual, gamma, **kw):
        """The op and its reference twin under the same shard_map, as NumPy."""
        return [
            run_in_shard_map(op, mesh, partials, residual, gamma, **kw)
            for op in (
                fp8norm.allreduce_residual_rms_norm_fp8,
                fp8norm.reference.allreduce_residual_rms_norm_fp8,
            )
        ]

    @pytest.mark.sampled(80)
    @pytest.mark.parametrize("size", [1, 2, 4, 8])
    @pytest.mark.parametrize("rows", [1, 8, 17, 20, 1024])
    @pytest.mark.parametrize("hidden", [4096, 8192])
    @pytest.mark.parametrize("reduce_dtype", [None, jnp.float32], ids=["x_dtype", "float32"])
    def test_matches_reference(size, rows, hidden, reduce_dtype):
        mesh = tp_mesh(size)
        partials, residual, gamma = allreduce_inputs(size, rows, hidden)
        out, ref = _kernel_and_reference(mesh, partials, residual, gamma, reduce_dtype=reduce_dtype)
        assert out[0].shape == (rows, hidden) and out[0].dtype == jnp.float8_e4m3fn
        assert out[1].shape == (rows, 1) and out[2].dtype == jnp.bfloat16
        assert_same_bits(numpy_of(out), numpy_of(ref))
        assert_same_on_every_device(out)

    @pytest.mark.parametrize("size", [2, 8])
    def test_float32_reduction_matches_the_unsharded_sum(size):
        # reduce_dtype=float32: the partials are summed, and the residual added, in
        # float32 (the bfloat16 reduction of test_matches_reference rounds h first). A
        # float32 sum of a few bfloat16 values is exact in any order, so this is a test
        # of the dtype; test_every_method_sums_in_the_axis_order is the one of the order.
        partials, residual, gamma = allreduce_inputs(size, 20, 4096)
        out = run_in_shard_map(
            fp8norm.allreduce_residual_rms_norm_fp8,
            tp_mesh(size),
            partials,
            residual,
            gamma,
            reduce_dtype=jnp.float32,
        )
        total = functools.reduce(np.add, partials.astype(np.float32))
        h = total + residual.astype(np.float32)
        ref = jax.jit(fp8norm.reference.add_rms_norm_fp8)(h, np.zeros_like(h), gamma)
        ref = [np.asarray(ref[0]), np.asarray(ref[1]), h.astype(jnp.bfloat16)]
        assert_same_bits(numpy_of(out), ref)

    def test_keywords_and_dtypes_pass_through():
        mesh = tp_mesh(4)
        partials, residual, gamma = allreduce_inputs(4, 8, 512, jnp.float16)
        kw = dict(
            scale_ub=0.05,
            weight_offset=1.0,
            out_dtype=jnp.float8_e4m3fnuz,
            scale_dtype=jnp.bfloat16,
        )
        out, ref = _kernel_and_reference(mesh, partials, residual, gamma, **kw)
        assert out[0].dtype == jnp.float8_e4m3fnuz and out[1].dtype == jnp.bfloat16
        assert_same_bits(numpy_of(out), numpy_of(ref))

    @pytest.mark.parametrize(
        "kw",
        [
            layout("fp8_group128"),
            layout("mxfp8"),
            layout("fp8_group128_ue8m0", reduce_dtype=jnp.float32),
            layout("fp8_static"),
            layout("nvfp4", global_scale=0.003),
            layout("mxfp4"),
        ],
        ids=["group128", "mxfp8", "ue8m0-float32", "static", "nvfp4", "mxfp4"],
    )
    def test_block_scaled_and_static_scales(kw):
        mesh = tp_mesh(4)
        partials, residual, gamma = allreduce_inputs(4, 17, 1024)
        out, ref = _kernel_and_reference(mesh, partials, residual, gamma, **kw)
        groups = 1024 // kw["group_size"] if "group_size" in kw else 1
        assert out[1].shape == (17, groups)
        assert_same_bits(out, ref)
        assert_same_on_every_device(out)
        # The wrapper for callers outside shard_map, a static scale as an array.
        for name in ("static_scale", "global_scale"):
            if name in kw:
                kw = dict(kw, **{name: jnp.float32(kw[name])})
        wrapped = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
            partials, residual, gamma, mesh=mesh, axis_name="tp", **kw
        )
        assert_same_bits(wrapped, out)

    @pytest.mark.parametrize("kw", [layout("mxfp8"), layout("nvfp4", global_scale=0.003)])
    def test_columnwise_outputs_are_the_same_on_every_device(kw):
        # The rows are replicated after the all-reduce, and so are y_t and scales_t: every
        # device's copy is read.
        mesh = tp_mesh(4)
        partials, residual, gamma = allreduce_inputs(4, 64, 256)

        def run(op):
            def per_device(p, r, g):
                return op(p[0], r, g, axis_name="tp", columnwise=True, **kw)

            fn = jax.shard_map(
                per_device, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(),) * 5
            )
            return jax.jit(fn)(
                jax.device_put(partials, NamedSharding(mesh, P("tp"))), residual, gamma
            )

        out = run(fp8norm.allreduce_residual_rms_norm_fp8)
        ref = run(fp8norm.reference.allreduce_residual_rms_norm_fp8)
        assert out[3].shape == (256, 64) and out[4].shape == (256, 64 // kw["group_size"])
        assert_same_bits(numpy_of(out), numpy_of(ref))
        assert_same_on_every_device(out)
        plain = run_in_shard_map(
            fp8norm.allreduce_residual_rms_norm_fp8, mesh, partials, residual, gamma, **kw
        )
        assert_same_bits(numpy_of(out[:3]), numpy_of(plain))
        with pytest.raises(ValueError, match="columnwise=True sums the partials with method='xla'"):
            run_in_shard_map(
                fp8norm.allreduce_residual_rms_norm_fp8,
                mesh,
                partials,
                residual,
                gamma,
                method="one_shot",
                columnwise=True,
                **kw,
            )

    def test_sharded_wrapper_for_callers_outside_shard_map():
        mesh = tp_mesh(8)
        partials, residual, gamma = allreduce_inputs(8, 17, 4096)
        out = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
            partials, residual, gamma, mesh=mesh, axis_name="tp"
        )
        ref = run_in_shard_map(
            fp8norm.reference.allreduce_residual_rms_norm_fp8, mesh, partials, residual, gamma
        )
        assert_same_bits(numpy_of(out), numpy_of(ref))
        assert all(o.sharding.is_fully_replicated for o in out)
        assert_same_on_every_device(out)
        # The same under an outer jit.
        jitted = jax.jit(
            lambda p, r, g: fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                p, r, g, mesh=mesh, axis_name="tp"
            )
        )(partials, residual, gamma)
        assert_same_bits(jitted, out)

    @pytest.mark.parametrize("reduce_dtype", [None, jnp.float32], ids=["x_dtype", "float32"])
    def test_compiled_hlo_is_one_all_reduce_and_the_custom_call(reduce_dtype):
        mesh = tp_mesh(8)
        partials, residual, gamma = allreduce_inputs(8, 64, 4096)

        def fn(p, r, g):
            return fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                p, r, g, mesh=mesh, axis_name="tp", reduce_dtype=reduce_dtype
            )

        hlo = jax.jit(fn).lower(partials, residual, gamma).compile().as_text()
        assert len(re.findall(r"\ball-reduce(?:-start)?\(", hlo)) == 1, hlo
        assert hlo.count('custom_call_target="fp8norm_add_rms_norm_fp8"') == 1, hlo
        for op in ("all-gather", "all-to-all", "reduce-scatter", "transpose(", " copy("):
            assert op not in hlo, (op, hlo)

    def _run_example(tp: int, **config) -> dict:
        """The example's errors, each within the example's tolerances for its config, and
        every device's result the same."""
        from jax_fp8norm.examples import llama_tp_block

        config = llama_tp_block.Config(**config)
        errors = llama_tp_block.run(tp, config, platform="cpu")
        residual_tolerance, next_tolerance = llama_tp_block.tolerances(config)
        assert errors["residual"] <= residual_tolerance
        assert errors["next_input"] <= next_tolerance
        assert errors["devices_identical"] == 1.0
        return errors

    @pytest.mark.parametrize("tp", [pytest.param(1, marks=EXTENDED), 8])
    def test_llama_block_example(tp):
        assert _run_example(tp)["platform"] == "cpu"

    # The example's other methods and formats are the extended tier's: the default tier runs
    # the one-kernel methods and FP4 across the devices in the tests above and below.
    @pytest.mark.parametrize("method", ["one_shot", "two_shot"])
    @EXTENDED
    def test_llama_block_example_one_kernel(method):
        assert _run_example(4, allreduce_method=method)["emulated"] == 1.0

    @pytest.mark.parametrize("fp4", ["nvfp4", "mxfp4"])
    @EXTENDED
    def test_llama_block_example_fp4(fp4):
        from jax_fp8norm.examples import llama_tp_block

        config = llama_tp_block.Config(fp4=fp4)
        assert llama_tp_block.tolerances(config) == llama_tp_block.FP4_TOLERANCES[fp4]
        # FP4 loses more than FP8, but only that: a lost global or block scale would be
        # far off (_run_example holds it to FP4's tolerances).
        assert _run_example(8, fp4=fp4)["residual"] > llama_tp_block.RESIDUAL_TOLERANCE

    def test_llama_block_example_config_refuses_bad_values():
        from jax_fp8norm.examples import llama_tp_block

        with pytest.raises(ValueError, match="allreduce_method must be one of"):
            llama_tp_block.Config(allreduce_method="nccl")
        with pytest.raises(ValueError, match="fp4 must be one of"):
            llama_tp_block.Config(fp4="fp4")
        with pytest.raises(ValueError, match="group_size is fixed"):
            llama_tp_block.Config(fp4="nvfp4", group_size=128)
