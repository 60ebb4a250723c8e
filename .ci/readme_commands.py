"""Prints the README's set-up commands as one bash script: every ```bash block of the
"## Set up" section, in order, each echoed before it runs. The README stays the one place
where those commands are written; CI runs them exactly as a user pastes them."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

readme = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md").read_text()
section = re.search(r"^## Set up\n(.*?)(?=^## )", readme, re.S | re.M)
if section is None:
    sys.exit("README.md has no '## Set up' section")
blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
if not blocks:
    sys.exit("README.md's '## Set up' section has no ```bash block")
print("set -euo pipefail")
for block in blocks:
    # One command per line, backslash continuations joined. Each runs in a group that
    # exits on failure: `set -e` alone would not stop at a failing `pip install .` in
    # `pip install . && python -m jax_fp8norm`, only at the last command of such a list.
    for command in block.replace("\\\n", " ").strip().splitlines():
        print(f"echo {shlex.quote('$ ' + command)}")
        print(f"{{ {command}\n}} || exit $?")
