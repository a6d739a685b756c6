"""The lint `make test` runs passes in a checkout as the README's two commands leave it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_lint_passes_after_the_demo_left_its_runs_directory(tmp_path):
    """Issue 27, defect 15: `make demo && make test` failed at `ruff check`: with the demo's runs/ at the root,
    isort took the tests' helper module `runs` for a first-party package and wanted 13 imports moved."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "runs" / "20261201-120000" / "checkpoints").mkdir(parents=True)  # what `make demo` leaves
    ruff = Path(sys.executable).parent / "ruff"
    done = subprocess.run([ruff, "check", "--no-cache", "."], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
