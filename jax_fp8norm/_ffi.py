"""Loads the compiled extension modules and registers their XLA FFI targets.

The modules live in a package of their own, ``jax_fp8norm_kernels``, installed beside
``jax_fp8norm`` (as jaxlib beside jax). A source tree that comes first on ``sys.path``, as
with ``python -m jax_fp8norm`` from a clone's root, then still finds the installed ones.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax

from jax_fp8norm._version import __version__

try:
    from jax_fp8norm_kernels import _fp8norm_cpu
except ImportError as _error:
    raise ImportError(
        "jax_fp8norm's compiled modules (jax_fp8norm_kernels) are not installed: run "
        "`python -m pip install .` in the jax_fp8norm source tree"
    ) from _error


def check_version(module) -> None:
    """Compiled modules of another version may register other targets or read other
    attributes: refuse them rather than fail later in a kernel call."""
    if module.version != __version__:
        raise ImportError(
            f"jax_fp8norm {__version__} found compiled modules of version {module.version} "
            f"({module.__file__}): reinstall with `python -m pip install .` from the source "
            "tree you import"
        )


# The ops' FFI targets. Every compiled module registers its handlers under the op names
# (src/common/ffi_registrations.h); the names of the targets are made here, once: the
# same on every platform for the native kernels, "fp8norm_simt_<op>" for the emulated
# CUDA kernels on the CPU backend. A norm has one target for every form: its attributes
# with_inverse_rms and columnwise say which results follow y, scales[, residual_out].
OPS = ("rms_norm_fp8", "add_rms_norm_fp8", "round")
# The one-kernel all-reduce: the CUDA modules (real and emulated) only, as the CPU
# backend's all-reduce is XLA's own.
PEER_OPS = ("allreduce_rms_norm_fp8",)
# The backward kernels (docs/spec.md, "Training: the backward pass").
BACKWARD_OPS = ("rms_norm_backward", "add_rms_norm_backward")
# The quantisers of the operands a layer makes itself (jax_fp8norm/quantize.py): the
# weight's, and the output gradient's FP4 one (jax_fp8norm._quantize_kernels).
QUANTIZER_OPS = ("quantize_weight", "quantize_gradient")
_ALL_OPS = OPS + PEER_OPS + BACKWARD_OPS + QUANTIZER_OPS
TARGETS = {op: f"fp8norm_{op}" for op in _ALL_OPS}
EMULATED_TARGETS = {op: f"fp8norm_simt_{op}" for op in _ALL_OPS}

# How each platform's XLA holds a float4_e2m1fn buffer, by the name of the layout the
# handlers' fp4_layout attribute gives as a code (src/common/ffi_decode.h, Fp4Layout; the
# codes are the modules', FP4_LAYOUT_CODES below): "packed_low_first", two codes per
# byte with element 2k in the low nibble. XLA gives sub-byte types a packed layout on the
# CPU and GPU backends (jaxlib 0.10.2's CPU backend: tests/test_fp4.py checks it, and
# tools/gpu_check.sh the GPU's); "one_per_byte", one code per byte, is what the handlers
# also take. The FFI's buffer sizes cannot tell the two apart, so the layout travels as
# an attribute.
FP4_LAYOUTS = {"cpu": "packed_low_first", "cuda": "packed_low_first"}


def fp4_layout(platform: str) -> int:
    """The fp4_layout attribute of a custom call lowered for ``platform``."""
    try:
        name = FP4_LAYOUTS[platform]
    except KeyError:
        raise NotImplementedError(
            f"jax_fp8norm does not know how the {platform!r} backend holds float4_e2m1fn buffers"
        ) from None
    return FP4_LAYOUT_CODES[name]


def _register(module, targets: dict[str, str], platform: str, ops: tuple = OPS) -> None:
    check_version(module)
    registrations = module.registrations()
    if set(registrations) != set(ops):
        raise ImportError(
            f"{module.__file__} registers the ops {sorted(registrations)}, expected {list(ops)}: "
            "reinstall with `python -m pip install .`"
        )
    for op, handler in registrations.items():
        jax.ffi.register_ffi_target(targets[op], handler, platform=platform)


_register(_fp8norm_cpu, TARGETS, "cpu", OPS + BACKWARD_OPS + QUANTIZER_OPS)

try:
    from jax_fp8norm_kernels import _fp8norm_cuda
except ImportError as _error:
    _fp8norm_cuda = None
    CUDA_UNAVAILABLE_REASON = (
        f"this build of jax_fp8norm has no CUDA kernels ({_error}); for them, reinstall it "
        "with `FP8NORM_CUDA=ON python -m pip install .` (without a CUDA toolkit the build "
        "takes nvcc from PyPI)"
    )
else:
    _register(_fp8norm_cuda, TARGETS, "CUDA", _ALL_OPS)
    CUDA_UNAVAILABLE_REASON = ""

# The CUDA kernels and handlers compiled for the host against the SIMT emulation
# (jax_fp8norm.simt), registered on the CPU backend under target names of their own.
try:
    from jax_fp8norm_kernels import _fp8norm_simt as simt_module
except ImportError as _error:
    simt_module = None
    SIMT_ERROR = str(_error)
else:
    _register(simt_module, EMULATED_TARGETS, "cpu", _ALL_OPS)
    SIMT_ERROR = ""

EMULATE_CUDA_ENV = "FP8NORM_EMULATE_CUDA"


def emulation_requested(environ=os.environ) -> bool:
    """Whether ``FP8NORM_EMULATE_CUDA`` asks for the CPU backend to run the emulated CUDA
    kernels: "1" (or "true", "yes", "on") yes; unset, "", "0" (or "false", "no", "off")
    no; anything else is an error."""
    value = environ.get(EMULATE_CUDA_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{EMULATE_CUDA_ENV}={environ[EMULATE_CUDA_ENV]!r}: expected 1 or 0")


# The one switch between the CPU kernels and the emulated CUDA kernels on the CPU
# backend: the lowering reads it (cpu_target), FP8NORM_EMULATE_CUDA seeds it and
# emulate_cuda() toggles it, so that any JAX program runs the CUDA code without a GPU.
_emulating = False


def _require_simt():
    if simt_module is None:
        raise RuntimeError(f"jax_fp8norm was built without the SIMT emulation: {SIMT_ERROR}")
    return simt_module


def emulating() -> bool:
    """Whether the ops lower to the emulated CUDA kernels on the CPU backend now."""
    return _emulating


def cpu_target(op: str) -> str:
    """The FFI target the op ``op`` lowers to on the CPU backend now."""
    return (EMULATED_TARGETS if _emulating else TARGETS)[op]


@contextlib.contextmanager
def emulate_cuda(on: bool = True) -> Iterator[None]:
    """Within the block, the ops on the CPU backend run the emulated CUDA kernels (or, with
    ``on=False``, the CPU kernels). Compiled executables do not know which kernels they
    call, so jax's caches are cleared on the way in and out."""
    global _emulating
    if on:
        _require_simt()
    previous, _emulating = _emulating, bool(on)
    jax.clear_caches()
    try:
        yield
    finally:
        _emulating = previous
        jax.clear_caches()


