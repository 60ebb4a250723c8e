""".ci/readme_commands.py, which turns the README's set-up section into the script CI runs:
every command a user is told to paste runs, in order, and stops CI when it fails; a block
it cannot run fails CI instead of being skipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / ".ci" / "readme_commands.py"


def _readme(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "README.md"
    path.write_text(f"# project\n\n## Set up\n\n{body}\n## Next\n\ntext\n")
    return path


def _script(readme: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), str(readme)], capture_output=True, text=True, check=False
    )


def _run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, str]:
    made = _script(_readme(tmp_path, body))
    assert made.returncode == 0, made.stderr
    ran = subprocess.run(
        ["bash", "-c", made.stdout], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    log = tmp_path / "log"
    return ran, log.read_text() if log.exists() else ""


def test_blank_lines_comments_and_multi_line_commands_run(tmp_path):
    body = """```bash
echo one >> log

# a comment line between commands
if true; then
  echo two >> log
fi
for i in 3 4; do
  echo "$i" >> log
done
cat >> log <<'EOF'
five
EOF
echo six \\
  seven >> log
```

More text, then a second block:

```bash
echo eight >> log
```
"""
    ran, log = _run(tmp_path, body)
    assert ran.returncode == 0, ran.stderr
    assert log.split() == ["one", "two", "3", "4", "five", "six", "seven", "eight"]


def test_a_failing_command_stops_the_script(tmp_path):
    body = """```bash
echo one >> log
false && echo never >> log
echo after >> log
```
"""
    ran, log = _run(tmp_path, body)
    assert ran.returncode == 1
    assert log.split() == ["one"]


@pytest.mark.parametrize(
    "block",
    [
        "```sh\necho skipped\n```\n",
        "```console\n$ echo skipped\n```\n",
        "  ```bash\n  echo skipped\n  ```\n",
        "```\necho skipped\n```\n",
        "```bash\necho never closed\n",
        "```bash\nif true; then\n  echo no fi\n```\n",
    ],
    ids=["sh", "console", "indented", "no-language", "unclosed", "unparsable"],
)
def test_a_block_ci_cannot_run_fails(tmp_path, block):
    made = _script(_readme(tmp_path, "```bash\necho ok\n```\n\n" + block))
    assert made.returncode != 0
    assert "readme_commands:" in made.stderr


def test_the_readme_itself_makes_a_script():
    made = _script(ROOT / "README.md")
    assert made.returncode == 0, made.stderr
    assert "pytest" in made.stdout and "python -m pip install ." in made.stdout
