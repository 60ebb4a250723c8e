"""On a GPU, jitted programs using the ops run with XLA's command buffers (CUDA graphs)
enabled for custom calls, and the ops are captured into them: the handlers declare
themselves command-buffer compatible. GPU-only; it runs in a subprocess because XLA's
flags are read once per process."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_fp8norm as fp8norm
    from jax_fp8norm.testing import assert_matches_reference

    x = jax.random.normal(jax.random.PRNGKey(0), (64, 1024), jnp.bfloat16)
    residual = jax.random.normal(jax.random.PRNGKey(1), (64, 1024), jnp.bfloat16)
    gamma = jnp.ones((1024,), jnp.bfloat16)

    def block(x, residual, gamma):
        y, scales, h = fp8norm.add_rms_norm_fp8(x * 2, residual, gamma)
        y2, scales2 = fp8norm.rms_norm_fp8(h + 1, gamma)
        return y, scales, h, y2, scales2

    got = jax.jit(block)(x, residual, gamma)
    for _ in range(3):  # replays of the recorded graph
        again = jax.jit(block)(x, residual, gamma)
    ref = jax.jit(lambda x, r, g: (
        *fp8norm.reference.add_rms_norm_fp8(x * 2, r, g),
        *fp8norm.reference.rms_norm_fp8(fp8norm.reference.add_rms_norm_fp8(x * 2, r, g)[2] + 1, g),
    ))(x, residual, gamma)
    assert_matches_reference(got[:3], ref[:3])
    assert_matches_reference(got[3:], ref[3:])
    for a, b in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    print("ok")
    """
)


def test_ops_inside_command_buffers(platform, tmp_path):
    if platform != "gpu":
        pytest.skip("command buffers are a GPU feature")
    dump = tmp_path / "dump"
    flags = " ".join(
        [
            os.environ.get("XLA_FLAGS", ""),
            "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL",
            "--xla_gpu_graph_min_graph_size=1",
            f"--xla_dump_to={dump}",
            "--xla_dump_hlo_pass_re=^$",
        ]
    )
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]
    optimized = [
        open(path).read() for path in glob.glob(str(dump / "*jit_block*after_optimizations.txt"))
    ]
    assert optimized, os.listdir(dump)
    # Computations are separated by blank lines, each headed by its name; XLA names the
    # ones it records into a command buffer "command_buffer...".
    blocks = "\n\n".join(optimized).split("\n\n")
    recorded = [b for b in blocks if "command_buffer" in b.split("\n", 1)[0]]
    assert recorded, "no command-buffer computation in the optimised HLO"
    captured = "\n".join(recorded)
    assert 'custom_call_target="fp8norm_add_rms_norm_fp8"' in captured, captured[-4000:]
    assert 'custom_call_target="fp8norm_rms_norm_fp8"' in captured, captured[-4000:]
