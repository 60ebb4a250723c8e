"""The shared libraries a wheel's compiled modules need (tools/checks/wheel_check.sh, and
tests/test_packaging.py on the installed modules): each ELF file's NEEDED entries must be
glibc's, libstdc++'s, libgcc_s's, the CUDA driver's (libcuda.so.1, which the NVIDIA driver
installs) or another file of the wheel, and it may carry no RPATH or RUNPATH but $ORIGIN:
no CUDA runtime or other toolkit library, no libpython, no folder of the build machine.

    python tools/checks/wheel_libraries.py FOLDER_OR_FILE...

prints each file's NEEDED entries and exits 1 naming every one that is not allowed (and 2
when the paths hold no shared library at all). Reads the ELF dynamic section itself, so
that it needs neither binutils nor auditwheel."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

# glibc's libraries (the manylinux policies' list) and its dynamic loaders.
GLIBC = frozenset(
    {
        "libc.so.6",
        "libm.so.6",
        "libdl.so.2",
        "librt.so.1",
        "libpthread.so.0",
        "libresolv.so.2",
        "libutil.so.1",
        "ld-linux-x86-64.so.2",
        "ld-linux-aarch64.so.1",
    }
)
ALLOWED = GLIBC | {"libstdc++.so.6", "libgcc_s.so.1", "libcuda.so.1"}
ALLOWED_PATHS = frozenset({"$ORIGIN", "${ORIGIN}"})

_SHT_DYNAMIC, _DT_NULL, _DT_NEEDED, _DT_RPATH, _DT_RUNPATH = 6, 0, 1, 15, 29


def dynamic_entries(path) -> tuple[list[str], list[str]]:
    """(NEEDED entries, RPATH and RUNPATH folders) of the ELF file ``path``."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path} is not an ELF file")
    wide, endian = data[4] == 2, "<" if data[5] == 1 else ">"
    if wide:
        (shoff,) = struct.unpack_from(endian + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(endian + "HH", data, 0x3A)
        header, entry = endian + "IIQQQQIIQQ", endian + "qQ"
    else:
        (shoff,) = struct.unpack_from(endian + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(endian + "HH", data, 0x2E)
        header, entry = endian + "IIIIIIIIII", endian + "iI"
    # Section header fields: name, type, flags, addr, offset, size, link, ...
    sections = [struct.unpack_from(header, data, shoff + i * shentsize) for i in range(shnum)]
    if not any(section[1] == _SHT_DYNAMIC for section in sections):
        # Stripped section headers (or a static file) would hide every NEEDED entry.
        raise ValueError(f"{path} has no dynamic section that this check can read")
    needed, folders = [], []
    for section in sections:
        if section[1] != _SHT_DYNAMIC:
            continue
        strtab = sections[section[6]]
        strings = data[strtab[4] : strtab[4] + strtab[5]]
        size = struct.calcsize(entry)
        for offset in range(section[4], section[4] + section[5], size):
            tag, value = struct.unpack_from(entry, data, offset)
            if tag == _DT_NULL:
                break
            if tag not in (_DT_NEEDED, _DT_RPATH, _DT_RUNPATH):
                continue
            text = strings[value : strings.index(b"\0", value)].decode()
            if tag == _DT_NEEDED:
                needed.append(text)
            else:
                folders.extend(text.split(":"))
    return needed, folders


def problems(libraries: dict) -> list[str]:
    """``libraries``: path -> (NEEDED entries, RPATH and RUNPATH folders). What is not
    allowed, one line per file and kind; a file of ``libraries`` may need another."""
    # The package's own modules only: a bundled library of the toolkit (a libcudart beside
    # them) is what the rule forbids, wherever it sits.
    own = {Path(path).name for path in libraries if Path(path).name.startswith("_fp8norm_")}
    found = []
    for path, (needed, folders) in libraries.items():
        outside = [name for name in needed if name not in ALLOWED and name not in own]
        if outside:
            found.append(
                f"{path} needs {outside}: a wheel's module may need only glibc, libstdc++, "
                "libgcc_s and the CUDA driver's libcuda.so.1"
            )
        paths = [folder for folder in folders if folder not in ALLOWED_PATHS]
        if paths:
            found.append(f"{path} has RPATH / RUNPATH {paths}: only $ORIGIN is allowed")
    return found


def shared_libraries(paths) -> list[Path]:
    """The ELF shared libraries among ``paths`` and in the folders among them."""
    files = []
    for path in map(Path, paths):
        candidates = sorted(path.rglob("*")) if path.is_dir() else [path]
        for candidate in candidates:
            name = candidate.name
            if candidate.is_file() and (name.endswith(".so") or ".so." in name):
                with open(candidate, "rb") as f:
                    if f.read(4) == b"\x7fELF":
                        files.append(candidate)
    return files


def main(argv: list[str]) -> int:
    files = shared_libraries(argv)
    if not files:
        print(f"wheel_libraries: no shared library in {argv}", file=sys.stderr)
        return 2
    libraries = {str(f): dynamic_entries(f) for f in files}
    for path, (needed, folders) in libraries.items():
        print(f"{Path(path).name}: needs {needed}" + (f", RUNPATH {folders}" if folders else ""))
    found = problems(libraries)
    for line in found:
        print(f"wheel_libraries: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
