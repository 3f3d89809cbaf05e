"""No file of the project names a path of one machine (a developer's checkout, a shared venv):
a fresh clone elsewhere has none of them. Tools that need another install take its path as
an argument (bench/*_vllm_check.py: VLLM_VENV)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MACHINE_PATHS = ["/work/", "/root/.cache/"]


def test_no_tracked_file_names_a_machine_path() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are not known")
    args = [arg for path in MACHINE_PATHS for arg in ("-e", path)]
    found = subprocess.run(["git", "grep", "-n", "-F", *args, "--", ".",
                            ":!tests/packaging/test_no_machine_paths.py"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert found.returncode == 1, found.stdout[:4000]  # 1: nothing matched
