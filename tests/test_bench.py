"""The benchmark harness (python -m jax_fp8norm.bench): bytes counted, the serialised
program keeps every call, the competitors compute the same thing, and a small run writes
its table, JSON and plot. No timing is asserted."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp8norm import bench, reference, simt


def test_op_bytes():
    # x 2*4*2 + gamma 4*2 + y 2*4 + scales 2*4
    assert bench.op_bytes("rms_norm_fp8", 2, 4, jnp.bfloat16) == 16 + 8 + 8 + 8
    # + residual read and residual_out written
    assert bench.op_bytes("add_rms_norm_fp8", 2, 4, jnp.bfloat16) == 40 + 32
    assert bench.op_bytes("rms_norm_fp8", 3, 5, jnp.float32) == 60 + 20 + 15 + 12
    # Scales per group: 2 rows x 2 groups of float32; e8m0: 2 x 8 bytes.
    assert bench.op_bytes("rms_norm_fp8/group128", 2, 256, jnp.bfloat16) == 1024 + 512 + 512 + 16
    assert bench.op_bytes("rms_norm_fp8/mxfp8", 2, 256, jnp.bfloat16) == 1024 + 512 + 512 + 16
    assert bench.op_bytes("rms_norm_fp8/static", 2, 256, jnp.bfloat16) == 1024 + 512 + 512 + 8


@pytest.mark.parametrize("impl", ["fp8norm", "xla_reference"])
def test_serialised_program_keeps_every_call(impl):
    fn = bench.JAX_IMPLS[impl]["rms_norm_fp8"]
    calls = 5
    rng = np.random.default_rng(1)
    input_sets = tuple(
        (jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16), jnp.ones((64,), jnp.bfloat16))
        for _ in range(calls)
    )
    program = bench.serialised(fn, calls)
    hlo = program.lower(input_sets).compile().as_text()
    if impl == "fp8norm":
        assert hlo.count('custom_call_target="fp8norm_rms_norm_fp8"') == calls
    outs = program(input_sets)
    assert len(outs) == calls
    for args, out in zip(input_sets, outs, strict=True):
        for got, want in zip(out, jax.jit(fn)(*args), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("op", ["rms_norm_fp8", "add_rms_norm_fp8"])
def test_formula_computes_the_same_thing(op):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((16, 512)), jnp.bfloat16)
    gamma = jnp.asarray(rng.uniform(0.5, 1.5, 512), jnp.bfloat16)
    args = (x, gamma) if op == "rms_norm_fp8" else (x, residual, gamma)
    got = jax.jit(bench.JAX_IMPLS["xla_formula"][op])(*args)
    want = getattr(reference, op)(*args)
    deq = np.asarray(got[0], np.float32) * np.asarray(got[1])
    deq_ref = np.asarray(want[0], np.float32) * np.asarray(want[1])
    np.testing.assert_allclose(deq, deq_ref, rtol=0.07, atol=1e-3 * np.abs(deq_ref).max())
    if op == "add_rms_norm_fp8":
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))


@pytest.mark.extended
def test_small_run_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["--preset", "smoke", "--impls", "fp8norm,xla_reference,xla_formula,copy"]
    argv += ["--json", str(out_json), "--png", str(out_png), "--repeats", "2"]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "rms_norm_fp8" in printed and "add_rms_norm_fp8" in printed
    data = json.loads(out_json.read_text())
    assert data["machine"]["backend"] == jax.default_backend()
    results = data["results"]
    expected_shapes = len(bench.grid(bench.PRESETS["smoke"]))
    # The per-row ops with all four implementations; the other scale layouts with the
    # kernel, the reference and the copy.
    assert len(results) == expected_shapes * (2 * 4 + len(bench.SCALED_OPS) * 3)
    assert {r["op"] for r in results} == set(bench.OPS)
    for r in results:
        assert r["seconds"] >= 0 and r["calls"] >= 4 and r["distinct_inputs"] >= 1
        assert r["bytes"] == bench.op_bytes(r["op"], r["rows"], r["hidden"], r["dtype"])
        assert r["checked"] == (r["impl"] in ("fp8norm", "xla_reference"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not out_png.exists()
    else:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_name_the_option():
    with pytest.raises(SystemExit):
        bench.main(["--ops", "layer_norm"])
    with pytest.raises(SystemExit):
        bench.main(["--impls", "cublas"])
    with pytest.raises(SystemExit):
        bench.main(["--variants", "fastest"])


def test_variants_need_cuda_kernels(capsys):
    # On the CPU backend without FP8NORM_EMULATE_CUDA the ops run the CPU kernel, which
    # has no variants: timing "variants" there would time one kernel four times.
    with pytest.raises(SystemExit):
        bench.main(["--preset", "smoke", "--variants", "all"])
    assert "--variants" in capsys.readouterr().err


@pytest.mark.skipif(not simt.available(), reason="built without the emulation")
def test_variants_are_timed_side_by_side_and_each_checked():
    with simt.kernels():
        results = bench.bench_shape(
            "add_rms_norm_fp8",
            8,
            256,
            "bfloat16",
            ("fp8norm", "copy"),
            bench.PRESETS["smoke"],
            repeats=1,
            variants=("block_shared", "warp_rows", "block_registers"),
        )
    names = [r.impl for r in results]
    assert names == [
        "fp8norm:block_shared",
        "fp8norm:warp_rows",
        "fp8norm:block_registers",
        "copy",
    ]
    assert all(r.checked for r in results if r.impl.startswith("fp8norm"))
    lines = bench.summary(results)
    assert len(lines) == 3 and all("of copy bandwidth" in line for line in lines)
    assert "warp_rows" in bench.format_table(results)
