"""An operator-only install, as the operator image has it: a fresh venv with the project
(without its dependencies) and the operator's pinned requirements only. No torch, numpy or
xxhash there; `shoal operator` must still start and reconcile against the emulator."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
NS = "serving"


@pytest.fixture(scope="module")
def operator_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("operator-only")
    # (cwd away from the checkout: its operator/ folder would shadow the stdlib's `operator`)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(work), str(ROOT)], check=True, capture_output=True, cwd=work)
    (wheel,) = work.glob("shoal-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, cwd=work)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # The same two steps as Dockerfile.operator (pip's cache makes the second quick here).
    for step in (["-r", str(ROOT / "requirements" / "operator.txt")], ["--no-deps", str(wheel)]):
        result = subprocess.run([*pip, *step], capture_output=True, text=True, timeout=300,
                                cwd=work)
        assert result.returncode == 0, result.stdout + result.stderr
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
