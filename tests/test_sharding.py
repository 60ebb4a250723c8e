"""The ops under a plain jax.jit with sharded inputs, on 8 virtual CPU devices: rows
sharded stay sharded (no all-gather, outputs keep the row sharding), a sharded hidden axis
still gives the right answer, and the ops work inside a user's shard_map.

Like test_allreduce, a normal session reruns this module in a subprocess with the devices.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_bits, random_gamma, random_rows, rerun_with_virtual_cpu_devices
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm

NUM_DEVICES = 8

if len(jax.devices("cpu")) < NUM_DEVICES:

    def test_on_eight_virtual_cpu_devices():
        rerun_with_virtual_cpu_devices(__file__, NUM_DEVICES)

else:
    COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")

    def _mesh(shape=(8,), names=("d",), axis_type=AxisType.Auto):
        return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))

    def _single_device(op, *args):
        cpu0 = jax.devices("cpu")[0]
        return jax.jit(op)(*(jax.device_put(np.asarray(a), cpu0) for a in args))

    def _collectives(hlo: str) -> list[str]:
        return [c for c in COLLECTIVES if re.search(rf"\b{c}(?:-start)?\(", hlo)]

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
        assert not _collectives(hlo), _collectives(hlo)
        assert hlo.count('custom_call_target="fp8norm_') == 1
        for out in outs:
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim), out.sharding
        assert_same_bits(outs, _single_device(op, *args))

    @pytest.mark.parametrize("op", [fp8norm.rms_norm_fp8, fp8norm.add_rms_norm_fp8])
    @pytest.mark.parametrize(
        ("mesh_shape", "spec"),
        [((8,), P(None, "d")), ((2, 4), P("a", "b")), ((4, 2), P(None, ("a", "b")))],
    )
    def test_hidden_sharded_inputs_give_the_right_answer(op, mesh_shape, spec):
        names = ("d",) if len(mesh_shape) == 1 else ("a", "b")
        mesh = _mesh(mesh_shape, names)
        args = _args(op, (16, 1024))
        placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args[:-1]]
        placed.append(jax.device_put(args[-1], NamedSharding(mesh, P(spec[-1]))))
        assert_same_bits(jax.jit(op)(*placed), _single_device(op, *args))

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
