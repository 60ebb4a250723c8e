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
    for line in block.strip().splitlines():
        print(f"echo {shlex.quote('$ ' + line)}")
        print(line)
