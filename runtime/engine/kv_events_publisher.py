"""Publishes the engine's KV-cache events on a ZeroMQ PUB socket (``--kv-events-endpoint``),
as vLLM's ZmqEventPublisher does, so llm-d's precise prefix-cache scorer and Shoal's router
in precise mode read the same stream. One multipart message per non-empty step:

    [topic, sequence (8 bytes, big endian), msgpack(EventBatch)]

``EventBatch`` and the events are ``runtime/kv/events.py``'s structs (vLLM's arrays). The
topic is ``kv@<pod>@<model>`` by default (``kv_events_topic.py``). The sequence number starts
at 0 when the publisher starts, so a subscriber can tell a gap (missed events) from a
restart (an empty cache). Sending never blocks the engine loop: PUB drops messages for a
subscriber whose queue is full rather than wait, and the subscriber sees the gap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import zmq
from shoal.runtime.kv.events import EventBatch, KVEvent

DEFAULT_TOPIC = b"kv-events"
SEND_HWM = 10_000  # queued messages per subscriber before PUB drops


class KVEventsPublisher:
    def __init__(self, endpoint: str, topic: bytes = DEFAULT_TOPIC,
                 context: zmq.Context | None = None) -> None:
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv events endpoint must be a zmq address like tcp://HOST:PORT, "
                             f"got {endpoint!r}")
        self.endpoint = endpoint
        self.topic = topic
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = 0

    @property
    def sequence(self) -> int:
        """Sequence number the next batch will carry."""
        return self._sequence

    def publish(self, events: Sequence[KVEvent]) -> None:
        if not events:
            return
        payload = self._encoder.encode(EventBatch(time.time(), list(events), 0))
        frames = [self.topic, self._sequence.to_bytes(8, "big"), payload]
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no room: drop, the sequence gap tells the subscriber
        self._sequence += 1

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._owns_context:
            self._context.term()
