"""README's two commands are the ones CI runs: the test command of README is .ci/run's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_test_command_is_what_ci_runs():
    demo, tests = readme_commands()
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert " && ".join(ci) == tests
    assert demo.startswith(". .ci/install && airay run jobs/")
    assert (ROOT / demo.split()[-1]).is_file()


def test_install_script_makes_a_venv_instead_of_touching_a_system_python():
    script = (ROOT / ".ci/install").read_text()
    # Sourced from the README, it must not leave `set -e` in the user's shell.
    assert not re.search(r"^set -", script, re.M)
    assert "python3 -m venv .venv" in script and ".venv/bin/activate" in script
