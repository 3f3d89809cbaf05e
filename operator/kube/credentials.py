"""Who the operator is to the API server: one kubernetes_asyncio Configuration, loaded once.

The operator's own client and kopf's login read the same Configuration, so both talk to the same
server as the same user. kubernetes_asyncio does the loading (kubeconfig files merged as
$KUBECONFIG lists them, contexts, CA and client certificates inline or as files, exec credential
plugins, in-cluster service-account credentials); this module adds what it leaves to the caller:
keeping a bearer token fresh while the process runs.

- In-cluster: the kubelet rotates the projected token by replacing the file; it is re-read as
  soon as the file changes (one stat per request), not once a minute.
- Exec plugin: re-run when its ExecCredential expires, and after a 401 (a revoked token).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import kopf
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config import ConfigException, kube_config, load_incluster_config

# Where the kubelet mounts the service account; SHOAL_SERVICE_ACCOUNT_DIR moves it (tests).
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class CredentialsError(RuntimeError):
    pass


class TokenSource(Protocol):
    async def refresh(self, configuration: Configuration, force: bool) -> None: ...

    def expiry(self) -> datetime | None: ...


class TokenFile:
    """A bearer token in a file that is replaced when it rotates (a projected SA token)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self.token = ""

    def _read_if_changed(self, force: bool) -> None:
        stat = self.path.stat()  # follows the kubelet's ..data symlink swap
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if force or key != self._seen:
            token = self.path.read_text().strip()
            if not token:
                raise CredentialsError(f"token file {self.path} is empty")
            self.token, self._seen = token, key

    async def refresh(self, configuration: Configuration, force: bool) -> None:
        self._read_if_changed(force)
        configuration.api_key["BearerToken"] = f"Bearer {self.token}"

    def expiry(self) -> datetime | None:
        return jwt_expiry(self.token)


class ExecPlugin:
    """An exec credential plugin (EKS, GKE, AKS, OIDC helpers), run by kubernetes_asyncio."""

    def __init__(self, loader: kube_config.KubeConfigLoader) -> None:
        self.loader = loader
        self._lock = asyncio.Lock()

    async def refresh(self, configuration: Configuration, force: bool) -> None:
        async with self._lock:
            # The loader re-runs the plugin itself once the credential's expirationTimestamp is
            # near; without a timestamp it would run it on every call, so only on demand here.
            known_expiry = hasattr(self.loader, "exec_plugin_expiry")
            if force and known_expiry:
                del self.loader.exec_plugin_expiry
            if force or known_expiry:
                await self.loader.load_from_exec_plugin()
            if getattr(self.loader, "token", None):
                configuration.api_key["BearerToken"] = self.loader.token

    def expiry(self) -> datetime | None:
        expiry: datetime | None = getattr(self.loader, "exec_plugin_expiry", None)
        return expiry


