"""The layer (rms_norm_dense) in the programs of data and tensor parallelism, on 8 virtual
CPU devices: rows sharded under jit (Auto and Explicit axes) and column-parallel weights
inside shard_map. Everything agrees with the single device's call but for the order of
float32 sums: the GEMMs are XLA's, whose order of summation may differ between the
sharded program and the single device's (docs/spec.md, "The layer"), and dgamma, dw and,
under tensor parallelism, dx are sums over the devices. Like test_sharding, a session
with fewer devices reruns this module in a subprocess with 8."""

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
    TIERS,
    random_gamma,
    random_rows,
    rerun_with_virtual_cpu_devices,
    same_bits,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm
from jax_fp8norm.testing import ulp_distance

NUM_DEVICES = 8
K, F, ROWS = 256, 512, 512

if len(jax.devices("cpu")) < NUM_DEVICES:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(__file__, NUM_DEVICES, tier)

else:

    def _keywords(name: str, *, keyed: bool = True) -> dict:
        """The recipe's keywords (NVFP4's global scale). An FP4 recipe's gradient rounded
        stochastically with one key where ``keyed`` (its bits at the element's global row
        under jit's partitioning), to nearest otherwise (inside shard_map, whose rows and
        columns are a device's own); the Hadamard transform off until the norm's
        columnwise codes take it."""
        keywords = {"recipe": name, **({"global_scale": 0.0021} if name == "nvfp4" else {})}
        if fp8norm.RECIPES[name].fp4:
            parts = {"key": jax.random.key(7)} if keyed else {"stochastic_rounding": False}
            keywords.update(parts, hadamard=False)
        return keywords

    def _operands(seed=0):
        x = random_rows(seed, (ROWS, K), jnp.bfloat16)
        gamma = random_gamma(seed, K, jnp.float32)
        rng = np.random.default_rng(seed)
        w = (rng.standard_normal((K, F)) / 16).astype(np.float32)
        g = rng.standard_normal((ROWS, F)).astype(np.float32)
        return x, gamma, w, g

    def _grads(keywords):
        def loss(x, gamma, w, g):
            out = fp8norm.rms_norm_dense(x, gamma, w, **keywords)
            return jnp.sum(out.astype(jnp.float32) * g), out

        return jax.grad(loss, (0, 1, 2), has_aux=True)

    def _single_device(fn, *args):
        cpu0 = jax.devices("cpu")[0]
        return jax.jit(fn)(*(jax.device_put(np.asarray(a), cpu0) for a in args))

    def _close(got, want, what):
        """Equal but for the order of a float32 sum: 2^-16 of the largest value, or an ulp
        of a bfloat16 result."""
        rtol = 2.0**-7 if got.dtype == jnp.bfloat16 else 2.0**-16
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(want).max() > 0, what
        np.testing.assert_allclose(
            got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=what
        )

    @pytest.mark.parametrize(
        ("axis_type", "name"),
        [
            (AxisType.Explicit, "nvfp4"),
            *(
                pytest.param(axis_type, name, marks=EXTENDED)
                for axis_type, name in [
                    (AxisType.Auto, "nvfp4"),
                    (AxisType.Auto, "mxfp8"),
                    (AxisType.Explicit, "mxfp8"),
                    (AxisType.Auto, "fp8_row"),
                    (AxisType.Explicit, "fp8_row"),
                ]
            ),
        ],
    )
    def test_data_parallel_rows(axis_type, name):
        keywords = _keywords(name)
        mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(axis_type,))
        x, gamma, w, g = _operands()
        rows = NamedSharding(mesh, P("data", None))
        # Explicit axes as their users set them: the mesh in context too (jnp's ops then
        # check the sharding of every axis they move).
        context = jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext()
        with context:
            (dx, dgamma, dw), out = jax.jit(_grads(keywords))(
                jax.device_put(x, rows), gamma, w, jax.device_put(g, rows)
            )
        (dx1, dgamma1, dw1), out1 = _single_device(_grads(keywords), x, gamma, w, g)
        if axis_type == AxisType.Explicit:  # each device's rows stay there
            assert out.sharding.spec == P("data", None) and dx.sharding.spec == P("data", None)
        # Every device's rows, each against the single device's.
        for shard in out.addressable_shards:
            _close(shard.data, np.asarray(out1)[shard.index], "out")
        _close(dx, dx1, "dx")
        _close(dgamma, dgamma1, "dgamma")
        _close(dw, dw1, "dw")

    # Rows sharded under jit so that a device's share is not whole blocks of the norm's
    # columnwise codes: 64 rows of MXFP8 over 8 devices, 8 rows each, and 32-row blocks.
    SPLIT_ROWS, WHOLE_ROWS, SPLIT_F = 64, 256, 128

    def _layer_grads(add: bool, keywords: dict):
        def loss(x, gamma, w, g):
            if add:
                out, residual_out = fp8norm.add_rms_norm_dense(x, x, gamma, w, **keywords)
                extra = jnp.sum(residual_out.astype(jnp.float32) * x.astype(jnp.float32))
                outs = (out, residual_out)
            else:
                out = fp8norm.rms_norm_dense(x, gamma, w, **keywords)
                extra, outs = 0.0, (out,)
            return jnp.sum(out.astype(jnp.float32) * g) + extra, outs

        return jax.grad(loss, (0, 1, 2), has_aux=True)

    def _rows_sharded_layer(rows: int, axis_type, add: bool = False, name: str = "mxfp8"):
        """The layer's gradients and outputs with x's and g's rows over 8 devices, and the
        compiled program's text."""
        keywords = _keywords(name)
        mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(axis_type,))
        _, x, gamma, w, g = _sum_operands(9)
        x, w, g = x[:rows], w[:, :SPLIT_F], g[:rows, :SPLIT_F]
        spec = NamedSharding(mesh, P("data", None))
        args = (jax.device_put(x, spec), gamma, w, jax.device_put(g, spec))
        context = jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext()
        fn = jax.jit(_layer_grads(add, keywords))
        with context:
            got = fn(*args)
            hlo = fn.lower(*args).compile().as_text()
        want = _single_device(_layer_grads(add, keywords), x, gamma, w, g)
        return got, want, hlo

    def _norm_kernel_rows(hlo: str) -> int:
        """The rows of x in the compiled program's norm call (a device's or all of them)."""
        target = re.compile(r'custom_call_target="fp8norm_(add_)?rms_norm_fp8"')
        (line,) = [ln for ln in hlo.splitlines() if target.search(ln)]
        return int(re.search(r"operand_layout_constraints=\{bf16\[(\d+),", line).group(1))

    BLOCK_ROWS = {"mxfp8": 32, "fp8_group128": 128, "nvfp4": 16, "mxfp4": 32}

    @pytest.mark.parametrize(
        ("axis_type", "add", "name"),
        [
            (AxisType.Auto, False, "mxfp8"),
            (AxisType.Explicit, False, "mxfp8"),
            (AxisType.Explicit, True, "mxfp8"),
            *(
                pytest.param(axis_type, add, name, marks=EXTENDED)
                for axis_type, add, name in [
                    (AxisType.Auto, True, "mxfp8"),
                    *(
                        (axis_type, False, name)
                        for axis_type in (AxisType.Auto, AxisType.Explicit)
                        for name in ("fp8_group128", "nvfp4", "mxfp4")
                    ),
                ]
            ),
        ],
    )
    def test_rows_sharded_in_parts_of_blocks_are_gathered(axis_type, add, name):
        """A device's share of the rows not whole blocks: the norm runs on all the rows (on
        every device), and every output and gradient has the unsharded call's bits. Under
        Explicit axes the layer gathers the rows itself, dw included; under Auto axes the
        norm's lowering does, and XLA may still split dw's GEMM over the rows, summing the
        devices' parts in its own order (docs/spec.md, "The layer")."""
        (grads, outs), (grads1, outs1), hlo = _rows_sharded_layer(SPLIT_ROWS, axis_type, add, name)
        block = BLOCK_ROWS[name]  # the norm's rows: all of them, padded to the block
        assert _norm_kernel_rows(hlo) == -(-SPLIT_ROWS // block) * block
        for what, a, b in zip(("out", "residual_out")[: len(outs)], outs, outs1, strict=True):
            _same_bits(a, b, what)
        _same_bits(grads[0], grads1[0], "dx")
        _same_bits(grads[1], grads1[1], "dgamma")
        if axis_type == AxisType.Explicit:  # the caller's sharding, the unsharded bits
            _same_bits(grads[2], grads1[2], "dw")
            assert outs[0].sharding.spec == P("data", None), outs[0].sharding
            assert grads[0].sharding.spec == P("data", None), grads[0].sharding
        else:
            _summed_over_devices(grads[2], grads1[2], "dw")

    @pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
    def test_rows_sharded_in_whole_blocks_stay_sharded(axis_type):
        """256 rows over 8 devices, 32 each: each device's norm call takes its own rows (a
        gather of the rows would cost the devices' work and an all-gather)."""
        (grads, (out,)), (grads1, (out1,)), hlo = _rows_sharded_layer(WHOLE_ROWS, axis_type)
        assert _norm_kernel_rows(hlo) == WHOLE_ROWS // NUM_DEVICES
        _same_bits(out, out1, "out")
        _same_bits(grads[0], grads1[0], "dx")
        _summed_over_devices(grads[2], grads1[2], "dw")

    @pytest.mark.parametrize(
        ("add", "w_spec"),
        [(False, P(None, "model")), (True, P(None, "model")), (False, P("model", None))],
    )
    def test_gathered_rows_keep_the_weights_columns(add, w_spec):
        """Rows split mid-block (32 rows of MXFP8, 16 a device over "data") and w split over
        "model" of a (2, 4) Explicit mesh, by columns or by K: the gathered layer's out has
        the type of the undifferentiated call (with w's columns over "model", its own), dw
        has w's type (a custom_vjp refuses another). out, residual_out and dw have the
        unsharded call's bits (all the rows on each device: dw's sums over the rows in one
        device's order); with w's columns split, dn's GEMM sums over F across the 4
        devices in XLA's order, so dx is that sum rounded once and dgamma within the sums'
        order (measured: dx identical, 8 of 128 of dgamma one float32 ulp off)."""
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        _, x, gamma, w, g = _sum_operands(9)
        x, w, g = x[:32], w[:, :SPLIT_F].astype(jnp.bfloat16), g[:32, :SPLIT_F]
        args = (
            jax.device_put(x, NamedSharding(mesh, P("data", None))),
            gamma,
            jax.device_put(w, NamedSharding(mesh, w_spec)),
            jax.device_put(g, NamedSharding(mesh, P("data", w_spec[1]))),
        )
        keywords = {"recipe": "mxfp8"}
        layer = fp8norm.add_rms_norm_dense if add else fp8norm.rms_norm_dense
        with jax.set_mesh(mesh):
            grads, outs = jax.jit(_layer_grads(add, keywords))(*args)
            plain = jax.jit(lambda x, gamma, w: layer(*((x,) * (1 + add)), gamma, w, **keywords))
            plain = plain(*args[:3])
        plain = plain if add else (plain,)
        names = ("out", "residual_out")[: len(outs)]
        for what, a, b in zip(names, outs, plain, strict=True):
            assert jax.typeof(a).sharding == jax.typeof(b).sharding, (what, a.sharding, b.sharding)
        assert outs[0].sharding.spec == P("data", w_spec[1]), outs[0].sharding
        assert grads[0].sharding.spec == P("data", None), grads[0].sharding
        assert jax.typeof(grads[2]).sharding == jax.typeof(args[2]).sharding, grads[2].sharding
        grads1, outs1 = _single_device(_layer_grads(add, keywords), x, gamma, w, g)
        for what, a, b in zip(names, outs, outs1, strict=True):
            _same_bits(a, b, what)
        _same_bits(grads[2], grads1[2], "dw")
        _rounded_once(grads[0], grads1[0], "dx")
        _summed_over_devices(grads[1], grads1[1], "dgamma")

    @pytest.mark.extended  # the default tier's tensor-parallel MLP has a column-parallel layer
    @pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
    def test_column_parallel_inside_shard_map(name):
        """Gate / up projections split over "tp" by columns; x replicated, so its cotangent
        (and gamma's) is the sum of every device's part."""
        mesh = jax.make_mesh((NUM_DEVICES,), ("tp",), axis_types=(AxisType.Auto,))
        x, gamma, w, g = _operands(1)

        def loss(x, gamma, w, g):
            def local(x, gamma, w, g):
                out = fp8norm.rms_norm_dense(x, gamma, w, **_keywords(name, keyed=False))
                return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * g), "tp")

            return jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P(), P(), P(None, "tp"), P(None, "tp")),
                out_specs=P(),
            )(x, gamma, w, g)

        dx, dgamma, dw = jax.jit(jax.grad(loss, (0, 1, 2)))(x, gamma, w, g)
        whole = _grads(_keywords(name, keyed=False))
        (dx1, dgamma1, dw1), _ = _single_device(whole, x, gamma, w, g)
        # w's columns are quantised per device as on one (blocks along K; w^T's blocks along
        # F lie within a device's columns); dx is the sum of the devices' parts of dn.
        _close(dw, dw1, "dw")
        _close(dx, dx1, "dx")
        _close(dgamma, dgamma1, "dgamma")

    @pytest.mark.parametrize("name", ["mxfp8", pytest.param("nvfp4", marks=EXTENDED)])
    def test_tensor_parallel_mlp_then_the_next_norm(name):
        """The examples' tensor-parallel layout, differentiated: a column-parallel up
        projection (rms_norm_dense of the replicated residual stream, w split by columns),
        SiLU, a row-parallel down projection (a partial sum on each device), then
        allreduce_add_rms_norm_dense into the next layer's column-parallel projection. The
        gradients of every parameter and of the input against the same block on one
        device (add_rms_norm_dense of the whole sum)."""
        keywords = _keywords(name, keyed=False)
        mesh = jax.make_mesh((NUM_DEVICES,), ("tp",), axis_types=(AxisType.Auto,))
        rng = np.random.default_rng(4)
        x = jnp.asarray(rng.standard_normal((128, K)), jnp.bfloat16)
        g1, g2 = (jnp.asarray(1 + 0.1 * rng.standard_normal(K), jnp.float32) for _ in "12")
        up = jnp.asarray(rng.standard_normal((K, F)) / 16, jnp.float32)
        down = jnp.asarray(rng.standard_normal((F, K)) / 16, jnp.float32)
        nxt = jnp.asarray(rng.standard_normal((K, F)) / 16, jnp.float32)
        cot = jnp.asarray(rng.standard_normal((128, F)), jnp.float32)

        def block(x, g1, up, down, g2, nxt, cot, *, tp):
            hidden = fp8norm.rms_norm_dense(x, g1, up, **keywords)
            partial = jax.nn.silu(hidden) @ down.astype(jnp.bfloat16)
            if tp:
                out, residual_out = fp8norm.allreduce_add_rms_norm_dense(
                    partial, x, g2, nxt, axis_name="tp", **keywords
                )
            else:
                out, residual_out = fp8norm.add_rms_norm_dense(partial, x, g2, nxt, **keywords)
            loss = jnp.sum(out.astype(jnp.float32) * cot)
            loss = jax.lax.psum(loss, "tp") if tp else loss
            return loss + jnp.sum(residual_out.astype(jnp.float32) ** 2)

        def sharded(*args):
            columns, rows = P(None, "tp"), P("tp", None)
            return jax.shard_map(
                functools.partial(block, tp=True),
                mesh=mesh,
                in_specs=(P(), P(), columns, rows, P(), columns, columns),
                out_specs=P(),
            )(*args)

        args = (x, g1, up, down, g2, nxt, cot)
        which = (0, 1, 2, 3, 4, 5)
        got = jax.jit(jax.grad(sharded, which))(*args)
        want = _single_device(jax.grad(functools.partial(block, tp=False), which), *args)
        for what, a, b in zip(("x", "g1", "up", "down", "g2", "next"), got, want, strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            error = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert error <= TP_AGREEMENT[name], (what, error)

    # How far the tensor-parallel block's gradients may be from the single device's,
    # relative (Frobenius). The devices' bfloat16 partial sums differ from one GEMM's in
    # their last bits, and XLA's all-reduce rounds their bfloat16 sum as it chooses (jax
    # 0.10's CPU all-reduce lands on the single GEMM's residual bits almost everywhere,
    # 0.12's on a quarter of them differently); the moved residual bits move codes of the
    # quantised tensors after them (MXFP8: measured 6e-5 on jax 0.10, 0.008 on 0.12). NVFP4
    # also takes each device's global scales from its own columns, so that its two
    # gradients are two different roundings (each about 8% of the norm off the exact one:
    # measured 0.12-0.14 apart). A missing sum over the devices leaves out 7/8 of a term.
    TP_AGREEMENT = {"mxfp8": 0.02, "nvfp4": 0.25}

    # The sums over devices inside shard_map (docs/spec.md, "The layer"): dgamma and dw
    # summed over the axis that splits the rows, dn over the axis that splits w by columns,
    # each in float32. Small shapes: 8 devices of 32 rows or 32 columns, MXFP8's blocks, so
    # that each device quantises what one device would (the blocks never cross devices).
    SUM_ROWS, SUM_K, SUM_F = 256, 128, 256
    MX = {"recipe": "mxfp8"}

    def _sum_operands(seed):
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal((SUM_ROWS, SUM_K)), jnp.bfloat16)
        gamma = jnp.asarray(1 + 0.1 * rng.standard_normal(SUM_K), jnp.float32)
        w = jnp.asarray(rng.standard_normal((SUM_K, SUM_F)) / 16, jnp.float32)
        g = jnp.asarray(rng.standard_normal((SUM_ROWS, SUM_F)), jnp.float32)
        return rng, x, gamma, w, g

    def _same_bits(got, want, what):
        assert np.all(np.isfinite(np.asarray(want, np.float32))), what
        same_bits(got, want, what)

    def _summed_over_devices(got, want, what):
        """float32 sums over the devices, in XLA's order: within 2^-18 of the largest value
        (measured: under 1e-7), where a sum left out or counted twice is off by the size of
        a term."""
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.all(np.isfinite(want)) and np.abs(want).max() > 0, what
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error <= 2.0**-18, (what, error)

    def _rounded_once(got, want, what):
        """A 16-bit result of a float32 sum over the devices, rounded once: within one unit
        in its last place, and at least 99% of the elements identical (measured: all). A
        result rounded on each device and then summed differs in far more (measured: 41%
        of dx when dn is not summed before the norm's backward)."""
        assert np.asarray(got).dtype == np.asarray(want).dtype == jnp.bfloat16, what
        ulps = ulp_distance(got, want)
        assert ulps.max() <= 1, (what, float(ulps.max()))
        assert np.count_nonzero(ulps) <= 0.01 * ulps.size, (what, np.count_nonzero(ulps))

    def test_rows_split_inside_shard_map():
        """Data parallelism written as shard_map: each device differentiates its 32 rows,
        and the layer sums dgamma and dw over the "data" axis (gamma and w are the same on
        every device). out and dx are each row's own: the same bits as one device's."""
        mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
        _, x, gamma, w, g = _sum_operands(5)
        grads = _grads({"recipe": "mxfp8"})

        def sharded(x, gamma, w, g):
            def local(x, gamma, w, g):
                (dx, dgamma, dw), out = grads(x, gamma, w, g)
                return dx, dgamma, dw, out

            rows = P("data", None)
            return jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(rows, P(), P(), rows),
                out_specs=(rows, P(), P(), rows),
            )(x, gamma, w, g)

        dx, dgamma, dw, out = jax.jit(sharded)(x, gamma, w, g)
        (dx1, dgamma1, dw1), out1 = _single_device(grads, x, gamma, w, g)
        # Row-local, but each a GEMM of another program's: float32 rounding apart at most.
        _close(out, out1, "out")
        _close(dx, dx1, "dx")
        _summed_over_devices(dgamma, dgamma1, "dgamma")
        _summed_over_devices(dw, dw1, "dw")

    def test_column_parallel_sums_dn_before_the_norms_backward():
        """w split by columns over "tp", x replicated: each device's dgrad GEMM gives its
        columns' part of dn, which the layer sums over "tp" in float32 before the norm's
        backward, so that the bfloat16 dx is rounded once."""
        mesh = jax.make_mesh((NUM_DEVICES,), ("tp",), axis_types=(AxisType.Auto,))
        _, x, gamma, w, g = _sum_operands(6)
        x, g = x[:64], g[:64]

        def loss(x, gamma, w, g):
            def local(x, gamma, w, g):
                out = fp8norm.rms_norm_dense(x, gamma, w, recipe="mxfp8")
                return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * g), "tp"), out

            columns = P(None, "tp")
            return jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P(), P(), columns, columns),
                out_specs=(P(), columns),
            )(x, gamma, w, g)

        (dx, dgamma, dw), out = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(x, gamma, w, g)
        (dx1, dgamma1, dw1), out1 = _single_device(_grads({"recipe": "mxfp8"}), x, gamma, w, g)
        _rounded_once(out, out1, "out")
        _rounded_once(dx, dx1, "dx")
        _summed_over_devices(dgamma, dgamma1, "dgamma")
        _summed_over_devices(dw, dw1, "dw")

    def _allreduce_layer(devices: int):
        """The gradients and outputs of allreduce_add_rms_norm_dense over ``devices``
        devices: partials of x [devices, rows, K] summed in float32 over "tp", a bfloat16
        residual, w split by columns."""
        mesh = jax.make_mesh(
            (devices,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
        )

        def loss(parts, residual, gamma, w, g, d_residual_out):
            def local(part, residual, gamma, w, g, d_residual_out):
                out, residual_out = fp8norm.allreduce_add_rms_norm_dense(
                    part[0], residual, gamma, w, axis_name="tp", reduce_dtype=jnp.float32, **MX
                )
                total = jax.lax.psum(jnp.sum(out.astype(jnp.float32) * g), "tp")
                total += jnp.sum(residual_out.astype(jnp.float32) * d_residual_out)
                return total, (out, residual_out)

            columns = P(None, "tp")
            return jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P("tp"), P(), P(), columns, columns, P()),
                out_specs=(P(), (columns, P())),
            )(parts, residual, gamma, w, g, d_residual_out)

        return jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))

    def test_allreduce_layer_float32_sum_bfloat16_residual():
        """allreduce_add_rms_norm_dense with reduce_dtype=float32 and a bfloat16 residual:
        the backward of a float32 h beside a 16-bit residual, and w split by columns (dn
        summed over "tp"), against the same layer on one device, whose x is the whole sum.
        The partials are the sum times powers of two that add up to 1, so that their float32
        sum is exact in any order: residual_out has the same bits, and each partial's
        cotangent is the sum's (counted once)."""
        rng, total, gamma, w, g = _sum_operands(7)
        total, g = total[:64], g[:64]
        share = np.array([2.0**-k for k in range(1, NUM_DEVICES)] + [2.0 ** -(NUM_DEVICES - 1)])
        parts = (np.asarray(total, np.float32)[None] * share[:, None, None]).astype(jnp.bfloat16)
        assert np.array_equal(parts.astype(np.float64).sum(0), np.asarray(total, np.float64))
        residual = jnp.asarray(rng.standard_normal(total.shape), jnp.bfloat16)
        d_residual_out = jnp.asarray(rng.standard_normal(total.shape), jnp.float32)
        args = (residual, gamma, w, g, d_residual_out)
        (dparts, dresidual, dgamma, dw), (out, residual_out) = _allreduce_layer(NUM_DEVICES)(
            parts, *args
        )
        (dx1, dresidual1, dgamma1, dw1), (out1, residual_out1) = _allreduce_layer(1)(
            np.asarray(total)[None], *args
        )
        _same_bits(residual_out, residual_out1, "residual_out")
        _rounded_once(out, out1, "out")
        for i in range(NUM_DEVICES):
            _rounded_once(dparts[i], dx1[0], f"dx of partial {i}")
        _rounded_once(dresidual, dresidual1, "dresidual")
        _summed_over_devices(dgamma, dgamma1, "dgamma")
        _summed_over_devices(dw, dw1, "dw")

    @pytest.mark.parametrize("differs", ["gamma", "static_scale"])
    def test_a_norm_of_each_device_counts_once(differs):
        """A gamma, or a calibrated scale, that differs between devices (stacked [devices,
        ...], split over "tp") beside a replicated x and residual: each device's layer is
        another function of x, whose backward is its own. x's, the residual's and (for a
        static scale) gamma's cotangents are the sums of every device's, each counted once:
        dn is summed only where the norm's outputs are the same on every device (a w split
        by columns), and here they are not. Against the same sum on one device: bfloat16
        sums of 8 terms in two orders, a few units in the last place apart, where a
        gradient counted on every device is 8 times too large."""
        mesh = jax.make_mesh((NUM_DEVICES,), ("tp",), axis_types=(AxisType.Auto,))
        rng, x, gamma, w, g = _sum_operands(8)
        x, g = x[:32], g[:32]
        residual = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)
        spread = 1 + 0.1 * rng.standard_normal((NUM_DEVICES, SUM_K if differs == "gamma" else 1))
        stacked = jnp.asarray(spread * (1.0 if differs == "gamma" else 0.02), jnp.float32)

        def layer(x, residual, gamma, w, g, mine):
            keywords = {"recipe": "mxfp8"} if differs == "gamma" else {"recipe": "fp8_static"}
            if differs == "gamma":
                gamma = mine
            else:
                keywords["static_scale"] = mine
            out, residual_out = fp8norm.add_rms_norm_dense(x, residual, gamma, w, **keywords)
            return jnp.sum(out.astype(jnp.float32) * g) + jnp.sum(residual_out.astype(jnp.float32))

        def sharded(x, residual, gamma, w, g, stacked):
            def local(x, residual, gamma, w, g, stacked):
                return jax.lax.psum(layer(x, residual, gamma, w, g, stacked[0]), "tp")

            replicated = (P(),) * 5
            return jax.shard_map(local, mesh=mesh, in_specs=(*replicated, P("tp")), out_specs=P())(
                x, residual, gamma, w, g, stacked
            )

        def whole(x, residual, gamma, w, g, stacked):
            return sum(layer(x, residual, gamma, w, g, stacked[i]) for i in range(NUM_DEVICES))

        # The cotangents of x, the residual, gamma (each device's own gamma where they
        # differ) and w; a static scale's are zeros (the straight-through rule).
        which = (0, 1, 5 if differs == "gamma" else 2, 3)
        args = (x, residual, gamma, w, g, stacked)
        got = jax.jit(jax.grad(sharded, which))(*args)
        want = _single_device(jax.grad(whole, which), *args)
        for what, a, b in zip(("dx", "dresidual", "dgamma", "dw"), got, want, strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.abs(b).max() > 0, what
            error = np.abs(a - b).max() / np.abs(b).max()
            assert error <= 2.0**-6, (what, error)
