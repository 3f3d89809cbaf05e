"""Pure rendering of spec.auth: which keys each process reads, from which file, and the flags.

Keys travel as files of a read-only Secret volume (``--api-key-file``,
``--upstream-api-key-file``), never as arguments or environment, so ``kubectl describe`` and
``/proc/<pid>/cmdline`` show paths only. Two shapes:

* behind the router (routing on, no inference gateway): the router checks the clients' keys
  and talks to the engines with its own key; the engines accept only that key and trust the
  router's ``x-shoal-tenant`` header (the tenant of the client's key). They never see the
  clients' keys, and a client that reaches an engine pod directly has no key it accepts, so it
  cannot name another tenant there.
* engines facing clients (routing off, or an inference gateway sending clients to the engine
  pods): the engines check the clients' keys themselves and trust no tenant header.
"""

from __future__ import annotations

from typing import Any

from shoal.operator.spec.service import AuthSpec, SecretKey, ServiceSpec

from shoal.contract.headers import TENANT_HEADER

AUTH_MOUNT = "/etc/shoal/auth"
API_KEYS_FILE = f"{AUTH_MOUNT}/api-keys"
UPSTREAM_KEY_FILE = f"{AUTH_MOUNT}/upstream-api-key"
AUTH_VOLUME = "auth"
SECRET_FILE_MODE = 0o440  # owner and fsGroup (the pod's group) read, nobody writes


def router_authenticates(spec: ServiceSpec) -> bool:
    """True when every client request reaches the engines through the router."""
    return spec.auth is not None and spec.routing.enabled \
        and not spec.routing.gateway.inference_pool


def engine_auth_args(spec: ServiceSpec) -> list[str]:
    if spec.auth is None:
        return []
    if router_authenticates(spec):
        return ["--api-key-file", UPSTREAM_KEY_FILE, "--tenant-header", TENANT_HEADER,
                "--cache-sharing", spec.auth.cache_sharing]
    return ["--api-key-file", API_KEYS_FILE, "--cache-sharing", spec.auth.cache_sharing]


def router_auth_args(spec: ServiceSpec) -> list[str]:
    if spec.auth is None:
        return []
    if router_authenticates(spec):
        return ["--api-key-file", API_KEYS_FILE, "--upstream-api-key-file", UPSTREAM_KEY_FILE,
                "--cache-sharing", spec.auth.cache_sharing]
    # the engines check the clients' keys; the router passes the client's key through
    return ["--cache-sharing", spec.auth.cache_sharing]


def _file_of(auth: AuthSpec, ref: SecretKey) -> str:
    return (API_KEYS_FILE if ref == auth.api_keys else UPSTREAM_KEY_FILE).rsplit("/", 1)[1]


def _volume(auth: AuthSpec, refs: list[SecretKey]) -> tuple[dict[str, Any], dict[str, Any]]:
    sources = [{"secret": {"name": ref.name, "items": [{"key": ref.key,
                                                        "path": _file_of(auth, ref)}]}}
               for ref in refs]
    volume = {"name": AUTH_VOLUME,
              "projected": {"sources": sources, "defaultMode": SECRET_FILE_MODE}}
    return volume, {"name": AUTH_VOLUME, "mountPath": AUTH_MOUNT, "readOnly": True}


def engine_auth_volume(spec: ServiceSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, mount) with only the key file the engine reads; None without spec.auth."""
    if spec.auth is None:
        return None
    ref = spec.auth.upstream_key if router_authenticates(spec) else spec.auth.api_keys
    return _volume(spec.auth, [ref])


def router_auth_volume(spec: ServiceSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    if spec.auth is None or not router_authenticates(spec):
        return None
    return _volume(spec.auth, [spec.auth.api_keys, spec.auth.upstream_key])
