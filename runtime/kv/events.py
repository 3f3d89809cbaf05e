"""KV-cache events in vLLM's wire format: which cached blocks an engine holds, for the
router's precise mode and for llm-d's precise prefix-cache scorer.

Recorded by the block pool when full blocks get their hashes (stored) and when a hashed
block is reallocated (removed); the engine core drains them once per step and publishes one
``EventBatch`` (``runtime/engine/kv_events_publisher.py``). The structs are
field for field vLLM's ``vllm/distributed/kv_events.py``:

    EventBatch       [ts, [event, ...], data_parallel_rank]
    BlockStored      {type: "BlockStored", block_hashes, parent_block_hash, token_ids,
                      block_size, lora_id, medium, lora_name}
    BlockRemoved     {type: "BlockRemoved", block_hashes, medium}
    AllBlocksCleared {type: "AllBlocksCleared"}

``block_hashes`` are Shoal's chained block hashes (``block_hash.py``: SHA-256 of the parent
hash, the block's token ids and the request's extra keys, cut to 64 bits), so Shoal's router
matches them by hashing the same token ids. A consumer with its own hash (llm-d computes
its block keys from ``token_ids``) uses the token ids each event carries, one
``block_size`` slice per hash. ``lora_name`` names the LoRA adapter whose KV the blocks
hold (None: the base model; the adapter is also in the hash), ``lora_id`` is None and
``medium`` None (the engine's one KV cache). As vLLM 0.32 encodes them, the batch is an array
and each event a map tagged by ``type`` (checked by decoding with vLLM's ``KVEventBatch``).
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag=True, tag_field="type"):
    block_hashes: list[int]  # a chain: each block's parent is the previous one
    parent_block_hash: int | None  # parent of the first block; None at the start of a sequence
    token_ids: list[int]  # the blocks' tokens, block_size per hash
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type"):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
