"""Authentication at the router's edge, and the headers the router sends upstream.

The router checks the client's Bearer key against its own keys (``--api-key``, repeatable,
and ``--api-key-file``), then talks to the engines with its own credential
(``--upstream-api-key``), never the client's: an engine without a key behind an
authenticating router is no way in. The authenticated tenant travels to the engines in
``x-shoal-tenant`` (the engines derive the per-tenant cache salt from it); a client's own
``x-shoal-tenant`` is always dropped, so no tenant can claim another's cache.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

from shoal.contract.headers import TENANT_HEADER
from shoal.contract.tenant import tenant_of_key

CLIENT_HEADERS_DROPPED = frozenset({"authorization", "x-api-key", TENANT_HEADER})
CLIENT_CREDENTIALS = frozenset({"authorization", "x-api-key"})


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments are skipped."""
    lines = Path(path).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


@dataclass(frozen=True)
class EdgeAuth:
    keys: tuple[str, ...] = ()
    upstream_key: str | None = None
    _tenants: dict[bytes, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in self.keys:
            self._tenants[key.encode()] = tenant_of_key(key)  # the engines' id for it

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tenant(self, authorization: str | None, x_api_key: str | None = None) -> str | None:
        """The tenant a request authenticates as, None if it does not: its Bearer token,
        else its ``x-api-key`` (Anthropic's clients). Every key is compared (constant time
        each), so timing does not tell which one nearly matched."""
        given = authorization or ""
        token = given[7:].strip().encode() if given[:7].lower() == "bearer " \
            else (x_api_key or "").strip().encode()
        found = None
        for key, tenant in self._tenants.items():
            if hmac.compare_digest(token, key):
                found = tenant
        return found

    def upstream_headers(self, client_headers: list[tuple[str, str]],
                         tenant: str | None) -> list[tuple[str, str]]:
        """The client's headers minus what only the router may say, plus the router's."""
        headers = [(k, v) for k, v in client_headers if k.lower() not in CLIENT_HEADERS_DROPPED
                   or (k.lower() in CLIENT_CREDENTIALS and not self.enabled
                       and self.upstream_key is None)]  # pass-through mode: no router keys
        if self.upstream_key is not None:
            headers.append(("Authorization", f"Bearer {self.upstream_key}"))
        if tenant is not None:
            headers.append((TENANT_HEADER, tenant))
        return headers

    def scrape_headers(self) -> dict[str, str]:
        """For the router's own calls to engines (/metrics behind the engines' key)."""
        return {"Authorization": f"Bearer {self.upstream_key}"} if self.upstream_key else {}
