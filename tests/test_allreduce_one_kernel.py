"""The one-kernel all-reduce methods (method="one_shot" / "two_shot": the CUDA kernel,
emulated by jax_fp8norm.simt, one virtual CPU device per GPU), on 8 virtual CPU devices: the
sum in the axis' order, the fixed-order reference, keywords and formats, scans, replays, 2-D
meshes, vmap and pmap, a row's bits apart from the rows around it, and the real GPUs where
there are some.

The set-up the all-reduce tests share, and the rerun in a subprocess with 8 devices for a
session with fewer, are in allreduce_cases.py.
"""

from __future__ import annotations

import functools

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
    assert_same_on_every_device,
    auto_on_emulated_devices,
    emulated,
    fixed_order_reference,
    numpy_of,
    run_in_shard_map,
    run_stacked,
    tp_mesh,
    with_method,
)
from helpers import (
    EXTENDED,
    REQUIRE_GPU,
    TIERS,
    assert_matches_reference,
    assert_same_bits,
    gpu_devices,
    random_gamma,
    random_rows,
    recipe,
    rerun_with_virtual_cpu_devices,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm
import jax_fp8norm as fp8norm
import jax_fp8norm.simt

if not HAVE_DEVICES:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(__file__, NUM_DEVICES, tier)

else:
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
        out = with_method(method, mesh, partials, residual, gamma)
        assert_every_copy(out, _axis_order_outputs(partials, residual, gamma))

    # The methods share the wrapper that sets the sum's dtype: one in the default tier.
    @pytest.mark.parametrize(
        "method", [ONE_KERNEL[0], *(pytest.param(m, marks=EXTENDED) for m in ONE_KERNEL[1:])]
    )
    def test_reduce_dtype_changes_nothing_for_the_one_kernel_methods(method):
        # They always sum in float32; XLA's all-reduce rounds a bfloat16 sum first, and on
        # these inputs that shows.
        mesh = tp_mesh(4)
        partials, residual, gamma = allreduce_inputs(4, 9, 1024)
        got = {
            name: emulated(method, mesh, partials, residual, gamma, reduce_dtype=dtype)
            for name, dtype in (("x_dtype", None), ("float32", jnp.float32))
        }
        for stacked in got.values():
            assert_every_copy(
                stacked, fixed_order_reference(method, mesh, partials, residual, gamma)
            )
        in_x_dtype = fixed_order_reference("xla", mesh, partials, residual, gamma)
        in_float32 = fixed_order_reference(
            "xla", mesh, partials, residual, gamma, reduce_dtype=jnp.float32
        )
        assert not np.array_equal(in_x_dtype[2].view(np.uint16), in_float32[2].view(np.uint16))

    @pytest.mark.sampled(54)
    @pytest.mark.parametrize("method", ONE_KERNEL)
    @pytest.mark.parametrize("size", [2, 4, 8])
    @pytest.mark.parametrize("rows", [1, 7, 33])
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
    def test_one_kernel_matches_the_fixed_order_reference(method, size, rows, dtype):
        mesh = tp_mesh(size)
        partials, residual, gamma = allreduce_inputs(size, rows, 1024, dtype)
        out = emulated(method, mesh, partials, residual, gamma)
        assert out[0].shape == (size, rows, 1024) and out[2].dtype == dtype
        assert_every_copy(out, fixed_order_reference(method, mesh, partials, residual, gamma))

    def test_fixed_order_reference_is_the_left_fold():
        # The reference states the order: ((x_0 + x_1) + x_2) + x_3 in float32, then the
        # residual; on inputs where another order gives other bits.
        mesh = tp_mesh(4)
        partials, residual, gamma = _order_visible_inputs(4, 9, 1024)
        _assert_the_order_shows(partials, residual)
        ref = fixed_order_reference("one_shot", mesh, partials, residual, gamma)
        assert_same_bits(ref, _axis_order_outputs(partials, residual, gamma))
        # ... and with bfloat16 partials not the same bits as XLA's bfloat16 all-reduce.
        partials, residual, gamma = allreduce_inputs(4, 9, 1024)
        ref = fixed_order_reference("one_shot", mesh, partials, residual, gamma)
        xla = fixed_order_reference("xla", mesh, partials, residual, gamma)
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
        mesh = tp_mesh(4)
        partials, residual, gamma = allreduce_inputs(4, 10, 1024)
        out = emulated(method, mesh, partials, residual, gamma, **kw)
        ref = fixed_order_reference(method, mesh, partials, residual, gamma, **kw)
        assert_every_copy(out, ref)
        # The wrapper for callers outside shard_map takes the method too; its outputs are
        # replicated: every device's copy.
        with jax_fp8norm.simt.kernels():
            wrapped = fp8norm.sharded_allreduce_residual_rms_norm_fp8(
                partials, residual, gamma, mesh=mesh, axis_name="tp", method=method, **kw
            )
        assert_same_on_every_device(wrapped)
        assert_same_bits(numpy_of(wrapped), ref)

    @pytest.mark.parametrize("method", ONE_KERNEL)
    def test_one_kernel_in_a_scan_of_25_calls(method):
        # A decoder's residual stream: each call's residual_out is the next one's residual,
        # 25 calls of one compiled custom call (one workspace, the epochs on the device).
        mesh = tp_mesh(4)
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
            return numpy_of(jax.jit(fn)(placed, residual, gamma))

        with jax_fp8norm.simt.kernels():
            out = run(fp8norm.allreduce_residual_rms_norm_fp8)
        ref = run(fp8norm.reference.allreduce_residual_rms_norm_fp8)
        assert_every_copy(out, [o[0] for o in ref])
        assert out[1].shape == (4, steps, rows, hidden)

    def test_one_kernel_replayed_calls_and_a_2d_mesh():
        # One compiled function called again and again, with other inputs in between: no
        # call sees another's data. Then tensor parallel over "tp" inside a (2, 4) mesh: one
        # group per "dp" row.
        mesh = tp_mesh(4)
        a = allreduce_inputs(4, 6, 1024)
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
            runs = [numpy_of(fn(jax.device_put(p, stacked), r, g)) for p, r, g in (a, b, a, a, b)]
        for args, got in zip((a, b, a, a, b), runs, strict=True):
            assert_every_copy(got, fixed_order_reference("two_shot", mesh, *args))

        grid = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices("cpu")[:8])
        partials = random_rows(8, (4, 16, 512), jnp.bfloat16, spread=0.5)
        residual = random_rows(9, (16, 512), jnp.bfloat16, spread=0.5)
        gamma = random_gamma(10, 512, jnp.float32)
        out = emulated("one_shot", grid, partials, residual, gamma)
        ref = run_stacked(
            fp8norm.reference.allreduce_residual_rms_norm_fp8,
            grid,
            partials,
            residual,
            gamma,
            method="one_shot",
        )
        assert_same_bits(out, ref)
        assert_every_copy(out, [o[0] for o in ref])

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
            partials, residual, gamma = allreduce_inputs(len(gpus), rows, 4096)
            out = run_in_shard_map(
                fp8norm.allreduce_residual_rms_norm_fp8,
                mesh,
                partials,
                residual,
                gamma,
                method=method,
            )
            ref = run_in_shard_map(
                fp8norm.reference.allreduce_residual_rms_norm_fp8,
                mesh,
                partials,
                residual,
                gamma,
                method=method,
            )
            assert_matches_reference(numpy_of(out), numpy_of(ref))
            assert_same_on_every_device(out)

    def test_one_kernel_under_vmap_pmap_and_varying_operands():
        mesh = tp_mesh(4)
        partials, residual, gamma = allreduce_inputs(4, 6, 256)
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
            out = numpy_of(
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
            ref = fixed_order_reference("two_shot", mesh, batched[:, k], residual, gamma)
            assert_every_copy([o[:, k] for o in out], ref)

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
        assert_same_bits(numpy_of(got), numpy_of(want))

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
        mesh = tp_mesh(size)
        if dtype == jnp.float32:
            partials, residual, gamma = _order_visible_inputs(size, 300, 1024)
        else:
            partials, residual, gamma = allreduce_inputs(size, 300, 1024, dtype)
        chosen = {
            rows: auto_on_emulated_devices(size, rows * 1024 * np.dtype(dtype).itemsize)
            for rows in (5, 300)
        }
        assert chosen == {5: "one_shot", 300: "one_shot" if size == 2 else "two_shot"}
        few = emulated("auto", mesh, partials[:, :5], residual[:5], gamma)
        many = emulated("auto", mesh, partials, residual, gamma)
        assert_same_bits([o[:, :5] for o in many], few)
        want = fixed_order_reference("one_shot", mesh, partials, residual, gamma)
        assert_every_copy(many, want)
        for method in ONE_KERNEL:
            assert_every_copy(emulated(method, mesh, partials, residual, gamma), want)
        # XLA's bfloat16 all-reduce gives other bits here, which auto must not switch to.
        if dtype == jnp.bfloat16:
            xla = fixed_order_reference("xla", mesh, partials, residual, gamma)
            assert not np.array_equal(xla[2].view(np.uint16), want[2].view(np.uint16))

    # ------------------------------------------------------------ edges and refusals
