"""KV events from an engine's block pool reach the router's view over ZeroMQ, eviction too."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from shoal.runtime.engine.kv_events_publisher import KVEventsPublisher
from shoal.runtime.kv.block_pool import BlockPool
from shoal.runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from shoal.runtime.router.policies.block_index import BlockIndex
from shoal.runtime.router.replicas.kv_events import (
    EventStreamState,
    KVEventsSubscriber,
    KVWireError,
    apply_message,
    events_endpoint,
)

HOST = "127.0.0.3"


def frames(seq: int, events) -> list[bytes]:
    return [b"kv@pod@m", seq.to_bytes(8, "big"),
            msgspec.msgpack.encode(EventBatch(0.0, events, 0))]


def test_wire_messages_update_the_view():
    index, state = BlockIndex(precise=True), EventStreamState()
    apply_message(index, state, frames(0, [BlockStored([1, 2, 3], None, list(range(48)), 16)]))
    apply_message(index, state, frames(1, [BlockRemoved([2])]))
    assert index.blocks() == {1, 3}
    apply_message(index, state, frames(3, [BlockStored([4], 3, list(range(16)), 16)]))
    assert state.gaps == 1 and index.blocks() == {1, 3, 4}
    apply_message(index, state, frames(0, [BlockStored([9], None, list(range(16)), 16)]))  # engine restarted
    assert state.restarts == 1 and index.blocks() == {9}
    apply_message(index, state, frames(1, [AllBlocksCleared()]))
    assert index.blocks() == frozenset()
    with pytest.raises(KVWireError):
        apply_message(index, state, frames(2, [{"type": "BlockMoved", "block_hashes": [1]}]))
    with pytest.raises(KVWireError):
        apply_message(index, state, [b"kv-events", b"\x00"])


def test_endpoint_is_derived_from_the_replica_address():
    assert events_endpoint("http://127.0.0.2:8000", 5557) == "tcp://127.0.0.2:5557"
    assert events_endpoint("http://engine-0.svc:80/v1", 1) == "tcp://engine-0.svc:1"
    with pytest.raises(ValueError):
        events_endpoint("not a url", 1)


def test_publisher_rejects_non_zmq_endpoints():
    with pytest.raises(ValueError, match="zmq address"):
        KVEventsPublisher("http://127.0.0.1:1")


async def test_router_view_follows_a_block_pool_through_eviction(free_port):
    port = free_port(HOST)
    publisher = KVEventsPublisher(f"tcp://{HOST}:{port}")
    replica = f"http://{HOST}:8000"
    index = BlockIndex(precise=True)
    subscriber = KVEventsSubscriber(port, lambda url: index if url == replica else None)
    subscriber.sync({replica})
    try:
        # PUB drops messages until the subscription has propagated: probe until one lands
        for _ in range(200):
            publisher.publish([AllBlocksCleared()])
            await asyncio.sleep(0.01)
            if subscriber.states[replica].batches:
                break
        assert subscriber.states[replica].batches
        pool = BlockPool(num_blocks=6)
        rng = random.Random(0)
        held: list[list] = []
        removals = 0
        for step in range(60):  # random allocate / cache / free: forces evictions
            if held and (rng.random() < 0.5 or pool.num_free < 3):
                pool.free(reversed(held.pop(rng.randrange(len(held)))))
            else:
                blocks = pool.allocate(rng.randint(1, 3))
                hashes = [rng.randrange(1, 40) for _ in blocks]
                pool.cache_blocks(blocks, hashes, None, 16, list(range(16 * len(blocks))))
                held.append(blocks)
            events = pool.drain_events()
            removals += sum(isinstance(e, BlockRemoved) for e in events)
            publisher.publish(events)
            if step % 10 == 0:
                await asyncio.sleep(0)
        expected = frozenset(pool.cached)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if index.blocks() == expected:
                break
        assert index.blocks() == expected
        assert subscriber.states[replica].gaps == 0
        assert removals > 5  # the view followed evictions, not just stores
    finally:
        await subscriber.close()
        publisher.close()


def test_the_wire_decodes_with_a_reader_written_from_llm_ds_schema():
    """llm-d's KV-events reader (llm-d-kv-cache-manager, pkg/kvcache/kvevents) as its
    schema documents it, and as vLLM 0.32 sends it: frames [topic "kv@<pod>@<model>", seq
    uint64 BE, msgpack], the payload an array [ts, events, data_parallel_rank], each event a
    map tagged by ``type``. Decoded with plain msgpack."""
    import socket

    from shoal.runtime.engine.kv_events_topic import kv_events_topic

    pool = BlockPool(num_blocks=4)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [11, 12], 7, 4, [1, 2, 3, 4, 5, 6, 7, 8])
    pool.free(reversed(blocks))
    pool.allocate(4)  # evicts both
    topic = kv_events_topic(None, "Qwen/Qwen3-0.6B")
    assert topic == f"kv@{socket.gethostname()}@Qwen/Qwen3-0.6B" or topic.endswith(
        "@Qwen/Qwen3-0.6B")
    raw = msgspec.msgpack.encode(EventBatch(12.5, pool.drain_events(), 0))

    ts, events, dp_rank = msgspec.msgpack.decode(raw)
    assert (ts, dp_rank) == (12.5, 0)
    stored, *removed = events
    assert stored == {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 7,
                      "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4,
                      "lora_id": None, "medium": None, "lora_name": None}
    assert sorted(h for e in removed for h in e["block_hashes"]) == [11, 12]
    assert all(e["type"] == "BlockRemoved" and e["medium"] is None for e in removed)
    assert kv_events_topic("custom", "m") == "custom"


def test_a_run_of_stored_blocks_split_by_an_already_cached_one_keeps_its_chain():
    pool = BlockPool(num_blocks=4)
    first = pool.allocate(1)
    pool.cache_blocks(first, [22], None, 2, [3, 4])
    pool.drain_events()
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [21, 22, 23], None, 2, [1, 2, 3, 4, 5, 6])
    assert pool.drain_events() == [BlockStored([21], None, [1, 2], 2),
                                   BlockStored([23], 22, [5, 6], 2)]
