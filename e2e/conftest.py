"""Fixtures for the end-to-end suite: a reachable cluster and its tools, or a clear skip."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@dataclass(frozen=True)
class Cluster:
    kubectl: str
    helm: str
    operator_image: str
    runtime_image: str

    def run(self, *args: str, input_text: str | None = None, check: bool = True,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
        tool = self.helm if args[0] == "helm" else self.kubectl
        result = subprocess.run([tool, *args[1:]], input=input_text, capture_output=True,
                                text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result


def _tool(name: str) -> str | None:
    override = os.environ.get(f"SHOAL_{name.upper()}")
    return override or shutil.which(name)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    kubectl, helm = _tool("kubectl"), _tool("helm")
    if kubectl is None or helm is None:
        pytest.skip("e2e needs kubectl and helm on PATH (or SHOAL_KUBECTL / SHOAL_HELM)")
    probe = subprocess.run([kubectl, "version", "--request-timeout=5s", "-o", "json"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or '"serverVersion"' not in probe.stdout:
        pytest.skip("no Kubernetes cluster reachable with the current kubeconfig "
                    f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no server'});"
                    " run e2e/run.sh to create a kind cluster")
    return Cluster(
        kubectl=kubectl, helm=helm,
        operator_image=os.environ.get("SHOAL_OPERATOR_IMAGE",
                                      "ghcr.io/shoal-dev/shoal-operator:0.1.0"),
        runtime_image=os.environ.get("SHOAL_RUNTIME_IMAGE",
                                     "ghcr.io/shoal-dev/shoal-runtime:0.1.0-cpu"),
    )
