"""Chained block hashes: the identity of cached KV.

A full block's hash covers its parent's hash, its token ids and the request's extra keys
(model revision, adapter, cache salt), so equal hashes mean equal KV. Prompt strings never
enter: cache identity follows the execution request. Shared with the router (precise and
token-level affinity), so it depends on nothing else in the runtime.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xxhash

NONE_HASH = 0


class ExtraKeys(NamedTuple):
    model_revision: str = ""
    adapter_id: str | None = None
    cache_salt: str | None = None

    def digest(self) -> bytes:
        text = f"{self.model_revision}\x1f{self.adapter_id or ''}\x1f{self.cache_salt or ''}"
        return xxhash.xxh64_digest(text.encode())


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: bytes) -> int:
    """Hash one full block. ``extra`` is ``ExtraKeys.digest()``, computed once per request.
    The bytes hashed are the parent hash (8 bytes, little-endian), ``extra`` and the token
    ids as int64 in native byte order (as numpy writes them), one-shot."""
    return xxhash.xxh64_intdigest(parent_hash.to_bytes(8, "little") + extra
                                  + array("q", token_ids).tobytes())


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
        parent_hash = xxhash.xxh64_intdigest(parent_hash.to_bytes(8, "little") + extra
                                             + data[start:start + block_bytes])
        hashes.append(parent_hash)
    return hashes
