"""`shoal operator` flags and credentials loading (no cluster needed)."""

from __future__ import annotations

import argparse
import base64
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from shoal.operator.cli import register
from shoal.operator.kube import KINDS
from shoal.operator.kubeconfig import KubeConfigError, from_kubeconfig, load_access


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["operator", *argv])


def test_flags() -> None:
    args = parse("-n", "ml", "-n", "research", "--interval", "2", "--server", "http://x:1")
    assert args.namespace == ["ml", "research"] and args.interval == 2.0
    assert parse().namespace == []  # default: all namespaces
    with pytest.raises(SystemExit):
        parse("-n", "ml", "--all-namespaces")


def test_operator_entry_point_does_not_import_torch() -> None:
    code = ("import sys, shoal.operator.cli, shoal.operator.handlers, shoal.operator.reconcile;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("command", [["shoal", "operator"], ["-m", "shoal.operator"]],
                         ids=["console-script", "module"])
def test_help(command: list[str]) -> None:
    argv = [str(Path(sys.executable).with_name("shoal")), *command[1:]] \
        if command[0] == "shoal" else [sys.executable, *command]
    out = subprocess.run([*argv, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--namespace" in out and "--liveness" in out


def write_kubeconfig(tmp_path: Path, user: dict[str, object]) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u",
                                                  "namespace": "ml"}}],
        "clusters": [{"name": "c", "cluster": {
            "server": "https://10.0.0.1:6443/",
            "certificate-authority-data": base64.b64encode(b"CA PEM").decode()}}],
        "users": [{"name": "u", "user": user}],
    }
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(config))
    return path


def test_kubeconfig_with_token(tmp_path: Path) -> None:
    access = from_kubeconfig(write_kubeconfig(tmp_path, {"token": "abc"}))
    assert access.server == "https://10.0.0.1:6443"
    assert access.token == "abc" and access.default_namespace == "ml"
    assert access.ca_path is not None and Path(access.ca_path).read_bytes() == b"CA PEM"


def test_kubeconfig_with_client_certificate_files(tmp_path: Path) -> None:
    access = from_kubeconfig(write_kubeconfig(tmp_path, {"client-certificate": "c.pem",
                                                         "client-key": "k.pem"}))
    assert access.cert_path == str(tmp_path / "c.pem")
    assert access.key_path == str(tmp_path / "k.pem")


def test_exec_plugins_and_missing_contexts_are_clear_errors(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path, {"exec": {"command": "aws"}})
    with pytest.raises(KubeConfigError, match="exec"):
        from_kubeconfig(path)
    with pytest.raises(KubeConfigError, match="context 'prod' not found"):
        from_kubeconfig(path, context="prod")


def test_explicit_server_wins(tmp_path: Path) -> None:
    access = load_access(server="http://127.0.0.1:8001/")
    assert access.server == "http://127.0.0.1:8001" and access.token is None
    with pytest.raises(KubeConfigError, match="no Kubernetes credentials"):
        load_access(kubeconfig=str(tmp_path / "missing"))


def test_api_paths() -> None:
    assert KINDS[("v1", "Pod")].path("ml", "p", "status") == "/api/v1/namespaces/ml/pods/p/status"
    assert KINDS[("apps/v1", "Deployment")].path("ml") == "/apis/apps/v1/namespaces/ml/deployments"
