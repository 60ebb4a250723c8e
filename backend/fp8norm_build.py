"""The build backend: scikit-build-core's, plus the CUDA compiler from PyPI where a build
wants the CUDA kernels and the machine has no CUDA toolkit, and one build at a time in
each build folder.

A build wants them with ``FP8NORM_CUDA=ON``, or by default (``AUTO``) on a machine with
an NVIDIA driver: a CUDA compiler alone (a toolkit in a container or on a CI runner with
no GPU) does not make ``AUTO`` build them, since nothing there could run them and they
are most of the build's time (seven GPU architectures). ``AUTO`` without a driver is
handed to CMake as such (``FP8NORM_NVIDIA_DRIVER=OFF``), which builds the CPU kernels
and says so. Where the build wants them, when no nvcc is in ``CUDACXX``, on PATH, under
``CUDA_PATH`` / ``CUDA_HOME`` or in ``/usr/local/cuda`` (and none is named to CMake), the
build asks for NVIDIA's compiler wheels (``nvidia-cuda-nvcc`` and the runtime, NVVM, CRT
and CCCL wheels it needs, which install into one ``nvidia/cu13`` tree) and hands their
nvcc to CMake. CPU-only machines download nothing. PyPI carries a whole compiler for CUDA 13
only (``nvidia-cuda-nvcc-cu12`` holds ptxas alone), so a machine whose driver or jax
plugin is CUDA 12 needs a toolkit. The nvcc the build settles on, the wheels' or an
installed one, is handed to CMake by name. pip's build isolation hides the user's
packages, so the jax plugin's CUDA major is read only in a build without it
(``--no-build-isolation``); the driver's is read always.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: builds are not locked
    fcntl = None

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import (
    build_sdist,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

# The CUDA 13 compiler on PyPI: nvcc, ptxas, nvlink, fatbinary; cicc (nvidia-nvvm); the
# runtime's headers and libcudart_static.a; the crt headers; CCCL's headers (CMake's
# CUDA::cudart_static names their folder). Pinned to the release the kernels' register
# and spill figures are measured with (README, "Build options").
PYPI_NVCC = {
    13: (
        "nvidia-cuda-nvcc==13.0.*",
        "nvidia-cuda-runtime==13.0.*",
        "nvidia-nvvm==13.0.*",
        "nvidia-cuda-crt==13.0.*",
        "nvidia-cuda-cccl==13.0.*",
    )
}
# Where those wheels put nvcc, relative to site-packages.
PYPI_NVCC_PATH = {13: Path("nvidia/cu13/bin/nvcc")}
# CMake looks here for nvcc after PATH (CMakeDetermineCUDACompiler).
DEFAULT_TOOLKIT_NVCC = Path("/usr/local/cuda/bin/nvcc")
_CUDA_SETTING = "cmake.define.FP8NORM_CUDA"
_COMPILER_SETTING = "cmake.define.CMAKE_CUDA_COMPILER"
# Whether AUTO found a driver (ON / OFF), for CMake, which cannot ask as this file does.
_DRIVER_SETTING = "cmake.define.FP8NORM_NVIDIA_DRIVER"
# pyproject.toml's [tool.scikit-build] build-dir (tests/test_build_backend.py holds the two
# together): where builds go unless a setting names another folder.
DEFAULT_BUILD_DIR = "build/{wheel_tag}"
# The build folder of builds with the wheels' nvcc, whose path changes with every isolated
# build environment: kept apart from the default one, so that a later build with a toolkit
# (or none) does not meet a compiler path that no longer exists in its cache.
PYPI_NVCC_BUILD_DIR = "build/{wheel_tag}-pypi-nvcc"


def _cmake_args_define(name: str, environ) -> str | None:
    """``-D<name>=<value>`` (or ``-D<name>:<type>=<value>``) in ``CMAKE_ARGS``."""
    found = re.findall(rf"-D{name}(?::\w+)?=(\S+)", environ.get("CMAKE_ARGS", ""))
    return found[-1] if found else None


def cuda_setting(config_settings: dict | None, environ=os.environ) -> str:
    """FP8NORM_CUDA as the build sees it: ``-C cmake.define.FP8NORM_CUDA=...``, then
    ``CMAKE_ARGS``, then the environment (pyproject.toml's define), AUTO by default; CMake
    reads it without regard to case too."""
    value = (
        (config_settings or {}).get(_CUDA_SETTING)
        or _cmake_args_define("FP8NORM_CUDA", environ)
        or environ.get("FP8NORM_CUDA")
        or "AUTO"
    )
    return str(value).strip().upper()


def chosen_compiler(config_settings: dict | None, environ=os.environ) -> str | None:
    """A CUDA compiler the user named to CMake (``-C cmake.define.CMAKE_CUDA_COMPILER=`` or
    ``CMAKE_ARGS``): the build takes it as it is."""
    return (config_settings or {}).get(_COMPILER_SETTING) or _cmake_args_define(
        "CMAKE_CUDA_COMPILER", environ
    )


def nvidia_driver_present() -> bool:
    """The NVIDIA driver's device node or its library: a machine that runs CUDA."""
    if Path("/dev/nvidiactl").exists():
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def system_nvcc(environ=os.environ) -> str | None:
    """An installed nvcc, or None: ``CUDACXX``, PATH, ``CUDA_PATH`` / ``CUDA_HOME``, the
    toolkit's default folder. The build hands it to CMake (whose own search stops short of
    the last two)."""
    if environ.get("CUDACXX"):
        return environ["CUDACXX"]
    on_path = shutil.which("nvcc", path=environ.get("PATH"))
    if on_path:
        return on_path
    for root in (environ.get("CUDA_PATH"), environ.get("CUDA_HOME")):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return str(DEFAULT_TOOLKIT_NVCC) if DEFAULT_TOOLKIT_NVCC.is_file() else None


def _jax_plugin_major() -> int | None:
    for major in (13, 12):
        try:
            importlib.metadata.version(f"jax-cuda{major}-plugin")
        except importlib.metadata.PackageNotFoundError:
            continue
        return major
    return None


def _driver_major() -> int | None:
    """The newest CUDA major the driver runs (cuDriverGetVersion), or None."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value // 1000


def cuda_major(plugin_major: int | None, driver_major: int | None) -> int | None:
    """The CUDA major whose compiler to take from PyPI: with a driver, the newest on PyPI
    that it runs (a CUDA 13 build runs beside jax's CUDA 12 plugin on such a driver);
    without one, the jax plugin's, else the newest. None where PyPI has none of those."""
    usable = [major for major in PYPI_NVCC if driver_major is None or major <= driver_major]
    if driver_major is None and plugin_major is not None:
        usable = [major for major in usable if major == plugin_major]
    return max(usable, default=None)


def cuda_wanted(
    config_settings: dict | None, environ=os.environ, *, driver_present=nvidia_driver_present
) -> bool:
    """Whether the build compiles the CUDA kernels: ``ON`` (a wheel builder, a build for
    another machine), or ``AUTO`` where an NVIDIA driver could run them; never ``OFF``."""
    setting = cuda_setting(config_settings, environ)
    return setting == "ON" or (setting == "AUTO" and driver_present())


def pypi_nvcc_requirements(
    config_settings: dict | None = None,
    environ=os.environ,
    *,
    driver_present=None,
    find_nvcc=None,
    plugin_major=_jax_plugin_major,
    driver_major=_driver_major,
) -> list[str]:
    """The compiler wheels this build needs from PyPI; [] where it wants no CUDA or has a
    toolkit. A CUDA major without a compiler on PyPI gets [] too, and CMake then says that
    no nvcc was found. ``driver_present`` and ``find_nvcc`` default to this machine's."""
    driver_present = driver_present or nvidia_driver_present
    find_nvcc = find_nvcc or system_nvcc
    wanted = cuda_wanted(config_settings, environ, driver_present=driver_present)
    if not wanted or chosen_compiler(config_settings, environ) or find_nvcc(environ):
        return []
    return list(PYPI_NVCC.get(cuda_major(plugin_major(), driver_major()), ()))


def installed_pypi_nvcc() -> str | None:
    """nvcc from the compiler wheels, where they are installed (the build's environment)."""
    for entry in sys.path:
        for relative in PYPI_NVCC_PATH.values():
            candidate = Path(entry or ".") / relative
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def complete_layout(nvcc: str) -> None:
    """nvcc 13.0's wheel looks for the runtime's libraries in ``lib64``, as a toolkit lays
    them out, where the runtime's wheel puts them in ``lib``: a link in the build's own
    environment joins the two (later wheels look in ``lib``)."""
    root = Path(nvcc).parent.parent
    if (root / "lib").is_dir() and not (root / "lib64").exists():
        (root / "lib64").symlink_to("lib")


def _with_compiler(
    config_settings: dict | None, environ=os.environ, *, driver_present=None
) -> dict | None:
    """The settings with CMake pointed at the nvcc the build found: the wheels' where it
    asked for them (in a build folder of their own), else an installed one; none where CUDA
    is off or the user named a compiler. ``AUTO`` also tells CMake whether a driver is
    here: without one it builds no CUDA, whatever compiler it could find."""
    driver_present = driver_present or nvidia_driver_present
    settings = dict(config_settings or {})
    if cuda_setting(settings, environ) == "AUTO":
        driver = driver_present()
        settings[_DRIVER_SETTING] = "ON" if driver else "OFF"
        if not driver:
            return settings
    if cuda_setting(settings, environ) == "OFF" or chosen_compiler(settings, environ):
        return settings if _DRIVER_SETTING in settings else config_settings
    if pypi_nvcc_requirements(settings, environ, driver_present=driver_present):
        nvcc = installed_pypi_nvcc()
        if nvcc is None:  # --no-build-isolation without the wheels: CMake decides
            return config_settings
        complete_layout(nvcc)
        settings.setdefault("build-dir", PYPI_NVCC_BUILD_DIR)
    else:
        nvcc = system_nvcc(environ)
        if nvcc is None:
            return settings if _DRIVER_SETTING in settings else config_settings
    return {**settings, _COMPILER_SETTING: nvcc}


class _Placeholders(dict):
    """A build-dir template's fields: ``wheel_tag`` by the interpreter that decides it, any
    other field by its name."""

    def __missing__(self, key: str) -> str:
        return key


def interpreter_key() -> str:
    """What a build's wheel tag depends on here (the interpreter, its ABI flags and the
    platform), without computing the tag: two builds that share a build folder share it."""
    return f"{sys.implementation.cache_tag}{sys.abiflags}-{sysconfig.get_platform()}"


def build_lock_path(config_settings: dict | None, environ=os.environ) -> Path | None:
    """The lock of the build folder this build uses (``build-dir`` from the settings, from
    ``SKBUILD_BUILD_DIR``, else pyproject.toml's), beside it; None for a temporary folder
    (an empty build-dir)."""
    settings = config_settings or {}
    if "build-dir" in settings:  # given, even empty (a temporary folder)
        template = settings["build-dir"]
    else:
        template = environ.get("SKBUILD_BUILD_DIR", DEFAULT_BUILD_DIR)
    if not str(template).strip():
        return None
    folder = str(template).format_map(_Placeholders(wheel_tag=interpreter_key()))
    return Path(folder.rstrip("/\\") + ".lock")


@contextlib.contextmanager
def build_folder_lock(path: Path | None, *, stream=sys.stderr):
    """Holds an exclusive lock on ``path`` (created if need be) for the build. A second
    install of the same checkout waits for the first instead of building beside it in the
    same folder, where each would delete or rewrite the other's objects mid-build; after
    the wait it finds the first's objects and rebuilds only what changed. A private folder
    instead would cost a full build (the CUDA kernels' minutes) on the same cores. The
    operating system releases the lock when its build ends in any way."""
    if path is None or fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"jax_fp8norm: another build of this checkout holds {path}; waiting for it",
                file=stream,
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def get_requires_for_build_wheel(config_settings=None):
    requires = _scikit_build.get_requires_for_build_wheel(config_settings)
    return [*requires, *pypi_nvcc_requirements(config_settings)]


def get_requires_for_build_editable(config_settings=None):
    requires = _scikit_build.get_requires_for_build_editable(config_settings)
    return [*requires, *pypi_nvcc_requirements(config_settings)]


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    settings = _with_compiler(config_settings)
    with build_folder_lock(build_lock_path(settings)):
        return _scikit_build.build_wheel(wheel_directory, settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    settings = _with_compiler(config_settings)
    with build_folder_lock(build_lock_path(settings)):
        return _scikit_build.build_editable(wheel_directory, settings, metadata_directory)
