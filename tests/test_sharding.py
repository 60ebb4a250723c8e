"""The ops under a plain jax.jit with sharded inputs, on 8 virtual CPU devices: rows
sharded stay sharded (no all-gather, outputs keep the row sharding), a sharded hidden axis
still gives the right answer, and the ops work inside a user's shard_map.

Like the all-reduce modules, a session with fewer devices reruns this module in a subprocess with 8.
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
    TIERS,
    assert_same_bits,
    collectives_in,
    layout,
    random_gamma,
    random_rows,
    rerun_with_virtual_cpu_devices,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm
import jax_fp8norm.simt
from jax_fp8norm import _training

NUM_DEVICES = 8

if len(jax.devices("cpu")) < NUM_DEVICES:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(__file__, NUM_DEVICES, tier)

else:

    def _mesh(shape=(8,), names=("d",), axis_type=AxisType.Auto):
        return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))

    def _single_device(op, *args):
        cpu0 = jax.devices("cpu")[0]
        return jax.jit(op)(*(jax.device_put(np.asarray(a), cpu0) for a in args))

    def _args(op, shape, dtype=jnp.bfloat16):
        x = random_rows(1, shape, dtype)
        gamma = random_gamma(2, shape[-1], jnp.float32)
        if op is fp8norm.rms_norm_fp8:
            return x, gamma
        return x, random_rows(3, shape, dtype), gamma

    @pytest.mark.parametrize("op", [fp8norm.rms_norm_fp8, fp8norm.add_rms_norm_fp8])
    @pytest.mark.parametrize(
        ("shape", "spec"),
        [
            ((64, 512), P("d", None)),
            ((4, 16, 512), P(None, "d", None)),
            ((8, 8, 512), P("d", None, None)),
        ],
    )
    @pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
    def test_row_sharded_inputs_stay_sharded(op, shape, spec, axis_type):
        mesh = _mesh(axis_type=axis_type)
        args = _args(op, shape)
        sharding = NamedSharding(mesh, spec)
        placed = [jax.device_put(a, sharding) for a in args[:-1]]
        placed.append(jax.device_put(args[-1], NamedSharding(mesh, P())))
        fn = jax.jit(op)
        outs = fn(*placed)
        hlo = fn.lower(*placed).compile().as_text()
        assert not collectives_in(hlo), collectives_in(hlo)
        assert hlo.count('custom_call_target="fp8norm_') == 1
        for out in outs:
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim), out.sharding
        assert_same_bits(outs, _single_device(op, *args))

    # (mesh shape, x's shape, x's spec): rows, hidden, both, two sharded row axes of a 3-D
    # x, and 2-D meshes with both axes on one dimension.
    SHARDINGS = {
        "rows": ((8,), (64, 512), P("a", None)),
        "hidden": ((8,), (16, 1024), P(None, "a")),
        "rows_and_hidden": ((2, 4), (16, 1024), P("a", "b")),
        "two_row_axes_3d": ((2, 4), (4, 16, 512), P("a", "b", None)),
        "2d_mesh_rows": ((2, 4), (32, 256), P(("a", "b"), None)),
        "2d_mesh_hidden": ((4, 2), (16, 1024), P(None, ("a", "b"))),
    }

    def _call(op, mode, num_row_operands):
        if mode == "eager":
            return op
        if mode == "jit":
            return jax.jit(op)
        return jax.jit(jax.vmap(op, in_axes=(0,) * num_row_operands + (None,)))

    @pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
    @pytest.mark.parametrize("op", [fp8norm.rms_norm_fp8, fp8norm.add_rms_norm_fp8])
    @pytest.mark.parametrize("case", list(SHARDINGS))
    @pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
    def test_every_sharding_gives_the_single_device_bits(axis_type, case, op, mode):
        mesh_shape, shape, spec = SHARDINGS[case]
        mesh = _mesh(mesh_shape, ("a", "b")[: len(mesh_shape)], axis_type)
        args = _args(op, shape)
        placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args[:-1]]
        # gamma sharded like x's hidden axis, so that a sharded gamma is covered too.
        placed.append(jax.device_put(args[-1], NamedSharding(mesh, P(spec[-1]))))
        call = _call(op, mode, len(args) - 1)
        outs = call(*placed)
        assert_same_bits(outs, _single_device(op, *args))
        if axis_type == AxisType.Explicit:
            # Every output: x's rows, the last axis whole; the declared type says the same.
            rows = P(*spec[:-1], None)
            declared = jax.eval_shape(call, *placed)
            for out, aval in zip(outs, declared, strict=True):
                assert out.sharding.spec == rows, (out.sharding, rows)
                assert aval.sharding.spec == rows, (aval.sharding, rows)

    BLOCK_SCALINGS = {
        "group128": layout("fp8_group128"),
        "mxfp8": layout("mxfp8"),
        "static": layout("fp8_static", static_scale=0.05),
        "nvfp4": layout("nvfp4", global_scale=0.004),
        "mxfp4": layout("mxfp4"),
    }

    @pytest.mark.parametrize("scaling", list(BLOCK_SCALINGS))
    @pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
    def test_block_scaled_rows_stay_sharded(axis_type, scaling):
        # Scales per group ([..., N // G]) keep the rows' sharding like the per-row ones;
        # a calibrated scale, here a jit argument, is replicated. No collective anywhere.
        mesh = _mesh(axis_type=axis_type)
        x, residual, gamma = _args(fp8norm.add_rms_norm_fp8, (64, 512))
        kw = dict(BLOCK_SCALINGS[scaling])
        # A calibrated or global scale: a jit argument.
        name = "global_scale" if "global_scale" in kw else "static_scale"
        static = kw.pop(name, None)

        def op(x, residual, gamma, *scale):
            extra = {name: scale[0]} if scale else {}
            return fp8norm.add_rms_norm_fp8(x, residual, gamma, **kw, **extra)

        spec = P("d", None)
        placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, residual)]
        scale = () if static is None else (np.float32(static),)
        fn = jax.jit(op)
        outs = fn(*placed, gamma, *scale)
        hlo = fn.lower(*placed, gamma, *scale).compile().as_text()
        assert not collectives_in(hlo), collectives_in(hlo)
        assert hlo.count('custom_call_target="fp8norm_') == 1
        for out in outs:
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim), out.sharding
        assert outs[1].shape == (64, 512 // kw["group_size"] if "group_size" in kw else 1)
        assert_same_bits(outs, _single_device(op, x, residual, gamma, *scale))

    # (mesh shape, x's shape, x's spec, recipe, rows): the first row dimension sharded by
    # whole blocks keeps the rows and y_t sharded ("sharded"; "sharded, scales_t gathered"
    # where the rule cannot name the blocks: 32 rows of 16 are not a multiple of 16 x 8
    # devices, so XLA may gather scales_t after the call); a block that would span two
    # devices, or a sharded row dimension after the first, gathers the rows ("gathered").
    COLUMNWISE_SHARDINGS = {
        "mxfp8_rows": ((8,), (256, 256), P("a", None), "mxfp8", "sharded"),
        "nvfp4_3d": ((8,), (8, 128, 64), P("a", None, None), "nvfp4", "sharded"),
        "nvfp4_3d_blocks_unnamed": ((8,), (8, 32, 64), P("a", None, None), "nvfp4", "scales"),
        "static_2d_mesh": ((2, 4), (64, 256), P(("a", "b"), None), "fp8_static", "sharded"),
        "group128_block_spans_devices": ((8,), (512, 256), P("a", None), "fp8_group128", ""),
        "mxfp8_8_rows_a_device": ((8,), (64, 256), P("a", None), "mxfp8", ""),
        "mxfp8_second_row_dim": ((8,), (4, 64, 128), P(None, "a", None), "mxfp8", ""),
    }

    @pytest.mark.parametrize("case", list(COLUMNWISE_SHARDINGS))
    @pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
    def test_columnwise_rows_stay_sharded_by_whole_blocks(axis_type, case):
        mesh_shape, shape, spec, name, rows = COLUMNWISE_SHARDINGS[case]
        mesh = _mesh(mesh_shape, ("a", "b")[: len(mesh_shape)], axis_type)
        x, residual, gamma = _args(fp8norm.add_rms_norm_fp8, shape)
        kw = dict(layout(name), columnwise=True)

        def op(x, residual, gamma):
            return _training.add_rms_norm_fp8_training(x, residual, gamma, **kw)

        placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, residual)]
        fn = jax.jit(op)
        outs = fn(*placed, gamma)
        assert_same_bits(outs, _single_device(op, x, residual, gamma))
        hlo = fn.lower(*placed, gamma).compile().as_text()
        assert hlo.count('custom_call_target="fp8norm_') == 1
        y_t, scales_t = outs[-2:]
        if not rows:  # the rows gathered before the kernel
            assert "all-gather" in collectives_in(hlo)
            return
        # Each device's copy of y_t holds its own rows' columns; no collective but, at
        # most, a gather of scales_t where the rule cannot name its blocks.
        allowed = set() if rows == "sharded" else {"all-gather"}
        assert set(collectives_in(hlo)) <= allowed, collectives_in(hlo)
        for shard in y_t.addressable_shards:
            assert shard.data.shape == (shape[-1], y_t.shape[1] // 8)
        axes = spec[0]
        assert y_t.sharding.is_equivalent_to(NamedSharding(mesh, P(None, axes)), 2)
        if rows == "sharded":
            blocks = None if name == "fp8_static" else axes
            assert scales_t.sharding.is_equivalent_to(NamedSharding(mesh, P(None, blocks)), 2)
        for out in outs[:-2]:
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim)

    @pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
    def test_columnwise_blocks_split_between_devices_beside_a_blocked_consumer(axis_type):
        """rms_norm_fp8_vjp of 64 rows of MXFP8 over 8 devices (8 rows each, blocks of 32),
        y_t and scales_t read by a consumer that splits the rows into blocks, as the layer's
        weight gradient does, beside an operand sharded by rows: under Auto axes XLA would
        give scales_t a part of the mesh axis, which the partitioner cannot take. The call
        runs on all the rows: the outputs and the backward's have the unsharded call's bits.
        (Under Explicit axes the consumer's reshape of rows split in parts of blocks is the
        user's to place: its operand there comes whole.)"""
        mesh = _mesh((8,), ("a",), axis_type)
        x, gamma = _args(fp8norm.rms_norm_fp8, (64, 256))
        g = random_rows(4, (64, 128), jnp.float32)
        dn = random_rows(5, (64, 256), jnp.float32)
        kw = layout("mxfp8")

        def op(x, gamma, g, dn):
            outs, backward = _training.rms_norm_fp8_vjp(x, gamma, columnwise=True, **kw)
            y_t, scales_t = outs[2:]
            blocks = y_t.astype(jnp.float32).reshape(256, 2, 32)
            blocks = blocks * scales_t.astype(jnp.float32)[..., None]
            weighted = jnp.einsum("kbr,brf->kf", blocks, g.reshape(2, 32, 128))
            return (*outs, *backward(dn), weighted)

        rows = NamedSharding(mesh, P("a", None))
        g_spec = rows if axis_type == AxisType.Auto else NamedSharding(mesh, P())
        context = jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext()
        with context:
            placed = (jax.device_put(x, rows), gamma, jax.device_put(g, g_spec))
            got = jax.jit(op)(*placed, jax.device_put(dn, rows))
        want = _single_device(op, x, gamma, g, dn)
        assert_same_bits(got[:6], want[:6])
        assert np.all(np.isfinite(np.asarray(want[6])))
        # XLA's own einsum, its float32 sums split over the devices as it chooses.
        tol = 2.0**-18
        np.testing.assert_allclose(got[6], want[6], rtol=tol, atol=tol * np.abs(want[6]).max())

    @pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
    def test_columnwise_inside_a_user_shard_map(name):
        # Each device's rows alone: its y_t is its rows' columns, as one call over them.
        mesh = _mesh()
        x, gamma = _args(fp8norm.rms_norm_fp8, (8, 32, 128))
        kw = dict(layout(name), columnwise=True)
        fn = jax.shard_map(
            lambda x, g: fp8norm.rms_norm_fp8(x, g, **kw),
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=(P("d"), P("d"), P(None, "d"), P(None, "d")),
        )
        outs = jax.jit(fn)(x, gamma)
        want = [
            _single_device(lambda x, g: fp8norm.rms_norm_fp8(x, g, **kw), x[i : i + 1], gamma)
            for i in range(8)
        ]
        for k, axis in enumerate((0, 0, 1, 1)):
            assert_same_bits(outs[k], np.concatenate([np.asarray(w[k]) for w in want], axis))

    def test_explicit_axes_residual_unlike_x_and_vmap_over_a_sharded_axis():
        mesh = _mesh((8,), ("a",), AxisType.Explicit)
        x, residual, gamma = _args(fp8norm.add_rms_norm_fp8, (16, 256))
        outs = jax.jit(fp8norm.add_rms_norm_fp8)(
            jax.device_put(x, NamedSharding(mesh, P("a", None))),
            jax.device_put(residual, NamedSharding(mesh, P(None, "a"))),
            gamma,
        )
        assert [o.sharding.spec for o in outs] == [P("a", None)] * 3  # x's rows decide
        assert_same_bits(outs, _single_device(fp8norm.add_rms_norm_fp8, x, residual, gamma))
        x3 = random_rows(7, (4, 8, 256), jnp.float32)
        x3s = jax.device_put(x3, NamedSharding(mesh, P(None, "a", None)))
        per_column = jax.vmap(fp8norm.rms_norm_fp8, in_axes=(1, None))
        outs = jax.jit(per_column)(x3s, gamma)
        assert [o.sharding.spec for o in outs] == [P("a", None, None)] * 2
        assert_same_bits(outs, _single_device(per_column, x3, gamma))

    def test_unreduced_input_is_refused_with_the_fix():
        mesh = _mesh((8,), ("a",), AxisType.Explicit)
        a = jax.device_put(np.ones((16, 64), np.float32), NamedSharding(mesh, P(None, "a")))
        b = jax.device_put(np.ones((64, 128), np.float32), NamedSharding(mesh, P("a", None)))
        gamma = np.ones((128,), np.float32)

        def norm_of_product(a, b, gamma, reduce_first):
            h = jnp.matmul(a, b, out_sharding=P(None, None, unreduced={"a"}))
            if reduce_first:
                h = jax.sharding.reshard(h, P(None, None))
            return fp8norm.rms_norm_fp8(h, gamma)

        def inside_shard_map(a, b, gamma):
            h = jnp.matmul(a, b, out_sharding=P(None, None, unreduced={"a"}))
            return jax.shard_map(
                fp8norm.rms_norm_fp8,
                in_specs=(P(None, None, unreduced={"a"}), P()),
                out_specs=(P(), P()),
            )(h, gamma)

        with jax.set_mesh(mesh):
            with pytest.raises(ValueError, match=r"x is unreduced over mesh axes \['a'\].*reshard"):
                jax.jit(norm_of_product, static_argnums=3)(a, b, gamma, False)
            with pytest.raises(ValueError, match=r"x is unreduced over mesh axes \['a'\]"):
                jax.jit(inside_shard_map)(a, b, gamma)
            outs = jax.jit(norm_of_product, static_argnums=3)(a, b, gamma, True)
        product = np.full((16, 128), 64.0, np.float32)
        assert_same_bits(outs, _single_device(fp8norm.rms_norm_fp8, product, gamma))

    @pytest.mark.parametrize("reduce_dtype", [None, jnp.float32], ids=["x_dtype", "float32"])
    @pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
    def test_allreduce_on_a_2d_mesh(axis_type, reduce_dtype):
        # Tensor parallel over "tp" (the all-reduce), rows sharded over "dp" (data parallel).
        mesh = _mesh((2, 4), ("dp", "tp"), axis_type)
        partials = random_rows(4, (4, 16, 512), jnp.bfloat16, spread=0.5)
        residual = random_rows(5, (16, 512), jnp.bfloat16, spread=0.5)
        gamma = random_gamma(6, 512, jnp.float32)
        placed = (
            jax.device_put(partials, NamedSharding(mesh, P("tp", "dp"))),
            jax.device_put(residual, NamedSharding(mesh, P("dp"))),
            jax.device_put(gamma, NamedSharding(mesh, P())),
        )

        def run(op):
            return jax.jit(
                jax.shard_map(
                    lambda p, r, g: op(p[0], r, g, axis_name="tp", reduce_dtype=reduce_dtype),
                    mesh=mesh,
                    in_specs=(P("tp", "dp"), P("dp"), P()),
                    out_specs=(P("dp"), P("dp"), P("dp")),
                )
            )(*placed)

        outs = run(fp8norm.allreduce_residual_rms_norm_fp8)
        for out in outs:
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("dp")), out.ndim)
        # The reference twin under the same shard_map: the same all-reduce, in the same order.
        want = run(fp8norm.reference.allreduce_residual_rms_norm_fp8)
        if reduce_dtype is not None:  # and in float32, the sum of the partials on one device
            h = functools.reduce(np.add, partials.astype(np.float32)) + residual.astype(np.float32)
            y, scales, _ = _single_device(fp8norm.reference.add_rms_norm_fp8, h, 0 * h, gamma)
            assert_same_bits([np.asarray(o) for o in want][:2], [y, scales])
        assert_same_bits([np.asarray(o) for o in outs], [np.asarray(w) for w in want])

    def test_sharded_calls_that_differ_only_in_settings_or_kernels_lower_apart():
        # custom_partitioning's call names its Python callbacks by address alone; jax's
        # persistent compilation cache keys on the program's text, so calls whose settings
        # or kernels differ must differ in their text without that address, or a reused
        # address would hand one the other's compiled program.
        x = jax.device_put(random_rows(1, (16, 256), jnp.bfloat16), NamedSharding(_mesh(), P("d")))
        gamma = random_gamma(2, 256, jnp.float32)

        def text(emulated=False, **kw):
            with fp8norm.simt.kernels() if emulated else contextlib.nullcontext():
                lowered = jax.jit(functools.partial(fp8norm.rms_norm_fp8, **kw)).lower(x, gamma)
            t = lowered.as_text()
            assert "CustomSPMDPartitioning" in t
            return re.sub(r'backend_config = "[0-9]+"', "", t)

        texts = [text(eps=1e-6), text(eps=1e-5), text(**layout("mxfp8"))]
        if fp8norm.simt.available():
            texts.append(text(emulated=True, eps=1e-6))
        assert len(set(texts)) == len(texts)
        assert text(eps=1e-6) == texts[0]  # the same call: the same text

    def test_rows_sharded_and_gamma_sharded():
        mesh = _mesh((2, 4), ("a", "b"))
        x, gamma = _args(fp8norm.rms_norm_fp8, (32, 256))
        xs = jax.device_put(x, NamedSharding(mesh, P("a", None)))
        gs = jax.device_put(gamma, NamedSharding(mesh, P("b")))
        outs = jax.jit(fp8norm.rms_norm_fp8)(xs, gs)
        assert_same_bits(outs, _single_device(fp8norm.rms_norm_fp8, x, gamma))

    def test_inside_a_user_shard_map():
        mesh = _mesh()
        x, gamma = _args(fp8norm.rms_norm_fp8, (64, 256))
        fn = jax.shard_map(
            lambda x, g: fp8norm.rms_norm_fp8(x, g),
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=(P("d"), P("d")),
        )
        outs = jax.jit(fn)(x, gamma)
        assert_same_bits(outs, _single_device(fp8norm.rms_norm_fp8, x, gamma))

    @pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
    def test_gradients_of_the_dequantized_ops_inside_a_user_shard_map(add):
        """Rows split over "d", gamma replicated: dx is each row's own (the single device's
        bits) and dgamma the sum of every device's part, as jax.grad of a replicated
        parameter is (docs/transformations.md): within float32 rounding of the one call's
        (a device's part alone could not leave the shard_map replicated)."""
        mesh = _mesh()
        x, gamma = _args(fp8norm.rms_norm_fp8, (64, 256), jnp.float32)
        residual = random_rows(4, x.shape, x.dtype)
        dn = random_rows(5, x.shape, jnp.float32)

        def loss(x, residual, gamma):
            if add:
                out, residual_out = fp8norm.add_rms_norm_fp8_dequantized(x, residual, gamma)
                return jnp.sum(out * dn) + jnp.sum(residual_out * dn)
            return jnp.sum(fp8norm.rms_norm_fp8_dequantized(x, gamma) * dn)

        def per_device(x, residual, gamma, dn_part):
            def local(x, residual, gamma):
                if add:
                    out, residual_out = fp8norm.add_rms_norm_fp8_dequantized(x, residual, gamma)
                    return jnp.sum(out * dn_part) + jnp.sum(residual_out * dn_part)
                return jnp.sum(fp8norm.rms_norm_fp8_dequantized(x, gamma) * dn_part)

            return jax.grad(local, (0, 1, 2))(x, residual, gamma)

        sharded = jax.jit(
            jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(P("d"), P("d"), P(), P("d")),
                out_specs=(P("d"), P("d"), P()),
            )
        )(x, residual, gamma, dn)
        whole = jax.jit(jax.grad(loss, (0, 1, 2)))(x, residual, gamma)
        assert_same_bits(sharded[0], whole[0])
        dgamma, want = np.asarray(sharded[2]), np.asarray(whole[2])
        assert np.all(np.isfinite(want)) and np.abs(want).min() > 0
        # Eight float32 partials summed: within their rounding, which cancellation in a
        # column can make large against its sum.
        np.testing.assert_allclose(dgamma, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        if add:
            assert_same_bits(sharded[1], whole[1])

    def test_vmap_and_dequantized_under_sharded_jit():
        mesh = _mesh()
        x, gamma = _args(fp8norm.rms_norm_fp8, (8, 16, 128), jnp.float32)
        xs = jax.device_put(x, NamedSharding(mesh, P("d")))
        batched = jax.jit(jax.vmap(fp8norm.rms_norm_fp8, in_axes=(0, None)))(xs, gamma)
        assert_same_bits(batched, _single_device(fp8norm.rms_norm_fp8, x, gamma))
        value = jax.jit(fp8norm.rms_norm_fp8_dequantized)(xs, gamma)
        y, scales = _single_device(fp8norm.rms_norm_fp8, x, gamma)
        np.testing.assert_array_equal(
            np.asarray(value), np.asarray(y, np.float32) * np.asarray(scales)
        )

    def test_export_of_a_sharded_program():
        # jax.export cannot serialise custom_partitioning's callback: exported programs
        # carry the kernel's call unpartitioned, and still give the same bits.
        pytest.importorskip("flatbuffers", reason="jax.export's serialisation needs flatbuffers")
        mesh = _mesh()
        x, gamma = _args(fp8norm.rms_norm_fp8, (64, 512))
        xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
        gs = jax.device_put(gamma, NamedSharding(mesh, P()))
        exported = jax.export.export(
            jax.jit(fp8norm.rms_norm_fp8), disabled_checks=fp8norm.EXPORT_DISABLED_CHECKS
        )(xs, gs)
        restored = jax.export.deserialize(exported.serialize())
        assert_same_bits(restored.call(xs, gs), _single_device(fp8norm.rms_norm_fp8, x, gamma))
