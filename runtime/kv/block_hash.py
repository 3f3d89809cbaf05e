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
    One-shot over the same bytes as ``hash_prefix_blocks`` (int64 token ids in native byte
    order, as numpy writes them), so both give the same hash; it runs every time a block
    fills, so it avoids building a numpy array for 16 ids."""
    return xxhash.xxh64_intdigest(parent_hash.to_bytes(8, "little") + extra
                                  + array("q", token_ids).tobytes())


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, extra: bytes,
                       start_hash: int = NONE_HASH, max_blocks: int | None = None) -> list[int]:
    """Hashes of every full block of ``token_ids`` (partial tail ignored)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    ids = np.asarray(token_ids[: num_full * block_size], dtype=np.int64)
    hashes: list[int] = []
    parent = start_hash
    for i in range(num_full):
        h = xxhash.xxh64()
        h.update(parent.to_bytes(8, "little"))
        h.update(extra)
        h.update(ids[i * block_size:(i + 1) * block_size].tobytes())
        parent = h.intdigest()
        hashes.append(parent)
    return hashes
