"""`shoal operator` flags, and how its credentials load and refresh (no API server needed)."""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from shoal.operator.cli import register
from shoal.operator.kube.credentials import (
    CredentialsError,
    ExecPlugin,
    TokenFile,
    connection_info,
    jwt_expiry,
    load_credentials,
    split_authorization,
)


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
    code = ("import sys, shoal.operator.cli, shoal.operator.loop.handlers, shoal.operator.loop.reconcile;"
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


def kubeconfig(path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None,
               **top: Any) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u",
                                                  "namespace": "ml"}}],
        "clusters": [{"name": "c", "cluster": cluster or {
            "server": "https://10.0.0.1:6443/",
            "certificate-authority-data": base64.b64encode(b"CA PEM").decode()}}],
        "users": [{"name": "u", "user": user}],
        **top,
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def test_kubeconfig_with_token_and_inline_ca(tmp_path: Path) -> None:
    creds = await load_credentials(kubeconfig=str(kubeconfig(tmp_path / "c", {"token": "abc"})))
    config = creds.configuration
    assert config.host == "https://10.0.0.1:6443" and creds.default_namespace == "ml"
    assert Path(config.ssl_ca_cert).read_bytes() == b"CA PEM"
    assert await creds.authorization() == "Bearer abc"
    info = await connection_info(creds, refresh=False)
    assert (info.server, info.scheme, info.token, info.insecure) == (
        "https://10.0.0.1:6443", "Bearer", "abc", False)
    assert info.ca_path == config.ssl_ca_cert and info.default_namespace == "ml"


@pytest.mark.parametrize("with_ca", [True, False], ids=["with-ca", "without-ca"])
async def test_kubeconfig_with_client_certificate(tmp_path: Path, with_ca: bool) -> None:
    (tmp_path / "c.pem").write_text("CERT")
    (tmp_path / "k.pem").write_text("KEY")
    cluster: dict[str, Any] = {"server": "https://10.0.0.1:6443"}
    if with_ca:
        (tmp_path / "ca.pem").write_text("CA")
        cluster["certificate-authority"] = "ca.pem"  # relative to the kubeconfig's folder
    else:
        cluster["insecure-skip-tls-verify"] = True
    path = kubeconfig(tmp_path / "config", {"client-certificate": "c.pem",
                                            "client-key": "k.pem"}, cluster)
    info = await connection_info(await load_credentials(kubeconfig=str(path)), refresh=False)
    assert (info.certificate_path, info.private_key_path) == (
        str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    assert info.token is None
    assert info.ca_path == (str(tmp_path / "ca.pem") if with_ca else None)
    assert info.insecure is (not with_ca)


async def test_kubeconfig_files_are_merged_like_kubectl(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The first file names the context; the user lives only in the second.
    first = kubeconfig(tmp_path / "a", {"token": "from-a"})
    second = tmp_path / "b"
    second.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "contexts": [{"name": "prod", "context": {"cluster": "c", "user": "p"}}],
        "users": [{"name": "u", "user": {"token": "ignored: a's u wins"}},
                  {"name": "p", "user": {"token": "from-b"}}]}))
    monkeypatch.setenv("KUBECONFIG", f"{first}{os.pathsep}{second}")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert await (await load_credentials()).authorization() == "Bearer from-a"
    prod = await load_credentials(context="prod")
    assert await prod.authorization() == "Bearer from-b" and prod.default_namespace is None


async def test_missing_contexts_and_credentials_are_clear_errors(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "c", {"token": "abc"})
    with pytest.raises(CredentialsError, match="context 'prod' not found"):
        await load_credentials(kubeconfig=str(path), context="prod")
    with pytest.raises(CredentialsError, match="no Kubernetes credentials"):
        await load_credentials(kubeconfig=str(tmp_path / "missing"))


async def test_explicit_server_has_no_credentials() -> None:
    creds = await load_credentials(server="http://127.0.0.1:8001/")
    assert creds.configuration.host == "http://127.0.0.1:8001"
    assert await creds.authorization() is None


async def test_exec_plugin_runs_once_and_again_when_forced(tmp_path: Path,
                                                           exec_plugin: SimpleNamespace) -> None:
    creds = await load_credentials(kubeconfig=str(kubeconfig(tmp_path / "c", exec_plugin.user)))
    assert isinstance(creds.source, ExecPlugin)
    for _ in range(3):  # no expirationTimestamp: cached, not re-run per request
        assert await creds.authorization() == "Bearer exec-token-1"
    info = await connection_info(creds, refresh=True)  # kopf's re-login after a 401
    assert info.token == "exec-token-2" and exec_plugin.issued() == [
        "exec-token-1", "exec-token-2"]
    assert await creds.authorization() == "Bearer exec-token-2"


async def test_in_cluster_token_is_re_read_when_the_file_is_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("first")
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "namespace").write_text("serving\n")
    monkeypatch.setenv("SHOAL_SERVICE_ACCOUNT_DIR", str(tmp_path))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    creds = await load_credentials()
    assert isinstance(creds.source, TokenFile)
    assert creds.configuration.host == "https://[fd00::1]:443"
    assert creds.default_namespace == "serving"
    assert await creds.authorization() == "Bearer first"
    # The kubelet writes the new token beside the old and swaps it in.
    (tmp_path / "token.new").write_text("second")
    os.replace(tmp_path / "token.new", tmp_path / "token")
    assert await creds.authorization() == "Bearer second"


def test_jwt_expiry_and_authorization_headers() -> None:
    claims = base64.urlsafe_b64encode(json.dumps({"exp": 1_900_000_000}).encode()).decode()
    assert jwt_expiry(f"h.{claims.rstrip('=')}.sig") == datetime.fromtimestamp(
        1_900_000_000, UTC)
    assert jwt_expiry("opaque-token") is None and jwt_expiry("a.!!.c") is None
    assert split_authorization("Bearer abc") == ("Bearer", "abc")
    assert split_authorization("abc") == (None, "abc")
    assert split_authorization(None) == (None, None)


def test_subcommand_listing_matches_each_subcommands_help() -> None:
    from shoal.cli import SUBCOMMANDS, build_parser, chosen_command

    full = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    shown = {c.dest: c.help for c in full._choices_actions}
    assert shown == {name: summary for name, (_, summary) in SUBCOMMANDS.items()}
    assert chosen_command(["--log-level", "x"]) == "" and chosen_command(["operator", "-n", "a"]) \
        == "operator"


def test_shoal_operator_imports_no_runtime_module() -> None:
    code = ("import sys; from shoal.cli import build_parser;"
            "build_parser(only='operator').parse_args(['operator']);"
            "print(sorted(m for m in sys.modules if m.startswith('shoal.runtime') or m in "
            "('numpy', 'xxhash', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
