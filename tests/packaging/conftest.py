"""Fixtures for the packaging tests: helm/kubectl (shared with tests/k8s) and chart rendering."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "shoal"


def _k8s_conftest() -> ModuleType:
    """tests/k8s/conftest.py owns the helm/kubectl extraction; reuse it rather than copy it."""
    name = "shoal_k8s_conftest_for_packaging"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "k8s" / "conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


k8s_tools = _k8s_conftest().k8s_tools


def _set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


@pytest.fixture(scope="session")
def helm(k8s_tools: SimpleNamespace) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run helm offline (no kube context needed for lint, template, install --dry-run=client)."""

    def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
        return subprocess.run([k8s_tools.helm, *args], cwd=cwd, capture_output=True, text=True,
                              timeout=120)

    return run


@pytest.fixture(scope="session")
def render_chart(helm: Callable[..., subprocess.CompletedProcess[str]]
                 ) -> Callable[..., list[dict[str, Any]]]:
    """`helm template` with --set values -> the rendered objects (empty documents dropped)."""

    def render(values: dict[str, str] | None = None, namespace: str = "shoal-system"
               ) -> list[dict[str, Any]]:
        result = helm("template", "shoal", str(CHART), "--namespace", namespace,
                      *_set_args(values or {}))
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return render
