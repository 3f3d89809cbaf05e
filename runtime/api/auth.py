"""API keys and tenants: who sent a request, and which prefix-cache salt that gives it.

Keys come from ``--api-key`` (repeatable) and ``--api-key-file`` (one per line, ``#``
comments). Each key is a tenant: with ``--cache-sharing tenant`` (the default) requests are
salted by their key, so one tenant never hits another's cached blocks (and cannot probe for
them through TTFT or the cached-token count). Behind a router that authenticates clients and
talks to engines with its own key, the router forwards the client's tenant in a header
(``--tenant-header``, ``x-shoal-tenant`` by convention, with ``tenant_of_key`` of the
client's key as its value, so a key's cache identity is the same directly and through the
router); it is trusted only when that flag is set, since any client with a key could send
it otherwise.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from shoal.contract.tenant import tenant_of_key

from .errors import APIError


def presented_key(authorization: str | None, x_api_key: str | None) -> bytes:
    """The key a client sent: a Bearer token (OpenAI clients) or ``x-api-key`` (Anthropic's
    clients); the Bearer token when both are there."""
    given = authorization or ""
    if given[:7].lower() == "bearer ":
        return given[7:].strip().encode()
    return (x_api_key or "").strip().encode()


def load_api_keys(keys: list[str], key_file: str | None) -> list[str]:
    found = [k for k in keys if k]
    if key_file is not None:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Authenticator:
    api_keys: tuple[bytes, ...]
    tenant_header: str | None = None
    per_tenant_cache: bool = True

    def authenticate(self, request: Request) -> str | None:
        """The tenant identity of an allowed request (None: no keys and no header); 401
        when keys are set and none matches."""
        identity: str | None = None
        if self.api_keys:
            token = presented_key(request.headers.get("authorization"),
                                  request.headers.get("x-api-key"))
            # compare against every key (no early exit): timing says nothing about which
            matched = [k for k in self.api_keys if hmac.compare_digest(token, k)]
            if not matched:
                raise APIError(401, "invalid or missing API key", None, "invalid_api_key")
            identity = tenant_of_key(matched[0].decode())
        if self.tenant_header is not None:
            forwarded = request.headers.get(self.tenant_header)
            if forwarded:
                identity = forwarded
        return identity

    def cache_tenant(self, identity: str | None) -> str | None:
        """What salts the prefix cache: the identity, unless caches are shared."""
        return identity if self.per_tenant_cache else None
