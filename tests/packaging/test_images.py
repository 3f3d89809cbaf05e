"""The container images: linted, and installing exactly what pyproject.toml declares."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not pinned with =="
            pins[_normalise(name)] = version
    return pins


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(specs: list[str]) -> dict[str, Requirement]:
    reqs = (Requirement(spec) for spec in specs)
    return {_normalise(r.name): r for r in reqs}


@pytest.mark.parametrize("dockerfile", ["Dockerfile.runtime", "Dockerfile.operator"])
def test_dockerfile_passes_hadolint(dockerfile: str) -> None:
    result = subprocess.run([HADOLINT, str(ROOT / dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("pins_file", "declared"),
    [
        ("requirements/runtime.txt", lambda p: p["project"]["dependencies"]),
        ("requirements/operator.txt", lambda p: p["project"]["optional-dependencies"]["operator"]),
    ],
)
def test_image_requirements_match_pyproject(pins_file: str, declared) -> None:
    wanted = _requirements(declared(_pyproject()))
    wanted.pop("torch", None)  # installed on its own layer, from the index matching the base image
    pins = _pins(ROOT / pins_file)
    assert set(pins) == set(wanted), (
        f"{pins_file} drifted from pyproject.toml: missing {sorted(set(wanted) - set(pins))}, "
        f"extra {sorted(set(pins) - set(wanted))}"
    )
    for name, version in pins.items():
        assert wanted[name].specifier.contains(version), (
            f"{pins_file}: {name}=={version} does not satisfy pyproject's {wanted[name]}"
        )


def test_runtime_image_torch_satisfies_pyproject() -> None:
    torch_req = _requirements(_pyproject()["project"]["dependencies"])["torch"]
    dockerfile = (ROOT / "Dockerfile.runtime").read_text()
    versions = re.findall(r'TORCH_SPEC="torch==([\w.]+)"', dockerfile)
    assert versions, "Dockerfile.runtime pins no torch"
    for version in versions:
        assert torch_req.specifier.contains(version), f"torch=={version} vs {torch_req}"


def test_images_install_the_project_without_resolving_dependencies_again() -> None:
    for name in ("Dockerfile.runtime", "Dockerfile.operator"):
        text = (ROOT / name).read_text()
        deps_at = text.index("requirements/")
        project_at = text.index("pip install --no-deps .")
        # dependency layer first, so a code change does not reinstall dependencies
        assert deps_at < text.index("COPY runtime") < project_at
        assert "USER 10001" in text and "HEALTHCHECK" not in text.replace("No HEALTHCHECK", "")
