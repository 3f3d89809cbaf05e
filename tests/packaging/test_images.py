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


def _arg_default(dockerfile: str, name: str) -> str:
    found = re.findall(rf"^ARG {name}=(\S*)$", (ROOT / dockerfile).read_text(), re.MULTILINE)
    assert len(found) == 1, f"{dockerfile}: ARG {name} declared {len(found)} times"
    return found[0].strip('"')


def test_runtime_image_pins_the_torch_the_tests_run() -> None:
    version = _arg_default("Dockerfile.runtime", "TORCH_VERSION")
    torch_req = _requirements(_pyproject()["project"]["dependencies"])["torch"]
    assert torch_req.specifier.contains(version), f"torch=={version} vs {torch_req}"
    makefile_pin = re.search(r"^TORCH\s*:=\s*torch==(\S+)$", (ROOT / "Makefile").read_text(),
                             re.MULTILINE)
    assert makefile_pin is not None and makefile_pin.group(1) == version, (
        "the image's torch differs from the one `make setup` installs (and the tests run)")
    text = (ROOT / "Dockerfile.runtime").read_text()
    assert '"torch==${TORCH_VERSION}"' in text


def test_base_images_and_torch_source_are_build_args() -> None:
    assert _arg_default("Dockerfile.operator", "BASE_IMAGE")
    for name in ("VARIANT", "CUDA_IMAGE", "CPU_IMAGE", "TORCH_INDEX_URL", "TORCH_FIND_LINKS"):
        _arg_default("Dockerfile.runtime", name)


def test_cuda_variant_brings_what_triton_and_flashinfer_need_at_run_time() -> None:
    text = (ROOT / "Dockerfile.runtime").read_text()
    cuda = text[text.index("AS base-cuda"):text.index("AS base-cpu")]
    # Triton compiles its C launcher at the first kernel launch: a compiler and Python.h.
    for package in ("gcc", "libc6-dev", "python3.12-dev"):
        assert package in cuda, package
    # flashinfer's prebuilt kernels at exactly flashinfer-python's version (no nvcc at startup).
    assert re.search(r'FLASHINFER_VERSION="\d+\.\d+\.\d+', cuda)
    for package in ("flashinfer-python[cu13]", "flashinfer-cubin", "flashinfer-jit-cache"):
        assert f'"{package}==${{FLASHINFER_VERSION}}"' in text, package


def test_dockerignore_sends_only_what_the_images_install() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "allowlist: everything is excluded first"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for name in ("Dockerfile.runtime", "Dockerfile.operator"):
        for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", (ROOT / name).read_text(),
                                 re.MULTILINE):
            copied.update(part.split("/")[0] for part in source.split())
    assert copied <= allowed | {"requirements"}, copied - allowed
    assert not {".venv", ".git", "tests", "bench"} & allowed


def test_make_has_image_targets_outside_the_default_test_run() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^images:", makefile, re.MULTILINE)
    assert re.search(r"^image-test:", makefile, re.MULTILINE)
    assert "tests/k8s/images_check.py" in makefile
    # not collected by `pytest` (make test): the file name is not test_*.py
    assert not (ROOT / "tests" / "k8s" / "images_check.py").name.startswith("test_")


def test_images_install_the_project_without_resolving_dependencies_again() -> None:
    for name in ("Dockerfile.runtime", "Dockerfile.operator"):
        text = (ROOT / name).read_text()
        deps_at = text.index("requirements/")
        project_at = text.index("pip install --no-deps /src")
        # dependency layer first, so a code change does not reinstall dependencies
        assert deps_at < text.index("COPY runtime") < project_at
        assert "USER 10001" in text and "HEALTHCHECK" not in text.replace("No HEALTHCHECK", "")
