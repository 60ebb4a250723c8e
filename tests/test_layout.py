"""docs/layout.md against the tree: every source file of the package, the C++, the tests
and the tools is named there, and every file it names exists."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"
# The folders whose every file the page names (not their subfolders: those are listed
# on their own or named as a whole).
FOLDERS = (
    "jax_fp8norm",
    "jax_fp8norm/bench",
    "jax_fp8norm/examples",
    "src/common",
    "src/cpu",
    "src/cuda",
    "src/simt",
    "src/simt/include",
    "tests",
    "tests/children",
    "tests/simt",
    "tests/cpu",
    "tools",
    "tools/checks",
    "tools/mutants",
    "tools/reports",
    "tools/gpu",
    "cmake",
    "docs",
    "benchmarks",
)
# Files a folder holds for its tools, not for a reader of the layout.
UNNAMED = {"__init__.py", "py.typed", "requirements.txt", "CMakeLists.txt", "README.md"}
FILE_NAME = re.compile(r"^[\w*./-]+\.(?:py|h|cc|cu|cuh|inc|cmake|sh|md|txt|png)$")


def layout_section() -> str:
    return LAYOUT.read_text()


def expand(token: str) -> list[str]:
    """``ffi_decode.{h,cc}`` -> ``ffi_decode.h``, ``ffi_decode.cc``."""
    braces = re.search(r"\{([^}]*)\}", token)
    if braces is None:
        return [token]
    head, tail = token[: braces.start()], token[braces.end() :]
    return [name for part in braces.group(1).split(",") for name in expand(head + part + tail)]


def named_files() -> list[str]:
    tokens = re.findall(r"`([^`\s]+)`", layout_section())
    return [name for token in tokens for name in expand(token) if FILE_NAME.match(name)]


def _matches(path: Path, name: str) -> bool:
    relative = path.relative_to(ROOT).as_posix()
    return (
        fnmatch.fnmatch(path.name, name)
        or fnmatch.fnmatch(relative, name)
        or (relative.endswith("/" + name))
    )


def test_every_source_file_is_named():
    names = named_files()
    unnamed = [
        path.relative_to(ROOT).as_posix()
        for folder in FOLDERS
        for path in sorted((ROOT / folder).iterdir())
        if path.is_file() and path.name not in UNNAMED and not path.name.startswith(".")
        if not any(_matches(path, name) for name in names)
    ]
    assert not unnamed, f"docs/layout.md does not name {unnamed}"


def test_every_named_file_exists():
    tree = [
        path
        for path in ROOT.rglob("*")
        if path.is_file() and not {"build", ".git"} & set(path.relative_to(ROOT).parts)
    ]
    missing = [name for name in named_files() if not any(_matches(p, name) for p in tree)]
    assert not missing, f"docs/layout.md names files that do not exist: {missing}"
