"""The benchmark harness (python -m jax_fp8norm.bench): bytes counted, the registry names
every implementation with what it computes, the serialised program keeps every call, the
competitors compute the same thing, distinct inputs and repeats are what the JSON and the
help say, and a small run writes its table, JSON and plot. No timing is asserted."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import reference_on_cpu

from jax_fp8norm import reference, simt
from jax_fp8norm.bench import cli, figure, implementations, ops, presets, report, runner, timing
from jax_fp8norm.bench.implementations import REGISTRY

ROOT = Path(__file__).resolve().parents[1]


def test_op_bytes():
    # x 2*4*2 + gamma 4*2 + y 2*4 + scales 2*4
    assert ops.op_bytes("rms_norm_fp8", 2, 4, jnp.bfloat16) == 16 + 8 + 8 + 8
    # + residual read and residual_out written
    assert ops.op_bytes("add_rms_norm_fp8", 2, 4, jnp.bfloat16) == 40 + 32
    assert ops.op_bytes("rms_norm_fp8", 3, 5, jnp.float32) == 60 + 20 + 15 + 12
    # Scales per group: 2 rows x 2 groups of float32; e8m0: 2 x 8 bytes.
    assert ops.op_bytes("rms_norm_fp8/group128", 2, 256, jnp.bfloat16) == 1024 + 512 + 512 + 16
    assert ops.op_bytes("rms_norm_fp8/mxfp8", 2, 256, jnp.bfloat16) == 1024 + 512 + 512 + 16
    assert ops.op_bytes("rms_norm_fp8/static", 2, 256, jnp.bfloat16) == 1024 + 512 + 512 + 8
    # FP4: y half a byte per element; scales one byte per group (16 for NVFP4, 32 MXFP4).
    assert ops.op_bytes("rms_norm_fp8/nvfp4", 2, 256, jnp.bfloat16) == 1024 + 512 + 256 + 32
    assert ops.op_bytes("rms_norm_fp8/mxfp4", 2, 256, jnp.bfloat16) == 1024 + 512 + 256 + 16


def test_registry_covers_every_implementation():
    assert REGISTRY.names == (
        "fp8norm",
        "xla_reference",
        "xla_formula",
        "torch_compile",
        "copy",
        "numpy_copy",
    )
    assert implementations.IMPLS == REGISTRY.names
    colours = [impl.colour for impl in REGISTRY]
    assert len(set(colours)) == len(colours), "one colour per implementation"
    for impl in REGISTRY:
        assert impl.description
        # Every implementation computes the per-row ops on the CPU backend but one.
        assert impl.supports("rms_norm_fp8", "cpu")
        assert impl.supports("add_rms_norm_fp8", "gpu") == (impl.name != "numpy_copy")
    # Only the kernel and the reference twin implement the other scale layouts (and the
    # copies, which move the bytes without computing anything).
    for op in ops.SCALED_OPS:
        assert {i.name for i in REGISTRY if i.supports(op, "cpu")} == {
            "fp8norm",
            "xla_reference",
            "copy",
            "numpy_copy",
        }
    assert {i.name for i in REGISTRY if i.checked} == {"fp8norm", "xla_reference"}
    assert {i.name for i in REGISTRY if i.ceiling} == {"copy", "numpy_copy"}
    with pytest.raises(KeyError):
        REGISTRY["cublas"]


def test_variants_resolve_through_the_kernel():
    variant = REGISTRY["fp8norm:warp_rows"]
    assert variant.name == "fp8norm:warp_rows" and variant.checked
    assert REGISTRY.colour("fp8norm:warp_rows") == variant.colour
    assert REGISTRY.colour("fp8norm:auto") == REGISTRY["fp8norm"].colour
    named = ("block_shared", "warp_rows", "block_registers")
    assert (
        len(
            {REGISTRY.colour(f"fp8norm:{v}") for v in named} | set(implementations.COLOURS.values())
        )
        == 9
    )
    # A variant no colour is fixed for gets the same colour every time.
    assert REGISTRY.colour("fp8norm:new") == REGISTRY.colour("fp8norm:new")
    assert [i.name for i in REGISTRY.expand("fp8norm", ("auto", "warp_rows"))] == [
        "fp8norm:auto",
        "fp8norm:warp_rows",
    ]
    assert [i.name for i in REGISTRY.expand("copy", ("warp_rows",))] == ["copy"]
    assert "fp8norm:warp_rows" in REGISTRY and "xla_formula:x" not in REGISTRY


@pytest.mark.parametrize("impl", ["fp8norm", "xla_reference"])
def test_serialised_program_keeps_every_call(impl):
    fn = REGISTRY[impl].build("rms_norm_fp8")
    calls = 5
    rng = np.random.default_rng(1)
    input_sets = tuple(
        (jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16), jnp.ones((64,), jnp.bfloat16))
        for _ in range(calls)
    )
    program = timing.serialised(fn, calls)
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
    got = jax.jit(REGISTRY["xla_formula"].build(op))(*args)
    want = reference_on_cpu(getattr(reference, op), *args)
    deq = np.asarray(got[0], np.float32) * np.asarray(got[1])
    deq_ref = np.asarray(want[0], np.float32) * np.asarray(want[1])
    np.testing.assert_allclose(deq, deq_ref, rtol=0.07, atol=1e-3 * np.abs(deq_ref).max())
    if op == "add_rms_norm_fp8":
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))


def test_distinct_input_sets_count_shared_buffers_once():
    a, b, gamma = np.zeros(2), np.ones(2), np.ones(2)
    assert timing.distinct_input_sets([(a, gamma), (b, gamma)]) == 2
    assert timing.distinct_input_sets([(a, gamma), (a, gamma), (b, gamma)]) == 2
    assert timing.distinct_input_sets([(a, gamma)] * 5) == 1


def test_distinct_inputs_are_the_inputs_the_calls_rotate_among():
    impls = ("fp8norm", "xla_reference", "copy", "numpy_copy")
    results = runner.bench_shape(
        "rms_norm_fp8", 8, 256, "bfloat16", impls, presets.PRESETS["smoke"], repeats=1
    )
    got = {r.impl: r for r in results}
    assert set(got) == set(impls)
    for name in ("fp8norm", "xla_reference", "copy"):
        # K calls in one program, one input set each.
        assert got[name].calls == presets.PRESETS["smoke"]["max_calls"]
        assert got[name].distinct_inputs == got[name].calls
    # NumPy's copy is timed one copy at a time on one pair of buffers.
    assert (got["numpy_copy"].calls, got["numpy_copy"].distinct_inputs) == (1, 1)


def test_unsupported_implementations_are_left_out():
    results = runner.bench_shape(
        "rms_norm_fp8/group128",
        2,
        256,
        "float32",
        ("xla_formula", "fp8norm", "torch_compile"),
        presets.PRESETS["smoke"],
        repeats=1,
    )
    assert [r.impl for r in results] == ["fp8norm"]
    with pytest.raises(ValueError, match="cublas"):
        runner.bench_shape(
            "rms_norm_fp8", 2, 256, "float32", ("cublas",), presets.PRESETS["smoke"], 1
        )


@pytest.mark.parametrize("op", ["rms_norm_fp8/nvfp4", "rms_norm_fp8/mxfp4"])
def test_fp4_layouts_run_in_the_harness(op):
    impls = ("fp8norm", "xla_reference", "xla_formula", "copy")
    results = runner.bench_shape(op, 8, 256, "bfloat16", impls, presets.PRESETS["smoke"], 1)
    # The formula computes per-row FP8 only; the kernel is checked against the twin.
    assert [r.impl for r in results] == ["fp8norm", "xla_reference", "copy"]
    group = {"rms_norm_fp8/nvfp4": 16, "rms_norm_fp8/mxfp4": 32}[op]
    # x and gamma in bfloat16, y half a byte per element, one byte per group's scale.
    nbytes = 8 * 256 * 2 + 256 * 2 + 8 * 256 // 2 + 8 * 256 // group
    assert all(r.bytes == nbytes and r.checked == (r.impl != "copy") for r in results)
    assert all(r.seconds >= 0 and r.calls == presets.PRESETS["smoke"]["max_calls"] for r in results)
    fn = jax.jit(REGISTRY["xla_reference"].build(op))
    y, scales = fn(*ops.shape_inputs(op, 8, 256, jnp.bfloat16, 0, 1, jax.devices()[0])[0])
    assert y.dtype == jnp.float4_e2m1fn and y.shape == (8, 256)
    assert scales.shape == (8, 256 // group) and scales.dtype.itemsize == 1


def test_repeats_keep_the_shortest_run():
    durations = iter([0.0, 5.0, 3.0, 4.0])  # the warm-up's is not timed
    now = [0.0]
    calls = []

    def run():
        calls.append(1)
        now[0] += next(durations)

    assert timing.shortest_seconds(run, 3, clock=lambda: now[0]) == 3.0
    assert len(calls) == 4  # a warm-up, then the three timed
    help_text = " ".join(cli.parser().format_help().split())
    assert "shortest" in help_text and "median" not in help_text


def test_result_files_read_back(tmp_path):
    results = [
        report.Result("rms_norm_fp8", "fp8norm", "bfloat16", 4, 256, 4096, 2e-6, 8, 8, True),
        report.Result("rms_norm_fp8", "numpy_copy", "bfloat16", 4, 256, 4096, 1e-6, 1, 1, False),
    ]
    path = tmp_path / "r.json"
    report.write_json(str(path), {"backend": "cpu"}, results)
    assert report.read_json(str(path)) == ({"backend": "cpu"}, results)
    # The files of earlier runs (benchmarks/results/) read back too.
    for old in sorted(ROOT.glob("benchmarks/results/*.json")):
        info, read = report.read_json(str(old))
        assert info["backend"] == "cpu" and len(read) == len(json.loads(old.read_text())["results"])
        assert all(r.seconds > 0 and r.gbps > 0 for r in read)


def _cpu_like_results() -> list[report.Result]:
    """A CPU run's kind of results: a per-row op and a scale layout (no formula for it), a
    bf16 grid and one float32 spot shape, the kernel, XLA's formula and NumPy's copy."""
    results = []
    shapes = [("bfloat16", 1, 4096), ("bfloat16", 16, 4096), ("bfloat16", 1, 8192)]
    shapes.append(("float32", 4096, 4096))
    for op in ("rms_norm_fp8", "rms_norm_fp8/group128"):
        for dtype, rows, hidden in shapes:
            nbytes = ops.op_bytes(op, rows, hidden, dtype)
            times = {"numpy_copy": 1e-6, "fp8norm": 4e-6, "xla_formula": 12e-6}
            for impl, seconds in times.items():
                if impl == "xla_formula" and op in ops.SCALED_OPS:
                    continue
                checked = impl == "fp8norm"
                calls = 1 if impl == "numpy_copy" else 8
                results.append(
                    report.Result(op, impl, dtype, rows, hidden, nbytes, seconds * rows, calls,
                                  calls, checked)
                )  # fmt: skip
    return results


def test_figure_layout():
    plan = figure.layout(_cpu_like_results())
    assert [m.key for m in plan.measures] == ["speed_up", "share"]
    # bfloat16 by hidden size, then rows; then the spot check's dtype.
    assert plan.shapes == [
        ("bfloat16", 1, 4096),
        ("bfloat16", 16, 4096),
        ("bfloat16", 1, 8192),
        ("float32", 4096, 4096),
    ]
    speed_up = plan.panel("rms_norm_fp8", "speed_up")
    assert list(speed_up.series) == ["fp8norm"]  # the formula is the line at 1x
    assert [v for _, v in speed_up.series["fp8norm"]] == pytest.approx([3.0] * 4)
    share = plan.panel("rms_norm_fp8", "share")
    assert list(share.series) == ["fp8norm", "xla_formula"]  # NumPy's copy is the 100% line
    assert [v for _, v in share.series["fp8norm"]] == pytest.approx([25.0] * 4)
    empty = plan.panel("rms_norm_fp8/group128", "speed_up")
    assert not empty.series and "per-row" in empty.note
    assert plan.panel("rms_norm_fp8/group128", "share").series
    for panel in plan.panels:
        assert not panel.series or sum(len(p) for p in panel.series.values()) > 1
    assert plan.implementations == ["fp8norm", "xla_formula", "numpy_copy"]


def test_figure_falls_back_to_bandwidth_and_the_copy_it_has():
    results = [r for r in _cpu_like_results() if r.impl == "fp8norm"]
    assert [m.key for m in figure.layout(results).measures] == ["gbps"]
    gpu_like = [
        report.Result(r.op, "copy", r.dtype, r.rows, r.hidden, r.bytes, r.seconds, 8, 8, False)
        for r in results
    ]
    plan = figure.layout(results + gpu_like)
    assert [(m.key, m.reference) for m in plan.measures] == [("share", "copy")]


def test_figure_without_matplotlib_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert figure.draw(_cpu_like_results(), str(tmp_path / "f.png")) is False
    assert not (tmp_path / "f.png").exists()


def test_figure_is_drawn_from_a_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.json"
    report.write_json(str(path), {"backend": "cpu", "device": "cpu"}, _cpu_like_results())
    assert figure.main([str(path)]) == 0  # beside the JSON, by default
    png = (tmp_path / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert 0.5 < width / height < 3, (width, height)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.extended
def test_small_run_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["--preset", "smoke", "--impls", "fp8norm,xla_reference,xla_formula,copy"]
    argv += ["--json", str(out_json), "--png", str(out_png), "--repeats", "2"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "rms_norm_fp8" in printed and "add_rms_norm_fp8" in printed
    data = json.loads(out_json.read_text())
    assert data["machine"]["backend"] == jax.default_backend()
    results = data["results"]
    expected_shapes = len(presets.grid(presets.PRESETS["smoke"]))
    # The per-row ops with all four implementations; the other scale layouts with the
    # kernel, the reference and the copy.
    assert len(results) == expected_shapes * (2 * 4 + len(ops.SCALED_OPS) * 3)
    assert {r["op"] for r in results} == set(ops.OPS)
    for r in results:
        assert r["seconds"] >= 0 and r["calls"] >= 4 and r["distinct_inputs"] == r["calls"]
        assert r["bytes"] == ops.op_bytes(r["op"], r["rows"], r["hidden"], r["dtype"])
        assert r["checked"] == (r["impl"] in ("fp8norm", "xla_reference"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not out_png.exists()
    else:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_name_the_option():
    with pytest.raises(SystemExit):
        cli.main(["--ops", "layer_norm"])
    with pytest.raises(SystemExit):
        cli.main(["--impls", "cublas"])
    with pytest.raises(SystemExit):
        cli.main(["--variants", "fastest"])


def test_variants_need_cuda_kernels(capsys):
    # On the CPU backend without FP8NORM_EMULATE_CUDA the ops run the CPU kernel, which
    # has no variants: timing "variants" there would time one kernel four times.
    with pytest.raises(SystemExit):
        cli.main(["--preset", "smoke", "--variants", "all"])
    assert "--variants" in capsys.readouterr().err


@pytest.mark.skipif(not simt.available(), reason="built without the emulation")
def test_variants_are_timed_side_by_side_and_each_checked():
    with simt.kernels():
        results = runner.bench_shape(
            "add_rms_norm_fp8",
            8,
            256,
            "bfloat16",
            ("fp8norm", "copy"),
            presets.PRESETS["smoke"],
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
    assert all(r.distinct_inputs == r.calls for r in results)
    lines = report.summary(results)
    assert len(lines) == 3 and all("of copy bandwidth" in line for line in lines)
    assert "warp_rows" in report.format_table(results)


def test_the_allreduce_op_runs_its_own_report(capsys):
    # On this process's devices (the session's virtual CPU devices: the XLA rows;
    # tests/test_allreduce_one_kernel.py runs the one-kernel methods on several emulated devices).
    assert (
        cli.main(["--ops", "allreduce_residual_rms_norm_fp8", "--rows", "2", "--hidden", "128"])
        == 0
    )
    out = capsys.readouterr().out
    assert "allreduce_residual_rms_norm_fp8, bfloat16 x 128" in out
    assert "method='xla'" in out and "xla all-reduce + jnp formula" in out


def test_backward_report_runs(capsys):
    """The backward's report (python -m jax_fp8norm.bench.backward) on a small shape: every
    entry timed, the ratios printed."""
    from jax_fp8norm.bench import backward

    assert backward.main(["--rows", "128", "--hidden", "256", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("backward: kernel", "backward: XLA autodiff", "add backward: kernel",
                 "forward: training form"):  # fmt: skip
        assert f"{name}: min" in out
    assert "XLA autodiff / kernel = " in out
    for name in backward.COLUMNWISE_RECIPES:
        assert f"{name}: rowwise + columnwise / rowwise = " in out
    assert backward.backward_bytes(2, 8, "bfloat16", add=False) == 2 * (8 * 8 + 4) + 64
    # 64 x 32 bfloat16: x 4096 bytes, gamma 64 (op_bytes counts it in x's dtype); MXFP8
    # codes 2048 and 64 e8m0 scales a layout; NVFP4 codes 1024 and 128 e4m3 scales a layout.
    assert backward.forward_bytes(64, 32, "bfloat16", "mxfp8", columnwise=False) == 4160 + 2112
    assert backward.forward_bytes(64, 32, "bfloat16", "mxfp8", columnwise=True) == 4160 + 4224
    assert backward.forward_bytes(64, 32, "bfloat16", "nvfp4", columnwise=True) == 4160 + 2304
    with pytest.raises(ValueError, match="recipe"):
        backward.main(["--recipes", "mxfp9"])


def test_layer_report_runs(capsys):
    """bench.layer times the fused layer, the hand-written one and bfloat16, and reports
    the ratio for each recipe; a recipe it cannot write by hand is refused."""
    from jax_fp8norm.bench import layer

    args = ["--rows", "64", "--hidden", "128", "--features", "128", "--rounds", "2"]
    assert layer.main([*args, "--recipes", "mxfp8,nvfp4"]) == 0
    out = capsys.readouterr().out
    for entry in ("bfloat16", "mxfp8 fused", "mxfp8 by_hand", "nvfp4 fused", "nvfp4 by_hand"):
        assert re.search(rf"^{entry} +[0-9.]+ +[0-9.]+$", out, re.M), (entry, out)
    assert re.search(r"^nvfp4: by_hand / fused = [0-9.]+x", out, re.M), out
    with pytest.raises(SystemExit):
        layer.main(["--recipes", "fp8_static"])
    assert "unknown recipes ['fp8_static']" in capsys.readouterr().err


def test_the_hand_written_layer_is_the_same_layer():
    """bench.layer's by-hand layer computes what the fused one does, to the formats'
    precision (the comparison is between two ways to the same result)."""
    from jax_fp8norm.bench import layer

    key = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(key[0], (64, 128), jnp.float32)
    gamma = 1 + 0.1 * jax.random.normal(key[1], (128,))
    w = jax.random.normal(key[2], (128, 64)) / 11
    fused = np.asarray(layer.fused_layer("mxfp8")(x, gamma, w))
    hand = np.asarray(layer.by_hand_layer("mxfp8")(x, gamma, w))
    exact = np.asarray(layer.bfloat16_layer(x, gamma, w))
    scale = np.abs(exact).max()
    assert np.abs(fused - hand).max() <= 0.08 * scale
    assert 0 < np.abs(hand - exact).max() <= 0.08 * scale
