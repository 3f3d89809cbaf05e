"""Precise mode: follow each engine's KV-cache events into the router's block index.

One ZeroMQ SUB socket per replica, connected to the endpoint derived from the replica's
address (same host, ``--kv-events-port``), subscribed to every topic (one engine per
endpoint; the engine's topic is ``kv@<pod>@<model>``). The wire format is vLLM's, as
``runtime/kv/events.py`` documents; it is decoded here from plain msgpack so the router
depends on the engine only through that format (and ``block_hash.py``), and a vLLM engine's
events read the same.

A sequence number that goes backwards means the engine restarted (its cache is empty), so
the replica's view is cleared; a forward gap means events were dropped, counted in the
router's metrics (the view heals as blocks are stored or removed again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from shoal.runtime.router.policies.block_index import BlockIndex

log = logging.getLogger("shoal.router.kv_events")

TOPIC = b""  # every topic: the endpoint is the engine's own


class KVWireError(ValueError):
    """A message that is not in the KV-events wire format."""


@dataclass
class EventStreamState:
    last_sequence: int | None = None
    batches: int = 0
    gaps: int = 0
    restarts: int = 0


def events_endpoint(replica_url: str, port: int) -> str:
    host = urlsplit(replica_url).hostname
    if not host:
        raise ValueError(f"cannot derive a kv-events endpoint from {replica_url!r}")
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def apply_event(index: BlockIndex, event: Any) -> None:
    """One event: a map tagged by ``type`` (vLLM 0.32) or a tagged array (older vLLM)."""
    if isinstance(event, dict):
        kind, hashes = event.get("type"), event.get("block_hashes")
    elif isinstance(event, list | tuple) and event and isinstance(event[0], str):
        kind, hashes = event[0], event[1] if len(event) >= 2 else None
    else:
        raise KVWireError(f"malformed kv event {event!r}")
    if kind == "BlockStored" and isinstance(hashes, list):
        index.stored(hashes)
    elif kind == "BlockRemoved" and isinstance(hashes, list):
        index.removed(hashes)
    elif kind == "AllBlocksCleared":
        index.cleared()
    else:
        raise KVWireError(f"unknown kv event {kind!r}")


def apply_message(index: BlockIndex, state: EventStreamState, frames: list[bytes]) -> None:
    """Apply one published batch to ``index``; pure apart from the two objects it updates."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVWireError(f"expected [topic, seq, payload], got {len(frames)} frames")
    sequence = int.from_bytes(frames[1], "big")
    if state.last_sequence is not None:
        if sequence <= state.last_sequence:
            state.restarts += 1
            index.cleared()
        elif sequence > state.last_sequence + 1:
            state.gaps += 1
    state.last_sequence = sequence
    batch = msgspec.msgpack.decode(frames[2])
    if not isinstance(batch, list) or len(batch) not in (2, 3) or \
            not isinstance(batch[1], list):
        raise KVWireError("payload must be an EventBatch [ts, [events], data_parallel_rank]")
    for event in batch[1]:
        apply_event(index, event)
    state.batches += 1


class KVEventsSubscriber:
    """Runs one receive task per replica; ``index_for(url)`` gives the index to update."""

    def __init__(self, port: int, index_for: Callable[[str], BlockIndex | None]) -> None:
        self.port = port
        self._index_for = index_for
        self._context = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.states: dict[str, EventStreamState] = {}

    def sync(self, urls: set[str]) -> None:
        for gone in set(self._tasks) - urls:
            self._tasks.pop(gone).cancel()
            self.states.pop(gone, None)
        for url in urls - set(self._tasks):
            self.states[url] = EventStreamState()
            self._tasks[url] = asyncio.create_task(self._follow(url), name=f"kv-events {url}")

    async def _follow(self, url: str) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        socket.connect(events_endpoint(url, self.port))
        try:
            while True:
                frames = await socket.recv_multipart()
                index = self._index_for(url)
                if index is None:
                    continue
                try:
                    apply_message(index, self.states[url], frames)
                except (KVWireError, msgspec.DecodeError) as exc:
                    log.warning("dropping bad kv-events message from %s: %s", url, exc)
        finally:
            socket.close(linger=0)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._context.term()
