"""An operator-only install, as the operator image has it: a fresh venv with the project
(without its dependencies) and the operator's pinned requirements and what they need, nothing
else. No torch, numpy or xxhash there; `shoal operator` must still start and reconcile against
the emulator."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from importlib.metadata import distribution
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from packaging.requirements import Requirement

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
NS = "serving"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def operator_closure() -> list[str]:
    """requirements/operator.txt's pins and everything they need (at the versions installed
    here, so pip resolves nothing and takes every wheel from its cache)."""
    pins = {}
    for line in (ROOT / "requirements" / "operator.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_normal(name)] = version
    found: dict[str, str] = {}
    todo = list(pins)
    while todo:
        name = _normal(todo.pop())
        if name in found:
            continue
        dist = distribution(name)
        found[name] = pins.get(name, dist.version)
        for spec in dist.requires or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return [f"{name}=={version}" for name, version in sorted(found.items())]


@pytest.fixture(scope="module")
def operator_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("operator-only")
    # (cwd away from the checkout: its operator/ folder would shadow the stdlib's `operator`)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(work), str(ROOT)], check=True, capture_output=True, cwd=work)
    (wheel,) = work.glob("shoal-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   cwd=work)
    # This pip installs into the new venv: the project without its dependencies (as
    # Dockerfile.operator does) and the operator's requirements, each --no-deps.
    closure = operator_closure()
    assert not {"torch", "numpy", "xxhash"} & {c.split("==")[0] for c in closure}
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "-q", "--no-deps", str(wheel), *closure],
        capture_output=True, text=True, timeout=300, cwd=work)
    assert result.returncode == 0, result.stdout + result.stderr
    check = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                            "check"], capture_output=True, text=True, cwd=work)
    # every installed distribution has what it requires (the shoal wheel aside: it declares
    # the runtime's dependencies, which an operator-only install leaves out on purpose)
    broken = [line for line in check.stdout.splitlines() if not line.startswith("shoal ")]
    assert not broken, check.stdout
    return venv


def test_only_the_operator_requirements_are_installed(operator_venv: Path) -> None:
    python = str(operator_venv / "bin" / "python")
    for module in ("torch", "numpy", "xxhash", "transformers"):
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                               cwd=operator_venv)
        assert found.returncode != 0, f"{module} is importable: not an operator-only install"
    help_text = subprocess.run([str(operator_venv / "bin" / "shoal"), "operator", "--help"],
                               capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0, help_text.stderr
    assert "--kubeconfig" in help_text.stdout
    listing = subprocess.run([str(operator_venv / "bin" / "shoal"), "--help"],
                             capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "operator" in listing.stdout, listing.stderr


async def test_operator_only_install_reconciles(operator_venv: Path, apiserver: SimpleNamespace,
                                                tmp_path: Path) -> None:
    api = apiserver.api
    (await api.post(f"/apis/serving.shoal.dev/v1alpha1/namespaces/{NS}/inferenceservices",
                    json={"apiVersion": "serving.shoal.dev/v1alpha1",
                          "kind": "InferenceService", "metadata": {"name": "m", "namespace": NS},
                          "spec": {"model": {"uri": "hf://org/m"}}})).raise_for_status()
    log = (tmp_path / "operator.log").open("wb")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = subprocess.Popen(
        [str(operator_venv / "bin" / "shoal"), "operator", "--server", apiserver.url,
         "--namespace", NS, "--interval", "1"], stdout=log, stderr=subprocess.STDOUT, env=env,
        cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        status: dict[str, Any] = {}
        while time.monotonic() < deadline and process.poll() is None:
            engine = await api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/m-engine")
            status = (await api.get(f"/apis/serving.shoal.dev/v1alpha1/namespaces/{NS}/"
                                    "inferenceservices/m")).json().get("status") or {}
            if engine.status_code == 200 and status.get("phase") == "Pending":
                break
            await asyncio.sleep(0.5)
        assert status.get("phase") == "Pending", (tmp_path / "operator.log").read_text()[-3000:]
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
