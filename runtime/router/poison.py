"""Per-request circuit breaking: a request that failed on one replica is not sent to another.

A request that was running when its replica failed (the engine died, a 5xx not marked
retry-safe, a broken stream, a timeout) may be what broke it. Clients retry such failures
on their own (the OpenAI SDKs retry 5xx twice), and with a balancer in front each retry
lands on a fresh replica: one poison request then walks the whole fleet. So the failed
request's fingerprint is remembered, pinned to the replica it hit, for ``window`` seconds:
a repeat goes to that replica only, or is refused while it is out of rotation.

The fingerprint is the tenant, path and body bytes: what an SDK's retry resends exactly.
Bounded: at most ``capacity`` fingerprints, the oldest forgotten first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


def fingerprint(tenant: str | None, path: str, body: bytes) -> bytes:
    digest = hashlib.sha256((tenant or "").encode() + b"\0" + path.encode() + b"\0")
    digest.update(body)
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
