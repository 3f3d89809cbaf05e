"""Namespaced imports work from a wheel, not only from the editable checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shoal.kernels import native_cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True, capture_output=True,
    )
    (found,) = out.glob("shoal-*.whl")
    return found


def test_wheel_contains_only_namespaced_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/", 1)[0] for name in names if "/" in name}
    assert {n for n in top_level if not n.endswith(".dist-info")} == {"shoal"}
    for package in ("runtime", "operator", "kernels"):
        assert f"shoal/{package}/__init__.py" in names
    for source in native_cpu.SOURCES:  # compiled on first use
        assert f"shoal/kernels/{source.name}" in names


def test_wheel_install_imports_namespaced_and_keeps_stdlib_operator(
    wheel: Path, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True,
    )
    probe = (
        "import operator, shoal, shoal.runtime, shoal.operator, shoal.kernels, "
        "shoal.runtime.kv.block_hash;"
        "assert operator.add(2, 3) == 5;"
        "print(shoal.runtime.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(target))
