"""The whole tree passes `ruff check` under pyproject.toml's configuration (line length 120; pycodestyle,
pyflakes, isort, pyupgrade and bugbear rules)."""

import subprocess
import sys
from pathlib import Path

from mlxpaged.testing.slowness import wall

REPO = Path(__file__).resolve().parent.parent


def test_ruff_check_is_clean():
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True, timeout=wall(300)
    )
    assert r.returncode == 0, f"ruff check . failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
