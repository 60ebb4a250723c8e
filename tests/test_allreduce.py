"""allreduce_residual_rms_norm_fp8 under shard_map, on 8 virtual CPU devices.

The virtual devices must be requested before jax starts: helpers.py asks for them. In a
session with fewer (a device count in the caller's XLA_FLAGS), this module only runs itself
again in a subprocess with 8; the subprocess runs the real cases.
"""

from __future__ import annotations

import contextlib
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
    layout,
    random_gamma,
    random_rows,
    recipe,
    rerun_with_virtual_cpu_devices,
)
from jax.sharding import Mesh, NamedSharding
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

    @pytest.mark.sampled(80)
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
        # reduce_dtype=float32: the partials are summed, and the residual added, in
        # float32 (the bfloat16 reduction of test_matches_reference rounds h first). A
        # float32 sum of a few bfloat16 values is exact in any order, so this is a test
        # of the dtype; test_every_method_sums_in_the_axis_order is the one of the order.
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

    @pytest.mark.parametrize("kw", [layout("mxfp8"), layout("nvfp4", global_scale=0.003)])
    def test_columnwise_outputs_are_the_same_on_every_device(kw):
        # The rows are replicated after the all-reduce, and so are y_t and scales_t: every
        # device's copy is read.
        mesh = _mesh(4)
        partials, residual, gamma = _inputs(4, 64, 256)

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
        assert_same_bits(_numpy(out), _numpy(ref))
        _assert_same_on_every_device(out)
        plain = _run(fp8norm.allreduce_residual_rms_norm_fp8, mesh, partials, residual, gamma, **kw)
        assert_same_bits(_numpy(out[:3]), _numpy(plain))
        with pytest.raises(ValueError, match="columnwise=True sums the partials with method='xla'"):
            _run(
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

    @pytest.mark.parametrize("tp", [pytest.param(1, marks=EXTENDED), 8])
    def test_llama_block_example(tp):
        from jax_fp8norm.examples import llama_tp_block

        errors = llama_tp_block.run(tp, platform="cpu")
        assert errors["platform"] == "cpu"
        assert errors["residual"] <= llama_tp_block.RESIDUAL_TOLERANCE
        assert errors["next_input"] <= llama_tp_block.NEXT_INPUT_TOLERANCE
        assert errors["devices_identical"] == 1.0

    # The example's other methods and formats are the extended tier's: the default tier runs
    # the one-kernel methods and FP4 across the devices in the tests above and below.
    @pytest.mark.parametrize("method", ["one_shot", "two_shot"])
    @EXTENDED
    def test_llama_block_example_one_kernel(method):
        from jax_fp8norm.examples import llama_tp_block

        config = llama_tp_block.Config(allreduce_method=method)
        errors = llama_tp_block.run(4, config, platform="cpu")
        assert errors["emulated"] == 1.0
        assert errors["residual"] <= llama_tp_block.RESIDUAL_TOLERANCE
        assert errors["next_input"] <= llama_tp_block.NEXT_INPUT_TOLERANCE
        assert errors["devices_identical"] == 1.0

    @pytest.mark.parametrize("fp4", ["nvfp4", "mxfp4"])
    @EXTENDED
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

    def test_llama_block_example_config_refuses_bad_values():
        from jax_fp8norm.examples import llama_tp_block

        with pytest.raises(ValueError, match="allreduce_method must be one of"):
            llama_tp_block.Config(allreduce_method="nccl")
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

    def _run_stacked(op, mesh, partials, residual, gamma, **kw):
        """op inside shard_map over ``mesh``, every device's outputs: each output as
        ``[tp, rows, ...]``, index t the copy of the devices at position t of "tp". A mesh
        with a "dp" axis splits the rows over it (a group along "tp" per "dp" index)."""
        rows = "dp" if "dp" in mesh.axis_names else None

        def per_device(p, r, g):
            return tuple(o[None] for o in op(p[0], r, g, axis_name="tp", **kw))

        specs = (P("tp", rows), P(rows), P())
        fn = jax.shard_map(
            per_device, mesh=mesh, in_specs=specs, out_specs=P("tp", rows), check_vma=False
        )
        placed = [
            jax.device_put(a, NamedSharding(mesh, spec))
            for a, spec in zip((partials, residual, gamma), specs, strict=True)
        ]
        # Every device's call done before any copy is read.
        return _numpy(jax.block_until_ready(jax.jit(fn)(*placed)))

    def _assert_every_copy(stacked, want):
        """Each device's copy of the outputs (``_run_stacked``) has ``want``'s bits."""
        for t in range(stacked[0].shape[0]):
            assert_same_bits([o[t] for o in stacked], want)

    def _fixed_order_reference(method, mesh, *args, **kw):
        """The reference twin's outputs for ``method``, as NumPy (one copy: the twin's
        all-gather makes them replicated)."""
        op = fp8norm.reference.allreduce_residual_rms_norm_fp8
        return _numpy(_run(op, mesh, *args, method=method, **kw))

    def _emulated(method, mesh, *args, **kw):
        """The op's outputs for ``method``, the CUDA kernels emulated: every device's copy
        (``_run_stacked``)."""
        with jax_fp8norm.simt.kernels():
            op = fp8norm.allreduce_residual_rms_norm_fp8
            return _run_stacked(op, mesh, *args, method=method, **kw)

    def _with_method(method, mesh, *args, **kw):
        """Every device's outputs for ``method``: "xla" on the CPU kernels, the others
        (auto among them) on the emulated CUDA kernels."""
        if method == "xla":
            op = fp8norm.allreduce_residual_rms_norm_fp8
            return _run_stacked(op, mesh, *args, method=method, **kw)
        return _emulated(method, mesh, *args, **kw)

    # Inputs that can see the order of the sum. A float32 sum of a few bfloat16 partials
    # is exact in any order, so bfloat16 inputs cannot tell one order from another; these
    # float32 partials spread over eight decades, partial 1 nearly cancelling partial 0.

    def _order_visible_inputs(size, rows, hidden, seed=0):
        rng = np.random.default_rng(seed)
        shape = (size, rows, hidden)
        partials = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)
        partials[1] = -partials[0] * (1 + 1e-3 * rng.standard_normal(shape[1:]))
        residual = rng.standard_normal(shape[1:]) * 10.0 ** rng.uniform(-3, 1, shape[1:])
        gamma = random_gamma(seed + 1, hidden, jnp.float32)
        return partials.astype(np.float32), residual.astype(np.float32), gamma

    def _fold(partials, residual, order):
        """((x_a + x_b) + ...) + residual in float32, the partials taken in ``order``."""
        total = partials[order[0]]
        for k in order[1:]:
            total = total + partials[k]
        return total + residual

    def _assert_the_order_shows(partials, residual):
        """Another order of the sum changes h, and with it residual_out (h itself in
        float32): the reversed fold, a pairwise tree, and a device that starts its fold
        at its own partial (devices 2 and up: x_1 + x_0 is x_0 + x_1)."""
        size = len(partials)
        assert size >= 3
        axis_order = _fold(partials, residual, range(size))
        others = {"reversed": list(range(size))[::-1]}
        others |= {
            f"own first on {d}": [d, *(k for k in range(size) if k != d)] for d in range(2, size)
        }
        folds = [(n, _fold(partials, residual, o)) for n, o in others.items()]
        if size >= 4:  # on 3, the pairwise tree is the left fold
            tree = (partials[0] + partials[1]) + functools.reduce(np.add, partials[2:])
            folds.append(("tree", tree + residual))
        for name, other in folds:
            assert not np.array_equal(other.view(np.uint32), axis_order.view(np.uint32)), name

    def _axis_order_outputs(partials, residual, gamma, **kw):
        """The spec's outputs, stated apart from the op and its twin's all-gather: h the
        left fold of the partials in the axis' order, plus the residual, in float32 (NumPy),
        then steps 1-7 (the reference on one device)."""
        h = _fold(partials, residual, range(len(partials)))
        y, scales = jax.jit(functools.partial(fp8norm.reference.rms_norm_fp8, **kw))(h, gamma)
        return [np.asarray(y), np.asarray(scales), h.astype(residual.dtype)]

    def _devices(order: str, size: int):
        devices = jax.devices("cpu")[:size]
        if order == "reversed":
            return devices[::-1]
        if order == "shuffled":
            return [devices[i] for i in np.random.default_rng(size).permutation(size)]
        return devices

    # The device-to-position mapping: positions along "tp" are not device ids. A 1-D mesh
    # of 3 (an odd size, slices of unequal rows), 4 reversed, and a (tp, dp) mesh with tp
    # outer over shuffled devices.
    MESHES = {
        "natural-3": lambda: Mesh(np.array(_devices("natural", 3)), ("tp",)),
        "reversed-4": lambda: Mesh(np.array(_devices("reversed", 4)), ("tp",)),
        "tp_outer-4x2": lambda: Mesh(np.array(_devices("shuffled", 8)).reshape(4, 2), ("tp", "dp")),
    }

    @pytest.mark.sampled(12)
    @pytest.mark.parametrize("mesh_kind", MESHES)
    @pytest.mark.parametrize("method", ["xla", "auto", *ONE_KERNEL])
    def test_every_method_sums_in_the_axis_order(method, mesh_kind):
        # The spec's order, on every device: the one-kernel methods by their design, auto
        # as the one it picks, and "xla" because XLA's CPU all-reduce folds in the axis'
        # order in float32 (docs/spec.md): should that change, this fails.
        mesh = MESHES[mesh_kind]()
        partials, residual, gamma = _order_visible_inputs(mesh.shape["tp"], 12, 1024)
        _assert_the_order_shows(partials, residual)
        out = _with_method(method, mesh, partials, residual, gamma)
        _assert_every_copy(out, _axis_order_outputs(partials, residual, gamma))

    # The methods share the wrapper that sets the sum's dtype: one in the default tier.
    @pytest.mark.parametrize(
        "method", [ONE_KERNEL[0], *(pytest.param(m, marks=EXTENDED) for m in ONE_KERNEL[1:])]
    )
    def test_reduce_dtype_changes_nothing_for_the_one_kernel_methods(method):
        # They always sum in float32; XLA's all-reduce rounds a bfloat16 sum first, and on
        # these inputs that shows.
        mesh = _mesh(4)
        partials, residual, gamma = _inputs(4, 9, 1024)
        got = {
            name: _emulated(method, mesh, partials, residual, gamma, reduce_dtype=dtype)
            for name, dtype in (("x_dtype", None), ("float32", jnp.float32))
        }
        for stacked in got.values():
            _assert_every_copy(
                stacked, _fixed_order_reference(method, mesh, partials, residual, gamma)
            )
        in_x_dtype = _fixed_order_reference("xla", mesh, partials, residual, gamma)
        in_float32 = _fixed_order_reference(
            "xla", mesh, partials, residual, gamma, reduce_dtype=jnp.float32
        )
        assert not np.array_equal(in_x_dtype[2].view(np.uint16), in_float32[2].view(np.uint16))

    @pytest.mark.sampled(54)
    @pytest.mark.parametrize("method", ONE_KERNEL)
    @pytest.mark.parametrize("size", [2, 4, 8])
    @pytest.mark.parametrize("rows", [1, 7, 33])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
    def test_one_kernel_matches_the_fixed_order_reference(method, size, rows, dtype):
        mesh = _mesh(size)
        partials, residual, gamma = _inputs(size, rows, 1024, dtype)
        out = _emulated(method, mesh, partials, residual, gamma)
        assert out[0].shape == (size, rows, 1024) and out[2].dtype == dtype
        _assert_every_copy(out, _fixed_order_reference(method, mesh, partials, residual, gamma))

    def test_fixed_order_reference_is_the_left_fold():
        # The reference states the order: ((x_0 + x_1) + x_2) + x_3 in float32, then the
        # residual; on inputs where another order gives other bits.
        mesh = _mesh(4)
        partials, residual, gamma = _order_visible_inputs(4, 9, 1024)
        _assert_the_order_shows(partials, residual)
        ref = _fixed_order_reference("one_shot", mesh, partials, residual, gamma)
        assert_same_bits(ref, _axis_order_outputs(partials, residual, gamma))
        # ... and with bfloat16 partials not the same bits as XLA's bfloat16 all-reduce.
        partials, residual, gamma = _inputs(4, 9, 1024)
        ref = _fixed_order_reference("one_shot", mesh, partials, residual, gamma)
        xla = _fixed_order_reference("xla", mesh, partials, residual, gamma)
        assert not np.array_equal(xla[2].view(np.uint16), ref[2].view(np.uint16))

    @pytest.mark.sampled(12)
    @pytest.mark.parametrize("method", ONE_KERNEL)
    @pytest.mark.parametrize(
        "kw",
        [
            recipe("fp8_group128"),
            recipe("mxfp8"),
            recipe("fp8_static"),
            recipe("nvfp4", global_scale=0.003),
            recipe("mxfp4"),
            dict(scale_ub=0.05, weight_offset=1.0, out_dtype=jnp.float8_e4m3fnuz),
        ],
        ids=["group128", "mxfp8", "static", "nvfp4", "mxfp4", "ub-offset-fnuz"],
    )
    def test_one_kernel_keywords(method, kw):
        mesh = _mesh(4)
        partials, residual, gamma = _inputs(4, 10, 1024)
        out = _emulated(method, mesh, partials, residual, gamma, **kw)
        ref = _fixed_order_reference(method, mesh, partials, residual, gamma, **kw)
        _assert_every_copy(out, ref)
        # The wrapper for callers outside shard_map takes the method too; its outputs are
        # replicated: every device's copy.
        with jax_fp8norm.simt.kernels():
            wrapped = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                partials, residual, gamma, mesh=mesh, axis_name="tp", method=method, **kw
            )
        _assert_same_on_every_device(wrapped)
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

            res, (y, s) = jax.lax.scan(step, r, p[0])
            return res[None], y[None], s[None]

        def run(op):
            fn = jax.shard_map(
                functools.partial(layers, op),
                mesh=mesh,
                in_specs=(P("tp"), P(), P()),
                out_specs=P("tp"),
                check_vma=False,
            )
            placed = jax.device_put(partials, NamedSharding(mesh, P("tp")))
            return _numpy(jax.jit(fn)(placed, residual, gamma))

        with jax_fp8norm.simt.kernels():
            out = run(fp8norm.allreduce_residual_rms_norm_fp8)
        ref = run(fp8norm.reference.allreduce_residual_rms_norm_fp8)
        _assert_every_copy(out, [o[0] for o in ref])
        assert out[1].shape == (4, steps, rows, hidden)

    def test_one_kernel_replayed_calls_and_a_2d_mesh():
        # One compiled function called again and again, with other inputs in between: no
        # call sees another's data. Then tensor parallel over "tp" inside a (2, 4) mesh: one
        # group per "dp" row.
        mesh = _mesh(4)
        a = _inputs(4, 6, 1024)
        b = _order_visible_inputs(4, 6, 1024)
        with jax_fp8norm.simt.kernels():
            fn = jax.jit(
                jax.shard_map(
                    lambda p, r, g: tuple(
                        o[None]
                        for o in fp8norm.allreduce_residual_rms_norm_fp8(
                            p[0], r, g, axis_name="tp", method="two_shot"
                        )
                    ),
                    mesh=mesh,
                    in_specs=(P("tp"), P(), P()),
                    out_specs=P("tp"),
                    check_vma=False,
                )
            )
            stacked = NamedSharding(mesh, P("tp"))
            runs = [_numpy(fn(jax.device_put(p, stacked), r, g)) for p, r, g in (a, b, a, a, b)]
        for args, got in zip((a, b, a, a, b), runs, strict=True):
            _assert_every_copy(got, _fixed_order_reference("two_shot", mesh, *args))

        grid = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices("cpu")[:8])
        partials = random_rows(8, (4, 16, 512), jnp.bfloat16, spread=0.5)
        residual = random_rows(9, (16, 512), jnp.bfloat16, spread=0.5)
        gamma = random_gamma(10, 512, jnp.float32)
        out = _emulated("one_shot", grid, partials, residual, gamma)
        ref = _run_stacked(
            fp8norm.reference.allreduce_residual_rms_norm_fp8,
            grid,
            partials,
            residual,
            gamma,
            method="one_shot",
        )
        assert_same_bits(out, ref)
        _assert_every_copy(out, [o[0] for o in ref])

    def _auto_on_emulated_devices(size, payload_bytes):
        """auto's choice for ``size`` emulated devices and a partial of ``payload_bytes``."""
        return jax_fp8norm._allreduce.select(
            "auto",
            platform="cpu",
            emulating=True,
            cuda_built=False,
            processes=1,
            num_devices=size,
            payload_bytes=payload_bytes,
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
            (2, 512, "one_shot"),
            (4, 384, "one_shot"),
            (4, 512, "two_shot"),
            (8, 96, "one_shot"),
            (8, 128, "two_shot"),
            (8, 8192, "two_shot"),
        ],
    )
    def test_auto_on_the_emulated_devices_follows_the_table(size, rows, chosen):
        mesh = _mesh(size)
        payload = rows * 1024 * 2
        assert chosen == _auto_on_emulated_devices(size, payload)
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

        argv = ["--rows", "17", "--hidden", "256", "--rounds", "1", "--devices", "2"]
        assert bench.main([*argv, "--emulate"]) == 0
        out = capsys.readouterr().out
        assert "2 x cpu (emulated CUDA kernels)" in out
        for name in ("xla all-reduce + jnp formula", "method='xla'", "method='two_shot'"):
            assert out.count(name) == 1, out
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

        def per_device(p, r, g):
            outs = jax.vmap(
                lambda x: fp8norm.allreduce_residual_rms_norm_fp8(
                    x, r, g, axis_name="tp", method="two_shot"
                )
            )(p[0])
            return tuple(o[None] for o in outs)

        with jax_fp8norm.simt.kernels():
            out = _numpy(
                jax.jit(
                    jax.shard_map(
                        per_device,
                        mesh=mesh,
                        in_specs=(P("tp"), P(), P()),
                        out_specs=P("tp"),
                        check_vma=False,
                    )
                )(jax.device_put(batched, NamedSharding(mesh, P("tp"))), residual, gamma)
            )
        assert out[0].shape == (4, 2, 6, 256)
        # The reference per batch element: XLA compiles the vmapped reference's scalar
        # divisions otherwise (a reciprocal, one unit off in some scales).
        for k in range(2):
            ref = _fixed_order_reference("two_shot", mesh, batched[:, k], residual, gamma)
            _assert_every_copy([o[:, k] for o in out], ref)

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

    # ------------------------------------------------------------ invariance (docs/spec.md)

    @pytest.mark.parametrize(
        "size,dtype",
        [(2, jnp.bfloat16), pytest.param(8, jnp.float32, marks=EXTENDED)],
        ids=["2-bfloat16", "8-float32"],
    )
    def test_a_rows_bits_do_not_depend_on_the_rows_around_it(size, dtype):
        # auto picks by size (one_shot for 5 rows; for 300 rows one_shot on 2 devices,
        # two_shot on 8), only among methods with the same bits: XLA's all-reduce would
        # round a bfloat16 sum. The first 5 rows of a call of 300 are a call of 5.
        mesh = _mesh(size)
        if dtype == jnp.float32:
            partials, residual, gamma = _order_visible_inputs(size, 300, 1024)
        else:
            partials, residual, gamma = _inputs(size, 300, 1024, dtype)
        chosen = {
            rows: _auto_on_emulated_devices(size, rows * 1024 * np.dtype(dtype).itemsize)
            for rows in (5, 300)
        }
        assert chosen == {5: "one_shot", 300: "one_shot" if size == 2 else "two_shot"}
        few = _emulated("auto", mesh, partials[:, :5], residual[:5], gamma)
        many = _emulated("auto", mesh, partials, residual, gamma)
        assert_same_bits([o[:, :5] for o in many], few)
        want = _fixed_order_reference("one_shot", mesh, partials, residual, gamma)
        _assert_every_copy(many, want)
        for method in ONE_KERNEL:
            _assert_every_copy(_emulated(method, mesh, partials, residual, gamma), want)
        # XLA's bfloat16 all-reduce gives other bits here, which auto must not switch to.
        if dtype == jnp.bfloat16:
            xla = _fixed_order_reference("xla", mesh, partials, residual, gamma)
            assert not np.array_equal(xla[2].view(np.uint16), want[2].view(np.uint16))

    # ------------------------------------------------------------ edges and refusals

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
        mesh = _mesh(4)
        partials = np.zeros((4, 3, 0), jnp.bfloat16)
        residual = np.zeros((3, 0), jnp.bfloat16)
        gamma = np.zeros((0,), np.float32)
        want = _numpy(
            jax.jit(functools.partial(fp8norm.reference.add_rms_norm_fp8, **kw))(
                residual, residual, gamma
            )
        )
        per_row = fp8norm.recipes.apply_recipe(kw).get("group_size") is None
        assert want[1].shape == ((3, 1) if per_row else (3, 0))
        for method in ("xla", "auto", *ONE_KERNEL):
            _assert_every_copy(_with_method(method, mesh, partials, residual, gamma, **kw), want)
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
            assert_same_bits(_numpy(got), _numpy(ref))

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
        return _numpy(jax.block_until_ready(jax.jit(fn)(placed, residual, gamma)))

    def test_the_allreduce_handler_refuses_what_its_lowering_never_sends():
        mesh = _mesh(4)
        args = _inputs(4, 5, 256)
        # As lowered, the call runs and gives the op's bits: the refusals below are the
        # changed attribute's alone.
        _assert_every_copy(
            _raw_allreduce(mesh, *args), _fixed_order_reference("one_shot", mesh, *args)
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
            # Decoded as one struct of every attribute: a stray one, or one of another
            # type, is the FFI's refusal.
            (dict(stray=np.int64(0)), "Wrong number of attributes"),
            (dict(rows=np.int32(5)), "Wrong scalar data type"),
        ]:
            with pytest.raises(jax.errors.JaxRuntimeError, match=message):
                _raw_allreduce(mesh, *args, **changes)
