"""The shared set-up of the all-reduce tests (test_allreduce_xla.py,
test_allreduce_one_kernel.py, test_allreduce_selection.py): the mesh, the op under shard_map,
the inputs, and every device's copy of the outputs for a method, the CUDA kernels emulated
(jax_fp8norm.simt) for the one-kernel methods.

The 8 virtual CPU devices must be requested before jax starts: helpers.py asks for them, and
is imported first. In a session with fewer (HAVE_DEVICES false), each of those modules only
runs itself again in a subprocess with NUM_DEVICES.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_same_bits, random_gamma, random_rows
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm
import jax_fp8norm as fp8norm
import jax_fp8norm._allreduce
import jax_fp8norm.simt

NUM_DEVICES = 8
HAVE_DEVICES = len(jax.devices("cpu")) >= NUM_DEVICES

# method="one_shot" / "two_shot": the CUDA kernel, emulated (jax_fp8norm.simt), one
# virtual CPU device per GPU. The outputs must equal the reference twin's fixed-order
# fold bit for bit, on every device. kernel_check holds the kernel to the CPU kernel at
# more shapes, in long sequences and replays, and reports deadlocks.
ONE_KERNEL = ("one_shot", "two_shot")


def tp_mesh(size: int) -> jax.sharding.Mesh:
    return jax.make_mesh((size,), ("tp",), devices=jax.devices("cpu")[:size])


def run_in_shard_map(op, mesh, partials, residual, gamma, **kw):
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


def numpy_of(outputs):
    return [np.asarray(o) for o in outputs]


def allreduce_inputs(size, rows, hidden, dtype=jnp.bfloat16):
    partials = random_rows(rows * 7 + size, (size, rows, hidden), dtype, spread=0.5)
    residual = random_rows(rows + 1, (rows, hidden), dtype, spread=0.5)
    gamma = random_gamma(hidden, hidden, jnp.float32)
    return partials, residual, gamma


def assert_same_on_every_device(outputs):
    for out in outputs:
        shards = [np.asarray(s.data).view(np.uint8) for s in out.addressable_shards]
        assert len(shards) >= 1
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])


def run_stacked(op, mesh, partials, residual, gamma, **kw):
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
    return numpy_of(jax.block_until_ready(jax.jit(fn)(*placed)))


def assert_every_copy(stacked, want):
    """Each device's copy of the outputs (``run_stacked``) has ``want``'s bits."""
    for t in range(stacked[0].shape[0]):
        assert_same_bits([o[t] for o in stacked], want)


def fixed_order_reference(method, mesh, *args, **kw):
    """The reference twin's outputs for ``method``, as NumPy (one copy: the twin's
    all-gather makes them replicated)."""
    op = fp8norm.reference.allreduce_residual_rms_norm_fp8
    return numpy_of(run_in_shard_map(op, mesh, *args, method=method, **kw))


def emulated(method, mesh, *args, **kw):
    """The op's outputs for ``method``, the CUDA kernels emulated: every device's copy
    (``run_stacked``)."""
    with jax_fp8norm.simt.kernels():
        op = fp8norm.allreduce_residual_rms_norm_fp8
        return run_stacked(op, mesh, *args, method=method, **kw)


def with_method(method, mesh, *args, **kw):
    """Every device's outputs for ``method``: "xla" on the CPU kernels, the others
    (auto among them) on the emulated CUDA kernels."""
    if method == "xla":
        op = fp8norm.allreduce_residual_rms_norm_fp8
        return run_stacked(op, mesh, *args, method=method, **kw)
    return emulated(method, mesh, *args, **kw)


def auto_on_emulated_devices(size, payload_bytes):
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
