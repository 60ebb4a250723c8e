"""The CUDA kernels on a grid of odd shapes, for compute-sanitizer (tools/gpu/sanitize_gpu.sh).

Every kernel variant (block_shared, warp_rows, block_registers) and every path of each is
taken: vectorised and scalar, the shared-memory row cache and the re-reading path (rows
longer than the cache), rows in registers with groups past the last row, one row and
many, every input dtype, 16-bit gamma and residual next to float32 sums, scales per group
(shuffled in registers and per thread in block_shared), e8m0, power-of-two and static
scales, and the rounding kernel. Each result is checked against the reference too, so a
silent wrong answer fails as well. Exits non-zero on a mismatch; compute-sanitizer's own
exit code reports its errors.

The scalar path is reached by hidden sizes that are not a multiple of the vector width
(1, 7, 9, 1023, 1025, 8193, 70001 in every dtype; 4098 for float32), not by offsets: XLA
hands a custom call a slice at an element offset as a fresh, aligned buffer, so a jax
program cannot pass the kernel a misaligned row (tests/test_cuda_device_setup.py shows it on
the emulated device). The misaligned vector path is the SIMT sanitizer run's
(tools/checks/simt_check.sh), which calls the launch with misaligned pointers directly.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8norm as fp8norm
from jax_fp8norm._checks import make_params
from jax_fp8norm._primitives import add_rms_norm_fp8_p
from jax_fp8norm.ops import round_float32
from jax_fp8norm.testing import assert_matches_reference

HIDDEN = [1, 7, 8, 9, 100, 264, 1023, 1025, 4096, 4098, 8193, 16384, 56321, 70001]
ROWS = [1, 3, 130]  # one per (dtype, hidden) pair, in turn


def _inputs(seed, rows, hidden, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, hidden)) * 10.0 ** rng.uniform(-2, 2, (rows, 1))
    x[0, 0] = np.nan if rows > 2 and seed % 3 == 0 else x[0, 0]
    residual = rng.standard_normal((rows, hidden))
    gamma = rng.uniform(-2, 2, hidden)
    return x.astype(dtype), residual.astype(dtype), gamma.astype(jnp.bfloat16)


def _reference(op, *args):
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return jax.jit(getattr(fp8norm.reference, op))(*(jax.device_put(a, cpu) for a in args))


def _reference_with(op, keywords, *args):
    cpu = jax.devices("cpu")[0]
    fn = getattr(fp8norm.reference, op)
    with jax.default_device(cpu):
        placed = [jax.device_put(a, cpu) for a in args]
        return jax.jit(lambda *a: fn(*a, **keywords))(*placed)


def _shapes(platform: str, device) -> int:
    count = 0
    for i, (dtype, hidden) in enumerate(
        (dtype, hidden) for dtype in (jnp.bfloat16, jnp.float16, jnp.float32) for hidden in HIDDEN
    ):
        rows = ROWS[i % len(ROWS)]
        x, residual, gamma = _inputs(i, rows, hidden, dtype)
        for op, args in (("rms_norm_fp8", (x, gamma)), ("add_rms_norm_fp8", (x, residual, gamma))):
            placed = [jax.device_put(a, device) for a in args]
            out = jax.jit(getattr(fp8norm, op))(*placed)
            ref = _reference(op, *args)
            assert_matches_reference([np.asarray(o) for o in out], [np.asarray(o) for o in ref])
            count += 1
    return count


def main(platform: str) -> int:
    device = jax.devices(platform)[0]
    count = 0
    for variant in fp8norm.cuda_kernel_variants()[1:]:  # every variant but auto
        with fp8norm.use_cuda_kernel(variant):
            count += _shapes(platform, device)
    # Scales per group (shuffled in registers: 32 and 128; per thread in block_shared: 3,
    # and rows too long for registers), e8m0 and power-of-two scales, a static scale.
    layouts = (
        dict(group_size=32, scale_dtype=jnp.float8_e8m0fnu),
        dict(group_size=128, power_of_two_scales=True),
        dict(group_size=3),
        dict(static_scale=0.02),
    )
    for variant in fp8norm.cuda_kernel_variants()[1:]:
        with fp8norm.use_cuda_kernel(variant):
            for i, hidden in enumerate((384, 7296, 24576)):  # multiples of 3 and 128
                x, residual, gamma = _inputs(100 + i, ROWS[i], hidden, jnp.bfloat16)
                for kw in layouts:
                    placed = [jax.device_put(a, device) for a in (x, residual, gamma)]
                    out = jax.jit(lambda *a, kw=kw: fp8norm.add_rms_norm_fp8(*a, **kw))(*placed)
                    ref = _reference_with("add_rms_norm_fp8", kw, x, residual, gamma)
                    assert_matches_reference(
                        [np.asarray(o) for o in out],
                        [np.asarray(o) for o in ref],
                        power_of_two=kw.get("power_of_two_scales") or None,
                    )
                    count += 1
    # A float32 sum meeting a bfloat16 residual stream (the float32 all-reduce's path).
    x, residual, gamma = _inputs(1, 7, 1031, jnp.bfloat16)
    params = make_params(
        jnp.bfloat16,
        eps=1e-6,
        weight_offset=0.0,
        scale_ub=None,
        out_dtype=jnp.float8_e4m3fn,
        scale_dtype=jnp.float32,
    )
    with jax.default_device(device):
        out = add_rms_norm_fp8_p.bind(
            jnp.asarray(x.astype(np.float32)),
            jnp.asarray(residual),
            jnp.asarray(gamma),
            **params.as_dict(),
        )
        jax.block_until_ready(out)
        count += 1
        # The rounding kernel.
        values = jnp.asarray(np.linspace(-500, 500, 100003).astype(np.float32))
        jax.block_until_ready(round_float32(values, jnp.float8_e4m3fn))
        count += 1
    print(f"sanitize_cases: {count} calls, all matching the reference")
    return 0


if __name__ == "__main__":
    # The platform may be named for a dry run on the CPU.
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu"))
