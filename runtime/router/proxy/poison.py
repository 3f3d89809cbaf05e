"""Per-request circuit breaking: a request that failed on one replica is not sent to another.

A request that was running when its replica failed (the engine died, a 5xx not marked
retry-safe, a broken stream, a timeout) may be what broke it. Clients retry such failures
on their own (the OpenAI SDKs retry 5xx twice), and with a balancer in front each retry
lands on a fresh replica: one poison request then walks the whole fleet. So the failed
request's fingerprint is remembered, pinned to the replica it hit, for ``window`` seconds:
a repeat goes to that replica only, or is refused while it is out of rotation.

The fingerprint is the tenant, the path and the body's meaning: the JSON re-serialised
canonically (keys sorted, no whitespace) without the fields that cannot change what the
engine executes (``user``, ``metadata``, request ids, ``stream`` and its options, ...). An SDK
retry resends the same bytes, but a client (or an attacker) may change ``user`` or reorder
keys, and each such variant would otherwise reach, and kill, a fresh replica (issue 36). A
body that is not JSON the stdlib decodes (too deep, numbers too long) keeps its bytes. The
tenant stays in the key: one tenant's failures never route another's requests, which would
tell it what others send. Bounded: at most ``capacity`` fingerprints, oldest forgotten first.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

# top-level request fields that change no token the engine computes: who asked, tracing,
# delivery (streamed or not), storage and routing hints
INERT_FIELDS = frozenset({
    "user", "metadata", "request_id", "stream", "stream_options", "store", "service_tier",
    "safety_identifier", "prompt_cache_key", "priority", "include_usage",
})


def meaning(body: bytes) -> bytes:
    """The body as the engine would execute it; its own bytes when not decodable JSON."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # includes UnicodeDecodeError, over-long ints
        return body
    if isinstance(parsed, dict):
        parsed = {k: v for k, v in parsed.items() if k not in INERT_FIELDS}
    try:
        text = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError, TypeError):
        return body
    return text.encode("utf-8", "surrogatepass")


def fingerprint(tenant: str | None, path: str, body: bytes) -> bytes:
    digest = hashlib.sha256((tenant or "").encode() + b"\0" + path.encode() + b"\0")
    digest.update(meaning(body))
    return digest.digest()


@dataclass(frozen=True)
class Quarantine:
    replica: str
    until: float


class FailedRequests:
    def __init__(self, window: float = 60.0, capacity: int = 10_000) -> None:
        self.window = window
        self.capacity = capacity
        self._entries: OrderedDict[bytes, Quarantine] = OrderedDict()

    def record(self, key: bytes, replica: str, now: float) -> None:
        if self.window <= 0:
            return
        self._entries.pop(key, None)
        self._entries[key] = Quarantine(replica, now + self.window)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def lookup(self, key: bytes, now: float) -> Quarantine | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.until <= now:
            del self._entries[key]
            return None
        return entry

    def __len__(self) -> int:
        return len(self._entries)
