"""KV-cache events: which cached blocks an engine holds, for the router's precise mode.

Recorded by the block pool when a full block gets its hash (stored) and when a hashed block
is reallocated (removed); the engine core drains them once per step and publishes them.
Hashes are the chained block hashes of ``block_hash.py``, so a router that hashes the same
token ids with the same extra keys can match them without seeing any token.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[int]  # a chain: each block's parent is the previous one
    parent_block_hash: int | None  # parent of the first block; None at the start of a sequence
    num_tokens: int  # tokens covered by these blocks (len(block_hashes) * block_size)


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