if emulation_requested():
    if simt_module is None:
        raise ImportError(
            f"{EMULATE_CUDA_ENV}=1, but this build of jax_fp8norm has no SIMT emulation "
            f"({SIMT_ERROR})"
        )
    _emulating = True

CUDA_KERNEL_ENV = "FP8NORM_CUDA_KERNEL"


def _kernel_modules() -> list:
    """The modules that carry the CUDA kernels: the CUDA build's and the emulation's."""
    return [m for m in (_fp8norm_cuda, simt_module) if m is not None]


def _agreed(name: str, modules: list):
    """What ``module.<name>()`` returns, alike in every one of ``modules``: the C++ defines
    each of these tables once, so modules that disagree come from different builds."""
    values = []
    for module in modules:
        export = getattr(module, name, None)
        if export is None:
            raise ImportError(
                f"{module.__file__} does not export {name}(): reinstall with "
                "`python -m pip install .`"
            )
        values.append((module, export()))
    (first, value), *others = values
    for module, other in others:
        if other != value:
            raise ImportError(
                f"jax_fp8norm's compiled modules disagree on {name}(): {value} in "
                f"{first.__file__}, {other} in {module.__file__}: reinstall with "
                "`python -m pip install .`"
            )
    return value


# The constants that cross into the handlers, as the compiled modules define them (no
# copies here). Every module's: the fp4_layout codes by layout name (kFp4LayoutNames in
# src/common/ffi_decode.h).
FP4_LAYOUT_CODES: dict[str, int] = dict(_agreed("fp4_layouts", [_fp8norm_cpu, *_kernel_modules()]))
# The format codes of the quantize_weight target by name (kWeightFormatNames in
# src/common/quantize_weight.h).
WEIGHT_FORMAT_CODES: dict[str, int] = dict(
    _agreed("weight_formats", [_fp8norm_cpu, *_kernel_modules()])
)
# The one-kernel all-reduce's, which the CUDA modules (real and emulated) carry
# (src/cuda/peer_allreduce.h: kAllReduceMethodNames, kMaxPeers): the method codes by
# name and the most devices of a group; empty and None in a build with neither module,
# where the kernel cannot run.
ALLREDUCE_METHOD_CODES: dict[str, int] = (
    dict(_agreed("allreduce_methods", _kernel_modules())) if _kernel_modules() else {}
)
MAX_PEERS: int | None = _agreed("max_peers", _kernel_modules()) if _kernel_modules() else None


