"""The CUDA kernels on a grid of odd shapes, for compute-sanitizer (tools/sanitize_gpu.sh).

Every path of the launch is taken: vectorised and scalar (hidden not a multiple of the
vector width, inputs at an offset inside a larger buffer), the shared-memory row cache and
the re-reading path (rows longer than the cache), one row and many, every input dtype,
16-bit gamma and residual next to float32 sums, and the rounding kernel. Each result is
checked against the reference too, so a silent wrong answer fails as well.
Exits non-zero on a mismatch; compute-sanitizer's own exit code reports its errors.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8norm as fp8norm
from jax_fp8norm._primitives import add_rms_norm_fp8_p
from jax_fp8norm._validation import make_params
from jax_fp8norm.ops import round_float32
from jax_fp8norm.testing import assert_matches_reference

HIDDEN = [1, 7, 8, 9, 100, 1023, 1025, 4096, 8193, 56321, 70001]
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


def main(platform: str) -> int:
    device = jax.devices(platform)[0]
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
    # Inputs at an element offset inside a larger buffer.
    for offset in (1, 3, 8):
        rows, hidden = 5, 512
        flat = jax.device_put(np.linspace(-3, 3, rows * hidden + 16).astype(jnp.bfloat16), device)
        gamma = jax.device_put(np.ones(hidden, jnp.float32), device)

        def sliced(flat, gamma, offset=offset, rows=rows, hidden=hidden):
            x = jax.lax.slice(flat, (offset,), (offset + rows * hidden,)).reshape(rows, hidden)
            return fp8norm.add_rms_norm_fp8(x, x, gamma)

        out = jax.jit(sliced)(flat, gamma)
        x = np.asarray(flat)[offset : offset + rows * hidden].reshape(rows, hidden)
        ref = _reference("add_rms_norm_fp8", x, x, np.ones(hidden, np.float32))
        assert_matches_reference([np.asarray(o) for o in out], [np.asarray(o) for o in ref])
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
