"""The build backend's additions to scikit-build-core: nvcc from PyPI where a build wants
the CUDA kernels and the machine has no toolkit, nothing anywhere else; AUTO's CUDA only
beside a driver; one build at a time per build folder. The build itself with the toolkit
hidden is tools/checks/wheel_check.sh (CI)."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
import fp8norm_build

NVCC_13 = list(fp8norm_build.PYPI_NVCC[13])
COMPILER = "cmake.define.CMAKE_CUDA_COMPILER"
DRIVER = "cmake.define.FP8NORM_NVIDIA_DRIVER"
REPO = Path(__file__).resolve().parents[1]


def _requirements(setting, *, driver=None, toolkit=None, plugin=None, settings=None):
    environ = {} if setting is None else {"FP8NORM_CUDA": setting}
    return fp8norm_build.pypi_nvcc_requirements(
        settings,
        environ,
        driver_present=lambda: driver is not None,
        find_nvcc=lambda environ: toolkit,
        plugin_major=lambda: plugin,
        driver_major=lambda: driver,
    )


@pytest.mark.parametrize(
    ("setting", "driver", "toolkit", "plugin", "expected"),
    [
        # CPU-only machines download nothing, whatever jax plugin is installed.
        (None, None, None, None, []),
        ("AUTO", None, None, 13, []),
        ("OFF", 13, None, 13, []),
        # A toolkit found: CMake takes it.
        ("ON", 13, "/usr/local/cuda/bin/nvcc", None, []),
        (None, 13, "/opt/cuda/bin/nvcc", 13, []),
        # A driver and no toolkit: CUDA 13's compiler, also beside jax's CUDA 12 plugin.
        (None, 13, None, None, NVCC_13),
        ("auto", 13, None, 12, NVCC_13),
        ("ON", 14, None, 13, NVCC_13),
        # ON without a driver (a build machine): the plugin's major, else the newest.
        ("ON", None, None, None, NVCC_13),
        ("ON", None, None, 13, NVCC_13),
        # CUDA 12 has no whole compiler on PyPI: nothing to take (CMake then says so).
        ("ON", None, None, 12, []),
        ("ON", 12, None, 12, []),
    ],
)
def test_the_compiler_wheels_are_asked_for_only_where_wanted_and_missing(
    setting, driver, toolkit, plugin, expected
):
    assert _requirements(setting, driver=driver, toolkit=toolkit, plugin=plugin) == expected


def test_the_config_setting_wins_over_the_environment():
    settings = {"cmake.define.FP8NORM_CUDA": "OFF"}
    assert _requirements("ON", driver=13, settings=settings) == []
    settings = {"cmake.define.FP8NORM_CUDA": "ON"}
    assert _requirements("OFF", settings=settings) == NVCC_13


def test_system_nvcc_looks_where_toolkits_are(tmp_path, monkeypatch):
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(fp8norm_build, "DEFAULT_TOOLKIT_NVCC", tmp_path / "absent" / "nvcc")
    empty = str(tmp_path / "empty")
    assert fp8norm_build.system_nvcc({"PATH": empty}) is None
    assert fp8norm_build.system_nvcc({"PATH": str(nvcc.parent)}) == str(nvcc)
    assert fp8norm_build.system_nvcc({"PATH": empty, "CUDA_HOME": str(nvcc.parents[1])}) == str(
        nvcc
    )
    assert fp8norm_build.system_nvcc({"PATH": empty, "CUDACXX": "/x/nvcc"}) == "/x/nvcc"
    monkeypatch.setattr(fp8norm_build, "DEFAULT_TOOLKIT_NVCC", nvcc)
    assert fp8norm_build.system_nvcc({"PATH": empty}) == str(nvcc)


def test_the_build_names_the_nvcc_it_settled_on(tmp_path, monkeypatch):
    nvcc = tmp_path / fp8norm_build.PYPI_NVCC_PATH[13]
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    compiler = "cmake.define.CMAKE_CUDA_COMPILER"
    # The wheels' nvcc, in a build folder of its own (unless one is given).
    monkeypatch.setattr(fp8norm_build, "pypi_nvcc_requirements", lambda s, e, **k: NVCC_13)
    on = {"FP8NORM_CUDA": "ON"}
    settings = fp8norm_build._with_compiler({"a": "b"}, on)
    assert settings == {
        "a": "b",
        compiler: str(nvcc),
        "build-dir": fp8norm_build.PYPI_NVCC_BUILD_DIR,
    }
    given = fp8norm_build._with_compiler({"build-dir": "mine"}, on)
    assert given["build-dir"] == "mine"
    # An installed nvcc, by name: CMake's own search misses /usr/local/cuda and CUDA_HOME.
    monkeypatch.setattr(fp8norm_build, "pypi_nvcc_requirements", lambda s, e, **k: [])
    monkeypatch.setattr(fp8norm_build, "system_nvcc", lambda e: "/opt/cuda/bin/nvcc")
    assert fp8norm_build._with_compiler({}, on) == {compiler: "/opt/cuda/bin/nvcc"}
    # AUTO with a driver: the same, and CMake told of the driver.
    assert fp8norm_build._with_compiler({}, {}, driver_present=lambda: True) == {
        compiler: "/opt/cuda/bin/nvcc",
        DRIVER: "ON",
    }
    # CUDA off, or a compiler the user named: the settings as they are.
    assert fp8norm_build._with_compiler({}, {"FP8NORM_CUDA": "off"}) == {}
    named = {compiler: "/x/nvcc"}
    assert fp8norm_build._with_compiler(named, on) == named
    assert fp8norm_build._with_compiler({}, {**on, "CMAKE_ARGS": "-DCMAKE_CUDA_COMPILER=/y"}) == {}


@pytest.mark.parametrize(
    ("setting", "driver", "wanted"),
    [
        (None, False, False),
        ("auto", False, False),
        (None, True, True),
        ("ON", False, True),
        ("ON", True, True),
        ("OFF", True, False),
    ],
)
def test_auto_builds_cuda_only_beside_a_driver(monkeypatch, setting, driver, wanted):
    # A toolkit alone (nvcc on PATH, no driver: a container, a CI runner) does not make
    # AUTO build the CUDA kernels; ON does, driver or not (wheel builders).
    environ = {} if setting is None else {"FP8NORM_CUDA": setting}
    assert fp8norm_build.cuda_wanted({}, environ, driver_present=lambda: driver) is wanted
    monkeypatch.setattr(fp8norm_build, "system_nvcc", lambda e: "/usr/local/bin/nvcc")
    settings = fp8norm_build._with_compiler({}, environ, driver_present=lambda: driver)
    assert (COMPILER in settings) is wanted
    auto = (setting or "AUTO").upper() == "AUTO"
    assert settings.get(DRIVER) == ({True: "ON", False: "OFF"}[driver] if auto else None)
    assert fp8norm_build.pypi_nvcc_requirements(
        {},
        environ,
        driver_present=lambda: driver,
        find_nvcc=lambda e: None,
        plugin_major=lambda: None,
        driver_major=lambda: 13 if driver else None,
    ) == (NVCC_13 if wanted else [])


def test_cmake_builds_no_cuda_for_auto_without_a_driver():
    # The backend's word reaches CMake's decision: AUTO with FP8NORM_NVIDIA_DRIVER=OFF
    # skips the compiler search, ahead of it.
    text = (REPO / "CMakeLists.txt").read_text()
    skip = text.index('if(_cuda_setting STREQUAL "AUTO" AND _driver STREQUAL "OFF")')
    assert skip < text.index("check_language(CUDA)")
    # The wheel check hides every nvcc and expects CUDA kernels from PyPI's: it forces ON.
    wheel_check = (REPO / "tools" / "checks" / "wheel_check.sh").read_text()
    assert "env FP8NORM_CUDA=ON python -m pip wheel ." in wheel_check


def test_the_lock_is_beside_the_build_folder():
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as f:
        build_dir = tomllib.load(f)["tool"]["scikit-build"]["build-dir"]
    assert build_dir == fp8norm_build.DEFAULT_BUILD_DIR
    key = fp8norm_build.interpreter_key()
    assert fp8norm_build.build_lock_path({}, {}) == Path(f"build/{key}.lock")
    pypi = {"build-dir": fp8norm_build.PYPI_NVCC_BUILD_DIR}
    assert fp8norm_build.build_lock_path(pypi, {}) == Path(f"build/{key}-pypi-nvcc.lock")
    environ = {"SKBUILD_BUILD_DIR": "out/{state}/"}
    assert fp8norm_build.build_lock_path({}, environ) == Path("out/state.lock")
    assert fp8norm_build.build_lock_path({"build-dir": ""}, {"SKBUILD_BUILD_DIR": " "}) is None
    # An empty build-dir given is a temporary folder, whatever the default: no lock.
    assert fp8norm_build.build_lock_path({"build-dir": ""}, {}) is None


def test_the_lock_key_follows_the_interpreter_and_platform(monkeypatch):
    # Builds whose wheel tags differ (a free-threaded or debug build's ABI flags, another
    # platform) use other folders, and so other locks.
    first = fp8norm_build.build_lock_path({}, {})
    monkeypatch.setattr(fp8norm_build.sysconfig, "get_platform", lambda: "other-platform")
    second = fp8norm_build.build_lock_path({}, {})
    monkeypatch.setattr(fp8norm_build.sys, "abiflags", "tdx", raising=False)
    third = fp8norm_build.build_lock_path({}, {})
    monkeypatch.setattr(fp8norm_build.sys.implementation, "cache_tag", "other-314")
    fourth = fp8norm_build.build_lock_path({}, {})
    assert len({first, second, third, fourth}) == 4, (first, second, third, fourth)
    assert "other-platform" in str(second) and "tdx" in str(third) and "other-314" in str(fourth)


@pytest.mark.parametrize("hook", ["build_wheel", "build_editable"])
def test_the_build_holds_the_lock_of_the_folder_it_builds_in(tmp_path, monkeypatch, hook):
    # The folder the compiler choice settled on (the wheels' nvcc: a folder of its own),
    # not the caller's, is locked while scikit-build-core builds.
    import fcntl

    monkeypatch.chdir(tmp_path)
    chosen = {"build-dir": fp8norm_build.PYPI_NVCC_BUILD_DIR, COMPILER: "/wheels/nvcc"}
    monkeypatch.setattr(fp8norm_build, "_with_compiler", lambda settings: dict(chosen))
    held = []

    def build(wheel_directory, settings, metadata_directory=None):
        path = fp8norm_build.build_lock_path(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append((settings, path))
        return "built.whl"

    monkeypatch.setattr(fp8norm_build._scikit_build, hook, build)
    assert getattr(fp8norm_build, hook)(str(tmp_path), {"build-dir": "mine"}) == "built.whl"
    key = fp8norm_build.interpreter_key()
    assert held == [(chosen, Path(f"build/{key}-pypi-nvcc.lock"))]
    with open(held[0][1], "a+") as lock:  # let go once the build returns
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_second_build_of_the_folder_waits_for_the_first(tmp_path):
    # Two builds of one checkout at once: the second waits (and says so) until the first
    # lets go of the folder, instead of building beside it.
    path = tmp_path / "build" / "tag.lock"
    events, said = [], io.StringIO()

    def second():
        with fp8norm_build.build_folder_lock(path, stream=said):
            events.append("second")

    with fp8norm_build.build_folder_lock(path):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and events == []
        assert "another build of this checkout holds" in said.getvalue()
        events.append("first done")
    thread.join(10)
    assert events == ["first done", "second"]
    # Free again, and a temporary folder takes no lock.
    with fp8norm_build.build_folder_lock(path), fp8norm_build.build_folder_lock(None):
        pass


def test_settings_from_cmake_args_and_in_any_case():
    assert fp8norm_build.cuda_setting({}, {"CMAKE_ARGS": "-DA=1 -DFP8NORM_CUDA:STRING=on"}) == "ON"
    assert fp8norm_build.cuda_setting({}, {"FP8NORM_CUDA": "Off"}) == "OFF"
    assert fp8norm_build.cuda_setting({}, {}) == "AUTO"
    # A compiler the user named is a toolkit: nothing to download.
    environ = {"FP8NORM_CUDA": "ON", "CMAKE_ARGS": "-DCMAKE_CUDA_COMPILER=/opt/nvcc"}
    assert (
        fp8norm_build.pypi_nvcc_requirements(
            {},
            environ,
            find_nvcc=lambda e: None,
            plugin_major=lambda: None,
            driver_major=lambda: None,
        )
        == []
    )


def test_the_wheels_library_folder_is_found_under_both_names(tmp_path):
    nvcc = tmp_path / "cu13" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    (tmp_path / "cu13" / "lib").mkdir()
    (tmp_path / "cu13" / "lib" / "libcudart_static.a").write_text("")
    fp8norm_build.complete_layout(str(nvcc))
    assert (tmp_path / "cu13" / "lib64" / "libcudart_static.a").is_file()
    fp8norm_build.complete_layout(str(nvcc))  # already there: left alone
