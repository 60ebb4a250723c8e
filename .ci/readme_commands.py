"""Prints the README's set-up commands as one bash script: every ```bash block of the
"## Set up" section, in order, each command echoed before it runs. The README stays the
one place where those commands are written; CI runs them exactly as a user pastes them,
and prints how long each took.

A command is as many lines as bash needs to parse it whole (an `if ... fi`, a loop, a
heredoc, a backslash continuation); blank and comment-only lines between commands are
skipped. Any other fence in the section (```sh, ```console, an indented or unclosed
fence) is an error: CI must not pass while skipping a command a user is told to run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path


def fail(message: str) -> None:
    sys.exit(f"readme_commands: {message}")


def set_up_section(readme: str) -> str:
    section = re.search(r"^## Set up\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    if section is None:
        fail("the README has no '## Set up' section")
    return section.group(1)


def bash_blocks(section: str) -> list[list[str]]:
    """The lines of each ```bash block; any other fence is an error."""
    blocks, current = [], None
    for number, line in enumerate(section.splitlines(), 1):
        fence = re.match(r"^(\s*)(```|~~~)(.*)$", line)
        if current is not None:
            if fence and fence.group(3).strip() == "" and fence.group(1) == "":
                blocks.append(current)
                current = None
            elif fence:
                fail(f"line {number} of '## Set up': a fence inside a block: {line!r}")
            else:
                current.append(line)
        elif fence:
            if fence.group(1) or fence.group(2) != "```" or fence.group(3).strip() != "bash":
                fail(
                    f"line {number} of '## Set up' opens a block CI would not run ({line!r}):"
                    " write set-up commands in ```bash blocks at the start of a line"
                )
            current = []
    if current is not None:
        fail("a ```bash block of '## Set up' is never closed")
    if not blocks:
        fail("the README's '## Set up' section has no ```bash block")
    return blocks


def parses_whole(text: str) -> bool:
    if text.rstrip().endswith("\\"):
        return False
    result = subprocess.run(["bash", "-n"], input=text + "\n", capture_output=True, text=True)
    # An open heredoc parses with only a warning ("delimited by end-of-file").
    return result.returncode == 0 and not result.stderr.strip()


def commands(block: list[str]) -> list[str]:
    """The block's complete commands, in order."""
    out, pending = [], []
    for line in block:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending.append(line)
        text = "\n".join(pending)
        if parses_whole(text):
            out.append(text)
            pending = []
    if pending:
        fail(f"a command of '## Set up' does not parse as bash: {chr(10).join(pending)!r}")
    return out


def script(readme: str) -> str:
    lines = ["set -euo pipefail"]
    for block in bash_blocks(set_up_section(readme)):
        for command in commands(block):
            # Each command runs in a group that exits on failure: `set -e` alone would not
            # stop at a failing `pip install .` in `pip install . && python -m jax_fp8norm`,
            # only at the last command of such a list.
            lines.append(f"echo {shlex.quote('$ ' + command)}")
            lines.append("started=$SECONDS")
            lines.append(f"{{ {command}\n}} || exit $?")
            lines.append('echo "(took $((SECONDS - started)) s)"')
    return "\n".join(lines)


if __name__ == "__main__":
    print(script(Path(sys.argv[1] if len(sys.argv) > 1 else "README.md").read_text()))
