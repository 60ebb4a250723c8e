"""Platforms without a kernel of ours (TPU, ROCm, a GPU when the build has no CUDA
kernels): each op lowers to its reference twin, with one warning per platform and process,
or an error under FP8NORM_FALLBACK=error. Shown without the hardware by lowering for those
platforms with jax.export."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RECIPE_NAMES, random_gamma, random_rows, recipe, reference_on_cpu

import jax_fp8norm as fp8norm
from jax_fp8norm import _fallback, _ffi, _primitives
from jax_fp8norm._checks import validate
from jax_fp8norm.testing import assert_same_bits

HIDDEN = 256
X = random_rows(0, (4, HIDDEN), jnp.bfloat16)
RESIDUAL = random_rows(1, (4, HIDDEN), jnp.bfloat16)
GAMMA = random_gamma(2, HIDDEN, jnp.bfloat16)
OUR_CUSTOM_CALL = re.compile(r"custom_call @fp8norm_\w+")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the first lowering of the process for every platform."""
    monkeypatch.setattr(_fallback, "_warned", set())
    monkeypatch.delenv(_fallback.FALLBACK_ENV, raising=False)


def _export(fn, platforms, *args):
    exported = jax.export.export(
        jax.jit(fn), platforms=platforms, disabled_checks=fp8norm.EXPORT_DISABLED_CHECKS
    )(*args)
    return exported, OUR_CUSTOM_CALL.findall(exported.mlir_module())


def _add(x, residual, gamma):
    return fp8norm.add_rms_norm_fp8(x, residual, gamma, **recipe("nvfp4"))


def test_one_artifact_for_cpu_cuda_and_tpu_whose_tpu_branch_is_the_twin():
    with pytest.warns(_fallback.KernelFallbackWarning) as record:
        exported, calls = _export(_add, ("cpu", "cuda", "tpu"), X, RESIDUAL, GAMMA)
    # One warning per platform without a kernel: tpu, and cuda in a build without its
    # kernels.
    warned = sorted(re.search(r"platform '(\w+)'", str(w.message)).group(1) for w in record)
    assert warned == (["tpu"] if fp8norm.built_with_cuda() else ["cuda", "tpu"])
    assert any("none for the 'tpu' backend" in str(w.message) for w in record)
    # One custom call per platform with a kernel: the cpu branch and, in a build with the
    # CUDA kernels, the cuda branch; none in the tpu branch, which alone has none.
    assert len(calls) == 1 + fp8norm.built_with_cuda(), calls
    _, tpu_calls = _export(_add, ("tpu",), X, RESIDUAL, GAMMA)
    assert tpu_calls == []
    # The artifact runs its cpu branch here: the kernel, the twin's bits.
    assert_same_bits(
        exported.call(X, RESIDUAL, GAMMA),
        reference_on_cpu(fp8norm.reference.add_rms_norm_fp8, X, RESIDUAL, GAMMA, **recipe("nvfp4")),
    )


def test_a_build_without_cuda_kernels_lowers_the_twin_for_cuda_and_warns_once(monkeypatch):
    monkeypatch.setattr(_ffi, "_fp8norm_cuda", None)
    monkeypatch.setattr(_ffi, "CUDA_UNAVAILABLE_REASON", "no CUDA kernels here: FP8NORM_CUDA=ON")
    with pytest.warns(_fallback.KernelFallbackWarning) as record:
        _, calls = _export(fp8norm.rms_norm_fp8, ("cuda",), X, GAMMA)
    assert calls == []
    (message,) = [str(w.message) for w in record]
    for words in ("'cuda'", "no CUDA kernels here: FP8NORM_CUDA=ON", "FP8NORM_FALLBACK=error"):
        assert words in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second lowering in the process: no warning
        _, calls = _export(_add, ("cuda",), X, RESIDUAL, GAMMA)
    assert calls == []


def test_fallback_error_refuses_naming_platform_and_switch(monkeypatch):
    monkeypatch.setenv(_fallback.FALLBACK_ENV, "error")
    with pytest.raises(
        RuntimeError, match=r"rms_norm_fp8 has no kernel for platform 'tpu'.*FP8NORM_FALLBACK=error"
    ):
        _export(fp8norm.rms_norm_fp8, ("tpu",), X, GAMMA)
    monkeypatch.setenv(_fallback.FALLBACK_ENV, "maybe")
    with pytest.raises(ValueError, match="FP8NORM_FALLBACK must be one of"):
        _export(fp8norm.rms_norm_fp8, ("tpu",), X, GAMMA)


def test_allreduce_on_a_platform_without_kernels_sums_with_xla_then_runs_the_twin():
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices("cpu")[:1])

    def allreduce(x, residual, gamma, method="auto"):
        return fp8norm.sharded_allreduce_residual_rms_norm_fp8(
            x[None], residual, gamma, mesh=mesh, axis_name="tp", method=method
        )

    with pytest.warns(_fallback.KernelFallbackWarning, match="'tpu'"):
        _, calls = _export(allreduce, ("tpu",), X, RESIDUAL, GAMMA)
    assert calls == []
    with pytest.raises(ValueError, match="one_shot"):
        _export(lambda *a: allreduce(*a, method="one_shot"), ("tpu",), X, RESIDUAL, GAMMA)


@pytest.mark.sampled(2)
@pytest.mark.parametrize("name", RECIPE_NAMES)
@pytest.mark.parametrize("op", ["rms", "add"])
def test_the_twin_rule_reads_the_kernels_operands_as_the_kernel_does(op, name):
    """The fallback rule's own function, run here on the kernel primitive's operands and
    parameters, against the CPU kernel: the same bits for every recipe."""
    keywords = recipe(name)
    rows = (X,) if op == "rms" else (X, RESIDUAL)
    call = validate(*rows[:1], GAMMA, *rows[1:], **keywords)
    operands = call.operands(*rows, GAMMA)
    twin = jax.jit(lambda *a: _primitives._twin(*a, **call.params.as_dict()))(*operands)
    kernel = (fp8norm.rms_norm_fp8 if op == "rms" else fp8norm.add_rms_norm_fp8)(
        *rows, GAMMA, **keywords
    )
    assert_same_bits(twin, kernel)
    assert np.asarray(kernel[0]).size == X.size
