"""kopf's login from the operator's kubernetes_asyncio credentials (kopf's `@kopf.on.login`).

kopf has its own HTTP client and only needs what goes on the wire: server, CA, client
certificate, and the Authorization header. kopf's built-in `login_via_async_client` reads the
library's *default* configuration (in-cluster or the default kubeconfig); this one reads the
operator's own, so `--kubeconfig`/`--context`/`--server` apply to kopf too.

kopf calls the handler at start-up, again when the credentials it holds expire (`expiration`:
the exec credential's or the token's own), and after a 401 from the API server. The later calls
force a refresh (re-run the plugin, re-read the token file): kopf refuses credentials equal to
ones that just failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import kopf
from shoal.operator.credentials import Credentials


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
