"""Chained block hashes: the identity of cached KV.

A full block's hash covers its parent's hash, its token ids and the request's extra keys
(model revision, adapter, cache salt), so equal hashes mean equal KV. Prompt strings never
enter: cache identity follows the execution request. Shared with the router (precise and
token-level affinity), so it depends on nothing else in the runtime.

SHA-256, not a fast non-cryptographic hash: with xxh64 and a fixed seed anyone can craft two
token sequences with one hash and make a request read another's KV (vLLM moved to SHA-256
after GHSA-rm76-4mrf-v9r8). The hash is cut to 64 bits because block hashes travel as
msgpack uint64 in KV events and key the pool's dict; finding a block that matches a given
block (a second preimage) still takes ~2**64 SHA-256 evaluations. Measured here: ~0.9 us per
16-token block against ~0.24 us for xxh64 (``tests/engine/test_block_hash.py`` prints it),
paid once per full block.

Tenants: ``tenant_cache_salt`` turns a tenant identity (``tenant_of_key`` of an API key in
``shoal.contract.tenant``, or the tenant header a trusted router forwards, which is the same id) into a salt, and ``effective_cache_salt`` combines it with the
request's own ``cache_salt``; the engine server and the router's precise mode both call
these, so their hashes agree.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

NONE_HASH = 0
HASH_VERSION = b"shoal-kv-sha256-v1"

_sha256 = hashlib.sha256


def tenant_cache_salt(identity: str) -> str:
    """A tenant's salt: a digest of its identity (the key never enters the hash itself)."""
    return _sha256(b"shoal-tenant\x1f" + identity.encode("utf-8", "replace")).hexdigest()[:32]


def effective_cache_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt the block hashes use: the tenant's (when caches are per tenant) and the
    request's own, so one tenant's salts never match another's."""
    if tenant is None:
        return cache_salt
    salt = tenant_cache_salt(tenant)
    return salt if cache_salt is None else f"{salt}/{cache_salt}"


class ExtraKeys(NamedTuple):
    model_revision: str = ""
    adapter_id: str | None = None
    cache_salt: str | None = None

    def digest(self) -> bytes:
        text = f"{self.model_revision}\x1f{self.adapter_id or ''}\x1f{self.cache_salt or ''}"
        return _sha256(HASH_VERSION + text.encode("utf-8", "replace")).digest()[:16]


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: bytes) -> int:
    """Hash one full block. ``extra`` is ``ExtraKeys.digest()``, computed once per request.
    The bytes hashed are the parent hash (8 bytes, little-endian), ``extra`` and the token
    ids as int64 in native byte order (as numpy writes them); the first 8 bytes of the
    SHA-256, little-endian, are the hash."""
    return _digest64(parent_hash.to_bytes(8, "little") + extra + array("q", token_ids).tobytes())


def hash_block_chain(parent_hash: int, token_ids: Sequence[int], block_size: int,
                     extra: bytes) -> list[int]:
    """``hash_block`` over consecutive full blocks (``len(token_ids)`` a multiple of
    ``block_size``), each chained to the previous one: the ids are converted once."""
    return _chain(parent_hash, array("q", token_ids).tobytes(), 8 * block_size, extra)


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, extra: bytes,
                       start_hash: int = NONE_HASH, max_blocks: int | None = None) -> list[int]:
    """Hashes of every full block of ``token_ids`` (partial tail ignored)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    data = np.asarray(token_ids[: num_full * block_size], dtype=np.int64).tobytes()
    return _chain(start_hash, data, 8 * block_size, extra)


def _chain(parent_hash: int, data: bytes, block_bytes: int, extra: bytes) -> list[int]:
    hashes: list[int] = []
    for start in range(0, len(data), block_bytes):
        parent_hash = _digest64(parent_hash.to_bytes(8, "little") + extra
                                + data[start:start + block_bytes])
        hashes.append(parent_hash)
    return hashes


def _digest64(data: bytes) -> int:
    return int.from_bytes(_sha256(data).digest()[:8], "little")
