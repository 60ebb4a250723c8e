"""The package as a user meets it: imported from a clone's root, where the source tree
comes first on sys.path, and the compiled modules' version check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jax_fp8norm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, **kwargs
    )


@pytest.mark.long_running
def test_imports_from_the_source_tree_root():
    # `python -c` from the root puts the root first on sys.path, as `python -m` does: the
    # source package is the one imported, and it must find the installed compiled modules.
    script = (
        "import jax, jax.numpy as jnp, jax_fp8norm as f;"
        "print(f.__file__);"
        "x = jnp.arange(16, dtype=jnp.bfloat16).reshape(2, 8); g = jnp.ones((8,), jnp.bfloat16);"
        "got, want = f.rms_norm_fp8(x, g), f.reference.rms_norm_fp8(x, g);"
        "print(all(bool((a == b).all()) for a, b in zip(got, want)))"
    )
    result = _run([sys.executable, "-c", script], cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    module_file, same = result.stdout.split()
    assert os.path.realpath(os.path.dirname(os.path.dirname(module_file))) == os.path.realpath(
        REPO_ROOT
    )
    assert same == "True"


def test_compiled_modules_carry_the_package_version():
    from jax_fp8norm_kernels import _fp8norm_cpu

    assert _fp8norm_cpu.version == jax_fp8norm.__version__
    if jax_fp8norm.built_with_cuda():
        from jax_fp8norm_kernels import _fp8norm_cuda

        assert _fp8norm_cuda.version == jax_fp8norm.__version__


def test_the_reason_names_the_fix():
    from jax_fp8norm import _ffi

    if jax_fp8norm.built_with_cuda():
        assert _ffi.CUDA_UNAVAILABLE_REASON == ""
    else:
        assert "FP8NORM_CUDA=ON python -m pip install ." in _ffi.CUDA_UNAVAILABLE_REASON


def test_import_does_not_start_jax_backends():
    # At import, before a user's jax.distributed.initialize, the check must not start jax.
    script = (
        "from jax._src import xla_bridge; import jax_fp8norm;"
        "print(xla_bridge.backends_are_initialized())"
    )
    result = _run([sys.executable, "-c", script])
    assert result.stdout.split() == ["False"], result.stderr[-2000:]


@pytest.mark.parametrize(
    ("runtime", "driver", "expected"),
    [
        (13000, 13000, None),
        (13000, 13020, None),
        (12080, 12020, None),  # an older minor version: CUDA's minor-version compatibility
        (12040, 13000, None),
        (13000, 12080, ["CUDA up to 12.8", "CUDA 13.0 runtime", "Update the NVIDIA driver"]),
        (12060, 11080, ["CUDA up to 11.8", "CUDA 12.6 runtime", "FP8NORM_CUDA=ON"]),
        (13000, 0, ["no CUDA driver", "CUDA 13.0"]),
    ],
)
def test_cuda_driver_check_message(runtime, driver, expected):
    from jax_fp8norm_kernels import _fp8norm_simt

    problem = _fp8norm_simt.cuda_driver_problem(runtime, driver)
    if expected is None:
        assert problem == ""
    else:
        for part in expected:
            assert part in problem, problem


def test_build_without_a_cuda_compiler_warns(tmp_path):
    # cmake and nanobind come with the test extra.
    # CUDACXX naming no compiler hides nvcc; a new session has no terminal, so the copy of
    # the warning written for pip's users goes nowhere.
    env = dict(os.environ, CUDACXX=str(tmp_path / "no-nvcc"))
    result = _run(
        ["cmake", "-S", REPO_ROOT, "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}"],
        env=env,
        start_new_session=True,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "CMake Warning" in result.stderr and "no CUDA compiler" in result.stderr
    assert "FP8NORM_CUDA=ON python -m pip install" in " ".join(result.stderr.split())


def test_test_requirements_are_the_test_extra():
    """tests/requirements.txt (the README's test install, which builds nothing) lists what
    pyproject.toml's `test` extra does."""
    import tomllib

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    with open(os.path.join(REPO_ROOT, "tests", "requirements.txt")) as f:
        listed = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert sorted(listed) == sorted(extra)


def test_the_oldest_tested_jax_is_the_oldest_allowed():
    """pyproject.toml's tested jax releases: the oldest is the dependencies' lower bound
    (the README's commands on Python 3.11 install it), the newest is newer."""
    import tomllib

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    tested = project["tool"]["jax_fp8norm"]["tested_jax"]
    dependencies = project["project"]["dependencies"]
    assert f"jax>={tested['oldest']}" in dependencies
    assert f"jaxlib>={tested['oldest']}" in dependencies
    as_tuple = lambda version: tuple(int(part) for part in version.split("."))  # noqa: E731
    assert as_tuple(tested["newest"]) > as_tuple(tested["oldest"])


def test_installed_package_is_typed_and_registers_every_op():
    """py.typed ships (PEP 561: type checkers read the keyword signatures), and every
    compiled module registers exactly the ops the FFI layer names targets for."""
    import importlib.util

    from jax_fp8norm import _ffi

    spec = importlib.util.find_spec("jax_fp8norm")
    installed = [p for p in spec.submodule_search_locations if "site-packages" in p]
    for location in installed or spec.submodule_search_locations:
        assert os.path.exists(os.path.join(location, "py.typed")), location
    assert sorted(_ffi._fp8norm_cpu.registrations()) == sorted(
        _ffi.OPS + _ffi.BACKWARD_OPS + _ffi.GRADIENT_QUANTIZER_OPS
    )
    # The one-kernel all-reduce is the CUDA modules' only (real and emulated).
    for module in [m for m in (_ffi._fp8norm_cuda, _ffi.simt_module) if m]:
        expected = _ffi.OPS + _ffi.PEER_OPS + _ffi.BACKWARD_OPS + _ffi.GRADIENT_QUANTIZER_OPS
        assert sorted(module.registrations()) == sorted(expected), module.__file__


def test_a_plain_import_carries_the_emulation_controls():
    """``import jax_fp8norm`` alone gives ``jax_fp8norm.simt`` (as the docs use it)."""
    script = "import jax_fp8norm; print(jax_fp8norm.simt.available(), jax_fp8norm.simt.active())"
    result = _run([sys.executable, "-c", script], cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "False"]


def _wheel_libraries():
    """tools/checks/wheel_libraries.py, the wheel check's rule on the libraries a compiled
    module needs."""
    import importlib.util

    path = os.path.join(REPO_ROOT, "tools", "checks", "wheel_libraries.py")
    spec = importlib.util.spec_from_file_location("wheel_libraries", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF modules (Linux)")
def test_the_compiled_modules_need_only_glibc_libstdcxx_libgcc_and_libcuda(tmp_path, capsys):
    """The installed modules pass the wheel check's rule (no CUDA runtime, no libpython, no
    RUNPATH); a module whose NEEDED names the CUDA runtime, and the lists of one that needs
    libpython or has a toolkit RUNPATH, do not."""
    import jax_fp8norm_kernels

    check = _wheel_libraries()
    folder = os.path.dirname(os.path.abspath(jax_fp8norm_kernels.__file__))
    modules = check.shared_libraries([folder])
    assert len(modules) == 2 + jax_fp8norm.built_with_cuda(), modules
    assert check.main([folder]) == 0, capsys.readouterr()
    # One of them with its longest NEEDED entry renamed to the CUDA runtime's.
    needed, _ = check.dynamic_entries(modules[0])
    name = max(needed, key=len).encode()
    data = modules[0].read_bytes()
    # Renamed in place, the file's length and offsets unchanged: the entry must be as long.
    assert len(name) >= len(b"libcudart.so") and data.count(name + b"\0") == 1, name
    fake = tmp_path / "_fp8norm_fake.so"
    fake.write_bytes(data.replace(name + b"\0", b"libcudart.so".ljust(len(name) + 1, b"\0")))
    assert "libcudart.so" in check.dynamic_entries(fake)[0]
    capsys.readouterr()
    assert check.main([str(fake)]) == 1
    assert "needs ['libcudart.so']" in capsys.readouterr().err
    assert check.main([str(tmp_path / "nothing")]) == 2
    found = check.problems(
        {
            "_fp8norm_a.so": (["libc.so.6", "libpython3.11.so.1.0", "_fp8norm_b.so"], []),
            "_fp8norm_b.so": (
                ["libcuda.so.1", "libstdc++.so.6", "libcudart.so.13"],
                ["/usr/local/cuda/lib64", "$ORIGIN"],
            ),
            "libcudart.so.13": ([], []),  # bundled beside them: not one of the package's own
        }
    )
    assert len(found) == 3, found
    assert "_fp8norm_a.so needs ['libpython3.11.so.1.0']" in found[0]
    assert "_fp8norm_b.so needs ['libcudart.so.13']" in found[1]
    assert "_fp8norm_b.so has RPATH / RUNPATH ['/usr/local/cuda/lib64']" in found[2]
