"""python -m jax_fp8norm (the README's first command): on a small shape every scale
layout, NVFP4 and MXFP4 included, is checked bit for bit and reported; --fp4 goes to the
tensor-parallel example and needs --tp."""

from __future__ import annotations

import jax
import pytest

from jax_fp8norm import __main__ as main_job
from jax_fp8norm.examples import llama_tp_block
from jax_fp8norm.recipes import RECIPES


@pytest.mark.long_running
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="bit for bit on the CPU backend")
def test_main_job_checks_every_layout(capsys):
    assert main_job.main(["--shape", "4x256", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    lines = [line.split()[:2] for line in out.splitlines() if line.rstrip().endswith(" ok")]
    assert lines == [
        ["rms_norm_fp8", "4"],
        ["add_rms_norm_fp8", "4"],
    ] + [
        ["rms", name]
        for name, recipe in RECIPES.items()
        if recipe.keywords["group_size"] != (None,)
    ]
    assert "all checks passed" in out
    assert "NVFP4" in out.splitlines()[1] and "MXFP4" in out.splitlines()[1]


@pytest.mark.parametrize("emulated, argv, iters", [
    (False, [], 20),
    (True, [], 0),  # the emulation's time says nothing of a GPU's
    (True, ["--iters", "3"], 3),
    (False, ["--iters", "0"], 0),
])  # fmt: skip
def test_emulated_kernels_are_not_timed_by_default(monkeypatch, capsys, emulated, argv, iters):
    calls = []
    monkeypatch.setattr(main_job._ffi, "emulating", lambda: emulated)
    monkeypatch.setattr(main_job, "_run_shape", lambda *args: calls.append(args) or True)
    assert main_job.main(["--shape", "4x256", *argv]) == 0
    assert [call[-1] for call in calls] == [iters]
    assert ("emulated CUDA kernels" in capsys.readouterr().out) == emulated


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="bit for bit on the CPU backend")
def test_untimed_lines_still_report_the_check(capsys):
    assert main_job.main(["--shape", "4x256", "--iters", "0"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.endswith(" ok")]
    assert lines and all("not timed" in line and " us " not in line for line in lines)
    with pytest.raises(SystemExit):
        main_job.main(["--iters", "-1"])


def test_nvfp4_global_scale_is_a_decode_scale():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 256))
    gamma = jax.numpy.full((256,), 2.0)
    n = x * jax.lax.rsqrt(jax.numpy.mean(x * x, axis=-1, keepdims=True) + 1e-6) * 2.0
    want = jax.numpy.max(jax.numpy.abs(n)) / (448 * 6)
    assert float(main_job._nvfp4_global_scale(x, gamma)) == pytest.approx(float(want), rel=1e-6)


def test_fp4_option_goes_to_the_example(monkeypatch):
    calls = []
    monkeypatch.setattr(llama_tp_block, "report", lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # backends have started
    assert main_job.main(["--tp", "8", "--fp4", "mxfp4"]) == 0
    assert main_job.main(["--tp", "2"]) == 0
    assert main_job.main(["--tp", "4", "--allreduce-method", "two_shot"]) == 0
    assert calls == [
        (8, None, "mxfp4", "auto"),
        (2, None, None, "auto"),
        (4, None, None, "two_shot"),
    ]
    for argv in (
        ["--fp4", "nvfp4"],
        ["--tp", "8", "--fp4", "nvfp4", "--group-size", "128"],
        ["--allreduce-method", "one_shot"],
        ["--tp", "8", "--allreduce-method", "nccl"],
    ):
        with pytest.raises(SystemExit):
            main_job.main(argv)
    with pytest.raises(SystemExit):
        main_job.main(["--tp", "8", "--fp4", "fp6"])
