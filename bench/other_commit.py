"""Another commit's code, importable beside this checkout's: for benchmarks that compare
before and after in one run (interleaved, so a change in the shared machine's load hits both).

``checkout(ref)`` extracts the commit's tree (``git archive``) into a temporary folder and
lays out ``shoal`` there as the editable install maps it (runtime/ as shoal.runtime, ...);
``env(path)`` is the environment a subprocess needs to import that ``shoal`` instead of ours
(a regular package on PYTHONPATH is found before the editable finder).
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# setup.py's ROOTS: subpackage name under shoal -> top-level folder
SUBPACKAGES = ("runtime", "operator", "kernels")  # kernels: a top-level folder before 2026-12-03


def checkout(ref: str, into: Path | None = None) -> Path:
    """The tree of ``ref`` in a new folder (under ``into`` or a temporary one); returns it."""
    root = Path(into or tempfile.mkdtemp(prefix="shoal-ref-"))
    tree = root / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref],
                             check=True, capture_output=True).stdout
    archive_path = root / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(tree, filter="data")
    package = root / "pkg" / "shoal"
    package.parent.mkdir()
    os.symlink(tree / "shoal", package, target_is_directory=True)
    for name in SUBPACKAGES:
        if not (tree / "shoal" / name).exists():
            os.symlink(tree / name, tree / "shoal" / name, target_is_directory=True)
    return root


def env(root: Path) -> dict[str, str]:
    """os.environ with PYTHONPATH set so ``import shoal`` finds the checkout at ``root``."""
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root / "pkg"), environ.get("PYTHONPATH", "")) if p)
    return environ


def script(root: Path, relative: str) -> Path:
    """A file of the checked-out tree (its own version of a benchmark script)."""
    return root / "tree" / relative
