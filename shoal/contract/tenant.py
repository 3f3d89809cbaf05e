"""The tenant identity of an API key: the same id whether a request reaches an engine
directly (the engine hashes the key) or through an authenticating router (which forwards
this id in ``headers.TENANT_HEADER``), so a key gets one prefix-cache identity either way."""

from __future__ import annotations

import hashlib


def tenant_of_key(api_key: str) -> str:
    """A stable, non-reversible tenant id for an API key."""
    return "key-" + hashlib.sha256(api_key.encode("utf-8", "replace")).hexdigest()[:16]
