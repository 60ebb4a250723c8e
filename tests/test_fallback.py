"""Platforms without a kernel of ours (TPU, ROCm, a GPU when the build has no CUDA
kernels): each op lowers to its reference twin, with one warning per platform and process,
or an error under FP8NORM_FALLBACK=error. Shown without the hardware by lowering for those
platforms with jax.export, and run here: in a child process whose CPU takes the fallback
rule, the twins give the kernels' bits for the ops, the training and columnwise forms, the
backwards and the layer's gradients."""

from __future__ import annotations

import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    RECIPE_NAMES,
    TIERS,
    outputs_of_script,
    random_gamma,
    random_rows,
    recipe,
    reference_on_cpu,
)

import jax_fp8norm as fp8norm
from jax_fp8norm import _fallback, _ffi, _primitives, _training
from jax_fp8norm._checks import validate
from jax_fp8norm.testing import assert_same_bits

HIDDEN = 256
X = random_rows(0, (4, HIDDEN), jnp.bfloat16)
RESIDUAL = random_rows(1, (4, HIDDEN), jnp.bfloat16)
GAMMA = random_gamma(2, HIDDEN, jnp.bfloat16)
OUR_CUSTOM_CALL = re.compile(r"custom_call @fp8norm_\w+")
# The target of a custom call of ours, in lowered (StableHLO) or compiled (HLO) text.
OUR_TARGET = re.compile(r'(?:custom_call @|custom_call_target=")(fp8norm_\w+)')


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


# The fallback run on this machine: a child process in which the CPU is a platform without
# a kernel of ours (our primitives' CPU rules not registered, so that the rule of every
# other platform, the twin's, lowers there), against the same calls on the kernels here.
# Rows a multiple of every block (128), finite data.
ROWS = 128
FX = random_rows(10, (ROWS, HIDDEN), jnp.bfloat16)
FRESIDUAL = random_rows(11, (ROWS, HIDDEN), jnp.bfloat16)
FGAMMA = random_gamma(12, HIDDEN, jnp.float32)
FDN = random_rows(13, (ROWS, HIDDEN), jnp.float32)
FW = (np.random.default_rng(14).standard_normal((HIDDEN, 64)) / 16).astype(np.float32)


def _training_backward(x, gamma, dn):
    *_, r = _training.rms_norm_fp8_training(x, gamma, weight_offset=1.0)
    return _training.rms_norm_backward(dn, x, gamma, r, weight_offset=1.0)


def _add_training_backward(x, residual, gamma, dn):
    *_, r = _training.add_rms_norm_fp8_training(x, residual, gamma)
    d_residual_out = (2 * dn).astype(residual.dtype)
    return _training.add_rms_norm_backward(dn, d_residual_out, x, residual, gamma, r)


def _dequantized_grads(x, gamma, dn):
    def loss(x, gamma):
        return jnp.sum(fp8norm.rms_norm_fp8_dequantized(x, gamma, recipe="mxfp8") * dn)

    return jax.grad(loss, (0, 1))(x, gamma)


def _parts(name):
    """An FP4 layer's gradient rounded stochastically with a fixed key (the same bits on
    either path); the Hadamard transform off until the norm's columnwise codes take it."""
    return {"key": jax.random.key(3), "hadamard": False} if fp8norm.RECIPES[name].fp4 else {}


def _layer_grads(x, gamma, w, name):
    def loss(x, gamma, w):
        return jnp.sum(fp8norm.rms_norm_dense(x, gamma, w, **recipe(name), **_parts(name)) ** 2)

    return jax.value_and_grad(loss, (0, 1, 2))(x, gamma, w)


def _add_layer_grads(x, residual, gamma, w):
    def loss(x, residual, gamma, w):
        out, residual_out = fp8norm.add_rms_norm_dense(
            x, residual, gamma, w, recipe="nvfp4", **_parts("nvfp4")
        )
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(residual_out * w[:, 0])

    return jax.value_and_grad(loss, (0, 1, 2, 3))(x, residual, gamma, w)


def _allreduce(x, residual, gamma):
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices("cpu")[:1])
    return fp8norm.sharded_allreduce_residual_rms_norm_fp8(
        x[None], residual, gamma, mesh=mesh, axis_name="tp", **recipe("fp8_group128")
    )


def fallback_calls() -> dict:
    """name -> (function, arguments): each op with every recipe, the training and columnwise
    forms, both backwards, the differentiable op's and the layer's gradients."""
    rms, add = (FX, FGAMMA), (FX, FRESIDUAL, FGAMMA)
    calls = {}
    for name in RECIPE_NAMES:
        calls[f"rms {name}"] = (functools.partial(fp8norm.rms_norm_fp8, **recipe(name)), rms)
        calls[f"add {name}"] = (functools.partial(fp8norm.add_rms_norm_fp8, **recipe(name)), add)
    forms = {
        "rms training fp8_row": (_training.rms_norm_fp8_training, rms, "fp8_row", False),
        "add training mxfp8": (_training.add_rms_norm_fp8_training, add, "mxfp8", False),
        "rms columnwise mxfp8": (fp8norm.rms_norm_fp8, rms, "mxfp8", True),
        "rms training columnwise nvfp4": (_training.rms_norm_fp8_training, rms, "nvfp4", True),
        "rms columnwise fp8_static": (fp8norm.rms_norm_fp8, rms, "fp8_static", True),
        "add training columnwise fp8_group128": (
            _training.add_rms_norm_fp8_training,
            add,
            "fp8_group128",
            True,
        ),
        "add columnwise mxfp4": (fp8norm.add_rms_norm_fp8, add, "mxfp4", True),
    }
    for key, (op, args, name, columnwise) in forms.items():
        calls[key] = (functools.partial(op, **recipe(name, columnwise=columnwise)), args)
    calls["rms backward"] = (_training_backward, (*rms, FDN))
    calls["add backward"] = (_add_training_backward, (*add, FDN))
    calls["dequantized grad"] = (_dequantized_grads, (*rms, FDN))
    for name in ("mxfp8", "fp8_row", "nvfp4"):
        calls[f"layer grad {name}"] = (functools.partial(_layer_grads, name=name), (*rms, FW))
    calls["add layer grad nvfp4"] = (_add_layer_grads, (*add, FW))
    calls["allreduce"] = (_allreduce, add)
    return calls


