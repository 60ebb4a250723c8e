"""The environment's say over which kernels run: FP8NORM_EMULATE_CUDA=1 turns on the FFI
layer's emulation switch for the whole process, so that the ops lower to the emulated CUDA
kernels on the CPU backend (any JAX program then runs the CUDA code without a GPU), and
FP8NORM_CUDA_KERNEL picks the CUDA kernel variant. Both are read at import, so each case
runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import outputs_of_script

import jax_fp8norm as fp8norm
from jax_fp8norm import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason="built without the emulation")

# Runs both ops (no simt.kernels()) and saves the outputs, the reference's, the target the
# program calls and what the emulation recorded.
SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from helpers import random_gamma, random_rows
import jax_fp8norm as fp8norm
from jax_fp8norm import simt

x = random_rows(0, (5, 4096), jnp.bfloat16)
residual = random_rows(1, (5, 4096), jnp.bfloat16)
gamma = random_gamma(2, 4096, jnp.float32)
hlo = jax.jit(fp8norm.add_rms_norm_fp8).lower(x, residual, gamma).as_text()
simt.take_launches()
got = jax.jit(fp8norm.add_rms_norm_fp8)(x, residual, gamma)
launches = simt.take_launches()
want = jax.jit(fp8norm.reference.add_rms_norm_fp8)(x, residual, gamma)
np.savez(
    sys.argv[1],
    **{f"got{i}": np.asarray(a).view(np.uint8) for i, a in enumerate(got)},
    **{f"want{i}": np.asarray(a).view(np.uint8) for i, a in enumerate(want)},
    native_target=np.array("fp8norm_add_rms_norm_fp8" in hlo and "fp8norm_simt_" not in hlo),
    emulated_target=np.array("fp8norm_simt_add_rms_norm_fp8" in hlo),
    active=np.array(simt.active()),
    launches=np.array(len(launches)),
    threads=np.array([l["threads"] for l in launches]),
    variant=np.array(fp8norm.cuda_kernel()),
)
"""


@pytest.mark.parametrize("emulate", ["1", ""])
def test_emulate_cuda_runs_the_cuda_kernels_behind_the_cpu_targets(tmp_path, emulate):
    out = outputs_of_script(SCRIPT, tmp_path / "out.npz", FP8NORM_EMULATE_CUDA=emulate)
    # The switch's one effect: the target the program calls.
    assert bool(out["native_target"]) != bool(emulate)
    assert bool(out["emulated_target"]) == bool(out["active"]) == bool(emulate)
    for i in range(3):
        assert (out[f"got{i}"] == out[f"want{i}"]).all()
    # Emulated launches only when asked for: the CPU kernels record none.
    assert int(out["launches"]) == (1 if emulate else 0)


def test_cuda_kernel_env_picks_the_variant(tmp_path):
    out = outputs_of_script(
        SCRIPT, tmp_path / "out.npz", FP8NORM_EMULATE_CUDA="1", FP8NORM_CUDA_KERNEL="block_shared"
    )
    assert str(out["variant"]) == "block_shared"
    assert out["threads"].tolist() == [512]  # block_shared: one vector per thread
    out = outputs_of_script(
        SCRIPT, tmp_path / "out.npz", FP8NORM_EMULATE_CUDA="1", FP8NORM_CUDA_KERNEL="warp_rows"
    )
    assert str(out["variant"]) == "warp_rows"
    assert out["threads"].tolist() == [256]
    assert (out["got0"] == out["want0"]).all()


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("FP8NORM_CUDA_KERNEL", "fastest", "FP8NORM_CUDA_KERNEL: unknown CUDA kernel variant"),
        ("FP8NORM_EMULATE_CUDA", "maybe", "FP8NORM_EMULATE_CUDA='maybe'"),
    ],
)
def test_a_bad_environment_value_names_the_variable(name, value, words):
    result = subprocess.run(
        [sys.executable, "-c", "import jax_fp8norm"],
        env={**os.environ, name: value},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert words in result.stderr


def test_variant_api():
    assert fp8norm.cuda_kernel_variants() == [
        "auto",
        "block_shared",
        "warp_rows",
        "block_registers",
    ]
    assert fp8norm.cuda_kernel() == "auto"
    with fp8norm.use_cuda_kernel("block_registers"):
        assert fp8norm.cuda_kernel() == "block_registers"
        assert simt.kernel_variant() == "block_registers"
    assert fp8norm.cuda_kernel() == "auto"
    with pytest.raises(ValueError, match="unknown CUDA kernel variant 'warp'"):
        with fp8norm.use_cuda_kernel("warp"):
            pass
