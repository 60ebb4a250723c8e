"""The constants that cross into the handlers are defined once, in C++ (one table next to
each enum), and exported by every compiled module that uses them: the FP4 layouts by
every module, the all-reduce's methods and group limit by the CUDA modules (real and
emulated). The loaded modules agree, and the Python package writes those values."""

from __future__ import annotations

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm
import jax_fp8norm.simt
from jax_fp8norm import _allreduce, _ffi

# docs/spec.md: fp4_layout 0 is one code per byte, 1 two per byte (low nibble first); the
# all-reduce's methods and its groups of at most 8 devices ("One-kernel all-reduce").
SPEC_FP4_LAYOUTS = {"one_per_byte": 0, "packed_low_first": 1}
SPEC_METHODS = {"one_shot": 1, "two_shot": 2}
SPEC_MAX_PEERS = 8


def _loaded() -> dict:
    modules = {"cpu": _ffi._fp8norm_cpu, "cuda": _ffi._fp8norm_cuda, "simt": _ffi.simt_module}
    return {name: module for name, module in modules.items() if module is not None}


def _kernel_modules() -> dict:
    return {name: module for name, module in _loaded().items() if name != "cpu"}


def test_every_module_exports_the_fp4_layouts():
    tables = {name: module.fp4_layouts() for name, module in _loaded().items()}
    assert "cpu" in tables
    for name, table in tables.items():
        assert table == SPEC_FP4_LAYOUTS, (name, table)


def test_the_cuda_modules_export_the_allreduce_constants():
    modules = _kernel_modules()
    if not modules:
        pytest.skip("this build has neither the CUDA kernels nor the SIMT emulation")
    for name, module in modules.items():
        assert module.allreduce_methods() == SPEC_METHODS, name
        assert module.max_peers() == SPEC_MAX_PEERS, name
    assert not hasattr(_ffi._fp8norm_cpu, "allreduce_methods")


def test_the_package_reads_the_modules_tables():
    cpu = _ffi._fp8norm_cpu
    assert _ffi.FP4_LAYOUT_CODES == cpu.fp4_layouts()
    for platform, name in _ffi.FP4_LAYOUTS.items():
        assert _ffi.fp4_layout(platform) == cpu.fp4_layouts()[name]
    modules = list(_kernel_modules().values())
    if not modules:
        assert _ffi.ALLREDUCE_METHOD_CODES == {} and _ffi.MAX_PEERS is None
        return
    assert _ffi.ALLREDUCE_METHOD_CODES == modules[0].allreduce_methods()
    assert _ffi.MAX_PEERS == modules[0].max_peers()
    assert set(_ffi.ALLREDUCE_METHOD_CODES) == set(_allreduce.ONE_KERNEL_METHODS)
    for method in _allreduce.ONE_KERNEL_METHODS:
        assert _allreduce.method_code(method) == modules[0].allreduce_methods()[method]


def test_the_lowering_writes_the_modules_fp4_layout_code(monkeypatch):
    """The attribute a call carries is the module's code: change the code the package
    read, and the lowered call changes with it."""
    x = jnp.ones((2, 64), jnp.float32)
    norm = functools.partial(fp8norm.rms_norm_fp8, recipe="mxfp4")

    def lowered_layout() -> str:
        jax.clear_caches()
        text = jax.jit(norm).lower(x, x[0]).as_text()
        return re.findall(r"fp4_layout = (\d+) : i64", text)

    code = _ffi.FP4_LAYOUT_CODES[_ffi.FP4_LAYOUTS["cpu"]]
    assert lowered_layout() == [str(code)]
    monkeypatch.setitem(_ffi.FP4_LAYOUT_CODES, _ffi.FP4_LAYOUTS["cpu"], 7)
    assert lowered_layout() == ["7"]


def test_the_lowering_writes_the_modules_method_code():
    if _ffi.simt_module is None:
        pytest.skip("this build has no SIMT emulation")
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("tp",))
    replicated = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((1, 4, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    residual = jax.ShapeDtypeStruct((4, 256), jnp.bfloat16, sharding=replicated)
    gamma = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=replicated)
    methods = _ffi.simt_module.allreduce_methods()
    for method, code in methods.items():
        fn = jax.shard_map(
            lambda p, r, g, method=method: fp8norm.allreduce_residual_rms_norm_fp8(
                p[0], r, g, axis_name="tp", method=method
            ),
            mesh=mesh,
            in_specs=(P("tp"), P(), P()),
            out_specs=(P(), P(), P()),
        )
        with jax_fp8norm.simt.kernels():
            text = jax.jit(fn).lower(x, residual, gamma).as_text()
        assert re.findall(r"method = (\d+) : i64", text) == [str(code)], (method, text)


def test_the_group_limit_is_the_modules():
    if _ffi.MAX_PEERS is None:
        pytest.skip("this build has neither the CUDA kernels nor the SIMT emulation")
    common = dict(platform="cpu", emulating=True, cuda_built=False, processes=1)
    assert _allreduce.unavailable_reason(num_devices=_ffi.MAX_PEERS, **common) == ""
    reason = _allreduce.unavailable_reason(num_devices=_ffi.MAX_PEERS + 1, **common)
    assert f"at most {_ffi.MAX_PEERS}" in reason


def test_without_a_cuda_module_the_method_code_is_refused(monkeypatch):
    monkeypatch.setattr(_ffi, "ALLREDUCE_METHOD_CODES", {})
    with pytest.raises(RuntimeError, match="no one-kernel all-reduce"):
        _allreduce.method_code("one_shot")


def _fake_module(path: str, **tables):
    exports = {name: (lambda value=value: value) for name, value in tables.items()}
    return types.SimpleNamespace(__file__=path, **exports)


def test_modules_that_disagree_are_refused():
    cpu = _fake_module("cpu.so", fp4_layouts=dict(SPEC_FP4_LAYOUTS))
    same = _fake_module("simt.so", fp4_layouts=dict(SPEC_FP4_LAYOUTS))
    other = _fake_module("cuda.so", fp4_layouts={"one_per_byte": 0, "packed_low_first": 2})
    assert _ffi._agreed("fp4_layouts", [cpu, same]) == SPEC_FP4_LAYOUTS
    with pytest.raises(ImportError, match=r"disagree on fp4_layouts\(\).*cuda\.so"):
        _ffi._agreed("fp4_layouts", [cpu, same, other])
    with pytest.raises(ImportError, match=r"does not export max_peers\(\)"):
        _ffi._agreed("max_peers", [cpu])