def cuda_kernel_variants() -> list[str]:
    """The names of the CUDA kernel variants, "auto" first (docs/performance.md)."""
    modules = _kernel_modules()
    return list(modules[0].kernel_variants()) if modules else []


def cuda_kernel() -> str:
    """The CUDA kernel variant launches use now ("auto" unless chosen)."""
    modules = _kernel_modules()
    return modules[0].kernel_variant() if modules else "auto"


def set_cuda_kernel(name: str) -> str:
    """Makes later launches of the CUDA kernels (real or emulated) use the variant ``name``;
    returns the one it replaces. The launch reads it when the kernel is launched, so
    compiled functions need no recompilation, with two consequences: a call XLA recorded
    into a CUDA graph keeps the variant it was recorded with until XLA records it again,
    and a call still being dispatched when the choice changes may see either (block on its
    results first). A variant that cannot hold a call's row runs block_shared for that
    call."""
    variants = cuda_kernel_variants()
    if name not in variants:
        raise ValueError(f"unknown CUDA kernel variant {name!r}: expected one of {variants}")
    previous = cuda_kernel()
    for module in _kernel_modules():
        module.set_kernel_variant(name)
    return previous


@contextlib.contextmanager
def use_cuda_kernel(name: str) -> Iterator[None]:
    """Within the block, launches of the CUDA kernels (real or emulated) use the variant
    ``name`` (see :func:`cuda_kernel_variants`); the previous choice is restored after."""
    previous = set_cuda_kernel(name)
    try:
        yield
    finally:
        set_cuda_kernel(previous)


if os.environ.get(CUDA_KERNEL_ENV):
    try:
        set_cuda_kernel(os.environ[CUDA_KERNEL_ENV])
    except ValueError as _error:
        raise ValueError(f"{CUDA_KERNEL_ENV}: {_error}") from None


def cpu_kernel_variant() -> str:
    """The instruction-set variant of the CPU kernel on this machine: "avx2" (AVX2 + FMA +
    F16C, x86-64 built with GCC) or "baseline". ``FP8NORM_CPU_ISA=baseline`` in the
    environment before the first call forces the baseline; both give the same bits."""
    return _fp8norm_cpu.cpu_kernel_variant()


def built_with_cuda() -> bool:
    """Whether this build of jax_fp8norm carries the CUDA kernels."""
    return _fp8norm_cuda is not None