# The default tier's share (a twin compiles in about a quarter of a second, the layer's
# gradient in two): the rowwise form, the add training form and its backward, the layer's
# gradient (the rms training form with columnwise outputs, the rms backward).
DEFAULT_FALLBACK_CALLS = ("rms fp8_row", "add backward", "layer grad mxfp8")


def run_fallback_calls(names) -> tuple[dict, dict]:
    """The calls ``names`` of fallback_calls, each jitted and run: ({name: its outputs'
    leaves as NumPy}, {name: the targets of our custom calls in its lowered and compiled
    programs})."""
    calls = fallback_calls()
    outputs, custom_calls = {}, {}
    cpu = jax.devices("cpu")[0]  # where jax defaults to a GPU too
    for name in names:
        fn, args = calls[name]
        args = [jax.device_put(a, cpu) for a in args]
        with jax.default_device(cpu):
            lowered = jax.jit(fn).lower(*args)
            compiled = lowered.compile()
            outputs[name] = [np.asarray(o) for o in jax.tree.leaves(compiled(*args))]
        text = lowered.as_text() + compiled.as_text()
        custom_calls[name] = sorted(set(OUR_TARGET.findall(text)))
    return outputs, custom_calls


# The child, given NAMES: our primitives' CPU rules are dropped as they are registered; it
# saves each call's outputs as their bits and dtypes.
FALLBACK_CHILD = """
import sys, warnings
from jax.interpreters import mlir

register, dropped = mlir.register_lowering, []

def without_cpu_kernels(prim, rule, platform=None, **keywords):
    if platform == "cpu" and prim.name.startswith("fp8norm_"):
        dropped.append(prim.name)
        return
    register(prim, rule, platform=platform, **keywords)

mlir.register_lowering = without_cpu_kernels
import numpy as np
import test_fallback  # imports jax_fp8norm
mlir.register_lowering = register

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    outputs, custom_calls = test_fallback.run_fallback_calls(NAMES)
assert not any(custom_calls.values()), custom_calls
warned = [str(w.message) for w in caught if w.category.__name__ == "KernelFallbackWarning"]
assert len(warned) == 1 and "platform 'cpu'" in warned[0], warned
saved = {"dropped": np.array(sorted(dropped))}
for name, outs in outputs.items():
    for i, o in enumerate(outs):
        saved[f"{name} {i}"] = o.view(f"u{o.dtype.itemsize}")
        saved[f"{name} {i} dtype"] = np.array(str(o.dtype))
np.savez(sys.argv[1], **saved)
"""


@pytest.mark.long_running
@pytest.mark.parametrize("tier", TIERS)
def test_the_fallback_runs_the_twins_bits_where_the_kernels_run(tmp_path, tier):
    """The twin lowered in place of every custom call of ours (none left in the compiled
    programs; the fallback warning for 'cpu'): the ops, their training and columnwise
    forms, both backwards and the layer's gradients give the kernels' bits, all finite.
    The default tier runs DEFAULT_FALLBACK_CALLS, the extended one every call."""
    names = DEFAULT_FALLBACK_CALLS if tier == "default" else tuple(fallback_calls())
    # The child imports jax_fp8norm from where this session did (the source tree), and
    # shares its compilation cache.
    source = os.path.dirname(os.path.dirname(os.path.abspath(fp8norm.__file__)))
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {"PYTHONPATH": os.pathsep.join((tests, source))}
    if jax.config.jax_compilation_cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    script = f"NAMES = {list(names)!r}\n{FALLBACK_CHILD}"
    child = outputs_of_script(script, tmp_path / "fallback.npz", **env)
    assert sorted(child.pop("dropped")) == [
        f"fp8norm_{name}"
        for name in (
            "add_rms_norm_backward",
            "add_rms_norm_fp8_kernel",
            "allreduce_rms_norm_fp8",
            "quantize_gradient",
            "quantize_weight",
            "rms_norm_backward",
            "rms_norm_fp8_kernel",
            "round",
        )
    ]
    outputs, custom_calls = run_fallback_calls(names)
    assert all(custom_calls.values()), custom_calls  # here, the kernels
    assert len(child) == 2 * sum(len(outs) for outs in outputs.values())
    for name, outs in outputs.items():
        for i, kernel in enumerate(outs):
            assert str(child[f"{name} {i} dtype"]) == str(kernel.dtype), (name, i)
            np.testing.assert_array_equal(
                child[f"{name} {i}"],
                kernel.view(f"u{kernel.dtype.itemsize}"),
                err_msg=f"{name}: output {i} ({kernel.dtype}), the twin's bits and the kernel's",
            )
            assert np.all(np.isfinite(kernel.astype(np.float32))), (name, i)
