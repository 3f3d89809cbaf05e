"""API server credentials: an explicit URL, in-cluster service account, or a kubeconfig file.

One loader feeds both kopf (its login handler) and the operator's own API client, so they
always talk to the same server as the same user. Exec/auth-provider plugins are not supported.
"""

from __future__ import annotations

import base64
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(RuntimeError):
    pass


@dataclass(frozen=True)
class ClusterAccess:
    server: str
    ca_path: str | None = None
    insecure: bool = False
    token: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    default_namespace: str | None = None


def _materialize(data_b64: str | None, path: str | None, base: Path) -> str | None:
    """kubeconfig allows inline base64 data or a path relative to the file; clients want paths."""
    if data_b64:
        handle = tempfile.NamedTemporaryFile(prefix="shoal-kube-", delete=False)
        with handle:
            handle.write(base64.b64decode(data_b64))
        return handle.name
    if path:
        return str((base / path).resolve())
    return None


def from_kubeconfig(path: Path, context: str | None = None) -> ClusterAccess:
    try:
        config: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise KubeConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
    name = context or config.get("current-context")
    contexts = {c["name"]: c.get("context") or {} for c in config.get("contexts") or []}
    if name not in contexts:
        raise KubeConfigError(f"kubeconfig {path}: context {name!r} not found")
    ctx = contexts[name]
    clusters = {c["name"]: c.get("cluster") or {} for c in config.get("clusters") or []}
    users = {u["name"]: u.get("user") or {} for u in config.get("users") or []}
    cluster = clusters.get(ctx.get("cluster"))
    if not cluster or not cluster.get("server"):
        raise KubeConfigError(f"kubeconfig {path}: cluster of context {name!r} has no server")
    user = users.get(ctx.get("user"), {})
    if "exec" in user or "auth-provider" in user:
        raise KubeConfigError(f"kubeconfig {path}: user of context {name!r} uses an exec/auth "
                              "plugin, which the operator does not run; use a token or cert")
    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = Path(user["tokenFile"]).read_text().strip()
    base = path.parent
    return ClusterAccess(
        server=cluster["server"].rstrip("/"),
        ca_path=_materialize(cluster.get("certificate-authority-data"),
                             cluster.get("certificate-authority"), base),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=token,
        cert_path=_materialize(user.get("client-certificate-data"),
                               user.get("client-certificate"), base),
        key_path=_materialize(user.get("client-key-data"), user.get("client-key"), base),
        default_namespace=ctx.get("namespace"),
    )


def in_cluster() -> ClusterAccess | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
        "KUBERNETES_SERVICE_PORT", "443")
    token_file = SERVICE_ACCOUNT_DIR / "token"
    if not host or not token_file.exists():
        return None
    host = f"[{host}]" if ":" in host else host
    namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
    return ClusterAccess(
        server=f"https://{host}:{port}",
        ca_path=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
        token=token_file.read_text().strip(),
        default_namespace=namespace_file.read_text().strip() if namespace_file.exists() else None,
    )


def load_access(server: str | None = None, kubeconfig: str | None = None,
                context: str | None = None) -> ClusterAccess:
    """--server wins (dev/tests, no auth); then in-cluster; then $KUBECONFIG or ~/.kube/config."""
    if server:
        return ClusterAccess(server=server.rstrip("/"), insecure=True)
    if kubeconfig is None:
        access = in_cluster()
        if access is not None:
            return access
    path = Path(kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
                or Path.home() / ".kube" / "config")
    if not path.exists():
        raise KubeConfigError(
            f"no Kubernetes credentials: not in a cluster and no kubeconfig at {path}"
        )
    return from_kubeconfig(path, context)
