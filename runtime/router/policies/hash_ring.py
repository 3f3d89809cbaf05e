"""Consistent-hash ring with virtual nodes: a key's home replica, stable under churn.

Each replica owns ``vnodes`` points on a 64-bit ring (xxhash64 of "url#i"); a key goes to
the owner of the first point clockwise from the key's hash. Removing a replica moves only
the keys it owned; adding one takes about 1/N of the keys, from every other replica alike.
``walk`` yields the distinct replicas in ring order from a key, so a bounded-load policy
can skip a full replica and fall to the next one without reshuffling anyone else's keys.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import xxhash

DEFAULT_VNODES = 256


def hash_key(key: bytes | str | int) -> int:
    if isinstance(key, int):
        key = key.to_bytes(8, "little", signed=False)
    elif isinstance(key, str):
        key = key.encode()
    return xxhash.xxh64_intdigest(key)


class HashRing:
    def __init__(self, replicas: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._replicas: set[str] = set()
        for replica in replicas:
            self.add(replica)

    @property
    def replicas(self) -> frozenset[str]:
        return frozenset(self._replicas)

    def add(self, replica: str) -> None:
        if replica in self._replicas:
            return
        self._replicas.add(replica)
        for i in range(self.vnodes):
            point = hash_key(f"{replica}#{i}")
            at = bisect.bisect_left(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, replica)

    def remove(self, replica: str) -> None:
        if replica not in self._replicas:
            return
        self._replicas.discard(replica)
        kept = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != replica]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def sync(self, replicas: Iterable[str]) -> None:
        """Make the ring hold exactly ``replicas`` (adds and removes only the difference)."""
        wanted = set(replicas)
        for gone in self._replicas - wanted:
            self.remove(gone)
        for new in sorted(wanted - self._replicas):
            self.add(new)

    def walk(self, key_hash: int) -> Iterator[str]:
        """Distinct replicas in clockwise order starting at ``key_hash``'s position."""
        if not self._points:
            return
        start = bisect.bisect_left(self._points, key_hash)
        seen: set[str] = set()
        n = len(self._points)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._replicas):
                    return

    def owner(self, key_hash: int) -> str | None:
        return next(self.walk(key_hash), None)
