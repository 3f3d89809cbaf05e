"""``--kv-events-config``: vLLM's JSON for KV-cache events, read into the publisher's endpoint
and topic. vLLM's keys: ``enable_kv_cache_events``, ``publisher`` (``zmq`` or ``null``),
``endpoint`` (default ``tcp://*:5557``), ``topic``; without a topic the events go out on
``kv@<pod>@<model>`` (``kv_events_topic.py``), the topic llm-d subscribes to. Queue sizing
(``hwm``, ``max_queue_size``, ``buffer_steps``) is accepted and not used: the publisher sends
each step's batch as it is made. ``replay_endpoint`` (re-sending past steps to a consumer
that missed them) is not implemented and is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.runtime.json_flag import json_object_flag

DEFAULT_ENDPOINT = "tcp://*:5557"
_ACCEPTED = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "hwm",
             "max_queue_size", "buffer_steps", "replay_endpoint"}


@dataclass(frozen=True)
class KVEventsSettings:
    endpoint: str | None  # None: no events
    topic: str | None  # None: kv@<pod>@<model>


def parse_kv_events_config(text: str) -> KVEventsSettings:
    """ValueError naming what is wrong."""
    raw = json_object_flag("--kv-events-config", text, _ACCEPTED)
    if raw.get("replay_endpoint"):
        raise ValueError("--kv-events-config: replay_endpoint is not supported")
    enabled = bool(raw.get("enable_kv_cache_events", False))
    publisher = raw.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher {publisher!r} is not zmq or null")
    if not enabled or publisher == "null":
        return KVEventsSettings(None, None)
    endpoint = raw.get("endpoint", DEFAULT_ENDPOINT)
    topic = raw.get("topic")
    if not isinstance(endpoint, str) or not endpoint:
        raise ValueError("--kv-events-config: endpoint must be a zmq address")
    if topic is not None and not isinstance(topic, str):
        raise ValueError("--kv-events-config: topic must be a string")
    return KVEventsSettings(endpoint, topic)