def jwt_expiry(token: str) -> datetime | None:
    """The `exp` claim of a JWT (not verified: only to know when to fetch a new one)."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        return datetime.fromtimestamp(float(payload["exp"]), UTC)
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None


@dataclass
class Credentials:
    configuration: Configuration
    default_namespace: str | None = None
    source: TokenSource | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.source is not None:
            source, configuration = self.source, self.configuration

            async def refresh_before_request(_: Configuration) -> None:
                await source.refresh(configuration, False)
            # kubernetes_asyncio awaits this hook whenever it builds an Authorization header.
            self.configuration.refresh_api_key_hook = refresh_before_request

    async def refresh(self, force: bool = False) -> None:
        if self.source is not None:
            await self.source.refresh(self.configuration, force)

    async def authorization(self) -> str | None:
        """The Authorization header value, refreshed first if the token has rotated."""
        header: str | None = await self.configuration.get_api_key_with_prefix("BearerToken")
        return header

    def expiry(self) -> datetime | None:
        return self.source.expiry() if self.source is not None else None


def _service_account_dir() -> Path:
    return Path(os.environ.get("SHOAL_SERVICE_ACCOUNT_DIR") or SERVICE_ACCOUNT_DIR)


def _in_cluster() -> Credentials | None:
    folder = _service_account_dir()
    if not os.environ.get("KUBERNETES_SERVICE_HOST") or not (folder / "token").exists():
        return None
    configuration = Configuration()
    load_incluster_config(client_configuration=configuration, try_refresh_token=False,
                          token_filename=str(folder / "token"),
                          cert_filename=str(folder / "ca.crt"))
    namespace_file = folder / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.exists() else None
    return Credentials(configuration, namespace, TokenFile(folder / "token"),
                       f"in-cluster service account ({folder})")


def _context(paths: str, context: str | None) -> tuple[bool, str | None]:
    """(whether its user runs an exec plugin, its namespace) for the context kubectl would use
    with these files merged."""
    merged = kube_config.KubeConfigMerger(paths).config
    name = context or (merged.safe_get("current-context") if merged is not None else None)
    if merged is None or not merged.safe_get("contexts") or \
            (found := merged["contexts"].get_with_name(name, safe=True)) is None:
        raise CredentialsError(f"kubeconfig {paths}: context {name!r} not found")
    body = found["context"]
    user = merged["users"].get_with_name(body.safe_get("user"), safe=True) \
        if merged.safe_get("users") and body.safe_get("user") else None
    entry = user.safe_get("user") if user is not None else None
    return bool(entry is not None and "exec" in entry), body.safe_get("namespace")


async def _from_kubeconfig(paths: str, context: str | None) -> Credentials:
    files = [p for p in paths.split(os.pathsep) if p]
    if not any(Path(p).expanduser().exists() for p in files):
        raise CredentialsError(
            f"no Kubernetes credentials: not in a cluster and no kubeconfig at {paths}")
    uses_exec, namespace = _context(paths, context)
    configuration = Configuration()
    # persist_config=False: never write refreshed tokens back into the user's files.
    loader = await kube_config.load_kube_config(
        config_file=paths, context=context, client_configuration=configuration,
        persist_config=False)
    source = ExecPlugin(loader) if uses_exec else None
    return Credentials(configuration, namespace, source, f"kubeconfig {paths}")


async def load_credentials(server: str | None = None, kubeconfig: str | None = None,
                           context: str | None = None) -> Credentials:
    """--server wins (dev/tests, no auth); then --kubeconfig; then in-cluster; then
    $KUBECONFIG (all its files, merged) or ~/.kube/config."""
    try:
        if server:
            return Credentials(Configuration(host=server.rstrip("/")), None, None, server)
        if kubeconfig:
            return await _from_kubeconfig(kubeconfig, context)
        in_cluster = _in_cluster()
        if in_cluster is not None:
            return in_cluster
        return await _from_kubeconfig(
            os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config"), context)
    except ConfigException as exc:
        raise CredentialsError(f"cannot load Kubernetes credentials: {exc}") from exc


# kopf's login from the operator's kubernetes_asyncio credentials (kopf's `@kopf.on.login`).
#
# kopf has its own HTTP client and only needs what goes on the wire: server, CA, client
# certificate, and the Authorization header. kopf's built-in `login_via_async_client` reads the
# library's *default* configuration (in-cluster or the default kubeconfig); this one reads the
# operator's own, so `--kubeconfig`/`--context`/`--server` apply to kopf too.
#
# kopf calls the handler at start-up, again when the credentials it holds expire (`expiration`:
# the exec credential's or the token's own), and after a 401 from the API server. The later calls
# force a refresh (re-run the plugin, re-read the token file): kopf refuses credentials equal to
# ones that just failed.


def split_authorization(header: str | None) -> tuple[str | None, str | None]:
    """'Bearer abc' -> ('Bearer', 'abc'); a bare token -> (None, token) (RFC 7235)."""
    if not header:
        return None, None
    scheme, _, token = header.partition(" ")
    return (scheme, token) if token else (None, scheme)


async def connection_info(credentials: Credentials, refresh: bool) -> kopf.ConnectionInfo:
    if refresh:
        await credentials.refresh(force=True)
    header = await credentials.authorization()
    scheme, token = split_authorization(header)  # Basic auth arrives as 'Basic <b64>' too
    config = credentials.configuration
    return kopf.ConnectionInfo(
        server=str(config.host),
        ca_path=config.ssl_ca_cert or None,
        insecure=not config.verify_ssl,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme,
        token=token,
        certificate_path=config.cert_file or None,
        private_key_path=config.key_file or None,
        default_namespace=credentials.default_namespace,
        expiration=credentials.expiry(),
    )


def login_handler(credentials: Credentials) -> Callable[..., Awaitable[kopf.ConnectionInfo]]:
    calls = 0

    async def login(**_: Any) -> kopf.ConnectionInfo:
        nonlocal calls
        calls += 1
        return await connection_info(credentials, refresh=calls > 1)

    return login
